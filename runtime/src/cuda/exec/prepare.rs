//! What the executor derives from a plan before lowering it: each buffer's pointer and
//! evaluated shape, the views (alias chains resolved to the buffer holding the bytes,
//! reshapes that run nothing), the updated params and optimizer state copied back after a
//! step, the mixed-precision AdamW whose casts run inside one kernel, and the updates it
//! writes in place where the plan did not; then the per-instruction lowering loop body,
//! the NCCL communicators and cuDNN's attention handle.

use super::*;
use weft_ir::plan::Instruction;

/// The plan's buffers with their shapes evaluated under `bindings` and their pointers in
/// the executor's allocations (the resident region, the arena, pinned host memory),
/// checked against the plan's sizes.
pub(super) fn place_buffers(
    plan: &ExecutionPlan,
    graph: &Graph,
    bindings: &Bindings,
    resident: &DevBuf,
    arena: &DevBuf,
    host: Option<&Pinned>,
) -> CudaResult<Vec<DevT>> {
    let mut bufs = Vec::with_capacity(plan.buffers.len());
    for b in &plan.buffers {
        let v = weft_ir::Value(b.value);
        let ty = graph.try_ty(v).ok_or_else(|| {
            CudaError::Plan(format!(
                "buffer {} holds %{} which the program lacks",
                b.id, b.value
            ))
        })?;
        let shape: Vec<usize> = ty
            .shape
            .iter()
            .map(|d| d.eval(bindings).map(|x| x.max(0) as usize))
            .collect::<Result<_, _>>()
            .map_err(|e| CudaError::Plan(format!("cannot size %{}: {e}", b.value)))?;
        let t = DevT {
            ptr: 0,
            dtype: ty.dtype,
            shape,
        };
        if t.bytes() > b.bytes {
            return Err(CudaError::Plan(format!(
                "buffer {} (%{}) needs {} bytes but the plan gives {}",
                b.id,
                b.value,
                t.bytes(),
                b.bytes
            )));
        }
        let ptr = match b.category {
            Category::Host => host.as_ref().map(|h| h.ptr as u64 + b.offset).unwrap_or(0),
            _ if b.resident => resident.ptr + b.offset,
            _ => arena.ptr + b.offset,
        };
        if !b.resident
            && b.category != Category::Host
            && b.offset + b.bytes > plan.memory.arena_bytes.max(256)
        {
            return Err(CudaError::Plan(format!(
                "buffer {} ends past the arena",
                b.id
            )));
        }
        if b.resident
            && b.category != Category::Host
            && b.offset + b.bytes > plan.memory.resident_bytes.max(256)
        {
            return Err(CudaError::Plan(format!(
                "buffer {} ends past the resident region",
                b.id
            )));
        }
        bufs.push(DevT { ptr, ..t });
    }
    Ok(bufs)
}

/// (from, to) buffers copied after each step: each output that updates a param or its
/// optimizer state, into the input it replaces.
pub(super) fn fed_back_updates(plan: &ExecutionPlan, graph: &Graph) -> Vec<(u32, u32)> {
    let mut updates = Vec::new();
    let buf_of_value: HashMap<u32, u32> = plan.buffers.iter().map(|b| (b.value, b.id)).collect();
    let params: HashMap<String, u32> = graph
        .params()
        .into_iter()
        .filter_map(|(n, v)| buf_of_value.get(&v.0).map(|&b| (n, b)))
        .collect();
    for (name, v) in graph.outputs() {
        let target =
            weft_ir::plan::fed_back_param(name, |n| params.contains_key(n)).map(|n| &params[n]);
        if let (Some(&to), Some(&from)) = (target, buf_of_value.get(&v.0)) {
            if to != from {
                updates.push((from, to));
            }
        }
    }
    updates
}

/// Resolves every buffer's alias chain to the buffer holding its bytes (`root_of`, which
/// it returns) and gives each view its root's pointer.
pub(super) fn resolve_views(plan: &ExecutionPlan, bufs: &mut [DevT]) -> CudaResult<Vec<u32>> {
    let nb = plan.buffers.len();
    let mut root_of: Vec<u32> = (0..nb as u32).collect();
    for b in &plan.buffers {
        let mut r = b.id;
        for _ in 0..=nb {
            match plan.buffers.get(r as usize).map(|x| x.alias_of) {
                Some(Some(a)) => r = a,
                Some(None) => break,
                None => {
                    return Err(CudaError::Plan(format!(
                        "buffer {} is a view of buffer {r}, which the plan lacks",
                        b.id
                    )))
                }
            }
        }
        if plan.buffers[r as usize].alias_of.is_some()
            || bufs[b.id as usize].bytes() > bufs[r as usize].bytes()
        {
            return Err(CudaError::Plan(format!("buffer {} is a view but its alias chain ends at no buffer of its size with storage", b.id)));
        }
        root_of[b.id as usize] = r;
        bufs[b.id as usize].ptr = bufs[r as usize].ptr;
    }
    Ok(root_of)
}

/// The reshape instructions whose output is a view of their input: nothing to run.
pub(super) fn view_reshapes(plan: &ExecutionPlan, root_of: &[u32]) -> HashSet<u32> {
    let mut elided: HashSet<u32> = HashSet::new();
    for ins in plan
        .instructions
        .iter()
        .filter(|i| i.op == "reshape" && i.inputs.len() == 1 && i.outputs.len() == 1)
    {
        let (ib, ob) = (ins.inputs[0] as usize, ins.outputs[0] as usize);
        if root_of[ob] as usize != ob && root_of[ob] == root_of[ib] {
            elided.insert(ins.id);
        }
    }
    elided
}

/// The instructions reading each root buffer, in program order.
pub(super) fn readers(plan: &ExecutionPlan, root_of: &[u32]) -> Vec<Vec<u32>> {
    let mut readers = vec![Vec::new(); plan.buffers.len()];
    for ins in &plan.instructions {
        for &b in &ins.inputs {
            let r = &mut readers[root_of[b as usize] as usize];
            if r.last() != Some(&ins.id) {
                r.push(ins.id);
            }
        }
    }
    readers
}

/// Each buffer's writer: the first instruction with it among its outputs.
pub(super) fn producers(plan: &ExecutionPlan) -> Vec<Option<u32>> {
    let mut producer: Vec<Option<u32>> = vec![None; plan.buffers.len()];
    for ins in &plan.instructions {
        for &b in &ins.outputs {
            producer[b as usize].get_or_insert(ins.id);
        }
    }
    producer
}

/// Makes the `updates` that can be written in place alias what they update (moving
/// their views) and drops them from the copy back.
pub(super) fn update_in_place(
    plan: &ExecutionPlan,
    bufs: &mut [DevT],
    root_of: &[u32],
    readers: &[Vec<u32>],
    writer: &[Option<u32>],
    updates: &mut Vec<(u32, u32)>,
) {
    let nb = plan.buffers.len();
    // A checked plan always has its clocks; without them nothing is written in place.
    let Ok(clock) = plan.clocks() else {
        return;
    };
    let mut aliased: Vec<u32> = Vec::new();
    for &(ob, to) in updates.iter() {
        let Some(w) = writer[ob as usize] else {
            continue;
        };
        // A view is written by its root's producer: leave it (and its root) to the
        // copy back.
        if root_of[ob as usize] != ob {
            continue;
        }
        let wi = &plan.instructions[w as usize];
        let tr = root_of[to as usize] as usize;
        if bufs[ob as usize].bytes() != bufs[to as usize].bytes()
            || bufs[ob as usize].dtype != bufs[to as usize].dtype
        {
            continue;
        }
        let reads_it = wi
            .inputs
            .iter()
            .any(|&b| root_of[b as usize] as usize == tr);
        let ok = if reads_it {
            // elementwise in place: the optimizer reading the value it replaces
            let pairs: &[(usize, usize)] = match wi.op.as_str() {
                op => weft_ir::plan::in_place_pairs(op),
            };
            let pos_out = wi.outputs.iter().position(|&b| b == ob);
            let pos_in = wi
                .inputs
                .iter()
                .position(|&b| root_of[b as usize] as usize == tr);
            pairs
                .iter()
                .any(|&(i, o)| Some(i) == pos_in && Some(o) == pos_out)
                && plan.reads_done_before(&clock, &readers[tr], w)
        } else {
            plan.reads_done_before(&clock, &readers[tr], w)
        };
        if ok {
            // the update's views move with it
            let ptr = bufs[to as usize].ptr;
            for b in (0..nb).filter(|&b| root_of[b] == ob) {
                bufs[b].ptr = ptr;
            }
            aliased.push(ob);
        }
    }
    updates.retain(|(from, _)| !aliased.contains(from));
}

/// NCCL's per-axis communicators (also for one rank, as a check that NCCL runs), and a
/// line saying what was loaded.
pub(super) fn communicators(
    plan: &ExecutionPlan,
    opts: &ExecOptions,
    env: &LaunchEnv,
) -> CudaResult<(Option<Comms>, String)> {
    let has_coll = plan.instructions.iter().any(|i| i.axis.is_some());
    let found = if env.world > 1 || (opts.nccl && crate::cuda::probe::nccl_present()) {
        match Comms::new(env, &plan.groups) {
            Ok(c) => {
                let s = format!("{} rank(s), {} axis communicator(s)", c.ranks, c.axes.len());
                (Some(c), s)
            }
            Err(e) if env.world == 1 && !has_coll => {
                (None, format!("unavailable ({e}); not needed for one rank"))
            }
            Err(e) => return Err(e),
        }
    } else {
        (None, "not loaded (one rank)".to_string())
    };
    Ok(found)
}

/// cuDNN's attention handle, when asked for: absence falls back to Weft's kernels (one
/// line on stderr).
pub(super) fn cudnn_attention(
    opts: &ExecOptions,
    streams: &[Stream],
) -> Option<RefCell<cudnn_sdpa::Sdpa>> {
    if opts.cudnn_attention && opts.fast_attention {
        let t = &opts.tuning;
        match cudnn_sdpa::Sdpa::new(
            streams
                .iter()
                .map(|s| s.0 as *mut std::ffi::c_void)
                .collect(),
            cudnn_sdpa::EnginePicks {
                fwd: t.cudnn_engine_fwd,
                bwd: t.cudnn_engine_bwd,
                list: t.cudnn_engine_list,
            },
        ) {
            Ok(c) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!(
                        "weft: attention: cuDNN {} fused flash attention, from {} (WEFT_CUDNN=FILE for another, WEFT_ATTENTION=weft for Weft's kernels)",
                        cudnn_sdpa::version_text(c.version),
                        crate::cuda::cudnn_lib::api().source
                    )
                });
                Some(RefCell::new(c))
            }
            Err(e) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!("weft: attention: cuDNN cannot be used, running Weft's kernels: {e}")
                });
                None
            }
        }
    } else {
        None
    }
}

/// What lowering an instruction reads besides the instruction: the program, the buffers
/// and the decisions above.
pub(super) struct Lowering<'a> {
    pub(super) graph: &'a Graph,
    pub(super) value_node: &'a HashMap<u32, Node>,
    pub(super) bufs: &'a [DevT],
    pub(super) elided: &'a HashSet<u32>,
    pub(super) bindings: &'a Bindings,
    pub(super) world: u32,
}

/// Lowers one instruction: its waits, its launches (nothing for a view), its signal.
pub(super) fn lower_instruction(
    lw: &mut Lower,
    ins: &Instruction,
    cx: &Lowering,
) -> CudaResult<()> {
    lw.stream = ins.stream as usize;
    lw.ins = ins.id;
    lw.ex.cur = 0;
    let node = *cx.value_node.get(&ins.node).ok_or_else(|| {
        CudaError::Plan(format!(
            "instruction {} runs %{} which the program lacks",
            ins.id, ins.node
        ))
    })?;
    let nd = cx.graph.node(node);
    lw.location = format!("instruction {} ({})", ins.id, cx.graph.describe(node));
    for e in &ins.wait {
        lw.push(StepKind::Wait(*e));
    }
    let ti: Vec<DevT> = ins
        .inputs
        .iter()
        .map(|&b| cx.bufs[b as usize].clone())
        .collect();
    let to: Vec<DevT> = ins
        .outputs
        .iter()
        .map(|&b| cx.bufs[b as usize].clone())
        .collect();
    if cx.elided.contains(&ins.id) {
        // a view: nothing to run
    } else if nd.op.is_collective() {
        let axis_size = nd
            .op
            .axis()
            .map_or(1, |a| cx.graph.mesh.size_or_one(a) as usize);
        lower_collective(lw, &nd.op, &ti, &to, cx.world, axis_size)?;
    } else if let Op::HostAdamW { .. } = &nd.op {
        optimizer::host_adamw(lw, &nd.op, &ti, &to)?;
    } else if matches!(nd.op.name(), "offload" | "reload") {
        let kind = if nd.op.name() == "offload" {
            CopyKind::D2H
        } else {
            CopyKind::H2D
        };
        lw.push(StepKind::Copy {
            dst: to[0].ptr,
            src: ti[0].ptr,
            bytes: to[0].bytes(),
            kind,
        });
    } else {
        lower_op(lw, &nd.op, &ti, &to, cx.bindings)?;
    }
    if let Some(e) = ins.signal {
        lw.push(StepKind::Record(e));
    }
    Ok(())
}

//! Lowering a program to an [`ExecutionPlan`]: schedule, memory plan and costs.
//!
//! - Streams: collectives run on a communication stream, host copies on two copy
//!   streams (device to host, host to device: the link is full duplex), the host CPU's
//!   optimizer update (`host_adamw`, `--offload-optimizer`) on a host stream present
//!   only when the program has one, everything else on the compute stream. Each stream keeps program order (a topological order the
//!   passes keep memory-friendly); a collective starts as soon as its operands exist,
//!   so it overlaps the compute that does not need it. A consumer on another stream
//!   waits for its producer's event. The compute stream also waits for each offload at
//!   the first instruction starting half a copy's duration after its predicted end, so
//!   the offloaded value's bytes return to the arena there.
//! - Memory: one buffer per value; params, gradients and optimizer state are resident;
//!   everything else lives in one arena, placed first-fit, where a buffer may reuse the
//!   bytes of another only once that one's last use is ordered before it on the new
//!   buffer's stream (same stream, or an event the stream waits for).
//! - Views: every value is contiguous, so a `reshape` moves no bytes. Its output is a
//!   view of its input's root buffer (`Buffer::alias_of`, as XLA's buffer assignment
//!   shares a bitcast's buffer): no storage of its own, the root's offset, and the
//!   root holds its bytes over the union of the group's live ranges. Only roots are
//!   placed and counted.
//! - In place: a training step's updated parameters and optimizer state (`param.*`,
//!   `optim.*`, `state.*` outputs fed back into the inputs of those names) are written
//!   over the inputs they replace once the old values are dead, and the ops of
//!   [`ELEMENTWISE_IN_PLACE`] over an operand that dies at the op (XLA's
//!   `CanShareOperandBufferWithUser`, input/output aliasing of donated buffers): the
//!   result joins its operand's group (`Buffer::alias_of`), so an updated weight is held
//!   once and nothing is copied back after the step.
//! - Costs: [`cost`]'s roofline and alpha-beta models give each instruction a duration;
//!   simulating the streams gives start times, step time and exposed communication.

pub mod cost;
pub mod profile;

use crate::bindings::{check_bindings, BindingError};
use std::collections::BTreeMap;
use weft_ir::plan::*;
use weft_ir::{Bindings, Graph, Node, Op, TensorType, Value, ValueRole};

/// What to lower for.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub device: DeviceProfile,
    /// Refuse plans whose peak exceeds this many bytes per rank.
    pub device_memory: u64,
    /// Values of `B` and `S` (mesh axis sizes are added from the graph's mesh).
    pub bindings: Bindings,
    /// The MODEL argument the program was compiled from, recorded in the plan.
    pub source: String,
}

impl PlanOptions {
    pub fn new(batch: i64, seq: i64) -> PlanOptions {
        PlanOptions {
            device: profile::preset("h200").expect("built-in profile"),
            device_memory: 80 << 30,
            bindings: Bindings::new().with("B", batch).with("S", seq),
            source: String::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LowerError {
    #[error("{0}")]
    Bindings(#[from] BindingError),
    #[error("the plan needs {} per rank but the device has {} (--device-memory)\n{}help: {help}", gib(*.peak), gib(*.limit), breakdown_text(.breakdown))]
    OutOfMemory {
        peak: u64,
        limit: u64,
        breakdown: BTreeMap<String, u64>,
        help: String,
    },
    #[error("cannot size {what} in {location}: {why}")]
    Size {
        what: String,
        location: String,
        why: String,
    },
}

pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn breakdown_text(b: &BTreeMap<String, u64>) -> String {
    b.iter()
        .map(|(k, v)| format!("  {k:<16} {}\n", gib(*v)))
        .collect()
}

const ALIGN: u64 = 256;

/// The most bytes all of a step's buffers may hold on one rank (2^60).
pub const MAX_PLAN_BYTES: u64 = 1 << 60;

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Bytes of a value on every rank: the largest, and the table when ranks differ.
fn sizes(
    ty: &TensorType,
    b: &Bindings,
    mesh: &weft_ir::Mesh,
) -> Result<(u64, Option<Vec<u64>>), weft_ir::DimError> {
    let axes: Vec<String> = {
        let mut a: Vec<String> = ty.shape.iter().flat_map(|d| d.rank_axes()).collect();
        a.sort();
        a.dedup();
        a
    };
    if axes.is_empty() {
        return Ok((ty.size_bytes(b)?, None));
    }
    let mut per_rank = Vec::with_capacity(mesh.world_size() as usize);
    for r in 0..mesh.world_size() {
        let mut rb = b.clone();
        for (i, (axis, _)) in mesh.axes.iter().enumerate() {
            rb = rb.with_coord(axis, mesh.coords(r)[i] as i64);
        }
        per_rank.push(ty.size_bytes(&rb)?);
    }
    let max = per_rank.iter().copied().max().unwrap_or(0);
    let uniform = per_rank.iter().all(|&x| x == max);
    Ok((max, if uniform { None } else { Some(per_rank) }))
}

/// Category of a value: resident params/grads/optimizer state, host memory (what
/// `offload` copies out, in the pinned host pool), or arena memory.
fn category(
    g: &Graph,
    v: Value,
    output_names: &BTreeMap<Value, Vec<String>>,
    host: &std::collections::BTreeSet<Value>,
) -> Category {
    let op = g.op_of(v);
    if matches!(op, Op::Offload { .. }) || host.contains(&v) {
        return Category::Host;
    }
    if let Op::Param { name, .. } = op {
        return if ValueRole::of(name).is_some_and(ValueRole::is_optimizer_state) {
            Category::OptimizerState
        } else {
            Category::Param
        };
    }
    if let Some(names) = output_names.get(&v) {
        let roles: Vec<ValueRole> = names.iter().filter_map(|n| ValueRole::of(n)).collect();
        if roles.contains(&ValueRole::Grad) {
            return Category::Grad;
        }
        if roles.iter().any(|r| r.is_optimizer_state()) {
            return Category::OptimizerState;
        }
        if roles.contains(&ValueRole::UpdatedParam) {
            return Category::Param;
        }
    }
    if op.is_collective() {
        Category::Comm
    } else {
        Category::Activation
    }
}

/// Ops whose result the planner writes over an operand that dies at the op (the pairs
/// are [`in_place_pairs`]). Only ops whose kernels are verified safe in place on every
/// runtime: `cross_entropy_grad` (the CPU reference runs on values, not buffers; the
/// CUDA `ce_bwd_*` and `ce_bwd_lse8_bf16` kernels read each logit of a row before, or
/// at the index of, the gradient element they write). Its logits gradient takes the
/// logits' bytes when the logits die there (not when the step returns them); and
/// `matmul_add` (cuBLASLt accumulates into C = D), whose sum takes its addend's bytes;
/// `embedding_grad` with an `init` (one block reads and writes each touched row).
pub const ELEMENTWISE_IN_PLACE: &[&str] = &["cross_entropy_grad", "matmul_add", "embedding_grad"];

/// How many compute instructions ahead of its place a ZeRO-3 parameter gather may
/// start (about a transformer layer's forward).
const ZERO3_PREFETCH: usize = 48;

/// The compute stream waits for an offload this many copy durations after the copy's
/// predicted start.
const OFFLOAD_WAIT_SLACK: f64 = 1.5;

/// The plan's streams: compute, communication, device-to-host and host-to-device copies
/// (a PCIe link is full duplex: offloads and prefetches move at the same time), and
/// the host CPU.
const NS: usize = 5;
/// The host CPU's stream.
const HOST_STREAM: u32 = 4;

fn stream_of(op: &Op) -> u32 {
    if op.is_collective() {
        1
    } else if op.name() == "offload" {
        2
    } else if op.name() == "reload" {
        3
    } else if matches!(op, Op::HostAdamW { .. }) {
        HOST_STREAM
    } else {
        0
    }
}

/// The values in host memory besides `offload`'s copies: what a host update reads
/// (master weights and moments; its gradient is an `offload` copy) and writes.
fn host_values(g: &Graph) -> Result<std::collections::BTreeSet<Value>, LowerError> {
    let mut out = std::collections::BTreeSet::new();
    for &n in g.nodes() {
        let nd = g.node(n);
        if !matches!(nd.op, Op::HostAdamW { .. }) {
            continue;
        }
        out.extend(nd.results.iter().copied());
        for (i, &v) in nd.operands.iter().enumerate() {
            let def = g.op_of(v);
            let ok = match i {
                1 => matches!(def, Op::Offload { .. }),
                4 => matches!(def, Op::Input { .. }),
                _ => matches!(def, Op::Param { .. }),
            };
            if !ok {
                return Err(LowerError::Size {
                    what: format!("operand {i} of `host_adamw` ({v})"),
                    location: g.describe(n),
                    why: "a host update reads host state params, an `offload` copy of its gradient and the step input".into(),
                });
            }
            if i != 1 && i != 4 {
                out.insert(v);
            }
        }
    }
    Ok(out)
}

/// Lowers `g` (a verified program) to a plan.
pub fn lower(g: &Graph, opts: &PlanOptions) -> Result<ExecutionPlan, LowerError> {
    lower_with_views(g, opts, true)
}

/// [`lower`], choosing whether reshapes become views of their input's bytes; without
/// views every value has bytes of its own (for comparison and debugging).
pub fn lower_with_views(
    g: &Graph,
    opts: &PlanOptions,
    views: bool,
) -> Result<ExecutionPlan, LowerError> {
    let mut b = opts.bindings.clone();
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64);
    }
    check_bindings(g, &b)?;
    // Data-dependent sizes (the rows an expert-parallel all_to_all_v receives) are
    // sized at their bound; the plan's bindings and shapes leave them unbound.
    let exact = b.clone();
    for (s, n) in g.runtime_symbols() {
        if let Some(v) = g.runtime_symbol_bound(n).and_then(|d| d.eval(&exact).ok()) {
            b = b.with(&s, v);
        }
    }
    let d = &opts.device;

    let mut output_names: BTreeMap<Value, Vec<String>> = BTreeMap::new();
    for (name, v) in g.outputs() {
        output_names.entry(*v).or_default().push(name.clone());
    }

    let host = host_values(g)?;
    let host_update = g
        .nodes()
        .iter()
        .any(|&n| matches!(g.node(n).op, Op::HostAdamW { .. }));
    // Buffers: one per value, in program order.
    let mut buffers: Vec<Buffer> = Vec::new();
    let mut buf_of: BTreeMap<Value, u32> = BTreeMap::new();
    for &n in g.nodes() {
        for &v in &g.node(n).results {
            let ty = g.ty(v);
            let (bytes, per_rank) = sizes(ty, &b, &g.mesh).map_err(|e| LowerError::Size {
                what: format!("{v}: {ty}"),
                location: g.describe(n),
                why: e.to_string(),
            })?;
            let category = category(g, v, &output_names, &host);
            let resident = matches!(
                category,
                Category::Param | Category::Grad | Category::OptimizerState
            );
            buf_of.insert(v, buffers.len() as u32);
            buffers.push(Buffer {
                id: buffers.len() as u32,
                value: v.0,
                dtype: ty.dtype,
                bytes,
                per_rank_bytes: per_rank,
                category,
                offset: 0,
                resident,
                live: (0, 0),
                alias_of: None,
            });
        }
    }

    // Every offset and sum below stays exact: the bytes of all buffers fit with room.
    let total = buffers
        .iter()
        .try_fold(0u64, |acc, b| acc.checked_add(b.bytes))
        .filter(|&t| t <= MAX_PLAN_BYTES);
    if total.is_none() {
        return Err(LowerError::Size {
            what: "the buffers of the step".into(),
            location: g.name.clone(),
            why: format!(
                "they hold more than {MAX_PLAN_BYTES} bytes per rank (the most Weft plans)"
            ),
        });
    }

    // Instructions in program order, each on its stream; simulate the streams.
    let compute_nodes: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| !matches!(g.node(n).op, Op::Param { .. } | Op::Input { .. }))
        .collect();
    let mut instructions: Vec<Instruction> = Vec::with_capacity(compute_nodes.len());
    let mut finish_of: BTreeMap<u32, f64> = BTreeMap::new(); // buffer -> time it is ready
    let mut producer_instr: BTreeMap<u32, u32> = BTreeMap::new(); // buffer -> instruction
    let mut stream_free = [0.0f64; NS];
    let mut compute_ids: Vec<u32> = Vec::new();
    let mut offloads_in_flight: Vec<(u32, f64)> = Vec::new(); // (event, predicted end)
    let mut events = 0u32;
    let mut collectives: BTreeMap<String, u64> = BTreeMap::new();
    let mut comm_bytes: BTreeMap<String, f64> = BTreeMap::new();
    let (mut compute_s, mut comm_s, mut copy_s, mut flops_total) = (0.0, 0.0, 0.0, 0.0);
    for &n in &compute_nodes {
        let nd = g.node(n);
        let id = instructions.len() as u32;
        let stream = stream_of(&nd.op);
        let inputs: Vec<u32> = nd.operands.iter().map(|v| buf_of[v]).collect();
        let outputs: Vec<u32> = nd.results.iter().map(|v| buf_of[v]).collect();
        let in_bytes: f64 = inputs
            .iter()
            .map(|&i| buffers[i as usize].bytes as f64)
            .sum();
        let out_bytes: f64 = outputs
            .iter()
            .map(|&i| buffers[i as usize].bytes as f64)
            .sum();
        let flops = {
            let f = weft_ir::flops::node_flops(g, n);
            max_over_ranks(&f, &b, &g.mesh).map_err(|e| LowerError::Size {
                what: format!("the FLOPs `{f}`"),
                location: g.describe(n),
                why: e.to_string(),
            })?
        };
        let (bytes, time) = match stream {
            1 => {
                let axis = nd.op.axis().unwrap_or_default();
                let p = g.mesh.size_or_one(axis);
                let inter = cost::crosses_nodes(&g.mesh, axis, d.gpus_per_node);
                let (moved, t) = cost::collective_cost(&nd.op, in_bytes, out_bytes, p, inter, d);
                *collectives.entry(nd.op.name().to_string()).or_default() += 1;
                *comm_bytes
                    .entry(format!("{}/{axis}", nd.op.name()))
                    .or_default() += moved;
                comm_s += t;
                (moved, t)
            }
            HOST_STREAM => {
                let params = g
                    .ty(nd.operands[0])
                    .numel()
                    .bind(&b)
                    .as_const()
                    .unwrap_or(0);
                let t = cost::host_adam_time(params as f64, d);
                (in_bytes + out_bytes, t)
            }
            2 | 3 => {
                // The copied value; later operands only order the copy.
                let moved = inputs
                    .first()
                    .map_or(0.0, |&i| buffers[i as usize].bytes as f64);
                let t = cost::copy_time(moved, d);
                copy_s += t;
                (moved, t)
            }
            _ => {
                let t = match grouped_shape(g, n, &b) {
                    Some(s) => cost::grouped_matmul_time(&s, d),
                    None => cost::compute_time(&nd.op, flops, in_bytes + out_bytes, d),
                };
                compute_s += t;
                (in_bytes + out_bytes, t)
            }
        };
        flops_total += flops;
        // Waits: operands produced on another stream.
        let mut wait = Vec::new();
        let mut ready = stream_free[stream as usize];
        for &i in &inputs {
            ready = ready.max(finish_of.get(&i).copied().unwrap_or(0.0));
            if let Some(&p) = producer_instr.get(&i) {
                if instructions[p as usize].stream != stream {
                    let e = match instructions[p as usize].signal {
                        Some(e) => e,
                        None => {
                            instructions[p as usize].signal = Some(events);
                            events += 1;
                            events - 1
                        }
                    };
                    if !wait.contains(&e) {
                        wait.push(e);
                    }
                }
            }
        }
        // A ZeRO-3 parameter gather is prefetched a bounded distance ahead: it waits for
        // the compute instruction ZERO3_PREFETCH compute instructions before it in
        // program order, so it overlaps about a layer of compute and at most that much
        // of gathered parameters is in flight (rather than every gather starting at
        // the beginning of the step because its shard is ready then).
        let zero3_gather = stream == 1
            && nd
                .meta
                .provenance
                .as_ref()
                .is_some_and(|p| p.reason.starts_with("ZeRO-3: gather"));
        if zero3_gather && compute_ids.len() >= ZERO3_PREFETCH {
            let p = compute_ids[compute_ids.len() - ZERO3_PREFETCH] as usize;
            let e = match instructions[p].signal {
                Some(e) => e,
                None => {
                    instructions[p].signal = Some(events);
                    events += 1;
                    events - 1
                }
            };
            if !wait.contains(&e) {
                wait.push(e);
            }
            ready = ready.max(instructions[p].start_s + instructions[p].time_s);
        }
        // The compute stream waits for an offload once the copy is predicted done, with
        // slack (a copy running late should not stall compute): from there on the
        // offloaded value's device bytes can be reused.
        if stream == 0 {
            offloads_in_flight.retain(|&(e, done)| {
                if done <= ready {
                    if !wait.contains(&e) {
                        wait.push(e);
                    }
                    false
                } else {
                    true
                }
            });
        }
        let start = ready;
        stream_free[stream as usize] = start + time;
        let signal = (stream == 2).then(|| {
            events += 1;
            offloads_in_flight.push((events - 1, start + OFFLOAD_WAIT_SLACK * time));
            events - 1
        });
        for &o in &outputs {
            finish_of.insert(o, start + time);
            producer_instr.insert(o, id);
        }
        if stream == 0 {
            compute_ids.push(id);
        }
        instructions.push(Instruction {
            id,
            stream,
            node: nd.results.first().map(|v| v.0).unwrap_or(0),
            op: nd.op.name().to_string(),
            inputs,
            outputs,
            wait,
            signal,
            flops,
            bytes,
            start_s: start,
            time_s: time,
            axis: nd.op.axis().map(str::to_string),
            provenance: nd
                .meta
                .provenance
                .as_ref()
                .map(|p| format!("{}: {}", p.pass, p.reason)),
            source: nd.meta.source.clone(),
        });
    }
    let last = instructions.len().saturating_sub(1) as u32;

    // Views: a reshape on the compute stream whose output has its input's bytes on
    // every rank, both on the device, and whose output is not itself resident (a
    // resident output keeps its own bytes in the resident region) shares its input's
    // root buffer. `root[b]` is the buffer holding b's bytes.
    let mut root: Vec<usize> = (0..buffers.len()).collect();
    for ins in &instructions {
        if !views
            || ins.op != "reshape"
            || ins.stream != 0
            || ins.inputs.len() != 1
            || ins.outputs.len() != 1
        {
            continue;
        }
        let (r, o) = (root[ins.inputs[0] as usize], ins.outputs[0] as usize);
        let (rb, ob) = (&buffers[r], &buffers[o]);
        if r == o
            || ob.resident
            || rb.category == Category::Host
            || ob.category == Category::Host
            || rb.bytes != ob.bytes
            || rb.per_rank_bytes != ob.per_rank_bytes
        {
            continue;
        }
        root[o] = r;
        buffers[o].alias_of = Some(r as u32);
    }

    // Vector clocks: clock[j][t] is the last instruction of stream t known to have
    // finished when instruction j starts (in-order streams plus the events it waits for,
    // transitively). -1: none.
    let mut clock: Vec<[i64; NS]> = Vec::with_capacity(instructions.len());
    let mut event_source: BTreeMap<u32, u32> = BTreeMap::new();
    let mut prev_on: [i64; NS] = [-1; NS];
    for ins in &instructions {
        let s = ins.stream as usize;
        let mut c = [-1i64; NS];
        if prev_on[s] >= 0 {
            let p = prev_on[s] as usize;
            c = max3(c, clock[p]);
            c[s] = c[s].max(p as i64);
        }
        for e in &ins.wait {
            let p = event_source[e] as usize;
            c = max3(c, clock[p]);
            let t = instructions[p].stream as usize;
            c[t] = c[t].max(p as i64);
        }
        clock.push(c);
        if let Some(e) = ins.signal {
            event_source.insert(e, ins.id);
        }
        prev_on[s] = ins.id as i64;
    }
    // In place: a result takes over the bytes of a value that is dead when it is
    // written (the rule and what the checker accepts are under `Buffer::alias_of`):
    // - updates: `param.<name>` / `optim.*` / `state.*` outputs (fed back into the
    //   inputs of those names) over the input they replace, same bytes and dtype, once
    //   every other read of the old value is ordered before the writer; the writer may
    //   read it only at an elementwise pair (`adamw`, `sgd`) or not at all (the `cast`
    //   back to bf16 after the f32 master's update);
    // - the ops of `ELEMENTWISE_IN_PLACE` over the operand of their pair, in the
    //   arena, when that operand (and its views) die at the op and is not returned.
    // The result and its views join the group: one root, the union live range.
    let mut shared_root = vec![false; buffers.len()]; // roots holding several values
    if views {
        let nb = buffers.len();
        let mut readers: Vec<Vec<u32>> = vec![Vec::new(); nb];
        for ins in &instructions {
            for &i in &ins.inputs {
                readers[i as usize].push(ins.id);
            }
        }
        let params: BTreeMap<String, Value> = g.params().into_iter().collect();
        let mut cands: Vec<(u32, usize, usize)> = Vec::new(); // (writer, result, operand replaced)
        for (name, v) in g.outputs() {
            let target = fed_back_param(name, |n| params.contains_key(n)).map(|n| &params[n]);
            let o = buf_of[v];
            if let (Some(t), Some(&w)) = (target, producer_instr.get(&o)) {
                cands.push((w, o as usize, buf_of[t] as usize));
            }
        }
        for ins in instructions
            .iter()
            .filter(|i| ELEMENTWISE_IN_PLACE.contains(&i.op.as_str()))
        {
            for &(i, o) in in_place_pairs(&ins.op) {
                if let (Some(&x), Some(&y)) = (ins.inputs.get(i), ins.outputs.get(o)) {
                    if !buffers[x as usize].resident {
                        cands.push((ins.id, y as usize, x as usize));
                    }
                }
            }
        }
        cands.sort();
        cands.dedup();
        for (w, o, x) in cands {
            let r = root[x];
            if root[o] != o || r == o || shared_root[r] {
                continue;
            }
            let (ob, rb) = (&buffers[o], &buffers[r]);
            if ob.bytes != rb.bytes
                || ob.per_rank_bytes != rb.per_rank_bytes
                || ob.dtype != rb.dtype
                || ob.resident != rb.resident
                || ob.category == Category::Host
                || rb.category == Category::Host
            {
                continue;
            }
            // Updates replace values the step starts with (nothing writes them).
            if rb.resident && producer_instr.contains_key(&(r as u32)) {
                continue;
            }
            let members: Vec<usize> = (0..nb).filter(|&b| root[b] == r).collect();
            if members
                .iter()
                .any(|&b| output_names.contains_key(&Value(buffers[b].value)))
            {
                continue; // the old value is returned
            }
            let ins = &instructions[w as usize];
            let pos = ins
                .outputs
                .iter()
                .position(|&b| b as usize == o)
                .unwrap_or(usize::MAX);
            let reads: Vec<usize> = ins
                .inputs
                .iter()
                .enumerate()
                .filter(|(_, &b)| root[b as usize] == r)
                .map(|(k, _)| k)
                .collect();
            let reads_ok = match reads.as_slice() {
                [] => rb.resident,
                [k] => in_place_pairs(&ins.op).contains(&(*k, pos)),
                _ => false,
            };
            let c = &clock[w as usize];
            let dead = members.iter().all(|&b| {
                readers[b]
                    .iter()
                    .all(|&i| i == w || i as i64 <= c[instructions[i as usize].stream as usize])
            });
            if !reads_ok || !dead {
                continue;
            }
            for b in 0..nb {
                if root[b] == o {
                    root[b] = r;
                    buffers[b].alias_of = Some(r as u32);
                }
            }
            shared_root[r] = true;
        }
    }

    // Liveness: first and last instruction touching each buffer.
    let mut uses: Vec<Vec<u32>> = vec![Vec::new(); buffers.len()];
    for ins in &instructions {
        for &i in &ins.inputs {
            uses[i as usize].push(ins.id);
        }
        for &o in &ins.outputs {
            buffers[o as usize].live.0 = ins.id;
        }
    }
    for (bi, buf) in buffers.iter_mut().enumerate() {
        let end = uses[bi].iter().copied().max().unwrap_or(buf.live.0);
        buf.live.1 = end.max(buf.live.0);
        // Resident values are held for the whole step, unless their bytes hold several
        // (an in-place update): then each value over its own range, the root over all.
        let whole_step = buf.resident && !shared_root[root[bi]];
        if output_names.contains_key(&Value(buf.value)) || whole_step {
            buf.live = (if whole_step { 0 } else { buf.live.0 }, last);
        }
    }
    // Inputs are filled before the first instruction.
    for (name, _, v) in g.inputs() {
        let _ = name;
        buffers[buf_of[&v] as usize].live.0 = 0;
    }
    // A root holds its bytes while it or any of its views is live (outputs pinned to
    // the end included).
    for bi in 0..buffers.len() {
        let r = root[bi];
        if r != bi {
            let l = buffers[bi].live;
            buffers[r].live = (buffers[r].live.0.min(l.0), buffers[r].live.1.max(l.1));
        }
    }

    // Last touch of each root on each stream (producer and views included), and the
    // roots whose bytes a graph output holds to the end.
    let mut last_touch: Vec<[i64; NS]> = vec![[-1; NS]; buffers.len()];
    for ins in &instructions {
        for &bi in ins.inputs.iter().chain(&ins.outputs) {
            let t = &mut last_touch[root[bi as usize]][ins.stream as usize];
            *t = (*t).max(ins.id as i64);
        }
    }
    let mut pinned_root = vec![false; buffers.len()];
    for (bi, buf) in buffers.iter().enumerate() {
        if output_names.contains_key(&Value(buf.value)) {
            pinned_root[root[bi]] = true;
        }
    }
    let pinned = |bi: usize, _: &[Buffer]| pinned_root[bi];
    let free_under = |bi: usize, c: &[i64; NS]| (0..NS).all(|t| last_touch[bi][t] <= c[t]);

    // First-fit arena placement of the roots in allocation order.
    let mut order: Vec<usize> = (0..buffers.len())
        .filter(|&i| !buffers[i].resident && root[i] == i && buffers[i].category != Category::Host)
        .collect();
    order.sort_by_key(|&i| (buffers[i].live.0, i));
    let mut placed: Vec<usize> = Vec::new();
    let mut arena_bytes = 0u64;
    let mut latest: [[i64; NS]; NS] = [[-1; NS]; NS];
    let stream_of_buffer = |c: usize| {
        producer_instr
            .get(&(c as u32))
            .map_or(0, |&p| instructions[p as usize].stream as usize)
    };
    // Buffers still to place, per producing stream: a placed buffer is forgotten once
    // it is free under the clocks of every stream that still writes one (streams that
    // never write again cannot conflict with it), so `placed` holds what is live, not
    // everything placed so far (quadratic on long programs).
    let mut remaining = [0usize; NS];
    for &c in &order {
        remaining[stream_of_buffer(c)] += 1;
    }
    for &c in &order {
        let size = align(buffers[c].bytes);
        let (clk, s) = match producer_instr.get(&(c as u32)) {
            Some(&p) => (clock[p as usize], instructions[p as usize].stream as usize),
            None => ([-1; NS], 0),
        };
        remaining[stream_of_buffer(c)] -= 1;
        latest[s] = max3(latest[s], clk);
        placed.retain(|&b| {
            pinned(b, &buffers)
                || !(0..NS)
                    .filter(|&t| remaining[t] > 0 || t == s)
                    .all(|t| free_under(b, &latest[t]))
                || buffers[b].live.1 >= buffers[c].live.0
        });
        let mut conflicts: Vec<(u64, u64)> = placed
            .iter()
            // (an input nothing reads is free under any clock, but holds its bytes from
            // before the first instruction: only a buffer written later may take them)
            .filter(|&&b| {
                pinned(b, &buffers)
                    || !free_under(b, &clk)
                    || buffers[b].live.1 >= buffers[c].live.0
            })
            .map(|&b| (buffers[b].offset, align(buffers[b].bytes)))
            .filter(|(_, sz)| *sz > 0)
            .collect();
        conflicts.sort();
        let mut off = 0u64;
        for (o, sz) in conflicts {
            if off + size <= o {
                break;
            }
            off = off.max(o + sz);
        }
        buffers[c].offset = off;
        arena_bytes = arena_bytes.max(off + size);
        placed.push(c);
    }
    // Host pool: one slot per host value, in program order; an updated host state
    // (an `optim.*` output) is written over the state param of its name, which the
    // host update reads last (the host stream runs in order).
    let mut host_bytes = 0u64;
    let mut host_param_offset: BTreeMap<String, u64> = BTreeMap::new();
    for buf in buffers.iter_mut() {
        if buf.category != Category::Host || buf.alias_of.is_some() {
            continue;
        }
        let v = Value(buf.value);
        let replaces = output_names
            .get(&v)
            .and_then(|names| names.iter().find_map(|n| host_param_offset.get(n).copied()));
        let offset = match replaces {
            Some(o) => o,
            None => {
                let o = host_bytes;
                host_bytes += align(buf.bytes);
                if let Op::Param { name, .. } = g.op_of(v) {
                    host_param_offset.insert(name.clone(), o);
                }
                o
            }
        };
        buf.offset = offset;
    }
    // Resident region.
    let mut resident_bytes = 0u64;
    for buf in buffers
        .iter_mut()
        .filter(|b| b.resident && b.alias_of.is_none())
    {
        buf.offset = resident_bytes;
        resident_bytes += align(buf.bytes);
    }
    // Views sit on their root's bytes (a view of a param in the resident region).
    for bi in 0..buffers.len() {
        let r = root[bi];
        if r != bi {
            buffers[bi].offset = buffers[r].offset;
            buffers[bi].resident = buffers[r].resident;
        }
    }

    // Live bytes over time, for the peak and its breakdown: a group's bytes once, under
    // its root's category and over the root's (union) range.
    let mut live_at = vec![BTreeMap::<Category, u64>::new(); instructions.len().max(1)];
    for buf in buffers
        .iter()
        .filter(|b| !b.resident && b.alias_of.is_none() && b.category != Category::Host)
    {
        for t in buf.live.0..=buf.live.1 {
            *live_at[t as usize].entry(buf.category).or_default() += buf.bytes;
        }
    }
    let (peak_at, peak_live) = live_at
        .iter()
        .enumerate()
        .map(|(i, m)| (i, m.values().sum::<u64>()))
        .max_by_key(|(i, s)| (*s, std::cmp::Reverse(*i)))
        .unwrap_or((0, 0));
    let mut breakdown: BTreeMap<String, u64> = BTreeMap::new();
    for c in [
        Category::Param,
        Category::Grad,
        Category::OptimizerState,
        Category::Activation,
        Category::Comm,
        Category::Workspace,
    ] {
        breakdown.insert(c.name().to_string(), 0);
    }
    for buf in buffers
        .iter()
        .filter(|b| b.resident && b.alias_of.is_none())
    {
        *breakdown.get_mut(buf.category.name()).unwrap() += buf.bytes;
    }
    for (c, v) in &live_at[peak_at] {
        *breakdown.entry(c.name().to_string()).or_default() += v;
    }
    // Arena bytes not live at the peak instant: fragmentation held as workspace.
    *breakdown.get_mut("workspace").unwrap() += arena_bytes.saturating_sub(peak_live);
    let peak_bytes = resident_bytes + arena_bytes;
    if peak_bytes > opts.device_memory {
        return Err(LowerError::OutOfMemory {
            peak: peak_bytes,
            limit: opts.device_memory,
            help: memory_help(&breakdown, &g.mesh),
            breakdown,
        });
    }

    let step_time_s = instructions
        .iter()
        .map(|i| i.start_s + i.time_s)
        .fold(0.0, f64::max);
    let exposed = (step_time_s - compute_s).max(0.0);
    let mfu = if step_time_s > 0.0 {
        flops_total / (step_time_s * d.matmul_tflops * 1e12)
    } else {
        0.0
    };
    let params = g
        .params()
        .into_iter()
        .map(|(name, v)| {
            let ty = g.ty(v);
            let parts = g.param_partition(&name).to_vec();
            let mut shape: Vec<i64> = ty
                .shape
                .iter()
                .map(|d| d.bind(&exact).as_const().unwrap_or(-1))
                .collect();
            for p in &parts {
                if p.dim < shape.len() {
                    shape[p.dim] = p.full_size();
                }
            }
            let grad_buffer = g
                .output(&weft_ir::role::grad_name(&name))
                .map(|gv| buf_of[&gv]);
            ParamPlacement {
                name,
                buffer: buf_of[&v],
                shape,
                dtype: ty.dtype,
                partitions: parts,
                grad_buffer,
            }
        })
        .collect();
    let program = weft_ir::print(g);
    let mut groups = BTreeMap::new();
    for (a, _) in &g.mesh.axes {
        groups.insert(a.clone(), g.mesh.groups(a).unwrap_or_default());
    }
    Ok(ExecutionPlan {
        version: PLAN_VERSION,
        model: g.name.clone(),
        step: Some(weft_ir::plan::StepKind::of_outputs(
            g.outputs().iter().map(|(n, _)| n.as_str()),
        )),
        source: opts.source.clone(),
        mesh: g.mesh.clone(),
        groups,
        bindings: exact.symbols.clone(),
        device: d.clone(),
        streams: vec![
            Stream {
                id: 0,
                kind: StreamKind::Compute,
                name: "compute".into(),
            },
            Stream {
                id: 1,
                kind: StreamKind::Comm,
                name: "comm".into(),
            },
            Stream {
                id: 2,
                kind: StreamKind::Copy,
                name: "d2h".into(),
            },
            Stream {
                id: 3,
                kind: StreamKind::Copy,
                name: "h2d".into(),
            },
        ]
        .into_iter()
        .chain(host_update.then(|| Stream {
            id: HOST_STREAM,
            kind: StreamKind::Host,
            name: "host".into(),
        }))
        .collect(),
        buffers,
        instructions,
        events,
        params,
        memory: MemoryReport {
            peak_bytes,
            breakdown,
            arena_bytes,
            resident_bytes,
            host_bytes,
            peak_at: peak_at as u32,
        },
        cost: CostSummary {
            step_time_s,
            compute_s,
            exposed_comm_s: exposed,
            comm_s,
            copy_s,
            flops: flops_total,
            mfu,
            comm_bytes,
            collectives,
        },
        program_digest: weft_ir::plan::digest(program.as_bytes()),
        program,
    })
}

fn max3(a: [i64; NS], b: [i64; NS]) -> [i64; NS] {
    std::array::from_fn(|t| a[t].max(b[t]))
}

/// The sizes of a `grouped_matmul(_grad)` node for the cost model (the largest over
/// ranks where they differ); `None` for other ops or sizes that do not evaluate.
fn grouped_shape(g: &Graph, n: Node, b: &Bindings) -> Option<cost::GroupedShape> {
    let nd = g.node(n);
    let (transpose_w, grad, bias) = match &nd.op {
        Op::GroupedMatmul { transpose_w } => (transpose_w.0, false, nd.operands.len() > 3),
        Op::GroupedMatmulGrad { transpose_w, bias } => (transpose_w.0, true, bias.0),
        _ => return None,
    };
    let size = |v: Value, i: usize| -> Option<f64> {
        max_over_ranks(g.ty(v).shape.get(i)?, b, &g.mesh).ok()
    };
    let (x, w, counts) = (nd.operands[0], nd.operands[1], nd.operands[2]);
    let (a, c) = (size(w, 1)?, size(w, 2)?);
    let (n_out, k) = if transpose_w { (c, a) } else { (a, c) };
    let groups = max_over_ranks(&g.ty(counts).numel(), b, &g.mesh).ok()?;
    Some(cost::GroupedShape {
        rows: size(x, 0)?,
        groups,
        experts: size(w, 0)?,
        n: n_out,
        k,
        elem_bytes: g.ty(x).dtype.size_bytes() as f64,
        grad,
        bias,
    })
}

fn max_over_ranks(
    d: &weft_ir::Dim,
    b: &Bindings,
    mesh: &weft_ir::Mesh,
) -> Result<f64, weft_ir::DimError> {
    // Costs are reported, never used as sizes: f64 cannot wrap.
    if d.rank_axes().is_empty() {
        return d.eval_f64(b);
    }
    let mut best = 0f64;
    for r in 0..mesh.world_size() {
        let mut rb = b.clone();
        for (i, (axis, _)) in mesh.axes.iter().enumerate() {
            rb = rb.with_coord(axis, mesh.coords(r)[i] as i64);
        }
        best = best.max(d.eval_f64(&rb)?);
    }
    Ok(best)
}

/// Which option would bring the plan under the limit, from what dominates the peak.
fn memory_help(breakdown: &BTreeMap<String, u64>, mesh: &weft_ir::Mesh) -> String {
    let get = |k: &str| breakdown.get(k).copied().unwrap_or(0);
    let states = get("params") + get("grads") + get("optimizer_state");
    let acts = get("activations") + get("comm_buffers") + get("workspace");
    if acts >= states {
        let sp = mesh.size_or_one("sp");
        format!(
            "activations dominate: raise sequence parallelism (e.g. --mesh sp={}), use --checkpoint selective or full, or --offload",
            (sp * 2).max(2)
        )
    } else {
        let tp = mesh.size_or_one("tp");
        format!("parameters, gradients and optimizer state dominate: raise tensor parallelism (e.g. tp={}) or shard optimizer state over dp (ZeRO)", (tp * 2).max(2))
    }
}

//! Scheduling: the program's compute nodes become [`Instruction`]s in program order,
//! each on its stream ([`stream_of`]) with a duration from [`cost`]'s models, and the
//! streams are simulated: an instruction starts once its stream is free and its
//! operands are ready, waiting on an event for operands from another stream; ZeRO-3
//! gathers are prefetched a bounded distance ahead ([`ZERO3_PREFETCH`]) and the compute
//! stream waits for offloads once they are predicted done ([`OFFLOAD_WAIT_SLACK`]), and
//! for side-stream updates the same way ([`UPDATE_WAIT_SLACK`]), so their operands'
//! bytes (the gradients) can be reused as they would be inline.
//! With an update stream, each device optimizer update starts once the compute stream
//! has issued what comes before it in the program, and the compute it overlaps is
//! priced slower ([`UPDATE_OVERLAP_SLOWDOWN`]).

// `LowerError` is large, as it is for `lower` itself (its public signature).
#![allow(clippy::result_large_err)]

use super::{cost, LowerError, HOST_STREAM, NS, UPDATE_STREAM};
use std::collections::BTreeMap;
use weft_ir::plan::*;
use weft_ir::{Bindings, Graph, Node, Op, Value};

/// How many compute instructions ahead of its place a ZeRO-3 parameter gather may
/// start (about a transformer layer's forward).
const ZERO3_PREFETCH: usize = 48;

/// The compute stream waits for an offload this many copy durations after the copy's
/// predicted start.
const OFFLOAD_WAIT_SLACK: f64 = 1.5;

/// The compute stream waits for a side-stream update this many of its durations after
/// its predicted start: it runs at low priority in what the compute kernels leave, so
/// it may take longer than alone. Without the wait nothing would order the update
/// before later compute, and no gradient's bytes could be reused after its update (the
/// gradients of a 20B model stayed live to the end of the step: 18 GiB more peak).
const UPDATE_WAIT_SLACK: f64 = 2.0;

/// The fraction of a side-stream update's overlap with compute that the compute stream
/// still loses: the update is bandwidth-bound and runs in the SMs and gaps the compute
/// kernels leave, but it shares HBM and the power budget with them. Fitted on an H100
/// (session 27, the 1.24B with `--torch-adamw` at 4096 and 16384 and with f32 master
/// weights at 4096): the steps saved 6.4 ms of the 21.7 ms of update time the plans
/// overlapped with compute, so compute lost about 0.7 of the overlap.
const UPDATE_OVERLAP_SLOWDOWN: f64 = 0.7;

fn stream_of(op: &Op, update_stream: bool) -> u32 {
    if update_stream
        && matches!(
            op,
            Op::AdamW { .. } | Op::AdamWMaster { .. } | Op::Sgd { .. }
        )
    {
        UPDATE_STREAM
    } else if op.is_collective() {
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

/// Totals the simulation gathers for the plan's [`CostSummary`].
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct StepCosts {
    /// Instructions per collective op.
    pub collectives: BTreeMap<String, u64>,
    /// Bytes moved per `op/axis`.
    pub comm_bytes: BTreeMap<String, f64>,
    pub compute_s: f64,
    pub comm_s: f64,
    pub copy_s: f64,
    /// Host optimizer updates (the host stream's `host_adamw`).
    pub host_update_s: f64,
    /// Device optimizer updates on their own stream (`--update-stream`).
    pub update_s: f64,
    pub flops: f64,
}

/// The simulated streams: instructions with their start times, waits and signals.
pub(super) struct Schedule {
    pub instructions: Vec<Instruction>,
    /// buffer -> the instruction that writes it (none for params and inputs).
    pub producer_instr: BTreeMap<u32, u32>,
    /// How many events the instructions signal.
    pub events: u32,
    pub costs: StepCosts,
}

/// The event instruction `ins` signals, allocating the next one if it has none yet.
fn signal_event(ins: &mut Instruction, events: &mut u32) -> u32 {
    match ins.signal {
        Some(e) => e,
        None => {
            ins.signal = Some(*events);
            *events += 1;
            *events - 1
        }
    }
}

/// Instructions in program order, each on its stream; simulates the streams. `b` prices
/// data-dependent sizes at their expected value (`StepBindings::expected`); the bytes
/// of `buffers` stay at their bound.
pub(super) fn schedule(
    g: &Graph,
    b: &Bindings,
    d: &DeviceProfile,
    buffers: &[Buffer],
    buf_of: &BTreeMap<Value, u32>,
    update_stream: bool,
) -> Result<Schedule, LowerError> {
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
    // Offloads and side-stream updates: (event, when the compute stream waits for it).
    let mut side_in_flight: Vec<(u32, f64)> = Vec::new();
    let mut events = 0u32;
    let mut costs = StepCosts::default();
    for &n in &compute_nodes {
        let nd = g.node(n);
        let id = instructions.len() as u32;
        let kind = stream_of(&nd.op, update_stream);
        let inputs: Vec<u32> = nd.operands.iter().map(|v| buf_of[v]).collect();
        // The unpacking of a reduced gradient bucket (grad-sync's reshapes, slices and
        // splits of a collective's result) runs on the communication stream after it:
        // on the compute stream, in program order right after the bucket's
        // reduce_scatter, it made the backward wait for every reduction (7 s of a 405B
        // step on dp=32,cp=8,sp=4).
        let grad_sync_epilogue = kind == 0
            && nd
                .meta
                .provenance
                .as_ref()
                .is_some_and(|p| p.pass == crate::grad_sync::NAME)
            && inputs.iter().any(|i| {
                producer_instr
                    .get(i)
                    .is_some_and(|&p| instructions[p as usize].stream == 1)
            });
        let stream = if grad_sync_epilogue { 1 } else { kind };
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
            max_over_ranks(&f, b, &g.mesh).map_err(|e| LowerError::Size {
                what: format!("the FLOPs `{f}`"),
                location: g.describe(n),
                why: e.to_string(),
            })?
        };
        let (bytes, time) = instruction_cost(
            g, n, kind, &inputs, in_bytes, out_bytes, flops, buffers, b, d, &mut costs,
        );
        costs.flops += flops;
        // Waits: operands produced on another stream.
        let mut wait = Vec::new();
        let mut ready = stream_free[stream as usize];
        for &i in &inputs {
            ready = ready.max(finish_of.get(&i).copied().unwrap_or(0.0));
            if let Some(&p) = producer_instr.get(&i) {
                if instructions[p as usize].stream != stream {
                    let e = signal_event(&mut instructions[p as usize], &mut events);
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
            let e = signal_event(&mut instructions[p], &mut events);
            if !wait.contains(&e) {
                wait.push(e);
            }
            ready = ready.max(instructions[p].start_s + instructions[p].time_s);
        }
        // A side-stream update starts once the compute stream has run everything before
        // it in the program: every earlier read of the parameter it overwrites in place
        // (a layer's input gradient may read the weight after its weight gradient).
        if update_stream && stream == UPDATE_STREAM {
            if let Some(&p) = compute_ids.last() {
                let p = p as usize;
                let e = signal_event(&mut instructions[p], &mut events);
                if !wait.contains(&e) {
                    wait.push(e);
                }
                ready = ready.max(instructions[p].start_s + instructions[p].time_s);
            }
        }
        // The compute stream waits for an offload or an update once it is predicted
        // done, with slack (one running late should not stall compute): from there on
        // the offloaded value's device bytes, or the updated gradient's, can be reused.
        if stream == 0 {
            side_in_flight.retain(|&(e, done)| {
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
        let time = match stream {
            // A copy beside one the other way shares the link's duplex rate.
            2 | 3 => {
                let other = stream_free[(5 - stream) as usize] - start;
                if other > 0.0 {
                    let t = cost::copy_time_beside(bytes, other, d);
                    costs.copy_s += t - time;
                    t
                } else {
                    time
                }
            }
            // Compute beside a host copy runs slower by the profile's fraction, and
            // beside a side-stream update by UPDATE_OVERLAP_SLOWDOWN.
            0 => {
                let copying = stream_free[2].max(stream_free[3]) - start;
                let mut extra = d.host_copy_compute_slowdown * time.min(copying.max(0.0));
                if update_stream {
                    let updating = stream_free[UPDATE_STREAM as usize] - start;
                    extra += UPDATE_OVERLAP_SLOWDOWN * time.min(updating.max(0.0));
                }
                costs.compute_s += extra;
                time + extra
            }
            _ => time,
        };
        stream_free[stream as usize] = start + time;
        let slack = match stream {
            2 => Some(OFFLOAD_WAIT_SLACK),
            UPDATE_STREAM if update_stream => Some(UPDATE_WAIT_SLACK),
            _ => None,
        };
        let signal = slack.map(|slack| {
            events += 1;
            side_in_flight.push((events - 1, start + slack * time));
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
    Ok(Schedule {
        instructions,
        producer_instr,
        events,
        costs,
    })
}

/// The bytes an instruction moves and its duration, by its stream: a collective's
/// alpha-beta cost, the host update's time, a copy over the host link, or compute's
/// roofline (grouped matmuls by their shape). Adds the time to its stream's total in
/// `costs`.
#[allow(clippy::too_many_arguments)]
fn instruction_cost(
    g: &Graph,
    n: Node,
    stream: u32,
    inputs: &[u32],
    in_bytes: f64,
    out_bytes: f64,
    flops: f64,
    buffers: &[Buffer],
    b: &Bindings,
    d: &DeviceProfile,
    costs: &mut StepCosts,
) -> (f64, f64) {
    let nd = g.node(n);
    match stream {
        1 => {
            let axis = nd.op.axis().unwrap_or_default();
            let (moved, t) = cost::node_collective_cost(g, n, in_bytes, out_bytes, d);
            *costs
                .collectives
                .entry(nd.op.name().to_string())
                .or_default() += 1;
            *costs
                .comm_bytes
                .entry(format!("{}/{axis}", nd.op.name()))
                .or_default() += moved;
            costs.comm_s += t;
            (moved, t)
        }
        HOST_STREAM if matches!(nd.op, Op::HostAdamW { .. }) => {
            let params = g.ty(nd.operands[0]).numel().bind(b).as_const().unwrap_or(0);
            let t = cost::host_adam_time(params as f64, d);
            costs.host_update_s += t;
            (in_bytes + out_bytes, t)
        }
        2 | 3 => {
            // The copied value; later operands only order the copy.
            let moved = inputs
                .first()
                .map_or(0.0, |&i| buffers[i as usize].bytes as f64);
            let t = cost::copy_time(moved, d);
            costs.copy_s += t;
            (moved, t)
        }
        _ => {
            let t = match grouped_shape(g, n, b) {
                Some(s) => cost::grouped_matmul_time(&s, d),
                None => {
                    let work = crate::memory::attention_work(g, n, b);
                    cost::compute_time(&nd.op, flops, in_bytes + out_bytes, work, d)
                        + lce_row_bytes(g, n, b).map_or(0.0, |by| cost::lce_row_pass_time(by, d))
                }
            };
            if stream == UPDATE_STREAM {
                costs.update_s += t;
            } else {
                costs.compute_s += t;
            }
            (in_bytes + out_bytes, t)
        }
    }
}

/// The sizes of a `grouped_matmul(_grad)` node for the cost model (the largest over
/// ranks where they differ); `None` for other ops or sizes that do not evaluate.
/// The logits' bytes (tokens x vocabulary x element size) of a
/// `linear_cross_entropy_with_grad`, whose row kernel the cost model adds to its GEMMs.
fn lce_row_bytes(g: &Graph, n: Node, b: &Bindings) -> Option<f64> {
    let nd = g.node(n);
    if !matches!(nd.op, Op::LinearCrossEntropyWithGrad { .. }) {
        return None;
    }
    let (x, w, labels) = (
        g.ty(nd.operands[0]),
        g.ty(nd.operands[1]),
        g.ty(nd.operands[2]),
    );
    let tokens = labels.numel().bind(b).as_const()? as f64;
    let vocab = w.shape[0].bind(b).as_const()? as f64;
    Some(tokens * vocab * x.dtype.size_bytes() as f64)
}

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

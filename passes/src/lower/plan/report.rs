//! Assembling the [`ExecutionPlan`]: the cost summary from the simulated streams,
//! where each parameter lives, the streams the plan uses, and the program it came from.

use super::schedule::{Schedule, StepCosts};
use super::{PlanOptions, HOST_STREAM};
use std::collections::BTreeMap;
use weft_ir::plan::*;
use weft_ir::{Bindings, Graph, Value};

/// The plan of `g` from its buffers, schedule and memory report.
pub(super) fn assemble(
    g: &Graph,
    opts: &PlanOptions,
    exact: &Bindings,
    buffers: Vec<Buffer>,
    buf_of: &BTreeMap<Value, u32>,
    sched: Schedule,
    memory: MemoryReport,
) -> ExecutionPlan {
    let d = &opts.device;
    // The fifth stream carries the host update or the device updates, never both.
    let side = sched
        .instructions
        .iter()
        .find(|i| i.stream == HOST_STREAM)
        .map(|i| match i.op.as_str() {
            "host_adamw" => StreamKind::Host,
            _ => StreamKind::Update,
        });
    let Schedule {
        instructions,
        events,
        costs,
        ..
    } = sched;
    let cost = cost_summary(&instructions, costs, d);
    let params = param_placements(g, exact, buf_of);
    let program = weft_ir::print(g);
    let mut groups = BTreeMap::new();
    for (a, _) in &g.mesh.axes {
        groups.insert(a.clone(), g.mesh.groups(a).unwrap_or_default());
    }
    ExecutionPlan {
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
        streams: streams(side),
        buffers,
        instructions,
        events,
        params,
        memory,
        cost,
        program_digest: weft_ir::plan::digest(program.as_bytes()),
        program,
    }
}

/// The step time (the last instruction's end), the communication it exposes beyond
/// the compute stream's busy time, and MFU, with the simulation's totals.
pub(super) fn cost_summary(
    instructions: &[Instruction],
    costs: StepCosts,
    d: &DeviceProfile,
) -> CostSummary {
    let StepCosts {
        collectives,
        comm_bytes,
        compute_s,
        comm_s,
        copy_s,
        host_update_s,
        update_s,
        flops: flops_total,
    } = costs;
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
    CostSummary {
        step_time_s,
        compute_s,
        exposed_comm_s: exposed,
        comm_s,
        copy_s,
        host_update_s,
        update_s,
        flops: flops_total,
        mfu,
        comm_bytes,
        collectives,
    }
}

/// Where each parameter lives: its buffer, full (unpartitioned) shape under `exact`
/// (-1 where a size does not evaluate), partitions and gradient buffer.
pub(super) fn param_placements(
    g: &Graph,
    exact: &Bindings,
    buf_of: &BTreeMap<Value, u32>,
) -> Vec<ParamPlacement> {
    g.params()
        .into_iter()
        .map(|(name, v)| {
            let ty = g.ty(v);
            let parts = g.param_partition(&name).to_vec();
            let mut shape: Vec<i64> = ty
                .shape
                .iter()
                .map(|d| d.bind(exact).as_const().unwrap_or(-1))
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
        .collect()
}

/// The plan's streams: compute, communication, the two copy directions, and `side`:
/// the host CPU when the step updates on the host, or the device updates' own stream.
pub(super) fn streams(side: Option<StreamKind>) -> Vec<Stream> {
    vec![
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
    .chain(side.map(|kind| {
        Stream {
            id: HOST_STREAM,
            kind,
            name: match kind {
                StreamKind::Update => "update",
                _ => "host",
            }
            .into(),
        }
    }))
    .collect()
}

//! The cost model: FLOPs and bytes of an instruction, and its predicted time — a
//! roofline for compute (matmul-class ops at the matmul rate, the rest at the vector
//! rate, both bounded by HBM bandwidth, plus a per-kernel overhead) and an alpha-beta
//! model for collectives over NVLink inside a node or the network across nodes.

use weft_ir::plan::DeviceProfile;
use weft_ir::{Mesh, Op};

/// Ops whose FLOPs run on tensor cores.
pub fn is_matmul_class(op: &Op) -> bool {
    matches!(
        op,
        Op::Linear {}
            | Op::Matmul { .. }
            | Op::GroupedMatmul { .. }
            | Op::Attention { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyGrad { .. }
    ) || op.name().ends_with("matmul_grad")
        || op.name() == "attention_grad"
}

/// Ops that only relabel memory (no kernel at all when the runtime makes them views).
pub fn is_view(op: &Op) -> bool {
    matches!(op, Op::Reshape { .. } | Op::Param { .. } | Op::Input { .. })
}

/// Seconds for a compute instruction.
pub fn compute_time(op: &Op, flops: f64, bytes: f64, d: &DeviceProfile) -> f64 {
    if is_view(op) {
        return 0.0;
    }
    let rate = if matches!(op, Op::Attention { .. }) || op.name() == "attention_grad" {
        d.attention_tflops
    } else if is_matmul_class(op) {
        d.matmul_tflops
    } else {
        d.vector_tflops
    } * 1e12;
    let t = (flops / rate).max(bytes / (d.hbm_gbps * 1e9));
    t + d.kernel_overhead_us * 1e-6
}

/// Whether the ranks of `axis`'s groups span more than one node.
pub fn crosses_nodes(mesh: &Mesh, axis: &str, gpus_per_node: u32) -> bool {
    let per = gpus_per_node.max(1);
    mesh.groups(axis)
        .map(|gs| gs.iter().any(|g| g.iter().any(|r| r / per != g[0] / per)))
        .unwrap_or(false)
}

/// Bytes a rank sends for a collective and the predicted seconds.
/// `in_bytes`/`out_bytes` are the rank's operand and result sizes.
pub fn collective_cost(
    op: &Op,
    in_bytes: f64,
    out_bytes: f64,
    group: u32,
    inter_node: bool,
    d: &DeviceProfile,
) -> (f64, f64) {
    if group <= 1 {
        return (0.0, 0.0);
    }
    let p = group as f64;
    let (bw, alpha) = if inter_node {
        (d.inter_node_gbps * 1e9, d.inter_node_latency_us * 1e-6)
    } else {
        (d.intra_node_gbps * 1e9, d.intra_node_latency_us * 1e-6)
    };
    let frac = (p - 1.0) / p;
    let (moved, steps) = match op {
        Op::AllToAll { .. } => (in_bytes * frac, p - 1.0),
        Op::AllReduce { .. } => (2.0 * in_bytes * frac, 2.0 * (p - 1.0)),
        Op::AllGather { .. } => (out_bytes * frac, p - 1.0),
        Op::ReduceScatter { .. } => (in_bytes * frac, p - 1.0),
        Op::Broadcast { .. } => (in_bytes, p.log2().ceil()),
        // One point-to-point send of the whole tensor (and one receive), one step.
        Op::RingShift { .. } => (in_bytes, 1.0),
        _ => (in_bytes * frac, p - 1.0),
    };
    (moved, alpha * steps + moved / bw)
}

/// Seconds for a host <-> device copy.
pub fn copy_time(bytes: f64, d: &DeviceProfile) -> f64 {
    bytes / (d.host_gbps * 1e9) + d.kernel_overhead_us * 1e-6
}

/// Seconds for the host CPU's AdamW update of `params` parameters
/// (`host_adamw`, run on the host stream).
pub fn host_adam_time(params: f64, d: &DeviceProfile) -> f64 {
    params / d.host_adam_params_per_s
}

//! The cost model: FLOPs and bytes of an instruction, and its predicted time — a
//! roofline for compute (matmul-class ops at the matmul rate, the rest at the vector
//! rate, both bounded by HBM bandwidth, plus a per-kernel overhead) and an alpha-beta
//! model for collectives over NVLink inside a node or the network across nodes.
//! Grouped matmuls (MoE experts) are priced as the runtime runs them: a host sync, then
//! one GEMM per group, each bounded below by the host's time to issue it.

use weft_ir::plan::DeviceProfile;
use weft_ir::{Mesh, Op};

/// Ops whose FLOPs run on tensor cores.
pub fn is_matmul_class(op: &Op) -> bool {
    matches!(
        op,
        Op::Linear {}
            | Op::Matmul { .. }
            | Op::MatmulAdd { .. }
            | Op::Fp8Matmul { .. }
            | Op::GroupedMatmul { .. }
            | Op::Attention { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyGrad { .. }
            | Op::LinearCrossEntropyWithGrad { .. }
    ) || op.name().ends_with("matmul_grad")
        || is_attention_class(op)
}

/// Ops priced at the attention rate: attention, its gradient, the ring's per-block
/// gradient, and the unexpanded ring ops (which the training passes price).
fn is_attention_class(op: &Op) -> bool {
    matches!(
        op,
        Op::Attention { .. }
            | Op::AttentionGrad { .. }
            | Op::AttentionBlockGrad { .. }
            | Op::RingAttention { .. }
            | Op::RingAttentionGrad { .. }
    )
}

/// Ops that only relabel memory (no kernel at all when the runtime makes them views).
pub fn is_view(op: &Op) -> bool {
    matches!(op, Op::Reshape { .. } | Op::Param { .. } | Op::Input { .. })
}

/// FP8 GEMM rate over the bf16 one (cuBLASLt on an H200, large shapes).
pub const FP8_GEMM_SPEEDUP: f64 = 1.6;
/// HBM passes of an `fp8_matmul`'s operand bytes besides the GEMM: the amax read, the
/// quantizing read and the 1-byte write (half an operand) for each operand.
const FP8_QUANTIZE_PASSES: f64 = 2.5;

/// Seconds for a compute instruction; `attention`: the rows and visited (query, key)
/// pairs of an `attention` or `attention_grad` (`weft_ir::flops::node_attention_work`),
/// whose per-row fixed work the profile's `attention_row_keys` prices.
pub fn compute_time(
    op: &Op,
    flops: f64,
    bytes: f64,
    attention: Option<(f64, f64)>,
    d: &DeviceProfile,
) -> f64 {
    if is_view(op) {
        return 0.0;
    }
    if matches!(op, Op::Fp8Matmul { .. }) {
        // Two amax and two quantize kernels, then the GEMM.
        let gemm = flops / (d.matmul_tflops * FP8_GEMM_SPEEDUP * 1e12);
        let quantize = bytes * FP8_QUANTIZE_PASSES / (d.hbm_gbps * 1e9);
        return gemm + quantize + 5.0 * d.kernel_overhead_us * 1e-6;
    }
    let rate = if is_attention_class(op) {
        let keys_per_row = attention.and_then(|(rows, pairs)| (rows > 0.0).then(|| pairs / rows));
        attention_tflops(d, is_backward_attention(op), keys_per_row)
    } else if is_matmul_class(op) {
        d.matmul_tflops
    } else {
        d.vector_tflops
    } * 1e12;
    let t = (flops / rate).max(bytes / (d.hbm_gbps * 1e9));
    t + d.kernel_overhead_us * 1e-6
}

/// TFLOP/s of a fused attention in one direction over rows that visit `keys_per_row`
/// keys each: the long-row rate (`attention_bwd_tflops` for the backward, where the
/// profile gives it) slowed by each row's fixed work (`attention_row_keys`).
pub fn attention_tflops(d: &DeviceProfile, backward: bool, keys_per_row: Option<f64>) -> f64 {
    let rate = if backward && d.attention_bwd_tflops > 0.0 {
        d.attention_bwd_tflops
    } else {
        d.attention_tflops
    };
    match keys_per_row {
        Some(k) if k > 0.0 => rate / (1.0 + d.attention_row_keys / k),
        _ => rate,
    }
}

/// TFLOP/s of a fused attention's forward and backward together (the backward 2.5x the
/// forward's FLOPs, `weft_ir::flops`) over rows that visit `keys_per_row` keys each:
/// the rate `weft plan`'s analytic model prices a step's attention at.
pub fn attention_step_tflops(d: &DeviceProfile, keys_per_row: f64) -> f64 {
    let k = Some(keys_per_row);
    3.5 / (1.0 / attention_tflops(d, false, k) + 2.5 / attention_tflops(d, true, k))
}

fn is_backward_attention(op: &Op) -> bool {
    matches!(
        op,
        Op::AttentionGrad { .. } | Op::AttentionBlockGrad { .. } | Op::RingAttentionGrad { .. }
    )
}

/// Passes over the logits' bytes that `linear_cross_entropy_with_grad`'s row kernel
/// (`lce_row_grad`: one block per whole-vocabulary row, reading it twice and writing it
/// once, 16 bytes at a time) costs beyond its three GEMMs, at the profile's HBM rate.
/// Measured (session 16, H100, 1.24B model, bf16, seq 16384): the op took 37.74 ms, its
/// three GEMMs about 33.9 ms, so the row kernel ~3.8 ms = 2.7 passes of the 4.2 GB of
/// logits at the h100 profile's 3000 GB/s. (Session 15's kernel, 2-byte loads, took
/// about 6 passes.)
pub const LCE_ROW_PASSES: f64 = 3.0;

/// Seconds of `linear_cross_entropy_with_grad`'s row kernel over `logit_bytes` (tokens x
/// vocabulary x element size), added to its GEMMs' time.
pub fn lce_row_pass_time(logit_bytes: f64, d: &DeviceProfile) -> f64 {
    logit_bytes * LCE_ROW_PASSES / (d.hbm_gbps * 1e9)
}

/// The sizes of a `grouped_matmul` or `grouped_matmul_grad`: `rows` [rows, k] split
/// over `groups` row groups (counts [E] or [G, E]) of weights [E, n, k].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupedShape {
    pub rows: f64,
    pub groups: f64,
    pub experts: f64,
    pub n: f64,
    pub k: f64,
    pub elem_bytes: f64,
    /// The gradient: dx and dw GEMMs per group (and a dbias one with `bias`), dw zeroed first.
    pub grad: bool,
    pub bias: bool,
}

/// Rows of a GEMM tile: a group's GEMM computes whole tiles, so a group of a few rows
/// costs a full tile of FLOPs (the small-row inefficiency).
const GEMM_TILE_ROWS: f64 = 128.0;

/// Seconds for a grouped matmul (or its gradient) as the CUDA runtime runs it: a stream
/// sync to read the per-group row counts, then for each group one cuBLASLt GEMM (dx and
/// dw in the gradient), issued one by one from the host. The counts are data, so rows
/// are taken as spread evenly over the groups. Each GEMM takes the longest of its
/// FLOPs (rows rounded up to a tile) at the matmul rate, its bytes at HBM bandwidth,
/// and the host's time to issue it: with a few hundred to a few thousand rows per
/// expert the issue time dominates (DeepSeek-V3-shaped stack on an H200: measured 17.6
/// ms forward and 28.5 ms backward where the FLOPs alone take 7.3 and 14.6 ms).
pub fn grouped_matmul_time(s: &GroupedShape, d: &DeviceProfile) -> f64 {
    let (rate, bw) = (d.matmul_tflops * 1e12, d.hbm_gbps * 1e9);
    let issue = d.grouped_gemm_issue_us * 1e-6;
    // Groups without rows are skipped; with rows spread evenly, at most `rows` have any.
    let groups = s.groups.min(s.rows).max(0.0);
    let rows = if groups > 0.0 { s.rows / groups } else { 0.0 };
    let tiled = (rows / GEMM_TILE_ROWS).ceil() * GEMM_TILE_ROWS;
    let gemm = |flops: f64, bytes: f64| (flops / rate).max(bytes / bw).max(issue);
    let eb = s.elem_bytes;
    let (n, k) = (s.n, s.k);
    // out [rows, n] = x [rows, k] @ w[e]^T: also the shape of dx = dy @ w[e].
    let mut per_group = gemm(2.0 * tiled * n * k, (rows * k + n * k + rows * n) * eb);
    let mut zeroed = 0.0;
    if s.grad {
        // dw[e] += dy^T @ x: reads and writes the expert's weight gradient.
        per_group += gemm(2.0 * rows * n * k, (rows * k + rows * n + 2.0 * n * k) * eb);
        if s.bias {
            per_group += gemm(2.0 * rows * n, (rows * n + 2.0 * n) * eb);
        }
        zeroed = s.experts * n * (k + s.bias as u8 as f64) * eb / bw;
    }
    d.host_sync_us * 1e-6 + zeroed + groups * per_group
}

/// Whether the ranks of `axis`'s groups span more than one node.
pub fn crosses_nodes(mesh: &Mesh, axis: &str, gpus_per_node: u32) -> bool {
    let per = gpus_per_node.max(1);
    mesh.groups(axis)
        .map(|gs| gs.iter().any(|g| g.iter().any(|r| r / per != g[0] / per)))
        .unwrap_or(false)
}

/// [`collective_cost`] of collective node `n` of `g` on its own axis (its group size
/// and whether that group spans nodes from the mesh), with the rank's operand and
/// result bytes.
pub fn node_collective_cost(
    g: &weft_ir::Graph,
    n: weft_ir::Node,
    in_bytes: f64,
    out_bytes: f64,
    d: &DeviceProfile,
) -> (f64, f64) {
    let op = &g.node(n).op;
    let axis = op.axis().unwrap_or_default();
    let p = g.mesh.size_or_one(axis);
    let inter = crosses_nodes(&g.mesh, axis, d.gpus_per_node);
    collective_cost(op, in_bytes, out_bytes, p, inter, d)
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

/// Seconds of a host copy of `bytes` that starts while the other direction stays busy
/// for `overlap_s` more seconds: that long it moves at its share of the duplex rate
/// (`host_duplex_gbps` / 2, where the profile gives one below twice `host_gbps`), the
/// rest at `host_gbps`.
pub fn copy_time_beside(bytes: f64, overlap_s: f64, d: &DeviceProfile) -> f64 {
    let alone = d.host_gbps * 1e9;
    let shared = d.host_bytes_per_s_beside_other_direction();
    let during = bytes.min(overlap_s.max(0.0) * shared);
    during / shared + (bytes - during) / alone + d.kernel_overhead_us * 1e-6
}

/// Seconds for the host CPU's AdamW update of `params` parameters
/// (`host_adamw`, run on the host stream).
pub fn host_adam_time(params: f64, d: &DeviceProfile) -> f64 {
    params / d.host_adam_params_per_s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attention(grad: bool) -> Op {
        let causal = true;
        let scale = weft_ir::Float(0.125);
        if grad {
            Op::AttentionGrad {
                layout: Default::default(),
                causal,
                scale,
                window: None,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            }
        } else {
            Op::Attention {
                layout: Default::default(),
                causal,
                scale,
                window: None,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            }
        }
    }

    /// A fused attention's time is its FLOPs at the direction's long-row rate, plus
    /// each query row's fixed work (`attention_row_keys` keys' worth): a causal
    /// S = 4096 row (2048 keys on average) costs 1 + 770 / 2048 of its FLOPs' time, a
    /// 16384 one 1 + 770 / 8192; a profile without the fields prices as before.
    #[test]
    fn attention_rows_price_their_fixed_work() {
        let d = crate::plan::profile::preset("h100").unwrap();
        let time = |grad: bool, s: f64, d: &DeviceProfile| {
            let rows = 32.0 * s;
            let pairs = rows * s / 2.0;
            let flops = pairs * if grad { 646.0 } else { 261.0 };
            let t = compute_time(&attention(grad), flops, 0.0, Some((rows, pairs)), d)
                - d.kernel_overhead_us * 1e-6;
            (t, flops)
        };
        for (grad, rate) in [(false, d.attention_tflops), (true, d.attention_bwd_tflops)] {
            for s in [4096.0, 16384.0] {
                let (t, flops) = time(grad, s, &d);
                let want = flops / (rate * 1e12) * (1.0 + d.attention_row_keys / (s / 2.0));
                assert!((t - want).abs() < 1e-9 * want, "{grad} {s}: {t} vs {want}");
            }
        }
        // the 1.24B step's 16 layers at 4096 on the H100: 3.24 ms forward and 9.22 ms
        // backward measured (session 21); the preset within 5%
        let (fwd, _) = time(false, 4096.0, &d);
        let (bwd, _) = time(true, 4096.0, &d);
        assert!((fwd * 16.0 / 3.24e-3 - 1.0).abs() < 0.05, "{}", fwd * 16.0);
        assert!((bwd * 16.0 / 9.22e-3 - 1.0).abs() < 0.05, "{}", bwd * 16.0);
        let mut plain = d.clone();
        plain.attention_bwd_tflops = 0.0;
        plain.attention_row_keys = 0.0;
        let (t, flops) = time(true, 4096.0, &plain);
        let want = flops / (plain.attention_tflops * 1e12);
        assert!((t - want).abs() < 1e-9 * want);
        // the analytic model's rate for the step: the two directions at their share
        let step = attention_step_tflops(&plain, 2048.0);
        assert!((step - plain.attention_tflops).abs() < 1e-9);
        assert!(attention_step_tflops(&d, 2048.0) < attention_step_tflops(&d, 8192.0));
    }

    /// Plans and profiles written before the attention fields existed load with them at
    /// 0: one rate both ways, no per-row work.
    #[test]
    fn profiles_without_the_attention_fields_load() {
        let mut v = serde_json::to_value(crate::plan::profile::preset("h200").unwrap()).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("attention_bwd_tflops");
        o.remove("attention_row_keys");
        let p: DeviceProfile = serde_json::from_value(v).unwrap();
        assert_eq!((p.attention_bwd_tflops, p.attention_row_keys), (0.0, 0.0));
        p.validate().unwrap();
    }

    fn shape(rows: f64, groups: f64, grad: bool) -> GroupedShape {
        GroupedShape {
            rows,
            groups,
            experts: groups,
            n: 4096.0,
            k: 7168.0,
            elem_bytes: 2.0,
            grad,
            bias: false,
        }
    }

    /// A copy beside one the other way moves at half the duplex rate while that one
    /// runs, then at the one-direction rate; without a duplex rate it never slows.
    #[test]
    fn a_copy_beside_the_other_direction_shares_the_duplex_rate() {
        let d = crate::plan::profile::preset("h100").unwrap();
        assert_eq!((d.host_gbps, d.host_duplex_gbps), (50.0, 72.0));
        let overhead = d.kernel_overhead_us * 1e-6;
        let gb = 1e9;
        let alone = copy_time(gb, &d);
        assert!((alone - (0.02 + overhead)).abs() < 1e-12, "{alone}");
        assert_eq!(copy_time_beside(gb, 0.0, &d), alone);
        // Beside a copy the whole way: 1 GB at 36 GB/s.
        let shared = copy_time_beside(gb, 1.0, &d);
        assert!((shared - (1.0 / 36.0 + overhead)).abs() < 1e-12, "{shared}");
        // Beside one for 10 ms: 0.36 GB shared, 0.64 GB alone.
        let part = copy_time_beside(gb, 0.01, &d);
        assert!(
            (part - (0.01 + 0.64 / 50.0 + overhead)).abs() < 1e-12,
            "{part}"
        );
        let mut none = d.clone();
        none.host_duplex_gbps = 0.0;
        assert_eq!(copy_time_beside(gb, 1.0, &none), alone);
    }

    #[test]
    fn grouped_gemms_cost_at_least_their_host_issue_and_at_most_a_dense_gemm_beyond_it() {
        let d = crate::plan::profile::preset("h200").unwrap();
        let issue = d.grouped_gemm_issue_us * 1e-6;
        let sync = d.host_sync_us * 1e-6;
        // No rows: only the sync. Fewer rows than groups: only groups with rows issue.
        assert_eq!(grouped_matmul_time(&shape(0.0, 32.0, false), &d), sync);
        let few = grouped_matmul_time(&shape(4.0, 32.0, false), &d);
        assert!((few - (sync + 4.0 * issue)).abs() < 1e-12, "{few}");
        // Many rows per group: the FLOPs dominate, as one dense GEMM of all rows.
        let big = grouped_matmul_time(&shape(32.0 * 65536.0, 32.0, false), &d);
        let dense = 2.0 * 32.0 * 65536.0 * 4096.0 * 7168.0 / (d.matmul_tflops * 1e12);
        assert!(big > dense && big < 1.05 * dense, "{big} vs {dense}");
        // The gradient issues dx and dw per group and zeroes the weight gradient first.
        let fwd = grouped_matmul_time(&shape(32768.0, 32.0, false), &d);
        let bwd = grouped_matmul_time(&shape(32768.0, 32.0, true), &d);
        assert!(bwd > 2.0 * fwd - sync, "{bwd} vs {fwd}");
    }
}

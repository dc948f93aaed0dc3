//! FLOP counts per node, as symbolic dims (so `B` and `S` stay free until a caller binds
//! them). Matmul-like ops count 2 FLOPs per multiply-add; elementwise ops one per output
//! element; causal attention counts the half of the score matrix a causal kernel computes.
//! The fused backward ops with matmuls inside (`attention_grad`, `grouped_matmul_grad`)
//! count their matmuls, so plan costs and MFU see the backward's real work.

use crate::dim::Dim;
use crate::graph::{Graph, Node};
use crate::ops::Op;

/// The (query, key) pairs one head of a causal attention with a window of `w` keeps,
/// for `a` queries aligned with the last of `b` keys: query `i` sits at `p = i + b - a`
/// and keeps the `min(p + 1, w)` keys `max(0, p - w + 1) ..= p` (none when `p < 0`), so
/// the count is `sum min(q, w)` over `q = max(b - a + 1, 1) ..= b`. `None` when it does
/// not fit an i64.
pub fn band_pairs(a: i64, b: i64, w: i64) -> Option<i64> {
    let (a, b, w) = (a as i128, b as i128, w.max(0) as i128);
    // sum of min(q, w) for q in 1..=n
    let upto = |n: i128| {
        if n <= 0 {
            0
        } else if n <= w {
            n * (n + 1) / 2
        } else {
            w * (w + 1) / 2 + (n - w) * w
        }
    };
    let (lo, hi) = ((b - a + 1).max(1), b);
    let count = if hi < lo { 0 } else { upto(hi) - upto(lo - 1) };
    i64::try_from(count).ok()
}

/// FLOPs of one node (forward).
pub fn node_flops(g: &Graph, n: Node) -> Dim {
    let d = g.node(n);
    let ins: Vec<&crate::types::TensorType> = d.operands.iter().map(|v| g.ty(*v)).collect();
    let out_numel = d
        .results
        .first()
        .map(|v| g.ty(*v).numel())
        .unwrap_or_else(Dim::zero);
    let last = |t: &crate::types::TensorType| t.shape.last().cloned().unwrap_or(Dim::from(1));
    match &d.op {
        Op::Param { .. } | Op::Input { .. } | Op::Full { .. } | Op::Arange { .. } => Dim::zero(),
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. } => Dim::zero(),
        Op::Split { .. }
        | Op::Expand { .. }
        | Op::Cast { .. }
        | Op::Embedding { .. }
        | Op::IndexSelect { .. } => Dim::zero(),
        Op::Gather { .. } | Op::ShiftLabels { .. } | Op::MoeDispatch { .. } => Dim::zero(),
        Op::Linear {} => {
            let k = last(ins[0]);
            out_numel * k * 2
                + if ins.len() > 2 {
                    g.ty(d.results[0]).numel()
                } else {
                    Dim::zero()
                }
        }
        Op::Matmul { transpose_a, .. }
        | Op::MatmulAdd { transpose_a, .. }
        | Op::Fp8Matmul { transpose_a, .. } => {
            let a = ins[0];
            let k = if *transpose_a {
                a.shape[a.rank() - 2].clone()
            } else {
                last(a)
            };
            // matmul_add adds its addend: one more FLOP per element.
            let addend = if matches!(d.op, Op::MatmulAdd { .. }) {
                out_numel.clone()
            } else {
                Dim::zero()
            };
            out_numel * k * 2 + addend
        }
        Op::GroupedMatmul { .. } => out_numel * last(ins[0]) * 2,
        Op::Attention { .. } => {
            // scores q k^T (2 D per kept pair) and probs v (2 Dv), plus the softmax (5).
            attention_flops(&d.op, ins[0], ins[1], ins[2], (2, 2, 5))
        }
        Op::AttentionGrad { .. } => {
            // Recomputing S = Q K^T (2 D), dV = P^T dO (2 Dv), dP = dO V^T (2 Dv),
            // dQ = dS K (2 D), dK = dS^T Q (2 D), and the elementwise dS (6).
            attention_flops(&d.op, ins[0], ins[1], ins[2], (6, 4, 6))
        }
        Op::RingAttention { axis, .. } | Op::RingAttentionGrad { axis, .. } => {
            // Every rank's queries against the whole sequence's keys (cp local blocks);
            // the zigzag causal ring skips the blocks above the diagonal (half), the
            // masked ring (window, not causal) computes every block. The backward is
            // attention_grad's work per pair.
            let (causal, windowed) = match &d.op {
                Op::RingAttention { causal, window, .. }
                | Op::RingAttentionGrad { causal, window, .. } => (*causal, window.is_some()),
                _ => unreachable!(),
            };
            let cp = g.mesh.size_or_one(axis) as i64;
            let (q, v) = (ins[0], ins[2]);
            let per = if matches!(d.op, Op::RingAttention { .. }) {
                (2, 2, 5)
            } else {
                (6, 4, 6)
            };
            let pairs = q.shape[0].clone()
                * q.shape[1].clone()
                * q.shape[2].clone()
                * (ins[1].shape[2].clone() * cp);
            let per_pair = q.shape[3].clone() * per.0 + v.shape[3].clone() * per.1 + per.2;
            let full = pairs * per_pair;
            if causal && !windowed {
                full / 2
            } else {
                full
            }
        }
        Op::AttentionBlockGrad { .. } => {
            // attention_grad's matmuls and elementwise work, every (query, key) pair of
            // the block (the probabilities come from the given log-sum-exp).
            let (q, k, v) = (ins[0], ins[1], ins[2]);
            let pairs =
                q.shape[0].clone() * q.shape[1].clone() * q.shape[2].clone() * k.shape[2].clone();
            let full = pairs * (q.shape[3].clone() * 6 + v.shape[3].clone() * 4 + 6);
            match &d.op {
                Op::AttentionBlockGrad { causal: true, .. } => full / 2,
                _ => full,
            }
        }
        Op::GroupedMatmulGrad { .. } => {
            // dx = dy w and dw = dy^T x: twice the forward's matmul.
            let k = last(ins[0]);
            ins[3].numel() * k * 4
        }
        Op::RmsNorm { .. } => out_numel * 4,
        // the add (1) and the norm (4) per element
        Op::AddRmsNorm { .. } => out_numel * 5,
        // the activation (4) and the product (1)
        Op::Glu { .. } => out_numel * 5,
        // the activation and its derivative (8) and three products
        Op::GluGrad { .. } => out_numel * 11,
        // `rms_norm_grad`'s count (the default: one per element) and the add
        Op::AddRmsNormGrad { .. } => out_numel * 2,
        Op::Softmax { .. } | Op::LogSoftmax { .. } => out_numel * 5,
        Op::CrossEntropy { .. } => ins[0].numel() * 5,
        Op::LinearCrossEntropy { .. } => {
            // the logits x w^T (2 H per logit) and their log-sum-exp (5 per logit)
            let logits = ins[2].numel() * ins[1].shape[0].clone();
            logits * (last(ins[0]) * 2 + 5)
        }
        Op::LinearCrossEntropyGrad { .. } => {
            // recomputed logits, dx = dz w and dw = dz^T x (2 H per logit each), and
            // the softmax and dz (6 per logit)
            let logits = ins[2].numel() * ins[1].shape[0].clone();
            logits * (last(ins[0]) * 6 + 6)
        }
        Op::LinearCrossEntropyWithGrad { .. } => {
            // the logits once, dx and dw (2 H per logit each), the statistics and dz
            let logits = ins[2].numel() * ins[1].shape[0].clone();
            logits * (last(ins[0]) * 6 + 11)
        }
        Op::Rope { .. } => out_numel * 3,
        Op::MoeCombine {} => g.ty(d.operands[0]).numel() * 2,
        op => match op.info().elementwise {
            Some(e) => out_numel * i64::from(e.flops),
            None => out_numel,
        },
    }
}

/// FLOPs of an attention (or its gradient) at `(per D, per Dv, per element)` for each
/// (query, key) pair a kernel that skips masked tiles visits ([`attention_work`]).
fn attention_flops(
    op: &Op,
    q: &crate::types::TensorType,
    k: &crate::types::TensorType,
    v: &crate::types::TensorType,
    (per_d, per_dv, per_el): (i64, i64, i64),
) -> Dim {
    let (work, unmasked) = attention_work(op, q, k, v);
    let layout = op.head_layout().unwrap_or_default();
    let (q, v) = (&layout.swap_to_bhsd(q), &layout.swap_to_bhsd(v));
    let per_pair = q.shape[3].clone() * per_d + v.shape[3].clone() * per_dv + per_el;
    match unmasked {
        // halved after the multiplication, so an odd count keeps its half FLOP
        Some(full) => full * per_pair / 2,
        None => work.pairs * per_pair,
    }
}

/// What an attention kernel walks: its query rows (B x Hq x Sq) and the (query, key)
/// pairs it visits when it skips masked tiles.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionWork {
    pub rows: Dim,
    pub pairs: Dim,
}

/// The rows and visited pairs of an `attention` or `attention_grad` node (operands q, k,
/// v): all pairs, half for causal, the band for a window (exact when the sequence
/// lengths are known; for symbolic ones the band of a sequence at least `window` long,
/// `S W - W (W - 1) / 2` per head). `None` for other ops.
pub fn node_attention_work(g: &Graph, n: Node) -> Option<AttentionWork> {
    let d = g.node(n);
    if !matches!(d.op, Op::Attention { .. } | Op::AttentionGrad { .. }) || d.operands.len() < 3 {
        return None;
    }
    let ty = |i: usize| g.ty(d.operands[i]);
    Some(attention_work(&d.op, ty(0), ty(1), ty(2)).0)
}

/// The work, and for a causal attention without a window the unmasked pair count it
/// halves.
fn attention_work(
    op: &Op,
    q: &crate::types::TensorType,
    k: &crate::types::TensorType,
    _v: &crate::types::TensorType,
) -> (AttentionWork, Option<Dim>) {
    let (causal, window) = match op {
        Op::Attention { causal, window, .. } | Op::AttentionGrad { causal, window, .. } => {
            (*causal, *window)
        }
        _ => (false, None),
    };
    // q, k in [B, H, S, D] order whatever the op's head layout
    let layout = op.head_layout().unwrap_or_default();
    let (q, k) = (&layout.swap_to_bhsd(q), &layout.swap_to_bhsd(k));
    let (sq, sk) = (q.shape[2].clone(), k.shape[2].clone());
    let rows = q.shape[0].clone() * q.shape[1].clone() * sq.clone();
    // (a window too large to count with is no narrower than the causal triangle)
    let Some(w) = window.filter(|&w| causal && w.checked_mul(w).is_some()) else {
        let full = rows.clone() * sk;
        return if causal {
            let pairs = full.clone() / 2;
            (AttentionWork { rows, pairs }, Some(full))
        } else {
            (AttentionWork { rows, pairs: full }, None)
        };
    };
    let heads = q.shape[0].clone() * q.shape[1].clone();
    let band = match (sq.as_const(), sk.as_const()) {
        (Some(a), Some(b)) => band_pairs(a, b, w),
        _ => None,
    };
    let pairs = match band {
        Some(per_head) => heads * per_head,
        None => heads * (sq * w - Dim::from(w * (w - 1) / 2)),
    };
    (AttentionWork { rows, pairs }, None)
}

/// Total forward FLOPs of the graph.
pub fn graph_flops(g: &Graph) -> Dim {
    g.nodes()
        .iter()
        .fold(Dim::zero(), |acc, &n| acc + node_flops(g, n))
}

#[cfg(test)]
mod tests {
    use super::band_pairs;

    /// The closed form counts what walking the queries one by one counts, for queries
    /// fewer than, as many as and more than the keys, windows narrower and wider.
    #[test]
    fn band_pairs_count_each_querys_kept_keys() {
        for a in 0..24i64 {
            for b in 0..24i64 {
                for w in 0..30i64 {
                    let walked: i64 = (0..a)
                        .map(|i| {
                            let p = i + b - a;
                            (p.min(b - 1) - (p - w + 1).max(0) + 1).max(0)
                        })
                        .sum();
                    assert_eq!(band_pairs(a, b, w), Some(walked), "a={a} b={b} w={w}");
                }
            }
        }
        // a 2^32-token sequence with a 2^32 window: 2^63 + 2^31 pairs, past an i64
        assert_eq!(band_pairs(1 << 32, 1 << 32, 1 << 32), None);
        assert_eq!(
            band_pairs(1 << 20, 1 << 20, 4096),
            Some(4096 * 4097 / 2 + ((1 << 20) - 4096) * 4096)
        );
    }
}

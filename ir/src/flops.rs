//! FLOP counts per node, as symbolic dims (so `B` and `S` stay free until a caller binds
//! them). Matmul-like ops count 2 FLOPs per multiply-add; elementwise ops one per output
//! element; causal attention counts the half of the score matrix a causal kernel computes.
//! The fused backward ops with matmuls inside (`attention_grad`, `grouped_matmul_grad`)
//! count their matmuls, so plan costs and MFU see the backward's real work.

use crate::dim::Dim;
use crate::graph::{Graph, Node};
use crate::ops::Op;

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
        | Op::Embedding {}
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
        Op::Matmul { transpose_a, .. } => {
            let a = ins[0];
            let k = if *transpose_a {
                a.shape[a.rank() - 2].clone()
            } else {
                last(a)
            };
            out_numel * k * 2
        }
        Op::GroupedMatmul {} => out_numel * last(ins[0]) * 2,
        Op::Attention { causal, .. } => {
            // scores q k^T and probs v: 2 matmuls of B*Nq*Sq*Sk*D, plus softmax.
            let q = ins[0];
            let sk = ins[1].shape[2].clone();
            let full = q.numel() * sk.clone() * 4 + q.numel() / last(q) * sk * 5;
            if *causal {
                full / 2
            } else {
                full
            }
        }
        Op::AttentionGrad { causal, .. } => {
            // dV = P^T dO, dP = dO V^T, dS, dQ = dS K, dK = dS^T Q plus recomputing S = Q K^T:
            // 5 matmuls of B*Nq*Sq*Sk*D (2.5x the forward's two), and the elementwise dS.
            let q = ins[0];
            let sk = ins[1].shape[2].clone();
            let full = q.numel() * sk.clone() * 10 + q.numel() / last(q) * sk * 6;
            if *causal {
                full / 2
            } else {
                full
            }
        }
        Op::GroupedMatmulGrad {} => {
            // dx = dy w and dw = dy^T x: twice the forward's matmul.
            let k = last(ins[0]);
            ins[3].numel() * k * 4
        }
        Op::RmsNorm { .. } => out_numel * 4,
        Op::Softmax { .. } | Op::LogSoftmax { .. } => out_numel * 5,
        Op::CrossEntropy { .. } => ins[0].numel() * 5,
        Op::Rope {} => out_numel * 3,
        Op::Silu {} | Op::Gelu { .. } | Op::Sigmoid {} | Op::Tanh {} => out_numel * 4,
        Op::MoeCombine {} => g.ty(d.operands[0]).numel() * 2,
        _ => out_numel,
    }
}

/// Total forward FLOPs of the graph.
pub fn graph_flops(g: &Graph) -> Dim {
    g.nodes()
        .iter()
        .fold(Dim::zero(), |acc, &n| acc + node_flops(g, n))
}

//! The reference of `layout=bshd` (`attention`, `attention_grad`, `rope` reading and
//! writing their per-head tensors as [B, S, H, D]): each per-head operand is transposed
//! to [B, H, S, D], the op's [B, H, S, D] kernel runs, and each per-head result is
//! transposed back. Masks, sinks, cos/sin and the log-sum-exp statistics have the same
//! shape in both layouts and pass through untouched.

use super::kernels::{self, Cx, KResult, KernelError};
use candle_core::Tensor;
use weft_ir::{HeadLayout, Op};

/// Evaluates a `layout=bshd` op through its [B, H, S, D] kernel.
pub(crate) fn eval_bshd(op: &Op, ins: &[Tensor], cx: &Cx) -> KResult<Vec<Tensor>> {
    // (per-head operands, per-head results): q, k, v (out, dout) and out (dq, dk, dv)
    let (per_head_ins, per_head_outs) = match op {
        Op::Rope { .. } => (1, 1),
        Op::Attention { .. } => (3, 1),
        Op::AttentionGrad { .. } => (5, 3),
        other => {
            return Err(KernelError(format!(
                "internal: `{}` has no head layout",
                other.name()
            )))
        }
    };
    let mut ins = ins.to_vec();
    for t in ins.iter_mut().take(per_head_ins) {
        *t = swap_heads_and_seq(t)?;
    }
    let mut outs = kernels::eval(&with_layout(op, HeadLayout::Bhsd), &ins, cx)?;
    for t in outs.iter_mut().take(per_head_outs) {
        *t = swap_heads_and_seq(t)?;
    }
    Ok(outs)
}

/// `op` with its head layout set to `layout` (other ops as they are).
pub(crate) fn with_layout(op: &Op, layout: HeadLayout) -> Op {
    let mut op = op.clone();
    match &mut op {
        Op::Attention { layout: l, .. }
        | Op::AttentionGrad { layout: l, .. }
        | Op::Rope { layout: l } => *l = layout,
        _ => {}
    }
    op
}

/// [B, S, H, D] <-> [B, H, S, D], contiguous.
fn swap_heads_and_seq(t: &Tensor) -> KResult<Tensor> {
    if t.rank() != 4 {
        return Err(KernelError(format!(
            "a per-head tensor must have rank 4, got shape {:?}",
            t.dims()
        )));
    }
    Ok(t.transpose(1, 2)?.contiguous()?)
}

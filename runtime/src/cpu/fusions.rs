//! The fused ops `fuse` makes (`glu`, `glu_grad`, `add_rms_norm`, `add_rms_norm_grad`,
//! `matmul_add`), each computed as the unfused ops it replaces: the same kernels in the
//! same order.
//! This runtime holds every float dtype in one precision, so the roundings the fused
//! GPU kernels keep (to the dtype where the unfused ops round) are identities here, and
//! a fused program equals its unfused one to the last bit on this runtime, but for the
//! order of the sums `fuse` reassociates into chains of `matmul_add`.

use super::backward_kernels::{gelu_grad, rms_norm_grad, silu_grad};
use super::kernels::{self, Cx, KResult};
use candle_core::Tensor;
use weft_ir::{GateAct, Op};

/// `act(x)`, as `kernels::eval` computes `silu` / `gelu` (differentiable by candle).
fn act(a: GateAct, x: &Tensor, cx: &Cx) -> KResult<Tensor> {
    let op = match a {
        GateAct::Silu => Op::Silu {},
        GateAct::Gelu => Op::Gelu { tanh_approx: false },
        GateAct::GeluTanh => Op::Gelu { tanh_approx: true },
    };
    Ok(kernels::eval(&op, std::slice::from_ref(x), cx)?.remove(0))
}

/// `dy * act'(x)`, as the backward ops `silu_grad` / `gelu_grad` compute it.
fn act_grad(a: GateAct, x: &Tensor, dy: &Tensor) -> KResult<Tensor> {
    match a {
        GateAct::Silu => silu_grad(x, dy),
        GateAct::Gelu => gelu_grad(x, dy, false),
        GateAct::GeluTanh => gelu_grad(x, dy, true),
    }
}

/// Evaluates one fused op (the arm of `kernels::eval` for them).
pub(crate) fn eval(op: &Op, ins: &[Tensor], cx: &Cx) -> KResult<Vec<Tensor>> {
    match op {
        Op::Glu { act: a } => Ok(vec![(act(*a, &ins[0], cx)? * &ins[1])?]),
        Op::GluGrad { act: a } => {
            let (gate, up, dy) = (&ins[0], &ins[1], &ins[2]);
            let dgate = act_grad(*a, gate, &(dy * up)?)?;
            let dup = (dy * act(*a, gate, cx)?)?;
            Ok(vec![dgate, dup])
        }
        Op::AddRmsNorm { eps } => {
            let sum = (&ins[0] + &ins[1])?;
            let normed = kernels::eval(
                &Op::RmsNorm { eps: *eps },
                &[sum.clone(), ins[2].clone()],
                cx,
            )?;
            Ok(vec![sum, normed.into_iter().next().expect("one result")])
        }
        Op::MatmulAdd {
            transpose_a,
            transpose_b,
        } => {
            let product = kernels::eval(
                &Op::Matmul {
                    transpose_a: *transpose_a,
                    transpose_b: *transpose_b,
                },
                &ins[..2],
                cx,
            )?;
            Ok(vec![(&product[0] + &ins[2])?])
        }
        Op::AddRmsNormGrad { eps } => {
            let (sum, w, dnorm, dsum) = (&ins[0], &ins[1], &ins[2], &ins[3]);
            let (dx, dw) = rms_norm_grad(sum, w, dnorm, eps.0)?;
            Ok(vec![(dsum + dx)?, dw])
        }
        other => Err(kernels::KernelError(format!(
            "internal: `{}` is not a fused op",
            other.name()
        ))),
    }
}

//! Backward rules of the unary elementwise ops (`neg`, `exp`, `log`, `sqrt`, `rsqrt`,
//! `tanh`, `sigmoid`, `silu`, `glu`, `gelu`, `relu`, `scale`, `add_scalar`,
//! `pow_scalar`, `cast`): the incoming gradient times the derivative, written with the
//! forward ops or a `*_grad` op (`silu_grad`, `glu_grad`, `gelu_grad`).

use super::super::Ad;
use crate::pass::PassError;
use weft_ir::{CmpOp, Float, Node, NodeData, Op, Value};

impl Ad<'_> {
    /// The gradient of the operand(s) of a unary elementwise op.
    /// `None` for an op not of this family.
    pub(super) fn vjp_elementwise(
        &mut self,
        _n: Node,
        d: &NodeData,
        g: Value,
        want: &[bool],
    ) -> Result<Option<Vec<Option<Value>>>, PassError> {
        let ops = &d.operands;
        let ty = |s: &Self, i: usize| s.ty(ops[i]);
        let y = d.results[0];
        let gt = self.ty(g);
        let w = |i: usize| want.get(i).copied().unwrap_or(false);
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        match &d.op {
            Op::Neg {} => out[0] = Some(self.op(Op::Neg {}, &[g])?),
            Op::Exp {} => out[0] = Some(self.mul(g, y)?),
            Op::Log {} => out[0] = Some(self.op(Op::Div {}, &[g, ops[0]])?),
            Op::Sqrt {} => {
                // d sqrt(x) = 1 / (2 sqrt(x))
                let h = self.op(Op::Scale { factor: Float(0.5) }, &[g])?;
                out[0] = Some(self.op(Op::Div {}, &[h, y])?);
            }
            Op::Rsqrt {} => {
                // d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
                let y3 = self.op(
                    Op::PowScalar {
                        exponent: Float(3.0),
                    },
                    &[y],
                )?;
                let t = self.mul(g, y3)?;
                out[0] = Some(self.op(
                    Op::Scale {
                        factor: Float(-0.5),
                    },
                    &[t],
                )?);
            }
            Op::Tanh {} => {
                let y2 = self.mul(y, y)?;
                let ny2 = self.op(Op::Neg {}, &[y2])?;
                let d1 = self.op(Op::AddScalar { value: Float(1.0) }, &[ny2])?;
                out[0] = Some(self.mul(g, d1)?);
            }
            Op::Sigmoid {} => {
                let ny = self.op(Op::Neg {}, &[y])?;
                let one_minus = self.op(Op::AddScalar { value: Float(1.0) }, &[ny])?;
                let dsig = self.mul(y, one_minus)?;
                out[0] = Some(self.mul(g, dsig)?);
            }
            Op::Silu {} => out[0] = Some(self.op(Op::SiluGrad {}, &[ops[0], g])?),
            Op::Glu { act } => {
                let r = self.ops(Op::GluGrad { act: *act }, &[ops[0], ops[1], g])?;
                (out[0], out[1]) = (w(0).then_some(r[0]), w(1).then_some(r[1]));
            }
            Op::Gelu { tanh_approx } => {
                out[0] = Some(self.op(
                    Op::GeluGrad {
                        tanh_approx: *tanh_approx,
                    },
                    &[ops[0], g],
                )?)
            }
            Op::Relu {} => {
                let x = ty(self, 0);
                let z = self.scalar(0.0, x.dtype)?;
                let pos = self.op(Op::Compare { op: CmpOp::Gt }, &[ops[0], z])?;
                let m = self.mask_of(pos, x.dtype)?;
                out[0] = Some(self.mul(g, m)?);
            }
            Op::Scale { factor } => out[0] = Some(self.op(Op::Scale { factor: *factor }, &[g])?),
            Op::AddScalar { .. } => out[0] = Some(g),
            Op::PowScalar { exponent } => {
                let e = exponent.0;
                out[0] = Some(if e == 1.0 {
                    g
                } else if e == 2.0 {
                    let t = self.mul(g, ops[0])?;
                    self.op(Op::Scale { factor: Float(2.0) }, &[t])?
                } else {
                    let p = self.op(
                        Op::PowScalar {
                            exponent: Float(e - 1.0),
                        },
                        &[ops[0]],
                    )?;
                    let p = self.op(Op::Scale { factor: Float(e) }, &[p])?;
                    self.mul(g, p)?
                });
            }
            Op::Cast { .. } => {
                let x = ty(self, 0);
                if x.dtype.is_float() {
                    out[0] = Some(if x.dtype == gt.dtype {
                        g
                    } else {
                        self.op(Op::Cast { dtype: x.dtype }, &[g])?
                    });
                }
            }
            _ => return Ok(None),
        }
        Ok(Some(out))
    }
}

//! Backward rules of the broadcasting binary ops (`add`, `sub`, `mul`, `div`, `pow`,
//! `maximum`, `minimum`, `where`): each operand's gradient is computed at the
//! result's shape and summed back to the operand's (`unbroadcast`).

use super::super::Ad;
use crate::pass::PassError;
use weft_ir::{CmpOp, Float, Node, NodeData, Op, Value};

impl Ad<'_> {
    /// The gradients of the operands of a broadcasting binary (or ternary `where`) op.
    /// `None` for an op not of this family.
    pub(super) fn vjp_binary(
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
            Op::Add {} | Op::Sub {} => {
                if w(0) {
                    let t = ty(self, 0);
                    out[0] = Some(self.unbroadcast(g, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let gb = if matches!(d.op, Op::Sub {}) {
                        self.op(Op::Neg {}, &[g])?
                    } else {
                        g
                    };
                    out[1] = Some(self.unbroadcast(gb, &t)?);
                }
            }
            Op::Mul {} => {
                for (i, j) in [(0, 1), (1, 0)] {
                    if w(i) {
                        let t = ty(self, i);
                        let p = self.mul(g, ops[j])?;
                        out[i] = Some(self.unbroadcast(p, &t)?);
                    }
                }
            }
            Op::Div {} => {
                if w(0) {
                    let t = ty(self, 0);
                    let q = self.op(Op::Div {}, &[g, ops[1]])?;
                    out[0] = Some(self.unbroadcast(q, &t)?);
                }
                if w(1) {
                    // d(a/b)/db = -a/b^2 = -y/b
                    let t = ty(self, 1);
                    let q = self.op(Op::Div {}, &[y, ops[1]])?;
                    let p = self.mul(g, q)?;
                    let p = self.op(Op::Neg {}, &[p])?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
            }
            Op::Pow {} => {
                if w(0) {
                    // b a^(b-1) = b y / a
                    let t = ty(self, 0);
                    let q = self.op(Op::Div {}, &[y, ops[0]])?;
                    let q = self.mul(q, ops[1])?;
                    let p = self.mul(g, q)?;
                    out[0] = Some(self.unbroadcast(p, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let l = self.op(Op::Log {}, &[ops[0]])?;
                    let q = self.mul(y, l)?;
                    let p = self.mul(g, q)?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
            }
            Op::Maximum {} | Op::Minimum {} => {
                // torch: the winner takes the gradient, ties split it evenly.
                let dt = gt.dtype;
                let cmp = if matches!(d.op, Op::Maximum {}) {
                    CmpOp::Gt
                } else {
                    CmpOp::Lt
                };
                let win = self.op(Op::Compare { op: cmp }, &[ops[0], ops[1]])?;
                let tie = self.op(Op::Compare { op: CmpOp::Eq }, &[ops[0], ops[1]])?;
                let win = self.mask_of(win, dt)?;
                let tie = self.mask_of(tie, dt)?;
                let half = self.op(Op::Scale { factor: Float(0.5) }, &[tie])?;
                let ma = self.op(Op::Add {}, &[win, half])?;
                if w(0) {
                    let t = ty(self, 0);
                    let p = self.mul(g, ma)?;
                    out[0] = Some(self.unbroadcast(p, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let nm = self.op(Op::Neg {}, &[ma])?;
                    let mb = self.op(Op::AddScalar { value: Float(1.0) }, &[nm])?;
                    let p = self.mul(g, mb)?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
            }
            Op::Where {} => {
                let z = self.scalar(0.0, gt.dtype)?;
                if w(1) {
                    let t = ty(self, 1);
                    let p = self.op(Op::Where {}, &[ops[0], g, z])?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
                if w(2) {
                    let t = ty(self, 2);
                    let p = self.op(Op::Where {}, &[ops[0], z, g])?;
                    out[2] = Some(self.unbroadcast(p, &t)?);
                }
            }
            _ => return Ok(None),
        }
        Ok(Some(out))
    }
}

//! Backward rules of the reductions (`sum`, `mean`, `max`), of `softmax` and
//! `log_softmax`, and of `topk`: a reduced gradient is expanded back over the reduced
//! dims (`max` shares it evenly among the maxima), the top-k values' gradient is
//! `scatter_add`ed into zeros at their indices.

use super::super::Ad;
use crate::pass::PassError;
use weft_ir::{CmpOp, Dim, Float, Node, NodeData, Op, TensorType, Value};

impl Ad<'_> {
    /// The gradient of the operand of a reduction, `softmax` or `log_softmax`.
    /// `None` for an op not of this family.
    pub(super) fn vjp_reduction(
        &mut self,
        n: Node,
        d: &NodeData,
        g: Value,
    ) -> Result<Option<Vec<Option<Value>>>, PassError> {
        let ops = &d.operands;
        let ty = |s: &Self, i: usize| s.ty(ops[i]);
        let y = d.results[0];
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        match &d.op {
            Op::Sum { dims, keepdim } => {
                let x = ty(self, 0);
                let ds = self.norm_dims(n, dims, x.rank())?;
                out[0] = Some(if ds.is_empty() {
                    g
                } else {
                    self.expand_back(g, &x, &ds, *keepdim)?
                });
            }
            Op::Mean { dims, keepdim } => {
                let x = ty(self, 0);
                let ds = self.norm_dims(n, dims, x.rank())?;
                if ds.is_empty() {
                    out[0] = Some(g);
                } else {
                    let count = ds.iter().fold(Dim::from(1), |a, &i| a * x.shape[i].clone());
                    let e = self.expand_back(g, &x, &ds, *keepdim)?;
                    out[0] = Some(match count.as_const() {
                        Some(c) => self.op(
                            Op::Scale {
                                factor: Float(1.0 / c as f64),
                            },
                            &[e],
                        )?,
                        None => {
                            let ones = self.op(
                                Op::Full {
                                    value: Float(1.0),
                                    ty: TensorType::new(
                                        x.dtype,
                                        ds.iter().map(|&i| x.shape[i].clone()).collect(),
                                    ),
                                },
                                &[],
                            )?;
                            let cnt = self.op(
                                Op::Sum {
                                    dims: (0..ds.len() as i64).collect(),
                                    keepdim: false,
                                },
                                &[ones],
                            )?;
                            self.op(Op::Div {}, &[e, cnt])?
                        }
                    });
                }
            }
            Op::Max { dims, keepdim } => {
                // amax: the gradient is shared evenly by the maxima.
                let x = ty(self, 0);
                let ds = self.norm_dims(n, dims, x.rank())?;
                if ds.is_empty() {
                    out[0] = Some(g);
                } else {
                    let kept: Vec<Dim> = x
                        .shape
                        .iter()
                        .enumerate()
                        .map(|(i, d)| {
                            if ds.contains(&i) {
                                Dim::from(1)
                            } else {
                                d.clone()
                            }
                        })
                        .collect();
                    let yk = if *keepdim { y } else { self.reshape(y, &kept)? };
                    let gk = if *keepdim { g } else { self.reshape(g, &kept)? };
                    let hit = self.op(Op::Compare { op: CmpOp::Eq }, &[ops[0], yk])?;
                    let m = self.mask_of(hit, x.dtype)?;
                    let cnt = self.op(
                        Op::Sum {
                            dims: ds.iter().map(|&i| i as i64).collect(),
                            keepdim: true,
                        },
                        &[m],
                    )?;
                    let share = self.op(Op::Div {}, &[gk, cnt])?;
                    out[0] = Some(self.mul(m, share)?);
                }
            }
            Op::Softmax { dim } => out[0] = Some(self.op(Op::SoftmaxGrad { dim: *dim }, &[y, g])?),
            Op::LogSoftmax { dim } => {
                let s = self.op(
                    Op::Sum {
                        dims: vec![*dim],
                        keepdim: true,
                    },
                    &[g],
                )?;
                let p = self.op(Op::Exp {}, &[y])?;
                let ps = self.mul(p, s)?;
                out[0] = Some(self.op(Op::Sub {}, &[g, ps])?);
            }
            _ => return Ok(None),
        }
        Ok(Some(out))
    }

    /// The gradient of `topk`'s operand from its values' gradient (the indices have none).
    pub(super) fn vjp_topk(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let Op::Topk { dim, .. } = &d.op else {
            return Err(self.no_rule(n, &d.op));
        };
        let ops = &d.operands;
        let ty = |s: &Self, i: usize| s.ty(ops[i]);
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        let Some(dv) = dy[0] else { return Ok(out) };
        let z = self.zeros(&ty(self, 0))?;
        out[0] = Some(self.op(Op::ScatterAdd { dim: *dim }, &[z, d.results[1], dv])?);
        Ok(out)
    }
}

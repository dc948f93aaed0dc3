//! Backward rules of the transformer blocks: `embedding`, `linear`, `matmul` (and the
//! fused `matmul_add`), `fp8_matmul` (straight-through, gradients in e5m2), `rms_norm`,
//! `rope` (itself with the sine negated), `cross_entropy` and `linear_cross_entropy`.
//! Attention is in `attention.rs`.

use super::super::{err, Ad};
use crate::pass::PassError;
use weft_ir::{Dim, Node, NodeData, Op, Value};

impl Ad<'_> {
    /// The gradients of the operands of a single-result transformer block.
    /// `None` for an op not of this family.
    pub(super) fn vjp_block(
        &mut self,
        n: Node,
        d: &NodeData,
        g: Value,
        want: &[bool],
    ) -> Result<Option<Vec<Option<Value>>>, PassError> {
        let ops = &d.operands;
        let ty = |s: &Self, i: usize| s.ty(ops[i]);
        let gt = self.ty(g);
        let w = |i: usize| want.get(i).copied().unwrap_or(false);
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        match &d.op {
            Op::Embedding { padding_idx } => {
                let wt = ty(self, 1);
                out[1] = Some(self.op(
                    Op::EmbeddingGrad {
                        num_embeddings: wt.shape[0].clone(),
                        padding_idx: padding_idx.clone(),
                    },
                    &[ops[0], g],
                )?);
            }
            Op::Linear {} => {
                let (xt, wt) = (ty(self, 0), ty(self, 1));
                let (nout, kin) = (wt.shape[0].clone(), wt.shape[1].clone());
                let lead: Vec<Dim> = xt.shape[..xt.rank() - 1].to_vec();
                let m = lead.iter().fold(Dim::from(1), |a, d| a * d.clone());
                if w(0) {
                    let g2 = if gt.rank() >= 2 {
                        g
                    } else {
                        self.reshape(g, &[Dim::from(1), nout.clone()])?
                    };
                    let dx = self.op(
                        Op::Matmul {
                            transpose_a: false,
                            transpose_b: false,
                        },
                        &[g2, ops[1]],
                    )?;
                    out[0] = Some(self.reshape(dx, &xt.shape)?);
                }
                if w(1) {
                    let g2 = self.reshape(g, &[m.clone(), nout.clone()])?;
                    let x2 = self.reshape(ops[0], &[m.clone(), kin.clone()])?;
                    out[1] = Some(self.op(
                        Op::Matmul {
                            transpose_a: true,
                            transpose_b: false,
                        },
                        &[g2, x2],
                    )?);
                }
                if ops.len() > 2 && w(2) {
                    let lead_dims: Vec<i64> = (0..gt.rank() as i64 - 1).collect();
                    out[2] = Some(if lead_dims.is_empty() {
                        g
                    } else {
                        self.op(
                            Op::Sum {
                                dims: lead_dims,
                                keepdim: false,
                            },
                            &[g],
                        )?
                    });
                }
            }
            Op::Matmul {
                transpose_a: ta,
                transpose_b: tb,
            }
            | Op::MatmulAdd {
                transpose_a: ta,
                transpose_b: tb,
            } => {
                let (ta, tb) = (*ta, *tb);
                // matmul_add's addend has the sum's type: its gradient is the sum's.
                if matches!(d.op, Op::MatmulAdd { .. }) && w(2) {
                    out[2] = Some(g);
                }
                if w(0) {
                    let t = ty(self, 0);
                    let da = if !ta {
                        self.op(
                            Op::Matmul {
                                transpose_a: false,
                                transpose_b: !tb,
                            },
                            &[g, ops[1]],
                        )?
                    } else {
                        self.op(
                            Op::Matmul {
                                transpose_a: tb,
                                transpose_b: true,
                            },
                            &[ops[1], g],
                        )?
                    };
                    out[0] = Some(self.unbroadcast(da, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let db = if !tb {
                        self.op(
                            Op::Matmul {
                                transpose_a: !ta,
                                transpose_b: false,
                            },
                            &[ops[0], g],
                        )?
                    } else {
                        self.op(
                            Op::Matmul {
                                transpose_a: true,
                                transpose_b: ta,
                            },
                            &[g, ops[0]],
                        )?
                    };
                    out[1] = Some(self.unbroadcast(db, &t)?);
                }
            }
            Op::Fp8Matmul {
                transpose_a: ta,
                transpose_b: tb,
                format_a: fa,
                format_b: fb,
            } => {
                // Straight-through, as matmul's rule, each product an fp8_matmul whose
                // incoming gradient is quantized to e5m2 and whose other operand keeps
                // its forward format.
                let (ta, tb, fa, fb) = (*ta, *tb, *fa, *fb);
                let g8 = weft_ir::Fp8Format::E5m2;
                let fp8 = |transpose_a, transpose_b, format_a, format_b| Op::Fp8Matmul {
                    transpose_a,
                    transpose_b,
                    format_a,
                    format_b,
                };
                if w(0) {
                    let t = ty(self, 0);
                    let da = if !ta {
                        self.op(fp8(false, !tb, g8, fb), &[g, ops[1]])?
                    } else {
                        self.op(fp8(tb, true, fb, g8), &[ops[1], g])?
                    };
                    out[0] = Some(self.unbroadcast(da, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let db = if !tb {
                        self.op(fp8(!ta, false, fa, g8), &[ops[0], g])?
                    } else {
                        self.op(fp8(true, ta, g8, fa), &[g, ops[0]])?
                    };
                    out[1] = Some(self.unbroadcast(db, &t)?);
                }
            }
            Op::RmsNorm { eps } => {
                let r = self.ops(Op::RmsNormGrad { eps: *eps }, &[ops[0], ops[1], g])?;
                out[0] = w(0).then_some(r[0]);
                out[1] = w(1).then_some(r[1]);
            }
            Op::Rope { layout } => {
                if w(1) || w(2) {
                    return Err(err(
                        "`autodiff` cannot differentiate `rope` wrt its tables",
                        self.g.describe(n),
                        "cos and sin depend on a parameter",
                    ));
                }
                let ns = self.op(Op::Neg {}, &[ops[2]])?;
                out[0] = Some(self.op(Op::Rope { layout: *layout }, &[g, ops[1], ns])?);
            }
            Op::CrossEntropy {
                ignore_index,
                reduction,
            } => {
                out[0] = Some(self.op(
                    Op::CrossEntropyGrad {
                        ignore_index: *ignore_index,
                        reduction: *reduction,
                    },
                    &[ops[0], ops[1], g],
                )?);
            }
            _ => return Ok(None),
        }
        Ok(Some(out))
    }

    /// The gradients of `linear_cross_entropy`'s hidden states and weight from its two
    /// statistics' gradients.
    pub(super) fn vjp_linear_cross_entropy(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
        want: &[bool],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let Op::LinearCrossEntropy {
            ignore_index,
            chunk,
            scale,
            softcap,
        } = &d.op
        else {
            return Err(self.no_rule(n, &d.op));
        };
        let ops = &d.operands;
        let y = d.results[0];
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        // One gradient op takes both statistics' gradients (zero where one has
        // none) and recomputes the logits chunk by chunk from the saved lse.
        if dy.iter().all(|g| g.is_none()) {
            return Ok(out);
        }
        let mut grads = Vec::new();
        for (r, g) in d.results.iter().zip(dy) {
            grads.push(match g {
                Some(g) => *g,
                None => {
                    let t = self.ty(*r);
                    self.zeros(&t)?
                }
            });
        }
        let r = self.ops(
            Op::LinearCrossEntropyGrad {
                ignore_index: *ignore_index,
                chunk: *chunk,
                scale: *scale,
                softcap: *softcap,
            },
            &[ops[0], ops[1], ops[2], y, grads[0], grads[1]],
        )?;
        let w = |i: usize| want.get(i).copied().unwrap_or(false);
        out[0] = w(0).then_some(r[0]);
        out[1] = w(1).then_some(r[1]);
        Ok(out)
    }
}

//! Backward rules of the layout and index ops: `reshape`, `permute`, `transpose` and
//! `zigzag` by their inverses, `expand` by summing back, `slice` by a zero-padded
//! `concat`, `split` and `concat` by each other, `gather` and `index_select` by a
//! `scatter_add` into zeros (and `scatter_add` by a `gather`), `offload`/`reload` as
//! the identity.

use super::super::{err, Ad};
use crate::pass::PassError;
use weft_ir::{Dim, Node, NodeData, Op, Value};

impl Ad<'_> {
    /// The gradients of the operands of a single-result layout or index op.
    /// `None` for an op not of this family.
    pub(super) fn vjp_layout(
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
            Op::Reshape { .. } => {
                let t = ty(self, 0);
                out[0] = Some(self.op(Op::Reshape { shape: t.shape }, &[g])?);
            }
            Op::Permute { perm } => {
                let r = perm.len();
                let mut inv = vec![0i64; r];
                for (i, &p) in perm.iter().enumerate() {
                    let p = weft_ir::shape::norm_dim(p, r)
                        .map_err(|m| err("`autodiff`: bad permutation", self.g.describe(n), m))?;
                    inv[p] = i as i64;
                }
                out[0] = Some(self.op(Op::Permute { perm: inv }, &[g])?);
            }
            Op::Transpose { dim0, dim1 } => {
                out[0] = Some(self.op(
                    Op::Transpose {
                        dim0: *dim0,
                        dim1: *dim1,
                    },
                    &[g],
                )?)
            }
            Op::Zigzag {
                dim,
                parts,
                inverse,
            } => {
                // A permutation: its transpose is the inverse permutation.
                out[0] = Some(self.op(
                    Op::Zigzag {
                        dim: *dim,
                        parts: *parts,
                        inverse: !*inverse,
                    },
                    &[g],
                )?)
            }
            Op::Slice { dim, start, len } => {
                // Zeros before and after this slice's gradient.
                let x = ty(self, 0);
                let k = weft_ir::shape::norm_dim(*dim, x.rank())
                    .map_err(|m| err("`autodiff`: bad slice", self.g.describe(n), m))?;
                let after = x.shape[k].clone() - start.clone() - len.clone();
                let mut parts = Vec::new();
                for (size, is_g) in [(start.clone(), false), (len.clone(), true), (after, false)] {
                    if is_g {
                        parts.push(g);
                    } else if size.as_const() != Some(0) {
                        let mut shape = x.shape.clone();
                        shape[k] = size;
                        parts.push(self.zeros(&x.with_shape(shape))?);
                    }
                }
                out[0] = Some(if parts.len() == 1 {
                    g
                } else {
                    self.op(Op::Concat { dim: *dim }, &parts)?
                });
            }
            Op::Concat { dim } => {
                let sizes: Vec<Dim> = ops
                    .iter()
                    .map(|v| {
                        let t = self.g.ty(*v);
                        weft_ir::shape::norm_dim(*dim, t.rank()).map(|k| t.shape[k].clone())
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|m| err("`autodiff`: bad concat", self.g.describe(n), m))?;
                let parts = if ops.len() == 1 {
                    vec![g]
                } else {
                    self.ops(Op::Split { dim: *dim, sizes }, &[g])?
                };
                for (i, p) in parts.into_iter().enumerate() {
                    out[i] = w(i).then_some(p);
                }
            }
            Op::Expand { .. } => {
                let t = ty(self, 0);
                out[0] = Some(self.unbroadcast(g, &t)?);
            }
            Op::Gather { dim } => {
                let t = ty(self, 0);
                let z = self.zeros(&t)?;
                out[0] = Some(self.op(Op::ScatterAdd { dim: *dim }, &[z, ops[1], g])?);
            }
            Op::IndexSelect { dim } => {
                let t = ty(self, 0);
                let k = weft_ir::shape::norm_dim(*dim, t.rank())
                    .map_err(|m| err("`autodiff`: bad index_select", self.g.describe(n), m))?;
                let idx_len = self.g.ty(ops[1]).shape[0].clone();
                let col: Vec<Dim> = (0..gt.rank())
                    .map(|i| {
                        if i == k {
                            idx_len.clone()
                        } else {
                            Dim::from(1)
                        }
                    })
                    .collect();
                let idx = self.reshape(ops[1], &col)?;
                let idx = self.op(
                    Op::Expand {
                        shape: gt.shape.clone(),
                    },
                    &[idx],
                )?;
                let z = self.zeros(&t)?;
                out[0] = Some(self.op(Op::ScatterAdd { dim: *dim }, &[z, idx, g])?);
            }
            Op::ScatterAdd { dim } => {
                out[0] = w(0).then_some(g);
                if w(2) {
                    out[2] = Some(self.op(Op::Gather { dim: *dim }, &[g, ops[1]])?);
                }
            }
            Op::Offload { .. } | Op::Reload { .. } => out[0] = Some(g),
            _ => return Ok(None),
        }
        Ok(Some(out))
    }

    /// The gradient of `split`'s operand: its results' gradients (zeros where one has
    /// none) concatenated.
    pub(super) fn vjp_split(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let Op::Split { dim, .. } = &d.op else {
            return Err(self.no_rule(n, &d.op));
        };
        let ops = &d.operands;
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        let mut parts = Vec::new();
        for (r, g) in d.results.iter().zip(dy) {
            parts.push(match g {
                Some(g) => *g,
                None => {
                    let t = self.ty(*r);
                    self.zeros(&t)?
                }
            });
        }
        out[0] = Some(if parts.len() == 1 {
            parts[0]
        } else {
            self.op(Op::Concat { dim: *dim }, &parts)?
        });
        Ok(out)
    }
}

//! Layout ops: `view`/`reshape` and the `squeeze` family, `expand`, `permute`,
//! `transpose`, `slice`/`select`, `cat`, the `split` family, and
//! `repeat_interleave`.

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{one, Lower, LR, LV};
use weft_ir::{Dim, Op, Value};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_layout(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.view.default"
            | "aten.reshape.default"
            | "aten._unsafe_view.default"
            | "aten.unsqueeze.default"
            | "aten.squeeze.dim"
            | "aten.squeeze.dims"
            | "aten.squeeze.default"
            | "aten.flatten.using_ints" => self.lower_reshape(n),
            "aten.expand.default" | "aten.expand_as.default" => self.lower_expand(n),
            "aten.permute.default" => self.lower_permute(n),
            "aten.transpose.int" | "aten.t.default" => self.lower_transpose(n),
            "aten.slice.Tensor" | "aten.select.int" => self.lower_slice_select(n),
            "aten.cat.default" => self.lower_cat(n),
            "aten.split_with_sizes.default"
            | "aten.split.Tensor"
            | "aten.chunk.default"
            | "aten.unbind.int" => self.lower_split(n),
            "aten.repeat_interleave.self_int" => self.lower_repeat_interleave(n),
            _ => return None,
        })
    }

    fn lower_reshape(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let ty = self.out_ty(n)?;
        let shape = self.gen_reshape(&self.ty(x).shape, &ty.shape);
        one(self.reshape(n, x, shape)?)
    }

    fn lower_expand(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        if self.causal.contains_key(&x) || self.broadcast_masks.contains(&x) {
            // A causal mask broadcasts; expanding it over batch and heads adds nothing.
            return one(x);
        }
        let ty = self.out_ty(n)?;
        let shape = self.gen_expand(&self.ty(x).shape, &ty.shape);
        if self.g.ty(x).shape == shape {
            return one(x);
        }
        one(self.emit(n, Op::Expand { shape }, &[x])?)
    }

    fn lower_permute(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let perm = self.ints_arg(n, n.arg_at(1))?;
        let r = perm.len() as i64;
        let perm: Vec<i64> = perm
            .into_iter()
            .map(|p| if p < 0 { p + r } else { p })
            .collect();
        if perm.iter().enumerate().all(|(i, &p)| i as i64 == p) {
            return one(x);
        }
        one(self.emit(n, Op::Permute { perm }, &[x])?)
    }

    fn lower_transpose(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let r = self.g.ty(x).rank() as i64;
        let (a, b) = if n.base() == "t" {
            (0, 1)
        } else {
            (self.int_arg(n, n.arg_at(1))?, self.int_arg(n, n.arg_at(2))?)
        };
        let (a, b) = (if a < 0 { a + r } else { a }, if b < 0 { b + r } else { b });
        if a == b {
            return one(x);
        }
        one(self.emit(n, Op::Transpose { dim0: a, dim1: b }, &[x])?)
    }

    fn lower_slice_select(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        if let (LV::Unset(u), "slice") = (self.arg_lv(n.arg_at(0)), n.base()) {
            return self.slice_unset(n, &u);
        }
        let x = self.tensor(n, n.arg_at(0))?;
        let xt = self.ty(x);
        let ty = self.out_ty(n)?;
        let r = xt.rank() as i64;
        let d = self.int_arg(n, n.arg_at(1))?;
        let d = if d < 0 { d + r } else { d };
        if d < 0 || d >= r {
            return Err(self.bad(n, format!("dim {d} out of range")));
        }
        let size = xt.shape[d as usize].clone();
        let norm = |s: Dim| -> Dim {
            match s.as_const() {
                Some(c) if c < 0 => size.clone() + c,
                _ => s,
            }
        };
        if n.base() == "select" {
            let i = norm(self.dim_arg(n, n.arg_at(2))?);
            let s = self.emit(
                n,
                Op::Slice {
                    dim: d,
                    start: i,
                    len: Dim::from(1),
                },
                &[x],
            )?;
            let shape = self.gen_reshape(&self.ty(s).shape, &ty.shape);
            return one(self.reshape(n, s, shape)?);
        }
        let step = self.int_arg(n, n.arg_at(4))?;
        if step != 1 {
            return one(self.strided_slice(n, x, d, step)?);
        }
        let start = match n.arg_at(2) {
            Arg::None => Dim::from(0),
            a => norm(self.dim_arg(n, a)?),
        };
        let mut len = ty.shape[d as usize].clone();
        // A static export's sequence length is `S` in a slice of a dim that follows
        // from input_ids, or of a table (a size-only value: `cos_cached[:S]`); a slice
        // of a model dim (`x[..., :6]` of a hidden size 16) keeps its constant length,
        // whatever the sequence length was.
        let of_table = matches!(n.arg_at(0), Arg::Tensor(t) if self.static_vals.contains(t));
        if self.same_size(&len, &size) {
            len = size.clone();
        } else if size.as_const().is_none() || of_table {
            len = self.seq_dim(&len);
        }
        if start == Dim::from(0) && len == size {
            return one(x);
        }
        one(self.emit(n, Op::Slice { dim: d, start, len }, &[x])?)
    }

    fn lower_cat(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let Arg::Tensors(names) = n.arg_at(0) else {
            return Err(self.bad(n, "cat of a non-list"));
        };
        let ty = self.out_ty(n)?;
        let mut vs = Vec::new();
        for nm in names {
            let v = self.tensor(n, &Arg::Tensor(nm.clone()))?;
            let t = self.ty(v);
            if t.rank() == 1 && t.shape[0] == Dim::from(0) {
                continue;
            }
            vs.push(self.cast(n, v, ty.dtype)?);
        }
        if vs.len() == 1 {
            return one(vs[0]);
        }
        let d = self.int_arg(n, n.arg_at(1))?;
        one(self.emit(n, Op::Concat { dim: d }, &vs)?)
    }

    fn lower_split(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let vs = self.split(n, x)?;
        Ok(vs.into_iter().map(LV::T).collect())
    }

    fn lower_repeat_interleave(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let r = self.int_arg(n, n.arg_at(1))?;
        let ty = self.out_ty(n)?;
        let xt = self.ty(x);
        let d = match n.arg_at(2) {
            Arg::None => return Err(self.unsupported(n, "repeat_interleave without dim")),
            a => self.int_arg(n, a)?,
        };
        let d = self.norm_dim(n, d, xt.rank())?;
        if r <= 0 {
            return Err(self.bad(n, "repeat count must be positive"));
        }
        let mut s1 = xt.shape.clone();
        s1.insert(d + 1, Dim::from(1));
        let u = self.reshape(n, x, s1.clone())?;
        s1[d + 1] = Dim::from(r);
        let e = self.emit(n, Op::Expand { shape: s1 }, &[u])?;
        let shape = self.gen_reshape(&self.ty(e).shape, &ty.shape);
        one(self.reshape(n, e, shape)?)
    }

    fn split(&mut self, n: &FxNode, x: Value) -> LR<Vec<Value>> {
        let xt = self.ty(x);
        let (d, sizes): (i64, Vec<Dim>) = match n.base() {
            "unbind" => {
                let d = self.int_arg(n, n.arg_at(1))?;
                let du = self.norm_dim(n, d, xt.rank())?;
                let k = xt.shape[du]
                    .as_const()
                    .ok_or_else(|| self.unsupported(n, "unbind of a symbolic dim"))?;
                if !(0..=1 << 16).contains(&k) {
                    return Err(self.bad(n, "unbind of a huge dim"));
                }
                let parts = self.emit_multi(
                    n,
                    Op::Split {
                        dim: d,
                        sizes: vec![Dim::from(1); k as usize],
                    },
                    &[x],
                )?;
                let mut out = Vec::new();
                for (p, o) in parts.into_iter().zip(&n.outputs) {
                    let ty = match o {
                        Some(o) => self.meta_ty(o)?,
                        None => continue,
                    };
                    let shape = self.gen_reshape(&self.ty(p).shape, &ty.shape);
                    out.push(self.reshape(n, p, shape)?);
                }
                return Ok(out);
            }
            "split_with_sizes" => {
                let (Arg::SymInts(_) | Arg::Ints(_)) = n.arg_at(1) else {
                    return Err(self.bad(n, "split sizes"));
                };
                let sizes = match n.arg_at(1) {
                    Arg::Ints(v) => v.iter().map(|&i| Dim::from(i)).collect(),
                    Arg::SymInts(v) => v
                        .iter()
                        .map(|s| self.dim_arg(n, &Arg::SymInt(s.clone())))
                        .collect::<LR<Vec<_>>>()?,
                    _ => unreachable!(),
                };
                (self.int_arg(n, n.arg_at(2))?, sizes)
            }
            _ => {
                let d = self.int_arg(n, n.arg_at(2))?;
                let du = self.norm_dim(n, d, xt.rank())?;
                let total = xt.shape[du].clone();
                let sizes = if n.base() == "chunk" {
                    let c = self.int_arg(n, n.arg_at(1))?;
                    if c <= 0 || c > 1 << 16 {
                        return Err(self.bad(n, format!("chunk into {c} parts")));
                    }
                    match total.as_const() {
                        Some(t) => {
                            let each = (t + c - 1) / c;
                            let mut v = Vec::new();
                            let mut left = t;
                            while left > 0 {
                                v.push(Dim::from(each.min(left)));
                                left -= each;
                            }
                            v
                        }
                        None => vec![total.clone() / c; c as usize],
                    }
                } else {
                    let s = self.int_arg(n, n.arg_at(1))?;
                    let t = total
                        .as_const()
                        .ok_or_else(|| self.unsupported(n, "split of a symbolic dim"))?;
                    if s <= 0 || t / s > 1 << 16 {
                        return Err(self.bad(n, format!("split into pieces of {s}")));
                    }
                    let mut v = Vec::new();
                    let mut left = t;
                    while left > 0 {
                        v.push(Dim::from(s.min(left)));
                        left -= s;
                    }
                    v
                };
                (d, sizes)
            }
        };
        if sizes.len() == 1 {
            return Ok(vec![x]);
        }
        self.emit_multi(n, Op::Split { dim: d, sizes }, &[x])
    }
}

//! `slice_scatter`, `copy`, and the empty tensors they fill.
//!
//! Core ATen writes a slice functionally: `x[.., a:b] = y` is
//! `slice_scatter(x, copy(slice(x, d, a, b), y), d, a, b)`, where `copy` gives `y`
//! broadcast to the slice's shape and dtype. On a tensor with values, a step-1
//! `slice_scatter` is the `concat` of `x` before the range, the source, and `x` after it
//! (other steps are refused).
//!
//! An `empty` tensor has no values until written (transformers' DeepSeek-V3 assembles
//! MLA's key in one: `new_empty`, then `[..., :nope] = k_pass` and `[..., nope:] =
//! k_rot`), and the importer invents none: it lowers to an [`Unset`], which records the
//! written ranges of one dim and the value of each. A slice of it keeps the written
//! ranges it covers, `copy` into it reads only its type, and `slice_scatter` adds a
//! range (replacing what it overlaps). Once the ranges tile the dim, the tensor is the
//! `concat` of the written values: the same `concat` filled.rs makes of the program
//! before decomposition. Every other use of a tensor with an unwritten part is refused,
//! naming the node that reads it and the empty tensor.

use super::fx::FxNode;
use super::lower::{LErr, Lower, LR, LV};
use super::schema::Arg;
use std::rc::Rc;
use weft_ir::{Dim, Op, TensorType, Value};

/// A tensor allocated empty, with the ranges of one dim written so far.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Unset {
    /// The node that allocated it, and that node's op.
    pub origin: String,
    pub origin_op: String,
    /// Its type (after any slices of it).
    pub ty: TensorType,
    /// The dim the writes are ranges of, once something is written.
    pub dim: Option<usize>,
    /// Written `[start, end)` ranges of `dim`, sorted and disjoint, each with its value.
    pub written: Vec<(i64, i64, Value)>,
}

impl Unset {
    /// The unwritten ranges of the write dim of constant size `size`.
    fn gaps(&self, size: i64) -> Vec<(i64, i64)> {
        let mut gaps = Vec::new();
        let mut at = 0;
        for &(a, b, _) in &self.written {
            if a > at {
                gaps.push((at, a));
            }
            at = b;
        }
        if at < size {
            gaps.push((at, size));
        }
        gaps
    }

    /// What is known of it, for messages.
    fn describe(&self) -> String {
        match (self.dim, self.ty.shape.get(self.dim.unwrap_or(0))) {
            (Some(d), Some(size)) => {
                let gaps: Vec<String> = match size.as_const() {
                    Some(s) => self
                        .gaps(s)
                        .into_iter()
                        .map(|(a, b)| format!("[{a}, {b})"))
                        .collect(),
                    None => vec![format!("part of {size}")],
                };
                format!("{} of dim {d} never written", gaps.join(", "))
            }
            _ => "nothing written".into(),
        }
    }
}

impl Lower<'_> {
    /// The refusal of any use of `u` other than the ones this module follows.
    pub fn unset_read(&self, n: &FxNode, u: &Unset) -> LErr {
        self.unsupported(
            n,
            format!(
                "reads the empty tensor of node `{}` ({}) with {}: its values are undefined (the importer follows an empty tensor only through slice, copy and slice_scatter until every element is written)",
                u.origin,
                u.origin_op,
                u.describe()
            ),
        )
    }

    /// `empty`, `empty_like`, `empty_permuted`: nothing written yet.
    pub fn lower_empty(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let mut ty = self.out_ty(n)?;
        ty.shape = match (n.base() == "empty_like", self.arg_lv(n.arg_at(0))) {
            (true, LV::T(x)) => self.gen_like(&self.ty(x).shape, &ty.shape),
            _ => self.gen_free(&ty.shape),
        };
        Ok(vec![LV::Unset(Rc::new(Unset {
            origin: n.name.clone(),
            origin_op: n.op.clone(),
            ty,
            dim: None,
            written: Vec::new(),
        }))])
    }

    /// `copy(dst, src)`: `src` broadcast to `dst`'s shape and cast to its dtype; `dst`
    /// gives only its type, so it may be unset.
    pub fn lower_copy(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let src = match self.arg_lv(n.arg_at(1)) {
            LV::T(v) => v,
            // Routing tags, an unset tensor, a deferred error: passed on as they are.
            other => return Ok(vec![other]),
        };
        let dst = match self.arg_lv(n.arg_at(0)) {
            LV::T(v) => self.ty(v),
            LV::Unset(u) => u.ty.clone(),
            LV::Err(e) => return Err(e),
            _ => self.out_ty(n)?,
        };
        let st = self.ty(src);
        let same = st.rank() == dst.rank()
            && st
                .shape
                .iter()
                .zip(&dst.shape)
                .all(|(a, b)| self.same_size(a, b));
        let v = if same {
            src
        } else {
            let shape = self.gen_expand(&st.shape, &dst.shape);
            self.emit(n, Op::Expand { shape }, &[src])?
        };
        Ok(vec![LV::T(self.cast(n, v, dst.dtype)?)])
    }

    /// `slice(u, dim, start, end, step)` of an unset tensor.
    pub fn slice_unset(&mut self, n: &FxNode, u: &Unset) -> LR<Vec<LV>> {
        let rank = u.ty.rank();
        let d = self.norm_dim(n, self.int_arg(n, n.arg_at(1))?, rank)?;
        if self.int_arg(n, n.arg_at(4))? != 1 {
            return Err(self.unset_read(n, u));
        }
        let size = u.ty.shape[d].clone();
        let start = match n.arg_at(2) {
            Arg::None => Dim::from(0),
            a => match self.dim_arg(n, a)? {
                s if s.as_const().is_some_and(|c| c < 0) => size.clone() + s,
                s => s,
            },
        };
        let recorded = self.out_ty(n)?.shape[d].clone();
        let len = if self.same_size(&recorded, &size) {
            size.clone()
        } else {
            self.seq_dim(&recorded)
        };
        let mut out = Unset {
            written: Vec::new(),
            ..u.clone()
        };
        out.ty.shape[d] = len.clone();
        if u.dim == Some(d) && !u.written.is_empty() {
            let (Some(s), Some(l)) = (start.as_const(), len.as_const()) else {
                return Err(self.unsupported(
                    n,
                    format!(
                        "a symbolic slice of the written dim {d} of the empty tensor of node `{}`",
                        u.origin
                    ),
                ));
            };
            for &(a, b, v) in &u.written {
                let (lo, hi) = (a.max(s), b.min(s + l));
                if lo < hi {
                    let part = self.slice_of(n, v, d, lo - a, hi - lo)?;
                    out.written.push((lo - s, hi - s, part));
                }
            }
        } else {
            for &(a, b, v) in &u.written {
                // A whole-dim slice (the recorded size, as the slice lowering reads one)
                // keeps the written value and its symbolic size.
                let whole = start.as_const() == Some(0)
                    && self.same_size(&self.ty(v).shape[d], &len)
                    && self.same_size(&size, &len);
                let part = if whole {
                    v
                } else {
                    self.slice_dim(n, v, d, start.clone(), len.clone())?
                };
                out.written.push((a, b, part));
            }
            if let Some(&(_, _, v)) = out.written.first() {
                out.ty.shape[d] = self.ty(v).shape[d].clone();
            }
        }
        if out.written.is_empty() {
            out.dim = None;
        }
        self.settle(n, out)
    }

    /// `slice_scatter(x, src, dim, start, end, step)`.
    pub fn lower_slice_scatter(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let src = self.tensor(n, n.arg_at(1))?;
        // The tensor written into: with values, or unset.
        let base: Result<Value, Rc<Unset>> = match self.arg_lv(n.arg_at(0)) {
            LV::T(x) => Ok(x),
            LV::Unset(u) => Err(u),
            _ => {
                return Err(match self.tensor(n, n.arg_at(0)) {
                    Err(e) => e,
                    Ok(_) => self.bad(n, "slice_scatter into a value that is not a tensor"),
                })
            }
        };
        let xty = match &base {
            Ok(x) => self.ty(*x),
            Err(u) => u.ty.clone(),
        };
        let rank = xty.rank();
        let d = self.norm_dim(n, self.int_arg(n, n.arg_at(2))?, rank)?;
        let step = self.int_arg(n, n.arg_at(5))?;
        if step != 1 {
            return Err(self.unsupported(n, format!("slice_scatter with step {step}")));
        }
        let st = self.ty(src);
        let size = xty.shape[d].clone();
        let start = match n.arg_at(3) {
            Arg::None => Dim::from(0),
            a => match self.dim_arg(n, a)? {
                s if s.as_const().is_some_and(|c| c < 0) => size.clone() + s,
                s => s,
            },
        };
        let len = st.shape.get(d).cloned().unwrap_or_else(|| Dim::from(0));
        let fits = st.rank() == rank
            && (0..rank).all(|k| k == d || self.same_size(&st.shape[k], &xty.shape[k]));
        if !fits {
            return Err(self.bad(
                n,
                format!("the source {st} is no slice of dim {d} of a {xty} tensor"),
            ));
        }
        // With constant bounds, the source must be exactly the range `[start, end)`.
        let end = match n.arg_at(4) {
            Arg::None => size.clone(),
            a => match self.dim_arg(n, a)? {
                e if e.as_const().is_some_and(|c| c < 0) => size.clone() + e,
                e => e,
            },
        };
        if let (Some(s), Some(e), Some(z), Some(l)) = (
            start.as_const(),
            end.as_const(),
            size.as_const(),
            len.as_const(),
        ) {
            if s < 0 || s > z || e.min(z) - s != l {
                return Err(self.bad(
                    n,
                    format!("a source of {l} along dim {d} for the range [{s}, {e}) of {z}"),
                ));
            }
        }
        let src = self.cast(n, src, xty.dtype)?;
        let whole = start.as_const() == Some(0) && self.same_size(&len, &size);
        if whole {
            return Ok(vec![LV::T(src)]);
        }
        match base {
            Ok(x) => {
                let mut parts = Vec::new();
                if start.as_const() != Some(0) {
                    parts.push(self.slice_dim(n, x, d, Dim::from(0), start.clone())?);
                }
                parts.push(src);
                let tail = size.clone() - start.clone() - len.clone();
                if tail.as_const() != Some(0) {
                    parts.push(self.slice_dim(n, x, d, start + len, tail)?);
                }
                Ok(vec![LV::T(self.emit(
                    n,
                    Op::Concat { dim: d as i64 },
                    &parts,
                )?)])
            }
            Err(u) => {
                let (Some(s), Some(l), Some(z)) =
                    (start.as_const(), len.as_const(), size.as_const())
                else {
                    return Err(self.unsupported(
                        n,
                        format!("a write of part of the symbolic dim {d} of the empty tensor of node `{}`", u.origin),
                    ));
                };
                if s < 0 || s + l > z {
                    return Err(
                        self.bad(n, format!("a write of [{s}, {}) into a dim of {z}", s + l))
                    );
                }
                if u.dim.is_some_and(|p| p != d) && !u.written.is_empty() {
                    return Err(self.unsupported(
                        n,
                        format!(
                            "writes dim {d} of the empty tensor of node `{}`, which is written along dim {}",
                            u.origin,
                            u.dim.unwrap_or(d)
                        ),
                    ));
                }
                let mut out = Unset {
                    dim: Some(d),
                    written: Vec::new(),
                    ..(*u).clone()
                };
                // The source's other dims are the tensor's (symbolic where the export
                // recorded the example batch).
                for (k, dim) in st.shape.iter().enumerate() {
                    if k != d {
                        out.ty.shape[k] = dim.clone();
                    }
                }
                for &(a, b, v) in &u.written {
                    if a < s {
                        let hi = b.min(s);
                        out.written
                            .push((a, hi, self.slice_of(n, v, d, 0, hi - a)?));
                    }
                    if b > s + l {
                        let lo = a.max(s + l);
                        out.written
                            .push((lo, b, self.slice_of(n, v, d, lo - a, b - lo)?));
                    }
                }
                out.written.push((s, s + l, src));
                out.written.sort_by_key(|w| w.0);
                self.settle(n, out)
            }
        }
    }

    /// An unset tensor whose written ranges tile its dim is their `concat`.
    fn settle(&mut self, n: &FxNode, u: Unset) -> LR<Vec<LV>> {
        let covered = match u.dim {
            Some(d) => u.ty.shape[d]
                .as_const()
                .is_some_and(|size| u.gaps(size).is_empty()),
            None => false,
        };
        if !covered {
            return Ok(vec![LV::Unset(Rc::new(u))]);
        }
        let values: Vec<Value> = u.written.iter().map(|w| w.2).collect();
        let v = match values[..] {
            [one] => one,
            _ => self.emit(
                n,
                Op::Concat {
                    dim: u.dim.unwrap_or(0) as i64,
                },
                &values,
            )?,
        };
        Ok(vec![LV::T(v)])
    }

    /// `x[.., start : start + len, ..]` on dim `d` (constants).
    fn slice_of(&mut self, n: &FxNode, x: Value, d: usize, start: i64, len: i64) -> LR<Value> {
        self.slice_dim(n, x, d, Dim::from(start), Dim::from(len))
    }

    fn slice_dim(&mut self, n: &FxNode, x: Value, d: usize, start: Dim, len: Dim) -> LR<Value> {
        if start.as_const() == Some(0) && self.ty(x).shape[d] == len {
            return Ok(x);
        }
        self.emit(
            n,
            Op::Slice {
                dim: d as i64,
                start,
                len,
            },
            &[x],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::fx::{FxGraph, FxNode};
    use super::super::lower::{Lower, LV};
    use super::super::schema::{Arg, SymInt, TensorMeta};
    use weft_ir::{DType, Dim, Op, TensorType, Value};

    const END: i64 = i64::MAX;

    fn t(s: &str) -> Arg {
        Arg::Tensor(s.into())
    }

    fn node(op: &str, out: &str, args: Vec<Arg>) -> FxNode {
        FxNode::for_test(op, out, args)
    }

    fn slice(out: &str, x: &str, start: i64, end: i64) -> FxNode {
        let ints = [1, start, end, 1].map(Arg::Int);
        node(
            "aten.slice.Tensor",
            out,
            [t(x)].into_iter().chain(ints).collect(),
        )
    }

    fn scatter(out: &str, x: &str, src: &str, start: i64, end: i64, step: i64) -> FxNode {
        let ints = [1, start, end, step].map(Arg::Int);
        let args = [t(x), t(src)].into_iter().chain(ints).collect();
        node("aten.slice_scatter.default", out, args)
    }

    fn copy(out: &str, dst: &str, src: &str) -> FxNode {
        node("aten.copy.default", out, vec![t(dst), t(src)])
    }

    /// `x[:, start:end] = src` as core ATen writes it, into `x`, giving `out`.
    fn write(x: &str, src: &str, start: i64, end: i64, out: &str) -> Vec<FxNode> {
        let (s, c) = (format!("{out}_s"), format!("{out}_c"));
        vec![
            slice(&s, x, start, end),
            copy(&c, &s, src),
            scatter(out, x, &c, start, end, 1),
        ]
    }

    /// Runs `nodes` over f32 `[batch, cols]` inputs (name, cols); every value's recorded
    /// type is `[2, cols]` (2 is the example batch). Returns each named value's lowering.
    fn lower(
        batch: Dim,
        inputs: &[(&str, i64)],
        nodes: Vec<FxNode>,
        cols: &[(&str, i64)],
    ) -> (weft_ir::Graph, Vec<(String, LV)>) {
        let mut fx = FxGraph {
            nodes,
            ..Default::default()
        };
        for (name, c) in inputs.iter().chain(cols) {
            fx.tensor_meta.insert(
                name.to_string(),
                TensorMeta {
                    dtype: 7,
                    sizes: vec![SymInt::Int(2), SymInt::Int(*c)],
                    strides: vec![SymInt::Int(*c), SymInt::Int(1)],
                    storage_offset: SymInt::Int(0),
                    requires_grad: false,
                },
            );
        }
        let mut l = Lower::for_tests(&fx, 2, 16, false);
        for (name, c) in inputs {
            l.test_input(
                name,
                TensorType::new(DType::F32, vec![batch.clone(), Dim::from(*c)]),
            );
        }
        l.run();
        let out = cols.iter().map(|(n, _)| (n.to_string(), l.lv(n))).collect();
        (std::mem::take(&mut l.g), out)
    }

    fn input(g: &weft_ir::Graph, name: &str) -> Value {
        g.inputs()
            .into_iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, v)| v)
            .unwrap()
    }

    /// `v`'s op and operands.
    fn def(g: &weft_ir::Graph, v: Value) -> (Op, Vec<Value>) {
        let n = g.node(g.def(v));
        (n.op.clone(), n.operands.clone())
    }

    fn empty() -> FxNode {
        node(
            "aten.empty.memory_format",
            "e",
            vec![Arg::Ints(vec![2, 12])],
        )
    }

    #[test]
    fn writes_tiling_an_empty_tensor_are_its_concat() {
        let mut nodes = vec![empty()];
        nodes.extend(write("e", "a", 0, 8, "w0"));
        nodes.extend(write("w0", "b", 8, END, "w1"));
        nodes.push(node("aten.relu.default", "r", vec![t("w1")]));
        let cols = [
            ("e", 12),
            ("w0_s", 8),
            ("w0_c", 8),
            ("w0", 12),
            ("w1_s", 4),
            ("w1_c", 4),
            ("w1", 12),
            ("r", 12),
        ];
        let (g, out) = lower(Dim::from(2), &[("a", 8), ("b", 4)], nodes, &cols);
        assert!(matches!(out[0].1, LV::Unset(_)), "{:?}", out[0]);
        let LV::T(w1) = out[6].1 else {
            panic!("{:?}", out[6]);
        };
        assert_eq!(
            def(&g, w1),
            (Op::Concat { dim: 1 }, vec![input(&g, "a"), input(&g, "b")])
        );
        assert!(matches!(out[7].1, LV::T(_)));
    }

    #[test]
    fn a_later_write_replaces_the_part_it_overlaps() {
        let mut nodes = vec![empty()];
        nodes.extend(write("e", "a", 0, 8, "w0"));
        nodes.extend(write("w0", "b", 6, END, "w1"));
        let cols = [
            ("e", 12),
            ("w0_s", 8),
            ("w0_c", 8),
            ("w0", 12),
            ("w1_s", 6),
            ("w1_c", 6),
            ("w1", 12),
        ];
        let (g, out) = lower(Dim::from(2), &[("a", 8), ("b", 6)], nodes, &cols);
        let LV::T(w1) = out[6].1 else {
            panic!("{:?}", out[6]);
        };
        let (op, parts) = def(&g, w1);
        assert_eq!(op, Op::Concat { dim: 1 });
        assert_eq!(parts[1], input(&g, "b"));
        assert_eq!(
            def(&g, parts[0]),
            (
                Op::Slice {
                    dim: 1,
                    start: Dim::from(0),
                    len: Dim::from(6)
                },
                vec![input(&g, "a")]
            )
        );
    }

    #[test]
    fn reading_an_unwritten_column_is_refused_naming_the_empty_tensor() {
        // Columns [0, 8) and [9, 12) written: column 8 never is.
        let mut nodes = vec![empty()];
        nodes.extend(write("e", "a", 0, 8, "w0"));
        nodes.extend(write("w0", "b", 9, END, "w1"));
        nodes.push(node("aten.relu.default", "r", vec![t("w1")]));
        let cols = [
            ("e", 12),
            ("w0_s", 8),
            ("w0_c", 8),
            ("w0", 12),
            ("w1_s", 3),
            ("w1_c", 3),
            ("w1", 12),
            ("r", 12),
        ];
        let (_, out) = lower(Dim::from(2), &[("a", 8), ("b", 3)], nodes, &cols);
        assert!(matches!(out[6].1, LV::Unset(_)), "{:?}", out[6]);
        let LV::Err(e) = &out[7].1 else {
            panic!("{:?}", out[7]);
        };
        let e = e.to_string();
        assert!(
            e.contains("node `r`")
                && e.contains("node `e` (aten.empty.memory_format)")
                && e.contains("[8, 9) of dim 1 never written"),
            "{e}"
        );
    }

    #[test]
    fn a_slice_of_the_written_part_reads_only_it() {
        // The first 8 columns are written; reading them needs nothing else.
        let mut nodes = vec![empty()];
        nodes.extend(write("e", "a", 0, 8, "w0"));
        nodes.push(slice("head", "w0", 2, 6));
        nodes.push(slice("tail", "w0", 6, END));
        nodes.push(node("aten.relu.default", "r", vec![t("tail")]));
        let cols = [
            ("e", 12),
            ("w0_s", 8),
            ("w0_c", 8),
            ("w0", 12),
            ("head", 4),
            ("tail", 6),
            ("r", 6),
        ];
        let (g, out) = lower(Dim::from(2), &[("a", 8)], nodes, &cols);
        let LV::T(head) = out[4].1 else {
            panic!("{:?}", out[4]);
        };
        assert_eq!(
            def(&g, head),
            (
                Op::Slice {
                    dim: 1,
                    start: Dim::from(2),
                    len: Dim::from(4)
                },
                vec![input(&g, "a")]
            )
        );
        assert!(matches!(out[5].1, LV::Unset(_)));
        let LV::Err(e) = &out[6].1 else {
            panic!("{:?}", out[6]);
        };
        assert!(
            e.to_string().contains("[2, 6) of dim 1 never written"),
            "{e}"
        );
    }

    #[test]
    fn a_write_into_values_is_a_concat_around_the_source() {
        let nodes = vec![
            scatter("mid", "x", "b", 3, 7, 1),
            scatter("head", "x", "b", -12, 4, 1),
            scatter("strided", "x", "b", 0, END, 3),
        ];
        let cols = [("mid", 12), ("head", 12), ("strided", 12)];
        let (g, out) = lower(Dim::from(2), &[("x", 12), ("b", 4)], nodes, &cols);
        let (x, b) = (input(&g, "x"), input(&g, "b"));
        let slice = |start: i64, len: i64| Op::Slice {
            dim: 1,
            start: Dim::from(start),
            len: Dim::from(len),
        };
        let LV::T(mid) = out[0].1 else {
            panic!("{:?}", out[0]);
        };
        let (op, parts) = def(&g, mid);
        assert_eq!(op, Op::Concat { dim: 1 });
        assert_eq!(parts[1], b);
        assert_eq!(def(&g, parts[0]), (slice(0, 3), vec![x]));
        assert_eq!(def(&g, parts[2]), (slice(7, 5), vec![x]));
        let LV::T(head) = out[1].1 else {
            panic!("{:?}", out[1]);
        };
        let (_, parts) = def(&g, head);
        assert_eq!(parts[0], b);
        assert_eq!(def(&g, parts[1]), (slice(4, 8), vec![x]));
        let LV::Err(e) = &out[2].1 else {
            panic!("{:?}", out[2]);
        };
        assert!(e.to_string().contains("slice_scatter with step 3"), "{e}");
    }

    #[test]
    fn a_source_that_is_not_the_range_is_refused() {
        // [3, 9) is 6 columns; the source has 4.
        let nodes = vec![scatter("w", "x", "b", 3, 9, 1)];
        let (_, out) = lower(Dim::from(2), &[("x", 12), ("b", 4)], nodes, &[("w", 12)]);
        let LV::Err(e) = &out[0].1 else {
            panic!("{:?}", out[0]);
        };
        assert!(e.to_string().contains("for the range [3, 9) of 12"), "{e}");
    }

    #[test]
    fn written_values_keep_their_symbolic_batch() {
        // The export fixed the batch at 2 in `empty`'s size; the written values are [B, ..].
        let mut nodes = vec![empty()];
        nodes.extend(write("e", "a", 0, 8, "w0"));
        nodes.push(node(
            "aten.slice.Tensor",
            "rows",
            vec![
                t("w0"),
                Arg::Int(0),
                Arg::Int(0),
                Arg::Int(END),
                Arg::Int(1),
            ],
        ));
        nodes.extend(write("rows", "b", 8, END, "w1"));
        let cols = [
            ("e", 12),
            ("w0_s", 8),
            ("w0_c", 8),
            ("w0", 12),
            ("rows", 12),
            ("w1_s", 4),
            ("w1_c", 4),
            ("w1", 12),
        ];
        let (g, out) = lower(Dim::sym("B"), &[("a", 8), ("b", 4)], nodes, &cols);
        let LV::T(w1) = out[7].1 else {
            panic!("{:?}", out[7]);
        };
        assert_eq!(
            def(&g, w1),
            (Op::Concat { dim: 1 }, vec![input(&g, "a"), input(&g, "b")])
        );
        assert_eq!(g.ty(w1).to_string(), "f32[B, 12]");
    }
}

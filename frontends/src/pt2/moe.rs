//! Mixture-of-experts blocks as transformers 5 exports them, to Weft's `moe_dispatch`
//! → `grouped_matmul` → `moe_combine`.
//!
//! Two expert implementations are recognised:
//! - `batched_mm`: `repeat_interleave(x, k)` pair rows in HF order (`t*k + slot`), per
//!   row `bmm(W[clamp(ids)], row)` (or `bmm(row, W[clamp(ids)])`, gpt-oss's [E, K, N]),
//!   weighted by the flat routing weights, summed as `view(T, k, H).sum(1)`; a clamp
//!   that could move an id (bounds inside `[0, E-1]`) keeps the block unrecognised;
//! - the default `grouped_mm` (on CPU/f32 the custom op `transformers::grouped_mm_fallback`):
//!   `sort` of the flat expert ids, rows `x[perm // k]` in sorted order, `histc` →
//!   `cumsum` offsets, grouped matmuls, the EP-sentinel `masked_fill`s (never true: top-k
//!   ids are below E), weights `w.flatten()[perm]`, un-permuted with `index_put` of the
//!   inverse permutation, summed as above.
//!
//! A plan found before lowering ([`plan`]) names each block's anchors (the expert
//! matmuls) and its entry (where the token rows are replicated). During lowering the
//! pair rows are carried as [`Rows`] in dispatch order; row-wise ops (activations,
//! `chunk`, strided `slice`s, `clamp`s, products) follow them; a per-expert bias added
//! to an expert matmul's rows (`add(rows, bias[ids])`, gpt-oss) becomes the grouped
//! matmul's bias operand; the final `sum` becomes `moe_combine` with the
//! routing weights folded in. Anything else that touches the rows stops the import with
//! an error naming the node, rather than computing something different.

use super::fx::{FxGraph, FxNode};
use super::lower::{LErr, Lower, Operand, Rows, LR, LV};
use super::schema::Arg;
use std::collections::{BTreeMap, BTreeSet};
use weft_ir::{DType, Dim, Op, TensorType, Value};

#[derive(Clone, Debug)]
pub(crate) struct MoeInfo {
    pub x: String,
    pub idx: String,
    pub k: i64,
    pub experts: i64,
    pub grouped: bool,
    pub matmuls: usize,
}

#[derive(Clone, Debug)]
pub(crate) struct Anchor {
    pub m: usize,
    pub x: String,
    pub w: String,
    pub layout: Layout,
}

/// How an expert weight multiplies the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `w` is [E, N, K] (a linear's layout): `grouped_matmul(rows, w, counts)`.
    Enk,
    /// `w` is [E, K, N] (gpt-oss's experts): `grouped_matmul` with `transpose_w`, as the
    /// config path builds it.
    Ekn,
    /// `w` is [E, K, N], transposed to [E, N, K] first (the grouped_mm fallback's form).
    EknTransposed,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct MoePlan {
    pub moes: Vec<MoeInfo>,
    /// Anchor output name → anchor.
    pub anchors: BTreeMap<String, Anchor>,
    /// Entry output name → block.
    pub entries: BTreeMap<String, usize>,
    /// Sort node name → block.
    pub sorts: BTreeMap<String, usize>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct MoeState {
    /// `(rows, counts, order)` of the block's `moe_dispatch`.
    pub dispatch: Option<(Value, Value, Value)>,
    /// `(rows, step)` → the rows' columns split by residue mod `step` (one split for
    /// every strided slice of the same rows: gpt-oss's interleaved gate and up).
    pub strided: BTreeMap<(Value, i64), Vec<Value>>,
}

fn prod<'f>(fx: &'f FxGraph, name: &str) -> Option<&'f FxNode> {
    fx.node_of(name)
}

fn targ(n: &FxNode, i: usize) -> Option<&str> {
    match n.arg_at(i) {
        Arg::Tensor(t) => Some(t.as_str()),
        _ => None,
    }
}

const NOOPS: &[&str] = &["to", "_to_copy", "clone", "alias", "contiguous", "detach"];

fn skip_noops<'f>(fx: &'f FxGraph, mut name: &'f str) -> &'f str {
    for _ in 0..16 {
        match prod(fx, name) {
            Some(n) if NOOPS.contains(&n.base()) => match targ(n, 0) {
                Some(t) => name = t,
                None => break,
            },
            _ => break,
        }
    }
    name
}

fn rank(fx: &FxGraph, name: &str) -> usize {
    fx.tensor_meta.get(name).map(|m| m.sizes.len()).unwrap_or(0)
}

fn const_size(fx: &FxGraph, name: &str, d: usize) -> Option<i64> {
    match fx.tensor_meta.get(name)?.sizes.get(d)? {
        super::schema::SymInt::Int(i) => Some(*i),
        _ => None,
    }
}

/// `idx` [T, k] from `clamp(reshape(idx, [-1]))` or `reshape(idx, [-1])`.
fn flat_idx(fx: &FxGraph, ids: &str) -> Option<String> {
    let mut name = skip_noops(fx, ids);
    if let Some(n) = prod(fx, name) {
        if n.base().starts_with("clamp") {
            name = skip_noops(fx, targ(n, 0)?);
        }
    }
    let n = prod(fx, name)?;
    if !matches!(n.base(), "reshape" | "view" | "_unsafe_view" | "flatten") {
        return None;
    }
    let idx = targ(n, 0)?;
    (rank(fx, idx) == 2).then(|| idx.to_string())
}

/// True unless `ids` is a `clamp` that can move a top-k expert id in `[0, experts)`
/// (transformers clamps to `[0, experts - 1]`, which changes nothing).
fn clamp_keeps_ids(fx: &FxGraph, ids: &str, experts: i64) -> bool {
    let Some(n) = prod(fx, skip_noops(fx, ids)) else {
        return true;
    };
    let bound = |i: usize| match n.arg_at(i) {
        Arg::None => None,
        a => Some(match a {
            Arg::Int(v) => *v as f64,
            Arg::Float(v) => *v,
            _ => f64::NAN,
        }),
    };
    let (lo, hi) = match n.base() {
        "clamp" => (bound(1), bound(2)),
        "clamp_min" => (bound(1), None),
        "clamp_max" => (None, bound(1)),
        _ => return true,
    };
    lo.is_none_or(|l| l <= 0.0) && hi.is_none_or(|h| h >= (experts - 1) as f64)
}

/// `histc(ids, bins, min, max)` counts each of `experts` ids in a bin of its own.
fn one_bin_per_expert(histc: &FxNode, experts: Option<i64>) -> bool {
    let num = |a: &Arg| match a {
        Arg::Int(v) => Some(*v as f64),
        Arg::Float(v) => Some(*v),
        _ => None,
    };
    let Some(e) = experts else { return false };
    (
        num(histc.arg("bins")),
        num(histc.arg("min")),
        num(histc.arg("max")),
    ) == (Some(e as f64), Some(0.0), Some((e - 1) as f64))
}

fn int_of(a: &Arg) -> Option<i64> {
    match a {
        Arg::Int(i) => Some(*i),
        Arg::Ints(v) if v.len() == 1 => Some(v[0]),
        _ => None,
    }
}

/// Finds every MoE block of the graph.
pub(crate) fn plan(fx: &FxGraph) -> MoePlan {
    let mut p = MoePlan::default();
    // (anchor output, idx, x, w, layout, grouped, sort node)
    let mut found: Vec<(String, String, String, String, Layout, bool, Option<String>)> = Vec::new();
    for n in &fx.nodes {
        let Some(out) = n.out() else { continue };
        match n.op.as_str() {
            "aten.squeeze.dim" | "aten.squeeze.dims" => {
                let Some(b) = targ(n, 0).and_then(|t| prod(fx, t)) else {
                    continue;
                };
                if b.op != "aten.bmm.default" {
                    continue;
                }
                let (Some(first), Some(second)) = (
                    targ(b, 0).and_then(|t| prod(fx, t)),
                    targ(b, 1).and_then(|t| prod(fx, t)),
                ) else {
                    continue;
                };
                // `bmm(W[ids], x.unsqueeze(-1))` with W [E, N, K] (Mixtral, Qwen3-MoE)
                // or `bmm(x.unsqueeze(1), W[ids])` with W [E, K, N] (gpt-oss).
                let (a, u, kn) = match (first.op.as_str(), second.op.as_str()) {
                    ("aten.index.Tensor", "aten.unsqueeze.default") => (first, second, false),
                    ("aten.unsqueeze.default", "aten.index.Tensor") => (second, first, true),
                    _ => continue,
                };
                let ids = match a.arg_at(1) {
                    Arg::OptionalTensors(v) if v.len() == 1 => v[0].clone(),
                    Arg::Tensors(v) if v.len() == 1 => Some(v[0].clone()),
                    _ => None,
                };
                let (Some(ids), Some(w), Some(x)) = (ids, targ(a, 0), targ(u, 0)) else {
                    continue;
                };
                if rank(fx, w) != 3 {
                    continue;
                }
                let unsqueezed_at = int_of(u.arg_at(1));
                let row_vector = matches!(unsqueezed_at, Some(1 | -2));
                let column_vector = matches!(unsqueezed_at, Some(2 | -1));
                if (kn && !row_vector) || (!kn && !column_vector) {
                    continue;
                }
                let keeps = const_size(fx, w, 0).is_some_and(|e| clamp_keeps_ids(fx, &ids, e));
                if let (Some(idx), true) = (flat_idx(fx, &ids), keeps) {
                    found.push((
                        out.to_string(),
                        idx,
                        x.to_string(),
                        w.to_string(),
                        if kn { Layout::Ekn } else { Layout::Enk },
                        false,
                        None,
                    ));
                }
            }
            "transformers.grouped_mm_fallback.default" => {
                let (Some(x), Some(wt), Some(offs)) = (targ(n, 0), targ(n, 1), targ(n, 2)) else {
                    continue;
                };
                // offs = cumsum(histc(sorted_ids))
                let Some(c) = prod(fx, skip_noops(fx, offs)) else {
                    continue;
                };
                if c.base() != "cumsum" {
                    continue;
                }
                let Some(h) = targ(c, 0).and_then(|t| prod(fx, skip_noops(fx, t))) else {
                    continue;
                };
                if h.base() != "histc" {
                    continue;
                }
                let Some(sorted) = targ(h, 0).map(|t| skip_noops(fx, t)) else {
                    continue;
                };
                let Some(s) = prod(fx, sorted) else { continue };
                // Expert ids sorted ascending (the offsets count up from expert 0).
                if s.base() != "sort"
                    || s.outputs.first().and_then(|o| o.as_deref()) != Some(sorted)
                    || matches!(s.arg("descending"), Arg::Bool(true))
                {
                    continue;
                }
                let Some(flat) = targ(s, 0) else { continue };
                let Some(idx) = flat_idx(fx, flat) else {
                    continue;
                };
                let (w, layout) = match prod(fx, wt) {
                    Some(t)
                        if t.base() == "transpose"
                            && matches!(
                                (int_of(t.arg_at(1)), int_of(t.arg_at(2))),
                                (Some(-2 | 1), Some(-1 | 2)) | (Some(-1 | 2), Some(-2 | 1))
                            ) =>
                    {
                        (targ(t, 0).unwrap_or(wt).to_string(), Layout::Enk)
                    }
                    Some(t)
                        if t.base() == "permute"
                            && matches!(t.arg_at(1), Arg::Ints(v) if v == &[0, 2, 1]) =>
                    {
                        (targ(t, 0).unwrap_or(wt).to_string(), Layout::Enk)
                    }
                    _ => (wt.to_string(), Layout::EknTransposed),
                };
                // The offsets count the rows of each expert only with one histc bin
                // per expert id: bins = E over [0, E-1] (min = max = 0 would take the
                // data's own range). Otherwise the block is not this one.
                if !one_bin_per_expert(h, const_size(fx, &w, 0)) {
                    continue;
                }
                found.push((
                    out.to_string(),
                    idx,
                    x.to_string(),
                    w,
                    layout,
                    true,
                    Some(s.name.clone()),
                ));
            }
            _ => {}
        }
    }
    for (out, idx, x, w, layout, grouped, sort) in found {
        let m = match p.moes.iter().position(|b| b.idx == idx) {
            Some(m) => m,
            None => {
                let Some(k) = const_size(fx, &idx, 1) else {
                    continue;
                };
                let Some(e) = const_size(fx, &w, 0) else {
                    continue;
                };
                p.moes.push(MoeInfo {
                    x: String::new(),
                    idx: idx.clone(),
                    k,
                    experts: e,
                    grouped,
                    matmuls: 0,
                });
                p.moes.len() - 1
            }
        };
        if let Some(s) = sort {
            p.sorts.insert(s, m);
        }
        p.moes[m].matmuls += 1;
        p.anchors.insert(out, Anchor { m, x, w, layout });
    }
    // Entries: walk back from each anchor's input through row-wise ops.
    let anchors: BTreeSet<String> = p.anchors.keys().cloned().collect();
    let mut entries = Vec::new();
    for a in p.anchors.values() {
        let info = &p.moes[a.m];
        if let Some((e, x)) = find_entry(fx, &a.x, info, &anchors, 0) {
            entries.push((e, x, a.m));
        }
    }
    for (e, x, m) in entries {
        p.moes[m].x = x;
        p.entries.insert(e, m);
    }
    // Blocks without an entry are left to the generic lowering.
    let bad: BTreeSet<usize> = (0..p.moes.len())
        .filter(|&m| p.moes[m].x.is_empty())
        .collect();
    p.anchors.retain(|_, a| !bad.contains(&a.m));
    p.sorts.retain(|_, m| !bad.contains(m));
    p
}

/// The entry node (rows of the token tensor replicated per slot) feeding `name`.
fn find_entry(
    fx: &FxGraph,
    name: &str,
    info: &MoeInfo,
    anchors: &BTreeSet<String>,
    depth: usize,
) -> Option<(String, String)> {
    if depth > 40 || anchors.contains(name) {
        return None;
    }
    let n = prod(fx, name)?;
    if let Some(x) = entry_x(fx, n, info) {
        return Some((name.to_string(), x));
    }
    for t in n.tensor_args() {
        // Only follow row tensors (same leading size), not masks or weights.
        if fx.tensor_meta.get(t).map(|m| m.sizes.first())
            == fx.tensor_meta.get(name).map(|m| m.sizes.first())
        {
            if let Some(r) = find_entry(fx, t, info, anchors, depth + 1) {
                return Some(r);
            }
        }
    }
    None
}

fn entry_x(fx: &FxGraph, n: &FxNode, info: &MoeInfo) -> Option<String> {
    let k = info.k;
    match n.base() {
        "repeat_interleave" if !info.grouped => (int_of(n.arg_at(1)) == Some(k)
            && int_of(n.arg_at(2)) == Some(0))
        .then(|| targ(n, 0).map(str::to_string))
        .flatten(),
        "view" | "reshape" | "_unsafe_view" if !info.grouped => {
            // view(clone(expand(unsqueeze(x, 1), [T, k, H])), [T*k, H])
            let e = prod(fx, skip_noops(fx, targ(n, 0)?))?;
            if e.base() != "expand"
                || rank(fx, e.out()?) != 3
                || const_size(fx, e.out()?, 1) != Some(k)
            {
                return None;
            }
            let u = prod(fx, targ(e, 0)?)?;
            (u.base() == "unsqueeze" && int_of(u.arg_at(1)) == Some(1))
                .then(|| targ(u, 0).map(str::to_string))
                .flatten()
        }
        "index" if info.grouped => {
            let i = match n.arg_at(1) {
                Arg::OptionalTensors(v) if v.len() == 1 => v[0].clone()?,
                Arg::Tensors(v) if v.len() == 1 => v[0].clone(),
                _ => return None,
            };
            let d = prod(fx, &i)?;
            let floor = d.base() == "floor_divide"
                || (d.op == "aten.div.Tensor_mode"
                    && matches!(d.arg("rounding_mode"), Arg::Str(s) if s == "floor"));
            if !floor || int_of(d.arg_at(1)) != Some(k) {
                return None;
            }
            let perm = targ(d, 0)?;
            let s = prod(fx, perm)?;
            (s.base() == "sort"
                && s.outputs.get(1).and_then(|o| o.as_deref()) == Some(perm)
                && !matches!(s.arg("descending"), Arg::Bool(true)))
            .then(|| targ(n, 0).map(str::to_string))
            .flatten()
        }
        _ => None,
    }
}

impl Lower<'_> {
    fn dispatch(&mut self, n: &FxNode, m: usize) -> LR<(Value, Value, Value)> {
        if let Some(d) = self.moe_state[m].dispatch {
            return Ok(d);
        }
        let info = self.moe.moes[m].clone();
        let x = self.tensor(n, &Arg::Tensor(info.x.clone()))?;
        let idx = self.tensor(n, &Arg::Tensor(info.idx.clone()))?;
        let r = self.emit_multi(
            n,
            Op::MoeDispatch {
                num_experts: info.experts,
            },
            &[x, idx],
        )?;
        let d = (r[0], r[1], r[2]);
        self.moe_state[m].dispatch = Some(d);
        Ok(d)
    }

    /// `rows * weights` materialised (weights of pair `order[r]` on row `r`).
    fn apply_scale(&mut self, n: &FxNode, r: Rows) -> LR<Value> {
        let Some(w) = r.scale else { return Ok(r.v) };
        let (_, _, order) = self.dispatch(n, r.m)?;
        let wt = self.ty(w);
        let flat = self.reshape(n, w, vec![wt.numel(), Dim::from(1)])?;
        let dt = self.ty(r.v).dtype;
        let flat = self.cast(n, flat, dt)?;
        let sorted = self.emit(n, Op::IndexSelect { dim: 0 }, &[flat, order])?;
        self.emit(n, Op::Mul {}, &[r.v, sorted])
    }

    fn rows_err(&self, n: &FxNode, what: &str) -> LErr {
        self.unsupported(n, format!("MoE rows reach {what}; only activations, chunk/split, products with the routing weights and the final view+sum are followed"))
    }

    /// `w` [T, k] if `v` is `reshape(w, [T*k(, 1)])` of a [T, k] tensor.
    fn pair_weights(&self, v: Value, k: i64) -> Option<Value> {
        let mut cur = v;
        for _ in 0..4 {
            let t = self.g.ty(cur);
            if t.rank() == 2 && t.shape[1] == Dim::from(k) && self.g.ty(v).numel() == t.numel() {
                return Some(cur);
            }
            let d = self.g.node(self.g.def(cur));
            match d.op {
                Op::Reshape { .. } | Op::Cast { .. } => cur = d.operands[0],
                _ => return None,
            }
        }
        None
    }

    /// Handles the nodes of recognised MoE blocks; `None` for every other node.
    pub(crate) fn lower_moe(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        if self.moe.moes.is_empty() {
            return None;
        }
        let out = n.out().unwrap_or("").to_string();
        if let Some(&m) = self.moe.entries.get(&out) {
            return Some(self.dispatch(n, m).map(|(rows, _, _)| {
                vec![LV::Rows(Rows {
                    m,
                    v: rows,
                    hf: !self.moe.moes[m].grouped,
                    scale: None,
                })]
            }));
        }
        if let Some(a) = self.moe.anchors.get(&out).cloned() {
            return Some(self.lower_anchor(n, &a));
        }
        if let Some(&m) = self.moe.sorts.get(&n.name) {
            return Some(Ok(vec![LV::SortedIds(m), LV::Perm(m)]));
        }
        let args: Vec<LV> = n.args.iter().map(|(_, a)| self.arg_lv(a)).collect();
        let index_args: Vec<LV> = match n.arg("indices") {
            Arg::OptionalTensors(v) => v
                .iter()
                .map(|t| t.as_ref().map(|t| self.lv(t)).unwrap_or(LV::None))
                .collect(),
            Arg::Tensors(v) => v.iter().map(|t| self.lv(t)).collect(),
            _ => vec![],
        };
        let tagged = |lv: &LV| {
            !matches!(
                lv,
                LV::T(_) | LV::Sym(_) | LV::Num(..) | LV::None | LV::Err(_) | LV::Unset(_)
            )
        };
        if !args.iter().chain(index_args.iter()).any(tagged) {
            return None;
        }
        Some(self.lower_tagged(n, args, index_args))
    }

    fn lower_anchor(&mut self, n: &FxNode, a: &Anchor) -> LR<Vec<LV>> {
        let x = match self.lv(&a.x) {
            LV::Rows(r) if r.m == a.m => r,
            LV::Err(e) => return Err(e),
            other => {
                return Err(self.bad(
                    n,
                    format!("the expert matmul's input is not the block's rows ({other:?})"),
                ))
            }
        };
        let xv = self.apply_scale(n, x)?;
        let w = self.tensor(n, &Arg::Tensor(a.w.clone()))?;
        let w = match a.layout {
            Layout::EknTransposed => self.emit(n, Op::Transpose { dim0: 1, dim1: 2 }, &[w])?,
            Layout::Enk | Layout::Ekn => w,
        };
        let (_, counts, _) = self.dispatch(n, a.m)?;
        let dt = self.ty(w).dtype;
        let xv = self.cast(n, xv, dt)?;
        let y = self.emit(
            n,
            Op::GroupedMatmul {
                transpose_w: (a.layout == Layout::Ekn).into(),
            },
            &[xv, w, counts],
        )?;
        Ok(vec![LV::Rows(Rows {
            m: a.m,
            v: y,
            hf: x.hf,
            scale: None,
        })])
    }

    fn lower_tagged(&mut self, n: &FxNode, args: Vec<LV>, index_args: Vec<LV>) -> LR<Vec<LV>> {
        let base = n.base().to_string();
        let a0 = args.first().cloned().unwrap_or(LV::None);
        // Propagate deferred errors first.
        for lv in args.iter().chain(&index_args) {
            if let LV::Err(e) = lv {
                return Err(e.clone());
            }
        }
        let info_k = |m: usize| self.moe.moes[m].k;
        match (&a0, base.as_str()) {
            // ---- routing bookkeeping
            (
                LV::SortedIds(m),
                "to" | "_to_copy" | "clamp" | "clamp_min" | "clamp_max" | "clone",
            ) => Ok(vec![LV::SortedIds(*m)]),
            (LV::SortedIds(m), "ge") => {
                let e = match args.get(1) {
                    Some(LV::Num(v, _)) => *v as i64,
                    _ => {
                        return Err(
                            self.unsupported(n, "comparison of sorted expert ids with a tensor")
                        )
                    }
                };
                if e >= self.moe.moes[*m].experts {
                    Ok(vec![LV::False])
                } else {
                    Err(self.unsupported(n, "an expert-id test that can be true"))
                }
            }
            (LV::SortedIds(_), "histc") => Ok(vec![LV::Counts]),
            (LV::Counts, "cumsum" | "to" | "_to_copy") => Ok(vec![LV::Offs]),
            (LV::Perm(m), "floor_divide" | "div") => {
                let k = info_k(*m);
                match args.get(1) {
                    Some(LV::Num(v, _)) if *v as i64 == k => Ok(vec![LV::PermTok]),
                    _ => Err(self.unsupported(
                        n,
                        "a division of the expert permutation other than by top-k",
                    )),
                }
            }
            (LV::Perm(_), "empty_like") => Ok(vec![LV::None]),
            (_, "index_put") => match index_args.as_slice() {
                [LV::Perm(m)] => Ok(vec![LV::InvPerm(*m)]),
                _ => Err(self.unsupported(
                    n,
                    "index_put other than the inverse of the expert permutation",
                )),
            },
            (
                LV::False,
                "unsqueeze" | "expand" | "to" | "_to_copy" | "view" | "reshape" | "clone",
            ) => Ok(vec![LV::False]),
            (_, "masked_fill") if matches!(args.get(1), Some(LV::False)) => Ok(vec![a0.clone()]),
            (_, "where") if matches!(a0, LV::False) => {
                Ok(vec![args.get(2).cloned().unwrap_or(LV::None)])
            }
            (LV::T(x), "index") => match index_args.as_slice() {
                [LV::Perm(m)] => {
                    let m = *m;
                    let k = info_k(m);
                    let xt = self.ty(*x);
                    let t = xt.numel() / Dim::from(k);
                    let w = self.reshape(n, *x, vec![t, Dim::from(k)])?;
                    Ok(vec![LV::PairW { m, w }])
                }
                _ => Err(self.unsupported(n, "indexing by an expert permutation")),
            },
            (
                LV::PairW { m, w },
                "unsqueeze" | "view" | "reshape" | "to" | "_to_copy" | "clone",
            ) => Ok(vec![LV::PairW { m: *m, w: *w }]),
            (LV::Rows(r), "index") => match index_args.as_slice() {
                [LV::InvPerm(m)] if *m == r.m && !r.hf => {
                    Ok(vec![LV::Rows(Rows { hf: true, ..*r })])
                }
                _ => Err(self.rows_err(n, "an index")),
            },
            // ---- row-wise compute
            (
                LV::Rows(r),
                "neg" | "exp" | "sigmoid" | "silu" | "relu" | "gelu" | "tanh" | "to" | "_to_copy"
                | "clone" | "alias" | "contiguous",
            ) => {
                let r = *r;
                if matches!(
                    base.as_str(),
                    "to" | "_to_copy" | "clone" | "alias" | "contiguous"
                ) {
                    let ty = self.out_ty(n)?;
                    let v = self.cast(n, r.v, ty.dtype)?;
                    return Ok(vec![LV::Rows(Rows { v, ..r })]);
                }
                let v = self.apply_scale(n, r)?;
                let op = match base.as_str() {
                    "neg" => Op::Neg {},
                    "exp" => Op::Exp {},
                    "sigmoid" => Op::Sigmoid {},
                    "silu" => Op::Silu {},
                    "relu" => Op::Relu {},
                    "tanh" => Op::Tanh {},
                    _ => Op::Gelu {
                        tanh_approx: matches!(n.arg("approximate"), Arg::Str(s) if s == "tanh"),
                    },
                };
                let v = self.emit(n, op, &[v])?;
                Ok(vec![LV::Rows(Rows {
                    v,
                    scale: None,
                    ..r
                })])
            }
            (LV::Rows(r), "chunk" | "split_with_sizes" | "split") => {
                let r = *r;
                let dim = match base.as_str() {
                    "chunk" | "split" => n.arg_at(2),
                    _ => n.arg_at(2),
                };
                let d = self.int_arg(n, dim)?;
                if d == 0 || d == -2 && self.ty(r.v).rank() == 2 {
                    return Err(self.rows_err(n, "a split across rows"));
                }
                let v = self.apply_scale(n, r)?;
                if self.ty(v).rank() != 2 {
                    return Err(self.rows_err(n, "a split of rows that are not [pairs, features]"));
                }
                let mut outs = Vec::new();
                let parts = {
                    let total = self.ty(v).shape[1].clone();
                    let sizes: Vec<Dim> = match base.as_str() {
                        "chunk" => {
                            let c = self.int_arg(n, n.arg_at(1))?;
                            if c <= 0 || c > 1 << 16 {
                                return Err(self.bad(n, format!("chunk into {c} parts")));
                            }
                            vec![total / Dim::from(c); c as usize]
                        }
                        "split" => {
                            let s = self.int_arg(n, n.arg_at(1))?;
                            if s <= 0 {
                                return Err(self.bad(n, format!("split into pieces of {s}")));
                            }
                            let t = total
                                .as_const()
                                .ok_or_else(|| self.rows_err(n, "a symbolic split"))?;
                            if t / s > 1 << 16 {
                                return Err(self.bad(n, "split into too many pieces"));
                            }
                            (0..(t + s - 1) / s)
                                .map(|i| Dim::from(s.min(t - i * s)))
                                .collect()
                        }
                        _ => self
                            .ints_arg(n, n.arg_at(1))?
                            .into_iter()
                            .map(Dim::from)
                            .collect(),
                    };
                    self.emit_multi(n, Op::Split { dim: 1, sizes }, &[v])?
                };
                for p in parts {
                    outs.push(LV::Rows(Rows {
                        v: p,
                        scale: None,
                        ..r
                    }));
                }
                Ok(outs)
            }
            (LV::Rows(r), "slice") => self.rows_slice(n, *r),
            (LV::Rows(r), "clamp" | "clamp_min" | "clamp_max") => {
                let r = *r;
                let (lo, hi) = match base.as_str() {
                    "clamp" => (n.arg_at(1).clone(), n.arg_at(2).clone()),
                    "clamp_min" => (n.arg_at(1).clone(), Arg::None),
                    _ => (Arg::None, n.arg_at(1).clone()),
                };
                let mut v = self.apply_scale(n, r)?;
                // Upper bound first, as the config path builds gpt-oss's clamps.
                for (bound, bin) in [(hi, super::lower::Bin::Min), (lo, super::lower::Bin::Max)] {
                    if !matches!(bound, Arg::None) {
                        let o = self.operand(n, &bound)?;
                        v = self.arith_v(n, bin, Operand::T(v), o)?;
                    }
                }
                Ok(vec![LV::Rows(Rows {
                    v,
                    scale: None,
                    ..r
                })])
            }
            (LV::Rows(r), "add") if self.expert_bias(n).is_some() => {
                let bias = self.expert_bias(n).unwrap_or_default();
                self.add_expert_bias(n, *r, &bias)
            }
            (_, "mul" | "add" | "sub" | "div") => self.rows_binary(n, &base, &args),
            (LV::Rows(r), "view" | "reshape" | "_unsafe_view") => {
                let ty = self.out_ty(n)?;
                let k = info_k(r.m);
                if r.hf && ty.rank() == 3 && ty.shape[1] == Dim::from(k) {
                    Ok(vec![LV::Grouped(*r)])
                } else {
                    Err(self.rows_err(n, "a reshape other than [tokens, top_k, hidden]"))
                }
            }
            (LV::Grouped(r), "sum") => {
                let r = *r;
                let dims = self.ints_arg(n, n.arg_at(1))?;
                if dims != [1] && dims != [-2] || matches!(n.arg_at(2), Arg::Bool(true)) {
                    return Err(self.rows_err(n, "a sum other than over top-k slots"));
                }
                let ty = self.out_ty(n)?;
                let (_, _, order) = self.dispatch(n, r.m)?;
                let info = self.moe.moes[r.m].clone();
                let w = match r.scale {
                    Some(w) => w,
                    None => {
                        let t = self.ty(self.tensor(n, &Arg::Tensor(info.idx.clone()))?);
                        self.full(n, 1.0, TensorType::new(ty.dtype, t.shape))?
                    }
                };
                let w = self.cast(n, w, ty.dtype)?;
                let v = self.cast(n, r.v, ty.dtype)?;
                let y = self.emit(n, Op::MoeCombine {}, &[v, order, w])?;
                let layer = n.scope.clone();
                self.report.recognise(
                    "moe",
                    layer.as_deref(),
                    format!(
                        "{} experts top-{} ({} form): moe_dispatch, {} grouped_matmul, moe_combine",
                        info.experts,
                        info.k,
                        if info.grouped {
                            "grouped_mm_fallback"
                        } else {
                            "batched_mm"
                        },
                        info.matmuls
                    ),
                );
                Ok(vec![LV::T(y)])
            }
            _ => Err(self.unsupported(n, format!("an op on MoE routing values ({:?})", a0))),
        }
    }

    /// `rows[:, start::step]` (gpt-oss's interleaved gate and up columns): the rows'
    /// columns reshaped to `[pairs, W/step, step]` and split on the last dim, as the
    /// config path builds it; one split serves every residue.
    fn rows_slice(&mut self, n: &FxNode, r: Rows) -> LR<Vec<LV>> {
        let v = self.apply_scale(n, r)?;
        let vt = self.ty(v);
        let d = self.int_arg(n, n.arg_at(1))?;
        if vt.rank() != 2 || !(d == 1 || d == -1) {
            return Err(self.rows_err(n, "a slice across rows"));
        }
        let width = vt.shape[1]
            .as_const()
            .ok_or_else(|| self.rows_err(n, "a slice of symbolic width"))?;
        let start = match n.arg_at(2) {
            Arg::None => 0,
            a => self.int_arg(n, a)?,
        };
        let end = match n.arg_at(3) {
            Arg::None => i64::MAX,
            a => self.int_arg(n, a)?,
        };
        let step = self.int_arg(n, n.arg_at(4))?;
        if step == 1 && start == 0 && end >= width {
            return Ok(vec![LV::Rows(Rows {
                v,
                scale: None,
                ..r
            })]);
        }
        if step < 2 || width % step != 0 || !(0..step).contains(&start) || end < width {
            return Err(self.rows_err(
                n,
                "a slice other than every step-th column from a start below the step",
            ));
        }
        let parts = match self.moe_state[r.m].strided.get(&(v, step)) {
            Some(p) => p.clone(),
            None => {
                let pairs = vt.shape[0].clone();
                let groups = vec![pairs.clone(), Dim::from(width / step), Dim::from(step)];
                let g3 = self.reshape(n, v, groups)?;
                let split = self.emit_multi(
                    n,
                    Op::Split {
                        dim: 2,
                        sizes: vec![Dim::from(1); step as usize],
                    },
                    &[g3],
                )?;
                let mut parts = Vec::new();
                for p in split {
                    parts.push(self.reshape(n, p, vec![pairs.clone(), Dim::from(width / step)])?);
                }
                self.moe_state[r.m].strided.insert((v, step), parts.clone());
                parts
            }
        };
        Ok(vec![LV::Rows(Rows {
            v: parts[start as usize],
            scale: None,
            ..r
        })])
    }

    /// The expert-bias parameter's placeholder when `n = add(rows, index(bias, [ids]))`
    /// with `bias` [E, N] and `ids` the block's flat expert ids (gpt-oss).
    fn expert_bias(&self, n: &FxNode) -> Option<String> {
        let other = prod(self.fx, targ(n, 1)?)?;
        if other.op != "aten.index.Tensor" {
            return None;
        }
        let ids = match other.arg_at(1) {
            Arg::OptionalTensors(v) if v.len() == 1 => v[0].clone()?,
            Arg::Tensors(v) if v.len() == 1 => v[0].clone(),
            _ => return None,
        };
        let bias = targ(other, 0)?;
        let LV::Rows(r) = self.lv(targ(n, 0)?) else {
            return None;
        };
        let info = &self.moe.moes[r.m];
        (rank(self.fx, bias) == 2
            && const_size(self.fx, bias, 0) == Some(info.experts)
            && clamp_keeps_ids(self.fx, &ids, info.experts)
            && flat_idx(self.fx, &ids).as_deref() == Some(info.idx.as_str()))
        .then(|| bias.to_string())
    }

    /// `grouped_matmul(rows, W, counts) + bias[expert of each row]` → the grouped matmul
    /// with its bias operand (the config path's form, which expert parallelism shards).
    fn add_expert_bias(&mut self, n: &FxNode, r: Rows, bias: &str) -> LR<Vec<LV>> {
        let mm = self.g.node(self.g.def(r.v));
        let operands = mm.operands.clone();
        let (Op::GroupedMatmul { .. }, 3, None) = (&mm.op, operands.len(), r.scale) else {
            return Err(self.rows_err(
                n,
                "an expert bias added to something other than an expert matmul",
            ));
        };
        let op = mm.op.clone();
        let b = self.tensor(n, &Arg::Tensor(bias.to_string()))?;
        if !matches!(self.g.op_of(b), Op::Param { .. }) {
            return Err(self.rows_err(n, "an expert bias that is not a parameter"));
        }
        let dt = self.ty(r.v).dtype;
        let b = self.cast(n, b, dt)?;
        let v = self.emit(n, op, &[operands[0], operands[1], operands[2], b])?;
        Ok(vec![LV::Rows(Rows {
            v,
            scale: None,
            ..r
        })])
    }

    fn rows_binary(&mut self, n: &FxNode, base: &str, args: &[LV]) -> LR<Vec<LV>> {
        let (a, b) = (args[0].clone(), args.get(1).cloned().unwrap_or(LV::None));
        let (r, other, swapped) = match (&a, &b) {
            (LV::Rows(r), o) => (*r, o.clone(), false),
            (o, LV::Rows(r)) => (*r, o.clone(), true),
            _ => return Err(self.unsupported(n, "arithmetic on MoE routing values")),
        };
        let k = self.moe.moes[r.m].k;
        // Routing weights: fold into the combine.
        if base == "mul" && r.scale.is_none() {
            let w = match &other {
                LV::PairW { m, w } if *m == r.m && !r.hf => Some(*w),
                LV::T(t) if r.hf => self.pair_weights(*t, k),
                _ => None,
            };
            if let Some(w) = w {
                return Ok(vec![LV::Rows(Rows {
                    scale: Some(w),
                    ..r
                })]);
            }
        }
        let x = self.apply_scale(n, r)?;
        let y = match other {
            LV::Rows(o) if o.m == r.m && o.hf == r.hf => Operand::T(self.apply_scale(n, o)?),
            LV::Num(v, kd) => Operand::Num(v, kd),
            LV::T(t) => {
                let tt = self.ty(t);
                let rows = self.ty(x).shape[0].clone();
                if tt.rank() >= 1 && tt.rank() == self.ty(x).rank() && tt.shape[0] == rows && r.hf {
                    // A per-pair tensor in HF order: bring it into dispatch order.
                    let (_, _, order) = self.dispatch(n, r.m)?;
                    Operand::T(self.emit(n, Op::IndexSelect { dim: 0 }, &[t, order])?)
                } else if tt.rank() < self.ty(x).rank() || tt.shape.first() == Some(&Dim::from(1)) {
                    Operand::T(t)
                } else {
                    return Err(self.rows_err(n, "arithmetic with a tensor that is not per pair"));
                }
            }
            _ => return Err(self.rows_err(n, "arithmetic with another MoE value")),
        };
        let bin = match base {
            "mul" => super::lower::Bin::Mul,
            "add" => super::lower::Bin::Add,
            "sub" => super::lower::Bin::Sub,
            _ => super::lower::Bin::Div,
        };
        if let Arg::Float(_) | Arg::Int(_) = n.arg("alpha") {
            if self.float_arg(n, n.arg("alpha"))? != 1.0 {
                return Err(self.rows_err(n, "add/sub with alpha"));
            }
        }
        let (p, q) = if swapped {
            (y, Operand::T(x))
        } else {
            (Operand::T(x), y)
        };
        let v = self.arith_v(n, bin, p, q)?;
        let _ = DType::F32;
        Ok(vec![LV::Rows(Rows {
            v,
            scale: None,
            ..r
        })])
    }
}

//! `shard-seq`: propagates the per-rank token dims from the sliced inputs through the
//! graph.
//!
//! Every transitive consumer of a sharded value is re-typed by the op's shape rule
//! (`Graph::reinfer`), and attributes that spell a global size are rewritten to the
//! per-rank size (`S` -> `S/sp`, `B` -> `B/dp`) where the old attribute no longer fits
//! the new operand: `reshape` and `expand` targets. The position `arange` that feeds
//! RoPE becomes `arange {start=@sp*S/sp}` of length `S/sp`, so every rank rotates its
//! tokens by their global positions.
//!
//! Ops that would mix tokens across ranks (a reduction, softmax, concat, slice, gather or
//! matmul contraction over a sharded dim) are errors, not silent partial results. The
//! exceptions are `attention` (rewritten by `ulysses-attention`) and `cross_entropy` /
//! `count_valid` (all-reduced by `sp-loss`).

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, DP, SP};
use crate::util::Layout;
use weft_ir::shape::norm_dim;
use weft_ir::{Dim, Graph, Node, Op, Provenance, TensorType, Value};

pub struct ShardSeq;

pub const NAME: &str = "shard-seq";

impl Pass for ShardSeq {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "re-type every consumer of the sliced inputs to per-rank sizes (S -> S/sp, B -> B/dp); RoPE positions start at @sp*S/sp"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::shard_inputs::NAME]
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::AnyOf(&[SP, DP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let layout = Layout::of(g, cx, NAME)?;
        let mut res = PassResult::unchanged();
        res.count("nodes_retyped", 0).count("attrs_localized", 0).count("positions_rewritten", 0);

        let positions = match &layout.seq {
            Some(s) => position_aranges(g, &Dim::sym(&s.symbol)),
            None => vec![],
        };
        let mut sharded = vec![false; g.value_capacity()];
        let order: Vec<Node> = g.nodes().to_vec();
        // Seeds: values already per-rank (the slices of shard-inputs).
        for &n in &order {
            for &v in &g.node(n).results {
                if g.ty(v).shape.iter().any(|d| layout.is_sharded(d)) {
                    sharded[v.0 as usize] = true;
                }
            }
        }
        for &n in &order {
            if positions.contains(&n) {
                if rewrite_arange(g, n, &layout) {
                    res.count("positions_rewritten", 1);
                    res.changed = true;
                }
                for &v in &g.node(n).results {
                    sharded[v.0 as usize] = true;
                }
                continue;
            }
            let d = g.node(n);
            if !d.operands.iter().any(|v| sharded[v.0 as usize]) {
                continue;
            }
            check_no_mixing(g, n, &layout)?;
            if localize_attrs(g, n, &layout) {
                res.count("attrs_localized", 1);
                res.changed = true;
            }
            let before: Vec<TensorType> = g.node(n).results.iter().map(|v| g.ty(*v).clone()).collect();
            g.reinfer(n).map_err(|e| {
                PassError::rewrite(NAME, format!("`{NAME}` cannot give `{}` per-rank sizes", e.op), e.location, e.message).with_help(
                    "an attribute or another operand still has the global size; build it from the sharded values or mark the input with its role",
                )
            })?;
            let results = g.node(n).results.clone();
            let mut retyped = false;
            for (v, old) in results.iter().zip(&before) {
                sharded[v.0 as usize] = true;
                retyped |= g.ty(*v) != old;
            }
            if retyped {
                res.count("nodes_retyped", 1);
                res.changed = true;
            }
        }
        Ok(res)
    }
}

/// Arange nodes of length `seq` whose values reach a `rope_table` through layout and
/// elementwise ops: the position ids.
fn position_aranges(g: &Graph, seq: &Dim) -> Vec<Node> {
    let mut out = Vec::new();
    let mut stack: Vec<Value> = Vec::new();
    for &n in g.nodes() {
        if matches!(g.node(n).op, Op::RopeTable { .. }) {
            stack.extend(g.node(n).operands.iter().copied());
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        let n = g.def(v);
        match &g.node(n).op {
            Op::Arange { ty, .. } if ty.shape[0] == *seq => out.push(n),
            Op::Reshape { .. } | Op::Expand { .. } | Op::Cast { .. } | Op::Add {} | Op::Sub {} | Op::AddScalar { .. } | Op::Scale { .. } => {
                stack.extend(g.node(n).operands.iter().copied());
            }
            _ => {}
        }
    }
    out.sort();
    out
}

fn rewrite_arange(g: &mut Graph, n: Node, layout: &Layout) -> bool {
    let split = layout.seq.as_ref().expect("positions are only rewritten when the sequence is split");
    let Op::Arange { start, ty } = &g.node(n).op else { return false };
    if ty.shape[0] != Dim::sym(&split.symbol) {
        return false; // already per-rank
    }
    let new_start = start.clone() + split.start();
    let new_ty = ty.with_shape(vec![split.local()]);
    let reason = format!("positions of this rank's block [{}, +{}) so RoPE uses global positions", new_start, split.local());
    let d = g.node_mut(n);
    d.op = Op::Arange { start: new_start, ty: new_ty };
    d.meta.provenance = Some(Provenance { pass: NAME.to_string(), reason });
    let _ = g.reinfer(n);
    true
}

/// Rewrites `reshape`/`expand`/`slice` attributes that no longer fit their (now
/// per-rank) operand. A reshape target takes the fewest localized symbols that make its
/// element count match (a batch-split mask keeps its global sequence dims); an expand
/// copies the operand's per-rank dims and localizes only the dims it broadcasts.
fn localize_attrs(g: &mut Graph, n: Node, layout: &Layout) -> bool {
    let operand_ty = g.ty(g.node(n).operands[0]).clone();
    let new_op = match &g.node(n).op {
        Op::Reshape { shape } => {
            let numel = |s: &[Dim]| TensorType::new(operand_ty.dtype, s.to_vec()).numel();
            if numel(shape) == operand_ty.numel() {
                return false;
            }
            let splits = layout.splits();
            let subsets: Vec<Vec<usize>> = match splits.len() {
                1 => vec![vec![0]],
                2 => vec![vec![0], vec![1], vec![0, 1]],
                _ => vec![],
            };
            let mut found = None;
            for subset in subsets {
                let cand: Vec<Dim> = shape
                    .iter()
                    .map(|d| subset.iter().fold(d.clone(), |acc, &i| acc.substitute(&splits[i].1.symbol, &splits[i].1.local())))
                    .collect();
                if numel(&cand) == operand_ty.numel() {
                    found = Some(cand);
                    break;
                }
            }
            match found {
                Some(shape) => Op::Reshape { shape },
                None => return false, // reinfer reports the mismatch
            }
        }
        Op::Expand { shape } => {
            if g.node(n).op.infer(&[&operand_ty]).is_ok() {
                return false;
            }
            let off = shape.len().saturating_sub(operand_ty.rank());
            let one = Dim::from(1);
            let shape = shape
                .iter()
                .enumerate()
                .map(|(i, d)| match i.checked_sub(off).map(|j| &operand_ty.shape[j]) {
                    Some(od) if *od != one => od.clone(),
                    _ => layout.localize(d),
                })
                .collect();
            Op::Expand { shape }
        }
        Op::Slice { dim, start, len } => {
            // A full-range slice written with the global size stays full-range.
            let Ok(k) = norm_dim(*dim, operand_ty.rank()) else { return false };
            if start.as_const() != Some(0) || *len == operand_ty.shape[k] || layout.localize(len) != operand_ty.shape[k] {
                return false;
            }
            Op::Slice { dim: *dim, start: start.clone(), len: operand_ty.shape[k].clone() }
        }
        _ => return false,
    };
    if new_op == g.node(n).op {
        return false;
    }
    g.node_mut(n).op = new_op;
    true
}

/// Errors when `n` would combine values across the ranks' token blocks.
fn check_no_mixing(g: &Graph, n: Node, layout: &Layout) -> Result<(), PassError> {
    let d = g.node(n);
    let ty = |i: usize| g.ty(d.operands[i]);
    // (operand, dim, what the op does along it)
    let mut along: Vec<(usize, i64, &str)> = Vec::new();
    match &d.op {
        Op::Sum { dims, .. } | Op::Mean { dims, .. } | Op::Max { dims, .. } => {
            along.extend(dims.iter().map(|&x| (0, x, "reduces over")));
        }
        Op::Softmax { dim } | Op::LogSoftmax { dim } => along.push((0, *dim, "normalizes over")),
        Op::Topk { dim, .. } => along.push((0, *dim, "selects along")),
        Op::Concat { dim } => along.extend((0..d.operands.len()).map(|i| (i, *dim, "concatenates along"))),
        Op::Gather { dim } | Op::IndexSelect { dim } => along.push((0, *dim, "indexes along")),
        Op::ScatterAdd { dim } => along.push((0, *dim, "scatters along")),
        Op::Linear {} => along.push((0, -1, "contracts")),
        Op::RmsNorm { .. } => along.push((0, -1, "normalizes over")),
        Op::Matmul { transpose_a, transpose_b } => {
            along.push((0, if *transpose_a { -2 } else { -1 }, "contracts"));
            along.push((1, if *transpose_b { -1 } else { -2 }, "contracts"));
        }
        Op::Slice { dim, start, len } => {
            let t = ty(0);
            if let Ok(k) = norm_dim(*dim, t.rank()) {
                let full = start.as_const() == Some(0) && (*len == t.shape[k] || layout.localize(len) == t.shape[k]);
                if !full {
                    along.push((0, *dim, "slices"));
                }
            }
        }
        Op::Split { dim, sizes } if sizes.len() > 1 => along.push((0, *dim, "splits")),
        Op::ShiftLabels { .. } => along.push((0, -1, "shifts along")),
        _ => {}
    }
    for (i, dim, what) in along {
        let t = ty(i);
        let Ok(k) = norm_dim(dim, t.rank()) else { continue };
        let size = &t.shape[k];
        if layout.is_sharded(size) {
            let axis = layout.splits().iter().find(|(_, s)| size.mentions(s.axis)).map(|(_, s)| s.axis).unwrap_or(SP);
            return Err(PassError::rewrite(
                NAME,
                format!("`{NAME}` cannot shard `{}`", d.op.name()),
                g.describe(n),
                format!(
                    "it {what} dim {k} of {} ({t}), which is split over `{axis}`; each rank would compute a partial result",
                    d.operands[i]
                ),
            )
            .with_help("only `attention` (ulysses-attention) and `cross_entropy`/`count_valid` (sp-loss) may combine tokens across ranks"));
        }
    }
    Ok(())
}

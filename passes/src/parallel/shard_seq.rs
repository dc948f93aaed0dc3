//! `shard-seq`: propagates the per-rank token dims from the sliced inputs through the
//! graph, keeping the program equal to the unsharded one.
//!
//! It removes the `all_gather`s `shard-inputs` left after each input slice and walks the
//! graph in program order. Each node that reads a per-rank value is
//!
//! - **token-local** (embedding, linear, norms, elementwise ops, reshapes, rope, MoE
//!   routing...): it is re-typed by its shape rule (`Graph::reinfer`); `reshape` and
//!   `expand` targets spelled with the global sizes are rewritten to the per-rank ones
//!   (`S` -> `S/sp`, `B` -> `B/dp`) where they no longer fit their operand;
//! - **token-mixing** along a per-rank dim (attention over the sequence, the loss over
//!   every token, a reduction, softmax, concat or contraction over that dim): the per-rank
//!   operand dims it mixes are `all_gather`ed back to the whole, so it computes what it
//!   did before. After `attention` the output is sliced back to this rank's block so the
//!   rest of the layer stays per-rank; `ulysses-attention` then trades the gather/slice
//!   pair for all_to_alls, and `sp-loss` the loss gathers for all_reduces;
//! - a **sum over every per-rank dim** of its operand (the MoE aux loss's per-expert
//!   token counts and probability sums over `[B*S, ..]` rows): summed per rank, then
//!   `all_reduce`d (sum) over the axes those dims are split on, so it needs no gather
//!   (a flattened `B*S/dp/sp` dim could not be gathered in order anyway);
//! - anything that does not fit per-rank operands (a node mixing a per-rank value with
//!   a whole one) falls back to gathering its operands (counted as `fallback_gathers`).
//!
//! The position `arange` that feeds RoPE becomes `arange {start=@sp*S/sp}` of length
//! `S/sp`, so each rank rotates its tokens by their global positions. Outputs that end
//! per-rank are gathered; `sp-loss` records their split instead.

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, CP, DP, SP};
use crate::util::{gather_dims, insert1, made_by, meta_for, Layout};
use std::collections::HashMap;
use weft_ir::shape::norm_dim;
use weft_ir::{At, Dim, Graph, Node, Op, Provenance, ReduceOp, Reduction, TensorType, Value};

pub struct ShardSeq;

pub const NAME: &str = "shard-seq";

impl Pass for ShardSeq {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "propagate per-rank token sizes (S -> S/sp, B -> B/dp) from the sliced inputs; gather only where ops mix tokens; RoPE positions start at @sp*S/sp"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::shard_inputs::NAME]
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::AnyOf(&[SP, CP, DP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let layout = Layout::of(g, cx, NAME)?;
        crate::util::refuse_unsplit_attention(g, NAME)?;
        let mut res = PassResult::unchanged();
        for k in [
            "input_gathers_removed",
            "nodes_retyped",
            "attrs_localized",
            "positions_rewritten",
            "gathers",
            "fallback_gathers",
            "outputs_gathered",
        ] {
            res.count(k, 0);
        }
        // 1. Drop the gathers shard-inputs put after the slices.
        let restoring: Vec<Node> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&n| {
                matches!(
                    g.node(n).op,
                    Op::AllGather { .. } | Op::Zigzag { inverse: true, .. }
                ) && made_by(g, n, crate::shard_inputs::NAME)
            })
            .collect();
        if restoring.is_empty() {
            // Nothing sliced since the last run (or shard-inputs found nothing to slice):
            // propagating again would undo what later passes made of the gathers.
            return Ok(res);
        }
        for n in restoring {
            let (x, r) = (g.node(n).operands[0], g.node(n).results[0]);
            g.replace_all_uses(r, x);
            g.remove_node(n);
            res.count("input_gathers_removed", 1);
            res.changed = true;
        }
        let mut p = Propagation {
            layout,
            gathered: HashMap::new(),
        };
        // 2. Positions.
        if let Some(s) = &p.layout.seq {
            for n in position_aranges(g, &Dim::sym(&s.symbol)) {
                if p.rewrite_arange(g, n) {
                    res.count("positions_rewritten", 1);
                    res.changed = true;
                }
            }
        }
        // 3. Every consumer of a per-rank value, in program order.
        let order: Vec<Node> = g.nodes().to_vec();
        for n in order {
            if g.try_node(n).is_none() || !g.node(n).operands.iter().any(|&v| p.per_rank(g, v)) {
                continue;
            }
            if made_by(g, n, NAME) {
                continue; // a gather or slice this pass made
            }
            p.visit(g, n, &mut res)?;
        }
        // 4. Outputs stay whole.
        let outputs: Vec<(String, Value)> = g.outputs().to_vec();
        for (name, v) in outputs {
            if p.per_rank(g, v) {
                let dims = p.sharded_dims(g, v);
                let anchor = g.def(v);
                let whole = p.gather(g, v, &dims, anchor, &format!("output `{name}`"))?;
                g.set_output(&name, whole);
                res.count("outputs_gathered", 1);
                res.changed = true;
            }
        }
        res.count("gathers", p.gathered.len() as u64);
        Ok(res)
    }
}

struct Propagation {
    layout: Layout,
    /// Gathers made so far, by (value, dims): one gather serves every consumer.
    gathered: HashMap<(Value, Vec<usize>), Value>,
}

impl Propagation {
    fn per_rank(&self, g: &Graph, v: Value) -> bool {
        g.ty(v).shape.iter().any(|d| self.layout.is_sharded(d))
    }

    fn sharded_dims(&self, g: &Graph, v: Value) -> Vec<usize> {
        g.ty(v)
            .shape
            .iter()
            .enumerate()
            .filter(|(_, d)| self.layout.is_sharded(d))
            .map(|(k, _)| k)
            .collect()
    }

    fn gather(
        &mut self,
        g: &mut Graph,
        v: Value,
        dims: &[usize],
        user: Node,
        reason: &str,
    ) -> Result<Value, PassError> {
        let key = (v, dims.to_vec());
        if let Some(&w) = self.gathered.get(&key) {
            return Ok(w);
        }
        let w = gather_dims(g, NAME, &self.layout, v, dims, user, reason)?;
        self.gathered.insert(key, w);
        Ok(w)
    }

    fn rewrite_arange(&self, g: &mut Graph, n: Node) -> bool {
        let split = self
            .layout
            .seq
            .as_ref()
            .expect("positions are rewritten only when the sequence is split");
        let Op::Arange { start, ty } = &g.node(n).op else {
            return false;
        };
        if ty.shape[0] != Dim::sym(&split.symbol) {
            return false; // already per-rank
        }
        if let Some(cp) = split.ring {
            // Zigzag positions are not one range: take this rank's block of the
            // zigzag-ordered positions.
            let out = g.node(n).results[0];
            let meta = meta_for(g, n, NAME, format!("positions in zigzag order over cp={cp}, so RoPE uses each token's global position"));
            let op = Op::Zigzag {
                dim: 0,
                parts: cp as i64,
                inverse: false,
            };
            let Ok(z) = insert1(g, NAME, At::After(n), op, &[out], meta) else {
                return false;
            };
            let reason = format!(
                "positions of this rank's block [{}, +{}) of the zigzag order",
                split.start(),
                split.local()
            );
            let meta = meta_for(g, n, NAME, reason);
            let op = Op::Slice {
                dim: 0,
                start: split.start(),
                len: split.local(),
            };
            let Ok(local) = insert1(g, NAME, At::After(g.def(z)), op, &[z], meta) else {
                return false;
            };
            g.replace_uses_except(out, local, g.def(z));
            return true;
        }
        let new_start = start.clone() + split.start();
        let new_ty = ty.with_shape(vec![split.local()]);
        let reason = format!(
            "positions of this rank's block [{}, +{}) so RoPE uses global positions",
            new_start,
            split.local()
        );
        let d = g.node_mut(n);
        d.op = Op::Arange {
            start: new_start,
            ty: new_ty,
        };
        d.meta.provenance = Some(Provenance {
            pass: NAME.to_string(),
            reason,
        });
        g.reinfer(n).is_ok()
    }

    fn visit(&mut self, g: &mut Graph, n: Node, res: &mut PassResult) -> Result<(), PassError> {
        let before: Vec<TensorType> = g.node(n).results.iter().map(|v| g.ty(*v).clone()).collect();
        let mixed = self.mixed_dims(g, n);
        if let Some(axes) = self.token_sum_axes(g, n) {
            self.reinfer(g, n)?;
            self.all_reduce_result(g, n, &axes)?;
            res.count("partial_sums", 1); // not pre-registered: only MoE aux losses have them
        } else if !mixed.is_empty() {
            self.gather_operands(
                g,
                n,
                &mixed,
                &format!("`{}` combines tokens", g.node(n).op.name()),
            )?;
            self.reinfer(g, n)?;
            if matches!(g.node(n).op, Op::Attention { .. }) {
                self.reslice_attention(g, n)?;
            }
        } else {
            let original = g.node(n).op.clone();
            if localize_attrs(g, n, &self.layout) {
                res.count("attrs_localized", 1);
            }
            if g.reinfer(n).is_err() {
                // Does not fit per-rank operands: compute it whole.
                g.node_mut(n).op = original;
                let all: Vec<(usize, Vec<usize>)> = (0..g.node(n).operands.len())
                    .map(|i| (i, self.sharded_dims(g, g.node(n).operands[i])))
                    .collect();
                self.gather_operands(g, n, &all, "operands of different sizes per rank")?;
                self.reinfer(g, n)?;
                res.count("fallback_gathers", 1);
            }
        }
        let retyped = g
            .node(n)
            .results
            .iter()
            .zip(&before)
            .any(|(v, t)| g.ty(*v) != t);
        if retyped {
            res.count("nodes_retyped", 1);
        }
        res.changed = true;
        Ok(())
    }

    fn reinfer(&self, g: &mut Graph, n: Node) -> Result<(), PassError> {
        g.reinfer(n).map_err(|e| {
            PassError::rewrite(NAME, format!("`{NAME}` cannot give `{}` per-rank sizes", e.op), e.location, e.message)
                .with_help("an attribute or operand still has a global size that shard-seq cannot tell apart; please report the model")
        })
    }

    /// Gathers the listed per-rank dims of each operand, for node `n` only.
    fn gather_operands(
        &mut self,
        g: &mut Graph,
        n: Node,
        dims: &[(usize, Vec<usize>)],
        reason: &str,
    ) -> Result<(), PassError> {
        for (i, ds) in dims {
            if ds.is_empty() {
                continue;
            }
            let v = g.node(n).operands[*i];
            let w = self.gather(g, v, ds, n, reason)?;
            g.node_mut(n).operands[*i] = w;
        }
        Ok(())
    }

    /// For a `sum` whose reduced dims include every per-rank dim of its operand: the
    /// axes those dims are split over, inner (`sp`) first.
    fn token_sum_axes(&self, g: &Graph, n: Node) -> Option<Vec<&'static str>> {
        let Op::Sum { dims, .. } = &g.node(n).op else {
            return None;
        };
        let t = g.ty(g.node(n).operands[0]);
        let reduced: Vec<usize> = dims
            .iter()
            .map(|&k| norm_dim(k, t.rank()).ok())
            .collect::<Option<_>>()?;
        let sharded = self.sharded_dims(g, g.node(n).operands[0]);
        if sharded.is_empty() || sharded.iter().any(|k| !reduced.contains(k)) {
            return None;
        }
        let mut axes: Vec<&'static str> = self
            .layout
            .splits()
            .iter()
            .flat_map(|(_, s)| s.axes())
            .filter(|a| sharded.iter().any(|&k| t.shape[k].mentions(a)))
            .collect();
        axes.sort_by_key(|&a| [SP, CP, DP].iter().position(|x| *x == a));
        Some(axes)
    }

    /// `all_reduce` (sum) of `n`'s result over `axes`, read by every other use.
    fn all_reduce_result(
        &mut self,
        g: &mut Graph,
        n: Node,
        axes: &[&'static str],
    ) -> Result<(), PassError> {
        let out = g.node(n).results[0];
        let (mut cur, mut at, mut first) = (out, n, None);
        for axis in axes {
            let meta = meta_for(
                g,
                n,
                NAME,
                format!("`sum` over every token: this rank's partial sum, added over {axis}"),
            );
            let op = Op::AllReduce {
                axis: axis.to_string(),
                op: ReduceOp::Sum,
            };
            cur = insert1(g, NAME, At::After(at), op, &[cur], meta)?;
            at = g.def(cur);
            first.get_or_insert(at);
        }
        if let Some(first) = first {
            g.replace_uses_except(out, cur, first);
        }
        Ok(())
    }

    /// Attention computed whole: keep this rank's sequence block of the output.
    fn reslice_attention(&mut self, g: &mut Graph, n: Node) -> Result<(), PassError> {
        let Some(split) = self.layout.seq.clone() else {
            return Ok(());
        };
        let out = g.node(n).results[0];
        if g.ty(out).shape[2] != Dim::sym(&split.symbol) {
            return Ok(());
        }
        let mut whole = out;
        if let Some(cp) = split.ring {
            let meta = meta_for(g, n, NAME, "attention output: into zigzag order over cp (ring-attention replaces the gathers, this and the slice with ring steps)");
            let op = Op::Zigzag {
                dim: 2,
                parts: cp as i64,
                inverse: false,
            };
            whole = insert1(g, NAME, At::After(n), op, &[out], meta)?;
        }
        let op = Op::Slice {
            dim: 2,
            start: split.start(),
            len: split.local(),
        };
        let meta = meta_for(g, n, NAME, "attention output: back to this rank's sequence block (ulysses-attention replaces the gathers and this slice with all_to_alls)");
        let local = insert1(g, NAME, At::After(g.def(whole)), op, &[whole], meta)?;
        let first = if whole == out {
            g.def(local)
        } else {
            g.def(whole)
        };
        g.replace_uses_except(out, local, first);
        Ok(())
    }

    /// The per-rank dims, per operand, that node `n` combines tokens along.
    fn mixed_dims(&self, g: &Graph, n: Node) -> Vec<(usize, Vec<usize>)> {
        let d = g.node(n);
        let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, dim) in mixing_dims(g, n, &self.layout) {
            let t = g.ty(d.operands[i]);
            let Ok(k) = norm_dim(dim, t.rank()) else {
                continue;
            };
            if self.layout.is_sharded(&t.shape[k]) {
                match out.iter_mut().find(|(j, _)| *j == i) {
                    Some((_, ks)) if !ks.contains(&k) => ks.push(k),
                    Some(_) => {}
                    None => out.push((i, vec![k])),
                }
            }
        }
        out
    }
}

/// `(operand, dim)` pairs node `n` combines values along (dims may be negative).
fn mixing_dims(g: &Graph, n: Node, layout: &Layout) -> Vec<(usize, i64)> {
    let d = g.node(n);
    let rank = |i: usize| g.ty(d.operands[i]).rank() as i64;
    let all = |i: usize| (0..rank(i)).map(move |k| (i, k));
    match &d.op {
        Op::Attention { .. } => {
            // Attention mixes the sequence of q, k, v (and both sequence dims of a mask).
            let mut v = vec![(0, 2), (1, 2), (2, 2)];
            if let Some(Ok(slots)) = d.op.attention_operands(d.operands.len()) {
                if let Some(m) = slots.mask {
                    v.extend([(m, 2), (m, 3)]);
                }
            }
            v
        }
        Op::CrossEntropy {
            reduction: Reduction::None,
            ..
        } => vec![(0, -1)],
        Op::CrossEntropy { .. } => all(0).chain(all(1)).collect(),
        Op::CountValid { .. } => all(0).collect(),
        Op::Sum { dims, .. } | Op::Mean { dims, .. } | Op::Max { dims, .. } => {
            dims.iter().map(|&k| (0, k)).collect()
        }
        Op::Softmax { dim } | Op::LogSoftmax { dim } | Op::Topk { dim, .. } => vec![(0, *dim)],
        Op::Concat { dim } => (0..d.operands.len()).map(|i| (i, *dim)).collect(),
        Op::Gather { dim } | Op::IndexSelect { dim } => vec![(0, *dim)],
        Op::ScatterAdd { dim } => vec![(0, *dim), (1, *dim), (2, *dim)],
        Op::Linear {} | Op::RmsNorm { .. } | Op::ShiftLabels { .. } => vec![(0, -1)],
        Op::Matmul {
            transpose_a,
            transpose_b,
        } => {
            vec![
                (0, if *transpose_a { -2 } else { -1 }),
                (1, if *transpose_b { -1 } else { -2 }),
            ]
        }
        Op::Slice { dim, start, len } => {
            let t = g.ty(d.operands[0]);
            // A slice of the whole dim (written with the global size or not) is local.
            match norm_dim(*dim, t.rank()) {
                Ok(k)
                    if !(start.as_const() == Some(0)
                        && (*len == t.shape[k] || layout.localize(len) == t.shape[k])) =>
                {
                    vec![(0, *dim)]
                }
                _ => vec![],
            }
        }
        Op::Split { dim, sizes } if sizes.len() > 1 => vec![(0, *dim)],
        // Collectives already written into the model exchange whole tensors.
        op if op.is_collective() => all(0).collect(),
        _ => vec![],
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
            Op::Reshape { .. }
            | Op::Expand { .. }
            | Op::Cast { .. }
            | Op::Add {}
            | Op::Sub {}
            | Op::AddScalar { .. }
            | Op::Scale { .. } => {
                stack.extend(g.node(n).operands.iter().copied());
            }
            _ => {}
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Rewrites `reshape`/`expand` targets and whole-dim `slice` lengths that no longer
/// fit their (now per-rank) operand. A reshape target takes the fewest localized symbols that make its element
/// count match (a batch-split mask keeps its global sequence dims); an expand copies
/// the operand's per-rank dims and localizes only the dims it broadcasts.
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
            let found = subsets.into_iter().find_map(|subset| {
                let cand: Vec<Dim> = shape
                    .iter()
                    .map(|d| {
                        subset.iter().fold(d.clone(), |acc, &i| {
                            acc.substitute(&splits[i].1.symbol, &splits[i].1.local())
                        })
                    })
                    .collect();
                (numel(&cand) == operand_ty.numel()).then_some(cand)
            });
            match found {
                Some(shape) => Op::Reshape { shape },
                None => return false,
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
                .map(
                    |(i, d)| match i.checked_sub(off).map(|j| &operand_ty.shape[j]) {
                        Some(od) if *od != one => od.clone(),
                        _ => layout.localize(d),
                    },
                )
                .collect();
            Op::Expand { shape }
        }
        Op::Slice { dim, start, len } => {
            let Ok(k) = norm_dim(*dim, operand_ty.rank()) else {
                return false;
            };
            if start.as_const() != Some(0)
                || *len == operand_ty.shape[k]
                || layout.localize(len) != operand_ty.shape[k]
            {
                return false;
            }
            Op::Slice {
                dim: *dim,
                start: start.clone(),
                len: operand_ty.shape[k].clone(),
            }
        }
        _ => return false,
    };
    if new_op == g.node(n).op {
        return false;
    }
    g.node_mut(n).op = new_op;
    true
}

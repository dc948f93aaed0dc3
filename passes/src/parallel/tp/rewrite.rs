//! `tensor-parallel`: splits linear layers, attention heads, the vocabulary and the
//! loss over the mesh axis `tp`, one SPMD program for every rank.
//!
//! 1. **Decide** each parameter from the first matching layer spec ([`super::spec`]):
//!    column (output features split), row (input features split), or whole. An
//!    attention's q/k/v projections split on head boundaries ([`super::sizes`]) and its
//!    o projection by the same q heads; fewer kv heads than ranks replicates the kv
//!    weights and each rank slices the kv head its q heads need. The embedding weight
//!    splits over the vocabulary (and a tied head with it: one parameter, one gradient).
//!    Sizes are computed once and recorded with `Graph::add_param_partition`; a
//!    parameter's node type becomes its per-rank shape (a per-rank table dim,
//!    `f32[tp?[3 2]*8, 32]`, when ranks differ).
//! 2. **Propagate** the per-rank sizes in program order: nodes re-infer their types;
//!    reshape targets follow the head counts (`[B, S, 4, 8]` -> `[B, S, tp?[3 2], 8]`),
//!    splits of fused outputs take each sub-parameter's per-rank size, and an op that
//!    would combine values along a split dim is an error naming it.
//! 3. **Collectives**: column-parallel linears need none in the forward; a row-parallel
//!    linear's output is `all_reduce`d (sum) over `tp`, its bias added after. A
//!    `gather_output` column pads, `all_gather`s and trims. The vocab-parallel embedding
//!    looks up the rank's rows (others zero) and `all_reduce`s; the cross-entropy of
//!    vocab-split logits takes the max and the sum of exponentials with `all_reduce`
//!    (max, sum) and the target logit from the rank that holds it, so logits are never
//!    gathered: the `logits` output is returned split over `tp` on its last dim.
//!
//! Backward collectives are autodiff's business (they are the duals of these). Whole
//! parameters that read split values (qk-norms, replicated kv weights) get a different
//! gradient on each rank, summed over `tp` (HF's `replicated_with_grad_allreduce`); the
//! pass says so in their provenance.
//!
//! With `sp`, run it after `sp-loss` (so the loss is already per-rank) and before
//! `ulysses-attention`, which then trades the local heads for sequence.

use super::sizes::{self, HeadSplit};
use super::spec::{self, LayerSpec, PartitionType, Rules, SpecError};
use super::TP;
use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult};
use crate::util::{insert1, made_by, meta_for};
use std::collections::{BTreeMap, HashMap, HashSet};
use weft_ir::{
    At, Bindings, CmpOp, DType, Dim, Float, Graph, Node, Op, Partition, Provenance, ReduceOp,
    Reduction, TensorType, Value,
};

pub struct TensorParallel;

pub const NAME: &str = "tensor-parallel";

impl Pass for TensorParallel {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "split linears (column/row by layer specs), attention heads, the vocabulary and the loss over tp; all_reduce after row-parallel linears; record parameter partitions"
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::All(&[TP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let p = cx.axis_size(NAME, TP)? as i64;
        crate::util::refuse_unsplit_attention(g, NAME)?;
        let mut res = PassResult::unchanged();
        for k in [
            "params_split",
            "params_sliced",
            "all_reduce",
            "all_gather",
            "attention_layers",
            "kv_heads_replicated",
            "vocab_parallel",
            "grad_allreduce_params",
        ] {
            res.count(k, 0);
        }
        // Applying twice must not split twice.
        if g.param_partitions()
            .iter()
            .any(|(_, ps)| ps.iter().any(|x| x.splits_over(TP)))
            || g.nodes().iter().any(|&n| made_by(g, n, NAME))
        {
            return Ok(res);
        }
        let o = &cx.options.tp;
        let hf = spec::from_hf_plan(
            &o.hf_plan,
            if o.hf_plan_source.is_empty() {
                "config.json"
            } else {
                &o.hf_plan_source
            },
        )
        .map_err(spec_error)?;
        let rules = Rules::new(o.spec.as_ref(), &hf).map_err(spec_error)?;
        let grain = o
            .grain
            .or(o.spec.as_ref().and_then(|s| s.grain))
            .unwrap_or(1);
        let vocab_grain = o.vocab_grain.unwrap_or(grain);
        let mut tp = Tp {
            p,
            grain,
            vocab_grain,
            orig: Vec::new(),
            plans: BTreeMap::new(),
            linears: HashMap::new(),
            subs: HashMap::new(),
            pieces: HashMap::new(),
            changed: HashSet::new(),
            grad_allreduce: BTreeMap::new(),
            sp: cx.mesh.size(crate::pass::SP).map(i64::from),
            seq_reduces: Vec::new(),
        };
        tp.orig = (0..g.value_capacity())
            .map(|i| g.try_ty(Value(i as u32)).cloned())
            .collect();
        tp.decide(g, &rules, o.model_type.as_deref(), &mut res)?;
        if tp
            .plans
            .values()
            .all(|pl| matches!(pl, ParamPlan::Whole { .. }))
        {
            return Ok(res);
        }
        tp.apply_params(g, &mut res)?;
        tp.propagate(g, &mut res)?;
        tp.outputs(g, &mut res)?;
        if o.sequence_parallel || o.spec.as_ref().is_some_and(|s| s.sequence_parallel) {
            tp.sequence_parallel(g, &mut res)?;
        }
        tp.mark_grad_allreduce(g, &mut res);
        res.changed = true;
        Ok(res)
    }
}

fn spec_error(e: SpecError) -> PassError {
    PassError::Rewrite {
        pass: NAME.into(),
        what: "invalid tensor-parallel spec".into(),
        location: e.location,
        why: e.why,
        help: e.help,
    }
}

fn param_error(name: &str, why: impl Into<String>) -> PassError {
    PassError::rewrite(
        NAME,
        format!("`{NAME}` cannot split a parameter"),
        format!("param `{name}`"),
        why,
    )
}

/// What happens to one parameter.
#[derive(Clone, Debug)]
enum ParamPlan {
    Whole {
        #[allow(dead_code)]
        why: String,
    },
    /// Split along `dim`: each sub-parameter's per-rank sizes, and the new dim.
    Split {
        kind: &'static str,
        dim: usize,
        pieces: Vec<Vec<i64>>,
        local: Dim,
        why: String,
        gather: bool,
    },
    /// Kept whole; each rank slices `[start, start+len)` of `dim` where it is read
    /// (replicated kv heads).
    Slice {
        dim: usize,
        segs: Vec<(Dim, Dim)>,
        why: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinearKind {
    Column { gather: bool },
    Row,
    Whole,
}

/// A linear (or grouped matmul) and how its output is split.
#[derive(Clone, Debug)]
struct LinearPlan {
    kind: LinearKind,
    /// Split output (column): old and new size of each sub-part of the split dim.
    subs: Vec<(i64, Dim)>,
    /// Per-rank sizes of the split output dim (for gathers and vocab).
    sizes: Vec<i64>,
    /// The dim of the output that is split (column).
    out_dim: usize,
}

struct Tp {
    p: i64,
    grain: i64,
    vocab_grain: i64,
    /// Every value's type before the pass.
    orig: Vec<Option<TensorType>>,
    plans: BTreeMap<String, ParamPlan>,
    linears: HashMap<Node, LinearPlan>,
    /// Values whose split dim is made of sub-parts: (dim, old size and new size of each).
    subs: HashMap<Value, (usize, Vec<(i64, Dim)>)>,
    /// Values whose last dim is split over tp: the per-rank sizes.
    pieces: HashMap<Value, Vec<i64>>,
    /// Values whose type the pass changed.
    changed: HashSet<Value>,
    /// Whole parameters read together with split values: why their gradients differ per rank.
    grad_allreduce: BTreeMap<String, String>,
    /// The size of `sp` (ulysses-attention follows and needs even local heads).
    sp: Option<i64>,
    /// The all_reduces that end a row-parallel layer or the vocab-parallel embedding
    /// (sequence parallelism turns them into reduce_scatters).
    seq_reduces: Vec<Node>,
}

/// How a weight is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    LinearW,
    LinearBias,
    Embedding,
    ExpertsW,
    /// The weight of an `rms_norm`.
    NormW,
}

/// What feeds one attention: the projection of q, k and v (linear, and the split of a
/// fused output), the o projection, and the head counts.
#[derive(Clone, Debug)]
struct Attn {
    node: Node,
    q: (Node, Option<(Node, usize)>),
    k: (Node, Option<(Node, usize)>),
    v: (Node, Option<(Node, usize)>),
    o: Option<Node>,
    nq: i64,
    nkv: i64,
    d: i64,
}

fn const_of(d: &Dim) -> Option<i64> {
    d.as_const()
}

fn per_rank(sizes: &[i64]) -> Dim {
    Dim::per_rank(TP, sizes.to_vec())
}

/// `unit * tp?[sizes/unit]` when every size divides by `unit` (clean head counts).
fn per_rank_scaled(sizes: &[i64], unit: i64) -> Dim {
    if unit > 1 && sizes.iter().all(|s| s % unit == 0) {
        per_rank(&sizes.iter().map(|s| s / unit).collect::<Vec<_>>()) * unit
    } else {
        per_rank(sizes)
    }
}

fn offsets(sizes: &[i64]) -> Vec<i64> {
    let mut acc = 0;
    sizes
        .iter()
        .map(|s| {
            let o = acc;
            acc += s;
            o
        })
        .collect()
}

impl Tp {
    fn orig_ty(&self, v: Value) -> Option<&TensorType> {
        self.orig.get(v.0 as usize).and_then(|t| t.as_ref())
    }

    // ---------------------------------------------------------------- decide

    fn decide(
        &mut self,
        g: &Graph,
        rules: &Rules,
        model_type: Option<&str>,
        res: &mut PassResult,
    ) -> Result<(), PassError> {
        let params: Vec<(String, Value)> = g.params();
        let by_value: HashMap<Value, String> =
            params.iter().map(|(n, v)| (*v, n.clone())).collect();
        let uses = g.uses();
        // Uses of every parameter.
        let mut param_uses: BTreeMap<String, Vec<(Node, Use)>> = BTreeMap::new();
        for &n in g.nodes() {
            let d = g.node(n);
            let mut note = |i: usize, u: Use| {
                if let Some(name) = d.operands.get(i).and_then(|v| by_value.get(v)) {
                    param_uses.entry(name.clone()).or_default().push((n, u));
                }
            };
            match d.op {
                Op::Linear {} => {
                    note(1, Use::LinearW);
                    note(2, Use::LinearBias);
                }
                Op::Embedding { .. } => note(1, Use::Embedding),
                Op::GroupedMatmul { .. } => {
                    note(1, Use::ExpertsW);
                    note(3, Use::LinearBias);
                }
                Op::RmsNorm { .. } => note(1, Use::NormW),
                _ => {}
            }
        }
        let attns = self.attentions(g, &uses);
        let mut attn_role: HashMap<Node, (usize, &'static str)> = HashMap::new();
        for (i, a) in attns.iter().enumerate() {
            attn_role.insert(a.q.0, (i, if a.q.1.is_some() { "qkv" } else { "q" }));
            if a.k.0 != a.q.0 {
                attn_role.insert(a.k.0, (i, "k"));
            }
            if a.v.0 != a.q.0 {
                attn_role.insert(a.v.0, (i, "v"));
            }
            if let Some(o) = a.o {
                attn_role.insert(o, (i, "o"));
            }
        }
        let head_splits: Vec<Result<HeadSplit, String>> = attns
            .iter()
            .map(|a| sizes::attention_heads(a.nq, a.nkv, self.p))
            .collect();

        // Weights first (biases follow them).
        for (name, v) in &params {
            let us = param_uses.get(name).cloned().unwrap_or_default();
            let ty = g.ty(*v).clone();
            let found = rules.find_how(name, model_type);
            if !g.param_partition(name).is_empty() {
                // Split by an earlier pass (expert-parallel): left as it is.
                self.plans.insert(
                    name.clone(),
                    ParamPlan::Whole {
                        why: "already partitioned".into(),
                    },
                );
                continue;
            }
            let is_bias = !us.is_empty() && us.iter().all(|(_, u)| *u == Use::LinearBias);
            if is_bias {
                if let Some((s, true)) = found {
                    if s.partition_type == PartitionType::Row {
                        return Err(param_error(name, format!("{} ({}) partitions the 1-D bias {ty} as row; a bias has no input dim to split", s.origin, s))
                            .with_help("match the layer's weight (`...\\.weight$`) instead: a column layer splits its bias with it, a row layer adds its whole bias after the all_reduce"));
                    }
                }
                continue;
            }
            let plan = if us.iter().any(|(_, u)| *u == Use::Embedding) {
                self.decide_embedding(name, &ty, found.map(|f| f.0))?
            } else if let Some(&(n, u)) = us
                .iter()
                .find(|(_, u)| matches!(u, Use::LinearW | Use::ExpertsW))
            {
                self.decide_linear(
                    g,
                    name,
                    &ty,
                    n,
                    u,
                    found.map(|f| f.0),
                    rules.strict,
                    &attns,
                    &attn_role,
                    &head_splits,
                )?
            } else {
                match found {
                    Some((s, true)) if s.partition_type != PartitionType::Skip => {
                        return Err(param_error(name, format!("{} ({s}) asks for a {} split of {ty}, which is not a linear or embedding weight", s.origin, s.partition_type.as_str()))
                            .with_help("only `skip` applies to norms and other parameters"));
                    }
                    Some((s, _)) if s.grad_allreduce => {
                        self.grad_allreduce
                            .insert(name.clone(), format!("{}: grad_allreduce", s.origin));
                        ParamPlan::Whole {
                            why: s.origin.clone(),
                        }
                    }
                    _ => ParamPlan::Whole {
                        why: "not a linear or embedding weight".into(),
                    },
                }
            };
            // Every linear reading this weight is planned like its first one.
            for &(n, u) in &us {
                if matches!(u, Use::LinearW | Use::ExpertsW | Use::Embedding) {
                    if let Some(lp) = self.linear_plan_of(g, n, u, &plan, name, &attns, &attn_role)
                    {
                        self.linears.insert(n, lp);
                    }
                }
            }
            self.plans.insert(name.clone(), plan);
        }
        // Biases follow their linear.
        for (name, _) in &params {
            let Some(us) = param_uses.get(name) else {
                continue;
            };
            if !us.iter().all(|(_, u)| *u == Use::LinearBias) {
                continue;
            }
            let n = us[0].0;
            let w = g.node(n).operands[1];
            let wname = by_value.get(&w).cloned().unwrap_or_default();
            let experts = matches!(g.node(n).op, Op::GroupedMatmul { .. });
            let plan = match self.plans.get(&wname) {
                Some(ParamPlan::Split { pieces, local, .. })
                    if experts
                        && matches!(
                            self.linears.get(&n).map(|l| l.kind),
                            Some(LinearKind::Column { .. })
                        ) =>
                {
                    ParamPlan::Split {
                        gather: false,
                        kind: "column",
                        dim: 1,
                        pieces: pieces.clone(),
                        local: local.clone(),
                        why: format!("bias [E, out] of column-parallel experts `{wname}`"),
                    }
                }
                Some(ParamPlan::Split { .. }) if experts => ParamPlan::Whole {
                    why: format!("bias of row-parallel experts `{wname}`: each rank adds 1/tp of it before the all_reduce"),
                },
                Some(ParamPlan::Split {
                    dim, pieces, local, ..
                }) if self.linears.get(&n).map(|l| l.kind) != Some(LinearKind::Row)
                    && *dim == 0 =>
                {
                    ParamPlan::Split {
                        gather: false,
                        kind: "column",
                        dim: 0,
                        pieces: pieces.clone(),
                        local: local.clone(),
                        why: format!("bias of column-parallel `{wname}`"),
                    }
                }
                Some(ParamPlan::Slice { segs, .. }) => ParamPlan::Slice {
                    dim: 0,
                    segs: segs.clone(),
                    why: format!("bias of `{wname}` (replicated kv heads)"),
                },
                Some(ParamPlan::Split { .. }) => ParamPlan::Whole {
                    why: format!("bias of row-parallel `{wname}`: added once after the all_reduce"),
                },
                _ => ParamPlan::Whole {
                    why: format!("bias of whole `{wname}`"),
                },
            };
            self.plans.insert(name.clone(), plan);
        }
        // A norm over the whole output of a column-parallel linear (olmo2's q/k norms)
        // splits its weight with that output; the norm all-reduces its sum of squares.
        for (name, _) in &params {
            let Some(us) = param_uses.get(name) else {
                continue;
            };
            if us.is_empty() || !us.iter().all(|(_, u)| *u == Use::NormW) {
                continue;
            }
            let Some(plan) = self.whole_projection_norm_plan(g, name, us, &by_value)? else {
                continue;
            };
            self.plans.insert(name.clone(), plan);
        }
        // An attention is split whole or not at all.
        for (i, a) in attns.iter().enumerate() {
            let kind = |n: Node| {
                self.linears
                    .get(&n)
                    .map(|l| l.kind)
                    .unwrap_or(LinearKind::Whole)
            };
            let split = |n: Node| {
                matches!(kind(n), LinearKind::Column { gather: false }) || self.slices_weight(g, n)
            };
            let (q, k, v) = (split(a.q.0), split(a.k.0), split(a.v.0));
            let o = a.o.map(|o| kind(o) == LinearKind::Row).unwrap_or(false);
            if !(q || k || v || o) {
                continue;
            }
            if !(q && k && v && o) {
                let name = |n: Node| g.describe(n);
                return Err(PassError::rewrite(
                    NAME,
                    format!("`{NAME}` cannot split the attention heads"),
                    g.describe(a.node),
                    format!(
                        "its projections are split inconsistently: q {} ({}), k {} ({}), v {} ({}), o {} ({})",
                        if q { "split" } else { "whole" }, name(a.q.0),
                        if k { "split" } else { "whole" }, name(a.k.0),
                        if v { "split" } else { "whole" }, name(a.v.0),
                        if o { "row" } else { "not row" }, a.o.map(name).unwrap_or_else(|| "none found".into()),
                    ),
                )
                .with_help("split q, k and v column-parallel and o row-parallel, or skip all four"));
            }
            if let Err(why) = &head_splits[i] {
                return Err(PassError::rewrite(
                    NAME,
                    format!(
                        "`{NAME}` cannot split the attention heads over tp={}",
                        self.p
                    ),
                    g.describe(a.node),
                    why.clone(),
                )
                .with_help("use a tp degree no larger than the number of q heads"));
            }
            if let (Ok(h), Some(sp)) = (&head_splits[i], self.sp.filter(|&sp| sp > 1)) {
                let uneven = h.q.iter().any(|&x| x != h.q[0]) || h.kv.iter().any(|&x| x != h.kv[0]);
                if uneven || h.q[0] % sp != 0 {
                    let good: Vec<String> = (1..=a.nq)
                        .filter(|t| a.nq % (t * sp) == 0 && (a.nkv % t == 0 || t % a.nkv == 0))
                        .map(|t| t.to_string())
                        .collect();
                    return Err(PassError::rewrite(
                        NAME,
                        format!("`{NAME}` cannot split the attention heads over tp={} with sp={sp}", self.p),
                        g.describe(a.node),
                        format!("each tp rank would hold {:?} q heads, and ulysses-attention over sp needs the same number on every rank, divisible by sp", h.q),
                    )
                    .with_help(format!("use a tp degree that works with sp={sp} for {} q / {} kv heads: {}", a.nq, a.nkv, good.join(", "))));
                }
            }
            res.count("attention_layers", 1);
            // Learned sinks (one logit per q head) split with the q heads.
            let d = g.node(a.node);
            if let Some(Ok(slots)) = d.op.attention_operands(d.operands.len()) {
                if let (Some(s), Ok(h)) = (slots.sinks, &head_splits[i]) {
                    if let Some(name) = by_value.get(&d.operands[s]) {
                        self.plans.insert(
                            name.clone(),
                            ParamPlan::Split {
                                kind: "column",
                                dim: 0,
                                pieces: vec![h.q.clone()],
                                local: per_rank(&h.q),
                                why: "attention sinks: one per q head, split with the heads".into(),
                                gather: false,
                            },
                        );
                    } else {
                        return Err(PassError::rewrite(
                            NAME,
                            format!("`{NAME}` cannot split the attention sinks"),
                            g.describe(a.node),
                            format!("its sinks {} are not a parameter", d.operands[s]),
                        ));
                    }
                }
            }
            if head_splits[i]
                .as_ref()
                .is_ok_and(|h| h.kv_replicated.is_some())
            {
                res.count("kv_heads_replicated", 1);
            }
        }
        Ok(())
    }

    /// The plan of a norm weight whose every norm reads the whole output of one
    /// column-parallel linear: split like that output. `None` when the norms read
    /// something else (the weight is then planned like any other).
    fn whole_projection_norm_plan(
        &self,
        g: &Graph,
        name: &str,
        uses: &[(Node, Use)],
        by_value: &HashMap<Value, String>,
    ) -> Result<Option<ParamPlan>, PassError> {
        let mut linear = None;
        for &(norm, _) in uses {
            let x = g.node(norm).operands[0];
            let lin = g.def(x);
            if !matches!(g.node(lin).op, Op::Linear {}) || linear.is_some_and(|l| l != lin) {
                return Ok(None);
            }
            linear = Some(lin);
        }
        let Some(lin) = linear else { return Ok(None) };
        if self.linears.get(&lin).map(|l| l.kind) != Some(LinearKind::Column { gather: false })
            && !self.slices_weight(g, lin)
        {
            return Ok(None);
        }
        let wname = by_value
            .get(&g.node(lin).operands[1])
            .cloned()
            .unwrap_or_default();
        match self.plans.get(&wname) {
            Some(ParamPlan::Split {
                dim: 0,
                pieces,
                local,
                ..
            }) => Ok(Some(ParamPlan::Split {
                gather: false,
                kind: "column",
                dim: 0,
                pieces: pieces.clone(),
                local: local.clone(),
                why: format!("norm over the whole output of column-parallel `{wname}`"),
            })),
            Some(ParamPlan::Slice { .. }) => Err(param_error(
                name,
                format!(
                    "normalises over the whole output of `{wname}`, whose heads are replicated over tp (more tp ranks than kv heads); the split norm is not implemented for replicated heads"
                ),
            )
            .with_help("use a tp degree no larger than num_key_value_heads")),
            _ => Ok(None),
        }
    }

    /// `rms_norm(x, w)` over a last dim split over tp, as its parts: the sum of squares
    /// of this rank's features is all-reduced over tp, so every rank divides by the
    /// mean over all features. The node becomes the final `* w` (its result is kept).
    fn split_rms_norm(
        &mut self,
        g: &mut Graph,
        n: Node,
        eps: f64,
        res: &mut PassResult,
    ) -> Result<(), PassError> {
        let (x, w) = (g.node(n).operands[0], g.node(n).operands[1]);
        if !self.changed.contains(&w) {
            return Err(self.mixing_error(g, n, 0, g.ty(x).rank() - 1));
        }
        let total: i64 = match (self.pieces.get(&x), self.orig_ty(x)) {
            (Some(ps), _) => ps.iter().sum(),
            (None, Some(t)) => t.shape.last().and_then(|d| d.as_const()).unwrap_or(0),
            (None, None) => 0,
        };
        if total <= 0 {
            return Err(self.mixing_error(g, n, 0, g.ty(x).rank() - 1));
        }
        let dtype = g.ty(x).dtype;
        let at = At::Before(n);
        let m = |g: &Graph, r: &str| meta_for(g, n, NAME, format!("rms_norm split over tp: {r}"));
        let mut xf = x;
        if dtype != DType::F32 {
            xf = insert1(
                g,
                NAME,
                at,
                Op::Cast { dtype: DType::F32 },
                &[x],
                m(g, "in f32"),
            )?;
        }
        let sq = insert1(g, NAME, at, Op::Mul {}, &[xf, xf], m(g, "squares"))?;
        let local = insert1(
            g,
            NAME,
            at,
            Op::Sum {
                dims: vec![-1],
                keepdim: true,
            },
            &[sq],
            m(g, "sum of this rank's squares"),
        )?;
        let t = g.ty(local).clone();
        let reason = format!(
            "sum of squares over every rank's features, {} bytes",
            t.numel() * t.dtype.size_bytes() as i64
        );
        let sum = insert1(
            g,
            NAME,
            at,
            Op::AllReduce {
                axis: TP.into(),
                op: ReduceOp::Sum,
            },
            &[local],
            m(g, &reason),
        )?;
        res.count("all_reduce", 1);
        let mean = insert1(
            g,
            NAME,
            at,
            Op::Scale {
                factor: Float(1.0 / total as f64),
            },
            &[sum],
            m(g, &format!("mean over all {total} features")),
        )?;
        let var = insert1(
            g,
            NAME,
            at,
            Op::AddScalar { value: Float(eps) },
            &[mean],
            m(g, "+ eps"),
        )?;
        let r = insert1(g, NAME, at, Op::Rsqrt {}, &[var], m(g, "rsqrt"))?;
        let mut y = insert1(g, NAME, at, Op::Mul {}, &[xf, r], m(g, "normalised"))?;
        if dtype != DType::F32 {
            y = insert1(
                g,
                NAME,
                at,
                Op::Cast { dtype },
                &[y],
                m(g, "back to the input dtype"),
            )?;
        }
        let d = g.node_mut(n);
        d.op = Op::Mul {};
        d.operands = vec![y, w];
        d.meta.provenance = Some(Provenance {
            pass: NAME.into(),
            reason: "rms_norm split over tp: times this rank's slice of the weight".into(),
        });
        self.reinfer(g, n)?;
        if let Some(ps) = self.pieces.get(&x).cloned() {
            let r = g.node(n).results[0];
            self.pieces.insert(r, ps);
        }
        Ok(())
    }

    fn slices_weight(&self, g: &Graph, n: Node) -> bool {
        let w = g.node(n).operands[1];
        g.params().iter().any(|(name, v)| {
            *v == w && matches!(self.plans.get(name), Some(ParamPlan::Slice { .. }))
        })
    }

    fn decide_embedding(
        &self,
        name: &str,
        ty: &TensorType,
        s: Option<&LayerSpec>,
    ) -> Result<ParamPlan, PassError> {
        let Some(s) = s else {
            return Ok(ParamPlan::Whole {
                why: "no layer spec matches".into(),
            });
        };
        if s.partition_type == PartitionType::Skip {
            return Ok(ParamPlan::Whole {
                why: s.origin.clone(),
            });
        }
        if s.partition_dim.is_some_and(|d| d != 0) {
            return Err(param_error(name, format!("{} splits the embedding {ty} on dim {}; only the vocabulary (dim 0) can be split", s.origin, s.partition_dim.unwrap_or(0)))
                .with_help("give the embedding `partition_dim: 0` or `skip`"));
        }
        let v = const_of(&ty.shape[0]).ok_or_else(|| {
            param_error(
                name,
                format!("its vocabulary size in {ty} is not a constant"),
            )
        })?;
        let sizes = sizes::grain_sizes(v, self.p, self.vocab_grain);
        if sizes.contains(&0) {
            return Err(param_error(
                name,
                format!(
                    "{v} vocabulary rows over tp={} leave a rank with none",
                    self.p
                ),
            ));
        }
        Ok(ParamPlan::Split {
            kind: "vocab",
            dim: 0,
            local: per_rank(&sizes),
            pieces: vec![sizes],
            why: format!("vocab-parallel embedding ({})", s.origin),
            gather: false,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn decide_linear(
        &mut self,
        g: &Graph,
        name: &str,
        ty: &TensorType,
        n: Node,
        u: Use,
        s: Option<&LayerSpec>,
        strict: bool,
        attns: &[Attn],
        attn_role: &HashMap<Node, (usize, &'static str)>,
        heads: &[Result<HeadSplit, String>],
    ) -> Result<ParamPlan, PassError> {
        let Some(s) = s else {
            if strict {
                return Err(param_error(
                    name,
                    format!("no layer spec matches this linear weight {ty} and the spec is strict"),
                )
                .with_help(
                    "add a layer spec for it (`\"partition_type\": \"skip\"` keeps it whole)",
                ));
            }
            return Ok(ParamPlan::Whole {
                why: "no layer spec matches".into(),
            });
        };
        let experts = u == Use::ExpertsW;
        // gpt-oss stores its experts transposed, [E, in, out].
        let transposed = matches!(g.node(n).op, Op::GroupedMatmul { transpose_w } if transpose_w.0);
        let (col_dim, row_dim) = match (experts, transposed) {
            (true, true) => (2, 1),
            (true, false) => (1, 2),
            _ => (0, 1),
        };
        let dim = match s.partition_type {
            PartitionType::Skip => {
                if s.grad_allreduce {
                    self.grad_allreduce
                        .insert(name.to_string(), format!("{}: grad_allreduce", s.origin));
                }
                return Ok(ParamPlan::Whole {
                    why: s.origin.clone(),
                });
            }
            PartitionType::Column => col_dim,
            PartitionType::Row => row_dim,
        };
        if let Some(d) = s.partition_dim {
            if d != dim {
                return Err(param_error(
                    name,
                    format!("{} ({s}) asks for partition_dim {d} of {ty}, but a {} split of this {} is dim {dim}", s.origin, s.partition_type.as_str(), if experts { "expert weight [E, out, in]" } else { "linear weight [out, in]" }),
                )
                .with_help(format!("use partition_dim {dim} or leave it out")));
            }
        }
        if let Some(shape) = &s.shape {
            if shape.len() != ty.rank() {
                return Err(param_error(name, format!("{} gives a shape of {} dims for the {}-dim {ty}; views of other ranks are not supported", s.origin, shape.len(), ty.rank())));
            }
        }
        let total = const_of(&ty.shape[dim])
            .ok_or_else(|| param_error(name, format!("dim {dim} of {ty} is not a constant")))?;
        let kind = if s.partition_type == PartitionType::Column {
            "column"
        } else {
            "row"
        };
        let why = format!("{kind}-parallel ({})", s.origin);
        // Attention projections split on head boundaries.
        if let Some(&(i, role)) = attn_role.get(&n) {
            let a = &attns[i];
            let h = match &heads[i] {
                Ok(h) => h.clone(),
                Err(e) => return Err(param_error(name, e.clone())),
            };
            let (q, kv) = (
                h.q.iter().map(|x| x * a.d).collect::<Vec<_>>(),
                h.kv.iter().map(|x| x * a.d).collect::<Vec<_>>(),
            );
            let (ql, kvl) = (per_rank_scaled(&q, a.d), per_rank_scaled(&kv, a.d));
            match (role, s.partition_type) {
                ("q", PartitionType::Column) | ("o", PartitionType::Row) => {
                    check_subs(name, s, dim, &[a.nq * a.d])?;
                    return Ok(ParamPlan::Split {
                        kind: if role == "o" { "row" } else { "column" },
                        dim,
                        pieces: vec![q],
                        local: ql,
                        why,
                        gather: s.gather_output,
                    });
                }
                ("k" | "v", PartitionType::Column) => {
                    check_subs(name, s, dim, &[a.nkv * a.d])?;
                    if let Some(which) = &h.kv_replicated {
                        let start = per_rank(&which.iter().map(|w| w * a.d).collect::<Vec<_>>());
                        return Ok(ParamPlan::Slice { dim, segs: vec![(start, Dim::from(a.d))], why: format!("kv heads replicated: {} kv heads for tp={}, each rank slices the one its q heads use ({})", a.nkv, self.p, s.origin) });
                    }
                    return Ok(ParamPlan::Split {
                        kind: "column",
                        dim,
                        pieces: vec![kv],
                        local: kvl,
                        why,
                        gather: s.gather_output,
                    });
                }
                ("qkv", PartitionType::Column) => {
                    let want = [a.nq * a.d, a.nkv * a.d, a.nkv * a.d];
                    check_subs(name, s, dim, &want)?;
                    if let Some(which) = &h.kv_replicated {
                        // The fused weight stays whole: each rank slices its q rows and
                        // the rows of the one kv head its q heads use, from k and v.
                        let q_start = per_rank(&offsets(&q));
                        let kv_at = |base: i64| {
                            per_rank(&which.iter().map(|w| base + w * a.d).collect::<Vec<_>>())
                        };
                        let segs = vec![
                            (q_start, ql.clone()),
                            (kv_at(want[0]), Dim::from(a.d)),
                            (kv_at(want[0] + want[1]), Dim::from(a.d)),
                        ];
                        self.subs_for_linear(
                            n,
                            vec![
                                (want[0], ql),
                                (want[1], Dim::from(a.d)),
                                (want[2], Dim::from(a.d)),
                            ],
                        );
                        return Ok(ParamPlan::Slice { dim, segs, why: format!("kv heads replicated: {} kv heads for tp={}, each rank slices its q rows and the kv head they use ({})", a.nkv, self.p, s.origin) });
                    }
                    let local = ql.clone() + kvl.clone() + kvl.clone();
                    self.subs_for_linear(
                        n,
                        vec![(want[0], ql), (want[1], kvl.clone()), (want[2], kvl)],
                    );
                    return Ok(ParamPlan::Split {
                        kind: "column",
                        dim,
                        pieces: vec![q, kv.clone(), kv],
                        local,
                        why,
                        gather: s.gather_output,
                    });
                }
                _ => {}
            }
        }
        // Sub-parameters: from the spec's shape, else from the split that follows.
        let following = following_split(
            g,
            n,
            if experts {
                1
            } else {
                g.ty(g.node(n).results[0]).rank() - 1
            },
        );
        let subs: Vec<i64> = match s.sub_params(dim) {
            Some(Ok(k)) => {
                if total % k != 0 {
                    return Err(param_error(name, format!("{} splits dim {dim} ({total}) into {k} equal sub-parameters, which does not divide", s.origin)));
                }
                vec![total / k; k as usize]
            }
            Some(Err(v)) => v,
            None if s.partition_type == PartitionType::Column => {
                following.clone().unwrap_or_else(|| vec![total])
            }
            None => vec![total],
        };
        if subs.iter().sum::<i64>() != total {
            return Err(param_error(
                name,
                format!(
                    "{}: sub-parameter sizes {subs:?} sum to {}, but dim {dim} of {ty} is {total}",
                    s.origin,
                    subs.iter().sum::<i64>()
                ),
            ));
        }
        if s.partition_type == PartitionType::Column {
            if let Some(f) = &following {
                if *f != subs && subs.len() > 1 {
                    return Err(param_error(name, format!("{}: sub-parameters {subs:?} differ from the split that follows the layer ({f:?})", s.origin)));
                }
            }
        }
        let is_vocab = !experts
            && g.node(n)
                .meta
                .source
                .as_deref()
                .is_some_and(|src| src.ends_with("lm_head"))
            || name.ends_with("lm_head.weight");
        let grain = if is_vocab && s.partition_type == PartitionType::Column {
            self.vocab_grain
        } else {
            self.grain
        };
        let pieces: Vec<Vec<i64>> = subs
            .iter()
            .map(|&t| {
                if transposed && s.partition_type == PartitionType::Column && t % 2 == 0 {
                    // gpt-oss interleaves gate and up columns: split whole (gate, up) pairs
                    sizes::grain_sizes(t / 2, self.p, grain)
                        .into_iter()
                        .map(|x| 2 * x)
                        .collect()
                } else {
                    sizes::grain_sizes(t, self.p, grain)
                }
            })
            .collect();
        if pieces.iter().any(|pc| pc.contains(&0)) {
            return Err(param_error(
                name,
                format!(
                    "splitting dim {dim} ({total}) over tp={} leaves a rank with nothing",
                    self.p
                ),
            ));
        }
        let locals: Vec<Dim> = pieces.iter().map(|pc| per_rank(pc)).collect();
        let local = locals.iter().fold(Dim::zero(), |a, b| a + b.clone());
        if s.partition_type == PartitionType::Column && subs.len() > 1 {
            self.subs_for_linear(n, subs.iter().copied().zip(locals).collect());
        }
        Ok(ParamPlan::Split {
            kind,
            dim,
            pieces,
            local,
            why,
            gather: s.gather_output,
        })
    }

    fn subs_for_linear(&mut self, n: Node, subs: Vec<(i64, Dim)>) {
        self.linears
            .entry(n)
            .or_insert(LinearPlan {
                kind: LinearKind::Whole,
                subs: vec![],
                sizes: vec![],
                out_dim: 0,
            })
            .subs = subs;
    }

    /// The plan of a linear / grouped matmul / embedding reading a weight planned `plan`.
    #[allow(clippy::too_many_arguments)]
    fn linear_plan_of(
        &self,
        g: &Graph,
        n: Node,
        u: Use,
        plan: &ParamPlan,
        _name: &str,
        _attns: &[Attn],
        _roles: &HashMap<Node, (usize, &'static str)>,
    ) -> Option<LinearPlan> {
        let subs = self
            .linears
            .get(&n)
            .map(|l| l.subs.clone())
            .unwrap_or_default();
        let out_rank = g.ty(g.node(n).results[0]).rank();
        match (u, plan) {
            (Use::Embedding, _) => None,
            (
                _,
                ParamPlan::Split {
                    kind,
                    dim,
                    pieces,
                    gather,
                    ..
                },
            ) => {
                let sizes: Vec<i64> = (0..self.p as usize)
                    .map(|r| pieces.iter().map(|pc| pc[r]).sum())
                    .collect();
                let transposed =
                    matches!(g.node(n).op, Op::GroupedMatmul { transpose_w } if transpose_w.0);
                let col = (u == Use::LinearW && *dim == 0)
                    || (u == Use::ExpertsW && *dim == if transposed { 2 } else { 1 });
                let gather = *kind != "vocab" && *gather;
                Some(LinearPlan {
                    kind: if col {
                        LinearKind::Column { gather }
                    } else {
                        LinearKind::Row
                    },
                    subs,
                    sizes,
                    out_dim: if u == Use::ExpertsW { 1 } else { out_rank - 1 },
                })
            }
            (_, ParamPlan::Slice { .. }) => Some(LinearPlan {
                kind: LinearKind::Column { gather: false },
                subs,
                sizes: vec![],
                out_dim: out_rank - 1,
            }),
            (_, ParamPlan::Whole { .. }) => Some(LinearPlan {
                kind: LinearKind::Whole,
                subs: vec![],
                sizes: vec![],
                out_dim: out_rank - 1,
            }),
        }
    }

    /// Every attention whose q, k, v come from linears.
    fn attentions(&self, g: &Graph, uses: &[Vec<(Node, usize)>]) -> Vec<Attn> {
        let mut out = Vec::new();
        for &n in g.nodes() {
            if !matches!(g.node(n).op, Op::Attention { .. }) {
                continue;
            }
            let ops = &g.node(n).operands;
            let (Some(q), Some(k), Some(v)) = (
                trace_back(g, ops[0]),
                trace_back(g, ops[1]),
                trace_back(g, ops[2]),
            ) else {
                continue;
            };
            let (qt, kt) = (g.ty(ops[0]), g.ty(ops[1]));
            let (Some(nq), Some(nkv), Some(d)) = (
                const_of(&qt.shape[1]),
                const_of(&kt.shape[1]),
                const_of(&qt.shape[3]),
            ) else {
                continue;
            };
            let o = trace_forward(g, g.node(n).results[0], uses);
            out.push(Attn {
                node: n,
                q,
                k,
                v,
                o,
                nq,
                nkv,
                d,
            });
        }
        out
    }

    // ---------------------------------------------------------------- apply

    fn apply_params(&mut self, g: &mut Graph, res: &mut PassResult) -> Result<(), PassError> {
        let params = g.params();
        let uses = g.uses();
        for (name, v) in params {
            let n = g.def(v);
            match self.plans.get(&name).cloned() {
                Some(ParamPlan::Split {
                    kind,
                    dim,
                    pieces,
                    local,
                    why,
                    ..
                }) => {
                    let Op::Param { ty, .. } = &g.node(n).op else {
                        continue;
                    };
                    let mut ty = ty.clone();
                    ty.shape[dim] = local;
                    let reason = format!(
                        "{why}: dim {dim} per rank {}",
                        Partition {
                            kind: kind.into(),
                            axes: vec![TP.into()],
                            dim,
                            pieces: pieces.clone()
                        }
                    );
                    let d = g.node_mut(n);
                    d.op = Op::Param {
                        name: name.clone(),
                        ty,
                    };
                    d.meta.provenance = Some(Provenance {
                        pass: NAME.into(),
                        reason,
                    });
                    g.reinfer(n)
                        .map_err(|e| crate::util::build_error(NAME, e))?;
                    g.add_param_partition(
                        &name,
                        Partition {
                            kind: kind.into(),
                            axes: vec![TP.into()],
                            dim,
                            pieces,
                        },
                    );
                    self.changed.insert(v);
                    res.count("params_split", 1);
                }
                Some(ParamPlan::Slice { dim, segs, why }) => {
                    for &(user, i) in &uses[v.0 as usize] {
                        let mut parts = Vec::new();
                        for (start, len) in &segs {
                            let meta = meta_for(
                                g,
                                user,
                                NAME,
                                format!("`{name}` rows [{start}, +{len}) of this rank: {why}"),
                            );
                            parts.push(insert1(
                                g,
                                NAME,
                                At::Before(user),
                                Op::Slice {
                                    dim: dim as i64,
                                    start: start.clone(),
                                    len: len.clone(),
                                },
                                &[v],
                                meta,
                            )?);
                        }
                        let s = if parts.len() == 1 {
                            parts[0]
                        } else {
                            let meta = meta_for(
                                g,
                                user,
                                NAME,
                                format!(
                                    "`{name}`: this rank's rows of each sub-parameter, in order"
                                ),
                            );
                            insert1(
                                g,
                                NAME,
                                At::Before(user),
                                Op::Concat { dim: dim as i64 },
                                &parts,
                                meta,
                            )?
                        };
                        g.node_mut(user).operands[i] = s;
                        self.changed.insert(s);
                    }
                    self.grad_allreduce.insert(
                        name.clone(),
                        "kv heads replicated: each rank reads the kv head its q heads use".into(),
                    );
                    res.count("params_sliced", 1);
                }
                _ => {}
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- propagate

    fn propagate(&mut self, g: &mut Graph, res: &mut PassResult) -> Result<(), PassError> {
        let order: Vec<Node> = g.nodes().to_vec();
        for n in order {
            if g.try_node(n).is_none() || made_by(g, n, NAME) {
                continue;
            }
            let d = g.node(n);
            if matches!(d.op, Op::Param { .. }) {
                continue;
            }
            let touched = d.operands.iter().any(|v| self.changed.contains(v));
            let planned = self
                .linears
                .get(&n)
                .is_some_and(|l| l.kind != LinearKind::Whole);
            if !touched && !planned {
                continue;
            }
            self.note_whole_params(g, n);
            self.visit(g, n, res)?;
            let Some(d) = g.try_node(n) else { continue };
            let results = d.results.clone();
            for v in results {
                if self.orig_ty(v).is_some_and(|t| t != g.ty(v)) {
                    self.changed.insert(v);
                }
            }
        }
        Ok(())
    }

    /// Whole parameters read by a node with split operands get per-rank gradients.
    fn note_whole_params(&mut self, g: &Graph, n: Node) {
        let d = g.node(n);
        if !d.operands.iter().any(|v| self.changed.contains(v)) {
            return;
        }
        for v in &d.operands {
            // Through elementwise ops of the weight alone (gemma's `(1 + w)` norm weight).
            let mut v = *v;
            while let (Op::Cast { .. } | Op::AddScalar { .. } | Op::Scale { .. }, [x]) =
                (g.op_of(v), g.node(g.def(v)).operands.as_slice())
            {
                v = *x;
            }
            if let Op::Param { name, .. } = g.op_of(v) {
                if matches!(self.plans.get(name), Some(ParamPlan::Whole { .. }))
                    && !self.grad_allreduce.contains_key(name)
                {
                    self.grad_allreduce.insert(
                        name.clone(),
                        format!("read by `{}` on split values", d.op.name()),
                    );
                }
            }
        }
    }

    /// A whole value broadcast by `expand` and joined by `concat` to values split over
    /// tp (multi-head latent attention's shared rope key, expanded to every head and
    /// concatenated with each head's own key part) takes the per-rank size of the split
    /// dim: each rank broadcasts it to its own heads only. Only an `expand` whose sole
    /// use is this concat, along a dim it broadcasts from size 1, is rewritten.
    fn follow_broadcasts_into_concat(
        &mut self,
        g: &mut Graph,
        n: Node,
        dim: i64,
    ) -> Result<(), PassError> {
        let operands = g.node(n).operands.clone();
        let rank = g.ty(operands[0]).rank();
        let Ok(cat) = weft_ir::shape::norm_dim(dim, rank) else {
            return Ok(());
        };
        for k in (0..rank).filter(|&k| k != cat) {
            let Some(size) = operands
                .iter()
                .find(|&&v| self.split_dims(g, v).contains(&k))
                .map(|&v| g.ty(v).shape[k].clone())
            else {
                continue;
            };
            for &v in &operands {
                if g.ty(v).shape[k] == size {
                    continue;
                }
                let e = g.def(v);
                let Op::Expand { shape } = g.node(e).op.clone() else {
                    continue;
                };
                let x = g.node(e).operands[0];
                let xt = g.ty(x).clone();
                let off = shape.len() - xt.rank();
                let broadcast = k < off || xt.shape[k - off] == Dim::from(1);
                if !broadcast || g.uses_of(v).len() != 1 {
                    continue;
                }
                let mut shape = shape;
                shape[k] = size.clone();
                g.node_mut(e).op = Op::Expand { shape };
                self.reinfer(g, e)?;
            }
        }
        Ok(())
    }

    fn reinfer(&self, g: &mut Graph, n: Node) -> Result<(), PassError> {
        g.reinfer(n).map_err(|e| {
            PassError::rewrite(NAME, format!("`{NAME}` cannot give `{}` per-rank sizes", e.op), e.location, e.message)
                .with_help("the layer specs split this layer's operands inconsistently (e.g. a column layer feeding a whole one); check the specs that match its parameters")
        })
    }

    fn split_dims(&self, g: &Graph, v: Value) -> Vec<usize> {
        match self.orig_ty(v) {
            Some(o) if o.rank() == g.ty(v).rank() => (0..o.rank())
                .filter(|&i| o.shape[i] != g.ty(v).shape[i])
                .collect(),
            _ => vec![],
        }
    }

    fn mixing_error(&self, g: &Graph, n: Node, operand: usize, dim: usize) -> PassError {
        let v = g.node(n).operands[operand];
        PassError::rewrite(
            NAME,
            format!("`{NAME}` cannot split `{}` over tp", g.node(n).op.name()),
            g.describe(n),
            format!(
                "it combines values along dim {dim} of {v} ({}), which is split over tp",
                g.ty(v)
            ),
        )
        .with_help("skip (or gather_output) the layer that produces this value in the layer specs")
    }

    fn visit(&mut self, g: &mut Graph, n: Node, res: &mut PassResult) -> Result<(), PassError> {
        let op = g.node(n).op.clone();
        let operands = g.node(n).operands.clone();
        let dims_of = |i: usize| self.split_dims(g, operands[i]);
        if let Op::RmsNorm { eps } = op {
            let last = g.ty(operands[0]).rank().saturating_sub(1);
            if dims_of(0).contains(&last) {
                return self.split_rms_norm(g, n, eps.0, res);
            }
        }
        // Ops that combine values along a dim.
        let mixes: Vec<(usize, i64)> = match &op {
            Op::RmsNorm { .. } => vec![(0, -1)],
            Op::Softmax { dim } | Op::LogSoftmax { dim } | Op::Topk { dim, .. } => vec![(0, *dim)],
            Op::Sum { dims, .. } | Op::Mean { dims, .. } | Op::Max { dims, .. } => {
                dims.iter().map(|&k| (0, k)).collect()
            }
            Op::Attention { .. } => vec![(0, 3), (1, 3), (2, 3), (0, 2), (1, 2)],
            Op::Rope { .. } => vec![(0, 3)],
            Op::Matmul {
                transpose_a,
                transpose_b,
            } => vec![
                (0, if *transpose_a { -2 } else { -1 }),
                (1, if *transpose_b { -1 } else { -2 }),
            ],
            Op::Gather { dim } | Op::IndexSelect { dim } => vec![(0, *dim)],
            Op::AllGather { dim, .. } | Op::Zigzag { dim, .. } => vec![(0, *dim)],
            Op::MoeDispatch { .. } | Op::MoeCombine {} => vec![(0, -1)],
            _ => vec![],
        };
        for (i, k) in mixes {
            let Some(&v) = operands.get(i) else { continue };
            let r = g.ty(v).rank();
            let Ok(k) = weft_ir::shape::norm_dim(k, r) else {
                continue;
            };
            if dims_of(i).contains(&k) {
                return Err(self.mixing_error(g, n, i, k));
            }
        }
        match op {
            Op::Linear {} | Op::GroupedMatmul { .. } => self.visit_linear(g, n, res),
            Op::Embedding { .. } => self.vocab_embedding(g, n, res),
            Op::CrossEntropy {
                ignore_index,
                reduction,
            } => self.vocab_cross_entropy(g, n, ignore_index, reduction, res),
            Op::CountValid { .. } | Op::ShiftLabels { .. } => self.reinfer(g, n),
            Op::Reshape { shape } => {
                let x = operands[0];
                let old_in = self.orig_ty(x).cloned().unwrap_or_else(|| g.ty(x).clone());
                let new_in = g.ty(x).clone();
                let target =
                    reshape_target(&old_in.shape, &new_in.shape, &shape, g).ok_or_else(|| {
                        PassError::rewrite(
                            NAME,
                            format!("`{NAME}` cannot follow the split through `reshape`"),
                            g.describe(n),
                            format!("cannot match {old_in} -> {shape:?} dim groups"),
                        )
                    })?;
                g.node_mut(n).op = Op::Reshape { shape: target };
                self.reinfer(g, n)?;
                if let Some(ps) = self.pieces.get(&x).cloned() {
                    let r = g.node(n).results[0];
                    if g.ty(r).shape.last() == new_in.shape.last() {
                        self.pieces.insert(r, ps);
                    }
                }
                Ok(())
            }
            Op::Split { dim, sizes } => {
                let x = operands[0];
                let k = weft_ir::shape::norm_dim(dim, g.ty(x).rank())
                    .map_err(|m| PassError::rewrite(NAME, "bad split", g.describe(n), m))?;
                if dims_of(0).contains(&k) {
                    let new_sizes = match self.subs.get(&x) {
                        Some((sd, subs))
                            if *sd == k
                                && subs.len() == sizes.len()
                                && subs
                                    .iter()
                                    .zip(&sizes)
                                    .all(|((o, _), s)| Dim::from(*o) == *s) =>
                        {
                            subs.iter().map(|(_, d)| d.clone()).collect()
                        }
                        _ => return Err(PassError::rewrite(
                            NAME,
                            format!("`{NAME}` cannot split the sub-parameters of a fused output"),
                            g.describe(n),
                            format!(
                                "its sizes [{}] are not the sub-parameters the layer was split by",
                                sizes
                                    .iter()
                                    .map(|d| d.to_string())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        )
                        .with_help(
                            "give the fused layer's spec a `shape` with these sub-parameter sizes",
                        )),
                    };
                    g.node_mut(n).op = Op::Split {
                        dim,
                        sizes: new_sizes,
                    };
                }
                self.reinfer(g, n)
            }
            Op::Expand { shape } => {
                let xt = g.ty(operands[0]).clone();
                let off = shape.len() - xt.rank();
                let one = Dim::from(1);
                let shape = shape
                    .iter()
                    .enumerate()
                    .map(|(i, d)| {
                        if i >= off && xt.shape[i - off] != one {
                            xt.shape[i - off].clone()
                        } else {
                            d.clone()
                        }
                    })
                    .collect();
                g.node_mut(n).op = Op::Expand { shape };
                self.reinfer(g, n)
            }
            Op::Slice { dim, start, len } => {
                let x = operands[0];
                let k = weft_ir::shape::norm_dim(dim, g.ty(x).rank())
                    .map_err(|m| PassError::rewrite(NAME, "bad slice", g.describe(n), m))?;
                if dims_of(0).contains(&k) {
                    let old = self.orig_ty(x).map(|t| t.shape[k].clone());
                    if start.as_const() != Some(0) || old.as_ref() != Some(&len) {
                        return Err(self.mixing_error(g, n, 0, k));
                    }
                    g.node_mut(n).op = Op::Slice {
                        dim,
                        start,
                        len: g.ty(x).shape[k].clone(),
                    };
                }
                self.reinfer(g, n)
            }
            Op::Concat { dim } => {
                self.follow_broadcasts_into_concat(g, n, dim)?;
                self.reinfer(g, n)
            }
            // Unary elementwise ops (the op table's class) keep the split of their
            // operand (granite's logit scale); so do a context-parallel gather and
            // zigzag, which move only the sequence.
            op if matches!(op, Op::Zigzag { .. } | Op::AllGather { .. })
                || op.elementwise() == Some(weft_ir::Elementwise::Unary) =>
            {
                self.reinfer(g, n)?;
                if let Some(ps) = self.pieces.get(&operands[0]).cloned() {
                    let r = g.node(n).results[0];
                    self.pieces.insert(r, ps);
                }
                Ok(())
            }
            _ => self.reinfer(g, n),
        }
    }

    fn visit_linear(
        &mut self,
        g: &mut Graph,
        n: Node,
        res: &mut PassResult,
    ) -> Result<(), PassError> {
        let Some(lp) = self.linears.get(&n).cloned() else {
            return self.reinfer(g, n);
        };
        let experts = matches!(g.node(n).op, Op::GroupedMatmul { .. });
        match lp.kind {
            LinearKind::Whole => self.reinfer(g, n),
            LinearKind::Column { gather } => {
                self.reinfer(g, n)?;
                let out = g.node(n).results[0];
                if !lp.subs.is_empty() {
                    self.subs.insert(out, (lp.out_dim, lp.subs.clone()));
                }
                if lp.out_dim + 1 == g.ty(out).rank() && !lp.sizes.is_empty() {
                    self.pieces.insert(out, lp.sizes.clone());
                }
                if gather {
                    let users = g.uses_of(out);
                    let whole = gather_uneven(
                        g,
                        n,
                        out,
                        lp.out_dim,
                        &lp.sizes,
                        "gather_output: every rank gets the whole output",
                    )?;
                    for (u, i) in users {
                        g.node_mut(u).operands[i] = whole;
                    }
                    let outs: Vec<(String, Value)> = g
                        .outputs()
                        .iter()
                        .filter(|(_, v)| *v == out)
                        .cloned()
                        .collect();
                    for (name, _) in outs {
                        g.set_output(&name, whole);
                    }
                    res.count("all_gather", 1);
                }
                Ok(())
            }
            LinearKind::Row => {
                let bias = if experts {
                    None
                } else {
                    g.node(n).operands.get(2).copied()
                };
                if bias.is_some() {
                    g.node_mut(n).operands.truncate(2);
                }
                if let (true, Some(&b)) = (experts, g.node(n).operands.get(3)) {
                    // Each expert row's bias depends on its group, so it cannot be added
                    // after the all_reduce as one tensor: every rank adds 1/tp of it.
                    let meta = meta_for(
                        g,
                        n,
                        NAME,
                        "row-parallel experts' bias: each rank adds 1/tp of it, the all_reduce sums them",
                    );
                    let part = insert1(
                        g,
                        NAME,
                        At::Before(n),
                        Op::Scale {
                            factor: weft_ir::Float(1.0 / self.p as f64),
                        },
                        &[b],
                        meta,
                    )?;
                    g.node_mut(n).operands[3] = part;
                }
                self.reinfer(g, n)?;
                let out = g.node(n).results[0];
                let t = g.ty(out).clone();
                let reason = format!(
                    "row-parallel: sum the partial products of every rank, {} bytes",
                    t.numel() * t.dtype.size_bytes() as i64
                );
                let meta = meta_for(g, n, NAME, reason);
                let reduced = insert1(
                    g,
                    NAME,
                    At::After(n),
                    Op::AllReduce {
                        axis: TP.into(),
                        op: ReduceOp::Sum,
                    },
                    &[out],
                    meta,
                )?;
                if !experts {
                    self.seq_reduces.push(g.def(reduced));
                }
                res.count("all_reduce", 1);
                let mut last = reduced;
                if let Some(b) = bias {
                    let meta = meta_for(
                        g,
                        n,
                        NAME,
                        "row-parallel bias: added once, after the all_reduce",
                    );
                    last = insert1(
                        g,
                        NAME,
                        At::After(g.def(reduced)),
                        Op::Add {},
                        &[reduced, b],
                        meta,
                    )?;
                }
                g.replace_uses_except(out, last, g.def(reduced));
                Ok(())
            }
        }
    }

    /// Per-rank constant tensor `[value of this rank]` (i64[1]).
    fn rank_values(
        g: &mut Graph,
        at: At,
        anchor: Node,
        values: &[i64],
        why: &str,
    ) -> Result<Value, PassError> {
        let meta = meta_for(g, anchor, NAME, why.to_string());
        insert1(
            g,
            NAME,
            at,
            Op::Arange {
                start: per_rank(values),
                ty: TensorType::new(DType::I64, vec![Dim::from(1)]),
            },
            &[],
            meta,
        )
    }

    /// The padding row in each rank's rows of a vocab-parallel table: `p - offset` on the
    /// rank holding row `p`; on the others their row count, a row no local id reaches
    /// (so no token is skipped there).
    fn local_padding_idx(p: &Dim, sizes: &[i64]) -> Option<Dim> {
        let p = p.as_const()?;
        let local = offsets(sizes)
            .iter()
            .zip(sizes)
            .map(|(&off, &len)| {
                if (off..off + len).contains(&p) {
                    p - off
                } else {
                    len
                }
            })
            .collect::<Vec<_>>();
        Some(per_rank(&local))
    }

    /// `(ids - offset, in_range)` for ids against this rank's `[offset, offset+size)`.
    fn local_index(
        g: &mut Graph,
        anchor: Node,
        ids: Value,
        sizes: &[i64],
        what: &str,
    ) -> Result<(Value, Value, Value), PassError> {
        let at = At::Before(anchor);
        let off = Self::rank_values(
            g,
            at,
            anchor,
            &offsets(sizes),
            &format!("{what}: first vocabulary row of this rank"),
        )?;
        let len = Self::rank_values(
            g,
            at,
            anchor,
            sizes,
            &format!("{what}: vocabulary rows of this rank"),
        )?;
        let m = |g: &Graph, r: &str| meta_for(g, anchor, NAME, format!("{what}: {r}"));
        let zero = insert1(
            g,
            NAME,
            at,
            Op::Full {
                value: Float(0.0),
                ty: TensorType::scalar(DType::I64),
            },
            &[],
            m(g, "zero"),
        )?;
        let local = insert1(
            g,
            NAME,
            at,
            Op::Sub {},
            &[ids, off],
            m(g, "index within this rank's rows"),
        )?;
        let ge = insert1(
            g,
            NAME,
            at,
            Op::Compare { op: CmpOp::Ge },
            &[local, zero],
            m(g, "row >= first"),
        )?;
        let lt = insert1(
            g,
            NAME,
            at,
            Op::Compare { op: CmpOp::Lt },
            &[local, len],
            m(g, "row < first + rows"),
        )?;
        let inr = insert1(
            g,
            NAME,
            at,
            Op::Where {},
            &[ge, lt, ge],
            m(g, "row held by this rank"),
        )?;
        let safe = insert1(
            g,
            NAME,
            at,
            Op::Where {},
            &[inr, local, zero],
            m(g, "rows of other ranks read row 0 (zeroed after)"),
        )?;
        Ok((safe, inr, zero))
    }

    fn vocab_embedding(
        &mut self,
        g: &mut Graph,
        n: Node,
        res: &mut PassResult,
    ) -> Result<(), PassError> {
        let w = g.node(n).operands[1];
        let Op::Param { name, .. } = g.op_of(w).clone() else {
            return self.reinfer(g, n);
        };
        let Some(ParamPlan::Split { pieces, .. }) = self.plans.get(&name).cloned() else {
            return self.reinfer(g, n);
        };
        let sizes = &pieces[0];
        let ids = g.node(n).operands[0];
        let (safe, inr, _) = Self::local_index(g, n, ids, sizes, "vocab-parallel embedding")?;
        g.node_mut(n).operands[0] = safe;
        if let Op::Embedding {
            padding_idx: Some(p),
        } = &g.node(n).op
        {
            let local = Self::local_padding_idx(p, sizes).ok_or_else(|| {
                PassError::rewrite(
                    NAME,
                    format!("`{NAME}` cannot split the embedding's vocabulary"),
                    g.describe(n),
                    format!("its padding_idx `{p}` is not a constant row of the whole table"),
                )
            })?;
            g.node_mut(n).op = Op::Embedding {
                padding_idx: Some(local),
            };
        }
        self.reinfer(g, n)?;
        let out = g.node(n).results[0];
        let t = g.ty(out).clone();
        let mut mask_shape = g.ty(ids).shape.clone();
        mask_shape.push(Dim::from(1));
        let m = |g: &Graph, r: &str| meta_for(g, n, NAME, format!("vocab-parallel embedding: {r}"));
        let mf = insert1(
            g,
            NAME,
            At::After(n),
            Op::Cast { dtype: t.dtype },
            &[inr],
            m(g, "1 where this rank holds the token's row"),
        )?;
        let mf = insert1(
            g,
            NAME,
            At::After(g.def(mf)),
            Op::Reshape { shape: mask_shape },
            &[mf],
            m(g, "mask per token"),
        )?;
        let y = insert1(
            g,
            NAME,
            At::After(g.def(mf)),
            Op::Mul {},
            &[out, mf],
            m(g, "rows of other ranks are zero here"),
        )?;
        let reason = format!(
            "sum every rank's rows (each token's row lives on one rank), {} bytes",
            t.numel() * t.dtype.size_bytes() as i64
        );
        let r = insert1(
            g,
            NAME,
            At::After(g.def(y)),
            Op::AllReduce {
                axis: TP.into(),
                op: ReduceOp::Sum,
            },
            &[y],
            m(g, &reason),
        )?;
        g.replace_uses_except(out, r, g.def(y));
        self.seq_reduces.push(g.def(r));
        res.count("all_reduce", 1);
        res.count("vocab_parallel", 1);
        Ok(())
    }

    fn vocab_cross_entropy(
        &mut self,
        g: &mut Graph,
        n: Node,
        ignore_index: i64,
        reduction: Reduction,
        res: &mut PassResult,
    ) -> Result<(), PassError> {
        let (logits, labels) = (g.node(n).operands[0], g.node(n).operands[1]);
        let Some(sizes) = self.pieces.get(&logits).cloned() else {
            if self.changed.contains(&logits) {
                return Err(self.mixing_error(g, n, 0, g.ty(logits).rank() - 1));
            }
            return self.reinfer(g, n);
        };
        let lt = g.ty(logits).clone();
        let at = At::Before(n);
        let m =
            |g: &Graph, r: &str| meta_for(g, n, NAME, format!("vocab-parallel cross-entropy: {r}"));
        let mut lf = logits;
        if lt.dtype != DType::F32 {
            lf = insert1(
                g,
                NAME,
                at,
                Op::Cast { dtype: DType::F32 },
                &[lf],
                m(g, "logits in f32"),
            )?;
        }
        let keep = |d: &[i64]| Op::Max {
            dims: d.to_vec(),
            keepdim: true,
        };
        let mx = insert1(
            g,
            NAME,
            at,
            keep(&[-1]),
            &[lf],
            m(g, "max of this rank's logits"),
        )?;
        let mx = insert1(
            g,
            NAME,
            at,
            Op::AllReduce {
                axis: TP.into(),
                op: ReduceOp::Max,
            },
            &[mx],
            m(g, "max over the whole vocabulary"),
        )?;
        let z = insert1(g, NAME, at, Op::Sub {}, &[lf, mx], m(g, "shifted logits"))?;
        let e = insert1(g, NAME, at, Op::Exp {}, &[z], m(g, "exp"))?;
        let s = insert1(
            g,
            NAME,
            at,
            Op::Sum {
                dims: vec![-1],
                keepdim: true,
            },
            &[e],
            m(g, "sum over this rank's vocabulary"),
        )?;
        let s = insert1(
            g,
            NAME,
            at,
            Op::AllReduce {
                axis: TP.into(),
                op: ReduceOp::Sum,
            },
            &[s],
            m(g, "sum over the whole vocabulary"),
        )?;
        let ls = insert1(g, NAME, at, Op::Log {}, &[s], m(g, "log-sum-exp"))?;
        let lse = insert1(g, NAME, at, Op::Add {}, &[ls, mx], m(g, "log-sum-exp"))?;
        let (safe, inr, _) =
            Self::local_index(g, n, labels, &sizes, "vocab-parallel cross-entropy")?;
        let mut idx_shape = g.ty(labels).shape.clone();
        idx_shape.push(Dim::from(1));
        let idx = insert1(
            g,
            NAME,
            at,
            Op::Reshape {
                shape: idx_shape.clone(),
            },
            &[safe],
            m(g, "label index"),
        )?;
        let t = insert1(
            g,
            NAME,
            at,
            Op::Gather { dim: -1 },
            &[lf, idx],
            m(g, "target logit if this rank holds it"),
        )?;
        let inf = insert1(
            g,
            NAME,
            at,
            Op::Cast { dtype: DType::F32 },
            &[inr],
            m(g, "1 where this rank holds the label"),
        )?;
        let inf = insert1(
            g,
            NAME,
            at,
            Op::Reshape { shape: idx_shape },
            &[inf],
            m(g, "per token"),
        )?;
        let t = insert1(g, NAME, at, Op::Mul {}, &[t, inf], m(g, "zero elsewhere"))?;
        let t = insert1(
            g,
            NAME,
            at,
            Op::AllReduce {
                axis: TP.into(),
                op: ReduceOp::Sum,
            },
            &[t],
            m(g, "the target logit, from the rank that holds it"),
        )?;
        let tok = insert1(g, NAME, at, Op::Sub {}, &[lse, t], m(g, "token loss"))?;
        let tok = insert1(
            g,
            NAME,
            at,
            Op::Reshape {
                shape: g.ty(labels).shape.clone(),
            },
            &[tok],
            m(g, "token loss"),
        )?;
        let out =
            crate::util::masked_token_loss(g, NAME, at, tok, labels, ignore_index, reduction, &m)?;
        let old = g.node(n).results[0];
        g.replace_all_uses(old, out);
        g.remove_node(n);
        res.count("all_reduce", 3);
        res.count("vocab_parallel", 1);
        Ok(())
    }

    /// Outputs that ended split: the vocab-split logits keep their split; others gather.
    fn outputs(&mut self, g: &mut Graph, res: &mut PassResult) -> Result<(), PassError> {
        let outs: Vec<(String, Value)> = g.outputs().to_vec();
        for (name, v) in outs {
            if !self.changed.contains(&v) {
                continue;
            }
            let dims = self.split_dims(g, v);
            let last = g.ty(v).rank().saturating_sub(1);
            match self.pieces.get(&v) {
                Some(_) if dims == [last] => {
                    g.add_output_split(&name, last, TP);
                }
                Some(sizes) if dims.len() == 1 => {
                    let sizes = sizes.clone();
                    let whole = gather_uneven(
                        g,
                        g.def(v),
                        v,
                        dims[0],
                        &sizes,
                        &format!("output `{name}` whole"),
                    )?;
                    g.set_output(&name, whole);
                    res.count("all_gather", 1);
                }
                _ => {
                    return Err(PassError::rewrite(
                        NAME,
                        format!("`{NAME}` cannot return output `{name}`"),
                        g.describe(g.def(v)),
                        format!(
                            "its type {} is split over tp in a way the pass cannot gather",
                            g.ty(v)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Megatron-style sequence parallelism inside tp: the all_reduce after each
    /// row-parallel layer (and the vocab-parallel embedding) becomes a reduce_scatter
    /// over the sequence (dim 1), so norms, residual adds and other per-token ops run
    /// on `S/tp` tokens; the inputs of column-parallel layers (and of any op that is not
    /// per-token) are all_gathered back to the whole sequence first.
    fn sequence_parallel(&mut self, g: &mut Graph, res: &mut PassResult) -> Result<(), PassError> {
        res.count("reduce_scatter", 0)
            .count("seq_all_gather", 0)
            .count("seq_slices", 0);
        let mut split: HashSet<Value> = HashSet::new();
        let reduces = std::mem::take(&mut self.seq_reduces);
        let mut seq_of: HashMap<Value, Dim> = HashMap::new();
        for &n in &reduces {
            let x = g.node(n).operands[0];
            let t = g.ty(x).clone();
            if t.rank() != 3 {
                continue;
            }
            let why = g
                .node(n)
                .meta
                .provenance
                .as_ref()
                .map(|p| p.reason.clone())
                .unwrap_or_default();
            let d = g.node_mut(n);
            d.op = Op::ReduceScatter {
                axis: TP.into(),
                dim: 1,
                op: ReduceOp::Sum,
            };
            d.meta.provenance = Some(Provenance {
                pass: NAME.into(),
                reason: format!("sequence parallel: {why}; each rank keeps its S/tp tokens"),
            });
            self.reinfer(g, n)?;
            let r = g.node(n).results[0];
            split.insert(r);
            seq_of.insert(r, t.shape[1].clone());
            if let Some(c) = res.counters.get_mut("all_reduce") {
                *c = c.saturating_sub(1);
            }
            res.count("reduce_scatter", 1);
        }
        let per_token = |op: &Op| {
            matches!(
                op,
                Op::RmsNorm { .. }
                    | Op::Add {}
                    | Op::Sub {}
                    | Op::Mul {}
                    | Op::Div {}
                    | Op::Cast { .. }
                    | Op::Silu {}
                    | Op::Gelu { .. }
                    | Op::Relu {}
                    | Op::Scale { .. }
                    | Op::AddScalar { .. }
                    | Op::Neg {}
                    | Op::Sigmoid {}
                    | Op::Tanh {}
                    | Op::Maximum {}
                    | Op::Minimum {}
            )
        };
        let mut gathered: HashMap<Value, Value> = HashMap::new();
        let mut sliced: HashMap<Value, Value> = HashMap::new();
        let order: Vec<Node> = g.nodes().to_vec();
        for n in order {
            let d = g.node(n);
            if !d.operands.iter().any(|v| split.contains(v)) {
                continue;
            }
            let ops = d.operands.clone();
            let seq = ops
                .iter()
                .find_map(|v| seq_of.get(v))
                .cloned()
                .expect("a split operand has a sequence dim");
            if per_token(&d.op) {
                for (i, v) in ops.iter().enumerate() {
                    let t = g.ty(*v);
                    if split.contains(v) || t.rank() != 3 || t.shape[1] != seq {
                        continue;
                    }
                    let local = seq.clone() / Dim::sym(TP);
                    let w = match sliced.get(v) {
                        Some(w) => *w,
                        None => {
                            let meta = meta_for(
                                g,
                                n,
                                NAME,
                                "sequence parallel: this rank's S/tp tokens of a whole value",
                            );
                            let op = Op::Slice {
                                dim: 1,
                                start: Dim::coord(TP) * local.clone(),
                                len: local,
                            };
                            let w = insert1(g, NAME, At::After(g.def(*v)), op, &[*v], meta)?;
                            res.count("seq_slices", 1);
                            sliced.insert(*v, w);
                            w
                        }
                    };
                    g.node_mut(n).operands[i] = w;
                }
                self.reinfer(g, n)?;
                for r in g.node(n).results.clone() {
                    if g.ty(r).rank() == 3 {
                        split.insert(r);
                        seq_of.insert(r, seq.clone());
                    }
                }
            } else {
                for (i, v) in ops.iter().enumerate() {
                    if !split.contains(v) {
                        continue;
                    }
                    let w = match gathered.get(v) {
                        Some(w) => *w,
                        None => {
                            let t = g.ty(*v).clone();
                            let reason = format!(
                                "sequence parallel: the whole sequence for `{}`, {} bytes per rank",
                                g.node(n).op.name(),
                                t.numel() * t.dtype.size_bytes() as i64
                            );
                            let meta = meta_for(g, n, NAME, reason);
                            let w = insert1(
                                g,
                                NAME,
                                At::After(g.def(*v)),
                                Op::AllGather {
                                    axis: TP.into(),
                                    dim: 1,
                                },
                                &[*v],
                                meta,
                            )?;
                            res.count("seq_all_gather", 1);
                            gathered.insert(*v, w);
                            w
                        }
                    };
                    g.node_mut(n).operands[i] = w;
                }
                self.reinfer(g, n)?;
            }
        }
        let outs: Vec<(String, Value)> = g.outputs().to_vec();
        for (name, v) in outs {
            if split.contains(&v) {
                let meta = meta_for(
                    g,
                    g.def(v),
                    NAME,
                    format!("sequence parallel: output `{name}` whole"),
                );
                let w = insert1(
                    g,
                    NAME,
                    At::After(g.def(v)),
                    Op::AllGather {
                        axis: TP.into(),
                        dim: 1,
                    },
                    &[v],
                    meta,
                )?;
                g.set_output(&name, w);
            }
        }
        Ok(())
    }

    fn mark_grad_allreduce(&self, g: &mut Graph, res: &mut PassResult) {
        for (name, v) in g.params() {
            let Some(why) = self.grad_allreduce.get(&name) else {
                continue;
            };
            let n = g.def(v);
            let d = g.node_mut(n);
            if d.meta.provenance.is_none() {
                d.meta.provenance = Some(Provenance {
                    pass: NAME.into(),
                    reason: format!("{GRAD_ALLREDUCE} ({why})"),
                });
            }
            res.count("grad_allreduce_params", 1);
        }
    }
}

/// The provenance text of whole parameters whose gradients are summed over tp.
pub const GRAD_ALLREDUCE: &str = "replicated over tp, gradients summed over tp (grad_allreduce)";

/// Sub-parameter sizes a spec gives must be the ones the graph has.
fn check_subs(name: &str, s: &LayerSpec, dim: usize, want: &[i64]) -> Result<(), PassError> {
    let total: i64 = want.iter().sum();
    let got: Option<Vec<i64>> = match s.sub_params(dim) {
        None => return Ok(()),
        Some(Ok(k)) => Some(vec![total / k.max(1); k as usize]),
        Some(Err(v)) => Some(v),
    };
    match got {
        Some(v) if v == want => Ok(()),
        Some(v) => Err(param_error(
            name,
            format!(
                "{} gives sub-parameters {v:?} but the attention's q, k, v sizes are {want:?}",
                s.origin
            ),
        )
        .with_help(format!("use \"shape\": [{want:?}, -1]"))),
        None => Ok(()),
    }
}

/// The linear whose output reaches `v` through layout and per-element ops (and at most
/// one split of a fused output).
fn trace_back(g: &Graph, v: Value) -> Option<(Node, Option<(Node, usize)>)> {
    let mut cur = v;
    let mut split = None;
    for _ in 0..64 {
        let n = g.def(cur);
        let d = g.node(n);
        match &d.op {
            Op::Linear {} => return Some((n, split)),
            Op::Split { .. } if split.is_none() => {
                let i = d.results.iter().position(|r| *r == cur)?;
                split = Some((n, i));
                cur = d.operands[0];
            }
            Op::Rope { .. }
            | Op::Transpose { .. }
            | Op::Permute { .. }
            | Op::RmsNorm { .. }
            | Op::Reshape { .. }
            | Op::Cast { .. }
            | Op::AllGather { .. }
            | Op::Zigzag { .. }
            | Op::Slice { .. }
            | Op::Expand { .. } => cur = d.operands[0],
            _ => return None,
        }
    }
    None
}

/// The linear that reads the attention output `v` (the o projection).
fn trace_forward(g: &Graph, v: Value, uses: &[Vec<(Node, usize)>]) -> Option<Node> {
    let mut cur = v;
    for _ in 0..64 {
        let us = uses.get(cur.0 as usize)?;
        let &(n, i) = us.first()?;
        match &g.node(n).op {
            Op::Linear {} if i == 0 => return Some(n),
            Op::Transpose { .. }
            | Op::Permute { .. }
            | Op::Reshape { .. }
            | Op::Cast { .. }
            | Op::Slice { .. }
            | Op::AllGather { .. }
            | Op::Zigzag { .. }
            | Op::AllToAll { .. } => cur = g.node(n).results[0],
            _ => return None,
        }
    }
    None
}

/// Sizes of the split (on `dim`, more than one part, constant) that is the only use of
/// linear `n`'s output.
fn following_split(g: &Graph, n: Node, dim: usize) -> Option<Vec<i64>> {
    let out = g.node(n).results[0];
    let us = g.uses_of(out);
    let [(u, 0)] = us.as_slice() else { return None };
    match &g.node(*u).op {
        Op::Split { dim: d, sizes }
            if sizes.len() > 1
                && weft_ir::shape::norm_dim(*d, g.ty(out).rank()).ok() == Some(dim) =>
        {
            sizes.iter().map(const_of).collect()
        }
        _ => None,
    }
}

/// Rewrites a reshape target for an operand whose dims changed: dims are grouped
/// between input and target by equal products (evaluated with sample sizes), and the
/// first non-1 target dim of each changed group is scaled by new/old.
/// The value a free symbol (`B`, `S`) takes while [`reshape_target`] matches dim
/// groups: highly composite, and a multiple of the mesh's rank count, so that any
/// `B/dp` or `S/(sp*tp)` the sharding passes wrote evaluates to an integer. (A fixed
/// 720720 = 2^4*3^2*5*7*11*13 made `B/dp` fractional for dp=32, and the reshape of
/// every attention layer on meshes like dp=32,sp=16,tp=2 was refused.)
fn free_symbol_stand_in(mesh: &weft_ir::Mesh) -> i64 {
    fn gcd(a: i64, b: i64) -> i64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    // Any denominator is a product of distinct axes' sizes, so it divides their product.
    let ranks = mesh
        .axes
        .iter()
        .try_fold(1i64, |p, (_, n)| p.checked_mul((*n as i64).max(1)))
        .unwrap_or(1);
    let base = 720_720i64;
    base.checked_mul(ranks / gcd(base, ranks)).unwrap_or(base)
}

fn reshape_target(old_in: &[Dim], new_in: &[Dim], target: &[Dim], g: &Graph) -> Option<Vec<Dim>> {
    let mut b = Bindings::new();
    let mut syms: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    for d in old_in.iter().chain(target) {
        syms.extend(d.symbols());
    }
    let stand_in = free_symbol_stand_in(&g.mesh);
    for s in syms {
        let v = g.mesh.size(&s).map(|x| x as i64).unwrap_or(stand_in);
        b = b.with(&s, v);
    }
    let ev = |d: &Dim| d.eval(&b).ok().map(|x| x as i128);
    let a: Vec<i128> = old_in.iter().map(ev).collect::<Option<_>>()?;
    let t: Vec<i128> = target.iter().map(ev).collect::<Option<_>>()?;
    let mut groups: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < t.len() {
        let (si, sj) = (i, j);
        let (mut pa, mut pt) = (a[i], t[j]);
        i += 1;
        j += 1;
        while pa != pt {
            if pa < pt {
                if i >= a.len() {
                    return None;
                }
                pa *= a[i];
                i += 1;
            } else {
                if j >= t.len() {
                    return None;
                }
                pt *= t[j];
                j += 1;
            }
        }
        groups.push((si..i, sj..j));
    }
    if let Some(last) = groups.last_mut() {
        last.0.end = a.len();
        last.1.end = t.len();
    } else if !(a.is_empty() && t.is_empty()) {
        return None;
    }
    let mut out = target.to_vec();
    for (gi, gt) in groups {
        let prod = |s: &[Dim]| s.iter().fold(Dim::from(1), |acc, d| acc * d.clone());
        let (op, np) = (prod(&old_in[gi.clone()]), prod(&new_in[gi]));
        if op == np {
            continue;
        }
        let k = gt.clone().find(|&k| t[k] != 1).unwrap_or(gt.start);
        out[k] = out[k].clone() * np.exact_div(&op);
    }
    Some(out)
}

/// `x` gathered whole along `dim` over tp. Even sizes: one `all_gather`. Uneven: pad to
/// the largest size, `all_gather`, and keep each rank's part (pad, gather, trim).
fn gather_uneven(
    g: &mut Graph,
    anchor: Node,
    x: Value,
    dim: usize,
    sizes: &[i64],
    why: &str,
) -> Result<Value, PassError> {
    let at = |g: &Graph, v: Value| At::After(g.def(v));
    let m = |g: &Graph, r: String| meta_for(g, anchor, NAME, format!("{why}: {r}"));
    let t = g.ty(x).clone();
    let max = sizes.iter().copied().max().unwrap_or(0);
    if sizes.iter().all(|&s| s == max) {
        let meta = m(
            g,
            format!(
                "all_gather dim {dim} over tp, {} bytes per rank",
                t.numel() * t.dtype.size_bytes() as i64
            ),
        );
        return insert1(
            g,
            NAME,
            at(g, x),
            Op::AllGather {
                axis: TP.into(),
                dim: dim as i64,
            },
            &[x],
            meta,
        );
    }
    let mut pad_ty = t.clone();
    pad_ty.shape[dim] = per_rank(&sizes.iter().map(|s| max - s).collect::<Vec<_>>());
    let pad = insert1(
        g,
        NAME,
        at(g, x),
        Op::Full {
            value: Float(0.0),
            ty: pad_ty,
        },
        &[],
        m(g, format!("pad this rank's part to {max}")),
    )?;
    let padded = insert1(
        g,
        NAME,
        at(g, pad),
        Op::Concat { dim: dim as i64 },
        &[x, pad],
        m(g, format!("pad to {max}")),
    )?;
    let all = insert1(
        g,
        NAME,
        at(g, padded),
        Op::AllGather {
            axis: TP.into(),
            dim: dim as i64,
        },
        &[padded],
        m(
            g,
            format!(
                "all_gather the padded parts, {} bytes per rank",
                t.numel() * t.dtype.size_bytes() as i64
            ),
        ),
    )?;
    let mut parts = Vec::new();
    let mut cur = all;
    for (r, &s) in sizes.iter().enumerate() {
        let p = insert1(
            g,
            NAME,
            at(g, cur),
            Op::Slice {
                dim: dim as i64,
                start: Dim::from(r as i64 * max),
                len: Dim::from(s),
            },
            &[all],
            m(g, format!("rank {r}'s {s} without padding")),
        )?;
        parts.push(p);
        cur = p;
    }
    insert1(
        g,
        NAME,
        at(g, cur),
        Op::Concat { dim: dim as i64 },
        &parts,
        m(g, "trimmed parts in rank order".into()),
    )
}

//! Helpers shared by the passes: node creation with provenance, and the sharding
//! layout (which symbols are the batch and sequence sizes, which axes split them).

use crate::pass::{PassContext, PassError, CP, DP, SP};
use weft_ir::{At, BuildError, Dim, Graph, Node, NodeMeta, Op, Provenance, Role, Value};

/// Metadata for a node a pass inserts on behalf of `anchor`: the anchor's model scope
/// and the pass's provenance.
pub(crate) fn meta_for(g: &Graph, anchor: Node, pass: &str, reason: impl Into<String>) -> NodeMeta {
    NodeMeta {
        source: g.node(anchor).meta.source.clone(),
        provenance: Some(Provenance {
            pass: pass.to_string(),
            reason: reason.into(),
        }),
        ..Default::default()
    }
}

/// The loss from per-token losses `tok` (shaped like `labels`): tokens whose label is
/// `ignore_index` contribute 0, then `reduction` (none, sum, or the mean over the valid
/// labels), as `cross_entropy` reduces. Shared by tp's vocab-parallel loss and the fused
/// lm_head loss; `meta` labels each inserted node.
#[allow(clippy::too_many_arguments)]
pub(crate) fn masked_token_loss(
    g: &mut Graph,
    pass: &str,
    at: At,
    tok: Value,
    labels: Value,
    ignore_index: i64,
    reduction: weft_ir::Reduction,
    meta: &dyn Fn(&Graph, &str) -> NodeMeta,
) -> Result<Value, PassError> {
    use weft_ir::{CmpOp, DType, Float, Reduction, TensorType};
    let ig = insert1(
        g,
        pass,
        at,
        Op::Full {
            value: Float(ignore_index as f64),
            ty: TensorType::scalar(DType::I64),
        },
        &[],
        meta(g, "ignore_index"),
    )?;
    let valid = insert1(
        g,
        pass,
        at,
        Op::Compare { op: CmpOp::Ne },
        &[labels, ig],
        meta(g, "labels that count"),
    )?;
    let valid = insert1(
        g,
        pass,
        at,
        Op::Cast { dtype: DType::F32 },
        &[valid],
        meta(g, "labels that count"),
    )?;
    let tok = insert1(
        g,
        pass,
        at,
        Op::Mul {},
        &[tok, valid],
        meta(g, "ignored labels contribute 0"),
    )?;
    let rank = g.ty(labels).rank() as i64;
    Ok(match reduction {
        Reduction::None => tok,
        Reduction::Sum | Reduction::Mean => {
            let sum = insert1(
                g,
                pass,
                at,
                Op::Sum {
                    dims: (0..rank).collect(),
                    keepdim: false,
                },
                &[tok],
                meta(g, "sum over tokens"),
            )?;
            if reduction == Reduction::Sum {
                sum
            } else {
                let c = insert1(
                    g,
                    pass,
                    at,
                    Op::CountValid { ignore_index },
                    &[labels],
                    meta(g, "valid labels"),
                )?;
                insert1(
                    g,
                    pass,
                    at,
                    Op::Div {},
                    &[sum, c],
                    meta(g, "mean over valid labels"),
                )?
            }
        }
    })
}

/// Inserts a single-result node, turning a shape error into a located pass error.
pub(crate) fn insert1(
    g: &mut Graph,
    pass: &str,
    at: At,
    op: Op,
    operands: &[Value],
    meta: NodeMeta,
) -> Result<Value, PassError> {
    g.insert_with(at, op, operands, meta)
        .map(|r| r[0])
        .map_err(|e| build_error(pass, e))
}

pub(crate) fn build_error(pass: &str, e: BuildError) -> PassError {
    PassError::rewrite(
        pass,
        format!("`{pass}` could not build `{}`", e.op),
        e.location,
        e.message,
    )
}

/// True when the node was inserted by `pass`.
pub(crate) fn made_by(g: &Graph, n: Node, pass: &str) -> bool {
    g.node(n)
        .meta
        .provenance
        .as_ref()
        .is_some_and(|p| p.pass == pass)
}

/// The symbol a dim is, if it is exactly one symbol (`S`, not `2*S` or `16`).
pub(crate) fn as_symbol(d: &Dim) -> Option<String> {
    let syms = d.symbols();
    match syms.as_slice() {
        [s] if Dim::sym(s) == *d => Some(s.clone()),
        _ => None,
    }
}

/// One sharded size: the symbol of the global size, the (innermost) mesh axis that
/// splits it, and for the sequence on a mesh with `cp` the ring size.
///
/// With `cp` the sequence is split in zigzag order (see `Op::Zigzag`): rank `r` of cp
/// holds chunks `r` and `2cp-1-r` of `2cp` equal chunks (the causal load balance of ring
/// attention), and with `sp` as well each cp rank's two chunks are split contiguously
/// over sp (cp outer, sp inner: `cp=4,sp=8` is Ulysses inside groups of 8 consecutive
/// ranks and a ring of 4 across them).
#[derive(Clone, Debug)]
pub(crate) struct Split {
    pub symbol: String,
    pub axis: &'static str,
    /// The sequence is in zigzag order over `cp` of this size.
    pub ring: Option<u32>,
}

impl Split {
    /// The per-rank size: `S/sp`, `S/cp`, `S/cp/sp`, `B/dp`.
    pub fn local(&self) -> Dim {
        let mut d = Dim::sym(&self.symbol);
        if self.ring.is_some() {
            d = d / Dim::sym(CP);
        }
        if self.axis != CP {
            d = d / Dim::sym(self.axis);
        }
        d
    }
    /// The first index this rank holds: `@sp*S/sp`; with cp, in the zigzag order
    /// (`@cp*S/cp + @sp*S/cp/sp`).
    pub fn start(&self) -> Dim {
        match self.ring {
            None => Dim::coord(self.axis) * self.local(),
            Some(_) => {
                let portion = Dim::coord(CP) * (Dim::sym(&self.symbol) / Dim::sym(CP));
                if self.axis == CP {
                    portion
                } else {
                    portion + Dim::coord(self.axis) * self.local()
                }
            }
        }
    }
    /// The mesh axes this size is split over, inner first.
    pub fn axes(&self) -> Vec<&'static str> {
        let mut v = vec![self.axis];
        if self.ring.is_some() && self.axis != CP {
            v.push(CP);
        }
        v
    }
}

/// How the token dims are sharded on this mesh: sequence over `sp`, batch over `dp`.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub seq: Option<Split>,
    pub batch: Option<Split>,
}

impl Layout {
    /// Reads the batch and sequence symbols off the `input_ids` input (or `labels`),
    /// and which of `sp` / `dp` the mesh has.
    pub fn of(g: &Graph, cx: &PassContext, pass: &str) -> Result<Layout, PassError> {
        let inputs = g.inputs();
        let tokens = inputs
            .iter()
            .find(|(_, r, _)| *r == Role::InputIds)
            .or_else(|| inputs.iter().find(|(_, r, _)| *r == Role::Labels))
            .ok_or_else(|| {
                PassError::rewrite(
                    pass,
                    format!("`{pass}` cannot find the token dims"),
                    format!("graph `{}`", g.name),
                    "it has no input with role input_ids or labels",
                )
                .with_help("mark the token ids input with `role=input_ids`")
            })?;
        let (name, _, v) = tokens;
        let ty = g.ty(*v);
        let loc = g.describe(g.def(*v));
        if ty.rank() != 2 {
            return Err(PassError::rewrite(
                pass,
                format!("`{pass}` cannot find the token dims"),
                loc,
                format!("input `{name}` has type {ty}; expected [batch, sequence]"),
            ));
        }
        let symbolic = |i: usize,
                        what: &str,
                        axis: &'static str|
         -> Result<Option<Split>, PassError> {
            if !cx.mesh.has(axis) {
                return Ok(None);
            }
            match as_symbol(&ty.shape[i]) {
                Some(symbol) => Ok(Some(Split { symbol, axis, ring: None })),
                None => Err(PassError::rewrite(
                    pass,
                    format!("`{pass}` cannot split the {what} over `{axis}`"),
                    loc.clone(),
                    format!("input `{name}` has type {ty}: its {what} dim `{}` is not a symbol", ty.shape[i]),
                )
                .with_help(format!("build the model with a symbolic {what} (e.g. `{}`) and bind it when making the plan", if i == 0 { "B" } else { "S" }))),
            }
        };
        let ring = cx.mesh.size(CP);
        let seq_axis = if cx.mesh.has(SP) { SP } else { CP };
        let seq = symbolic(1, "sequence", seq_axis)?.map(|s| Split { ring, ..s });
        Ok(Layout {
            batch: symbolic(0, "batch", DP)?,
            seq,
        })
    }

    /// The splits in mesh-independent order: batch (dim 0) first, then sequence (dim 1).
    pub fn splits(&self) -> Vec<(usize, &Split)> {
        let mut out = Vec::new();
        if let Some(b) = &self.batch {
            out.push((0, b));
        }
        if let Some(s) = &self.seq {
            out.push((1, s));
        }
        out
    }

    /// Rewrites a global size to the per-rank size (`S` -> `S/sp`, `B` -> `B/dp`).
    pub fn localize(&self, d: &Dim) -> Dim {
        let mut out = d.clone();
        for (_, s) in self.splits() {
            out = out.substitute(&s.symbol, &s.local());
        }
        out
    }

    /// True when `d` is (a multiple of) a per-rank size made by this layout, i.e. it
    /// mentions a sharded axis' size symbol.
    pub fn is_sharded(&self, d: &Dim) -> bool {
        self.splits()
            .iter()
            .any(|(_, s)| s.axes().iter().any(|a| d.mentions(a)))
    }
}

/// Divisors of `n` greater than 1, ascending.
pub(crate) fn divisors(n: i64) -> Vec<i64> {
    (2..=n.max(1)).filter(|d| n % d == 0).collect()
}

pub(crate) fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a.abs()
    } else {
        gcd(b, a % b)
    }
}

/// Gathers the per-rank dims `dims` of `v` back to their global size with
/// `all_gather`s right after `v`'s definition (sequence before batch, i.e. inner mesh
/// axis first). Every dim must be exactly a layout's per-rank size (`S/sp`, `B/dp`):
/// a flattened per-rank dim (`B*S/dp/sp`) has no contiguous global order to gather.
pub(crate) fn gather_dims(
    g: &mut Graph,
    pass: &str,
    layout: &Layout,
    v: Value,
    dims: &[usize],
    user: Node,
    reason: &str,
) -> Result<Value, PassError> {
    let ty = g.ty(v).clone();
    let mut plan: Vec<(usize, &Split)> = Vec::new();
    for &k in dims {
        let d = &ty.shape[k];
        match layout.splits().into_iter().find(|(_, s)| *d == s.local()) {
            Some((_, s)) => plan.push((k, s)),
            None => {
                return Err(PassError::rewrite(
                    pass,
                    format!("`{pass}` cannot gather the whole tokens for `{}`", g.node(user).op.name()),
                    g.describe(user),
                    format!("dim {k} of {v} ({ty}) is `{d}`, a per-rank size mixed with other dims; it has no contiguous global order"),
                )
                .with_help("keep batch and sequence in separate dims before ops that combine tokens"));
            }
        }
    }
    // Inner axis (sp, cp) first, so the dp gather is outermost.
    plan.sort_by_key(|&(k, s)| (s.axis == DP, k));
    let mut cur = v;
    for (k, split) in plan {
        let what = if split.axis == DP {
            "batch"
        } else {
            "sequence"
        };
        for axis in split.axes() {
            let meta = meta_for(
                g,
                user,
                pass,
                format!("{reason}: whole {what} (dim {k}) over {axis}"),
            );
            cur = insert1(
                g,
                pass,
                At::After(g.def(cur)),
                Op::AllGather {
                    axis: axis.to_string(),
                    dim: k as i64,
                },
                &[cur],
                meta,
            )?;
        }
        if let Some(cp) = split.ring {
            let meta = meta_for(
                g,
                user,
                pass,
                format!("{reason}: the gathered sequence (dim {k}) from zigzag order back to token order"),
            );
            cur = insert1(
                g,
                pass,
                At::After(g.def(cur)),
                Op::Zigzag {
                    dim: k as i64,
                    parts: cp as i64,
                    inverse: true,
                },
                &[cur],
                meta,
            )?;
        }
    }
    Ok(cur)
}

/// Follows a chain of `all_gather`s made by `pass` back from `v`: the per-rank value,
/// the gathered `(dim, axis)` outermost first, and the gather nodes.
pub(crate) fn strip_gathers(
    g: &Graph,
    v: Value,
    pass: &str,
) -> (Value, Vec<(usize, String)>, Vec<Node>) {
    let mut cur = v;
    let mut dims = Vec::new();
    let mut nodes = Vec::new();
    loop {
        let n = g.def(cur);
        match &g.node(n).op {
            Op::AllGather { axis, dim } if made_by(g, n, pass) => {
                dims.push((*dim as usize, axis.clone()));
                nodes.push(n);
                cur = g.node(n).operands[0];
            }
            _ => return (cur, dims, nodes),
        }
    }
}

/// [`strip_gathers`] that also sees through the `zigzag {inverse}` made by `pass` on top
/// of a context-parallel gather, wherever it sits among the gathers (a dp gather of the
/// batch can be outside it), for consumers whose result does not depend on the token
/// order, such as the loss sums; the zigzag node is listed with the gathers, in order.
pub(crate) fn strip_seq_gathers(
    g: &Graph,
    v: Value,
    pass: &str,
) -> (Value, Vec<(usize, String)>, Vec<Node>) {
    let mut cur = v;
    let mut dims = Vec::new();
    let mut nodes = Vec::new();
    loop {
        let n = g.def(cur);
        match &g.node(n).op {
            Op::AllGather { axis, dim } if made_by(g, n, pass) => {
                dims.push((*dim as usize, axis.clone()));
            }
            Op::Zigzag { inverse: true, .. } if made_by(g, n, pass) => {}
            _ => return (cur, dims, nodes),
        }
        nodes.push(n);
        cur = g.node(n).operands[0];
    }
}

/// Removes those of `nodes` whose results no longer have any use, counting uses by
/// nodes removed here as gone (so a chain listed outermost first goes entirely).
/// One pass over the graph, whatever the number of nodes.
pub(crate) fn remove_unused(g: &mut Graph, nodes: &[Node]) {
    let uses = g.uses();
    let outputs: Vec<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
    let mut removed: std::collections::HashSet<Node> = std::collections::HashSet::new();
    let mut order = Vec::new();
    for &n in nodes {
        let Some(d) = g.try_node(n) else { continue };
        if removed.contains(&n) {
            continue;
        }
        let used = d.results.iter().any(|v| {
            outputs.contains(v) || uses[v.0 as usize].iter().any(|(m, _)| !removed.contains(m))
        });
        if !used {
            removed.insert(n);
            order.push(n);
        }
    }
    g.remove_nodes(&order);
}

/// Refuses, for pass `pass`, any `attention` with a log-sum-exp result: the parallel
/// rewrites do not yet carry the log-sum-exp across ranks, and must not compute
/// something else. (The window, soft-cap and value head dim need nothing: every rank
/// computes whole rows of the scores for its heads; the per-head sinks are sliced or
/// split with the heads by ulysses-attention and tensor-parallel.)
pub fn refuse_unsplit_attention(g: &Graph, pass: &str) -> Result<(), PassError> {
    for &n in g.nodes() {
        if let Op::Attention { lse, .. } = &g.node(n).op {
            let what = match lse.0 {
                true => "an attention's log-sum-exp result",
                false => continue,
            };
            return Err(PassError::rewrite(
                pass,
                format!("`{pass}` cannot split {what} yet"),
                g.describe(n),
                "the rewrite would drop or misplace them",
            )
            .with_help("compile this model without sequence or tensor parallelism"));
        }
    }
    Ok(())
}

//! `autodiff`: reverse-mode differentiation of the forward + loss graph into a joint
//! graph that also computes `grad.<param>` for every parameter (under its HF name;
//! a tied parameter, used by several nodes, gets one summed gradient).
//!
//! Backward nodes follow the forward in program order, in reverse order of the forward
//! nodes they differentiate; each carries `[backward of %v]` naming its forward node
//! (by its first result), the forward node's scope and provenance `autodiff: <op>`.
//! Gradients are written with the training ops of the IR where a composite would be
//! slow (`attention_grad`, `rms_norm_grad`, `cross_entropy_grad`, `embedding_grad`,
//! `silu_grad`, `gelu_grad`, `softmax_grad`, `grouped_matmul_grad`, `moe_combine_grad`)
//! and with the forward ops otherwise (see `rules.rs`).
//!
//! # SPMD
//! The program runs on every rank; after `sp-loss` every rank holds the same loss `L`.
//! The pass differentiates `J = L` when the loss is replicated, and the mean of the
//! ranks' losses over the axes it varies over otherwise (the data-parallel convention);
//! the seed is 1 (or 1/n) on every rank. A gradient is *complete* when each rank holds
//! the gradient of its own instance of the value, and *partial* over axis `a` when the
//! true gradient is the sum over the ranks of `a` of what each rank holds. A gradient
//! contribution that reaches a value replicated over `a` from a consumer that varies
//! over `a` (each rank differentiates through its own tokens) is partial over `a`.
//! Collectives transpose accordingly (see [`replication`] for what varies):
//!
//! - `all_reduce` (sum) over `a`: identity when the output gradient is complete over
//!   `a`, an `all_reduce` when it is partial;
//! - `all_gather` over `a`: this rank's chunk (`slice` at `@a`) of a complete
//!   gradient, `reduce_scatter` of a partial one;
//! - `reduce_scatter` over `a`: `all_gather`; `all_to_all` over `a`: the inverse
//!   `all_to_all` (scatter and gather dims swapped); `broadcast`: the root keeps it;
//!   `all_to_all_v` (expert-parallel dispatch): the inverse exchange, sending back
//!   what each rank received (its send counts `all_to_all`'d).
//!
//! Partial gradients of activations are summed where they meet complete ones (an
//! `all_reduce` made here); those of parameters are summed over their replicas by an
//! `all_reduce` per parameter and axis, each with its provenance and bytes, which
//! `grad-sync` coalesces into buckets. The program therefore computes the exact
//! gradients after this pass alone, which `weft check --train` verifies.

pub mod replication;
mod rules;

use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::util::build_error;
use replication::{bit, names, Axes};
use std::collections::BTreeMap;
use weft_ir::{
    At, Derived, DerivedKind, Dim, Float, Graph, Node, NodeMeta, Op, Provenance, ReduceOp,
    TensorType, Value,
};

pub struct Autodiff;

pub const NAME: &str = "autodiff";

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "reverse-mode autodiff: a backward node for every forward op (collectives transposed under replication), grad.<param> outputs under the HF names"
    }
    fn run(&self, g: &mut Graph, _cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        for k in [
            "backward_nodes",
            "grads",
            "grads_unused",
            "collectives",
            "partial_param_grads",
        ] {
            res.count(k, 0);
        }
        if g.outputs()
            .iter()
            .any(|(n, _)| weft_ir::ValueRole::of(n) == Some(weft_ir::ValueRole::Grad))
        {
            return Ok(res); // already differentiated
        }
        let before = g.node_count();
        let finishing = differentiate(g, &mut res)?;
        // With micro-batches, each one's backward right after its forward.
        crate::micro_batches::interleave(g);
        hoist_param_gradients(g, &finishing);
        res.count("backward_nodes", (g.node_count() - before) as u64);
        res.changed = true;
        Ok(res)
    }
}

/// One contribution to a value's gradient and the axes it is partial over.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Contrib {
    pub v: Value,
    pub partial: Axes,
}

/// The state of one differentiation: the graph, the replication analysis and the
/// metadata given to the nodes made for the forward node being differentiated.
pub(crate) struct Ad<'g> {
    pub g: &'g mut Graph,
    pub varying: Vec<Axes>,
    pub meta: NodeMeta,
    pub collectives: u64,
    /// Nodes made so far, by op and operands.
    pub memo: std::collections::HashMap<(Op, Vec<Value>), Vec<Value>>,
}

fn err(what: impl Into<String>, location: impl Into<String>, why: impl Into<String>) -> PassError {
    PassError::rewrite(NAME, what, location, why)
}

/// Which values need a gradient: floats that depend on a parameter and that the loss
/// depends on.
fn needs_grad(g: &Graph, loss: Value) -> Vec<bool> {
    let cap = g.value_capacity();
    let mut from_param = vec![false; cap];
    for &n in g.nodes() {
        let d = g.node(n);
        let dep =
            matches!(d.op, Op::Param { .. }) || d.operands.iter().any(|v| from_param[v.0 as usize]);
        for v in &d.results {
            from_param[v.0 as usize] = dep && g.ty(*v).dtype.is_float();
        }
    }
    let mut to_loss = vec![false; cap];
    to_loss[loss.0 as usize] = true;
    for &n in g.nodes().iter().rev() {
        let d = g.node(n);
        if d.results.iter().any(|v| to_loss[v.0 as usize]) {
            for v in &d.operands {
                to_loss[v.0 as usize] = true;
            }
        }
    }
    (0..cap).map(|i| from_param[i] && to_loss[i]).collect()
}

/// Returns the nodes that finish the parameters' gradients (see [`hoist_param_gradients`]).
fn differentiate(g: &mut Graph, res: &mut PassResult) -> Result<Vec<Node>, PassError> {
    let loss = g.output("loss").ok_or_else(|| {
        err(
            "`autodiff` has no loss to differentiate",
            format!("graph `{}`", g.name),
            format!(
                "it has no output named `loss` (outputs: {})",
                g.outputs()
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .with_help("name the scalar training loss `loss`")
    })?;
    let loss_ty = g.ty(loss).clone();
    if !loss_ty.dtype.is_float() {
        return Err(err(
            "`autodiff` cannot differentiate the loss",
            g.describe(g.def(loss)),
            format!("it is {loss_ty}, not a float"),
        ));
    }
    let needs = needs_grad(g, loss);
    let varying = replication::varying(g);
    let mesh = g.mesh.clone();
    let order: Vec<Node> = g.nodes().to_vec();
    let mut ad = Ad {
        g,
        varying,
        meta: NodeMeta::default(),
        collectives: 0,
        memo: Default::default(),
    };
    let mut grads: BTreeMap<Value, Vec<Contrib>> = BTreeMap::new();
    let mut param_grads: BTreeMap<String, Vec<Contrib>> = BTreeMap::new();

    // The seed: dJ/dL = 1 on every rank, or 1/n when the loss differs across n ranks
    // (J is then their mean).
    let loss_node = ad.g.def(loss);
    ad.set_meta(loss_node, "seed: d loss / d loss");
    let loss_var = replication::of(&ad.varying, loss);
    let n = replication::size(&mesh, loss_var) as f64;
    let seed = ad.op(
        Op::Full {
            value: Float(1.0 / n),
            ty: loss_ty,
        },
        &[],
    )?;
    grads.insert(
        loss,
        vec![Contrib {
            v: seed,
            partial: 0,
        }],
    );

    // The nodes that finish the parameters' gradients: the sums of a parameter's
    // contributions, then their reductions over its replicas.
    let mut finishing: Vec<Node> = Vec::new();
    for &n in order.iter().rev() {
        let d = ad.g.node(n).clone();
        if !d.results.iter().any(|v| grads.contains_key(v)) {
            continue;
        }
        ad.set_meta(n, d.op.name());
        let made_from = ad.g.nodes().len();
        let mut dys: Vec<Option<Contrib>> = Vec::with_capacity(d.results.len());
        for v in &d.results {
            dys.push(match grads.remove(v) {
                Some(cs) => Some(ad.total(cs)?),
                None => None,
            });
        }
        if let Op::Param { name, .. } = &d.op {
            finishing.extend_from_slice(&ad.g.nodes()[made_from..]);
            if let Some(c) = dys[0] {
                param_grads.entry(name.clone()).or_default().push(c);
            }
            continue;
        }
        let want: Vec<bool> = d.operands.iter().map(|v| needs[v.0 as usize]).collect();
        if !want.iter().any(|w| *w) {
            continue;
        }
        let contribs = if d.op.is_collective() {
            ad.collective_vjp(n, &d, &dys, &want)?
        } else {
            // One partial set for every result, then the op's rule.
            let common = dys
                .iter()
                .flatten()
                .fold(replication::all(&mesh), |m, c| m & c.partial);
            let mut dy: Vec<Option<Value>> = Vec::with_capacity(dys.len());
            for c in &dys {
                dy.push(match c {
                    Some(c) => Some(ad.reduce(
                        c.v,
                        c.partial & !common,
                        "gradient of a replicated value meets a complete one",
                    )?),
                    None => None,
                });
            }
            let out_var = d
                .results
                .iter()
                .fold(0, |m, v| m | replication::of(&ad.varying, *v));
            let gs = ad.vjp(n, &d, &dy, &want)?;
            gs.into_iter()
                .enumerate()
                .filter_map(|(i, gv)| {
                    let gv = gv?;
                    let x = d.operands[i];
                    let partial = (common | out_var) & !replication::of(&ad.varying, x);
                    Some((i, Contrib { v: gv, partial }))
                })
                .collect()
        };
        for (i, c) in contribs {
            let x = d.operands[i];
            if !needs[x.0 as usize] {
                continue;
            }
            if ad.g.ty(c.v) != ad.g.ty(x) {
                return Err(err(
                    format!(
                        "`autodiff` made a gradient of the wrong type for `{}`",
                        d.op.name()
                    ),
                    ad.g.describe(n),
                    format!(
                        "operand {i} is {} but its gradient {} is {}",
                        ad.g.ty(x),
                        c.v,
                        ad.g.ty(c.v)
                    ),
                )
                .with_help("this is a bug in the op's backward rule; please report the model"));
            }
            grads.entry(x).or_default().push(c);
        }
    }

    // Every parameter's gradient, summed over its replicas, as `grad.<name>`.
    let tail_start = ad.g.nodes().len();
    let mut done = std::collections::BTreeSet::new();
    for (name, v) in ad.g.params() {
        if !done.insert(name.clone()) {
            continue;
        }
        let pnode = ad.g.def(v);
        let out = weft_ir::role::grad_name(&name);
        let grad = match param_grads.remove(&name) {
            Some(cs) => {
                ad.set_meta(pnode, "param gradient");
                let c = ad.total(cs)?;
                if c.partial != 0 {
                    res.count("partial_param_grads", 1);
                }
                let mut cur = c.v;
                for axis in names(&mesh, c.partial) {
                    let bytes = ad.bytes(cur);
                    ad.set_meta(
                        pnode,
                        &format!("gradient of `{name}`, replicated over {axis}: sum of the ranks' partial gradients, {bytes} bytes (grad-sync buckets these)"),
                    );
                    cur = ad.op(
                        Op::AllReduce {
                            axis: axis.clone(),
                            op: ReduceOp::Sum,
                        },
                        &[cur],
                    )?;
                    ad.collectives += 1;
                }
                res.count("grads", 1);
                cur
            }
            None => {
                ad.set_meta(
                    pnode,
                    "the loss does not depend on this param: zero gradient",
                );
                res.count("grads_unused", 1);
                let ty = ad.g.ty(v).clone();
                ad.op(
                    Op::Full {
                        value: Float(0.0),
                        ty,
                    },
                    &[],
                )?
            }
        };
        // A partitioned param's gradient stays this rank's shard; runtimes and plans
        // assemble it by the param's partition, as they cut the weight.
        ad.g.set_output(&out, grad);
    }
    res.count("collectives", ad.collectives);
    finishing.extend_from_slice(&ad.g.nodes()[tail_start..]);
    Ok(finishing)
}

/// Moves the nodes that finish the parameters' gradients (`finishing`, made at the
/// program's end: the sums of a parameter's contributions; their reductions over its
/// replicas, and what reads those, stay) to right after their operands, in the order
/// they were made. With micro-batches each gradient is the sum of every micro-batch's
/// contribution; left at the end, every gradient looked final only after the last
/// backward, so `grad-sync` reduced them all after it (none overlapped) and `optimizer`
/// placed every update after it (Llama-3-8B on dp=8 with 2 micro-batches: 27 buckets
/// after the backward, 120 ms of communication not hidden against 62 ms with one).
/// Zeros for unused parameters stay at the end.
fn hoist_param_gradients(g: &mut Graph, finishing: &[Node]) {
    if finishing.is_empty() {
        return;
    }
    let order = g.nodes().to_vec();
    let pos: std::collections::HashMap<Node, usize> =
        order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let finishing_set: std::collections::HashSet<Node> = finishing.iter().copied().collect();
    // Where each node goes: after the program position of its latest operand, through
    // the finishing nodes it reads (which go there first, in the order they were made).
    let mut at: std::collections::HashMap<Node, usize> = std::collections::HashMap::new();
    let mut moved: Vec<(usize, usize, Node)> = Vec::new();
    for (k, &n) in finishing.iter().enumerate() {
        let operands = &g.node(n).operands;
        // Reductions stay: `grad-sync` replaces them with its buckets, placed by the
        // local gradients, and a later pass must not anchor to one it removes.
        if operands.is_empty() || g.node(n).op.is_collective() {
            continue;
        }
        let p = operands
            .iter()
            .map(|&v| {
                let d = g.def(v);
                match at.get(&d) {
                    Some(&p) => p,
                    None if finishing_set.contains(&d) => usize::MAX,
                    None => pos[&d],
                }
            })
            .max()
            .unwrap_or(0);
        if p == usize::MAX {
            // Reads a node that stays (a zero gradient at the end): stay too.
            continue;
        }
        at.insert(n, p);
        moved.push((p, k, n));
    }
    moved.sort();
    let moving: std::collections::HashSet<Node> = moved.iter().map(|m| m.2).collect();
    let mut new = Vec::with_capacity(order.len());
    let mut next = moved.iter().peekable();
    for (i, &n) in order.iter().enumerate() {
        if !moving.contains(&n) {
            new.push(n);
        }
        while let Some(&&(p, _, m)) = next.peek() {
            if p != i {
                break;
            }
            new.push(m);
            next.next();
        }
    }
    g.set_order(new);
}

impl Ad<'_> {
    /// Nodes made from now on differentiate forward node `n`.
    pub(crate) fn set_meta(&mut self, n: Node, reason: &str) {
        let d = self.g.node(n);
        self.meta = NodeMeta {
            source: d.meta.source.clone(),
            provenance: Some(Provenance {
                pass: NAME.into(),
                reason: reason.into(),
            }),
            derived: Some(Derived {
                kind: DerivedKind::Backward,
                of: d.results[0],
            }),
            micro_batch: d.meta.micro_batch,
        };
    }

    pub(crate) fn op(&mut self, op: Op, xs: &[Value]) -> Result<Value, PassError> {
        Ok(self.ops(op, xs)?[0])
    }

    /// Makes (or reuses: the IR is pure, so equal op and operands give equal values)
    /// a node; e.g. the reshape of a linear's input serves q, k and v's weight grads.
    pub(crate) fn ops(&mut self, op: Op, xs: &[Value]) -> Result<Vec<Value>, PassError> {
        let key = (op, xs.to_vec());
        if let Some(r) = self.memo.get(&key) {
            return Ok(r.clone());
        }
        let r = self
            .g
            .insert_with(At::End, key.0.clone(), xs, self.meta.clone())
            .map_err(|e| build_error(NAME, e))?;
        self.memo.insert(key, r.clone());
        Ok(r)
    }

    pub(crate) fn ty(&self, v: Value) -> TensorType {
        self.g.ty(v).clone()
    }

    /// The per-rank size of `v` in bytes, as a dim.
    pub(crate) fn bytes(&self, v: Value) -> Dim {
        let t = self.g.ty(v);
        t.numel() * t.dtype.size_bytes() as i64
    }

    /// `all_reduce` (sum) of `v` over each axis of `axes`.
    pub(crate) fn reduce(&mut self, v: Value, axes: Axes, why: &str) -> Result<Value, PassError> {
        let mut cur = v;
        let mesh = self.g.mesh.clone();
        let saved = self.meta.clone();
        for axis in names(&mesh, axes) {
            let reason = format!(
                "{why}: sum the partial gradient over {axis}, {} bytes",
                self.bytes(cur)
            );
            self.meta.provenance = Some(Provenance {
                pass: NAME.into(),
                reason,
            });
            cur = self.op(
                Op::AllReduce {
                    axis,
                    op: ReduceOp::Sum,
                },
                &[cur],
            )?;
            self.collectives += 1;
        }
        self.meta = saved;
        Ok(cur)
    }

    /// The sum of a value's gradient contributions. Contributions partial over axes
    /// the others are complete over are summed over those axes first (grouped, so one
    /// collective serves every contribution with the same partial axes); the result is
    /// partial over the axes every contribution is partial over. Summed in forward
    /// order (the contributions arrive in reverse).
    pub(crate) fn total(&mut self, mut cs: Vec<Contrib>) -> Result<Contrib, PassError> {
        cs.reverse();
        let common = cs.iter().fold(!0 as Axes, |m, c| m & c.partial);
        let mut groups: Vec<(Axes, Vec<Value>)> = Vec::new();
        for c in &cs {
            match groups.iter_mut().find(|(p, _)| *p == c.partial) {
                Some((_, vs)) => vs.push(c.v),
                None => groups.push((c.partial, vec![c.v])),
            }
        }
        let mut parts = Vec::new();
        for (p, vs) in groups {
            let mut acc = vs[0];
            for &v in &vs[1..] {
                acc = self.op(Op::Add {}, &[acc, v])?;
            }
            parts.push(self.reduce(acc, p & !common, "gradient contributions meet")?);
        }
        let mut acc = parts[0];
        for &v in &parts[1..] {
            acc = self.op(Op::Add {}, &[acc, v])?;
        }
        Ok(Contrib {
            v: acc,
            partial: common,
        })
    }

    /// Gradients of a collective's operand: `(operand, contribution)`.
    fn collective_vjp(
        &mut self,
        n: Node,
        d: &weft_ir::NodeData,
        dys: &[Option<Contrib>],
        want: &[bool],
    ) -> Result<Vec<(usize, Contrib)>, PassError> {
        let Some(dy) = dys[0] else { return Ok(vec![]) };
        if !want[0] {
            return Ok(vec![]);
        }
        let mesh = self.g.mesh.clone();
        let x = d.operands[0];
        let axis = d.op.axis().expect("collectives have an axis").to_string();
        let a = bit(&mesh, &axis);
        let x_rep = replication::of(&self.varying, x) & a == 0;
        // Over `a`: a replicated operand sums every rank's path, so its contribution is
        // partial over `a`; other partial axes pass through (the transpose is linear).
        let rest = dy.partial & !a;
        let partial_a = if x_rep { a } else { 0 };
        let xt = self.ty(x);
        let v = match &d.op {
            Op::AllReduce { op, .. } => {
                let mut g = if dy.partial & a != 0 {
                    self.set_meta(n, &format!("all_reduce transposed: the output gradient is partial over {axis}, so it is summed"));
                    self.collectives += 1;
                    self.op(
                        Op::AllReduce {
                            axis: axis.clone(),
                            op: ReduceOp::Sum,
                        },
                        &[dy.v],
                    )?
                } else {
                    dy.v
                };
                match op {
                    ReduceOp::Sum => {}
                    ReduceOp::Avg => {
                        let k = mesh.size(&axis).unwrap_or(1) as f64;
                        g = self.op(
                            Op::Scale {
                                factor: Float(1.0 / k),
                            },
                            &[g],
                        )?;
                    }
                    ReduceOp::Max | ReduceOp::Min => {
                        // The ranks holding the extremum share the gradient (torch's
                        // amax rule): mask / (number of such ranks).
                        let which = other_name(*op);
                        self.set_meta(n, &format!("all_reduce {which} transposed: the gradient goes to the ranks holding the {which} over {axis}"));
                        let hit = self.op(
                            Op::Compare {
                                op: weft_ir::CmpOp::Eq,
                            },
                            &[x, d.results[0]],
                        )?;
                        let mask = self.op(Op::Cast { dtype: xt.dtype }, &[hit])?;
                        self.collectives += 1;
                        let count = self.op(
                            Op::AllReduce {
                                axis: axis.clone(),
                                op: ReduceOp::Sum,
                            },
                            &[mask],
                        )?;
                        let share = self.op(Op::Div {}, &[g, count])?;
                        g = self.op(Op::Mul {}, &[mask, share])?;
                    }
                }
                g
            }
            Op::AllGather { dim, .. } => {
                let k = weft_ir::shape::norm_dim(*dim, xt.rank())
                    .map_err(|m| err("`autodiff`: bad all_gather", self.g.describe(n), m))?;
                if dy.partial & a != 0 {
                    self.set_meta(n, &format!("all_gather transposed: reduce_scatter of a gradient partial over {axis}"));
                    self.collectives += 1;
                    self.op(
                        Op::ReduceScatter {
                            axis: axis.clone(),
                            dim: *dim,
                            op: ReduceOp::Sum,
                        },
                        &[dy.v],
                    )?
                } else {
                    let len = xt.shape[k].clone();
                    let start = chunk_start(&axis, &len);
                    self.set_meta(
                        n,
                        &format!(
                            "all_gather transposed: this rank's chunk of the gradient along {axis}"
                        ),
                    );
                    self.op(
                        Op::Slice {
                            dim: *dim,
                            start,
                            len,
                        },
                        &[dy.v],
                    )?
                }
            }
            Op::ReduceScatter { dim, op, .. } => {
                if *op != ReduceOp::Sum {
                    return Err(err(
                        "`autodiff` cannot differentiate this `reduce_scatter`",
                        self.g.describe(n),
                        "only sum has a gradient here",
                    ));
                }
                self.set_meta(
                    n,
                    &format!("reduce_scatter transposed: all_gather over {axis}"),
                );
                self.collectives += 1;
                self.op(
                    Op::AllGather {
                        axis: axis.clone(),
                        dim: *dim,
                    },
                    &[dy.v],
                )?
            }
            Op::AllToAll {
                scatter_dim,
                gather_dim,
                ..
            } => {
                self.set_meta(
                    n,
                    &format!("all_to_all transposed: the inverse all_to_all over {axis}"),
                );
                self.collectives += 1;
                self.op(
                    Op::AllToAll {
                        axis: axis.clone(),
                        scatter_dim: *gather_dim,
                        gather_dim: *scatter_dim,
                    },
                    &[dy.v],
                )?
            }
            Op::AllToAllV { .. } => {
                // Each row's gradient goes back to the rank that sent the row: the inverse
                // exchange, whose send counts are what this rank received (the counts
                // all_to_all'd). Over the atoms of `a` where the rows were replicated
                // (tp peers dispatching the same tokens) the gradient is partial.
                self.set_meta(n, &format!("all_to_all_v transposed: row gradients back to the ranks that sent the rows over {axis}"));
                let recv = self.op(
                    Op::AllToAll {
                        axis: axis.clone(),
                        scatter_dim: 0,
                        gather_dim: 0,
                    },
                    &[d.operands[1]],
                )?;
                let back = self.op(
                    Op::AllToAllV {
                        axis: axis.clone(),
                        rows: xt.shape[0].clone(),
                    },
                    &[dy.v, recv],
                )?;
                self.collectives += 2;
                let partial = rest | (a & !replication::of(&self.varying, x));
                return Ok(vec![(0, Contrib { v: back, partial })]);
            }
            Op::RingShift { shift, .. } => {
                // A permutation of the ranks: the gradient goes back the other way.
                self.set_meta(
                    n,
                    &format!("ring_shift transposed: the gradient travels back {shift} step(s) over {axis}"),
                );
                self.collectives += 1;
                let back = self.op(
                    Op::RingShift {
                        axis: axis.clone(),
                        shift: -*shift,
                    },
                    &[dy.v],
                )?;
                return Ok(vec![(
                    0,
                    Contrib {
                        v: back,
                        partial: dy.partial,
                    },
                )]);
            }
            Op::Broadcast { root, .. } => {
                let g = if dy.partial & a != 0 {
                    self.collectives += 1;
                    self.op(
                        Op::AllReduce {
                            axis: axis.clone(),
                            op: ReduceOp::Sum,
                        },
                        &[dy.v],
                    )?
                } else {
                    dy.v
                };
                // Only the root's operand reaches the output.
                self.set_meta(n, &format!("broadcast transposed: the gradient goes to the root (rank {root} of {axis})"));
                let coord = self.op(
                    Op::Arange {
                        start: Dim::coord(&axis),
                        ty: TensorType::new(weft_ir::DType::I64, vec![Dim::from(1)]),
                    },
                    &[],
                )?;
                let root_t = self.op(
                    Op::Full {
                        value: Float(*root as f64),
                        ty: TensorType::new(weft_ir::DType::I64, vec![Dim::from(1)]),
                    },
                    &[],
                )?;
                let is_root = self.op(
                    Op::Compare {
                        op: weft_ir::CmpOp::Eq,
                    },
                    &[coord, root_t],
                )?;
                let is_root = self.op(Op::Reshape { shape: vec![] }, &[is_root])?;
                let zero = self.op(
                    Op::Full {
                        value: Float(0.0),
                        ty: TensorType::scalar(xt.dtype),
                    },
                    &[],
                )?;
                self.op(Op::Where {}, &[is_root, g, zero])?
            }
            other => {
                return Err(err(
                    format!("`autodiff` cannot differentiate `{}` yet", other.name()),
                    self.g.describe(n),
                    "its transpose is not written",
                )
                .with_help("keep this collective out of the differentiated part of the graph"))
            }
        };
        Ok(vec![(
            0,
            Contrib {
                v,
                partial: rest | partial_a,
            },
        )])
    }
}

fn other_name(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "sum",
        ReduceOp::Avg => "avg",
        ReduceOp::Max => "max",
        ReduceOp::Min => "min",
    }
}

/// Where this rank's chunk of length `len` starts in a dim gathered over `axis`:
/// `@axis * len`, or the prefix sums of a per-rank size table.
fn chunk_start(axis: &str, len: &Dim) -> Dim {
    if let Some(sizes) = per_rank_sizes(len, axis) {
        let mut starts = Vec::with_capacity(sizes.len());
        let mut at = 0;
        for s in sizes {
            starts.push(at);
            at += s;
        }
        return Dim::per_rank(axis, starts);
    }
    Dim::coord(axis) * len.clone()
}

/// The table of a dim that is exactly one per-rank size table over `axis`.
fn per_rank_sizes(d: &Dim, axis: &str) -> Option<Vec<i64>> {
    let tables = d.per_rank_tables();
    if tables.len() != 1 || tables[0].0 != axis {
        return None;
    }
    let n = tables[0].1;
    let b = |c: usize| weft_ir::Bindings::new().with_coord(axis, c as i64);
    let sizes: Option<Vec<i64>> = (0..n).map(|c| d.eval(&b(c)).ok()).collect();
    let sizes = sizes?;
    (Dim::per_rank(axis, sizes.clone()) == *d).then_some(sizes)
}

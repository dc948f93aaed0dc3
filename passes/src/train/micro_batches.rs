//! `micro-batches`: gradient accumulation over `N` micro-batches in one step.
//!
//! Runs on the forward program (after the sharding passes, before `autodiff`). Every
//! node that depends on the token inputs is cloned `N` times; clone `i` reads rows
//! `[i*B/N, (i+1)*B/N)` of each token input (`slice` of dim 0) and has `B` replaced by
//! `B/N` in its types and attributes, so whatever the passes did per rank (a `dp`
//! block, an `sp` block, collectives) is done on the micro-batch. Clones carry
//! `[micro-batch i]`.
//!
//! The loss stays the global mean over the valid tokens of the *whole* batch (not a
//! mean of per-micro-batch means): with the loss `div(all_reduce*(sum), all_reduce*(count))`
//! each micro-batch computes its token-loss sum, the sums are added locally, and the
//! count is computed once on the whole batch, so one `all_reduce` per axis serves the
//! step as before. Outputs with a batch dim (`logits`) are the micro-batches' pieces
//! concatenated.
//!
//! A MoE load-balancing term (`loss = ce + scale{coef}(aux)`, outputs `ce_loss` and
//! `aux_loss`) is computed per micro-batch, as each of HF's forward calls under
//! gradient accumulation computes it from its own tokens' routing: the step's aux is
//! the mean of the micro-batches' (`scale{1/N}` of their sum), so the loss keeps the
//! scale of a single call. (HF's Trainer adds each call's aux undivided when the model
//! takes `num_items_in_batch`, i.e. N times this; a plain `loss / N` loop gives this.)
//! With `dp`, micro-batch `i` is the `i`-th 1/N of every rank's rows, and its aux
//! statistics are summed over the ranks (`shard-seq`'s all_reduce, cloned per
//! micro-batch): the aux of those rows together, as ranks stepping in lockstep see it. `autodiff` then accumulates each parameter's gradient over the
//! micro-batches before `grad-sync`'s single reduction (DeepSpeed's
//! `coalesce_grad_reduction`), and orders each micro-batch's backward right after its
//! forward.

use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::util::{as_symbol, build_error};
use std::collections::{HashMap, HashSet};
use weft_ir::{At, Dim, Float, Graph, Node, NodeMeta, Op, Provenance, ReduceOp, Role, Value};

pub struct MicroBatches;

pub const NAME: &str = "micro-batches";

impl Pass for MicroBatches {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "gradient accumulation: clone the token-dependent forward per micro-batch (B -> B/N), add the loss sums, count valid tokens once for the whole batch"
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let n = cx.options.train.micro_batches;
        let mut res = PassResult::unchanged();
        res.count("micro_batches", n as u64)
            .count("cloned_nodes", 0)
            .count("removed_nodes", 0);
        if n <= 1
            || g.nodes()
                .iter()
                .any(|&x| g.node(x).meta.micro_batch.is_some())
        {
            return Ok(res);
        }
        check_count(g, n)?;
        split(g, n, &mut res)?;
        res.changed = true;
        Ok(res)
    }
}

/// The most micro-batches one step may hold: the graph holds a clone of the
/// token-dependent forward per micro-batch, so this bounds the memory the option can
/// make the compiler use (real runs use tens).
pub const MAX_MICRO_BATCHES: u32 = 4096;

/// Checked before anything is cloned: `n` is at most [`MAX_MICRO_BATCHES`].
fn check_count(g: &Graph, n: u32) -> Result<(), PassError> {
    if n > MAX_MICRO_BATCHES {
        return Err(err(
            g,
            &format!("{n} micro-batches is more than {MAX_MICRO_BATCHES}"),
            "each micro-batch is a clone of the forward in the graph",
        ));
    }
    Ok(())
}

/// What a command checks before compiling a step of `n` micro-batches for a concrete
/// batch: at most [`MAX_MICRO_BATCHES`], and dividing each data-parallel rank's rows
/// (the pass itself works on the symbolic batch; this catches the mismatch before the
/// forward is cloned `n` times).
pub fn check_micro_batches(n: u32, batch: Option<i64>, mesh: &weft_ir::Mesh) -> Result<(), String> {
    if n > MAX_MICRO_BATCHES {
        return Err(format!(
            "invalid --micro-batches {n}: more than {MAX_MICRO_BATCHES} (each is a clone of the forward in the graph)"
        ));
    }
    if let Some(b) = batch {
        let dp = mesh.size_or_one(crate::pass::DP) as i64;
        if n > 1 && b % (dp * n as i64) != 0 {
            return Err(format!(
                "invalid --micro-batches {n}: --batch {b} over dp={dp} is {} rows per rank, which {n} micro-batches do not divide\nhelp: use a batch that is a multiple of {}",
                b as f64 / dp as f64,
                dp * n as i64
            ));
        }
    }
    Ok(())
}

fn err(g: &Graph, what: &str, why: impl Into<String>) -> PassError {
    PassError::rewrite(
        NAME,
        format!("`{NAME}` cannot split the step: {what}"),
        format!("graph `{}`", g.name),
        why,
    )
}

/// `op` with every dim of its attributes mapped by `f`.
fn map_dims(op: &Op, f: &dyn Fn(&Dim) -> Dim) -> Op {
    let ty = |t: &weft_ir::TensorType| t.with_shape(t.shape.iter().map(f).collect());
    match op {
        Op::Full { value, ty: t } => Op::Full {
            value: *value,
            ty: ty(t),
        },
        Op::Arange { start, ty: t } => Op::Arange {
            start: f(start),
            ty: ty(t),
        },
        Op::Reshape { shape } => Op::Reshape {
            shape: shape.iter().map(f).collect(),
        },
        Op::Expand { shape } => Op::Expand {
            shape: shape.iter().map(f).collect(),
        },
        Op::Slice { dim, start, len } => Op::Slice {
            dim: *dim,
            start: f(start),
            len: f(len),
        },
        Op::Split { dim, sizes } => Op::Split {
            dim: *dim,
            sizes: sizes.iter().map(f).collect(),
        },
        Op::AllToAllV { axis, rows } => Op::AllToAllV {
            axis: axis.clone(),
            rows: f(rows),
        },
        other => other.clone(),
    }
}

fn split(g: &mut Graph, n: u32, res: &mut PassResult) -> Result<(), PassError> {
    let inputs = g.inputs();
    let ids = inputs
        .iter()
        .find(|(_, r, _)| *r == Role::InputIds)
        .or_else(|| inputs.iter().find(|(_, r, _)| *r == Role::Labels));
    let Some((_, _, ids)) = ids else {
        return Err(err(
            g,
            "no token input",
            "it has no input with role input_ids or labels",
        ));
    };
    let batch = g
        .ty(*ids)
        .shape
        .first()
        .and_then(as_symbol)
        .ok_or_else(|| {
            err(
                g,
                "no batch symbol",
                format!(
                    "input_ids is {}, whose batch dim is not a symbol",
                    g.ty(*ids)
                ),
            )
        })?;
    let bsym = Dim::sym(&batch);
    let micro = bsym.clone() / Dim::from(n as i64);
    // Token inputs: those whose dim 0 is the batch. Where `shard-inputs` cut a rank's
    // batch block (a dim-0 slice), the micro-batches split that block, so each rank's
    // pieces stay in its block's row order; elsewhere they split the input itself.
    let token_inputs: Vec<Value> = inputs
        .iter()
        .filter(|(_, _, v)| g.ty(*v).shape.first() == Some(&bsym))
        .map(|(_, _, v)| *v)
        .collect();
    let uses = g.uses();
    let mut roots: Vec<Value> = Vec::new();
    for &t in &token_inputs {
        let mut stack = vec![t];
        let mut found = false;
        while let Some(v) = stack.pop() {
            for &(u, _) in &uses[v.0 as usize] {
                let d = g.node(u);
                match &d.op {
                    Op::Slice { dim: 0, .. }
                        if crate::util::made_by(g, u, crate::shard_inputs::NAME) =>
                    {
                        roots.push(d.results[0]);
                        found = true;
                    }
                    Op::ShiftLabels { .. } => stack.push(d.results[0]),
                    _ => {}
                }
            }
        }
        if !found {
            roots.push(t);
        }
    }
    roots.sort();
    roots.dedup();
    // The loss: div(all_reduce*(sum), all_reduce*(count)), plus scale(aux) with a MoE aux loss.
    let loss = g
        .output("loss")
        .ok_or_else(|| err(g, "no loss", "it has no output named `loss`"))?;
    let (ce_loss, aux) = aux_term(g, loss);
    let ld = g.def(ce_loss);
    let (num, den) = match (&g.node(ld).op, g.node(ld).operands.as_slice()) {
        (Op::Div {}, [a, b]) => (*a, *b),
        (op, _) => {
            return Err(err(g, "the loss is not a sum over tokens divided by a count", format!("`loss` is made by `{}`", op.name()))
                .with_help("build the loss as cross_entropy {reduction=sum} / count_valid (sp-loss does for reduction=mean)"))
        }
    };
    let strip = |mut v: Value| {
        let mut chain = Vec::new();
        while let Op::AllReduce {
            op: ReduceOp::Sum, ..
        } = &g.node(g.def(v)).op
        {
            chain.push(g.def(v));
            v = g.node(g.def(v)).operands[0];
        }
        chain.reverse();
        (v, chain)
    };
    let (num0, num_chain) = strip(num);
    let additive = match &g.node(g.def(num0)).op {
        Op::CrossEntropy {
            reduction: weft_ir::Reduction::Sum,
            ..
        } => true,
        Op::Sum { dims, .. } => {
            dims.contains(&0) || g.ty(g.node(g.def(num0)).operands[0]).rank() == dims.len()
        }
        _ => false,
    };
    if !additive || g.ty(num0).rank() != 0 {
        return Err(err(
            g,
            "the loss numerator is not a sum over tokens",
            format!("it is made by `{}`", g.node(g.def(num0)).op.name()),
        ));
    }
    // The nodes that depend on the token inputs, in program order.
    let order: Vec<Node> = g.nodes().to_vec();
    let mut dep: HashSet<Value> = roots.iter().copied().collect();
    let mut nodes: Vec<Node> = Vec::new();
    let root_nodes: HashSet<Node> = roots.iter().map(|v| g.def(*v)).collect();
    for &x in &order {
        let d = g.node(x);
        if matches!(d.op, Op::Input { .. }) || root_nodes.contains(&x) {
            continue;
        }
        if d.operands.iter().any(|v| dep.contains(v)) {
            nodes.push(x);
            dep.extend(d.results.iter().copied());
        }
    }
    if let Some((aux, _)) = aux {
        if !dep.contains(&aux) {
            return Err(err(
                g,
                "the aux loss does not depend on the tokens",
                format!(
                    "{} is not computed from the token inputs",
                    g.describe(g.def(aux))
                ),
            ));
        }
    }
    if !dep.contains(&num0) {
        return Err(err(
            g,
            "the loss does not depend on the tokens",
            "nothing to split",
        ));
    }
    // Clone per micro-batch.
    // Data-dependent sizes (the rows an expert-parallel `all_to_all_v` receives) differ
    // per micro-batch: each clone binds its own symbol (`R57` -> `R57_mb1`).
    let cloned: HashSet<Node> = nodes.iter().copied().collect();
    let runtime: Vec<String> = g
        .runtime_symbols()
        .into_iter()
        .filter(|(_, x)| cloned.contains(x))
        .map(|(s, _)| s)
        .collect();
    let mut clones: Vec<HashMap<Value, Value>> = Vec::new();
    for i in 0..n {
        let sub = |d: &Dim| {
            runtime.iter().fold(d.substitute(&batch, &micro), |d, r| {
                d.substitute(r, &Dim::sym(&format!("{r}_mb{i}")))
            })
        };
        let mut map: HashMap<Value, Value> = HashMap::new();
        for &r in &roots {
            let meta = NodeMeta {
                source: g.node(g.def(r)).meta.source.clone(),
                provenance: Some(Provenance {
                    pass: NAME.into(),
                    reason: format!("rows of micro-batch {i} of {n}"),
                }),
                derived: None,
                micro_batch: Some(i),
            };
            let rows = g.ty(r).shape[0].clone() / Dim::from(n as i64);
            let op = Op::Slice {
                dim: 0,
                start: rows.clone() * Dim::from(i as i64),
                len: rows,
            };
            let v = g
                .insert_with(At::End, op, &[r], meta)
                .map_err(|e| build_error(NAME, e))?[0];
            map.insert(r, v);
        }
        for &x in &nodes {
            let d = g.node(x).clone();
            let op = map_dims(&d.op, &sub);
            let operands: Vec<Value> = d
                .operands
                .iter()
                .map(|v| *map.get(v).unwrap_or(v))
                .collect();
            let mut meta = d.meta.clone();
            meta.micro_batch = Some(i);
            let rs = g
                .insert_with(At::End, op, &operands, meta)
                .map_err(|e| build_error(NAME, e))?;
            for (a, b) in d.results.iter().zip(rs) {
                let want: Vec<Dim> = g.ty(*a).shape.iter().map(&sub).collect();
                if g.ty(b).shape != want {
                    return Err(err(
                        g,
                        "a node does not follow the micro-batch size",
                        format!(
                            "{} gives {} for micro-batch {i}, expected {:?}",
                            g.describe(x),
                            g.ty(b),
                            want
                        ),
                    ));
                }
                map.insert(*a, b);
            }
            res.count("cloned_nodes", 1);
        }
        clones.push(map);
    }
    let meta = |reason: &str| NodeMeta {
        source: Some("loss".into()),
        provenance: Some(Provenance {
            pass: NAME.into(),
            reason: reason.into(),
        }),
        ..Default::default()
    };
    // The loss: the micro-batches' sums added, reduced as before, over the whole count.
    let mut total = clones[0][&num0];
    for m in &clones[1..] {
        total = g
            .insert_with(
                At::End,
                Op::Add {},
                &[total, m[&num0]],
                meta("token-loss sums of the micro-batches"),
            )
            .map_err(|e| build_error(NAME, e))?[0];
    }
    for &c in &num_chain {
        let d = g.node(c).clone();
        let mut m = d.meta.clone();
        m.micro_batch = None;
        total = g
            .insert_with(At::End, d.op.clone(), &[total], m)
            .map_err(|e| build_error(NAME, e))?[0];
    }
    let new_ce = g
        .insert_with(
            At::End,
            Op::Div {},
            &[total, den],
            meta("global mean over the valid tokens of the whole batch"),
        )
        .map_err(|e| build_error(NAME, e))?[0];
    // Scalar outputs: the loss and its parts, rebuilt from the micro-batches.
    let mut scalars: HashMap<Value, Value> = HashMap::from([(ce_loss, new_ce)]);
    let mut new_loss = new_ce;
    if let Some((aux, weight)) = aux {
        let mut sum = clones[0][&aux];
        for m in &clones[1..] {
            sum = g
                .insert_with(
                    At::End,
                    Op::Add {},
                    &[sum, m[&aux]],
                    meta("MoE aux losses of the micro-batches (each from its own tokens' routing)"),
                )
                .map_err(|e| build_error(NAME, e))?[0];
        }
        let mean = g
            .insert_with(
                At::End,
                Op::Scale {
                    factor: Float(1.0 / n as f64),
                },
                &[sum],
                meta("MoE aux loss: the mean of the micro-batches' (one forward call's scale)"),
            )
            .map_err(|e| build_error(NAME, e))?[0];
        let weighted = g
            .insert_with(
                At::End,
                weight,
                &[mean],
                meta("router_aux_loss_coef x aux loss"),
            )
            .map_err(|e| build_error(NAME, e))?[0];
        new_loss = g
            .insert_with(
                At::End,
                Op::Add {},
                &[new_ce, weighted],
                meta("cross-entropy + weighted MoE aux loss"),
            )
            .map_err(|e| build_error(NAME, e))?[0];
        scalars.insert(aux, mean);
    }
    scalars.insert(loss, new_loss);
    // Batch outputs: the micro-batches' pieces along dim 0.
    let outs: Vec<(String, Value)> = g.outputs().to_vec();
    for (name, v) in outs {
        if let Some(&w) = scalars.get(&v) {
            g.set_output(&name, w);
            continue;
        }
        if !dep.contains(&v) {
            continue;
        }
        if !g.ty(v).shape.first().is_some_and(|d| d.mentions(&batch)) {
            return Err(err(
                g,
                &format!("output `{name}` has no batch dim"),
                format!("it is {}", g.ty(v)),
            ));
        }
        let parts: Vec<Value> = clones.iter().map(|m| m[&v]).collect();
        let cat = g
            .insert_with(
                At::End,
                Op::Concat { dim: 0 },
                &parts,
                meta("the micro-batches' pieces"),
            )
            .map_err(|e| build_error(NAME, e))?[0];
        g.set_output(&name, cat);
    }
    // The originals no one reads any more.
    let before = g.node_count();
    loop {
        let uses = g.uses();
        let outputs: HashSet<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
        let dead: Vec<Node> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&x| {
                let d = g.node(x);
                !matches!(d.op, Op::Input { .. } | Op::Param { .. })
                    && d.results
                        .iter()
                        .all(|r| uses[r.0 as usize].is_empty() && !outputs.contains(r))
            })
            .collect();
        if dead.is_empty() {
            break;
        }
        g.remove_nodes(&dead);
    }
    res.count("removed_nodes", (before - g.node_count()) as u64);
    Ok(())
}

/// `loss = add(ce, scale{coef}(aux))` (a MoE aux loss): `(ce, Some((aux, scale op)))`;
/// otherwise `(loss, None)`.
fn aux_term(g: &Graph, loss: Value) -> (Value, Option<(Value, Op)>) {
    let d = g.node(g.def(loss));
    if let (Op::Add {}, [ce, weighted]) = (&d.op, d.operands.as_slice()) {
        let w = g.node(g.def(*weighted));
        if matches!(g.node(g.def(*ce)).op, Op::Div {}) && matches!(w.op, Op::Scale { .. }) {
            return (*ce, Some((w.operands[0], w.op.clone())));
        }
    }
    (loss, None)
}

/// Reorders a joint graph so each micro-batch's backward follows its forward: a
/// topological order that always runs the ready node of the lowest micro-batch
/// (forward nodes by their tag, other nodes take the highest micro-batch they read),
/// ties in program order.
///
/// Kahn's algorithm with a priority queue, written here rather than petgraph's
/// `algo::toposort`: that one is a DFS order with no say in which ready node comes
/// next, and the priority (micro-batch, then program position) is the point.
/// Iterative, so its depth does not grow with the graph.
pub fn interleave(g: &mut Graph) {
    if !g
        .nodes()
        .iter()
        .any(|&x| g.node(x).meta.micro_batch.is_some())
    {
        return;
    }
    let order: Vec<Node> = g.nodes().to_vec();
    let pos: HashMap<Node, usize> = order.iter().enumerate().map(|(i, x)| (*x, i)).collect();
    let mut key: HashMap<Node, u32> = HashMap::new();
    for &x in &order {
        let d = g.node(x);
        // Forward nodes by their tag; the rest by what they read (a backward node shared
        // by the micro-batches, such as -sin for rope, belongs to none of them).
        let from_operands = || {
            d.operands
                .iter()
                .map(|v| key[&g.def(*v)])
                .max()
                .unwrap_or(0)
        };
        let k = match (d.meta.micro_batch, d.meta.derived) {
            (Some(m), None) => m,
            _ => from_operands(),
        };
        key.insert(x, k);
    }
    let mut indeg: HashMap<Node, usize> = HashMap::new();
    let mut users: HashMap<Node, Vec<Node>> = HashMap::new();
    for &x in &order {
        let mut preds: Vec<Node> = g.node(x).operands.iter().map(|v| g.def(*v)).collect();
        preds.sort();
        preds.dedup();
        indeg.insert(x, preds.len());
        for p in preds {
            users.entry(p).or_default().push(x);
        }
    }
    let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<(u32, usize)>> = order
        .iter()
        .filter(|x| indeg[x] == 0)
        .map(|x| std::cmp::Reverse((key[x], pos[x])))
        .collect();
    let mut out = Vec::with_capacity(order.len());
    while let Some(std::cmp::Reverse((_, p))) = ready.pop() {
        let x = order[p];
        out.push(x);
        for u in users.get(&x).cloned().unwrap_or_default() {
            let e = indeg.get_mut(&u).expect("every node has an in-degree");
            *e -= 1;
            if *e == 0 {
                ready.push(std::cmp::Reverse((key[&u], pos[&u])));
            }
        }
    }
    g.set_order(out);
}

//! What a training step keeps in device memory, per rank: the joint graph's forward
//! and backward sides, the activations the backward reads from the forward (saved),
//! and an estimate of parameters, gradients, optimizer state, saved activations and
//! the peak of everything live in program order. `checkpoint` and `offload` use the
//! analysis; `weft compile --stats` prints the estimate.

use crate::training::TrainOptions;
use std::collections::{HashMap, HashSet};
use weft_ir::{Bindings, DerivedKind, Graph, Node, Op, Value, ValueRole};

/// Passes whose nodes belong to the step after the forward.
const AFTER_FORWARD: &[&str] = &[
    "autodiff",
    "grad-sync",
    "optimizer",
    "checkpoint",
    "offload",
];

/// True for a node of the forward (not made by autodiff or a later training pass).
pub fn is_forward(g: &Graph, n: Node) -> bool {
    let m = &g.node(n).meta;
    m.derived.is_none()
        && !m
            .provenance
            .as_ref()
            .is_some_and(|p| AFTER_FORWARD.contains(&p.pass.as_str()))
}

/// True for the sources every rank holds whatever the policy (params, inputs).
pub fn is_resident(op: &Op) -> bool {
    matches!(op, Op::Param { .. } | Op::Input { .. })
}

/// The joint graph's split into forward and the rest, and the saved activations.
pub struct Joint {
    /// Program position of every live node.
    pub pos: HashMap<Node, usize>,
    pub forward: HashSet<Node>,
    /// Forward values (not params or inputs) that a node after the forward reads,
    /// other than through an `offload` copy, in program order.
    pub saved: Vec<Value>,
    /// For each saved value, the positions of its uses after the forward.
    pub backward_uses: HashMap<Value, Vec<usize>>,
}

impl Joint {
    pub fn of(g: &Graph) -> Joint {
        let order = g.nodes();
        let pos: HashMap<Node, usize> = order.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let forward: HashSet<Node> = order
            .iter()
            .copied()
            .filter(|&n| is_forward(g, n))
            .collect();
        let mut backward_uses: HashMap<Value, Vec<usize>> = HashMap::new();
        for (i, &n) in order.iter().enumerate() {
            if forward.contains(&n) || matches!(g.node(n).op, Op::Offload { .. }) {
                continue;
            }
            for v in &g.node(n).operands {
                let d = g.def(*v);
                if forward.contains(&d) && !is_resident(&g.node(d).op) {
                    backward_uses.entry(*v).or_default().push(i);
                }
            }
        }
        let mut saved: Vec<Value> = backward_uses.keys().copied().collect();
        saved.sort_by_key(|v| (pos[&g.def(*v)], v.0));
        Joint {
            pos,
            forward,
            saved,
            backward_uses,
        }
    }
}

/// The bindings per-rank bytes are evaluated at: the mesh sizes, rank 0's coordinates,
/// and `B`, `S` from the options (default: one 4096-token sequence per dp rank).
pub fn bindings(g: &Graph, opts: &TrainOptions) -> Bindings {
    let mut b = Bindings::new();
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64).with_coord(a, 0);
    }
    let dp = g.mesh.size_or_one("dp") as i64;
    b.with("B", opts.batch.unwrap_or(dp))
        .with("S", opts.seq.unwrap_or(4096))
}

/// Per-rank bytes of a value (0 when a size cannot be evaluated).
pub fn bytes(g: &Graph, v: Value, b: &Bindings) -> u64 {
    g.ty(v).size_bytes(b).unwrap_or(0)
}

/// FLOPs of a node at the bindings (forward count; 0 when unknown).
pub fn flops(g: &Graph, n: Node, b: &Bindings) -> f64 {
    weft_ir::flops::node_flops(g, n)
        .eval(b)
        .map(|x| x as f64)
        .unwrap_or(0.0)
}

/// The rows and visited (query, key) pairs of an `attention` or `attention_grad` at the
/// bindings, for the cost model's per-row term (`None` for other ops or unknown sizes).
pub fn attention_work(g: &Graph, n: Node, b: &Bindings) -> Option<(f64, f64)> {
    let w = weft_ir::flops::node_attention_work(g, n)?;
    let rows = w.rows.eval_f64(b).ok()?;
    let pairs = w.pairs.eval_f64(b).ok()?;
    Some((rows, pairs))
}

/// The model layer a scope belongs to: `model.layers.3` for `model.layers.3.mlp`.
pub fn layer_of(source: Option<&str>) -> Option<String> {
    let s = source?;
    let rest = s.strip_prefix("model.layers.")?;
    let idx: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    (!idx.is_empty()).then(|| format!("model.layers.{idx}"))
}

/// The layer number of a layer scope.
pub fn layer_index(layer: &str) -> Option<usize> {
    layer.strip_prefix("model.layers.")?.parse().ok()
}

/// Per-rank memory of a training step, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryEstimate {
    /// Parameters (this rank's shards), not counting optimizer state.
    pub params: u64,
    /// Parameter gradients, as held on this rank (each parameter the step returns a
    /// `grad.*` or a `param.*` update of, at its per-rank size). How many are live at
    /// once is in `peak_live`.
    pub grads: u64,
    /// Optimizer state on the device: moments, buffers and f32 master weights (`optim.*`).
    pub optimizer: u64,
    /// Optimizer state in host memory that the step streams in for its updates
    /// (`--stream-optimizer-state`: state params only `reload` reads).
    pub host_optimizer: u64,
    /// Activations the forward keeps for the backward, on the device.
    pub saved_activations: u64,
    /// Activations moved to host memory by `offload`.
    pub offloaded: u64,
    /// The most bytes of values live at once in program order, the order the plan
    /// schedules and allocates in (activations, their gradients, saved activations,
    /// recomputed values, parameter gradients until their update reads them, or to the
    /// end of the step when it returns them), without params and optimizer state
    /// (updated in place); a reshape shares its operand's bytes and the logits gradient
    /// the logits', as in the plan.
    pub peak_live: u64,
    /// params + optimizer + peak_live.
    pub total: u64,
}

/// Estimates the per-rank memory of a step at the bindings.
pub fn estimate(g: &Graph, b: &Bindings) -> MemoryEstimate {
    let mut e = MemoryEstimate::default();
    let uses = g.uses();
    let mut seen = HashSet::new();
    for (name, v) in g.params() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let by = bytes(g, v, b);
        if ValueRole::of(&name).is_some_and(ValueRole::is_optimizer_state) {
            let readers = &uses[v.0 as usize];
            let streamed = !readers.is_empty()
                && readers
                    .iter()
                    .all(|&(n, i)| i == 0 && matches!(g.node(n).op, Op::Reload { .. }));
            if streamed {
                e.host_optimizer += by;
            } else {
                e.optimizer += by;
            }
        } else {
            e.params += by;
        }
    }
    // A gradient has its parameter's per-rank type: count each parameter the step
    // returns a gradient or an update of (a step that updates the parameters need not
    // return the gradients).
    let outs: HashSet<&str> = g.outputs().iter().map(|(n, _)| n.as_str()).collect();
    let mut seen = HashSet::new();
    for (name, v) in g.params() {
        if ValueRole::of(&name).is_some_and(ValueRole::is_optimizer_state)
            || !seen.insert(name.clone())
        {
            continue;
        }
        let grad = weft_ir::role::grad_name(&name);
        let update = weft_ir::role::updated_name(&name);
        if outs.contains(grad.as_str()) || outs.contains(update.as_str()) {
            e.grads += bytes(g, v, b);
        }
    }
    let joint = Joint::of(g);
    e.saved_activations = joint.saved.iter().map(|v| bytes(g, *v, b)).sum();
    // Activations copied out (a streamed state's copy back is an output, not one).
    let out_values: HashSet<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
    for &n in g.nodes() {
        if let Op::Offload { .. } = g.node(n).op {
            let r = g.node(n).results[0];
            if !out_values.contains(&r) {
                e.offloaded += bytes(g, r, b);
            }
        }
    }
    // Liveness in program order: a value lives from its node to its last use, step
    // outputs to the end; params, inputs and host copies are not counted, nor the
    // updated params and optimizer state (written in place of the resident ones).
    let order = g.nodes();
    let mut last = vec![0usize; g.value_capacity()];
    for (i, &n) in order.iter().enumerate() {
        for v in &g.node(n).operands {
            last[v.0 as usize] = i;
        }
    }
    let mut in_place = vec![false; g.value_capacity()];
    let param_names: HashSet<String> = g.params().into_iter().map(|(n, _)| n).collect();
    for (name, v) in g.outputs() {
        if weft_ir::plan::fed_back_param(name, |n| param_names.contains(n)).is_some() {
            in_place[v.0 as usize] = true;
        } else {
            last[v.0 as usize] = usize::MAX;
        }
    }
    // Shared bytes, as the plan places them: a reshape is a view of its operand's bytes
    // (the group lives to its members' last use), and the ops of
    // `plan::ELEMENTWISE_IN_PLACE` write over an operand whose group dies there.
    let mut root: Vec<usize> = (0..g.value_capacity()).collect();
    let mut group_last = last.clone();
    for (i, &n) in order.iter().enumerate() {
        let d = g.node(n);
        let join = |x: Value, y: Value, root: &mut Vec<usize>, group_last: &mut Vec<usize>| {
            let r = root[x.0 as usize];
            root[y.0 as usize] = r;
            group_last[r] = group_last[r].max(last[y.0 as usize]);
        };
        if matches!(d.op, Op::Reshape { .. })
            && !in_place[d.results[0].0 as usize]
            && bytes(g, d.operands[0], b) == bytes(g, d.results[0], b)
            && !matches!(g.node(g.def(d.operands[0])).op, Op::Offload { .. })
        {
            join(d.operands[0], d.results[0], &mut root, &mut group_last);
        } else if crate::plan::ELEMENTWISE_IN_PLACE.contains(&d.op.name()) {
            for &(oi, ri) in weft_ir::plan::in_place_pairs(d.op.name()) {
                // An optional operand (`embedding_grad`'s init) may be absent.
                let (Some(&x), Some(&y)) = (d.operands.get(oi), d.results.get(ri)) else {
                    continue;
                };
                let xd = &g.node(g.def(x)).op;
                if group_last[root[x.0 as usize]] == i
                    && !is_resident(xd)
                    && !in_place[y.0 as usize]
                    && bytes(g, x, b) == bytes(g, y, b)
                {
                    join(x, y, &mut root, &mut group_last);
                }
            }
        }
    }
    let mut frees: Vec<Vec<u64>> = vec![Vec::new(); order.len() + 1];
    let (mut live, mut peak) = (0u64, 0u64);
    for (i, &n) in order.iter().enumerate() {
        let d = g.node(n);
        // Params, inputs and host copies hold no device bytes of their own (but what dies
        // at them, such as a value at its offload, is freed below all the same).
        let holds = !(is_resident(&d.op) || matches!(d.op, Op::Offload { .. }));
        for v in d.results.iter().filter(|_| holds) {
            if in_place[v.0 as usize] || root[v.0 as usize] != v.0 as usize {
                continue;
            }
            let by = bytes(g, *v, b);
            live += by;
            let l = group_last[v.0 as usize];
            let at = if l == usize::MAX {
                order.len()
            } else {
                l.max(i)
            };
            frees[at].push(by);
        }
        peak = peak.max(live);
        for by in frees[i].drain(..) {
            live -= by;
        }
    }
    e.peak_live = peak;
    e.total = e.params + e.optimizer + e.peak_live;
    e
}

/// True when the node was recomputed by `checkpoint`.
pub fn is_recompute(g: &Graph, n: Node) -> bool {
    g.node(n)
        .meta
        .derived
        .is_some_and(|d| d.kind == DerivedKind::Recompute)
}

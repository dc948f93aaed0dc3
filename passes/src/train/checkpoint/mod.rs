//! `checkpoint`: selective activation checkpointing on the joint graph.
//!
//! The backward reads forward values (the saved activations). A policy chooses which
//! to keep; every other one the backward reads is recomputed from kept values,
//! parameters and inputs by copies of its forward nodes, each marked
//! `[recompute of %v]` with provenance, placed just before the first backward node
//! that needs it (so a recomputed value lives only as long as its backward use).
//!
//! - `full` (per layer): keep what enters each layer (the residual stream between
//!   layers) and what lies outside the layers (embedding, final norm, head, loss);
//!   recompute everything inside a layer, collectives included.
//! - `selective` (AutoSP's): like `full`, but also keep attention outputs (quadratic
//!   in the sequence to recompute) and collective results (recomputing them would
//!   communicate again); matmuls, norms and elementwise ops are recomputed.
//! - With `--offload` (and no offload budget), `selective` and `budget=` send to the
//!   host, instead of recomputing them, the compute-bound values (projection outputs)
//!   the host link can carry: layer by layer, the set with the most recompute time whose
//!   copies leave by the end of the next layer's forward and come back before their
//!   backward use, on the plan cost model's clock (see `host.rs`).
//! - `budget=<bytes>`: keep the step's peak of live values per rank (the memory
//!   estimate's `peak live`: saved and recomputed activations, backward transients,
//!   gradients in flight; parameters and optimizer state aside) within the budget at
//!   the least recompute. A min-cut over the forward part of the joint graph as in
//!   PyTorch's partitioner chooses what to save for a saved-bytes target: cutting
//!   `n_in -> n_out` saves `n` (its bytes), cutting `source -> n_in` recomputes `n`
//!   (λ × its FLOPs from the cost model), every value the backward reads drains to the
//!   sink, forward edges are uncuttable; λ (bytes per FLOP) is searched for the largest
//!   one whose cut fits the target. A recomputed value lives from its recompute to its
//!   last backward use, so each cut is checked by the liveness estimate of the whole
//!   step (after `grad-sync` and `optimizer`) and the target lowered by the overshoot
//!   until the peak fits; a budget that even the cut saving least cannot meet is an
//!   error. Collectives are never recomputed. Sizes are evaluated at the options' `B`
//!   and `S`. The min-cut is in `min_cut.rs`, the offload in place of recompute in
//!   `host.rs`.

mod host;
mod min_cut;

use crate::memory::{bytes, flops, is_resident, layer_of, Joint};
use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::training::CheckpointPolicy;
use host::{budget_with_offload, link_options, offload_instead, offload_rewrite};
use min_cut::min_cut_keep;
use std::collections::{HashMap, HashSet};
use weft_ir::{At, Derived, DerivedKind, Graph, Node, Op, Provenance, Value};

pub struct Checkpoint;

pub const NAME: &str = "checkpoint";

impl Pass for Checkpoint {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "activation checkpointing: keep what the policy says (full per layer, selective, or a byte budget by min-cut) and recompute the rest before its backward use"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::autodiff::NAME]
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        for k in [
            "saved_before",
            "saved_after",
            "recomputed_nodes",
            "saved_bytes_before",
            "saved_bytes_after",
            "recompute_flops",
        ] {
            res.count(k, 0);
        }
        let policy = cx.options.train.checkpoint.clone();
        if policy == CheckpointPolicy::None
            || g.nodes().iter().any(|&n| crate::memory::is_recompute(g, n))
        {
            return Ok(res);
        }
        let b = crate::memory::bindings(g, &cx.options.train);
        let joint = Joint::of(g);
        res.count("saved_before", joint.saved.len() as u64);
        res.count(
            "saved_bytes_before",
            joint.saved.iter().map(|v| bytes(g, *v, &b)).sum(),
        );
        let why = match &policy {
            CheckpointPolicy::None => unreachable!(),
            CheckpointPolicy::Full => "full: recomputed in its layer's backward".to_string(),
            CheckpointPolicy::Selective => "selective: recomputed (matmuls and elementwise ops; attention outputs and collectives are kept)".to_string(),
            CheckpointPolicy::Budget(bytes_max) => format!("budget={bytes_max}: recomputed (min-cut of saved bytes and recompute FLOPs)"),
        };
        // `budget=` with `--offload` may choose what goes to the host itself.
        let mut chosen_to_host = None;
        let keep = match policy.clone() {
            CheckpointPolicy::None => unreachable!(),
            CheckpointPolicy::Full => layer_keep(g, &joint, false),
            CheckpointPolicy::Selective => layer_keep(g, &joint, true),
            CheckpointPolicy::Budget(budget) => {
                let (keep, peak, tries) = match link_options(cx) {
                    None => budget_keep(g, &joint, &b, budget, &why, cx, &[], 0)?,
                    Some(o) => match budget_with_offload(g, &joint, &b, budget, &why, cx, o)? {
                        Some((keep, to_host, peak, tries)) => {
                            chosen_to_host = Some(to_host);
                            (keep, peak, tries)
                        }
                        // Below what selective + offload needs: the min-cut, with what
                        // selective + offload sends to the host kept at no device cost;
                        // if even that cannot fit (a value on its way to or from the host
                        // still holds device bytes), the min-cut alone, the host link
                        // then carrying what it can of what that recomputes.
                        None => {
                            let host =
                                offload_instead(g, &joint, &b, &layer_keep(g, &joint, true), o);
                            match budget_keep(
                                g,
                                &joint,
                                &b,
                                budget,
                                &why,
                                cx,
                                &host,
                                o.link_bytes_per_s,
                            ) {
                                Ok((keep, peak, tries)) => {
                                    chosen_to_host = Some(
                                        host.into_iter().filter(|v| keep.contains(v)).collect(),
                                    );
                                    (keep, peak, tries)
                                }
                                Err(_) => budget_keep(g, &joint, &b, budget, &why, cx, &[], 0)?,
                            }
                        }
                    },
                };
                res.count("budget_tries", tries);
                res.count("peak_bytes", peak);
                keep
            }
        };
        // With `--offload` (no offload budget): what the host link can carry goes there
        // instead of being recomputed.
        let to_host = match (&policy, link_options(cx)) {
            (CheckpointPolicy::Selective | CheckpointPolicy::Budget(_), Some(o)) => {
                let v = chosen_to_host.unwrap_or_else(|| offload_instead(g, &joint, &b, &keep, o));
                res.count("offloaded", v.len() as u64);
                res.count("offloaded_bytes", v.iter().map(|x| bytes(g, *x, &b)).sum());
                v
            }
            _ => Vec::new(),
        };
        let mut keep = keep;
        keep.extend(to_host.iter().copied());
        let (cloned, fl) = apply(g, &joint, &keep, &policy, &why, &b)?;
        if cloned == 0 && to_host.is_empty() {
            return Ok(res);
        }
        res.count("recomputed_nodes", cloned as u64);
        res.count("recompute_flops", fl as u64);
        let after = Joint::of(g);
        res.count("saved_after", after.saved.len() as u64);
        res.count(
            "saved_bytes_after",
            after.saved.iter().map(|v| bytes(g, *v, &b)).sum(),
        );
        if !to_host.is_empty() {
            let o = link_options(cx).expect("offload options");
            offload_rewrite(g, &to_host, &b, o.link_bytes_per_s)?;
        }
        res.changed = true;
        Ok(res)
    }
}

/// Recomputes every saved value of `joint` not in `keep` (only `full` re-runs a
/// layer's collectives; the others keep their results). Returns the number of clones
/// and their FLOPs.
fn apply(
    g: &mut Graph,
    joint: &Joint,
    keep: &HashSet<Value>,
    policy: &CheckpointPolicy,
    why: &str,
    b: &weft_ir::Bindings,
) -> Result<(usize, f64), PassError> {
    let recompute_collectives = *policy == CheckpointPolicy::Full;
    let recompute: Vec<Value> = joint
        .saved
        .iter()
        .copied()
        .filter(|v| {
            !keep.contains(v) && (recompute_collectives || !g.node(g.def(*v)).op.is_collective())
        })
        .collect();
    if recompute.is_empty() {
        return Ok((0, 0.0));
    }
    rematerialize(g, joint, keep, &recompute, why, b, recompute_collectives)
}

/// The peak of live values per rank (the estimate's `peak_live`) of the step `g`
/// becomes once `keep` is applied and the rest of the training pipeline (`grad-sync`,
/// then `optimizer` when the options have one, which frees each gradient as its
/// bucket is updated) has run, with the kept values of `to_host` offloaded (over a
/// link of `link` bytes per second).
#[allow(clippy::too_many_arguments)]
fn step_peak(
    g: &Graph,
    joint: &Joint,
    keep: &HashSet<Value>,
    to_host: &[Value],
    link: u64,
    policy: &CheckpointPolicy,
    why: &str,
    b: &weft_ir::Bindings,
    cx: &PassContext,
) -> Result<u64, PassError> {
    let mut t = g.clone();
    apply(&mut t, joint, keep, policy, why, b)?;
    let host: Vec<Value> = to_host
        .iter()
        .copied()
        .filter(|v| keep.contains(v))
        .collect();
    if !host.is_empty() {
        offload_rewrite(&mut t, &host, b, link)?;
    }
    finish_step(&mut t, cx)?;
    Ok(crate::memory::estimate(&t, b).peak_live)
}

/// The training passes after `checkpoint` that change the step's liveness: `grad-sync`,
/// then `optimizer` when the options have one (it frees each gradient as its bucket is
/// updated).
fn finish_step(t: &mut Graph, cx: &PassContext) -> Result<(), PassError> {
    use crate::pass::Pass;
    crate::grad_sync::GradSync.run(t, cx)?;
    if cx.options.train.optimizer.is_some() {
        crate::optimizer::OptimizerPass.run(t, cx)?;
    }
    Ok(())
}

/// The values to keep so that the step's peak of live values fits `budget`, the peak
/// that keeping them gives, and how many cuts were tried. The min-cut bounds the saved
/// bytes; recomputed values live from their recompute to their last backward use and
/// the backward has its own transients, so each cut is checked by the liveness
/// estimate of the whole step, and the saved-bytes target lowered by the overshoot
/// until it fits. Errors when even the cut that keeps the least does not fit. Values of
/// `to_host` cost no device bytes in the cut and are offloaded when kept.
#[allow(clippy::too_many_arguments)]
fn budget_keep(
    g: &Graph,
    joint: &Joint,
    b: &weft_ir::Bindings,
    budget: u64,
    why: &str,
    cx: &PassContext,
    to_host: &[Value],
    link: u64,
) -> Result<(HashSet<Value>, u64, u64), PassError> {
    let policy = CheckpointPolicy::Budget(budget);
    let free: HashSet<Value> = to_host.iter().copied().collect();
    let saved_of = |keep: &HashSet<Value>| -> u64 {
        keep.iter()
            .filter(|v| !free.contains(v))
            .map(|v| bytes(g, *v, b))
            .sum()
    };
    let mut target = budget;
    let mut tries = 0;
    for _ in 0..MAX_BUDGET_TRIES {
        let (keep, met) = min_cut_keep(g, joint, b, target, &free);
        if !met {
            break;
        }
        tries += 1;
        let peak = step_peak(g, joint, &keep, to_host, link, &policy, why, b, cx)?;
        if peak <= budget {
            return Ok((keep, peak, tries));
        }
        let next = target.min(saved_of(&keep)).saturating_sub(peak - budget);
        if next == 0 || next >= target {
            break;
        }
        target = next;
    }
    // The cut that keeps the least.
    let (least, _) = min_cut_keep(g, joint, b, 0, &free);
    tries += 1;
    let peak = step_peak(g, joint, &least, to_host, link, &policy, why, b, cx)?;
    if peak <= budget {
        return Ok((least, peak, tries));
    }
    let gib = |x: u64| match x {
        x if x >= 1 << 30 => format!("{:.3} GiB", x as f64 / (1u64 << 30) as f64),
        x if x >= 1 << 20 => format!("{:.3} MiB", x as f64 / (1u64 << 20) as f64),
        x => format!("{:.3} KiB", x as f64 / 1024.0),
    };
    Err(PassError::rewrite(
        NAME,
        format!("`--checkpoint budget={budget}` cannot be met"),
        format!("graph `{}`", g.name),
        format!(
            "recomputing all it can, the step still peaks at {peak} bytes ({}) of live values per rank (saving {} bytes), over the budget of {budget} bytes ({})",
            gib(peak),
            saved_of(&least),
            gib(budget)
        ),
    )
    .with_help(format!("raise the budget to at least {peak}, use `--checkpoint full` (which also recomputes collectives), or lower the per-rank activations (more `sp` or `tp`, a smaller batch, --micro-batches{})", if to_host.is_empty() { ", --offload" } else { "" })))
}

/// How many cuts `budget=` checks by liveness before taking the one that keeps least.
const MAX_BUDGET_TRIES: usize = 12;

/// The values `full` (and `selective`, with `also_attention`) keep: those defined
/// outside the layers, those a later scope reads (a layer's outputs), and for
/// `selective` attention outputs and collective results.
///
/// A layer's outputs are kept whether or not the backward reads them: where it reads
/// only values computed from them (a norm that casts the residual stream to f32 before
/// anything else, as gemma2's does in bf16, is read through the cast), a layer's
/// recompute must still start from its input, not from the previous layer's recompute
/// (which chained every layer's recompute back to the embedding, all placed before the
/// last layer's backward: gemma2-9b's `full` kept the peak of `none`). Kept values the
/// backward and the recomputes do not read die after the forward as before.
fn layer_keep(g: &Graph, joint: &Joint, also_attention: bool) -> HashSet<Value> {
    let layer_of_node = |n: Node| layer_of(g.node(n).meta.source.as_deref());
    let crossing = crossing_values(g, joint);
    let mut keep: HashSet<Value> = joint
        .saved
        .iter()
        .copied()
        .filter(|v| {
            let d = g.def(*v);
            let op = &g.node(d).op;
            layer_of_node(d).is_none()
                || (also_attention
                    && (matches!(op, Op::Attention { .. } | Op::RingAttention { .. })
                        || op.is_collective()))
        })
        .collect();
    keep.extend(crossing);
    keep
}

/// Forward values read by a forward node of another layer (or outside the layers):
/// each layer's outputs, the residual stream between layers.
fn crossing_values(g: &Graph, joint: &Joint) -> HashSet<Value> {
    let layer_of_node = |n: Node| layer_of(g.node(n).meta.source.as_deref());
    let mut crossing: HashSet<Value> = HashSet::new();
    for &n in g.nodes() {
        if !joint.forward.contains(&n) {
            continue;
        }
        let here = layer_of_node(n);
        for v in &g.node(n).operands {
            let d = g.def(*v);
            if layer_of_node(d).is_some() && layer_of_node(d) != here {
                crossing.insert(*v);
            }
        }
    }
    crossing
}

/// Clones the forward nodes that compute `values` from kept values, params and inputs,
/// each just before the first node after the forward that reads it; rewires those
/// reads. Returns the number of clones and their FLOPs.
fn rematerialize(
    g: &mut Graph,
    joint: &Joint,
    keep: &HashSet<Value>,
    values: &[Value],
    why: &str,
    b: &weft_ir::Bindings,
    recompute_collectives: bool,
) -> Result<(usize, f64), PassError> {
    // The forward nodes to clone: the closure of `values` back to kept values (and,
    // unless collectives are recomputed, back to collective results, then kept too).
    let mut keep = keep.clone();
    let mut need: HashSet<Node> = HashSet::new();
    let mut stack: Vec<Value> = values.to_vec();
    while let Some(v) = stack.pop() {
        let d = g.def(v);
        if need.contains(&d)
            || is_resident(&g.node(d).op)
            || !joint.forward.contains(&d)
            || keep.contains(&v)
        {
            continue;
        }
        if !recompute_collectives && g.node(d).op.is_collective() {
            keep.insert(v);
            continue;
        }
        need.insert(d);
        for x in &g.node(d).operands {
            if !keep.contains(x) {
                stack.push(*x);
            }
        }
    }
    let mut nodes: Vec<Node> = need.into_iter().collect();
    nodes.sort_by_key(|n| joint.pos[n]);
    // Where each clone must exist: before its first backward reader, and before the
    // clones that read it (processed consumers first).
    let mut anchor: HashMap<Node, usize> = HashMap::new();
    let inf = usize::MAX;
    for &n in nodes.iter().rev() {
        let mut at = inf;
        for r in &g.node(n).results {
            if let Some(us) = joint.backward_uses.get(r) {
                at = at.min(us.iter().copied().min().unwrap_or(inf));
            }
        }
        anchor.insert(n, at);
    }
    for &n in nodes.iter().rev() {
        let a = anchor[&n];
        for x in g.node(n).operands.clone() {
            let d = g.def(x);
            if let Some(ax) = anchor.get_mut(&d) {
                *ax = (*ax).min(a);
            }
        }
    }
    let order: Vec<Node> = g.nodes().to_vec();
    let mut plan: Vec<(usize, usize, Node)> = nodes
        .iter()
        .map(|n| (anchor[n], joint.pos[n], *n))
        .filter(|(a, _, _)| *a != inf)
        .collect();
    plan.sort();
    let mut map: HashMap<Value, Value> = HashMap::new();
    let mut fl = 0.0;
    for &(a, _, n) in &plan {
        let d = g.node(n).clone();
        let operands: Vec<Value> = d
            .operands
            .iter()
            .map(|x| *map.get(x).unwrap_or(x))
            .collect();
        let tys: Vec<_> = d.results.iter().map(|v| g.ty(*v).clone()).collect();
        let mut meta = d.meta.clone();
        let layer = layer_of(d.meta.source.as_deref()).unwrap_or_else(|| "the model".into());
        meta.provenance = Some(Provenance {
            pass: NAME.into(),
            reason: format!("{why}, for the backward of {layer}"),
        });
        meta.derived = Some(Derived {
            kind: DerivedKind::Recompute,
            of: d.results[0],
        });
        let new = g.insert_typed(At::Before(order[a]), d.op.clone(), &operands, tys, meta);
        for (old, nv) in d.results.iter().zip(new) {
            map.insert(*old, nv);
        }
        fl += flops(g, n, b);
    }
    // Backward readers use the recomputed values.
    for &n in &order {
        if joint.forward.contains(&n) || matches!(g.node(n).op, Op::Offload { .. }) {
            continue;
        }
        let ops: Vec<Value> = g
            .node(n)
            .operands
            .iter()
            .map(|x| *map.get(x).unwrap_or(x))
            .collect();
        g.node_mut(n).operands = ops;
    }
    Ok((plan.len(), fl))
}

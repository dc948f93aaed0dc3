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
//!   backward use, on the plan cost model's clock (see `offload_instead`).
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
//!   and `S`.

use crate::memory::{bytes, flops, is_resident, layer_of, Joint};
use crate::offload;
use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::training::CheckpointPolicy;
use std::collections::{BTreeMap, HashMap, HashSet};
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

/// The offload options when `--offload` has no budget of its own (then `checkpoint`
/// chooses what goes to the host).
fn link_options(cx: &PassContext) -> Option<&crate::training::OffloadOptions> {
    cx.options
        .train
        .offload
        .as_ref()
        .filter(|o| o.budget.is_none())
}

/// Sends `to_host` (kept values of the graph `apply` rewrote) to the host: offload after
/// the last forward use, reload when the next layer's backward starts.
fn offload_rewrite(
    g: &mut Graph,
    to_host: &[Value],
    b: &weft_ir::Bindings,
    link_bytes_per_s: u64,
) -> Result<(), PassError> {
    let after = Joint::of(g);
    let order = g.nodes().to_vec();
    let w =
        offload::Windows::of(g, &after, &order, b, None).expect("offloaded values lie in layers");
    let mut cands: Vec<offload::Cand> = to_host
        .iter()
        .filter_map(|&v| offload::Cand::of(g, &after, &order, &w, b, v, 0, 0))
        .collect();
    offload::rewrite(g, &order, &after, &mut cands, link_bytes_per_s, NAME, |c| {
        format!(
            "selective + offload: saved for the backward of layer {} on the host instead of recomputed ({} bytes after the last forward use)",
            c.layer, c.bytes
        )
    })?;
    Ok(())
}

/// `budget=` with `--offload`: start from `selective` with the host link carrying what
/// it can (as for `selective --offload`), then spend what the budget leaves on keeping
/// the remaining recomputed values on the device, most recompute time per byte first
/// (the longest such prefix that fits, by bisection, each checked by the liveness
/// estimate of the whole step with its offloads). `None` when that start already
/// exceeds the budget: the min-cut, which can recompute more than `selective` does,
/// decides then. Returns the values to keep on the device, those to send to the host,
/// the estimated peak and how many estimates it took.
#[allow(clippy::type_complexity)]
fn budget_with_offload(
    g: &Graph,
    joint: &Joint,
    b: &weft_ir::Bindings,
    budget: u64,
    why: &str,
    cx: &PassContext,
    o: &crate::training::OffloadOptions,
) -> Result<Option<(HashSet<Value>, Vec<Value>, u64, u64)>, PassError> {
    let policy = CheckpointPolicy::Budget(budget);
    let selective = layer_keep(g, joint, true);
    let to_host = offload_instead(g, joint, b, &selective, o);
    let mut base = selective.clone();
    base.extend(to_host.iter().copied());
    let peak_of = |extra: &[Value]| -> Result<u64, PassError> {
        let mut keep = base.clone();
        keep.extend(extra.iter().copied());
        let mut t = g.clone();
        apply(&mut t, joint, &keep, &policy, why, b)?;
        if !to_host.is_empty() {
            offload_rewrite(&mut t, &to_host, b, o.link_bytes_per_s)?;
        }
        finish_step(&mut t, cx)?;
        Ok(crate::memory::estimate(&t, b).peak_live)
    };
    let mut tries = 1;
    let peak0 = peak_of(&[])?;
    if peak0 > budget {
        return Ok(None);
    }
    let mut more: Vec<(f64, Value)> = joint
        .saved
        .iter()
        .copied()
        .filter(|v| !base.contains(v) && !g.node(g.def(*v)).op.is_collective())
        .map(|v| {
            let (_, secs) = exclusive_recompute(g, joint, &base, b, &o.device.0, v);
            (secs / bytes(g, v, b).max(1) as f64, v)
        })
        .collect();
    more.sort_by(|(x, a), (y, c)| y.total_cmp(x).then(a.0.cmp(&c.0)));
    let more: Vec<Value> = more.into_iter().map(|(_, v)| v).collect();
    let (mut lo, mut hi, mut peak) = (0, more.len(), peak0);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        tries += 1;
        let p = peak_of(&more[..mid])?;
        if p <= budget {
            (lo, peak) = (mid, p);
        } else {
            hi = mid - 1;
        }
    }
    let mut keep = selective;
    keep.extend(more[..lo].iter().copied());
    Ok(Some((keep, to_host, peak, tries)))
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

/// The values `selective` would recompute that the host link carries instead, with
/// `--offload` and no offload budget: those whose recompute is compute-bound on the
/// device (at least its ridge point, matmul FLOP/s over HBM bytes/s, in FLOPs per byte
/// of the value: on an H200 about 184, where a projection's output has 2 x hidden;
/// memory-bound ones recompute about as fast as they would be read back), in the layers
/// the offload options allow: layer by layer, the set with the most recompute time
/// whose copies the link (`link_bytes_per_s`, planned at [`LINK_PLANNED_SHARE`]) moves
/// in time as [`offload::LinkQueues`] simulates them on the compute stream's clock
/// (the plan's cost model on the options' device): out by the end of the next layer's
/// forward, back before the first backward use.
fn offload_instead(
    g: &Graph,
    joint: &Joint,
    b: &weft_ir::Bindings,
    keep: &HashSet<Value>,
    o: &crate::training::OffloadOptions,
) -> Vec<Value> {
    let order = g.nodes().to_vec();
    let Some(w) = offload::Windows::of(g, joint, &order, b, Some(&o.device.0)) else {
        return Vec::new();
    };
    let d = &o.device.0;
    let ridge = d.matmul_tflops * 1e12 / (d.hbm_gbps * 1e9);
    let cands: Vec<(f64, offload::Cand)> = joint
        .saved
        .iter()
        .copied()
        .filter(|v| !keep.contains(v) && !g.node(g.def(*v)).op.is_collective())
        .filter_map(|v| offload::Cand::of(g, joint, &order, &w, b, v, o.keep_last, o.min_bytes))
        .filter_map(|c| {
            let (fl, secs) = exclusive_recompute(g, joint, keep, b, &o.device.0, c.v);
            (fl >= ridge * c.bytes as f64).then(|| (secs / c.bytes as f64, c))
        })
        .collect();
    // Per layer, the set of most recompute time that fits the room: exhaustively over
    // the densest candidates (a handful per layer: projections), then greedily.
    let mut by_layer: BTreeMap<usize, Vec<(f64, offload::Cand)>> = BTreeMap::new();
    for (density, c) in cands {
        by_layer.entry(c.layer).or_default().push((density, c));
    }
    let mut chosen: Vec<Value> = Vec::new();
    let mut queues = offload::LinkQueues::new(&w, o.link_bytes_per_s as f64 * LINK_PLANNED_SHARE);
    for (_, mut cs) in by_layer {
        cs.sort_by(|(pa, a), (pc, c)| {
            pc.total_cmp(pa)
                .then(c.bytes.cmp(&a.bytes))
                .then(a.v.0.cmp(&c.v.0))
        });
        let n = cs.len().min(KNAPSACK_MAX);
        let pick = |mask: usize| -> Vec<&offload::Cand> {
            (0..n)
                .filter(|i| mask >> i & 1 == 1)
                .map(|i| &cs[i].1)
                .collect()
        };
        let (mut best, mut best_secs, mut best_end) = (0usize, 0.0f64, None);
        for mask in 1usize..(1 << n) {
            let secs: f64 = (0..n)
                .filter(|i| mask >> i & 1 == 1)
                .map(|i| cs[i].0 * cs[i].1.bytes as f64)
                .sum();
            if secs > best_secs {
                if let Some(end) = queues.try_layer(&pick(mask)) {
                    (best, best_secs, best_end) = (mask, secs, Some(end));
                }
            }
        }
        let mut taken = pick(best);
        if let Some(end) = best_end {
            queues.commit(end);
        }
        for (_, c) in &cs[n..] {
            taken.push(c);
            match queues.try_layer(&taken) {
                Some(end) => queues.commit(end),
                None => {
                    taken.pop();
                }
            }
        }
        chosen.extend(taken.iter().map(|c| c.v));
    }
    chosen.sort_by_key(|v| (joint.pos[&g.def(*v)], v.0));
    chosen
}

/// The share of the host link's bandwidth selective + offload plans with: a copy that
/// runs past its window makes the compute stream wait (or holds device memory longer).
const LINK_PLANNED_SHARE: f64 = 0.85;

/// Candidates per layer the selective + offload choice searches exhaustively.
const KNAPSACK_MAX: usize = 12;

/// The FLOPs and predicted seconds of recomputing `v` alone: its defining node and,
/// through single-use operands the backward does not read (a projection feeding only
/// rope, say), the forward nodes that only it needs.
fn exclusive_recompute(
    g: &Graph,
    joint: &Joint,
    keep: &HashSet<Value>,
    b: &weft_ir::Bindings,
    device: &weft_ir::plan::DeviceProfile,
    v: Value,
) -> (f64, f64) {
    let d = g.def(v);
    let mut fl = flops(g, d, b);
    let mut secs = offload::compute_seconds(g, d, b, device);
    for &x in &g.node(d).operands {
        let xd = g.def(x);
        let only_here = g
            .nodes()
            .iter()
            .filter(|&&n| joint.forward.contains(&n) && g.node(n).operands.contains(&x))
            .count()
            == 1;
        if joint.forward.contains(&xd)
            && !is_resident(&g.node(xd).op)
            && !keep.contains(&x)
            && !joint.backward_uses.contains_key(&x)
            && only_here
        {
            let (f, s) = exclusive_recompute(g, joint, keep, b, device, x);
            fl += f;
            secs += s;
        }
    }
    (fl, secs)
}

/// How many cuts `budget=` checks by liveness before taking the one that keeps least.
const MAX_BUDGET_TRIES: usize = 12;

/// The values `full` (and `selective`, with `also_attention`) keep: those defined
/// outside the layers, those a later scope reads (a layer's outputs), and for
/// `selective` attention outputs and collective results.
fn layer_keep(g: &Graph, joint: &Joint, also_attention: bool) -> HashSet<Value> {
    let layer_of_node = |n: Node| layer_of(g.node(n).meta.source.as_deref());
    let crossing = crossing_values(g, joint);
    joint
        .saved
        .iter()
        .copied()
        .filter(|v| {
            let d = g.def(*v);
            let op = &g.node(d).op;
            layer_of_node(d).is_none()
                || crossing.contains(v)
                || (also_attention && (matches!(op, Op::Attention { .. }) || op.is_collective()))
        })
        .collect()
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

// ---- budget: min-cut ----

/// Dinic max-flow on f64 capacities.
struct Flow {
    adj: Vec<Vec<usize>>,
    to: Vec<usize>,
    cap: Vec<f64>,
}

impl Flow {
    fn new(n: usize) -> Flow {
        Flow {
            adj: vec![Vec::new(); n],
            to: Vec::new(),
            cap: Vec::new(),
        }
    }
    fn edge(&mut self, a: usize, b: usize, c: f64) {
        self.adj[a].push(self.to.len());
        self.to.push(b);
        self.cap.push(c);
        self.adj[b].push(self.to.len());
        self.to.push(a);
        self.cap.push(0.0);
    }
    fn levels(&self, s: usize) -> Vec<i64> {
        let mut level = vec![-1i64; self.adj.len()];
        level[s] = 0;
        let mut q = std::collections::VecDeque::from([s]);
        while let Some(u) = q.pop_front() {
            for &e in &self.adj[u] {
                let v = self.to[e];
                if self.cap[e] > 1e-9 && level[v] < 0 {
                    level[v] = level[u] + 1;
                    q.push_back(v);
                }
            }
        }
        level
    }
    fn push(&mut self, u: usize, t: usize, f: f64, level: &[i64], it: &mut [usize]) -> f64 {
        if u == t {
            return f;
        }
        while it[u] < self.adj[u].len() {
            let e = self.adj[u][it[u]];
            let v = self.to[e];
            if self.cap[e] > 1e-9 && level[v] == level[u] + 1 {
                let d = self.push(v, t, f.min(self.cap[e]), level, it);
                if d > 0.0 {
                    self.cap[e] -= d;
                    self.cap[e ^ 1] += d;
                    return d;
                }
            }
            it[u] += 1;
        }
        0.0
    }
    /// Runs the max flow; returns the nodes reachable from `s` in the residual graph.
    fn min_cut(&mut self, s: usize, t: usize) -> Vec<bool> {
        loop {
            let level = self.levels(s);
            if level[t] < 0 {
                return level.iter().map(|l| *l >= 0).collect();
            }
            let mut it = vec![0usize; self.adj.len()];
            loop {
                let f = self.push(s, t, f64::INFINITY, &level, &mut it);
                if f <= 0.0 {
                    break;
                }
            }
        }
    }
}

/// The values to keep for a byte budget, and whether the budget is met.
fn min_cut_keep(
    g: &Graph,
    joint: &Joint,
    b: &weft_ir::Bindings,
    budget: u64,
    free: &HashSet<Value>,
) -> (HashSet<Value>, bool) {
    // Forward nodes that matter: those the saved values depend on.
    let mut nodes: Vec<Node> = Vec::new();
    let mut seen: HashSet<Node> = HashSet::new();
    let mut stack: Vec<Node> = joint.saved.iter().map(|v| g.def(*v)).collect();
    while let Some(n) = stack.pop() {
        if !seen.insert(n) || is_resident(&g.node(n).op) || !joint.forward.contains(&n) {
            continue;
        }
        nodes.push(n);
        for x in &g.node(n).operands {
            stack.push(g.def(*x));
        }
    }
    nodes.sort_by_key(|n| joint.pos[n]);
    let index: BTreeMap<Node, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let saved_set: HashSet<Value> = joint.saved.iter().copied().collect();
    let crossing = crossing_values(g, joint);
    // Values on the host (`free`) cost no device bytes to keep.
    let size = |n: Node| -> f64 {
        g.node(n)
            .results
            .iter()
            .filter(|v| !free.contains(v))
            .map(|v| bytes(g, *v, b) as f64)
            .sum()
    };
    // Identical layers would all switch at the same λ; a slightly higher price for
    // recomputing later layers orders them (earlier layers' activations live longest).
    let cost: Vec<f64> = nodes
        .iter()
        .map(|&n| {
            let layer = layer_of(g.node(n).meta.source.as_deref())
                .and_then(|l| crate::memory::layer_index(&l))
                .unwrap_or(0);
            flops(g, n, b) * (1.0 + 1e-3 * layer as f64)
        })
        .collect();
    let sizes: Vec<f64> = nodes.iter().map(|&n| size(n)).collect();
    let solve = |lambda: f64| -> (HashSet<Value>, f64) {
        let (s, t) = (2 * nodes.len(), 2 * nodes.len() + 1);
        let mut f = Flow::new(2 * nodes.len() + 2);
        for (i, &n) in nodes.iter().enumerate() {
            let (nin, nout) = (2 * i, 2 * i + 1);
            f.edge(nin, nout, sizes[i]);
            // Collectives are not recomputed (they would communicate again), nor what
            // lies outside the layers or crosses between them: a recompute stays in
            // its layer, so a recomputed value lives only through its layer's backward
            // instead of from the first backward use of a chain through every layer.
            let banned = g.node(n).op.is_collective()
                || layer_of(g.node(n).meta.source.as_deref()).is_none()
                || g.node(n).results.iter().any(|v| crossing.contains(v));
            // A tiny recompute cost so that free ops are recomputed only when it helps.
            f.edge(
                s,
                nin,
                if banned {
                    f64::INFINITY
                } else {
                    lambda * cost[i] + 1e-6
                },
            );
            for x in &g.node(n).operands {
                if let Some(&j) = index.get(&g.def(*x)) {
                    f.edge(2 * j + 1, nin, f64::INFINITY);
                }
            }
            if g.node(n).results.iter().any(|v| saved_set.contains(v)) {
                f.edge(nout, t, f64::INFINITY);
            }
        }
        let reach = f.min_cut(s, t);
        let mut keep = HashSet::new();
        let mut total = 0.0;
        for (i, &n) in nodes.iter().enumerate() {
            // A cut node's results are kept (the recompute of a saved value that the
            // cut passes through starts from them, whether the backward reads them or not).
            if reach[2 * i] && !reach[2 * i + 1] {
                for v in &g.node(n).results {
                    keep.insert(*v);
                }
                total += sizes[i];
            }
        }
        (keep, total)
    };
    // λ: bytes per FLOP. Large λ: recomputing is dear, keep everything.
    let (mut lo, mut hi) = (1e-15f64, 1e6f64);
    let (best_keep, best_bytes) = solve(lo);
    if best_bytes > budget as f64 {
        return (best_keep, false);
    }
    let (all_keep, all_bytes) = solve(hi);
    if all_bytes <= budget as f64 {
        return (all_keep, true);
    }
    let mut best = best_keep;
    for _ in 0..48 {
        let mid = (lo.ln() + hi.ln()) / 2.0;
        let mid = mid.exp();
        let (keep, total) = solve(mid);
        if total <= budget as f64 {
            lo = mid;
            best = keep;
        } else {
            hi = mid;
        }
    }
    (best, true)
}

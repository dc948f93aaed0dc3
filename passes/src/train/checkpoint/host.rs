//! Host offload in place of recompute, for `selective` and `budget=` with `--offload`:
//! which recomputable values the host link carries in time (a per-layer exhaustive
//! choice on the compute stream's predicted clock), the rewrite that sends them there,
//! and the budget search that starts from selective + offload.

use super::{layer_keep, step_peak, NAME};
use crate::memory::{bytes, flops, is_resident, Joint};
use crate::offload;
use crate::pass::{PassContext, PassError};
use crate::training::CheckpointPolicy;
use std::collections::{BTreeMap, HashSet};
use weft_ir::{Graph, Value};

/// The offload options when `--offload` has no budget of its own (then `checkpoint`
/// chooses what goes to the host).
pub(super) fn link_options(cx: &PassContext) -> Option<&crate::training::OffloadOptions> {
    cx.options
        .train
        .offload
        .as_ref()
        .filter(|o| o.budget.is_none())
}

/// Sends `to_host` (kept values of the graph `apply` rewrote) to the host: offload after
/// the last forward use, reload when the next layer's backward starts.
pub(super) fn offload_rewrite(
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
pub(super) fn budget_with_offload(
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
        step_peak(
            g,
            joint,
            &keep,
            &to_host,
            o.link_bytes_per_s,
            &policy,
            why,
            b,
            cx,
        )
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
pub(super) fn offload_instead(
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
pub(super) fn exclusive_recompute(
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
        // (the scan for other forward uses last: most operands are weights or kept)
        let only_here = || {
            g.nodes()
                .iter()
                .filter(|&&n| joint.forward.contains(&n) && g.node(n).operands.contains(&x))
                .count()
                == 1
        };
        if joint.forward.contains(&xd)
            && !is_resident(&g.node(xd).op)
            && !keep.contains(&x)
            && !joint.backward_uses.contains_key(&x)
            && only_here()
        {
            let (f, s) = exclusive_recompute(g, joint, keep, b, device, x);
            fl += f;
            secs += s;
        }
    }
    (fl, secs)
}

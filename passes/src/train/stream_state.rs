//! Scheduling of streamed optimizer state (`stream_optimizer_state`). The `optimizer`
//! pass reads each state param (in pinned host memory) through a `reload` and writes
//! the new state back with an `offload`, both placed with the parameter's update deep
//! in the backward. Left there, each update would wait for the host link. Here, on the
//! plan's cost model (compute time per node on the options' device profile, the host
//! link at the profile's one-direction rate plus a launch per copy, one copy at a time
//! per direction):
//! - device to host: the new states leave as their updates end; the last updates whose
//!   copies would still be running when the compute ends (a tied embedding's, whose
//!   gradient is final last) keep their state on the device;
//! - host to device: the state copies are packed latest update first, each ending by
//!   its update and by the next one's start; those that would have to start before the
//!   backward (where they would sit over the peak) keep their state on the device, and
//!   leave their link time to earlier updates. Then, earliest update first, each
//!   update's reloads go after the latest compute node from which the stream, with the
//!   copies queued before (the activations' reloads stay where they are), brings them
//!   in by the update without making a copy queued behind them late; an update for
//!   which there is none keeps its state on the device. So where the link cannot carry
//!   the whole state inside the backward, it carries what it can and no update waits.
//! - The host params go first in the program (they hold no device memory).

use crate::memory::bytes;
use crate::offload::compute_seconds;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use weft_ir::plan::DeviceProfile;
use weft_ir::{Bindings, Graph, Node, Op, Value};

/// What [`schedule`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scheduled {
    /// State reloads moved ahead of their update.
    pub prefetched: usize,
    /// State tensors kept on the device (their copy back would outlast the step).
    pub kept_on_device: usize,
}

/// Schedules the state `reloads` the `optimizer` pass made (see the module header).
pub fn schedule(g: &mut Graph, reloads: &[Node], b: &Bindings, d: &DeviceProfile) -> Scheduled {
    let mut out = Scheduled::default();
    if reloads.is_empty() {
        return out;
    }
    // At one direction's rate: the plan's simulation then slows what overlaps the other
    // direction. Planning at the shared rate streamed less for little time: Llama-3-8B
    // at 8192 with bf16 state, 65.5 GiB and 710 ms against 61.9 GiB and 743 ms; the
    // 1.24B at 16384 on the h100 profile, 24.1 GiB against 23.0 at the same step.
    // A copy's time as the plan's cost model prices one alone on the link (its launch
    // included).
    let copy_secs =
        |g: &Graph, v: Value| crate::plan::cost::copy_time_beside(bytes(g, v, b) as f64, 0.0, d);
    let order = g.nodes().to_vec();
    let pos: HashMap<Node, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // Compute-stream start time of each position, and when the compute ends.
    let mut start = Vec::with_capacity(order.len() + 1);
    let mut t = 0.0;
    for &n in &order {
        start.push(t);
        t += compute_seconds(g, n, b, d);
    }
    let end = t;
    start.push(end);
    let uses = g.uses();
    let first_use = |v: Value| uses[v.0 as usize].iter().map(|(n, _)| pos[n]).min();
    // The state reloads of each update (their first reader), by its position.
    let mut by_update: BTreeMap<usize, Vec<Node>> = BTreeMap::new();
    for &r in reloads {
        if let Some(u) = first_use(g.node(r).results[0]) {
            by_update.entry(u).or_default().push(r);
        }
    }
    // Each update's transfer time, once.
    let secs: BTreeMap<usize, f64> = by_update
        .iter()
        .map(|(&u, rs)| {
            (
                u,
                rs.iter().map(|&r| copy_secs(g, g.node(r).results[0])).sum(),
            )
        })
        .collect();

    // Device to host: new states leave as their updates end, one copy at a time; the
    // last updates whose copies would end after the compute keep their state.
    let mut keep: BTreeSet<usize> = BTreeSet::new();
    loop {
        let mut free = 0.0f64;
        for (&u, &t) in &secs {
            if !keep.contains(&u) {
                free = free.max(start[u + 1]) + t;
            }
        }
        if free <= end {
            break;
        }
        match by_update.keys().rev().find(|u| !keep.contains(u)) {
            Some(&u) => {
                keep.insert(u);
            }
            None => break,
        }
    }
    for u in &keep {
        keep_on_device(g, &by_update[u], &mut out);
    }
    by_update.retain(|u, _| !keep.contains(u));

    // Host to device, one copy at a time in program order: the activations' reloads
    // stay where they are; each update's state reloads (earliest update first) go after
    // the latest compute node from which the stream, with every copy queued before,
    // still brings them in by the update.
    let streamed: HashSet<Node> = by_update.values().flatten().copied().collect();
    // Queued copies: (program position, issue time, seconds, deadline). A copy at
    // position k is issued when the node before it ends (start[k]); a state copy anchored
    // after the node at k (position k + 0.5) when that node ends (start[k + 1]). Its
    // deadline is when its first reader starts.
    let mut queue: Vec<(f64, f64, f64, f64)> = Vec::new();
    for (k, &n) in order.iter().enumerate() {
        let Some(nd) = g.try_node(n) else { continue };
        if matches!(nd.op, Op::Reload { .. }) && !streamed.contains(&n) {
            let v = nd.results[0];
            let deadline = first_use(v).map_or(end, |p| start[p]);
            queue.push((k as f64, start[k], copy_secs(g, v), deadline));
        }
    }
    // Never before the backward: a state brought in during the forward would sit on the
    // device over the step's peak (its start), which is what streaming saves.
    // With micro-batches, not before the last one's forward either: a state brought in
    // during an earlier micro-batch's backward would sit over the last forward.
    let forward = crate::memory::Joint::of(g).forward;
    let last_forward = order
        .iter()
        .rposition(|n| forward.contains(n))
        .map_or(0, |k| k + 1);
    let anchor_ok = |g: &Graph, n: Node| {
        pos[&n] >= last_forward
            && g.try_node(n).is_some_and(|nd| {
                !nd.results.is_empty()
                    && !nd.op.is_collective()
                    && !matches!(
                        nd.op,
                        Op::Offload { .. }
                            | Op::Reload { .. }
                            | Op::Param { .. }
                            | Op::Input { .. }
                    )
            })
    };
    // Latest deadline first, the state copies packed as late as their updates allow on
    // one link: each ends by its update and by the start of the next one's. What would
    // have to start before the backward's first node stays on the device (the updates
    // nearest the backward's start, over the peak anyway); dropping it leaves its slot
    // to earlier updates. Issuing each copy just in time instead, earliest update first,
    // left the link idle while small states waited for their slot and then had no room
    // for the large ones (the 1.24B's f32 state at 16384: 3 of 14 GiB streamed).
    let backward_start = (last_forward..order.len())
        .find(|&k| anchor_ok(g, order[k]))
        .map_or(end, |k| start[k + 1]);
    let mut latest_issue: HashMap<usize, f64> = HashMap::new();
    let mut next_start = end;
    for (&u, _) in by_update.iter().rev() {
        let issue = start[u].min(next_start) - secs[&u];
        if issue >= backward_start {
            latest_issue.insert(u, issue);
            next_start = issue;
        }
    }
    let mut after: HashMap<Node, Vec<Node>> = HashMap::new();
    let mut moved: HashSet<Node> = HashSet::new();
    let mut last_anchor = 0;
    let mut host_params: Vec<Node> = Vec::new();
    for (&u, rs) in &by_update {
        let Some(&issue_by) = latest_issue.get(&u) else {
            keep_on_device(g, rs, &mut out);
            continue;
        };
        let first = rs
            .iter()
            .map(|r| pos[r])
            .min()
            .expect("a group has a reload");
        // Not before what the reloads read or wait for, but a param (which moves with
        // them).
        let floor = rs
            .iter()
            .flat_map(|&r| g.node(r).operands.iter())
            .map(|&v| g.def(v))
            .filter(|&d| !matches!(g.node(d).op, Op::Param { .. }))
            .map(|d| pos[&d] + 1)
            .max()
            .unwrap_or(0)
            .max(last_anchor);
        let dur = secs[&u];
        queue.sort_by(|a, b| a.0.total_cmp(&b.0));
        // free[i]: when the stream is free after the first i queued copies.
        let mut free = vec![0.0f64; queue.len() + 1];
        for (i, &(_, issued, secs, _)) in queue.iter().enumerate() {
            free[i + 1] = free[i].max(issued) + secs;
        }
        let mut chosen = None;
        // The latest anchors whose end is by `issue_by` (`start` does not decrease).
        let upto = first.min(start.partition_point(|&t| t <= issue_by).saturating_sub(1));
        for k in (floor..upto).rev() {
            if !anchor_ok(g, order[k]) {
                continue;
            }
            let before = queue.partition_point(|&(p, ..)| p <= k as f64 + 0.5);
            if free[before].max(start[k + 1]) + dur <= start[u] {
                chosen = Some((k, before));
                break;
            }
        }
        // Nor may it make a copy queued behind it late that was not (an activation's
        // reload above all: its reader would wait).
        if let Some((k, before)) = chosen {
            let mut t = free[before].max(start[k + 1]) + dur;
            for (i, &(_, issued, secs, deadline)) in queue.iter().enumerate().skip(before) {
                t = t.max(issued) + secs;
                if t > deadline.max(free[i + 1]) + 1e-9 {
                    chosen = None;
                    break;
                }
            }
        }
        // A state the link cannot bring in by its update, from any point of the backward,
        // stays on the device: brought in late it would stall the update, and the later
        // updates' states would queue behind it until every copy was issued at the
        // backward's start, over the peak.
        let Some((k, _)) = chosen else {
            keep_on_device(g, rs, &mut out);
            continue;
        };
        last_anchor = k;
        queue.push((k as f64 + 0.5, start[k + 1], dur, start[u]));
        let a = order[k];
        let dep = g.node(a).results[0];
        let list = after.entry(a).or_default();
        for &r in rs {
            let param = g.def(g.node(r).operands[0]);
            if matches!(g.node(param).op, Op::Param { .. }) && moved.insert(param) {
                host_params.push(param);
            }
            g.node_mut(r).operands.push(dep);
            list.push(r);
            moved.insert(r);
            out.prefetched += 1;
        }
    }
    // The host state params go first (they hold no device memory), so that a later pass
    // moving a reload with its anchor (`fuse` replacing the anchor) keeps it after them.
    let mut new = host_params;
    new.reserve(order.len());
    for &n in &order {
        if moved.contains(&n) {
            continue;
        }
        new.push(n);
        if let Some(rs) = after.get(&n) {
            new.extend_from_slice(rs);
        }
    }
    // Unstreamed reloads were removed from the graph.
    new.retain(|n| g.try_node(*n).is_some());
    g.set_order(new);
    out
}

/// Keeps the states of one update (its `reloads`) on the device.
fn keep_on_device(g: &mut Graph, reloads: &[Node], out: &mut Scheduled) {
    for &r in reloads {
        unstream(g, r);
        out.kept_on_device += 1;
    }
}

/// Keeps the state `reload` reads on the device: its readers read the param, and the
/// state output its update's result rather than the copy back.
fn unstream(g: &mut Graph, reload: Node) {
    let param_v = g.node(reload).operands[0];
    let copy = g.node(reload).results[0];
    g.replace_all_uses(copy, param_v);
    g.remove_node(reload);
    let Op::Param { name, .. } = g.op_of(param_v).clone() else {
        return;
    };
    if let Some(o) = g.output(&name) {
        let def = g.def(o);
        if matches!(g.node(def).op, Op::Offload { .. }) {
            let x = g.node(def).operands[0];
            g.set_output(&name, x);
            g.remove_node(def);
        }
    }
}

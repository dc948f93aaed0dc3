//! Scheduling of streamed optimizer state (`stream_optimizer_state`). The `optimizer`
//! pass reads each state param (in pinned host memory) through a `reload` and writes
//! the new state back with an `offload`, both placed with the parameter's update deep
//! in the backward. Left there, each update would wait for the host link. Here, on the
//! plan's cost model (compute time per node on the options' device profile, the host
//! link at the profile's rate, one copy at a time per direction):
//! - the host-to-device copies (the activations' reloads and the states') are laid out
//!   as late as their readers allow, latest deadline first, on the one in-order stream;
//!   each update's state reloads then move to after the last compute node that ends
//!   before their slot, which becomes their `after` operand (so the device holds a state
//!   only from its prefetch to its update);
//! - the device-to-host copies of new states run as soon as their updates end; the
//!   states whose copies would still be running when the compute ends (the last
//!   updates: a tied embedding's, whose gradient is final last) stay on the device
//!   instead, as unstreamed state.

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
    // direction (placing every copy at the shared rate moved prefetches into the
    // forward, where they raised the peak for no time gained).
    let link = d.host_gbps * 1e9;
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
            let by: u64 = rs.iter().map(|&r| bytes(g, g.node(r).results[0], b)).sum();
            (u, by as f64 / link)
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
        for &r in &by_update[u] {
            unstream(g, r);
            out.kept_on_device += 1;
        }
    }
    by_update.retain(|u, _| !keep.contains(u));

    // Host to device, one copy at a time in program order: the activations' reloads
    // stay where they are; each update's state reloads (earliest update first) go after
    // the latest compute node from which the stream, with every copy queued before,
    // still brings them in by the update.
    let streamed: HashSet<Node> = by_update.values().flatten().copied().collect();
    // Queued copies: (program position, issue time, seconds). A copy at position k is
    // issued when the node before it ends (start[k]); a state copy anchored after the
    // node at k (position k + 0.5) when that node ends (start[k + 1]).
    let mut queue: Vec<(f64, f64, f64)> = Vec::new();
    for (k, &n) in order.iter().enumerate() {
        let Some(nd) = g.try_node(n) else { continue };
        if matches!(nd.op, Op::Reload { .. }) && !streamed.contains(&n) {
            queue.push((k as f64, start[k], bytes(g, nd.results[0], b) as f64 / link));
        }
    }
    // Never before the backward: a state brought in during the forward would sit on the
    // device over the step's peak (its start), which is what streaming saves.
    let forward = crate::memory::Joint::of(g).forward;
    let anchor_ok = |g: &Graph, n: Node| {
        !forward.contains(&n)
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
    let mut after: HashMap<Node, Vec<Node>> = HashMap::new();
    let mut moved: HashSet<Node> = HashSet::new();
    for (&u, rs) in &by_update {
        let first = rs
            .iter()
            .map(|r| pos[r])
            .min()
            .expect("a group has a reload");
        let dur = secs[&u];
        queue.sort_by(|a, b| a.0.total_cmp(&b.0));
        // free[i]: when the stream is free after the first i queued copies.
        let mut free = vec![0.0f64; queue.len() + 1];
        for (i, &(_, issued, secs)) in queue.iter().enumerate() {
            free[i + 1] = free[i].max(issued) + secs;
        }
        let mut chosen = None;
        let mut fallback = None;
        for k in (0..first).rev() {
            if !anchor_ok(g, order[k]) {
                continue;
            }
            fallback.get_or_insert(k);
            let before = queue.partition_point(|&(p, _, _)| p < k as f64 + 0.5);
            if free[before].max(start[k + 1]) + dur <= start[u] {
                chosen = Some(k);
                break;
            }
        }
        let Some(k) = chosen.or(fallback) else {
            continue;
        };
        queue.push((k as f64 + 0.5, start[k + 1], dur));
        let a = order[k];
        let dep = g.node(a).results[0];
        let list = after.entry(a).or_default();
        for &r in rs {
            let param = g.def(g.node(r).operands[0]);
            if matches!(g.node(param).op, Op::Param { .. }) && moved.insert(param) {
                list.push(param);
            }
            g.node_mut(r).operands.push(dep);
            list.push(r);
            moved.insert(r);
            out.prefetched += 1;
        }
    }
    let mut new = Vec::with_capacity(order.len());
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

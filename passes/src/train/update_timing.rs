//! When each parameter update runs, on the plan's clock. The `optimizer` pass places
//! every update (its group of nodes) in the backward right after the reduction of its
//! gradient (ZeRO-2/3: one bucket later). The compute stream runs in program order, so
//! an update whose reduction is still on the communication stream stalls it, and with
//! it the rest of the backward: where the reductions take longer than the backward that
//! produces their gradients (a data-parallel group across nodes), every update waited
//! and the plan exposed all of its communication (llama3-8b on dp=16 over two nodes:
//! 691 ms exposed of 691). Here each update that would wait moves to right after the
//! first compute node by whose end its reduction is predicted done (at the latest to
//! the step's end), so the backward runs on while the collectives drain. Values are
//! unchanged; only the program order moves, and a reduced gradient lives that much
//! longer.
//!
//! The clock: compute nodes at [`crate::offload::compute_seconds`] on the options'
//! device profile, in program order; collectives one at a time in program order on
//! the plan cost model's link rates ([`crate::plan::cost::collective_cost`]), each
//! starting when its operands are ready; host copies free.

use crate::memory::bytes;
use crate::offload::compute_seconds;
use std::collections::{HashMap, HashSet};
use weft_ir::plan::DeviceProfile;
use weft_ir::{Bindings, Graph, Node, Value};

/// Seconds one collective takes on the plan cost model.
fn collective_seconds(g: &Graph, n: Node, b: &Bindings, d: &DeviceProfile) -> f64 {
    let nd = g.node(n);
    let axis = nd.op.axis().unwrap_or_default();
    let p = g.mesh.size_or_one(axis);
    let inter = crate::plan::cost::crosses_nodes(&g.mesh, axis, d.gpus_per_node);
    let sum = |vs: &[Value]| vs.iter().map(|v| bytes(g, *v, b) as f64).sum::<f64>();
    crate::plan::cost::collective_cost(&nd.op, sum(&nd.operands), sum(&nd.results), p, inter, d).1
}

/// The two streams' clocks and when each value is ready.
struct Clock<'a> {
    g: &'a Graph,
    b: &'a Bindings,
    d: &'a DeviceProfile,
    compute: f64,
    comm: f64,
    ready: HashMap<Value, f64>,
}

impl Clock<'_> {
    fn ready_of(&self, vs: &[Value]) -> f64 {
        vs.iter()
            .map(|v| self.ready.get(v).copied().unwrap_or(0.0))
            .fold(0.0, f64::max)
    }

    fn run(&mut self, n: Node) {
        let nd = self.g.node(n);
        let inputs = self.ready_of(&nd.operands);
        let end = if nd.op.is_collective() {
            self.comm = self.comm.max(inputs) + collective_seconds(self.g, n, self.b, self.d);
            self.comm
        } else {
            let secs = compute_seconds(self.g, n, self.b, self.d);
            if secs > 0.0 {
                self.compute = self.compute.max(inputs) + secs;
                self.compute
            } else {
                inputs
            }
        };
        for r in &nd.results {
            self.ready.insert(*r, end);
        }
    }
}

/// Whether `n` was made by the gradient reduction or the optimizer.
fn made_by_sync(g: &Graph, n: Node) -> bool {
    g.node(n)
        .meta
        .provenance
        .as_ref()
        .is_some_and(|p| p.pass == crate::grad_sync::NAME || p.pass == crate::optimizer::NAME)
}

/// Moves the nodes downstream of the gradient reductions (what grad-sync and the
/// optimizer make from a reduced gradient: its pieces, the updates) that would wait for
/// a collective to right after the first node by whose end their inputs are predicted
/// ready, keeping their order (see the module header). Returns how many moved.
pub fn defer_waiting_updates(g: &mut Graph, b: &Bindings, d: &DeviceProfile) -> usize {
    let order = g.nodes().to_vec();
    // Downstream of a reduction: made by grad-sync or the optimizer, and reading a
    // collective of theirs or another such node.
    let mut downstream: HashSet<Node> = HashSet::new();
    let mut from_reduction: HashSet<Value> = HashSet::new();
    for &n in &order {
        if !made_by_sync(g, n) {
            continue;
        }
        let nd = g.node(n);
        let reads = nd.operands.iter().any(|v| from_reduction.contains(v));
        if nd.op.is_collective() || reads {
            from_reduction.extend(nd.results.iter().copied());
        }
        if reads {
            downstream.insert(n);
        }
    }
    if downstream.is_empty() {
        return 0;
    }
    let mut clock = Clock {
        g,
        b,
        d,
        compute: 0.0,
        comm: 0.0,
        ready: HashMap::new(),
    };
    let mut emitted: HashSet<Value> = HashSet::new();
    let mut new = Vec::with_capacity(order.len());
    let mut waiting: Vec<Node> = Vec::new();
    let mut moved: HashSet<Node> = HashSet::new();
    let emit = |n: Node, clock: &mut Clock, new: &mut Vec<Node>, emitted: &mut HashSet<Value>| {
        clock.run(n);
        new.push(n);
        emitted.extend(clock.g.node(n).results.iter().copied());
    };
    // Whether a waiting node can run now without stalling the compute stream.
    let runs_now = |n: Node, clock: &Clock, emitted: &HashSet<Value>| {
        let nd = clock.g.node(n);
        let inputs_made = nd.operands.iter().all(|v| {
            emitted.contains(v)
                || !clock
                    .g
                    .try_value(*v)
                    .is_some_and(|x| downstream.contains(&x.def))
        });
        inputs_made
            && (nd.op.is_collective()
                || compute_seconds(clock.g, n, clock.b, clock.d) == 0.0
                || clock.ready_of(&nd.operands) <= clock.compute)
    };
    for &n in &order {
        if downstream.contains(&n) {
            if waiting.is_empty() && runs_now(n, &clock, &emitted) {
                emit(n, &mut clock, &mut new, &mut emitted);
            } else {
                waiting.push(n);
            }
            continue;
        }
        // What this node reads of the waiting nodes runs first, in order (with what
        // those read).
        let mut need: HashSet<Value> = clock.g.node(n).operands.iter().copied().collect();
        let mut flush = vec![false; waiting.len()];
        for (k, &w) in waiting.iter().enumerate().rev() {
            let nd = clock.g.node(w);
            if nd.results.iter().any(|r| need.contains(r)) {
                flush[k] = true;
                need.extend(nd.operands.iter().copied());
            }
        }
        let mut rest = Vec::with_capacity(waiting.len());
        for (k, w) in waiting.drain(..).enumerate() {
            if flush[k] {
                emit(w, &mut clock, &mut new, &mut emitted);
            } else {
                rest.push(w);
            }
        }
        waiting = rest;
        emit(n, &mut clock, &mut new, &mut emitted);
        // The waiting nodes that can run now, in order; one that cannot holds back
        // what comes after it in its chain only.
        let mut rest = Vec::with_capacity(waiting.len());
        for w in waiting.drain(..) {
            if runs_now(w, &clock, &emitted) {
                emit(w, &mut clock, &mut new, &mut emitted);
            } else {
                moved.insert(w);
                rest.push(w);
            }
        }
        waiting = rest;
    }
    for w in waiting {
        moved.insert(w);
        emit(w, &mut clock, &mut new, &mut emitted);
    }
    let moved = moved.len();
    if moved > 0 {
        g.set_order(new);
    }
    moved
}

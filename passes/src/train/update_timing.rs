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
//! longer. [`DeferUpdates::Within`] bounds the reduced gradients' bytes so held: past
//! it the oldest held updates run where they are, stalling. Where a plan no longer
//! fits the device, the driver compiles the same options again holding less (the
//! overshoot off the held bytes' peak), then with the updates kept in place.
//!
//! The clock: compute nodes at [`crate::offload::compute_seconds`] on the options'
//! device profile, in program order; collectives one at a time in program order on
//! the plan cost model's link rates ([`crate::plan::cost::node_collective_cost`]), each
//! starting when its operands are ready; host copies free.

use crate::memory::bytes;
use crate::offload::compute_seconds;
use std::collections::{HashMap, HashSet};

/// How far the `optimizer` pass may move the updates past their reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeferUpdates {
    /// Each update right after its reduction: reduced gradients live least long.
    Off,
    /// Every update that would stall moves to where its inputs are ready.
    All,
    /// As `All` while the reduced gradients the held updates keep alive stay within
    /// this many bytes; past it the oldest held updates run where they are.
    Within(u64),
}

/// What [`defer_waiting_updates`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Deferred {
    /// Nodes moved.
    pub moved: usize,
    /// The most bytes of reduced gradients held past their place at once.
    pub held_peak_bytes: u64,
}
use weft_ir::plan::DeviceProfile;
use weft_ir::{Bindings, Graph, Node, Value};

/// Seconds one collective takes on the plan cost model.
fn collective_seconds(g: &Graph, n: Node, b: &Bindings, d: &DeviceProfile) -> f64 {
    let nd = g.node(n);
    let sum = |vs: &[Value]| vs.iter().map(|v| bytes(g, *v, b) as f64).sum::<f64>();
    crate::plan::cost::node_collective_cost(g, n, sum(&nd.operands), sum(&nd.results), d).1
}

/// The two streams' clocks, each node's seconds (computed once) and when each value
/// is ready.
struct Clock<'a> {
    g: &'a Graph,
    b: &'a Bindings,
    d: &'a DeviceProfile,
    compute: f64,
    comm: f64,
    secs: HashMap<Node, f64>,
    ready: HashMap<Value, f64>,
}

impl Clock<'_> {
    fn ready_of(&self, vs: &[Value]) -> f64 {
        vs.iter()
            .map(|v| self.ready.get(v).copied().unwrap_or(0.0))
            .fold(0.0, f64::max)
    }

    /// Seconds `n` takes on its stream (a collective on the link, else the compute).
    fn seconds(&mut self, n: Node) -> f64 {
        let (g, b, d) = (self.g, self.b, self.d);
        *self.secs.entry(n).or_insert_with(|| {
            if g.node(n).op.is_collective() {
                collective_seconds(g, n, b, d)
            } else {
                compute_seconds(g, n, b, d)
            }
        })
    }

    fn run(&mut self, n: Node) {
        let secs = self.seconds(n);
        let nd = self.g.node(n);
        let inputs = self.ready_of(&nd.operands);
        let end = if nd.op.is_collective() {
            self.comm = self.comm.max(inputs) + secs;
            self.comm
        } else if secs > 0.0 {
            self.compute = self.compute.max(inputs) + secs;
            self.compute
        } else {
            inputs
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

/// The nodes held back, in program order, the values they make, and the reduced
/// gradients (made, not by a held node) they keep alive.
#[derive(Default)]
struct Waiting {
    nodes: Vec<Node>,
    makes: HashSet<Value>,
    /// No held node can run before the compute clock reaches this.
    not_before: f64,
    /// Per held node, the kept-alive values it reads (once per operand).
    keeps: HashMap<Node, Vec<Value>>,
    /// Per kept-alive value, how many held operands read it.
    readers: HashMap<Value, u32>,
    bytes: u64,
    peak_bytes: u64,
    /// The most `bytes` may be once a node is placed.
    cap: u64,
    /// The values made from a reduced gradient (what holding keeps alive).
    reduced: HashSet<Value>,
}

impl Waiting {
    /// Holds `n` (after the held nodes).
    fn hold(&mut self, g: &Graph, b: &Bindings, n: Node) {
        let nd = g.node(n);
        for v in &nd.operands {
            if self.reduced.contains(v) && !self.makes.contains(v) {
                self.keep(g, b, n, *v);
            }
        }
        self.makes.extend(nd.results.iter().copied());
        self.nodes.push(n);
        self.not_before = 0.0;
    }

    fn keep(&mut self, g: &Graph, b: &Bindings, reader: Node, v: Value) {
        let r = self.readers.entry(v).or_insert(0);
        if *r == 0 {
            self.bytes = self.bytes.saturating_add(bytes(g, v, b));
        }
        *r += 1;
        self.keeps.entry(reader).or_default().push(v);
    }

    /// Runs the oldest held nodes (a prefix of the held ones has all its inputs) while
    /// the reduced gradients they keep alive exceed the cap, then notes the held
    /// bytes' peak. `current`: the node being placed (run where it is if flushed, not
    /// moved).
    fn within_cap(
        &mut self,
        clock: &mut Clock<'_>,
        new: &mut Vec<Node>,
        moved: &mut HashSet<Node>,
        current: Node,
    ) {
        while self.bytes > self.cap && !self.nodes.is_empty() {
            let w = self.nodes.remove(0);
            if w != current {
                moved.insert(w);
            }
            clock.run(w);
            new.push(w);
            self.ran(clock.g, clock.b, w);
        }
        self.peak_bytes = self.peak_bytes.max(self.bytes);
    }

    /// Accounts for held node `w` (already out of `nodes`) having run: what it kept
    /// alive has one reader less, and what it made is alive for the held nodes that
    /// read it.
    fn ran(&mut self, g: &Graph, b: &Bindings, w: Node) {
        for v in self.keeps.remove(&w).unwrap_or_default() {
            let r = self.readers.get_mut(&v).expect("a kept value has readers");
            *r -= 1;
            if *r == 0 {
                self.readers.remove(&v);
                self.bytes = self.bytes.saturating_sub(bytes(g, v, b));
            }
        }
        let wd = g.node(w);
        for r in &wd.results {
            self.makes.remove(r);
        }
        let made: Vec<Value> = wd
            .results
            .iter()
            .copied()
            .filter(|r| self.reduced.contains(r))
            .collect();
        if made.is_empty() {
            return;
        }
        for n in self.nodes.clone() {
            for v in &g.node(n).operands {
                if made.contains(v) {
                    self.keep(g, b, n, *v);
                }
            }
        }
    }
}

/// Moves the nodes downstream of the gradient reductions (what grad-sync and the
/// optimizer make from a reduced gradient: its pieces, the updates) that would wait for
/// a collective to right after the first node by whose end their inputs are predicted
/// ready, keeping their order, holding at most `how`'s bytes of reduced gradients (see
/// the module header).
pub fn defer_waiting_updates(
    g: &mut Graph,
    b: &Bindings,
    d: &DeviceProfile,
    how: DeferUpdates,
) -> Deferred {
    let cap = match how {
        DeferUpdates::Off => return Deferred::default(),
        DeferUpdates::All => u64::MAX,
        DeferUpdates::Within(bytes) => bytes,
    };
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
        return Deferred::default();
    }
    let mut clock = Clock {
        g,
        b,
        d,
        compute: 0.0,
        comm: 0.0,
        secs: HashMap::new(),
        ready: HashMap::new(),
    };
    let mut new = Vec::with_capacity(order.len());
    let mut held = Waiting {
        cap,
        reduced: from_reduction,
        ..Waiting::default()
    };
    let mut moved: HashSet<Node> = HashSet::new();
    for &n in &order {
        if downstream.contains(&n) {
            let nd = clock.g.node(n);
            let after_held = nd.operands.iter().any(|v| held.makes.contains(v));
            let stalls = clock.seconds(n) > 0.0
                && !nd.op.is_collective()
                && clock.ready_of(&nd.operands) > clock.compute;
            if held.nodes.is_empty() && !after_held && !stalls {
                clock.run(n);
                new.push(n);
                continue;
            }
            held.hold(clock.g, b, n);
            held.within_cap(&mut clock, &mut new, &mut moved, n);
            continue;
        }
        // What this node reads of the held nodes runs first, in order (with what those
        // read).
        let nd = clock.g.node(n);
        if nd.operands.iter().any(|v| held.makes.contains(v)) {
            let mut need: HashSet<Value> = nd.operands.iter().copied().collect();
            let mut flush = vec![false; held.nodes.len()];
            for (k, &w) in held.nodes.iter().enumerate().rev() {
                let wd = clock.g.node(w);
                if wd.results.iter().any(|r| need.contains(r)) {
                    flush[k] = true;
                    need.extend(wd.operands.iter().copied());
                }
            }
            let mut ran = Vec::new();
            for (k, w) in std::mem::take(&mut held.nodes).into_iter().enumerate() {
                if flush[k] {
                    moved.insert(w);
                    clock.run(w);
                    new.push(w);
                    ran.push(w);
                } else {
                    held.nodes.push(w);
                }
            }
            for w in ran {
                held.ran(clock.g, b, w);
            }
            held.not_before = 0.0;
            held.within_cap(&mut clock, &mut new, &mut moved, n);
        }
        clock.run(n);
        new.push(n);
        if held.nodes.is_empty() || clock.compute < held.not_before {
            continue;
        }
        // The held nodes that can run now without stalling the compute stream, in
        // order; one that cannot holds back only what reads it.
        let mut rest = Vec::with_capacity(held.nodes.len());
        let mut ran = Vec::new();
        let mut not_before = f64::INFINITY;
        for w in std::mem::take(&mut held.nodes) {
            let wd = clock.g.node(w);
            let inputs_held = wd.operands.iter().any(|v| held.makes.contains(v));
            let ready = clock.ready_of(&wd.operands);
            let secs = clock.seconds(w);
            if !inputs_held && (wd.op.is_collective() || secs == 0.0 || ready <= clock.compute) {
                clock.run(w);
                new.push(w);
                for r in &wd.results {
                    held.makes.remove(r);
                }
                ran.push(w);
            } else {
                if !inputs_held {
                    not_before = not_before.min(ready);
                }
                moved.insert(w);
                rest.push(w);
            }
        }
        held.nodes = rest;
        for w in ran {
            held.ran(clock.g, b, w);
        }
        held.within_cap(&mut clock, &mut new, &mut moved, n);
        held.not_before = if not_before.is_finite() {
            not_before
        } else {
            0.0
        };
    }
    for w in std::mem::take(&mut held.nodes) {
        moved.insert(w);
        clock.run(w);
        new.push(w);
    }
    let moved = moved.len();
    if moved > 0 {
        g.set_order(new);
    }
    Deferred {
        moved,
        held_peak_bytes: if moved > 0 { held.peak_bytes } else { 0 },
    }
}

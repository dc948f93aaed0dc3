//! The min-cut behind `budget=`: which forward values to keep so that the saved bytes
//! fit a target at the least recompute (PyTorch's partitioner's formulation), solved
//! with petgraph's Dinic max-flow over the forward part of the joint graph.

use crate::memory::{bytes, flops, is_resident, layer_of, Joint};
use std::collections::{BTreeMap, HashSet};
use weft_ir::{Graph, Node, Value};

use super::crossing_values;
use petgraph::algo::dinics;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use petgraph::Direction;

/// A flow network for petgraph's Dinic max-flow (`algo::dinics`, iterative: its depth
/// does not grow with the graph). Capacities are fixed-point integers (units of
/// 1e-9 of the f64 capacity): exact arithmetic, so a saturated edge has exactly zero
/// residual capacity and the min cut read from the residual graph is the one the flow
/// found; `INFINITE` is far above any sum of finite capacities.
struct Flow {
    net: DiGraph<(), u128>,
}

const SCALE: f64 = 1e9;
const INFINITE: u128 = u128::MAX >> 8;

impl Flow {
    fn new(n: usize) -> Flow {
        let mut net = DiGraph::with_capacity(n, 4 * n);
        for _ in 0..n {
            net.add_node(());
        }
        Flow { net }
    }
    fn edge(&mut self, a: usize, b: usize, c: f64) {
        let cap = if c.is_finite() {
            ((c * SCALE).round() as u128).min(INFINITE)
        } else {
            INFINITE
        };
        self.net.add_edge(NodeIndex::new(a), NodeIndex::new(b), cap);
    }
    /// Runs the max flow; returns the nodes reachable from `s` in the residual graph.
    fn min_cut(&mut self, s: usize, t: usize) -> Vec<bool> {
        let (_, flows) = dinics(&self.net, NodeIndex::new(s), NodeIndex::new(t));
        let mut reach = vec![false; self.net.node_count()];
        reach[s] = true;
        let mut queue = std::collections::VecDeque::from([NodeIndex::<u32>::new(s)]);
        while let Some(u) = queue.pop_front() {
            // Forward residual: capacity left; backward residual: flow to undo.
            let forward = self
                .net
                .edges_directed(u, Direction::Outgoing)
                .filter(|e| *e.weight() > flows[e.id().index()])
                .map(|e| e.target());
            let backward = self
                .net
                .edges_directed(u, Direction::Incoming)
                .filter(|e| flows[e.id().index()] > 0)
                .map(|e| e.source());
            let next: Vec<NodeIndex> = forward.chain(backward).collect();
            for v in next {
                if !reach[v.index()] {
                    reach[v.index()] = true;
                    queue.push_back(v);
                }
            }
        }
        reach
    }
}

/// The values to keep for a byte budget, and whether the budget is met.
pub(super) fn min_cut_keep(
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

#[cfg(test)]
mod tests {
    use super::Flow;

    #[test]
    fn min_cut_of_a_small_network() {
        // s -> a (3), s -> b (2), a -> b (1), a -> t (2), b -> t (3): max flow 5,
        // and the cut {s} | {a, b, t} (both source edges saturated).
        let (s, a, b, t) = (0, 1, 2, 3);
        let mut f = Flow::new(4);
        f.edge(s, a, 3.0);
        f.edge(s, b, 2.0);
        f.edge(a, b, 1.0);
        f.edge(a, t, 2.0);
        f.edge(b, t, 3.0);
        assert_eq!(f.min_cut(s, t), [true, false, false, false]);
        // A narrow middle edge: the cut falls there.
        let mut f = Flow::new(4);
        f.edge(s, a, 10.0);
        f.edge(a, b, 0.5);
        f.edge(b, t, f64::INFINITY);
        f.edge(s, t, 0.25);
        assert_eq!(f.min_cut(s, t), [true, true, false, false]);
    }

    #[test]
    fn a_long_chain_does_not_recurse() {
        // 200k nodes in a row: a recursive augmenting-path search would overflow the
        // test thread's stack.
        let n = 200_000;
        let mut f = Flow::new(n);
        for i in 0..n - 1 {
            f.edge(i, i + 1, if i == n / 2 { 1.0 } else { 5.0 });
        }
        let reach = f.min_cut(0, n - 1);
        assert!(reach[..=n / 2].iter().all(|r| *r));
        assert!(reach[n / 2 + 1..].iter().all(|r| !*r));
    }
}

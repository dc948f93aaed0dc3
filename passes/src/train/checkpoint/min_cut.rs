//! The min-cut behind `budget=`: which forward values to keep so that the saved bytes
//! fit a target at the least recompute (PyTorch's partitioner's formulation), solved
//! with a Dinic max-flow over the forward part of the joint graph.

use crate::memory::{bytes, flops, is_resident, layer_of, Joint};
use std::collections::{BTreeMap, HashSet};
use weft_ir::{Graph, Node, Value};

use super::crossing_values;

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

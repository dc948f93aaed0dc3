//! `offload`: host offload of saved activations.
//!
//! A saved activation (a forward value the backward reads, after `checkpoint`) of at
//! least `min_bytes` per rank, in a layer other than the last `keep_last` (whose
//! backward comes first, with no time to bring anything back), is copied to host
//! memory by `offload {stream="d2h"}` right after its last forward use (its operands
//! after the value are that use: the copy waits for it, and the device buffer is free
//! once both are done), and brought back by `reload {stream="h2d"}` issued when the
//! backward of the next layer starts (its operand after the host copy is that node's
//! result), so the copy hides under that layer's backward; the backward reads the
//! reloaded value.
//!
//! Planner mode (`budget`): offload, earliest layers first and largest tensors first,
//! only until the saved activations left on the device fit the budget, and only what
//! the host link (`link_bytes_per_s`, default 25 GB/s) moves in the compute time of the
//! window it hides under (the next layer's forward for the copy out, its backward —
//! recompute included — for the copy in). Compute time is the plan's cost model
//! ([`crate::plan::cost::compute_time`]: roofline of FLOPs and bytes plus the kernel
//! overhead) on the options' device profile (`h200` unless `--device` says otherwise);
//! collectives run on their own stream and are not counted.

use crate::memory::{bytes, flops, layer_index, layer_of, Joint};
use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::util::build_error;
use std::collections::{BTreeMap, HashMap};
use weft_ir::{At, Graph, Node, NodeMeta, Op, Provenance, Value};

pub struct Offload;

pub const NAME: &str = "offload";

/// Predicted seconds of node `n` on the compute stream (0 for collectives and host
/// copies, which run on their own streams). The fused backward ops with matmuls inside
/// (`attention_grad`, `grouped_matmul_grad`), which the FLOP count prices as
/// elementwise, are priced at 2.5x and 2x their forward op, as the plan's kernels do.
pub fn compute_seconds(
    g: &Graph,
    n: Node,
    b: &weft_ir::Bindings,
    d: &weft_ir::plan::DeviceProfile,
) -> f64 {
    let nd = g.node(n);
    if nd.op.is_collective() || matches!(nd.op, Op::Offload { .. } | Op::Reload { .. }) {
        return 0.0;
    }
    let mut fl = flops(g, n, b);
    let factor = match nd.op {
        Op::AttentionGrad { .. } => 2.5,
        Op::GroupedMatmulGrad {} => 2.0,
        _ => 0.0,
    };
    if factor > 0.0 {
        if let Some(fwd) = nd
            .meta
            .derived
            .and_then(|x| g.try_value(x.of))
            .map(|x| x.def)
        {
            fl = fl.max(factor * flops(g, fwd, b));
        }
    }
    let by: u64 = nd
        .operands
        .iter()
        .chain(&nd.results)
        .map(|v| bytes(g, *v, b))
        .sum();
    crate::plan::cost::compute_time(&nd.op, fl, by as f64, d)
}

impl Pass for Offload {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "host offload of saved activations: d2h copy after the last forward use, h2d prefetch when the next layer's backward starts; planner mode fits a memory budget within the host link bandwidth"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::autodiff::NAME]
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        for k in [
            "offloaded",
            "offloaded_bytes",
            "device_saved_bytes",
            "candidates",
            "skipped_bandwidth",
        ] {
            res.count(k, 0);
        }
        let Some(o) = cx.options.train.offload.clone() else {
            return Ok(res);
        };
        if g.nodes()
            .iter()
            .any(|&n| matches!(g.node(n).op, Op::Offload { .. }))
        {
            return Ok(res);
        }
        let b = crate::memory::bindings(g, &cx.options.train);
        let joint = Joint::of(g);
        let order: Vec<Node> = g.nodes().to_vec();
        let layer_at =
            |n: Node| layer_of(g.node(n).meta.source.as_deref()).and_then(|l| layer_index(&l));
        let last_layer = order.iter().filter_map(|&n| layer_at(n)).max();
        let Some(last_layer) = last_layer else {
            return Ok(res);
        };
        // The first node after the forward of each layer's backward, and the predicted
        // compute time of each layer's forward and backward.
        let mut bwd_start: BTreeMap<usize, usize> = BTreeMap::new();
        let mut fwd_s: BTreeMap<usize, f64> = BTreeMap::new();
        let mut bwd_s: BTreeMap<usize, f64> = BTreeMap::new();
        let timed = o.budget.is_some();
        for (i, &n) in order.iter().enumerate() {
            let Some(l) = layer_at(n) else { continue };
            let t = if timed {
                compute_seconds(g, n, &b, &o.device.0)
            } else {
                0.0
            };
            if joint.forward.contains(&n) {
                *fwd_s.entry(l).or_default() += t;
            } else {
                bwd_start.entry(l).or_insert(i);
                *bwd_s.entry(l).or_default() += t;
            }
        }
        // Candidates: saved values of the layers before the last `keep_last`.
        struct Cand {
            v: Value,
            layer: usize,
            bytes: u64,
            after_fwd: usize,
            prefetch: usize,
        }
        let mut cands = Vec::new();
        let total_saved: u64 = joint.saved.iter().map(|v| bytes(g, *v, &b)).sum();
        for &v in &joint.saved {
            let d = g.def(v);
            let Some(layer) = layer_at(d) else { continue };
            if layer + o.keep_last > last_layer {
                continue;
            }
            let by = bytes(g, v, &b);
            if by < o.min_bytes.max(1) {
                continue;
            }
            let uses = &joint.backward_uses[&v];
            let first_bwd = *uses.iter().min().expect("saved values have backward uses");
            let fwd_last = order
                .iter()
                .enumerate()
                .filter(|(_, n)| joint.forward.contains(n) && g.node(**n).operands.contains(&v))
                .map(|(i, _)| i)
                .max()
                .unwrap_or(joint.pos[&d]);
            // Prefetch when the backward of the next layer starts (never after the use).
            let prefetch = bwd_start
                .get(&(layer + 1))
                .copied()
                .unwrap_or(first_bwd)
                .min(first_bwd.saturating_sub(1));
            if prefetch <= fwd_last {
                continue;
            }
            cands.push(Cand {
                v,
                layer,
                bytes: by,
                after_fwd: fwd_last,
                prefetch,
            });
        }
        res.count("candidates", cands.len() as u64);
        // Which to offload.
        let mut chosen: Vec<&Cand> = Vec::new();
        if let Some(budget) = o.budget {
            cands.sort_by_key(|c| (c.layer, std::cmp::Reverse(c.bytes), c.v.0));
            let mut on_device = total_saved;
            // Bytes each window can move: copies out during the next layer's forward,
            // copies in during its backward.
            let mut out_room: HashMap<usize, f64> = HashMap::new();
            let mut in_room: HashMap<usize, f64> = HashMap::new();
            for c in &cands {
                if on_device <= budget {
                    break;
                }
                let next = c.layer + 1;
                let link = o.link_bytes_per_s as f64;
                let out = out_room
                    .entry(next)
                    .or_insert(fwd_s.get(&next).copied().unwrap_or(0.0) * link);
                let inr = in_room
                    .entry(next)
                    .or_insert(bwd_s.get(&next).copied().unwrap_or(0.0) * link);
                if (c.bytes as f64) > *out || (c.bytes as f64) > *inr {
                    res.count("skipped_bandwidth", 1);
                    continue;
                }
                *out -= c.bytes as f64;
                *inr -= c.bytes as f64;
                on_device -= c.bytes;
                chosen.push(c);
            }
            if on_device > budget {
                res.count("budget_not_met", 1);
            }
        } else {
            chosen = cands.iter().collect();
        }
        chosen.sort_by_key(|c| (c.after_fwd, c.v.0));
        // Rewrite: offload after the last forward use, reload at the prefetch point.
        let mut offloaded_bytes = 0;
        let mut redirect: HashMap<Value, (Value, usize)> = HashMap::new();
        for c in &chosen {
            let d = g.def(c.v);
            let src = g.node(d).meta.source.clone();
            let meta = |reason: String| NodeMeta {
                source: src.clone(),
                provenance: Some(Provenance {
                    pass: NAME.into(),
                    reason,
                }),
                ..Default::default()
            };
            let user = order[c.after_fwd];
            let mut ops = vec![c.v];
            if user != d {
                ops.push(g.node(user).results[0]);
            }
            let host = g
                .insert_with(At::After(user), Op::Offload { stream: "d2h".into() }, &ops, meta(format!("saved for the backward of layer {}: {} bytes to host after the last forward use", c.layer, c.bytes)))
                .map_err(|e| build_error(NAME, e))?[0];
            let at = order[c.prefetch];
            let dep = g.node(at).results[0];
            let secs = c.bytes as f64 / o.link_bytes_per_s as f64;
            let back = g
                .insert_with(
                    At::After(at),
                    Op::Reload { stream: "h2d".into() },
                    &[host, dep],
                    meta(format!("prefetch for the backward of layer {}: {} bytes, {:.3} ms on the host link, issued with the backward of layer {}", c.layer, c.bytes, secs * 1e3, c.layer + 1)),
                )
                .map_err(|e| build_error(NAME, e))?[0];
            redirect.insert(c.v, (back, c.prefetch));
            offloaded_bytes += c.bytes;
        }
        // Backward readers after the prefetch point read the reloaded value.
        for (i, &n) in order.iter().enumerate() {
            if joint.forward.contains(&n) {
                continue;
            }
            let ops: Vec<Value> = g
                .node(n)
                .operands
                .iter()
                .map(|x| match redirect.get(x) {
                    Some((r, p)) if i > *p => *r,
                    _ => *x,
                })
                .collect();
            g.node_mut(n).operands = ops;
        }
        res.count("offloaded", chosen.len() as u64);
        res.count("offloaded_bytes", offloaded_bytes);
        res.count("device_saved_bytes", total_saved - offloaded_bytes);
        res.changed = !chosen.is_empty();
        Ok(res)
    }
}

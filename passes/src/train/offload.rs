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
//! the host link (`link_bytes_per_s`, default the device profile's: 55 GB/s on an
//! H200) moves in the compute time of the window it hides under (the next layer's
//! forward for the copy out, its backward — recompute included — for the copy in).
//!
//! With `--checkpoint selective` and no budget, the `checkpoint` pass has already
//! chosen what goes to the host (the recomputable matmul outputs the link can carry
//! within those windows, instead of recomputing them) and inserted the copies with
//! the helpers here; this pass then adds nothing. Compute time is the plan's cost model
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
/// (`attention_grad`, `grouped_matmul_grad`) are priced at no less than 2.5x and 2x
/// their forward op.
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
        Op::GroupedMatmulGrad { .. } => 2.0,
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
    let work = crate::memory::attention_work(g, n, b);
    crate::plan::cost::compute_time(&nd.op, fl, by as f64, work, d)
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
        let timed = o.budget.is_some();
        let Some(w) = Windows::of(g, &joint, &order, &b, timed.then_some(&o.device.0)) else {
            return Ok(res);
        };
        let mut cands: Vec<Cand> = joint
            .saved
            .iter()
            .filter_map(|&v| Cand::of(g, &joint, &order, &w, &b, v, o.keep_last, o.min_bytes))
            .collect();
        let total_saved: u64 = joint.saved.iter().map(|v| bytes(g, *v, &b)).sum();
        res.count("candidates", cands.len() as u64);
        // Which to offload.
        let mut chosen: Vec<Cand> = Vec::new();
        if let Some(budget) = o.budget {
            cands.sort_by_key(|c| (c.layer, std::cmp::Reverse(c.bytes), c.v.0));
            let mut on_device = total_saved;
            let mut room = LinkRoom::new(&w, o.link_bytes_per_s);
            for c in cands {
                if on_device <= budget {
                    break;
                }
                if !room.take(&c) {
                    res.count("skipped_bandwidth", 1);
                    continue;
                }
                on_device -= c.bytes;
                chosen.push(c);
            }
            if on_device > budget {
                res.count("budget_not_met", 1);
            }
        } else {
            chosen = cands;
        }
        let offloaded_bytes = rewrite(
            g,
            &order,
            &joint,
            &mut chosen,
            o.link_bytes_per_s,
            NAME,
            |c| {
                format!(
                "saved for the backward of layer {}: {} bytes to host after the last forward use",
                c.layer, c.bytes
            )
            },
        )?;
        res.count("offloaded", chosen.len() as u64);
        res.count("offloaded_bytes", offloaded_bytes);
        res.count("device_saved_bytes", total_saved - offloaded_bytes);
        res.changed = !chosen.is_empty();
        Ok(res)
    }
}

/// The layer index of a node's scope (`model.layers.3.mlp` -> 3).
fn layer_at(g: &Graph, n: Node) -> Option<usize> {
    layer_of(g.node(n).meta.source.as_deref()).and_then(|l| layer_index(&l))
}

/// The time windows copies hide under, per layer: where its backward starts, and the
/// predicted compute seconds of its forward and its backward (0 when untimed).
pub(crate) struct Windows {
    bwd_start: BTreeMap<usize, usize>,
    fwd_s: BTreeMap<usize, f64>,
    bwd_s: BTreeMap<usize, f64>,
    last_layer: usize,
    /// The compute stream's predicted clock at the end of each program position (it
    /// runs the program in order), and at the end of each layer's forward.
    t_end: Vec<f64>,
    fwd_end: BTreeMap<usize, f64>,
}

impl Windows {
    /// `None` when the graph has no layers. Untimed without a device.
    pub(crate) fn of(
        g: &Graph,
        joint: &Joint,
        order: &[Node],
        b: &weft_ir::Bindings,
        device: Option<&weft_ir::plan::DeviceProfile>,
    ) -> Option<Windows> {
        let mut w = Windows {
            bwd_start: BTreeMap::new(),
            fwd_s: BTreeMap::new(),
            bwd_s: BTreeMap::new(),
            last_layer: 0,
            t_end: Vec::with_capacity(order.len()),
            fwd_end: BTreeMap::new(),
        };
        let mut any = false;
        let mut clock = 0.0;
        for (i, &n) in order.iter().enumerate() {
            let t = device.map_or(0.0, |d| compute_seconds(g, n, b, d));
            clock += t;
            w.t_end.push(clock);
            let Some(l) = layer_at(g, n) else { continue };
            any = true;
            w.last_layer = w.last_layer.max(l);
            if joint.forward.contains(&n) {
                *w.fwd_s.entry(l).or_default() += t;
                w.fwd_end.insert(l, clock);
            } else {
                w.bwd_start.entry(l).or_insert(i);
                *w.bwd_s.entry(l).or_default() += t;
            }
        }
        any.then_some(w)
    }
}

/// The two copy streams of the host link as FIFO queues on the compute stream's
/// predicted clock (a [`Windows`] timed on a device): whether a layer's offloads, each
/// issued after its last forward use, leave the device by the end of the next layer's
/// forward (later, the compute stream would wait for them or hold their bytes), and
/// its prefetches, issued when the next layer's backward starts, arrive before their
/// first backward use.
pub(crate) struct LinkQueues<'a> {
    w: &'a Windows,
    bytes_per_s: f64,
    /// When the device-to-host queue is next free.
    out_free: f64,
}

impl<'a> LinkQueues<'a> {
    pub(crate) fn new(w: &'a Windows, bytes_per_s: f64) -> Self {
        LinkQueues {
            w,
            bytes_per_s,
            out_free: 0.0,
        }
    }

    /// The device-to-host queue's end if `cs` (all of one layer) join it, or `None`
    /// when either direction misses its deadline.
    pub(crate) fn try_layer(&self, cs: &[&Cand]) -> Option<f64> {
        let Some(first) = cs.first() else {
            return Some(self.out_free);
        };
        let layer = first.layer;
        let deadline_out = *self.w.fwd_end.get(&(layer + 1))?;
        let mut by_avail: Vec<&&Cand> = cs.iter().collect();
        by_avail.sort_by_key(|c| (c.after_fwd, c.v.0));
        let mut q = self.out_free;
        for c in by_avail {
            q = q.max(self.w.t_end[c.after_fwd]) + c.bytes as f64 / self.bytes_per_s;
        }
        if q > deadline_out {
            return None;
        }
        let issue = self.w.t_end[cs.iter().map(|c| c.prefetch).min()?];
        let arrive = issue + cs.iter().map(|c| c.bytes as f64).sum::<f64>() / self.bytes_per_s;
        let need = cs
            .iter()
            .map(|c| self.w.t_end[c.first_bwd.saturating_sub(1)])
            .fold(f64::INFINITY, f64::min);
        (arrive <= need).then_some(q)
    }

    /// Commits a layer's choice (the queue end [`Self::try_layer`] gave).
    pub(crate) fn commit(&mut self, out_end: f64) {
        self.out_free = out_end;
    }
}

/// A saved value that can go to the host: defined in a layer before the last
/// `keep_last`, at least `min_bytes`, with room between its last forward use and the
/// prefetch point (the start of the next layer's backward, or just before its own
/// first backward use if that comes earlier).
pub(crate) struct Cand {
    pub(crate) v: Value,
    pub(crate) layer: usize,
    pub(crate) bytes: u64,
    after_fwd: usize,
    prefetch: usize,
    first_bwd: usize,
}

impl Cand {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn of(
        g: &Graph,
        joint: &Joint,
        order: &[Node],
        w: &Windows,
        b: &weft_ir::Bindings,
        v: Value,
        keep_last: usize,
        min_bytes: u64,
    ) -> Option<Cand> {
        let d = g.def(v);
        if matches!(g.node(d).op, Op::Offload { .. }) {
            return None;
        }
        let layer = layer_at(g, d)?;
        let by = bytes(g, v, b);
        if layer + keep_last > w.last_layer || by < min_bytes.max(1) {
            return None;
        }
        let first_bwd = *joint.backward_uses.get(&v)?.iter().min()?;
        let fwd_last = order
            .iter()
            .enumerate()
            .filter(|(_, n)| joint.forward.contains(n) && g.node(**n).operands.contains(&v))
            .map(|(i, _)| i)
            .max()
            .unwrap_or(joint.pos[&d]);
        let prefetch = w
            .bwd_start
            .get(&(layer + 1))
            .copied()
            .unwrap_or(first_bwd)
            .min(first_bwd.saturating_sub(1));
        (prefetch > fwd_last).then_some(Cand {
            v,
            layer,
            bytes: by,
            after_fwd: fwd_last,
            prefetch,
            first_bwd,
        })
    }
}

/// Bytes the host link can still move in each window: copies out of layer `l` during
/// the forward of layer `l + 1`, copies back in during its backward.
pub(crate) struct LinkRoom<'a> {
    w: &'a Windows,
    link: f64,
    out: BTreeMap<usize, f64>,
    inn: BTreeMap<usize, f64>,
}

impl<'a> LinkRoom<'a> {
    pub(crate) fn new(w: &'a Windows, link_bytes_per_s: u64) -> Self {
        LinkRoom {
            w,
            link: link_bytes_per_s as f64,
            out: BTreeMap::new(),
            inn: BTreeMap::new(),
        }
    }
    /// Reserves room for `c` if both its windows have it.
    pub(crate) fn take(&mut self, c: &Cand) -> bool {
        let next = c.layer + 1;
        let out = self
            .out
            .entry(next)
            .or_insert(self.w.fwd_s.get(&next).copied().unwrap_or(0.0) * self.link);
        let inn = self
            .inn
            .entry(next)
            .or_insert(self.w.bwd_s.get(&next).copied().unwrap_or(0.0) * self.link);
        let by = c.bytes as f64;
        if by > *out || by > *inn {
            return false;
        }
        *out -= by;
        *inn -= by;
        true
    }
}

/// Inserts `offload {stream="d2h"}` after each chosen value's last forward use and
/// `reload {stream="h2d"}` at its prefetch point, and points the backward readers after
/// that point at the reloaded value. `reason` says why each was offloaded. Returns the
/// bytes offloaded.
pub(crate) fn rewrite(
    g: &mut Graph,
    order: &[Node],
    joint: &Joint,
    chosen: &mut [Cand],
    link_bytes_per_s: u64,
    pass: &str,
    reason: impl Fn(&Cand) -> String,
) -> Result<u64, PassError> {
    chosen.sort_by_key(|c| (c.after_fwd, c.v.0));
    let mut offloaded_bytes = 0;
    let mut redirect: HashMap<Value, (Value, usize)> = HashMap::new();
    for c in chosen.iter() {
        let d = g.def(c.v);
        let src = g.node(d).meta.source.clone();
        let meta = |reason: String| NodeMeta {
            source: src.clone(),
            provenance: Some(Provenance {
                pass: pass.into(),
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
            .insert_with(
                At::After(user),
                Op::Offload {
                    stream: "d2h".into(),
                },
                &ops,
                meta(reason(c)),
            )
            .map_err(|e| build_error(pass, e))?[0];
        let at = order[c.prefetch];
        let dep = g.node(at).results[0];
        let secs = c.bytes as f64 / link_bytes_per_s as f64;
        let back = g
            .insert_with(
                At::After(at),
                Op::Reload {
                    stream: "h2d".into(),
                },
                &[host, dep],
                meta(format!(
                    "prefetch for the backward of layer {}: {} bytes, {:.3} ms on the host link, issued with the backward of layer {}",
                    c.layer,
                    c.bytes,
                    secs * 1e3,
                    c.layer + 1
                )),
            )
            .map_err(|e| build_error(pass, e))?[0];
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
    Ok(offloaded_bytes)
}

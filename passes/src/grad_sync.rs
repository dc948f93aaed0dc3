//! `grad-sync`: coalesced gradient reduction.
//!
//! `autodiff` sums each parameter's gradient over the axes it is replicated on (and
//! whose ranks saw different tokens: `dp`, `sp`; `tp` for parameters a tensor-parallel
//! layer leaves whole; the expert data-parallel group for experts) with one
//! `all_reduce` per parameter and axis. This pass coalesces them into buckets as
//! DeepSpeed and PyTorch DDP do: gradients with the same reduction axes and dtype are
//! taken in the order the backward produces them, flattened and concatenated until a
//! bucket holds `bucket_bytes` (default 500 MB, DeepSpeed's `reduce_bucket_size`), and
//! each bucket is reduced by one collective per axis, placed right after its last
//! gradient is produced, so the first buckets overlap the rest of the backward.
//!
//! The scale is a sum over every axis: the loss `autodiff` differentiates is already
//! the global mean over the valid tokens of the whole batch (and of the mean over ranks
//! where the loss differs per rank), so the replicas' partial gradients add up to it.
//!
//! With `reduce_scatter` (ZeRO-2 style) a bucket is padded to a multiple of the `dp`
//! size and `reduce_scatter`ed over `dp`, so each rank keeps the reduced shard the
//! sharded optimizer updates; the `grad.*` outputs then `all_gather` it back.

use crate::autodiff::{GRAD_PREFIX, NAME as AUTODIFF};
use crate::pass::{Pass, PassContext, PassError, PassResult, DP};
use crate::util::{build_error, made_by};
use weft_ir::{At, Bindings, DType, Dim, Float, Graph, Node, NodeMeta, Op, Provenance, ReduceOp, TensorType, Value};

pub struct GradSync;

pub const NAME: &str = "grad-sync";

impl Pass for GradSync {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "coalesce the per-parameter gradient all_reduces autodiff made into buckets (reduce_bucket_size), reduced in backward order; ZeRO reduce_scatter option"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[AUTODIFF]
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        for k in ["params", "buckets", "collectives", "collectives_before", "bucket_bytes_max"] {
            res.count(k, 0);
        }
        let syncs = find_syncs(g);
        if syncs.is_empty() {
            return Ok(res);
        }
        let opts = &cx.options.train;
        res.count("params", syncs.len() as u64);
        res.count("collectives_before", syncs.iter().map(|s| s.axes.len() as u64).sum());
        let buckets = plan_buckets(g, syncs, opts.bucket_bytes);
        let mut dead = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            res.count("bucket_bytes_max", 0);
            let m = res.counters.get_mut("bucket_bytes_max").unwrap();
            *m = (*m).max(b.bytes);
            let n = emit_bucket(g, i, b, opts.reduce_scatter, &cx.mesh)?;
            res.count("collectives", n);
            for s in &b.members {
                dead.extend(s.chain.iter().copied());
            }
        }
        res.count("buckets", buckets.len() as u64);
        g.remove_nodes(&dead.into_iter().rev().collect::<Vec<_>>());
        res.changed = true;
        Ok(res)
    }
}

/// One parameter gradient `autodiff` reduces: the output, the local (partial)
/// gradient, the axes and the `all_reduce` nodes to replace.
#[derive(Clone, Debug)]
pub(crate) struct Sync {
    pub output: String,
    pub local: Value,
    pub axes: Vec<String>,
    pub chain: Vec<Node>,
}

/// The gradient outputs made of `all_reduce` chains by autodiff, in backward order
/// (the program position of the local gradient).
fn find_syncs(g: &Graph) -> Vec<Sync> {
    let uses = g.uses();
    let mut out = Vec::new();
    for (name, v) in g.outputs() {
        if !name.starts_with(GRAD_PREFIX) {
            continue;
        }
        let mut cur = *v;
        let mut axes = Vec::new();
        let mut chain = Vec::new();
        loop {
            let n = g.def(cur);
            let single_use = uses[cur.0 as usize].len() <= 1;
            match &g.node(n).op {
                Op::AllReduce { axis, op: ReduceOp::Sum } if made_by(g, n, AUTODIFF) && single_use => {
                    axes.push(axis.clone());
                    chain.push(n);
                    cur = g.node(n).operands[0];
                }
                _ => break,
            }
        }
        if !chain.is_empty() {
            axes.reverse();
            out.push(Sync { output: name.clone(), local: cur, axes, chain });
        }
    }
    let pos: std::collections::HashMap<Node, usize> = g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect();
    out.sort_by_key(|s| pos[&g.def(s.local)]);
    out
}

/// A bucket: gradients with the same reduction axes and dtype, in backward order.
pub(crate) struct Bucket {
    pub axes: Vec<String>,
    pub dtype: DType,
    pub members: Vec<Sync>,
    pub bytes: u64,
}

/// Per-rank bytes of a value, evaluated with the mesh sizes and rank 0's coordinates
/// (parameter gradients have constant sizes, or per-rank tables).
pub(crate) fn value_bytes(g: &Graph, v: Value) -> u64 {
    let mut b = Bindings::new();
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64).with_coord(a, 0);
    }
    g.ty(v).size_bytes(&b).unwrap_or(0)
}

fn plan_buckets(g: &Graph, syncs: Vec<Sync>, limit: u64) -> Vec<Bucket> {
    let mut open: Vec<Bucket> = Vec::new();
    let mut done: Vec<Bucket> = Vec::new();
    for s in syncs {
        let dtype = g.ty(s.local).dtype;
        let bytes = value_bytes(g, s.local);
        let i = match open.iter().position(|b| b.axes == s.axes && b.dtype == dtype) {
            Some(i) => i,
            None => {
                open.push(Bucket { axes: s.axes.clone(), dtype, members: Vec::new(), bytes: 0 });
                open.len() - 1
            }
        };
        open[i].members.push(s);
        open[i].bytes += bytes;
        if open[i].bytes >= limit {
            done.push(open.remove(i));
        }
    }
    done.extend(open);
    // Emit in the order the buckets become ready (their last gradient).
    let pos: std::collections::HashMap<Node, usize> = g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect();
    done.sort_by_key(|b| b.members.iter().map(|s| pos[&g.def(s.local)]).max().unwrap_or(0));
    done
}

fn numel(t: &TensorType) -> Dim {
    t.numel()
}

/// Writes bucket `i` after its last gradient; returns the number of collectives.
fn emit_bucket(g: &mut Graph, i: usize, b: &Bucket, reduce_scatter: bool, mesh: &weft_ir::Mesh) -> Result<u64, PassError> {
    let pos: std::collections::HashMap<Node, usize> = g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let last = b.members.iter().map(|s| g.def(s.local)).max_by_key(|n| pos[n]).expect("buckets are not empty");
    let names: Vec<&str> = b.members.iter().map(|s| &s.output[GRAD_PREFIX.len()..]).collect();
    let what = format!("bucket {i} ({} params, {} bytes per rank: {})", b.members.len(), b.bytes, summarize(&names));
    let at = std::cell::Cell::new(last);
    let add = |g: &mut Graph, op: Op, xs: &[Value], reason: String| -> Result<Value, PassError> {
        let meta = NodeMeta { source: None, provenance: Some(Provenance { pass: NAME.into(), reason }), ..Default::default() };
        let v = g.insert_with(At::After(at.get()), op, xs, meta).map_err(|e| build_error(NAME, e))?[0];
        at.set(g.def(v));
        Ok(v)
    };
    // Flatten and concatenate.
    let sizes: Vec<Dim> = b.members.iter().map(|s| numel(g.ty(s.local))).collect();
    let total = sizes.iter().fold(Dim::zero(), |a, d| a + d.clone());
    let mut flats = Vec::new();
    for (s, n) in b.members.iter().zip(&sizes) {
        let t = g.ty(s.local).clone();
        flats.push(if t.shape.len() == 1 { s.local } else { add(g, Op::Reshape { shape: vec![n.clone()] }, &[s.local], format!("{what}: flatten"))? });
    }
    let mut flat = if flats.len() == 1 { flats[0] } else { add(g, Op::Concat { dim: 0 }, &flats, format!("{what}: coalesce"))? };
    let mut collectives = 0;
    let dp_size = mesh.size(DP).unwrap_or(1) as i64;
    let scatter = reduce_scatter && b.axes.iter().any(|a| a == DP) && dp_size > 1;
    let mut padded = total.clone();
    if scatter {
        // Pad to a multiple of dp, then each rank keeps its reduced shard.
        if let Some(t) = total.as_const() {
            let pad = (dp_size - t % dp_size) % dp_size;
            if pad > 0 {
                let z = add(g, Op::Full { value: Float(0.0), ty: TensorType::new(b.dtype, vec![Dim::from(pad)]) }, &[], format!("{what}: padding to a multiple of dp={dp_size}"))?;
                flat = add(g, Op::Concat { dim: 0 }, &[flat, z], format!("{what}: pad"))?;
                padded = Dim::from(t + pad);
            }
        } else {
            return Err(PassError::rewrite(NAME, "`grad-sync` cannot shard a bucket", what, format!("its size `{total}` is not a constant")));
        }
        let reason = format!("{what}: ZeRO reduce_scatter over dp, sum (the loss is the global mean over valid tokens), {} bytes", b.bytes);
        flat = add(g, Op::ReduceScatter { axis: DP.into(), dim: 0, op: ReduceOp::Sum }, &[flat], reason)?;
        collectives += 1;
    }
    // Other axes: all_reduce (sum), innermost axis first.
    let mut axes: Vec<&String> = b.axes.iter().filter(|a| !(scatter && a.as_str() == DP)).collect();
    axes.sort_by_key(|a| std::cmp::Reverse(mesh.axes.iter().position(|(x, _)| x == *a)));
    for axis in axes {
        let reason = format!("{what}: all_reduce over {axis}, sum (the loss is the global mean over valid tokens), {} bytes", b.bytes);
        flat = add(g, Op::AllReduce { axis: axis.clone(), op: ReduceOp::Sum }, &[flat], reason)?;
        collectives += 1;
    }
    if scatter {
        flat = add(g, Op::AllGather { axis: DP.into(), dim: 0 }, &[flat], format!("{what}: the whole gradient for the grad outputs (a sharded optimizer reads the shard)"))?;
        if padded != total {
            flat = add(g, Op::Slice { dim: 0, start: Dim::zero(), len: total.clone() }, &[flat], format!("{what}: drop the padding"))?;
        }
    }
    let parts = if b.members.len() == 1 {
        vec![flat]
    } else {
        let meta = NodeMeta { source: None, provenance: Some(Provenance { pass: NAME.into(), reason: format!("{what}: back to parameters") }), ..Default::default() };
        let r = g.insert_with(At::After(at.get()), Op::Split { dim: 0, sizes }, &[flat], meta).map_err(|e| build_error(NAME, e))?;
        at.set(g.def(r[0]));
        r
    };
    for (s, p) in b.members.iter().zip(parts) {
        let t = g.ty(s.local).clone();
        let v = if g.ty(p).shape == t.shape { p } else { add(g, Op::Reshape { shape: t.shape.clone() }, &[p], format!("{what}: {}", &s.output[GRAD_PREFIX.len()..]))? };
        g.set_output(&s.output, v);
    }
    Ok(collectives)
}

fn summarize(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [a] => a.to_string(),
        [a, .., z] => format!("{a} .. {z}"),
    }
}

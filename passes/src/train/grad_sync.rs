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
//! With `reduce_scatter` (ZeRO-2 style) a bucket is laid out rank-major and
//! `reduce_scatter`ed over `dp`, so each rank keeps the reduced chunks of every member
//! that the sharded optimizer updates (returned as `grad_shard.<param>` when a ZeRO
//! optimizer follows); the `grad.*` outputs `all_gather` them back.

use crate::autodiff::{GRAD_PREFIX, NAME as AUTODIFF};
use crate::pass::{Pass, PassContext, PassError, PassResult, DP};
use crate::util::{build_error, made_by};
use weft_ir::{
    At, Bindings, DType, Dim, Float, Graph, Node, NodeMeta, Op, Provenance, ReduceOp, TensorType,
    Value,
};

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
        for k in [
            "params",
            "buckets",
            "collectives",
            "collectives_before",
            "bucket_bytes_max",
        ] {
            res.count(k, 0);
        }
        let syncs = find_syncs(g);
        if syncs.is_empty() {
            return Ok(res);
        }
        let opts = &cx.options.train;
        res.count("params", syncs.len() as u64);
        res.count(
            "collectives_before",
            syncs.iter().map(|s| s.axes.len() as u64).sum(),
        );
        let buckets = plan_buckets(g, syncs, opts.bucket_bytes);
        let mut dead = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            res.count("bucket_bytes_max", 0);
            let m = res.counters.get_mut("bucket_bytes_max").unwrap();
            *m = (*m).max(b.bytes);
            let shards_out = opts.reduce_scatter && opts.zero1 && opts.optimizer.is_some();
            let n = emit_bucket(g, i, b, opts.reduce_scatter, shards_out, &cx.mesh)?;
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
                Op::AllReduce {
                    axis,
                    op: ReduceOp::Sum,
                } if made_by(g, n, AUTODIFF) && single_use => {
                    axes.push(axis.clone());
                    chain.push(n);
                    cur = g.node(n).operands[0];
                }
                _ => break,
            }
        }
        if !chain.is_empty() {
            axes.reverse();
            out.push(Sync {
                output: name.clone(),
                local: cur,
                axes,
                chain,
            });
        }
    }
    let pos: std::collections::HashMap<Node, usize> =
        g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect();
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
        let i = match open
            .iter()
            .position(|b| b.axes == s.axes && b.dtype == dtype)
        {
            Some(i) => i,
            None => {
                open.push(Bucket {
                    axes: s.axes.clone(),
                    dtype,
                    members: Vec::new(),
                    bytes: 0,
                });
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
    let pos: std::collections::HashMap<Node, usize> =
        g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect();
    done.sort_by_key(|b| {
        b.members
            .iter()
            .map(|s| pos[&g.def(s.local)])
            .max()
            .unwrap_or(0)
    });
    done
}

fn numel(t: &TensorType) -> Dim {
    t.numel()
}

/// The prefix of the per-rank gradient shards a ZeRO step returns for the sharded
/// optimizer (`optimizer` reads and removes them): `grad_shard.<param>`, this rank's
/// `ceil(n/dp)` elements of the flattened, zero-padded gradient, split over `dp`.
pub const SHARD_PREFIX: &str = "grad_shard.";

/// Writes bucket `i` after its last gradient; returns the number of collectives.
///
/// All-reduce buckets are the members' gradients flattened and concatenated. A ZeRO
/// bucket is laid out rank-major: each member flattened, padded to `dp * chunk`
/// (`chunk = ceil(n/dp)`), viewed `[dp, chunk]` and concatenated along the chunks, so
/// that the `reduce_scatter` over dp leaves each rank exactly the chunks of every
/// member that the sharded optimizer updates (its `1/dp` of each parameter).
fn emit_bucket(
    g: &mut Graph,
    i: usize,
    b: &Bucket,
    reduce_scatter: bool,
    shards_out: bool,
    mesh: &weft_ir::Mesh,
) -> Result<u64, PassError> {
    let pos: std::collections::HashMap<Node, usize> =
        g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let last = b
        .members
        .iter()
        .map(|s| g.def(s.local))
        .max_by_key(|n| pos[n])
        .expect("buckets are not empty");
    let names: Vec<&str> = b
        .members
        .iter()
        .map(|s| &s.output[GRAD_PREFIX.len()..])
        .collect();
    let what = format!(
        "bucket {i} ({} params, {} bytes per rank: {})",
        b.members.len(),
        b.bytes,
        summarize(&names)
    );
    let at = std::cell::Cell::new(last);
    let add =
        |g: &mut Graph, op: Op, xs: &[Value], reason: String| -> Result<Vec<Value>, PassError> {
            let meta = NodeMeta {
                source: None,
                provenance: Some(Provenance {
                    pass: NAME.into(),
                    reason,
                }),
                ..Default::default()
            };
            let v = g
                .insert_with(At::After(at.get()), op, xs, meta)
                .map_err(|e| build_error(NAME, e))?;
            at.set(g.def(v[0]));
            Ok(v)
        };
    let add1 = |g: &mut Graph, op: Op, xs: &[Value], reason: String| -> Result<Value, PassError> {
        Ok(add(g, op, xs, reason)?[0])
    };
    let sizes: Vec<Dim> = b.members.iter().map(|s| numel(g.ty(s.local))).collect();
    let dp_size = mesh.size(DP).unwrap_or(1) as i64;
    let scatter = reduce_scatter
        && b.axes.iter().any(|a| a == DP)
        && dp_size > 1
        && sizes.iter().all(|d| d.is_const());
    let mut collectives = 0;
    let reduce_others = |g: &mut Graph,
                         mut flat: Value,
                         collectives: &mut u64|
     -> Result<Value, PassError> {
        // Axes other than a scattered dp: all_reduce (sum), innermost axis first.
        let mut axes: Vec<&String> = b
            .axes
            .iter()
            .filter(|a| !(scatter && a.as_str() == DP))
            .collect();
        axes.sort_by_key(|a| std::cmp::Reverse(mesh.axes.iter().position(|(x, _)| x == *a)));
        for axis in axes {
            let reason = format!("{what}: all_reduce over {axis}, sum (the loss is the global mean over valid tokens), {} bytes", value_bytes(g, flat));
            flat = add1(
                g,
                Op::AllReduce {
                    axis: axis.clone(),
                    op: ReduceOp::Sum,
                },
                &[flat],
                reason,
            )?;
            *collectives += 1;
        }
        Ok(flat)
    };
    if !scatter {
        let mut flats = Vec::new();
        for (s, n) in b.members.iter().zip(&sizes) {
            let t = g.ty(s.local).clone();
            flats.push(if t.shape.len() == 1 {
                s.local
            } else {
                add1(
                    g,
                    Op::Reshape {
                        shape: vec![n.clone()],
                    },
                    &[s.local],
                    format!("{what}: flatten"),
                )?
            });
        }
        let flat = if flats.len() == 1 {
            flats[0]
        } else {
            add1(
                g,
                Op::Concat { dim: 0 },
                &flats,
                format!("{what}: coalesce"),
            )?
        };
        let flat = reduce_others(g, flat, &mut collectives)?;
        let parts = if b.members.len() == 1 {
            vec![flat]
        } else {
            add(
                g,
                Op::Split { dim: 0, sizes },
                &[flat],
                format!("{what}: back to parameters"),
            )?
        };
        for (s, p) in b.members.iter().zip(parts) {
            let t = g.ty(s.local).clone();
            let v = if g.ty(p).shape == t.shape {
                p
            } else {
                add1(
                    g,
                    Op::Reshape {
                        shape: t.shape.clone(),
                    },
                    &[p],
                    format!("{what}: {}", &s.output[GRAD_PREFIX.len()..]),
                )?
            };
            g.set_output(&s.output, v);
        }
        return Ok(collectives);
    }
    // ZeRO: rank-major [dp, sum of chunks], reduce_scatter over dp.
    let dpd = Dim::from(dp_size);
    let mut chunks = Vec::new();
    let mut rows = Vec::new();
    for (s, n) in b.members.iter().zip(&sizes) {
        let n = n.as_const().expect("checked constant");
        let chunk = (n + dp_size - 1) / dp_size;
        chunks.push(Dim::from(chunk));
        let mut v = s.local;
        if g.ty(v).rank() != 1 {
            v = add1(
                g,
                Op::Reshape {
                    shape: vec![Dim::from(n)],
                },
                &[v],
                format!("{what}: flatten"),
            )?;
        }
        if chunk * dp_size != n {
            let z = add1(
                g,
                Op::Full {
                    value: Float(0.0),
                    ty: TensorType::new(b.dtype, vec![Dim::from(chunk * dp_size - n)]),
                },
                &[],
                format!("{what}: padding to a multiple of dp={dp_size}"),
            )?;
            v = add1(g, Op::Concat { dim: 0 }, &[v, z], format!("{what}: pad"))?;
        }
        rows.push(add1(
            g,
            Op::Reshape {
                shape: vec![dpd.clone(), Dim::from(chunk)],
            },
            &[v],
            format!("{what}: one chunk per dp rank"),
        )?);
    }
    let total: i64 = chunks.iter().map(|c| c.as_const().unwrap()).sum();
    let mut flat = if rows.len() == 1 {
        rows[0]
    } else {
        add1(
            g,
            Op::Concat { dim: 1 },
            &rows,
            format!("{what}: coalesce, rank-major"),
        )?
    };
    let reason = format!("{what}: ZeRO reduce_scatter over dp, sum (the loss is the global mean over valid tokens), {} bytes", b.bytes);
    flat = add1(
        g,
        Op::ReduceScatter {
            axis: DP.into(),
            dim: 0,
            op: ReduceOp::Sum,
        },
        &[flat],
        reason,
    )?;
    collectives += 1;
    // [dp_size/dp, total]: the one row this rank keeps (the slice gives its size as a constant).
    flat = add1(
        g,
        Op::Slice {
            dim: 0,
            start: Dim::zero(),
            len: Dim::from(1),
        },
        &[flat],
        format!("{what}: this rank's row"),
    )?;
    let mut shard = add1(
        g,
        Op::Reshape {
            shape: vec![Dim::from(total)],
        },
        &[flat],
        format!("{what}: this rank's shard"),
    )?;
    shard = reduce_others(g, shard, &mut collectives)?;
    if shards_out {
        let parts = if b.members.len() == 1 {
            vec![shard]
        } else {
            add(
                g,
                Op::Split {
                    dim: 0,
                    sizes: chunks.clone(),
                },
                &[shard],
                format!("{what}: each parameter's chunk"),
            )?
        };
        for (s, p) in b.members.iter().zip(parts) {
            let out = format!("{SHARD_PREFIX}{}", &s.output[GRAD_PREFIX.len()..]);
            g.set_output(&out, p);
            g.add_output_split(&out, 0, DP);
        }
    }
    // The whole gradients for the grad outputs.
    let whole = add1(
        g,
        Op::Reshape {
            shape: vec![Dim::from(1), Dim::from(total)],
        },
        &[shard],
        format!("{what}: gather the shards"),
    )?;
    let whole = add1(g, Op::AllGather { axis: DP.into(), dim: 0 }, &[whole], format!("{what}: the whole gradient for the grad outputs (the sharded optimizer reads the shard)"))?;
    let parts = if b.members.len() == 1 {
        vec![whole]
    } else {
        add(
            g,
            Op::Split {
                dim: 1,
                sizes: chunks.clone(),
            },
            &[whole],
            format!("{what}: back to parameters"),
        )?
    };
    for ((s, p), c) in b.members.iter().zip(parts).zip(&chunks) {
        let t = g.ty(s.local).clone();
        let n = numel(&t);
        let name = &s.output[GRAD_PREFIX.len()..];
        let flat = add1(
            g,
            Op::Reshape {
                shape: vec![Dim::sym(DP) * c.clone()],
            },
            &[p],
            format!("{what}: {name}"),
        )?;
        let flat = add1(
            g,
            Op::Slice {
                dim: 0,
                start: Dim::zero(),
                len: n,
            },
            &[flat],
            format!("{what}: {name} without padding"),
        )?;
        let v = if t.rank() == 1 {
            flat
        } else {
            add1(
                g,
                Op::Reshape {
                    shape: t.shape.clone(),
                },
                &[flat],
                format!("{what}: {name}"),
            )?
        };
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

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
//! `reduce_scatter`ed over its parameters' data-parallel group (`zero::ZeroGroup`:
//! dp x sp for dense parameters, tp-sharded or not, edp for experts), so each rank
//! keeps the reduced chunks of every member that the sharded optimizer updates
//! (returned as `grad_shard.<param>` when a ZeRO optimizer follows); the `grad.*`
//! outputs `all_gather` them back. Axes outside the group (tp for the parameters tp
//! leaves whole) are `all_reduce`d on the shard.
//!
//! With micro-batches a ZeRO-2 bucket is reduce-scattered once per micro-batch, right
//! after that micro-batch's backward finishes its members, and the shards are added
//! (`reduce_scatter` is linear): only a shard of each gradient lives across
//! micro-batches, as DeepSpeed's stage 2 with gradient accumulation does.

use crate::autodiff::NAME as AUTODIFF;
use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::util::made_by;
use crate::zero::{Emitter, ZeroGroup, ZeroSplit};
use weft_ir::{
    At, Bindings, DType, Dim, Graph, Node, NodeMeta, Op, ReduceOp, TensorType, Value, ValueRole,
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
            "reduce_scatter_buckets",
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
        let buckets = plan_buckets(g, syncs, opts.bucket_bytes, opts.reduce_scatter);
        let shards_out = opts.reduce_scatter && opts.zero1 && opts.optimizer.is_some();
        // Each bucket reads and rewrites only its own members' gradients, which exist
        // before the first bucket is written: one readers table and one order serve
        // every bucket (a scan per bucket made the pass quadratic in the step's size).
        let before = Before {
            uses: g.uses(),
            pos: g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect(),
        };
        let mut dead = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            res.count("bucket_bytes_max", 0);
            let m = res.counters.get_mut("bucket_bytes_max").unwrap();
            *m = (*m).max(b.bytes);
            let zero3 = opts.zero3 && shards_out;
            let scatter = !b.group.is_empty()
                && b.members
                    .iter()
                    .all(|s| member_split(g, s, &b.group, zero3).is_some());
            let n = if scatter {
                let (n, adds) = emit_scatter_bucket(g, &before, i, b, shards_out, zero3)?;
                dead.extend(adds);
                res.count("reduce_scatter_buckets", 1);
                n
            } else {
                emit_bucket(g, &before, i, b, &cx.mesh)?
            };
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
    /// `grad.<param>`.
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
        if ValueRole::of(name) != Some(ValueRole::Grad) {
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

/// A bucket: gradients with the same reduction axes, dtype and ZeRO group (empty
/// without `reduce_scatter`), in backward order.
pub(crate) struct Bucket {
    pub axes: Vec<String>,
    pub dtype: DType,
    pub members: Vec<Sync>,
    pub bytes: u64,
    pub group: ZeroGroup,
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

fn plan_buckets(g: &Graph, syncs: Vec<Sync>, limit: u64, scatter: bool) -> Vec<Bucket> {
    let mut open: Vec<Bucket> = Vec::new();
    let mut done: Vec<Bucket> = Vec::new();
    for s in syncs {
        let dtype = g.ty(s.local).dtype;
        let bytes = value_bytes(g, s.local);
        // A parameter too small to split over its group (fewer elements than ranks:
        // gpt-oss's attention sinks over 8 ranks) is all-reduced in a bucket of its own
        // kind: in a ZeRO bucket it made the whole bucket an all-reduce, and the stage-3
        // parameters in it lost their sharded gradients.
        let group = if scatter {
            let group = ZeroGroup::of_param(g, s.param()).within(&s.axes);
            if crate::zero::param_split(&g.mesh, g.ty(s.local), &group, false).is_some() {
                group
            } else {
                ZeroGroup::default()
            }
        } else {
            ZeroGroup::default()
        };
        let i = match open
            .iter()
            .position(|b| b.axes == s.axes && b.dtype == dtype && b.group == group)
        {
            Some(i) => i,
            None => {
                open.push(Bucket {
                    axes: s.axes.clone(),
                    dtype,
                    members: Vec::new(),
                    bytes: 0,
                    group,
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

/// Writes all-reduce bucket `i` after its last gradient: the members' gradients
/// flattened and concatenated, one `all_reduce` per axis; returns the number of
/// collectives.
fn emit_bucket(
    g: &mut Graph,
    before: &Before,
    i: usize,
    b: &Bucket,
    mesh: &weft_ir::Mesh,
) -> Result<u64, PassError> {
    let last = before.last_node(g, b.members.iter().map(|s| s.local));
    let what = bucket_name(i, b);
    let mut em = Emitter {
        pass: NAME,
        at: At::After(last),
        meta: NodeMeta::default(),
        g,
    };
    let sizes: Vec<Dim> = b.members.iter().map(|s| numel(em.g.ty(s.local))).collect();
    let mut flats = Vec::new();
    for (s, n) in b.members.iter().zip(&sizes) {
        let t = em.g.ty(s.local).clone();
        flats.push(if t.shape.len() == 1 {
            s.local
        } else {
            em.op(
                Op::Reshape {
                    shape: vec![n.clone()],
                },
                &[s.local],
                &format!("{what}: flatten"),
            )?
        });
    }
    let flat = if flats.len() == 1 {
        flats[0]
    } else {
        em.op(Op::Concat { dim: 0 }, &flats, &format!("{what}: coalesce"))?
    };
    let mut collectives = 0;
    let flat = reduce_others(
        &mut em,
        b,
        &ZeroGroup::default(),
        flat,
        &what,
        mesh,
        &mut collectives,
    )?;
    let parts = if b.members.len() == 1 {
        vec![flat]
    } else {
        em.ops(
            Op::Split { dim: 0, sizes },
            &[flat],
            &format!("{what}: back to parameters"),
        )?
    };
    for (s, p) in b.members.iter().zip(parts) {
        let t = em.g.ty(s.local).clone();
        let v = if em.g.ty(p).shape == t.shape {
            p
        } else {
            em.op(
                Op::Reshape {
                    shape: t.shape.clone(),
                },
                &[p],
                &format!("{what}: {}", s.param()),
            )?
        };
        em.g.set_output(&s.output, v);
    }
    Ok(collectives)
}

/// The program as it was before the first bucket was written.
struct Before {
    uses: Vec<Vec<(Node, usize)>>,
    pos: std::collections::HashMap<Node, usize>,
}

impl Before {
    /// The node of the last of `vs` (values that existed then) in program order.
    fn last_node(&self, g: &Graph, vs: impl Iterator<Item = Value>) -> Node {
        vs.map(|v| g.def(v))
            .max_by_key(|n| self.pos[n])
            .expect("buckets are not empty")
    }
}

fn bucket_name(i: usize, b: &Bucket) -> String {
    let names: Vec<&str> = b.members.iter().map(|s| s.param()).collect();
    format!(
        "bucket {i} ({} params, {} bytes per rank: {})",
        b.members.len(),
        b.bytes,
        summarize(&names)
    )
}

/// `all_reduce` (sum) of `flat` over the bucket's axes outside `group`, innermost first.
fn reduce_others(
    em: &mut Emitter,
    b: &Bucket,
    group: &ZeroGroup,
    mut flat: Value,
    what: &str,
    mesh: &weft_ir::Mesh,
    collectives: &mut u64,
) -> Result<Value, PassError> {
    let mut axes: Vec<&String> = b.axes.iter().filter(|a| !group.has(a)).collect();
    axes.sort_by_key(|a| std::cmp::Reverse(mesh.axes.iter().position(|(x, _)| x == *a)));
    for axis in axes {
        let reason = format!(
            "{what}: all_reduce over {axis}, sum (the loss is the global mean over valid tokens), {} bytes",
            value_bytes(em.g, flat)
        );
        flat = em.op(
            Op::AllReduce {
                axis: axis.clone(),
                op: ReduceOp::Sum,
            },
            &[flat],
            &reason,
        )?;
        *collectives += 1;
    }
    Ok(flat)
}

impl Sync {
    /// The parameter whose gradient this is.
    pub fn param(&self) -> &str {
        weft_ir::ValueName::parse(&self.output)
            .param()
            .unwrap_or(&self.output)
    }
}

/// A member's local gradient as the sum of its micro-batches' contributions: the
/// leaves of the `add` tree autodiff built, by micro-batch, and the tree's adds.
/// `None` when a leaf belongs to no micro-batch (or there is one).
fn micro_batch_parts(
    g: &Graph,
    local: Value,
    uses: &[Vec<(Node, usize)>],
) -> Option<(std::collections::BTreeMap<u32, Vec<Value>>, Vec<Node>)> {
    let mut parts: std::collections::BTreeMap<u32, Vec<Value>> = Default::default();
    let mut adds = Vec::new();
    let mut stack = vec![local];
    while let Some(v) = stack.pop() {
        let n = g.def(v);
        let d = g.node(n);
        let inner = v == local || uses[v.0 as usize].len() == 1;
        if matches!(d.op, Op::Add {})
            && made_by(g, n, AUTODIFF)
            && inner
            && d.meta.micro_batch.is_none()
        {
            adds.push(n);
            stack.extend(d.operands.iter().rev().copied());
        } else {
            parts.entry(d.meta.micro_batch?).or_default().push(v);
        }
    }
    (parts.len() > 1).then_some((parts, adds))
}

/// Writes ZeRO bucket `i`: each member flattened and laid out `[Z, chunk]`, one row
/// per rank of its [`ZeroSplit`] (a narrow rank's piece followed by zeros: padding in
/// the collective's buffer only), concatenated along the rows, so that the
/// `reduce_scatter` over the group leaves each rank the rows of every member, which it
/// cuts to exactly the pieces the sharded optimizer updates. With micro-batches, once per
/// micro-batch after its last contribution, the shards added. Returns the number of
/// collectives and the nodes of the replaced accumulation.
fn emit_scatter_bucket(
    g: &mut Graph,
    before: &Before,
    i: usize,
    b: &Bucket,
    shards_out: bool,
    zero3: bool,
) -> Result<(u64, Vec<Node>), PassError> {
    let what = bucket_name(i, b);
    let splits: Vec<ZeroSplit> = b
        .members
        .iter()
        .map(|s| member_split(g, s, &b.group, zero3).expect("checked split"))
        .collect();
    let chunks: Vec<i64> = splits.iter().map(ZeroSplit::chunk).collect();
    // The rounds: one per micro-batch when every member splits the same way.
    let split: Vec<_> = b
        .members
        .iter()
        .map(|s| micro_batch_parts(g, s.local, &before.uses))
        .collect();
    let same_rounds = split.iter().all(|p| {
        p.as_ref().map(|(m, _)| m.keys().collect::<Vec<_>>())
            == split[0].as_ref().map(|(m, _)| m.keys().collect::<Vec<_>>())
    });
    let mut dead = Vec::new();
    let rounds: Vec<(Option<u32>, Vec<Vec<Value>>)> = match (&split[0], same_rounds) {
        (Some((m0, _)), true) => {
            for p in split.iter().flatten() {
                dead.extend(p.1.iter().copied());
            }
            m0.keys()
                .map(|k| {
                    let leaves = split
                        .iter()
                        .map(|p| p.as_ref().unwrap().0[k].clone())
                        .collect();
                    (Some(*k), leaves)
                })
                .collect()
        }
        _ => vec![(None, b.members.iter().map(|s| vec![s.local]).collect())],
    };
    let mut collectives = 0;
    let mut shard: Option<Value> = None;
    let mut em_at = At::End;
    for (mb, leaves) in &rounds {
        let tag = mb
            .map(|m| format!(" [micro-batch {m}]"))
            .unwrap_or_default();
        let last = before.last_node(g, leaves.iter().flatten().copied());
        let mut em = Emitter {
            pass: NAME,
            at: At::After(last),
            meta: NodeMeta::default(),
            g,
        };
        let mut rows = Vec::new();
        for ((s, vs), split) in b.members.iter().zip(leaves).zip(&splits) {
            let mut v = vs[0];
            for &x in &vs[1..] {
                v = em.op(
                    Op::Add {},
                    &[v, x],
                    &format!("{what}{tag}: this micro-batch's gradient of {}", s.param()),
                )?;
            }
            v = em.rows_layout(split, v, &format!("{what}{tag}: {}", s.param()))?;
            v = em.flat_const(v, split.numel_dim(), &format!("{what}{tag}"))?;
            rows.push(em.split_rows(split, v, &format!("{what}{tag}"))?);
        }
        let flat = if rows.len() == 1 {
            rows[0]
        } else {
            em.op(
                Op::Concat { dim: 1 },
                &rows,
                &format!("{what}{tag}: coalesce, rank-major"),
            )?
        };
        let part = em.reduce_scatter(&b.group, flat, &format!("{what}{tag}"))?;
        collectives += b.group.axes.len() as u64;
        shard = Some(match shard {
            None => part,
            Some(acc) => em.op(
                Op::Add {},
                &[acc, part],
                &format!("{what}{tag}: accumulate the shard (reduce_scatter is linear)"),
            )?,
        });
        em_at = em.at;
    }
    let mut em = Emitter {
        pass: NAME,
        at: em_at,
        meta: NodeMeta::default(),
        g,
    };
    let mesh = em.g.mesh.clone();
    let shard = reduce_others(
        &mut em,
        b,
        &b.group,
        shard.expect("one round"),
        &what,
        &mesh,
        &mut collectives,
    )?;
    let chunk_dims: Vec<Dim> = chunks.iter().map(|c| Dim::from(*c)).collect();
    if shards_out {
        let parts = if b.members.len() == 1 {
            vec![shard]
        } else {
            em.ops(
                Op::Split {
                    dim: 0,
                    sizes: chunk_dims.clone(),
                },
                &[shard],
                &format!("{what}: each parameter's chunk"),
            )?
        };
        for ((s, p), split) in b.members.iter().zip(parts).zip(&splits) {
            let param = s.param();
            // The per-rank gradient shard (ValueRole::GradShard) the sharded optimizer
            // reads and removes: this rank's piece of the flattened gradient (its width
            // of the parameter's split over its ZeRO group, no padding).
            let p = em.own_piece(split, p, &format!("{what}: {param}"))?;
            let out = weft_ir::role::grad_shard_name(param);
            em.g.set_output(&out, p);
            let pparts = em.g.param_partition(param).to_vec();
            crate::zero::split_output(em.g, &out, &split.output_axes(&pparts));
        }
    }
    // ZeRO-3 parameters (rows of dim 0, or 1, per rank) return their gradient as those rows,
    // partitioned like the parameter; the others the whole gradient.
    let stage3: Vec<bool> = splits.iter().map(|s| s.rows).collect();
    if stage3.iter().any(|x| *x) {
        let parts = if b.members.len() == 1 {
            vec![shard]
        } else {
            em.ops(
                Op::Split {
                    dim: 0,
                    sizes: chunk_dims.clone(),
                },
                &[shard],
                &format!("{what}: each parameter's rows"),
            )?
        };
        for ((s, p), split) in b
            .members
            .iter()
            .zip(parts)
            .zip(&splits)
            .filter(|(_, x)| x.rows)
        {
            let mut shape = split.rows_view(&em.g.ty(s.local).shape);
            shape[0] = split.unit_width();
            let rows_what = format!("{what}: ZeRO-3 rows of {}", s.param());
            let p = em.own_piece(split, p, &rows_what)?;
            let v = em.unflat(p, &shape, &rows_what)?;
            let v = em.rows_layout(split, v, &rows_what)?;
            em.g.set_output(&s.output, v);
        }
        if stage3.iter().all(|x| *x) {
            return Ok((collectives, dead));
        }
    }
    // The whole gradients for the grad outputs.
    let whole = em.all_gather(&b.group, shard, &format!("{what}: the whole gradient for the grad outputs (the sharded optimizer reads the shard)"))?;
    let parts = if b.members.len() == 1 {
        vec![whole]
    } else {
        em.ops(
            Op::Split {
                dim: 1,
                sizes: chunk_dims,
            },
            &[whole],
            &format!("{what}: back to parameters"),
        )?
    };
    for ((s, p), split) in b
        .members
        .iter()
        .zip(parts)
        .zip(&splits)
        .filter(|(_, x)| !x.rows)
    {
        let t = em.g.ty(s.local).clone();
        let name = s.param();
        let v = em.join_rows(split, p, &format!("{what}: {name}"))?;
        let v = em.unflat(v, &t.shape, &format!("{what}: {name}"))?;
        em.g.set_output(&s.output, v);
    }
    Ok((collectives, dead))
}

/// The split of member `s`'s gradient over `group`: its parameter's ZeRO split (rows
/// at stage 3 when `group` is the parameter's own group), as the optimizer makes it.
fn member_split(g: &Graph, s: &Sync, group: &ZeroGroup, zero3: bool) -> Option<ZeroSplit> {
    let stage3 = zero3 && ZeroGroup::of_param(g, s.param()) == *group;
    crate::zero::param_split(&g.mesh, g.ty(s.local), group, stage3)
}

fn summarize(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [a] => a.to_string(),
        [a, .., z] => format!("{a} .. {z}"),
    }
}

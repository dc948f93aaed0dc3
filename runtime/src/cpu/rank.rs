//! One simulated rank: runs every node of the SPMD graph in program order with its own
//! coordinates bound, checks each result against its node's type, and meets the other
//! ranks in collectives.

use super::comm::{Comm, CommError};
use super::host::{kind, kind_of, values_i64, Kind};
use super::kernels::{self, Cx, KernelError};
use super::{Precision, RuntimeError};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;
use weft_ir::attrs::ReduceOp;
use weft_ir::shape::norm_dim;
use weft_ir::{Bindings, DType, Graph, Mesh, Node, Op};

/// What every rank shares: the graph, the full weights and inputs, the communicator.
pub(crate) struct Shared<'a> {
    pub graph: &'a Graph,
    pub mesh: &'a Mesh,
    /// `B`, `S`, other user symbols and every mesh axis size; no coordinates.
    pub bindings: &'a Bindings,
    pub precision: Precision,
    /// Gradients on, with a separate param replica (candle variable) per rank, so that
    /// each rank's gradient can be reported. Otherwise the ranks share one variable per
    /// param (its full tensor; split params are views of it), and candle's accumulation
    /// sums the replicas' gradients and puts split pieces in place.
    pub per_rank_vars: bool,
    /// Full (unsharded) params and inputs as candle tensors.
    pub params: &'a BTreeMap<String, Tensor>,
    pub inputs: &'a BTreeMap<String, Tensor>,
    /// How each param is split across ranks (absent: replicated).
    pub param_splits: &'a BTreeMap<String, Vec<(usize, String)>>,
    /// The process groups of each mesh axis.
    pub groups: &'a BTreeMap<String, Vec<Vec<u32>>>,
    /// For every value id, the program position of its last use (outputs: never freed).
    pub last_use: &'a [usize],
    pub comm: &'a Comm,
}

/// What a rank leaves behind.
pub(crate) struct RankOut {
    pub outputs: BTreeMap<String, Tensor>,
    /// The rank's param replicas (candle variables) when gradients are on.
    pub vars: BTreeMap<String, Tensor>,
    /// Seconds spent per op name (collectives include the wait for the group).
    pub op_seconds: BTreeMap<&'static str, (usize, f64)>,
}

/// `None`: the rank stopped because another failed.
pub(crate) type RankResult = Result<RankOut, Option<RuntimeError>>;

/// The bindings of `rank`: the shared ones plus its coordinate on every axis.
pub(crate) fn rank_bindings(sh: &Shared, rank: u32) -> Bindings {
    let mut b = sh.bindings.clone();
    for (i, (axis, _)) in sh.mesh.axes.iter().enumerate() {
        b.coords
            .insert(axis.clone(), sh.mesh.coords(rank)[i] as i64);
    }
    b
}

/// The part of a full param that `rank` holds: nested even splits, outermost first.
/// This is the hook where parameter sharding plugs in.
pub(crate) fn local_param(
    full: &Tensor,
    splits: &[(usize, String)],
    mesh: &Mesh,
    rank: u32,
) -> Result<Tensor, String> {
    let mut t = full.clone();
    for (dim, axis) in splits {
        let size = mesh
            .size(axis)
            .ok_or_else(|| format!("split over axis `{axis}`, which the mesh `{mesh}` lacks"))?
            as usize;
        let c = mesh.coord(rank, axis).unwrap_or(0) as usize;
        let n = *t
            .dims()
            .get(*dim)
            .ok_or_else(|| format!("split dim {dim} is out of range for {:?}", t.dims()))?;
        if n % size != 0 {
            return Err(format!(
                "dim {dim} of size {n} does not split evenly over `{axis}` ({size} ranks)"
            ));
        }
        t = t
            .narrow(*dim, c * (n / size), n / size)
            .map_err(|e| e.to_string())?;
    }
    Ok(t)
}

pub(crate) fn run_rank(sh: &Shared, rank: u32) -> RankResult {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_rank_inner(sh, rank)));
    let r = match r {
        Ok(r) => r,
        Err(p) => {
            let message = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Some(RuntimeError::Panic { rank, message }))
        }
    };
    if r.is_err() {
        sh.comm.abort();
    }
    r
}

fn run_rank_inner(sh: &Shared, rank: u32) -> RankResult {
    let g = sh.graph;
    let mut b = rank_bindings(sh, rank);
    let float = sh.precision.float_dtype();
    let mut vals: Vec<Option<Tensor>> = vec![None; g.value_capacity()];
    let mut vars: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut op_seconds: BTreeMap<&'static str, (usize, f64)> = BTreeMap::new();
    for (pos, &n) in g.nodes().iter().enumerate() {
        let started = std::time::Instant::now();
        if sh.comm.is_aborted() {
            return Err(None);
        }
        let node = g.node(n);
        let fail = |message: String| {
            Some(RuntimeError::Node {
                rank,
                node: g.describe(n),
                op: node.op.name(),
                message,
            })
        };
        // A data-dependent size (the rows an `all_to_all_v` receives) is bound on this
        // rank from the tensor the node produces; its result type is checked after.
        let binds = node
            .op
            .defined_symbol()
            .filter(|s| !b.symbols.contains_key(s));
        let mut out_types = Vec::with_capacity(node.results.len());
        if binds.is_none() {
            for v in &node.results {
                out_types.push((g.ty(*v).dtype, eval_shape(g.ty(*v), &b).map_err(fail)?));
            }
        }
        let mut ins = Vec::with_capacity(node.operands.len());
        for v in &node.operands {
            match vals.get(v.0 as usize).and_then(|t| t.clone()) {
                Some(t) => ins.push(t),
                None => {
                    return Err(fail(format!(
                        "operand {v} has no value (not computed before its use)"
                    )))
                }
            }
        }
        let outs: Vec<Tensor> = match &node.op {
            Op::Param { name, .. } => {
                if let Some(t) = vars.get(name) {
                    vec![t.clone()]
                } else {
                    let full = sh
                        .params
                        .get(name)
                        .ok_or_else(|| fail(format!("no weight for param `{name}`")))?;
                    let splits = sh
                        .param_splits
                        .get(name)
                        .map(|s| s.as_slice())
                        .unwrap_or(&[]);
                    let parts = g.param_partition(name);
                    let local = if parts.is_empty() {
                        local_param(full, splits, sh.mesh, rank)
                    } else {
                        super::partition::local_param(full, parts, sh.mesh, rank)
                    };
                    let local = local.map_err(|m| fail(format!("param `{name}`: {m}")))?;
                    let local = if sh.per_rank_vars {
                        let var =
                            Var::from_tensor(&local.detach()).map_err(|e| fail(e.to_string()))?;
                        let t = var.as_tensor().clone();
                        vars.insert(name.clone(), t.clone());
                        t
                    } else {
                        local
                    };
                    vec![local]
                }
            }
            Op::Input { name, .. } => {
                vec![sh
                    .inputs
                    .get(name)
                    .ok_or_else(|| fail(format!("no tensor for input `{name}`")))?
                    .clone()]
            }
            op if op.is_collective() => {
                vec![
                    collective(sh, rank, n, op, ins, &out_types).map_err(|e| match e {
                        CommError::Aborted => None,
                        CommError::Failed(m) => fail(m),
                    })?,
                ]
            }
            op => {
                let cx = Cx {
                    bindings: &b,
                    float,
                    out: &out_types,
                };
                kernels::eval(op, &ins, &cx).map_err(|KernelError(m)| fail(m))?
            }
        };
        if outs.len() != node.results.len() {
            return Err(fail(format!(
                "internal: {} results for {} values",
                outs.len(),
                node.results.len()
            )));
        }
        if let Some(s) = binds {
            b.symbols
                .insert(s, outs[0].dims().first().copied().unwrap_or(0) as i64);
            for v in &node.results {
                out_types.push((g.ty(*v).dtype, eval_shape(g.ty(*v), &b).map_err(fail)?));
            }
        }
        for (i, (t, (dtype, shape))) in outs.iter().zip(&out_types).enumerate() {
            check_result(t, *dtype, shape).map_err(|m| {
                let which = if outs.len() > 1 {
                    format!("result {i} ")
                } else {
                    String::new()
                };
                fail(format!("{which}{m} (type {})", g.ty(node.results[i])))
            })?;
        }
        for (v, t) in node.results.iter().zip(outs) {
            // a result nobody uses (and that is no output) is dropped at once
            if sh.last_use.get(v.0 as usize) != Some(&pos) {
                vals[v.0 as usize] = Some(t);
            }
        }
        let e = op_seconds.entry(node.op.name()).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += started.elapsed().as_secs_f64();
        for v in &node.operands {
            if sh.last_use.get(v.0 as usize) == Some(&pos) {
                vals[v.0 as usize] = None;
            }
        }
    }
    let mut outputs = BTreeMap::new();
    for (name, v) in g.outputs() {
        let t = vals
            .get(v.0 as usize)
            .and_then(|t| t.clone())
            .ok_or_else(|| {
                Some(RuntimeError::Output {
                    name: name.clone(),
                    message: format!("its value {v} was never computed"),
                })
            })?;
        outputs.insert(name.clone(), t);
    }
    Ok(RankOut {
        outputs,
        vars,
        op_seconds,
    })
}

/// A computed tensor must have the node's evaluated shape and the storage dtype of its kind.
fn check_result(t: &Tensor, dtype: DType, shape: &[usize]) -> Result<(), String> {
    if t.dims() != shape {
        return Err(format!(
            "computed shape {:?} but the node's type says {:?}",
            t.dims(),
            shape
        ));
    }
    if kind_of(t.dtype()) != kind(dtype) {
        return Err(format!(
            "computed a {:?} tensor for a {dtype} value",
            t.dtype()
        ));
    }
    Ok(())
}

/// The concrete shape of `ty` on this rank.
fn eval_shape(ty: &weft_ir::TensorType, b: &Bindings) -> Result<Vec<usize>, String> {
    let mut shape = Vec::with_capacity(ty.rank());
    for d in &ty.shape {
        let x = d
            .eval(b)
            .map_err(|e| format!("cannot evaluate the size `{d}` of its type {ty}: {e}"))?;
        if x < 0 {
            return Err(format!("the size `{d}` of its type {ty} is negative ({x})"));
        }
        shape.push(x as usize);
    }
    Ok(shape)
}

/// Tags the rendezvous key of a collective's second exchange (`all_to_all_v` trades
/// its send counts first, then the rows); node ids stay below it.
const SECOND_EXCHANGE: u32 = 1 << 31;

fn collective(
    sh: &Shared,
    rank: u32,
    n: Node,
    op: &Op,
    mut ins: Vec<Tensor>,
    out_types: &[(DType, Vec<usize>)],
) -> Result<Tensor, CommError> {
    let x = ins.remove(0);
    let axis = op.axis().expect("collectives have an axis");
    let groups = sh
        .groups
        .get(axis)
        .ok_or_else(|| CommError::Failed(format!("mesh `{}` has no axis `{axis}`", sh.mesh)))?;
    let (gi, group) = groups
        .iter()
        .enumerate()
        .find(|(_, g)| g.contains(&rank))
        .ok_or_else(|| {
            CommError::Failed(format!("internal: rank {rank} is in no group of `{axis}`"))
        })?;
    let size = group.len();
    let member = group
        .iter()
        .position(|&r| r == rank)
        .expect("rank is in its group");
    let rank_of = x.rank();
    let dim = |d: i64| norm_dim(d, rank_of).map_err(CommError::Failed);
    let err = |e: candle_core::Error| e.to_string();
    let key = (n.0, gi);
    match op {
        Op::AllReduce { op: rop, .. } => {
            let rop = *rop;
            sh.comm.exchange(key, member, size, x, move |xs| {
                let r = reduce(&xs, rop)?;
                Ok(vec![r; xs.len()])
            })
        }
        Op::AllGather { dim: d, .. } => {
            let d = dim(*d)?;
            sh.comm.exchange(key, member, size, x, move |xs| {
                let r = if xs.len() == 1 {
                    xs[0].clone()
                } else {
                    Tensor::cat(&xs, d).map_err(err)?
                };
                Ok(vec![r; xs.len()])
            })
        }
        Op::ReduceScatter {
            dim: d, op: rop, ..
        } => {
            let (d, rop) = (dim(*d)?, *rop);
            sh.comm.exchange(key, member, size, x, move |xs| {
                let r = reduce(&xs, rop)?;
                let len = r.dims()[d];
                if len % xs.len() != 0 {
                    return Err(format!(
                        "dim {d} of size {len} does not split evenly over the {} ranks of `{axis}`",
                        xs.len()
                    ));
                }
                let c = len / xs.len();
                (0..xs.len())
                    .map(|j| r.narrow(d, j * c, c).map_err(err))
                    .collect()
            })
        }
        Op::Broadcast { root, .. } => {
            let root = *root;
            if root < 0 || root as usize >= size {
                return Err(CommError::Failed(format!(
                    "root {root} is out of range for the {size} ranks of `{axis}`"
                )));
            }
            sh.comm.exchange(key, member, size, x, move |xs| {
                Ok(vec![xs[root as usize].clone(); xs.len()])
            })
        }
        Op::AllToAll {
            scatter_dim,
            gather_dim,
            ..
        } => {
            let (sd, gd) = (dim(*scatter_dim)?, dim(*gather_dim)?);
            let _ = out_types;
            sh.comm.exchange(key, member, size, x, move |xs| {
                let p = xs.len();
                // chunks[i][j]: member i's chunk for member j.
                let mut chunks: Vec<Vec<Tensor>> = Vec::with_capacity(p);
                for (i, t) in xs.iter().enumerate() {
                    let len = t.dims()[sd];
                    if len % p != 0 {
                        return Err(format!(
                            "member {i} of `{axis}` has {len} entries in scatter dim {sd}, not divisible by the {p} ranks \
                             (the IR gives no per-rank split sizes for all_to_all)"
                        ));
                    }
                    let c = len / p;
                    chunks.push((0..p).map(|j| t.narrow(sd, j * c, c).map_err(err)).collect::<Result<_, _>>()?);
                }
                (0..p)
                    .map(|j| {
                        let mine: Vec<&Tensor> = (0..p).map(|i| &chunks[i][j]).collect();
                        if p == 1 {
                            Ok(mine[0].clone())
                        } else {
                            Tensor::cat(&mine, gd).map_err(err)
                        }
                    })
                    .collect()
            })
        }
        Op::AllToAllV { .. } => {
            let counts = ins.pop().ok_or_else(|| {
                CommError::Failed("internal: all_to_all_v without send_counts".into())
            })?;
            let sends = values_i64(&counts).map_err(CommError::Failed)?;
            let rows = x.dims()[0];
            if sends.len() != size
                || sends.iter().any(|&c| c < 0)
                || sends.iter().sum::<i64>() != rows as i64
            {
                return Err(CommError::Failed(format!(
                    "send_counts {sends:?} must be {size} non-negative row counts (one per rank of `{axis}`) summing to the {rows} rows of x"
                )));
            }
            // Every member's send counts first, so the member that joins the rows knows them all.
            let all =
                sh.comm
                    .exchange((n.0 | SECOND_EXCHANGE, gi), member, size, counts, |xs| {
                        let t = Tensor::stack(&xs, 0).map_err(err)?;
                        Ok(vec![t; xs.len()])
                    })?;
            let all = values_i64(&all).map_err(CommError::Failed)?;
            sh.comm.exchange(key, member, size, x, move |xs| {
                let p = xs.len();
                // chunks[i][j]: member i's rows for member j (none when it sends none).
                let mut chunks: Vec<Vec<Option<Tensor>>> = Vec::with_capacity(p);
                for (i, t) in xs.iter().enumerate() {
                    let mut at = 0usize;
                    let mut row = Vec::with_capacity(p);
                    for j in 0..p {
                        let c = all[i * p + j] as usize;
                        row.push(if c == 0 {
                            None
                        } else {
                            Some(t.narrow(0, at, c).map_err(err)?)
                        });
                        at += c;
                    }
                    chunks.push(row);
                }
                (0..p)
                    .map(|j| {
                        let mine: Vec<&Tensor> =
                            (0..p).filter_map(|i| chunks[i][j].as_ref()).collect();
                        match mine.as_slice() {
                            [] => {
                                let mut shape = xs[0].dims().to_vec();
                                shape[0] = 0;
                                Tensor::zeros(shape, xs[0].dtype(), xs[0].device()).map_err(err)
                            }
                            [one] => Ok((*one).clone()),
                            _ => Tensor::cat(&mine, 0).map_err(err),
                        }
                    })
                    .collect()
            })
        }
        Op::RingShift { shift, .. } => {
            // Member j receives member (j - shift) mod p's tensor.
            let shift = *shift;
            sh.comm.exchange(key, member, size, x, move |xs| {
                let p = xs.len() as i64;
                Ok((0..p)
                    .map(|j| xs[(j - shift).rem_euclid(p) as usize].clone())
                    .collect())
            })
        }
        _ => Err(CommError::Failed(format!(
            "internal: `{}` is not a collective",
            op.name()
        ))),
    }
}

/// Reduces the members' tensors in member order (every rank gets bitwise the same).
fn reduce(xs: &[Tensor], op: ReduceOp) -> Result<Tensor, String> {
    let err = |e: candle_core::Error| e.to_string();
    for (i, t) in xs.iter().enumerate() {
        if t.dims() != xs[0].dims() {
            return Err(format!(
                "member {i} has shape {:?} but member 0 has {:?}",
                t.dims(),
                xs[0].dims()
            ));
        }
    }
    if op == ReduceOp::Avg && kind_of(xs[0].dtype()) != Kind::Float {
        return Err("`avg` needs a float tensor (an integer average is not defined)".into());
    }
    let mut acc = xs[0].clone();
    for t in &xs[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc.add(t),
            ReduceOp::Max => acc.maximum(t),
            ReduceOp::Min => acc.minimum(t),
        }
        .map_err(err)?;
    }
    if op == ReduceOp::Avg && xs.len() > 1 {
        acc = (acc / xs.len() as f64).map_err(err)?;
    }
    Ok(acc)
}

//! Which mesh axes each value varies over: the replication analysis SPMD autodiff
//! needs to transpose collectives and to know which gradients are partial.
//!
//! A value *varies* over axis `a` when ranks that differ only in their `a` coordinate
//! may hold different values; otherwise it is *replicated* over `a`. Inputs are given
//! whole to every rank (replicated); a `slice` at `@sp` makes its result vary over
//! `sp`; params vary over the axes of their partitions; `all_reduce`, `all_gather` and
//! `broadcast` over `a` make their result replicated over `a`; `reduce_scatter` and
//! `all_to_all` over `a` make it vary. Any other op varies where an operand does, or
//! where its attributes or result types mention a rank coordinate or a per-rank size.

use weft_ir::{Dim, Graph, Mesh, Op, Value};

/// A set of mesh axes, as bits in mesh order (bit i: `mesh.axes[i]`).
pub type Axes = u64;

/// The bit of `axis`, or 0 when the mesh lacks it.
pub fn bit(mesh: &Mesh, axis: &str) -> Axes {
    mesh.axes.iter().position(|(a, _)| a == axis).map(|i| 1u64 << i).unwrap_or(0)
}

/// The axes of a set, in mesh order.
pub fn names(mesh: &Mesh, axes: Axes) -> Vec<String> {
    mesh.axes.iter().enumerate().filter(|(i, _)| axes & (1 << i) != 0).map(|(_, (a, _))| a.clone()).collect()
}

/// The product of the axes' sizes.
pub fn size(mesh: &Mesh, axes: Axes) -> u64 {
    mesh.axes.iter().enumerate().filter(|(i, _)| axes & (1 << i) != 0).map(|(_, (_, n))| *n as u64).product()
}

/// Every axis of the mesh.
pub fn all(mesh: &Mesh) -> Axes {
    (0..mesh.axes.len()).fold(0, |m, i| m | (1 << i))
}

/// The dims an op's attributes hold (shapes, starts, lengths, sizes).
pub fn attr_dims(op: &Op) -> Vec<&Dim> {
    match op {
        Op::Param { ty, .. } | Op::Input { ty, .. } | Op::Full { ty, .. } => ty.shape.iter().collect(),
        Op::Arange { start, ty } => std::iter::once(start).chain(ty.shape.iter()).collect(),
        Op::Reshape { shape } | Op::Expand { shape } => shape.iter().collect(),
        Op::Slice { start, len, .. } => vec![start, len],
        Op::Split { sizes, .. } => sizes.iter().collect(),
        Op::EmbeddingGrad { num_embeddings } => vec![num_embeddings],
        Op::AllToAllV { rows, .. } => vec![rows],
        _ => vec![],
    }
}

fn dim_axes(mesh: &Mesh, d: &Dim) -> Axes {
    d.rank_axes().iter().fold(0, |m, a| m | bit(mesh, a))
}

/// For every value id, the axes it varies over (0 for ids that are not values).
pub fn varying(g: &Graph) -> Vec<Axes> {
    let mesh = &g.mesh;
    let mut out = vec![0 as Axes; g.value_capacity()];
    for &n in g.nodes() {
        let d = g.node(n);
        let ins: Axes = d.operands.iter().fold(0, |m, v| m | out.get(v.0 as usize).copied().unwrap_or(0));
        let mut mask = match &d.op {
            Op::Param { name, .. } => g.param_partition(name).iter().fold(0, |m, p| m | bit(mesh, &p.axis)),
            Op::Input { .. } => 0,
            Op::AllReduce { axis, .. } | Op::AllGather { axis, .. } | Op::Broadcast { axis, .. } => ins & !bit(mesh, axis),
            Op::ReduceScatter { axis, .. } | Op::AllToAll { axis, .. } | Op::AllToAllV { axis, .. } => ins | bit(mesh, axis),
            _ => ins,
        };
        if !d.op.is_collective() {
            for dim in attr_dims(&d.op) {
                mask |= dim_axes(mesh, dim);
            }
            for v in &d.results {
                for dim in &g.ty(*v).shape {
                    mask |= dim_axes(mesh, dim);
                }
            }
        }
        for v in &d.results {
            out[v.0 as usize] = mask;
        }
    }
    out
}

/// `varying` as a lookup that is 0 for values created after the analysis.
pub fn of(v: &[Axes], x: Value) -> Axes {
    v.get(x.0 as usize).copied().unwrap_or(0)
}

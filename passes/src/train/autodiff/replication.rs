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
//!
//! Axis sets are sets of *atoms*: without `ep` an atom is a mesh axis. The derived
//! axes `ep` and `edp` regroup the ranks of the others (see `weft_ir::mesh`), so the
//! product axis an ep group cuts is split into the part inside a group and the part
//! across groups, and every axis is a union of atoms: `dp=4,tp=2,ep=4` has atoms
//! dp/2 (across), dp%2 (inside), tp; dp = both dp atoms, ep = dp%2 + tp, edp = dp/2.
//! Sums over an axis set are then over disjoint axes covering it ([`names`]), never
//! over `dp` and `ep` both for the same ranks.

use weft_ir::{Dim, Graph, Mesh, Op, Value};

/// A set of atoms (mesh axes, or parts of one an ep group cuts), as bits.
pub type Axes = u64;

/// Every atom's size, and each mesh axis as a set of atoms (in mesh order).
fn atoms(mesh: &Mesh) -> (Vec<u64>, Vec<(String, Axes)>) {
    let Some((cut, inside)) = mesh.expert_cut() else {
        let sizes = mesh.axes.iter().map(|(_, n)| *n as u64).collect();
        return (
            sizes,
            mesh.axes
                .iter()
                .enumerate()
                .map(|(i, (a, _))| (a.clone(), 1 << i))
                .collect(),
        );
    };
    let product: Vec<&(String, u32)> = mesh
        .axes
        .iter()
        .filter(|(a, _)| !weft_ir::mesh::is_derived(a))
        .collect();
    let (mut sizes, mut axes, mut ep, mut edp) = (Vec::new(), Vec::new(), 0 as Axes, 0 as Axes);
    for (i, (a, n)) in product.iter().enumerate() {
        let mut mask = 0;
        let mut push = |size: u64, sizes: &mut Vec<u64>| {
            sizes.push(size);
            let b = 1 << (sizes.len() - 1);
            mask |= b;
            b
        };
        if i < cut {
            edp |= push(*n as u64, &mut sizes);
        } else if i > cut {
            ep |= push(*n as u64, &mut sizes);
        } else {
            let (across, within) = (*n / inside, inside);
            if across > 1 || within == 1 {
                edp |= push(across as u64, &mut sizes);
            }
            if within > 1 {
                ep |= push(within as u64, &mut sizes);
            }
        }
        axes.push((a.clone(), mask));
    }
    for (a, _) in &mesh.axes {
        match a.as_str() {
            weft_ir::mesh::EP => axes.push((a.clone(), ep)),
            weft_ir::mesh::EDP => axes.push((a.clone(), edp)),
            _ => {}
        }
    }
    (sizes, axes)
}

/// The atoms of `axis`, or 0 when the mesh lacks it.
pub fn bit(mesh: &Mesh, axis: &str) -> Axes {
    if mesh.size(weft_ir::mesh::EP).is_none() {
        return mesh
            .axes
            .iter()
            .position(|(a, _)| a == axis)
            .map(|i| 1u64 << i)
            .unwrap_or(0);
    }
    atoms(mesh)
        .1
        .into_iter()
        .find(|(a, _)| a == axis)
        .map(|(_, m)| m)
        .unwrap_or(0)
}

/// Disjoint mesh axes that make up a set of atoms, in mesh order: the fewest, and
/// those earliest in the mesh among equally few (`dp` before `edp`). Atoms no axis
/// set covers exactly are left out (no program the passes make needs one).
pub fn names(mesh: &Mesh, axes: Axes) -> Vec<String> {
    let (_, of) = atoms(mesh);
    let cands: Vec<(usize, Axes)> = of
        .iter()
        .enumerate()
        .filter(|(_, (_, m))| *m != 0 && m & !axes == 0)
        .map(|(i, (_, m))| (i, *m))
        .collect();
    fn best(
        cands: &[(usize, Axes)],
        left: Axes,
        pick: &mut Vec<usize>,
        out: &mut Option<Vec<usize>>,
    ) {
        if left == 0 {
            if out.as_ref().is_none_or(|o| pick.len() < o.len()) {
                *out = Some(pick.clone());
            }
            return;
        }
        for (k, &(i, m)) in cands.iter().enumerate() {
            if m & !left == 0 {
                pick.push(i);
                best(&cands[k + 1..], left & !m, pick, out);
                pick.pop();
            }
        }
    }
    let mut found = None;
    best(&cands, axes, &mut Vec::new(), &mut found);
    let mut picked = found.unwrap_or_else(|| {
        // No exact cover: the disjoint axes that fit, largest first.
        let (mut left, mut picked) = (axes, Vec::new());
        let mut by_size = cands.clone();
        by_size.sort_by_key(|(i, m)| (std::cmp::Reverse(m.count_ones()), *i));
        for (i, m) in by_size {
            if m & !left == 0 {
                left &= !m;
                picked.push(i);
            }
        }
        picked
    });
    picked.sort();
    picked.into_iter().map(|i| of[i].0.clone()).collect()
}

/// The number of ranks a set of atoms spans.
pub fn size(mesh: &Mesh, axes: Axes) -> u64 {
    let (sizes, _) = atoms(mesh);
    sizes
        .iter()
        .enumerate()
        .filter(|(i, _)| axes & (1 << i) != 0)
        .map(|(_, n)| *n)
        .product()
}

/// Every atom of the mesh.
pub fn all(mesh: &Mesh) -> Axes {
    (0..atoms(mesh).0.len()).fold(0, |m, i| m | (1 << i))
}

/// The dims an op's attributes hold (shapes, starts, lengths, sizes).
pub fn attr_dims(op: &Op) -> Vec<&Dim> {
    match op {
        Op::Param { ty, .. } | Op::Input { ty, .. } | Op::Full { ty, .. } => {
            ty.shape.iter().collect()
        }
        Op::Arange { start, ty } => std::iter::once(start).chain(ty.shape.iter()).collect(),
        Op::Reshape { shape } | Op::Expand { shape } => shape.iter().collect(),
        Op::Slice { start, len, .. } => vec![start, len],
        Op::Split { sizes, .. } => sizes.iter().collect(),
        Op::EmbeddingGrad {
            num_embeddings,
            padding_idx,
        } => std::iter::once(num_embeddings).chain(padding_idx).collect(),
        Op::Embedding { padding_idx } => padding_idx.iter().collect(),
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
        let ins: Axes = d
            .operands
            .iter()
            .fold(0, |m, v| m | out.get(v.0 as usize).copied().unwrap_or(0));
        let mut mask = match &d.op {
            Op::Param { name, .. } => g
                .param_partition(name)
                .iter()
                .fold(0, |m, p| p.axes.iter().fold(m, |m, a| m | bit(mesh, a))),
            Op::Input { .. } => 0,
            Op::AllReduce { axis, .. }
            | Op::AllGather { axis, .. }
            | Op::Broadcast { axis, .. } => ins & !bit(mesh, axis),
            Op::ReduceScatter { axis, .. }
            | Op::AllToAll { axis, .. }
            | Op::AllToAllV { axis, .. }
            | Op::RingShift { axis, .. }
            | Op::RingAttention { axis, .. }
            | Op::RingAttentionGrad { axis, .. } => ins | bit(mesh, axis),
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

//! Reshardable metadata: for every parameter of a compiled program, how its full
//! (checkpoint) tensor maps to each rank's shard, read off the graph's parameter
//! partitions; and the checkpoint operations built on it: cut a full checkpoint into
//! per-rank shards, put shards back together, and so reshard `tp=a` to `tp=b` exactly
//! (slicing and concatenation move values without arithmetic, so a round trip is
//! byte-identical).

use super::rewrite::GRAD_ALLREDUCE;
use std::collections::BTreeMap;
use weft_ir::{Bindings, Graph, HostData, HostTensor, Mesh, Partition};

/// One split of a parameter, as recorded by the pass that made it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PartitionLayout {
    /// `column`, `row`, `vocab`, `expert`, ...
    pub kind: String,
    /// The mesh axis, or a group of axes joined by `*` (`dp*sp`: their ranks
    /// flattened row-major, outermost first, one width per group rank).
    pub axis: String,
    /// The dim of the full tensor that is split.
    pub dim: usize,
    /// Full size of each sub-parameter along `dim` (one entry unless fused).
    pub sub_params: Vec<i64>,
    /// Each rank's shard size along `dim`, in coordinate order (group rank order).
    pub rank_sizes: Vec<i64>,
    /// For each sub-parameter, its width on every rank (the partition's pieces).
    pub sub_shard_widths: Vec<Vec<i64>>,
}

/// Everything needed to cut or rebuild one parameter.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamLayout {
    pub name: String,
    pub dtype: String,
    /// The full (checkpoint) shape.
    pub logical_shape: Vec<usize>,
    /// True when every rank holds all of it.
    pub replicated: bool,
    /// Splits, outermost first (empty when replicated).
    pub partitions: Vec<PartitionLayout>,
    /// Replicated, but read with split values: the ranks' gradients must be summed.
    pub grad_allreduce: bool,
    /// Other checkpoint names of this parameter (`lm_head.weight` of a tied embedding).
    pub tied_aliases: Vec<String>,
}

impl ParamLayout {
    fn partition(&self, i: usize) -> Result<Partition, String> {
        let p = &self.partitions[i];
        Ok(Partition {
            kind: p.kind.clone(),
            axes: weft_ir::partition::parse_axes(&p.axis)
                .map_err(|e| format!("param `{}`: {e}", self.name))?,
            dim: p.dim,
            pieces: p.sub_shard_widths.clone(),
        })
    }
}

/// The layout of every parameter of `g`, in program order. `tied` lists checkpoint
/// aliases as `(alias, param)`.
pub fn param_layouts(g: &Graph, tied: &[(String, String)]) -> Result<Vec<ParamLayout>, String> {
    let mut b = Bindings::new();
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64).with_coord(a, 0);
    }
    let mut out = Vec::new();
    for (name, v) in g.params() {
        let ty = g.ty(v);
        let parts = g.param_partition(&name);
        let mut shape = Vec::new();
        for (i, d) in ty.shape.iter().enumerate() {
            let split: Vec<&Partition> = parts.iter().filter(|p| p.dim == i).collect();
            let n = match split.first() {
                Some(p) => p.full_size(),
                None => d
                    .eval(&b)
                    .map_err(|e| format!("param `{name}`: dim {i} of {ty}: {e}"))?,
            };
            shape.push(n as usize);
        }
        let grad_allreduce = matches!(&g.node(g.def(v)).meta.provenance, Some(p) if p.reason.starts_with(GRAD_ALLREDUCE));
        out.push(ParamLayout {
            name: name.clone(),
            dtype: ty.dtype.name().to_string(),
            logical_shape: shape,
            replicated: parts.is_empty(),
            partitions: parts
                .iter()
                .map(|p| PartitionLayout {
                    kind: p.kind.clone(),
                    axis: p.axis_name(),
                    dim: p.dim,
                    sub_params: p.pieces.iter().map(|x| x.iter().sum()).collect(),
                    rank_sizes: p.shard_sizes(),
                    sub_shard_widths: p.pieces.clone(),
                })
                .collect(),
            grad_allreduce,
            tied_aliases: tied
                .iter()
                .filter(|(_, p)| *p == name)
                .map(|(a, _)| a.clone())
                .collect(),
        });
    }
    Ok(out)
}

/// The axes any parameter is split over, in mesh order, with their sizes.
pub fn shard_axes(layouts: &[ParamLayout], mesh: &Mesh) -> Vec<(String, u32)> {
    mesh.axes
        .iter()
        .filter(|(a, _)| {
            layouts.iter().any(|l| {
                l.partitions
                    .iter()
                    .any(|p| p.axis.split('*').any(|x| x == a))
            })
        })
        .cloned()
        .collect()
}

/// Every combination of coordinates of `axes`, row-major (the last axis fastest).
pub fn shard_coords(axes: &[(String, u32)]) -> Vec<Vec<u32>> {
    let mut out = vec![vec![]];
    for (_, n) in axes {
        out = out
            .into_iter()
            .flat_map(|c| (0..*n).map(move |i| [c.clone(), vec![i]].concat()))
            .collect();
    }
    out
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// For each dim, the full-tensor index of each shard index, after applying the
/// parameter's partitions at the given coordinates of the shard `axes` (a group
/// partition at the row-major index of those coordinates over its axes).
fn index_maps(
    l: &ParamLayout,
    coords: &BTreeMap<String, u32>,
    axes: &[(String, u32)],
) -> Result<Vec<Vec<usize>>, String> {
    let mut maps: Vec<Vec<usize>> = l.logical_shape.iter().map(|&n| (0..n).collect()).collect();
    for i in 0..l.partitions.len() {
        let p = l.partition(i)?;
        let c = p
            .coord_with(|a| {
                let n = axes.iter().find(|(x, _)| x == a)?.1;
                Some((*coords.get(a)?, n))
            })
            .map_err(|e| format!("param `{}`: {e}", l.name))?;
        let cur = &maps[p.dim];
        if p.full_size() as usize != cur.len() {
            return Err(format!(
                "param `{}`: partition of dim {} covers {} entries, the tensor has {}",
                l.name,
                p.dim,
                p.full_size(),
                cur.len()
            ));
        }
        let mut next = Vec::new();
        for (s, e) in p.ranges(c) {
            next.extend_from_slice(&cur[s as usize..e as usize]);
        }
        maps[p.dim] = next;
    }
    Ok(maps)
}

fn gather_elems(t: &HostTensor, maps: &[Vec<usize>]) -> HostTensor {
    let shape: Vec<usize> = maps.iter().map(|m| m.len()).collect();
    let st = strides(&t.shape);
    let n: usize = shape.iter().product();
    let mut idx = Vec::with_capacity(n);
    let mut cur = vec![0usize; shape.len()];
    for _ in 0..n {
        idx.push(
            cur.iter()
                .enumerate()
                .map(|(d, &i)| maps[d][i] * st[d])
                .sum::<usize>(),
        );
        for d in (0..shape.len()).rev() {
            cur[d] += 1;
            if cur[d] < shape[d] {
                break;
            }
            cur[d] = 0;
        }
    }
    let data = match &t.data {
        HostData::F64(v) => HostData::F64(idx.iter().map(|&i| v[i]).collect()),
        HostData::I64(v) => HostData::I64(idx.iter().map(|&i| v[i]).collect()),
        // A checkpoint's bytes stay in their dtype: the shard copies its elements.
        HostData::Raw(b) => {
            let es = t.dtype.size_bytes() as usize;
            let bytes = b.bytes();
            HostData::Raw(weft_ir::RawBytes::owned(
                idx.iter()
                    .flat_map(|&i| &bytes[i * es..(i + 1) * es])
                    .copied()
                    .collect(),
            ))
        }
    };
    HostTensor {
        dtype: t.dtype,
        shape,
        data,
    }
}

fn scatter_elems(
    full: &mut HostTensor,
    shard: &HostTensor,
    maps: &[Vec<usize>],
) -> Result<(), String> {
    let shape: Vec<usize> = maps.iter().map(|m| m.len()).collect();
    if shard.shape != shape {
        return Err(format!(
            "shard has shape {:?}, the layout says {:?}",
            shard.shape, shape
        ));
    }
    let shard = shard.widened();
    let shard = shard.as_ref();
    let st = strides(&full.shape);
    let mut cur = vec![0usize; shape.len()];
    for k in 0..shard.numel() {
        let i: usize = cur
            .iter()
            .enumerate()
            .map(|(d, &c)| maps[d][c] * st[d])
            .sum();
        match (&mut full.data, &shard.data) {
            (HostData::F64(f), HostData::F64(s)) => f[i] = s[k],
            (HostData::I64(f), HostData::I64(s)) => f[i] = s[k],
            _ => return Err("shard and full tensor differ in kind".into()),
        }
        for d in (0..shape.len()).rev() {
            cur[d] += 1;
            if cur[d] < shape[d] {
                break;
            }
            cur[d] = 0;
        }
    }
    Ok(())
}

/// Cuts a full checkpoint into one shard per coordinate combination of `axes` (see
/// [`shard_axes`], [`shard_coords`]). Tied aliases are not written (their parameter is).
pub fn shard_checkpoint(
    layouts: &[ParamLayout],
    full: &BTreeMap<String, HostTensor>,
    axes: &[(String, u32)],
) -> Result<Vec<BTreeMap<String, HostTensor>>, String> {
    let mut out = Vec::new();
    for cs in shard_coords(axes) {
        let coords: BTreeMap<String, u32> = axes.iter().map(|(a, _)| a.clone()).zip(cs).collect();
        let mut shard = BTreeMap::new();
        for l in layouts {
            let t = full
                .get(&l.name)
                .or_else(|| l.tied_aliases.iter().find_map(|a| full.get(a)))
                .ok_or_else(|| format!("the checkpoint has no `{}`", l.name))?;
            if t.shape != l.logical_shape {
                return Err(format!(
                    "`{}` has shape {:?} in the checkpoint, the program's layout says {:?}",
                    l.name, t.shape, l.logical_shape
                ));
            }
            let maps = index_maps(l, &coords, axes)?;
            shard.insert(
                l.name.clone(),
                if l.replicated {
                    t.clone()
                } else {
                    gather_elems(t, &maps)
                },
            );
        }
        out.push(shard);
    }
    Ok(out)
}

/// The most elements one parameter of a layout may have (2^40): checked before a full
/// tensor is allocated for it.
pub const MAX_LAYOUT_ELEMENTS: u64 = 1 << 40;

/// Checks layouts read from a file before anything is indexed or allocated by them:
/// at least one parameter; shard axes of positive sizes whose product is at most
/// [`weft_ir::mesh::MAX_RANKS`]; each split names one of those axes, a dim inside the
/// shape, pieces of one length per rank (that axis's size), non-negative, covering
/// the dim exactly; and each shape at most [`MAX_LAYOUT_ELEMENTS`] elements.
pub fn validate_layouts(layouts: &[ParamLayout], axes: &[(String, u32)]) -> Result<(), String> {
    if layouts.is_empty() {
        return Err("the layout lists no parameters".into());
    }
    let mut world: u64 = 1;
    for (a, n) in axes {
        if *n == 0 {
            return Err(format!("shard axis `{a}` has size 0"));
        }
        world = world.saturating_mul(*n as u64);
    }
    if world > weft_ir::mesh::MAX_RANKS {
        return Err(format!(
            "the shard axes make {world} shards (at most {})",
            weft_ir::mesh::MAX_RANKS
        ));
    }
    for l in layouts {
        let numel = l
            .logical_shape
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n as u64))
            .filter(|&n| n <= MAX_LAYOUT_ELEMENTS);
        if numel.is_none() {
            return Err(format!(
                "param `{}` has shape {:?}, more than {MAX_LAYOUT_ELEMENTS} elements",
                l.name, l.logical_shape
            ));
        }
        if l.replicated != l.partitions.is_empty() {
            return Err(format!(
                "param `{}` says replicated={} but lists {} splits",
                l.name,
                l.replicated,
                l.partitions.len()
            ));
        }
        // A later split of a dim cuts each shard of the earlier one (ZeRO's split of a
        // tp shard): it covers the size that split leaves, equal on every rank.
        let mut current: Vec<Option<i64>> =
            l.logical_shape.iter().map(|&n| Some(n as i64)).collect();
        for p in &l.partitions {
            // A group of axes (`dp*sp`) holds the product of their sizes in ranks.
            let group = weft_ir::partition::parse_axes(&p.axis)
                .map_err(|e| format!("param `{}`: {e}", l.name))?;
            let mut n = 1u32;
            for a in &group {
                let Some((_, k)) = axes.iter().find(|(x, _)| x == a) else {
                    return Err(format!(
                        "param `{}` is split over `{a}`, which is not a shard axis",
                        l.name
                    ));
                };
                n = n.saturating_mul(*k);
            }
            let n = &n;
            if p.dim >= l.logical_shape.len() {
                return Err(format!(
                    "param `{}`: split dim {} is out of range for shape {:?}",
                    l.name, p.dim, l.logical_shape
                ));
            }
            if p.sub_shard_widths.is_empty()
                || p.sub_shard_widths.iter().any(|w| w.len() != *n as usize)
            {
                return Err(format!(
                    "param `{}`: the split over `{}` must list {n} widths per piece",
                    l.name, p.axis
                ));
            }
            if p.sub_shard_widths.iter().flatten().any(|&w| w < 0) {
                return Err(format!("param `{}`: a negative shard width", l.name));
            }
            let covered = p
                .sub_shard_widths
                .iter()
                .flatten()
                .try_fold(0i64, |acc, &w| acc.checked_add(w));
            let want = current[p.dim];
            if covered.is_none() || covered != want {
                return Err(format!(
                    "param `{}`: the split of dim {} covers {:?} entries, the shape has {}{}",
                    l.name,
                    p.dim,
                    covered,
                    l.logical_shape[p.dim],
                    match want {
                        Some(w) if w != l.logical_shape[p.dim] as i64 =>
                            format!(" ({w} in each shard of the splits before it)"),
                        _ => String::new(),
                    }
                ));
            }
            let sizes: Vec<i64> = (0..*n as usize)
                .map(|r| p.sub_shard_widths.iter().map(|w| w[r]).sum())
                .collect();
            current[p.dim] = sizes.iter().all(|&x| x == sizes[0]).then_some(sizes[0]);
        }
    }
    Ok(())
}

/// Puts shards (in [`shard_coords`] order) back into the full checkpoint, after
/// [`validate_layouts`]. Replicated parameters must agree on every shard.
pub fn unshard_checkpoint(
    layouts: &[ParamLayout],
    shards: &[BTreeMap<String, HostTensor>],
    axes: &[(String, u32)],
) -> Result<BTreeMap<String, HostTensor>, String> {
    validate_layouts(layouts, axes)?;
    let all = shard_coords(axes);
    if all.len() != shards.len() {
        return Err(format!(
            "{} shards for {} coordinate combinations",
            shards.len(),
            all.len()
        ));
    }
    let mut out = BTreeMap::new();
    for l in layouts {
        let first = shards[0]
            .get(&l.name)
            .ok_or_else(|| format!("shard 0 has no `{}`", l.name))?;
        if l.replicated {
            let want = first.digest();
            for (k, shard) in shards.iter().enumerate().skip(1) {
                if shard.get(&l.name).map(HostTensor::digest) != Some(want.clone()) {
                    return Err(format!(
                        "`{}` is replicated, but shard {k} holds a different copy than shard 0 (or none)",
                        l.name
                    ));
                }
            }
            out.insert(l.name.clone(), first.clone());
            continue;
        }
        let n: usize = l.logical_shape.iter().product();
        let data = if first.dtype.is_float() {
            HostData::F64(vec![0.0; n])
        } else {
            HostData::I64(vec![0; n])
        };
        let mut full = HostTensor {
            dtype: first.dtype,
            shape: l.logical_shape.clone(),
            data,
        };
        for (cs, shard) in all.iter().zip(shards) {
            let coords: BTreeMap<String, u32> = axes
                .iter()
                .map(|(a, _)| a.clone())
                .zip(cs.iter().copied())
                .collect();
            let maps = index_maps(l, &coords, axes)?;
            let t = shard
                .get(&l.name)
                .ok_or_else(|| format!("a shard has no `{}`", l.name))?;
            scatter_elems(&mut full, t, &maps).map_err(|e| format!("`{}`: {e}", l.name))?;
        }
        out.insert(l.name.clone(), full);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(pieces: Vec<Vec<i64>>, shape: Vec<usize>, dim: usize) -> ParamLayout {
        ParamLayout {
            name: "w".into(),
            dtype: "f32".into(),
            logical_shape: shape,
            replicated: false,
            partitions: vec![PartitionLayout {
                kind: "column".into(),
                axis: "tp".into(),
                dim,
                sub_params: pieces.iter().map(|p| p.iter().sum()).collect(),
                rank_sizes: vec![],
                sub_shard_widths: pieces,
            }],
            grad_allreduce: false,
            tied_aliases: vec![],
        }
    }

    #[test]
    fn fused_shards_round_trip() {
        // q 4 rows, k 2, v 2 over 2 ranks, 3 columns.
        let l = layout(vec![vec![2, 2], vec![1, 1], vec![1, 1]], vec![8, 3], 0);
        let full: BTreeMap<String, HostTensor> = [(
            "w".to_string(),
            HostTensor::floats(
                weft_ir::DType::F32,
                vec![8, 3],
                (0..24).map(|x| x as f64).collect(),
            ),
        )]
        .into();
        let axes = vec![("tp".to_string(), 2)];
        let shards = shard_checkpoint(std::slice::from_ref(&l), &full, &axes).unwrap();
        assert_eq!(
            shards[1]["w"].to_f64(),
            vec![6., 7., 8., 9., 10., 11., 15., 16., 17., 21., 22., 23.]
        );
        assert_eq!(unshard_checkpoint(&[l], &shards, &axes).unwrap(), full);
    }
}

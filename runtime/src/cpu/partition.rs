//! Parameters split by the graph's partition metadata (`Graph::param_partitions`):
//! each rank's shard is cut from the full weight (fused sub-parameters concatenated
//! in order, nested partitions applied outermost first, a group partition by the rank's
//! row-major index over its axes), and a shard's gradient is put back in place (added,
//! so replicas on axes the parameter is not split over sum).

use candle_core::Tensor;
use weft_ir::{Mesh, Partition};

/// For each dim of the full tensor, the full index of every shard index on `rank`.
pub(crate) fn index_maps(
    shape: &[usize],
    parts: &[Partition],
    mesh: &Mesh,
    rank: u32,
) -> Result<Vec<Vec<usize>>, String> {
    let mut maps: Vec<Vec<usize>> = shape.iter().map(|&n| (0..n).collect()).collect();
    for p in parts {
        // One axis's coordinate, or the rank's row-major index in a group of axes.
        let c = p.coord_on(mesh, rank)?;
        let cur = maps
            .get(p.dim)
            .ok_or_else(|| format!("split dim {} is out of range for {shape:?}", p.dim))?;
        if p.full_size() as usize != cur.len() || c >= p.ranks() {
            return Err(format!(
                "partition `{p}` does not fit dim {} of size {} (rank coordinate {c})",
                p.dim,
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

/// Contiguous runs `(start, len)` of an index map.
fn runs(map: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &i in map {
        match out.last_mut() {
            Some((s, l)) if *s + *l == i => *l += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

/// The shard of `rank`: narrows (and concatenations of fused pieces) of `full`, so the
/// autograd graph leads back to `full`.
pub(crate) fn local_param(
    full: &Tensor,
    parts: &[Partition],
    mesh: &Mesh,
    rank: u32,
) -> Result<Tensor, String> {
    let maps = index_maps(full.dims(), parts, mesh, rank)?;
    let mut t = full.clone();
    for (d, m) in maps.iter().enumerate() {
        if m.len() == full.dims()[d] && m.iter().enumerate().all(|(i, &x)| i == x) {
            continue;
        }
        let pieces: Vec<Tensor> = runs(m)
            .into_iter()
            .map(|(s, l)| t.narrow(d, s, l))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        t = if pieces.len() == 1 {
            pieces.into_iter().next().expect("one piece")
        } else {
            Tensor::cat(&pieces, d).map_err(|e| e.to_string())?
        };
    }
    Ok(t)
}

/// `acc[maps(i)] += block[i]` for `rank`'s shard gradient `block` of shape `bshape`.
pub(crate) fn add_shard(
    acc: &mut [f64],
    shape: &[usize],
    block: &[f64],
    bshape: &[usize],
    parts: &[Partition],
    mesh: &Mesh,
    rank: u32,
) -> Result<(), String> {
    let maps = index_maps(shape, parts, mesh, rank)?;
    let want: Vec<usize> = maps.iter().map(|m| m.len()).collect();
    if want != bshape {
        return Err(format!(
            "a shard gradient has shape {bshape:?} but the partition gives {want:?}"
        ));
    }
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let mut cur = vec![0usize; bshape.len()];
    for v in block {
        let i: usize = cur
            .iter()
            .enumerate()
            .map(|(d, &c)| maps[d][c] * strides[d])
            .sum();
        acc[i] += v;
        for d in (0..bshape.len()).rev() {
            cur[d] += 1;
            if cur[d] < bshape[d] {
                break;
            }
            cur[d] = 0;
        }
    }
    Ok(())
}

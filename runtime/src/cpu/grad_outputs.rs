//! Gradient (and update and optimizer state) outputs of partitioned parameters. `autodiff` returns `grad.<param>` for
//! a parameter split by the graph's partition metadata as that parameter's shard on
//! every rank (no gather: real training never needs the whole gradient in one place);
//! the full gradient is assembled here the way the full weight is cut, fused
//! sub-parameters and uneven shards included. Ranks that differ only on axes the
//! parameter is not split over hold the same shard, checked when `check_replicas` is on.

use super::host::values_f64;
use super::partition::add_shard;
use super::rank::{RankOut, Shared};
use super::{Precision, RunOptions};
use candle_core::{Device, Tensor};

/// `Some(full tensor)` when output `name` is a partitioned parameter's gradient or
/// update (shaped and split like the parameter it names) or state (an output named like
/// a partitioned parameter itself, assembled by that parameter's partition) returned as
/// each rank's shard.
pub(crate) fn assemble_param_grad(
    sh: &Shared,
    opts: &RunOptions,
    name: &str,
    ranks: &[RankOut],
) -> Option<Result<Tensor, String>> {
    if !sh.graph.output_split(name).is_empty() {
        return None;
    }
    let param_like = match weft_ir::ValueName::parse(name) {
        weft_ir::ValueName::Grad(p) | weft_ir::ValueName::UpdatedParam(p) => Some(p),
        _ => None,
    };
    let candidates = std::iter::once(name).chain(param_like);
    let param = candidates
        .into_iter()
        .find(|p| !sh.graph.param_partition(p).is_empty() && sh.params.contains_key(*p))?;
    Some(assemble(sh, opts, name, param, ranks))
}

fn assemble(
    sh: &Shared,
    opts: &RunOptions,
    name: &str,
    param: &str,
    ranks: &[RankOut],
) -> Result<Tensor, String> {
    let full = sh
        .params
        .get(param)
        .ok_or_else(|| format!("is the gradient of param `{param}`, which has no weight"))?;
    let shape = full.dims().to_vec();
    let parts = sh.graph.param_partition(param);
    let mesh = sh.mesh;
    let split_axes: Vec<&str> = parts
        .iter()
        .flat_map(|p| p.axes.iter().map(String::as_str))
        .collect();
    let mut acc = vec![0.0f64; full.elem_count()];
    let tol = match sh.precision {
        Precision::F32 => 1e-4,
        Precision::F64 => 1e-10,
    };
    for (r, ro) in ranks.iter().enumerate() {
        let r = r as u32;
        let t = ro
            .outputs
            .get(name)
            .ok_or_else(|| format!("rank {r} has no value for it"))?;
        // The representative of this shard: the first rank with the same coordinates on
        // the split axes (derived ones such as `ep` included).
        let fixed: Vec<(&str, u32)> = split_axes
            .iter()
            .map(|a| (*a, mesh.coord(r, a).unwrap_or(0)))
            .collect();
        let rep = mesh.rank_with(&fixed).unwrap_or(r);
        if rep == r {
            let v = values_f64(t)?;
            add_shard(&mut acc, &shape, &v, t.dims(), parts, mesh, r)?;
        } else if opts.check_replicas {
            let (a, b) = (
                values_f64(&ranks[rep as usize].outputs[name])?,
                values_f64(t)?,
            );
            let scale = a.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            if a.len() != b.len() || a.iter().zip(&b).any(|(x, y)| (x - y).abs() > tol * scale) {
                return Err(format!(
                    "rank {r} holds a different shard than rank {rep}, though they differ only on axes `{param}` is not split over (a missing gradient reduction?)"
                ));
            }
        }
    }
    Tensor::from_vec(acc, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(sh.precision.float_dtype()))
        .map_err(|e| e.to_string())
}

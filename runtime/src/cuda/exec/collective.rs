//! Lowering of collectives to NCCL steps on the op's mesh axis: all-reduce, all-gather
//! and reduce-scatter (along an inner dim through a strided unpack or pack around
//! NCCL's member-major blocks), broadcast, and the point-to-point exchanges
//! (`all_to_all` as grouped sends and receives between a packing and an unpacking
//! strided copy, `ring_shift` as one send and one receive). On one rank an op NCCL has
//! no call for is a copy.

use super::*;

/// One collective step for `op`.
pub(super) fn lower_collective(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
    world: u32,
    axis_size: usize,
) -> CudaResult<()> {
    let axis = op.axis().unwrap_or_default().to_string();
    let (x, o) = (&ins[0], &outs[0]);
    let dtype = x.dtype;
    let coll = match op {
        Op::AllReduce { op, .. } => Coll::AllReduce { op: *op },
        Op::AllGather { dim, .. } => {
            let d = norm(*dim, x.rank())?;
            if let Some(unpack) = gather_unpack(&x.shape, d, axis_size) {
                // NCCL lands the members' operands one after another; lay them out
                // along `dim`.
                let landing = lw.ex.scratch(lw.stream, o.bytes());
                lw.push(StepKind::Collective {
                    coll: Coll::AllGather,
                    axis,
                    send: x.ptr,
                    recv: landing,
                    count: x.numel(),
                    dtype,
                });
                let es = esz(dtype);
                return lw.strided(
                    o.ptr,
                    landing,
                    es,
                    &unpack.shape,
                    &unpack.src,
                    &layout::strides(&unpack.shape),
                );
            }
            Coll::AllGather
        }
        Op::ReduceScatter { op, dim, .. } => {
            let d = norm(*dim, x.rank())?;
            let pack =
                scatter_pack(&x.shape, d, axis_size).map_err(|m| lw.unsup("reduce_scatter", &m))?;
            if let Some(pack) = pack {
                // NCCL reduces member j's chunk from the j-th contiguous block: lay the
                // chunks of `dim` out as blocks first.
                let stage = lw.ex.scratch(lw.stream, x.bytes());
                lw.strided(
                    stage,
                    x.ptr,
                    esz(dtype),
                    &pack.shape,
                    &pack.src,
                    &layout::strides(&pack.shape),
                )?;
                lw.push(StepKind::Collective {
                    coll: Coll::ReduceScatter { op: *op },
                    axis,
                    send: stage,
                    recv: o.ptr,
                    count: o.numel(),
                    dtype,
                });
                return Ok(());
            }
            Coll::ReduceScatter { op: *op }
        }
        Op::Broadcast { root, .. } => Coll::Broadcast { root: *root as i32 },
        Op::RingShift { shift, .. } => Coll::Exchange(comm::Exchange::Shift(*shift)),
        Op::AllToAll {
            scatter_dim,
            gather_dim,
            ..
        } if axis_size > 1 => {
            let (sd, gd) = (norm(*scatter_dim, x.rank())?, norm(*gather_dim, x.rank())?);
            let plan = all_to_all_layout(&x.shape, sd, gd, axis_size)
                .map_err(|m| lw.unsup("all_to_all", &m))?;
            let es = esz(dtype);
            let staged = match &plan.pack {
                Some(c) => {
                    let stage = lw.ex.scratch(lw.stream, x.bytes());
                    lw.strided(
                        stage,
                        x.ptr,
                        es,
                        &c.shape,
                        &c.src,
                        &layout::strides(&c.shape),
                    )?;
                    stage
                }
                None => x.ptr,
            };
            let landing = if plan.unpack.is_some() {
                lw.ex.scratch(lw.stream, o.bytes())
            } else {
                o.ptr
            };
            lw.push(StepKind::Collective {
                coll: Coll::Exchange(comm::Exchange::AllToAll),
                axis,
                send: staged,
                recv: landing,
                count: x.numel(),
                dtype,
            });
            if let Some(c) = &plan.unpack {
                lw.strided(
                    o.ptr,
                    landing,
                    es,
                    &c.shape,
                    &c.src,
                    &layout::strides(&c.shape),
                )?;
            }
            return Ok(());
        }
        other => {
            if world == 1 && x.bytes() == o.bytes() {
                lw.copy(o.ptr, x.ptr, o.bytes());
                return Ok(());
            }
            return Err(lw.unsup(other.name(), "not written for several ranks yet"));
        }
    };
    let count = match coll {
        Coll::ReduceScatter { .. } => o.numel(),
        _ => x.numel(),
    };
    lw.push(StepKind::Collective {
        coll,
        axis,
        send: x.ptr,
        recv: o.ptr,
        count,
        dtype,
    });
    Ok(())
}

/// A strided copy into a contiguous buffer: the destination's `shape` and, per dim,
/// the source's element stride.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Gather4 {
    pub(super) shape: Vec<usize>,
    pub(super) src: Vec<i64>,
}

/// How an `all_to_all` of `shape` over `p` members moves through NCCL, which sends
/// contiguous runs: `pack` lays chunk `j` (of the scatter dim) out as the `j`-th
/// contiguous block (none where the dims before the scatter dim are all 1), and
/// `unpack` lays the received blocks, one per member in member order, out along the
/// gather dim (none where the dims before it are all 1: the blocks land in place).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct AllToAllLayout {
    pub(super) pack: Option<Gather4>,
    pub(super) unpack: Option<Gather4>,
}

pub(super) fn all_to_all_layout(
    shape: &[usize],
    sd: usize,
    gd: usize,
    p: usize,
) -> Result<AllToAllLayout, String> {
    if sd >= shape.len() || gd >= shape.len() {
        return Err(format!("dims {sd}/{gd} out of range for shape {shape:?}"));
    }
    if p == 0 || shape[sd] % p != 0 {
        return Err(format!(
            "scatter dim {sd} of {shape:?} does not divide over {p} ranks"
        ));
    }
    let prod = |d: &[usize]| d.iter().product::<usize>();
    let c = shape[sd] / p;
    let (pre, post) = (prod(&shape[..sd]), prod(&shape[sd + 1..]));
    let pack = (pre > 1).then(|| chunks_to_blocks(pre, p, c, post));
    let mut chunk = shape.to_vec();
    chunk[sd] = c;
    let (pre2, g, post2) = (prod(&chunk[..gd]), chunk[gd], prod(&chunk[gd + 1..]));
    let unpack = (pre2 > 1).then(|| blocks_to_chunks(pre2, p, g, post2));
    Ok(AllToAllLayout { pack, unpack })
}

/// `[pre, p, c, post]` -> `[p, pre, c, post]`: member `j`'s chunk of a dim becomes the
/// `j`-th contiguous block, as NCCL sends (all_to_all) and reduces (reduce_scatter) it.
fn chunks_to_blocks(pre: usize, p: usize, c: usize, post: usize) -> Gather4 {
    Gather4 {
        shape: vec![p, pre, c, post],
        src: vec![(c * post) as i64, (p * c * post) as i64, post as i64, 1],
    }
}

/// `[p, pre, g, post]` -> `[pre, p, g, post]`: the blocks NCCL lands member after member
/// (all_to_all, all_gather) laid out along a dim.
fn blocks_to_chunks(pre: usize, p: usize, g: usize, post: usize) -> Gather4 {
    Gather4 {
        shape: vec![pre, p, g, post],
        src: vec![(g * post) as i64, (pre * g * post) as i64, post as i64, 1],
    }
}

/// The unpack of an `all_gather` of `shape` along `dim` over `p` members: NCCL lands
/// the operands member after member (`[p, pre, g, post]`), the result is
/// `[pre, p * g, post]`. `None` where the dims before `dim` are all 1 (the blocks land
/// in place) or there is one member.
pub(super) fn gather_unpack(shape: &[usize], dim: usize, p: usize) -> Option<Gather4> {
    let pre: usize = shape[..dim].iter().product();
    let (g, post) = (shape[dim], shape[dim + 1..].iter().product::<usize>());
    (pre > 1 && p > 1).then(|| blocks_to_chunks(pre, p, g, post))
}

/// The pack of a `reduce_scatter` of `shape` along `dim` over `p` members: member `j`'s
/// chunk of `dim` becomes the `j`-th contiguous block (`[pre, p, c, post]` ->
/// `[p, pre, c, post]`), as NCCL reduces it. `None` where the dims before `dim` are all
/// 1 or there is one member.
pub(super) fn scatter_pack(
    shape: &[usize],
    dim: usize,
    p: usize,
) -> Result<Option<Gather4>, String> {
    let pre: usize = shape[..dim].iter().product();
    if pre <= 1 || p <= 1 {
        return Ok(None);
    }
    if shape[dim] % p != 0 {
        return Err(format!(
            "dim {dim} of {shape:?} does not divide over {p} members"
        ));
    }
    let (c, post) = (shape[dim] / p, shape[dim + 1..].iter().product::<usize>());
    Ok(Some(chunks_to_blocks(pre, p, c, post)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::comm::{transfers, Exchange};

    fn gather(src: &[f32], g: &Gather4) -> Vec<f32> {
        let n: usize = g.shape.iter().product();
        (0..n)
            .map(|flat| {
                let (mut rest, mut at) = (flat, 0i64);
                for d in (0..4).rev() {
                    at += (rest % g.shape[d]) as i64 * g.src[d];
                    rest /= g.shape[d];
                }
                src[at as usize]
            })
            .collect()
    }

    fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = flat % shape[d];
            flat /= shape[d];
        }
        idx
    }

    fn ravel(idx: &[usize], shape: &[usize]) -> usize {
        idx.iter().zip(shape).fold(0, |a, (&i, &n)| a * n + i)
    }

    /// Packing, NCCL's sends and receives, and unpacking give every member what the CPU
    /// reference's all_to_all gives (member i's chunk j of the scatter dim becomes block
    /// i of member j's gather dim), for every pair of dims, including equal ones.
    #[test]
    fn all_to_all_through_contiguous_sends_is_the_reference() {
        let shape = [2usize, 6, 3, 4];
        let n: usize = shape.iter().product();
        for p in [1usize, 2, 3] {
            for sd in 0..4 {
                if shape[sd] % p != 0 {
                    continue;
                }
                for gd in 0..4 {
                    let lay = all_to_all_layout(&shape, sd, gd, p).unwrap();
                    let xs: Vec<Vec<f32>> = (0..p)
                        .map(|m| (0..n).map(|i| (m * n + i) as f32).collect())
                        .collect();
                    let staged: Vec<Vec<f32>> = xs
                        .iter()
                        .map(|x| lay.pack.as_ref().map_or(x.clone(), |g| gather(x, g)))
                        .collect();
                    let mut landed = vec![vec![0f32; n]; p];
                    for (me, st) in staged.iter().enumerate() {
                        for s in transfers(Exchange::AllToAll, me, p, n).0 {
                            let (_, recvs) = transfers(Exchange::AllToAll, s.peer, p, n);
                            let r = recvs.iter().find(|t| t.peer == me).unwrap();
                            landed[s.peer][r.offset..r.offset + r.count]
                                .copy_from_slice(&st[s.offset..s.offset + s.count]);
                        }
                    }
                    let c = shape[sd] / p;
                    let mut chunk = shape.to_vec();
                    chunk[sd] = c;
                    let mut oshape = chunk.clone();
                    oshape[gd] *= p;
                    for (j, l) in landed.iter().enumerate() {
                        let out = lay.unpack.as_ref().map_or(l.clone(), |g| gather(l, g));
                        for (flat, &got) in out.iter().enumerate() {
                            let mut idx = unravel(flat, &oshape);
                            let i = idx[gd] / chunk[gd];
                            idx[gd] %= chunk[gd];
                            idx[sd] += j * c;
                            let want = xs[i][ravel(&idx, &shape)];
                            assert_eq!(got, want, "p {p} sd {sd} gd {gd} member {j} at {flat}");
                        }
                    }
                }
            }
        }
    }

    /// An all_gather along an inner dim (NCCL's member-major landing, then the unpack)
    /// and a reduce_scatter along one (the pack, then NCCL's block-j-to-member-j sum)
    /// give the CPU reference's results: members' operands concatenated along `dim`,
    /// and member j's chunk of `dim` of the sum.
    #[test]
    fn inner_dim_gather_and_scatter_are_the_reference() {
        let shape = [2usize, 3, 4, 2];
        let n: usize = shape.iter().product();
        for p in [1usize, 2, 3] {
            let xs: Vec<Vec<f32>> = (0..p)
                .map(|m| (0..n).map(|i| (m * 1000 + i) as f32).collect())
                .collect();
            for d in 0..4 {
                // all_gather: landing = operands one after another.
                let landing: Vec<f32> = xs.concat();
                let out =
                    gather_unpack(&shape, d, p).map_or(landing.clone(), |g| gather(&landing, &g));
                let mut oshape = shape.to_vec();
                oshape[d] *= p;
                for (flat, &got) in out.iter().enumerate() {
                    let mut idx = unravel(flat, &oshape);
                    let m = idx[d] / shape[d];
                    idx[d] %= shape[d];
                    assert_eq!(
                        got,
                        xs[m][ravel(&idx, &shape)],
                        "gather p {p} dim {d} at {flat}"
                    );
                }
                // reduce_scatter of inputs whose `dim` is p times longer.
                let mut ishape = shape.to_vec();
                ishape[d] *= p;
                let ni: usize = ishape.iter().product();
                let ins: Vec<Vec<f32>> = (0..p)
                    .map(|m| (0..ni).map(|i| (m * 7 + i * 3) as f32).collect())
                    .collect();
                let pack = scatter_pack(&ishape, d, p).unwrap();
                let staged: Vec<Vec<f32>> = ins
                    .iter()
                    .map(|x| pack.as_ref().map_or(x.clone(), |g| gather(x, g)))
                    .collect();
                for j in 0..p {
                    let got: Vec<f32> = (0..n)
                        .map(|i| staged.iter().map(|s| s[j * n + i]).sum())
                        .collect();
                    for (flat, &g) in got.iter().enumerate() {
                        let mut idx = unravel(flat, &shape);
                        idx[d] += j * shape[d];
                        let want: f32 = ins.iter().map(|x| x[ravel(&idx, &ishape)]).sum();
                        assert_eq!(g, want, "scatter p {p} dim {d} member {j} at {flat}");
                    }
                }
            }
        }
    }
}

//! Lowering of collectives to NCCL steps on the op's mesh axis (all-reduce, all-gather
//! and reduce-scatter along dim 0, broadcast); on one rank an op NCCL has no call for is a
//! copy.

use super::*;

/// One collective step for `op`.
pub(super) fn lower_collective(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
    world: u32,
) -> CudaResult<()> {
    let axis = op.axis().unwrap_or_default().to_string();
    let (x, o) = (&ins[0], &outs[0]);
    let dtype = x.dtype;
    let coll = match op {
        Op::AllReduce { op, .. } => Coll::AllReduce { op: *op },
        Op::AllGather { dim, .. } => {
            if norm(*dim, x.rank())? != 0
                && x.shape[..norm(*dim, x.rank())?].iter().any(|&d| d != 1)
            {
                return Err(lw.unsup(
                    "all_gather along an inner dim",
                    "NCCL gathers along dim 0; not written yet",
                ));
            }
            Coll::AllGather
        }
        Op::ReduceScatter { op, dim, .. } => {
            if norm(*dim, x.rank())? != 0
                && x.shape[..norm(*dim, x.rank())?].iter().any(|&d| d != 1)
            {
                return Err(lw.unsup(
                    "reduce_scatter along an inner dim",
                    "NCCL scatters along dim 0; not written yet",
                ));
            }
            Coll::ReduceScatter { op: *op }
        }
        Op::Broadcast { root, .. } => Coll::Broadcast { root: *root as i32 },
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

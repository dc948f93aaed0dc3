//! Lowering of reductions along dims (sum, mean, max: one warp per output element, one
//! block for few outputs of long reductions) and
//! of softmax / log-softmax and their backward along the last dim (one block per row).

use super::*;
use kernels::ReduceCode;

/// Reductions at least this long with fewer than [`BLOCK_REDUCE_MAX_OUTPUTS`] outputs
/// run a block per output instead of a warp.
const BLOCK_REDUCE_MIN: u64 = 4096;
const BLOCK_REDUCE_MAX_OUTPUTS: u64 = 1024;

/// `sum` / `mean` / `max` (`code`) over `dims`.
pub(super) fn reduce(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dims: &[i64],
    code: ReduceCode,
) -> CudaResult<()> {
    let o = &outs[0];
    let x = &ins[0];
    let ds: Vec<usize> = dims
        .iter()
        .map(|&d| norm(d, x.rank()))
        .collect::<CudaResult<_>>()?;
    if ds.is_empty() {
        lw.copy(o.ptr, x.ptr, o.bytes());
        return Ok(());
    }
    let (rd, nout, nred) = layout::red(&x.shape, &ds).map_err(|m| lw.unsup("a reduction", &m))?;
    let name = if x.dtype == DType::I64 {
        "reduce_i64"
    } else {
        kname("reduce", x.dtype)?
    };
    if x.dtype != o.dtype {
        return Err(lw.unsup(
            "a reduction changing dtype",
            "output dtype differs from input",
        ));
    }
    // A warp per output leaves the device idle when there are few outputs (a loss summed
    // over 16k tokens took 0.28 ms on one warp); then a block per output.
    if x.dtype.is_float() && nred >= BLOCK_REDUCE_MIN && nout < BLOCK_REDUCE_MAX_OUTPUTS {
        let k = kernels::ReduceBlock {
            out: o.ptr,
            input: x.ptr,
            nout: nout as i64,
            nred: nred as i64,
            code,
            rd,
        };
        return lw.run(kname("reduce_block", x.dtype)?, nout, k);
    }
    let k = kernels::Reduce {
        out: o.ptr,
        input: x.ptr,
        nout: nout as i64,
        nred: nred as i64,
        code,
        rd,
    };
    lw.run(name, nout, k)
}

/// `softmax` / `log_softmax` along the last dim.
pub(super) fn softmax(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dim: i64,
    log: bool,
) -> CudaResult<()> {
    let o = &outs[0];
    let x = &ins[0];
    let d = norm(dim, x.rank())?;
    if d != x.rank() - 1 {
        return Err(lw.unsup("softmax along a dim other than the last", "transpose first"));
    }
    let n = *x.shape.last().unwrap() as u64;
    let rows = x.numel().checked_div(n).unwrap_or(0);
    let name = kname("softmax", x.dtype)?;
    let k = kernels::Softmax {
        out: o.ptr,
        input: x.ptr,
        rows: rows as i64,
        n: n as i64,
        logsm: log as i32,
    };
    lw.run(name, rows, k)
}

/// `softmax_grad` along the last dim: dx from y and dy.
pub(super) fn softmax_grad(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dim: i64,
) -> CudaResult<()> {
    let o = &outs[0];
    let y = &ins[0];
    if norm(dim, y.rank())? != y.rank() - 1 {
        return Err(lw.unsup(
            "softmax_grad along a dim other than the last",
            "transpose first",
        ));
    }
    let n = *y.shape.last().unwrap() as u64;
    let rows = y.numel().checked_div(n).unwrap_or(0);
    let name = kname("softmax_bwd", y.dtype)?;
    let k = kernels::SoftmaxBwd {
        dx: o.ptr,
        y: y.ptr,
        dy: ins[1].ptr,
        rows: rows as i64,
        n: n as i64,
    };
    lw.run(name, rows, k)
}

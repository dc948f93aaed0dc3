//! Lowering of reductions along dims (sum, mean, max: one warp per output element) and
//! of softmax / log-softmax and their backward along the last dim (one block per row).

use super::*;

/// `sum` / `mean` / `max` over `dims` (`c`: 0 sum, 1 mean, 2 max).
pub(super) fn reduce(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dims: &[i64],
    c: i32,
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
    lw.warps(
        name,
        nout,
        vec![
            Arg::P(o.ptr),
            Arg::P(x.ptr),
            Arg::I64(nout as i64),
            Arg::I64(nred as i64),
            Arg::I32(c),
            Arg::blob(&rd),
        ],
    )
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
    let rows = if n == 0 { 0 } else { x.numel() / n };
    let name = kname("softmax", x.dtype)?;
    let logsm = log as i32;
    lw.rows(
        name,
        rows,
        256,
        0,
        vec![
            Arg::P(o.ptr),
            Arg::P(x.ptr),
            Arg::I64(rows as i64),
            Arg::I64(n as i64),
            Arg::I32(logsm),
        ],
    )
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
    let rows = if n == 0 { 0 } else { y.numel() / n };
    let name = kname("softmax_bwd", y.dtype)?;
    lw.rows(
        name,
        rows,
        256,
        0,
        vec![
            Arg::P(o.ptr),
            Arg::P(y.ptr),
            Arg::P(ins[1].ptr),
            Arg::I64(rows as i64),
            Arg::I64(n as i64),
        ],
    )
}

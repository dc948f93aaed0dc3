//! Lowering of indexed ops: embedding lookup and its gradient, gather, index_select,
//! scatter_add, topk and one_hot. Out-of-range indices set the device error flag, which
//! the executor reads after the step.

use super::*;

/// `embedding`: one block per id.
pub(super) fn embedding(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (ids, w) = (&ins[0], &ins[1]);
    if ids.dtype != DType::I64 {
        return Err(lw.unsup("embedding with non-i64 ids", "cast the ids to i64"));
    }
    let h = w.shape[1] as u64;
    let name = kname("embedding", w.dtype)?;
    lw.rows(
        name,
        ids.numel(),
        128,
        0,
        vec![
            Arg::P(o.ptr),
            Arg::P(ids.ptr),
            Arg::P(w.ptr),
            Arg::I64(ids.numel() as i64),
            Arg::I64(h as i64),
            Arg::I64(w.shape[0] as i64),
            Arg::P(err),
        ],
    )
}

/// `embedding_grad`: dy rows added into a zeroed table.
pub(super) fn embedding_grad(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (ids, dy) = (&ins[0], &ins[1]);
    let h = *dy.shape.last().unwrap() as i64;
    lw.memset(o.ptr, o.bytes());
    let name = kname("embedding_bwd", o.dtype)?;
    lw.rows(
        name,
        ids.numel(),
        256,
        0,
        vec![
            Arg::P(o.ptr),
            Arg::P(ids.ptr),
            Arg::P(dy.ptr),
            Arg::I64(ids.numel() as i64),
            Arg::I64(h),
            Arg::I64(o.shape[0] as i64),
            Arg::P(err),
        ],
    )
}

/// `gather` along `dim` (i64 indices).
pub(super) fn gather(lw: &mut Lower, ins: &[DevT], outs: &[DevT], dim: &i64) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (x, idx) = (&ins[0], &ins[1]);
    let d = norm(*dim, x.rank())?;
    if idx.dtype != DType::I64 {
        return Err(lw.unsup("gather with non-i64 indices", "cast to i64"));
    }
    let xs = layout::strides(&x.shape);
    let mut st = layout::Strided {
        rank: idx.rank() as i32,
        shape: [1; 8],
        ss: [0; 8],
        ds: [0; 8],
    };
    for i in 0..idx.rank() {
        st.shape[i] = idx.shape[i] as i64;
        st.ss[i] = xs[i];
    }
    lw.n(
        "gather_any",
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(x.ptr),
            Arg::P(idx.ptr),
            Arg::I32(esz(o.dtype) as i32),
            Arg::I64(o.numel() as i64),
            Arg::blob(&st),
            Arg::I32(d as i32),
            Arg::I64(x.shape[d] as i64),
            Arg::P(err),
        ],
    )
}

/// `index_select` along `dim`.
pub(super) fn index_select(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dim: &i64,
) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (x, idx) = (&ins[0], &ins[1]);
    let d = norm(*dim, x.rank())?;
    let outer: usize = x.shape[..d].iter().product();
    let inner: usize = x.shape[d + 1..].iter().product();
    lw.n(
        "index_select_any",
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(x.ptr),
            Arg::P(idx.ptr),
            Arg::I32(code(idx.dtype)),
            Arg::I32(esz(o.dtype) as i32),
            Arg::I64(outer as i64),
            Arg::I64(x.shape[d] as i64),
            Arg::I64(idx.numel() as i64),
            Arg::I64(inner as i64),
            Arg::P(err),
        ],
    )
}

/// `scatter_add` along `dim` into a copy of `dst`.
pub(super) fn scatter_add(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dim: &i64,
) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (dst, idx, src) = (&ins[0], &ins[1], &ins[2]);
    let d = norm(*dim, dst.rank())?;
    lw.copy(o.ptr, dst.ptr, o.bytes());
    let os = layout::strides(&o.shape);
    let mut st = layout::Strided {
        rank: src.rank() as i32,
        shape: [1; 8],
        ss: [0; 8],
        ds: [0; 8],
    };
    for i in 0..src.rank() {
        st.shape[i] = src.shape[i] as i64;
        st.ds[i] = os[i];
    }
    let name = kname("scatter_add", o.dtype)?;
    lw.n(
        name,
        src.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(idx.ptr),
            Arg::P(src.ptr),
            Arg::I64(src.numel() as i64),
            Arg::blob(&st),
            Arg::I32(d as i32),
            Arg::I64(o.shape[d] as i64),
            Arg::P(err),
        ],
    )
}

/// `topk` along the last dim: values and i64 indices.
pub(super) fn topk(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    k: &i64,
    dim: &i64,
) -> CudaResult<()> {
    let x = &ins[0];
    let d = norm(*dim, x.rank())?;
    if d != x.rank() - 1 {
        return Err(lw.unsup("topk along a dim other than the last", "transpose first"));
    }
    let n = x.shape[d] as u64;
    let rows = if n == 0 { 0 } else { x.numel() / n };
    lw.n(
        "topk_any",
        rows,
        vec![
            Arg::P(outs[0].ptr),
            Arg::I32(code(outs[0].dtype)),
            Arg::P(outs[1].ptr),
            Arg::P(x.ptr),
            Arg::I32(code(x.dtype)),
            Arg::I64(rows as i64),
            Arg::I64(n as i64),
            Arg::I32(*k as i32),
        ],
    )
}

/// `one_hot`.
pub(super) fn one_hot(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    num_classes: &i64,
) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let idx = &ins[0];
    lw.n(
        "one_hot",
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::I32(code(o.dtype)),
            Arg::P(idx.ptr),
            Arg::I64(idx.numel() as i64),
            Arg::I64(*num_classes),
            Arg::P(err),
        ],
    )
}

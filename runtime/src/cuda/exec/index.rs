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
    let k = kernels::Embedding {
        out: o.ptr,
        ids: ids.ptr,
        w: w.ptr,
        ntok: ids.numel() as i64,
        h: h as i64,
        vocab: w.shape[0] as i64,
        err,
    };
    lw.run(name, ids.numel(), k)
}

/// `embedding_grad`: dy rows added into a zeroed table; the `padding_idx` row's tokens
/// are skipped (HF's `nn.Embedding(padding_idx=...)`).
pub(super) fn embedding_grad(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    padding_idx: Option<&Dim>,
    bindings: &Bindings,
) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (ids, dy) = (&ins[0], &ins[1]);
    // Any id in range differs from -1, so -1 is "no padding row".
    let pad = match padding_idx {
        Some(p) => p
            .eval(bindings)
            .map_err(|e| CudaError::Plan(e.to_string()))?,
        None => -1,
    };
    let h = *dy.shape.last().unwrap() as i64;
    // The rows are added to `init` (a tied lm_head's weight gradient) where `fuse` gave
    // one, in its own bytes when the plan writes the result over it, else to zeros.
    match ins.get(2) {
        Some(init) if init.ptr == o.ptr => {}
        Some(init) => lw.copy(o.ptr, init.ptr, o.bytes()),
        None => lw.memset(o.ptr, o.bytes()),
    }
    let name = kname("embedding_bwd", o.dtype)?;
    let k = kernels::EmbeddingBwd {
        dw: o.ptr,
        ids: ids.ptr,
        dy: dy.ptr,
        ntok: ids.numel() as i64,
        h,
        vocab: o.shape[0] as i64,
        pad,
        accumulate: i32::from(ins.len() > 2),
        err,
    };
    lw.run(name, ids.numel(), k)
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
    for (i, &size) in idx.shape.iter().enumerate() {
        st.shape[i] = size as i64;
        st.ss[i] = xs[i];
    }
    let k = kernels::Gather {
        out: o.ptr,
        x: x.ptr,
        idx: idx.ptr,
        esz: esz(o.dtype) as i32,
        n: o.numel() as i64,
        st,
        d: d as i32,
        xd: x.shape[d] as i64,
        err,
    };
    lw.run("gather_any", o.numel(), k)
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
    let k = kernels::IndexSelect {
        out: o.ptr,
        x: x.ptr,
        idx: idx.ptr,
        icode: idx.dtype,
        esz: esz(o.dtype) as i32,
        outer: outer as i64,
        nx: x.shape[d] as i64,
        m: idx.numel() as i64,
        inner: inner as i64,
        err,
    };
    lw.run("index_select_any", o.numel(), k)
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
    for (i, &size) in src.shape.iter().enumerate() {
        st.shape[i] = size as i64;
        st.ds[i] = os[i];
    }
    let name = kname("scatter_add", o.dtype)?;
    let k = kernels::ScatterAdd {
        out: o.ptr,
        idx: idx.ptr,
        src: src.ptr,
        n: src.numel() as i64,
        st,
        d: d as i32,
        od: o.shape[d] as i64,
        err,
    };
    lw.run(name, src.numel(), k)
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
    let rows = x.numel().checked_div(n).unwrap_or(0);
    let kernel = kernels::Topk {
        vals: outs[0].ptr,
        vcode: outs[0].dtype,
        idx: outs[1].ptr,
        x: x.ptr,
        xcode: x.dtype,
        rows: rows as i64,
        n: n as i64,
        k: *k as i32,
    };
    lw.run("topk_any", rows, kernel)
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
    let k = kernels::OneHot {
        out: o.ptr,
        ocode: o.dtype,
        idx: idx.ptr,
        n: idx.numel() as i64,
        classes: *num_classes,
        err,
    };
    lw.run("one_hot", o.numel(), k)
}

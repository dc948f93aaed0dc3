//! Lowering of data movement: reshape, permute, transpose, slice, split, zigzag, concat
//! and expand, each one or more strided copies (a plain contiguous run becomes a memcpy).

use super::*;

/// `reshape`: a copy (the layout is row-major on both sides).
pub(super) fn reshape(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    lw.copy(o.ptr, ins[0].ptr, o.bytes());
    Ok(())
}

/// `permute`.
pub(super) fn permute(lw: &mut Lower, ins: &[DevT], outs: &[DevT], perm: &[i64]) -> CudaResult<()> {
    let o = &outs[0];
    let x = &ins[0];
    let p: Vec<usize> = perm
        .iter()
        .map(|&d| norm(d, x.rank()))
        .collect::<CudaResult<_>>()?;
    let xs = layout::strides(&x.shape);
    let ss: Vec<i64> = p.iter().map(|&i| xs[i]).collect();
    lw.strided(
        o.ptr,
        x.ptr,
        esz(o.dtype),
        &o.shape,
        &ss,
        &layout::strides(&o.shape),
    )
}

/// `transpose` of two dims.
pub(super) fn transpose(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dim0: &i64,
    dim1: &i64,
) -> CudaResult<()> {
    let o = &outs[0];
    let x = &ins[0];
    let (a, b) = (norm(*dim0, x.rank())?, norm(*dim1, x.rank())?);
    let mut ss = layout::strides(&x.shape);
    ss.swap(a, b);
    lw.strided(
        o.ptr,
        x.ptr,
        esz(o.dtype),
        &o.shape,
        &ss,
        &layout::strides(&o.shape),
    )
}

/// `slice` of `dim` from `start`.
pub(super) fn slice(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dim: &i64,
    start: &Dim,
    bindings: &Bindings,
) -> CudaResult<()> {
    let o = &outs[0];
    let x = &ins[0];
    let d = norm(*dim, x.rank())?;
    let s = start
        .eval(bindings)
        .map_err(|e| CudaError::Plan(e.to_string()))?;
    let xs = layout::strides(&x.shape);
    let src = x.ptr + (s * xs[d]) as u64 * x.dtype.size_bytes();
    lw.strided(
        o.ptr,
        src,
        esz(o.dtype),
        &o.shape,
        &xs,
        &layout::strides(&o.shape),
    )
}

/// `split` along `dim` into the outputs.
pub(super) fn split(lw: &mut Lower, ins: &[DevT], outs: &[DevT], dim: &i64) -> CudaResult<()> {
    let x = &ins[0];
    let d = norm(*dim, x.rank())?;
    let xs = layout::strides(&x.shape);
    let mut at = 0usize;
    for out in outs {
        let src = x.ptr + (at as i64 * xs[d]) as u64 * x.dtype.size_bytes();
        lw.strided(
            out.ptr,
            src,
            esz(out.dtype),
            &out.shape,
            &xs,
            &layout::strides(&out.shape),
        )?;
        at += out.shape[d];
    }
    Ok(())
}

/// `zigzag`: chunks of `dim` reordered for context parallelism.
pub(super) fn zigzag(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    dim: &i64,
    parts: &i64,
    inverse: &bool,
) -> CudaResult<()> {
    let o = &outs[0];
    // One strided copy per chunk: output chunk i is input chunk order[i].
    let x = &ins[0];
    let d = norm(*dim, x.rank())?;
    let order = weft_ir::shape::zigzag_order(*parts as usize, *inverse);
    let c = x.shape[d] / order.len();
    let mut chunk = x.shape.clone();
    chunk[d] = c;
    let (xs, os) = (layout::strides(&x.shape), layout::strides(&o.shape));
    let bytes = x.dtype.size_bytes();
    for (i, &j) in order.iter().enumerate() {
        let src = x.ptr + (j as i64 * c as i64 * xs[d]) as u64 * bytes;
        let dst = o.ptr + (i as i64 * c as i64 * os[d]) as u64 * bytes;
        lw.strided(dst, src, esz(o.dtype), &chunk, &xs, &os)?;
    }
    Ok(())
}

/// `concat` along `dim`.
pub(super) fn concat(lw: &mut Lower, ins: &[DevT], outs: &[DevT], dim: &i64) -> CudaResult<()> {
    let o = &outs[0];
    let d = norm(*dim, o.rank())?;
    let os = layout::strides(&o.shape);
    let mut at = 0usize;
    for x in ins {
        let dst = o.ptr + (at as i64 * os[d]) as u64 * o.dtype.size_bytes();
        lw.strided(
            dst,
            x.ptr,
            esz(o.dtype),
            &x.shape,
            &layout::strides(&x.shape),
            &os,
        )?;
        at += x.shape[d];
    }
    Ok(())
}

/// `expand`: a broadcast copy.
pub(super) fn expand(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let x = &ins[0];
    let ss = layout::broadcast_strides(&x.shape, &o.shape).map_err(|m| lw.unsup("expand", &m))?;
    lw.strided(
        o.ptr,
        x.ptr,
        esz(o.dtype),
        &o.shape,
        &ss,
        &layout::strides(&o.shape),
    )
}

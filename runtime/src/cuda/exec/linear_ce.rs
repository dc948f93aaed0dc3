//! Lowering of `linear_cross_entropy` and `linear_cross_entropy_grad`: per vocabulary
//! chunk, a cuBLASLt GEMM `z = x w_c^T` into one scratch buffer of [tokens, chunk] in x's
//! dtype, then `lce_stats` (running max / sum of exp and the target logit, in f32) or, in
//! the backward, `lce_dz` (the logits' gradient, in place) and two GEMMs:
//! `dx += dz w_c` and `dw_c = dz^T x`. No [tokens, vocab] tensor exists.
//!
//! `linear_cross_entropy_with_grad` chunks over the tokens instead: per chunk of `rows`
//! tokens one GEMM writes their logits over the whole vocabulary, `lce_row_grad` takes
//! each row's statistics and turns it into dz in place, and two GEMMs give the chunk's
//! `dx_c = dz w` and add `dz^T x_c` into dw. The logits are computed once.

use super::*;

/// The op's attributes as the kernels take them (0 for no soft-cap, 1 for no scale).
struct LceAttrs {
    ignore: i64,
    chunk: u64,
    scale: f32,
    cap: f32,
}

impl LceAttrs {
    fn of(lw: &Lower, op: &Op) -> CudaResult<LceAttrs> {
        let (Op::LinearCrossEntropy {
            ignore_index,
            chunk,
            scale,
            softcap,
        }
        | Op::LinearCrossEntropyGrad {
            ignore_index,
            chunk,
            scale,
            softcap,
        }
        | Op::LinearCrossEntropyWithGrad {
            ignore_index,
            rows: chunk,
            scale,
            softcap,
        }) = op
        else {
            return Err(lw.unsup(op.name(), "not a linear_cross_entropy"));
        };
        Ok(LceAttrs {
            ignore: *ignore_index,
            chunk: u64::try_from(*chunk)
                .ok()
                .filter(|&c| c > 0)
                .ok_or_else(|| lw.unsup(op.name(), &format!("chunk {chunk} must be positive")))?,
            scale: scale.map_or(1.0, |s| s.0 as f32),
            cap: softcap.map_or(0.0, |c| c.0 as f32),
        })
    }
}

/// (tokens, hidden, vocab) of x [.., H] and w [V, H], refusing mixed dtypes and labels
/// other than i64.
fn sizes(
    lw: &Lower,
    op: &Op,
    x: &DevT,
    w: &DevT,
    labels_dtype: DType,
) -> CudaResult<(u64, u64, u64)> {
    if x.dtype != w.dtype {
        return Err(lw.unsup(
            op.name(),
            &format!("x and w must share a dtype: x {}, w {}", x.dtype, w.dtype),
        ));
    }
    if !matches!(labels_dtype, DType::I64) {
        return Err(lw.unsup(
            op.name(),
            &format!("labels must be i64 (the kernels read 8-byte labels), got {labels_dtype}"),
        ));
    }
    let h = *x.shape.last().unwrap_or(&0) as u64;
    let n = x.numel().checked_div(h).unwrap_or(0);
    Ok((n, h, w.shape[0] as u64))
}

fn gemm_shape(
    dtype: DType,
    m: u64,
    n: u64,
    k: u64,
    ta: bool,
    tb: bool,
    accumulate: bool,
) -> GemmShape {
    GemmShape {
        dtype,
        m,
        n,
        k,
        ta,
        tb,
        batch: 1,
        sa: 0,
        sb: 0,
        sc: 0,
        bias: false,
        accumulate,
        fp8: None,
    }
}

/// Forward: `outs` = [lse, target], f32 per token.
pub(super) fn linear_ce_fwd(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
) -> CudaResult<()> {
    let a = LceAttrs::of(lw, op)?;
    let (x, w, labels) = (&ins[0], &ins[1], &ins[2]);
    let (lse, target) = (&outs[0], &outs[1]);
    let (n, h, v) = sizes(lw, op, x, w, labels.dtype)?;
    if n == 0 {
        return Ok(());
    }
    needs_classes(lw, op, v)?;
    let chunk = a.chunk.min(v);
    let es = esz(x.dtype) as u64;
    let z = lw
        .ex
        .scratch(lw.stream, chunk_scratch_bytes(lw, op, n, chunk, es)?);
    let m = lw.ex.scratch(lw.stream, n * 4);
    let s = lw.ex.scratch(lw.stream, n * 4);
    let k = kernels::LceInit {
        m,
        s,
        target: target.ptr,
        rows: n as i64,
    };
    lw.run("lce_init", n, k)?;
    let stats = kname("lce_stats", x.dtype)?;
    let err = lw.gpu.err_flag.ptr;
    let mut c0 = 0;
    while c0 < v {
        let len = chunk.min(v - c0);
        let wc = w.ptr + c0 * h * es;
        lw.gemm(
            gemm_shape(x.dtype, n, len, h, false, true, false),
            x.ptr,
            wc,
            z,
            0,
        );
        let k = kernels::LceStats {
            m,
            s,
            target: target.ptr,
            z,
            labels: labels.ptr,
            len: len as i64,
            c0: c0 as i64,
            v: v as i64,
            ignore: a.ignore,
            scale: a.scale,
            cap: a.cap,
            err,
        };
        lw.run(stats, n, k)?;
        c0 += len;
    }
    let k = kernels::LceFinish {
        lse: lse.ptr,
        m,
        s,
        rows: n as i64,
    };
    lw.run("lce_finish", n, k)
}

/// Backward: operands x, w, labels, lse, dlse, dtarget; `outs` = [dx, dw].
pub(super) fn linear_ce_bwd(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
) -> CudaResult<()> {
    let a = LceAttrs::of(lw, op)?;
    let (x, w, labels, lse, dlse, dtarget) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4], &ins[5]);
    let (dx, dw) = (&outs[0], &outs[1]);
    let (n, h, v) = sizes(lw, op, x, w, labels.dtype)?;
    if n == 0 || v == 0 || h == 0 {
        lw.fill(dx, 0.0)?;
        return lw.fill(dw, 0.0);
    }
    let chunk = a.chunk.min(v);
    let es = esz(x.dtype) as u64;
    let z = lw
        .ex
        .scratch(lw.stream, chunk_scratch_bytes(lw, op, n, chunk, es)?);
    let dz = kname("lce_dz", x.dtype)?;
    let mut c0 = 0;
    while c0 < v {
        let len = chunk.min(v - c0);
        let wc = w.ptr + c0 * h * es;
        lw.gemm(
            gemm_shape(x.dtype, n, len, h, false, true, false),
            x.ptr,
            wc,
            z,
            0,
        );
        let k = kernels::LceDz {
            z,
            labels: labels.ptr,
            lse: lse.ptr,
            dlse: dlse.ptr,
            dtarget: dtarget.ptr,
            rows: n as i64,
            len: len as i64,
            c0: c0 as i64,
            ignore: a.ignore,
            scale: a.scale,
            cap: a.cap,
        };
        lw.run(dz, n * len, k)?;
        // dx (+)= dz [n, len] @ w_c [len, h]
        lw.gemm(
            gemm_shape(x.dtype, n, h, len, false, false, c0 > 0),
            z,
            wc,
            dx.ptr,
            0,
        );
        // dw_c = dz^T [len, n] @ x [n, h]
        let dwc = dw.ptr + c0 * h * es;
        lw.gemm(
            gemm_shape(x.dtype, len, h, n, true, false, false),
            z,
            x.ptr,
            dwc,
            0,
        );
        c0 += len;
    }
    Ok(())
}

/// Forward and backward in one: operands x, w, labels, dlse, dtarget; `outs` = [lse,
/// target, dx, dw].
pub(super) fn linear_ce_with_grad(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
) -> CudaResult<()> {
    let a = LceAttrs::of(lw, op)?;
    let (x, w, labels, dlse, dtarget) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
    let (lse, target, dx, dw) = (&outs[0], &outs[1], &outs[2], &outs[3]);
    let (n, h, v) = sizes(lw, op, x, w, labels.dtype)?;
    if n == 0 {
        return lw.fill(dw, 0.0);
    }
    needs_classes(lw, op, v)?;
    let rows = a.chunk.min(n);
    let es = esz(x.dtype) as u64;
    let z = lw
        .ex
        .scratch(lw.stream, chunk_scratch_bytes(lw, op, rows, v, es)?);
    let row_grad = kname("lce_row_grad", x.dtype)?;
    let err = lw.gpu.err_flag.ptr;
    let mut r0 = 0;
    while r0 < n {
        let len = rows.min(n - r0);
        let xc = x.ptr + r0 * h * es;
        // z [len, V] = x_c w^T
        lw.gemm(
            gemm_shape(x.dtype, len, v, h, false, true, false),
            xc,
            w.ptr,
            z,
            0,
        );
        let k = kernels::LceRowGrad {
            z,
            labels: labels.ptr + r0 * esz(labels.dtype) as u64,
            lse: lse.ptr + r0 * 4,
            target: target.ptr + r0 * 4,
            dlse: dlse.ptr + r0 * 4,
            dtarget: dtarget.ptr + r0 * 4,
            v: v as i64,
            ignore: a.ignore,
            scale: a.scale,
            cap: a.cap,
            err,
        };
        lw.run(row_grad, len, k)?;
        // dx_c = dz [len, V] @ w [V, h]
        lw.gemm(
            gemm_shape(x.dtype, len, h, v, false, false, false),
            z,
            w.ptr,
            dx.ptr + r0 * h * es,
            0,
        );
        // dw (+)= dz^T [V, len] @ x_c [len, h]
        lw.gemm(
            gemm_shape(x.dtype, v, h, len, true, false, r0 > 0),
            z,
            xc,
            dw.ptr,
            0,
        );
        r0 += len;
    }
    Ok(())
}

/// A cross-entropy needs a class: an empty vocabulary is refused by name.
fn needs_classes(lw: &Lower, op: &Op, v: u64) -> CudaResult<()> {
    if v == 0 {
        return Err(lw.unsup(
            op.name(),
            "an empty vocabulary (a cross-entropy needs a class)",
        ));
    }
    Ok(())
}

/// Bytes of one [tokens, chunk] logits block, checked (an overflow is an error naming
/// the op, not a wrapped allocation).
fn chunk_scratch_bytes(lw: &Lower, op: &Op, n: u64, chunk: u64, es: u64) -> CudaResult<u64> {
    n.checked_mul(chunk)
        .and_then(|b| b.checked_mul(es))
        .ok_or_else(|| {
            lw.unsup(
                op.name(),
                &format!("a [{n}, {chunk}] chunk scratch overflows 64-bit bytes"),
            )
        })
}

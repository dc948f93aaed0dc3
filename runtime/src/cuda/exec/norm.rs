//! Lowering of `rms_norm` and `rms_norm_grad`: 16-byte-vector bf16 kernels for the common
//! row widths, else the generic per-row kernels; the weight gradient sums per-block
//! partials in a fixed order (deterministic).

use super::*;

/// `rms_norm`: one block per row.
pub(super) fn rms_norm(lw: &mut Lower, ins: &[DevT], outs: &[DevT], eps: &Float) -> CudaResult<()> {
    let o = &outs[0];
    let (x, w) = (&ins[0], &ins[1]);
    let h = *x.shape.last().unwrap() as u64;
    let rows = x.numel().checked_div(h).unwrap_or(0);
    if let Some(name) = rms8_kernel(&[x, o], w, h, "rms_fwd8_bf16") {
        let k = kernels::RmsFwd8 {
            out: o.ptr,
            x: x.ptr,
            w: w.ptr,
            wcode: w.dtype,
            rows: rows as i64,
            h: h as i32,
            eps: eps.0 as f32,
            rstd: 0,
        };
        return lw.run(name, rows, k);
    }
    let name = kname("rms_norm", x.dtype)?;
    let k = kernels::RmsNorm {
        out: o.ptr,
        x: x.ptr,
        w: w.ptr,
        wcode: w.dtype,
        rows: rows as i64,
        h: h as i64,
        eps: eps.0 as f32,
        rstd: 0,
    };
    lw.run(name, rows, k)
}

/// `rms_norm_grad`: dx per row, dw from per-block partial column sums.
pub(super) fn rms_norm_grad(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    eps: &Float,
) -> CudaResult<()> {
    let (x, w, dy) = (&ins[0], &ins[1], &ins[2]);
    let (dx, dw) = (&outs[0], &outs[1]);
    let h = *x.shape.last().unwrap() as u64;
    let rows = x.numel().checked_div(h).unwrap_or(0);
    if let Some(name) = rms8_kernel(&[x, dy, dx], w, h, "rms_bwd8_bf16") {
        // About 512 blocks (4 rows each at 2048 rows): enough warps in flight to hide
        // the per-row reductions; dw from per-block partials, summed in a fixed order.
        let rpb = rows.div_ceil(512).max(1);
        let nblocks = rows.div_ceil(rpb);
        let part = lw.ex.scratch(lw.stream, nblocks.max(1) * h * 4);
        let k = kernels::RmsBwd8 {
            dx: dx.ptr,
            dw_acc: part,
            x: x.ptr,
            w: w.ptr,
            wcode: w.dtype,
            dy: dy.ptr,
            rows: rows as i64,
            h: h as i32,
            eps: eps.0 as f32,
            rpb: rpb as i32,
        };
        lw.run(name, nblocks, k)?;
        let k = kernels::ColsumF32To {
            out: dw.ptr,
            ocode: dw.dtype,
            part,
            nrows: nblocks as i64,
            h: h as i64,
        };
        return lw.run_at(
            "colsum_f32_to",
            (h.div_ceil(32) as u32, 1, 1),
            (32, 8, 1),
            0,
            k,
        );
    }
    let acc = lw.ex.scratch(lw.stream, h * 4);
    let rstd = lw.ex.scratch(lw.stream, rows * 4);
    let name = kname("rms_norm_bwd", x.dtype)?;
    let k = kernels::RmsNormBwd {
        dx: dx.ptr,
        rstd,
        x: x.ptr,
        w: w.ptr,
        wcode: w.dtype,
        dy: dy.ptr,
        rows: rows as i64,
        h: h as i64,
        eps: eps.0 as f32,
    };
    lw.run(name, rows, k)?;
    lw.memset(acc, h * 4);
    let chunk = 256u64;
    let gy = rows.div_ceil(chunk).max(1);
    let name = kname("rms_dw_partial", x.dtype)?;
    let k = kernels::RmsDwPartial {
        acc,
        x: x.ptr,
        dy: dy.ptr,
        rstd,
        rows: rows as i64,
        h: h as i64,
        chunk: chunk as i64,
    };
    lw.run_at(
        name,
        (h.div_ceil(32) as u32, gy as u32, 1),
        (32, 8, 1),
        0,
        k,
    )?;
    let k = kernels::F32To {
        out: dw.ptr,
        ocode: dw.dtype,
        input: acc,
        n: h as i64,
    };
    lw.run("f32_to_any", h, k)
}

/// The 16-byte-vector bf16 rms_norm kernel for rows of `h` (a multiple of 8, at most 8192)
/// with a f32 or bf16 weight, by chunks per thread, where every row tensor (`rows`) is
/// bf16 and 16-byte aligned; None where the generic kernel must run.
fn rms8_kernel(rows: &[&DevT], w: &DevT, h: u64, base: &str) -> Option<&'static str> {
    if !rows
        .iter()
        .all(|t| t.dtype == DType::BF16 && t.ptr.is_multiple_of(16))
        || !matches!(w.dtype, DType::BF16 | DType::F32)
        || !h.is_multiple_of(8)
        || !w.ptr.is_multiple_of(16)
    {
        return None;
    }
    let per_thread = (h / 8).div_ceil(256);
    Some(match (base, per_thread) {
        ("rms_fwd8_bf16", 0..=1) => "rms_fwd8_bf16_r1",
        ("rms_fwd8_bf16", 2) => "rms_fwd8_bf16_r2",
        ("rms_fwd8_bf16", 3..=4) => "rms_fwd8_bf16_r4",
        ("rms_bwd8_bf16", 0..=1) => "rms_bwd8_bf16_r1",
        ("rms_bwd8_bf16", 2) => "rms_bwd8_bf16_r2",
        ("rms_bwd8_bf16", 3..=4) => "rms_bwd8_bf16_r4",
        _ => return None,
    })
}

//! Lowering of `rms_norm` and `rms_norm_grad`: 16-byte-vector bf16 kernels for the common
//! row widths, else the generic per-row kernels; the weight gradient sums per-block
//! partials in a fixed order (deterministic).

use super::*;

/// `rms_norm`: one block per row.
pub(super) fn rms_norm(lw: &mut Lower, ins: &[DevT], outs: &[DevT], eps: &Float) -> CudaResult<()> {
    let o = &outs[0];
    let (x, w) = (&ins[0], &ins[1]);
    let h = *x.shape.last().unwrap() as u64;
    let rows = if h == 0 { 0 } else { x.numel() / h };
    if let Some(name) = rms8_kernel(x, w, h, "rms_fwd8_bf16") {
        return lw.rows(
            name,
            rows,
            256,
            0,
            vec![
                Arg::P(o.ptr),
                Arg::P(x.ptr),
                Arg::P(w.ptr),
                Arg::I32(code(w.dtype)),
                Arg::I64(rows as i64),
                Arg::I32(h as i32),
                Arg::F32(eps.0 as f32),
                Arg::P(0),
            ],
        );
    }
    let name = kname("rms_norm", x.dtype)?;
    lw.rows(
        name,
        rows,
        256,
        0,
        vec![
            Arg::P(o.ptr),
            Arg::P(x.ptr),
            Arg::P(w.ptr),
            Arg::I32(code(w.dtype)),
            Arg::I64(rows as i64),
            Arg::I64(h as i64),
            Arg::F32(eps.0 as f32),
            Arg::P(0),
        ],
    )
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
    let rows = if h == 0 { 0 } else { x.numel() / h };
    if let Some(name) = rms8_kernel(x, w, h, "rms_bwd8_bf16") {
        // About 512 blocks (4 rows each at 2048 rows): enough warps in flight to hide
        // the per-row reductions; dw from per-block partials, summed in a fixed order.
        let rpb = rows.div_ceil(512).max(1);
        let nblocks = rows.div_ceil(rpb);
        let part = lw.ex.scratch(lw.stream, nblocks.max(1) * h * 4);
        lw.rows(
            name,
            nblocks,
            256,
            0,
            vec![
                Arg::P(dx.ptr),
                Arg::P(part),
                Arg::P(x.ptr),
                Arg::P(w.ptr),
                Arg::I32(code(w.dtype)),
                Arg::P(dy.ptr),
                Arg::I64(rows as i64),
                Arg::I32(h as i32),
                Arg::F32(eps.0 as f32),
                Arg::I32(rpb as i32),
            ],
        )?;
        let l = lw.gpu.launch(
            "colsum_f32_to",
            (h.div_ceil(32) as u32, 1, 1),
            (32, 8, 1),
            0,
            vec![
                Arg::P(dw.ptr),
                Arg::I32(code(dw.dtype)),
                Arg::P(part),
                Arg::I64(nblocks as i64),
                Arg::I64(h as i64),
            ],
        )?;
        lw.launch(l);
        return Ok(());
    }
    let acc = lw.ex.scratch(lw.stream, h * 4);
    let rstd = lw.ex.scratch(lw.stream, rows * 4);
    let name = kname("rms_norm_bwd", x.dtype)?;
    lw.rows(
        name,
        rows,
        256,
        0,
        vec![
            Arg::P(dx.ptr),
            Arg::P(rstd),
            Arg::P(x.ptr),
            Arg::P(w.ptr),
            Arg::I32(code(w.dtype)),
            Arg::P(dy.ptr),
            Arg::I64(rows as i64),
            Arg::I64(h as i64),
            Arg::F32(eps.0 as f32),
        ],
    )?;
    lw.memset(acc, h * 4);
    let chunk = 256u64;
    let gy = rows.div_ceil(chunk).max(1);
    let name = kname("rms_dw_partial", x.dtype)?;
    let lp = lw.gpu.launch(
        name,
        (h.div_ceil(32) as u32, gy as u32, 1),
        (32, 8, 1),
        0,
        vec![
            Arg::P(acc),
            Arg::P(x.ptr),
            Arg::P(dy.ptr),
            Arg::P(rstd),
            Arg::I64(rows as i64),
            Arg::I64(h as i64),
            Arg::I64(chunk as i64),
        ],
    )?;
    lw.launch(lp);
    lw.n(
        "f32_to_any",
        h,
        vec![
            Arg::P(dw.ptr),
            Arg::I32(code(dw.dtype)),
            Arg::P(acc),
            Arg::I64(h as i64),
        ],
    )
}

/// The 16-byte-vector bf16 rms_norm kernel for rows of `h` (a multiple of 8, at most 8192)
/// with a f32 or bf16 weight, by chunks per thread; None where the generic kernel must run.
pub(super) fn rms8_kernel(x: &DevT, w: &DevT, h: u64, base: &str) -> Option<&'static str> {
    if x.dtype != DType::BF16
        || !matches!(w.dtype, DType::BF16 | DType::F32)
        || !h.is_multiple_of(8)
        || !x.ptr.is_multiple_of(16)
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

//! Lowering of the fused ops `fuse` makes (`glu`, `glu_grad`, `add_rms_norm`,
//! `add_rms_norm_grad`) to the kernels of `fused.cu`: 16-byte bf16 vectors where the
//! tensors allow (bf16, 8-element multiples, 16-byte aligned; for the norms a row of at
//! most 8192), else one generic kernel per storage type. Each kernel rounds where the
//! unfused kernels round, so a fused plan computes what the unfused one does.

use super::*;

/// bf16 tensors of one element count (a multiple of 8), 16-byte aligned.
fn bf16_vec8(ts: &[&DevT]) -> bool {
    let n = ts[0].numel();
    n.is_multiple_of(8)
        && ts
            .iter()
            .all(|t| t.dtype == DType::BF16 && t.numel() == n && t.ptr.is_multiple_of(16))
}

/// Rows and row width of a norm's input.
fn rows_of(x: &DevT) -> (u64, u64) {
    let h = x.shape.last().copied().unwrap_or(0) as u64;
    (x.numel().checked_div(h).unwrap_or(0), h)
}

/// The 8-wide row kernel `base_r{1,2,4}` for bf16 rows of `h` (a multiple of 8, at most
/// 8192) with every row tensor 16-byte aligned and `w` bf16 or f32.
fn row8_kernel(base: &str, rows: &[&DevT], w: &DevT, h: u64) -> Option<&'static str> {
    if !h.is_multiple_of(8)
        || !matches!(w.dtype, DType::BF16 | DType::F32)
        || !w.ptr.is_multiple_of(16)
        || !rows
            .iter()
            .all(|t| t.dtype == DType::BF16 && t.ptr.is_multiple_of(16))
    {
        return None;
    }
    let r = match (h / 8).div_ceil(256) {
        0..=1 => 1,
        2 => 2,
        3..=4 => 4,
        _ => return None,
    };
    Some(intern(&format!("{base}_r{r}")))
}

/// Lowers one fused op; `ins`/`outs` are its operands and results.
pub(super) fn lower_fused(lw: &mut Lower, op: &Op, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    match op {
        Op::Glu { act } => {
            let (gate, up, o) = (&ins[0], &ins[1], &outs[0]);
            let n = o.numel();
            let vec8 = bf16_vec8(&[o, gate, up]);
            let (name, count) = if vec8 {
                ("glu8_bf16", n / 8)
            } else {
                (kname("glu", o.dtype)?, n)
            };
            let k = kernels::Glu {
                out: o.ptr,
                gate: gate.ptr,
                up: up.ptr,
                n: count as i64,
                act: (*act).into(),
            };
            lw.run(name, count, k)
        }
        Op::GluGrad { act } => {
            let (gate, up, dy) = (&ins[0], &ins[1], &ins[2]);
            let (dgate, dup) = (&outs[0], &outs[1]);
            let n = gate.numel();
            let vec8 = bf16_vec8(&[gate, up, dy, dgate, dup]);
            let (name, count) = if vec8 {
                ("glu_bwd8_bf16", n / 8)
            } else {
                (kname("glu_bwd", gate.dtype)?, n)
            };
            let k = kernels::GluBwd {
                dgate: dgate.ptr,
                dup: dup.ptr,
                gate: gate.ptr,
                up: up.ptr,
                dy: dy.ptr,
                n: count as i64,
                act: (*act).into(),
            };
            lw.run(name, count, k)
        }
        Op::AddRmsNorm { eps } => {
            let (x, y, w) = (&ins[0], &ins[1], &ins[2]);
            let (sum, normed) = (&outs[0], &outs[1]);
            let (rows, h) = rows_of(x);
            let eps = eps.0 as f32;
            if let Some(name) = row8_kernel("add_rms_fwd8_bf16", &[x, y, sum, normed], w, h) {
                let k = kernels::AddRmsFwd8 {
                    sum: sum.ptr,
                    normed: normed.ptr,
                    x: x.ptr,
                    y: y.ptr,
                    w: w.ptr,
                    wcode: w.dtype,
                    rows: rows as i64,
                    h: h as i32,
                    eps,
                };
                return lw.run(name, rows, k);
            }
            let k = kernels::AddRmsNorm {
                sum: sum.ptr,
                normed: normed.ptr,
                x: x.ptr,
                y: y.ptr,
                w: w.ptr,
                wcode: w.dtype,
                rows: rows as i64,
                h: h as i64,
                eps,
            };
            lw.run(kname("add_rms_norm", x.dtype)?, rows, k)
        }
        Op::AddRmsNormGrad { eps } => add_rms_norm_grad(lw, eps, ins, outs),
        other => Err(lw.unsup(other.name(), "not a fused op")),
    }
}

/// `add_rms_norm_grad(sum, w, dnorm, dres)`: dsum and dw.
fn add_rms_norm_grad(lw: &mut Lower, eps: &Float, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let (x, w, dy, dres) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    let (dsum, dw) = (&outs[0], &outs[1]);
    let (rows, h) = rows_of(x);
    let Some(name) = row8_kernel("add_rms_bwd8_bf16", &[x, dy, dres, dsum], w, h) else {
        // Other dtypes and shapes: rms_norm_grad's kernels (dx written into dsum), then
        // the residual gradient added in place.
        norm::rms_norm_grad(lw, &ins[..3], outs, eps)?;
        let n = dsum.numel();
        let k = kernels::BinarySame {
            out: dsum.ptr,
            a: dsum.ptr,
            b: dres.ptr,
            n: n as i64,
            code: kernels::BinaryCode::Add,
        };
        return lw.run(kname("binary_c", dsum.dtype)?, n, k);
    };
    // As rms_norm_grad's row kernel: about 512 blocks, dw from per-block partials summed
    // in a fixed order.
    let rpb = rows.div_ceil(512).max(1);
    let nblocks = rows.div_ceil(rpb);
    let part = lw.ex.scratch(lw.stream, nblocks.max(1) * h * 4);
    let k = kernels::AddRmsBwd8 {
        dsum: dsum.ptr,
        dw_acc: part,
        x: x.ptr,
        w: w.ptr,
        wcode: w.dtype,
        dy: dy.ptr,
        dres: dres.ptr,
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
    lw.run_at(
        "colsum_f32_to",
        (h.div_ceil(32) as u32, 1, 1),
        (32, 8, 1),
        0,
        k,
    )
}

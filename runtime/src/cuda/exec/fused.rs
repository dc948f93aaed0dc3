//! Lowering of the fused ops `fuse` makes (`glu`, `glu_grad`, `add_rms_norm`,
//! `add_rms_norm_grad`) to the kernels of `fused.cu`: 16-byte bf16 vectors where the
//! tensors allow (bf16, 8-element multiples, 16-byte aligned; for the norms a row of at
//! most 8192), else one generic kernel per storage type. Each kernel rounds where the
//! unfused kernels round, so a fused plan computes what the unfused one does.

use super::*;
use weft_ir::GateAct;

fn act_code(a: GateAct) -> i32 {
    match a {
        GateAct::Silu => 0,
        GateAct::Gelu => 1,
        GateAct::GeluTanh => 2,
    }
}

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
    (if h == 0 { 0 } else { x.numel() / h }, h)
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
            let (n, a) = (o.numel(), act_code(*act));
            if bf16_vec8(&[o, gate, up]) {
                let args = vec![
                    Arg::P(o.ptr),
                    Arg::P(gate.ptr),
                    Arg::P(up.ptr),
                    Arg::I64(n as i64 / 8),
                    Arg::I32(a),
                ];
                return lw.n("glu8_bf16", n / 8, args);
            }
            let args = vec![
                Arg::P(o.ptr),
                Arg::P(gate.ptr),
                Arg::P(up.ptr),
                Arg::I64(n as i64),
                Arg::I32(a),
            ];
            lw.n(kname("glu", o.dtype)?, n, args)
        }
        Op::GluGrad { act } => {
            let (gate, up, dy) = (&ins[0], &ins[1], &ins[2]);
            let (dgate, dup) = (&outs[0], &outs[1]);
            let (n, a) = (gate.numel(), act_code(*act));
            let vec8 = bf16_vec8(&[gate, up, dy, dgate, dup]);
            let args = vec![
                Arg::P(dgate.ptr),
                Arg::P(dup.ptr),
                Arg::P(gate.ptr),
                Arg::P(up.ptr),
                Arg::P(dy.ptr),
                Arg::I64(if vec8 { n as i64 / 8 } else { n as i64 }),
                Arg::I32(a),
            ];
            if vec8 {
                return lw.n("glu_bwd8_bf16", n / 8, args);
            }
            lw.n(kname("glu_bwd", gate.dtype)?, n, args)
        }
        Op::AddRmsNorm { eps } => {
            let (x, y, w) = (&ins[0], &ins[1], &ins[2]);
            let (sum, normed) = (&outs[0], &outs[1]);
            let (rows, h) = rows_of(x);
            if let Some(name) = row8_kernel("add_rms_fwd8_bf16", &[x, y, sum, normed], w, h) {
                let args = vec![
                    Arg::P(sum.ptr),
                    Arg::P(normed.ptr),
                    Arg::P(x.ptr),
                    Arg::P(y.ptr),
                    Arg::P(w.ptr),
                    Arg::I32(layout::code(w.dtype)),
                    Arg::I64(rows as i64),
                    Arg::I32(h as i32),
                    Arg::F32(eps.0 as f32),
                ];
                return lw.rows(name, rows, 256, 0, args);
            }
            let args = vec![
                Arg::P(sum.ptr),
                Arg::P(normed.ptr),
                Arg::P(x.ptr),
                Arg::P(y.ptr),
                Arg::P(w.ptr),
                Arg::I32(layout::code(w.dtype)),
                Arg::I64(rows as i64),
                Arg::I64(h as i64),
                Arg::F32(eps.0 as f32),
            ];
            lw.rows(kname("add_rms_norm", x.dtype)?, rows, 256, 0, args)
        }
        Op::AddRmsNormGrad { eps } => add_rms_norm_grad(lw, eps.0 as f32, ins, outs),
        other => Err(lw.unsup(other.name(), "not a fused op")),
    }
}

/// `add_rms_norm_grad(sum, w, dnorm, dres)`: dsum and dw.
fn add_rms_norm_grad(lw: &mut Lower, eps: f32, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let (x, w, dy, dres) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    let (dsum, dw) = (&outs[0], &outs[1]);
    let (rows, h) = rows_of(x);
    if let Some(name) = row8_kernel("add_rms_bwd8_bf16", &[x, dy, dres, dsum], w, h) {
        // As rms_norm_grad's row kernel: about 512 blocks, dw from per-block partials
        // summed in a fixed order.
        let rpb = rows.div_ceil(512).max(1);
        let nblocks = rows.div_ceil(rpb);
        let part = lw.ex.scratch(lw.stream, nblocks.max(1) * h * 4);
        lw.rows(
            name,
            nblocks,
            256,
            0,
            vec![
                Arg::P(dsum.ptr),
                Arg::P(part),
                Arg::P(x.ptr),
                Arg::P(w.ptr),
                Arg::I32(layout::code(w.dtype)),
                Arg::P(dy.ptr),
                Arg::P(dres.ptr),
                Arg::I64(rows as i64),
                Arg::I32(h as i32),
                Arg::F32(eps),
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
                Arg::I32(layout::code(dw.dtype)),
                Arg::P(part),
                Arg::I64(nblocks as i64),
                Arg::I64(h as i64),
            ],
        )?;
        lw.launch(l);
        return Ok(());
    }
    // Other dtypes and shapes: the unfused kernels (rms_norm_grad's dx written into dsum,
    // then the residual gradient added in place).
    let acc = lw.ex.scratch(lw.stream, h * 4);
    let rstd = lw.ex.scratch(lw.stream, rows * 4);
    lw.rows(
        kname("rms_norm_bwd", x.dtype)?,
        rows,
        256,
        0,
        vec![
            Arg::P(dsum.ptr),
            Arg::P(rstd),
            Arg::P(x.ptr),
            Arg::P(w.ptr),
            Arg::I32(layout::code(w.dtype)),
            Arg::P(dy.ptr),
            Arg::I64(rows as i64),
            Arg::I64(h as i64),
            Arg::F32(eps),
        ],
    )?;
    lw.memset(acc, h * 4);
    let chunk = 256u64;
    let gy = rows.div_ceil(chunk).max(1);
    let lp = lw.gpu.launch(
        kname("rms_dw_partial", x.dtype)?,
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
            Arg::I32(layout::code(dw.dtype)),
            Arg::P(acc),
            Arg::I64(h as i64),
        ],
    )?;
    let n = dsum.numel();
    lw.n(
        kname("binary_c", dsum.dtype)?,
        n,
        vec![
            Arg::P(dsum.ptr),
            Arg::P(dsum.ptr),
            Arg::P(dres.ptr),
            Arg::I64(n as i64),
            Arg::I32(0),
        ],
    )
}

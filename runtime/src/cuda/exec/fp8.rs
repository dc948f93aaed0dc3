//! Lowering of `fp8_matmul`: each operand's amax, then its FP8 bytes in the layout
//! cuBLASLt's FP8 GEMM takes (A `[m, k]`, B stored `[n, k]`: k contiguous in both, so an
//! operand stored the other way is transposed while it is quantized), then one FP8 GEMM
//! with the two dequantizing factors, accumulating in f32. Where cuBLASLt's FP8 path does
//! not apply (sizes not multiples of 16, batched operands), each operand is quantized
//! and dequantized in its own dtype and the ordinary GEMM multiplies them: the same
//! values, since the scales are powers of two.

use super::*;
use crate::cuda::gemm::fp8_sizes_ok;
use weft_ir::Fp8Format;

fn format_code(f: Fp8Format) -> i32 {
    match f {
        Fp8Format::E4m3 => 0,
        Fp8Format::E5m2 => 1,
    }
}

/// The amax of `t` into a fresh zeroed scratch word; returns its address.
fn amax(lw: &mut Lower, t: &DevT) -> CudaResult<u64> {
    let slot = lw.ex.scratch(lw.stream, 4);
    lw.memset(slot, 4);
    if t.dtype == DType::BF16 && t.numel().is_multiple_of(8) {
        lw.run(
            "fp8_amax8_bf16",
            t.numel() / 8,
            kernels::Fp8Amax8 {
                amax: slot,
                x: t.ptr,
                n8: (t.numel() / 8) as i64,
            },
        )?;
        return Ok(slot);
    }
    let name = kname("fp8_amax", t.dtype)?;
    lw.run(
        name,
        t.numel(),
        kernels::Fp8Amax {
            amax: slot,
            x: t.ptr,
            n: t.numel() as i64,
        },
    )?;
    Ok(slot)
}

/// `t` viewed as `[rows, cols]` quantized into scratch, transposed to `[cols, rows]`
/// when `transpose`; returns (bytes, dequantizing factor).
fn quantize(
    lw: &mut Lower,
    t: &DevT,
    (rows, cols): (u64, u64),
    transpose: bool,
    format: Fp8Format,
) -> CudaResult<(u64, u64)> {
    let slot = amax(lw, t)?;
    let out = lw.ex.scratch(lw.stream, rows * cols);
    let inv_scale = lw.ex.scratch(lw.stream, 4);
    if t.dtype == DType::BF16 && !transpose && cols % 8 == 0 {
        let n8 = rows * cols / 8;
        lw.run(
            "fp8_quantize8_bf16",
            n8,
            kernels::Fp8Quantize8 {
                out,
                inv_scale,
                x: t.ptr,
                amax: slot,
                n8: n8 as i64,
                fmt: format_code(format),
            },
        )?;
        return Ok((out, inv_scale));
    }
    let tiles64 = (rows / 64) * (cols / 64);
    if t.dtype == DType::BF16
        && transpose
        && rows % 64 == 0
        && cols % 64 == 0
        && tiles64 <= i32::MAX as u64
    {
        lw.run_at(
            "fp8_quantize_t64_bf16",
            (tiles64 as u32, 1, 1),
            (256, 1, 1),
            0,
            kernels::Fp8QuantizeT64 {
                out,
                inv_scale,
                x: t.ptr,
                amax: slot,
                rows: rows as i64,
                cols: cols as i64,
                fmt: format_code(format),
            },
        )?;
        return Ok((out, inv_scale));
    }
    let tiles = rows.div_ceil(32) * cols.div_ceil(32);
    if tiles > i32::MAX as u64 {
        return Err(lw.unsup("fp8_matmul of this size", "more than 2^31 32x32 tiles"));
    }
    let name = kname("fp8_quantize", t.dtype)?;
    lw.run_at(
        name,
        (tiles as u32, 1, 1),
        (32, 8, 1),
        0,
        kernels::Fp8Quantize {
            out,
            inv_scale,
            x: t.ptr,
            amax: slot,
            rows: rows as i64,
            cols: cols as i64,
            transpose: i32::from(transpose),
            fmt: format_code(format),
        },
    )?;
    Ok((out, inv_scale))
}

/// `t` quantized and dequantized into scratch of its type.
fn quantize_dequantize(lw: &mut Lower, t: &DevT, format: Fp8Format) -> CudaResult<DevT> {
    let slot = amax(lw, t)?;
    let out = DevT {
        ptr: lw.ex.scratch(lw.stream, t.bytes()),
        dtype: t.dtype,
        shape: t.shape.clone(),
    };
    let name = kname("fp8_qdq", t.dtype)?;
    lw.run(
        name,
        t.numel(),
        kernels::Fp8Qdq {
            out: out.ptr,
            x: t.ptr,
            amax: slot,
            n: t.numel() as i64,
            fmt: format_code(format),
        },
    )?;
    Ok(out)
}

/// `fp8_matmul` of `a` and `b` into `o`.
pub(super) fn fp8_matmul(
    lw: &mut Lower,
    a: &DevT,
    b: &DevT,
    o: &DevT,
    (ta, tb): (bool, bool),
    (fa, fb): (Fp8Format, Fp8Format),
) -> CudaResult<()> {
    if a.dtype != b.dtype || o.dtype != a.dtype {
        return Err(lw.unsup(
            "fp8_matmul on mixed dtypes",
            "operands and result must share a dtype",
        ));
    }
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(lw.unsup("fp8_matmul of vectors", "operands need two dims"));
    }
    // A 2-D b and an a whose batch folds into its rows (a not transposed, or 2-D).
    let ba: usize = a.shape[..ra - 2].iter().product();
    let bb: usize = b.shape[..rb - 2].iter().product();
    let (am, ak) = if ta {
        (a.shape[ra - 1], a.shape[ra - 2])
    } else {
        (a.shape[ra - 2], a.shape[ra - 1])
    };
    let n = if tb { b.shape[rb - 2] } else { b.shape[rb - 1] };
    let m = (ba * am) as u64;
    let (n, k) = (n as u64, ak as u64);
    let direct = bb == 1 && (ba == 1 || !ta) && fp8_sizes_ok(m, n, k) && o.dtype != DType::F64;
    if !direct {
        let qa = quantize_dequantize(lw, a, fa)?;
        let qb = quantize_dequantize(lw, b, fb)?;
        return super::matmul::matmul(lw, &qa, &qb, o, ta, tb, None);
    }
    // A as [m, k]: stored [m, k] unless transposed ([k, m]).
    let (qa, sa) = if ta {
        quantize(lw, a, (k, m), true, fa)?
    } else {
        quantize(lw, a, (m, k), false, fa)?
    };
    // B as [n, k]: stored [n, k] when transposed, else [k, n].
    let (qb, sb) = if tb {
        quantize(lw, b, (n, k), false, fb)?
    } else {
        quantize(lw, b, (k, n), true, fb)?
    };
    let shape = GemmShape {
        dtype: o.dtype,
        m,
        n,
        k,
        ta: false,
        tb: true,
        batch: 1,
        sa: 0,
        sb: 0,
        sc: 0,
        bias: false,
        accumulate: false,
        fp8: Some((fa, fb)),
    };
    lw.gemm_fp8(shape, qa, qb, sa, sb, o.ptr);
    Ok(())
}

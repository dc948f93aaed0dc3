//! `fp8_matmul` on the CPU reference: each operand quantized and dequantized exactly as
//! `weft_ir::fp8` defines (per-tensor power-of-two scale from the operand's f32 amax),
//! then the plain matmul. The quantization is straight-through for candle's autograd
//! (`x + (q(x) - x).detach()`), as FP8 training differentiates it.

use super::host::values_f64;
use super::kernels::{self, Cx, KResult};
use candle_core::Tensor;
use weft_ir::{Fp8Format, Op};

/// `x` quantized to `format` with its current per-tensor scale, and dequantized.
pub(crate) fn quantize_dequantize(x: &Tensor, format: Fp8Format) -> KResult<Tensor> {
    let v = values_f64(x)?;
    let amax = v.iter().fold(0f32, |m, &x| {
        let a = (x as f32).abs();
        if a > m || a.is_nan() {
            a
        } else {
            m
        }
    });
    let e = format.scale_exp(amax);
    let q: Vec<f64> = v
        .iter()
        .map(|&x| format.quantize_dequantize(x as f32, e) as f64)
        .collect();
    let q = Tensor::from_vec(q, x.dims(), x.device())?.to_dtype(x.dtype())?;
    // Straight-through: the value of q, the gradient of x.
    Ok((x + (q - x)?.detach())?)
}

/// `fp8_matmul`: the operands quantized, then `matmul` with the same transposes.
pub(crate) fn eval(op: &Op, ins: &[Tensor], cx: &Cx) -> KResult<Vec<Tensor>> {
    let Op::Fp8Matmul {
        transpose_a,
        transpose_b,
        format_a,
        format_b,
    } = op
    else {
        unreachable!("fp8::eval takes fp8_matmul")
    };
    let a = quantize_dequantize(&ins[0], *format_a)?;
    let b = quantize_dequantize(&ins[1], *format_b)?;
    kernels::eval(
        &Op::Matmul {
            transpose_a: *transpose_a,
            transpose_b: *transpose_b,
        },
        &[a, b],
        cx,
    )
}

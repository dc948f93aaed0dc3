//! FP8 numerics of `fp8_matmul`, shared by every runtime: the two formats (OCP e4m3fn
//! for values, e5m2 for gradients), per-tensor current scaling by a power of two, and
//! round-to-nearest-even with saturation to the largest finite value.
//!
//! The scale of an operand is `2^e` with `e = floor(log2(max_finite / amax))` (clamped
//! to `[-SCALE_EXP_LIMIT, SCALE_EXP_LIMIT]`; 1 when `amax` is 0 or not finite), so that
//! `amax * scale <= max_finite` and dequantizing (`q / scale`) is exact in any float
//! dtype: the CPU reference, the CUDA kernels and cuBLASLt see the same values. The
//! CUDA kernel `fp8_quantize` (`runtime/src/cuda/fp8.cu`) mirrors these functions.

use crate::attrs::AttrValue;

/// An FP8 storage format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, no infinities (max 448): weights and activations.
    E4m3,
    /// 5 exponent bits, 2 mantissa bits (max 57344): gradients, for their range.
    E5m2,
}

/// Scale exponents stay within this bound (an all-tiny or all-huge tensor still scales
/// into f32's normal range).
pub const SCALE_EXP_LIMIT: i32 = 100;

impl Fp8Format {
    pub fn keyword(self) -> &'static str {
        match self {
            Fp8Format::E4m3 => "e4m3",
            Fp8Format::E5m2 => "e5m2",
        }
    }

    /// The largest finite value.
    pub fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4m3 => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }

    /// Explicit mantissa bits.
    pub fn mantissa_bits(self) -> i32 {
        match self {
            Fp8Format::E4m3 => 3,
            Fp8Format::E5m2 => 2,
        }
    }

    /// The exponent of the smallest normal value (subnormals share its quantum).
    pub fn min_normal_exp(self) -> i32 {
        match self {
            Fp8Format::E4m3 => -6,
            Fp8Format::E5m2 => -14,
        }
    }

    /// The code cuBLASLt and the CUDA kernels use (`cudaDataType`: CUDA_R_8F_E4M3 = 28,
    /// CUDA_R_8F_E5M2 = 29).
    pub fn cuda_data_type(self) -> i32 {
        match self {
            Fp8Format::E4m3 => 28,
            Fp8Format::E5m2 => 29,
        }
    }

    /// The scale exponent `e` for an operand whose largest magnitude is `amax`.
    pub fn scale_exp(self, amax: f32) -> i32 {
        if !(amax.is_finite() && amax > 0.0) {
            return 0;
        }
        // floor(log2(max / amax)) from the exponents and mantissas of both, exactly.
        let (em, mm) = exp_mantissa(self.max_finite());
        let (ea, ma) = exp_mantissa(amax);
        let e = em - ea - i32::from(ma > mm);
        e.clamp(-SCALE_EXP_LIMIT, SCALE_EXP_LIMIT)
    }

    /// `x` rounded to the nearest value of this format (ties to even), saturating at
    /// the largest finite value; NaN stays NaN.
    pub fn round(self, x: f32) -> f32 {
        if x.is_nan() {
            return x;
        }
        let max = self.max_finite();
        let a = x.abs();
        if a >= max {
            return max.copysign(x);
        }
        if a == 0.0 {
            return x;
        }
        let e = exp_mantissa(a).0.max(self.min_normal_exp());
        let quantum = (e - self.mantissa_bits()) as f64;
        let q = (a as f64) * (-quantum).exp2();
        let r = round_half_even(q) * quantum.exp2();
        (r.min(max as f64) as f32).copysign(x)
    }

    /// `x` quantized with scale `2^scale_exp` and dequantized: what the GEMM multiplies.
    pub fn quantize_dequantize(self, x: f32, scale_exp: i32) -> f32 {
        let s = (scale_exp as f64).exp2();
        (self.round(((x as f64) * s) as f32) as f64 / s) as f32
    }
}

/// The unbiased exponent and the 23 mantissa bits of a positive finite f32 (subnormals
/// normalized).
fn exp_mantissa(x: f32) -> (i32, u32) {
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0 {
        // Subnormal: shift the leading one into the implicit position.
        let lz = man.leading_zeros() as i32 - 8;
        (-126 - lz, (man << (lz + 1)) & 0x7f_ffff)
    } else {
        (exp - 127, man)
    }
}

fn round_half_even(q: f64) -> f64 {
    let f = q.floor();
    let d = q - f;
    if d > 0.5 || (d == 0.5 && f % 2.0 != 0.0) {
        f + 1.0
    } else {
        f
    }
}

impl AttrValue for Fp8Format {
    fn fmt_attr(&self) -> Option<String> {
        Some(self.keyword().to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        match s {
            "e4m3" => Ok(Fp8Format::E4m3),
            "e5m2" => Ok(Fp8Format::E5m2),
            _ => Err(format!("expected one of e4m3, e5m2, found `{s}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Fp8Format::{E4m3, E5m2};

    #[test]
    fn e4m3_grid_and_saturation() {
        // Normal range: 3 mantissa bits between powers of two.
        assert_eq!(E4m3.round(1.0), 1.0);
        assert_eq!(E4m3.round(1.0625), 1.0); // halfway between 1 and 1.125: ties to even
        assert_eq!(E4m3.round(1.1875), 1.25); // halfway between 1.125 and 1.25: to 1.25
        assert_eq!(E4m3.round(1.2), 1.25);
        assert_eq!(E4m3.round(-3.3), -3.25);
        assert_eq!(E4m3.round(447.0), 448.0);
        assert_eq!(E4m3.round(1e6), 448.0);
        assert_eq!(E4m3.round(-1e6), -448.0);
        // Subnormals: quantum 2^-9.
        assert_eq!(E4m3.round(2f32.powi(-9)), 2f32.powi(-9));
        assert_eq!(E4m3.round(2f32.powi(-11)), 0.0);
        assert_eq!(E4m3.round(3.0 * 2f32.powi(-10)), 2.0 * 2f32.powi(-9));
        assert!(E4m3.round(f32::NAN).is_nan());
    }

    #[test]
    fn e5m2_grid() {
        assert_eq!(E5m2.round(1.1), 1.0);
        assert_eq!(E5m2.round(1.2), 1.25);
        assert_eq!(E5m2.round(1.375), 1.5); // tie between 1.25 and 1.5: to even (1.5)
        assert_eq!(E5m2.round(60000.0), 57344.0);
        assert_eq!(E5m2.round(2f32.powi(-16)), 2f32.powi(-16));
    }

    #[test]
    fn scale_keeps_amax_in_range_and_is_exact_power_of_two() {
        for &amax in &[1e-30f32, 1e-3, 0.5, 1.0, 3.7, 448.0, 449.0, 1e5, 7e37] {
            for f in [E4m3, E5m2] {
                let e = f.scale_exp(amax);
                let scaled = amax as f64 * (e as f64).exp2();
                if e.abs() < super::SCALE_EXP_LIMIT {
                    assert!(scaled <= f.max_finite() as f64, "{amax} {e}");
                    assert!(scaled * 2.0 > f.max_finite() as f64, "{amax} {e}");
                }
            }
        }
        assert_eq!(E4m3.scale_exp(448.0), 0);
        assert_eq!(E4m3.scale_exp(224.0), 1);
        assert_eq!(E4m3.scale_exp(224.1), 0);
        assert_eq!(E4m3.scale_exp(0.0), 0);
        assert_eq!(E4m3.scale_exp(f32::INFINITY), 0);
        // Subnormal amax.
        assert_eq!(E4m3.scale_exp(f32::from_bits(1)), super::SCALE_EXP_LIMIT);
    }

    #[test]
    fn quantize_dequantize_is_exact_on_the_grid() {
        let e = E4m3.scale_exp(0.02);
        let y = E4m3.quantize_dequantize(0.013, e);
        // y * 2^e is on the e4m3 grid, and within half a quantum of 0.013 * 2^e.
        let s = (e as f32).exp2();
        assert_eq!(E4m3.round(y * s), y * s);
        assert!((y - 0.013).abs() <= 0.013 / 16.0);
    }
}

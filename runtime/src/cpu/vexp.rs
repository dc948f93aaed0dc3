//! AVX-512 row primitives for the fused softmax / cross-entropy kernels in f32: the row
//! max and `sum(exp(x - m))`. Rust's scalar `f32::exp` is a libm call per element, and
//! the cross-entropy over a 32k vocabulary runs it on every logit twice a step; 16 lanes
//! at a time it is an order of magnitude cheaper.
//!
//! `exp` is the Cephes polynomial on `r = x - n ln2` (`|r| <= ln2 / 2`), scaled by `2^n`
//! with `vscalefps` (which underflows to zero and denormals correctly); about 1 ulp, as
//! PyTorch's vectorized (Sleef) exp. NaN propagates. Without AVX-512F (checked at run
//! time, as for [`super::sgemm`]) the scalar loops run.
//!
//! Safety: the intrinsics run only after the feature check; tails use masked loads and
//! stores, which touch no lane outside the slice.

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
use super::sgemm::avx512;

/// The row max; NaN when the row has one; -inf for an empty row.
pub(crate) fn max(r: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F detected.
        return unsafe { max_avx512(r) };
    }
    r.iter().fold(
        f32::NEG_INFINITY,
        |m, &x| if x > m || x.is_nan() { x } else { m },
    )
}

/// `sum(exp(r - m))`, also writing each `exp(r[i] - m)` to `out[i]` when given (`out`
/// as long as `r`).
pub(crate) fn exp_sum(r: &[f32], m: f32, out: Option<&mut [f32]>) -> f32 {
    if let Some(o) = &out {
        assert_eq!(o.len(), r.len());
    }
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F detected; out (when given) is as long as r.
        return unsafe { exp_sum_avx512(r, m, out.map(|o| o.as_mut_ptr())) };
    }
    match out {
        Some(o) => o.iter_mut().zip(r).fold(0.0, |s, (o, &x)| {
            *o = (x - m).exp();
            s + *o
        }),
        None => r.iter().fold(0.0, |s, &x| s + (x - m).exp()),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn max_avx512(r: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut nan: __mmask16 = 0;
    for c in r.chunks(16) {
        let k: __mmask16 = if c.len() == 16 {
            0xffff
        } else {
            ((1u32 << c.len()) - 1) as u16
        };
        // SAFETY: the mask keeps to the chunk's elements.
        let v = unsafe { _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), k, c.as_ptr()) };
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        acc = _mm512_max_ps(acc, v);
    }
    if nan != 0 {
        f32::NAN
    } else {
        _mm512_reduce_max_ps(acc)
    }
}

/// `exp(x)` of 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // below -104 the result is 0 in f32 (scalef underflows), above 88.7 inf; max(lo, x)
    // and min(hi, .) return x when it is NaN
    let x = _mm512_min_ps(
        _mm512_set1_ps(88.8),
        _mm512_max_ps(_mm512_set1_ps(-104.0), x),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let y = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_scalef_ps(y, n)
}

/// # Safety
/// `out`, when given, points at `r.len()` writable floats that nothing else accesses.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_avx512(r: &[f32], m: f32, out: Option<*mut f32>) -> f32 {
    use std::arch::x86_64::*;
    let vm = _mm512_set1_ps(m);
    let mut acc = _mm512_setzero_ps();
    for (i, c) in r.chunks(16).enumerate() {
        let k: __mmask16 = if c.len() == 16 {
            0xffff
        } else {
            ((1u32 << c.len()) - 1) as u16
        };
        // SAFETY: the mask keeps to the chunk's elements, of r and of out alike.
        unsafe {
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, c.as_ptr()), vm));
            acc = _mm512_mask_add_ps(acc, k, acc, e);
            if let Some(o) = out {
                _mm512_mask_storeu_ps(o.add(i * 16), k, e);
            }
        }
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let xs: Vec<f32> = (0..2000)
            .map(|i| -110.0 + i as f32 * 0.099)
            .chain([0.0, -0.0, f32::NEG_INFINITY, -1e-30, 88.0])
            .collect();
        let mut out = vec![0f32; xs.len()];
        exp_sum(&xs, 0.0, Some(&mut out));
        for (&x, &o) in xs.iter().zip(&out) {
            let w = (x as f64).exp();
            let ulp = f32::EPSILON as f64 * w.max(f32::MIN_POSITIVE as f64);
            assert!(
                (o as f64 - w).abs() <= 2.0 * ulp + 1.5e-45,
                "exp({x}) = {o}, want {w}"
            );
        }
        // the sum, shifted to stay finite in f32
        let want_s: f64 = xs.iter().map(|&x| (x as f64 - 88.0).exp()).sum();
        let s = exp_sum(&xs, 88.0, None) as f64;
        assert!((s - want_s).abs() <= 1e-5 * want_s, "{s} vs {want_s}");
        // tails of every length, NaN propagation, max
        for n in 0..40 {
            let r: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
            let m = max(&r);
            assert_eq!(m, r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
            let want: f32 = r.iter().map(|&x| (x - m).exp()).sum();
            assert!((exp_sum(&r, m, None) - want).abs() <= 1e-5 * want.max(1.0));
        }
        let mut r = vec![1.0f32; 21];
        r[19] = f32::NAN;
        assert!(max(&r).is_nan());
        assert!(exp_sum(&r, 0.0, None).is_nan());
    }
}

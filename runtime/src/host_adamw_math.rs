//! The host optimizer's arithmetic: AdamW over f32 master weights and moments in host
//! memory, with the gradient read and the parameter written in f32, bf16 or f16. The
//! CUDA runtime's `host_adamw` (`--offload-optimizer`) runs it on its pinned buffers;
//! it needs no GPU, so it is tested and benchmarked here (`cargo bench -p weft-runtime
//! --bench host_adamw`).
//!
//! Each element is the CPU reference's `host_adamw` in f32, operation for operation
//! (candle's `affine` is `x * mul + add` with both constants rounded to f32, `+ 0.0`
//! included, which turns `-0.0` into `+0.0`), so master weights and moments are
//! bit-identical to the CPU reference run at f32 precision; the parameter is the new
//! master rounded to its dtype (round to nearest even). The loop works in chunks copied
//! to the stack: the dtype is decided once a chunk, the conversions and the update run
//! over plain arrays the compiler vectorizes, and outputs may alias inputs (the plan
//! updates state in place) because a chunk is read whole before it is written.

use half::slice::HalfFloatSliceExt;
use weft_ir::DType;

/// Elements per chunk: four f32 arrays of this size stay in L1.
const CHUNK: usize = 512;

/// A host address the update reads or writes, with its element type.
#[derive(Clone, Copy, Debug)]
pub struct HostSpan {
    pub ptr: u64,
    pub dtype: DType,
}

/// What one update reads and writes: `n` elements in each span. Master weights and
/// moments are f32; the gradient and the parameter f32, bf16 or f16.
#[derive(Clone, Copy, Debug)]
pub struct AdamWSpans {
    pub master: HostSpan,
    pub grad: HostSpan,
    pub m: HostSpan,
    pub v: HostSpan,
    pub out_master: HostSpan,
    pub out_m: HostSpan,
    pub out_v: HostSpan,
    pub out_param: HostSpan,
}

impl AdamWSpans {
    /// Each span with its name, as errors say it.
    pub fn named(&self) -> [(&'static str, HostSpan); 8] {
        [
            ("master", self.master),
            ("gradient", self.grad),
            ("m", self.m),
            ("v", self.v),
            ("new master", self.out_master),
            ("new m", self.out_m),
            ("new v", self.out_v),
            ("parameter", self.out_param),
        ]
    }

    /// The first span whose dtype the update does not read or write, with what it
    /// takes there: master weights and moments f32, the gradient and the parameter f32,
    /// bf16 or f16.
    pub fn unsupported_dtype(&self) -> Option<(&'static str, DType, &'static str)> {
        let state = [
            ("master", self.master),
            ("m", self.m),
            ("v", self.v),
            ("new master", self.out_master),
            ("new m", self.out_m),
            ("new v", self.out_v),
        ];
        let io = [("gradient", self.grad), ("parameter", self.out_param)];
        let f32_state = "the host optimizer keeps master weights and moments in f32";
        state
            .into_iter()
            .find(|(_, s)| s.dtype != DType::F32)
            .map(|(what, s)| (what, s.dtype, f32_state))
            .or_else(|| {
                io.into_iter()
                    .find(|(_, s)| !matches!(s.dtype, DType::F32 | DType::BF16 | DType::F16))
                    .map(|(what, s)| (what, s.dtype, "f32, bf16 or f16"))
            })
    }
}

/// The update's constants at step `t`, rounded to f32 as the CPU reference rounds them.
#[derive(Clone, Copy, Debug)]
pub struct AdamWConstants {
    decay: f32,
    b1: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    inv_c2: f32,
    eps: f32,
    lr_over_c1: f32,
}

impl AdamWConstants {
    /// `hyper` is `[lr, beta1, beta2, eps, weight_decay]`; `warmup` scales lr linearly
    /// over its first steps (`lr * min(1, t / warmup)`); `t` counts updates from 1.
    pub fn new(hyper: [f64; 5], warmup: Option<i64>, t: f64) -> AdamWConstants {
        let [lr, beta1, beta2, eps, weight_decay] = hyper;
        let (c1, c2) = (1.0 - beta1.powf(t), 1.0 - beta2.powf(t));
        let lr = match warmup {
            Some(w) if w > 0 => lr * (t / w as f64).min(1.0),
            _ => lr,
        };
        AdamWConstants {
            decay: (1.0 - lr * weight_decay) as f32,
            b1: beta1 as f32,
            one_minus_b1: (1.0 - beta1) as f32,
            b2: beta2 as f32,
            one_minus_b2: (1.0 - beta2) as f32,
            inv_c2: (1.0 / c2) as f32,
            eps: eps as f32,
            lr_over_c1: (lr / c1) as f32,
        }
    }

    /// One element: the CPU reference's `adamw` (runtime/src/cpu/backward_kernels.rs),
    /// each candle op in turn. Returns the new (master, m, v).
    #[inline(always)]
    pub fn update(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let p = p * self.decay + 0.0;
        let m = (m * self.b1 + 0.0) + (g * self.one_minus_b1 + 0.0);
        let v = (v * self.b2 + 0.0) + ((g * g) * self.one_minus_b2 + 0.0);
        let denom = (v * self.inv_c2 + 0.0).sqrt() * 1.0 + self.eps;
        let upd = (m * self.lr_over_c1 + 0.0) / denom;
        (p - upd, m, v)
    }
}

/// Updates elements `lo..hi` of `s`.
///
/// # Safety
/// Every span of `s` holds at least `hi` elements of its dtype, which
/// [`AdamWSpans::unsupported_dtype`] accepts, and is valid for reads
/// (inputs) or writes (outputs) for the call, and nothing else touches `lo..hi`
/// meanwhile. An output may be the same memory as an input; outputs do not overlap
/// each other, and no span overlaps another at a different offset.
pub unsafe fn adamw_range(s: &AdamWSpans, k: &AdamWConstants, lo: usize, hi: usize) {
    let mut p = [0f32; CHUNK];
    let mut g = [0f32; CHUNK];
    let mut m = [0f32; CHUNK];
    let mut v = [0f32; CHUNK];
    let mut i = lo;
    while i < hi {
        let n = CHUNK.min(hi - i);
        read_f32(s.master, i, &mut p[..n]);
        read_f32(s.m, i, &mut m[..n]);
        read_f32(s.v, i, &mut v[..n]);
        read_float(s.grad, i, &mut g[..n]);
        update_chunk(k, &mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
        write_f32(s.out_master, i, &p[..n]);
        write_f32(s.out_m, i, &m[..n]);
        write_f32(s.out_v, i, &v[..n]);
        write_float(s.out_param, i, &p[..n]);
        i += n;
    }
}

/// The update over one chunk, in place: plain slices, so the loop vectorizes.
#[inline(always)]
fn update_chunk(k: &AdamWConstants, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for j in 0..n {
        let (np, nm, nv) = k.update(p[j], g[j], m[j], v[j]);
        p[j] = np;
        m[j] = nm;
        v[j] = nv;
    }
}

/// # Safety
/// `s` holds f32 elements `i..i + out.len()`, readable.
#[inline(always)]
unsafe fn read_f32(s: HostSpan, i: usize, out: &mut [f32]) {
    out.copy_from_slice(std::slice::from_raw_parts(
        (s.ptr as *const f32).add(i),
        out.len(),
    ));
}

/// # Safety
/// `s` holds f32 elements `i..i + x.len()`, writable.
#[inline(always)]
unsafe fn write_f32(s: HostSpan, i: usize, x: &[f32]) {
    std::slice::from_raw_parts_mut((s.ptr as *mut f32).add(i), x.len()).copy_from_slice(x);
}

/// # Safety
/// `s` holds elements `i..i + out.len()` of its dtype (f32, bf16 or f16), readable.
#[inline(always)]
unsafe fn read_float(s: HostSpan, i: usize, out: &mut [f32]) {
    let n = out.len();
    match s.dtype {
        DType::BF16 => std::slice::from_raw_parts((s.ptr as *const half::bf16).add(i), n)
            .convert_to_f32_slice(out),
        DType::F16 => std::slice::from_raw_parts((s.ptr as *const half::f16).add(i), n)
            .convert_to_f32_slice(out),
        // f32: the only other dtype `unsupported_dtype` lets through.
        _ => read_f32(s, i, out),
    }
}

/// # Safety
/// `s` holds elements `i..i + x.len()` of its dtype (f32, bf16 or f16), writable.
#[inline(always)]
unsafe fn write_float(s: HostSpan, i: usize, x: &[f32]) {
    let n = x.len();
    match s.dtype {
        DType::BF16 => std::slice::from_raw_parts_mut((s.ptr as *mut half::bf16).add(i), n)
            .convert_from_f32_slice(x),
        DType::F16 => std::slice::from_raw_parts_mut((s.ptr as *mut half::f16).add(i), n)
            .convert_from_f32_slice(x),
        // f32, as in `read_float`.
        _ => write_f32(s, i, x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32
                    / (1u32 << 24) as f32;
                (x - 0.5) * scale
            })
            .collect()
    }

    /// Dtypes the loop does not read are named, span by span; the ones it does pass.
    #[test]
    fn unsupported_dtypes_are_named() {
        let span = |dtype| HostSpan { ptr: 0, dtype };
        let s = |grad, param, v| AdamWSpans {
            master: span(DType::F32),
            grad: span(grad),
            m: span(DType::F32),
            v: span(v),
            out_master: span(DType::F32),
            out_m: span(DType::F32),
            out_v: span(DType::F32),
            out_param: span(param),
        };
        for d in [DType::F32, DType::BF16, DType::F16] {
            assert_eq!(s(d, d, DType::F32).unsupported_dtype(), None);
        }
        assert_eq!(
            s(DType::I64, DType::BF16, DType::F32).unsupported_dtype(),
            Some(("gradient", DType::I64, "f32, bf16 or f16"))
        );
        assert_eq!(
            s(DType::F32, DType::F64, DType::F32)
                .unsupported_dtype()
                .map(|x| x.0),
            Some("parameter")
        );
        assert_eq!(
            s(DType::F32, DType::F32, DType::BF16)
                .unsupported_dtype()
                .map(|x| (x.0, x.1)),
            Some(("v", DType::BF16))
        );
    }

    /// The element update against candle's f32 ops, the CPU reference's code path.
    #[test]
    fn the_update_is_the_cpu_references_bit_for_bit() {
        use candle_core::{Device, Tensor};
        let n = 257;
        let (p, g, m) = (values(n, 1, 2.0), values(n, 2, 0.1), values(n, 3, 0.01));
        let v: Vec<f32> = values(n, 4, 0.001).iter().map(|x| x.abs()).collect();
        let hyper = [1e-3, 0.9, 0.95, 1e-8, 0.1];
        let t = 3.0;
        let dev = Device::Cpu;
        let tt = |x: &Vec<f32>| Tensor::from_slice(x, n, &dev).unwrap();
        let step = Tensor::new(t as f32, &dev).unwrap();
        let (wp, wm, wv) =
            crate::cpu::host_adamw_reference(&tt(&p), &tt(&g), &tt(&m), &tt(&v), &step, hyper)
                .unwrap();
        let k = AdamWConstants::new(hyper, None, t);
        let (wp, wm, wv) = (
            wp.to_vec1::<f32>().unwrap(),
            wm.to_vec1::<f32>().unwrap(),
            wv.to_vec1::<f32>().unwrap(),
        );
        for i in 0..n {
            let (np, nm, nv) = k.update(p[i], g[i], m[i], v[i]);
            assert_eq!(
                (np.to_bits(), nm.to_bits(), nv.to_bits()),
                (wp[i].to_bits(), wm[i].to_bits(), wv[i].to_bits()),
                "element {i}"
            );
        }
    }

    /// The chunked loop, in place (outputs over inputs, as the plan runs it) and across
    /// chunk boundaries, against the element update and half's scalar conversions, for
    /// each gradient and parameter dtype; the values include zeros, -0.0, subnormals,
    /// infinities and NaN so the conversions' edge cases are covered.
    #[test]
    fn chunks_in_place_match_the_element_update() {
        let n = 2 * CHUNK + 37;
        let mut specials = vec![0.0, -0.0, 1e-40, -1e-41, f32::INFINITY, f32::NAN, 65504.0];
        specials.extend(values(n - specials.len(), 9, 3.0));
        for (gd, pd) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::F16, DType::F16),
            (DType::F32, DType::BF16),
        ] {
            let p0 = values(n, 1, 2.0);
            let g0 = specials.clone();
            let m0 = values(n, 3, 0.01);
            let v0: Vec<f32> = values(n, 4, 0.001).iter().map(|x| x.abs()).collect();
            let k = AdamWConstants::new([1e-3, 0.9, 0.95, 1e-8, 0.1], Some(4), 2.0);
            let g_as = |d: DType| -> Vec<u8> {
                match d {
                    DType::BF16 => g0
                        .iter()
                        .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                        .collect(),
                    DType::F16 => g0
                        .iter()
                        .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
                        .collect(),
                    _ => g0.iter().flat_map(|x| x.to_le_bytes()).collect(),
                }
            };
            let mut gbytes = g_as(gd);
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let mut param = vec![0u8; n * pd.size_bytes() as usize];
            let span = |ptr: *mut u8, dtype| HostSpan {
                ptr: ptr as u64,
                dtype,
            };
            let s = AdamWSpans {
                master: span(p.as_mut_ptr() as *mut u8, DType::F32),
                grad: span(gbytes.as_mut_ptr(), gd),
                m: span(m.as_mut_ptr() as *mut u8, DType::F32),
                v: span(v.as_mut_ptr() as *mut u8, DType::F32),
                out_master: span(p.as_mut_ptr() as *mut u8, DType::F32),
                out_m: span(m.as_mut_ptr() as *mut u8, DType::F32),
                out_v: span(v.as_mut_ptr() as *mut u8, DType::F32),
                out_param: span(param.as_mut_ptr(), pd),
            };
            // Two calls split inside a chunk, as two threads' ranges would be.
            unsafe {
                adamw_range(&s, &k, 0, CHUNK + 5);
                adamw_range(&s, &k, CHUNK + 5, n);
            }
            for i in 0..n {
                let g = match gd {
                    DType::BF16 => half::bf16::from_f32(g0[i]).to_f32(),
                    DType::F16 => half::f16::from_f32(g0[i]).to_f32(),
                    _ => g0[i],
                };
                let (np, nm, nv) = k.update(p0[i], g, m0[i], v0[i]);
                let want = (np.to_bits(), nm.to_bits(), nv.to_bits());
                assert_eq!(
                    (p[i].to_bits(), m[i].to_bits(), v[i].to_bits()),
                    want,
                    "{gd}/{pd} element {i}"
                );
                let got_param = match pd {
                    DType::BF16 => u16::from_le_bytes([param[2 * i], param[2 * i + 1]]) as u32,
                    DType::F16 => u16::from_le_bytes([param[2 * i], param[2 * i + 1]]) as u32,
                    _ => u32::from_le_bytes(param[4 * i..4 * i + 4].try_into().unwrap()),
                };
                let want_param = match pd {
                    DType::BF16 => half::bf16::from_f32(np).to_bits() as u32,
                    DType::F16 => half::f16::from_f32(np).to_bits() as u32,
                    _ => np.to_bits(),
                };
                assert_eq!(got_param, want_param, "{gd}/{pd} parameter element {i}");
            }
        }
    }
}

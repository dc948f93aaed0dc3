//! The host optimizer update (`host_adamw`, `--offload-optimizer`) on CUDA.
//!
//! The plan keeps the f32 master weights and Adam moments in pinned host memory (its
//! `Host` buffers); a parameter's gradient reaches the host by an `offload` copy on the
//! device-to-host stream, the update runs on the host, and the parameter in its own dtype
//! goes back by a `reload` on the host-to-device stream. This module is the middle part:
//! each `host_adamw` instruction becomes a copy of the step counter into a pinned scalar
//! and a host function (`cuLaunchHostFunc`) on the plan's host stream, ordered after the
//! gradient's copy by the plan's events. The host function splits the update over several
//! threads while the device keeps running the rest of the backward, so per-bucket copies
//! overlap with the host arithmetic. In a step replayed as a CUDA graph the host function
//! is a host node of the graph, run in the same order; it makes no CUDA calls, which both
//! require.
//!
//! The arithmetic is the CPU reference's `host_adamw` in f32, operation for operation
//! (candle's `affine` is `x * mul + add` with both constants rounded to f32, `+ 0.0`
//! included, which turns `-0.0` into `+0.0`), so master weights and moments are
//! bit-identical to the CPU reference run at f32 precision; the parameter copy is the
//! new master rounded to its dtype (round to nearest even).

use super::device::{Gpu, Pinned};
use super::error::{CudaError, CudaResult};
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use weft_ir::DType;

/// No error; the step counter was below 1; a dtype the loop does not read.
const OK: u32 = 0;
const BAD_STEP: u32 = 1;

/// Elements per thread below which more threads do not pay for their start.
const MIN_PER_THREAD: usize = 1 << 16;

/// A host address the update reads or writes (pinned memory the plan sized).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostSpan {
    pub ptr: u64,
    pub dtype: DType,
}

/// One `host_adamw` instruction, lowered: what its host function reads and writes.
#[derive(Debug)]
pub(crate) struct HostAdamW {
    pub master: HostSpan,
    pub grad: HostSpan,
    pub m: HostSpan,
    pub v: HostSpan,
    pub out_master: HostSpan,
    pub out_m: HostSpan,
    pub out_v: HostSpan,
    pub out_param: HostSpan,
    pub n: usize,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Linear learning-rate warmup in steps (`lr * min(1, t / warmup)`).
    pub warmup: Option<i64>,
    /// The step counter, copied from the device before the update (8 pinned bytes).
    step: PinnedScalar,
    step_dtype: DType,
    threads: usize,
    /// [`OK`] or why the last update did nothing (read after the step).
    status: AtomicU32,
    /// The step value the last failed update saw (f64 bits).
    seen_step: std::sync::atomic::AtomicU64,
    /// Where the instruction came from, for errors.
    pub location: String,
}

/// A pinned 8-byte scalar (the step counter's copy); freed with the job.
struct PinnedScalar(Pinned);

impl std::fmt::Debug for PinnedScalar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedScalar({:p})", self.0.ptr)
    }
}
// SAFETY: the pointer is a pinned host allocation owned by this value; the host
// function reads it only after the stream-ordered copy into it has completed, and the
// executor never writes it from another thread meanwhile.
unsafe impl Send for PinnedScalar {}
unsafe impl Sync for PinnedScalar {}

impl HostAdamW {
    /// Checks the operand dtypes (float master/moments in f32, grad and param f32, bf16
    /// or f16) and allocates the step scalar.
    pub fn new(
        gpu: &Gpu,
        spans: [HostSpan; 8],
        n: usize,
        step_dtype: DType,
        hyper: [f64; 5],
        location: String,
    ) -> CudaResult<HostAdamW> {
        let [master, grad, m, v, out_master, out_m, out_v, out_param] = spans;
        for (what, s) in [
            ("master", master),
            ("m", m),
            ("v", v),
            ("new master", out_master),
            ("new m", out_m),
            ("new v", out_v),
        ] {
            if s.dtype != DType::F32 {
                return Err(CudaError::unsupported(
                    format!("a host AdamW {what} in {}", s.dtype),
                    location.clone(),
                    "the host optimizer keeps master weights and moments in f32",
                ));
            }
        }
        for (what, s) in [("gradient", grad), ("parameter", out_param)] {
            if !matches!(s.dtype, DType::F32 | DType::BF16 | DType::F16) {
                return Err(CudaError::unsupported(
                    format!("a host AdamW {what} in {}", s.dtype),
                    location.clone(),
                    "f32, bf16 or f16",
                ));
            }
        }
        // The host function dereferences every span: each must be host memory (the
        // plan's pinned `Host` buffers), never a device address.
        for (what, s) in [
            ("master", master),
            ("gradient", grad),
            ("m", m),
            ("v", v),
            ("new master", out_master),
            ("new m", out_m),
            ("new v", out_v),
            ("parameter", out_param),
        ] {
            if n > 0 && !is_host_memory(s.ptr) {
                return Err(CudaError::Plan(format!(
                    "host_adamw at {location}: its {what} is not in host memory (the plan must place a host update's operands and results in its pinned host buffers)"
                )));
            }
        }
        if !matches!(step_dtype, DType::F32 | DType::F64) {
            return Err(CudaError::unsupported(
                format!("a host AdamW step counter in {step_dtype}"),
                location.clone(),
                "an f32 or f64 scalar",
            ));
        }
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 32);
        let [lr, beta1, beta2, eps, weight_decay] = hyper;
        Ok(HostAdamW {
            master,
            grad,
            m,
            v,
            out_master,
            out_m,
            out_v,
            out_param,
            n,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup: None,
            step: PinnedScalar(gpu.alloc_pinned(8)?),
            step_dtype,
            threads,
            status: AtomicU32::new(OK),
            seen_step: Default::default(),
            location,
        })
    }

    /// Where the step counter is copied to before the update.
    pub fn step_ptr(&self) -> u64 {
        self.step.0.ptr as u64
    }

    /// Enqueues the update on `stream` (after everything enqueued there before it).
    pub fn enqueue(self: &Arc<Self>, stream: sys::CUstream) -> CudaResult<()> {
        // SAFETY: the job outlives every step that enqueues it (the executor owns the
        // Arc in its steps and synchronizes before dropping them); the callback makes
        // no CUDA calls.
        unsafe {
            sys::cuLaunchHostFunc(
                stream,
                Some(run_host_adamw),
                Arc::as_ptr(self) as *mut std::ffi::c_void,
            )
        }
        .result()
        .map_err(|e| CudaError::driver("cuLaunchHostFunc (host AdamW)", e))
    }

    /// The error of the last update, if it refused to run.
    pub fn take_error(&self) -> Option<CudaError> {
        match self.status.swap(OK, Ordering::AcqRel) {
            OK => None,
            _ => Some(CudaError::BadData {
                after: self.location.clone(),
                message: format!(
                    "step must be at least 1 (it counts the updates, the first is 1), got {}",
                    f64::from_bits(self.seen_step.load(Ordering::Acquire))
                ),
            }),
        }
    }

    fn step_value(&self) -> f64 {
        // SAFETY: 8 pinned bytes, written by the completed copy before this runs.
        unsafe {
            match self.step_dtype {
                DType::F64 => std::ptr::read(self.step.0.ptr as *const f64),
                _ => std::ptr::read(self.step.0.ptr as *const f32) as f64,
            }
        }
    }

    /// The update on this thread and `threads - 1` others, each over a contiguous range.
    fn run(&self) {
        let t = self.step_value();
        if t.is_nan() || t < 1.0 {
            self.seen_step.store(t.to_bits(), Ordering::Release);
            self.status.store(BAD_STEP, Ordering::Release);
            return;
        }
        let k = Constants::new(self, t);
        let threads = self.threads.min(self.n.div_ceil(MIN_PER_THREAD)).max(1);
        let per = self.n.div_ceil(threads);
        std::thread::scope(|s| {
            for i in 1..threads {
                let (lo, hi) = (i * per, ((i + 1) * per).min(self.n));
                if lo < hi {
                    let k = &k;
                    s.spawn(move || self.range(k, lo, hi));
                }
            }
            self.range(&k, 0, per.min(self.n));
        });
    }

    /// Elements `lo..hi`; reads and writes through raw pointers because the new values
    /// may be written over the old ones (the plan updates state in place), element by
    /// element after reading it.
    fn range(&self, k: &Constants, lo: usize, hi: usize) {
        let f32s = |s: HostSpan| s.ptr as *mut f32;
        let (p0, m0, v0) = (f32s(self.master), f32s(self.m), f32s(self.v));
        let (p1, m1, v1) = (f32s(self.out_master), f32s(self.out_m), f32s(self.out_v));
        for i in lo..hi {
            // SAFETY: `i < n`, and every span holds `n` elements of its dtype (checked
            // against the plan's buffer sizes when lowered); ranges are disjoint.
            unsafe {
                let g = read_float(self.grad, i);
                let (p, m, v) = (*p0.add(i), *m0.add(i), *v0.add(i));
                let (np, nm, nv) = k.update(p, g, m, v);
                *p1.add(i) = np;
                *m1.add(i) = nm;
                *v1.add(i) = nv;
                write_float(self.out_param, i, np);
            }
        }
    }
}

/// The update's constants, rounded to f32 as the CPU reference rounds them.
struct Constants {
    decay: f32,
    b1: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    inv_c2: f32,
    eps: f32,
    lr_over_c1: f32,
}

impl Constants {
    fn new(j: &HostAdamW, t: f64) -> Constants {
        let (c1, c2) = (1.0 - j.beta1.powf(t), 1.0 - j.beta2.powf(t));
        let lr = match j.warmup {
            Some(w) if w > 0 => j.lr * (t / w as f64).min(1.0),
            _ => j.lr,
        };
        Constants {
            decay: (1.0 - lr * j.weight_decay) as f32,
            b1: j.beta1 as f32,
            one_minus_b1: (1.0 - j.beta1) as f32,
            b2: j.beta2 as f32,
            one_minus_b2: (1.0 - j.beta2) as f32,
            inv_c2: (1.0 / c2) as f32,
            eps: j.eps as f32,
            lr_over_c1: (lr / c1) as f32,
        }
    }

    /// One element: the CPU reference's `adamw` (runtime/src/cpu/backward_kernels.rs),
    /// each candle op in turn.
    #[inline(always)]
    fn update(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let p = p * self.decay + 0.0;
        let m = (m * self.b1 + 0.0) + (g * self.one_minus_b1 + 0.0);
        let v = (v * self.b2 + 0.0) + ((g * g) * self.one_minus_b2 + 0.0);
        let denom = (v * self.inv_c2 + 0.0).sqrt() * 1.0 + self.eps;
        let upd = (m * self.lr_over_c1 + 0.0) / denom;
        (p - upd, m, v)
    }
}

/// Whether `ptr` is host memory the driver knows (pinned), by its pointer attribute.
fn is_host_memory(ptr: u64) -> bool {
    if ptr == 0 {
        return false;
    }
    let mut kind: u32 = 0;
    // SAFETY: a 4-byte out value for CU_POINTER_ATTRIBUTE_MEMORY_TYPE.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            &mut kind as *mut u32 as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        )
    };
    r.result().is_ok() && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

/// # Safety
/// `s.ptr` holds at least `i + 1` elements of `s.dtype` (f32, bf16 or f16).
#[inline(always)]
unsafe fn read_float(s: HostSpan, i: usize) -> f32 {
    match s.dtype {
        DType::BF16 => half::bf16::from_bits(*(s.ptr as *const u16).add(i)).to_f32(),
        DType::F16 => half::f16::from_bits(*(s.ptr as *const u16).add(i)).to_f32(),
        _ => *(s.ptr as *const f32).add(i),
    }
}

/// # Safety
/// As [`read_float`], for writing.
#[inline(always)]
unsafe fn write_float(s: HostSpan, i: usize, x: f32) {
    match s.dtype {
        DType::BF16 => *(s.ptr as *mut u16).add(i) = half::bf16::from_f32(x).to_bits(),
        DType::F16 => *(s.ptr as *mut u16).add(i) = half::f16::from_f32(x).to_bits(),
        _ => *(s.ptr as *mut f32).add(i) = x,
    }
}

/// The host function `cuLaunchHostFunc` calls: `data` is a live `HostAdamW`.
unsafe extern "C" fn run_host_adamw(data: *mut std::ffi::c_void) {
    let job = &*(data as *const HostAdamW);
    // A panic must not unwind into the driver's thread.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run())).is_err() {
        job.status.store(BAD_STEP, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The element update against candle's f32 ops, the CPU reference's code path.
    #[test]
    fn the_update_is_the_cpu_references_bit_for_bit() {
        use candle_core::{Device, Tensor};
        let n = 257;
        let mk = |seed: u32, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32
                        / (1u32 << 24) as f32;
                    (x - 0.5) * scale
                })
                .collect()
        };
        let (p, g, m) = (mk(1, 2.0), mk(2, 0.1), mk(3, 0.01));
        let v: Vec<f32> = mk(4, 0.001).iter().map(|x| x.abs()).collect();
        let (lr, b1, b2, eps, wd, t) = (1e-3, 0.9, 0.95, 1e-8, 0.1, 3.0);
        let dev = Device::Cpu;
        let tt = |x: &Vec<f32>| Tensor::from_slice(x, n, &dev).unwrap();
        let step = Tensor::new(t as f32, &dev).unwrap();
        let (wp, wm, wv) = crate::cpu::host_adamw_reference(
            &tt(&p),
            &tt(&g),
            &tt(&m),
            &tt(&v),
            &step,
            [lr, b1, b2, eps, wd],
        )
        .unwrap();
        let job = HostAdamW {
            master: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            grad: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            m: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            v: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            out_master: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            out_m: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            out_v: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            out_param: HostSpan {
                ptr: 0,
                dtype: DType::F32,
            },
            n,
            lr,
            beta1: b1,
            beta2: b2,
            eps,
            weight_decay: wd,
            warmup: None,
            step: PinnedScalar(Pinned {
                ptr: std::ptr::null_mut(),
                bytes: 0,
            }),
            step_dtype: DType::F32,
            threads: 1,
            status: AtomicU32::new(OK),
            seen_step: Default::default(),
            location: String::new(),
        };
        let k = Constants::new(&job, t);
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
}

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
//! The arithmetic is `crate::host_adamw_math` (the CPU reference's update, bit for bit,
//! in vectorized chunks).

use super::device::{Gpu, Pinned};
use super::error::{CudaError, CudaResult};
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use weft_ir::DType;

pub(crate) use crate::host_adamw_math::HostSpan;
use crate::host_adamw_math::{adamw_range, AdamWConstants, AdamWSpans};

/// No error; the step counter was below 1; a dtype the loop does not read.
const OK: u32 = 0;
const BAD_STEP: u32 = 1;

/// Elements per thread below which more threads do not pay for their start.
const MIN_PER_THREAD: usize = 1 << 16;

/// One `host_adamw` instruction, lowered: what its host function reads and writes.
#[derive(Debug)]
pub(crate) struct HostAdamW {
    spans: AdamWSpans,
    pub n: usize,
    /// `[lr, beta1, beta2, eps, weight_decay]`.
    hyper: [f64; 5],
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
        let spans = AdamWSpans {
            master,
            grad,
            m,
            v,
            out_master,
            out_m,
            out_v,
            out_param,
        };
        if let Some((what, dtype, takes)) = spans.unsupported_dtype() {
            return Err(CudaError::unsupported(
                format!("a host AdamW {what} in {dtype}"),
                location.clone(),
                takes,
            ));
        }
        // The host function dereferences every span: each must be host memory (the
        // plan's pinned `Host` buffers), never a device address.
        for (what, s) in spans.named() {
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
        Ok(HostAdamW {
            spans,
            n,
            hyper,
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
        let k = AdamWConstants::new(self.hyper, self.warmup, t);
        let threads = self.threads.min(self.n.div_ceil(MIN_PER_THREAD)).max(1);
        let per = self.n.div_ceil(threads);
        // SAFETY: every span holds `n` elements of its dtype (checked against the plan's
        // buffer sizes when lowered), in pinned host memory; the ranges are disjoint and
        // the device touches none of these buffers until this host function returns.
        std::thread::scope(|s| {
            for i in 1..threads {
                let (lo, hi) = (i * per, ((i + 1) * per).min(self.n));
                if lo < hi {
                    let k = &k;
                    s.spawn(move || unsafe { adamw_range(&self.spans, k, lo, hi) });
                }
            }
            unsafe { adamw_range(&self.spans, &k, 0, per.min(self.n)) };
        });
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

/// The host function `cuLaunchHostFunc` calls: `data` is a live `HostAdamW`.
unsafe extern "C" fn run_host_adamw(data: *mut std::ffi::c_void) {
    let job = &*(data as *const HostAdamW);
    // A panic must not unwind into the driver's thread.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run())).is_err() {
        job.status.store(BAD_STEP, Ordering::Release);
    }
}

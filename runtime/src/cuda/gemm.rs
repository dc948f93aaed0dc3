//! GEMMs through cuBLASLt, with the matmul descriptor, the four layouts and the chosen
//! algorithm cached per shape (cuBLASLt's heuristic query costs tens of microseconds,
//! more than a small GEMM). Shapes whose row count changes every step (one GEMM per
//! expert of a mixture of experts) reuse the algorithm chosen for their power-of-two
//! row bucket once cuBLASLt's check accepts it for the exact shape, and past
//! [`EXACT_CACHE_LIMIT`] shapes their descriptors are made per call and dropped. bf16/f16 operands accumulate in f32; f32 operands run in
//! full f32 (not TF32) unless TF32 is allowed.
//!
//! Everything here is row-major, as the IR is: `C[b] = op(A[b]) @ op(B[b])` with
//! `A` stored `[m, k]` (or `[k, m]` when `ta`) and `B` stored `[k, n]` (or `[n, k]`
//! when `tb`). cuBLAS is column-major, so it computes `C^T = op(B)^T op(A)^T`.

use super::error::{CudaError, CudaResult, DriverCheck};
use cudarc::cublaslt::{result as lt, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use weft_ir::{DType, Fp8Format};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub dtype: DType,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub ta: bool,
    pub tb: bool,
    pub batch: u64,
    /// Batch strides in elements (0: the operand is shared by every batch entry).
    pub sa: i64,
    pub sb: i64,
    pub sc: i64,
    /// Adds a bias vector of length n (epilogue).
    pub bias: bool,
    /// Accumulates into C (beta = 1).
    pub accumulate: bool,
    /// FP8 operands (formats of A and B), each with a dequantizing factor on the device
    /// (`run_fp8`); `dtype` is then C's. cuBLASLt takes them only as A `[m, k]` and B
    /// stored `[n, k]` (`ta` false, `tb` true), with m, n and k multiples of 16.
    pub fp8: Option<(Fp8Format, Fp8Format)>,
}

/// Whether cuBLASLt's FP8 GEMM takes these sizes (its 16-byte alignment rule).
pub fn fp8_sizes_ok(m: u64, n: u64, k: u64) -> bool {
    m.is_multiple_of(16) && n.is_multiple_of(16) && k.is_multiple_of(16) && m > 0 && n > 0 && k > 0
}

fn fp8_dt(f: Fp8Format) -> sys::cudaDataType {
    match f {
        Fp8Format::E4m3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5m2 => sys::cudaDataType::CUDA_R_8F_E5M2,
    }
}

struct Cached {
    desc: sys::cublasLtMatmulDesc_t,
    la: sys::cublasLtMatrixLayout_t,
    lb: sys::cublasLtMatrixLayout_t,
    lc: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// cuBLASLt's ranked candidates still to be timed on first use (`Gemm::tune`);
    /// empty once timed or when the shape is not tuned.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
}

/// GEMMs of at least this many FLOPs are timed over cuBLASLt's top candidates on their
/// first use when tuning is on; smaller ones take the heuristic's first choice.
const TUNE_MIN_FLOPS: f64 = 1e9;
/// How many of cuBLASLt's ranked algorithms are timed.
const TUNE_CANDIDATES: usize = 8;
/// Timed runs per candidate (after one untimed run).
const TUNE_RUNS: usize = 3;

/// Shapes whose descriptors stay cached; past it (a long MoE run meets a new row count
/// per expert and step) they are made for the call and destroyed after it.
const EXACT_CACHE_LIMIT: usize = 4096;

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    pub workspace: super::device::DevBuf,
    cache: HashMap<GemmShape, Cached>,
    /// The algorithm per shape with `m` rounded up to a power of two.
    algos: HashMap<GemmShape, sys::cublasLtMatmulAlgo_t>,
    pub allow_tf32: bool,
    /// The forward FP8 GEMMs without periodic promotion (`Tuning::fp8_fast_accum`).
    pub fp8_fast_accum: bool,
    /// Time cuBLASLt's top candidates on a shape's first eager use and keep the
    /// fastest (`Tuning::gemm_tune`); never while a CUDA graph is being captured.
    pub tune: bool,
    pub capturing: bool,
    pub plans_made: u64,
    /// Shapes timed, shapes where a candidate beat the heuristic's first, and the
    /// seconds spent timing.
    pub tuned: (usize, usize, f64),
}

// SAFETY: used from one thread at a time (the executor's).
unsafe impl Send for Gemm {}

fn dt(d: DType) -> CudaResult<sys::cudaDataType> {
    Ok(match d {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::F64 => sys::cudaDataType::CUDA_R_64F,
        other => {
            return Err(CudaError::unsupported(
                format!("a {other} matmul"),
                "cuBLASLt",
                "matmuls take float operands",
            ))
        }
    })
}

impl Gemm {
    pub fn new(gpu: &super::device::Gpu, workspace_bytes: usize) -> CudaResult<Gemm> {
        let handle = lt::create_handle().ck("cublasLtCreate")?;
        let workspace = gpu.alloc(workspace_bytes, "the cuBLASLt workspace")?;
        Ok(Gemm {
            handle,
            workspace,
            cache: HashMap::new(),
            algos: HashMap::new(),
            allow_tf32: false,
            fp8_fast_accum: false,
            tune: false,
            capturing: false,
            plans_made: 0,
            tuned: (0, 0, 0.0),
        })
    }

    /// The cached plan of `s`, or `None` when the cache is full and `s` is not in it.
    fn plan(&mut self, s: &GemmShape) -> CudaResult<Option<&Cached>> {
        if !self.cache.contains_key(s) {
            if self.cache.len() >= EXACT_CACHE_LIMIT {
                return Ok(None);
            }
            let c = self.make(s)?;
            self.cache.insert(*s, c);
        }
        Ok(self.cache.get(s))
    }

    fn bucket(s: &GemmShape) -> GemmShape {
        GemmShape {
            m: s.m.next_power_of_two(),
            ..*s
        }
    }

    fn make(&mut self, s: &GemmShape) -> CudaResult<Cached> {
        let t = dt(s.dtype)?;
        let compute = match s.dtype {
            DType::F64 => sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
            DType::F32 if self.allow_tf32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let scale = if s.dtype == DType::F64 {
            sys::cudaDataType::CUDA_R_64F
        } else {
            sys::cudaDataType::CUDA_R_32F
        };
        let desc = lt::create_matmul_desc(compute, scale).ck("cublasLtMatmulDescCreate")?;
        // Column-major: D (n x m) = X (n x k) * Y (k x m), X from B's storage, Y from A's.
        let opx: i32 = if s.tb { 1 } else { 0 }; // CUBLAS_OP_T / CUBLAS_OP_N
        let opy: i32 = if s.ta { 1 } else { 0 };
        let set = |attr: sys::cublasLtMatmulDescAttributes_t, p: *const c_void, size: usize| {
            // SAFETY: desc is live; p points at a value of `size` bytes.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, p, size) }
                .ck("cublasLtMatmulDescSetAttribute")
        };
        set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &opx as *const _ as *const c_void,
            std::mem::size_of_val(&opx),
        )?;
        set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &opy as *const _ as *const c_void,
            std::mem::size_of_val(&opy),
        )?;
        if self.fp8_fast_accum && s.fp8 == Some((Fp8Format::E4m3, Fp8Format::E4m3)) {
            // The forward product (e4m3 x e4m3) without cuBLASLt's periodic promotion,
            // as torchao's default recipe runs it; the gradients' GEMMs keep it.
            let fast: i8 = 1;
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                &fast as *const _ as *const c_void,
                1,
            )?;
        }
        if s.bias {
            let epi = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epi as *const _ as *const c_void,
                std::mem::size_of_val(&epi),
            )?;
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                &t as *const _ as *const c_void,
                std::mem::size_of_val(&t),
            )?;
        }
        // Stored shapes (rows x cols, column-major, ld = rows).
        let (xr, xc) = if s.tb { (s.k, s.n) } else { (s.n, s.k) };
        let (yr, yc) = if s.ta { (s.m, s.k) } else { (s.k, s.m) };
        let layout = |t: sys::cudaDataType,
                      r: u64,
                      c: u64,
                      stride: i64|
         -> CudaResult<sys::cublasLtMatrixLayout_t> {
            let l = lt::create_matrix_layout(t, r, c, r as i64).ck("cublasLtMatrixLayoutCreate")?;
            if s.batch > 1 {
                let b = s.batch as i32;
                // SAFETY: l is live; values are i32/i64 as the attributes require.
                unsafe {
                    lt::set_matrix_layout_attribute(
                        l,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &b as *const _ as *const c_void,
                        4,
                    )
                    .ck("cublasLtMatrixLayoutSetAttribute(batch)")?;
                    lt::set_matrix_layout_attribute(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const _ as *const c_void, 8)
                        .ck("cublasLtMatrixLayoutSetAttribute(stride)")?;
                }
            }
            Ok(l)
        };
        let (tx, ty) = match s.fp8 {
            Some((fa, fb)) => (fp8_dt(fb), fp8_dt(fa)),
            None => (t, t),
        };
        let la = layout(tx, xr, xc, s.sb)?;
        let lb = layout(ty, yr, yc, s.sa)?;
        let lc = layout(t, s.n, s.m, s.sc)?;
        let tuned = self.tune && s.fp8.is_none() && Self::flops(s) >= TUNE_MIN_FLOPS;
        // The bucket's algorithm, where cuBLASLt accepts it for this exact shape.
        if let Some(algo) = self.algos.get(&Self::bucket(s)).copied().filter(|_| !tuned) {
            // SAFETY: every descriptor is live; `result` is plain data cuBLASLt fills.
            let ok = unsafe {
                let mut result: sys::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
                sys::cublasLtMatmulAlgoCheck(self.handle, desc, la, lb, lc, lc, &algo, &mut result)
                    == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && result.workspaceSize <= self.workspace.bytes
            };
            if ok {
                return Ok(Cached {
                    desc,
                    la,
                    lb,
                    lc,
                    algo,
                    candidates: Vec::new(),
                });
            }
        }
        self.plans_made += 1;
        let pref = lt::create_matmul_pref().ck("cublasLtMatmulPreferenceCreate")?;
        let ws = self.workspace.bytes as u64;
        // SAFETY: pref is live.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const _ as *const c_void,
                8,
            )
            .ck("cublasLtMatmulPreferenceSetAttribute")?;
        }
        let want = if tuned { TUNE_CANDIDATES } else { 1 };
        // SAFETY: every descriptor is live; `results` has room for `want` entries.
        let (status, results) = unsafe {
            let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
                vec![std::mem::zeroed(); want];
            let mut returned: i32 = 0;
            let status = sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                la,
                lb,
                lc,
                lc,
                pref,
                want as i32,
                results.as_mut_ptr(),
                &mut returned,
            );
            results.truncate(returned.max(0) as usize);
            (status, results)
        };
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let fits: Vec<sys::cublasLtMatmulAlgo_t> = results
            .iter()
            .filter(|r| {
                r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && r.workspaceSize <= self.workspace.bytes
            })
            .map(|r| r.algo)
            .collect();
        let Some(&algo) = fits
            .first()
            .filter(|_| status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        else {
            return Err(CudaError::Cublas {
                call: format!("cublasLtMatmulAlgoGetHeuristic for {s:?}"),
                code: format!("{status:?} ({} candidates)", results.len()),
            });
        };
        self.algos.entry(Self::bucket(s)).or_insert(algo);
        Ok(Cached {
            desc,
            la,
            lb,
            lc,
            algo,
            candidates: if fits.len() > 1 { fits } else { Vec::new() },
        })
    }

    fn flops(s: &GemmShape) -> f64 {
        2.0 * s.m as f64 * s.n as f64 * s.k as f64 * s.batch as f64
    }

    /// Times each of `s`'s candidates writing into a scratch output (the real inputs
    /// are only read, so an accumulating GEMM's addend stays as it was) and keeps the
    /// fastest. Where the scratch cannot be allocated the heuristic's choice stays.
    #[allow(clippy::too_many_arguments)]
    fn tune_shape(
        &mut self,
        s: &GemmShape,
        a: u64,
        b: u64,
        c_in: u64,
        bias: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> CudaResult<()> {
        use cudarc::driver::result as dr;
        let Some(plan) = self.cache.get_mut(s) else {
            return Ok(());
        };
        let candidates = std::mem::take(&mut plan.candidates);
        let first = plan.algo;
        let started = std::time::Instant::now();
        let elem = match s.dtype {
            DType::F64 => 8,
            DType::F32 => 4,
            _ => 2,
        };
        let rows = if s.batch > 1 {
            (s.batch - 1) * s.sc.max(0) as u64 + s.m * s.n
        } else {
            s.m * s.n
        };
        let bytes = (rows * elem) as usize;
        // SAFETY: plain allocation, freed by the DevBuf.
        let Ok(ptr) = (unsafe { dr::malloc_sync(bytes) }) else {
            return Ok(());
        };
        let scratch = super::device::DevBuf { ptr, bytes };
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let (t0, t1) = (
            dr::event::create(flags).ck("cuEventCreate")?,
            dr::event::create(flags).ck("cuEventCreate")?,
        );
        let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
        for algo in candidates {
            let time = |this: &mut Self| -> CudaResult<f32> {
                this.enqueue(s, Some(algo), a, b, c_in, scratch.ptr, bias, stream)?;
                // SAFETY: live events and stream.
                unsafe { dr::event::record(t0, stream) }.ck("cuEventRecord")?;
                for _ in 0..TUNE_RUNS {
                    this.enqueue(s, Some(algo), a, b, c_in, scratch.ptr, bias, stream)?;
                }
                unsafe { dr::event::record(t1, stream) }.ck("cuEventRecord")?;
                unsafe { dr::event::synchronize(t1) }.ck("cuEventSynchronize")?;
                unsafe { dr::event::elapsed(t0, t1) }.ck("cuEventElapsedTime")
            };
            // A candidate cuBLASLt ranks but cannot run here is skipped.
            if let Ok(ms) = time(self) {
                if best.is_none_or(|(b, _)| ms < b) {
                    best = Some((ms, algo));
                }
            }
        }
        // SAFETY: the events are no longer used.
        unsafe {
            let _ = dr::event::destroy(t0);
            let _ = dr::event::destroy(t1);
        }
        drop(scratch);
        if let (Some((_, algo)), Some(plan)) = (best, self.cache.get_mut(s)) {
            plan.algo = algo;
            let changed = algo.data != first.data;
            self.tuned.1 += changed as usize;
        }
        self.tuned.0 += 1;
        self.tuned.2 += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Enqueues `C = op(A) op(B) (+ bias)` (or `C +=` when `accumulate`) on `stream`.
    pub fn run(
        &mut self,
        s: &GemmShape,
        a: u64,
        b: u64,
        c: u64,
        bias: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> CudaResult<()> {
        self.run_into(s, a, b, c, c, bias, stream)
    }

    /// Enqueues `D = op(A) op(B) (+ bias)`, or with `accumulate` `D = op(A) op(B) + C`
    /// (`C` and `D` of one layout; `C` may be `D`).
    #[allow(clippy::too_many_arguments)]
    pub fn run_into(
        &mut self,
        s: &GemmShape,
        a: u64,
        b: u64,
        c_in: u64,
        c: u64,
        bias: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> CudaResult<()> {
        if s.m == 0 || s.n == 0 || s.batch == 0 {
            return Ok(());
        }
        self.plan(s)?;
        let untimed = self.cache.get(s).is_some_and(|p| !p.candidates.is_empty());
        if untimed && !self.capturing {
            self.tune_shape(s, a, b, c_in, bias, stream)?;
        }
        self.enqueue(s, None, a, b, c_in, c, bias, stream)
    }

    /// One `cublasLtMatmul` of `s` with its plan's algorithm or `algo`.
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &mut self,
        s: &GemmShape,
        algo: Option<sys::cublasLtMatmulAlgo_t>,
        a: u64,
        b: u64,
        c_in: u64,
        c: u64,
        bias: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> CudaResult<()> {
        let (ws, wsb, handle) = (self.workspace.ptr, self.workspace.bytes, self.handle);
        let owned;
        let p = match self.plan(s)? {
            Some(p) => p,
            None => {
                owned = OwnedPlan(self.make(s)?);
                &owned.0
            }
        };
        let algo = algo.unwrap_or(p.algo);
        if s.bias {
            // SAFETY: desc is live; the pointer attribute is a device address.
            unsafe {
                lt::set_matmul_desc_attribute(
                    p.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias as *const u64 as *const c_void,
                    8,
                )
                .ck("cublasLtMatmulDescSetAttribute(bias)")?;
            }
        }
        let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let beta32 = if s.accumulate { one32 } else { zero32 };
        let beta64 = if s.accumulate { one64 } else { zero64 };
        let (alpha, beta): (*const c_void, *const c_void) = if s.dtype == DType::F64 {
            (&one64 as *const f64 as _, &beta64 as *const f64 as _)
        } else {
            (&one32 as *const f32 as _, &beta32 as *const f32 as _)
        };
        // SAFETY: all pointers are device buffers sized by the caller for this shape.
        unsafe {
            lt::matmul(
                handle,
                p.desc,
                alpha,
                beta,
                b as *const c_void,
                p.la,
                a as *const c_void,
                p.lb,
                c_in as *const c_void,
                p.lc,
                c as *mut c_void,
                p.lc,
                &algo,
                ws as *mut c_void,
                wsb,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| CudaError::Cublas {
            call: format!("cublasLtMatmul {s:?}"),
            code: format!("{:?}", e.0),
        })
    }

    /// Enqueues an FP8 GEMM `D = (sa * A) (sb * B)^T` (`s.fp8` set, A `[m, k]`, B stored
    /// `[n, k]`), `sa` and `sb` f32 dequantizing factors on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn run_fp8(
        &mut self,
        s: &GemmShape,
        a: u64,
        b: u64,
        scale_a: u64,
        scale_b: u64,
        c: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> CudaResult<()> {
        let p = match self.plan(s)? {
            Some(p) => p.desc,
            None => {
                return Err(CudaError::unsupported(
                    "an FP8 GEMM past the plan cache".to_string(),
                    "cuBLASLt",
                    "FP8 GEMM shapes stay cached".to_string(),
                ))
            }
        };
        // cuBLAS's A is our B (column-major swap), so their scales swap too.
        for (attr, ptr) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                scale_b,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                scale_a,
            ),
        ] {
            // SAFETY: desc is live; the attribute is a device address.
            unsafe {
                lt::set_matmul_desc_attribute(p, attr, &ptr as *const u64 as *const c_void, 8)
                    .ck("cublasLtMatmulDescSetAttribute(scale)")?;
            }
        }
        self.run_into(s, a, b, c, c, 0, stream)
    }

    pub fn cached_shapes(&self) -> usize {
        self.cache.len()
    }
}

impl Cached {
    fn destroy(&self) {
        // SAFETY: created in `make`, destroyed once (by its owner).
        unsafe {
            let _ = lt::destroy_matrix_layout(self.la);
            let _ = lt::destroy_matrix_layout(self.lb);
            let _ = lt::destroy_matrix_layout(self.lc);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A plan made for one call when the cache is full: destroyed after the call is
/// enqueued (cuBLASLt reads the descriptors when the call is made, not when it runs).
struct OwnedPlan(Cached);

impl Drop for OwnedPlan {
    fn drop(&mut self) {
        self.0.destroy();
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        for (_, c) in self.cache.drain() {
            c.destroy();
        }
        // SAFETY: created in `new`.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

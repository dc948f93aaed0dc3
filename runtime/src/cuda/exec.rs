//! The plan executor. At load it allocates the plan's resident region and its arena as
//! one device allocation each (buffers at their planned offsets; no allocation per
//! tensor), the pinned host pool for offloaded values, one CUDA stream per plan stream
//! and one event per plan event, and lowers every instruction to a list of launches
//! (kernels, cuBLASLt GEMMs, copies, NCCL calls, event waits and records) with every
//! pointer resolved. A step replays that list; only data-dependent ops (grouped GEMMs,
//! whose row counts live on the device) read back a few integers in the middle.

use super::comm::{self, Comms, LaunchEnv};
use super::cudnn_sdpa;
use super::device::{err_flag_text, Arg, DevBuf, Event, Gpu, GpuOptions, Launch, Pinned, Stream};
use super::error::{CudaError, CudaResult};
use super::gemm::{Gemm, GemmShape};
use super::layout::{self, code, fsuffix};
use super::tuning::Tuning;
use cudarc::driver::{result as dr, sys};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use weft_ir::attrs::{CmpOp, ReduceOp, Reduction, RopeScaling};
use weft_ir::plan::{Category, ExecutionPlan};
use weft_ir::role::{ValueName, ValueRole};
use weft_ir::{Bindings, DType, Graph, HostTensor, Node, Op};

mod attention;
mod linear_ce;
use attention::{attention_bwd, attention_fwd, attention_parts};

/// How to run.
#[derive(Clone, Debug)]
pub struct ExecOptions {
    pub gpu: GpuOptions,
    /// Tensor-core flash attention for bf16 head dims 64 and 128 (else the generic kernel).
    pub fast_attention: bool,
    /// cuDNN's fused flash attention (forward and backward) for bf16 attention without a
    /// mask and with Sq == Sk, where libcudnn loads and an engine supports the graph;
    /// everything else (and everything when cuDNN is absent) runs Weft's kernels. Needs
    /// `fast_attention` too. On by default: measured on an H200 (cuDNN 9.14) at 2.0-2.6x
    /// Weft's kernels fwd+bwd (S=4096..16384, d 64/128). libcudnn must be on the library
    /// path: on the GPU machine
    /// `LD_LIBRARY_PATH=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cudnn/lib)`.
    pub cudnn_attention: bool,
    /// f32 GEMMs may use TF32.
    pub allow_tf32: bool,
    /// Create NCCL communicators even for one rank (checks NCCL works).
    pub nccl: bool,
    pub gemm_workspace: usize,
    /// Kernel variants and profiling (read once from the environment by `from_env`).
    pub tuning: Tuning,
}

/// `WEFT_ATTENTION` -> (`fast_attention`, `cudnn_attention`): unset, `auto` or `cudnn`:
/// cuDNN where it can run, else Weft's tensor-core kernels; `weft`: Weft's tensor-core
/// kernels; `generic`: Weft's generic kernel.
fn attention_choice(v: Option<&str>) -> (bool, bool) {
    match v {
        Some("generic") => (false, false),
        Some("weft") => (true, false),
        _ => (true, true),
    }
}

impl Default for ExecOptions {
    /// cuDNN and tensor-core attention, the default knobs, the kernel cache in the system
    /// temp dir: the same everywhere (no environment read).
    fn default() -> Self {
        ExecOptions {
            gpu: GpuOptions::default(),
            fast_attention: true,
            cudnn_attention: true,
            allow_tf32: false,
            nccl: true,
            gemm_workspace: 64 << 20,
            tuning: Tuning::default(),
        }
    }
}

impl ExecOptions {
    /// The defaults with what the environment asks for: `WEFT_ATTENTION`, the kernel
    /// cache (`WEFT_CACHE_DIR`, ...), `WEFT_NVRTC_SPLIT` and the [`Tuning`] knobs.
    pub fn from_env() -> Self {
        let (fast_attention, cudnn_attention) =
            attention_choice(std::env::var("WEFT_ATTENTION").ok().as_deref());
        ExecOptions {
            gpu: GpuOptions::from_env(),
            fast_attention,
            cudnn_attention,
            tuning: Tuning::from_env(),
            ..ExecOptions::default()
        }
    }
}

/// A device tensor: a pointer into one of the executor's allocations.
#[derive(Clone, Debug)]
pub struct DevT {
    pub ptr: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl DevT {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&x| x as u64).product()
    }
    pub fn bytes(&self) -> u64 {
        self.numel() * self.dtype.size_bytes()
    }
    fn rank(&self) -> usize {
        self.shape.len()
    }
}

#[derive(Clone, Copy, Debug)]
enum CopyKind {
    D2D,
    D2H,
    H2D,
}

#[derive(Clone, Debug)]
enum Coll {
    AllReduce { op: ReduceOp },
    AllGather,
    ReduceScatter { op: ReduceOp },
    Broadcast { root: i32 },
}

#[derive(Clone, Debug)]
enum StepKind {
    Launch(Launch),
    Gemm {
        shape: GemmShape,
        a: u64,
        b: u64,
        c: u64,
        bias: u64,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: u64,
        kind: CopyKind,
    },
    Memset {
        dst: u64,
        bytes: u64,
    },
    Wait(u32),
    Record(u32),
    Grouped(Box<Grouped>),
    /// cuDNN fused attention: a finalized plan and its variant pack, run with
    /// `cudnnBackendExecute` on the handle bound to the step's stream.
    Cudnn(Arc<cudnn_sdpa::Exec>),
    Collective {
        coll: Coll,
        axis: String,
        send: u64,
        recv: u64,
        count: u64,
        dtype: DType,
    },
}

#[derive(Clone, Debug)]
struct Grouped {
    dtype: DType,
    counts: u64,
    ncounts: usize,
    experts: usize,
    x: u64,
    w: u64,
    /// Output rows (forward) or dx (backward).
    out: u64,
    rows: u64,
    n: u64,
    k: u64,
    /// Backward: (dy, dw).
    grad: Option<(u64, u64)>,
    /// The weights are [E, k, n] (gpt-oss's layout) instead of [E, n, k].
    transpose_w: bool,
    /// Forward: a per-expert bias [E, n] added to each group's rows (0: none).
    bias: u64,
    /// Backward: dbias [E, n] (0: none) and a buffer of `rows` ones in the dtype (the
    /// column sums of dy run as `ones^T dy` GEMMs).
    dbias: u64,
    ones: u64,
}

#[derive(Clone, Debug)]
struct Step {
    stream: usize,
    ins: u32,
    kind: StepKind,
}

/// Where the time of a step went.
#[derive(Clone, Debug, Default)]
pub struct StepTiming {
    /// Device time from the first launch to the end of every stream, seconds.
    pub device_s: f64,
    /// Host wall time of the step.
    pub wall_s: f64,
    /// Host time spent enqueueing.
    pub enqueue_s: f64,
}

/// Memory the executor holds, against the plan's prediction.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MemoryUse {
    pub planned_peak_bytes: u64,
    pub planned_arena_bytes: u64,
    pub planned_resident_bytes: u64,
    /// The plan's breakdown at its peak.
    pub planned_breakdown: BTreeMap<String, u64>,
    /// Allocated for the arena and the resident region (must equal the plan's).
    pub allocated_plan_bytes: u64,
    /// Runtime extras outside the plan: kernel scratch, saved attention statistics,
    /// constants, the cuBLASLt workspace.
    pub runtime_extra_bytes: u64,
    pub pinned_host_bytes: u64,
    /// Device bytes in use (free memory at start minus the lowest free seen), which
    /// includes allocator rounding and library allocations.
    pub measured_peak_bytes: u64,
}

/// Launch-time numbers worth reporting.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LoadReport {
    pub kernel_compile_s: f64,
    pub kernel_cache_hit: bool,
    pub lower_s: f64,
    pub launches_per_step: usize,
    pub gemm_shapes: usize,
    pub nccl: String,
    pub fast_attention: bool,
    pub device: String,
}

pub struct Executor {
    gemm: Gemm,
    tuning: Tuning,
    pub plan: ExecutionPlan,
    pub graph: Graph,
    pub env: LaunchEnv,
    streams: Vec<Stream>,
    events: Vec<Event>,
    t_start: Event,
    t_ends: Vec<Event>,
    _resident: DevBuf,
    _arena: DevBuf,
    _extra: DevBuf,
    host: Option<Pinned>,
    bufs: Vec<DevT>,
    steps: Vec<Step>,
    comms: Option<Comms>,
    /// (from, to) buffers copied after each step: updated params and optimizer state.
    updates: Vec<(u32, u32)>,
    pub load: LoadReport,
    min_free: u64,
    planned_extra: u64,
    /// Per op (and GEMM shape): launches and device milliseconds of the last step run
    /// with `WEFT_PROFILE` set.
    pub profile: Option<BTreeMap<String, (usize, f64)>>,
    /// Last: dropped after every allocation, handle and communicator above.
    pub gpu: Gpu,
}

// ---------------------------------------------------------------- kernel names

fn kname(base: &str, d: DType) -> CudaResult<&'static str> {
    let s = fsuffix(d).ok_or_else(|| {
        CudaError::unsupported(
            format!("`{base}` on {d}"),
            "kernel selection",
            "float dtypes only",
        )
    })?;
    Ok(intern(&format!("{base}_{s}")))
}

fn intern(s: &str) -> &'static str {
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let m = NAMES.get_or_init(Default::default);
    let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(v) = g.get(s) {
        return v;
    }
    let v: &'static str = Box::leak(s.to_string().into_boxed_str());
    g.insert(s.to_string(), v);
    v
}

/// HF `rope_init_fn` inverse frequencies in f32 steps: the CPU reference's table.
fn rope_inv_freq(theta: f64, dim: usize, scaling: &RopeScaling) -> Vec<f32> {
    weft_ir::attrs::rope_inv_freq(theta, dim, scaling, true)
        .into_iter()
        .map(|x| x as f32)
        .collect()
}

// ---------------------------------------------------------------- lowering

/// Extra memory regions the lowering asks for; two passes: the first (with zero bases)
/// sizes them, the second fills in real pointers.
struct Extra {
    scratch_base: Vec<u64>,
    scratch_need: Vec<u64>,
    cur: u64,
    side_base: u64,
    side_used: u64,
    consts_base: u64,
    consts: Vec<u8>,
}

fn align256(x: u64) -> u64 {
    x.div_ceil(256) * 256
}

impl Extra {
    /// The first lowering pass (sizes only; its pointers are offsets from 0).
    fn sizing(&self) -> bool {
        self.side_base == 0
    }
    fn scratch(&mut self, stream: usize, bytes: u64) -> u64 {
        let p = self.scratch_base[stream] + self.cur;
        self.cur += align256(bytes.max(1));
        self.scratch_need[stream] = self.scratch_need[stream].max(self.cur);
        p
    }
    fn side(&mut self, bytes: u64) -> u64 {
        let p = self.side_base + self.side_used;
        self.side_used += align256(bytes.max(1));
        p
    }
    fn constant(&mut self, bytes: &[u8]) -> u64 {
        let off = align256(self.consts.len() as u64);
        self.consts.resize(off as usize, 0);
        self.consts.extend_from_slice(bytes);
        self.consts_base + off
    }
}

struct Lower<'a> {
    gpu: &'a Gpu,
    ex: Extra,
    steps: Vec<Step>,
    stream: usize,
    ins: u32,
    fast_attention: bool,
    tuning: Tuning,
    /// Saved log-sum-exp of attention forwards by output pointer: the output a backward
    /// reads is the one its forward wrote (q, k, v may be recomputed copies elsewhere).
    attn_lse: HashMap<u64, u64>,
    /// cuDNN's attention plans and handles (when selected and loadable).
    cudnn: Option<&'a RefCell<cudnn_sdpa::Sdpa>>,
    /// The saved statistics (of `attn_lse`) that cuDNN's forward wrote: natural-log f32
    /// log-sum-exp, which only cuDNN's backward reads (Weft's kernels keep log2 units).
    cudnn_lse: HashSet<u64>,
    /// Saved per-row log-sum-exp of cross-entropy forwards: (logits, labels) -> lse pointer.
    ce_lse: HashMap<(u64, u64), u64>,
    location: String,
    /// Fused mixed-precision AdamW: (low-precision grad, low-precision param out) pointers.
    fused_adamw: Option<(u64, u64, DType)>,
}

impl Lower<'_> {
    fn push(&mut self, kind: StepKind) {
        self.steps.push(Step {
            stream: self.stream,
            ins: self.ins,
            kind,
        });
    }
    fn launch(&mut self, l: Launch) {
        self.push(StepKind::Launch(l));
    }
    fn n(&mut self, name: &'static str, n: u64, args: Vec<Arg>) -> CudaResult<()> {
        let l = self.gpu.launch_n(name, n, args)?;
        self.launch(l);
        Ok(())
    }
    fn rows(
        &mut self,
        name: &'static str,
        rows: u64,
        block: u32,
        smem: u32,
        args: Vec<Arg>,
    ) -> CudaResult<()> {
        if rows == 0 {
            return Ok(());
        }
        if rows > u32::MAX as u64 {
            return Err(self.unsup(name, "more rows than one grid dimension holds"));
        }
        let l = self
            .gpu
            .launch(name, (rows as u32, 1, 1), (block, 1, 1), smem, args)?;
        self.launch(l);
        Ok(())
    }
    fn warps(&mut self, name: &'static str, items: u64, args: Vec<Arg>) -> CudaResult<()> {
        let blocks = items.div_ceil(8);
        if blocks == 0 {
            return Ok(());
        }
        let l = self
            .gpu
            .launch(name, (blocks as u32, 1, 1), (256, 1, 1), 0, args)?;
        self.launch(l);
        Ok(())
    }
    fn unsup(&self, what: &str, why: &str) -> CudaError {
        CudaError::unsupported(what.to_string(), self.location.clone(), why.to_string())
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: u64) {
        if bytes > 0 && dst != src {
            self.push(StepKind::Copy {
                dst,
                src,
                bytes,
                kind: CopyKind::D2D,
            });
        }
    }
    fn memset(&mut self, dst: u64, bytes: u64) {
        if bytes > 0 {
            self.push(StepKind::Memset { dst, bytes });
        }
    }
    fn fill(&mut self, t: &DevT, value: f64) -> CudaResult<()> {
        let pat = layout::fill_pattern(value, t.dtype);
        let name = match t.dtype.size_bytes() {
            1 => "fill_b1",
            2 => "fill_b2",
            4 => "fill_b4",
            _ => "fill_b8",
        };
        self.n(
            name,
            t.numel(),
            vec![Arg::P(t.ptr), Arg::I64(t.numel() as i64), Arg::U64(pat)],
        )
    }
    /// `dst[ds . i] = src[ss . i]` over `shape` (element offsets applied to the pointers).
    fn strided(
        &mut self,
        dst: u64,
        src: u64,
        esz: usize,
        shape: &[usize],
        ss: &[i64],
        ds: &[i64],
    ) -> CudaResult<()> {
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let (st, w, count) = layout::strided_copy(shape, ss, ds, esz, src, dst)
            .map_err(|m| self.unsup("a layout copy", &m))?;
        // A plain contiguous run is a memcpy.
        if st.rank == 1 && st.ss[0] == 1 && st.ds[0] == 1 {
            self.copy(dst, src, count * w as u64);
            return Ok(());
        }
        let name = match w {
            1 => "copy_strided_b1",
            2 => "copy_strided_b2",
            4 => "copy_strided_b4",
            8 => "copy_strided_b8",
            _ => "copy_strided_b16",
        };
        self.n(
            name,
            count,
            vec![
                Arg::P(dst),
                Arg::P(src),
                Arg::I64(count as i64),
                Arg::blob(&st),
            ],
        )
    }
    fn gemm(&mut self, shape: GemmShape, a: u64, b: u64, c: u64, bias: u64) {
        self.push(StepKind::Gemm {
            shape,
            a,
            b,
            c,
            bias,
        });
    }
}

fn esz(d: DType) -> usize {
    d.size_bytes() as usize
}

fn norm(d: i64, rank: usize) -> CudaResult<usize> {
    weft_ir::shape::norm_dim(d, rank).map_err(CudaError::Plan)
}

fn ptr_or_null(t: Option<&DevT>) -> u64 {
    t.map(|t| t.ptr).unwrap_or(0)
}

fn lower_op(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
    bindings: &Bindings,
) -> CudaResult<()> {
    let err = lw.gpu.err_flag.ptr;
    let o = &outs[0];
    let same = |a: &DevT, b: &DevT| a.shape == b.shape;
    let vec8 = |ts: &[&DevT]| {
        o.dtype == DType::BF16
            && o.numel().is_multiple_of(8)
            && ts
                .iter()
                .all(|t| t.ptr % 16 == 0 && t.dtype == DType::BF16 && t.numel() == o.numel())
    };
    let unary = |lw: &mut Lower, code_: i32, p: f32| -> CudaResult<()> {
        if vec8(&[o, &ins[0]]) {
            return lw.n(
                "unary8_bf16",
                o.numel() / 8,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(ins[0].ptr),
                    Arg::I64(o.numel() as i64 / 8),
                    Arg::I32(code_),
                    Arg::F32(p),
                ],
            );
        }
        let name = kname("unary", o.dtype)?;
        lw.n(
            name,
            o.numel(),
            vec![
                Arg::P(o.ptr),
                Arg::P(ins[0].ptr),
                Arg::I64(o.numel() as i64),
                Arg::I32(code_),
                Arg::F32(p),
            ],
        )
    };
    let binary = |lw: &mut Lower, code_: i32| -> CudaResult<()> {
        let (a, b) = (&ins[0], &ins[1]);
        if a.dtype != b.dtype {
            return Err(lw.unsup(
                "a binary op on mixed dtypes",
                &format!("{} and {}", a.dtype, b.dtype),
            ));
        }
        if a.dtype.is_int() && o.dtype == DType::I64 && a.dtype == DType::I64 {
            let bc = layout::bcast(&o.shape, &[&a.shape, &b.shape])
                .map_err(|m| lw.unsup("broadcast", &m))?;
            return lw.n(
                "binary_i64",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(a.ptr),
                    Arg::P(b.ptr),
                    Arg::I64(o.numel() as i64),
                    Arg::I32(code_),
                    Arg::blob(&bc),
                ],
            );
        }
        if same(a, o) && same(b, o) && vec8(&[o, a, b]) {
            return lw.n(
                "binary8_bf16",
                o.numel() / 8,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(a.ptr),
                    Arg::P(b.ptr),
                    Arg::I64(o.numel() as i64 / 8),
                    Arg::I32(code_),
                ],
            );
        }
        if same(a, o) && same(b, o) {
            let name = kname("binary_c", o.dtype)?;
            return lw.n(
                name,
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(a.ptr),
                    Arg::P(b.ptr),
                    Arg::I64(o.numel() as i64),
                    Arg::I32(code_),
                ],
            );
        }
        let bc = layout::bcast(&o.shape, &[&a.shape, &b.shape])
            .map_err(|m| lw.unsup("broadcast", &m))?;
        let name = kname("binary", o.dtype)?;
        lw.n(
            name,
            o.numel(),
            vec![
                Arg::P(o.ptr),
                Arg::P(a.ptr),
                Arg::P(b.ptr),
                Arg::I64(o.numel() as i64),
                Arg::I32(code_),
                Arg::blob(&bc),
            ],
        )
    };
    match op {
        Op::Param { .. } | Op::Input { .. } => Ok(()),
        Op::Full { value, .. } => lw.fill(o, value.0),
        Op::Arange { start, .. } => {
            let s = start
                .eval(bindings)
                .map_err(|e| CudaError::Plan(e.to_string()))?;
            lw.n(
                "arange_any",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::I32(code(o.dtype)),
                    Arg::I64(o.numel() as i64),
                    Arg::I64(s),
                ],
            )
        }
        Op::Neg {} => unary(lw, 0, 0.0),
        Op::Exp {} => unary(lw, 1, 0.0),
        Op::Log {} => unary(lw, 2, 0.0),
        Op::Sqrt {} => unary(lw, 3, 0.0),
        Op::Rsqrt {} => unary(lw, 4, 0.0),
        Op::Tanh {} => unary(lw, 5, 0.0),
        Op::Sigmoid {} => unary(lw, 6, 0.0),
        Op::Silu {} => unary(lw, 7, 0.0),
        Op::Gelu { tanh_approx } => unary(lw, if *tanh_approx { 9 } else { 8 }, 0.0),
        Op::Relu {} => unary(lw, 10, 0.0),
        Op::Scale { factor } => unary(lw, 11, factor.0 as f32),
        Op::AddScalar { value } => unary(lw, 12, value.0 as f32),
        Op::PowScalar { exponent } => unary(lw, 13, exponent.0 as f32),
        Op::Add {} => binary(lw, 0),
        Op::Sub {} => binary(lw, 1),
        Op::Mul {} => binary(lw, 2),
        Op::Div {} => binary(lw, 3),
        Op::Pow {} => binary(lw, 4),
        Op::Maximum {} => binary(lw, 5),
        Op::Minimum {} => binary(lw, 6),
        Op::Compare { op } => {
            let (a, b) = (&ins[0], &ins[1]);
            let c = match op {
                CmpOp::Eq => 0,
                CmpOp::Ne => 1,
                CmpOp::Lt => 2,
                CmpOp::Le => 3,
                CmpOp::Gt => 4,
                CmpOp::Ge => 5,
            };
            let bc = layout::bcast(&o.shape, &[&a.shape, &b.shape])
                .map_err(|m| lw.unsup("broadcast", &m))?;
            lw.n(
                "compare_any",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(a.ptr),
                    Arg::P(b.ptr),
                    Arg::I32(code(a.dtype)),
                    Arg::I64(o.numel() as i64),
                    Arg::I32(c),
                    Arg::blob(&bc),
                ],
            )
        }
        Op::Where {} => {
            let bc = layout::bcast(&o.shape, &[&ins[0].shape, &ins[1].shape, &ins[2].shape])
                .map_err(|m| lw.unsup("broadcast", &m))?;
            lw.n(
                "where_any",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(ins[0].ptr),
                    Arg::P(ins[1].ptr),
                    Arg::P(ins[2].ptr),
                    Arg::I32(esz(o.dtype) as i32),
                    Arg::I64(o.numel() as i64),
                    Arg::blob(&bc),
                ],
            )
        }
        Op::Cast { .. } => {
            if ins[0].dtype == o.dtype {
                lw.copy(o.ptr, ins[0].ptr, o.bytes());
                return Ok(());
            }
            lw.n(
                "cast_any",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::I32(code(o.dtype)),
                    Arg::P(ins[0].ptr),
                    Arg::I32(code(ins[0].dtype)),
                    Arg::I64(o.numel() as i64),
                ],
            )
        }
        Op::Sum { dims, .. } | Op::Mean { dims, .. } | Op::Max { dims, .. } => {
            let x = &ins[0];
            let ds: Vec<usize> = dims
                .iter()
                .map(|&d| norm(d, x.rank()))
                .collect::<CudaResult<_>>()?;
            if ds.is_empty() {
                lw.copy(o.ptr, x.ptr, o.bytes());
                return Ok(());
            }
            let c = match op {
                Op::Sum { .. } => 0,
                Op::Mean { .. } => 1,
                _ => 2,
            };
            let (rd, nout, nred) =
                layout::red(&x.shape, &ds).map_err(|m| lw.unsup("a reduction", &m))?;
            let name = if x.dtype == DType::I64 {
                "reduce_i64"
            } else {
                kname("reduce", x.dtype)?
            };
            if x.dtype != o.dtype {
                return Err(lw.unsup(
                    "a reduction changing dtype",
                    "output dtype differs from input",
                ));
            }
            lw.warps(
                name,
                nout,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(x.ptr),
                    Arg::I64(nout as i64),
                    Arg::I64(nred as i64),
                    Arg::I32(c),
                    Arg::blob(&rd),
                ],
            )
        }
        Op::Softmax { dim } | Op::LogSoftmax { dim } => {
            let x = &ins[0];
            let d = norm(*dim, x.rank())?;
            if d != x.rank() - 1 {
                return Err(lw.unsup("softmax along a dim other than the last", "transpose first"));
            }
            let n = *x.shape.last().unwrap() as u64;
            let rows = if n == 0 { 0 } else { x.numel() / n };
            let name = kname("softmax", x.dtype)?;
            let logsm = matches!(op, Op::LogSoftmax { .. }) as i32;
            lw.rows(
                name,
                rows,
                256,
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(x.ptr),
                    Arg::I64(rows as i64),
                    Arg::I64(n as i64),
                    Arg::I32(logsm),
                ],
            )
        }
        Op::Embedding {} => {
            let (ids, w) = (&ins[0], &ins[1]);
            if ids.dtype != DType::I64 {
                return Err(lw.unsup("embedding with non-i64 ids", "cast the ids to i64"));
            }
            let h = w.shape[1] as u64;
            let name = kname("embedding", w.dtype)?;
            lw.rows(
                name,
                ids.numel(),
                128,
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(ids.ptr),
                    Arg::P(w.ptr),
                    Arg::I64(ids.numel() as i64),
                    Arg::I64(h as i64),
                    Arg::I64(w.shape[0] as i64),
                    Arg::P(err),
                ],
            )
        }
        Op::Linear {} => {
            let (x, w) = (&ins[0], &ins[1]);
            if x.dtype != w.dtype || o.dtype != x.dtype {
                return Err(lw.unsup(
                    "linear on mixed dtypes",
                    &format!("x {}, w {}", x.dtype, w.dtype),
                ));
            }
            let k = *x.shape.last().unwrap() as u64;
            let n = w.shape[0] as u64;
            let m = if k == 0 { 0 } else { x.numel() / k };
            let bias = ins.get(2);
            let shape = GemmShape {
                dtype: x.dtype,
                m,
                n,
                k,
                ta: false,
                tb: true,
                batch: 1,
                sa: 0,
                sb: 0,
                sc: 0,
                bias: bias.is_some(),
                accumulate: false,
            };
            if k == 0 {
                return match bias {
                    Some(b) => {
                        let bc = layout::bcast(&o.shape, &[&b.shape, &b.shape])
                            .map_err(|m| lw.unsup("broadcast", &m))?;
                        lw.strided(
                            o.ptr,
                            b.ptr,
                            esz(o.dtype),
                            &o.shape,
                            &bc.sa[..o.rank()],
                            &layout::strides(&o.shape),
                        )
                    }
                    None => lw.fill(o, 0.0),
                };
            }
            lw.gemm(shape, x.ptr, w.ptr, o.ptr, ptr_or_null(bias));
            Ok(())
        }
        Op::Matmul {
            transpose_a,
            transpose_b,
        } => lower_matmul(lw, &ins[0], &ins[1], o, *transpose_a, *transpose_b),
        Op::RmsNorm { eps } => {
            let (x, w) = (&ins[0], &ins[1]);
            let h = *x.shape.last().unwrap() as u64;
            let rows = if h == 0 { 0 } else { x.numel() / h };
            if let Some(name) = rms8_kernel(x, w, h, "rms_fwd8_bf16") {
                return lw.rows(
                    name,
                    rows,
                    256,
                    0,
                    vec![
                        Arg::P(o.ptr),
                        Arg::P(x.ptr),
                        Arg::P(w.ptr),
                        Arg::I32(code(w.dtype)),
                        Arg::I64(rows as i64),
                        Arg::I32(h as i32),
                        Arg::F32(eps.0 as f32),
                        Arg::P(0),
                    ],
                );
            }
            let name = kname("rms_norm", x.dtype)?;
            lw.rows(
                name,
                rows,
                256,
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(x.ptr),
                    Arg::P(w.ptr),
                    Arg::I32(code(w.dtype)),
                    Arg::I64(rows as i64),
                    Arg::I64(h as i64),
                    Arg::F32(eps.0 as f32),
                    Arg::P(0),
                ],
            )
        }
        Op::RopeTable {
            theta,
            dim,
            scaling,
        } => {
            let inv = rope_inv_freq(theta.0, *dim as usize, scaling);
            let bytes: Vec<u8> = inv.iter().flat_map(|x| x.to_le_bytes()).collect();
            let invp = lw.ex.constant(&bytes);
            let pos = &ins[0];
            let half = (*dim / 2) as i32;
            lw.n(
                "rope_table",
                o.numel(),
                vec![
                    Arg::P(outs[0].ptr),
                    Arg::P(outs[1].ptr),
                    Arg::I32(code(o.dtype)),
                    Arg::P(pos.ptr),
                    Arg::I32(code(pos.dtype)),
                    Arg::I64(pos.numel() as i64),
                    Arg::I32(half),
                    Arg::P(invp),
                    Arg::F32(scaling.attention_factor() as f32),
                ],
            )
        }
        Op::Rope {} => {
            let (x, c, s) = (&ins[0], &ins[1], &ins[2]);
            if x.rank() != 4 || c.rank() != 3 || c.dtype != s.dtype {
                return Err(lw.unsup(
                    "rope",
                    "x must be [B, N, S, D] and cos/sin [B|1, S, r] of one dtype",
                ));
            }
            let (b, nh, sq, d) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
            let r = c.shape[2];
            let cbs = if c.shape[0] == 1 {
                0
            } else {
                (c.shape[1] * r) as i64
            };
            let fits = d / 2 <= 512
                && d % 2 == 0
                && r % 2 == 0
                && r <= d
                && sq <= i32::MAX as usize
                && nh <= 65535
                && b <= 65535;
            if fits && d >= 2 {
                let tx = (d / 2) as u32;
                let ty = (256 / tx).max(1);
                let name = kname("rope2", x.dtype)?;
                let l = lw.gpu.launch(
                    name,
                    (sq.div_ceil(ty as usize) as u32, nh as u32, b as u32),
                    (tx, ty, 1),
                    0,
                    vec![
                        Arg::P(o.ptr),
                        Arg::P(x.ptr),
                        Arg::P(c.ptr),
                        Arg::P(s.ptr),
                        Arg::I32(code(c.dtype)),
                        Arg::I32(nh as i32),
                        Arg::I32(sq as i32),
                        Arg::I32(d as i32),
                        Arg::I32(r as i32),
                        Arg::I64(cbs),
                    ],
                )?;
                lw.launch(l);
                return Ok(());
            }
            let name = kname("rope", x.dtype)?;
            lw.n(
                name,
                x.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(x.ptr),
                    Arg::P(c.ptr),
                    Arg::P(s.ptr),
                    Arg::I32(code(c.dtype)),
                    Arg::I64(b as i64),
                    Arg::I64(nh as i64),
                    Arg::I64(sq as i64),
                    Arg::I64(d as i64),
                    Arg::I64(r as i64),
                    Arg::I64(cbs),
                ],
            )
        }
        Op::Attention {
            causal,
            scale,
            window,
            ..
        } => {
            let (mask, extras) = attention_parts(op, ins, outs).map_err(|why| {
                lw.unsup(
                    "this attention",
                    &format!("its kernels do not implement {why}\nhelp: run with `--backend cpu`"),
                )
            })?;
            // Per query row: the log-sum-exp (tensor-core path) or the max and the sum (generic).
            let lse = lw
                .ex
                .side(8 * ins[0].shape[0] as u64 * ins[0].shape[1] as u64 * ins[0].shape[2] as u64);
            lw.attn_lse.insert(o.ptr, lse);
            attention_fwd(
                lw,
                &ins[0],
                &ins[1],
                &ins[2],
                mask,
                o,
                lse,
                *causal,
                scale.0 as f32,
                window.unwrap_or(0),
                &extras,
            )
        }
        Op::AttentionGrad {
            causal,
            scale,
            window,
            ..
        } => {
            let (mask, extras) = attention_parts(op, ins, outs).map_err(|why| {
                lw.unsup(
                    "this attention_grad",
                    &format!("its kernels do not implement {why}\nhelp: run with `--backend cpu`"),
                )
            })?;
            attention_bwd(
                lw,
                ins,
                mask,
                outs,
                *causal,
                scale.0 as f32,
                window.unwrap_or(0),
                &extras,
            )
        }
        Op::ShiftLabels { ignore_index } => {
            let l = &ins[0];
            let n = *l.shape.last().unwrap_or(&1) as i64;
            let rows = if n == 0 { 0 } else { l.numel() as i64 / n };
            lw.n(
                "shift_labels",
                l.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(l.ptr),
                    Arg::I64(rows),
                    Arg::I64(n),
                    Arg::I64(*ignore_index),
                ],
            )
        }
        Op::CountValid { ignore_index } => {
            let l = &ins[0];
            let lp = lw.gpu.launch(
                "count_valid",
                (1, 1, 1),
                (1024, 1, 1),
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::I32(code(o.dtype)),
                    Arg::P(l.ptr),
                    Arg::I64(l.numel() as i64),
                    Arg::I64(*ignore_index),
                ],
            )?;
            lw.launch(lp);
            Ok(())
        }
        Op::CrossEntropy {
            ignore_index,
            reduction,
        } => {
            let (x, l) = (&ins[0], &ins[1]);
            let v = *x.shape.last().unwrap() as u64;
            let rows = l.numel();
            let per_row = match reduction {
                Reduction::None if o.dtype == DType::F32 => o.ptr,
                _ => lw.ex.scratch(lw.stream, rows * 4),
            };
            // Keep the per-row log-sum-exp for a one-pass backward.
            let lse = lw.ex.side(rows * 4);
            lw.ce_lse.insert((x.ptr, l.ptr), lse);
            let name = kname("ce_rows", x.dtype)?;
            lw.rows(
                name,
                rows,
                512,
                0,
                vec![
                    Arg::P(per_row),
                    Arg::P(lse),
                    Arg::P(x.ptr),
                    Arg::P(l.ptr),
                    Arg::I64(rows as i64),
                    Arg::I64(v as i64),
                    Arg::I64(*ignore_index),
                    Arg::P(err),
                ],
            )?;
            match reduction {
                Reduction::None => {
                    if per_row != o.ptr {
                        lw.n(
                            "f32_to_any",
                            rows,
                            vec![
                                Arg::P(o.ptr),
                                Arg::I32(code(o.dtype)),
                                Arg::P(per_row),
                                Arg::I64(rows as i64),
                            ],
                        )?;
                    }
                    Ok(())
                }
                Reduction::Sum | Reduction::Mean => {
                    let labels = if *reduction == Reduction::Mean {
                        l.ptr
                    } else {
                        0
                    };
                    let lp = lw.gpu.launch(
                        "sum_f32",
                        (1, 1, 1),
                        (1024, 1, 1),
                        0,
                        vec![
                            Arg::P(o.ptr),
                            Arg::I32(code(o.dtype)),
                            Arg::P(per_row),
                            Arg::I64(rows as i64),
                            Arg::F32(1.0),
                            Arg::P(labels),
                            Arg::I64(rows as i64),
                            Arg::I64(*ignore_index),
                        ],
                    )?;
                    lw.launch(lp);
                    Ok(())
                }
            }
        }
        Op::CrossEntropyGrad {
            ignore_index,
            reduction,
        } => {
            let (x, l, dl) = (&ins[0], &ins[1], &ins[2]);
            let v = *x.shape.last().unwrap() as u64;
            let rows = l.numel();
            let mode = match reduction {
                Reduction::None => 0,
                Reduction::Sum => 1,
                Reduction::Mean => 2,
            };
            let count = if mode == 2 {
                let c = lw.ex.scratch(lw.stream, 4);
                let lp = lw.gpu.launch(
                    "count_valid",
                    (1, 1, 1),
                    (1024, 1, 1),
                    0,
                    vec![
                        Arg::P(c),
                        Arg::I32(0),
                        Arg::P(l.ptr),
                        Arg::I64(rows as i64),
                        Arg::I64(*ignore_index),
                    ],
                )?;
                lw.launch(lp);
                c
            } else {
                0
            };
            if let (Some(&lse), true) = (
                lw.ce_lse.get(&(x.ptr, l.ptr)),
                vec8(&[o, x]) && v.is_multiple_of(8),
            ) {
                return lw.rows(
                    "ce_bwd_lse8_bf16",
                    rows,
                    512,
                    0,
                    vec![
                        Arg::P(o.ptr),
                        Arg::P(x.ptr),
                        Arg::P(l.ptr),
                        Arg::P(lse),
                        Arg::P(dl.ptr),
                        Arg::I32(code(dl.dtype)),
                        Arg::I32(mode),
                        Arg::P(count),
                        Arg::I64(rows as i64),
                        Arg::I64(v as i64 / 8),
                        Arg::I64(*ignore_index),
                    ],
                );
            }
            let name = kname("ce_bwd", x.dtype)?;
            lw.rows(
                name,
                rows,
                512,
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(x.ptr),
                    Arg::P(l.ptr),
                    Arg::P(dl.ptr),
                    Arg::I32(code(dl.dtype)),
                    Arg::I32(mode),
                    Arg::P(count),
                    Arg::I64(rows as i64),
                    Arg::I64(v as i64),
                    Arg::I64(*ignore_index),
                ],
            )
        }
        Op::Reshape { .. } => {
            lw.copy(o.ptr, ins[0].ptr, o.bytes());
            Ok(())
        }
        Op::Permute { perm } => {
            let x = &ins[0];
            let p: Vec<usize> = perm
                .iter()
                .map(|&d| norm(d, x.rank()))
                .collect::<CudaResult<_>>()?;
            let xs = layout::strides(&x.shape);
            let ss: Vec<i64> = p.iter().map(|&i| xs[i]).collect();
            lw.strided(
                o.ptr,
                x.ptr,
                esz(o.dtype),
                &o.shape,
                &ss,
                &layout::strides(&o.shape),
            )
        }
        Op::Transpose { dim0, dim1 } => {
            let x = &ins[0];
            let (a, b) = (norm(*dim0, x.rank())?, norm(*dim1, x.rank())?);
            let mut ss = layout::strides(&x.shape);
            ss.swap(a, b);
            lw.strided(
                o.ptr,
                x.ptr,
                esz(o.dtype),
                &o.shape,
                &ss,
                &layout::strides(&o.shape),
            )
        }
        Op::Slice { dim, start, .. } => {
            let x = &ins[0];
            let d = norm(*dim, x.rank())?;
            let s = start
                .eval(bindings)
                .map_err(|e| CudaError::Plan(e.to_string()))?;
            let xs = layout::strides(&x.shape);
            let src = x.ptr + (s * xs[d]) as u64 * x.dtype.size_bytes();
            lw.strided(
                o.ptr,
                src,
                esz(o.dtype),
                &o.shape,
                &xs,
                &layout::strides(&o.shape),
            )
        }
        Op::Split { dim, .. } => {
            let x = &ins[0];
            let d = norm(*dim, x.rank())?;
            let xs = layout::strides(&x.shape);
            let mut at = 0usize;
            for out in outs {
                let src = x.ptr + (at as i64 * xs[d]) as u64 * x.dtype.size_bytes();
                lw.strided(
                    out.ptr,
                    src,
                    esz(out.dtype),
                    &out.shape,
                    &xs,
                    &layout::strides(&out.shape),
                )?;
                at += out.shape[d];
            }
            Ok(())
        }
        Op::Zigzag {
            dim,
            parts,
            inverse,
        } => {
            // One strided copy per chunk: output chunk i is input chunk order[i].
            let x = &ins[0];
            let d = norm(*dim, x.rank())?;
            let order = weft_ir::shape::zigzag_order(*parts as usize, *inverse);
            let c = x.shape[d] / order.len();
            let mut chunk = x.shape.clone();
            chunk[d] = c;
            let (xs, os) = (layout::strides(&x.shape), layout::strides(&o.shape));
            let bytes = x.dtype.size_bytes();
            for (i, &j) in order.iter().enumerate() {
                let src = x.ptr + (j as i64 * c as i64 * xs[d]) as u64 * bytes;
                let dst = o.ptr + (i as i64 * c as i64 * os[d]) as u64 * bytes;
                lw.strided(dst, src, esz(o.dtype), &chunk, &xs, &os)?;
            }
            Ok(())
        }
        Op::Concat { dim } => {
            let d = norm(*dim, o.rank())?;
            let os = layout::strides(&o.shape);
            let mut at = 0usize;
            for x in ins {
                let dst = o.ptr + (at as i64 * os[d]) as u64 * o.dtype.size_bytes();
                lw.strided(
                    dst,
                    x.ptr,
                    esz(o.dtype),
                    &x.shape,
                    &layout::strides(&x.shape),
                    &os,
                )?;
                at += x.shape[d];
            }
            Ok(())
        }
        Op::Expand { .. } => {
            let x = &ins[0];
            let ss = layout::broadcast_strides(&x.shape, &o.shape)
                .map_err(|m| lw.unsup("expand", &m))?;
            lw.strided(
                o.ptr,
                x.ptr,
                esz(o.dtype),
                &o.shape,
                &ss,
                &layout::strides(&o.shape),
            )
        }
        Op::Gather { dim } => {
            let (x, idx) = (&ins[0], &ins[1]);
            let d = norm(*dim, x.rank())?;
            if idx.dtype != DType::I64 {
                return Err(lw.unsup("gather with non-i64 indices", "cast to i64"));
            }
            let xs = layout::strides(&x.shape);
            let mut st = layout::Strided {
                rank: idx.rank() as i32,
                shape: [1; 8],
                ss: [0; 8],
                ds: [0; 8],
            };
            for i in 0..idx.rank() {
                st.shape[i] = idx.shape[i] as i64;
                st.ss[i] = xs[i];
            }
            lw.n(
                "gather_any",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(x.ptr),
                    Arg::P(idx.ptr),
                    Arg::I32(esz(o.dtype) as i32),
                    Arg::I64(o.numel() as i64),
                    Arg::blob(&st),
                    Arg::I32(d as i32),
                    Arg::I64(x.shape[d] as i64),
                    Arg::P(err),
                ],
            )
        }
        Op::IndexSelect { dim } => {
            let (x, idx) = (&ins[0], &ins[1]);
            let d = norm(*dim, x.rank())?;
            let outer: usize = x.shape[..d].iter().product();
            let inner: usize = x.shape[d + 1..].iter().product();
            lw.n(
                "index_select_any",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(x.ptr),
                    Arg::P(idx.ptr),
                    Arg::I32(code(idx.dtype)),
                    Arg::I32(esz(o.dtype) as i32),
                    Arg::I64(outer as i64),
                    Arg::I64(x.shape[d] as i64),
                    Arg::I64(idx.numel() as i64),
                    Arg::I64(inner as i64),
                    Arg::P(err),
                ],
            )
        }
        Op::ScatterAdd { dim } => {
            let (dst, idx, src) = (&ins[0], &ins[1], &ins[2]);
            let d = norm(*dim, dst.rank())?;
            lw.copy(o.ptr, dst.ptr, o.bytes());
            let os = layout::strides(&o.shape);
            let mut st = layout::Strided {
                rank: src.rank() as i32,
                shape: [1; 8],
                ss: [0; 8],
                ds: [0; 8],
            };
            for i in 0..src.rank() {
                st.shape[i] = src.shape[i] as i64;
                st.ds[i] = os[i];
            }
            let name = kname("scatter_add", o.dtype)?;
            lw.n(
                name,
                src.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(idx.ptr),
                    Arg::P(src.ptr),
                    Arg::I64(src.numel() as i64),
                    Arg::blob(&st),
                    Arg::I32(d as i32),
                    Arg::I64(o.shape[d] as i64),
                    Arg::P(err),
                ],
            )
        }
        Op::LinearCrossEntropy { .. } => linear_ce::linear_ce_fwd(lw, op, ins, outs),
        Op::LinearCrossEntropyGrad { .. } => linear_ce::linear_ce_bwd(lw, op, ins, outs),
        Op::Topk { k, dim } => {
            let x = &ins[0];
            let d = norm(*dim, x.rank())?;
            if d != x.rank() - 1 {
                return Err(lw.unsup("topk along a dim other than the last", "transpose first"));
            }
            let n = x.shape[d] as u64;
            let rows = if n == 0 { 0 } else { x.numel() / n };
            lw.n(
                "topk_any",
                rows,
                vec![
                    Arg::P(outs[0].ptr),
                    Arg::I32(code(outs[0].dtype)),
                    Arg::P(outs[1].ptr),
                    Arg::P(x.ptr),
                    Arg::I32(code(x.dtype)),
                    Arg::I64(rows as i64),
                    Arg::I64(n as i64),
                    Arg::I32(*k as i32),
                ],
            )
        }
        Op::OneHot { num_classes, .. } => {
            let idx = &ins[0];
            lw.n(
                "one_hot",
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::I32(code(o.dtype)),
                    Arg::P(idx.ptr),
                    Arg::I64(idx.numel() as i64),
                    Arg::I64(*num_classes),
                    Arg::P(err),
                ],
            )
        }
        Op::MoeDispatch { num_experts } => {
            let (x, e) = (&ins[0], &ins[1]);
            let (rows, counts, order) = (&outs[0], &outs[1], &outs[2]);
            let tk = e.numel();
            let k = if e.rank() == 2 { e.shape[1] } else { 1 };
            let ne = *num_experts as u32;
            let lp = lw.gpu.launch(
                "moe_route",
                (1, 1, 1),
                (ne.clamp(32, 1024), 1, 1),
                ne * 8,
                vec![
                    Arg::P(counts.ptr),
                    Arg::P(order.ptr),
                    Arg::P(e.ptr),
                    Arg::I64(tk as i64),
                    Arg::I32(ne as i32),
                    Arg::P(err),
                ],
            )?;
            lw.launch(lp);
            let h = x.shape[1] as i64;
            let name = kname("moe_gather", x.dtype)?;
            lw.n(
                name,
                rows.numel(),
                vec![
                    Arg::P(rows.ptr),
                    Arg::P(x.ptr),
                    Arg::P(order.ptr),
                    Arg::I64(tk as i64),
                    Arg::I32(k as i32),
                    Arg::I64(h),
                ],
            )
        }
        Op::GroupedMatmul { transpose_w } => {
            let (x, w, c) = (&ins[0], &ins[1], &ins[2]);
            let bias = ins.get(3);
            if w.dtype != x.dtype || bias.is_some_and(|b| b.dtype != x.dtype) {
                return Err(lw.unsup(
                    "grouped_matmul on mixed dtypes",
                    &format!(
                        "x {}, w {}, bias {:?}",
                        x.dtype,
                        w.dtype,
                        bias.map(|b| b.dtype)
                    ),
                ));
            }
            // [E, n, k], or [E, k, n] transposed
            let (n, k) = if transpose_w.0 {
                (w.shape[2], w.shape[1])
            } else {
                (w.shape[1], w.shape[2])
            };
            lw.push(StepKind::Grouped(Box::new(Grouped {
                dtype: x.dtype,
                counts: c.ptr,
                ncounts: c.numel() as usize,
                experts: w.shape[0],
                x: x.ptr,
                w: w.ptr,
                out: o.ptr,
                rows: x.shape[0] as u64,
                n: n as u64,
                k: k as u64,
                grad: None,
                transpose_w: transpose_w.0,
                bias: bias.map_or(0, |b| b.ptr),
                dbias: 0,
                ones: 0,
            })));
            Ok(())
        }
        Op::GroupedMatmulGrad { transpose_w, bias } => {
            let (x, w, c, dy) = (&ins[0], &ins[1], &ins[2], &ins[3]);
            if w.dtype != x.dtype || dy.dtype != x.dtype {
                return Err(lw.unsup(
                    "grouped_matmul_grad on mixed dtypes",
                    &format!("x {}, w {}, dy {}", x.dtype, w.dtype, dy.dtype),
                ));
            }
            let (n, k) = if transpose_w.0 {
                (w.shape[2], w.shape[1])
            } else {
                (w.shape[1], w.shape[2])
            };
            let rows = x.shape[0] as u64;
            let (dbias, ones) = if bias.0 {
                let db = &outs[2];
                if db.dtype != x.dtype {
                    return Err(lw.unsup(
                        "grouped_matmul_grad with a dbias in another dtype",
                        &format!("x {}, dbias {}", x.dtype, db.dtype),
                    ));
                }
                let ones = DevT {
                    ptr: lw.ex.scratch(lw.stream, rows.max(1) * esz(x.dtype) as u64),
                    dtype: x.dtype,
                    shape: vec![rows.max(1) as usize],
                };
                lw.fill(&ones, 1.0)?;
                (db.ptr, ones.ptr)
            } else {
                (0, 0)
            };
            lw.push(StepKind::Grouped(Box::new(Grouped {
                dtype: x.dtype,
                counts: c.ptr,
                ncounts: c.numel() as usize,
                experts: w.shape[0],
                x: x.ptr,
                w: w.ptr,
                out: outs[0].ptr,
                rows,
                n: n as u64,
                k: k as u64,
                grad: Some((dy.ptr, outs[1].ptr)),
                transpose_w: transpose_w.0,
                bias: 0,
                dbias,
                ones,
            })));
            Ok(())
        }
        Op::MoeCombine {} => {
            let (rows, order, w) = (&ins[0], &ins[1], &ins[2]);
            let (t, k) = (w.shape[0], w.shape[1]);
            let tk = (t * k) as u64;
            let inv = lw.ex.scratch(lw.stream, tk * 4);
            lw.n(
                "fill_i32",
                tk,
                vec![Arg::P(inv), Arg::I64(tk as i64), Arg::I32(-1)],
            )?;
            lw.n(
                "moe_inverse",
                rows.shape[0] as u64,
                vec![
                    Arg::P(inv),
                    Arg::P(order.ptr),
                    Arg::I64(rows.shape[0] as i64),
                    Arg::I64(tk as i64),
                    Arg::P(err),
                ],
            )?;
            let name = kname("moe_combine", o.dtype)?;
            lw.n(
                name,
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(rows.ptr),
                    Arg::P(inv),
                    Arg::P(w.ptr),
                    Arg::I32(code(w.dtype)),
                    Arg::I64(t as i64),
                    Arg::I32(k as i32),
                    Arg::I64(rows.shape[1] as i64),
                ],
            )
        }
        Op::MoeCombineGrad {} => {
            let (rows, order, w, dy) = (&ins[0], &ins[1], &ins[2], &ins[3]);
            let k = w.shape[1];
            lw.memset(outs[1].ptr, outs[1].bytes());
            let name = kname("moe_combine_bwd", rows.dtype)?;
            lw.warps(
                name,
                rows.shape[0] as u64,
                vec![
                    Arg::P(outs[0].ptr),
                    Arg::P(outs[1].ptr),
                    Arg::P(rows.ptr),
                    Arg::P(order.ptr),
                    Arg::P(w.ptr),
                    Arg::P(dy.ptr),
                    Arg::I64(rows.shape[0] as i64),
                    Arg::I32(k as i32),
                    Arg::I64(rows.shape[1] as i64),
                ],
            )
        }
        Op::RmsNormGrad { eps } => {
            let (x, w, dy) = (&ins[0], &ins[1], &ins[2]);
            let (dx, dw) = (&outs[0], &outs[1]);
            let h = *x.shape.last().unwrap() as u64;
            let rows = if h == 0 { 0 } else { x.numel() / h };
            if let Some(name) = rms8_kernel(x, w, h, "rms_bwd8_bf16") {
                // About 512 blocks (4 rows each at 2048 rows): enough warps in flight to hide
                // the per-row reductions; dw from per-block partials, summed in a fixed order.
                let rpb = rows.div_ceil(512).max(1);
                let nblocks = rows.div_ceil(rpb);
                let part = lw.ex.scratch(lw.stream, nblocks.max(1) * h * 4);
                lw.rows(
                    name,
                    nblocks,
                    256,
                    0,
                    vec![
                        Arg::P(dx.ptr),
                        Arg::P(part),
                        Arg::P(x.ptr),
                        Arg::P(w.ptr),
                        Arg::I32(code(w.dtype)),
                        Arg::P(dy.ptr),
                        Arg::I64(rows as i64),
                        Arg::I32(h as i32),
                        Arg::F32(eps.0 as f32),
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
                        Arg::I32(code(dw.dtype)),
                        Arg::P(part),
                        Arg::I64(nblocks as i64),
                        Arg::I64(h as i64),
                    ],
                )?;
                lw.launch(l);
                return Ok(());
            }
            let acc = lw.ex.scratch(lw.stream, h * 4);
            let rstd = lw.ex.scratch(lw.stream, rows * 4);
            let name = kname("rms_norm_bwd", x.dtype)?;
            lw.rows(
                name,
                rows,
                256,
                0,
                vec![
                    Arg::P(dx.ptr),
                    Arg::P(rstd),
                    Arg::P(x.ptr),
                    Arg::P(w.ptr),
                    Arg::I32(code(w.dtype)),
                    Arg::P(dy.ptr),
                    Arg::I64(rows as i64),
                    Arg::I64(h as i64),
                    Arg::F32(eps.0 as f32),
                ],
            )?;
            lw.memset(acc, h * 4);
            let chunk = 256u64;
            let gy = rows.div_ceil(chunk).max(1);
            let name = kname("rms_dw_partial", x.dtype)?;
            let lp = lw.gpu.launch(
                name,
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
                    Arg::I32(code(dw.dtype)),
                    Arg::P(acc),
                    Arg::I64(h as i64),
                ],
            )
        }
        Op::EmbeddingGrad { .. } => {
            let (ids, dy) = (&ins[0], &ins[1]);
            let h = *dy.shape.last().unwrap() as i64;
            lw.memset(o.ptr, o.bytes());
            let name = kname("embedding_bwd", o.dtype)?;
            lw.rows(
                name,
                ids.numel(),
                256,
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(ids.ptr),
                    Arg::P(dy.ptr),
                    Arg::I64(ids.numel() as i64),
                    Arg::I64(h),
                    Arg::I64(o.shape[0] as i64),
                    Arg::P(err),
                ],
            )
        }
        Op::SiluGrad {} => {
            if vec8(&[o, &ins[0], &ins[1]]) {
                return lw.n(
                    "silu_bwd8_bf16",
                    o.numel() / 8,
                    vec![
                        Arg::P(o.ptr),
                        Arg::P(ins[0].ptr),
                        Arg::P(ins[1].ptr),
                        Arg::I64(o.numel() as i64 / 8),
                    ],
                );
            }
            let name = kname("silu_bwd", o.dtype)?;
            lw.n(
                name,
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(ins[0].ptr),
                    Arg::P(ins[1].ptr),
                    Arg::I64(o.numel() as i64),
                ],
            )
        }
        Op::GeluGrad { tanh_approx } => {
            let name = kname("gelu_bwd", o.dtype)?;
            lw.n(
                name,
                o.numel(),
                vec![
                    Arg::P(o.ptr),
                    Arg::P(ins[0].ptr),
                    Arg::P(ins[1].ptr),
                    Arg::I64(o.numel() as i64),
                    Arg::I32(*tanh_approx as i32),
                ],
            )
        }
        Op::SoftmaxGrad { dim } => {
            let y = &ins[0];
            if norm(*dim, y.rank())? != y.rank() - 1 {
                return Err(lw.unsup(
                    "softmax_grad along a dim other than the last",
                    "transpose first",
                ));
            }
            let n = *y.shape.last().unwrap() as u64;
            let rows = if n == 0 { 0 } else { y.numel() / n };
            let name = kname("softmax_bwd", y.dtype)?;
            lw.rows(
                name,
                rows,
                256,
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::P(y.ptr),
                    Arg::P(ins[1].ptr),
                    Arg::I64(rows as i64),
                    Arg::I64(n as i64),
                ],
            )
        }
        Op::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            let (p, g, m, v, step) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
            let n = p.numel();
            let aligned = |ps: &[u64]| n % 8 == 0 && ps.iter().all(|x| x % 16 == 0);
            let hyper = [lr, beta1, beta2, eps, weight_decay].map(|x| Arg::F32(x.0 as f32));
            if let Some((glow, pout, low)) = lw.fused_adamw {
                let ptrs = [
                    pout,
                    outs[0].ptr,
                    outs[1].ptr,
                    outs[2].ptr,
                    p.ptr,
                    glow,
                    m.ptr,
                    v.ptr,
                ];
                let (name, items) = if low == DType::BF16 && aligned(&ptrs) {
                    ("adamw_master8_bf16", n / 8)
                } else {
                    (kname("adamw_master", low)?, n)
                };
                let mut args: Vec<Arg> = ptrs.into_iter().map(Arg::P).collect();
                args.extend([
                    Arg::P(step.ptr),
                    Arg::I32(code(step.dtype)),
                    Arg::I64(items as i64),
                ]);
                args.extend(hyper);
                return lw.n(name, items, args);
            }
            if g.dtype != p.dtype || m.dtype != v.dtype {
                return Err(lw.unsup(
                    "adamw",
                    "grad must have the param's dtype and m, v one dtype",
                ));
            }
            let ptrs = [
                outs[0].ptr,
                outs[1].ptr,
                outs[2].ptr,
                p.ptr,
                g.ptr,
                m.ptr,
                v.ptr,
            ];
            let (name, items) =
                if p.dtype == DType::BF16 && m.dtype == DType::BF16 && aligned(&ptrs) {
                    ("adamw8_bf16_bf16", n / 8)
                } else {
                    let name = format!(
                        "adamw_{}_{}",
                        fsuffix(p.dtype).unwrap_or("?"),
                        fsuffix(m.dtype).unwrap_or("?")
                    );
                    (intern(&name), n)
                };
            let mut args: Vec<Arg> = ptrs.into_iter().map(Arg::P).collect();
            args.extend([
                Arg::P(step.ptr),
                Arg::I32(code(step.dtype)),
                Arg::I64(items as i64),
            ]);
            args.extend(hyper);
            lw.n(name, items, args)
        }
        Op::Sgd {
            lr,
            momentum,
            weight_decay,
        } => {
            let (p, g) = (&ins[0], &ins[1]);
            let name = kname("sgd", p.dtype)?;
            let (buf, bo) = match ins.get(2) {
                Some(b) => (b.ptr, outs[1].ptr),
                None => (0, 0),
            };
            lw.n(
                name,
                p.numel(),
                vec![
                    Arg::P(outs[0].ptr),
                    Arg::P(bo),
                    Arg::P(p.ptr),
                    Arg::P(g.ptr),
                    Arg::P(buf),
                    Arg::I64(p.numel() as i64),
                    Arg::F32(lr.0 as f32),
                    Arg::F32(momentum.0 as f32),
                    Arg::F32(weight_decay.0 as f32),
                ],
            )
        }
        other if other.is_collective() => Err(lw.unsup(
            other.name(),
            "internal: collectives are lowered by the executor",
        )),
        other => Err(lw.unsup(
            &format!("op `{}`", other.name()),
            "no CUDA kernel for it yet",
        )),
    }
}

fn lower_matmul(
    lw: &mut Lower,
    a: &DevT,
    b: &DevT,
    o: &DevT,
    ta: bool,
    tb: bool,
) -> CudaResult<()> {
    if a.dtype != b.dtype || a.dtype != o.dtype {
        return Err(lw.unsup(
            "matmul on mixed dtypes",
            "operands and result must share a dtype",
        ));
    }
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(lw.unsup("matmul of vectors", "operands need two dims"));
    }
    let (m, k) = if ta {
        (a.shape[ra - 1], a.shape[ra - 2])
    } else {
        (a.shape[ra - 2], a.shape[ra - 1])
    };
    let n = if tb { b.shape[rb - 2] } else { b.shape[rb - 1] };
    let ba: usize = a.shape[..ra - 2].iter().product();
    let bb: usize = b.shape[..rb - 2].iter().product();
    let bo: usize = o.shape[..o.rank() - 2].iter().product();
    // b shared by every batch entry of a (and a not transposed): one big GEMM.
    if bb == 1 && !ta {
        let shape = GemmShape {
            dtype: a.dtype,
            m: (ba * m) as u64,
            n: n as u64,
            k: k as u64,
            ta,
            tb,
            batch: 1,
            sa: 0,
            sb: 0,
            sc: 0,
            bias: false,
            accumulate: false,
        };
        lw.gemm(shape, a.ptr, b.ptr, o.ptr, 0);
        return Ok(());
    }
    let ok = |x: usize| x == bo || x == 1;
    if !ok(ba) || !ok(bb) {
        return Err(lw.unsup(
            "matmul with partially broadcast batch dims",
            "expand the operand first",
        ));
    }
    let shape = GemmShape {
        dtype: a.dtype,
        m: m as u64,
        n: n as u64,
        k: k as u64,
        ta,
        tb,
        batch: bo as u64,
        sa: if ba == 1 { 0 } else { (m * k) as i64 },
        sb: if bb == 1 { 0 } else { (k * n) as i64 },
        sc: (m * n) as i64,
        bias: false,
        accumulate: false,
    };
    lw.gemm(shape, a.ptr, b.ptr, o.ptr, 0);
    Ok(())
}

/// The 16-byte-vector bf16 rms_norm kernel for rows of `h` (a multiple of 8, at most 8192)
/// with a f32 or bf16 weight, by chunks per thread; None where the generic kernel must run.
fn rms8_kernel(x: &DevT, w: &DevT, h: u64, base: &str) -> Option<&'static str> {
    if x.dtype != DType::BF16
        || !matches!(w.dtype, DType::BF16 | DType::F32)
        || !h.is_multiple_of(8)
        || !x.ptr.is_multiple_of(16)
        || !w.ptr.is_multiple_of(16)
    {
        return None;
    }
    let per_thread = (h / 8).div_ceil(256);
    Some(match (base, per_thread) {
        ("rms_fwd8_bf16", 0..=1) => "rms_fwd8_bf16_r1",
        ("rms_fwd8_bf16", 2) => "rms_fwd8_bf16_r2",
        ("rms_fwd8_bf16", 3..=4) => "rms_fwd8_bf16_r4",
        ("rms_bwd8_bf16", 0..=1) => "rms_bwd8_bf16_r1",
        ("rms_bwd8_bf16", 2) => "rms_bwd8_bf16_r2",
        ("rms_bwd8_bf16", 3..=4) => "rms_bwd8_bf16_r4",
        _ => return None,
    })
}

// ---------------------------------------------------------------- the executor

impl Executor {
    /// Loads `plan` for this process's rank (from the launcher environment).
    pub fn new(plan: &ExecutionPlan, opts: &ExecOptions) -> CudaResult<Executor> {
        let env = LaunchEnv::from_env()?;
        let world = plan.mesh.world_size().max(1);
        if env.world != world {
            if env.world == 1 && world > 1 {
                return Err(CudaError::Launcher(format!(
                    "the plan is for {world} ranks (mesh {}) but this process was launched alone\nhelp: launch {world} processes, e.g. `torchrun --nproc-per-node {world} weft run ...`",
                    plan.mesh
                )));
            }
            return Err(CudaError::Launcher(format!(
                "the plan is for {world} ranks but WORLD_SIZE is {}",
                env.world
            )));
        }
        let mut gopts = opts.gpu.clone();
        if env.world > 1 {
            gopts.ordinal = env.local_rank as usize;
        }
        let gpu = Gpu::new(&gopts)?;
        Self::with_gpu(gpu, plan, opts, env)
    }

    pub fn with_gpu(
        gpu: Gpu,
        plan: &ExecutionPlan,
        opts: &ExecOptions,
        env: LaunchEnv,
    ) -> CudaResult<Executor> {
        let t0 = std::time::Instant::now();
        let graph = weft_ir::parse(&plan.program)
            .map_err(|e| CudaError::Plan(format!("the plan's program does not parse: {e}")))?;
        if let Some(&n) = graph
            .nodes()
            .iter()
            .find(|&&n| matches!(graph.node(n).op, Op::HostAdamW { .. }))
        {
            return Err(CudaError::unsupported(
                "the host optimizer update (`host_adamw`, --offload-optimizer)",
                graph.describe(n),
                "the CUDA executor has no host AdamW loop yet; compile without --offload-optimizer (ZeRO shards the optimizer state on the device instead)",
            ));
        }
        if !graph.runtime_symbols().is_empty() {
            return Err(CudaError::unsupported(
                "data-dependent sizes (all_to_all_v)",
                plan.model.clone(),
                "the CUDA executor binds sizes once per plan",
            ));
        }
        let mut bindings = Bindings::new();
        for (k, v) in &plan.bindings {
            bindings = bindings.with(k, *v);
        }
        for (i, (axis, _)) in plan.mesh.axes.iter().enumerate() {
            bindings = bindings.with_coord(axis, plan.mesh.coords(env.rank)[i] as i64);
        }
        let mut gemm = Gemm::new(&gpu, opts.gemm_workspace)?;
        gemm.allow_tf32 = opts.allow_tf32;

        // Allocations: the resident region and the arena, as planned.
        let oom = |e: CudaError, what: &str| {
            match e {
            CudaError::OutOfMemory { bytes, free, total, .. } => CudaError::OutOfMemory {
                what: what.to_string(),
                bytes,
                free,
                total,
                breakdown: plan.memory.breakdown.clone(),
                help: "the plan's memory (above) does not fit: raise sequence or tensor parallelism, or use --checkpoint / --offload".into(),
            },
            e => e,
        }
        };
        let resident = gpu
            .alloc(
                plan.memory.resident_bytes.max(256) as usize,
                "the resident region (params, grads, optimizer state)",
            )
            .map_err(|e| oom(e, "the resident region"))?;
        let arena = gpu
            .alloc(
                plan.memory.arena_bytes.max(256) as usize,
                "the activation arena",
            )
            .map_err(|e| oom(e, "the activation arena"))?;
        let host_need = plan
            .buffers
            .iter()
            .filter(|b| b.category == Category::Host)
            .map(|b| b.offset + b.bytes)
            .max()
            .unwrap_or(0)
            .max(plan.memory.host_bytes);
        let host = if host_need > 0 {
            Some(gpu.alloc_pinned(host_need as usize)?)
        } else {
            None
        };

        // Buffers: pointers and evaluated shapes.
        let value_node: HashMap<u32, Node> = graph
            .nodes()
            .iter()
            .flat_map(|&n| graph.node(n).results.iter().map(move |v| (v.0, n)))
            .collect();
        let mut bufs = Vec::with_capacity(plan.buffers.len());
        for b in &plan.buffers {
            let v = weft_ir::Value(b.value);
            let ty = graph.try_ty(v).ok_or_else(|| {
                CudaError::Plan(format!(
                    "buffer {} holds %{} which the program lacks",
                    b.id, b.value
                ))
            })?;
            let shape: Vec<usize> = ty
                .shape
                .iter()
                .map(|d| d.eval(&bindings).map(|x| x.max(0) as usize))
                .collect::<Result<_, _>>()
                .map_err(|e| CudaError::Plan(format!("cannot size %{}: {e}", b.value)))?;
            let t = DevT {
                ptr: 0,
                dtype: ty.dtype,
                shape,
            };
            if t.bytes() > b.bytes {
                return Err(CudaError::Plan(format!(
                    "buffer {} (%{}) needs {} bytes but the plan gives {}",
                    b.id,
                    b.value,
                    t.bytes(),
                    b.bytes
                )));
            }
            let ptr = match b.category {
                Category::Host => host.as_ref().map(|h| h.ptr as u64 + b.offset).unwrap_or(0),
                _ if b.resident => resident.ptr + b.offset,
                _ => arena.ptr + b.offset,
            };
            if !b.resident
                && b.category != Category::Host
                && b.offset + b.bytes > plan.memory.arena_bytes.max(256)
            {
                return Err(CudaError::Plan(format!(
                    "buffer {} ends past the arena",
                    b.id
                )));
            }
            if b.resident
                && b.category != Category::Host
                && b.offset + b.bytes > plan.memory.resident_bytes.max(256)
            {
                return Err(CudaError::Plan(format!(
                    "buffer {} ends past the resident region",
                    b.id
                )));
            }
            bufs.push(DevT { ptr, ..t });
        }

        let streams: Vec<Stream> = plan
            .streams
            .iter()
            .map(|_| gpu.stream())
            .collect::<CudaResult<_>>()?;
        let events: Vec<Event> = (0..plan.events)
            .map(|_| gpu.event(false))
            .collect::<CudaResult<_>>()?;

        // NCCL: per-axis communicators (also for one rank, as a check that NCCL runs).
        let has_coll = plan.instructions.iter().any(|i| i.axis.is_some());
        let (comms, nccl) = if env.world > 1 || (opts.nccl && super::probe::nccl_present()) {
            match Comms::new(&env, &plan.groups) {
                Ok(c) => {
                    let s = format!("{} rank(s), {} axis communicator(s)", c.ranks, c.axes.len());
                    (Some(c), s)
                }
                Err(e) if env.world == 1 && !has_coll => {
                    (None, format!("unavailable ({e}); not needed for one rank"))
                }
                Err(e) => return Err(e),
            }
        } else {
            (None, "not loaded (one rank)".to_string())
        };

        // Updated params / optimizer state go back into their inputs after each step.
        let mut updates = Vec::new();
        let buf_of_value: HashMap<u32, u32> =
            plan.buffers.iter().map(|b| (b.value, b.id)).collect();
        let params: HashMap<String, u32> = graph
            .params()
            .into_iter()
            .filter_map(|(n, v)| buf_of_value.get(&v.0).map(|&b| (n, b)))
            .collect();
        for (name, v) in graph.outputs() {
            let target =
                weft_ir::plan::fed_back_param(name, |n| params.contains_key(n)).map(|n| &params[n]);
            if let (Some(&to), Some(&from)) = (target, buf_of_value.get(&v.0)) {
                if to != from {
                    updates.push((from, to));
                }
            }
        }

        // Aliases (`alias_of`) take their root's pointer; `root_of` maps every buffer to
        // the buffer holding its bytes. Reshapes are views: the plan makes a reshape's
        // output a view of its input's root buffer (same bytes, held over the group's
        // live ranges), and the reshape runs nothing. Updates are in place: the plan
        // writes an updated param / optimizer state over the input it replaces once the
        // old value is dead (and `cross_entropy_grad` over logits that die there), so
        // such an update shares its target's bytes and has nothing to copy back.
        let nb = plan.buffers.len();
        let mut root_of: Vec<u32> = (0..nb as u32).collect();
        for b in &plan.buffers {
            let mut r = b.id;
            for _ in 0..=nb {
                match plan.buffers.get(r as usize).map(|x| x.alias_of) {
                    Some(Some(a)) => r = a,
                    Some(None) => break,
                    None => {
                        return Err(CudaError::Plan(format!(
                            "buffer {} is a view of buffer {r}, which the plan lacks",
                            b.id
                        )))
                    }
                }
            }
            if plan.buffers[r as usize].alias_of.is_some()
                || bufs[b.id as usize].bytes() > bufs[r as usize].bytes()
            {
                return Err(CudaError::Plan(format!("buffer {} is a view but its alias chain ends at no buffer of its size with storage", b.id)));
            }
            root_of[b.id as usize] = r;
            bufs[b.id as usize].ptr = bufs[r as usize].ptr;
        }
        updates.retain(|&(from, to)| root_of[from as usize] != root_of[to as usize]);
        let mut elided: std::collections::HashSet<u32> = std::collections::HashSet::new();
        for ins in plan
            .instructions
            .iter()
            .filter(|i| i.op == "reshape" && i.inputs.len() == 1 && i.outputs.len() == 1)
        {
            let (ib, ob) = (ins.inputs[0] as usize, ins.outputs[0] as usize);
            if root_of[ob] as usize != ob && root_of[ob] == root_of[ib] {
                elided.insert(ins.id);
            }
        }
        let mut last_read = vec![0u32; nb];
        for ins in &plan.instructions {
            for &b in &ins.inputs {
                let r = root_of[b as usize] as usize;
                last_read[r] = last_read[r].max(ins.id);
            }
        }
        // Mixed-precision AdamW as the `optimizer` pass writes it, cast(grad) -> adamw on
        // the f32 master -> cast back, runs as one kernel: the casts are elided.
        let mut readers: Vec<Vec<u32>> = vec![Vec::new(); nb];
        let mut producer: Vec<Option<u32>> = vec![None; nb];
        for ins in &plan.instructions {
            for &b in &ins.inputs {
                readers[b as usize].push(ins.id);
            }
            for &b in &ins.outputs {
                producer[b as usize].get_or_insert(ins.id);
            }
        }
        let outputs: std::collections::HashSet<u32> = graph
            .outputs()
            .iter()
            .filter_map(|(_, v)| plan.buffers.iter().find(|b| b.value == v.0).map(|b| b.id))
            .collect();
        let mut fused: HashMap<u32, (u32, u32)> = HashMap::new(); // adamw -> (low grad, low param out)
        let mut writer: Vec<Option<u32>> = producer.clone();
        for a_ins in plan
            .instructions
            .iter()
            .filter(|i| i.op == "adamw" && i.inputs.len() == 5)
        {
            let gb = a_ins.inputs[1] as usize;
            let Some(c1) = producer[gb] else { continue };
            let c1i = &plan.instructions[c1 as usize];
            let p32 = a_ins.outputs[0] as usize;
            let low = |d: DType| d == DType::BF16 || d == DType::F16;
            if c1i.op != "cast"
                || readers[gb] != [a_ins.id]
                || outputs.contains(&(gb as u32))
                || !low(bufs[c1i.inputs[0] as usize].dtype)
                || bufs[gb].dtype != DType::F32
            {
                continue;
            }
            if [a_ins.inputs[0], a_ins.inputs[2], a_ins.inputs[3]]
                .iter()
                .any(|&b| bufs[b as usize].dtype != DType::F32)
            {
                continue;
            }
            let [c2] = readers[p32].as_slice() else {
                continue;
            };
            let c2i = &plan.instructions[*c2 as usize];
            if c2i.op != "cast"
                || bufs[c2i.outputs[0] as usize].dtype != bufs[c1i.inputs[0] as usize].dtype
                || c2i.stream != a_ins.stream
                || c1i.stream != a_ins.stream
            {
                continue;
            }
            // Fused, the low param is written at the adamw, not at the cast. When the plan
            // writes it in place over the old param, the old value must be dead there too:
            // nothing reads those bytes from the adamw to the cast, and nothing on the
            // stream waits for an event in between (so every read ordered before the cast
            // is ordered before the adamw).
            let lo = c2i.outputs[0] as usize;
            if root_of[lo] as usize != lo {
                let r = root_of[lo];
                let between = |i: &&weft_ir::plan::Instruction| i.id >= a_ins.id && i.id < *c2;
                let read = plan
                    .instructions
                    .iter()
                    .filter(between)
                    .any(|i| i.inputs.iter().any(|&b| root_of[b as usize] == r));
                let waits = plan
                    .instructions
                    .iter()
                    .filter(between)
                    .any(|i| i.stream == a_ins.stream && i.id > a_ins.id && !i.wait.is_empty())
                    || !c2i.wait.is_empty();
                if read || waits {
                    continue;
                }
            }
            fused.insert(a_ins.id, (c1i.inputs[0], c2i.outputs[0]));
            elided.insert(c1);
            elided.insert(*c2);
            writer[c2i.outputs[0] as usize] = Some(a_ins.id);
        }
        // Updates the plan did not write in place (older plans, or where it could not)
        // write in place here when nothing after the write reads the old value (an
        // elementwise optimizer kernel may read it itself): no copy back, and the
        // `param.*` / `optim.*` outputs alias what they update. Updates the plan wrote
        // in place were dropped above; the groups left here hold one value each.
        let mut aliased: Vec<u32> = Vec::new();
        for &(ob, to) in &updates {
            let Some(w) = writer[ob as usize] else {
                continue;
            };
            // A view is written by its root's producer: leave it (and its root) to the
            // copy back.
            if root_of[ob as usize] != ob {
                continue;
            }
            let wi = &plan.instructions[w as usize];
            let tr = root_of[to as usize] as usize;
            if bufs[ob as usize].bytes() != bufs[to as usize].bytes()
                || bufs[ob as usize].dtype != bufs[to as usize].dtype
            {
                continue;
            }
            let reads_it = wi
                .inputs
                .iter()
                .any(|&b| root_of[b as usize] as usize == tr);
            let ok = if reads_it {
                // elementwise in place: the optimizer reading the value it replaces
                let pairs: &[(usize, usize)] = match wi.op.as_str() {
                    "adamw" => &[(0, 0), (2, 1), (3, 2)],
                    "sgd" => &[(0, 0), (2, 1)],
                    _ => &[],
                };
                let pos_out = wi.outputs.iter().position(|&b| b == ob);
                let pos_in = wi
                    .inputs
                    .iter()
                    .position(|&b| root_of[b as usize] as usize == tr);
                pairs
                    .iter()
                    .any(|&(i, o)| Some(i) == pos_in && Some(o) == pos_out)
                    && last_read[tr] <= w
            } else {
                last_read[tr] < w
            };
            if ok {
                // the update's views move with it
                let ptr = bufs[to as usize].ptr;
                for b in (0..nb).filter(|&b| root_of[b] == ob) {
                    bufs[b].ptr = ptr;
                }
                aliased.push(ob);
            }
        }
        updates.retain(|(from, _)| !aliased.contains(from));

        // cuDNN attention, when asked for: absence falls back to Weft's kernels (one line).
        let cudnn = if opts.cudnn_attention && opts.fast_attention {
            match cudnn_sdpa::Sdpa::new(
                streams
                    .iter()
                    .map(|s| s.0 as *mut std::ffi::c_void)
                    .collect(),
            ) {
                Ok(c) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        eprintln!(
                            "weft: attention: cuDNN {} fused flash attention (WEFT_ATTENTION=weft for Weft's kernels)",
                            cudnn_sdpa::version_text(c.version)
                        )
                    });
                    Some(RefCell::new(c))
                }
                Err(e) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        eprintln!(
                            "weft: attention: cuDNN cannot be used, running Weft's kernels: {e}"
                        )
                    });
                    None
                }
            }
        } else {
            None
        };

        // Lowering, twice: sizes first, then pointers.
        let ns = plan.streams.len().max(1);
        let lower_all = |ex: Extra| -> CudaResult<(Vec<Step>, Extra)> {
            let mut lw = Lower {
                gpu: &gpu,
                ex,
                steps: Vec::new(),
                stream: 0,
                ins: 0,
                fast_attention: opts.fast_attention,
                tuning: opts.tuning,
                attn_lse: HashMap::new(),
                cudnn: cudnn.as_ref(),
                cudnn_lse: HashSet::new(),
                ce_lse: HashMap::new(),
                location: String::new(),
                fused_adamw: None,
            };
            for ins in &plan.instructions {
                lw.stream = ins.stream as usize;
                lw.ins = ins.id;
                lw.ex.cur = 0;
                let node = *value_node.get(&ins.node).ok_or_else(|| {
                    CudaError::Plan(format!(
                        "instruction {} runs %{} which the program lacks",
                        ins.id, ins.node
                    ))
                })?;
                let nd = graph.node(node);
                lw.location = format!("instruction {} ({})", ins.id, graph.describe(node));
                for e in &ins.wait {
                    lw.push(StepKind::Wait(*e));
                }
                let ti: Vec<DevT> = ins
                    .inputs
                    .iter()
                    .map(|&b| bufs[b as usize].clone())
                    .collect();
                let to: Vec<DevT> = ins
                    .outputs
                    .iter()
                    .map(|&b| bufs[b as usize].clone())
                    .collect();
                lw.fused_adamw = fused.get(&ins.id).map(|&(g, p)| {
                    (
                        bufs[g as usize].ptr,
                        bufs[p as usize].ptr,
                        bufs[g as usize].dtype,
                    )
                });
                if elided.contains(&ins.id) {
                    // a view: nothing to run
                } else if nd.op.is_collective() {
                    lower_collective(&mut lw, &nd.op, &ti, &to, env.world)?;
                } else if matches!(nd.op.name(), "offload" | "reload") {
                    let kind = if nd.op.name() == "offload" {
                        CopyKind::D2H
                    } else {
                        CopyKind::H2D
                    };
                    lw.push(StepKind::Copy {
                        dst: to[0].ptr,
                        src: ti[0].ptr,
                        bytes: to[0].bytes(),
                        kind,
                    });
                } else {
                    lower_op(&mut lw, &nd.op, &ti, &to, &bindings)?;
                }
                if let Some(e) = ins.signal {
                    lw.push(StepKind::Record(e));
                }
            }
            Ok((lw.steps, lw.ex))
        };
        let zero = Extra {
            scratch_base: vec![0; ns],
            scratch_need: vec![0; ns],
            cur: 0,
            side_base: 0,
            side_used: 0,
            consts_base: 0,
            consts: Vec::new(),
        };
        let (_, sized) = lower_all(zero)?;
        let mut extra_bytes = 0u64;
        let mut scratch_off = Vec::with_capacity(ns);
        for &n in &sized.scratch_need {
            scratch_off.push(extra_bytes);
            extra_bytes += align256(n);
        }
        let side_off = extra_bytes;
        extra_bytes += align256(sized.side_used);
        let consts_off = extra_bytes;
        extra_bytes += align256(sized.consts.len() as u64);
        let extra = gpu
            .alloc(extra_bytes.max(256) as usize, "kernel scratch")
            .map_err(|e| oom(e, "kernel scratch"))?;
        let real = Extra {
            scratch_base: scratch_off.iter().map(|o| extra.ptr + o).collect(),
            scratch_need: vec![0; ns],
            cur: 0,
            side_base: extra.ptr + side_off,
            side_used: 0,
            consts_base: extra.ptr + consts_off,
            consts: Vec::new(),
        };
        let (steps, filled) = lower_all(real)?;
        gpu.htod(extra.ptr + consts_off, &filled.consts)?;

        let t_start = gpu.event(true)?;
        let t_ends = (0..streams.len())
            .map(|_| gpu.event(true))
            .collect::<CudaResult<Vec<_>>>()?;
        let (free, _) = gpu.mem_info()?;
        let load = LoadReport {
            kernel_compile_s: gpu.compile.seconds,
            kernel_cache_hit: gpu.compile.cache_hit,
            lower_s: t0.elapsed().as_secs_f64(),
            launches_per_step: steps
                .iter()
                .filter(|s| {
                    matches!(
                        s.kind,
                        StepKind::Launch(_) | StepKind::Gemm { .. } | StepKind::Cudnn(_)
                    )
                })
                .count(),
            gemm_shapes: 0,
            nccl,
            fast_attention: opts.fast_attention,
            device: format!(
                "{} (sm_{}{}, {} SMs, {:.0} GiB)",
                gpu.info.name,
                gpu.info.compute_capability.0,
                gpu.info.compute_capability.1,
                gpu.info.multiprocessors,
                gpu.info.total_memory as f64 / (1u64 << 30) as f64
            ),
        };
        Ok(Executor {
            gemm,
            tuning: opts.tuning,
            plan: plan.clone(),
            graph,
            env,
            streams,
            events,
            t_start,
            t_ends,
            _resident: resident,
            _arena: arena,
            planned_extra: extra_bytes,
            _extra: extra,
            host,
            bufs,
            steps,
            comms,
            updates,
            load,
            min_free: free,
            profile: None,
            gpu,
        })
    }

    /// How many steps run cuDNN's fused attention (0 unless `cudnn_attention` was asked
    /// for and cuDNN could run the plan's attention).
    pub fn cudnn_attention_steps(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| matches!(s.kind, StepKind::Cudnn(_)))
            .count()
    }

    /// The device tensor holding program value `%v`.
    pub fn value(&self, v: u32) -> Option<&DevT> {
        self.plan
            .buffers
            .iter()
            .find(|b| b.value == v)
            .map(|b| &self.bufs[b.id as usize])
    }

    /// Copies weights into the resident params (optimizer state not in `weights` is zeroed).
    pub fn load_params(&mut self, weights: &BTreeMap<String, HostTensor>) -> CudaResult<()> {
        self.gpu.bind()?;
        let mut masters = Vec::new();
        for (name, v) in self.graph.params() {
            let t = self
                .value(v.0)
                .cloned()
                .ok_or_else(|| CudaError::Plan(format!("param `{name}` has no buffer")))?;
            match weights.get(&name) {
                Some(w) => {
                    if w.shape != t.shape {
                        if !self.graph.param_partition(&name).is_empty() {
                            return Err(CudaError::unsupported(format!("sharded param `{name}`"), "load_params", "loading a rank's piece of a split param is not written yet"));
                        }
                        return Err(CudaError::Plan(format!("weight `{name}` has shape {:?} but the program wants {:?}", w.shape, t.shape)));
                    }
                    self.gpu.htod(t.ptr, &layout::to_device_bytes(w, t.dtype))?;
                }
                None if ValueRole::of(&name) == Some(ValueRole::MasterWeight) => masters.push(name.clone()),
                None if ValueRole::of(&name).is_some_and(|r| r.is_optimizer_state()) || name.contains(".exp_avg") => self.gpu.memset(t.ptr, 0, t.bytes() as usize)?,
                None => return Err(CudaError::Plan(format!("no weight for param `{name}`\nhelp: pass --weights, or let the CLI initialise random weights"))),
            }
        }
        self.init_masters(&masters)
    }

    /// Master weights (`optim.master.<p>`) start as the params they shadow (cast on the device).
    fn init_masters(&mut self, masters: &[String]) -> CudaResult<()> {
        let params: BTreeMap<String, weft_ir::Value> = self.graph.params().into_iter().collect();
        for m in masters {
            let ValueName::MasterWeight(src) = ValueName::parse(m) else {
                continue;
            };
            let (Some(sv), Some(mv)) = (params.get(src), params.get(m)) else {
                return Err(CudaError::Plan(format!(
                    "master weight `{m}` has no param `{src}` to start from"
                )));
            };
            let (s, d) = (
                self.value(sv.0).cloned().unwrap(),
                self.value(mv.0).cloned().unwrap(),
            );
            if s.numel() != d.numel() {
                return Err(CudaError::unsupported(
                    format!("master weight `{m}`"),
                    "load_params",
                    "a sharded master copy (ZeRO) is not initialised on the device yet",
                ));
            }
            let l = self.gpu.launch_n(
                "cast_any",
                d.numel(),
                vec![
                    Arg::P(d.ptr),
                    Arg::I32(code(d.dtype)),
                    Arg::P(s.ptr),
                    Arg::I32(code(s.dtype)),
                    Arg::I64(d.numel() as i64),
                ],
            )?;
            l.enqueue(self.streams[0].0)?;
        }
        self.gpu.sync()
    }

    /// Copies the program's inputs (by input name) to the device.
    pub fn set_inputs(&mut self, inputs: &BTreeMap<String, HostTensor>) -> CudaResult<()> {
        self.gpu.bind()?;
        for (name, _, v) in self.graph.inputs() {
            let t = self
                .value(v.0)
                .cloned()
                .ok_or_else(|| CudaError::Plan(format!("input `{name}` has no buffer")))?;
            let h = inputs
                .get(&name)
                .ok_or_else(|| CudaError::Plan(format!("no tensor for input `{name}`")))?;
            if h.shape != t.shape {
                return Err(CudaError::Plan(format!("input `{name}` has shape {:?} but the plan is for {:?} (compile with matching --seq/--batch)", h.shape, t.shape)));
            }
            self.gpu.htod(t.ptr, &layout::to_device_bytes(h, t.dtype))?;
        }
        Ok(())
    }

    /// Writes a param (or optimizer state) by name.
    pub fn set_param(&mut self, name: &str, t: &HostTensor) -> CudaResult<()> {
        let v = self
            .graph
            .params()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| CudaError::Plan(format!("no param `{name}`")))?;
        let d = self
            .value(v.0)
            .cloned()
            .ok_or_else(|| CudaError::Plan(format!("param `{name}` has no buffer")))?;
        self.gpu.htod(d.ptr, &layout::to_device_bytes(t, d.dtype))
    }

    /// Runs the program once (every instruction on its stream), then copies updated
    /// params and optimizer state back into place. Blocks until the device is done.
    pub fn run_step(&mut self) -> CudaResult<StepTiming> {
        self.gpu.bind()?;
        let wall = std::time::Instant::now();
        let s0 = self.streams[0].0;
        // SAFETY: live event and stream.
        unsafe { dr::event::record(self.t_start.0, s0) }
            .map_err(|e| CudaError::driver("cuEventRecord", e))?;
        for s in 1..self.streams.len() {
            unsafe {
                dr::stream::wait_event(
                    self.streams[s].0,
                    self.t_start.0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
        }
        // Profiling (WEFT_PROFILE): an event before each instruction's work on stream 0.
        let profiling = self.tuning.profile;
        let mut marks: Vec<(u32, Event)> = Vec::new();
        let mut last_ins = u32::MAX;
        for i in 0..self.steps.len() {
            if profiling && self.steps[i].stream == 0 && self.steps[i].ins != last_ins {
                last_ins = self.steps[i].ins;
                let e = self.gpu.event(true)?;
                unsafe { dr::event::record(e.0, s0) }
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                marks.push((last_ins, e));
            }
            self.exec(i)?;
        }
        let upd_mark = if profiling {
            let e = self.gpu.event(true)?;
            unsafe { dr::event::record(e.0, s0) }
                .map_err(|e| CudaError::driver("cuEventRecord", e))?;
            Some(e)
        } else {
            None
        };
        // Join every stream into stream 0, then the updates.
        for s in 1..self.streams.len() {
            unsafe {
                dr::event::record(self.t_ends[s].0, self.streams[s].0)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                dr::stream::wait_event(
                    s0,
                    self.t_ends[s].0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
            }
        }
        for &(from, to) in &self.updates {
            let (f, t) = (&self.bufs[from as usize], &self.bufs[to as usize]);
            self.gpu.dtod_async(t.ptr, f.ptr, f.bytes() as usize, s0)?;
        }
        unsafe { dr::event::record(self.t_ends[0].0, s0) }
            .map_err(|e| CudaError::driver("cuEventRecord", e))?;
        let enqueue_s = wall.elapsed().as_secs_f64();
        unsafe { dr::event::synchronize(self.t_ends[0].0) }
            .map_err(|e| CudaError::driver("cuEventSynchronize (the step)", e))?;
        let ms = unsafe { dr::event::elapsed(self.t_start.0, self.t_ends[0].0) }
            .map_err(|e| CudaError::driver("cuEventElapsedTime", e))?;
        let flag = self.gpu.take_err_flag()?;
        if flag != 0 {
            return Err(CudaError::BadData {
                after: "the step".into(),
                message: err_flag_text(flag).into(),
            });
        }
        if let Some(end) = upd_mark {
            let mut by_op: BTreeMap<String, (usize, f64)> = BTreeMap::new();
            for k in 0..marks.len() {
                let next = if k + 1 < marks.len() {
                    &marks[k + 1].1
                } else {
                    &end
                };
                let ms = unsafe { dr::event::elapsed(marks[k].1 .0, next.0) }.unwrap_or(0.0) as f64;
                let ins = &self.plan.instructions[marks[k].0 as usize];
                let key = format!(
                    "{}{}",
                    ins.op,
                    if ins.op == "matmul" || ins.op == "linear" {
                        format!(" {:?}", self.bufs[ins.outputs[0] as usize].shape)
                    } else {
                        String::new()
                    }
                );
                let e = by_op.entry(key).or_insert((0, 0.0));
                e.0 += 1;
                e.1 += ms;
            }
            let upd = unsafe { dr::event::elapsed(end.0, self.t_ends[0].0) }.unwrap_or(0.0) as f64;
            by_op.insert("(update copies)".into(), (self.updates.len(), upd));
            self.profile = Some(by_op);
        }
        if let Ok((free, _)) = self.gpu.mem_info() {
            self.min_free = self.min_free.min(free);
        }
        self.load.gemm_shapes = self.gemm.cached_shapes();
        Ok(StepTiming {
            device_s: ms as f64 / 1e3,
            wall_s: wall.elapsed().as_secs_f64(),
            enqueue_s,
        })
    }

    fn exec(&mut self, i: usize) -> CudaResult<()> {
        let st = &self.steps[i];
        let s = self.streams[st.stream].0;
        let at = |e: CudaError| -> CudaError {
            match e {
                CudaError::Driver { call, code } => CudaError::Driver {
                    call: format!("{call} at instruction {}", st.ins),
                    code,
                },
                e => e,
            }
        };
        match &st.kind {
            StepKind::Launch(l) => l.enqueue(s).map_err(at),
            StepKind::Gemm {
                shape,
                a,
                b,
                c,
                bias,
            } => self.gemm.run(shape, *a, *b, *c, *bias, s),
            StepKind::Copy {
                dst,
                src,
                bytes,
                kind,
            } => {
                let r = unsafe {
                    match kind {
                        CopyKind::D2D => dr::memcpy_dtod_async(*dst, *src, *bytes as usize, s),
                        CopyKind::D2H => sys::cuMemcpyDtoHAsync_v2(
                            *dst as *mut std::ffi::c_void,
                            *src,
                            *bytes as usize,
                            s,
                        )
                        .result(),
                        CopyKind::H2D => sys::cuMemcpyHtoDAsync_v2(
                            *dst,
                            *src as *const std::ffi::c_void,
                            *bytes as usize,
                            s,
                        )
                        .result(),
                    }
                };
                r.map_err(|e| at(CudaError::driver("cuMemcpyAsync", e)))
            }
            StepKind::Memset { dst, bytes } => {
                unsafe { dr::memset_d8_async(*dst, 0, *bytes as usize, s) }
                    .map_err(|e| at(CudaError::driver("cuMemsetD8Async", e)))
            }
            StepKind::Wait(e) => unsafe {
                dr::stream::wait_event(
                    s,
                    self.events[*e as usize].0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| at(CudaError::driver("cuStreamWaitEvent", e))),
            StepKind::Record(e) => unsafe { dr::event::record(self.events[*e as usize].0, s) }
                .map_err(|e| at(CudaError::driver("cuEventRecord", e))),
            StepKind::Grouped(g) => {
                let g = g.clone();
                self.grouped(&g, s)
            }
            StepKind::Cudnn(x) => x
                .run()
                .map_err(|e| CudaError::Plan(format!("{e} at instruction {}", st.ins))),
            StepKind::Collective {
                coll,
                axis,
                send,
                recv,
                count,
                dtype,
            } => {
                let comm = match &self.comms {
                    Some(c) => c.axis(axis)?,
                    None => {
                        // One rank and no NCCL: every collective is a copy.
                        let bytes = count * dtype.size_bytes();
                        return if send != recv {
                            unsafe { dr::memcpy_dtod_async(*recv, *send, bytes as usize, s) }
                                .map_err(|e| CudaError::driver("cuMemcpyDtoDAsync", e))
                        } else {
                            Ok(())
                        };
                    }
                };
                let ty = comm::nccl_type(*dtype)?;
                let red = |op: &ReduceOp| match op {
                    ReduceOp::Sum => cudarc::nccl::sys::ncclRedOp_t::ncclSum,
                    ReduceOp::Avg => cudarc::nccl::sys::ncclRedOp_t::ncclAvg,
                    ReduceOp::Max => cudarc::nccl::sys::ncclRedOp_t::ncclMax,
                    ReduceOp::Min => cudarc::nccl::sys::ncclRedOp_t::ncclMin,
                };
                let cs = s as cudarc::nccl::sys::cudaStream_t;
                let (sp, rp) = (
                    *send as *const std::ffi::c_void,
                    *recv as *mut std::ffi::c_void,
                );
                let n = *count as usize;
                // SAFETY: buffers sized by the plan; comm live.
                let r = unsafe {
                    match coll {
                        Coll::AllReduce { op } => {
                            cudarc::nccl::sys::ncclAllReduce(sp, rp, n, ty, red(op), comm, cs)
                        }
                        Coll::AllGather => {
                            cudarc::nccl::sys::ncclAllGather(sp, rp, n, ty, comm, cs)
                        }
                        Coll::ReduceScatter { op } => {
                            cudarc::nccl::sys::ncclReduceScatter(sp, rp, n, ty, red(op), comm, cs)
                        }
                        Coll::Broadcast { root } => {
                            cudarc::nccl::sys::ncclBroadcast(sp, rp, n, ty, *root, comm, cs)
                        }
                    }
                };
                r.result().map(|_| ()).map_err(|e| {
                    CudaError::nccl(
                        &format!("{coll:?} over `{axis}` at instruction {}", st.ins),
                        e,
                    )
                })
            }
        }
    }

    /// Grouped GEMMs: reads the row counts (a sync of this stream), then one GEMM per group.
    fn grouped(&mut self, g: &Grouped, s: sys::CUstream) -> CudaResult<()> {
        unsafe { dr::stream::synchronize(s) }
            .map_err(|e| CudaError::driver("cuStreamSynchronize (expert counts)", e))?;
        let mut raw = vec![0u8; g.ncounts * 8];
        self.gpu.dtoh(&mut raw, g.counts)?;
        let counts: Vec<i64> = raw
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let total: i64 = counts.iter().sum();
        if counts.iter().any(|&c| c < 0) || total as u64 != g.rows {
            return Err(CudaError::BadData {
                after: "moe_dispatch".into(),
                message: format!("expert counts {counts:?} do not sum to the {} rows", g.rows),
            });
        }
        let es = g.dtype.size_bytes();
        if let Some((_, dw)) = g.grad {
            unsafe { dr::memset_d8_async(dw, 0, (g.experts as u64 * g.n * g.k * es) as usize, s) }
                .map_err(|e| CudaError::driver("cuMemsetD8Async", e))?;
            if g.dbias != 0 {
                unsafe {
                    dr::memset_d8_async(g.dbias, 0, (g.experts as u64 * g.n * es) as usize, s)
                }
                .map_err(|e| CudaError::driver("cuMemsetD8Async", e))?;
            }
        }
        let plain =
            |m: u64, n: u64, k: u64, ta: bool, tb: bool, accumulate: bool, bias: bool| GemmShape {
                dtype: g.dtype,
                m,
                n,
                k,
                ta,
                tb,
                batch: 1,
                sa: 0,
                sb: 0,
                sc: 0,
                bias,
                accumulate,
            };
        let mut at = 0u64;
        for (gi, &c) in counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let c = c as u64;
            let e = (gi % g.experts) as u64;
            let w = g.w + e * g.n * g.k * es;
            let x = g.x + at * g.k * es;
            match g.grad {
                None => {
                    let out = g.out + at * g.n * es;
                    // out_g [c, n] = x_g [c, k] @ w[e]^T ([n, k]) or @ w[e] ([k, n]) (+ bias[e])
                    let bias = if g.bias != 0 {
                        g.bias + e * g.n * es
                    } else {
                        0
                    };
                    let shape = plain(c, g.n, g.k, false, !g.transpose_w, false, g.bias != 0);
                    self.gemm.run(&shape, x, w, out, bias, s)?;
                }
                Some((dy, dw)) => {
                    let dyp = dy + at * g.n * es;
                    let dx = g.out + at * g.k * es;
                    // dx_g [c, k] = dy_g [c, n] @ w[e] ([n, k]) or @ w[e]^T ([k, n])
                    let shape = plain(c, g.k, g.n, false, g.transpose_w, false, false);
                    self.gemm.run(&shape, dyp, w, dx, 0, s)?;
                    let dwp = dw + e * g.n * g.k * es;
                    if g.transpose_w {
                        // dw[e] [k, n] += x_g^T [k, c] @ dy_g [c, n]
                        let shape = plain(g.k, g.n, c, true, false, true, false);
                        self.gemm.run(&shape, x, dyp, dwp, 0, s)?;
                    } else {
                        // dw[e] [n, k] += dy_g^T [n, c] @ x_g [c, k]
                        let shape = plain(g.n, g.k, c, true, false, true, false);
                        self.gemm.run(&shape, dyp, x, dwp, 0, s)?;
                    }
                    if g.dbias != 0 {
                        // dbias[e] [1, n] += ones [1, c] @ dy_g [c, n]
                        let shape = plain(1, g.n, c, false, false, true, false);
                        self.gemm
                            .run(&shape, g.ones, dyp, g.dbias + e * g.n * es, 0, s)?;
                    }
                }
            }
            at += c;
        }
        Ok(())
    }

    /// Reads a program value back as a host tensor.
    pub fn read(&self, t: &DevT) -> CudaResult<HostTensor> {
        self.gpu.bind()?;
        let mut b = vec![0u8; t.bytes() as usize];
        self.gpu.dtoh(&mut b, t.ptr)?;
        Ok(layout::from_device_bytes(&b, t.dtype, t.shape.clone()))
    }

    /// An output of the program by name.
    pub fn output(&self, name: &str) -> CudaResult<HostTensor> {
        let v = self
            .graph
            .output(name)
            .ok_or_else(|| CudaError::Plan(format!("the program has no output `{name}`")))?;
        let t = self
            .value(v.0)
            .ok_or_else(|| CudaError::Plan(format!("output `{name}` has no buffer")))?;
        self.read(t)
    }

    /// A param's current value by name.
    pub fn param(&self, name: &str) -> CudaResult<HostTensor> {
        let v = self
            .graph
            .params()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| CudaError::Plan(format!("no param `{name}`")))?;
        let t = self
            .value(v.0)
            .ok_or_else(|| CudaError::Plan(format!("param `{name}` has no buffer")))?;
        self.read(t)
    }

    pub fn output_names(&self) -> Vec<String> {
        self.graph
            .outputs()
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub fn memory(&self) -> MemoryUse {
        MemoryUse {
            planned_peak_bytes: self.plan.memory.peak_bytes,
            planned_arena_bytes: self.plan.memory.arena_bytes,
            planned_resident_bytes: self.plan.memory.resident_bytes,
            planned_breakdown: self.plan.memory.breakdown.clone(),
            allocated_plan_bytes: self._resident.bytes as u64 + self._arena.bytes as u64,
            runtime_extra_bytes: self.planned_extra
                + self.gemm.workspace.bytes as u64
                + self.gpu.err_flag.bytes as u64,
            pinned_host_bytes: self.host.as_ref().map(|h| h.bytes as u64).unwrap_or(0),
            measured_peak_bytes: self.gpu.free_at_start.saturating_sub(self.min_free),
        }
    }
}

fn lower_collective(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
    world: u32,
) -> CudaResult<()> {
    let axis = op.axis().unwrap_or_default().to_string();
    let (x, o) = (&ins[0], &outs[0]);
    let dtype = x.dtype;
    let coll = match op {
        Op::AllReduce { op, .. } => Coll::AllReduce { op: *op },
        Op::AllGather { dim, .. } => {
            if norm(*dim, x.rank())? != 0
                && x.shape[..norm(*dim, x.rank())?].iter().any(|&d| d != 1)
            {
                return Err(lw.unsup(
                    "all_gather along an inner dim",
                    "NCCL gathers along dim 0; not written yet",
                ));
            }
            Coll::AllGather
        }
        Op::ReduceScatter { op, dim, .. } => {
            if norm(*dim, x.rank())? != 0
                && x.shape[..norm(*dim, x.rank())?].iter().any(|&d| d != 1)
            {
                return Err(lw.unsup(
                    "reduce_scatter along an inner dim",
                    "NCCL scatters along dim 0; not written yet",
                ));
            }
            Coll::ReduceScatter { op: *op }
        }
        Op::Broadcast { root, .. } => Coll::Broadcast { root: *root as i32 },
        other => {
            if world == 1 && x.bytes() == o.bytes() {
                lw.copy(o.ptr, x.ptr, o.bytes());
                return Ok(());
            }
            return Err(lw.unsup(other.name(), "not written for several ranks yet"));
        }
    };
    let count = match coll {
        Coll::ReduceScatter { .. } => o.numel(),
        _ => x.numel(),
    };
    lw.push(StepKind::Collective {
        coll,
        axis,
        send: x.ptr,
        recv: o.ptr,
        count,
        dtype,
    });
    Ok(())
}

impl Executor {
    /// Initialises every param on the device (no host copy of the weights): normal(0, std)
    /// for matrices and embeddings, ones for norm weights, zeros for biases and optimizer state.
    pub fn init_params_random(&mut self, seed: u64, std: f32) -> CudaResult<()> {
        self.gpu.bind()?;
        let mut masters = Vec::new();
        for (i, (name, v)) in self.graph.params().into_iter().enumerate() {
            let t = self
                .value(v.0)
                .cloned()
                .ok_or_else(|| CudaError::Plan(format!("param `{name}` has no buffer")))?;
            let lower = name.to_ascii_lowercase();
            let role = ValueRole::of(&name);
            if role == Some(ValueRole::MasterWeight) {
                masters.push(name.clone());
                continue;
            }
            if role.is_some_and(|r| r.is_optimizer_state())
                || lower.ends_with("bias")
                || !t.dtype.is_float()
            {
                self.gpu.memset(t.ptr, 0, t.bytes() as usize)?;
                continue;
            }
            let (s, mean) = if lower.contains("norm") {
                (0.0, 1.0)
            } else {
                (std, 0.0)
            };
            let l = self.gpu.launch_n(
                "init_normal_any",
                t.numel(),
                vec![
                    Arg::P(t.ptr),
                    Arg::I32(code(t.dtype)),
                    Arg::I64(t.numel() as i64),
                    Arg::U64(seed.wrapping_mul(1_000_003).wrapping_add(i as u64)),
                    Arg::F32(s),
                    Arg::F32(mean),
                ],
            )?;
            l.enqueue(self.streams[0].0)?;
        }
        self.gpu.sync()?;
        self.init_masters(&masters)
    }

    /// Names of the program's params.
    pub fn param_names(&self) -> Vec<String> {
        self.graph.params().into_iter().map(|(n, _)| n).collect()
    }
}

impl Executor {
    /// Fills the arena with 0xFF bytes (NaN in every float dtype), so a value no kernel
    /// wrote shows up in checks. Call before `set_inputs`.
    pub fn poison_arena(&mut self) -> CudaResult<()> {
        self.gpu.bind()?;
        self.gpu.memset(self._arena.ptr, 0xff, self._arena.bytes)
    }
}

#[cfg(test)]
mod attention_choice_tests {
    use super::attention_choice;

    #[test]
    fn weft_attention_env() {
        assert_eq!(attention_choice(None), (true, true));
        assert_eq!(attention_choice(Some("cudnn")), (true, true));
        assert_eq!(attention_choice(Some("auto")), (true, true));
        assert_eq!(attention_choice(Some("weft")), (true, false));
        assert_eq!(attention_choice(Some("generic")), (false, false));
    }
}

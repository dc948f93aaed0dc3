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
use super::kernels::{self, Kernel, Shape};
use super::layout::{self, fsuffix};
use super::tuning::Tuning;
use cudarc::driver::{result as dr, sys};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use weft_ir::attrs::{CmpOp, Flag, Float, ReduceOp, Reduction, RopeScaling};
use weft_ir::plan::{Category, ExecutionPlan, StreamKind};
use weft_ir::role::{ValueName, ValueRole};
use weft_ir::{Bindings, DType, Dim, Graph, HostTensor, Node, Op};

mod attention;
mod collective;
mod elementwise;
mod fp8;
mod fused;
mod index;
mod linear_ce;
mod loss;
mod lower;
mod matmul;
mod moe;
mod movement;
mod norm;
mod optimizer;
mod prepare;
mod reduce;
mod rope;
use collective::lower_collective;
use lower::*;
use prepare::*;

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
    /// path (for a pip install, the `nvidia/cudnn/lib` directory of the
    /// `nvidia-cudnn-cu13` package; docs/GPU.md).
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
    AllReduce {
        op: ReduceOp,
    },
    AllGather,
    ReduceScatter {
        op: ReduceOp,
    },
    Broadcast {
        root: i32,
    },
    /// Point-to-point sends and receives of `count` elements (all_to_all, ring_shift).
    Exchange(comm::Exchange),
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
        /// What an accumulating GEMM adds to (`c` itself unless `matmul_add` names
        /// another buffer).
        addend: u64,
        /// An FP8 GEMM's dequantizing factors of `a` and `b` (device f32 scalars).
        fp8_scales: Option<(u64, u64)>,
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
    /// The host optimizer update, a host function on the step's stream.
    HostAdamW(Arc<super::host_adamw::HostAdamW>),
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
    /// GEMM shapes timed over cuBLASLt's candidates, those where another than the
    /// heuristic's first won, and the seconds the timing took (`WEFT_GEMM_TUNE=1`).
    pub gemm_tuned: (usize, usize, f64),
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
    /// The streams have priorities (the plan has an update stream).
    prioritised: bool,
    events: Vec<Event>,
    t_start: Event,
    t_ends: Vec<Event>,
    /// Recorded on stream 0 at the start of the step's work; the other streams wait on it.
    fork: Event,
    /// The step as a CUDA graph, captured on the second step where the plan allows it.
    step_graph: Option<super::step_graph::StepGraph>,
    /// Steps run so far, and whether capture was tried and failed (then never again).
    steps_run: u64,
    graph_refused: Option<String>,
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
    /// The same last step per stream-0 instruction, in launch order: (instruction index,
    /// device milliseconds until the next instruction's mark).
    pub profile_instructions: Vec<(u32, f64)>,
    /// Last: dropped after every allocation, handle and communicator above.
    pub gpu: Gpu,
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
        gemm.fp8_fast_accum = opts.tuning.fp8_fast_accum;
        gemm.tune = opts.tuning.gemm_tune;

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
        let mut bufs = place_buffers(plan, &graph, &bindings, &resident, &arena, host.as_ref())?;

        // With an update stream, the updates run at the lowest priority and every other
        // stream at the highest, so the updates take only the SMs the rest leaves idle.
        let prioritised = plan.streams.iter().any(|s| s.kind == StreamKind::Update);
        // (the graph replays keep these priorities: see `StepGraph::capture`)
        let streams: Vec<Stream> = plan
            .streams
            .iter()
            .map(|s| {
                if prioritised {
                    gpu.stream_with_priority(s.kind != StreamKind::Update)
                } else {
                    gpu.stream()
                }
            })
            .collect::<CudaResult<_>>()?;
        let events: Vec<Event> = (0..plan.events)
            .map(|_| gpu.event(false))
            .collect::<CudaResult<_>>()?;

        let (comms, nccl) = communicators(plan, opts, &env)?;

        // Updated params / optimizer state go back into their inputs after each step.
        let mut updates = fed_back_updates(plan, &graph);

        // Aliases (`alias_of`) take their root's pointer; `root_of` maps every buffer to
        // the buffer holding its bytes. Reshapes are views: the plan makes a reshape's
        // output a view of its input's root buffer (same bytes, held over the group's
        // live ranges), and the reshape runs nothing. Updates are in place: the plan
        // writes an updated param / optimizer state over the input it replaces once the
        // old value is dead (and `cross_entropy_grad` over logits that die there), so
        // such an update shares its target's bytes and has nothing to copy back.
        let root_of = resolve_views(plan, &mut bufs)?;
        updates.retain(|&(from, to)| root_of[from as usize] != root_of[to as usize]);
        let elided = view_reshapes(plan, &root_of);
        let readers = readers(plan, &root_of);
        let writer = producers(plan);
        // Updates the plan did not write in place (older plans, or where it could not)
        // write in place here when nothing after the write reads the old value (an
        // elementwise optimizer kernel may read it itself): no copy back, and the
        // `param.*` / `optim.*` outputs alias what they update. Updates the plan wrote
        // in place were dropped above; the groups left here hold one value each.
        update_in_place(plan, &mut bufs, &root_of, &readers, &writer, &mut updates);

        // cuDNN attention, when asked for: absence falls back to Weft's kernels (one line).
        let cudnn = cudnn_attention(opts, &streams);

        // Lowering, twice: sizes first, then pointers.
        let value_node: HashMap<u32, Node> = graph
            .nodes()
            .iter()
            .flat_map(|&n| graph.node(n).results.iter().map(move |v| (v.0, n)))
            .collect();
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
            };
            let cx = Lowering {
                graph: &graph,
                value_node: &value_node,
                bufs: &bufs,
                elided: &elided,
                bindings: &bindings,
                world: env.world,
            };
            for ins in &plan.instructions {
                lower_instruction(&mut lw, ins, &cx)?;
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
        let fork = gpu.event(false)?;
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
            gemm_tuned: (0, 0, 0.0),
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
            prioritised,
            events,
            t_start,
            t_ends,
            fork,
            step_graph: None,
            steps_run: 0,
            graph_refused: None,
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
            profile_instructions: Vec::new(),
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
            let k = kernels::Cast {
                out: d.ptr,
                to: d.dtype,
                input: s.ptr,
                from: s.dtype,
                n: d.numel() as i64,
            };
            let l = self.gpu.launch_n("cast_any", d.numel(), k.args())?;
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

    /// Whether this plan's step can be captured as a CUDA graph, or why not.
    fn capturable(&self) -> super::step_graph::Capture {
        use super::step_graph::Capture;
        if !self.tuning.cuda_graph {
            return Capture::No("WEFT_CUDA_GRAPH=0");
        }
        if self.tuning.profile {
            return Capture::No("profiling (WEFT_PROFILE) times each instruction");
        }
        for st in &self.steps {
            match st.kind {
                // Without communicators (one rank) a collective is a device copy.
                StepKind::Collective { .. } if self.comms.is_some() => {
                    return Capture::No("collectives across ranks")
                }
                StepKind::Grouped(_) => {
                    return Capture::No("MoE grouped GEMMs read their row counts on the host")
                }
                _ => {}
            }
        }
        Capture::Yes
    }

    /// Why the step is not replayed as a CUDA graph (None while it is, or before the
    /// second step decides).
    pub fn cuda_graph_refusal(&self) -> Option<String> {
        match self.capturable() {
            super::step_graph::Capture::No(why) => Some(why.to_string()),
            super::step_graph::Capture::Yes => self.graph_refused.clone(),
        }
    }

    /// Whether steps are replayed from a captured CUDA graph.
    pub fn replays_cuda_graph(&self) -> bool {
        self.step_graph.is_some()
    }

    /// Runs the program once (every instruction on its stream), then copies updated
    /// params and optimizer state back into place. Blocks until the device is done.
    /// The first step runs eagerly (it fills the GEMM and kernel caches); where the plan
    /// allows, the second is captured as a CUDA graph and every step after replays it.
    pub fn run_step(&mut self) -> CudaResult<StepTiming> {
        self.gpu.bind()?;
        let wall = std::time::Instant::now();
        let s0 = self.streams[0].0;
        if self.step_graph.is_none()
            && self.graph_refused.is_none()
            && self.steps_run >= 1
            && matches!(self.capturable(), super::step_graph::Capture::Yes)
        {
            let captured = {
                let this = &mut *self;
                this.gemm.capturing = true;
                let node_priority = this.prioritised;
                let g = super::step_graph::StepGraph::capture(s0, node_priority, || {
                    let mut none = Vec::new();
                    this.enqueue_work(false, &mut none)
                });
                this.gemm.capturing = false;
                g
            };
            match captured {
                Ok(g) => self.step_graph = Some(g),
                Err(e) => self.graph_refused = Some(format!("capture failed: {e}")),
            }
        }
        // SAFETY: live event and stream.
        unsafe { dr::event::record(self.t_start.0, s0) }
            .map_err(|e| CudaError::driver("cuEventRecord", e))?;
        let profiling = self.tuning.profile;
        let mut marks: Vec<(u32, Event)> = Vec::new();
        match &self.step_graph {
            Some(g) => g.launch(s0)?,
            None => self.enqueue_work(profiling, &mut marks)?,
        }
        self.steps_run += 1;
        let upd_mark = marks.pop().filter(|_| profiling).map(|(_, e)| e);
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
        for st in &self.steps {
            if let StepKind::HostAdamW(j) = &st.kind {
                if let Some(e) = j.take_error() {
                    return Err(e);
                }
            }
        }
        if let Some(end) = upd_mark {
            let mut by_op: BTreeMap<String, (usize, f64)> = BTreeMap::new();
            self.profile_instructions.clear();
            for k in 0..marks.len() {
                let next = if k + 1 < marks.len() {
                    &marks[k + 1].1
                } else {
                    &end
                };
                let ms = unsafe { dr::event::elapsed(marks[k].1 .0, next.0) }.unwrap_or(0.0) as f64;
                self.profile_instructions.push((marks[k].0, ms));
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
        self.load.gemm_tuned = self.gemm.tuned;
        Ok(StepTiming {
            device_s: ms as f64 / 1e3,
            wall_s: wall.elapsed().as_secs_f64(),
            enqueue_s,
        })
    }

    /// Issues one step's work on the streams: fork from stream 0, every instruction,
    /// join into stream 0, the parameter updates. With `profiling`, an event before each
    /// stream-0 instruction goes into `marks`, and a last one (instruction u32::MAX)
    /// before the updates. Issued eagerly or into a graph capture alike.
    fn enqueue_work(&mut self, profiling: bool, marks: &mut Vec<(u32, Event)>) -> CudaResult<()> {
        let s0 = self.streams[0].0;
        // SAFETY: live event and streams.
        unsafe { dr::event::record(self.fork.0, s0) }
            .map_err(|e| CudaError::driver("cuEventRecord", e))?;
        for s in 1..self.streams.len() {
            unsafe {
                dr::stream::wait_event(
                    self.streams[s].0,
                    self.fork.0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
        }
        // Profiling (WEFT_PROFILE): an event before each instruction's work on stream 0.
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
        if profiling {
            let e = self.gpu.event(true)?;
            unsafe { dr::event::record(e.0, s0) }
                .map_err(|e| CudaError::driver("cuEventRecord", e))?;
            marks.push((u32::MAX, e));
        }
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
        Ok(())
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
                addend,
                fp8_scales,
            } => match fp8_scales {
                Some((sa, sb)) => self.gemm.run_fp8(shape, *a, *b, *sa, *sb, *c, s),
                None => self.gemm.run_into(shape, *a, *b, *addend, *c, *bias, s),
            },
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
            StepKind::HostAdamW(j) => j.enqueue(s).map_err(at),
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
                                .result()
                        }
                        Coll::AllGather => {
                            cudarc::nccl::sys::ncclAllGather(sp, rp, n, ty, comm, cs).result()
                        }
                        Coll::ReduceScatter { op } => {
                            cudarc::nccl::sys::ncclReduceScatter(sp, rp, n, ty, red(op), comm, cs)
                                .result()
                        }
                        Coll::Broadcast { root } => {
                            cudarc::nccl::sys::ncclBroadcast(sp, rp, n, ty, *root, comm, cs)
                                .result()
                        }
                        Coll::Exchange(x) => comm::send_recv(comm, *x, *send, *recv, n, *dtype, cs),
                    }
                };
                r.map(|_| ()).map_err(|e| {
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
                fp8: None,
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
            let k = kernels::InitNormal {
                out: t.ptr,
                code: t.dtype,
                n: t.numel() as i64,
                seed: seed.wrapping_mul(1_000_003).wrapping_add(i as u64),
                stdv: s,
                mean,
            };
            let l = self.gpu.launch_n("init_normal_any", t.numel(), k.args())?;
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

//! The ExecutionPlan: what a runtime executes. One plan serves every rank (SPMD): an
//! ordered list of instructions, each on a stream (compute, communication, host copy),
//! with events for cross-stream dependencies; buffers with sizes and offsets in one
//! device arena; resident placements for parameters, gradients and optimizer state;
//! the mesh and its process groups; per-parameter partition metadata; and the concrete
//! sizes bound for `B` and `S`. Where ranks differ (uneven shards) a buffer carries a
//! per-rank size table and the arena is laid out for the largest.
//!
//! The program itself travels as Weft text IR (`program`), so a runtime rebuilds every
//! op with its attributes from the same parser the compiler uses.

use crate::mesh::Mesh;
use crate::partition::Partition;
use std::collections::BTreeMap;

/// The plan format version; loading a plan of another version is an error.
/// 2: buffers may share another buffer's bytes (`Buffer::alias_of`): views of a
/// reshape, and outputs written in place (older plans without in-place outputs stay
/// valid, so the version did not change for them).
pub const PLAN_VERSION: u32 = 2;

/// The (operand, result) index pairs at which an op may write its result over the
/// operand's bytes: each result element is computed from the operand's element at the
/// same index by the thread that writes it (or after the whole operand row is read),
/// so the kernels of every runtime are safe with the result aliasing that operand.
///
/// - `adamw(w, g, m, v, step) -> (w', m', v')`: (0, 0), (2, 1), (3, 2).
/// - `sgd(w, g[, buf]) -> (w'[, buf'])`: (0, 0), (2, 1).
/// - `cross_entropy_grad(logits, labels, dloss) -> dlogits`: (0, 0). The CUDA kernels
///   (`ce_bwd_*`, `ce_bwd_lse8_bf16`) run one block per row and read the row's logits
///   before (the max/sum reduction, synchronised) or at the same index as (the
///   gradient loop) each element they write.
/// - `matmul_add(a, b, c) -> d`: (2, 0). One accumulating GEMM (cuBLASLt's beta = 1 with
///   C = D, its in-place form) reads each element of `c` only to write the same element.
/// - `embedding_grad(ids, dy, init) -> dw`: (2, 0). One CUDA block writes each touched row,
///   reading its `init` value first (`embedding_bwd_*` with `accumulate`).
///
/// Anything else writes in place only when it does not read the value it replaces.
pub fn in_place_pairs(op: &str) -> &'static [(usize, usize)] {
    match op {
        "adamw" | "adamw_master" => &[(0, 0), (2, 1), (3, 2)],
        "sgd" => &[(0, 0), (2, 1)],
        "cross_entropy_grad" => &[(0, 0)],
        "matmul_add" => &[(2, 0)],
        "embedding_grad" => &[(2, 0)],
        _ => &[],
    }
}

/// The parameter a training step's output is fed back into: `param.<name>` replaces
/// `<name>` (or a parameter itself named `param.<name>`), `optim.*` and `state.*` the
/// parameter of the same name. `None` for other outputs, or when `is_param` knows no
/// such parameter.
pub fn fed_back_param<'a>(output: &'a str, is_param: impl Fn(&str) -> bool) -> Option<&'a str> {
    use crate::role::ValueName;
    let candidates = match ValueName::parse(output) {
        ValueName::UpdatedParam(rest) => [Some(rest), Some(output)],
        ValueName::MasterWeight(_)
        | ValueName::OptimizerState { .. }
        | ValueName::Step
        | ValueName::LegacyState(_) => [Some(output), None],
        _ => [None, None],
    };
    candidates.into_iter().flatten().find(|n| is_param(n))
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExecutionPlan {
    pub version: u32,
    pub model: String,
    /// What the program computes: a whole training step or a forward pass only (plans
    /// written before this field read as `None`; [`ExecutionPlan::step_kind`] infers it).
    #[serde(default)]
    pub step: Option<StepKind>,
    /// The MODEL argument the plan was compiled from (a preset name or a path), so
    /// `weft check PLAN` can rebuild the unsharded reference.
    #[serde(default)]
    pub source: String,
    pub mesh: Mesh,
    /// Process groups of every mesh axis: `groups[axis]` lists rank groups.
    pub groups: BTreeMap<String, Vec<Vec<u32>>>,
    /// Concrete values of the program's size symbols (`B`, `S`, axis sizes).
    pub bindings: BTreeMap<String, i64>,
    /// The device profile the schedule and costs were computed for.
    pub device: DeviceProfile,
    pub streams: Vec<Stream>,
    pub buffers: Vec<Buffer>,
    pub instructions: Vec<Instruction>,
    /// Number of events (ids are `0..events`).
    pub events: u32,
    pub params: Vec<ParamPlacement>,
    pub memory: MemoryReport,
    pub cost: CostSummary,
    /// The program as Weft text IR; instruction `node` ids are its value ids.
    pub program: String,
    /// SHA-256 of `program` (hex), checked on load: an edited or swapped program is
    /// refused. Empty in plans written before it existed.
    #[serde(default)]
    pub program_digest: String,
}

/// SHA-256 of `bytes`, in lowercase hex.
pub fn digest(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The longest sequence Weft plans for (2^32 tokens), far above any model's context.
pub const MAX_SEQ: i64 = 1 << 32;
/// The largest batch Weft plans for (2^24 sequences).
pub const MAX_BATCH: i64 = 1 << 24;

/// The most streams a plan may have (Weft's plans have four, five with a host update).
pub const MAX_STREAMS: usize = 64;

impl DeviceProfile {
    /// Bytes a second one direction of the host link moves while the other is busy: its
    /// share of `host_duplex_gbps`, at most `host_gbps` (all of it where the profile
    /// gives no duplex rate).
    pub fn host_bytes_per_s_beside_other_direction(&self) -> f64 {
        let alone = self.host_gbps * 1e9;
        if self.host_duplex_gbps > 0.0 {
            (self.host_duplex_gbps * 1e9 / 2.0).min(alone)
        } else {
            alone
        }
    }
    /// Every rate and size positive and finite, latencies and overheads non-negative
    /// and finite, at least one GPU per node: a cost model divides by these.
    pub fn validate(&self) -> Result<(), String> {
        let rates = [
            ("matmul_tflops", self.matmul_tflops),
            ("attention_tflops", self.attention_tflops),
            ("vector_tflops", self.vector_tflops),
            ("hbm_gbps", self.hbm_gbps),
            ("memory_gib", self.memory_gib),
            ("intra_node_gbps", self.intra_node_gbps),
            ("inter_node_gbps", self.inter_node_gbps),
            ("host_gbps", self.host_gbps),
            ("host_adam_params_per_s", self.host_adam_params_per_s),
        ];
        for (name, v) in rates {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("`{name}` is {v}: must be a positive number"));
            }
        }
        let delays = [
            ("kernel_overhead_us", self.kernel_overhead_us),
            ("intra_node_latency_us", self.intra_node_latency_us),
            ("inter_node_latency_us", self.inter_node_latency_us),
            ("grouped_gemm_issue_us", self.grouped_gemm_issue_us),
            ("host_sync_us", self.host_sync_us),
            ("host_duplex_gbps", self.host_duplex_gbps),
            ("attention_bwd_tflops", self.attention_bwd_tflops),
            ("attention_row_keys", self.attention_row_keys),
        ];
        for (name, v) in delays {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("`{name}` is {v}: must be a non-negative number"));
            }
        }
        if !(self.host_copy_compute_slowdown.is_finite()
            && (0.0..1.0).contains(&self.host_copy_compute_slowdown))
        {
            return Err(format!(
                "`host_copy_compute_slowdown` is {}: must be at least 0 and below 1",
                self.host_copy_compute_slowdown
            ));
        }
        if self.gpus_per_node == 0 {
            return Err("`gpus_per_node` is 0: must be at least 1".into());
        }
        Ok(())
    }
}

/// What a plan's program computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// Forward, backward, gradient reduction and (where asked) the optimizer update.
    Training,
    /// The forward pass only: loss and logits, no gradients.
    Forward,
}

impl StepKind {
    /// A training step returns gradients (`grad.*`) or updated parameters and optimizer
    /// state (`param.*`, `optim.*`); a forward program neither.
    pub fn of_outputs<'a>(mut names: impl Iterator<Item = &'a str>) -> StepKind {
        if names.any(|n| crate::role::ValueRole::of(n).is_some_and(|r| r.is_training_output())) {
            StepKind::Training
        } else {
            StepKind::Forward
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StepKind::Training => "training step",
            StepKind::Forward => "forward pass",
        }
    }

    /// What the plan's predicted time is the time of.
    pub fn time_name(self) -> &'static str {
        match self {
            StepKind::Training => "step",
            StepKind::Forward => "forward",
        }
    }
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    Compute,
    Comm,
    /// Host <-> device copies (offload, prefetch).
    Copy,
    /// The host CPU (the optimizer update of `--offload-optimizer`).
    Host,
    /// The device's optimizer updates beside the compute stream, at a lower priority
    /// (`--update-stream`).
    Update,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stream {
    pub id: u32,
    pub kind: StreamKind,
    pub name: String,
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Param,
    Grad,
    OptimizerState,
    Activation,
    Workspace,
    Comm,
    /// Lives in pinned host memory (offloaded activations; with `--offload-optimizer`
    /// the master weights, moments and what the host update reads and writes).
    Host,
}

impl Category {
    pub fn name(self) -> &'static str {
        match self {
            Category::Param => "params",
            Category::Grad => "grads",
            Category::OptimizerState => "optimizer_state",
            Category::Activation => "activations",
            Category::Workspace => "workspace",
            Category::Comm => "comm_buffers",
            Category::Host => "host",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Buffer {
    pub id: u32,
    /// The value (`%N` of `program`) held in this buffer.
    pub value: u32,
    pub dtype: crate::types::DType,
    /// Bytes on the largest rank.
    pub bytes: u64,
    /// Bytes per rank when ranks differ (uneven shards); absent when all are equal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_rank_bytes: Option<Vec<u64>>,
    pub category: Category,
    /// Offset in the device arena, or in the resident region for params, grads and
    /// optimizer state (see `resident`). A view has its root's offset.
    pub offset: u64,
    /// Params, grads and optimizer state live for the whole step in their own region.
    /// A view has its root's flag (a view of a param lives in the resident region).
    pub resident: bool,
    /// First and last instruction (indices into `instructions`) that touch the buffer.
    /// A root's range covers those of its views (its bytes are held while any is live).
    pub live: (u32, u32),
    /// This buffer shares that buffer's bytes; no storage of its own. The buffer named
    /// is the root of the group (it has storage); the alias has the same size, offset
    /// and `resident` flag, and the group is placed and counted once, held over the
    /// union of its members' live ranges. Two kinds (see [`ExecutionPlan::check`]):
    ///
    /// - A view: the output of a `reshape` of a buffer of the same group (every value
    ///   is contiguous, so a reshape moves no bytes); the reshape runs nothing. It is
    ///   the same value as its input.
    /// - In place: the output is written over the group's bytes, a new value replacing
    ///   the one held there, which must be dead by then: every read of the old value
    ///   (its buffer and its views) is by an instruction ordered before the writer
    ///   (same stream, or through events), no buffer of the old value is live after
    ///   the writer (a graph output is live to the end), and the writer itself reads
    ///   the old value at most once, at an operand it computes the output from
    ///   elementwise ([`in_place_pairs`]). Two uses:
    ///   - updates: the output updating a value the step starts with (`param.<name>`
    ///     and `optim.*`/`state.*` outputs fed back into the inputs of those names,
    ///     same bytes and dtype) takes the input's resident bytes, so an updated
    ///     parameter or optimizer state is held once and nothing is copied back after
    ///     the step. `adamw` writes (master', m', v') over (master, m, v) and `sgd`
    ///     (w', buf') over (w, buf) at the positional pairs; the `cast` writing the
    ///     updated bf16 parameter from the f32 master reads nothing of the old
    ///     parameter, so it may write once the old parameter's last read is before it.
    ///   - elementwise ops whose operand dies at the op, in arena memory: the op must
    ///     be one whose kernels are safe in place (listed by [`in_place_pairs`]), e.g.
    ///     `cross_entropy_grad`'s logits gradient over the logits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias_of: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Instruction {
    pub id: u32,
    pub stream: u32,
    /// The node's first result (`%N` in `program`).
    pub node: u32,
    pub op: String,
    pub inputs: Vec<u32>,
    pub outputs: Vec<u32>,
    /// Events this instruction waits for before it starts.
    pub wait: Vec<u32>,
    /// Event recorded when it finishes (consumed on another stream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<u32>,
    pub flops: f64,
    /// Bytes read and written (device memory), or moved per rank for collectives.
    pub bytes: f64,
    /// Predicted start and duration in seconds.
    pub start_s: f64,
    pub time_s: f64,
    /// The mesh axis of a collective.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axis: Option<String>,
    /// Which pass inserted the node and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamPlacement {
    pub name: String,
    pub buffer: u32,
    /// Logical (full) shape.
    pub shape: Vec<i64>,
    pub dtype: crate::types::DType,
    /// How the full tensor is split across ranks (empty: replicated).
    pub partitions: Vec<Partition>,
    /// The buffer of its gradient output, if the program computes one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_buffer: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryReport {
    /// Peak device bytes on the largest rank.
    pub peak_bytes: u64,
    /// Bytes by category at the peak (resident categories in full).
    pub breakdown: BTreeMap<String, u64>,
    /// Size of the reused activation arena.
    pub arena_bytes: u64,
    /// Size of the resident region (params, grads, optimizer state).
    pub resident_bytes: u64,
    /// Pinned host bytes (offloaded activations).
    pub host_bytes: u64,
    /// The instruction at which the peak occurs.
    pub peak_at: u32,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CostSummary {
    pub step_time_s: f64,
    /// Busy time of the compute stream.
    pub compute_s: f64,
    /// Time the step spends beyond the compute stream's busy time: communication,
    /// host copies and optimizer updates off the compute stream not hidden under it.
    pub exposed_comm_s: f64,
    pub comm_s: f64,
    pub copy_s: f64,
    /// Host optimizer updates (`host_adamw`, `--offload-optimizer`), on the host stream.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_update_s: f64,
    /// Device optimizer updates on the update stream (`--update-stream`), beside the
    /// compute stream and not part of its busy time.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub update_s: f64,
    pub flops: f64,
    /// Model FLOPs utilisation: flops / (step time * peak matmul rate).
    pub mfu: f64,
    pub comm_bytes: BTreeMap<String, f64>,
    pub collectives: BTreeMap<String, u64>,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// Rates a cost model needs, per device and interconnect. Presets for A100, H100 and
/// H200; a JSON file overrides them.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DeviceProfile {
    pub name: String,
    /// Dense bf16 matmul rate reached in practice (not the datasheet peak).
    pub matmul_tflops: f64,
    /// Fused (flash-style) attention's rate on long rows: the forward's, and the
    /// backward's where `attention_bwd_tflops` is 0.
    pub attention_tflops: f64,
    /// The fused attention backward's rate on long rows (0: `attention_tflops`).
    #[serde(default)]
    pub attention_bwd_tflops: f64,
    /// Each query row's fixed work in a fused attention kernel (loading its query,
    /// the softmax statistics, writing its output), as a number of keys' worth of
    /// work: short rows run below the long-row rate (0: none).
    #[serde(default)]
    pub attention_row_keys: f64,
    /// Rate of non-matmul float work.
    pub vector_tflops: f64,
    pub hbm_gbps: f64,
    pub kernel_overhead_us: f64,
    pub memory_gib: f64,
    pub gpus_per_node: u32,
    /// Per-GPU bandwidth and latency inside a node (NVLink).
    pub intra_node_gbps: f64,
    pub intra_node_latency_us: f64,
    /// Per-GPU bandwidth and latency across nodes (network).
    pub inter_node_gbps: f64,
    pub inter_node_latency_us: f64,
    /// Host link (PCIe) for offload copies, one direction alone.
    pub host_gbps: f64,
    /// Both directions of the host link at once, together (0: each direction keeps
    /// `host_gbps`). Copies out and in that overlap share it.
    #[serde(default)]
    pub host_duplex_gbps: f64,
    /// Fraction by which compute slows while a host copy runs (the copies' memory
    /// traffic): 0.07 is a GEMM at 93% of its rate beside them.
    #[serde(default)]
    pub host_copy_compute_slowdown: f64,
    /// Parameters a second the host CPU updates with AdamW for one GPU
    /// (`--offload-optimizer`: the node's cores shared by its GPUs).
    #[serde(default = "default_host_adam_params_per_s")]
    pub host_adam_params_per_s: f64,
    /// Host time to issue one GEMM of a grouped matmul (one cuBLASLt call per expert,
    /// its plan looked up or made for that expert's row count): a group's GEMM takes at
    /// least this long however few its rows.
    #[serde(default = "default_grouped_gemm_issue_us")]
    pub grouped_gemm_issue_us: f64,
    /// A stream synchronisation and small device-to-host read (a grouped matmul reads
    /// its per-expert row counts before issuing the GEMMs): the GPU drains and idles.
    #[serde(default = "default_host_sync_us")]
    pub host_sync_us: f64,
}

/// Host issue time per grouped-matmul GEMM for profiles that do not give one: fitted to
/// the DeepSeek-V3-shaped stack on an H200 (bench/GPU_NOTES.md session 5: 128 forward
/// GEMMs of ~1024 rows in 17.6 ms, 256 backward ones in 28.5 ms, where the GEMMs' FLOPs
/// alone take 7.3 and 14.6 ms).
pub fn default_grouped_gemm_issue_us() -> f64 {
    120.0
}

/// Stream synchronisation cost for profiles that do not give one.
pub fn default_host_sync_us() -> f64 {
    15.0
}

/// A host AdamW rate for profiles that do not give one: 2 G parameters/s per GPU. Measured
/// on the 16 host cores that serve one H100 (bench/GPU_NOTES.md, session 24): the update
/// alone runs at 3.1 G parameters/s there (`cargo bench -p weft-runtime --bench
/// host_adamw`, memory-bound at 87 GB/s, 28 bytes a parameter), and the 1.24B model's
/// step with `--offload-optimizer` takes 0.61 s, 2.0 G parameters/s with the gradient and
/// parameter copies and the updates that wait for the backward. A node with fewer cores
/// or less memory bandwidth per GPU should give its own rate.
pub fn default_host_adam_params_per_s() -> f64 {
    2.0e9
}

/// Why a plan cannot be loaded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("invalid plan JSON in {file}: {message}")]
    Json { file: String, message: String },
    #[error("plan {file} has format version {found}, this weft reads version {expected}\nhelp: recompile the plan with this weft (`weft compile ... -o plan.json`)")]
    Version {
        file: String,
        found: u32,
        expected: u32,
    },
    #[error("inconsistent plan {file}: {message}")]
    Inconsistent { file: String, message: String },
}

impl ExecutionPlan {
    /// The plan's [`StepKind`]: recorded, or (older plans) read off the program's outputs.
    pub fn step_kind(&self) -> StepKind {
        self.step.unwrap_or_else(|| {
            // The program's last `return name=%v, ...` line names its outputs.
            let ret = self
                .program
                .lines()
                .rev()
                .find_map(|l| l.trim_start().strip_prefix("return "))
                .unwrap_or("");
            StepKind::of_outputs(ret.split(", ").map(|o| o.split('=').next().unwrap_or("")))
        })
    }

    /// Whether every instruction in `reads` but `w` itself has finished when instruction
    /// `w` starts, by the vector `clock` ([`Self::clocks`]): its stream's order and the
    /// events it waits for. Program order is not enough: a read on another stream that
    /// `w` does not wait for may still be running.
    pub fn reads_done_before(&self, clock: &[Vec<i64>], reads: &[u32], w: u32) -> bool {
        let c = &clock[w as usize];
        reads
            .iter()
            .all(|&i| i == w || c[self.instructions[i as usize].stream as usize] >= i as i64)
    }

    /// Vector clocks: `clock[j][t]` is the last instruction of stream `t` known to have
    /// finished when instruction `j` starts (in-order streams plus the events it waits
    /// for, transitively); -1: none.
    pub fn clocks(&self) -> Result<Vec<Vec<i64>>, String> {
        let ns = self.streams.len().max(1);
        let n = self.instructions.len();
        let mut clock: Vec<Vec<i64>> = Vec::with_capacity(n);
        let mut prev_on = vec![-1i64; ns];
        let mut source = vec![usize::MAX; self.events as usize];
        for ins in &self.instructions {
            let s = ins.stream as usize;
            let mut c = vec![-1i64; ns];
            let join = |c: &mut Vec<i64>, p: usize, clock: &Vec<Vec<i64>>| {
                for t in 0..ns {
                    c[t] = c[t].max(clock[p][t]);
                }
                let ps = self.instructions[p].stream as usize;
                c[ps] = c[ps].max(p as i64);
            };
            if prev_on[s] >= 0 {
                join(&mut c, prev_on[s] as usize, &clock);
            }
            for e in &ins.wait {
                let p = source.get(*e as usize).copied().unwrap_or(usize::MAX);
                if p == usize::MAX {
                    return Err(format!(
                        "instruction {} waits for event {e} that no earlier instruction records",
                        ins.id
                    ));
                }
                join(&mut c, p, &clock);
            }
            clock.push(c);
            if let Some(e) = ins.signal {
                if let Some(slot) = source.get_mut(e as usize) {
                    *slot = ins.id as usize;
                }
            }
            prev_on[s] = ins.id as i64;
        }
        Ok(clock)
    }

    /// Every arena buffer that reuses bytes of an earlier one is written only after
    /// every instruction that touches the earlier one has finished, in every order the
    /// streams may run in: in-order streams plus the events instructions wait for
    /// (vector clocks recomputed here, independently of the planner).
    pub fn check_reuse_is_ordered(&self) -> Result<(), String> {
        let root = self.storage_roots()?;
        let ns = self.streams.len().max(1);
        let clock = self.clocks()?;
        let mut touch: Vec<Vec<i64>> = vec![vec![-1; ns]; self.buffers.len()];
        let mut producer: Vec<Option<usize>> = vec![None; self.buffers.len()];
        // A view's touches and producer are its root's: they share bytes.
        for ins in &self.instructions {
            for &b in ins.inputs.iter().chain(&ins.outputs) {
                let t = &mut touch[root[b as usize] as usize][ins.stream as usize];
                *t = (*t).max(ins.id as i64);
            }
            for &b in &ins.outputs {
                producer[root[b as usize] as usize].get_or_insert(ins.id as usize);
            }
        }
        let mut arena: Vec<&Buffer> = self
            .buffers
            .iter()
            .filter(|b| {
                b.alias_of.is_none() && !b.resident && b.category != Category::Host && b.bytes > 0
            })
            .collect();
        // In producer order, each byte range remembers its latest writer; a buffer must
        // be ordered after every touch of the writers whose bytes it takes. Checking
        // only the latest writer suffices: it was itself ordered after the one before
        // (vector clocks are transitive), so this is near-linear where all pairs were
        // quadratic.
        arena.retain(|b| producer[b.id as usize].is_some());
        arena.sort_by_key(|b| (producer[b.id as usize], b.id));
        let mut segments: BTreeMap<u64, (u64, usize)> = BTreeMap::new(); // start -> (end, buffer)
        for b in arena {
            let (start, end) = (b.offset, b.offset.saturating_add(b.bytes));
            let second = producer[b.id as usize].unwrap_or(0);
            let c = &clock[second];
            let overlapping: Vec<(u64, u64, usize)> = segments
                .range(..end)
                .rev()
                .take_while(|(_, (e, _))| *e > start)
                .map(|(&s, &(e, o))| (s, e, o))
                .collect();
            // Segments never overlap, so those ending after `start` among the ones
            // starting before `end` are contiguous from the last; one that starts before
            // `start` and ends after it is found by the same scan.
            for &(s0, e0, first) in &overlapping {
                if (0..ns).any(|t| touch[first][t] > c[t]) {
                    return Err(format!(
                        "buffer {} reuses bytes of buffer {first} but its producer (instruction {second}) may run before the last use of buffer {first}",
                        b.id
                    ));
                }
                segments.remove(&s0);
                if s0 < start {
                    segments.insert(s0, (start, first));
                }
                if e0 > end {
                    segments.insert(end, (e0, first));
                }
            }
            segments.insert(start, (end, b.id as usize));
        }
        Ok(())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans serialize") + "\n"
    }

    /// Parses a plan and checks its version and internal consistency.
    pub fn from_json(text: &str, file: &str) -> Result<ExecutionPlan, PlanError> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| PlanError::Json {
            file: file.into(),
            message: e.to_string(),
        })?;
        let found = v.get("version").and_then(|x| x.as_u64()).unwrap_or(0) as u32;
        if found != PLAN_VERSION {
            return Err(PlanError::Version {
                file: file.into(),
                found,
                expected: PLAN_VERSION,
            });
        }
        let plan: ExecutionPlan = serde_json::from_value(v).map_err(|e| PlanError::Json {
            file: file.into(),
            message: e.to_string(),
        })?;
        plan.check().map_err(|message| PlanError::Inconsistent {
            file: file.into(),
            message,
        })?;
        Ok(plan)
    }

    /// The buffer holding each buffer's bytes: itself, or for a view (`alias_of`) the
    /// end of its alias chain. Refuses views of missing buffers, chains that never end
    /// at a buffer with storage, and views whose size, offset, region or memory kind
    /// differ from their root's.
    pub fn storage_roots(&self) -> Result<Vec<u32>, String> {
        let n = self.buffers.len();
        let mut root = Vec::with_capacity(n);
        for (i, b) in self.buffers.iter().enumerate() {
            let mut r = i;
            let mut chain = vec![i];
            while let Some(a) = self.buffers[r].alias_of {
                if a as usize >= n {
                    return Err(format!("buffer {r} is a view of buffer {a}, which the plan lacks (it has {n} buffers)"));
                }
                r = a as usize;
                chain.push(r);
                if chain.len() > n {
                    let shown: Vec<String> =
                        chain.iter().take(8).map(|c| format!("b{c}")).collect();
                    return Err(format!(
                        "buffer {i} is a view whose alias chain ({}{}) never reaches a buffer with storage of its own",
                        shown.join(" -> "),
                        if chain.len() > 8 { " -> ..." } else { "" }
                    ));
                }
            }
            if r != i {
                let rb = &self.buffers[r];
                if b.bytes != rb.bytes || b.per_rank_bytes != rb.per_rank_bytes {
                    return Err(format!("buffer {i} is a view of buffer {r} but has {} bytes where its root has {} (a view has its root's size on every rank)", b.bytes, rb.bytes));
                }
                if b.category == Category::Host || rb.category == Category::Host {
                    return Err(format!("buffer {i} is a view of buffer {r} in host memory: only device buffers have views"));
                }
                if b.offset != rb.offset || b.resident != rb.resident {
                    return Err(format!(
                        "buffer {i} is a view of buffer {r} but is placed at offset {} ({}) where its root is at {} ({})",
                        b.offset,
                        if b.resident { "resident" } else { "arena" },
                        rb.offset,
                        if rb.resident { "resident" } else { "arena" }
                    ));
                }
            }
            root.push(r as u32);
        }
        Ok(root)
    }

    /// Every buffer sharing another's bytes (`Buffer::alias_of`) is a view made by a
    /// reshape of the same bytes, or a result written in place over a value that is
    /// dead by then (the rule is under `Buffer::alias_of`); anything else is refused.
    ///
    /// A group's bytes hold a sequence of values (versions): the root's, then each
    /// in-place result's, in the order their writers run; a view belongs to the
    /// version of its reshape's operand. An in-place write ends the version before it.
    fn check_aliases(&self, root: &[u32]) -> Result<(), String> {
        let nb = self.buffers.len();
        if (0..nb).all(|b| root[b] as usize == b) {
            return Ok(());
        }
        let clock = self.clocks()?;
        let mut writers: Vec<Vec<u32>> = vec![Vec::new(); nb];
        let mut readers: Vec<Vec<u32>> = vec![Vec::new(); nb];
        let mut group: Vec<Vec<u32>> = vec![Vec::new(); nb];
        for ins in &self.instructions {
            for &b in &ins.inputs {
                readers[b as usize].push(ins.id);
            }
            for &b in &ins.outputs {
                writers[b as usize].push(ins.id);
            }
        }
        for b in 0..nb {
            group[root[b] as usize].push(b as u32);
        }
        for (b, w) in writers.iter().enumerate() {
            let r = root[b];
            if r as usize != b && w.len() != 1 {
                return Err(format!("buffer {b} shares the bytes of buffer {r} but {} instructions write it (an alias is written by exactly one)", w.len()));
            }
        }
        // version[b]: the buffer heading the value b holds (the root, or an in-place
        // result); heads[r]: the versions of root r's bytes as (writer, head), in order.
        let mut version: Vec<u32> = (0..nb as u32).collect();
        let mut heads: Vec<Vec<(i64, u32)>> = (0..nb)
            .map(|r| vec![(writers[r].first().map_or(-1, |&w| w as i64), r as u32)])
            .collect();
        for ins in &self.instructions {
            for (pos, &o) in ins.outputs.iter().enumerate() {
                let (o, r) = (o as usize, root[o as usize] as usize);
                if r == o {
                    continue;
                }
                if ins.op == "reshape"
                    && ins.inputs.len() == 1
                    && root[ins.inputs[0] as usize] as usize == r
                {
                    version[o] = version[ins.inputs[0] as usize];
                    continue;
                }
                // In place: over the version current when the writer runs.
                let w = ins.id;
                let what = format!("buffer {o} is written in place over buffer {r}'s bytes by instruction {w} ({})", ins.op);
                let &(first, _) = &heads[r][0];
                if first >= w as i64 {
                    return Err(format!(
                        "{what} before buffer {r} itself is written (instruction {first})"
                    ));
                }
                let old = heads[r]
                    .iter()
                    .rev()
                    .find(|(at, _)| *at < w as i64)
                    .map(|&(_, h)| h)
                    .unwrap_or(r as u32);
                let (ob, rb) = (&self.buffers[o], &self.buffers[r]);
                if ob.dtype != rb.dtype {
                    return Err(format!(
                        "{what} but holds {} where the bytes hold {} (in place keeps the dtype)",
                        ob.dtype, rb.dtype
                    ));
                }
                let members: Vec<u32> = group[r]
                    .iter()
                    .copied()
                    .filter(|&b| {
                        b as usize != o
                            && version[b as usize] == old
                            && root[b as usize] as usize == r
                    })
                    .collect();
                let reads_old: Vec<usize> = ins
                    .inputs
                    .iter()
                    .enumerate()
                    .filter(|(_, &b)| members.contains(&b))
                    .map(|(k, _)| k)
                    .collect();
                let pairs = in_place_pairs(&ins.op);
                let at_pair = |k: usize| pairs.contains(&(k, pos));
                if rb.resident {
                    // An update of a value the step starts with.
                    if !writers[r].is_empty() || old as usize != r {
                        return Err(format!(
                            "{what}: in the resident region only an update of a value the step starts with (a parameter or optimizer state no instruction writes) is written in place, once"
                        ));
                    }
                    if !(reads_old.is_empty() || (reads_old.len() == 1 && at_pair(reads_old[0]))) {
                        return Err(format!(
                            "{what} but reads the value it replaces at operand(s) {reads_old:?}: only the elementwise pairs {pairs:?} (operand, result) of `{}` may",
                            ins.op
                        ));
                    }
                } else if !(reads_old.len() == 1 && at_pair(reads_old[0])) {
                    return Err(format!(
                        "{what}: in the arena only an op computing its result elementwise from the operand it replaces (and reading it there only) writes in place; `{}` reads it at operand(s) {reads_old:?}, its in-place pairs are {pairs:?}",
                        ins.op
                    ));
                }
                // The old value is dead: read only before the writer (ordered), live no
                // longer (the root's own range is its group's union, so its reads say).
                for &b in &members {
                    let bb = &self.buffers[b as usize];
                    if b as usize != r && bb.live.1 > w {
                        return Err(format!("{what} but buffer {b}, the value it replaces, is live until instruction {}", bb.live.1));
                    }
                    for &i in &readers[b as usize] {
                        let s = self.instructions[i as usize].stream as usize;
                        if i != w && i as i64 > clock[w as usize][s] {
                            return Err(format!("{what} but instruction {i} reads the value it replaces (buffer {b}) and may run after the write"));
                        }
                    }
                }
                version[o] = o as u32;
                heads[r].push((w as i64, o as u32));
            }
        }
        Ok(())
    }

    /// Checks ids, stream references, event pairing, buffer liveness, views, and that no
    /// two arena buffers that are live at once overlap (a root and its views share
    /// bytes, and hold them over the union of their live ranges).
    pub fn check(&self) -> Result<(), String> {
        self.check_bounds()?;
        for (i, s) in self.streams.iter().enumerate() {
            if s.id as usize != i {
                return Err(format!("stream {i} has id {}", s.id));
            }
        }
        for (i, b) in self.buffers.iter().enumerate() {
            if b.id as usize != i {
                return Err(format!("buffer {i} has id {}", b.id));
            }
            if b.live.0 > b.live.1 || b.live.1 as usize >= self.instructions.len().max(1) {
                return Err(format!(
                    "buffer {i} has live range {:?} outside the {} instructions",
                    b.live,
                    self.instructions.len()
                ));
            }
        }
        let mut signalled = vec![None; self.events as usize];
        for (i, ins) in self.instructions.iter().enumerate() {
            if ins.id as usize != i {
                return Err(format!("instruction {i} has id {}", ins.id));
            }
            if ins.stream as usize >= self.streams.len() {
                return Err(format!(
                    "instruction {i} is on unknown stream {}",
                    ins.stream
                ));
            }
            for b in ins.inputs.iter().chain(&ins.outputs) {
                if *b as usize >= self.buffers.len() {
                    return Err(format!("instruction {i} uses unknown buffer {b}"));
                }
            }
            for e in &ins.wait {
                match signalled.get(*e as usize) {
                    Some(Some(_)) => {}
                    Some(None) => {
                        return Err(format!(
                            "instruction {i} waits for event {e} before any instruction records it"
                        ))
                    }
                    None => return Err(format!("instruction {i} waits for unknown event {e}")),
                }
            }
            if let Some(e) = ins.signal {
                match signalled.get_mut(e as usize) {
                    Some(slot @ None) => *slot = Some(i),
                    Some(Some(j)) => {
                        return Err(format!(
                            "event {e} is recorded twice (instructions {j} and {i})"
                        ))
                    }
                    None => return Err(format!("instruction {i} records unknown event {e}")),
                }
            }
        }
        let root = self.storage_roots()?;
        self.check_aliases(&root)?;
        self.check_reuse_is_ordered()?;
        // A root holds its bytes while it or any of its views is live.
        let mut held: Vec<(u32, u32)> = self.buffers.iter().map(|b| b.live).collect();
        for (i, b) in self.buffers.iter().enumerate() {
            let r = root[i] as usize;
            if r != i {
                held[r] = (held[r].0.min(b.live.0), held[r].1.max(b.live.1));
            }
        }
        // Arena buffers live at the same time must not overlap: sweep over time with
        // the live buffers kept by offset (they never overlap each other, so a new one
        // need only be compared with its neighbours).
        let mut arena: Vec<&Buffer> = self
            .buffers
            .iter()
            .filter(|b| {
                b.alias_of.is_none() && !b.resident && b.category != Category::Host && b.bytes > 0
            })
            .collect();
        arena.sort_by_key(|b| (held[b.id as usize].0, b.id));
        let mut ending: std::collections::BinaryHeap<std::cmp::Reverse<(u32, u64)>> =
            Default::default(); // (last instruction, offset) of live buffers
        let mut live: BTreeMap<u64, (u64, u32)> = BTreeMap::new(); // offset -> (end, buffer)
        for b in arena {
            let (from, to) = held[b.id as usize];
            while let Some(std::cmp::Reverse((last, off))) = ending.peek().copied() {
                if last >= from {
                    break;
                }
                ending.pop();
                live.remove(&off);
            }
            let end = b.offset.saturating_add(b.bytes);
            let before = live.range(..=b.offset).next_back();
            let after = live.range(b.offset..).next();
            for (&o, &(e, other)) in before.into_iter().chain(after) {
                if o < end && b.offset < e {
                    return Err(format!(
                        "buffers {other} and {} overlap in the arena while both are live",
                        b.id
                    ));
                }
            }
            live.insert(b.offset, (end, b.id));
            ending.push(std::cmp::Reverse((to, b.offset)));
        }
        self.check_program()?;
        Ok(())
    }
}

/// Self-check of a loaded plan beyond its schedule: what a runtime trusts before it
/// allocates or launches anything.
impl ExecutionPlan {
    /// Checked first, before anything is sized by them: the mesh is one Weft makes
    /// (at most [`crate::mesh::MAX_RANKS`] ranks) and its groups are exactly the ones
    /// it induces; the device profile is usable; stream and event counts are bounded
    /// by the plan's own size; bindings are in range and agree with the mesh.
    pub fn check_bounds(&self) -> Result<(), String> {
        let parsed = crate::mesh::Mesh::parse(&self.mesh.to_string())
            .map_err(|e| format!("its mesh: {e}"))?;
        if parsed != self.mesh {
            return Err(format!("its mesh `{}` is not in normal form", self.mesh));
        }
        let axes: std::collections::BTreeSet<&String> =
            self.mesh.axes.iter().map(|(a, _)| a).collect();
        if !self.groups.keys().eq(axes.iter().copied()) {
            return Err(format!(
                "its groups are for axes [{}] but the mesh is `{}`",
                self.groups.keys().cloned().collect::<Vec<_>>().join(", "),
                self.mesh
            ));
        }
        for (axis, groups) in &self.groups {
            if Some(groups) != self.mesh.groups(axis).as_ref() {
                return Err(format!(
                    "the groups of axis `{axis}` are not the ones mesh `{}` induces (a rank out of range or misplaced)",
                    self.mesh
                ));
            }
        }
        self.device
            .validate()
            .map_err(|e| format!("device profile `{}`: {e}", self.device.name))?;
        if self.streams.len() > MAX_STREAMS {
            return Err(format!(
                "it has {} streams (at most {MAX_STREAMS})",
                self.streams.len()
            ));
        }
        if self.events as usize > self.instructions.len() {
            return Err(format!(
                "it has {} events but only {} instructions to record them",
                self.events,
                self.instructions.len()
            ));
        }
        for (sym, v) in &self.bindings {
            let max = match sym.as_str() {
                "B" => MAX_BATCH,
                "S" => MAX_SEQ,
                _ => i64::MAX,
            };
            if *v <= 0 || *v > max {
                return Err(format!("binding {sym}={v} is out of range (1 to {max})"));
            }
        }
        for (a, n) in &self.mesh.axes {
            if let Some(v) = self.bindings.get(a) {
                if *v != *n as i64 {
                    return Err(format!("binding {a}={v} differs from the mesh's {a}={n}"));
                }
            }
        }
        Ok(())
    }

    /// Checked last (the schedule's own checks name their faults more precisely): the
    /// program matches its digest, parses, verifies, has the plan's mesh, and every
    /// buffer holds a value of the program with that value's dtype and bytes.
    pub fn check_program(&self) -> Result<(), String> {
        if !self.program_digest.is_empty() && digest(self.program.as_bytes()) != self.program_digest
        {
            return Err(
                "its program does not match its digest (the program was edited or swapped)".into(),
            );
        }
        let g = crate::parse::parse(&self.program).map_err(|e| format!("its program: {e}"))?;
        crate::verify::verify(&g).map_err(|r| {
            format!(
                "its program does not verify: {}",
                r.errors
                    .first()
                    .map(|e| format!("{}: {}", e.location, e.message))
                    .unwrap_or_default()
            )
        })?;
        if g.mesh != self.mesh {
            return Err(format!(
                "its program is for mesh `{}` but the plan is for `{}`",
                g.mesh, self.mesh
            ));
        }
        let mut b = crate::dim::Bindings::new();
        for (k, v) in &self.bindings {
            b = b.with(k, *v);
        }
        for (a, n) in &self.mesh.axes {
            b = b.with(a, *n as i64);
        }
        let world = self.mesh.world_size() as usize;
        for buf in &self.buffers {
            let Some(ty) = g.try_ty(crate::graph::Value(buf.value)) else {
                return Err(format!(
                    "buffer {} holds %{}, which the program lacks",
                    buf.id, buf.value
                ));
            };
            if buf
                .offset
                .checked_add(buf.bytes)
                .is_none_or(|end| end > 1 << 60)
            {
                return Err(format!(
                    "buffer {} ends past 2^60 bytes (offset {}, {} bytes)",
                    buf.id, buf.offset, buf.bytes
                ));
            }
            if buf
                .per_rank_bytes
                .as_ref()
                .is_some_and(|t| t.len() != world)
            {
                return Err(format!(
                    "buffer {} lists per-rank sizes for other than the {world} ranks",
                    buf.id
                ));
            }
            if ty.dtype != buf.dtype {
                return Err(format!(
                    "buffer {} is {} but %{} is {ty}",
                    buf.id, buf.dtype, buf.value
                ));
            }
            // Sizes that need a rank coordinate or a data-dependent symbol are checked
            // per rank by the runtime; the rest must match exactly.
            if ty.shape.iter().all(|d| d.rank_axes().is_empty()) {
                if let Ok(want) = ty.size_bytes(&b) {
                    if want != buf.bytes {
                        return Err(format!(
                            "buffer {} holds %{}: {ty}, {want} bytes with the plan's bindings, but says {}",
                            buf.id, buf.value, buf.bytes
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

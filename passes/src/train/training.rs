//! Options of the training passes (`micro-batches`, `autodiff`, `checkpoint`,
//! `offload`, `grad-sync`, `optimizer`) and the training pipeline: the forward pipeline
//! a mesh needs, then the passes that turn it into a whole training step.

use crate::registry::{default_pipeline_explained, Pipeline, Step};
use weft_ir::{Float, Mesh};

/// Which activations the backward recomputes instead of keeping from the forward.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CheckpointPolicy {
    /// Keep every activation the backward reads.
    #[default]
    None,
    /// Per layer: keep only what enters each layer (and what is outside the layers);
    /// recompute the rest of the layer before its backward.
    Full,
    /// AutoSP's selective policy: keep attention outputs and collective results (no
    /// recomputed communication), recompute matmuls and cheap elementwise ops.
    Selective,
    /// Keep the step's peak of live values per rank (the memory estimate's `peak
    /// live`: saved and recomputed activations, transients and gradients in flight;
    /// parameters and optimizer state aside) within this many bytes, choosing what to
    /// recompute for the least extra compute (a min-cut over the joint graph, checked
    /// by the liveness estimate).
    Budget(u64),
}

impl CheckpointPolicy {
    /// Parses `none`, `full`, `selective` or `budget=<bytes>` (suffixes k, M, G, Ki, Mi, Gi).
    pub fn parse(text: &str) -> Result<CheckpointPolicy, String> {
        let t = text.trim();
        match t {
            "none" => Ok(CheckpointPolicy::None),
            "full" => Ok(CheckpointPolicy::Full),
            "selective" => Ok(CheckpointPolicy::Selective),
            _ => match t.strip_prefix("budget=") {
                Some(b) => parse_bytes(b).map(CheckpointPolicy::Budget),
                None => Err(format!("unknown checkpoint policy `{t}` (expected none, full, selective or budget=<bytes>)")),
            },
        }
    }
}

impl std::fmt::Display for CheckpointPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointPolicy::None => write!(f, "none"),
            CheckpointPolicy::Full => write!(f, "full"),
            CheckpointPolicy::Selective => write!(f, "selective"),
            CheckpointPolicy::Budget(b) => write!(f, "budget={b}"),
        }
    }
}

/// Parses a byte count: `1000`, `64M`, `1.5G`, `512Mi`, `2GiB`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim().trim_end_matches(['B', 'b']);
    let (num, mult) = [
        ("Ki", 1u64 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("K", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ]
    .iter()
    .find_map(|(s, m)| t.strip_suffix(s).map(|n| (n, *m)))
    .unwrap_or((t, 1));
    // Whole numbers exactly (a u64 is more precise than an f64), fractions in floating point.
    if let Ok(n) = num.trim().parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| format!("`{text}` is more bytes than Weft counts (at most 2^64 - 1)"));
    }
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a byte count (e.g. 4G, 512Mi, 1000000)"))?;
    if v < 0.0 || !v.is_finite() {
        return Err(format!("`{text}` is not a byte count"));
    }
    let bytes = (v * mult as f64).round();
    // 2^64 and above would saturate to u64::MAX: another number than the one given.
    if bytes >= 18_446_744_073_709_551_616.0 {
        return Err(format!(
            "`{text}` is more bytes than Weft counts (at most 2^64 - 1)"
        ));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod parse_bytes_tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_past_u64_are_refused_not_saturated() {
        assert_eq!(parse_bytes("1.5Ki"), Ok(1536));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_bytes("16Gi"), Ok(16 << 30));
        for t in [
            "99999999999999999999999",
            "20000000T",
            "1e300",
            "18446744073709551616",
            "17179869184Gi",
        ] {
            let e = parse_bytes(t).unwrap_err();
            assert!(e.contains("more bytes than Weft counts"), "{t}: {e}");
        }
    }
}

/// The optimizer the `optimizer` pass writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optimizer {
    AdamW {
        lr: Float,
        beta1: Float,
        beta2: Float,
        eps: Float,
        weight_decay: Float,
    },
    Sgd {
        lr: Float,
        momentum: Float,
        weight_decay: Float,
    },
}

impl Optimizer {
    /// torch.optim.AdamW's defaults (weight decay 0.01) at learning rate `lr`.
    pub fn adamw(lr: f64) -> Optimizer {
        Optimizer::AdamW {
            lr: Float(lr),
            beta1: Float(0.9),
            beta2: Float(0.999),
            eps: Float(1e-8),
            weight_decay: Float(0.01),
        }
    }
    pub fn sgd(lr: f64) -> Optimizer {
        Optimizer::Sgd {
            lr: Float(lr),
            momentum: Float(0.0),
            weight_decay: Float(0.0),
        }
    }
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. } => lr.0,
        }
    }
    pub fn with_lr(self, v: f64) -> Optimizer {
        match self {
            Optimizer::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => Optimizer::AdamW {
                lr: Float(v),
                beta1,
                beta2,
                eps,
                weight_decay,
            },
            Optimizer::Sgd {
                momentum,
                weight_decay,
                ..
            } => Optimizer::Sgd {
                lr: Float(v),
                momentum,
                weight_decay,
            },
        }
    }
}

/// Host offload of saved activations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadOptions {
    /// Keep the saved activations of the last `keep_last` layers on the device (their
    /// backward comes first, with no time to prefetch them).
    pub keep_last: usize,
    /// Offload only tensors of at least this many bytes per rank.
    pub min_bytes: u64,
    /// Planner mode: offload (largest first, earliest layers first) only until the
    /// saved activations on the device fit this many bytes per rank, and only what the
    /// link can move in the compute time between the forward use and the backward use.
    pub budget: Option<u64>,
    /// Host link bandwidth, bytes per second (default the device profile's `host_gbps`:
    /// 55 GB/s on the default H200).
    pub link_bytes_per_s: u64,
    /// The device whose compute the copies hide under, timed by the plan's cost model
    /// (default the `h200` profile; `weft compile --device` sets it).
    pub device: Device,
}

/// A device profile as a pass option (options compare equal; a profile's rates are
/// finite numbers, so equality is an equivalence).
#[derive(Clone, Debug, PartialEq)]
pub struct Device(pub weft_ir::plan::DeviceProfile);

impl Eq for Device {}

impl Device {
    /// The profile's host link, bytes per second.
    pub fn link_bytes_per_s(&self) -> u64 {
        (self.0.host_gbps * 1e9) as u64
    }
}

impl Default for Device {
    fn default() -> Self {
        Device(crate::plan::profile::preset("h200").expect("built-in profile"))
    }
}

impl Default for OffloadOptions {
    fn default() -> Self {
        OffloadOptions {
            keep_last: 1,
            min_bytes: 1 << 20,
            budget: None,
            link_bytes_per_s: Device::default().link_bytes_per_s(),
            device: Device::default(),
        }
    }
}

/// The options of the training passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainOptions {
    /// `micro-batches`: gradient accumulation over this many micro-batches (1: none).
    pub micro_batches: u32,
    /// `checkpoint`: which activations to recompute.
    pub checkpoint: CheckpointPolicy,
    /// `offload`: host offload of saved activations (`None`: off).
    pub offload: Option<OffloadOptions>,
    /// `grad-sync`: bucket size in bytes (DeepSpeed's reduce_bucket_size, 500 MB).
    pub bucket_bytes: u64,
    /// `grad-sync`: ZeRO-style `reduce_scatter` over each parameter's data-parallel
    /// group instead of `all_reduce`.
    pub reduce_scatter: bool,
    /// `optimizer`: the update, or `None` for a step that stops at the gradients.
    pub optimizer: Option<Optimizer>,
    /// `optimizer`: shard the optimizer states (and master weights) over each
    /// parameter's data-parallel group (ZeRO-1; `zero::ZeroGroup`).
    pub zero1: bool,
    /// `optimizer`: ZeRO-3, also shard the parameters themselves (by rows of dim 0),
    /// gathered before each forward and backward region that reads them. Needs
    /// `zero1` and `reduce_scatter`.
    pub zero3: bool,
    /// `optimizer`: ZeRO-Offload's optimizer placement: f32 master weights and AdamW
    /// moments (ZeRO-sharded as the stage says) live in pinned host memory; each
    /// gradient chunk is copied to the host (`offload`), the host CPU updates it
    /// (`host_adamw`) and the parameter in its dtype comes back (`reload`). Needs AdamW
    /// and master weights.
    pub offload_optimizer: bool,
    /// `optimizer`: the optimizer state (moments, master weights, SGD momentum; ZeRO-sharded
    /// as the stage says) lives in pinned host memory, and the device runs the update:
    /// each parameter's state is brought in (`reload`, prefetched ahead of its update
    /// during the backward) and its new state goes back (`offload`). The device holds
    /// only the state of the few updates in flight; the host link carries the state
    /// twice per step, in the backward, beside the activations' reloads.
    pub stream_optimizer_state: bool,
    /// The device whose compute the streamed state's copies hide under, timed by the
    /// plan's cost model (default the `h200` profile; the driver sets the request's).
    pub device: Device,
    /// `optimizer`: low-precision (bf16, f16) parameters get f32 master weights and f32
    /// states (mixed precision). Off, the update runs on the parameter itself with states
    /// in its dtype, as `torch.optim.AdamW` does on a bf16 model.
    pub master_weights: bool,
    /// `optimizer`: keep returning the parameter gradients (`grad.*`) from a step that
    /// updates the parameters (what `weft check --train` and `eval --grads` compare).
    /// Off, the step returns only the updates and states, so each gradient is freed
    /// as soon as its bucket's update has read it (as a real trainer does).
    pub grad_outputs: bool,
    /// Sizes the memory-aware passes (checkpoint budget, offload planner) evaluate
    /// per-rank bytes at: `B` and `S` (default: 1 sequence of 4096 tokens per dp rank).
    /// `ring-lower` stops a sliding window's ring early for `S` (and sequences at least
    /// as long; unknown, it takes every step).
    pub batch: Option<i64>,
    pub seq: Option<i64>,
    /// `linear-cross-entropy`: fuse the lm_head and the loss so no logits tensor exists
    /// (where the logits are not an output).
    pub fused_loss: bool,
    /// `linear-cross-entropy`: vocabulary rows per chunk (`None`: sized from the
    /// tokens so the chunk's logits stay under 256 MiB).
    pub loss_chunk: Option<i64>,
    /// `fp8`: the linear layers' GEMMs in FP8 (e4m3 forward, e5m2 gradients).
    pub fp8: bool,
    /// `optimizer`: AdamW's learning rate rises linearly over this many steps
    /// (`lr * min(1, step / warmup)`), then stays.
    pub warmup_steps: Option<u32>,
    /// `ring-lower`: how context parallelism moves k/v between the cp ranks, ring
    /// steps (default) or one all-gather (`--cp-kv`). Also read by a forward-only
    /// program's ring lowering (the driver sets it from the request).
    pub cp_kv: crate::ring_allgather::CpKv,
    /// `optimizer`: how far the updates that would stall the compute stream waiting for
    /// their gradient's reduction move towards where it is predicted done
    /// ([`crate::train::update_timing`]); `Off` keeps each right after its reduction,
    /// holding the reduced gradients least long (the driver holds less where a plan
    /// does not fit otherwise).
    pub defer_updates: crate::train::update_timing::DeferUpdates,
    /// Whether the plan runs the device's optimizer updates on a stream of their own
    /// beside the compute stream (`--update-stream`,
    /// [`crate::plan::PlanOptions::update_stream`]).
    pub update_stream: UpdateStream,
}

/// Where the device's optimizer updates run ([`TrainOptions::update_stream`]). Inert
/// without device updates (no optimizer, or the host's update).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UpdateStream {
    /// On the compute stream, between the backward's kernels.
    Off,
    /// On a stream of their own.
    On,
    /// On a stream of their own unless the plan then no longer fits the device memory:
    /// a compute stream that no longer waits for the updates can run ahead of them, and
    /// of reductions that outlast the backward, holding more gradients at once. The
    /// driver then plans them on the compute stream. The default (measured faster on
    /// an H100: bench/GPU_NOTES.md, session 27).
    #[default]
    WhereItFits,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            micro_batches: 1,
            checkpoint: CheckpointPolicy::None,
            offload: None,
            bucket_bytes: 500_000_000,
            reduce_scatter: false,
            optimizer: None,
            zero1: false,
            zero3: false,
            offload_optimizer: false,
            stream_optimizer_state: false,
            device: Device::default(),
            master_weights: true,
            grad_outputs: true,
            batch: None,
            seq: None,
            fused_loss: true,
            loss_chunk: None,
            fp8: false,
            warmup_steps: None,
            cp_kv: Default::default(),
            defer_updates: crate::train::update_timing::DeferUpdates::All,
            update_stream: UpdateStream::default(),
        }
    }
}

impl TrainOptions {
    /// The ZeRO stage these options amount to (3: shard the parameters too, 2:
    /// reduce_scatter gradients, 1: shard the optimizer state, 0: none of these).
    pub fn zero_stage(&self) -> u8 {
        if self.zero3 {
            3
        } else if self.reduce_scatter {
            2
        } else if self.zero1 {
            1
        } else {
            0
        }
    }

    /// Sets the ZeRO stage (0 to 3): what `--zero N` sets.
    pub fn set_zero_stage(&mut self, stage: u8) {
        self.zero1 = stage >= 1;
        self.reduce_scatter = stage >= 2;
        self.zero3 = stage >= 3;
    }

    /// The memory-relevant choices in one line, as the CLI flags name them:
    /// `--checkpoint selective --offload --zero 1 --micro-batches 1` (no `--offload`: none).
    pub fn summary(&self) -> String {
        let mut s = format!("--checkpoint {}", self.checkpoint);
        if let Some(o) = &self.offload {
            match o.budget {
                Some(b) => s.push_str(&format!(" --offload-budget {b}")),
                None => s.push_str(" --offload"),
            }
        }
        s.push_str(&format!(
            " --zero {} --micro-batches {}",
            self.zero_stage(),
            self.micro_batches
        ));
        if self.offload_optimizer {
            s.push_str(" --offload-optimizer");
        }
        if self.stream_optimizer_state {
            s.push_str(" --stream-optimizer-state");
        }
        if !self.fused_loss {
            s.push_str(" --unfused-loss");
        }
        if self.fp8 {
            s.push_str(" --fp8");
        }
        if let Some(w) = self.warmup_steps {
            s.push_str(&format!(" --warmup-steps {w}"));
        }
        if self.update_stream == UpdateStream::Off
            && self.optimizer.is_some()
            && !self.offload_optimizer
        {
            s.push_str(" --update-stream=false");
        }
        if self.cp_kv != crate::ring_allgather::CpKv::Ring {
            // It holds the whole sequence's k/v per layer where the ring holds two blocks.
            s.push_str(&format!(" --cp-kv {}", self.cp_kv.name()));
        }
        s
    }
}

/// The pipeline of a whole training step on `mesh`: the forward pipeline, then the
/// training passes `opts` asks for, each with the reason for its position.
pub fn training_pipeline(mesh: &Mesh, opts: &TrainOptions) -> Pipeline {
    let mut p = default_pipeline_explained(mesh);
    p.steps.extend(training_steps(opts));
    crate::registry::place_ring_lower(&mut p);
    p
}

/// The training passes `opts` asks for, in order, each with the reason for its
/// position; they follow whatever forward pipeline the program went through.
pub fn training_steps(opts: &TrainOptions) -> Vec<Step> {
    let mut p = Vec::new();
    let push = |p: &mut Vec<Step>, pass: &str, why: &str| {
        p.push(Step {
            pass: pass.to_string(),
            why: why.to_string(),
        })
    };
    if opts.fused_loss {
        push(
            &mut p,
            crate::linear_ce::NAME,
            "after the forward passes (it matches the per-rank loss, vocab-parallel included) and before micro-batches and autodiff, which clone and differentiate the fused op",
        );
    }
    if opts.fp8 {
        push(
            &mut p,
            crate::fp8::NAME,
            "after the forward passes and linear-cross-entropy (the loss's lm_head stays in its dtype) and before autodiff, which differentiates each FP8 GEMM into FP8 GEMMs",
        );
    }
    if opts.micro_batches > 1 {
        push(
            &mut p,
            "micro-batches",
            "after the forward passes (it splits each rank's batch, whatever the sharding) and before autodiff, so the backward of each micro-batch accumulates into one gradient",
        );
    }
    push(&mut p, "autodiff", "after every forward rewrite: differentiates the parallel program itself, collectives included");
    if opts.checkpoint != CheckpointPolicy::None {
        push(
            &mut p,
            "checkpoint",
            "after autodiff: it chooses among the forward values the backward reads",
        );
    }
    if opts.offload.is_some() {
        push(&mut p, "offload", "after checkpoint: only what is still saved for the backward is worth moving to the host");
    }
    push(&mut p, "grad-sync", "after the backward is complete: buckets the parameter gradients' reductions in the order backward produces them");
    if opts.optimizer.is_some() {
        push(
            &mut p,
            "optimizer",
            "after grad-sync: updates each parameter from its reduced gradient",
        );
    }
    p
}

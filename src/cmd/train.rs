//! What `compile`, `eval`, `check` and `run` share to build a training step: the flags
//! of the training passes (checkpointing, offload, micro-batches, gradient buckets,
//! ZeRO, optimizer) and the gradients read back from a step's `grad.*` outputs.

use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use weft_ir::HostTensor;
use weft_passes::driver::{Open, Request, TrainRequest};
use weft_passes::ring_allgather::CpKv;
use weft_passes::training::{
    parse_bytes, CheckpointPolicy, OffloadOptions, Optimizer, TrainOptions, UpdateStream,
};

#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// Activation checkpointing: `none`, `full` (per layer), `selective` (keep attention
    /// outputs, recompute matmuls and elementwise ops) or `budget=<bytes>` (keep the
    /// step's peak of live values per rank within the budget at the least recompute,
    /// checked by the liveness estimate; `weft run --steps 0` prints that estimate).
    /// Not given: a plan takes the policy of the fastest option set that fits the
    /// device memory (the search of `weft plan` on the given mesh), and says which.
    #[arg(long, value_name = "POLICY")]
    pub checkpoint: Option<String>,
    /// Offload saved activations to host memory (async copies on their own streams,
    /// prefetched before their backward use; the last layer's stay on the device). With
    /// `--checkpoint selective` or `budget=`, what would be recomputed goes to the host
    /// instead where the host link (the --device profile's) can carry it in time.
    /// `--offload=false` forbids it; not given, a plan turns it on only when nothing
    /// fits without it.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub offload: Option<bool>,
    /// Offload planner: offload only until the saved activations fit this many bytes per
    /// rank, within what the host link can hide under compute (implies --offload).
    #[arg(long, value_name = "BYTES")]
    pub offload_budget: Option<String>,
    /// Offload only saved activations of at least this many bytes per rank.
    #[arg(long, default_value = "1Mi", value_name = "BYTES")]
    pub offload_min_bytes: String,
    /// Gradient accumulation: run the step as N micro-batches (one gradient reduction).
    /// Not given: 1, or for a plan the count (a power of two dividing a rank's batch,
    /// at most 8) of the fastest option set that fits.
    #[arg(long, value_name = "N")]
    pub micro_batches: Option<u32>,
    /// Gradient reduction bucket size in millions of bytes of gradient (10^6 bytes; a
    /// bucket of 500 holds 250M bf16 or 125M f32 gradient elements). Default 500.
    #[arg(long, default_value_t = 500.0, value_name = "MB")]
    pub bucket_mb: f64,
    /// ZeRO stage, over each parameter's data-parallel group (dp x sp for dense
    /// parameters, edp for experts, tp-split ones included): 0 (all_reduce gradients),
    /// 1 (shard optimizer states and master weights), 2 (also reduce_scatter
    /// gradients, per micro-batch), 3 (also shard the parameters by rows, all_gathered
    /// before each forward and backward use). Not given: 0, or for a plan the stage of
    /// the fastest option set that fits the device memory.
    #[arg(long, value_name = "STAGE")]
    pub zero: Option<u8>,
    /// Keep the f32 master weights and AdamW moments in pinned host memory: gradient
    /// chunks stream to the host, the host CPU runs AdamW, the updated parameters
    /// stream back (ZeRO-Offload). Combines with --zero (the host state is sharded
    /// the same way). `--offload-optimizer=false` forbids it; not given, a plan turns
    /// it on when it is part of the fastest option set that fits (and pins at most
    /// --host-memory). On CUDA the update runs on the host's cores as a host node of the
    /// step's CUDA graph.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub offload_optimizer: Option<bool>,
    /// Keep the optimizer state (AdamW moments, master weights, SGD momentum) in pinned
    /// host memory and update on the GPU: each parameter's state is prefetched to the
    /// device ahead of its update in the backward and written back after it, so the
    /// device holds only the updates in flight. Costs host-link time (the state crosses
    /// twice per step), which long sequences hide under the backward.
    /// `--stream-optimizer-state=false` forbids it; not given, a plan turns it on when it
    /// is part of the fastest option set that fits.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub stream_optimizer_state: Option<bool>,
    /// Optimizer update in the step: adamw, sgd or none.
    #[arg(long, value_name = "NAME")]
    pub optimizer: Option<String>,
    /// Learning rate of the optimizer.
    #[arg(long, default_value_t = 1e-3, value_name = "X")]
    pub lr: f64,
    /// Update bf16/f16 parameters in their own dtype with states in that dtype (as
    /// torch.optim.AdamW on a bf16 model) instead of on f32 master weights.
    #[arg(long)]
    pub no_master_weights: bool,
    /// Run the `fuse` pass last: SwiGLU/GeGLU (`glu`, `glu_grad`) and residual add +
    /// rms_norm (`add_rms_norm`, `add_rms_norm_grad`) fused, forward and backward, each
    /// equal to the ops it replaces. On by default; `--fuse=false` leaves them unfused.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub fuse: Option<bool>,
    /// Keep the lm_head and the cross-entropy as separate ops (the step materialises the
    /// [tokens, vocab] logits) instead of `linear_cross_entropy` over vocabulary chunks.
    /// Neither this nor --fused-loss: the compiler chooses (unfused where it fits, as it
    /// is faster; fused where the logits do not fit).
    #[arg(long, conflicts_with = "fused_loss")]
    pub unfused_loss: bool,
    /// Always fuse the lm_head and the cross-entropy (`linear_cross_entropy`, no logits
    /// tensor in the step).
    #[arg(long)]
    pub fused_loss: bool,
    /// Run the linear layers' GEMMs in FP8: e4m3 weights and activations, e5m2
    /// gradients, per-tensor power-of-two scales from each operand's current amax,
    /// f32 accumulation (the `fp8` pass). The lm_head, routers, attention and MoE
    /// experts stay in the model's dtype, as do master weights and optimizer states.
    #[arg(long)]
    pub fp8: bool,
    /// AdamW's learning rate rises linearly over the first N steps (`--lr` times
    /// min(1, step / N)), as a warmup schedule does; constant after.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub warmup_steps: Option<u32>,
    /// How context parallelism (`cp`) moves k/v between ranks: `ring` (default; ring
    /// steps overlapped with attention, two k/v blocks alive) or `allgather` (one
    /// all_gather of k and v per layer, a reduce_scatter of dk and dv in the backward;
    /// not overlapped, the whole sequence's k/v held).
    #[arg(long, value_name = "KIND")]
    pub cp_kv: Option<String>,
    /// Run the optimizer updates on a CUDA stream of their own at low priority, beside
    /// the backward: each update starts when the compute stream reaches it and fills
    /// the SMs the backward's kernels leave idle, instead of taking compute-stream time
    /// (1-2% of the 1.24B's step on an H100). Not given: on wherever the device runs the
    /// update (off where the host does, with --offload-optimizer).
    /// `--update-stream=false` keeps the updates on the compute stream. Given, it is
    /// refused with --offload-optimizer or without an optimizer, and a plan leaves the
    /// host update out of its choices.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub update_stream: Option<bool>,
}

impl TrainArgs {
    /// The training request: the options given (defaults elsewhere), and which of
    /// them the driver may choose by memory; `default_optimizer` when `--optimizer`
    /// is absent.
    pub fn request(&self, default_optimizer: &str) -> CliResult<TrainRequest> {
        let checkpoint = match &self.checkpoint {
            None => CheckpointPolicy::None,
            Some(c) => CheckpointPolicy::parse(c).map_err(|m| {
                CliError::input(format!("invalid --checkpoint: {m}"))
                    .with_help("use none, full, selective or budget=<bytes> (e.g. budget=2G)")
            })?,
        };
        let min_bytes = parse_bytes(&self.offload_min_bytes)
            .map_err(|m| CliError::input(format!("invalid --offload-min-bytes: {m}")))?;
        let template = OffloadOptions {
            min_bytes,
            ..Default::default()
        };
        let offload = match (&self.offload_budget, self.offload) {
            (Some(_), Some(false)) => {
                return Err(CliError::input(
                    "--offload-budget and --offload=false contradict each other",
                ))
            }
            (Some(b), _) => {
                let budget = parse_bytes(b)
                    .map_err(|m| CliError::input(format!("invalid --offload-budget: {m}")))?;
                Some(OffloadOptions {
                    budget: Some(budget),
                    ..template.clone()
                })
            }
            (None, Some(true)) => Some(template.clone()),
            (None, _) => None,
        };
        let micro_batches = self.micro_batches.unwrap_or(1);
        if micro_batches == 0 {
            return Err(CliError::input(
                "invalid --micro-batches 0: must be at least 1",
            ));
        }
        if !(self.bucket_mb > 0.0) {
            return Err(CliError::input(format!(
                "invalid --bucket-mb {}: must be positive",
                self.bucket_mb
            )));
        }
        let zero = self.zero.unwrap_or(0);
        if zero > 3 {
            return Err(CliError::input(format!(
                "invalid --zero {zero}: stages 0, 1, 2 and 3 are supported"
            )));
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(CliError::input(format!(
                "invalid --lr {}: must be a non-negative number",
                self.lr
            )));
        }
        let optimizer = match self.optimizer.as_deref().unwrap_or(default_optimizer) {
            "adamw" => Some(Optimizer::adamw(self.lr)),
            "sgd" => Some(Optimizer::sgd(self.lr)),
            "none" => None,
            o => {
                return Err(CliError::input(format!("invalid --optimizer `{o}`"))
                    .with_help("use adamw, sgd or none"))
            }
        };
        if optimizer.is_none() {
            if let Some(w) = self.warmup_steps {
                return Err(CliError::input(format!(
                    "--warmup-steps {w} warms up the optimizer's learning rate, but this step has no optimizer"
                ))
                .with_help("give --optimizer adamw"));
            }
            if self.stream_optimizer_state == Some(true) {
                return Err(CliError::input(
                    "--stream-optimizer-state streams the optimizer's state, but this step has no optimizer",
                )
                .with_help("give --optimizer adamw or sgd"));
            }
            if self.update_stream == Some(true) {
                return Err(CliError::input(
                    "--update-stream moves the optimizer's updates to a stream of their own, but this step has no optimizer",
                )
                .with_help("give --optimizer adamw or sgd, or drop --update-stream"));
            }
        }
        if self.update_stream == Some(true) && self.offload_optimizer == Some(true) {
            return Err(CliError::input(
                "--update-stream moves the device's optimizer updates, but with --offload-optimizer the host CPU runs them",
            )
            .with_help("drop one of the two"));
        }
        Ok(TrainRequest {
            options: TrainOptions {
                micro_batches,
                checkpoint,
                offload,
                bucket_bytes: (self.bucket_mb * 1e6) as u64,
                reduce_scatter: zero >= 2,
                optimizer,
                zero1: zero >= 1,
                zero3: zero >= 3,
                offload_optimizer: self.offload_optimizer == Some(true),
                stream_optimizer_state: self.stream_optimizer_state == Some(true),
                // The driver sets the request's device profile.
                device: Default::default(),
                master_weights: !self.no_master_weights,
                // check and eval compare the gradients; `compile` drops them from a plan.
                grad_outputs: true,
                batch: None,
                seq: None,
                fused_loss: !self.unfused_loss,
                loss_chunk: None,
                fp8: self.fp8,
                warmup_steps: self.warmup_steps,
                cp_kv: self.cp_kv()?,
                defer_updates: weft_passes::train::update_timing::DeferUpdates::All,
                // Not given: wherever the device updates and the plan still fits (the
                // lowering leaves it off where the search puts the update on the host).
                update_stream: match self.update_stream {
                    Some(true) => UpdateStream::On,
                    Some(false) => UpdateStream::Off,
                    None => UpdateStream::default(),
                },
            },
            open: Open {
                checkpoint: self.checkpoint.is_none(),
                offload: self.offload.is_none() && self.offload_budget.is_none(),
                zero: self.zero.is_none(),
                micro_batches: self.micro_batches.is_none(),
                // The host update needs AdamW on f32 master weights.
                offload_optimizer: self.offload_optimizer.is_none()
                    && self.stream_optimizer_state != Some(true)
                    && self.update_stream != Some(true)
                    && matches!(optimizer, Some(Optimizer::AdamW { .. }))
                    && !self.no_master_weights,
                fused_loss: !self.unfused_loss && !self.fused_loss,
                stream_optimizer_state: self.stream_optimizer_state.is_none()
                    && optimizer.is_some()
                    && self.offload_optimizer != Some(true),
            },
            offload_template: template,
        })
    }

    /// `--cp-kv` (default `ring`).
    pub fn cp_kv(&self) -> CliResult<CpKv> {
        match &self.cp_kv {
            None => Ok(CpKv::Ring),
            Some(s) => CpKv::parse(s).map_err(|m| CliError::input(format!("invalid --cp-kv: {m}"))),
        }
    }

    /// Refuses training flags on a forward-only compile, which has no step for them to
    /// change (`--fuse` and `--cp-kv` apply to the forward too).
    pub fn refuse_for_forward_only(&self) -> CliResult {
        if self.any() {
            return Err(CliError::input(
                "--forward-only compiles no training step, so the training flags given (--checkpoint, --offload, --zero, --micro-batches, --optimizer, --fp8, --warmup-steps, ...) would change nothing",
            )
            .with_help("drop --forward-only, or the training flags"));
        }
        Ok(())
    }

    /// Whether the driver runs `fuse` (`--fuse`, default on).
    pub fn fuse(&self) -> bool {
        self.fuse.unwrap_or(true)
    }

    /// True when any training flag is given (so `check` and `eval` build a training
    /// step without `--train` / `--grads`).
    pub fn any(&self) -> bool {
        self.checkpoint.is_some()
            || self.offload.is_some()
            || self.offload_budget.is_some()
            || self.micro_batches.is_some()
            || self.zero.is_some()
            || self.offload_optimizer.is_some()
            || self.stream_optimizer_state.is_some()
            || self.optimizer.is_some()
            || self.no_master_weights
            || self.unfused_loss
            || self.fused_loss
            || self.fp8
            || self.warmup_steps.is_some()
            || self.update_stream.is_some()
    }
}

/// The gradients a training step returned as `grad.<param>` outputs, by param name.
pub fn graph_grads(outputs: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    outputs
        .iter()
        .filter_map(|(k, v)| match weft_ir::ValueName::parse(k) {
            weft_ir::ValueName::Grad(p) => Some((p.to_string(), v.clone())),
            _ => None,
        })
        .collect()
}

/// The per-rank memory of the training step under each checkpoint policy (none,
/// selective, full, and the one compiled), each compiled by the driver from `req`
/// with the compiled step's other options: a table for `weft compile --stats`.
pub fn memory_table(req: &Request, compiled: &TrainOptions) -> CliResult<String> {
    use weft_passes::memory::{bindings, estimate};
    let mut policies = vec![
        CheckpointPolicy::None,
        CheckpointPolicy::Selective,
        CheckpointPolicy::Full,
    ];
    if !policies.contains(&compiled.checkpoint) {
        policies.push(compiled.checkpoint.clone());
    }
    let gib = |b: u64| format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64);
    let mut rows = vec![[
        "checkpoint",
        "saved activations",
        "offloaded",
        "params",
        "grads",
        "optimizer",
        "peak live",
        "total",
    ]
    .map(String::from)
    .to_vec()];
    let mut at = String::new();
    for p in policies {
        let mut r = req.clone();
        let mut t = r.train.clone().unwrap_or_default();
        t.options = compiled.clone();
        t.options.checkpoint = p.clone();
        t.open = Open::default();
        r.train = Some(t);
        r.plan = false;
        r.instrumentation = weft_passes::Instrumentation {
            check_requires: r.instrumentation.check_requires,
            verify_each: false,
            ..Default::default()
        };
        let c =
            weft_passes::driver::compile(&r, &mut std::io::sink()).map_err(super::driver_err)?;
        let opts = c.train.clone().unwrap_or_default();
        let b = bindings(&c.program, &opts);
        at = format!("B={}, S={}", b.symbols["B"], b.symbols["S"]);
        let e = estimate(&c.program, &b);
        rows.push(vec![
            p.to_string(),
            gib(e.saved_activations),
            gib(e.offloaded),
            gib(e.params),
            gib(e.grads),
            if e.host_optimizer > 0 {
                format!("{} (+{} host)", gib(e.optimizer), gib(e.host_optimizer))
            } else {
                gib(e.optimizer)
            },
            gib(e.peak_live),
            gib(e.total),
        ]);
    }
    let mut out = format!("memory per rank of the training step ({at}):\n");
    out.push_str(&super::table(rows));
    Ok(out)
}

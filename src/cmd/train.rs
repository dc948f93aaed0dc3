//! What `compile`, `eval`, `check` and `run` share to build a training step: the flags
//! of the training passes (checkpointing, offload, micro-batches, gradient buckets,
//! ZeRO, optimizer) and the gradients read back from a step's `grad.*` outputs.

use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use weft_ir::HostTensor;
use weft_passes::training::{
    parse_bytes, CheckpointPolicy, OffloadOptions, Optimizer, TrainOptions,
};

#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// Activation checkpointing: `none`, `full` (per layer), `selective` (keep attention
    /// outputs, recompute matmuls and elementwise ops) or `budget=<bytes>` (keep the
    /// step's peak of live values per rank within the budget at the least recompute,
    /// checked by the liveness estimate; `weft run --steps 0` prints that estimate).
    #[arg(long, default_value = "none", value_name = "POLICY")]
    pub checkpoint: String,
    /// Offload saved activations to host memory (async copies on their own streams,
    /// prefetched before their backward use; the last layer's stay on the device). With
    /// `--checkpoint selective` or `budget=`, what would be recomputed goes to the host
    /// instead where the host link (the --device profile's) can carry it in time.
    #[arg(long)]
    pub offload: bool,
    /// Offload planner: offload only until the saved activations fit this many bytes per
    /// rank, within what the host link can hide under compute (implies --offload).
    #[arg(long, value_name = "BYTES")]
    pub offload_budget: Option<String>,
    /// Offload only saved activations of at least this many bytes per rank.
    #[arg(long, default_value = "1Mi", value_name = "BYTES")]
    pub offload_min_bytes: String,
    /// Gradient accumulation: run the step as N micro-batches (one gradient reduction).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub micro_batches: u32,
    /// Gradient reduction bucket size in MB (DeepSpeed's reduce_bucket_size: 500).
    #[arg(long, default_value_t = 500.0, value_name = "MB")]
    pub bucket_mb: f64,
    /// ZeRO stage, over each parameter's data-parallel group (dp x sp for dense
    /// parameters, edp for experts, tp-split ones included): 0 (all_reduce gradients),
    /// 1 (shard optimizer states and master weights), 2 (also reduce_scatter
    /// gradients, per micro-batch), 3 (also shard the parameters by rows, all_gathered
    /// before each forward and backward use).
    #[arg(long, default_value_t = 0, value_name = "STAGE")]
    pub zero: u8,
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
}

impl TrainArgs {
    /// The training passes' options; `default_optimizer` when `--optimizer` is absent.
    pub fn options(&self, default_optimizer: &str) -> CliResult<TrainOptions> {
        let checkpoint = CheckpointPolicy::parse(&self.checkpoint).map_err(|m| {
            CliError::input(format!("invalid --checkpoint: {m}"))
                .with_help("use none, full, selective or budget=<bytes> (e.g. budget=2G)")
        })?;
        let min_bytes = parse_bytes(&self.offload_min_bytes)
            .map_err(|m| CliError::input(format!("invalid --offload-min-bytes: {m}")))?;
        let offload = match (&self.offload_budget, self.offload) {
            (Some(b), _) => {
                let budget = parse_bytes(b)
                    .map_err(|m| CliError::input(format!("invalid --offload-budget: {m}")))?;
                Some(OffloadOptions {
                    budget: Some(budget),
                    min_bytes,
                    ..Default::default()
                })
            }
            (None, true) => Some(OffloadOptions {
                min_bytes,
                ..Default::default()
            }),
            (None, false) => None,
        };
        if self.micro_batches == 0 {
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
        if self.zero > 3 {
            return Err(CliError::input(format!(
                "invalid --zero {}: stages 0, 1, 2 and 3 are supported",
                self.zero
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
        Ok(TrainOptions {
            micro_batches: self.micro_batches,
            checkpoint,
            offload,
            bucket_bytes: (self.bucket_mb * 1e6) as u64,
            reduce_scatter: self.zero >= 2,
            optimizer,
            zero1: self.zero >= 1,
            zero3: self.zero >= 3,
            master_weights: !self.no_master_weights,
            // check and eval compare the gradients; `compile` drops them from a plan.
            grad_outputs: true,
            batch: None,
            seq: None,
        })
    }

    /// True when any training flag differs from its default (so `compile` builds a
    /// training step without `--train`).
    pub fn any(&self) -> bool {
        self.checkpoint != "none"
            || self.offload
            || self.offload_budget.is_some()
            || self.micro_batches != 1
            || self.zero != 0
            || self.optimizer.is_some()
            || self.no_master_weights
    }
}

/// The training passes after the forward pipeline, for `opts`.
pub fn training_passes(mesh: &weft_ir::Mesh, opts: &TrainOptions) -> Vec<String> {
    let forward = weft_passes::default_pipeline(mesh).len();
    weft_passes::training::training_pipeline(mesh, opts)
        .names()
        .into_iter()
        .skip(forward)
        .map(String::from)
        .collect()
}

/// The gradients a training step returned as `grad.<param>` outputs, by param name.
pub fn graph_grads(outputs: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    outputs
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix(weft_passes::autodiff::GRAD_PREFIX)
                .map(|p| (p.to_string(), v.clone()))
        })
        .collect()
}

/// The per-rank memory of the training step under each checkpoint policy (none,
/// selective, full, and the one given), compiled from `model` with `forward` then the
/// training passes: a table for `weft compile --stats`.
pub fn memory_table(
    model: &weft_ir::Graph,
    cx: &weft_passes::PassContext,
    forward: &[String],
) -> CliResult<String> {
    use weft_passes::memory::{bindings, estimate};
    let mut policies = vec![
        CheckpointPolicy::None,
        CheckpointPolicy::Selective,
        CheckpointPolicy::Full,
    ];
    if !policies.contains(&cx.options.train.checkpoint) {
        policies.push(cx.options.train.checkpoint.clone());
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
        let mut c = cx.clone();
        c.options.train.checkpoint = p.clone();
        let mut names: Vec<String> = forward.to_vec();
        names.extend(training_passes(&c.mesh, &c.options.train));
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut g = model.clone();
        let ins = weft_passes::Instrumentation {
            check_requires: false,
            verify_each: false,
            ..Default::default()
        };
        weft_passes::PassManager::new(ins)
            .run(&mut g, &c, &refs, &mut std::io::sink())
            .map_err(crate::fail)?;
        let b = bindings(&g, &c.options.train);
        at = format!("B={}, S={}", b.symbols["B"], b.symbols["S"]);
        let e = estimate(&g, &b);
        rows.push(vec![
            p.to_string(),
            gib(e.saved_activations),
            gib(e.offloaded),
            gib(e.params),
            gib(e.grads),
            gib(e.optimizer),
            gib(e.peak_live),
            gib(e.total),
        ]);
    }
    let w: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = format!("memory per rank of the training step ({at}):\n");
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if i == 0 {
                    format!("{s:<w$}", w = w[i])
                } else {
                    format!("{s:>w$}", w = w[i])
                }
            })
            .collect();
        out.push_str(&format!("  {}\n", cells.join("  ")));
    }
    Ok(out)
}

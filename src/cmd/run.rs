//! `weft run`: train (or, for a program without an optimizer, evaluate) a model or plan
//! for `--steps` steps on a backend, printing per-step loss, step time, tokens/s, MFU
//! and peak memory. `--backend cuda` runs the plan on the GPU (needs a build with
//! `--features cuda`); `--backend cpu` runs the same program on the CPU reference.
//! `--check` compares the first steps' losses and gradients with the CPU reference.

use super::session::draw_inputs;
use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use weft_ir::{DType, ExecutionPlan, Graph, HostTensor, Op};

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Preset name, config.json or model directory, .weft file, or a plan .json (run as
    /// compiled).
    pub model: String,
    /// cpu (the reference runtime, f32) or cuda (needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Optimizer steps to run (0: compile and print the plan's prediction, run nothing).
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// Mesh axes outermost first (empty: one rank).
    #[arg(long, default_value = "")]
    pub mesh: String,
    /// Weights (safetensors). Default: the model directory's, else seeded random weights
    /// (drawn on the device for the cuda backend).
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Inputs: safetensors with `input_ids` and `labels` (i64 [B, S]), used every step.
    #[arg(long)]
    pub inputs: Option<PathBuf>,
    /// Token file (flat little-endian uint16, nanoGPT style): each step reads the next B*S tokens.
    #[arg(long, conflicts_with = "inputs")]
    pub data: Option<PathBuf>,
    /// Float dtype of params and activations: keep (the model's), bf16 or f32.
    #[arg(long, default_value = "keep")]
    pub dtype: String,
    /// Sequence length (default: --inputs' length, else 8 per sequence-parallel rank).
    #[arg(long)]
    pub seq: Option<i64>,
    /// Global batch size (default: --inputs' batch, else 2 per data-parallel rank).
    #[arg(long)]
    pub batch: Option<i64>,
    /// Seed of random weights and drawn inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the forward pass only (loss, no backward or optimizer update).
    #[arg(long)]
    pub forward_only: bool,
    /// Device profile the plan is scheduled and sized for: h200, h100, a100 or a JSON
    /// file (default: with `--backend cuda`, the profile of the GPU found, else h200).
    #[arg(long)]
    pub device: Option<String>,
    /// Per-rank device memory the plan must fit, in GiB (default: the device profile's,
    /// at most the memory of the GPU found with `--backend cuda`).
    #[arg(long, value_name = "GIB")]
    pub device_memory: Option<f64>,
    /// Pinned host memory per rank the plan may hold, in GiB: offloaded activations, the
    /// host optimizer's state and streamed optimizer state (default with `--backend
    /// cuda`: 90% of this machine's available memory, shared by the node's ranks
    /// (LOCAL_WORLD_SIZE); else no limit).
    #[arg(long, value_name = "GIB")]
    pub host_memory: Option<f64>,
    /// Compare each step's loss (and the first step's gradients) with the CPU reference
    /// (f32) for this many steps (0: off). `--check` alone checks the first step.
    #[arg(long, num_args = 0..=1, default_missing_value = "1", default_value_t = 0)]
    pub check: usize,
    /// Relative tolerance of --check (default: 3e-2 for bf16 programs, 1e-3 for f32; with
    /// --fp8 1.5e-1 and 2e-2, since FP8 rounding amplifies small differences).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// Peak dense matmul rate for MFU, TFLOP/s (default: 989, H100/H200 bf16 dense).
    #[arg(long, default_value_t = 989.0)]
    pub peak_tflops: f64,
    /// Generic attention kernels instead of the tensor-core ones.
    #[arg(long)]
    pub generic_attention: bool,
    /// Write the plan that was run here.
    #[arg(long)]
    pub plan_out: Option<PathBuf>,
    /// cuda: profile the last step (as `WEFT_PROFILE` does) and write one tab-separated row
    /// per compute-stream instruction to FILE: index, op, source, the plan's predicted
    /// milliseconds and the measured device milliseconds (bench/gap.py ranks them).
    #[arg(long, value_name = "FILE")]
    pub profile_out: Option<PathBuf>,
    /// Write the first step's gradients to FILE (safetensors, f32, `grad.<param>` for
    /// each parameter, as `weft eval --grads` writes them: HF names for a checkpoint, MoE
    /// experts stacked as `weft compile` lists them), to compare with another framework's
    /// step on the same weights and batch (`bench/loss_parity.py --grads`). Training steps on a
    /// one-rank mesh; both backends.
    #[arg(long, value_name = "FILE")]
    pub grads_out: Option<PathBuf>,
    /// Print one JSON document instead of the table (both backends): the run (backend,
    /// model, training, batch, seq, compile_s, mean_step_s, tokens_per_s, notes; on
    /// cuda also the plan's predicted_step_s, memory and load) and `steps`, one object per step (step, loss, step_s,
    /// tokens_per_s, mfu on GPUs); the header goes to stderr.
    #[arg(long)]
    pub json: bool,
    /// The update as torch.optim.AdamW does it on a bf16 model (betas 0.9/0.95, eps 1e-8,
    /// weight decay 0.1, --lr): on the params themselves, moments in the param dtype, no f32
    /// master weights; still placed in the backward by the `optimizer` pass.
    #[arg(long)]
    pub torch_adamw: bool,
    #[command(flatten)]
    pub train: super::train::TrainArgs,
}

/// The program and plan to run, with the weights and inputs.
pub struct Prepared {
    pub program: Graph,
    pub plan: ExecutionPlan,
    pub training: bool,
    pub host_weights: Option<BTreeMap<String, HostTensor>>,
    pub batch: i64,
    pub seq: i64,
    /// The embedding's rows, where the program has an embedding: token ids must be below.
    pub vocab: Option<i64>,
    pub compile_s: f64,
    pub notes: Vec<String>,
    /// The model's parameter count, where the model is known.
    pub params: Option<u64>,
    /// The update each step applies, in words.
    pub optimizer: String,
}

/// The optimizer of a training step in words (for the run header).
fn optimizer_text(t: Option<&weft_passes::training::TrainOptions>) -> String {
    use weft_passes::training::Optimizer;
    let Some(t) = t else {
        return "optimizer: none (forward only)".into();
    };
    let master = if t.master_weights {
        "f32 master weights"
    } else {
        "in the parameters' dtype"
    };
    let opt = match &t.optimizer {
        Some(Optimizer::AdamW {
            lr,
            beta1,
            beta2,
            weight_decay,
            ..
        }) => format!(
            "AdamW lr {} betas {}/{} weight decay {} ({master})",
            lr.0, beta1.0, beta2.0, weight_decay.0
        ),
        Some(Optimizer::Sgd { lr, .. }) => format!("SGD lr {} ({master})", lr.0),
        None => "none (gradients only)".into(),
    };
    format!("optimizer: {opt}; {}", t.summary())
}

/// The model's vocabulary (the range drawn token ids cover): the embedding's rows, or,
/// where the program holds a vocab-parallel slice of them, the whole table's rows from
/// the parameter's partition.
fn vocab_of(g: &Graph) -> Option<i64> {
    g.nodes().iter().find_map(|&n| match g.node(n).op {
        Op::Embedding { .. } => {
            let mut w = g.node(n).operands[1];
            let local = g.ty(w).shape[0].as_const()?;
            // Back through what a rank does to its slice before the lookup (a cast, a
            // ZeRO-3 gather of its rows) to the parameter itself.
            for _ in 0..8 {
                match g.op_of(w) {
                    Op::Param { name, .. } => {
                        let full = g
                            .param_partition(name)
                            .iter()
                            .find(|p| p.dim == 0)
                            .map(|p| p.full_size());
                        return Some(full.unwrap_or(local));
                    }
                    _ => match g.node(g.def(w)).operands.first() {
                        Some(&x) => w = x,
                        None => break,
                    },
                }
            }
            Some(local)
        }
        _ => None,
    })
}

pub fn prepare(a: &Args) -> CliResult<Prepared> {
    let t0 = std::time::Instant::now();
    let mut notes = Vec::new();
    // A plan given as MODEL runs as is.
    if let Some(plan) = super::session::read_plan(&a.model)? {
        let program = weft_ir::parse(&plan.program)
            .map_err(|e| CliError::input(format!("the program of plan {}: {e}", a.model)))?;
        let training = plan.step_kind() == weft_ir::plan::StepKind::Training;
        let (b, s) = (
            plan.bindings.get("B").copied().unwrap_or(1),
            plan.bindings.get("S").copied().unwrap_or(1),
        );
        let vocab = vocab_of(&program);
        let host_weights = match &a.weights {
            Some(w) if !plan.source.is_empty() => {
                let model = super::load_model(&plan.source)?;
                Some(weft_frontends::load_weights(&model, w).map_err(super::frontend_err)?)
            }
            _ => None,
        };
        let params = if plan.source.is_empty() {
            None
        } else {
            super::load_model(&plan.source)
                .ok()
                .map(|m| m.param_count())
        };
        let optimizer = if training {
            "optimizer: as compiled into the plan".to_string()
        } else {
            optimizer_text(None)
        };
        return Ok(Prepared {
            program,
            plan,
            training,
            host_weights,
            batch: b,
            seq: s,
            vocab,
            compile_s: t0.elapsed().as_secs_f64(),
            notes,
            params,
            optimizer,
        });
    }
    let mesh = super::parse_mesh(&a.mesh)?;
    let model = super::load_model(&a.model)?;
    // --inputs fixes the batch and sequence length.
    let given: Option<(i64, i64)> = match &a.inputs {
        Some(p) => {
            let t = super::session::read_inputs(p)?;
            let shape = &t["input_ids"].shape;
            for (flag, given, have) in [("--batch", a.batch, shape[0]), ("--seq", a.seq, shape[1])]
            {
                if let Some(g) = given.filter(|&g| g != have as i64) {
                    return Err(CliError::input(format!(
                        "{flag} {g} differs from --inputs {}, whose input_ids are {shape:?}",
                        p.display()
                    ))
                    .with_help(format!(
                        "drop {flag} (the inputs fix it) or give inputs of that size"
                    )));
                }
            }
            Some((shape[0] as i64, shape[1] as i64))
        }
        None => None,
    };
    let (db, ds) = weft_passes::driver::default_run_sizes(&mesh);
    let batch = a.batch.or(given.map(|x| x.0)).unwrap_or(db);
    let seq = a.seq.or(given.map(|x| x.1)).unwrap_or(ds);
    let mut req = super::request(&model, &mesh, None, &a.model)?;
    weft_passes::bindings::check_batch_seq(Some(batch), Some(seq)).map_err(CliError::input)?;
    req.batch = Some(batch);
    req.seq = Some(seq);
    req.plan = true;
    req.dtype = super::compile::parse_dtype(Some(&a.dtype), "--dtype")?;
    req.fuse = a.train.fuse();
    req.cp_kv = a.train.cp_kv()?;
    req.model = super::graph_in_dtype(&model, req.dtype)?;
    let (profile, memory) = device_to_plan_for(&a);
    (req.device, req.device_memory) = super::device(&profile, memory)?;
    req.host_memory = match a.host_memory {
        None if a.backend == "cuda" => pinnable_host_bytes(),
        given => super::gib_limit("--host-memory", given)?,
    };
    if a.forward_only {
        a.train.refuse_for_forward_only()?;
    } else {
        let mut t = a.train.request("adamw")?;
        weft_passes::micro_batches::check_micro_batches(
            t.options.micro_batches,
            Some(batch),
            &mesh,
        )
        .map_err(CliError::input)?;
        // Only --check compares gradients (and logits); a training run lets each
        // gradient die once its bucket has updated the weights.
        t.options.grad_outputs = a.check > 0 || a.grads_out.is_some();
        if a.torch_adamw {
            // torch.optim.AdamW(fused=True) on the bf16 model, as bench/torch_llama_step.py
            // runs it, placed in the backward by the `optimizer` pass: each gradient dies
            // at its update instead of living to the end of the step.
            t.options.optimizer = Some(weft_passes::training::Optimizer::AdamW {
                lr: weft_ir::Float(a.train.lr),
                beta1: weft_ir::Float(0.9),
                beta2: weft_ir::Float(0.95),
                eps: weft_ir::Float(1e-8),
                weight_decay: weft_ir::Float(0.1),
            });
            t.options.master_weights = false;
        }
        req.train = Some(t);
    }
    if model.param_count() > 100_000_000 {
        eprintln!(
            "compiling the {} of {} for B={batch} S={seq} ...",
            req.step_kind().name(),
            model.name
        );
    }
    let c = weft_passes::driver::compile(&req, &mut std::io::sink()).map_err(super::driver_err)?;
    if let Some(ch) = &c.choice {
        notes.push(format!("chose {} ({})", ch.chosen, ch.why));
    }
    let plan = c.plan.expect("the request asks for a plan");
    let optimizer = optimizer_text(c.train.as_ref());
    let g = c.program;
    let training = c.kind == weft_ir::plan::StepKind::Training;
    let checkpoint = a
        .weights
        .clone()
        .or_else(|| model.dir().and_then(super::session::find_checkpoint));
    // Host weights of a real model take a while and many GiB: say so before.
    let host_weights = match checkpoint {
        Some(w) => Some(super::session::load_weights(&model, &w)?),
        None if (a.backend == "cpu" && a.steps > 0) || a.check > 0 => {
            super::session::check_host_memory(&model)?;
            Some(super::session::draw_random_weights(&model, a.seed))
        }
        None => None,
    };
    let vocab = vocab_of(&g);
    Ok(Prepared {
        program: g,
        plan,
        training,
        host_weights,
        batch,
        seq,
        vocab,
        compile_s: t0.elapsed().as_secs_f64(),
        notes,
        params: Some(model.param_count()),
        optimizer,
    })
}

/// The inputs of step `step`: `--inputs`, the next tokens of `--data`, or drawn.
pub struct Feeder {
    /// Where the inputs come from, for errors.
    source: String,
    fixed: Option<BTreeMap<String, HostTensor>>,
    data: Option<Vec<u16>>,
    /// The `--data` file, named once when a run reads past its end and wraps around.
    data_path: Option<PathBuf>,
    wrapped: bool,
    at: usize,
    batch: usize,
    seq: usize,
    vocab: i64,
    seed: u64,
}

impl Feeder {
    pub fn new(a: &Args, batch: i64, seq: i64, vocab: Option<i64>) -> CliResult<Feeder> {
        let fixed = match &a.inputs {
            Some(p) => Some(super::session::read_inputs(p)?),
            None => None,
        };
        let data = match &a.data {
            Some(p) => {
                let b = weft_ir::files::read(p).map_err(|e| {
                    CliError::input(format!("cannot read --data {}: {e}", p.display()))
                })?;
                if b.len() % 2 != 0 {
                    return Err(CliError::input(format!(
                        "--data {}: {} bytes is not a whole number of uint16 tokens",
                        p.display(),
                        b.len()
                    ))
                    .with_help("a token file is flat little-endian uint16 (2 bytes per token)"));
                }
                let toks: Vec<u16> = b
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect();
                // Checked here, once, rather than by the step that first reads a bad
                // token (perhaps hours into a run).
                if let Some(v) = vocab {
                    if let Some((i, &t)) = toks.iter().enumerate().find(|(_, &t)| i64::from(t) >= v)
                    {
                        return Err(CliError::input(format!(
                            "--data {}: token {i} (byte {}) is {t}, not below the model's vocabulary size {v}",
                            p.display(),
                            2 * i
                        ))
                        .with_help("the token file must come from this model's tokenizer"));
                    }
                }
                if toks.len() < (batch * seq) as usize {
                    return Err(CliError::input(format!(
                        "--data {} holds {} tokens, fewer than one batch ({})",
                        p.display(),
                        toks.len(),
                        batch * seq
                    )));
                }
                Some(toks)
            }
            None => None,
        };
        let source = match (&a.inputs, &a.data) {
            (Some(p), _) => format!("--inputs {}", p.display()),
            (None, Some(p)) => format!("--data {}", p.display()),
            (None, None) => format!("the drawn inputs (seed {})", a.seed),
        };
        Ok(Feeder {
            source,
            fixed,
            data,
            data_path: a.data.clone(),
            wrapped: false,
            at: 0,
            batch: batch as usize,
            seq: seq as usize,
            vocab: vocab.unwrap_or(2),
            seed: a.seed,
        })
    }

    /// The inputs of step `step` that `g` takes, refused where every label is ignored.
    pub fn next_for(&mut self, g: &Graph, step: usize) -> CliResult<BTreeMap<String, HostTensor>> {
        let all = self.next(step);
        let source = format!("{}, step {step}", self.source);
        super::session::check_extra_inputs(g, &all, &source, &[weft_ir::role::STEP_NAME, "step"])?;
        super::session::check_labels(g, &all, &source)?;
        Ok(inputs_for(g, &all))
    }

    pub fn next(&mut self, step: usize) -> BTreeMap<String, HostTensor> {
        let mut m = if let Some(f) = &self.fixed {
            f.clone()
        } else if let Some(d) = &self.data {
            let n = self.batch * self.seq;
            if self.at + n > d.len() {
                if !self.wrapped {
                    eprintln!(
                        "note: step {} wraps around to the start of --data {} ({} tokens, {n} per step)",
                        step + 1,
                        self.data_path.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                        d.len()
                    );
                    self.wrapped = true;
                }
                self.at = 0;
            }
            let ids: Vec<i64> = d[self.at..self.at + n].iter().map(|&t| t as i64).collect();
            self.at += n;
            let mut m = BTreeMap::new();
            m.insert(
                "input_ids".to_string(),
                HostTensor::ints(DType::I64, vec![self.batch, self.seq], ids.clone()),
            );
            m.insert(
                "labels".to_string(),
                HostTensor::ints(DType::I64, vec![self.batch, self.seq], ids),
            );
            m
        } else {
            draw_inputs(
                self.vocab,
                self.batch,
                self.seq,
                self.seed.wrapping_add(step as u64),
            )
        };
        // The optimizer's 1-based step counter, where the program takes it as an input.
        m.insert(
            weft_ir::role::STEP_NAME.into(),
            HostTensor::floats(DType::F32, vec![], vec![(step + 1) as f64]),
        );
        m.insert(
            "step".into(),
            HostTensor::floats(DType::F32, vec![], vec![(step + 1) as f64]),
        );
        m
    }
}

/// The program's checkpoint-buffer inputs (`Role::Buffer`): from `weights` where given,
/// else zeros.
#[cfg(feature = "cuda")]
pub fn buffer_inputs(
    g: &Graph,
    weights: Option<&BTreeMap<String, HostTensor>>,
) -> BTreeMap<String, HostTensor> {
    g.inputs()
        .into_iter()
        .filter(|(_, role, _)| *role == weft_ir::Role::Buffer)
        .map(|(n, _, v)| {
            let t = weights.and_then(|w| w.get(&n)).cloned().unwrap_or_else(|| {
                let shape: Vec<usize> = g
                    .ty(v)
                    .shape
                    .iter()
                    .map(|d| d.as_const().unwrap_or(0).max(0) as usize)
                    .collect();
                let len = shape.iter().product();
                HostTensor::floats(g.ty(v).dtype, shape, vec![0.0; len])
            });
            (n, t)
        })
        .collect()
}

/// Only the inputs the program has.
pub fn inputs_for(g: &Graph, all: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    g.inputs()
        .into_iter()
        .filter_map(|(n, _, _)| all.get(&n).map(|t| (n, t.clone())))
        .collect()
}

#[derive(serde::Serialize, Clone, Debug)]
pub struct StepReport {
    /// 1-based, as the text prints it.
    pub step: usize,
    pub loss: f64,
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation against --peak-tflops (GPU backends only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_loss: Option<f64>,
    /// The MoE load-balancing loss (unweighted), where the model has one (`loss` includes
    /// `router_aux_loss_coef` times it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
}

/// The CPU reference run of `g` for `steps` steps, feeding each step's updated params
/// and state back (see `fed_back_param`), handing each step's result and wall time to
/// `on_step` as it finishes (so a long run reports as it goes and holds one step's
/// outputs at a time).
pub fn cpu_steps(
    g: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    feeder: &mut Feeder,
    steps: usize,
    (b, s): (i64, i64),
    precision: weft_runtime::cpu::Precision,
    on_step: &mut dyn FnMut(weft_runtime::cpu::RunResult, f64) -> CliResult,
) -> CliResult {
    let mut w = weights.clone();
    // Optimizer state: zero moments, master weights copied from the params (full
    // tensors, also for states sharded over dp); anything else missing starts at zero.
    w.extend(
        weft_passes::optimizer::initial_state(g, &w)
            .map_err(|m| CliError::input(format!("optimizer state: {m}")))?,
    );
    for (name, v) in g.params() {
        if !w.contains_key(&name) {
            let ty = g.ty(v);
            let shape: Vec<usize> = ty
                .shape
                .iter()
                .map(|d| d.as_const().unwrap_or(0) as usize)
                .collect();
            let n = shape.iter().product();
            w.insert(name, HostTensor::floats(ty.dtype, shape, vec![0.0; n]));
        }
    }
    for step in 0..steps {
        let spin =
            crate::progress::spinner(&format!("step {}/{steps} on the CPU reference", step + 1));
        let t = std::time::Instant::now();
        let inputs = feeder.next_for(g, step)?;
        let opts = weft_runtime::cpu::RunOptions::new(precision)
            .bind("B", b)
            .bind("S", s);
        let r = weft_runtime::cpu::run(g, &w, &inputs, &opts)
            .map_err(|e| CliError::input(format!("CPU reference, step {step}: {e}")))?;
        for (name, t) in &r.outputs {
            if let Some(p) = weft_ir::plan::fed_back_param(name, |n| w.contains_key(n)) {
                w.insert(p.to_string(), t.clone());
            }
        }
        let dt = t.elapsed().as_secs_f64();
        spin.finish_and_clear();
        on_step(r, dt)?;
    }
    Ok(())
}

pub fn run(a: Args) -> CliResult {
    if !(a.peak_tflops.is_finite() && a.peak_tflops > 0.0) {
        return Err(CliError::input(format!(
            "invalid --peak-tflops {}: must be a positive number (the device's peak, for MFU)",
            a.peak_tflops
        )));
    }
    if let Some(t) = a.tolerance {
        // NaN would fail every comparison (`rel 1e-6 > NaN`), as would a negative one;
        // an infinite one would pass every comparison.
        if !(t.is_finite() && t >= 0.0) {
            return Err(CliError::input(format!(
                "invalid --tolerance {t}: must be a non-negative relative tolerance (e.g. 1e-3)"
            )));
        }
    }
    if a.check > 0 && a.backend == "cpu" {
        return Err(CliError::input(
            "--check compares a GPU run with the CPU reference, but --backend is cpu (nothing to compare)",
        )
        .with_help("use --backend cuda with --check, or drop --check"));
    }
    if a.profile_out.is_some() && (a.backend != "cuda" || a.steps == 0) {
        return Err(CliError::input(
            "--profile-out times the GPU's instructions, but this run executes none on a GPU",
        )
        .with_help("use it with --backend cuda and --steps 1 or more"));
    }
    if let Some(path) = &a.grads_out {
        if a.steps == 0 {
            return Err(CliError::input(format!(
                "--grads-out {} writes the first step's gradients, but --steps 0 runs none",
                path.display()
            ))
            .with_help("use --steps 1 or more"));
        }
        if a.forward_only {
            return Err(CliError::input(
                "--grads-out writes gradients, but --forward-only runs no backward",
            ));
        }
    }
    for out in [&a.plan_out, &a.profile_out, &a.grads_out]
        .into_iter()
        .flatten()
    {
        let mut inputs = vec![("MODEL", Path::new(&a.model))];
        let named = [
            ("--weights", &a.weights),
            ("--inputs", &a.inputs),
            ("--data", &a.data),
        ];
        for (what, p) in named {
            inputs.extend(p.as_deref().map(|p| (what, p)));
        }
        inputs.extend(
            a.device
                .as_deref()
                .and_then(super::device_file)
                .map(|p| ("--device", p)),
        );
        super::refuse_overwrite(out, &inputs)?;
    }
    if a.steps == 0 && a.check == 0 {
        return plan_only(&a);
    }
    match a.backend.as_str() {
        "cpu" => run_cpu(&a),
        "cuda" => run_cuda(&a),
        b => Err(CliError::input(format!("unknown --backend `{b}`")).with_help("use cpu or cuda")),
    }
}

/// Why `--grads-out` cannot write the step's gradients, if it cannot: before any step runs.
fn check_grads_out(a: &Args, p: &Prepared) -> CliResult {
    let Some(path) = &a.grads_out else {
        return Ok(());
    };
    let refuse = |why: String| CliError::input(format!("--grads-out {}: {why}", path.display()));
    if !p.training {
        return Err(refuse(
            "this program is a forward step; it has no gradients".into(),
        ));
    }
    let ranks = p.plan.mesh.world_size();
    if ranks > 1 {
        return Err(refuse(format!(
            "the mesh has {ranks} ranks, whose gradients are sharded; it writes one rank's full gradients"
        ))
        .with_help("run it with a one-rank mesh (no --mesh)"));
    }
    if grad_outputs(&p.program).is_empty() {
        return Err(refuse(format!(
            "the program of {} returns no gradients (a plan keeps the outputs it was compiled with)",
            a.model
        ))
        .with_help("give the model instead of a plan, so run compiles the step with its gradients as outputs"));
    }
    Ok(())
}

/// The program's gradient outputs (`grad.<param>`).
fn grad_outputs(g: &Graph) -> Vec<String> {
    g.outputs()
        .iter()
        .filter(|(name, _)| is_grad(name))
        .map(|(name, _)| name.clone())
        .collect()
}

fn is_grad(name: &str) -> bool {
    weft_ir::ValueRole::of(name) == Some(weft_ir::ValueRole::Grad)
}

/// `--grads-out`: the first step's `grad.<param>` outputs, as f32 safetensors.
fn write_grads(a: &Args, outputs: &BTreeMap<String, HostTensor>) -> CliResult {
    let Some(path) = &a.grads_out else {
        return Ok(());
    };
    let grads: Vec<_> = outputs.iter().filter(|(name, _)| is_grad(name)).collect();
    let count = grads.len();
    weft_frontends::save_safetensors(path, grads).map_err(super::frontend_err)?;
    eprintln!(
        "wrote the first step's gradients of {count} parameters to {}",
        path.display()
    );
    Ok(())
}

/// `--plan-out`: the plan that runs.
fn write_plan(a: &Args, p: &Prepared) -> CliResult {
    if let Some(path) = &a.plan_out {
        super::write_out(Some(path), &p.plan.to_json())?;
    }
    Ok(())
}

/// `--steps 0`: compile the step the flags describe, write it with `--plan-out`, and say
/// what the plan predicts; nothing runs and no weights are made.
fn plan_only(a: &Args) -> CliResult {
    let p = prepare(a)?;
    for n in &p.notes {
        eprintln!("note: {n}");
    }
    write_plan(a, &p)?;
    let m = &p.plan.memory;
    let gib = |x: u64| x as f64 / (1u64 << 30) as f64;
    let bindings = weft_passes::memory::bindings(
        &p.program,
        &weft_passes::training::TrainOptions {
            batch: Some(p.batch),
            seq: Some(p.seq),
            ..Default::default()
        },
    );
    // What `--checkpoint budget=` bounds.
    let live = weft_passes::memory::estimate(&p.program, &bindings).peak_live;
    println!(
        "plan ({}) for B={} S={}: peak {:.2} GiB (arena {:.2} + resident {:.2}; host {:.2}), {} {:.3} ms predicted; live-value estimate {:.2} GB; --steps 0: nothing ran",
        p.plan.step_kind().name(),
        p.batch,
        p.seq,
        gib(m.peak_bytes),
        gib(m.arena_bytes),
        gib(m.resident_bytes),
        gib(m.host_bytes),
        p.plan.step_kind().time_name(),
        p.plan.cost.step_time_s * 1e3,
        live as f64 / 1e9
    );
    Ok(())
}

/// What runs: model, parameters, sizes, where the tokens come from, the optimizer.
fn print_header(a: &Args, p: &Prepared) {
    let data = match (&a.inputs, &a.data) {
        (Some(f), _) => format!("--inputs {} (the same batch every step)", f.display()),
        (None, Some(f)) => format!("--data {} (the next B*S tokens each step)", f.display()),
        (None, None) => format!(
            "random tokens (seed {}, fresh each step: nothing to learn, the loss stays flat; give --inputs or --data)",
            a.seed
        ),
    };
    let text = format!(
        "{} ({} parameters) on {} ({}), mesh {}, B={} S={}\n  data: {data}\n  {}\n",
        p.plan.model,
        p.params
            .map(super::models::group_digits)
            .unwrap_or_else(|| "?".into()),
        a.backend,
        if p.training {
            "training step"
        } else {
            "forward only"
        },
        super::mesh_text(&p.plan.mesh),
        p.batch,
        p.seq,
        p.optimizer
    );
    if a.json {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
}

fn print_step(a: &Args, r: &StepReport) {
    if !a.json {
        let refl = r
            .reference_loss
            .map(|l| format!("  (cpu {l:.6})"))
            .unwrap_or_default();
        let mfu = r
            .mfu
            .map(|m| format!("  MFU {:>5.1}%", m * 100.0))
            .unwrap_or_default();
        let aux = r
            .aux_loss
            .map(|l| format!("  (aux {l:.6})"))
            .unwrap_or_default();
        println!(
            "step {:>4}  loss {:>10.6}{refl}{aux}  {:>9.2} ms  {:>10.0} tok/s{mfu}",
            r.step,
            r.loss,
            r.step_s * 1e3,
            r.tokens_per_s,
        );
    }
}

fn run_cpu(a: &Args) -> CliResult {
    let p = prepare(a)?;
    check_grads_out(a, &p)?;
    for n in &p.notes {
        eprintln!("note: {n}");
    }
    print_header(a, &p);
    let weights = p.host_weights.clone().ok_or_else(|| {
        CliError::input(format!(
            "the cpu backend needs host weights to run {}",
            a.model
        ))
        .with_help("give --weights FILE (a plan records its model, not its weights)")
    })?;
    super::session::check_run_memory(&p.program, p.batch, p.seq, true)?;
    let mut feeder = Feeder::new(a, p.batch, p.seq, p.vocab)?;
    let tokens = (p.batch * p.seq) as f64;
    let mut reports: Vec<StepReport> = Vec::new();
    let mut on_step = |r: weft_runtime::cpu::RunResult, dt: f64| {
        if reports.is_empty() {
            write_grads(a, &r.outputs)?;
        }
        let loss = r
            .outputs
            .get("loss")
            .map(|t| t.to_f64()[0])
            .unwrap_or(f64::NAN);
        let rep = StepReport {
            step: reports.len() + 1,
            loss,
            step_s: dt,
            tokens_per_s: tokens / dt,
            mfu: None,
            reference_loss: None,
            aux_loss: r.outputs.get("aux_loss").map(|t| t.to_f64()[0]),
        };
        print_step(a, &rep);
        reports.push(rep);
        Ok(())
    };
    cpu_steps(
        &p.program,
        &weights,
        &mut feeder,
        a.steps,
        (p.batch, p.seq),
        weft_runtime::cpu::Precision::F32,
        &mut on_step,
    )?;
    if a.json {
        let mean_s = reports.iter().map(|r| r.step_s).sum::<f64>() / reports.len().max(1) as f64;
        print!(
            "{}",
            super::json(&serde_json::json!({
                "backend": "cpu",
                "model": p.plan.model,
                "training": p.training,
                "batch": p.batch,
                "seq": p.seq,
                "params": p.params,
                "optimizer": p.optimizer,
                "compile_s": p.compile_s,
                "mean_step_s": mean_s,
                "tokens_per_s": tokens / mean_s,
                "steps": reports,
                "notes": p.notes,
            }))
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &Args) -> CliResult {
    Err(
        CliError::input("this weft was built without the CUDA backend")
            .with_help("rebuild with `cargo build --release --features cuda`"),
    )
}

/// One row per profiled instruction: what the plan predicted for it beside what it took.
#[cfg(feature = "cuda")]
fn write_instruction_profile(
    path: &std::path::Path,
    plan: &ExecutionPlan,
    rows: &[(u32, f64)],
) -> CliResult {
    let mut out = String::from("index\top\tsource\tpredicted_ms\tmeasured_ms\n");
    for &(i, ms) in rows {
        let ins = &plan.instructions[i as usize];
        let source = ins
            .source
            .as_deref()
            .unwrap_or("-")
            .replace(['\t', '\n'], " ");
        out.push_str(&format!(
            "{i}\t{}\t{source}\t{:.4}\t{ms:.4}\n",
            ins.op,
            ins.time_s * 1e3
        ));
    }
    super::write_out(Some(path), &out)
}

#[cfg(feature = "cuda")]
fn run_cuda(a: &Args) -> CliResult {
    use weft_runtime::cuda::{ExecOptions, Executor};
    let cuda_err = |e: weft_runtime::cuda::CudaError| CliError::input(format!("CUDA backend: {e}"));
    // Fail fast, before compiling, when there is no GPU or no CUDA library.
    weft_runtime::cuda::probe(0).map_err(cuda_err)?;
    let p = prepare(a)?;
    for n in &p.notes {
        eprintln!("note: {n}");
    }
    check_grads_out(a, &p)?;
    print_header(a, &p);
    write_plan(a, &p)?;
    let mut opts = ExecOptions::from_env();
    if a.profile_out.is_some() {
        opts.tuning.profile = true;
    }
    if a.generic_attention {
        opts.fast_attention = false;
    }
    let t_load = std::time::Instant::now();
    let mut ex = Executor::new(&p.plan, &opts).map_err(cuda_err)?;
    match &p.host_weights {
        Some(w) => ex.load_params(w).map_err(cuda_err)?,
        None => ex.init_params_random(a.seed, 0.02).map_err(cuda_err)?,
    }
    let load_s = t_load.elapsed().as_secs_f64();
    let mut feeder = Feeder::new(a, p.batch, p.seq, p.vocab)?;
    let reference = if a.check > 0 {
        let w = p.host_weights.as_ref().ok_or_else(|| {
            CliError::input("--check needs host weights")
                .with_help("give --weights FILE (a plan records its model, not its weights)")
        })?;
        let mut f2 = Feeder::new(a, p.batch, p.seq, p.vocab)?;
        use weft_runtime::cpu::Precision::F32;
        let steps = a.check.min(a.steps.max(1));
        let mut runs = Vec::new();
        let shape = (p.batch, p.seq);
        cpu_steps(&p.program, w, &mut f2, steps, shape, F32, &mut |r, _| {
            runs.push(r);
            Ok(())
        })?;
        Some(runs)
    } else {
        None
    };
    let tokens = (p.batch * p.seq) as f64;
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    let bf16 = p
        .program
        .params()
        .iter()
        .any(|(_, v)| p.program.ty(*v).dtype == DType::BF16);
    // FP8 rounding is discontinuous: a difference of one part in 1e4 upstream (the GPU's
    // FP8 tensor cores accumulate in less than f32) moves an operand element across a
    // rounding boundary now and then, and each such element moves by a whole FP8 step
    // (6-25%), so FP8 programs get a wider default.
    let fp8 = p
        .program
        .nodes()
        .iter()
        .any(|&n| matches!(p.program.node(n).op, weft_ir::Op::Fp8Matmul { .. }));
    let tol = a.tolerance.unwrap_or(match (bf16, fp8) {
        (true, true) => 1.5e-1,
        (false, true) => 2e-2,
        (true, false) => 3e-2,
        (false, false) => 1e-3,
    });
    // Checkpoint buffers (deepseek_v3's correction bias) are inputs the device needs every
    // step: from the host weights, else zero as HF initialises them.
    let buffers = buffer_inputs(&p.program, p.host_weights.as_ref());
    for step in 0..a.steps {
        let mut inputs = feeder.next_for(&p.program, step)?;
        inputs.extend(buffers.clone());
        ex.set_inputs(&inputs).map_err(cuda_err)?;
        let t = ex.run_step().map_err(cuda_err)?;
        let loss = ex.output("loss").map(|t| t.to_f64()[0]).unwrap_or(f64::NAN);
        let dt = t.device_s;
        let reference_loss = reference
            .as_ref()
            .and_then(|r| r.get(step))
            .and_then(|r| r.outputs.get("loss"))
            .map(|t| t.to_f64()[0]);
        if let Some(rl) = reference_loss {
            let e = (loss - rl).abs() / rl.abs().max(1e-6);
            if !(e <= tol) {
                failures.push(format!(
                    "step {}: loss {loss} vs cpu {rl} (rel {e:.2e} > {tol:.0e})",
                    step + 1
                ));
            }
        }
        if step == 0 && (a.grads_out.is_some() || reference.is_some()) {
            // The first step's gradients, copied from the device once for both uses.
            let mut got = BTreeMap::new();
            for name in grad_outputs(&p.program) {
                let t = ex.output(&name).map_err(cuda_err)?;
                got.insert(name, t);
            }
            write_grads(a, &got)?;
            if let Some(r) = reference.as_ref().and_then(|r| r.first()) {
                // The gradients as one set: one that is zero in theory is held to a floor
                // tied to the largest gradient (weft_ir::tensor::NOISE_FLOOR).
                let want: BTreeMap<String, HostTensor> = r
                    .outputs
                    .iter()
                    .filter(|(name, _)| is_grad(name))
                    .map(|(n, t)| (n.clone(), t.clone()))
                    .collect();
                use weft_ir::tensor::{set_rel_errs, Measure};
                for e in set_rel_errs(&got, &want, Measure::L2) {
                    if !(e.err <= tol) {
                        failures.push(format!(
                            "step 1: {} differs from the cpu reference (rel {:.2e} > {tol:.0e}{})",
                            e.name,
                            e.err,
                            if e.noise_level {
                                ", against the noise floor"
                            } else {
                                ""
                            }
                        ));
                    }
                }
            }
        }
        let rep = StepReport {
            step: step + 1,
            loss,
            step_s: dt,
            tokens_per_s: tokens / dt,
            mfu: Some(p.plan.cost.flops / (dt * a.peak_tflops * 1e12)),
            reference_loss,
            aux_loss: ex.output("aux_loss").ok().map(|t| t.to_f64()[0]),
        };
        print_step(a, &rep);
        reports.push(rep);
    }
    if let Some(prof) = &ex.profile {
        let mut rows: Vec<_> = prof.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        eprintln!("profile of the last step (device ms by op, {total:.2} ms in all):");
        for (k, (n, ms)) in rows.iter() {
            eprintln!(
                "  {ms:>9.3} ms {:>5.1}%  {n:>5}x  {k}",
                100.0 * ms / total.max(1e-9)
            );
        }
    }
    if let Some(path) = &a.profile_out {
        write_instruction_profile(path, &p.plan, &ex.profile_instructions)?;
    }
    let mem = ex.memory();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // The first step fills the caches; with a CUDA graph the second also captures it.
    let warmup = if ex.replays_cuda_graph() && reports.len() > 3 {
        2
    } else if reports.len() > 2 {
        1
    } else {
        0
    };
    let steady: Vec<&StepReport> = reports.iter().skip(warmup).collect();
    let graph_note = match ex.cuda_graph_refusal() {
        None if ex.replays_cuda_graph() => "steps replay one CUDA graph".to_string(),
        None => "launched per kernel".to_string(),
        Some(why) => format!("launched per kernel (no CUDA graph: {why})"),
    };
    let mean_s = steady.iter().map(|r| r.step_s).sum::<f64>() / steady.len().max(1) as f64;
    if a.json {
        print!(
            "{}",
            super::json(&serde_json::json!({
                "backend": "cuda",
                "model": p.plan.model,
                "training": p.training,
                "batch": p.batch,
                "seq": p.seq,
                "params": p.params,
                "optimizer": p.optimizer,
                "device": ex.load.device,
                "load": ex.load,
                "cuda_graph": ex.replays_cuda_graph(),
                "cuda_graph_refusal": ex.cuda_graph_refusal(),
                "load_s": load_s,
                "compile_s": p.compile_s,
                "predicted_step_s": p.plan.cost.step_time_s,
                "memory": mem,
                "mean_step_s": mean_s,
                "tokens_per_s": tokens / mean_s,
                "steps": reports,
                "check_failures": failures,
                "notes": p.notes,
            }))
        );
    } else {
        println!(
            "{} on {}: {} program, B={} S={}, {} launches/step, {graph_note}; compile {:.2}s, kernels {:.2}s ({}), load {:.2}s",
            p.plan.model,
            ex.load.device,
            if p.training { "training" } else { "forward" },
            p.batch,
            p.seq,
            ex.load.launches_per_step,
            p.compile_s,
            ex.load.kernel_compile_s,
            if ex.load.kernel_cache_hit { "cached" } else { "compiled" },
            load_s
        );
        println!(
            "mean step {:.2} ms ({:.2} ms predicted, measured/predicted {:.2}), {:.0} tok/s; memory: planned peak {:.2} GiB (arena {:.2} + resident {:.2}), measured {:.2} GiB (runtime extra {:.2} GiB); nccl: {}",
            mean_s * 1e3,
            p.plan.cost.step_time_s * 1e3,
            mean_s / p.plan.cost.step_time_s.max(1e-12),
            tokens / mean_s,
            gib(mem.planned_peak_bytes),
            gib(mem.planned_arena_bytes),
            gib(mem.planned_resident_bytes),
            gib(mem.measured_peak_bytes),
            gib(mem.runtime_extra_bytes),
            ex.load.nccl
        );
        let (tuned, changed, tune_s) = ex.load.gemm_tuned;
        if tuned > 0 {
            println!(
                "gemm tuning: {tuned} shapes timed over cuBLASLt's candidates in the first step ({tune_s:.2}s), {changed} took another than the heuristic's first"
            );
        }
    }
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("check failed: {f}");
        }
        return Err(CliError::failed(format!(
            "{} check(s) against the CPU reference failed",
            failures.len()
        )));
    }
    if reference.is_some() && !a.json {
        println!(
            "check: losses{} match the CPU reference within {tol:.0e}",
            if p.training {
                " and first-step gradients"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// The device profile and memory a run plans for: what the user named, else (for
/// `--backend cuda`) the GPU this process will run on, so that a run on an H100 is not
/// planned against an H200's 139 GiB; h200 where nothing is named or found.
fn device_to_plan_for(a: &Args) -> (String, Option<f64>) {
    if let Some(d) = &a.device {
        return (d.clone(), a.device_memory);
    }
    #[cfg(feature = "cuda")]
    if a.backend == "cuda" {
        let ordinal = std::env::var("LOCAL_RANK")
            .ok()
            .and_then(|r| r.parse::<usize>().ok())
            .unwrap_or(0);
        if let Ok(info) = weft_runtime::cuda::probe::probe(ordinal) {
            let profile = profile_of_gpu(&info.name).unwrap_or("h200");
            let found = info.total_memory as f64 / (1u64 << 30) as f64;
            let memory = a.device_memory.or_else(|| {
                weft_passes::plan::profile::load(profile)
                    .ok()
                    .map(|p| p.memory_gib.min(found))
            });
            eprintln!(
                "planning for {profile} ({}, {found:.1} GiB found; --device names another profile)",
                info.name
            );
            return (profile.to_string(), memory);
        }
    }
    ("h200".to_string(), a.device_memory)
}

/// What this process may pin for a CUDA run: 90% of the machine's available memory
/// (`MemAvailable` in /proc/meminfo), shared by the node's ranks (`LOCAL_WORLD_SIZE`);
/// `None` where it cannot be read.
fn pinnable_host_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    let ranks = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    Some(kib.saturating_mul(1024) / 10 * 9 / ranks)
}

/// The built-in profile of a GPU by its name, where there is one.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn profile_of_gpu(name: &str) -> Option<&'static str> {
    let n = name.to_ascii_uppercase();
    ["H200", "H100", "A100"]
        .into_iter()
        .find(|g| n.contains(g))
        .map(|g| match g {
            "H200" => "h200",
            "H100" => "h100",
            _ => "a100",
        })
}

#[cfg(test)]
mod device_tests {
    use super::profile_of_gpu;

    #[test]
    fn gpus_map_to_their_profiles() {
        assert_eq!(profile_of_gpu("NVIDIA H100 80GB HBM3"), Some("h100"));
        assert_eq!(profile_of_gpu("NVIDIA H200"), Some("h200"));
        assert_eq!(profile_of_gpu("NVIDIA A100-SXM4-80GB"), Some("a100"));
        assert_eq!(profile_of_gpu("NVIDIA L40S"), None);
    }
}

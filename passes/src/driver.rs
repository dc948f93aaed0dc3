//! The compile driver: one function every CLI verb calls to turn a model into the
//! program (and plan) it runs.
//!
//! A [`Request`] names the model graph, the mesh (the one place it is given: the
//! driver puts it on the graph and the pass context), the config facts the passes
//! need (the HF tp plan and model type), the sizes `B` and `S` (symbolic when not
//! given), what to compile (a forward pass, or a training step with its options), an
//! optional explicit forward pass list, an optional float dtype, the pass manager's
//! instrumentation and the device the plan is made for. [`compile`] returns a
//! [`Compiled`]: the program, the pipeline it went through with the reason for every
//! position, the pass manager's report, the bound sizes, the plan when sizes are
//! concrete, and, for training steps whose options were left open, what the driver
//! chose and why ([`Choice`]).
//!
//! Training options the request leaves open (`TrainRequest::open`: ZeRO stage,
//! checkpoint policy, activation offload, micro-batches) are chosen as the fastest set
//! that fits the device memory, by the search of `weft plan` restricted to the
//! request's mesh: every combination of the open options is priced by the analytic
//! model of [`crate::search`] (when the request carries the model's [`ModelShape`]),
//! the best are compiled in that order, and the compiled plan's predicted step time
//! picks among those that fit. Without a shape (a `.weft` or `.pt2` program) the
//! combinations are compiled in a fixed order of cost and the first that fits wins.
//! Options the request gives are kept; when they do not fit the error says which
//! options would (and, failing those, which mesh). [`evaluate`] compiles and plans one
//! candidate option set (peak and predicted time), the unit every search reuses.

use crate::lower::plan::{self, LowerError, PlanOptions};
use crate::manager::{Instrumentation, PassManager, RunReport};
use crate::pass::{PassContext, PassError};
use crate::registry::{default_pipeline_explained, Pipeline, Step};
use crate::search::{Candidate, ModelShape, Scored, SearchSpec};
use crate::tp::TpOptions;
use crate::training::{
    training_steps, CheckpointPolicy, OffloadOptions, TrainOptions, UpdateStream,
};
use crate::update_timing::DeferUpdates;
use std::io::Write;
use weft_ir::plan::{DeviceProfile, ExecutionPlan, StepKind};
use weft_ir::{Bindings, DType, Graph, Mesh};

/// What to compile.
#[derive(Clone, Debug)]
pub struct Request {
    /// The unsharded model (or a program compiled earlier, with `passes` empty).
    pub model: Graph,
    /// The mesh to compile for.
    pub mesh: Mesh,
    /// `tensor-parallel`'s facts from the model's config (HF tp plan, model type) and
    /// any explicit layer specs.
    pub tp: TpOptions,
    /// Global batch `B` and sequence length `S`; when only one is given the other takes
    /// the smallest size the mesh allows. Both `None`: the program stays symbolic.
    pub batch: Option<i64>,
    pub seq: Option<i64>,
    /// `None`: the forward pass only. `Some`: a whole training step.
    pub train: Option<TrainRequest>,
    /// The forward pipeline instead of the mesh's default (`Pipeline::parse` of a
    /// `--passes` list); training passes follow it.
    pub passes: Option<Pipeline>,
    /// Run the model in this float dtype (`convert-dtype` first).
    pub dtype: Option<DType>,
    pub instrumentation: Instrumentation,
    /// The device the plan is scheduled and costed for (and offload hides copies on).
    pub device: DeviceProfile,
    /// Per-rank memory the plan must fit (`None`: the device profile's memory).
    pub device_memory: Option<u64>,
    /// Pinned host memory per rank the plan may hold (offloaded activations, the host
    /// optimizer's state, streamed optimizer state); `None`: no limit.
    pub host_memory: Option<u64>,
    /// Lower to an [`ExecutionPlan`] (needs concrete sizes).
    pub plan: bool,
    /// The MODEL argument, recorded in the plan.
    pub source: String,
    /// The model's layer sizes for the analytic search over open training options
    /// (`None`: no config, the options are compiled in a fixed order instead).
    pub shape: Option<ModelShape>,
    /// Run `fuse` last (SwiGLU and residual add + rms_norm fused, forward and
    /// backward); `--fuse=false` turns it off.
    pub fuse: bool,
    /// How `ring-lower` moves k/v between the cp ranks (`--cp-kv`: ring steps, or one
    /// all-gather), forward-only or in a training step.
    pub cp_kv: crate::ring_allgather::CpKv,
}

impl Request {
    /// A forward compile of `model` for `mesh` with default options on the h200 profile.
    pub fn new(model: Graph, mesh: Mesh) -> Request {
        Request {
            model,
            mesh,
            tp: TpOptions::default(),
            batch: None,
            seq: None,
            train: None,
            passes: None,
            dtype: None,
            instrumentation: Instrumentation::default(),
            device: plan::profile::preset("h200").expect("built-in profile"),
            device_memory: None,
            host_memory: None,
            plan: false,
            source: String::new(),
            shape: None,
            fuse: true,
            cp_kv: Default::default(),
        }
    }

    /// The model's shape as the step runs it: its parameters in `dtype` when the request
    /// converts them (a checkpoint stored in f32 trained in bf16 holds bf16 parameters
    /// and moments; gpt-oss-20b on one rank was priced at 238 GiB against 121 planned).
    pub fn step_shape(&self) -> Option<ModelShape> {
        let mut shape = self.shape.clone()?;
        if let Some(d) = self.dtype {
            shape.param_bytes = d.size_bytes() as u64;
        }
        Some(shape)
    }

    /// The memory limit per rank: the request's, else the device profile's.
    pub fn memory_limit(&self) -> u64 {
        self.device_memory
            .unwrap_or((self.device.memory_gib * (1u64 << 30) as f64) as u64)
    }

    pub fn step_kind(&self) -> StepKind {
        if self.train.is_some() {
            StepKind::Training
        } else {
            StepKind::Forward
        }
    }
}

/// A training step's options, and which of them the driver may choose.
#[derive(Clone, Debug, Default)]
pub struct TrainRequest {
    /// The options as given (or their defaults, where `open` lets the driver choose).
    pub options: TrainOptions,
    /// What the user left unspecified.
    pub open: Open,
    /// The offload settings used where the driver turns offload on.
    pub offload_template: OffloadOptions,
}

/// Training options left unspecified: the driver picks them by memory and time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Open {
    pub checkpoint: bool,
    pub offload: bool,
    pub zero: bool,
    pub micro_batches: bool,
    pub offload_optimizer: bool,
    /// lm_head + cross-entropy fused over vocabulary chunks (`linear_cross_entropy`):
    /// no logits tensor, one more lm_head GEMM (the backward recomputes each chunk).
    pub fused_loss: bool,
    /// The optimizer state streamed from host memory (`--stream-optimizer-state`).
    pub stream_optimizer_state: bool,
}

impl Open {
    /// Every option open.
    pub fn all() -> Open {
        Open {
            checkpoint: true,
            offload: true,
            zero: true,
            micro_batches: true,
            offload_optimizer: true,
            fused_loss: true,
            stream_optimizer_state: true,
        }
    }
    pub fn any(&self) -> bool {
        self.checkpoint
            || self.offload
            || self.zero
            || self.micro_batches
            || self.offload_optimizer
            || self.fused_loss
            || self.stream_optimizer_state
    }
}

/// What the driver chose for the open training options, and why.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Choice {
    /// The chosen options as flags (`--checkpoint selective --offload ...`).
    pub chosen: String,
    /// One line per candidate tried, in order, with its peak and predicted time.
    pub tried: Vec<String>,
    /// Why the chosen one wins.
    pub why: String,
}

/// The compiled program and what the driver knows about it.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub program: Graph,
    /// Every pass that ran, with the reason for its position.
    pub pipeline: Pipeline,
    pub report: RunReport,
    /// `B`, `S` as bound (empty when the program stays symbolic).
    pub bindings: Bindings,
    /// The plan, when the request asked for one.
    pub plan: Option<ExecutionPlan>,
    pub kind: StepKind,
    /// The training options compiled (for a training step).
    pub train: Option<TrainOptions>,
    /// What the driver chose for open training options.
    pub choice: Option<Choice>,
}

/// Why a compile failed. `Display` is the message after `error: ` (with `help:` lines).
/// The large variants are boxed: every compile returns this error type, and the error
/// path is cold.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("{0}")]
    Pass(Box<PassError>),
    #[error("{0}")]
    Lower(Box<LowerError>),
    #[error("{0}")]
    Bindings(Box<crate::BindingError>),
    #[error("{what}{}", .help.as_ref().map(|h| format!("\nhelp: {h}")).unwrap_or_default())]
    Input { what: String, help: Option<String> },
    /// No option set fits the device: each tried, and what would help.
    #[error("no training options fit {limit} per rank ({kind}):\n{}\n{last}", .tried.iter().map(|t| format!("  {t}")).collect::<Vec<_>>().join("\n"))]
    NoFit {
        limit: String,
        kind: String,
        tried: Vec<String>,
        /// The plan error of the least device peak tried (its breakdown and help), or
        /// what the host memory limit refused.
        last: Box<NoFitReason>,
    },
}

/// Why the least demanding option set tried did not fit.
#[derive(Debug, thiserror::Error)]
pub enum NoFitReason {
    #[error(transparent)]
    Device(LowerError),
    #[error("the plans that fit the device pin more host memory than --host-memory allows: the least, {peak} per rank, against {limit}\nhelp: {HOST_MEMORY_HELP}, or more ranks to shard the state over (dp with --zero)")]
    Host { peak: String, limit: String },
}

/// What to do about a plan over `--host-memory`.
const HOST_MEMORY_HELP: &str =
    "give more --host-memory, or fewer offloads (--offload, --offload-optimizer, --stream-optimizer-state)";

impl From<PassError> for DriverError {
    fn from(e: PassError) -> Self {
        DriverError::Pass(Box::new(e))
    }
}

impl From<LowerError> for DriverError {
    fn from(e: LowerError) -> Self {
        DriverError::Lower(Box::new(e))
    }
}

impl From<crate::BindingError> for DriverError {
    fn from(e: crate::BindingError) -> Self {
        DriverError::Bindings(Box::new(e))
    }
}

/// One candidate option set, compiled and planned.
#[derive(Clone, Debug)]
pub struct Evaluated {
    pub options: TrainOptions,
    pub compiled: Compiled,
    pub peak_bytes: u64,
    /// Pinned host bytes per rank.
    pub host_bytes: u64,
    pub step_time_s: f64,
    /// Fits the device memory and the host memory limit.
    pub fits: bool,
}

/// The forward pipeline of the request (its `passes`, else the mesh's default), after
/// `convert-dtype` when a dtype is asked for, then the training passes.
pub fn pipeline(req: &Request, train: Option<&TrainOptions>) -> Pipeline {
    let mut p = Pipeline::default();
    if req.dtype.is_some() {
        p.steps.push(Step {
            pass: crate::convert_dtype::NAME.to_string(),
            why: "first: every later pass types what it inserts from the converted parameters and inputs".to_string(),
        });
    }
    let forward = req
        .passes
        .clone()
        .unwrap_or_else(|| default_pipeline_explained(&req.mesh));
    p.steps.extend(forward.steps);
    if let Some(t) = train {
        p.steps.extend(training_steps(t));
        crate::registry::place_ring_lower(&mut p);
    }
    if req.fuse {
        p.steps.push(Step {
            pass: crate::fuse::NAME.to_string(),
            why: "last: fuses the finished program's patterns (forward, backward, recomputed and reloaded values alike), so no later pass sees a fused op".to_string(),
        });
    }
    p
}

/// Binds `B` and `S`: when only one is given, the other takes the smallest size the
/// mesh allows (one sequence per data-parallel rank, one token per sequence-parallel
/// rank); neither: unbound.
pub fn sizes(mesh: &Mesh, batch: Option<i64>, seq: Option<i64>) -> Result<Bindings, DriverError> {
    let mut b = Bindings::new();
    let (batch, seq) = match (batch, seq) {
        (None, None) => (None, None),
        (b, s) => (
            Some(b.unwrap_or(mesh.size_or_one("dp") as i64)),
            Some(s.unwrap_or(mesh.size_or_one("sp") as i64)),
        ),
    };
    for (flag, sym, v) in [("--batch", "B", batch), ("--seq", "S", seq)] {
        if let Some(v) = v {
            if v <= 0 {
                return Err(DriverError::Input {
                    what: format!("invalid {flag} {v}: must be positive"),
                    help: None,
                });
            }
            b = b.with(sym, v);
        }
    }
    Ok(b)
}

/// The sizes drawn inputs take when a verb that runs a model is given neither
/// `--batch` nor `--seq`: 2 sequences per data-parallel rank, 8 tokens per
/// sequence-parallel rank.
pub fn default_run_sizes(mesh: &Mesh) -> (i64, i64) {
    (
        2 * mesh.size_or_one("dp") as i64,
        8 * mesh.size_or_one("sp") as i64,
    )
}

/// Compiles the request. Printed instrumentation (print-before/after/changes, the
/// statistics table) goes to `sink`.
pub fn compile(req: &Request, sink: &mut dyn Write) -> Result<Compiled, DriverError> {
    let Some(train) = &req.train else {
        return compile_with(req, None, sink, req.memory_limit());
    };
    let bindings = sizes(&req.mesh, req.batch, req.seq)?;
    if !req.plan || bindings.symbols.is_empty() || !train.open.any() {
        let c = compile_with(req, Some(&train.options), sink, req.memory_limit());
        return match c {
            Err(DriverError::Lower(e)) if matches!(*e, LowerError::OutOfMemory { .. }) => {
                Err(with_what_fits(req, *e, &bindings))
            }
            Ok(c) => match (&c.plan, req.host_memory) {
                (Some(p), Some(h)) if p.memory.host_bytes > h => Err(DriverError::Input {
                    what: format!(
                        "the plan pins {} of host memory per rank, over --host-memory {}",
                        plan::gib(p.memory.host_bytes),
                        plan::gib(h)
                    ),
                    help: Some(HOST_MEMORY_HELP.into()),
                }),
                _ => Ok(c),
            },
            c => c,
        };
    }
    let limit = req.memory_limit();
    let ranked = rank(req, train, &bindings);
    // When the caller's instrumentation only verifies, candidates are compiled with
    // its verification and the winner's compile is returned as is.
    let reuse = only_verifies(&req.instrumentation);
    let verify = reuse && req.instrumentation.verify_each;
    let mut tried = Vec::new();
    let mut fits: Vec<(usize, Evaluated)> = Vec::new();
    let mut least: Option<(u64, LowerError)> = None;
    // The least pinned host memory among the plans that fit the device but not the host.
    let mut least_host: Option<u64> = None;
    let consider = |i: usize| -> Result<bool, DriverError> {
        let r = &ranked[i];
        let e = evaluate_verified(req, &r.options, verify)?;
        tried.push(candidate_line(
            &e,
            limit,
            req.host_memory,
            r.analytic.as_ref(),
        ));
        let fit = e.fits;
        if fit {
            fits.push((i, e));
        } else if e.peak_bytes > limit {
            if least.as_ref().is_none_or(|(p, _)| e.peak_bytes < *p) {
                let err = out_of_memory(&e, limit, suggest_mesh(req, &bindings));
                least = Some((e.peak_bytes, err));
            }
        } else if least_host.is_none_or(|h| e.host_bytes < h) {
            least_host = Some(e.host_bytes);
        }
        Ok(fit)
    };
    let order = search(&ranked, consider)?;
    let (evaluated, fell_back) = (order.in_rank_order, order.fell_back);
    // The fastest compiled plan that fits (ties: the better ranked).
    let Some((_, best)) = fits.iter().min_by(|a, b| {
        a.1.step_time_s
            .total_cmp(&b.1.step_time_s)
            .then(a.0.cmp(&b.0))
    }) else {
        let last = match (least_host, least) {
            (Some(h), _) => NoFitReason::Host {
                peak: plan::gib(h),
                limit: plan::gib(req.host_memory.unwrap_or(0)),
            },
            (None, Some((_, e))) => NoFitReason::Device(e),
            (None, None) => {
                return Err(DriverError::Input {
                    what: "no training option set was compiled".into(),
                    help: None,
                })
            }
        };
        return Err(DriverError::NoFit {
            limit: plan::gib(limit),
            kind: format!("{} of {}", req.step_kind().name(), req.model.name),
            tried,
            last: Box::new(last),
        });
    };
    let analytic = ranked.iter().any(|r| r.analytic.is_some());
    let combinations = format!(
        "{} combinations of the open options ({}) on mesh {}",
        ranked.len(),
        open_names(&train.open),
        mesh_name(&req.mesh),
    );
    let limit_text = plan::gib(limit);
    let why = match (fell_back, analytic) {
        (true, true) => format!(
            "the fastest predicted step of the {} that fit {limit_text} per rank among {MEMORY_FALLBACK} more option sets compiled least analytic memory first, after the {evaluated} best-ranked of {combinations} did not fit",
            fits.len(),
        ),
        (true, false) => format!(
            "the fastest predicted step of the {} that fit {limit_text} per rank among {MEMORY_FALLBACK} more of {combinations}, tried cheapest first after the first {evaluated} did not fit (the model has no config for the analytic model)",
            fits.len(),
        ),
        (false, true) => format!(
            "the fastest predicted step of the {} compiled option sets that fit {limit_text} per rank; {combinations} were ranked by `weft plan`'s analytic model and the best compiled",
            fits.len(),
        ),
        (false, false) => format!(
            "the first of {combinations} that fits {limit_text} per rank, tried cheapest first (more ZeRO, then micro-batches, then recomputation, then activation offload, then optimizer offload; the model has no config for the analytic model)",
        ),
    };
    let options = best.options.clone();
    let mut c = if reuse {
        best.compiled.clone()
    } else {
        // Compile once more with the caller's instrumentation, so printing and
        // statistics describe the program returned.
        compile_with(req, Some(&options), sink, limit)?
    };
    c.choice = Some(Choice {
        chosen: options.summary(),
        why,
        tried,
    });
    Ok(c)
}

/// At most this many option sets are compiled for one choice.
const MAX_EVALUATIONS: usize = 8;
/// Compiled finalists that fit, among which the fastest compiled plan wins.
const FINALISTS: usize = 2;
/// When none of the first [`MAX_EVALUATIONS`] fits, this many more option sets are
/// compiled, least analytic memory first, and the fastest of those that fit wins.
const MEMORY_FALLBACK: usize = 4;
/// A later finalist is compiled only when its analytic step time is within this
/// factor of the first that fit.
const FINALIST_SLACK: f64 = 1.1;

/// What [`search`] compiled.
#[derive(Debug, PartialEq, Eq)]
struct SearchOrder {
    /// Option sets compiled in ranked order (the first this many).
    in_rank_order: usize,
    /// Whether none of those fit and [`MEMORY_FALLBACK`] more were compiled, least
    /// analytic memory first.
    fell_back: bool,
}

/// Compiles ranked option sets in the search's order through `compile_fits` (which
/// compiles the `i`-th and says whether it fits): in ranked order until one fits (at
/// most [`MAX_EVALUATIONS`]), then up to [`FINALISTS`] that fit whose analytic time is
/// within [`FINALIST_SLACK`] of the first fit's. When none of those fits, the analytic
/// model priced them under the limit and was wrong (streamed state the host link
/// cannot carry in time, say): [`MEMORY_FALLBACK`] more, least analytic memory first.
fn search(
    ranked: &[Ranked],
    mut compile_fits: impl FnMut(usize) -> Result<bool, DriverError>,
) -> Result<SearchOrder, DriverError> {
    let mut first_fit: Option<usize> = None;
    let mut nfits = 0;
    let mut i = 0;
    while i < ranked.len() && i < MAX_EVALUATIONS {
        if let Some(first) = first_fit {
            let close = match (&ranked[first].analytic, &ranked[i].analytic) {
                (Some(a), Some(b)) => b.fits && b.time.step <= a.time.step * FINALIST_SLACK,
                _ => false,
            };
            if nfits >= FINALISTS || !close {
                break;
            }
        }
        if compile_fits(i)? {
            first_fit.get_or_insert(i);
            nfits += 1;
        }
        i += 1;
    }
    let fell_back = nfits == 0 && i < ranked.len();
    if fell_back {
        let mut rest: Vec<usize> = (i..ranked.len()).collect();
        rest.sort_by_key(|&j| ranked[j].analytic.as_ref().map(|a| a.memory.total));
        for j in rest.into_iter().take(MEMORY_FALLBACK) {
            compile_fits(j)?;
        }
    }
    Ok(SearchOrder {
        in_rank_order: i,
        fell_back,
    })
}

/// One combination of training options, with its analytic estimate when the request
/// has a model shape.
#[derive(Clone, Debug)]
pub struct Ranked {
    pub options: TrainOptions,
    pub analytic: Option<Scored>,
}

/// Every combination of the open options, in the order the search compiles them:
/// analytically fitting ones by predicted step time, then the rest by predicted
/// memory; without a shape, [`candidates`]'s fixed order of cost.
pub fn rank(req: &Request, train: &TrainRequest, bindings: &Bindings) -> Vec<Ranked> {
    let per_rank = bindings
        .symbols
        .get("B")
        .map(|b| b / req.mesh.size_or_one(crate::pass::DP) as i64);
    // Without a data-parallel group (dp, sp, cp and edp all 1) every ZeRO stage is the
    // same plan as stage 0: rank it once.
    let no_zero_group = [crate::pass::DP, crate::pass::SP, "cp", weft_ir::mesh::EDP]
        .iter()
        .all(|a| req.mesh.size_or_one(a) == 1);
    let mut out: Vec<Ranked> = candidates(train, per_rank)
        .into_iter()
        .filter(|o| !(no_zero_group && train.open.zero && o.zero_stage() > 0))
        .map(|options| Ranked {
            analytic: analytic(req, bindings, &options),
            options,
        })
        .collect();
    if out.iter().all(|r| r.analytic.is_some()) {
        // A stable sort keeps the fixed order among equals.
        out.sort_by(|a, b| {
            let (a, b) = (a.analytic.as_ref().unwrap(), b.analytic.as_ref().unwrap());
            b.fits.cmp(&a.fits).then(if a.fits {
                a.time.step.total_cmp(&b.time.step)
            } else {
                a.memory.total.cmp(&b.memory.total)
            })
        });
    } else {
        for r in &mut out {
            r.analytic = None;
        }
    }
    out
}

/// The analytic search's view of the request and one option set: `None` without a
/// model shape, sizes, or on a mesh with axes the search does not model.
fn analytic(req: &Request, b: &Bindings, opts: &TrainOptions) -> Option<Scored> {
    let shape = &req.step_shape()?;
    let (batch, seq) = (*b.symbols.get("B")?, *b.symbols.get("S")?);
    let known = [
        "dp",
        "cp",
        "sp",
        "tp",
        weft_ir::mesh::EP,
        weft_ir::mesh::EDP,
    ];
    if req
        .mesh
        .axes
        .iter()
        .any(|(a, _)| !known.contains(&a.as_str()))
    {
        return None;
    }
    let axis = |a: &str| req.mesh.size_or_one(a);
    let spec = SearchSpec {
        gpus: req.mesh.world_size(),
        gpus_per_node: req.device.gpus_per_node.max(1),
        seq: seq as u64,
        batch: batch as u64,
        device: req.device.clone(),
        device_memory: req.memory_limit(),
        host_memory: req.host_memory,
        peak_flops: crate::search::peak_flops(&req.device),
        grad_outputs: opts.grad_outputs,
    };
    let c = Candidate {
        dp: axis("dp"),
        cp: axis("cp"),
        sp: axis("sp"),
        tp: axis("tp"),
        ep: axis(weft_ir::mesh::EP),
        zero: opts.zero_stage(),
        checkpoint: match opts.checkpoint {
            CheckpointPolicy::None => "none",
            CheckpointPolicy::Full => "full",
            // A budget recomputes about what selective does.
            CheckpointPolicy::Selective | CheckpointPolicy::Budget(_) => "selective",
        },
        offload: opts.offload.is_some(),
        offload_optimizer: opts.offload_optimizer,
        fused_loss: opts.fused_loss,
        micro_batches: opts.micro_batches,
        cp_kv: opts.cp_kv,
    };
    let mut s = crate::search::score(shape, &spec, &c);
    // The search prices mixed precision's f32 master weights and moments (12 bytes a
    // parameter); without master weights the moments are in the parameters' dtype.
    if !opts.master_weights && !opts.offload_optimizer && shape.param_bytes < 4 {
        let own = (s.memory.optimizer as f64 * 2.0 * shape.param_bytes as f64 / 12.0) as u64;
        s.memory.total -= s.memory.optimizer - own;
        s.memory.optimizer = own;
    }
    if opts.stream_optimizer_state {
        stream_state_estimate(&mut s, shape, &req.device);
    }
    // The compiled plan decides what fits: an option set the model prices just over the
    // limit is ranked among those that fit (the 1.24B at 16384 without checkpointing,
    // fused loss and streamed state: 24.25 GiB priced, 23.03 planned, under 24 GiB).
    s.fits = s.memory.total as f64 <= req.memory_limit() as f64 * ANALYTIC_FIT_MARGIN
        && req
            .host_memory
            .is_none_or(|h| s.memory.host as f64 <= h as f64 * ANALYTIC_FIT_MARGIN);
    Some(s)
}

/// How far over the memory limit an analytic peak may be and still rank among the option
/// sets that fit (the analytic peaks track the plans within a few percent).
const ANALYTIC_FIT_MARGIN: f64 = 1.1;

/// The analytic model of `--stream-optimizer-state` (which the search does not
/// enumerate), as the `optimizer` pass and `stream_state` schedule it. The state but for
/// what the last updates keep (the embedding's and the lm_head's rows, whose gradients
/// are final last) and a layer's in flight may make a round trip over the host link,
/// each direction at its share of the duplex rate, during the last micro-batch's
/// backward (about two thirds of its compute); compute beside the copies slows by the
/// profile's fraction. Where the link keeps up, all of it leaves the device. Where it does not, the schedule
/// streams only the states it can bring in by their updates and keeps the rest on the
/// device, so nothing stalls and part is saved: [`LINK_BOUND_SHARE`] of what the link
/// carries in the backward.
fn stream_state_estimate(s: &mut Scored, shape: &ModelShape, d: &DeviceProfile) {
    let state = s.memory.optimizer as f64;
    let params = shape.params().max(1) as f64;
    let vocab_rows = (shape.vocab * shape.hidden * if shape.tied { 1 } else { 2 }) as f64;
    let kept = (vocab_rows / params + 2.0 / shape.layers.max(1) as f64).min(1.0);
    let streamed = state * (1.0 - kept);
    let rate = d.host_bytes_per_s_beside_other_direction();
    // The updates run in the last micro-batch's backward.
    let backward = s.time.compute * 2.0 / 3.0 / s.candidate.micro_batches.max(1) as f64;
    let carried = if streamed <= rate * backward {
        streamed
    } else {
        rate * backward * LINK_BOUND_SHARE
    };
    let added = d.host_copy_compute_slowdown * carried / rate;
    s.memory.host += carried as u64;
    let on_device = ((state - carried) as u64).min(s.memory.optimizer);
    s.memory.total -= s.memory.optimizer - on_device;
    s.memory.optimizer = on_device;
    s.time.step += added;
    s.time.compute += added;
}

/// The share of what the host link carries in the backward that a link-bound streamed
/// state saves at the peak. Measured on the compiled plans (h200 profile): the 1.24B at
/// 16384 with f32 state 0.94, Llama-3-8B at 8192 with bf16 state 0.76 (no
/// checkpointing) and 1.0 (selective); with f32 state and full checkpointing 0.1, where
/// the copies back that would outlast the step keep the last updates' states and the
/// copies in the first's. Priced low: the compiled plan decides what fits.
const LINK_BOUND_SHARE: f64 = 0.5;

/// The best analytic mesh for the request's model on as many GPUs, as flags, when
/// the request's mesh cannot fit (`None` without a shape or when nothing fits).
fn suggest_mesh(req: &Request, b: &Bindings) -> Option<String> {
    let shape = &req.step_shape()?;
    let (batch, seq) = (*b.symbols.get("B")?, *b.symbols.get("S")?);
    let spec = SearchSpec {
        gpus: req.mesh.world_size(),
        gpus_per_node: req.device.gpus_per_node.max(1),
        seq: seq as u64,
        batch: batch as u64,
        device: req.device.clone(),
        device_memory: req.memory_limit(),
        host_memory: req.host_memory,
        peak_flops: crate::search::peak_flops(&req.device),
        grad_outputs: req.train.as_ref().is_some_and(|t| t.options.grad_outputs),
    };
    let best = crate::search::search(shape, &spec).into_iter().next()?;
    best.fits.then(|| {
        format!(
            "--mesh {} {} (peak about {} per rank by the analytic model of `weft plan`)",
            best.candidate.mesh(),
            best.candidate.flags(),
            plan::gib(best.memory.total)
        )
    })
}

fn open_names(o: &Open) -> String {
    let mut v = Vec::new();
    for (on, name) in [
        (o.zero, "--zero"),
        (o.checkpoint, "--checkpoint"),
        (o.offload, "--offload"),
        (o.micro_batches, "--micro-batches"),
        (o.offload_optimizer, "--offload-optimizer"),
        (o.fused_loss, "--fused-loss / --unfused-loss"),
        (o.stream_optimizer_state, "--stream-optimizer-state"),
    ] {
        if on {
            v.push(name);
        }
    }
    v.join(", ")
}

fn mesh_name(m: &Mesh) -> String {
    if m.axes.is_empty() {
        "(one rank)".into()
    } else {
        m.to_string()
    }
}

/// Whether `ins` asks for nothing but (maybe) verification: no printing, statistics,
/// stopping or bisecting.
fn only_verifies(ins: &Instrumentation) -> bool {
    ins.print_before == crate::PassFilter::None
        && ins.print_after == crate::PassFilter::None
        && !ins.print_changes
        && !ins.stats
        && ins.stop_after.is_none()
        && ins.bisect_limit.is_none()
}

/// Compiles and plans one training option set without a memory limit: the program,
/// its peak per rank, its predicted step time, and whether it fits the request's
/// device memory. Needs concrete sizes.
pub fn evaluate(req: &Request, opts: &TrainOptions) -> Result<Evaluated, DriverError> {
    evaluate_verified(req, opts, false)
}

/// [`evaluate`], verifying the graph after every pass when `verify_each`.
fn evaluate_verified(
    req: &Request,
    opts: &TrainOptions,
    verify_each: bool,
) -> Result<Evaluated, DriverError> {
    let mut quiet = req.clone();
    quiet.instrumentation = Instrumentation {
        verify_each,
        check_requires: req.instrumentation.check_requires,
        ..Instrumentation::default()
    };
    quiet.plan = true;
    let c = compile_with(&quiet, Some(opts), &mut std::io::sink(), u64::MAX)?;
    let p = c.plan.as_ref().ok_or_else(|| DriverError::Input {
        what: "evaluating training options needs concrete sizes".into(),
        help: Some("give --seq (and --batch)".into()),
    })?;
    let (peak, time, host) = (p.memory.peak_bytes, p.cost.step_time_s, p.memory.host_bytes);
    let host_fits = req.host_memory.is_none_or(|h| host <= h);
    let fits = peak <= req.memory_limit() && host_fits;
    let (moved, held) = (
        c.report.counter("updates_deferred"),
        c.report.counter("deferred_held_bytes"),
    );
    // What holding reduced gradients longer can add at the peak: their buffers, and
    // the transients beside them.
    let releasable: u64 = ["comm_buffers", "grads", "workspace"]
        .iter()
        .filter_map(|k| p.memory.breakdown.get(*k))
        .sum();
    let over = peak.saturating_sub(req.memory_limit());
    if peak > req.memory_limit() && opts.update_stream == UpdateStream::WhereItFits {
        // Inline, each update holds the compute stream until its gradient is reduced:
        // never more gradients at once than beside it, so the inline plan (with its own
        // search of how long to hold them) is the one to fit or to report.
        return evaluate_verified(
            req,
            &TrainOptions {
                update_stream: UpdateStream::Off,
                ..opts.clone()
            },
            verify_each,
        );
    }
    if !fits
        && host_fits
        && moved > 0
        && over <= releasable
        && opts.defer_updates == DeferUpdates::All
    {
        // Updates moved past their reductions hold the reduced gradients longer: with
        // each update right after its reduction the same options may fit, and then
        // the most that can be held and still fit is searched (a bisection of the
        // held bytes, starting at the peak's held bytes less the overshoot).
        let with = |defer_updates| {
            evaluate_verified(
                req,
                &TrainOptions {
                    defer_updates,
                    ..opts.clone()
                },
                verify_each,
            )
        };
        let mut best = with(DeferUpdates::Off)?;
        if best.fits {
            let (mut fits_at, mut over_at) = (0u64, held);
            let mut cap = held.saturating_sub(over);
            for _ in 0..DEFERRAL_TRIES {
                if cap <= fits_at || cap >= over_at {
                    cap = fits_at + (over_at - fits_at) / 2;
                }
                if over_at - fits_at < MIN_DEFERRAL_STEP {
                    break;
                }
                let e = with(DeferUpdates::Within(cap))?;
                if e.fits {
                    fits_at = cap;
                    if e.step_time_s < best.step_time_s {
                        best = e;
                    }
                } else {
                    over_at = cap;
                }
                cap = fits_at + (over_at - fits_at) / 2;
            }
            return Ok(best);
        }
    }
    Ok(Evaluated {
        options: opts.clone(),
        fits,
        compiled: c,
        peak_bytes: peak,
        host_bytes: host,
        step_time_s: time,
    })
}

/// How many bounds on the reduced gradients held past their reductions the driver
/// tries for a plan that fits only with its updates kept in place, and the smallest
/// gap between a bound that fits and one that does not worth another try.
const DEFERRAL_TRIES: usize = 4;
const MIN_DEFERRAL_STEP: u64 = 64 << 20;

/// Micro-batch counts the driver tries when `--micro-batches` is open: powers of two
/// that divide a rank's batch, at most this many.
const MAX_OPEN_MICRO_BATCHES: i64 = 8;

/// Every combination of the open options (given options stay as given), in a fixed
/// order of cost, cheapest first: ZeRO stage innermost (sharding state costs the least
/// time), then micro-batch counts, then checkpoint none, selective, full, then the
/// same with activation offload, then all of it with the optimizer on the host. `per_rank_batch` bounds the micro-batch
/// counts (`None`: 1 only).
pub fn candidates(train: &TrainRequest, per_rank_batch: Option<i64>) -> Vec<TrainOptions> {
    let policies = if train.open.checkpoint {
        vec![
            CheckpointPolicy::None,
            CheckpointPolicy::Selective,
            CheckpointPolicy::Full,
        ]
    } else {
        vec![train.options.checkpoint.clone()]
    };
    let offloads = if train.open.offload {
        vec![None, Some(train.offload_template.clone())]
    } else {
        vec![train.options.offload.clone()]
    };
    let zeros: Vec<u8> = if train.open.zero {
        (0..=3).collect()
    } else {
        vec![train.options.zero_stage()]
    };
    let mbs: Vec<u32> = if train.open.micro_batches {
        let per_rank = per_rank_batch.unwrap_or(1).max(1);
        (0..)
            .map(|k| 1i64 << k)
            .take_while(|&m| m <= per_rank.min(MAX_OPEN_MICRO_BATCHES))
            .filter(|m| per_rank % m == 0)
            .map(|m| m as u32)
            .collect()
    } else {
        vec![train.options.micro_batches]
    };
    let host_optimizer = if train.open.offload_optimizer {
        vec![false, true]
    } else {
        vec![train.options.offload_optimizer]
    };
    // The unfused loss first: it is faster where its logits fit (the fused loss's row
    // kernel or, over tp, its recomputed chunks cost more than the logits' round trips).
    // A step that returns its gradients keeps the logits anyway (the pass does not fuse
    // it).
    let fused_losses = if train.open.fused_loss && !train.options.grad_outputs {
        vec![false, true]
    } else {
        vec![train.options.fused_loss]
    };
    // Streamed state after the same options with the state on the device: it costs
    // host-link time (and compute beside the copies) for the state's device bytes.
    let streams = if train.open.stream_optimizer_state && train.options.optimizer.is_some() {
        vec![false, true]
    } else {
        vec![train.options.stream_optimizer_state]
    };
    let mut out = Vec::new();
    for &host in &host_optimizer {
        for &stream in &streams {
            if host && stream {
                continue;
            }
            for off in &offloads {
                for p in &policies {
                    for &mb in &mbs {
                        for &z in &zeros {
                            for &fused in &fused_losses {
                                let mut o = train.options.clone();
                                o.checkpoint = p.clone();
                                o.offload = off.clone();
                                o.micro_batches = mb;
                                o.set_zero_stage(z);
                                o.offload_optimizer = host;
                                o.fused_loss = fused;
                                o.stream_optimizer_state = stream;
                                out.push(o);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

fn candidate_line(
    e: &Evaluated,
    limit: u64,
    host_limit: Option<u64>,
    analytic: Option<&Scored>,
) -> String {
    format!(
        "{}: peak {} per rank, step {:.3} ms predicted{}{}",
        e.options.summary(),
        plan::gib(e.peak_bytes),
        e.step_time_s * 1e3,
        analytic
            .map(|s| format!(
                " (analytic: {}, {:.3} ms)",
                plan::gib(s.memory.total),
                s.time.step * 1e3
            ))
            .unwrap_or_default(),
        if e.peak_bytes > limit {
            format!(" (over {})", plan::gib(limit))
        } else if !e.fits {
            format!(
                " (pins {} of host memory, over --host-memory {})",
                plan::gib(e.host_bytes),
                plan::gib(host_limit.unwrap_or(0))
            )
        } else if e.options.defer_updates == DeferUpdates::Off {
            " (each update right after its reduction, to fit)".to_string()
        } else if let DeferUpdates::Within(b) = e.options.defer_updates {
            format!(
                " (updates moved past their reductions holding at most {} of reduced gradients, to fit)",
                plan::gib(b)
            )
        } else {
            String::new()
        }
    )
}

fn out_of_memory(e: &Evaluated, limit: u64, mesh: Option<String>) -> LowerError {
    let p = e
        .compiled
        .plan
        .as_ref()
        .expect("evaluated candidates have plans");
    LowerError::OutOfMemory {
        peak: e.peak_bytes,
        limit,
        breakdown: p.memory.breakdown.clone(),
        help: match mesh {
            Some(m) => format!("no option set fits this mesh; on as many GPUs {m} fits, or give --device-memory"),
            None => "raise tensor parallelism (e.g. tp=2) or sequence parallelism, or give --device-memory".into(),
        },
    }
}

/// The given options do not fit: name the fastest option set (every option open) on
/// the same mesh that does, else a mesh that does, or keep the plan's own help.
fn with_what_fits(req: &Request, e: LowerError, bindings: &Bindings) -> DriverError {
    let LowerError::OutOfMemory {
        peak,
        limit,
        breakdown,
        help,
    } = e
    else {
        return DriverError::from(e);
    };
    let given = req.train.as_ref().map(|t| t.options.clone());
    let mut all = req.train.clone().unwrap_or_default();
    all.open = Open::all();
    let mut found = None;
    for (i, r) in rank(req, &all, bindings).iter().enumerate() {
        if i >= MAX_EVALUATIONS {
            break;
        }
        if Some(&r.options) == given.as_ref() {
            continue;
        }
        if let Ok(ev) = evaluate(req, &r.options) {
            if ev.fits {
                found = Some(ev);
                break;
            }
        }
    }
    let help = match (found, suggest_mesh(req, bindings)) {
        (Some(ev), _) => format!(
            "{} fits (peak {} per rank, step {:.3} ms predicted); or leave --zero, --checkpoint, --offload, --micro-batches and --offload-optimizer out and the compiler chooses",
            ev.options.summary(),
            plan::gib(ev.peak_bytes),
            ev.step_time_s * 1e3
        ),
        (None, Some(m)) => format!("no option set fits this mesh; on as many GPUs {m} fits"),
        (None, None) => help,
    };
    DriverError::from(LowerError::OutOfMemory {
        peak,
        limit,
        breakdown,
        help,
    })
}

/// One compile with fixed options: the pipeline, the passes, the sizes, the plan.
fn compile_with(
    req: &Request,
    train: Option<&TrainOptions>,
    sink: &mut dyn Write,
    limit: u64,
) -> Result<Compiled, DriverError> {
    let bindings = sizes(&req.mesh, req.batch, req.seq)?;
    if req.cp_kv != crate::ring_allgather::CpKv::Ring && req.mesh.size_or_one(crate::pass::CP) < 2 {
        // Nothing would move k/v: refuse rather than compile something the option does
        // not describe.
        return Err(DriverError::Input {
            what: format!(
                "--cp-kv {} chooses how context parallelism moves k/v, and the mesh `{}` has no cp axis larger than 1",
                req.cp_kv.name(),
                req.mesh
            ),
            help: Some("add cp=N (N >= 2) to --mesh, or leave --cp-kv out".into()),
        });
    }
    let mut cx = PassContext::new(req.mesh.clone());
    cx.options.tp = req.tp.clone();
    cx.options.dtype = req.dtype;
    let mut g = req.model.clone();
    let mut train = train.cloned();
    if let Some(t) = &mut train {
        // The memory-aware passes (checkpoint budget, offload planner) size the step
        // as it will run, and hide copies under this device's compute.
        if let Some(b) = bindings.symbols.get("B") {
            t.batch = Some(*b);
        }
        if let Some(s) = bindings.symbols.get("S") {
            t.seq = Some(*s);
        }
        t.cp_kv = req.cp_kv;
        t.device = crate::training::Device(req.device.clone());
        if let Some(o) = &mut t.offload {
            o.device = crate::training::Device(req.device.clone());
            o.link_bytes_per_s = o.device.link_bytes_per_s();
        }
        if !t.grad_outputs {
            // A training step reports the loss; returning the logits would keep the
            // largest activation of the step (S x vocab) alive to its end.
            g.remove_output("logits");
        }
        cx.options.train = t.clone();
    } else if let Some(s) = bindings.symbols.get("S") {
        // A forward-only program's ring lowering sizes a sliding window's ring too.
        cx.options.train.seq = Some(*s);
    }
    cx.options.train.cp_kv = req.cp_kv;
    if !bindings.symbols.is_empty() {
        crate::bindings::check_total_bytes(&g, &bindings)?;
    }
    let pipeline = pipeline(req, train.as_ref());
    let names = pipeline.names();
    let report = PassManager::new(req.instrumentation.clone()).run(&mut g, &cx, &names, sink)?;
    if !bindings.symbols.is_empty() {
        crate::check_bindings(&g, &bindings)?;
    }
    let plan = if req.plan {
        if bindings.symbols.is_empty() {
            return Err(DriverError::Input {
                what: "a plan needs concrete sizes".into(),
                help: Some("pass --seq (and --batch) to bind S and B".into()),
            });
        }
        let opts = PlanOptions {
            device: req.device.clone(),
            device_memory: limit,
            bindings: bindings.clone(),
            source: req.source.clone(),
            update_stream: train
                .as_ref()
                .is_some_and(|t| t.update_stream != UpdateStream::Off),
        };
        Some(plan::lower(&g, &opts)?)
    } else {
        None
    };
    Ok(Compiled {
        program: g,
        pipeline,
        report,
        bindings,
        plan,
        kind: if train.is_some() {
            StepKind::Training
        } else {
            StepKind::Forward
        },
        train,
        choice: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training::Optimizer;

    /// Ranked option sets with analytic (step seconds, memory bytes, fits).
    fn ranked_of(analytic: &[(f64, u64, bool)]) -> Vec<Ranked> {
        analytic
            .iter()
            .map(|&(step, total, fits)| Ranked {
                options: TrainOptions::default(),
                analytic: Some(Scored {
                    candidate: Default::default(),
                    memory: crate::search::MemoryBreakdown {
                        total,
                        ..Default::default()
                    },
                    time: crate::search::TimeBreakdown {
                        step,
                        ..Default::default()
                    },
                    fits,
                }),
            })
            .collect()
    }

    /// The search's compile order against compiled outcomes (`fits[i]`): the ranked
    /// order to the first fit and its close finalists; none of the first eight fitting,
    /// four more by least analytic memory; a fit among those found.
    #[test]
    fn the_search_compiles_finalists_then_the_leanest_when_none_fit() {
        let run = |ranked: &[Ranked], fits: &[bool]| {
            let mut order = Vec::new();
            let s = search(ranked, |i| {
                order.push(i);
                Ok(fits[i])
            })
            .unwrap();
            (order, s)
        };
        // The second fits; the third is within 10% of its time and fits too: two
        // finalists, the fourth not compiled.
        let r = ranked_of(&[
            (1.0, 9, true),
            (1.0, 9, true),
            (1.05, 9, true),
            (1.06, 9, true),
        ]);
        let (order, s) = run(&r, &[false, true, true, true]);
        assert_eq!(order, [0, 1, 2]);
        assert!(!s.fell_back);
        // A finalist more than 10% slower is not compiled.
        let r = ranked_of(&[(1.0, 9, true), (1.2, 9, true)]);
        assert_eq!(run(&r, &[true, true]).0, [0]);
        // Twelve ranked, the first eight (priced to fit) do not: the other four by
        // analytic memory, least first, all compiled (the fastest that fits wins).
        let mut a: Vec<(f64, u64, bool)> =
            (0..8).map(|i| (1.0 + i as f64 * 0.01, 50, true)).collect();
        a.extend([
            (5.0, 40, false),
            (5.0, 10, false),
            (5.0, 30, false),
            (5.0, 20, false),
        ]);
        let r = ranked_of(&a);
        let fits: Vec<bool> = (0..12).map(|i| i >= 8).collect();
        let (order, s) = run(&r, &fits);
        assert_eq!(order, [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 10, 8]);
        assert_eq!(
            s,
            SearchOrder {
                in_rank_order: 8,
                fell_back: true
            }
        );
        // Nothing left to fall back on.
        let r = ranked_of(&[(1.0, 9, true)]);
        assert!(!run(&r, &[false]).1.fell_back);
    }

    fn request(mesh: &str, train: Option<TrainRequest>) -> Request {
        let model = weft_frontends::load("llama-tiny").unwrap().graph;
        let mut r = Request::new(model, Mesh::parse(mesh).unwrap());
        r.batch = Some(2);
        r.seq = Some(64);
        r.plan = true;
        r.train = train;
        r
    }

    fn open_training() -> TrainRequest {
        TrainRequest {
            options: TrainOptions {
                optimizer: Some(Optimizer::adamw(1e-3)),
                grad_outputs: false,
                ..Default::default()
            },
            open: Open {
                checkpoint: true,
                offload: true,
                ..Open::default()
            },
            offload_template: OffloadOptions::default(),
        }
    }

    #[test]
    fn forward_and_training_pipelines_carry_their_reasons() {
        let f = compile(&request("sp=2", None), &mut std::io::sink()).unwrap();
        assert_eq!(f.kind, StepKind::Forward);
        assert_eq!(f.plan.as_ref().unwrap().step_kind(), StepKind::Forward);
        assert!(!f.pipeline.names().contains(&"autodiff"));
        let t = compile(
            &request("sp=2", Some(open_training())),
            &mut std::io::sink(),
        )
        .unwrap();
        assert_eq!(t.plan.as_ref().unwrap().step_kind(), StepKind::Training);
        assert!(t.pipeline.steps.iter().all(|s| !s.why.is_empty()));
        let forward = &f.pipeline.names()[..f.pipeline.steps.len() - 1];
        assert_eq!(
            &t.pipeline.names()[..forward.len()],
            forward,
            "the training step starts with the forward pipeline"
        );
        assert_eq!(f.pipeline.names().last(), Some(&"fuse"));
        assert_eq!(t.pipeline.names().last(), Some(&"fuse"), "fuse runs last");
        assert!(
            t.program.output("logits").is_none(),
            "a training step drops the logits"
        );
    }

    #[test]
    fn open_options_take_the_first_candidate_that_fits() {
        // Plenty of memory: no checkpointing, no offload.
        let c = compile(
            &request("sp=2", Some(open_training())),
            &mut std::io::sink(),
        )
        .unwrap();
        let choice = c.choice.unwrap();
        assert_eq!(choice.tried.len(), 1);
        assert_eq!(c.train.unwrap().checkpoint, CheckpointPolicy::None);
        // A limit between the peaks of `none` and `full` picks a checkpointing policy.
        let mut r = request("sp=2", Some(open_training()));
        let none = evaluate(&r, &candidates(r.train.as_ref().unwrap(), None)[0]).unwrap();
        let full = evaluate(&r, &candidates(r.train.as_ref().unwrap(), None)[2]).unwrap();
        assert!(full.peak_bytes < none.peak_bytes);
        r.device_memory = Some(full.peak_bytes);
        let c = compile(&r, &mut std::io::sink()).unwrap();
        let chosen = c.train.unwrap().checkpoint;
        assert_ne!(chosen, CheckpointPolicy::None, "{:?}", c.choice);
        assert!(c.plan.unwrap().memory.peak_bytes <= full.peak_bytes);
        // Below every candidate: the error lists what was tried.
        r.device_memory = Some(1 << 10);
        let e = compile(&r, &mut std::io::sink()).unwrap_err().to_string();
        assert!(
            e.contains("no training options fit") && e.contains("--checkpoint full"),
            "{e}"
        );
    }

    #[test]
    fn an_open_loss_stays_unfused_where_its_logits_fit_and_fuses_where_they_do_not() {
        let mut train = open_training();
        // The updates inline: beside the compute, the gradients they hold a little longer
        // set this tiny model's peak, not the logits this test is about.
        train.options.update_stream = UpdateStream::Off;
        train.open = Open {
            fused_loss: true,
            ..Open::default()
        };
        let cands = candidates(&train, None);
        assert_eq!(
            cands.iter().map(|o| o.fused_loss).collect::<Vec<_>>(),
            [false, true],
            "the unfused (faster) loss is tried first"
        );
        let mut r = request("", Some(train.clone()));
        let unfused = evaluate(&r, &cands[0]).unwrap();
        let fused = evaluate(&r, &cands[1]).unwrap();
        assert!(fused.peak_bytes < unfused.peak_bytes);
        let c = compile(&r, &mut std::io::sink()).unwrap();
        assert!(!c.train.unwrap().fused_loss, "{:?}", c.choice);
        // Memory for the fused step only: the compiler fuses, and says so.
        r.device_memory = Some(fused.peak_bytes);
        let c = compile(&r, &mut std::io::sink()).unwrap();
        assert!(c.train.unwrap().fused_loss, "{:?}", c.choice);
        // On one rank `fuse` computes the fused loss's gradient with its forward.
        assert!(c.program.nodes().iter().any(|&n| matches!(
            c.program.node(n).op,
            weft_ir::Op::LinearCrossEntropyWithGrad { .. }
        )));
        // A step that returns its gradients keeps the logits: nothing to choose.
        train.options.grad_outputs = true;
        assert_eq!(candidates(&train, None).len(), 1);
    }

    /// The analytic ranking prices a bf16 model's state without master weights in bf16:
    /// two moments of 2 bytes against mixed precision's 12 bytes a parameter; streamed,
    /// most of it leaves the device.
    #[test]
    fn the_ranking_prices_the_state_as_the_options_hold_it() {
        let mut r = request("", Some(open_training()));
        // A llama of 16 small layers in bf16 (the ranking reads only these sizes).
        r.shape = Some(ModelShape {
            name: "llama-16x64".into(),
            layers: 16,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab: 256,
            moe_layers: 0,
            experts: 0,
            top_k: 0,
            expert_ffn: 0,
            tied: false,
            param_bytes: 2,
            layer_windows: Vec::new(),
            single_norms: true,
            logit_softcap: false,
            expert_saved: 3,
        });
        let b = Bindings::new().with("B", 2).with("S", 64);
        let mut o = open_training().options;
        let Some(mixed) = analytic(&r, &b, &o) else {
            panic!("llama-tiny has an analytic shape")
        };
        o.master_weights = false;
        let own = analytic(&r, &b, &o).unwrap();
        assert_eq!(
            own.memory.optimizer * 3,
            mixed.memory.optimizer,
            "{own:?} {mixed:?}"
        );
        assert_eq!(
            mixed.memory.total - own.memory.total,
            mixed.memory.optimizer - own.memory.optimizer
        );
        o.stream_optimizer_state = true;
        let streamed = analytic(&r, &b, &o).unwrap();
        assert!(
            streamed.memory.optimizer < own.memory.optimizer,
            "{streamed:?}"
        );
        assert!(streamed.time.step >= own.time.step);
    }

    /// One rank has no group to shard state over: ZeRO stages past 0 are the same plan
    /// and are ranked (and compiled) once; on dp=2 all four are.
    #[test]
    fn zero_stages_are_ranked_only_where_a_group_shards_them() {
        let mut t = open_training();
        t.open = Open {
            zero: true,
            ..Open::default()
        };
        let stages = |mesh: &str| {
            let r = request(mesh, Some(t.clone()));
            let b = Bindings::new().with("B", 2).with("S", 64);
            let mut z: Vec<u8> = rank(&r, &t, &b)
                .iter()
                .map(|x| x.options.zero_stage())
                .collect();
            z.sort();
            z
        };
        assert_eq!(stages(""), [0]);
        assert_eq!(stages("tp=2"), [0]);
        assert_eq!(stages("dp=2"), [0, 1, 2, 3]);
    }

    #[test]
    fn open_streamed_state_is_taken_where_only_it_fits() {
        let mut train = open_training();
        train.open = Open {
            stream_optimizer_state: true,
            ..Open::default()
        };
        let cands = candidates(&train, None);
        assert_eq!(
            cands
                .iter()
                .map(|o| o.stream_optimizer_state)
                .collect::<Vec<_>>(),
            [false, true],
            "the state on the device first"
        );
        let mut r = request("", Some(train.clone()));
        let resident = evaluate(&r, &cands[0]).unwrap();
        let streamed = evaluate(&r, &cands[1]).unwrap();
        assert!(streamed.peak_bytes < resident.peak_bytes);
        // Memory for the streamed step only: the compiler streams the state, and says so.
        r.device_memory = Some(streamed.peak_bytes);
        let c = compile(&r, &mut std::io::sink()).unwrap();
        assert!(c.train.unwrap().stream_optimizer_state, "{:?}", c.choice);
        assert!(c
            .choice
            .unwrap()
            .chosen
            .contains("--stream-optimizer-state"));
        // Without an optimizer there is no state to stream: nothing to choose.
        train.options.optimizer = None;
        assert_eq!(candidates(&train, None).len(), 1);
    }

    #[test]
    fn an_open_zero_stage_shards_state_before_recomputing() {
        // dp=2 x sp=2: ZeRO shards over four ranks. A limit below the unsharded
        // step's peak but above ZeRO-1's takes a ZeRO stage, not recomputation.
        let mut t = open_training();
        t.open = Open {
            fused_loss: false,
            ..Open::all()
        };
        let mut r = request("dp=2,sp=2", Some(t));
        r.batch = Some(4);
        let cands = candidates(r.train.as_ref().unwrap(), Some(2));
        assert_eq!(
            cands.len(),
            4 * 2 * 3 * 2 * 3,
            "zero x micro-batches x checkpoint x offload x (state on the device, streamed, host optimizer)"
        );
        assert!(cands[..48]
            .iter()
            .all(|o| !o.offload_optimizer && !o.stream_optimizer_state));
        assert!(cands[48..96]
            .iter()
            .all(|o| !o.offload_optimizer && o.stream_optimizer_state));
        assert!(cands[96..]
            .iter()
            .all(|o| o.offload_optimizer && !o.stream_optimizer_state));
        assert_eq!(
            cands
                .iter()
                .map(|o| o.zero_stage())
                .take(4)
                .collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        let plain = evaluate(&r, &cands[0]).unwrap();
        let zero1 = evaluate(&r, &cands[1]).unwrap();
        assert!(
            zero1.peak_bytes < plain.peak_bytes,
            "{} {}",
            zero1.peak_bytes,
            plain.peak_bytes
        );
        r.device_memory = Some(zero1.peak_bytes);
        let c = compile(&r, &mut std::io::sink()).unwrap();
        let chosen = c.train.unwrap();
        assert_eq!(chosen.zero_stage(), 1, "{:?}", c.choice);
        assert_eq!(chosen.checkpoint, CheckpointPolicy::None);
        let choice = c.choice.unwrap();
        assert!(choice.chosen.contains("--zero 1"), "{}", choice.chosen);
        assert_eq!(choice.tried.len(), 2, "{:?}", choice.tried);
    }

    #[test]
    fn given_options_that_do_not_fit_name_what_would() {
        let mut t = open_training();
        t.open = Open::default();
        let mut r = request("sp=2", Some(t));
        let full = {
            let mut o = r.train.as_ref().unwrap().options.clone();
            o.checkpoint = CheckpointPolicy::Full;
            evaluate(&r, &o).unwrap()
        };
        r.device_memory = Some(full.peak_bytes);
        let e = compile(&r, &mut std::io::sink()).unwrap_err().to_string();
        assert!(e.contains("help: --checkpoint"), "{e}");
    }
}

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
//! Training options the request leaves open (`TrainRequest::open`) are chosen as
//! the cheapest set that fits the device memory, tried in a fixed order (checkpoint
//! none, selective, full, then the same with activation offload); options the request
//! gives are kept, and when they do not fit the error says which options would.
//! [`evaluate`] compiles and plans one candidate option set (peak and predicted time),
//! the unit a search over meshes and ZeRO stages reuses.

use crate::lower::plan::{self, LowerError, PlanOptions};
use crate::manager::{Instrumentation, PassManager, RunReport};
use crate::pass::{PassContext, PassError};
use crate::registry::{default_pipeline_explained, Pipeline, Step};
use crate::tp::TpOptions;
use crate::training::{training_steps, CheckpointPolicy, OffloadOptions, TrainOptions};
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
    /// Lower to an [`ExecutionPlan`] (needs concrete sizes).
    pub plan: bool,
    /// The MODEL argument, recorded in the plan.
    pub source: String,
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
            plan: false,
            source: String::new(),
        }
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

/// Training options left unspecified: the driver picks them by memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Open {
    pub checkpoint: bool,
    pub offload: bool,
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
        /// The plan error of the least peak tried (its breakdown and help).
        last: Box<LowerError>,
    },
}

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
    pub step_time_s: f64,
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
    let open = train.open.checkpoint || train.open.offload;
    if !req.plan || bindings.symbols.is_empty() || !open {
        let c = compile_with(req, Some(&train.options), sink, req.memory_limit());
        return match c {
            Err(DriverError::Lower(e)) if matches!(*e, LowerError::OutOfMemory { .. }) => {
                Err(with_what_fits(req, train, *e))
            }
            c => c,
        };
    }
    // Open options: the first candidate that fits, in the order of `candidates`.
    let limit = req.memory_limit();
    let mut tried = Vec::new();
    let mut least: Option<(u64, LowerError)> = None;
    for opts in candidates(train) {
        let e = evaluate(req, &opts)?;
        tried.push(candidate_line(&e, limit));
        if e.fits {
            // Run once more with the caller's instrumentation, so printing and
            // statistics describe the program returned.
            let mut c = compile_with(req, Some(&opts), sink, limit)?;
            c.choice = Some(Choice {
                chosen: opts.summary(),
                why: format!(
                    "the first of checkpoint none, selective, full, then each with --offload (each later one recomputes or copies more) that fits {} per rank",
                    plan::gib(limit)
                ),
                tried,
            });
            return Ok(c);
        }
        if least.as_ref().is_none_or(|(p, _)| e.peak_bytes < *p) {
            let err = out_of_memory(&e, limit);
            least = Some((e.peak_bytes, err));
        }
    }
    let (_, last) = least.expect("at least one candidate");
    Err(DriverError::NoFit {
        limit: plan::gib(limit),
        kind: format!("{} of {}", req.step_kind().name(), req.model.name),
        tried,
        last: Box::new(last),
    })
}

/// Compiles and plans one training option set without a memory limit: the program,
/// its peak per rank, its predicted step time, and whether it fits the request's
/// device memory. Needs concrete sizes.
pub fn evaluate(req: &Request, opts: &TrainOptions) -> Result<Evaluated, DriverError> {
    let mut quiet = req.clone();
    quiet.instrumentation = Instrumentation {
        verify_each: false,
        check_requires: req.instrumentation.check_requires,
        ..Instrumentation::default()
    };
    quiet.plan = true;
    let c = compile_with(&quiet, Some(opts), &mut std::io::sink(), u64::MAX)?;
    let p = c.plan.as_ref().ok_or_else(|| DriverError::Input {
        what: "evaluating training options needs concrete sizes".into(),
        help: Some("give --seq (and --batch)".into()),
    })?;
    let (peak, time) = (p.memory.peak_bytes, p.cost.step_time_s);
    Ok(Evaluated {
        options: opts.clone(),
        fits: peak <= req.memory_limit(),
        compiled: c,
        peak_bytes: peak,
        step_time_s: time,
    })
}

/// The candidate option sets for the open options, cheapest first: checkpoint none,
/// selective, full (where the checkpoint is open), then the same with offload (where
/// offload is open). Given options stay as given.
pub fn candidates(train: &TrainRequest) -> Vec<TrainOptions> {
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
    let mut out = Vec::new();
    for off in &offloads {
        for p in &policies {
            let mut o = train.options.clone();
            o.checkpoint = p.clone();
            o.offload = off.clone();
            out.push(o);
        }
    }
    out
}

fn candidate_line(e: &Evaluated, limit: u64) -> String {
    format!(
        "{}: peak {} per rank, step {:.3} ms predicted{}",
        e.options.summary(),
        plan::gib(e.peak_bytes),
        e.step_time_s * 1e3,
        if e.fits {
            String::new()
        } else {
            format!(" (over {})", plan::gib(limit))
        }
    )
}

fn out_of_memory(e: &Evaluated, limit: u64) -> LowerError {
    let p = e
        .compiled
        .plan
        .as_ref()
        .expect("evaluated candidates have plans");
    LowerError::OutOfMemory {
        peak: e.peak_bytes,
        limit,
        breakdown: p.memory.breakdown.clone(),
        help: "raise tensor parallelism (e.g. tp=2), shard optimizer state (--zero), or give --device-memory".into(),
    }
}

/// The given options do not fit: name the first candidate (all options open) that
/// does, or keep the plan's own help when none does.
fn with_what_fits(req: &Request, train: &TrainRequest, e: LowerError) -> DriverError {
    let mut all = train.clone();
    all.open = Open {
        checkpoint: true,
        offload: true,
    };
    for opts in candidates(&all) {
        if opts == train.options {
            continue;
        }
        if let Ok(ev) = evaluate(req, &opts) {
            if ev.fits {
                if let LowerError::OutOfMemory {
                    peak,
                    limit,
                    breakdown,
                    ..
                } = e
                {
                    return DriverError::from(LowerError::OutOfMemory {
                        peak,
                        limit,
                        breakdown,
                        help: format!(
                            "{} fits (peak {} per rank, step {:.3} ms predicted); or leave --checkpoint and --offload out and the compiler chooses",
                            opts.summary(),
                            plan::gib(ev.peak_bytes),
                            ev.step_time_s * 1e3
                        ),
                    });
                }
            }
        }
    }
    DriverError::from(e)
}

/// One compile with fixed options: the pipeline, the passes, the sizes, the plan.
fn compile_with(
    req: &Request,
    train: Option<&TrainOptions>,
    sink: &mut dyn Write,
    limit: u64,
) -> Result<Compiled, DriverError> {
    let bindings = sizes(&req.mesh, req.batch, req.seq)?;
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
        assert_eq!(
            &t.pipeline.names()[..f.pipeline.steps.len()],
            &f.pipeline.names()[..],
            "the training step starts with the forward pipeline"
        );
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
        let none = evaluate(&r, &candidates(r.train.as_ref().unwrap())[0]).unwrap();
        let full = evaluate(&r, &candidates(r.train.as_ref().unwrap())[2]).unwrap();
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

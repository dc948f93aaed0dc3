//! `weft plan`: the best training plan for a model on a cluster. Searches meshes (dp,
//! sp, tp, ep), ZeRO stage, checkpoint policy, activation and optimizer offload and
//! micro-batches
//! with the analytic model of `weft_passes::search`, compiles the finalists through
//! the compile path (the best of each mesh family first; each compile calibrates the
//! analytic memory and step time of its policy and layout, and one over the limit gives
//! its mesh's next fitting candidate a turn), then the challengers that the corrected
//! step times bring near the best, and ranks them by the compiled plan's predicted step
//! time among those whose compiled peak fits.

use crate::error::{CliError, CliResult};
use std::path::PathBuf;
use weft_passes::search::{self, Candidate, ModelShape, Scored, SearchSpec};

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json or model directory.
    pub model: String,
    /// Number of GPUs.
    #[arg(long)]
    pub gpus: u32,
    /// GPUs per node (NVLink domain); default the device profile's.
    #[arg(long)]
    pub gpus_per_node: Option<u32>,
    /// Device profile: h100, h200, a100 or a JSON file.
    #[arg(long, default_value = "h200")]
    pub device: String,
    /// Sequence length.
    #[arg(long)]
    pub seq: u64,
    /// Global batch in sequences (default: about 4M tokens, at least 1 sequence).
    #[arg(long)]
    pub batch: Option<u64>,
    /// Per-rank device memory the plan must fit, GiB (default the profile's).
    #[arg(long)]
    pub device_memory: Option<f64>,
    /// Pinned host memory per rank the plan may hold, in GiB: offloaded activations and
    /// the host optimizer's state (default: no limit). A node's usable RAM divided by
    /// its GPUs.
    #[arg(long, value_name = "GIB")]
    pub host_memory: Option<f64>,
    /// Rows of the table.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Finalists compiled through the compile path (the best candidate of each mesh
    /// family, by which of cp, sp, tp and ep it uses, first); challengers the compiles'
    /// corrections bring within 2% of the best are compiled besides, up to 4x in all.
    #[arg(long, default_value_t = 3)]
    pub finalists: usize,
    /// Write the best plan (ExecutionPlan JSON) here.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Print every candidate as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Leave context parallelism (`cp`, ring attention) out of the search.
    #[arg(long)]
    pub no_cp: bool,
}

/// The search's view of a parsed model config.
pub fn shape_of(model: &weft_frontends::Model) -> CliResult<ModelShape> {
    let c = model.config.as_ref().ok_or_else(|| {
        CliError::input(format!(
            "`{}` has no config (a .weft or .pt2 program)",
            model.name
        ))
        .with_help("give a preset or a config.json: the search reads layer sizes from it")
    })?;
    use weft_frontends::config::MoeKind;
    let expert_saved = match c.moe.as_ref().map(|m| m.kind) {
        Some(MoeKind::GptOss) => 8,
        Some(MoeKind::Softmax) | None => 3,
    };
    let (moe_layers, experts, top_k, expert_ffn) = match &c.moe {
        Some(m) => (
            (0..c.num_hidden_layers)
                .filter(|&i| c.is_sparse_layer(i))
                .count() as u64,
            m.num_experts as u64,
            m.top_k as u64,
            m.expert_intermediate_size as u64,
        ),
        None => (0, 0, 0, 0),
    };
    Ok(ModelShape {
        name: model.name.clone(),
        layers: c.num_hidden_layers as u64,
        hidden: c.hidden_size as u64,
        heads: c.num_attention_heads as u64,
        kv_heads: c.num_key_value_heads as u64,
        head_dim: c.head_dim as u64,
        ffn: c.intermediate_size as u64,
        vocab: c.vocab_size as u64,
        moe_layers,
        experts,
        top_k,
        expert_ffn,
        tied: c.tie_word_embeddings,
        param_bytes: model.param_dtype.size_bytes(),
        layer_windows: if c.layer_windows.iter().any(Option::is_some) {
            c.layer_windows
                .iter()
                .map(|w| w.map(|w| w as u64))
                .collect()
        } else {
            Vec::new()
        },
        single_norms: c.norm_placement != weft_frontends::config::NormPlacement::Sandwich,
        logit_softcap: c.final_softcap.is_some(),
        expert_saved,
    })
}

/// A compiled finalist: the plan's own peak and step time.
pub struct Compiled {
    pub peak: u64,
    pub step_s: f64,
    pub plan: Option<weft_ir::plan::ExecutionPlan>,
    pub error: Option<String>,
    pub compile_s: f64,
}

impl Compiled {
    /// A finalist that produced no plan, with why (`refused: ...` when the passes
    /// refused its mesh, which the other options do not change).
    fn failed(error: String) -> Compiled {
        Compiled {
            peak: 0,
            step_s: f64::INFINITY,
            plan: None,
            error: Some(error),
            compile_s: 0.0,
        }
    }
}

/// Compiles one candidate through the compile driver (`driver::evaluate`: forward
/// pipeline, training passes, plan lowering). Finalists with micro-batches are compiled for one micro-batch (the
/// peak of a step with accumulation is that of one micro-batch's step; the step time
/// is that step plus the others' forward and backward,
/// `plan::accumulation::micro_batched_step_time`), which keeps compile time bounded.
pub fn evaluate(
    model: &weft_frontends::Model,
    c: &Candidate,
    spec: &SearchSpec,
) -> CliResult<Compiled> {
    let start = std::time::Instant::now();
    let mesh = super::parse_mesh(&c.mesh())?;
    let micro_batch = (spec.batch / c.micro_batches as u64) as i64;
    let mut opts = weft_passes::training::TrainOptions {
        optimizer: Some(weft_passes::training::Optimizer::adamw(1e-4)),
        zero1: c.zero >= 1,
        reduce_scatter: c.zero >= 2,
        zero3: c.zero >= 3,
        offload_optimizer: c.offload_optimizer,
        checkpoint: weft_passes::training::CheckpointPolicy::parse(c.checkpoint)
            .map_err(CliError::input)?,
        grad_outputs: false,
        batch: Some(micro_batch),
        seq: Some(spec.seq as i64),
        ..Default::default()
    };
    if c.offload {
        let device = weft_passes::training::Device(spec.device.clone());
        opts.offload = Some(weft_passes::training::OffloadOptions {
            link_bytes_per_s: device.link_bytes_per_s(),
            device,
            ..Default::default()
        });
    }
    let mut req = weft_passes::driver::Request::new(model.graph.clone(), mesh);
    req.tp = super::shard::tp_options(model, None)?;
    req.batch = Some(micro_batch);
    req.seq = Some(spec.seq as i64);
    req.device = spec.device.clone();
    req.device_memory = Some(spec.device_memory);
    req.host_memory = spec.host_memory;
    req.plan = true;
    req.source = model.name.clone();
    req.cp_kv = c.cp_kv;
    req.instrumentation = weft_passes::Instrumentation {
        verify_each: false,
        check_requires: false,
        ..Default::default()
    };
    let out = match weft_passes::driver::evaluate(&req, &opts) {
        Ok(e) if e.fits => Compiled {
            peak: e.peak_bytes,
            // The gradient reduction and the update run once a step, not per micro-batch.
            step_s: e
                .compiled
                .plan
                .as_ref()
                .map_or(e.step_time_s * c.micro_batches as f64, |p| {
                    weft_passes::plan::accumulation::micro_batched_step_time(p, c.micro_batches)
                }),
            plan: e.compiled.plan,
            error: None,
            compile_s: 0.0,
        },
        Ok(e) => Compiled {
            peak: e.peak_bytes,
            step_s: f64::INFINITY,
            plan: None,
            error: Some(match spec.host_memory {
                Some(h) if e.peak_bytes <= spec.device_memory && e.host_bytes > h => format!(
                    "pins {} GiB of host memory, over --host-memory",
                    gib(e.host_bytes)
                ),
                _ => "does not fit".into(),
            }),
            compile_s: 0.0,
        },
        Err(e) => Compiled::failed(refusal(&e.to_string())),
    };
    Ok(Compiled {
        compile_s: start.elapsed().as_secs_f64(),
        ..out
    })
}

/// Compiles `batch` on up to as many threads as the machine has, results in order. A
/// candidate the passes refuse comes back with the refusal as its error.
fn compile_finalists(
    model: &weft_frontends::Model,
    batch: &[&Scored],
    spec: &SearchSpec,
) -> Vec<Compiled> {
    let one = |s: &Scored| {
        evaluate(model, &s.candidate, spec)
            .unwrap_or_else(|e| Compiled::failed(refusal(&e.to_string())))
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out: Vec<Compiled> = Vec::with_capacity(batch.len());
    for chunk in batch.chunks(threads.max(1)) {
        std::thread::scope(|sc| {
            // A large stack, as the main thread's: the passes recurse over the graph.
            let handles: Vec<_> = chunk
                .iter()
                .map(|s| {
                    std::thread::Builder::new()
                        .stack_size(64 << 20)
                        .spawn_scoped(sc, || one(s))
                })
                .collect();
            for (h, s) in handles.into_iter().zip(chunk) {
                out.push(h.ok().and_then(|h| h.join().ok()).unwrap_or_else(|| {
                    Compiled::failed(format!(
                        "internal error: compiling --mesh {} {} stopped",
                        s.candidate.mesh(),
                        s.candidate.flags()
                    ))
                }));
            }
        });
    }
    out
}

/// The first line of a driver error, as a finalist's refusal.
fn refusal(e: &str) -> String {
    format!("refused: {}", e.lines().next().unwrap_or(""))
}

fn gib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 30) as f64)
}

fn row(s: &Scored) -> Vec<String> {
    let c = &s.candidate;
    let m = &s.memory;
    vec![
        // The all-gather variant of cp is a different plan on the same mesh.
        match c.cp_kv {
            weft_passes::ring_allgather::CpKv::Ring => c.mesh(),
            kv => format!("{} (cp-kv {})", c.mesh(), kv.name()),
        },
        format!("{}", c.zero),
        c.checkpoint.to_string(),
        match (c.offload, c.offload_optimizer) {
            (false, false) => "no".into(),
            (true, false) => "act".into(),
            (false, true) => "optim".into(),
            (true, true) => "act+optim".into(),
        },
        c.micro_batches.to_string(),
        gib(m.total),
        gib(m.host),
        format!(
            "{}/{}/{}/{}/{}",
            gib(m.params),
            gib(m.grads),
            gib(m.optimizer),
            gib(m.activations),
            gib(m.transient)
        ),
        format!("{:.3}", s.time.step),
        format!("{:.0}", s.time.tokens_per_s_per_gpu),
        format!("{:.1}%", s.time.mfu * 100.0),
        format!("{:.3}", s.time.exposed_comm),
    ]
}

/// Why `best` beats `other` (their step times `b`, `o`), from their analytic breakdowns.
fn why(best: &Scored, b: f64, other: &Scored, o: f64) -> String {
    let (bt, ot) = (&best.time, &other.time);
    let d_compute = ot.compute - bt.compute;
    let d_comm = ot.exposed_comm - bt.exposed_comm;
    let main = if d_comm.abs() >= d_compute.abs() {
        format!(
            "exposed communication {:.3} s vs {:.3} s (tp/sp/ep collectives on the critical path, gradient and ZeRO traffic the backward does not hide)",
            bt.exposed_comm, ot.exposed_comm
        )
    } else {
        format!(
            "compute {:.3} s vs {:.3} s (recomputation, micro-batch overheads)",
            bt.compute, ot.compute
        )
    };
    let mem = format!(
        "; peak {} vs {} GiB analytic",
        gib(best.memory.total),
        gib(other.memory.total)
    );
    format!(
        "--mesh {} {} takes {:.3} s a step, {:.1}% less than --mesh {} {} ({:.3} s): {main}{mem}",
        best.candidate.mesh(),
        best.candidate.flags(),
        b,
        (1.0 - b / o) * 100.0,
        other.candidate.mesh(),
        other.candidate.flags(),
        o,
    )
}

/// How much slower (analytic) than the best a mesh family's best candidate may be and
/// still be compiled among the first finalists: the analytic model ranks families
/// less surely than candidates within one (for llama3.1-405b on 1024 GPUs it put the
/// tp=8 meshes 1.6x behind the others while their compiled steps were about even).
const FAMILY_SLACK: f64 = 2.0;

/// A mesh's family: which of cp, sp, tp and ep it uses.
fn mesh_family(c: &Candidate) -> (bool, bool, bool, bool) {
    (c.cp > 1, c.sp > 1, c.tp > 1, c.ep > 1)
}

/// The fitting candidates (best analytic first) reordered so that the best of each
/// mesh family (which of cp, sp, tp and ep it uses) within [`FAMILY_SLACK`] of the
/// best comes first, in analytic order, then the rest: the finalists then cover the
/// families the compiled plans can tell apart, not only near-copies of one mesh.
pub fn diverse_first(fitting: Vec<&Scored>) -> Vec<&Scored> {
    let Some(best) = fitting.first().map(|s| s.time.step) else {
        return fitting;
    };
    let mut seen = std::collections::BTreeSet::new();
    let (mut first, mut rest) = (Vec::new(), Vec::new());
    for s in fitting {
        if s.time.step <= best * FAMILY_SLACK && seen.insert(mesh_family(&s.candidate)) {
            first.push(s);
        } else {
            rest.push(s);
        }
    }
    first.extend(rest);
    first
}

/// Compiled over analytic peak, learned from the compiled finalists. The analytic
/// model's memory error follows the memory policy (checkpointing, activation and
/// optimizer offload) more than the mesh: `none` with `--offload` is priced as if every
/// layer's activations left the device (70B on 64 GPUs: 52 GiB priced, 433 compiled).
/// A candidate is calibrated by its own mesh and policy when one compiled, else by the
/// largest ratio its policy showed on any mesh, else not at all. The step time is
/// calibrated too (compiled over analytic step, [`Calibration::step`]).
#[derive(Default)]
struct Calibration {
    exact: std::collections::BTreeMap<(String, Policy), f64>,
    by_policy: std::collections::BTreeMap<Policy, f64>,
    /// Every compiled finalist's step time over its analytic one.
    times: Vec<(Candidate, f64)>,
}

/// A candidate's memory policy: checkpointing, activation offload, optimizer offload.
type Policy = (&'static str, bool, bool);

impl Calibration {
    fn policy(c: &Candidate) -> Policy {
        (c.checkpoint, c.offload, c.offload_optimizer)
    }
    fn record(&mut self, c: &Candidate, ratio: f64) {
        for e in [
            self.exact
                .entry((c.mesh(), Self::policy(c)))
                .or_insert(ratio),
            self.by_policy.entry(Self::policy(c)).or_insert(ratio),
        ] {
            *e = e.max(ratio);
        }
    }
    fn factor(&self, c: &Candidate) -> f64 {
        let policy = Self::policy(c);
        self.exact
            .get(&(c.mesh(), policy))
            .or_else(|| self.by_policy.get(&policy))
            .copied()
            .unwrap_or(1.0)
    }
    fn fits(&self, s: &Scored, limit: u64) -> bool {
        search::fits_calibrated(s, self.factor(&s.candidate), limit)
    }
    /// A compiled finalist's step time over its analytic one.
    fn record_time(&mut self, c: &Candidate, ratio: f64) {
        if ratio.is_finite() && ratio > 0.0 {
            self.times.push((c.clone(), ratio));
        }
    }
    /// The analytic step time of `s` as the compiled finalists have corrected it: its
    /// own ratio if it compiled, else the mean ratio of its memory policy (of every
    /// finalist when none of that policy compiled) times how far finalists with the
    /// same model-parallel layout (cp, sp, tp, ep and the cp exchange, any dp) stood
    /// from their own policy's mean. The analytic model's errors follow both: the
    /// policy's recompute and copies, the layout's collectives (llama3-70b on 64 GPUs:
    /// compiled over analytic 1.10 for dp=32,cp=2 and 1.12 for dp=16,cp=4 with
    /// selective + offload, 1.18 for dp=16,sp=4 and 1.19 for dp=16,cp=2,sp=2 with
    /// `none` + offload).
    fn step(&self, s: &Scored) -> f64 {
        let c = &s.candidate;
        if let Some((_, r)) = self.times.iter().find(|(t, _)| t == c) {
            return s.time.step * r;
        }
        let policy_mean = |p: Policy| {
            mean(
                self.times
                    .iter()
                    .filter(|(t, _)| Self::policy(t) == p)
                    .map(|x| x.1),
            )
            .or_else(|| mean(self.times.iter().map(|x| x.1)))
            .unwrap_or(1.0)
        };
        let layout = |t: &Candidate| (t.cp, t.sp, t.tp, t.ep, t.cp_kv);
        let layout_factor = mean(
            self.times
                .iter()
                .filter(|(t, _)| layout(t) == layout(c))
                .map(|(t, r)| r / policy_mean(Self::policy(t))),
        )
        .unwrap_or(1.0);
        s.time.step * policy_mean(Self::policy(c)) * layout_factor
    }
}

/// The mean of `values`, `None` when there are none.
fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// After a finalist compiled over the memory limit: the next candidate of its mesh that
/// fits under its calibration goes to the front of `pending`, so the mesh is still
/// represented when the analytic model was short on the failed option set
/// (qwen3-30b-a3b on 32 GPUs: dp=32 with selective
/// checkpointing and offload was priced at 79 GiB and compiled at 110, while dp=32 with
/// full checkpointing, 51 GiB priced, was the fastest plan that fits). Returns the
/// promoted candidate.
fn promote_on_mesh(
    pending: &mut std::collections::VecDeque<&Scored>,
    mesh: &str,
    calibration: &Calibration,
    limit: u64,
) -> Option<Candidate> {
    let i = pending
        .iter()
        .position(|s| s.candidate.mesh() == mesh && calibration.fits(s, limit))?;
    let s = pending.remove(i)?;
    pending.push_front(s);
    Some(s.candidate.clone())
}

/// The most GPUs `weft plan` searches over.
const MAX_GPUS: u32 = 1 << 16;

/// The most finalists `weft plan` compiles before challengers (each compile takes up to
/// tens of seconds on the largest meshes; challengers add up to three times as many).
const MAX_FINALISTS: usize = 64;

/// How close to the best compiled step a candidate's calibrated analytic time must come
/// for it to be compiled as a challenger: the analytic model ranks meshes of one policy
/// only to a few percent (llama3-70b on 64 GPUs: dp=16,sp=4 priced 1.1% slower than
/// dp=32,cp=2 with selective + offload, compiled 0.9% faster).
const CHALLENGER_SLACK: f64 = 0.02;

/// The finalists' search state: what compiled, what the compiles taught, and the
/// candidates still waiting.
struct Finalists<'a> {
    calibration: Calibration,
    compiled: Vec<(&'a Scored, Compiled)>,
    /// Meshes the passes refused (the other options do not change that).
    refused: std::collections::BTreeSet<String>,
    /// Meshes whose failed finalist had a successor promoted (once per mesh), and the
    /// promoted candidates, which count toward neither bound on the finalists.
    promoted_meshes: std::collections::BTreeSet<String>,
    promoted: std::collections::BTreeSet<Candidate>,
    pending: std::collections::VecDeque<&'a Scored>,
    limit: u64,
}

impl<'a> Finalists<'a> {
    fn ranked(&self) -> impl Iterator<Item = &(&'a Scored, Compiled)> {
        self.compiled
            .iter()
            .filter(|(s, _)| !self.promoted.contains(&s.candidate))
    }
    fn ranked_tried(&self) -> usize {
        self.ranked().count()
    }
    fn ranked_fitting(&self) -> usize {
        self.ranked().filter(|(_, c)| c.plan.is_some()).count()
    }
    /// The least compiled step time among the plans that fit.
    fn best_step(&self) -> Option<f64> {
        self.compiled
            .iter()
            .filter(|(_, c)| c.plan.is_some())
            .map(|(_, c)| c.step_s)
            .min_by(f64::total_cmp)
    }
    /// Whether a pending candidate may still fit and its mesh was not refused.
    fn eligible(&self, s: &Scored) -> bool {
        !self.refused.contains(&s.candidate.mesh()) && self.calibration.fits(s, self.limit)
    }
    /// Compiles `batch` (each candidate with the note its line ends with), learns from
    /// each result and says what compiled.
    fn compile(
        &mut self,
        model: &weft_frontends::Model,
        batch: Vec<(&'a Scored, String)>,
        spec: &SearchSpec,
    ) {
        let (batch, notes): (Vec<&Scored>, Vec<String>) = batch.into_iter().unzip();
        let results = compile_finalists(model, &batch, spec);
        for ((s, c), note) in batch.into_iter().zip(results).zip(notes) {
            let mesh = s.candidate.mesh();
            if c.error.as_deref().is_some_and(|e| e.starts_with("refused")) {
                self.refused.insert(mesh.clone());
            }
            if c.peak > 0 && s.memory.total > 0 {
                self.calibration
                    .record(&s.candidate, c.peak as f64 / s.memory.total as f64);
                if c.plan.is_none() && self.promoted_meshes.insert(mesh.clone()) {
                    if let Some(p) =
                        promote_on_mesh(&mut self.pending, &mesh, &self.calibration, self.limit)
                    {
                        self.promoted.insert(p);
                    }
                }
            }
            if c.plan.is_some() && s.time.step > 0.0 {
                self.calibration
                    .record_time(&s.candidate, c.step_s / s.time.step);
            }
            eprintln!(
                "  compiled --mesh {mesh} {}: {} in {:.1} s{note}",
                s.candidate.flags(),
                match &c.error {
                    None => format!("peak {} GiB, step {:.3} s", gib(c.peak), c.step_s),
                    Some(e) => format!("{e} (peak {} GiB)", gib(c.peak)),
                },
                c.compile_s,
            );
            self.compiled.push((s, c));
        }
    }
}

pub fn run(a: Args) -> CliResult {
    let start = std::time::Instant::now();
    if let Some(out) = &a.output {
        let mut inputs = vec![("MODEL", std::path::Path::new(&a.model))];
        inputs.extend(super::device_file(&a.device).map(|p| ("--device", p)));
        super::refuse_overwrite(out, &inputs)?;
    }
    let model = super::load_model(&a.model)?;
    let shape = shape_of(&model)?;
    let device = weft_passes::plan::profile::load(&a.device).map_err(CliError::input)?;
    if !(1..=MAX_FINALISTS).contains(&a.finalists) {
        return Err(CliError::input(format!(
            "invalid --finalists {}: must be between 1 and {MAX_FINALISTS}",
            a.finalists
        )));
    }
    if a.gpus_per_node == Some(0) {
        return Err(CliError::input(
            "invalid --gpus-per-node 0: must be at least 1",
        ));
    }
    if a.gpus == 0 || a.gpus > MAX_GPUS {
        return Err(CliError::input(format!(
            "invalid --gpus {}: must be between 1 and {MAX_GPUS}",
            a.gpus
        )));
    }
    let batch = a
        .batch
        .unwrap_or_else(|| ((1u64 << 22) / a.seq.max(1)).max(1));
    use weft_passes::bindings::{MAX_BATCH, MAX_SEQ};
    for (flag, v, max) in [("--batch", batch, MAX_BATCH), ("--seq", a.seq, MAX_SEQ)] {
        if v == 0 || v > max as u64 {
            return Err(CliError::input(format!(
                "invalid {flag} {v}: must be between 1 and {max}"
            )));
        }
    }
    let mem_gib = a.device_memory.unwrap_or(device.memory_gib);
    if !(mem_gib > 0.0) {
        return Err(CliError::input(format!(
            "invalid --device-memory {mem_gib}: must be positive GiB"
        )));
    }
    let peak_flops = search::peak_flops(&device);
    let spec = SearchSpec {
        gpus: a.gpus,
        gpus_per_node: a.gpus_per_node.unwrap_or(device.gpus_per_node).max(1),
        seq: a.seq,
        batch,
        device_memory: (mem_gib * (1u64 << 30) as f64) as u64,
        host_memory: super::gib_limit("--host-memory", a.host_memory)?,
        device,
        peak_flops,
        grad_outputs: false,
    };
    let mut all = search::search(&shape, &spec);
    if a.no_cp {
        all.retain(|s| s.candidate.cp <= 1);
    }
    if all.is_empty() {
        return Err(CliError::input(format!(
            "no mesh of {} GPUs splits {} at seq {} and batch {batch}: tp must divide the heads ({}), the kv heads ({}, or be a multiple of them) and the vocabulary ({}) within a node ({} GPUs), sp the heads left, sp (2 x cp x sp with cp) the sequence, and dp the batch",
            a.gpus,
            shape.name,
            a.seq,
            shape.heads,
            shape.kv_heads,
            shape.vocab,
            spec.gpus_per_node
        ))
        .with_help("use a GPU count with more divisors (a power of two), or a --batch that the data-parallel degree divides"));
    }
    let fitting = all.iter().filter(|s| s.fits).count();
    let searched = start.elapsed().as_secs_f64();
    if a.json {
        let v: Vec<serde_json::Value> = all
            .iter()
            .map(|s| {
                serde_json::json!({
                    "mesh": s.candidate.mesh(),
                    "zero": s.candidate.zero,
                    "checkpoint": s.candidate.checkpoint,
                    "offload": s.candidate.offload,
                    "offload_optimizer": s.candidate.offload_optimizer,
                    "micro_batches": s.candidate.micro_batches,
                    "cp_kv": s.candidate.cp_kv.name(),
                    "fits": s.fits,
                    "memory": s.memory,
                    "time": s.time,
                })
            })
            .collect();
        print!("{}", super::json(&v));
    }
    eprintln!(
        "weft plan: {} ({:.2}B params, {:.2}B active) on {} x {} ({} per node), seq {}, batch {} ({} tokens), {:.0} GiB per GPU{}",
        shape.name,
        shape.params() as f64 / 1e9,
        shape.active_params() as f64 / 1e9,
        a.gpus,
        spec.device.name,
        spec.gpus_per_node,
        a.seq,
        batch,
        batch * a.seq,
        mem_gib,
        spec.host_memory
            .map(|h| format!(", {} GiB of host memory per GPU", gib(h)))
            .unwrap_or_default()
    );
    eprintln!(
        "searched {} candidates analytically in {:.1} ms: {} fit",
        all.len(),
        searched * 1e3,
        fitting
    );
    if fitting == 0 {
        // Over the host limit only: the least host memory among those that fit the device.
        let device_fits = all
            .iter()
            .filter(|s| s.memory.total <= spec.device_memory)
            .min_by_key(|s| s.memory.host);
        if let (Some(least), Some(h)) = (device_fits, spec.host_memory) {
            return Err(CliError::input(format!(
                "no plan fits {mem_gib:.0} GiB per GPU within --host-memory {} GiB: the plans that fit the device pin at least {} GiB of host memory per GPU ({} {})",
                gib(h),
                gib(least.memory.host),
                least.candidate.mesh(),
                least.candidate.flags(),
            ))
            .with_help("give more --host-memory, use more GPUs, a shorter --seq or a smaller --batch"));
        }
        let least = &all[0];
        return Err(CliError::input(format!(
            "no plan fits {mem_gib:.0} GiB per GPU: the smallest, {} {}, needs {} GiB",
            least.candidate.mesh(),
            least.candidate.flags(),
            gib(least.memory.total)
        ))
        .with_help("use more GPUs, a shorter --seq or a smaller --batch"));
    }
    let mut rows = vec![[
        "mesh",
        "zero",
        "ckpt",
        "offload",
        "micro",
        "peak GiB",
        "host GiB",
        "params/grads/optim/act/tmp",
        "step s",
        "tok/s/GPU",
        "MFU",
        "exposed s",
    ]
    .map(String::from)
    .to_vec()];
    rows.extend(all.iter().filter(|s| s.fits).take(a.top).map(row));
    eprintln!(
        "top candidates (analytic estimate):\n{}",
        super::table(rows)
    );
    // Finalists: the best analytic candidates, compiled. Each compilation calibrates
    // the analytic memory and step time of its mesh and memory policy
    // ([`Calibration`]); candidates that cannot fit under that calibration are skipped.
    let limit = spec.device_memory;
    let want = a.finalists;
    let mut f = Finalists {
        calibration: Calibration::default(),
        compiled: Vec::new(),
        refused: Default::default(),
        promoted_meshes: Default::default(),
        promoted: Default::default(),
        pending: diverse_first(all.iter().filter(|s| s.fits).collect()).into(),
        limit,
    };
    // Finalists are compiled `want` at a time, on as many threads as the machine has:
    // which candidates are compiled depends only on the batch size, not on the cores.
    while !f.pending.is_empty() {
        let (ok, tried) = (f.ranked_fitting(), f.ranked_tried());
        if ok >= want || tried >= want * 4 {
            break;
        }
        let room = (want - ok).min(want * 4 - tried);
        let mut batch: Vec<(&Scored, String)> = Vec::new();
        while let Some(s) = f.pending.pop_front() {
            if !f.eligible(s) {
                continue;
            }
            batch.push((s, String::new()));
            if batch.len() == room {
                break;
            }
        }
        f.compile(&model, batch, &spec);
    }
    // Challengers: while candidates not compiled yet would come within
    // [`CHALLENGER_SLACK`] of the best compiled step once their analytic time is
    // corrected as the finalists' were, the `want` most promising are compiled too,
    // within the same cap.
    loop {
        let tried = f.ranked_tried();
        let Some(best) = f.best_step() else { break };
        if tried >= want * 4 {
            break;
        }
        let mut challengers: Vec<(usize, f64)> = f
            .pending
            .iter()
            .enumerate()
            .filter(|(_, s)| f.eligible(s))
            .map(|(i, s)| (i, f.calibration.step(s)))
            .filter(|(_, t)| *t < best * (1.0 + CHALLENGER_SLACK))
            .collect();
        challengers.sort_by(|x, y| x.1.total_cmp(&y.1).then(x.0.cmp(&y.0)));
        challengers.truncate(want.min(want * 4 - tried));
        if challengers.is_empty() {
            break;
        }
        let batch = challengers
            .iter()
            .map(|&(i, t)| {
                (
                    f.pending[i],
                    format!(" (challenger: {t:.3} s as calibrated)"),
                )
            })
            .collect();
        let mut taken: Vec<usize> = challengers.iter().map(|c| c.0).collect();
        taken.sort_unstable_by(|x, y| y.cmp(x));
        for i in taken {
            f.pending.remove(i);
        }
        f.compile(&model, batch, &spec);
    }
    let Finalists {
        calibration,
        compiled,
        refused,
        ..
    } = f;
    let mut fit: Vec<&(&Scored, Compiled)> =
        compiled.iter().filter(|(_, c)| c.plan.is_some()).collect();
    fit.sort_by(|x, y| {
        x.1.step_s
            .total_cmp(&y.1.step_s)
            .then(x.0.candidate.cmp(&y.0.candidate))
    });
    let Some((best, plan)) = fit.first().map(|x| (x.0, &x.1)) else {
        return Err(CliError::input(format!(
            "none of the {} finalists fits after compilation",
            compiled.len()
        ))
        .with_help("raise --finalists or --device-memory"));
    };
    // With --json, stdout holds the candidates only.
    let say = |line: String| {
        if a.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    say(format!(
        "best: --mesh {} {} (peak {} GiB compiled, step {:.3} s predicted, {:.0} tok/s/GPU, MFU {:.1}%, exposed communication {:.3} s analytic)",
        best.candidate.mesh(),
        best.candidate.flags(),
        gib(plan.peak),
        plan.step_s,
        (batch * a.seq) as f64 / plan.step_s / a.gpus as f64,
        best.time.mfu * best.time.step / plan.step_s * 100.0,
        best.time.exposed_comm,
    ));
    // Why: against the next compiled finalist, else the best analytic other mesh that
    // fits (compiled and fitting, or not compiled and fitting as calibrated).
    let fits = |s: &Scored| match compiled.iter().find(|(c, _)| c.candidate == s.candidate) {
        Some((_, c)) => c.plan.is_some(),
        None => !refused.contains(&s.candidate.mesh()) && calibration.fits(s, spec.device_memory),
    };
    let other = fit.get(1).map(|x| (x.0, x.1.step_s)).or_else(|| {
        search::rival(&all, &best.candidate, fits)
            .map(|s| (s, s.time.step * plan.step_s / best.time.step))
    });
    match other {
        Some((o, o_step)) => say(format!("why: {}", why(best, plan.step_s, o, o_step))),
        None => say(format!(
            "why: --mesh {} {} is the only mesh that fits {} GiB per GPU (compiled, or analytic with the compiled peaks' calibration)",
            best.candidate.mesh(),
            best.candidate.flags(),
            gib(spec.device_memory)
        )),
    }
    if let (Some(path), Some(p)) = (&a.output, &plan.plan) {
        super::write_out(Some(path), &p.to_json())?;
    }
    eprintln!("weft plan took {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compiled finalist's memory ratio calibrates its own mesh and policy, and its
    /// policy on other meshes (the largest ratio seen for it); other policies stay
    /// uncalibrated.
    #[test]
    fn calibration_follows_the_memory_policy() {
        let c = |dp: u32, sp: u32, checkpoint: &'static str, offload: bool| Candidate {
            dp,
            sp,
            zero: 3,
            checkpoint,
            offload,
            ..Default::default()
        };
        let mut cal = Calibration::default();
        cal.record(&c(64, 1, "none", true), 8.0);
        cal.record(&c(32, 2, "none", true), 6.0);
        assert_eq!(cal.factor(&c(64, 1, "none", true)), 8.0);
        assert_eq!(cal.factor(&c(32, 2, "none", true)), 6.0);
        assert_eq!(cal.factor(&c(16, 4, "none", true)), 8.0);
        assert_eq!(cal.factor(&c(64, 1, "none", false)), 1.0);
        assert_eq!(cal.factor(&c(64, 1, "selective", true)), 1.0);
    }

    /// A candidate's step is corrected by its own compiled ratio, else by its policy's
    /// mean ratio times how far its layout's finalists stood from their policies' means.
    #[test]
    fn step_calibration_combines_the_policy_and_the_layout() {
        let c = |dp: u32, sp: u32, checkpoint: &'static str| Candidate {
            dp,
            sp,
            zero: 3,
            checkpoint,
            offload: true,
            ..Default::default()
        };
        let scored = |c: Candidate| Scored {
            candidate: c,
            memory: Default::default(),
            time: search::TimeBreakdown {
                step: 10.0,
                ..Default::default()
            },
            fits: true,
        };
        let mut cal = Calibration::default();
        assert_eq!(cal.step(&scored(c(16, 4, "selective"))), 10.0);
        cal.record_time(&c(32, 2, "selective"), 1.1);
        cal.record_time(&c(16, 4, "none"), 1.2);
        cal.record_time(&c(8, 8, "none"), 1.3);
        // Compiled: its own ratio.
        assert!((cal.step(&scored(c(16, 4, "none"))) - 12.0).abs() < 1e-9);
        // Selective on sp=4: selective's mean (1.1) times sp=4's standing among `none`
        // finalists (1.2 / 1.25).
        let want = 10.0 * 1.1 * 1.2 / 1.25;
        assert!((cal.step(&scored(c(16, 4, "selective"))) - want).abs() < 1e-9);
        // A policy never compiled takes every finalist's mean; a new layout stands at 1.
        let full = cal.step(&scored(c(4, 16, "full")));
        assert!((full - 10.0 * 3.6 / 3.0).abs() < 1e-9, "{full}");
    }

    /// The first finalists are the best candidate of each mesh family within the
    /// slack, in analytic order; every candidate is still there once.
    #[test]
    fn finalists_cover_mesh_families_first() {
        let model = super::super::load_model("llama3-8b").unwrap();
        let shape = shape_of(&model).unwrap();
        let device = weft_passes::plan::profile::load("h100").unwrap();
        let spec = SearchSpec {
            gpus: 16,
            gpus_per_node: 8,
            seq: 32768,
            batch: 16,
            device_memory: 80 << 30,
            host_memory: None,
            peak_flops: search::peak_flops(&device),
            device,
            grad_outputs: false,
        };
        let all = search::search(&shape, &spec);
        let fitting: Vec<&Scored> = all.iter().filter(|s| s.fits).collect();
        let ordered = diverse_first(fitting.clone());
        assert_eq!(ordered.len(), fitting.len());
        let family = |s: &Scored| mesh_family(&s.candidate);
        let best = fitting[0].time.step;
        let mut leaders: Vec<&Scored> = Vec::new();
        for s in &fitting {
            if s.time.step <= best * FAMILY_SLACK && leaders.iter().all(|l| family(l) != family(s))
            {
                leaders.push(s);
            }
        }
        assert!(leaders.len() > 1, "one family only: nothing to diversify");
        for (got, want) in ordered.iter().zip(&leaders) {
            assert_eq!(got.candidate, want.candidate);
        }
        assert_ne!(family(ordered[0]), family(ordered[1]));
    }
}

//! What `eval` and `check` share: weights (given, found beside the config, or drawn
//! from a seed), inputs (given or drawn), compiling the parallel program for a mesh,
//! and running a graph on the CPU reference runtime.

use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use weft_frontends::Model;
use weft_ir::{DType, Graph, HostTensor, Mesh, Op};
use weft_runtime::cpu::{self, Precision, RunOptions, RunResult};

/// Options every command that runs a model takes.
#[derive(clap::Args, Clone)]
pub struct RunArgs {
    /// Preset name, config.json or model directory, torch.export .pt2, .weft file, or
    /// a plan .json.
    pub model: String,
    /// Weights (safetensors, or an index json / directory of shards). Default: the
    /// model directory's model.safetensors if there is one, else seeded random weights.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Inputs: safetensors with `input_ids` and `labels` (i64 [B, S]). Default: drawn
    /// from --seed with --batch and --seq.
    #[arg(long)]
    pub inputs: Option<PathBuf>,
    /// Mesh axes outermost first, e.g. `dp=2,sp=4` (empty: one rank).
    #[arg(long, default_value = "")]
    pub mesh: String,
    /// Global batch size of drawn inputs (default: 2 per data-parallel rank).
    #[arg(long)]
    pub batch: Option<i64>,
    /// Sequence length of drawn inputs (default: 8 per sequence-parallel rank).
    #[arg(long)]
    pub seq: Option<i64>,
    /// Seed for random weights and inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Comma-separated forward pass names instead of the mesh's default pipeline.
    #[arg(long)]
    pub passes: Option<String>,
    /// For a .pt2 MODEL: the HF config.json, for what the export cannot tell (Llama 3 rope scaling).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Float precision of the reference runtime: f32 or f64.
    #[arg(long, default_value = "f64")]
    pub precision: String,
    /// DeepSpeed `tensor_parallel.partition_config` JSON: layer specs for tp meshes.
    #[arg(long, value_name = "FILE")]
    pub tp_spec: Option<PathBuf>,
    #[command(flatten)]
    pub train: super::train::TrainArgs,
}

impl RunArgs {
    /// The files this command reads (MODEL, --weights, --inputs, --config, --tp-spec),
    /// for refusing an output that would overwrite one.
    pub fn input_paths(&self) -> Vec<(&'static str, &Path)> {
        let mut out: Vec<(&'static str, &Path)> = vec![("MODEL", Path::new(&self.model))];
        let named = [
            ("--weights", &self.weights),
            ("--inputs", &self.inputs),
            ("--config", &self.config),
            ("--tp-spec", &self.tp_spec),
        ];
        for (what, p) in named {
            if let Some(p) = p {
                out.push((what, p.as_path()));
            }
        }
        out
    }
}

pub struct Session {
    /// The unsharded model (for a plan: rebuilt from the MODEL it was compiled from).
    pub model: Model,
    /// The program of a plan given as MODEL; `None` compiles the model for `mesh`.
    pub precompiled: Option<Graph>,
    pub mesh: Mesh,
    pub weights: BTreeMap<String, HostTensor>,
    pub inputs: BTreeMap<String, HostTensor>,
    pub precision: Precision,
    /// Where the weights came from, for reports.
    pub weights_from: String,
    /// `--tp-spec`.
    pub tp_spec: Option<PathBuf>,
    /// `--fuse`: run the `fuse` pass last.
    pub fuse: bool,
    /// `--cp-kv`: how `ring-lower` moves k/v between the cp ranks.
    pub cp_kv: weft_passes::ring_allgather::CpKv,
}

impl Session {
    pub fn new(a: &RunArgs) -> CliResult<Session> {
        let mut mesh = super::parse_mesh(&a.mesh)?;
        let mut archive_weights = None;
        let (model, precompiled) = match read_plan(&a.model)? {
            Some(plan) => {
                let program = weft_ir::parse(&plan.program).map_err(|e| {
                    CliError::input(format!("the program of plan {}: {e}", a.model))
                })?;
                if !a.mesh.is_empty() && mesh != plan.mesh {
                    return Err(CliError::input(format!(
                        "--mesh {mesh} differs from the mesh {} plan {} was compiled for",
                        plan.mesh, a.model
                    )));
                }
                mesh = plan.mesh.clone();
                if plan.source.is_empty() {
                    return Err(CliError::input(format!(
                        "plan {} does not record the model it was compiled from",
                        a.model
                    )));
                }
                (super::load_model(&plan.source)?, Some(program))
            }
            None => {
                let (m, imported) = super::load_model_and_weights(&a.model, a.config.as_deref())?;
                archive_weights = imported.map(|i| i.weights);
                (m, None)
            }
        };
        let precision = match a.precision.as_str() {
            "f32" => Precision::F32,
            "f64" => Precision::F64,
            p => {
                return Err(CliError::input(format!("invalid --precision `{p}`"))
                    .with_help("use f32 or f64"))
            }
        };
        let checkpoint = a.weights.clone().or_else(|| {
            if archive_weights.is_some() {
                None
            } else {
                model.dir().and_then(find_checkpoint)
            }
        });
        let (weights, weights_from) = match checkpoint {
            None if archive_weights.is_some() => (
                archive_weights.take().unwrap_or_default(),
                format!("from the archive {}", a.model),
            ),
            Some(w) => (load_weights(&model, &w)?, w.display().to_string()),
            None => {
                check_host_memory(&model)?;
                (
                    draw_random_weights(&model, a.seed),
                    format!("random (seed {})", a.seed),
                )
            }
        };
        weft_passes::bindings::check_batch_seq(a.batch, a.seq).map_err(CliError::input)?;
        let inputs_from = match &a.inputs {
            Some(p) => p.display().to_string(),
            None => "the drawn inputs".to_string(),
        };
        let inputs = match &a.inputs {
            Some(p) => {
                let t = read_inputs(p)?;
                let shape = &t["input_ids"].shape;
                for (flag, given, have) in
                    [("--batch", a.batch, shape[0]), ("--seq", a.seq, shape[1])]
                {
                    if given.is_some_and(|g| g != have as i64) {
                        return Err(CliError::input(format!(
                            "{flag} {} differs from --inputs {}, whose input_ids are {shape:?}",
                            given.unwrap_or(0),
                            p.display()
                        ))
                        .with_help(format!(
                            "drop {flag} (the inputs fix it) or give inputs of that size"
                        )));
                    }
                }
                t
            }
            None => {
                let (db, ds) = weft_passes::driver::default_run_sizes(&mesh);
                let batch = a.batch.unwrap_or(db);
                let seq = a.seq.unwrap_or(ds);
                if batch <= 0 || seq <= 0 {
                    return Err(CliError::input(format!(
                        "invalid --batch {batch} / --seq {seq}: must be positive"
                    )));
                }
                check_run_memory(&model.graph, batch, seq, true)?;
                draw_inputs(
                    vocab_size(&model.graph)?,
                    batch as usize,
                    seq as usize,
                    a.seed,
                )
            }
        };
        check_extra_inputs(&model.graph, &inputs, &inputs_from, &[])?;
        check_labels(&model.graph, &inputs, &inputs_from)?;
        Ok(Session {
            model,
            precompiled,
            mesh,
            weights,
            inputs,
            precision,
            weights_from,
            tp_spec: a.tp_spec.clone(),
            fuse: a.train.fuse(),
            cp_kv: a.train.cp_kv()?,
        })
    }

    /// The program for the session's mesh through the driver: the forward pipeline (or
    /// `passes`), then for `train` the training passes it asks for, at the inputs'
    /// sizes. A plan given as MODEL is its program; a forward plan asked for a
    /// training step gets the training passes on top.
    pub fn compile(
        &self,
        passes: Option<&str>,
        train: Option<weft_passes::driver::TrainRequest>,
    ) -> CliResult<Graph> {
        let (b, s) = self.input_sizes()?;
        let mut req = super::request(&self.model, &self.mesh, self.tp_spec.as_deref(), "")?;
        req.batch = Some(b);
        req.seq = Some(s);
        req.passes = super::parse_passes(passes)?;
        req.fuse = self.fuse;
        req.cp_kv = self.cp_kv;
        if let Some(p) = &self.precompiled {
            let is_training =
                weft_ir::plan::StepKind::of_outputs(p.outputs().iter().map(|(n, _)| n.as_str()))
                    == weft_ir::plan::StepKind::Training;
            if train.is_none() || is_training {
                let bind = weft_passes::driver::sizes(&self.mesh, Some(b), Some(s))
                    .map_err(super::driver_err)?;
                weft_passes::check_bindings(p, &bind).map_err(crate::fail)?;
                return Ok(p.clone());
            }
            // The plan's program is the forward already: only the training passes run.
            req.model = p.clone();
            req.passes = Some(weft_passes::Pipeline::default());
            req.instrumentation.check_requires = false;
        }
        req.train = train;
        weft_passes::driver::compile(&req, &mut std::io::sink())
            .map(|c| c.program)
            .map_err(super::driver_err)
    }

    /// `(B, S)` of the inputs.
    pub fn input_sizes(&self) -> CliResult<(i64, i64)> {
        let ids = self
            .inputs
            .get("input_ids")
            .ok_or_else(|| CliError::input("the inputs have no `input_ids`"))?;
        match ids.shape.as_slice() {
            [b, s] => Ok((*b as i64, *s as i64)),
            other => Err(CliError::input(format!(
                "`input_ids` must be [batch, seq], got {other:?}"
            ))),
        }
    }

    /// Runs `g` on the CPU reference runtime.
    pub fn run(&self, g: &Graph, grads: bool) -> CliResult<RunResult> {
        let (b, s) = self.input_sizes()?;
        let opts = RunOptions::new(self.precision)
            .with_grads(grads)
            .bind("B", b)
            .bind("S", s);
        // A training step with an optimizer: its first step, from fresh optimizer state.
        let state = weft_passes::optimizer::initial_state(g, &self.weights)
            .map_err(|m| CliError::input(format!("optimizer state: {m}")))?;
        if !state.is_empty()
            || g.inputs()
                .iter()
                .any(|(n, _, _)| n == weft_passes::optimizer::STEP_INPUT)
        {
            let mut weights = self.weights.clone();
            weights.extend(state);
            let mut inputs = self.inputs.clone();
            inputs.insert(
                weft_passes::optimizer::STEP_INPUT.into(),
                HostTensor::floats(DType::F32, vec![], vec![1.0]),
            );
            return cpu::run(g, &weights, &inputs, &opts).map_err(|e| {
                CliError::input(format!("running {} on the CPU reference: {e}", g.name))
            });
        }
        cpu::run(g, &self.weights, &self.inputs, &opts)
            .map_err(|e| CliError::input(format!("running {} on the CPU reference: {e}", g.name)))
    }
}

/// A plan JSON given as MODEL (`None` for anything else).
pub fn read_plan(spec: &str) -> CliResult<Option<weft_ir::ExecutionPlan>> {
    let path = Path::new(spec);
    if !path.is_file() {
        return Ok(None);
    }
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(None);
    };
    if !(text.trim_start().starts_with('{') && text.contains("\"program\"")) {
        return Ok(None);
    }
    weft_ir::ExecutionPlan::from_json(&text, spec)
        .map(Some)
        .map_err(crate::fail)
}

/// Seeded random weights for `model`. For a real model it says first that they take a
/// while and how much host memory they will hold (f64: 8 bytes a parameter), and shows
/// a bar as they are drawn; silent for small models.
pub fn draw_random_weights(model: &Model, seed: u64) -> BTreeMap<String, HostTensor> {
    let n = model.param_count();
    if n > 100_000_000 {
        eprintln!(
            "drawing {} random parameters on the host (seed {seed}): {:.1} GiB of host memory as f64 ...",
            super::models::group_digits(n),
            n as f64 * 8.0 / (1u64 << 30) as f64
        );
    }
    let bar = crate::progress::elements(n, "drawing weights");
    let w =
        weft_frontends::random_weights_observed(model, seed, &mut |done| bar.set_position(done));
    bar.finish_and_clear();
    w
}

/// Loads `model`'s weights from `path`, saying so for a real model, with a spinner while
/// it reads.
pub fn load_weights(model: &Model, path: &Path) -> CliResult<BTreeMap<String, HostTensor>> {
    let big = model.param_count() > 100_000_000;
    if big {
        eprintln!("loading weights from {} ...", path.display());
    }
    let spin = big.then(|| crate::progress::spinner(&format!("loading {}", path.display())));
    let w = weft_frontends::load_weights(model, path).map_err(super::frontend_err);
    if let Some(s) = spin {
        s.finish_and_clear();
    }
    w
}

/// Random weights live in host memory as f64: refuse a model whose weights would not
/// fit in the memory available now (`MemAvailable`), before allocating any of them.
pub fn check_host_memory(model: &Model) -> CliResult {
    let bytes = model.param_count() as u128 * 8;
    match mem_available() {
        Some(avail) if bytes > avail => Err(CliError::input(format!(
            "random weights for {} need {:.1} GiB of host memory (f64), more than the {:.1} GiB available",
            model.name,
            bytes as f64 / (1u64 << 30) as f64,
            avail as f64 / (1u64 << 30) as f64
        ))
        .with_help("the CPU reference runs small models; give a smaller config")),
        _ => Ok(()),
    }
}

/// The host memory available now (`MemAvailable`), where the system says.
fn mem_available() -> Option<u128> {
    std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u128>().ok())
            .map(|kb| kb * 1024)
    })
}

/// Refuses a CPU reference run of `g` at `batch` x `seq` that cannot fit in the host
/// memory available now, before anything of that size is allocated: the run holds at
/// least its largest value (at the bindings, in its own dtype; the runtime computes in
/// f32 or f64) and, where `drawn`, the token ids and labels it draws (i64 [B, S] each).
/// A lower bound, so a run it passes may still need more; one it refuses cannot fit.
pub fn check_run_memory(g: &Graph, batch: i64, seq: i64, drawn: bool) -> CliResult {
    let Some(available) = mem_available() else {
        return Ok(());
    };
    let mut b = weft_ir::Bindings::new().with("B", batch).with("S", seq);
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64).with_coord(a, 0);
    }
    let mut largest: Option<(u128, weft_ir::Value)> = None;
    for &n in g.nodes() {
        for &v in &g.node(n).results {
            let bytes = match g.ty(v).size_bytes(&b) {
                Ok(x) => x as u128,
                Err(weft_ir::DimError::Overflow(_)) => u128::MAX / 4,
                Err(_) => continue,
            };
            if largest.is_none_or(|(l, _)| bytes > l) {
                largest = Some((bytes, v));
            }
        }
    }
    let tokens = if drawn {
        2 * 8 * batch.max(0) as u128 * seq.max(0) as u128
    } else {
        0
    };
    let value = largest.map_or(0, |(x, _)| x);
    let need = tokens.saturating_add(value);
    if need <= available {
        return Ok(());
    }
    let gib = |x: u128| {
        if x > u64::MAX as u128 {
            "more than 2^64 bytes".to_string()
        } else {
            format!("{:.1} GiB", x as f64 / (1u64 << 30) as f64)
        }
    };
    let what = match largest {
        Some((x, v)) => format!("its largest value, {v}: {}, holds {}", g.ty(v), gib(x)),
        None => "its values".into(),
    };
    Err(CliError::input(format!(
        "the CPU reference run of {} at B={batch} S={seq} needs {} of host memory ({what}{}), more than the {} available",
        g.name,
        match gib(need) {
            n if n.starts_with("more") => n,
            n => format!("at least {n}"),
        },
        if drawn {
            format!("; the token ids and labels {}", gib(tokens))
        } else {
            String::new()
        },
        gib(available)
    ))
    .with_help("give a smaller --batch or --seq"))
}

/// The checkpoint in a model directory: `model.safetensors`, else the index of a sharded
/// one (`model.safetensors.index.json`), as HF saves them. Every command that defaults
/// to the model directory's weights finds them here.
pub fn find_checkpoint(dir: &Path) -> Option<PathBuf> {
    ["model.safetensors", "model.safetensors.index.json"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.exists())
}

/// Reads `--inputs`: `input_ids` and `labels`, integer `[batch, seq]` tensors of one
/// shape with at least one token. Every command that takes `--inputs` reads them here.
pub fn read_inputs(p: &Path) -> CliResult<BTreeMap<String, HostTensor>> {
    let t = weft_frontends::read_safetensors(p).map_err(super::frontend_err)?;
    for name in ["input_ids", "labels"] {
        let x = t.get(name).ok_or_else(|| {
            CliError::input(format!("missing tensor `{name}` in {}", p.display()))
                .with_help("inputs need `input_ids` and `labels`, both i64 [batch, seq]")
        })?;
        if !x.dtype.is_int() || x.shape.len() != 2 {
            return Err(CliError::input(format!(
                "`{name}` in {} must be an integer [batch, seq] tensor, got {:?} {:?}",
                p.display(),
                x.dtype,
                x.shape
            )));
        }
    }
    if t["input_ids"].shape != t["labels"].shape {
        return Err(CliError::input(format!(
            "`input_ids` {:?} and `labels` {:?} differ in shape in {}",
            t["input_ids"].shape,
            t["labels"].shape,
            p.display()
        )));
    }
    if t["input_ids"].shape.contains(&0) {
        return Err(CliError::input(format!(
            "`input_ids` in {} has shape {:?}: no tokens to run",
            p.display(),
            t["input_ids"].shape
        ))
        .with_help("give at least one row (batch) of at least one token (seq)"));
    }
    Ok(t)
}

/// Refuses a tensor of the inputs that the model does not take, rather than running
/// without it: HF's forward reads an `attention_mask` (padding, or several sequences
/// packed in a row) and `position_ids` (the positions rope rotates by), and either
/// changes the logits and the loss. An all-ones `attention_mask` and `position_ids` of
/// `0..seq` on every row are what Weft computes, and pass. `source` names where the
/// inputs came from; `added` names the tensors the caller put there itself (`weft run`'s
/// step counters), which are not checked.
pub fn check_extra_inputs(
    g: &Graph,
    inputs: &BTreeMap<String, HostTensor>,
    source: &str,
    added: &[&str],
) -> CliResult<()> {
    let mut taken: Vec<String> = g.inputs().into_iter().map(|(n, _, _)| n).collect();
    taken.extend(added.iter().map(|s| s.to_string()));
    let seq = inputs
        .get("input_ids")
        .and_then(|t| t.shape.last().copied());
    for (name, t) in inputs {
        if taken.contains(name) {
            continue;
        }
        let ints = (t.dtype.is_int() || t.dtype == DType::Bool).then(|| t.to_i64());
        let (neutral, why) = match name.as_str() {
            "attention_mask" => (
                ints.as_ref().is_some_and(|v| v.iter().all(|&x| x == 1)),
                "HF's forward masks the keys where it is 0 (padding, packed sequences); Weft attends causally to every token of a row, so only an all-ones mask is accepted",
            ),
            "position_ids" => (
                seq.is_some_and(|s| {
                    s > 0
                        && t.shape.last() == Some(&s)
                        && ints
                            .as_ref()
                            .is_some_and(|v| v.iter().enumerate().all(|(i, &x)| x == (i % s) as i64))
                }),
                "HF's rope rotates each token by its position id; Weft uses 0..seq on every row, so only those are accepted",
            ),
            _ => (false, "Weft would run without it"),
        };
        if !neutral {
            return Err(CliError::input(format!(
                "the inputs from {source} hold `{name}` {:?}, which {} does not take: {why}",
                t.shape, g.name
            ))
            .with_help(format!(
                "give only the model's inputs ({}); mark positions to skip with label -100",
                g.inputs()
                    .into_iter()
                    .filter(|(n, role, _)| {
                        *role != weft_ir::Role::Buffer
                            && n != weft_ir::role::STEP_NAME
                            && weft_ir::ValueRole::of(n).is_none()
                    })
                    .map(|(n, _, _)| n)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    Ok(())
}

/// Refuses inputs whose every label is ignored: the loss is a mean over the valid labels,
/// so with none it is 0/0, undefined, and any comparison or training step on it is
/// meaningless (the parallel program is not at fault). Where `g` shifts the labels as HF
/// does (`shift_labels`), a row's first label is never a target and does not count.
/// `source` names where the inputs came from.
pub fn check_labels(
    g: &Graph,
    inputs: &BTreeMap<String, HostTensor>,
    source: &str,
) -> CliResult<()> {
    let Some(labels) = inputs.get("labels") else {
        return Ok(());
    };
    let shift = g.nodes().iter().find_map(|&n| match g.node(n).op {
        Op::ShiftLabels { ignore_index } => Some(ignore_index),
        _ => None,
    });
    let ignore_index = shift.unwrap_or(weft_frontends::build::IGNORE_INDEX);
    let row = labels.shape.last().copied().unwrap_or(1).max(1);
    let first_target = usize::from(shift.is_some());
    let valid = labels
        .to_i64()
        .iter()
        .enumerate()
        .filter(|(i, &t)| i % row >= first_target && t != ignore_index)
        .count();
    if valid > 0 {
        return Ok(());
    }
    let why = if shift.is_some() && row == 1 {
        "with one token per row there is nothing to predict (HF shifts the labels by one)"
            .to_string()
    } else if shift.is_some() {
        format!("every label is {ignore_index} (ignored) at positions 1.. of each row (HF shifts the labels by one, so position 0 is never a target)")
    } else {
        format!("every label is {ignore_index} (ignored)")
    };
    Err(CliError::input(format!(
        "no valid label in `labels` of {source} {:?}: {why}; the loss, a mean over the valid labels, is 0/0 and undefined",
        labels.shape
    ))
    .with_help(format!(
        "give at least one label that is not {ignore_index}{}",
        if shift.is_some() { " after the first position of a row" } else { "" }
    )))
}

/// The vocabulary size: rows of the token embedding table.
fn vocab_size(g: &Graph) -> CliResult<i64> {
    g.nodes()
        .iter()
        .find_map(|&n| match g.node(n).op {
            Op::Embedding { .. } => g.ty(g.node(n).operands[1]).shape[0].as_const(),
            _ => None,
        })
        .ok_or_else(|| {
            CliError::input(format!(
                "{} has no embedding with a constant vocabulary; pass --inputs",
                g.name
            ))
        })
}

/// Random tokens and labels (labels are the tokens with about one in eight ignored).
pub fn draw_inputs(
    vocab: i64,
    batch: usize,
    seq: usize,
    seed: u64,
) -> BTreeMap<String, HostTensor> {
    let mut state = seed ^ 0x5eed_1e55_u64;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let n = batch * seq;
    let ids: Vec<i64> = (0..n).map(|_| (next() % vocab as u64) as i64).collect();
    let mut labels: Vec<i64> = ids
        .iter()
        .map(|&t| if next() % 8 == 0 { -100 } else { t })
        .collect();
    // A draw that ignores every target (possible on tiny batches) would leave the loss
    // undefined: keep the first target of the first row.
    if seq >= 2 && (0..n).all(|i| i % seq == 0 || labels[i] == -100) {
        labels[1] = ids[1];
    }
    let mut m = BTreeMap::new();
    m.insert(
        "input_ids".to_string(),
        HostTensor::ints(DType::I64, vec![batch, seq], ids),
    );
    m.insert(
        "labels".to_string(),
        HostTensor::ints(DType::I64, vec![batch, seq], labels),
    );
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_inputs_always_keep_a_target() {
        // One target per draw (batch 1, seq 2): without the guard about one seed in
        // eight would ignore it.
        for seed in 0..64 {
            let m = draw_inputs(128, 1, 2, seed);
            let (ids, labels) = (m["input_ids"].to_i64(), m["labels"].to_i64());
            assert_eq!(labels[1], ids[1], "seed {seed}");
        }
    }
}

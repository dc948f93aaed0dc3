//! `weft shard`: cut a full safetensors checkpoint into per-rank shards for a mesh
//! (`rank-tp0.safetensors`, ... plus `layout.json`, the reshardable metadata of every
//! parameter), or with `--unshard` put a shard directory back into one checkpoint.
//! Resharding tp=a to tp=b is `--unshard` then `shard`; values only move, so a round
//! trip is byte-identical.
//!
//! With `--zero N` the training state is sharded as a ZeRO-N AdamW step on the mesh
//! holds it: the parameters (by rows over their data-parallel group at stage 3) and
//! the optimizer state (`optim.master.*`, `optim.m.*`, `optim.v.*`: flat and split
//! near-evenly over the group from stage 1, no padding; a group of several axes that
//! a size does not divide is one split over its flattened ranks, `dp*sp` in
//! `layout.json`). The checkpoint stores each state in the layout
//! of its parameter (a universal checkpoint; states it lacks start as a first step
//! would: moments zero, master weights the parameters), and `--unshard` writes them
//! back in that layout, so a run resumes on another mesh or stage by unsharding and
//! sharding again. Also: the pass options every command that compiles shares
//! (`--tp-spec`, the config's `base_model_tp_plan`).

use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use weft_frontends::Model;
use weft_ir::HostTensor;
use weft_passes::tp::{self, ParamLayout, TpOptions, TpSpec};

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json or model directory to shard (not used by `--unshard`:
    /// the shard directory's layout.json says everything).
    #[arg(required_unless_present = "unshard")]
    pub model: Option<String>,
    /// The full checkpoint to cut (default: the model directory's model.safetensors, or
    /// its model.safetensors.index.json);
    /// with `--unshard`, the shard directory to read.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Mesh axes, e.g. `tp=4` or `dp=2,tp=2` (parameters split over tp get one shard
    /// per tp rank; other axes replicate).
    #[arg(long, default_value = "")]
    pub mesh: String,
    /// DeepSpeed `tensor_parallel.partition_config` JSON (layer specs).
    #[arg(long, value_name = "FILE")]
    pub tp_spec: Option<PathBuf>,
    /// Shard the training state of a ZeRO stage 0-3 AdamW step on the mesh: the
    /// parameters and the optimizer state (master weights, moments), each split as the
    /// step holds it.
    #[arg(long, value_name = "STAGE")]
    pub zero: Option<u8>,
    /// Put the shards in `--weights DIR` back into the full checkpoint `-o FILE`.
    #[arg(long)]
    pub unshard: bool,
    /// Output directory (shards) or file (`--unshard`).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Print {output, mesh, files, params, split} as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct LayoutFile {
    model: String,
    mesh: String,
    /// Axes the shards are cut over, outermost first, with their sizes.
    axes: Vec<(String, u32)>,
    /// One file per coordinate combination, in row-major order.
    files: Vec<String>,
    params: Vec<ParamLayout>,
    /// SHA-256 of each file of `files`, checked before `--unshard` reads it.
    #[serde(default)]
    file_digests: Vec<String>,
    /// SHA-256 of each full tensor (`HostTensor::digest`), checked after `--unshard`
    /// puts it back together.
    #[serde(default)]
    tensor_digests: BTreeMap<String, String>,
    /// The ZeRO stage of a training-state layout (`--zero`); `None`: parameters only.
    #[serde(default)]
    zero: Option<u8>,
}

/// The program whose state layout `weft shard --zero` writes: the AdamW training step
/// of `model` on `mesh` at ZeRO `stage` (`None`: the forward pass, parameters only).
fn state_program(
    model: &Model,
    mesh: &weft_ir::Mesh,
    tp_spec: Option<&Path>,
    source: &str,
    stage: Option<u8>,
) -> CliResult<weft_ir::Graph> {
    let mut req = super::request(model, mesh, tp_spec, source)?;
    if let Some(stage) = stage {
        if stage > 3 {
            return Err(CliError::input(format!(
                "invalid --zero {stage}: stages 0, 1, 2 and 3 are supported"
            )));
        }
        let mut options = weft_passes::training::TrainOptions {
            optimizer: Some(weft_passes::training::Optimizer::adamw(1e-3)),
            grad_outputs: false,
            ..Default::default()
        };
        options.set_zero_stage(stage);
        req.train = Some(weft_passes::driver::TrainRequest {
            options,
            ..Default::default()
        });
    }
    Ok(weft_passes::driver::compile(&req, &mut std::io::sink())
        .map_err(super::driver_err)?
        .program)
}

/// The parameter an optimizer state belongs to (`optim.m.w` -> `w`).
fn state_param(state: &str) -> Option<&str> {
    match weft_ir::ValueName::parse(state) {
        weft_ir::ValueName::MasterWeight(p)
        | weft_ir::ValueName::OptimizerState { param: p, .. } => Some(p),
        _ => None,
    }
}

/// `tensor-parallel`'s options for `model`: the explicit `--tp-spec`, the config's HF
/// tp plan and the model type.
pub fn tp_options(model: &Model, tp_spec: Option<&Path>) -> CliResult<TpOptions> {
    let mut o = TpOptions::default();
    if let Some(p) = tp_spec {
        let text = weft_ir::files::read_to_string(p)
            .map_err(|e| CliError::input(format!("cannot read --tp-spec {}: {e}", p.display())))?;
        let spec =
            TpSpec::from_deepspeed_json(&text, &p.display().to_string()).map_err(crate::fail)?;
        o.spec = Some(spec);
    }
    if let Some(c) = &model.config {
        o.hf_plan = c.tp_plan.clone();
        o.model_type = Some(c.model_type.clone());
        let file = match &model.origin {
            weft_frontends::Origin::Config(p) => p.display().to_string(),
            _ => "config.json".to_string(),
        };
        o.hf_plan_source = file;
    }
    Ok(o)
}

fn shard_name(axes: &[(String, u32)], coords: &[u32]) -> String {
    if axes.is_empty() {
        return "rank.safetensors".to_string();
    }
    let parts: Vec<String> = axes
        .iter()
        .zip(coords)
        .map(|((a, _), c)| format!("{a}{c}"))
        .collect();
    format!("rank-{}.safetensors", parts.join("-"))
}

pub fn run(a: Args) -> CliResult {
    if a.unshard {
        return unshard(&a);
    }
    let spec = a.model.clone().unwrap_or_default();
    let mesh = super::parse_mesh(&a.mesh)?;
    let model = super::load_model(&spec)?;
    let g = state_program(&model, &mesh, a.tp_spec.as_deref(), &spec, a.zero)?;
    let layouts = tp::param_layouts(&g, &model.tied).map_err(CliError::input)?;
    let checkpoint = a
        .weights
        .clone()
        .or_else(|| model.dir().and_then(super::session::find_checkpoint))
        .ok_or_else(|| {
            CliError::input("no checkpoint to shard").with_help("give --weights FILE")
        })?;
    super::refuse_overwrite(&a.output, &[("checkpoint", &checkpoint)])?;
    let mut full = weft_frontends::read_checkpoint(&checkpoint)
        .map_err(super::frontend_err)?
        .tensors;
    // Optimizer state: in its parameter's layout in the checkpoint (or as a first step
    // starts it), in the step's layout in the shards.
    let mut universal: BTreeMap<String, HostTensor> = BTreeMap::new();
    if a.zero.is_some() {
        let fresh = weft_passes::optimizer::initial_state(&g, &full).map_err(|e| {
            CliError::input(format!("training state of {}: {e}", checkpoint.display()))
        })?;
        for (name, _) in g.params() {
            let Some(param) = state_param(&name) else {
                continue;
            };
            let shape = full.get(param).map(|t| t.shape.clone()).ok_or_else(|| {
                CliError::input(format!(
                    "{} has no `{param}`, whose optimizer state `{name}` the step holds",
                    checkpoint.display()
                ))
            })?;
            let bad =
                |e: String| CliError::input(format!("`{name}` in {}: {e}", checkpoint.display()));
            let (u, held) = match full.get(&name) {
                Some(u) => (
                    u.clone(),
                    weft_passes::optimizer::state_from_param(&g, &name, u).map_err(bad)?,
                ),
                None => {
                    let held = fresh[&name].clone();
                    (
                        weft_passes::optimizer::state_as_param(&g, &name, &held, &shape)
                            .map_err(bad)?,
                        held,
                    )
                }
            };
            universal.insert(name.clone(), u);
            full.insert(name, held);
        }
    }
    let axes = tp::layout::shard_axes(&layouts, &mesh);
    let shards = tp::shard_checkpoint(&layouts, &full, &axes)
        .map_err(|e| CliError::input(format!("sharding {}: {e}", checkpoint.display())))?;
    std::fs::create_dir_all(&a.output)
        .map_err(|e| CliError::input(format!("cannot create {}: {e}", a.output.display())))?;
    let earlier_files = retire_earlier_layout(&a.output)?;
    let coords = tp::layout::shard_coords(&axes);
    let mut files = Vec::new();
    let mut file_digests = Vec::new();
    for (cs, shard) in coords.iter().zip(&shards) {
        let name = shard_name(&axes, cs);
        let path = a.output.join(&name);
        weft_frontends::save_safetensors(&path, shard).map_err(super::frontend_err)?;
        file_digests.push(file_digest(&path)?);
        files.push(name);
    }
    let tensor_digests = layouts
        .iter()
        .filter_map(|l| {
            universal
                .get(&l.name)
                .or_else(|| full.get(&l.name))
                .or_else(|| l.tied_aliases.iter().find_map(|t| full.get(t)))
                .map(|t| (l.name.clone(), t.digest()))
        })
        .collect();
    let lf = LayoutFile {
        file_digests,
        tensor_digests,
        model: spec.clone(),
        mesh: mesh.to_string(),
        axes: axes.clone(),
        files,
        params: layouts,
        zero: a.zero,
    };
    super::write_out(Some(&a.output.join("layout.json")), &super::json(&lf))?;
    remove_stale_shards(&a.output, &earlier_files, &lf.files)?;
    let split = lf.params.iter().filter(|l| !l.replicated).count();
    if a.json {
        print!(
            "{}",
            super::json(&serde_json::json!({
                "output": a.output.display().to_string(),
                "mesh": mesh.to_string(),
                "files": lf.files,
                "params": lf.params.len(),
                "split": split,
            }))
        );
        return Ok(());
    }
    eprintln!(
        "sharded {} for mesh {mesh}: {} files, {split} of {} parameters split -> {}",
        checkpoint.display(),
        shards.len(),
        lf.params.len(),
        a.output.display()
    );
    Ok(())
}

/// The shard files an earlier `weft shard` into `dir` listed, with its layout.json
/// removed first: while the new shards are written, no layout describes files that no
/// longer match it. Files the directory holds that no layout names are never touched.
fn retire_earlier_layout(dir: &Path) -> CliResult<Vec<String>> {
    let path = dir.join("layout.json");
    let Ok(text) = weft_ir::files::read_to_string(&path) else {
        return Ok(Vec::new());
    };
    let files = serde_json::from_str::<LayoutFile>(&text)
        .map(|lf| lf.files)
        .unwrap_or_default();
    std::fs::remove_file(&path)
        .map_err(|e| CliError::input(format!("cannot replace {}: {e}", path.display())))?;
    Ok(files)
}

/// Removes the shards of an earlier layout that the new one does not write (a tp=4
/// directory sharded again for tp=2 would otherwise keep rank-tp2 and rank-tp3 beside
/// the new files). Only plain names of the form [`shard_name`] writes that the earlier
/// layout listed: a layout naming any other file never removes it.
fn remove_stale_shards(dir: &Path, earlier: &[String], current: &[String]) -> CliResult {
    for f in earlier {
        let plain = Path::new(f).components().count() == 1
            && f.starts_with("rank")
            && f.ends_with(".safetensors");
        if !plain || current.contains(f) {
            continue;
        }
        let path = dir.join(f);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(CliError::input(format!(
                    "cannot remove the earlier shard {}: {e}",
                    path.display()
                )))
            }
        }
    }
    Ok(())
}

/// SHA-256 of a file's bytes.
fn file_digest(path: &Path) -> CliResult<String> {
    let bytes = weft_ir::files::read(path)
        .map_err(|e| CliError::input(format!("cannot read {}: {e}", path.display())))?;
    Ok(weft_ir::plan::digest(&bytes))
}

fn unshard(a: &Args) -> CliResult {
    let dir = a.weights.clone().ok_or_else(|| {
        CliError::input("--unshard needs --weights DIR (a directory `weft shard` wrote)")
    })?;
    let text = weft_ir::files::read_to_string(&dir.join("layout.json")).map_err(|e| {
        CliError::input(format!(
            "cannot read {}: {e}",
            dir.join("layout.json").display()
        ))
    })?;
    let layout_path = dir.join("layout.json");
    let bad = |why: String| CliError::input(format!("{}: {why}", layout_path.display()));
    let lf: LayoutFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    super::refuse_overwrite(&a.output, &[("shard directory", &dir)])?;
    tp::layout::validate_layouts(&lf.params, &lf.axes).map_err(bad)?;
    if lf.file_digests.len() != lf.files.len() {
        return Err(bad(format!(
            "lists {} files but {} digests (a layout without digests cannot be checked)",
            lf.files.len(),
            lf.file_digests.len()
        ))
        .with_help("shard the checkpoint again with this weft"));
    }
    let mut shards: Vec<BTreeMap<String, HostTensor>> = Vec::new();
    for (f, want) in lf.files.iter().zip(&lf.file_digests) {
        let path = dir.join(f);
        if Path::new(f).components().count() != 1 {
            return Err(bad(format!(
                "file `{f}` is not a plain name in the shard directory"
            )));
        }
        if file_digest(&path)? != *want {
            return Err(CliError::input(format!(
                "shard {} does not match its digest in layout.json: it was changed, damaged or swapped with another",
                path.display()
            )));
        }
        shards.push(weft_frontends::read_safetensors(&path).map_err(super::frontend_err)?);
    }
    let mut full = tp::unshard_checkpoint(&lf.params, &shards, &lf.axes)
        .map_err(|e| CliError::input(format!("unsharding {}: {e}", dir.display())))?;
    if lf.zero.is_some() {
        // The states back in their parameters' layout, as the step on the layout's mesh
        // holds them.
        let model = super::load_model(&lf.model)?;
        let mesh = super::parse_mesh(&lf.mesh)?;
        let g = state_program(&model, &mesh, None, &lf.model, lf.zero)?;
        let states: Vec<String> = full
            .keys()
            .filter(|n| state_param(n).is_some())
            .cloned()
            .collect();
        for name in states {
            let param = state_param(&name).expect("a state");
            let shape = full.get(param).map(|t| t.shape.clone()).ok_or_else(|| {
                bad(format!(
                    "has optimizer state `{name}` but not its parameter `{param}`"
                ))
            })?;
            let u = weft_passes::optimizer::state_as_param(&g, &name, &full[&name], &shape)
                .map_err(|e| bad(format!("`{name}`: {e}")))?;
            full.insert(name, u);
        }
    }
    for (name, t) in &full {
        if lf.tensor_digests.get(name) != Some(&t.digest()) {
            return Err(CliError::input(format!(
                "unsharding {}: `{name}` put back together does not match the digest of the checkpoint it was cut from",
                dir.display()
            )));
        }
    }
    weft_frontends::save_safetensors(&a.output, &full).map_err(super::frontend_err)?;
    if a.json {
        print!(
            "{}",
            super::json(&serde_json::json!({
                "output": a.output.display().to_string(),
                "mesh": lf.mesh,
                "files": lf.files,
                "params": full.len(),
            }))
        );
        return Ok(());
    }
    eprintln!(
        "unsharded {} ({} files, mesh {}) -> {}",
        dir.display(),
        lf.files.len(),
        lf.mesh,
        a.output.display()
    );
    Ok(())
}

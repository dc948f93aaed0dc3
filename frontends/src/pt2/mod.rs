//! Import of `.pt2` archives written by `torch.export.save` (torch 2.9 and later), with
//! no Python at import time.
//!
//! ```text
//! archive.rs   zip → entries; layout and version checks; strided weight decoding
//! schema.rs    models/model.json → typed ExportedProgram (schema major 8)
//! signature.rs the program's inputs by role; input_ids and its B/S symbols
//! sympy.rs     symbolic sizes (sympy srepr) → Weft dims
//! fx.rs        inline HOPs, functionalize in-place ops, fill defaults (opschema.rs)
//! filled.rs    an empty tensor filled by copy_ into slices (MLA's key) → cat
//! scatter.rs   slice_scatter, copy, and empty tensors written by slices (decomposed MLA key)
//! sources.rs   graph inputs, parameters (tied merged) and buffers
//! lower.rs     exported ops → Weft ops, deferred errors, type checks
//! attention.rs SDPA, causal masks and rotary tables (evaluated by consteval.rs)
//! moe.rs       transformers' MoE experts → moe_dispatch / grouped_matmul / moe_combine
//! rewrite.rs   linear, rms_norm, rope and decomposed attention on the Weft graph
//! sinks.rs     gpt-oss's sink column in the attention softmax
//! strided.rs   step-k slices (DeepSeek-V3's interleaved rope pairs) as a de-interleave
//! outputs.rs   logits and router logits outputs; HF's loss (and MoE aux loss)
//! finish.rs    rewrites and verification of the Weft graph; the weights
//! report.rs    what was recognised, what was not
//! ```
//!
//! The imported graph follows the conventions of [`crate::build`]: inputs `input_ids`
//! and `labels` [B, S] (the export's sequence symbol becomes `S`, a dynamic batch `B`),
//! parameters named by their state_dict names (tied ones merged), HF's causal-LM loss
//! appended (`shift_labels` → `cross_entropy` sum / `count_valid`), outputs `loss`
//! then `logits`, and every node scoped to its HF module from `nn_module_stack`. A
//! program exported with `output_router_logits` (a named output with `router_logits`)
//! gets HF's MoE load-balancing loss over those outputs, with the coefficient and
//! top-k from `--config` (`loss = ce_loss + coef * aux_loss`, as [`crate::build`]).

mod archive;
mod attention;
mod consteval;
mod error;
mod filled;
mod finish;
mod fx;
mod lower;
mod moe;
mod opschema;
mod outputs;
mod report;
mod rewrite;
mod scatter;
mod schema;
mod shapes;
mod signature;
mod sinks;
mod sources;
mod strided;
mod sympy;

pub use archive::Archive;
pub use error::Pt2Error;
pub use report::{ImportReport, Recognised};

use lower::Lower;
use schema::SymInt;
use signature::{Signature, TokenIds};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use weft_ir::{Graph, HostTensor};

/// How to import.
#[derive(Clone, Debug)]
pub struct Pt2Options {
    /// Weights to use instead of the archive's (required when it was saved without them):
    /// a safetensors file or directory with HF names (per-expert MoE tensors are fused).
    pub weights: Option<PathBuf>,
    /// The model's config.json, to recognise rotary scalings that cannot be fitted from
    /// the tables alone (llama3).
    pub config: Option<PathBuf>,
    /// Append HF's causal-LM loss over a `labels` input (default true).
    pub add_loss: bool,
    /// Graph name (default: the archive's file stem).
    pub name: Option<String>,
}

impl Default for Pt2Options {
    fn default() -> Self {
        Pt2Options {
            weights: None,
            config: None,
            add_loss: true,
            name: None,
        }
    }
}

/// An imported model.
#[derive(Clone, Debug)]
pub struct Pt2Import {
    pub graph: Graph,
    /// Every parameter and checkpoint buffer (input of role `buffer`) of the graph by name.
    pub weights: BTreeMap<String, HostTensor>,
    pub report: ImportReport,
}

/// True if `bytes` hold a PT2 archive: a zip whose central directory names a
/// `models/*.json` entry (or an older export layout). See [`is_pt2_file`].
pub fn looks_like_pt2(bytes: &[u8]) -> bool {
    archive::is_pt2_zip(bytes)
}

pub use archive::is_pt2_file;

/// Imports the archive at `path` (memory-mapped: weights stay views of the file).
pub fn import(path: &Path, opts: &Pt2Options) -> Result<Pt2Import, Pt2Error> {
    let ar = Archive::open(path)?;
    let mut opts = opts.clone();
    if opts.name.is_none() {
        opts.name = path.file_stem().map(|s| s.to_string_lossy().to_string());
    }
    import_archive(ar, &opts)
}

/// Reads and checks an archive and its program, without lowering (the fuzz target's
/// entry point, and what `weft inspect` needs to name the writer).
pub fn read_archive(
    name: &str,
    bytes: Vec<u8>,
) -> Result<(Archive, String, schema::Program), Pt2Error> {
    let ar = Archive::from_bytes(name, bytes)?;
    let (model, prog) = read_program(&ar)?;
    Ok((ar, model, prog))
}

/// The model name and program of a read archive, checked.
fn read_program(ar: &Archive) -> Result<(String, schema::Program), Pt2Error> {
    let model = ar.check_layout()?;
    let rel = format!("models/{model}.json");
    let entry = ar.entry_name(&rel);
    let v = schema::parse_json(&entry, ar.text(&rel)?)?;
    let (major, minor, torch) = schema::schema_version(&entry, &v)?;
    if major != 8 {
        return Err(Pt2Error::SchemaVersion {
            entry,
            major,
            minor,
            torch,
        });
    }
    let prog = schema::read_program(&entry, &v)?;
    Ok((model, prog))
}

/// Imports an archive held in memory; `name` labels it in messages.
pub fn import_bytes(name: &str, bytes: Vec<u8>, opts: &Pt2Options) -> Result<Pt2Import, Pt2Error> {
    import_archive(Archive::from_bytes(name, bytes)?, opts)
}

/// Imports an archive opened by [`Archive::open`] or [`Archive::from_bytes`]; the
/// graph is named `opts.name`, else after the archive's program.
pub fn import_archive(ar: Archive, opts: &Pt2Options) -> Result<Pt2Import, Pt2Error> {
    let (model, prog) = read_program(&ar)?;
    let wcfg = ar.payload_config(&format!("data/weights/{model}_weights_config.json"))?;
    let ccfg = ar.payload_config(&format!("data/constants/{model}_constants_config.json"))?;
    let weights = ar.tensors("data/weights", &wcfg)?;
    let constants = ar.tensors("data/constants", &ccfg)?;
    let entry = ar.entry_name(&format!("models/{model}.json"));
    let fx = fx::build(&entry, &prog.graph)?;
    let mut report = first_report(&prog, &fx);
    let Signature {
        user_inputs,
        params,
        consts,
        missing_consts,
        persistent,
    } = Signature::read(&prog.inputs, &weights, &constants)?;
    let ids = signature::token_ids(&fx, &user_inputs, &mut report)?;

    let gname = opts.name.clone().unwrap_or_else(|| model.clone());
    let mut lw = new_lower(&fx, &gname, &ids, consts, report);
    let config = opts.config.as_deref().map(read_config).transpose()?;
    if let Some((_, cfg)) = &config {
        lw.rope_cfg = Some(cfg.rope.clone());
    }
    lw.moe_state = vec![Default::default(); lw.moe.moes.len()];

    let ids_ty = sources::token_ids_type(&lw, &ids)?;
    let labels = sources::add_inputs(&mut lw, &ids.name, &ids_ty, &user_inputs, opts.add_loss)?;
    let param_names = sources::add_params(&mut lw, &ar, &wcfg, &params)?;
    let buffer_values = sources::add_buffers(&mut lw, &persistent)?;
    for c in &missing_consts {
        lw.report
            .notes
            .push(format!("constant `{c}` has no stored value"));
    }
    lw.static_vals = sources::size_only_values(&fx, &lw.consts);

    lw.run();

    let (logits_name, router_names) = outputs::model_outputs(&prog.outputs, &prog.output_fields)?;
    // `--config`'s file and MoE fields (the aux loss's coefficient and top-k).
    let config_moe = config
        .as_ref()
        .map(|(file, cfg)| (file.clone(), cfg.moe.clone()));
    let aux = outputs::aux_loss_config(&config_moe, router_names.len(), &prog.output_fields)?;
    let extra = prog.outputs.len() - 1 - router_names.len();
    if extra > 0 {
        lw.report.notes.push(format!(
            "{extra} output(s) besides the logits and router logits ignored (use_cache=False drops past_key_values)"
        ));
    }
    let logits = outputs::logits_value(&lw, &logits_name)?;
    let mut g = std::mem::take(&mut lw.g);
    outputs::add_outputs(
        &mut lw,
        &mut g,
        labels,
        logits,
        aux,
        &router_names,
        &user_inputs,
    )?;

    let softcap = config.as_ref().and_then(|(_, cfg)| cfg.attn_softcap);
    let report = finish::rewrite(&mut g, &mut lw, softcap)?;
    let weights = finish::weights(
        &ar.name,
        opts.weights.as_deref(),
        &g,
        &param_names,
        &weights,
        buffer_values,
    )?;
    Ok(Pt2Import {
        graph: g,
        weights,
        report,
    })
}

/// The lowering state for graph `name`, before any source is added: `ids`' symbols,
/// the buffers and constants `consts`, the MoE blocks found in `fx`, and `ids`' sizes
/// in the export's example (2 for a symbol without a hint).
fn new_lower<'a>(
    fx: &'a fx::FxGraph,
    name: &str,
    ids: &TokenIds,
    consts: BTreeMap<String, HostTensor>,
    report: ImportReport,
) -> Lower<'a> {
    let example = |s: &SymInt| match s {
        SymInt::Int(i) => *i,
        SymInt::Expr { hint, .. } => hint.unwrap_or(2),
    };
    Lower {
        symmap: ids.symmap.clone(),
        consts,
        report,
        moe: moe::plan(fx),
        seq_sym: ids.seq_sym.clone(),
        batch_sym: ids.batch_sym.clone(),
        b0: example(&ids.meta.sizes[0]),
        s0: example(&ids.meta.sizes[1]),
        generalize_seq: ids.seq_sym.is_none(),
        ..Lower::new(fx, name)
    }
}

/// The report's header (versions, dialect, node count) and the notes of the FX pass.
fn first_report(prog: &schema::Program, fx: &fx::FxGraph) -> ImportReport {
    let mut report = ImportReport {
        torch_version: prog.torch_version.clone(),
        schema: format!("{}.{}", prog.schema.0, prog.schema.1),
        dialect: if fx.nodes.iter().any(|n| {
            matches!(
                n.base(),
                "linear" | "scaled_dot_product_attention" | "softmax" | "to"
            )
        }) {
            "training".into()
        } else {
            "core-aten".into()
        },
        exported_nodes: prog.graph.nodes.len(),
        ..Default::default()
    };
    if fx.dropped > 0 {
        report
            .notes
            .push(format!("{} assert/metadata nodes dropped", fx.dropped));
    }
    if !fx.assembled.is_empty() {
        report.notes.push(format!(
            "empty tensors filled by copy_ into slices read as cat: {}",
            fx.assembled.join(", ")
        ));
    }
    if !fx.functionalized.is_empty() {
        report.notes.push(format!(
            "in-place ops made functional: {}",
            fx.functionalized.join(", ")
        ));
    }
    report
}

/// `--config`'s file (as messages name it) and its model config.
fn read_config(path: &Path) -> Result<(String, crate::config::ModelConfig), Pt2Error> {
    let text = weft_ir::files::read_to_string(path).map_err(|source| Pt2Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let cfg = crate::config::ModelConfig::from_json_str(&text, &path.display().to_string())
        .map_err(|e| Pt2Error::Signature {
            message: format!("--config: {e}"),
        })?;
    Ok((path.display().to_string(), cfg))
}

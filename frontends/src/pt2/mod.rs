//! Import of `.pt2` archives written by `torch.export.save` (torch 2.9 and later), with
//! no Python at import time.
//!
//! ```text
//! archive.rs   zip → entries; layout and version checks; strided weight decoding
//! schema.rs    models/model.json → typed ExportedProgram (schema major 8)
//! sympy.rs     symbolic sizes (sympy srepr) → Weft dims
//! fx.rs        inline HOPs, functionalize in-place ops, fill defaults (opschema.rs)
//! filled.rs    an empty tensor filled by copy_ into slices (MLA's key) → cat
//! scatter.rs   slice_scatter, copy, and empty tensors written by slices (decomposed MLA key)
//! lower.rs     exported ops → Weft ops, deferred errors, type checks
//! attention.rs SDPA, causal masks and rotary tables (evaluated by consteval.rs)
//! moe.rs       transformers' MoE experts → moe_dispatch / grouped_matmul / moe_combine
//! rewrite.rs   linear, rms_norm, rope and decomposed attention on the Weft graph
//! sinks.rs     gpt-oss's sink column in the attention softmax
//! strided.rs   step-k slices (DeepSeek-V3's interleaved rope pairs) as a de-interleave
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
mod fx;
mod lower;
mod moe;
mod opschema;
mod report;
mod rewrite;
mod scatter;
mod schema;
mod shapes;
mod sinks;
mod strided;
mod sympy;

pub use archive::Archive;
pub use error::Pt2Error;
pub use report::{ImportReport, Recognised};

use lower::{Lower, LV};
use schema::{Arg, InputSpec, OutputSpec, SymInt};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use weft_ir::{DType, Dim, Graph, HostTensor, Op, Reduction, Role, TensorType};

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

/// The output positions of the `logits` field and of the `router_logits` field's
/// tensors, from the output's field names and leaf counts (none: unnamed output).
fn output_positions(fields: &[(String, usize)]) -> (Option<usize>, std::ops::Range<usize>) {
    let (mut at, mut logits, mut routers) = (0, None, 0..0);
    for (name, leaves) in fields {
        match name.as_str() {
            "logits" => logits = Some(at),
            "router_logits" => routers = at..at + leaves,
            _ => {}
        }
        at += leaves;
    }
    (logits, routers)
}

/// The aux loss to add, `(router_aux_loss_coef, MoE fields)`, when the archive returns
/// router logits; an error where the archive and `--config` disagree or the config is
/// missing (the coefficient and top-k are not in the archive).
fn aux_loss_config(
    config: &Option<(String, Option<crate::config::MoeConfig>)>,
    routers: usize,
    fields: &[(String, usize)],
) -> Result<Option<(f64, crate::config::MoeConfig)>, Pt2Error> {
    let names = || {
        fields
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let exported = routers > 0 || fields.iter().any(|(n, _)| n == "aux_loss");
    match (exported, config) {
        (false, Some((file, Some(moe)))) if moe.aux_loss_coef.is_some() => Err(router_loss_refused(&format!(
            "--config {file} sets output_router_logits: true but the program returns no router logits (outputs: {})",
            if fields.is_empty() { "unnamed".to_string() } else { names() }
        ))),
        (false, _) => Ok(None),
        (true, None) => Err(Pt2Error::Signature {
            message: format!(
                "the program returns router logits (outputs: {}): it was exported with output_router_logits: true, and HF's loss then adds router_aux_loss_coef x the MoE load-balancing loss, whose coefficient and top-k are not in the archive; pass the model's config.json with --config",
                names()
            ),
        }),
        (true, Some((file, moe))) => match moe {
            Some(m) if routers > 0 => match m.aux_loss_coef {
                Some(coef) => Ok(Some((coef, m.clone()))),
                None => Err(router_loss_refused(&format!(
                    "the program returns router logits (exported with output_router_logits: true) but --config {file} sets it false"
                ))),
            },
            _ => Err(router_loss_refused(&format!(
                "the program returns `aux_loss` without router logits, or --config {file} has no MoE fields (outputs: {})",
                names()
            ))),
        },
    }
}

/// `loss = ce + coef * aux` with the aux loss of HF's `load_balancing_loss_func` over the
/// router logits (softmax in f32, top-k, as transformers recomputes them): (loss, aux).
fn add_aux_loss(
    g: &mut Graph,
    ce: weft_ir::Value,
    router_logits: &[weft_ir::Value],
    coef: f64,
    moe: &crate::config::MoeConfig,
) -> Result<(weft_ir::Value, weft_ir::Value), weft_ir::BuildError> {
    let mut routers = Vec::new();
    for &l in router_logits {
        let source = g.node(g.def(l)).meta.source.clone();
        g.set_scope(source.as_deref());
        let mut x = l;
        if g.ty(x).dtype != DType::F32 {
            x = g.add(Op::Cast { dtype: DType::F32 }, &[x])?;
        }
        let probs = g.add(Op::Softmax { dim: -1 }, &[x])?;
        let top = g.add_multi(
            Op::Topk {
                k: moe.top_k as i64,
                dim: -1,
            },
            &[probs],
        )?;
        routers.push((probs, top[1]));
    }
    let aux = crate::build::aux_loss::aux_loss(g, &routers, moe.num_experts, moe.top_k)?;
    g.set_scope(Some("loss"));
    let weighted = g.add(
        Op::Scale {
            factor: weft_ir::Float(coef),
        },
        &[aux],
    )?;
    let loss = g.add(Op::Add {}, &[ce, weighted])?;
    Ok((loss, aux))
}

/// An archive and `--config` that disagree on HF's MoE load-balancing loss: the
/// importer cannot tell which loss HF trains with.
fn router_loss_refused(why: &str) -> Pt2Error {
    Pt2Error::Signature {
        message: format!(
            "{why}; with output_router_logits HF's loss adds router_aux_loss_coef x the MoE load-balancing loss over the router logits the program returns. Export with output_router_logits=True and pass that config.json, or neither"
        ),
    }
}

/// Labels equal to this take no part in the loss (HF's `ignore_index`).
const IGNORE_INDEX: i64 = -100;

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
    let name = ar.name.clone();
    let name = name.as_str();
    let wcfg = ar.payload_config(&format!("data/weights/{model}_weights_config.json"))?;
    let ccfg = ar.payload_config(&format!("data/constants/{model}_constants_config.json"))?;
    let weights = ar.tensors("data/weights", &wcfg)?;
    let constants = ar.tensors("data/constants", &ccfg)?;
    let entry = ar.entry_name(&format!("models/{model}.json"));
    let fx = fx::build(&entry, &prog.graph)?;

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

    // ---- signature
    let mut user_inputs: Vec<String> = Vec::new();
    let mut params: Vec<(String, String)> = Vec::new(); // (placeholder, state_dict name)
    let mut consts: BTreeMap<String, HostTensor> = BTreeMap::new();
    let mut missing_consts = Vec::new();
    // Persistent buffers (placeholder -> state_dict name): checkpoint tensors that a
    // program may read as data (DeepSeek-V3's `e_score_correction_bias`).
    let mut persistent: BTreeMap<String, String> = BTreeMap::new();
    for spec in &prog.inputs {
        match spec {
            InputSpec::User {
                arg: Arg::Tensor(n),
            } => user_inputs.push(n.clone()),
            InputSpec::User { .. } | InputSpec::ConstantInput { .. } => {}
            InputSpec::Parameter { name, target } => params.push((name.clone(), target.clone())),
            InputSpec::Buffer {
                name,
                target,
                persistent: keep,
            } if *keep => {
                persistent.insert(name.clone(), target.clone());
                match constants.get(target).or_else(|| weights.get(target)) {
                    Some(Some(t)) => {
                        consts.insert(name.clone(), t.clone());
                    }
                    _ => missing_consts.push(target.clone()),
                }
            }
            InputSpec::Buffer { name, target, .. } | InputSpec::Constant { name, target } => {
                match constants.get(target).or_else(|| weights.get(target)) {
                    Some(Some(t)) => {
                        consts.insert(name.clone(), t.clone());
                    }
                    _ => missing_consts.push(target.clone()),
                }
            }
            InputSpec::Other { kind } => {
                return Err(Pt2Error::Signature {
                    message: format!(
                        "input kind `{kind}` (custom objects, tokens) is not supported"
                    ),
                })
            }
        }
    }
    let ids_name = user_inputs
        .iter()
        .find(|n| n.as_str() == "input_ids")
        .or_else(|| user_inputs.first())
        .cloned()
        .ok_or_else(|| Pt2Error::Signature {
            message: "the program has no tensor input (export with kwargs={\"input_ids\": ids})"
                .into(),
        })?;
    let ids_meta = fx
        .tensor_meta
        .get(&ids_name)
        .ok_or_else(|| Pt2Error::Signature {
            message: format!("input `{ids_name}` has no recorded type"),
        })?
        .clone();
    if ids_meta.sizes.len() != 2 {
        return Err(Pt2Error::Signature {
            message: format!(
                "input `{ids_name}` has rank {}, expected [batch, sequence]",
                ids_meta.sizes.len()
            ),
        });
    }
    let mut symmap = BTreeMap::new();
    let (mut seq_sym, mut batch_sym) = (None, None);
    for (i, (weft, slot)) in [("B", &mut batch_sym), ("S", &mut seq_sym)]
        .into_iter()
        .enumerate()
    {
        if let SymInt::Expr { expr, .. } = &ids_meta.sizes[i] {
            match sympy::parse(expr) {
                Ok(sympy::Expr::Sym(s)) => {
                    symmap.insert(s.clone(), Dim::sym(weft));
                    report.symbols.push(format!("{s} -> {weft}"));
                    *slot = Some(s);
                }
                _ => {
                    return Err(Pt2Error::SymExpr {
                        expr: expr.clone(),
                        place: format!("dim {i} of input `{ids_name}`"),
                        message: "an input size must be a plain symbol".into(),
                    })
                }
            }
        }
    }
    if seq_sym.is_none() {
        report.notes.push(format!("static export: sequence length {} recognised as S wherever a shape follows from input_ids", ids_meta.sizes[1].clone().hint_or()));
    }
    if batch_sym.is_none() {
        report.notes.push(format!("the export fixed the batch at {}: the graph's batch is the symbol B, shapes re-derived from input_ids", ids_meta.sizes[0].clone().hint_or()));
    }

    // ---- graph sources
    let gname = opts.name.clone().unwrap_or_else(|| model.clone());
    let mut g = Graph::new(&gname);
    let mut env: BTreeMap<String, LV> = BTreeMap::new();
    let example = |s: &SymInt| match s {
        SymInt::Int(i) => *i,
        SymInt::Expr { hint, .. } => hint.unwrap_or(2),
    };
    let generalize_seq = seq_sym.is_none();
    // `--config`'s file and MoE fields (the aux loss's coefficient and top-k).
    let mut config_moe: Option<(String, Option<crate::config::MoeConfig>)> = None;
    let mut config_attn_softcap: Option<f64> = None;
    let mut lw = Lower {
        symmap,
        consts,
        report,
        moe: moe::plan(&fx),
        seq_sym,
        batch_sym,
        b0: example(&ids_meta.sizes[0]),
        s0: example(&ids_meta.sizes[1]),
        generalize_seq,
        ..Lower::new(&fx, &gname)
    };
    if let Some(c) = &opts.config {
        let text = std::fs::read_to_string(c).map_err(|source| Pt2Error::Io {
            path: c.clone(),
            source,
        })?;
        let cfg = crate::config::ModelConfig::from_json_str(&text, &c.display().to_string())
            .map_err(|e| Pt2Error::Signature {
                message: format!("--config: {e}"),
            })?;
        config_moe = Some((c.display().to_string(), cfg.moe.clone()));
        config_attn_softcap = cfg.attn_softcap;
        lw.rope_cfg = Some(cfg.rope);
    }
    lw.moe_state = vec![Default::default(); lw.moe.moes.len()];
    let ids_ty = lw.meta_ty(&ids_name).map_err(lower::unwrap_err)?;
    let ids_ty = TensorType::new(ids_ty.dtype, vec![Dim::sym("B"), Dim::sym("S")]);
    if ids_ty.dtype != DType::I64 {
        return Err(Pt2Error::Signature {
            message: format!("input `{ids_name}` is {ids_ty}, expected int64 token ids"),
        });
    }
    std::mem::swap(&mut g, &mut lw.g);
    g.set_scope(Some("model"));
    let ids = g
        .add(
            Op::Input {
                name: "input_ids".into(),
                role: Role::InputIds,
                ty: ids_ty.clone(),
            },
            &[],
        )
        .unwrap();
    env.insert(ids_name.clone(), LV::T(ids));
    let labels = if opts.add_loss {
        g.set_scope(Some("loss"));
        Some(
            g.add(
                Op::Input {
                    name: "labels".into(),
                    role: Role::Labels,
                    ty: ids_ty.clone(),
                },
                &[],
            )
            .unwrap(),
        )
    } else {
        None
    };
    for u in &user_inputs {
        if *u == ids_name {
            continue;
        }
        let mut ty = lw.meta_ty(u).map_err(lower::unwrap_err)?;
        if ty.rank() == 2
            && lw.same_size(&ty.shape[0], &ids_ty.shape[0])
            && lw.same_size(&ty.shape[1], &ids_ty.shape[1])
        {
            ty.shape = ids_ty.shape.clone();
        }
        let role = match u.as_str() {
            "attention_mask" => Role::AttentionMask,
            "position_ids" => Role::PositionIds,
            "labels" => Role::Labels,
            _ => Role::Other,
        };
        g.set_scope(Some("model"));
        let v = g
            .add(
                Op::Input {
                    name: u.clone(),
                    role,
                    ty,
                },
                &[],
            )
            .map_err(|e| Pt2Error::Signature {
                message: e.to_string(),
            })?;
        env.insert(u.clone(), LV::T(v));
    }
    // Parameters, tied ones (same storage record and view) merged into the first name.
    let mut by_storage: BTreeMap<String, String> = BTreeMap::new();
    let mut param_names: Vec<String> = Vec::new();
    let mut alias_of: BTreeMap<String, String> = BTreeMap::new();
    for (ph, target) in &params {
        let stored = |p: &schema::PayloadMeta| {
            ar.get(&format!("data/weights/{}", p.path_name))
                .is_some_and(|b| !b.is_empty())
        };
        if let Some(p) = wcfg.get(target).filter(|p| stored(p)) {
            let key = format!("{}|{:?}", p.path_name, p.meta);
            if let Some(first) = by_storage.get(&key) {
                alias_of.insert(target.clone(), first.clone());
                lw.report.tied.push(format!("{target} -> {first}"));
                let v = env
                    .get(&params.iter().find(|(_, t)| t == first).unwrap().0)
                    .cloned()
                    .unwrap();
                env.insert(ph.clone(), v);
                continue;
            }
            by_storage.insert(key, target.clone());
        }
        let ty = lw.meta_ty(ph).map_err(lower::unwrap_err)?;
        g.set_scope(Some(
            target.rsplit_once('.').map(|(m, _)| m).unwrap_or(target),
        ));
        let v = g
            .add(
                Op::Param {
                    name: target.clone(),
                    ty,
                },
                &[],
            )
            .map_err(|e| Pt2Error::Signature {
                message: e.to_string(),
            })?;
        env.insert(ph.clone(), LV::T(v));
        param_names.push(target.clone());
    }
    let mut buffer_values: BTreeMap<String, HostTensor> = BTreeMap::new();
    for (ph, t) in &lw.consts {
        // A one-element float buffer (gemma's `embed_scale`) is a constant: `full`.
        if t.dtype.is_float() && t.numel() == 1 {
            let ty = TensorType::new(t.dtype, t.shape.iter().map(|&d| Dim::from(d)).collect());
            g.set_scope(Some("model"));
            if let Ok(v) = g.add(
                Op::Full {
                    value: weft_ir::Float(t.to_f64()[0]),
                    ty,
                },
                &[],
            ) {
                lw.report.notes.push(format!(
                    "buffer `{ph}` (one element, {}) read as a constant",
                    t.to_f64()[0]
                ));
                env.insert(ph.clone(), LV::T(v));
                continue;
            }
        }
        // A persistent float buffer is a checkpoint tensor: a graph input of role
        // `buffer` (read with the weights, never trained), as the config builders make.
        if let Some(target) = persistent.get(ph).filter(|_| t.dtype.is_float()) {
            let ty = TensorType::new(t.dtype, t.shape.iter().map(|&d| Dim::from(d)).collect());
            g.set_scope(Some(
                target.rsplit_once('.').map(|(m, _)| m).unwrap_or(target),
            ));
            let v = g
                .add(
                    Op::Input {
                        name: target.clone(),
                        role: Role::Buffer,
                        ty,
                    },
                    &[],
                )
                .map_err(|e| Pt2Error::Signature {
                    message: e.to_string(),
                })?;
            buffer_values.insert(target.clone(), t.clone());
            env.insert(ph.clone(), LV::T(v));
            continue;
        }
        env.insert(
            ph.clone(),
            LV::Err(std::rc::Rc::new(Pt2Error::UnsupportedOp {
                op: "buffer".into(),
                node: ph.clone(),
                layer: None,
                message: "a buffer is used as data outside the recognised rotary/mask computations; Weft graphs have no constant tensors".into(),
            })),
        );
    }
    for c in &missing_consts {
        lw.report
            .notes
            .push(format!("constant `{c}` has no stored value"));
    }
    std::mem::swap(&mut g, &mut lw.g);
    lw.env = env;

    // ---- size-only values
    let mut stat: BTreeSet<String> = lw.consts.keys().cloned().collect();
    for n in &fx.nodes {
        if n.tensor_args().iter().all(|t| stat.contains(*t)) {
            stat.extend(n.outputs.iter().flatten().cloned());
        }
    }
    lw.static_vals = stat;

    // ---- lower
    lw.run();

    // ---- outputs
    let user_outputs: Vec<Option<String>> = prog
        .outputs
        .iter()
        .map(|o| match o {
            OutputSpec::User {
                arg: Arg::Tensor(n),
            } => Some(n.clone()),
            _ => None,
        })
        .collect();
    for o in &prog.outputs {
        if let OutputSpec::Other { kind, name } = o {
            return Err(Pt2Error::Signature { message: format!("output `{name}` is a {kind}; export the forward only (no buffer mutation or gradients)") });
        }
    }
    // A named output (`MoeCausalLMOutputWithPast`): the logits by name, and the router
    // logits when exported with output_router_logits (HF's loss then has the aux term).
    let (logits_at, routers_at) = output_positions(&prog.output_fields);
    let logits_name = user_outputs
        .get(logits_at.unwrap_or(0))
        .cloned()
        .flatten()
        .or_else(|| user_outputs.iter().flatten().next().cloned())
        .ok_or_else(|| Pt2Error::Signature {
            message: "the program has no tensor output".into(),
        })?;
    let router_names: Vec<String> = routers_at
        .clone()
        .filter_map(|i| user_outputs.get(i).cloned().flatten())
        .collect();
    let aux = aux_loss_config(&config_moe, router_names.len(), &prog.output_fields)?;
    let extra = prog.outputs.len() - 1 - router_names.len();
    if extra > 0 {
        lw.report.notes.push(format!(
            "{extra} output(s) besides the logits and router logits ignored (use_cache=False drops past_key_values)"
        ));
    }
    let logits = match lw.lv(&logits_name) {
        LV::T(v) => v,
        LV::Err(e) => return Err(lower::unwrap_err(e)),
        other => {
            return Err(Pt2Error::Signature {
                message: format!("the first output is not a tensor ({other:?})"),
            })
        }
    };
    let lt = lw.g.ty(logits).clone();
    if lt.rank() != 3 || !lt.dtype.is_float() {
        return Err(Pt2Error::Signature {
            message: format!("the first output is {lt}; expected logits [batch, sequence, vocab]"),
        });
    }
    let mut g = std::mem::take(&mut lw.g);
    let mut loss_parts = None;
    if let Some(labels) = labels {
        g.set_scope(Some("loss"));
        let build = |g: &mut Graph| -> Result<weft_ir::Value, weft_ir::BuildError> {
            let shifted = g.add(
                Op::ShiftLabels {
                    ignore_index: IGNORE_INDEX,
                },
                &[labels],
            )?;
            let total = g.add(
                Op::CrossEntropy {
                    ignore_index: IGNORE_INDEX,
                    reduction: Reduction::Sum,
                },
                &[logits, shifted],
            )?;
            let count = g.add(
                Op::CountValid {
                    ignore_index: IGNORE_INDEX,
                },
                &[shifted],
            )?;
            g.add(Op::Div {}, &[total, count])
        };
        let ce = build(&mut g).map_err(|e| Pt2Error::Signature {
            message: format!("adding the loss: {e}"),
        })?;
        lw.report.notes.push("HF causal-LM loss added (shift_labels, cross_entropy sum / count_valid, ignore_index -100)".into());
        match aux {
            Some((coef, moe)) => {
                if user_inputs.iter().any(|u| u == "attention_mask") {
                    // HF weights each router row by the mask (padding excluded).
                    return Err(Pt2Error::Signature {
                        message: "the program takes an `attention_mask` and returns router logits: HF's MoE load-balancing loss then weights every router row by the mask, which the importer does not implement; export without attention_mask (Weft's programs are causal over whole rows)".into(),
                    });
                }
                let mut routers = Vec::new();
                for name in &router_names {
                    match lw.lv(name) {
                        LV::T(v) => routers.push(v),
                        LV::Err(e) => return Err(lower::unwrap_err(e)),
                        other => {
                            return Err(Pt2Error::Signature {
                                message: format!(
                                    "router logits output `{name}` is not a tensor ({other:?})"
                                ),
                            })
                        }
                    }
                }
                let (loss, aux_loss) =
                    add_aux_loss(&mut g, ce, &routers, coef, &moe).map_err(|e| {
                        Pt2Error::Signature {
                            message: format!("adding the MoE load-balancing loss: {e}"),
                        }
                    })?;
                g.set_output("loss", loss);
                loss_parts = Some((ce, aux_loss));
                lw.report.notes.push(format!(
                    "HF MoE load-balancing loss added over the {} router logits outputs: loss = ce_loss + {coef} x aux_loss (router_aux_loss_coef, top-{} of {} experts, from --config)",
                    routers.len(), moe.top_k, moe.num_experts
                ));
            }
            None => g.set_output("loss", ce),
        }
    }
    g.set_scope(None);
    g.set_output("logits", logits);
    if let Some((ce, aux_loss)) = loss_parts {
        g.set_output("ce_loss", ce);
        g.set_output("aux_loss", aux_loss);
    }

    // ---- rewrites
    let causal = std::mem::take(&mut lw.causal);
    let mask_windows = std::mem::take(&mut lw.mask_windows);
    let mut report = std::mem::take(&mut lw.report);
    rewrite::dce(&mut g);
    rewrite::Rewriter {
        report: &mut report,
        causal: &causal,
        windows: &mask_windows,
    }
    .run(&mut g);
    rewrite::leftovers(&g, &mut report);
    if let Some(cap) = config_attn_softcap {
        let capped = g.nodes().iter().any(|&n| {
            matches!(
                g.node(n).op,
                Op::Attention {
                    softcap: Some(_),
                    ..
                }
            )
        });
        if !capped {
            // The program is imported as exported; say where it parts from the config.
            report.notes.push(format!(
                "--config sets attn_logit_softcapping {cap}, but the exported attention has no soft-cap (transformers' SDPA path drops it; export with attn_implementation=\"eager\" to keep it)"
            ));
        }
    }
    report.weft_nodes = g.node_count();
    weft_ir::verify(&g).map_err(|r| Pt2Error::Verify {
        report: r.to_string(),
    })?;

    // ---- weights
    let weights = match &opts.weights {
        Some(p) => {
            let m =
                crate::model::Model::from_graph(g.clone(), crate::model::Origin::TextIr(p.clone()))
                    .map_err(|e| Pt2Error::Weights {
                        archive: name.into(),
                        message: e.to_string(),
                    })?;
            crate::weights::load_weights(&m, p).map_err(|e| Pt2Error::Weights {
                archive: name.into(),
                message: e.to_string(),
            })?
        }
        None => {
            let mut out = BTreeMap::new();
            let mut absent = Vec::new();
            for pname in &param_names {
                match weights.get(pname) {
                    Some(Some(t)) => {
                        out.insert(pname.clone(), t.clone());
                    }
                    _ => absent.push(pname.clone()),
                }
            }
            if !absent.is_empty() {
                return Err(Pt2Error::Weights {
                    archive: name.into(),
                    message: format!(
                        "the archive was saved without weights ({} of {} parameters have empty storage, e.g. `{}`)",
                        absent.len(),
                        param_names.len(),
                        absent[0]
                    ),
                });
            }
            out
        }
    };
    let mut weights = weights;
    for (name, t) in buffer_values {
        if g.inputs().iter().any(|(n, _, _)| *n == name) {
            weights.entry(name).or_insert(t);
        }
    }
    let _ = alias_of;
    Ok(Pt2Import {
        graph: g,
        weights,
        report,
    })
}

impl SymInt {
    fn hint_or(self) -> i64 {
        match self {
            SymInt::Int(i) => i,
            SymInt::Expr { hint, .. } => hint.unwrap_or(0),
        }
    }
}

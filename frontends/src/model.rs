//! [`Model`] and [`load`]: a MODEL argument (preset name, config.json, model directory
//! or `.weft` text IR) to a verified graph. The kind of file is detected by its content,
//! not its extension: text whose first line is `graph "..."` is text IR, a JSON object
//! with `model_type` is an HF config.

use crate::build::{build_graph, params};
use crate::config::{Family, ModelConfig};
use crate::error::FrontendError;
use crate::presets::{find_preset, preset_names};
use std::path::{Path, PathBuf};
use weft_ir::{DType, Graph, Op, TensorType};

/// Where a model came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Preset(String),
    /// An HF config.json (the file itself, not its directory).
    Config(PathBuf),
    TextIr(PathBuf),
}

/// A model: its forward + loss graph and what it was built from.
#[derive(Clone, Debug)]
pub struct Model {
    pub name: String,
    pub family: Family,
    /// The parsed config (`None` for text IR).
    pub config: Option<ModelConfig>,
    pub graph: Graph,
    /// The dtype of the (floating-point) parameters.
    pub param_dtype: DType,
    /// Checkpoint names that are another parameter under a second name, as
    /// `(alias, param)`: `("lm_head.weight", "model.embed_tokens.weight")` when tied.
    pub tied: Vec<(String, String)>,
    pub origin: Origin,
}

impl Model {
    /// Builds the graph of a parsed config; the graph is named `name`.
    pub fn from_config(
        name: &str,
        config: ModelConfig,
        origin: Origin,
    ) -> Result<Model, FrontendError> {
        let graph = build_graph(name, &config)?;
        let tied = if config.tie_word_embeddings {
            vec![(params::LM_HEAD.to_string(), params::EMBED.to_string())]
        } else {
            vec![]
        };
        Ok(Model {
            name: name.to_string(),
            family: config.family,
            param_dtype: config.dtype,
            config: Some(config),
            graph,
            tied,
            origin,
        })
    }

    /// Wraps a verified text-IR graph. Every parameter must have a constant shape.
    pub fn from_graph(graph: Graph, origin: Origin) -> Result<Model, FrontendError> {
        let file = match &origin {
            Origin::TextIr(p) | Origin::Config(p) => p.display().to_string(),
            Origin::Preset(n) => n.clone(),
        };
        weft_ir::verify(&graph).map_err(|r| FrontendError::TextIr {
            file: file.clone(),
            message: r.to_string(),
        })?;
        let mut param_dtype = None;
        for (name, ty) in graph_params(&graph) {
            if ty.shape.iter().any(|d| d.as_const().is_none()) {
                return Err(FrontendError::TextIr { file, message: format!("parameter `{name}` has a symbolic shape {ty}; parameters need constant shapes") });
            }
            if param_dtype.is_none() && ty.dtype.is_float() {
                param_dtype = Some(ty.dtype);
            }
        }
        if checked_param_count(&graph_params(&graph)).is_none() {
            return Err(FrontendError::TextIr {
                file,
                message: "the parameters hold more than 2^64 elements in all".into(),
            });
        }
        let names: Vec<String> = graph.params().into_iter().map(|(n, _)| n).collect();
        let tied = if names.iter().any(|n| n == params::EMBED)
            && !names.iter().any(|n| n == params::LM_HEAD)
        {
            vec![(params::LM_HEAD.to_string(), params::EMBED.to_string())]
        } else {
            vec![]
        };
        Ok(Model {
            name: graph.name.clone(),
            family: Family::WeftIr,
            config: None,
            param_dtype: param_dtype.unwrap_or(DType::F32),
            graph,
            tied,
            origin,
        })
    }

    /// Parameters as `(name, type)` in graph order.
    pub fn params(&self) -> Vec<(String, TensorType)> {
        graph_params(&self.graph)
    }

    /// The checkpoint buffers the graph reads (inputs of role `buffer`, e.g. deepseek_v3's
    /// `e_score_correction_bias`), as `(name, type)`: loaded with the weights, never trained.
    pub fn buffers(&self) -> Vec<(String, TensorType)> {
        self.graph
            .inputs()
            .into_iter()
            .filter(|(_, role, _)| *role == weft_ir::Role::Buffer)
            .map(|(name, _, v)| (name, self.graph.ty(v).clone()))
            .collect()
    }

    /// What importing this model leaves out or adds beside HF's parameters, one line
    /// each, for `weft import --report`.
    pub fn import_notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let buffers = self.buffers();
        if let Some((first, ty)) = buffers.first() {
            notes.push(format!(
                "{} checkpoint buffer(s) read with the weights, never trained (HF buffers, not parameters): {first} {ty}{}",
                buffers.len(),
                if buffers.len() > 1 { ", ..." } else { "" }
            ));
        }
        if let Some(mla) = self.config.as_ref().and_then(|c| c.mla.as_ref()) {
            if mla.mtp_layers > 0 {
                let prefixes = crate::weights::mtp_layer_prefixes(self);
                notes.push(format!(
                    "num_nextn_predict_layers = {}: the multi-token-prediction layer(s) {}* may be in the checkpoint; HF's forward never runs them and its loader drops them, and so does Weft (not in the graph, not trained)",
                    mla.mtp_layers,
                    prefixes.join("*, ").trim_end_matches('*')
                ));
            }
        }
        notes
    }

    /// Total number of parameter elements (a tied weight counts once).
    pub fn param_count(&self) -> u64 {
        checked_param_count(&self.params()).unwrap_or(u64::MAX)
    }

    /// The std of HF's normal init (`initializer_range`, 0.02 without a config).
    pub fn initializer_range(&self) -> f64 {
        self.config.as_ref().map_or(0.02, |c| c.initializer_range)
    }

    /// The directory a config or text IR was read from (where weights usually sit).
    pub fn dir(&self) -> Option<&Path> {
        match &self.origin {
            Origin::Config(p) | Origin::TextIr(p) => p.parent(),
            Origin::Preset(_) => None,
        }
    }
}

fn graph_params(g: &Graph) -> Vec<(String, TensorType)> {
    g.nodes()
        .iter()
        .filter_map(|&n| match &g.node(n).op {
            Op::Param { name, ty } => Some((name.clone(), ty.clone())),
            _ => None,
        })
        .collect()
}

/// Loads a preset name, a config.json, a model directory (with config.json) or a
/// weft text-IR file.
pub fn load(spec: &str) -> Result<Model, FrontendError> {
    if let Some(p) = find_preset(spec) {
        return Model::from_config(p.name, p.config()?, Origin::Preset(p.name.to_string()));
    }
    let path = Path::new(spec);
    if path.is_dir() {
        let config = path.join("config.json");
        if !config.is_file() {
            return Err(FrontendError::UnknownSpec {
                spec: spec.into(),
                why: "the directory has no config.json".into(),
            });
        }
        return load_file(&config, spec);
    }
    if path.is_file() {
        return load_file(path, spec);
    }
    if path.exists() {
        return Err(FrontendError::UnknownSpec {
            spec: spec.into(),
            why: "it is a special file (a device, FIFO or socket), not a regular file or directory"
                .into(),
        });
    }
    let mut why = "it is not a preset, and no file or directory has this path".to_string();
    let close = similar_presets(spec);
    if !close.is_empty() {
        why.push_str(&format!(" (did you mean {}?)", close.join(" or ")));
    }
    Err(FrontendError::UnknownSpec {
        spec: spec.into(),
        why,
    })
}

/// Loads a file, detecting its kind by content.
pub fn load_file(path: &Path, spec: &str) -> Result<Model, FrontendError> {
    let (bytes, whole) = read_small(path).map_err(|e| FrontendError::io(path, e))?;
    if bytes.starts_with(b"PK\x03\x04") {
        return Err(FrontendError::UnknownSpec {
            spec: spec.into(),
            why: "it is a zip archive (a .pt2?); the torch.export importer is not available".into(),
        });
    }
    if !whole {
        return Err(FrontendError::UnknownSpec {
            spec: spec.into(),
            why: format!("it is larger ({} MiB) than any config.json or weft text IR (a checkpoint? give it with --weights)", MAX_TEXT_MODEL_BYTES >> 20),
        });
    }
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t,
        Err(e) => {
            return Err(FrontendError::UnknownSpec {
                spec: spec.into(),
                why: format!(
                    "byte {} (line {}) is not UTF-8: a binary file, not a config.json or weft text IR",
                    e.valid_up_to(),
                    bytes[..e.valid_up_to()].iter().filter(|&&b| b == b'\n').count() + 1
                ),
            });
        }
    };
    let text = text.trim_start_matches('\u{feff}');
    let first = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("//"))
        .unwrap_or("");
    let file = path.display().to_string();
    if first.starts_with("graph ") {
        let graph = weft_ir::parse(text).map_err(|e| FrontendError::TextIr {
            file: file.clone(),
            message: e.to_string(),
        })?;
        weft_ir::verify(&graph).map_err(|r| FrontendError::TextIr {
            file: file.clone(),
            message: r.in_source(&graph, text, &file),
        })?;
        return Model::from_graph(graph, Origin::TextIr(path.to_path_buf()));
    }
    if first.starts_with('{') {
        let v = crate::fields::parse_json_no_duplicates(text).map_err(|message| {
            FrontendError::Json {
                file: file.clone(),
                message,
            }
        })?;
        if v.get("model_type").is_none() {
            return Err(FrontendError::UnknownSpec {
                spec: spec.into(),
                why: "it is JSON without `model_type`, so not an HF config.json".into(),
            });
        }
        let config = ModelConfig::from_json(&v, &file)?;
        return Model::from_config(
            &model_name(path),
            config,
            Origin::Config(path.to_path_buf()),
        );
    }
    Err(FrontendError::UnknownSpec {
        spec: spec.into(),
        why: "it is neither an HF config.json nor weft text IR (`graph \"...\"`)".into(),
    })
}

/// Files larger than this are not config.json or text IR (both are small: a graph
/// names its parameters, it does not hold them); only their head is read.
const MAX_TEXT_MODEL_BYTES: u64 = 64 << 20;

/// The whole file (and `true`) if it is small enough to be a config or text IR, else its
/// first bytes (enough to tell a zip), so a checkpoint given as MODEL is not read whole.
fn read_small(path: &Path) -> std::io::Result<(Vec<u8>, bool)> {
    use std::io::Read;
    weft_ir::files::check_regular(path)?;
    let f = std::fs::File::open(path)?;
    let whole = f.metadata()?.len() <= MAX_TEXT_MODEL_BYTES;
    let mut bytes = Vec::new();
    f.take(if whole { MAX_TEXT_MODEL_BYTES } else { 4 })
        .read_to_end(&mut bytes)?;
    Ok((bytes, whole))
}

/// A config's model name: its directory's name for `.../<name>/config.json`, else the file stem.
fn model_name(path: &Path) -> String {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    if path.file_name().and_then(|s| s.to_str()) != Some("config.json") {
        return stem.to_string();
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::env::current_dir().unwrap_or_default(),
    };
    let dir = dir.canonicalize().unwrap_or(dir);
    dir.file_name()
        .and_then(|s| s.to_str())
        .unwrap_or("model")
        .to_string()
}

/// Presets whose names contain `spec` or are within two edits of it.
fn similar_presets(spec: &str) -> Vec<&'static str> {
    let s = spec.to_ascii_lowercase();
    preset_names()
        .into_iter()
        .filter(|n| (s.len() >= 3 && n.contains(s.as_str())) || edit_distance(n, &s) <= 2)
        .collect()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for j in 0..b.len() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != b[j]))
                .min(row[j] + 1)
                .min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The number of parameter elements, counted with checked arithmetic (`None` past
/// `u64`; the verifier already bounds each parameter).
fn checked_param_count<'a>(
    params: impl IntoIterator<Item = &'a (String, weft_ir::TensorType)>,
) -> Option<u64> {
    params.into_iter().try_fold(0u64, |acc, (_, t)| {
        let n = t.shape.iter().try_fold(1u64, |p, d| {
            p.checked_mul(u64::try_from(d.as_const().unwrap_or(0)).unwrap_or(0))
        })?;
        acc.checked_add(n)
    })
}

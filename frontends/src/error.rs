//! The one error type of the frontends. Every variant names what failed and where (a
//! file, a config field, a tensor) and, through [`FrontendError::help`], how to fix it
//! where that is known, so the CLI can print `error: ...` then `help: ...`.

use std::fmt;
use std::path::PathBuf;

/// One tensor that does not fit the model, in a [`FrontendError::WeightMismatch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WeightProblem {
    /// The model has this parameter (type `want`) but no file provides it.
    Missing { name: String, want: String },
    /// A file provides a tensor the model has no parameter for.
    Extra { name: String, file: String },
    /// The tensor exists but its dtype or shape differs from the parameter.
    Misshaped {
        name: String,
        file: String,
        got: String,
        want: String,
    },
}

impl fmt::Display for WeightProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightProblem::Missing { name, want } => write!(f, "missing: {name} ({want})"),
            WeightProblem::Extra { name, file } => write!(f, "extra: {name} in {file}"),
            WeightProblem::Misshaped {
                name,
                file,
                got,
                want,
            } => {
                write!(
                    f,
                    "misshaped: {name} in {file}: the file has {got}, the model wants {want}"
                )
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    /// A config field is missing or has a bad value. `file` is a path or `preset <name>`.
    #[error("invalid config in {file}: field `{field}` {message}")]
    Config {
        file: String,
        field: String,
        message: String,
    },

    #[error("unknown model_type `{model_type}` in {file}")]
    UnknownModelType { file: String, model_type: String },

    #[error("unsupported rope type `{rope_type}` in {file}: field `{field}`")]
    UnsupportedRope {
        file: String,
        field: String,
        rope_type: String,
    },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot write {path}: {message}")]
    Write { path: PathBuf, message: String },

    #[error("invalid JSON in {file}: {message}")]
    Json { file: String, message: String },

    /// `load` was given something that is neither a preset nor a readable model file.
    #[error("unknown model `{spec}`: {why}")]
    UnknownSpec { spec: String, why: String },

    #[error("invalid text IR in {file}: {message}")]
    TextIr { file: String, message: String },

    /// Building the graph failed; a config the parser accepted should never get here.
    #[error("building the graph of {model} failed in {source}")]
    Build {
        model: String,
        #[source]
        source: weft_ir::BuildError,
    },

    #[error("invalid safetensors file {file}: {message}")]
    Safetensors { file: String, message: String },

    /// Every tensor that does not fit, in one error.
    #[error("{}", mismatch_text(.checkpoint, .problems))]
    WeightMismatch {
        checkpoint: String,
        problems: Vec<WeightProblem>,
    },
}

fn mismatch_text(checkpoint: &str, problems: &[WeightProblem]) -> String {
    let count = |f: fn(&WeightProblem) -> bool| problems.iter().filter(|p| f(p)).count();
    let (m, e, s) = (
        count(|p| matches!(p, WeightProblem::Missing { .. })),
        count(|p| matches!(p, WeightProblem::Extra { .. })),
        count(|p| matches!(p, WeightProblem::Misshaped { .. })),
    );
    let mut out = format!(
        "weights do not match the model in {checkpoint}: {m} missing, {e} extra, {s} misshaped"
    );
    for p in problems {
        out.push_str(&format!("\n  {p}"));
    }
    out
}

impl FrontendError {
    /// How to fix the error, where that is known.
    pub fn help(&self) -> Option<String> {
        match self {
            FrontendError::UnknownModelType { model_type, .. } if model_type == "gemma3" => Some(
                "this is Gemma 3's multimodal config (Gemma3ForConditionalGeneration); Weft builds the text model: save its `text_config` as a config.json (model_type `gemma3_text`, with the top-level torch_dtype)".to_string(),
            ),
            FrontendError::UnknownModelType { .. } => Some(format!(
                "supported model types: {}",
                crate::config::Family::MODEL_TYPES.join(", ")
            )),
            FrontendError::UnsupportedRope { .. } => {
                Some("supported rope types: default, linear, llama3, yarn".to_string())
            }
            FrontendError::UnknownSpec { .. } => Some(format!(
                "give a preset ({}), a config.json, a model directory or a .weft file",
                crate::presets::preset_names().join(", ")
            )),
            FrontendError::WeightMismatch { .. } => Some(
                "check that the checkpoint belongs to this config (model_type, sizes, dtype)"
                    .to_string(),
            ),
            FrontendError::Config { field, .. } if crate::neutral::is_math_field(field) => {
                Some(format!(
                    "set `{field}` to 0 in config.json to train without it (HF applies it only in train mode)"
                ))
            }
            FrontendError::Config { field, .. } if field == "hidden_act" => {
                Some("only silu MLPs are supported".to_string())
            }
            _ => None,
        }
    }

    pub(crate) fn config(file: &str, field: &str, message: impl Into<String>) -> FrontendError {
        FrontendError::Config {
            file: file.to_string(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> FrontendError {
        FrontendError::Io {
            path: path.into(),
            source,
        }
    }
}

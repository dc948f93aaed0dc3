//! weft-frontends: everything that turns a model on disk (or a preset name) into a
//! weft graph and its weights.
//!
//! - [`config`]: HF `config.json` → [`ModelConfig`] (both transformers 4 and 5 forms).
//! - [`build`]: config → forward + loss [`weft_ir::Graph`] with HF's parameter names.
//! - [`presets`]: built-in published configs (`llama3-8b`, `mixtral-8x7b`, tiny ones, ...).
//! - [`model`]: [`Model`] and [`load`] (preset, config.json, model directory, `.weft`).
//! - [`weights`]: safetensors checkpoints in and out, checked against the graph.
//! - [`init`]: seeded random weights at HF's init scale.

pub mod build;
pub mod config;
pub mod deepseek;
pub mod error;
mod fields;
mod gemma;
pub mod init;
pub mod mapped;
pub mod model;
mod neutral;
pub mod presets;
pub mod pt2;
pub mod weights;

pub use build::{build_graph, param_count};
pub use config::{Activation, Family, ModelConfig, MoeConfig, RopeConfig, Router};
pub use error::{FrontendError, WeightProblem};
pub use init::{random_weights, random_weights_observed};
pub use model::{load, load_file, Model, Origin};
pub use presets::{presets, Preset, PresetInfo};
pub use weights::{
    check_weights, checkpoint_files, load_weights, read_checkpoint, read_safetensors,
    save_safetensors, Checkpoint,
};

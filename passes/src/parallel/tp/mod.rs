//! Tensor parallelism over the mesh axis `tp` (Megatron style, DeepSpeed AutoTP's
//! sharding rules), as one SPMD program for every rank.
//!
//! - [`spec`]: layer specs (DeepSpeed `partition_config` JSON, HF `base_model_tp_plan`,
//!   the built-in preset) deciding which parameters split and how;
//! - [`sizes`]: the per-rank sizes (kv-head boundaries, grain, replicated kv heads);
//! - [`rewrite`]: the `tensor-parallel` pass;
//! - [`layout`]: the reshardable per-parameter metadata of a compiled program, and
//!   cutting a full checkpoint into per-rank shards and back.

pub mod layout;
pub mod rewrite;
pub mod sizes;
pub mod spec;

pub use layout::{param_layouts, shard_checkpoint, unshard_checkpoint, ParamLayout};
pub use rewrite::{TensorParallel, NAME};
pub use spec::{LayerSpec, PartitionType, SpecError, TpSpec};

/// The mesh axis tensor parallelism runs over.
pub const TP: &str = "tp";

/// What `tensor-parallel` reads from [`crate::PassOptions`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TpOptions {
    /// An explicit spec (`--tp-spec FILE`): first priority.
    pub spec: Option<TpSpec>,
    /// HF `base_model_tp_plan` entries from config.json, in file order: second priority.
    pub hf_plan: Vec<(String, String)>,
    /// Where `hf_plan` came from, for messages.
    pub hf_plan_source: String,
    /// The model's `model_type`, for specs with `model_types`.
    pub model_type: Option<String>,
    /// DeepSpeed `tp_grain_size` (default: the spec's, else 1).
    pub grain: Option<i64>,
    /// Grain of vocabulary dims (default: `grain`).
    pub vocab_grain: Option<i64>,
    /// Megatron-style sequence parallelism inside tp: norms and residuals on `S/tp`
    /// tokens, all_gather before column-parallel layers, reduce_scatter after row ones.
    pub sequence_parallel: bool,
}

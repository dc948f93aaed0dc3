//! weft-passes: the pass manager and the rewrite passes.
//!
//! - [`Pass`]: a named rewrite with a one-line summary, its prerequisites and the mesh
//!   axes it needs; [`PassContext`] carries the mesh and options, [`PassResult`] what
//!   changed and the pass's counters.
//! - [`registry`]: every pass by name, pipelines as data with the reason for each
//!   position, [`default_pipeline`] per mesh.
//! - [`PassManager`]: runs a pipeline with verify-each, print-before/after,
//!   print-changes (unified diffs), statistics, stop-after and bisect.
//! - Sequence parallelism (mesh axis `sp`, DeepSpeed Ulysses/AutoSP in SPMD form):
//!   [`shard_inputs`], [`shard_seq`], [`ulysses`], [`sp_loss`]; data parallelism over
//!   `dp` is handled by the same passes (batch dim). [`canonicalize`]: fold, CSE, DCE.
//! - Tensor parallelism (mesh axis `tp`): [`tp`] (`tensor-parallel`, layer specs,
//!   per-rank sizes, reshardable parameter layouts).
//! - Expert parallelism (mesh axis `ep`, derived from the ranks like DeepSpeed's expert
//!   groups): [`ep`] (`expert-parallel`).
//! - [`check_bindings`]: plan-time check that concrete sizes divide.

pub mod autodiff;
pub mod bindings;
pub mod canonicalize;
pub mod checkpoint;
pub mod ep;
pub mod grad_sync;
pub mod manager;
pub mod memory;
pub mod micro_batches;
pub mod offload;
pub mod optimizer;
pub mod pass;
pub mod plan;
pub mod registry;
pub mod shard_inputs;
pub mod shard_seq;
pub mod simplify;
pub mod sp_loss;
pub mod tp;
pub mod training;
pub mod ulysses;
mod util;

pub use bindings::{check_bindings, BindingError};
pub use manager::{run_pipeline, Instrumentation, PassFilter, PassManager, PassStats, RunReport};
pub use pass::{MeshAxes, Pass, PassContext, PassError, PassOptions, PassResult, DP, SP, TP};
pub use registry::{
    check_pipeline, default_pipeline, default_pipeline_explained, lookup, pass_names, passes,
    Pipeline, Step,
};

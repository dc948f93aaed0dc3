//! weft-passes: the compile driver, the pass manager and the rewrite passes.
//!
//! - [`driver`]: the one compile every CLI verb calls: a request (model, mesh, sizes,
//!   training options, pass list, instrumentation, device) in; the program, the
//!   pipeline with its reasons, the report, the plan and the options it chose out.
//! - [`Pass`]: a named rewrite with a one-line summary, its prerequisites and the mesh
//!   axes it needs; [`PassContext`] carries the mesh and options, [`PassResult`] what
//!   changed and the pass's counters.
//! - [`registry`]: every pass by name, pipelines as data with the reason for each
//!   position, [`default_pipeline`] per mesh.
//! - [`PassManager`]: runs a pipeline with verify-each, print-before/after,
//!   print-changes (unified diffs), statistics, stop-after and bisect.
//! - The passes by what they do: [`parallel`] (sp/Ulysses, dp, tp, ep), [`train`]
//!   (micro-batches, autodiff, checkpoint, offload, grad-sync, optimizer), [`lower`]
//!   (plan, memory estimate, bindings) and [`cleanup`] (simplify, canonicalize).

pub mod cleanup;
pub mod driver;
pub mod lower;
pub mod manager;
pub mod parallel;
pub mod pass;
pub mod placement;
pub mod readers;
pub mod registry;
pub mod train;
mod util;

// The pass modules by their old flat names, so `crate::ulysses` and
// `weft_passes::autodiff` keep working across the folder split.
pub use cleanup::{canonicalize, simplify};
pub use lower::{bindings, convert_dtype, fuse, memory, plan, search};
pub use parallel::{
    ep, ring, ring_allgather, ring_lower, ring_steps, shard_inputs, shard_seq, sp_loss, tp, ulysses,
};
pub use train::{
    autodiff, checkpoint, fp8, grad_sync, linear_ce, micro_batches, offload, optimizer,
    stream_state, training, update_timing, zero, zero_split,
};

pub use bindings::{check_bindings, BindingError};
pub use manager::{run_pipeline, Instrumentation, PassFilter, PassManager, PassStats, RunReport};
pub use pass::{MeshAxes, Pass, PassContext, PassError, PassOptions, PassResult, DP, SP, TP};
pub use registry::{
    check_pipeline, default_pipeline, default_pipeline_explained, lookup, parse_pass_names,
    pass_names, passes, Pipeline, Step,
};

//! Training passes: what turns a forward program into a training step.
//!
//! [`linear_ce`] (lm_head + cross-entropy fused over vocabulary chunks), [`fp8`] (the
//! linear layers' GEMMs in FP8), [`micro_batches`] (gradient accumulation), [`autodiff`] (the backward),
//! [`checkpoint`] (recompute policies and the memory budget), [`offload`] (activations
//! to the host), [`grad_sync`] (coalesced gradient reduction), [`optimizer`] (updates
//! inside the backward; [`update_timing`] moves those that would wait for their
//! reduction), [`zero`] and [`zero_split`] (ZeRO's groups, collectives and
//! padding-free splits) and [`training`] (the training options and pass list).

pub mod autodiff;
pub mod checkpoint;
pub mod fp8;
pub mod grad_sync;
pub mod linear_ce;
pub mod micro_batches;
pub mod offload;
pub mod optimizer;
pub mod stream_state;
pub mod training;
pub mod update_timing;
pub mod zero;
pub mod zero_split;

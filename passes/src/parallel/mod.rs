//! Parallelism passes: how one program is split over a mesh axis.
//!
//! - Sequence parallelism (axis `sp`, DeepSpeed Ulysses/AutoSP in SPMD form):
//!   [`shard_inputs`], [`shard_seq`], [`ulysses`], [`sp_loss`]; data parallelism over
//!   `dp` rides on the same passes (batch dim).
//! - Context parallelism (axis `cp`, ring attention with zigzag load balance, and the
//!   Ulysses x ring hybrid with `sp`): [`ring`], on the sequence split `shard_inputs` /
//!   `shard_seq` make in zigzag order, and [`ring_lower`], which expands the ring ops
//!   into ring steps after `autodiff` ([`ring_steps`]: where a sliding window lets
//!   the ring stop early; [`ring_allgather`]: the all-gather variant, `--cp-kv`).
//! - Tensor parallelism (axis `tp`): [`tp`].
//! - Expert parallelism (axis `ep`, DeepSpeed's expert groups): [`ep`].

pub mod ep;
pub mod ring;
pub mod ring_allgather;
pub mod ring_lower;
pub mod ring_steps;
pub mod shard_inputs;
pub mod shard_seq;
pub mod sp_loss;
pub mod tp;
pub mod ulysses;

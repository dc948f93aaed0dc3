//! weft-runtime: executors for Weft graphs.
//!
//! - [`cpu`]: the reference executor. It runs an SPMD graph on simulated ranks (one
//!   thread per rank, real in-process collectives) with candle-core tensors, and takes
//!   gradients with candle's autograd. Every compiler pass is judged against it.
//! - `cuda` (behind the cargo feature `cuda`): the plan executor on an NVIDIA GPU
//!   (cuBLASLt, NVRTC kernels, NCCL, streams and events from the plan).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

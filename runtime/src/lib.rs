//! weft-runtime: executors for Weft graphs.
//!
//! - [`cpu`]: the reference executor. It runs an SPMD graph on simulated ranks (one
//!   thread per rank, real in-process collectives) with candle-core tensors, and takes
//!   gradients with candle's autograd. Every compiler pass is judged against it.
//! - [`host_adamw_math`]: AdamW over host memory, the CUDA host optimizer's arithmetic.
//! - [`launch`]: who this process is among launched ones (torchrun/Slurm/`weft launch`
//!   variables) and the rendezvous that hands out the NCCL id, with a timeout.
//! - `cuda` (behind the cargo feature `cuda`): the plan executor on an NVIDIA GPU
//!   (cuBLASLt, NVRTC kernels, NCCL, streams and events from the plan).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host_adamw_math;
pub mod launch;

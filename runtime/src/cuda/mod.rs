//! The CUDA executor (cargo feature `cuda`): runs an [`ExecutionPlan`] on an NVIDIA GPU.
//!
//! - [`probe`]: is there a GPU and are libcuda, NVRTC and cuBLASLt loadable? Absence
//!   is a [`CudaError`], never a panic (cudarc loads libraries dynamically and would
//!   panic at the first call into a missing one).
//! - [`device`]: context, the kernel module (CUDA C in `kernels.cu`, `attention.cu`,
//!   `backward.cu`, compiled once by NVRTC to a cubin and cached on disk), raw
//!   allocations, streams, events, pinned memory, launches.
//! - [`cudnn_sdpa`]: cuDNN's fused flash attention (forward and backward) through the
//!   cuDNN backend API; the default where libcudnn loads (`WEFT_ATTENTION=weft` for Weft's
//!   own kernels).
//! - `host_adamw`: the host optimizer update (`--offload-optimizer`): AdamW on host
//!   threads over the pinned master weights and moments, as a host function on the
//!   plan's host stream.
//! - [`gemm`]: cuBLASLt GEMMs with descriptors and algorithms cached per shape.
//! - [`comm`]: launcher variables (torchrun, Slurm) and NCCL communicators per mesh axis.
//! - [`exec`]: the plan executor: the plan's arena and resident region as one
//!   allocation each, its streams and events, every instruction lowered to launches once,
//!   a step replays them.
//! - [`layout`]: host-side layout logic, unit-tested without a GPU.
//! - `kernels`: typed descriptors of the CUDA kernels (parameters, launch shape, op
//!   codes), checked against the kernel source by a unit test.
//!
//! Typical use:
//! ```no_run
//! # fn f(plan: &weft_ir::ExecutionPlan, w: &std::collections::BTreeMap<String, weft_ir::HostTensor>,
//! #      x: &std::collections::BTreeMap<String, weft_ir::HostTensor>) -> Result<(), weft_runtime::cuda::CudaError> {
//! use weft_runtime::cuda::{Executor, ExecOptions};
//! let mut ex = Executor::new(plan, &ExecOptions::from_env())?;
//! ex.load_params(w)?;
//! ex.set_inputs(x)?;
//! let t = ex.run_step()?;
//! let loss = ex.output("loss")?;
//! # Ok(()) }
//! ```

pub mod comm;
pub mod cudnn_lib;
pub mod cudnn_sdpa;
pub mod device;
pub mod error;
pub mod exec;
pub mod gemm;
pub(crate) mod host_adamw;
pub(crate) mod kernels;
pub mod layout;
pub mod nvrtc;
pub mod probe;
pub(crate) mod step_graph;
pub mod tuning;

pub use comm::LaunchEnv;
pub use device::{Gpu, GpuOptions};
pub use error::{CudaError, CudaResult};
pub use exec::{DevT, ExecOptions, Executor, LoadReport, MemoryUse, StepTiming};
pub use probe::{probe, DeviceInfo};
pub use tuning::Tuning;

/// A one-line answer to "can the CUDA backend run here?", without panicking.
pub fn availability() -> Result<DeviceInfo, CudaError> {
    probe(0)
}

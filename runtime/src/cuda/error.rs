//! Errors of the CUDA backend. Every driver, cuBLASLt, NVRTC and NCCL call is checked and
//! turned into one of these, naming the call; absence of a GPU or of a library is an
//! error too (never a panic), with what would fix it.

use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A shared library the backend loads at run time is missing.
    #[error("the CUDA backend needs {lib}, which was not found on this machine\nhelp: {help}")]
    MissingLibrary { lib: &'static str, help: String },
    /// The driver loaded but reports no device.
    #[error("no CUDA device is visible ({0})\nhelp: check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or run with `--backend cpu`")]
    NoDevice(String),
    #[error("CUDA driver call `{call}` failed: {code}")]
    Driver { call: String, code: String },
    #[error("cuBLASLt call `{call}` failed: {code}")]
    Cublas { call: String, code: String },
    #[error("NVRTC could not compile the kernels ({message})\n{log}")]
    Nvrtc { message: String, log: String },
    #[error("NCCL call `{call}` failed: {code}")]
    Nccl { call: String, code: String },
    /// A device allocation did not fit; `breakdown` is the program's memory by category.
    #[error("out of device memory allocating {what} ({}): {} free of {}\n{}help: {help}",
        gib(*.bytes), gib(*.free), gib(*.total), breakdown_text(.breakdown))]
    OutOfMemory {
        what: String,
        bytes: u64,
        free: u64,
        total: u64,
        breakdown: BTreeMap<String, u64>,
        help: String,
    },
    /// An op, dtype or shape this backend does not run yet.
    #[error("the CUDA backend cannot run {what} in {location}: {why}")]
    Unsupported {
        what: String,
        location: String,
        why: String,
    },
    /// The plan or its program is inconsistent with what the executor was given.
    #[error("{0}")]
    Plan(String),
    /// A kernel found bad data (a token id or label out of range).
    #[error("a kernel found bad data after instruction {after}: {message}")]
    BadData { after: String, message: String },
    #[error("launcher environment: {0}")]
    Launcher(String),
}

pub type CudaResult<T> = Result<T, CudaError>;

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn breakdown_text(b: &BTreeMap<String, u64>) -> String {
    b.iter()
        .map(|(k, v)| format!("  {k:<16} {}\n", gib(*v)))
        .collect()
}

impl CudaError {
    pub(crate) fn driver(call: &str, e: cudarc::driver::DriverError) -> CudaError {
        let name = e
            .error_name()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let text = e
            .error_string()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError::Driver {
            call: call.to_string(),
            code: if text.is_empty() {
                name
            } else {
                format!("{name}: {text}")
            },
        }
    }
    pub(crate) fn cublas(call: &str, e: cudarc::cublaslt::result::CublasError) -> CudaError {
        CudaError::Cublas {
            call: call.to_string(),
            code: format!("{:?}", e.0),
        }
    }
    pub(crate) fn nccl(call: &str, e: cudarc::nccl::result::NcclError) -> CudaError {
        // NcclError's Debug prints only "NcclError": name the ncclResult_t.
        CudaError::Nccl {
            call: call.to_string(),
            code: format!("{:?}", e.0),
        }
    }
    pub(crate) fn unsupported(
        what: impl Into<String>,
        location: impl Into<String>,
        why: impl Into<String>,
    ) -> CudaError {
        CudaError::Unsupported {
            what: what.into(),
            location: location.into(),
            why: why.into(),
        }
    }
    /// True when the driver said the device is out of memory.
    pub fn is_oom(&self) -> bool {
        matches!(self, CudaError::OutOfMemory { .. })
            || matches!(self, CudaError::Driver { code, .. } if code.contains("OUT_OF_MEMORY"))
    }
}

/// `r.map_err(|e| CudaError::driver(call, e))`.
pub(crate) trait DriverCheck<T> {
    fn ck(self, call: &str) -> CudaResult<T>;
}
impl<T> DriverCheck<T> for Result<T, cudarc::driver::DriverError> {
    fn ck(self, call: &str) -> CudaResult<T> {
        self.map_err(|e| CudaError::driver(call, e))
    }
}
impl<T> DriverCheck<T> for Result<T, cudarc::cublaslt::result::CublasError> {
    fn ck(self, call: &str) -> CudaResult<T> {
        self.map_err(|e| CudaError::cublas(call, e))
    }
}

impl From<crate::launch::LaunchError> for CudaError {
    fn from(e: crate::launch::LaunchError) -> CudaError {
        CudaError::Launcher(e.0)
    }
}

//! Is there a GPU, and are the libraries the backend loads at run time present? With
//! `dynamic-loading`, cudarc panics at the first call into a missing library, so every
//! library is checked here first and absence becomes a [`CudaError`].

use super::error::{CudaError, CudaResult};
use cudarc::driver::sys::CUdevice_attribute as Attr;

/// What `probe` found.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: u64,
    pub multiprocessors: i32,
    pub device_count: i32,
}

/// Checks libcuda, NVRTC and cuBLASLt, initialises the driver and describes device
/// `ordinal`. NCCL is checked separately ([`nccl_present`]), only when a run needs it.
pub fn probe(ordinal: usize) -> CudaResult<DeviceInfo> {
    // SAFETY: these only try to open the libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::MissingLibrary {
            lib: "the NVIDIA driver library (libcuda.so)",
            help: "run on a machine with an NVIDIA GPU and driver, or use `--backend cpu`".into(),
        });
    }
    cudarc::driver::result::init()
        .map_err(|e| CudaError::NoDevice(format!("cuInit: {:?}", e.0)))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| CudaError::NoDevice(format!("cuDeviceGetCount: {:?}", e.0)))?;
    if count <= 0 {
        return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
    }
    if ordinal as i32 >= count {
        return Err(CudaError::NoDevice(format!(
            "device {ordinal} was asked for but only {count} are visible (LOCAL_RANK or CUDA_VISIBLE_DEVICES)"
        )));
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::MissingLibrary {
            lib: "NVRTC (libnvrtc.so, CUDA 13)",
            help: "install the CUDA toolkit's runtime libraries or add their directory to LD_LIBRARY_PATH".into(),
        });
    }
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(CudaError::MissingLibrary {
            lib: "cuBLASLt (libcublasLt.so, CUDA 13)",
            help: "install the CUDA toolkit's cuBLAS or add its directory to LD_LIBRARY_PATH"
                .into(),
        });
    }
    let dev = cudarc::driver::result::device::get(ordinal as i32)
        .map_err(|e| CudaError::driver("cuDeviceGet", e))?;
    let name = cudarc::driver::result::device::get_name(dev)
        .map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
    // SAFETY: dev is a valid device handle.
    let attr = |a: Attr| {
        unsafe { cudarc::driver::result::device::get_attribute(dev, a) }
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))
    };
    let major = attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let sms = attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let total = unsafe { cudarc::driver::result::device::total_mem(dev) }
        .map_err(|e| CudaError::driver("cuDeviceTotalMem", e))? as u64;
    Ok(DeviceInfo {
        ordinal,
        name,
        compute_capability: (major, minor),
        total_memory: total,
        multiprocessors: sms,
        device_count: count,
    })
}

/// Whether libnccl can be loaded (a missing NCCL panics inside cudarc at first use, so
/// this is also wrapped in `catch_unwind`).
pub fn nccl_present() -> bool {
    std::panic::catch_unwind(|| unsafe { cudarc::nccl::sys::is_culib_present() }).unwrap_or(false)
}

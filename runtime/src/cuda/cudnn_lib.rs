//! libcudnn, loaded here rather than through cudarc's loader. cudarc tries the
//! unversioned `libcudnn.so` first, which on a typical machine only the system's cuDNN
//! provides: where PyTorch's pip cuDNN (newer) is on `LD_LIBRARY_PATH`, the system's
//! older one won anyway (9.14 over 9.19 on the GPU machine). Order: `WEFT_CUDNN` (a file), the soname
//! `libcudnn.so.9` (`LD_LIBRARY_PATH` first, then the loader's cache), `libcudnn.so`.
//! cudarc's `cudnn::sys` still gives the types.

use cudarc::cudnn::sys as c;
use std::ffi::{c_char, c_void};

type Status = c::cudnnStatus_t;
type Raw = c::cudnnBackendDescriptor_t;

/// The entry points the attention module calls.
pub struct Lib {
    _lib: libloading::Library,
    /// What was loaded (the name or path given to the loader).
    pub source: String,
    pub get_version: unsafe extern "C" fn() -> usize,
    pub get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub get_last_error_string: unsafe extern "C" fn(*mut c_char, usize),
    pub create: unsafe extern "C" fn(*mut c::cudnnHandle_t) -> Status,
    pub destroy: unsafe extern "C" fn(c::cudnnHandle_t) -> Status,
    pub set_stream: unsafe extern "C" fn(c::cudnnHandle_t, c::cudaStream_t) -> Status,
    pub backend_create_descriptor:
        unsafe extern "C" fn(c::cudnnBackendDescriptorType_t, *mut Raw) -> Status,
    pub backend_destroy_descriptor: unsafe extern "C" fn(Raw) -> Status,
    pub backend_finalize: unsafe extern "C" fn(Raw) -> Status,
    pub backend_execute: unsafe extern "C" fn(c::cudnnHandle_t, Raw, Raw) -> Status,
    pub backend_set_attribute: unsafe extern "C" fn(
        Raw,
        c::cudnnBackendAttributeName_t,
        c::cudnnBackendAttributeType_t,
        i64,
        *const c_void,
    ) -> Status,
    pub backend_get_attribute: unsafe extern "C" fn(
        Raw,
        c::cudnnBackendAttributeName_t,
        c::cudnnBackendAttributeType_t,
        i64,
        *mut i64,
        *mut c_void,
    ) -> Status,
}

/// The names tried, in order.
fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("WEFT_CUDNN") {
        v.push(p.to_string_lossy().into_owned());
    }
    v.push("libcudnn.so.9".into());
    v.push("libcudnn.so".into());
    v
}

fn load(name: &str) -> Result<Lib, String> {
    // SAFETY: loading libcudnn runs its initialisers, which have no preconditions; the
    // symbols' types are cuDNN 9's C API (as cudarc's bindings declare them).
    unsafe {
        let lib = libloading::Library::new(name).map_err(|e| format!("{name}: {e}"))?;
        macro_rules! sym {
            ($s:literal) => {
                *lib.get($s)
                    .map_err(|e| format!("{name}: {}: {e}", String::from_utf8_lossy($s)))?
            };
        }
        Ok(Lib {
            source: mapped_path().unwrap_or_else(|| name.to_string()),
            get_version: sym!(b"cudnnGetVersion"),
            get_error_string: sym!(b"cudnnGetErrorString"),
            get_last_error_string: sym!(b"cudnnGetLastErrorString"),
            create: sym!(b"cudnnCreate"),
            destroy: sym!(b"cudnnDestroy"),
            set_stream: sym!(b"cudnnSetStream"),
            backend_create_descriptor: sym!(b"cudnnBackendCreateDescriptor"),
            backend_destroy_descriptor: sym!(b"cudnnBackendDestroyDescriptor"),
            backend_finalize: sym!(b"cudnnBackendFinalize"),
            backend_execute: sym!(b"cudnnBackendExecute"),
            backend_set_attribute: sym!(b"cudnnBackendSetAttribute"),
            backend_get_attribute: sym!(b"cudnnBackendGetAttribute"),
            _lib: lib,
        })
    }
}

/// The file the loader mapped for libcudnn (Linux), to say which one runs.
fn mapped_path() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            std::path::Path::new(p)
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with("libcudnn.so"))
        })
        .map(str::to_string)
}

/// The first candidate that loads with every symbol, once per process; else why none
/// did.
pub fn lib() -> Result<&'static Lib, String> {
    static L: std::sync::OnceLock<Result<Lib, String>> = std::sync::OnceLock::new();
    L.get_or_init(|| {
        let mut why = Vec::new();
        for name in candidates() {
            match load(&name) {
                Ok(l) => return Ok(l),
                Err(e) => why.push(e),
            }
        }
        Err(why.join("; "))
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// [`lib`] where it has loaded before (every cuDNN call runs after
/// `cudnn_sdpa::available` succeeded).
pub fn api() -> &'static Lib {
    lib().expect("cuDNN is used only after cudnn_sdpa::available() loaded it")
}

#[cfg(test)]
mod tests {
    /// The soname (which follows LD_LIBRARY_PATH) before the unversioned name (which on
    /// most machines only the system's cuDNN has).
    #[test]
    fn the_soname_is_tried_before_the_unversioned_name() {
        let c = super::candidates();
        let at = |n: &str| c.iter().position(|x| x == n).unwrap();
        assert!(at("libcudnn.so.9") < at("libcudnn.so"), "{c:?}");
        assert_eq!(c.last().map(String::as_str), Some("libcudnn.so"));
    }
}

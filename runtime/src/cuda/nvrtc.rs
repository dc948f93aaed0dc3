//! Run-time compilation of the kernels through NVRTC, straight to a cubin for the
//! device's architecture, cached on disk: the key hashes the source, the options, the
//! NVRTC version and the architecture, so a second start loads the cubin in
//! milliseconds and any change recompiles.

use super::error::{CudaError, CudaResult};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// Where compiled kernels are cached: `$WEFT_CACHE_DIR`, else `$XDG_CACHE_HOME/weft/kernels`,
/// else `~/.cache/weft/kernels`, else the system temp dir.
pub fn default_cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("WEFT_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Ok(d) = std::env::var("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("weft").join("kernels");
    }
    if let Ok(h) = std::env::var("HOME") {
        return PathBuf::from(h).join(".cache").join("weft").join("kernels");
    }
    std::env::temp_dir().join("weft-kernels")
}

/// Directories searched for `cuda_bf16.h` (NVRTC has no built-in copy):
/// `$WEFT_CUDA_INCLUDE`, `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Ok(d) = std::env::var("WEFT_CUDA_INCLUDE") {
        v.push(PathBuf::from(d));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(d) = std::env::var(var) {
            v.push(PathBuf::from(d).join("include"));
        }
    }
    v.push(PathBuf::from("/usr/local/cuda/include"));
    v.retain(|d| d.join("cuda_bf16.h").exists());
    v.dedup();
    v
}

/// FNV-1a 64, for cache keys (stable across runs and platforms).
pub fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// How a compile went.
#[derive(Clone, Debug)]
pub struct CompileReport {
    pub cache_hit: bool,
    pub seconds: f64,
    pub path: PathBuf,
}

fn nvrtc_version() -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    (a, b)
}

/// Compiles `src` for `sm_{cc}` (a cubin), or loads it from `cache_dir`.
pub fn compile_cubin(
    src: &str,
    cc: (i32, i32),
    cache_dir: &Path,
    extra_opts: &[String],
    threads: usize,
) -> CudaResult<(Vec<u8>, CompileReport)> {
    let t0 = std::time::Instant::now();
    let includes = include_dirs();
    if includes.is_empty() {
        return Err(CudaError::Nvrtc {
            message: "cuda_bf16.h was not found".into(),
            log: "help: set CUDA_HOME (or WEFT_CUDA_INCLUDE) to the CUDA toolkit whose include/ holds cuda_bf16.h".into(),
        });
    }
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        "--extra-device-vectorization".to_string(),
    ];
    opts.extend(extra_opts.iter().cloned());
    for d in &includes {
        opts.push(format!("-I{}", d.display()));
    }
    let ver = nvrtc_version();
    let opt_text = opts.join(" ");
    let key = fnv64(&[
        src.as_bytes(),
        opt_text.as_bytes(),
        format!("{ver:?}").as_bytes(),
    ]);
    let path = cache_dir.join(format!("weft-{arch}-{key:016x}.cubin"));
    if let Ok(bin) = std::fs::read(&path) {
        if !bin.is_empty() {
            return Ok((
                bin,
                CompileReport {
                    cache_hit: true,
                    seconds: t0.elapsed().as_secs_f64(),
                    path,
                },
            ));
        }
    }
    let csrc = CString::new(src).map_err(|_| CudaError::Nvrtc {
        message: "source has a NUL byte".into(),
        log: String::new(),
    })?;
    // NVRTC's split compilation runs the optimizer over the kernels on `threads` cores
    // (0: every core; the output is the same program); an NVRTC that does not know the
    // option compiles on one thread. 1 is one thread (to compare cold starts).
    let g = if threads == 1 {
        compile_program(&csrc, &opts, &opt_text)?
    } else {
        let mut split = opts.clone();
        split.push(format!("--split-compile={threads}"));
        match compile_program(&csrc, &split, &opt_text) {
            Ok(g) => g,
            Err(CudaError::Nvrtc { message, .. }) if message.contains("INVALID_OPTION") => {
                compile_program(&csrc, &opts, &opt_text)?
            }
            Err(e) => return Err(e),
        }
    };
    let mut size = 0usize;
    // SAFETY: prog compiled; out-parameter.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcGetCUBINSize(g.0, &mut size) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(CudaError::Nvrtc {
            message: format!("nvrtcGetCUBINSize: {r:?} (is {arch} a real architecture?)"),
            log: String::new(),
        });
    }
    let mut bin = vec![0u8; size];
    let r = unsafe {
        cudarc::nvrtc::sys::nvrtcGetCUBIN(g.0, bin.as_mut_ptr() as *mut std::ffi::c_char)
    };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Nvrtc {
            message: format!("nvrtcGetCUBIN: {r:?}"),
            log: String::new(),
        });
    }
    // Best effort: a cache that cannot be written only costs the next start a compile.
    if std::fs::create_dir_all(cache_dir).is_ok() {
        let tmp = cache_dir.join(format!(".weft-{key:016x}.{}.tmp", std::process::id()));
        if std::fs::write(&tmp, &bin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((
        bin,
        CompileReport {
            cache_hit: false,
            seconds: t0.elapsed().as_secs_f64(),
            path,
        },
    ))
}

/// A compiled NVRTC program (destroyed on drop).
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `compile_program`, destroyed once.
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

fn compile_program(src: &CString, opts: &[String], opt_text: &str) -> CudaResult<Program> {
    let name = CString::new("weft_kernels.cu").expect("no NUL");
    let prog =
        cudarc::nvrtc::result::create_program(src, Some(&name)).map_err(|e| CudaError::Nvrtc {
            message: format!("nvrtcCreateProgram: {:?}", e.0),
            log: String::new(),
        })?;
    let g = Program(prog);
    // SAFETY: prog is a live program.
    let compiled = unsafe { cudarc::nvrtc::result::compile_program(g.0, opts) };
    if let Err(e) = compiled {
        let log = unsafe { cudarc::nvrtc::result::get_program_log(g.0) }
            .map(|raw| {
                unsafe { CStr::from_ptr(raw.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        return Err(CudaError::Nvrtc {
            message: format!("{:?} with options `{opt_text}`", e.0),
            log,
        });
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_is_stable_and_separates_parts() {
        assert_eq!(fnv64(&[b"abc"]), fnv64(&[b"abc"]));
        assert_ne!(fnv64(&[b"ab", b"c"]), fnv64(&[b"a", b"bc"]));
        assert_ne!(fnv64(&[b"x"]), fnv64(&[b"y"]));
    }

    #[test]
    fn cache_dir_honours_env() {
        // Only checks the shape of the default; env vars are process-global, so no set_var.
        let d = default_cache_dir();
        assert!(d.components().count() > 0);
    }
}

//! The device: context, the kernel module, raw allocations, streams, events, pinned
//! host memory and kernel launches. Everything is a thin checked wrapper over the
//! driver API (cudarc's `result` layer): the executor manages streams and events
//! itself, so cudarc's own event tracking is off.

use super::error::{CudaError, CudaResult, DriverCheck};
use super::nvrtc::{self, CompileReport};
use super::probe::DeviceInfo;
use cudarc::driver::{result as dr, sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::Arc;

/// The kernels' CUDA C source (one translation unit).
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("kernels.cu"),
    "\n",
    include_str!("attention.cu"),
    "\n",
    include_str!("backward.cu"),
    "\n",
    include_str!("fused.cu"),
    "\n",
    include_str!("linear_ce.cu"),
    "\n",
    include_str!("fp8.cu")
);

/// An owned device allocation.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by `Gpu::alloc`, freed once.
            let _ = unsafe { dr::free_sync(self.ptr) };
        }
    }
}

/// Pinned (page-locked) host memory, allocated once.
pub struct Pinned {
    pub ptr: *mut u8,
    pub bytes: usize,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by cuMemHostAlloc, freed once.
            let _ = unsafe { dr::free_host(self.ptr as *mut c_void) };
        }
    }
}

// SAFETY: the pointer is only dereferenced by the thread that owns the executor.
unsafe impl Send for Pinned {}

pub struct Stream(pub sys::CUstream);
impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by `Gpu::stream`, destroyed once.
        let _ = unsafe { dr::stream::destroy(self.0) };
    }
}

pub struct Event(pub sys::CUevent);
impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `Gpu::event`, destroyed once.
        let _ = unsafe { dr::event::destroy(self.0) };
    }
}

/// A kernel argument, kept alive until the launch.
#[derive(Clone, Debug)]
pub enum Arg {
    P(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    U64(u64),
    /// A `#[repr(C)]` struct passed by value.
    Blob(Box<[u8]>),
}

impl Arg {
    fn ptr(&self) -> *mut c_void {
        match self {
            Arg::P(v) | Arg::U64(v) => v as *const u64 as *mut c_void,
            Arg::I64(v) => v as *const i64 as *mut c_void,
            Arg::I32(v) => v as *const i32 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
            Arg::Blob(b) => b.as_ptr() as *mut c_void,
        }
    }
    /// A `#[repr(C)]` value as a by-value kernel parameter.
    pub fn blob<T: Copy>(v: &T) -> Arg {
        // SAFETY: T is plain old data (repr(C) structs of integers).
        let bytes = unsafe {
            std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>())
        };
        Arg::Blob(bytes.to_vec().into_boxed_slice())
    }
}

/// A resolved kernel launch.
#[derive(Clone, Debug)]
pub struct Launch {
    pub func: sys::CUfunction,
    pub name: &'static str,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem: u32,
    pub args: Vec<Arg>,
}

// SAFETY: CUfunction handles are valid in every thread that binds the context.
unsafe impl Send for Launch {}

impl Launch {
    /// Enqueues the launch on `stream`.
    pub(crate) fn enqueue(&self, stream: sys::CUstream) -> CudaResult<()> {
        if self.grid.0 == 0 || self.grid.1 == 0 || self.grid.2 == 0 {
            return Ok(());
        }
        let mut ptrs: Vec<*mut c_void> = self.args.iter().map(Arg::ptr).collect();
        // SAFETY: the function comes from the loaded module; arguments match the kernel's
        // signature (each call site mirrors its kernel), and live for this call.
        unsafe {
            dr::launch_kernel(
                self.func, self.grid, self.block, self.smem, stream, &mut ptrs,
            )
        }
        .map_err(|e| {
            CudaError::driver(
                &format!(
                    "cuLaunchKernel({}, grid {:?}, block {:?}, smem {})",
                    self.name, self.grid, self.block, self.smem
                ),
                e,
            )
        })
    }
}

/// The device with its kernel module loaded.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub info: DeviceInfo,
    module: sys::CUmodule,
    funcs: std::cell::RefCell<HashMap<&'static str, sys::CUfunction>>,
    pub compile: CompileReport,
    /// Device int that kernels set when they meet bad data.
    pub err_flag: DevBuf,
    /// Free device bytes right after the context and module were set up.
    pub free_at_start: u64,
}

// SAFETY: the executor uses a Gpu from one thread at a time and binds the context first.
unsafe impl Send for Gpu {}

#[derive(Clone, Debug)]
pub struct GpuOptions {
    pub ordinal: usize,
    pub cache_dir: PathBuf,
    /// NVRTC's optimizer threads (`--split-compile`): 0 every core, 1 one thread.
    pub nvrtc_threads: usize,
}

impl Default for GpuOptions {
    /// Device 0, the kernel cache in the system temp dir, NVRTC on every core (no
    /// environment read; see [`GpuOptions::from_env`]).
    fn default() -> Self {
        GpuOptions {
            ordinal: 0,
            cache_dir: std::env::temp_dir().join("weft-kernels"),
            nvrtc_threads: 0,
        }
    }
}

impl GpuOptions {
    /// The kernel cache from `WEFT_CACHE_DIR` / `XDG_CACHE_HOME` / `HOME`, NVRTC's threads
    /// from `WEFT_NVRTC_SPLIT` (1 compiles on one thread).
    pub fn from_env() -> Self {
        GpuOptions {
            ordinal: 0,
            cache_dir: nvrtc::default_cache_dir(),
            nvrtc_threads: std::env::var("WEFT_NVRTC_SPLIT")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        }
    }
}

impl Gpu {
    /// Probes, creates the primary context on `ordinal`, compiles (or loads) the kernels.
    pub fn new(opts: &GpuOptions) -> CudaResult<Gpu> {
        let info = super::probe::probe(opts.ordinal)?;
        let ctx = CudaContext::new(opts.ordinal).ck("cuDevicePrimaryCtxRetain")?;
        // We order work with our own streams and events.
        // SAFETY: no cudarc-managed allocation exists yet.
        unsafe { ctx.disable_event_tracking() };
        ctx.bind_to_thread().ck("cuCtxSetCurrent")?;
        let (bin, compile) = nvrtc::compile_cubin(
            KERNEL_SOURCE,
            info.compute_capability,
            &opts.cache_dir,
            &[],
            opts.nvrtc_threads,
        )?;
        // SAFETY: `bin` is a cubin NVRTC produced for this device.
        let module = unsafe { dr::module::load_data(bin.as_ptr() as *const c_void) }
            .ck("cuModuleLoadData")?;
        let (free, _) = dr::mem_get_info().ck("cuMemGetInfo")?;
        let mut gpu = Gpu {
            ctx,
            info,
            module,
            funcs: Default::default(),
            compile,
            err_flag: DevBuf { ptr: 0, bytes: 0 },
            free_at_start: free as u64,
        };
        gpu.err_flag = gpu.alloc(256, "the error flag")?;
        gpu.memset(gpu.err_flag.ptr, 0, 256)?;
        Ok(gpu)
    }

    pub fn bind(&self) -> CudaResult<()> {
        self.ctx.bind_to_thread().ck("cuCtxSetCurrent")
    }

    /// A kernel of the module by name (looked up once).
    pub fn func(&self, name: &'static str) -> CudaResult<sys::CUfunction> {
        if let Some(f) = self.funcs.borrow().get(name) {
            return Ok(*f);
        }
        let c = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: module is loaded.
        let f = unsafe { dr::module::get_function(self.module, c) }
            .ck(&format!("cuModuleGetFunction({name})"))?;
        self.funcs.borrow_mut().insert(name, f);
        Ok(f)
    }

    /// A launch of kernel `name` (args in the kernel's order).
    pub fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: Vec<Arg>,
    ) -> CudaResult<Launch> {
        let func = self.func(name)?;
        if smem > 48 * 1024 {
            // SAFETY: valid function handle; raising its dynamic shared-memory limit.
            unsafe {
                dr::function::set_function_attribute(
                    func,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            }
            .ck(&format!(
                "cuFuncSetAttribute({name}, max dynamic smem {smem})"
            ))?;
        }
        Ok(Launch {
            func,
            name,
            grid,
            block,
            smem,
            args,
        })
    }

    /// A grid-stride elementwise launch over `n` items.
    pub fn launch_n(&self, name: &'static str, n: u64, args: Vec<Arg>) -> CudaResult<Launch> {
        let block = 256u32;
        let max_blocks = (self.info.multiprocessors.max(1) as u64) * 16;
        let blocks = n.div_ceil(block as u64).clamp(1, max_blocks.max(1)) as u32;
        let grid = if n == 0 { (0, 1, 1) } else { (blocks, 1, 1) };
        self.launch(name, grid, (block, 1, 1), 0, args)
    }

    pub fn alloc(&self, bytes: usize, what: &str) -> CudaResult<DevBuf> {
        if bytes == 0 {
            return Ok(DevBuf { ptr: 0, bytes: 0 });
        }
        // SAFETY: plain allocation.
        match unsafe { dr::malloc_sync(bytes) } {
            Ok(ptr) => Ok(DevBuf { ptr, bytes }),
            Err(e) => {
                let (free, total) = dr::mem_get_info().unwrap_or((0, 0));
                let err = CudaError::driver(&format!("cuMemAlloc({bytes} bytes for {what})"), e);
                if err.is_oom() {
                    Err(CudaError::OutOfMemory {
                        what: what.to_string(),
                        bytes: bytes as u64,
                        free: free as u64,
                        total: total as u64,
                        breakdown: Default::default(),
                        help: "use a smaller --seq or --batch, or a mesh with more ranks".into(),
                    })
                } else {
                    Err(err)
                }
            }
        }
    }

    pub fn alloc_pinned(&self, bytes: usize) -> CudaResult<Pinned> {
        if bytes == 0 {
            return Ok(Pinned {
                ptr: std::ptr::null_mut(),
                bytes: 0,
            });
        }
        // SAFETY: plain pinned allocation.
        let p = unsafe { dr::malloc_host(bytes, 0) }.ck(&format!("cuMemHostAlloc({bytes})"))?;
        Ok(Pinned {
            ptr: p as *mut u8,
            bytes,
        })
    }

    pub fn stream(&self) -> CudaResult<Stream> {
        Ok(Stream(
            dr::stream::create(dr::stream::StreamKind::NonBlocking).ck("cuStreamCreate")?,
        ))
    }

    /// A non-blocking stream at the context's highest priority (`high`) or its lowest:
    /// where both run, the block scheduler issues a pending high-priority kernel's
    /// blocks first as SMs free up.
    pub fn stream_with_priority(&self, high: bool) -> CudaResult<Stream> {
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: plain queries and creation in the current context; the out-pointers
        // are live locals.
        unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
                .result()
                .ck("cuCtxGetStreamPriorityRange")?;
            let mut st: sys::CUstream = std::ptr::null_mut();
            sys::cuStreamCreateWithPriority(
                &mut st,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                if high { greatest } else { least },
            )
            .result()
            .ck("cuStreamCreateWithPriority")?;
            Ok(Stream(st))
        }
    }

    pub fn event(&self, timing: bool) -> CudaResult<Event> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        Ok(Event(dr::event::create(flags).ck("cuEventCreate")?))
    }

    pub fn memset(&self, ptr: u64, value: u8, bytes: usize) -> CudaResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ptr..ptr+bytes is inside one of our allocations.
        unsafe { dr::memset_d8_sync(ptr, value, bytes) }.ck("cuMemsetD8")
    }

    pub fn htod(&self, dst: u64, src: &[u8]) -> CudaResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: dst has room for src (the caller sized it from the plan).
        unsafe { dr::memcpy_htod_sync(dst, src) }.ck(&format!("cuMemcpyHtoD({} bytes)", src.len()))
    }

    pub fn dtoh(&self, dst: &mut [u8], src: u64) -> CudaResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: src holds dst.len() bytes.
        unsafe { dr::memcpy_dtoh_sync(dst, src) }.ck(&format!("cuMemcpyDtoH({} bytes)", dst.len()))
    }

    pub(crate) fn dtod_async(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: sys::CUstream,
    ) -> CudaResult<()> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: both ranges are inside our allocations.
        unsafe { dr::memcpy_dtod_async(dst, src, bytes, stream) }
            .ck(&format!("cuMemcpyDtoDAsync({bytes})"))
    }

    pub fn sync(&self) -> CudaResult<()> {
        self.ctx.synchronize().ck("cuCtxSynchronize")
    }

    /// Reads and clears the bad-data flag.
    pub fn take_err_flag(&self) -> CudaResult<i32> {
        let mut b = [0u8; 4];
        self.dtoh(&mut b, self.err_flag.ptr)?;
        let v = i32::from_le_bytes(b);
        if v != 0 {
            self.memset(self.err_flag.ptr, 0, 4)?;
        }
        Ok(v)
    }

    /// (free, total) device bytes now.
    pub fn mem_info(&self) -> CudaResult<(u64, u64)> {
        let (f, t) = dr::mem_get_info().ck("cuMemGetInfo")?;
        Ok((f as u64, t as u64))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        // SAFETY: loaded in `new`, unloaded once; the error flag is freed by its own Drop.
        let _ = unsafe { dr::module::unload(self.module) };
    }
}

/// What a bad-data code means.
pub fn err_flag_text(code: i32) -> &'static str {
    match code {
        1 => "a token id is out of range for the embedding's rows",
        2 => "a label is out of range for the number of classes (and is not ignore_index)",
        3 => "a one_hot class index is out of range",
        4 => "an index_select index is out of range",
        5 => "a gather index is out of range",
        6 => "a scatter_add index is out of range",
        7 => "an expert index is out of range for num_experts",
        8 => "a moe_combine order entry is out of range",
        9 => "an embedding gradient id is out of range",
        _ => "unknown bad-data code",
    }
}

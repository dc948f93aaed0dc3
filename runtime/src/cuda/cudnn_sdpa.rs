//! cuDNN's fused flash attention (scaled dot-product attention), forward and backward,
//! through the cuDNN *backend* API (cudarc's raw `cudnn::sys` bindings; there is no C++
//! frontend here, so the operation graphs are built descriptor by descriptor).
//!
//! The graphs are the ones NVIDIA's cudnn-frontend lowers its SDPA nodes to (the engines
//! recognise these patterns and run them as one fused flash-attention kernel):
//!
//! forward (`O = softmax(scale * Q Kᵀ, causal) V`, `Stats = logsumexp` per row, f32):
//! ```text
//!   S  = matmul(Q, Kᵀ)                          f32 virtual [B,Hq,S,S]
//!   S  = S * scale                              scale: f32 pass-by-value
//!   S  = select(S, -inf, row >= col)            causal: GEN_INDEX axis 2/3 (i32), CMP_GE (bool)
//!   M  = reduce_max(S); E = exp(S - M); Z = reduce_add(E)
//!   Stats = M + log(Z)                          f32 [B,Hq,S,1] (natural log)
//!   P  = E / Z                                  bf16 virtual
//!   O  = matmul(P, V)
//! ```
//! backward (`dP - rowsum(dO∘O)` form, GQA through reduction over the head groups):
//! ```text
//!   Dsum = reduce_add(dO * O) * 1               f32 [B,Hq,S,1] (workspace tensor)
//!   P    = exp(mask(scale * Q Kᵀ) - Stats)      f32 virtual
//!   dV   = matmul(reshape(P)ᵀ, dO)              (GQA: [B,Hq,S,D] then reduce_add to Hkv)
//!   dS   = (matmul(dO, Vᵀ) - Dsum) * P * scale
//!   dK   = matmul(reshape(dS)ᵀ, Q)              (GQA as dV)
//!   dQacc= matmul(dS, reshape(Kᵀ))              f32 [B,Hq,S,D] (workspace tensor)
//!   dQ   = identity(dQacc)
//! ```
//! K and V are passed as Kᵀ/Vᵀ: the same memory with the last two dims and strides swapped.
//! A sliding window adds the band's left edge after the causal select, in both graphs
//! (`keep = col + W > row`: GEN_INDEX, a float ADD of the window, CMP_GT, select — the
//! composite diagonal-band node cudnn-frontend emits for cuDNN before 9.21). V, O, dO and
//! dV may have a head dim of their own (`Shape::dv`).
//!
//! Selected by default where libcudnn loads (`WEFT_ATTENTION=weft` forces Weft's kernels).
//! Measured on an H200 with cuDNN 9.14.0 (bf16, causal, 32 q / 8 kv heads, fwd+bwd):
//! S=4096 d=64 347 TFLOP/s (Weft 169), d=128 460 (183); S=16384 d=64 471 (194),
//! d=128 544 (206); the 1.24B Llama step 83.0 -> 72.0 ms at S=4096, 528.9 -> 356.8 ms
//! at S=16384.
//!
//! libcudnn is loaded at run time ([`crate::cuda::cudnn_lib`]: `WEFT_CUDNN`, then
//! `libcudnn.so.9` through `LD_LIBRARY_PATH`). On the GPU machine PyTorch's pip package
//! (nvidia-cudnn-cu13) has a newer one than the system's: put the package's `lib`
//! directory on `LD_LIBRARY_PATH` (see [`CUDNN_HELP`]).
//! Absence, an old version, or a graph no engine supports is an `Err(String)` that the
//! executor turns into one line on stderr and a fallback to Weft's own kernels.

use crate::cuda::cudnn_lib::{api, lib};
use c::cudnnBackendAttributeName_t as A;
use c::cudnnBackendAttributeType_t as Ty;
use c::cudnnBackendDescriptorType_t as D;
use c::cudnnDataType_t as Dt;
use c::cudnnPointwiseMode_t as Pw;
use cudarc::cudnn::sys as c;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

type Raw = c::cudnnBackendDescriptor_t;
type R<T> = Result<T, String>;

/// Where libcudnn usually is on the GPU machine, for error messages.
pub const CUDNN_HELP: &str = "libcudnn.so.9 (cuDNN 9) was not found: put its directory on LD_LIBRARY_PATH, e.g. with PyTorch's pip package (nvidia-cudnn-cu13) in the python3 on PATH: `export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + \"/lib\")')`";

/// Is libcudnn loadable with every symbol this module calls, and which version is it
/// (`cudnnGetVersion`, e.g. 91300)?
pub fn available() -> R<usize> {
    static V: std::sync::OnceLock<R<usize>> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        let lib = lib().map_err(|e| format!("{CUDNN_HELP} ({e})"))?;
        let v = unsafe { (lib.get_version)() };
        if v < 90000 {
            return Err(format!(
                "cuDNN {} is too old: the backend graph API of cuDNN 9 is needed",
                version_text(v)
            ));
        }
        Ok(v)
    })
    .clone()
}

/// 91300 -> "9.13.0".
pub fn version_text(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

fn status_text(s: c::cudnnStatus_t) -> String {
    let name = unsafe {
        let p = (api().get_error_string)(s);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    let mut buf = vec![0 as std::ffi::c_char; 2048];
    let last = std::panic::catch_unwind(move || unsafe {
        (api().get_last_error_string)(buf.as_mut_ptr(), buf.len());
        CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
    })
    .unwrap_or_default();
    let mut t = format!("{s:?}");
    if !name.is_empty() && !t.contains(&name) {
        t = format!("{t} ({name})");
    }
    if !last.trim().is_empty() {
        t = format!("{t}: {}", last.trim());
    }
    t
}

fn ck(s: c::cudnnStatus_t, what: impl FnOnce() -> String) -> R<()> {
    if s == c::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("{}: {}", what(), status_text(s)))
    }
}

/// An owned backend descriptor.
struct Desc(Raw);
impl Drop for Desc {
    fn drop(&mut self) {
        if !self.0.is_null() {
            unsafe { (api().backend_destroy_descriptor)(self.0) };
        }
    }
}
// SAFETY: descriptors are only used from the executor's thread, one at a time.
unsafe impl Send for Desc {}
unsafe impl Sync for Desc {}

fn create(t: D, what: &str) -> R<Desc> {
    let mut d: Raw = std::ptr::null_mut();
    ck(
        unsafe { (api().backend_create_descriptor)(t, &mut d) },
        || format!("cudnnBackendCreateDescriptor({t:?}) for {what}"),
    )?;
    Ok(Desc(d))
}

fn set<T>(d: Raw, a: A, ty: Ty, vals: &[T], what: &str) -> R<()> {
    ck(
        unsafe {
            (api().backend_set_attribute)(
                d,
                a,
                ty,
                vals.len() as i64,
                vals.as_ptr() as *const c_void,
            )
        },
        || format!("cudnnBackendSetAttribute({a:?}) on {what}"),
    )
}

/// Sets a descriptor-valued attribute.
fn set_desc(d: Raw, a: A, descs: &[Raw], what: &str) -> R<()> {
    set(d, a, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, descs, what)
}

fn finalize(d: Raw, what: &str) -> R<()> {
    ck(unsafe { (api().backend_finalize)(d) }, || {
        format!("cudnnBackendFinalize({what})")
    })
}

/// A cuDNN handle bound to one CUDA stream.
struct Handle(c::cudnnHandle_t);
impl Drop for Handle {
    fn drop(&mut self) {
        unsafe { (api().destroy)(self.0) };
    }
}
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// What a graph computes; with the stream, the key plans are cached under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub s: usize,
    pub d: usize,
    /// Value head dim (may differ from the query/key one, as DeepSeek-V3's 192/128).
    pub dv: usize,
    pub causal: bool,
    /// Sliding window (keys `j` with `i - j < window` kept), 0 for none; only with `causal`.
    pub window: usize,
    pub scale_bits: u32,
    pub backward: bool,
    /// Q, K, V, O and their gradients lie in memory as [B, S, H, D] (`layout=bshd`):
    /// the graph keeps the [B, H, S, D] dims and permutes the strides.
    pub bshd: bool,
}

impl Shape {
    fn scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
}

// Tensor uids of the variant pack.
const Q: i64 = 1;
const K: i64 = 2;
const V: i64 = 3;
const O: i64 = 4;
const STATS: i64 = 5;
const DO: i64 = 6;
const DQ: i64 = 7;
const DK: i64 = 8;
const DV: i64 = 9;
const DSUM: i64 = 10;
const DQ_ACC: i64 = 11;
const SCALE: i64 = 20;
const ONE: i64 = 21;
const NEG_INF: i64 = 22;
const WINDOW: i64 = 23;
const NEG_INF_BAND: i64 = 24;

/// A finalized execution plan and what running it needs.
pub struct Plan {
    plan: Desc,
    /// Operation graph, ops, tensors, engine config: kept alive with the plan.
    _keep: Vec<Desc>,
    handle: Arc<Handle>,
    pub workspace: u64,
    /// Pass-by-value scalars: (uid, host value); the variant pack points here.
    scalars: Box<[(i64, f32)]>,
    pub shape: Shape,
    /// The engine config index (in heuristics order) that finalized.
    pub engine: usize,
}
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

/// Device pointers of one call.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ptrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub stats: u64,
    pub d_o: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    /// Backward workspace tensors: f32 [B,Hq,S,1] and f32 [B,Hq,S,D].
    pub dsum: u64,
    pub dq_acc: u64,
    pub workspace: u64,
}

/// One call site: a plan and its variant pack (built once, replayed every step).
pub struct Exec {
    plan: Arc<Plan>,
    pack: Desc,
}
unsafe impl Send for Exec {}
unsafe impl Sync for Exec {}

impl std::fmt::Debug for Exec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cudnn sdpa {:?} (engine {}, workspace {} B)",
            self.plan.shape, self.plan.engine, self.plan.workspace
        )
    }
}

impl Exec {
    pub fn new(plan: Arc<Plan>, p: &Ptrs) -> R<Exec> {
        let s = plan.shape;
        let mut uids: Vec<i64> = Vec::new();
        let mut ptrs: Vec<*mut c_void> = Vec::new();
        let mut add = |u: i64, p: u64| {
            uids.push(u);
            ptrs.push(p as *mut c_void);
        };
        add(Q, p.q);
        add(K, p.k);
        add(V, p.v);
        add(O, p.o);
        add(STATS, p.stats);
        if s.backward {
            add(DO, p.d_o);
            add(DQ, p.dq);
            add(DK, p.dk);
            add(DV, p.dv);
            add(DSUM, p.dsum);
            add(DQ_ACC, p.dq_acc);
        }
        for (u, v) in plan.scalars.iter() {
            uids.push(*u);
            ptrs.push(v as *const f32 as *mut c_void);
        }
        let pack = create(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack")?;
        set(
            pack.0,
            A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            Ty::CUDNN_TYPE_INT64,
            &uids,
            "variant pack",
        )?;
        set(
            pack.0,
            A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            Ty::CUDNN_TYPE_VOID_PTR,
            &ptrs,
            "variant pack",
        )?;
        let ws = [p.workspace as *mut c_void];
        set(
            pack.0,
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            Ty::CUDNN_TYPE_VOID_PTR,
            &ws,
            "variant pack",
        )?;
        finalize(pack.0, "variant pack")?;
        Ok(Exec { plan, pack })
    }

    /// Enqueues the fused kernel(s) on the stream the plan's handle is bound to.
    pub fn run(&self) -> R<()> {
        ck(
            unsafe { (api().backend_execute)(self.plan.handle.0, self.plan.plan.0, self.pack.0) },
            || format!("cudnnBackendExecute (sdpa {:?})", self.plan.shape),
        )
    }
}

/// Which finalized plan each direction takes (0: the heuristics' first), and whether to
/// list them (`Tuning::cudnn_engine_*`).
#[derive(Clone, Copy, Debug, Default)]
pub struct EnginePicks {
    pub fwd: usize,
    pub bwd: usize,
    pub list: bool,
}

/// Per executor: the handles (one per stream) and the plans (one per shape and stream).
pub struct Sdpa {
    pub version: usize,
    picks: EnginePicks,
    streams: Vec<c::cudaStream_t>,
    handles: Vec<Option<Arc<Handle>>>,
    plans: HashMap<(Shape, usize), R<Arc<Plan>>>,
}

impl Sdpa {
    /// `streams`: the executor's CUDA streams (raw `CUstream`), indexed as the plan's.
    /// The GPU's context must be current on this thread.
    pub fn new(streams: Vec<*mut c_void>, picks: EnginePicks) -> R<Sdpa> {
        let version = available()?;
        let n = streams.len();
        Ok(Sdpa {
            version,
            picks,
            streams: streams.into_iter().map(|s| s as c::cudaStream_t).collect(),
            handles: vec![None; n],
            plans: HashMap::new(),
        })
    }

    fn handle(&mut self, stream: usize) -> R<Arc<Handle>> {
        if let Some(h) = &self.handles[stream] {
            return Ok(h.clone());
        }
        let mut h: c::cudnnHandle_t = std::ptr::null_mut();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
            (api().create)(&mut h)
        }))
        .map_err(|_| "cudnnCreate panicked (a cuDNN symbol is missing)".to_string())?;
        ck(r, || "cudnnCreate".to_string())?;
        let h = Arc::new(Handle(h));
        ck(
            unsafe { (api().set_stream)(h.0, self.streams[stream]) },
            || format!("cudnnSetStream (stream {stream})"),
        )?;
        self.handles[stream] = Some(h.clone());
        Ok(h)
    }

    /// The plan, or `None` after printing (once per shape) why cuDNN cannot run it.
    pub fn plan_or_report(
        &mut self,
        shape: Shape,
        stream: usize,
        location: &str,
    ) -> Option<Arc<Plan>> {
        let fresh = !self.plans.contains_key(&(shape, stream));
        match self.plan(shape, stream) {
            Ok(p) => Some(p),
            Err(e) => {
                if fresh {
                    eprintln!("weft: cuDNN attention cannot run {location}, using Weft's kernels for it: {e}");
                }
                None
            }
        }
    }

    /// The plan for `shape` on `stream`, built (and cached, also when it fails) once.
    pub fn plan(&mut self, shape: Shape, stream: usize) -> R<Arc<Plan>> {
        if let Some(p) = self.plans.get(&(shape, stream)) {
            return p.clone();
        }
        let r = self
            .handle(stream)
            .and_then(|h| build(h, shape, self.version, self.picks));
        let r = r.map(Arc::new);
        self.plans.insert((shape, stream), r.clone());
        r
    }
}

/// Reads one value of attribute `a` (of type `ty`) from descriptor `d` into `out`.
fn get_one<T>(d: Raw, a: A, ty: Ty, out: &mut T, what: impl FnOnce() -> String) -> R<()> {
    let mut n = 0i64;
    ck(
        unsafe { (api().backend_get_attribute)(d, a, ty, 1, &mut n, out as *mut T as *mut c_void) },
        what,
    )
}

/// The global index of an engine config's engine (what cuDNN's API log calls
/// `engineId`), for listing the plans.
fn engine_index(cfg: Raw) -> Option<i64> {
    let engine = create(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine").ok()?;
    let mut raw = engine.0;
    let desc = Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR;
    get_one(
        cfg,
        A::CUDNN_ATTR_ENGINECFG_ENGINE,
        desc,
        &mut raw,
        String::new,
    )
    .ok()?;
    let mut index = 0i64;
    let int = Ty::CUDNN_TYPE_INT64;
    get_one(
        engine.0,
        A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX,
        int,
        &mut index,
        String::new,
    )
    .ok()?;
    Some(index)
}

// ---------------------------------------------------------------- graph building

#[derive(Clone, Copy)]
struct T {
    raw: Raw,
    dims: [i64; 4],
    strides: [i64; 4],
}

struct G {
    keep: Vec<Desc>,
    ops: Vec<Raw>,
    next: i64,
    scalars: Vec<(i64, f32)>,
}

fn contig(d: [i64; 4]) -> [i64; 4] {
    [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1]
}

impl G {
    #[allow(clippy::too_many_arguments)]
    fn tensor(
        &mut self,
        uid: Option<i64>,
        dims: [i64; 4],
        strides: [i64; 4],
        dt: Dt,
        virt: bool,
        by_value: bool,
        what: &str,
    ) -> R<T> {
        let uid = uid.unwrap_or_else(|| {
            self.next += 1;
            self.next
        });
        let what = format!("tensor {what} (uid {uid}, {dt:?} {dims:?} strides {strides:?})");
        let t = create(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR, &what)?;
        set(
            t.0,
            A::CUDNN_ATTR_TENSOR_DATA_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[dt],
            &what,
        )?;
        set(
            t.0,
            A::CUDNN_ATTR_TENSOR_DIMENSIONS,
            Ty::CUDNN_TYPE_INT64,
            &dims,
            &what,
        )?;
        set(
            t.0,
            A::CUDNN_ATTR_TENSOR_STRIDES,
            Ty::CUDNN_TYPE_INT64,
            &strides,
            &what,
        )?;
        set(
            t.0,
            A::CUDNN_ATTR_TENSOR_UNIQUE_ID,
            Ty::CUDNN_TYPE_INT64,
            &[uid],
            &what,
        )?;
        set(
            t.0,
            A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
            Ty::CUDNN_TYPE_INT64,
            &[16i64],
            &what,
        )?;
        set(
            t.0,
            A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
            Ty::CUDNN_TYPE_BOOLEAN,
            &[virt],
            &what,
        )?;
        if by_value {
            set(
                t.0,
                A::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                Ty::CUDNN_TYPE_BOOLEAN,
                &[true],
                &what,
            )?;
        }
        finalize(t.0, &what)?;
        let raw = t.0;
        self.keep.push(t);
        Ok(T { raw, dims, strides })
    }
    fn io(&mut self, uid: i64, dims: [i64; 4], strides: [i64; 4], dt: Dt, what: &str) -> R<T> {
        self.tensor(Some(uid), dims, strides, dt, false, false, what)
    }
    fn virt(&mut self, dims: [i64; 4], strides: [i64; 4], dt: Dt, what: &str) -> R<T> {
        self.tensor(None, dims, strides, dt, true, false, what)
    }
    fn scalar(&mut self, uid: i64, v: f32, what: &str) -> R<T> {
        self.scalars.push((uid, v));
        self.tensor(
            Some(uid),
            [1; 4],
            [1; 4],
            Dt::CUDNN_DATA_FLOAT,
            false,
            true,
            what,
        )
    }

    /// A pointwise op: `ins` are X, B, T in that order.
    fn pw(&mut self, mode: Pw, prec: Dt, ins: &[T], y: T, axis: Option<i64>, name: &str) -> R<()> {
        let what = format!("pointwise {name} ({mode:?})");
        let pd = create(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &what)?;
        set(
            pd.0,
            A::CUDNN_ATTR_POINTWISE_MODE,
            Ty::CUDNN_TYPE_POINTWISE_MODE,
            &[mode],
            &what,
        )?;
        set(
            pd.0,
            A::CUDNN_ATTR_POINTWISE_MATH_PREC,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[prec],
            &what,
        )?;
        if let Some(ax) = axis {
            set(
                pd.0,
                A::CUDNN_ATTR_POINTWISE_AXIS,
                Ty::CUDNN_TYPE_INT64,
                &[ax],
                &what,
            )?;
        }
        finalize(pd.0, &what)?;
        let op = create(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, &what)?;
        set_desc(
            op.0,
            A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
            &[pd.0],
            &what,
        )?;
        set_desc(
            op.0,
            A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
            &[ins[0].raw],
            &what,
        )?;
        if let Some(b) = ins.get(1) {
            set_desc(
                op.0,
                A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
                &[b.raw],
                &what,
            )?;
        }
        if let Some(t) = ins.get(2) {
            set_desc(
                op.0,
                A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC,
                &[t.raw],
                &what,
            )?;
        }
        set_desc(
            op.0,
            A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC,
            &[y.raw],
            &what,
        )?;
        set(
            op.0,
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
            Ty::CUDNN_TYPE_FLOAT,
            &[1.0f32],
            &what,
        )?;
        set(
            op.0,
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
            Ty::CUDNN_TYPE_FLOAT,
            &[1.0f32],
            &what,
        )?;
        finalize(op.0, &what)?;
        self.ops.push(op.0);
        self.keep.push(pd);
        self.keep.push(op);
        Ok(())
    }
    /// A pointwise op into a new virtual tensor shaped like `ins[0]` (or `like`).
    fn pw_new(&mut self, mode: Pw, ins: &[T], dt: Dt, like: Option<T>, name: &str) -> R<T> {
        let l = like.unwrap_or(ins[0]);
        let y = self.virt(l.dims, l.strides, dt, name)?;
        self.pw(mode, Dt::CUDNN_DATA_FLOAT, ins, y, None, name)?;
        Ok(y)
    }
    fn matmul(&mut self, a: T, b: T, y: T, name: &str) -> R<()> {
        let what = format!("matmul {name}");
        let md = create(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR, &what)?;
        set(
            md.0,
            A::CUDNN_ATTR_MATMUL_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[Dt::CUDNN_DATA_FLOAT],
            &what,
        )?;
        finalize(md.0, &what)?;
        let op = create(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, &what)?;
        set_desc(op.0, A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[a.raw], &what)?;
        set_desc(op.0, A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[b.raw], &what)?;
        set_desc(op.0, A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[y.raw], &what)?;
        set_desc(op.0, A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[md.0], &what)?;
        finalize(op.0, &what)?;
        self.ops.push(op.0);
        self.keep.push(md);
        self.keep.push(op);
        Ok(())
    }
    fn reduce(&mut self, red: c::cudnnReduceTensorOp_t, x: T, y: T, name: &str) -> R<()> {
        let what = format!("reduction {name} ({red:?})");
        let rd = create(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR, &what)?;
        set(
            rd.0,
            A::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[Dt::CUDNN_DATA_FLOAT],
            &what,
        )?;
        set(
            rd.0,
            A::CUDNN_ATTR_REDUCTION_OPERATOR,
            Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            &[red],
            &what,
        )?;
        finalize(rd.0, &what)?;
        let op = create(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, &what)?;
        set_desc(op.0, A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[rd.0], &what)?;
        set_desc(
            op.0,
            A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC,
            &[x.raw],
            &what,
        )?;
        set_desc(
            op.0,
            A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC,
            &[y.raw],
            &what,
        )?;
        finalize(op.0, &what)?;
        self.ops.push(op.0);
        self.keep.push(rd);
        self.keep.push(op);
        Ok(())
    }
    fn reshape(&mut self, x: T, y: T, name: &str) -> R<()> {
        let what = format!("reshape {name}");
        let op = create(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, &what)?;
        set_desc(op.0, A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[x.raw], &what)?;
        set_desc(op.0, A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[y.raw], &what)?;
        finalize(op.0, &what)?;
        self.ops.push(op.0);
        self.keep.push(op);
        Ok(())
    }

    /// Top-left causal mask: keep `s` where row >= col, else `neg_inf`.
    fn causal(&mut self, s: T, neg_inf: f32) -> R<T> {
        let i32t = Dt::CUDNN_DATA_INT32;
        let row = self.virt(s.dims, s.strides, i32t, "row index")?;
        self.pw(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            Dt::CUDNN_DATA_FLOAT,
            &[s],
            row,
            Some(2),
            "gen_row_index",
        )?;
        let col = self.virt(s.dims, s.strides, i32t, "col index")?;
        self.pw(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            Dt::CUDNN_DATA_FLOAT,
            &[s],
            col,
            Some(3),
            "gen_col_index",
        )?;
        let keep = self.virt(s.dims, s.strides, Dt::CUDNN_DATA_BOOLEAN, "row >= col")?;
        self.pw(
            Pw::CUDNN_POINTWISE_CMP_GE,
            Dt::CUDNN_DATA_BOOLEAN,
            &[row, col],
            keep,
            None,
            "row>=col",
        )?;
        let ninf = self.scalar(NEG_INF, neg_inf, "-inf")?;
        self.pw_new(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            &[s, ninf, keep],
            Dt::CUDNN_DATA_FLOAT,
            Some(s),
            "causal select",
        )
    }

    /// The band's left edge after the causal mask: keep `s` where col + window > row
    /// (cudnn-frontend's composite diagonal-band node, which the fused engines recognise
    /// on cuDNN before 9.21: GEN_INDEX of the masked scores, a float ADD, CMP_GT, select).
    fn band(&mut self, s: T, window: usize, neg_inf: f32) -> R<T> {
        let i32t = Dt::CUDNN_DATA_INT32;
        let f32t = Dt::CUDNN_DATA_FLOAT;
        let row = self.virt(s.dims, s.strides, i32t, "band row index")?;
        self.pw(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            f32t,
            &[s],
            row,
            Some(2),
            "gen_row_index",
        )?;
        let col = self.virt(s.dims, s.strides, i32t, "band col index")?;
        self.pw(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            f32t,
            &[s],
            col,
            Some(3),
            "gen_col_index",
        )?;
        let w = self.scalar(WINDOW, window as f32, "window")?;
        let shifted = self.virt(s.dims, s.strides, f32t, "col + window")?;
        self.pw(
            Pw::CUDNN_POINTWISE_ADD,
            f32t,
            &[col, w],
            shifted,
            None,
            "col+window",
        )?;
        let keep = self.virt(
            s.dims,
            s.strides,
            Dt::CUDNN_DATA_BOOLEAN,
            "col + window > row",
        )?;
        self.pw(
            Pw::CUDNN_POINTWISE_CMP_GT,
            Dt::CUDNN_DATA_BOOLEAN,
            &[shifted, row],
            keep,
            None,
            "col+window>row",
        )?;
        let ninf = self.scalar(NEG_INF_BAND, neg_inf, "-inf (band)")?;
        self.pw_new(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            &[s, ninf, keep],
            Dt::CUDNN_DATA_FLOAT,
            Some(s),
            "band select",
        )
    }

    /// The causal mask, then the window's left edge if there is one.
    fn mask(&mut self, s: T, sh: &Shape, neg_inf: f32) -> R<T> {
        if !sh.causal {
            return Ok(s);
        }
        let s = self.causal(s, neg_inf)?;
        if sh.window == 0 {
            return Ok(s);
        }
        self.band(s, sh.window, neg_inf)
    }
}

fn build(handle: Arc<Handle>, sh: Shape, version: usize, picks: EnginePicks) -> R<Plan> {
    let (b, hq, hk, s, d) = (
        sh.b as i64,
        sh.hq as i64,
        sh.hkv as i64,
        sh.s as i64,
        sh.d as i64,
    );
    // cuDNN before 9.10 prefers the lowest float to -inf in masks (as cudnn-frontend does).
    let neg_inf = if version < 91000 {
        f32::MIN
    } else {
        f32::NEG_INFINITY
    };
    let bf = Dt::CUDNN_DATA_BFLOAT16;
    let f32t = Dt::CUDNN_DATA_FLOAT;
    let mut g = G {
        keep: Vec::new(),
        ops: Vec::new(),
        next: 100,
        scalars: Vec::new(),
    };
    let dvh = sh.dv as i64;
    let qd = [b, hq, s, d];
    let kd = [b, hk, s, d];
    // V, O, dO and dV have the value head dim.
    let vd = [b, hk, s, dvh];
    let od = [b, hq, s, dvh];
    // The strides of the per-head inputs and outputs: row-major BHSD, or BSHD memory
    // under the same [B, H, S, D] dims.
    let io = |dims: [i64; 4]| {
        if sh.bshd {
            [dims[1] * dims[2] * dims[3], dims[3], dims[1] * dims[3], 1]
        } else {
            contig(dims)
        }
    };
    // Kᵀ and Vᵀ: [B,Hkv,D,S] over K's and V's memory (their last two strides swapped).
    let swap_last = |st: [i64; 4]| [st[0], st[1], st[3], st[2]];
    let vtd = [b, hk, dvh, s];
    let vts = swap_last(io(vd));
    let ktd = [b, hk, d, s];
    let kts = swap_last(io(kd));
    let sd = [b, hq, s, s];
    let ss = contig(sd);
    let rd = [b, hq, s, 1];
    let rs = [hq * s, s, 1, 1];
    let q = g.io(Q, qd, io(qd), bf, "Q")?;
    let kt = g.io(K, ktd, kts, bf, "K^T")?;
    let o = g.io(O, od, io(od), bf, "O")?;
    let stats = g.io(STATS, rd, rs, f32t, "Stats")?;
    let scale = g.scalar(SCALE, sh.scale(), "attn scale")?;
    let add = c::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD;
    if !sh.backward {
        let v = g.io(V, vd, io(vd), bf, "V")?;
        let s1 = g.virt(sd, ss, f32t, "Q K^T")?;
        g.matmul(q, kt, s1, "bmm1")?;
        let mut sc = g.pw_new(
            Pw::CUDNN_POINTWISE_MUL,
            &[s1, scale],
            f32t,
            None,
            "attn_scale",
        )?;
        sc = g.mask(sc, &sh, neg_inf)?;
        let m = g.virt(rd, rs, f32t, "row max")?;
        g.reduce(
            c::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX,
            sc,
            m,
            "max",
        )?;
        let sub = g.pw_new(Pw::CUDNN_POINTWISE_SUB, &[sc, m], f32t, None, "sub")?;
        let e = g.pw_new(Pw::CUDNN_POINTWISE_EXP, &[sub], f32t, None, "exp")?;
        let z = g.virt(rd, rs, f32t, "row sum")?;
        g.reduce(add, e, z, "sum")?;
        let lz = g.pw_new(Pw::CUDNN_POINTWISE_LOG, &[z], f32t, None, "log")?;
        g.pw(
            Pw::CUDNN_POINTWISE_ADD,
            f32t,
            &[m, lz],
            stats,
            None,
            "stats = max + log(sum)",
        )?;
        let p = g.virt(sd, ss, bf, "softmax")?;
        g.pw(Pw::CUDNN_POINTWISE_DIV, f32t, &[e, z], p, None, "div")?;
        g.matmul(p, v, o, "bmm2")?;
    } else {
        let vt = g.io(V, vtd, vts, bf, "V^T")?;
        let d_o = g.io(DO, od, io(od), bf, "dO")?;
        let dq = g.io(DQ, qd, io(qd), bf, "dQ")?;
        let dk = g.io(DK, kd, io(kd), bf, "dK")?;
        let dv = g.io(DV, vd, io(vd), bf, "dV")?;
        let one = g.scalar(ONE, 1.0, "one")?;
        // Dsum = rowsum(dO * O)
        let t = g.virt(od, [hq * s * dvh, s * dvh, hq * dvh, 1], f32t, "dO*O")?;
        g.pw(
            Pw::CUDNN_POINTWISE_MUL,
            f32t,
            &[d_o, o],
            t,
            None,
            "mul_dO_O",
        )?;
        let r = g.virt(rd, rs, f32t, "rowsum(dO*O)")?;
        g.reduce(add, t, r, "reduce_dO_o")?;
        let dsum = g.io(DSUM, rd, rs, f32t, "softmax_sum")?;
        g.pw(
            Pw::CUDNN_POINTWISE_MUL,
            f32t,
            &[r, one],
            dsum,
            None,
            "scale_dropout_inv",
        )?;
        // P = exp(mask(scale * Q K^T) - Stats)
        let s1 = g.virt(sd, ss, f32t, "Q K^T")?;
        g.matmul(q, kt, s1, "matmul_Q_KT")?;
        let s2 = g.pw_new(
            Pw::CUDNN_POINTWISE_MUL,
            &[s1, scale],
            f32t,
            None,
            "mul_s_attn_scale",
        )?;
        let mut s3 = g.pw_new(Pw::CUDNN_POINTWISE_SUB, &[s2, stats], f32t, None, "sub_s_m")?;
        s3 = g.mask(s3, &sh, neg_inf)?;
        let p = g.pw_new(Pw::CUDNN_POINTWISE_EXP, &[s3], f32t, None, "exp_s")?;
        // dV = P^T dO (per q head, then summed over each kv head's group)
        let td = [b, hq, s, s];
        let tstr = [hq * s * s, s * s, 1, s];
        let pt = g.virt(td, tstr, bf, "P^T")?;
        g.reshape(p, pt, "reshape_p")?;
        let full = [b, hq, s, d];
        if hq == hk {
            g.matmul(pt, d_o, dv, "matmul_pT_dO")?;
        } else {
            let fullv = [b, hq, s, dvh];
            let dvf = g.virt(fullv, contig(fullv), bf, "dV full heads")?;
            g.matmul(pt, d_o, dvf, "matmul_pT_dO")?;
            g.reduce(add, dvf, dv, "red_dV_head")?;
        }
        // dS = (dO V^T - Dsum) * P * scale
        let dp = g.virt(sd, ss, f32t, "dO V^T")?;
        g.matmul(d_o, vt, dp, "matmul_dO_VT")?;
        let dp2 = g.pw_new(
            Pw::CUDNN_POINTWISE_SUB,
            &[dp, dsum],
            f32t,
            None,
            "sub_dP_softmax_sum",
        )?;
        let ds1 = g.pw_new(
            Pw::CUDNN_POINTWISE_MUL,
            &[dp2, p],
            f32t,
            None,
            "mul_dP_exp_s",
        )?;
        let ds = g.pw_new(
            Pw::CUDNN_POINTWISE_MUL,
            &[ds1, scale],
            f32t,
            None,
            "mul_dS_attn_scale",
        )?;
        // dK = dS^T Q
        let dst = g.virt(td, tstr, bf, "dS^T")?;
        g.reshape(ds, dst, "reshape_dS")?;
        if hq == hk {
            g.matmul(dst, q, dk, "matmul_dST_Q")?;
        } else {
            let dkf = g.virt(full, contig(full), bf, "dK full heads")?;
            g.matmul(dst, q, dkf, "matmul_dST_Q")?;
            g.reduce(add, dkf, dk, "red_dK_head")?;
        }
        // dQ = dS K (accumulated in f32)
        // K's own memory strides, as cudnn-frontend gives this reshape (row-major
        // strides here are not K's in the [B, S, H, D] layout). This was the one
        // difference from PyTorch's graph, whose backward cuDNN 9.19 runs on engines 6/7
        // ~15% faster than Weft's ran (engine 2); see bench/GPU_NOTES.md, session 20.
        let kr = g.virt(kd, io(kd), f32t, "K (from K^T)")?;
        g.reshape(kt, kr, "reshape_k")?;
        let dqa = g.io(DQ_ACC, qd, contig(qd), f32t, "dQ accumulator")?;
        g.matmul(ds, kr, dqa, "matmul_dS_K")?;
        g.pw(
            Pw::CUDNN_POINTWISE_IDENTITY,
            f32t,
            &[dqa],
            dq,
            None,
            "identity_dQ",
        )?;
    }

    // Operation graph.
    let what = format!("operation graph ({} ops) of sdpa {sh:?}", g.ops.len());
    let og = create(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &what)?;
    set(
        og.0,
        A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
        Ty::CUDNN_TYPE_HANDLE,
        &[handle.0],
        &what,
    )?;
    set_desc(og.0, A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &g.ops, &what)?;
    finalize(og.0, &what)?;

    // Engine configs from the heuristics (mode A, then the fallback list), the first
    // that finalizes into an execution plan wins, or the `pick`-th (`Tuning`'s
    // `cudnn_engine_*`).
    let pick = if sh.backward { picks.bwd } else { picks.fwd };
    let list = picks.list;
    let mut finalized = 0usize;
    let mut tried = Vec::new();
    for mode in [
        c::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        c::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    ] {
        let hw = format!("engine heuristics {mode:?}");
        let heur = match create(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &hw).and_then(|h| {
            set_desc(h.0, A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[og.0], &hw)?;
            set(
                h.0,
                A::CUDNN_ATTR_ENGINEHEUR_MODE,
                Ty::CUDNN_TYPE_HEUR_MODE,
                &[mode],
                &hw,
            )?;
            finalize(h.0, &hw)?;
            Ok(h)
        }) {
            Ok(h) => h,
            Err(e) => {
                tried.push(e);
                continue;
            }
        };
        let mut count = 0i64;
        let r = unsafe {
            (api().backend_get_attribute)(
                heur.0,
                A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                0,
                &mut count,
                std::ptr::null_mut(),
            )
        };
        if let Err(e) = ck(r, || format!("{hw}: result count")) {
            tried.push(e);
            continue;
        }
        if count <= 0 {
            tried.push(format!("{hw}: no engine config"));
            continue;
        }
        let mut cfgs = Vec::new();
        for _ in 0..count {
            cfgs.push(create(
                D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
                "engine config",
            )?);
        }
        let mut raws: Vec<Raw> = cfgs.iter().map(|x| x.0).collect();
        let mut got = 0i64;
        let r = unsafe {
            (api().backend_get_attribute)(
                heur.0,
                A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                count,
                &mut got,
                raws.as_mut_ptr() as *mut c_void,
            )
        };
        if let Err(e) = ck(r, || format!("{hw}: results")) {
            tried.push(e);
            continue;
        }
        for (i, cfg) in cfgs.into_iter().take(got.max(0) as usize).enumerate() {
            let pw = format!("execution plan from {hw} config {i}");
            let plan = create(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &pw)?;
            let r = set(
                plan.0,
                A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                Ty::CUDNN_TYPE_HANDLE,
                &[handle.0],
                &pw,
            )
            .and_then(|_| {
                set(
                    plan.0,
                    A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                    Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                    &[cfg.0],
                    &pw,
                )
            })
            .and_then(|_| finalize(plan.0, &pw));
            if let Err(e) = r {
                tried.push(e);
                continue;
            }
            let mut ws = 0i64;
            get_one(
                plan.0,
                A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                Ty::CUDNN_TYPE_INT64,
                &mut ws,
                || format!("{pw}: workspace size"),
            )?;
            let this = finalized;
            finalized += 1;
            if list {
                eprintln!(
                    "weft: cuDNN sdpa {} {hw} config {i}: plan {this}, engine {}, workspace {ws} B{}",
                    if sh.backward { "backward" } else { "forward" },
                    engine_index(cfg.0).map_or("?".to_string(), |e| e.to_string()),
                    if this == pick { " (taken)" } else { "" }
                );
            }
            if this < pick {
                continue;
            }
            let mut keep = g.keep;
            keep.push(og);
            keep.push(cfg);
            keep.push(heur);
            return Ok(Plan {
                plan,
                _keep: keep,
                handle,
                workspace: ws.max(0) as u64,
                scalars: g.scalars.into_boxed_slice(),
                shape: sh,
                engine: i,
            });
        }
    }
    if finalized > 0 {
        return Err(format!(
            "plan {pick} of cuDNN's was asked for (WEFT_CUDNN_ENGINE_{}) but only {finalized} finalize for sdpa {sh:?}",
            if sh.backward { "BWD" } else { "FWD" }
        ));
    }
    let n = tried.len();
    let mut distinct: Vec<String> = Vec::new();
    for t in tried {
        if !distinct.contains(&t) {
            distinct.push(t);
        }
    }
    distinct.truncate(8);
    Err(format!(
        "no cuDNN engine runs this attention graph (sdpa {sh:?}); {n} attempts failed: {}",
        if distinct.is_empty() {
            "the heuristics returned nothing".to_string()
        } else {
            distinct.join(" | ")
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics() {
        // Without libcudnn (CI) this is an error that says how to fix it.
        match available() {
            Ok(v) => assert!(v >= 90000),
            Err(e) => assert!(e.contains("cudnn") || e.contains("cuDNN"), "{e}"),
        }
    }

    #[test]
    fn versions_read_as_text() {
        assert_eq!(version_text(91400), "9.14.0");
        assert_eq!(version_text(90602), "9.6.2");
    }
}

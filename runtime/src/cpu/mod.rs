//! The CPU reference executor: runs a [`Graph`] on simulated ranks with candle-core
//! tensors, and judges every compiler pass by comparing the outputs and gradients of the
//! graph before and after it.
//!
//! # How a run goes
//! 1. Bindings: the caller's symbols (`B`, `S`, ...), every mesh axis bound to its size,
//!    and any plain symbol an input's type mentions (`S` from `input_ids: i64[B, S]`)
//!    bound from the tensor given for it.
//! 2. Weights (full, unsharded, keyed by param name) and inputs (full, keyed by input
//!    name) are checked against their nodes' types and converted once.
//! 3. One worker thread per rank of `graph.mesh` runs the whole SPMD program with its
//!    coordinates bound (`@sp`), checking every computed tensor against its node's type
//!    evaluated for that rank; a mismatch is an error naming the node and rank, which is
//!    how a wrong pass shows up. Collectives are real exchanges between the workers over
//!    the groups [`weft_ir::Mesh::groups`] defines. A rank that fails stops them all.
//! 4. Outputs are assembled from the ranks' pieces by `graph.output_split(name)`;
//!    outputs with no split come from rank 0 (checked equal on every rank when
//!    [`RunOptions::check_replicas`] is on).
//! 5. Gradients (when asked): see below.
//!
//! # Precision
//! [`Precision::F64`] computes every float tensor in f64 whatever its graph dtype (for
//! tight reference checks); [`Precision::F32`] computes floats in f32 (bf16/f16 graph
//! dtypes too: no rounding to them is emulated). Integers are i64, bools u8.
//!
//! # Gradients
//! There is no autodiff pass yet, so gradients come from candle's autograd over the
//! executed forward. Params are candle variables. Collectives pass candle tensors
//! between the threads and build their results with `cat`/`narrow`/`add`, so the ranks'
//! forwards form one autograd graph.
//!
//! The convention: **backward runs once, from the assembled loss output** (the sum of
//! its elements; for the usual replicated scalar loss that is rank 0's loss), and a
//! replicated parameter's gradient is **the sum of its replicas' gradients**. Why this
//! is the gradient of the SPMD program: after the loss `all_reduce` every rank holds the
//! same loss `L`, and rank 0's copy is a function of every rank's replicas through the
//! collectives; a replicated parameter is one variable tied across ranks, so
//! `dL/dθ = Σ_r dL/dθ_r`. Summing the P ranks' losses and dividing by P would give the
//! same numbers at P times the backward cost. A split parameter's gradient is its ranks'
//! pieces put back in place (and summed over the axes it is replicated on).
//!
//! By default the ranks literally share one variable per param (split params take views
//! of it), so candle's accumulation does the sum and the placement. With
//! [`RunOptions::keep_rank_outputs`] every rank gets its own copy instead, and
//! [`RunResult::rank_grads`] reports each replica's gradient (their sum is the same).
//! `tests::grads` checks both against finite differences and the one-rank graph.

mod backward_kernels;
mod comm;
mod error;
mod fp8;
mod fused;
mod fusions;
mod grad_outputs;
mod head_layout;
mod host;
pub(crate) mod kernels;
mod linear_ce;
mod partition;
mod rank;
mod sgemm;
mod vexp;

#[cfg(test)]
mod tests;

pub use error::RuntimeError;

/// The reference AdamW (`adamw` / `host_adamw`) on candle tensors, for the host
/// optimizer's bit-for-bit test: `[lr, beta1, beta2, eps, weight_decay]`.
#[cfg(test)]
pub(crate) fn host_adamw_reference(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: &Tensor,
    [lr, b1, b2, eps, wd]: [f64; 5],
) -> Result<(Tensor, Tensor, Tensor), String> {
    backward_kernels::adamw(p, g, m, v, step, lr, b1, b2, eps, wd).map_err(|e| e.0)
}

use candle_core::Tensor;
use comm::Comm;
use rank::{RankOut, RankResult, Shared};
use std::collections::BTreeMap;
use weft_ir::{Bindings, Dim, Graph, HostTensor};

/// The float type every float tensor is computed in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Floats in f32 (bf16/f16 graph dtypes computed in f32).
    #[default]
    F32,
    /// Every float in f64, for tight reference checks.
    F64,
}

/// How to run a graph.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub precision: Precision,
    /// Compute the gradients of the loss output with respect to every param.
    pub grads: bool,
    /// Values of size symbols (`B`, `S`, ...). Mesh axis sizes and rank coordinates are
    /// bound by the executor; plain symbols of input types are inferred from the inputs.
    pub bindings: Bindings,
    /// The output whose gradients `grads` computes (the sum of its elements).
    pub loss: String,
    /// How params are split across ranks: `(dim, axis)` nested, outermost first, each an
    /// even split. A param not listed is replicated (every rank holds all of it). The
    /// weights given to [`run`] are always full; each rank gets its piece.
    pub param_splits: BTreeMap<String, Vec<(usize, String)>>,
    /// Check that outputs with no split are equal on every rank (an output that differs
    /// across ranks but does not say how it is split is an error).
    pub check_replicas: bool,
    /// Keep every rank's raw outputs (and gradients) in [`RunResult`].
    pub keep_rank_outputs: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            precision: Precision::F32,
            grads: false,
            bindings: Bindings::new(),
            loss: "loss".to_string(),
            param_splits: BTreeMap::new(),
            check_replicas: true,
            keep_rank_outputs: false,
        }
    }
}

impl RunOptions {
    pub fn new(precision: Precision) -> Self {
        RunOptions {
            precision,
            ..Default::default()
        }
    }
    pub fn with_grads(mut self, grads: bool) -> Self {
        self.grads = grads;
        self
    }
    /// Binds a size symbol (`B`, `S`).
    pub fn bind(mut self, name: &str, value: i64) -> Self {
        self.bindings.symbols.insert(name.to_string(), value);
        self
    }
}

/// What a run produced.
#[derive(Clone, Debug, Default)]
pub struct RunResult {
    /// Every graph output, full (assembled from the ranks' pieces), in its graph dtype.
    pub outputs: BTreeMap<String, HostTensor>,
    /// d(loss)/d(param) for every param of the graph, full, in the param's dtype
    /// (zeros for a param the loss does not depend on). Empty unless `grads`.
    pub grads: BTreeMap<String, HostTensor>,
    /// Per rank, its raw outputs (its piece of split outputs). Empty unless `keep_rank_outputs`.
    pub rank_outputs: Vec<BTreeMap<String, HostTensor>>,
    /// Per rank, the gradients of its param replicas. Empty unless `keep_rank_outputs` and `grads`.
    pub rank_grads: Vec<BTreeMap<String, HostTensor>>,
    /// The bindings used (without rank coordinates), inferred symbols included.
    pub bindings: Bindings,
    /// Where the time went.
    pub profile: Profile,
}

/// Wall-clock times of a run, for finding slow ops (not for snapshots: they vary).
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// Every rank's forward (until the last one ends).
    pub forward_s: f64,
    /// Assembling outputs and converting them to host tensors.
    pub outputs_s: f64,
    /// candle's backward.
    pub backward_s: f64,
    /// Assembling the parameter gradients and converting them to host tensors.
    pub grads_s: f64,
    /// Per op name: (nodes run, seconds), summed over ranks.
    pub ops: BTreeMap<&'static str, (usize, f64)>,
}

impl Profile {
    /// A table of the slowest ops, for humans.
    pub fn table(&self) -> String {
        let mut rows: Vec<_> = self.ops.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let mut s = format!(
            "forward {:.3}s, outputs {:.3}s, backward {:.3}s, gradients to host {:.3}s\n",
            self.forward_s, self.outputs_s, self.backward_s, self.grads_s
        );
        for (name, (n, t)) in rows {
            s.push_str(&format!("  {name:<16} {n:>6} {t:>9.4}s\n"));
        }
        s
    }
}

/// Runs `graph` on the CPU over every rank of `graph.mesh`.
///
/// `weights` are keyed by param name and `inputs` by input name; both are full
/// (unsharded) tensors: the graph itself slices each rank's block (with `slice` ops at
/// `@axis` coordinates), and params are replicated unless `opts.param_splits` says
/// otherwise.
pub fn run(
    graph: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
    opts: &RunOptions,
) -> Result<RunResult, RuntimeError> {
    let bindings = bind(graph, inputs, opts)?;
    let p = opts.precision;

    let mut params = BTreeMap::new();
    for (name, v) in graph.params() {
        if params.contains_key(&name) {
            continue;
        }
        let w = weights
            .get(&name)
            .ok_or_else(|| RuntimeError::MissingWeight { name: name.clone() })?;
        let ty = graph.ty(v);
        let bad = |message: String| RuntimeError::BadTensor {
            kind: "param",
            name: name.clone(),
            message,
        };
        if !opts.param_splits.contains_key(&name) && graph.param_partition(&name).is_empty() {
            check_host_shape(w, ty, &bindings).map_err(bad)?;
        }
        let shared_var = opts.grads && !opts.keep_rank_outputs;
        params.insert(
            name.clone(),
            host::to_candle(w, ty.dtype, p, shared_var).map_err(bad)?,
        );
    }
    let mut ins = BTreeMap::new();
    for (name, role, v) in graph.inputs() {
        if ins.contains_key(&name) {
            continue;
        }
        // A checkpoint buffer (`Role::Buffer`) comes with the weights unless given as an input.
        let t = inputs
            .get(&name)
            .or_else(|| {
                (role == weft_ir::Role::Buffer)
                    .then(|| weights.get(&name))
                    .flatten()
            })
            .ok_or_else(|| RuntimeError::MissingInput { name: name.clone() })?;
        let ty = graph.ty(v);
        let bad = |message: String| RuntimeError::BadTensor {
            kind: "input",
            name: name.clone(),
            message,
        };
        check_host_shape(t, ty, &bindings).map_err(bad)?;
        ins.insert(
            name.clone(),
            host::to_candle(t, ty.dtype, p, false).map_err(bad)?,
        );
    }
    for name in opts.param_splits.keys() {
        if !params.contains_key(name) {
            return Err(RuntimeError::BadTensor {
                kind: "param",
                name: name.clone(),
                message: "has a split in `param_splits` but the graph has no such param".into(),
            });
        }
    }

    let mut groups = BTreeMap::new();
    for (axis, _) in &graph.mesh.axes {
        groups.insert(axis.clone(), graph.mesh.groups(axis).unwrap_or_default());
    }
    let last_use = last_uses(graph);
    let comm = Comm::new();
    let shared = Shared {
        graph,
        mesh: &graph.mesh,
        bindings: &bindings,
        precision: p,
        per_rank_vars: opts.grads && opts.keep_rank_outputs,
        params: &params,
        inputs: &ins,
        param_splits: &opts.param_splits,
        groups: &groups,
        last_use: &last_use,
        comm: &comm,
    };

    // The coordinator runs on a thread with a large stack: dropping (and walking, for
    // backward) the autograd graph of a deep model recurses once per op.
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("weft-cpu".into())
            .stack_size(COORDINATOR_STACK)
            .spawn_scoped(s, || coordinate(&shared, opts))
            .map_err(|e| RuntimeError::Panic {
                rank: 0,
                message: format!("cannot start the coordinator thread: {e}"),
            })?
            .join()
            .unwrap_or_else(|p| {
                Err(RuntimeError::Panic {
                    rank: 0,
                    message: panic_text(&p),
                })
            })
    })
    .map(|mut r| {
        r.bindings = bindings.clone();
        r
    })
}

const COORDINATOR_STACK: usize = 512 << 20;
const WORKER_STACK: usize = 64 << 20;

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

fn coordinate(sh: &Shared, opts: &RunOptions) -> Result<RunResult, RuntimeError> {
    let world = sh.mesh.world_size().max(1);
    let t0 = std::time::Instant::now();
    let results: Vec<RankResult> = if world == 1 {
        vec![rank::run_rank(sh, 0)]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    std::thread::Builder::new()
                        .name(format!("weft-rank-{r}"))
                        .stack_size(WORKER_STACK)
                        .spawn_scoped(s, move || rank::run_rank(sh, r))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|p| {
                        sh.comm.abort();
                        Err(Some(RuntimeError::Panic {
                            rank: r as u32,
                            message: panic_text(&p),
                        }))
                    }),
                    Err(e) => {
                        sh.comm.abort();
                        Err(Some(RuntimeError::Panic {
                            rank: r as u32,
                            message: format!("cannot start its thread: {e}"),
                        }))
                    }
                })
                .collect()
        })
    };
    let mut ranks: Vec<RankOut> = Vec::with_capacity(results.len());
    let mut first_err: Option<RuntimeError> = None;
    let mut aborted = false;
    for r in results {
        match r {
            Ok(o) => ranks.push(o),
            Err(Some(e)) => {
                first_err.get_or_insert(e);
            }
            Err(None) => aborted = true,
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    if aborted {
        return Err(RuntimeError::Panic {
            rank: 0,
            message: "internal: ranks stopped without an error".into(),
        });
    }

    let g = sh.graph;
    let mut res = RunResult::default();
    res.profile.forward_s = t0.elapsed().as_secs_f64();
    for r in &ranks {
        for (op, (n, t)) in &r.op_seconds {
            let e = res.profile.ops.entry(op).or_insert((0, 0.0));
            e.0 += n;
            e.1 += t;
        }
    }
    let t1 = std::time::Instant::now();
    let mut loss_tensor = None;
    for (name, v) in g.outputs() {
        let full = assemble(sh, opts, name, &ranks)?;
        let dtype = g.ty(*v).dtype;
        res.outputs.insert(
            name.clone(),
            host::to_host(&full, dtype).map_err(|m| RuntimeError::Output {
                name: name.clone(),
                message: m,
            })?,
        );
        if opts.grads && *name == opts.loss {
            loss_tensor = Some(full);
        }
    }
    if opts.keep_rank_outputs {
        for r in &ranks {
            let mut m = BTreeMap::new();
            for (name, v) in g.outputs() {
                let t = host::to_host(&r.outputs[name], g.ty(*v).dtype).map_err(|m| {
                    RuntimeError::Output {
                        name: name.clone(),
                        message: m,
                    }
                })?;
                m.insert(name.clone(), t);
            }
            res.rank_outputs.push(m);
        }
    }
    if opts.grads {
        let loss = loss_tensor.ok_or_else(|| RuntimeError::Backward {
            loss: opts.loss.clone(),
            message: format!(
                "the graph has no output named `{}` (outputs: {})",
                opts.loss,
                g.outputs()
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })?;
        res.profile.outputs_s = t1.elapsed().as_secs_f64();
        let t2 = std::time::Instant::now();
        gradients(sh, opts, &loss, &ranks, &mut res)?;
        res.profile.grads_s = t2.elapsed().as_secs_f64() - res.profile.backward_s;
    } else {
        res.profile.outputs_s = t1.elapsed().as_secs_f64();
    }
    Ok(res)
}

/// Binds the caller's symbols, the mesh axis sizes, and plain symbols of input types.
fn bind(
    graph: &Graph,
    inputs: &BTreeMap<String, HostTensor>,
    opts: &RunOptions,
) -> Result<Bindings, RuntimeError> {
    let mut b = opts.bindings.clone();
    b.coords.clear();
    for (axis, size) in &graph.mesh.axes {
        match b.symbols.get(axis) {
            Some(&v) if v != *size as i64 => {
                return Err(RuntimeError::Bindings(format!(
                    "`{axis}` is bound to {v} but the mesh `{}` says {size}",
                    graph.mesh
                )))
            }
            _ => {
                b.symbols.insert(axis.clone(), *size as i64);
            }
        }
    }
    for (name, _, v) in graph.inputs() {
        let Some(t) = inputs.get(&name) else { continue };
        let ty = graph.ty(v);
        if ty.rank() != t.shape.len() {
            continue; // reported with the input's shape check
        }
        for (d, &n) in ty.shape.iter().zip(&t.shape) {
            let syms = d.symbols();
            if syms.len() == 1 && *d == Dim::sym(&syms[0]) {
                let s = &syms[0];
                match b.symbols.get(s) {
                    Some(&have) if have != n as i64 => {
                        return Err(RuntimeError::Bindings(format!(
                            "input `{name}` has {n} in a dim of size `{s}`, but `{s}` is {have}"
                        )))
                    }
                    Some(_) => {}
                    None => {
                        b.symbols.insert(s.clone(), n as i64);
                    }
                }
            }
        }
    }
    Ok(b)
}

/// Checks a full weight or input against its node's type, where the type can be
/// evaluated without rank coordinates (otherwise each rank checks its own).
fn check_host_shape(t: &HostTensor, ty: &weft_ir::TensorType, b: &Bindings) -> Result<(), String> {
    let mut want = Vec::new();
    for d in &ty.shape {
        match d.eval(b) {
            Ok(v) => want.push(v),
            Err(weft_ir::DimError::UnboundCoord(_))
            | Err(weft_ir::DimError::CoordOutOfRange { .. }) => return Ok(()),
            Err(e) => return Err(format!("cannot evaluate its type {ty}: {e}")),
        }
    }
    let have: Vec<i64> = t.shape.iter().map(|&x| x as i64).collect();
    if have != want || t.shape.len() != ty.rank() {
        return Err(format!(
            "has shape {:?} but its node's type {ty} is {:?}",
            t.shape, want
        ));
    }
    Ok(())
}

/// The program position of each value's last use (its definition when unused);
/// outputs are never freed.
fn last_uses(g: &Graph) -> Vec<usize> {
    let mut last = vec![usize::MAX; g.value_capacity()];
    let mut is_output = vec![false; g.value_capacity()];
    for (_, v) in g.outputs() {
        if let Some(o) = is_output.get_mut(v.0 as usize) {
            *o = true;
        }
    }
    for (pos, &n) in g.nodes().iter().enumerate() {
        for v in g.node(n).results.iter().chain(&g.node(n).operands) {
            if let Some(l) = last.get_mut(v.0 as usize) {
                *l = pos;
            }
        }
    }
    for (i, o) in is_output.iter().enumerate() {
        if *o {
            last[i] = usize::MAX;
        }
    }
    last
}

/// Makes glibc's `malloc` keep freed memory for reuse instead of returning it to the
/// system (no `mmap` for large blocks, no trimming). A run allocates and frees many
/// tensors of tens of megabytes (logits, embedding gradients); by default each comes
/// from a fresh `mmap` whose pages fault and get zeroed on first touch, which costs a
/// third of a forward+backward at 32k vocabularies. This is process-wide and keeps the
/// peak memory mapped, so it is opt-in: a program (the CLI, a benchmark) calls it once
/// at start. Returns whether it took effect (only on Linux with glibc).
pub fn tune_allocator() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_MAX: i32 = -4;
        // SAFETY: mallopt only changes allocator parameters; both values are valid.
        unsafe { mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, i32::MAX) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Which rank holds each block of a split: for split axes' coordinates `cs`, the rank
/// with those coordinates and 0 on every other axis.
fn rank_with(mesh: &weft_ir::Mesh, fixed: &[(String, u32)]) -> u32 {
    if fixed.iter().any(|(a, _)| weft_ir::mesh::is_derived(a)) {
        // Derived axes (ep, edp) regroup the others' ranks: search by coordinates.
        let want: Vec<(&str, u32)> = fixed.iter().map(|(a, c)| (a.as_str(), *c)).collect();
        if let Some(r) = mesh.rank_with(&want) {
            return r;
        }
    }
    let coords: Vec<u32> = mesh
        .axes
        .iter()
        .map(|(a, _)| {
            fixed
                .iter()
                .find(|(x, _)| x == a)
                .map(|(_, c)| *c)
                .unwrap_or(0)
        })
        .collect();
    mesh.rank_of(&coords)
}

/// The full value of output `name` from the ranks' pieces (a candle tensor, still
/// connected to the autograd graph).
fn assemble(
    sh: &Shared,
    opts: &RunOptions,
    name: &str,
    ranks: &[RankOut],
) -> Result<Tensor, RuntimeError> {
    let mesh = sh.mesh;
    let splits = sh.graph.output_split(name);
    let out_err = |message: String| RuntimeError::Output {
        name: name.to_string(),
        message,
    };
    if let Some(full) = grad_outputs::assemble_param_grad(sh, opts, name, ranks) {
        return full.map_err(out_err);
    }
    for (_, axis) in splits {
        if !mesh.has(axis) {
            return Err(out_err(format!(
                "is split over axis `{axis}`, which the mesh `{mesh}` lacks"
            )));
        }
    }
    fn build(
        mesh: &weft_ir::Mesh,
        splits: &[(usize, String)],
        fixed: &mut Vec<(String, u32)>,
        ranks: &[RankOut],
        name: &str,
    ) -> Result<Tensor, String> {
        let Some(((dim, axis), rest)) = splits.split_first() else {
            return Ok(ranks[rank_with(mesh, fixed) as usize].outputs[name].clone());
        };
        let size = mesh.size(axis).unwrap_or(1);
        let mut parts = Vec::with_capacity(size as usize);
        for c in 0..size {
            fixed.push((axis.clone(), c));
            parts.push(build(mesh, rest, fixed, ranks, name)?);
            fixed.pop();
        }
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        if let Some(p) = parts.iter().find(|p| *dim >= p.rank()) {
            return Err(format!(
                "split dim {dim} is out of range for a piece of shape {:?}",
                p.dims()
            ));
        }
        Tensor::cat(&parts, *dim)
            .map_err(|e| format!("cannot join the pieces split over `{axis}`: {e}"))
    }
    let full = build(mesh, splits, &mut Vec::new(), ranks, name).map_err(out_err)?;

    if opts.check_replicas && ranks.len() > 1 {
        // Every rank must equal the rank holding the same block.
        let split_axes: Vec<&str> = splits.iter().map(|(_, a)| a.as_str()).collect();
        let tol = match sh.precision {
            Precision::F32 => 1e-4,
            Precision::F64 => 1e-10,
        };
        let mut cache: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
        for r in 0..ranks.len() as u32 {
            let fixed: Vec<(String, u32)> = split_axes
                .iter()
                .map(|a| (a.to_string(), mesh.coord(r, a).unwrap_or(0)))
                .collect();
            let rep = rank_with(mesh, &fixed);
            if rep == r {
                continue;
            }
            let (a, b) = (
                &ranks[rep as usize].outputs[name],
                &ranks[r as usize].outputs[name],
            );
            if a.dims() != b.dims() {
                return Err(out_err(format!(
                    "rank {r} has shape {:?} but rank {rep}, which should hold the same values, has {:?} \
                     (is the output split over an axis the graph does not declare?)",
                    b.dims(),
                    a.dims()
                )));
            }
            if a.id() == b.id() {
                continue;
            }
            if let std::collections::btree_map::Entry::Vacant(e) = cache.entry(rep) {
                e.insert(host::values_f64(a).map_err(&out_err)?);
            }
            let av = &cache[&rep];
            let bv = host::values_f64(b).map_err(&out_err)?;
            let scale = av.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            if let Some((i, (x, y))) = av.iter().zip(&bv).enumerate().find(|(_, (x, y))| {
                !((*x - *y).abs() <= tol * scale || (x.is_nan() && y.is_nan()) || *x == *y)
            }) {
                return Err(out_err(format!(
                    "rank {r} differs from rank {rep} at flat position {i} ({y} vs {x}), but the output has no split \
                     over the axes on which they differ\nhelp: declare how the output is split with `add_output_split`"
                )));
            }
        }
    }
    Ok(full)
}

/// Backward from the loss, then each param's gradient assembled from its replicas.
fn gradients(
    sh: &Shared,
    opts: &RunOptions,
    loss: &Tensor,
    ranks: &[RankOut],
    res: &mut RunResult,
) -> Result<(), RuntimeError> {
    let bwd = |message: String| RuntimeError::Backward {
        loss: opts.loss.clone(),
        message,
    };
    if host::kind_of(loss.dtype()) != host::Kind::Float {
        return Err(bwd(format!(
            "the loss is a {:?} tensor, not a float",
            loss.dtype()
        )));
    }
    let root = if loss.rank() == 0 {
        loss.clone()
    } else {
        loss.sum_all().map_err(|e| bwd(e.to_string()))?
    };
    let tb = std::time::Instant::now();
    let store = root.backward().map_err(|e| bwd(e.to_string()))?;
    res.profile.backward_s = tb.elapsed().as_secs_f64();
    let g = sh.graph;
    for (name, v) in g.params() {
        if res.grads.contains_key(&name) {
            continue;
        }
        let dtype = g.ty(v).dtype;
        let full = &sh.params[&name];
        let shape = full.dims().to_vec();
        let splits = opts
            .param_splits
            .get(&name)
            .map(|s| s.as_slice())
            .unwrap_or(&[]);
        let mut acc = Vec::new();
        if !sh.per_rank_vars {
            // One variable shared by every rank: its gradient is already the sum.
            if let Some(gr) = store.get(full) {
                acc = host::values_f64(gr).map_err(&bwd)?;
            }
        }
        for (r, ro) in ranks.iter().enumerate() {
            if !sh.per_rank_vars {
                break;
            }
            let Some(var) = ro.vars.get(&name) else {
                continue;
            };
            let grad = match store.get(var) {
                Some(gr) => gr.clone(),
                None => var.zeros_like().map_err(|e| bwd(e.to_string()))?,
            };
            let gv = host::values_f64(&grad).map_err(&bwd)?;
            if acc.is_empty() {
                acc = vec![0.0f64; full.elem_count()];
            }
            let parts = g.param_partition(&name);
            if parts.is_empty() {
                let offsets = split_offsets(&shape, splits, sh.mesh, r as u32);
                add_block(&mut acc, &shape, &gv, grad.dims(), &offsets);
            } else {
                partition::add_shard(&mut acc, &shape, &gv, grad.dims(), parts, sh.mesh, r as u32)
                    .map_err(|m| bwd(format!("param `{name}`: {m}")))?;
            }
            if res.rank_grads.len() < ranks.len() {
                res.rank_grads.resize(ranks.len(), BTreeMap::new());
            }
            res.rank_grads[r].insert(
                name.clone(),
                HostTensor::floats(dtype, grad.dims().to_vec(), gv),
            );
        }
        if acc.is_empty() {
            acc = vec![0.0f64; full.elem_count()];
        }
        res.grads
            .insert(name.clone(), HostTensor::floats(dtype, shape, acc));
    }
    Ok(())
}

/// Where `rank`'s piece of a param split by `splits` starts in each dim.
fn split_offsets(
    shape: &[usize],
    splits: &[(usize, String)],
    mesh: &weft_ir::Mesh,
    rank: u32,
) -> Vec<usize> {
    let mut off = vec![0usize; shape.len()];
    let mut ext = shape.to_vec();
    for (dim, axis) in splits {
        let size = mesh.size_or_one(axis) as usize;
        let c = mesh.coord(rank, axis).unwrap_or(0) as usize;
        let chunk = ext[*dim] / size;
        off[*dim] += c * chunk;
        ext[*dim] = chunk;
    }
    off
}

/// `acc[offsets + i] += block[i]` for a row-major block inside a row-major tensor.
fn add_block(acc: &mut [f64], shape: &[usize], block: &[f64], bshape: &[usize], offsets: &[usize]) {
    if bshape == shape {
        for (a, b) in acc.iter_mut().zip(block) {
            *a += b;
        }
        return;
    }
    let rank = shape.len();
    let mut strides = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let inner = bshape.last().copied().unwrap_or(1);
    if inner == 0 {
        return;
    }
    let mut idx = vec![0usize; rank];
    for (row, chunk) in block.chunks(inner).enumerate() {
        // multi-index of this row in the block (all dims but the last)
        let mut r = row;
        for i in (0..rank.saturating_sub(1)).rev() {
            idx[i] = r % bshape[i];
            r /= bshape[i];
        }
        let base: usize = (0..rank.saturating_sub(1))
            .map(|i| (idx[i] + offsets[i]) * strides[i])
            .sum::<usize>()
            + offsets.last().copied().unwrap_or(0);
        for (j, v) in chunk.iter().enumerate() {
            acc[base + j] += v;
        }
    }
}

//! Fused row kernels with hand-written backward passes, as candle custom ops: softmax,
//! log-softmax and token cross-entropy over the last dim. Composed from candle's
//! elementwise ops these make a dozen full-size temporaries each way (the logits of a
//! 32k vocabulary are the largest tensors of a step); fused they read and write each
//! row once, rows in parallel.
//!
//! Each op works on contiguous f32 or f64 rows and accumulates in that type, as torch
//! does on the CPU.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use candle_core::backend::BackendStorage;
use rayon::prelude::*;

/// The float types rows are computed in.
trait Fl: Copy + Send + Sync + PartialOrd + 'static {
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn zero() -> Self;
    fn one() -> Self;
    fn neg_inf() -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! fl {
    ($t:ty) => {
        impl Fl for $t {
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn sub(self, o: Self) -> Self {
                self - o
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn div(self, o: Self) -> Self {
                self / o
            }
            fn zero() -> Self {
                0.0
            }
            fn one() -> Self {
                1.0
            }
            fn neg_inf() -> Self {
                <$t>::NEG_INFINITY
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}
fl!(f32);
fl!(f64);

/// Rows below this many elements in total are done on the calling thread.
const PAR_MIN: usize = 1 << 15;

fn row_max<T: Fl>(r: &[T]) -> T {
    r.iter().fold(T::neg_inf(), |m, &x| if x > m || x.is_nan() { x } else { m })
}

/// `log(sum(exp(r)))`, with its max subtracted first.
fn row_lse<T: Fl>(r: &[T]) -> T {
    let m = row_max(r);
    let s = r.iter().fold(T::zero(), |s, &x| s.add(x.sub(m).exp()));
    m.add(s.ln())
}

/// Applies `f(in_row, out_row)` to every row of `n` elements, in parallel when large.
fn rows<T: Fl>(x: &[T], n: usize, f: impl Fn(usize, &[T], &mut [T]) + Sync) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if n == 0 {
        return out;
    }
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(n).zip(x.par_chunks(n)).enumerate().for_each(|(i, (o, r))| f(i, r, o));
    } else {
        out.chunks_mut(n).zip(x.chunks(n)).enumerate().for_each(|(i, (o, r))| f(i, r, o));
    }
    out
}

fn contiguous<'a, T: candle_core::WithDType>(s: &'a [T], l: &Layout, op: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{op}: operand is not contiguous"),
    }
}

fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1)
}

/// Dispatches a row kernel over the float storage kinds.
macro_rules! on_floats {
    ($s:expr, $l:expr, $name:expr, |$x:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(v) => {
                let $x = contiguous(v, $l, $name)?;
                CpuStorage::F32($body)
            }
            CpuStorage::F64(v) => {
                let $x = contiguous(v, $l, $name)?;
                CpuStorage::F64($body)
            }
            other => candle_core::bail!("{}: expected f32 or f64, got {:?}", $name, other.dtype()),
        }
    };
}

// ---- softmax ----

fn softmax_rows<T: Fl>(x: &[T], n: usize) -> Vec<T> {
    rows(x, n, |_, r, o| {
        let m = row_max(r);
        let mut s = T::zero();
        for (o, &v) in o.iter_mut().zip(r) {
            *o = v.sub(m).exp();
            s = s.add(*o);
        }
        for o in o.iter_mut() {
            *o = o.div(s);
        }
    })
}

/// `dx = y * (g - sum(g * y))` per row; `y` and `g` interleaved as one slice pair.
fn softmax_bwd_rows<T: Fl>(y: &[T], g: &[T], n: usize) -> Vec<T> {
    rows(y, n, |i, yr, o| {
        let gr = &g[i * n..(i + 1) * n];
        let dot = yr.iter().zip(gr).fold(T::zero(), |s, (&a, &b)| s.add(a.mul(b)));
        for ((o, &yv), &gv) in o.iter_mut().zip(yr).zip(gr) {
            *o = yv.mul(gv.sub(dot));
        }
    })
}

/// Softmax over the last dim.
pub(crate) struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "weft-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l);
        Ok((on_floats!(s, l, "softmax", |x| softmax_rows(x, n)), l.shape().clone()))
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.contiguous()?.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBwd)?))
    }
}

struct SoftmaxBwd;

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "weft-softmax-bwd"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l1);
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => {
                CpuStorage::F32(softmax_bwd_rows(contiguous(y, l1, "softmax-bwd")?, contiguous(g, l2, "softmax-bwd")?, n))
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => {
                CpuStorage::F64(softmax_bwd_rows(contiguous(y, l1, "softmax-bwd")?, contiguous(g, l2, "softmax-bwd")?, n))
            }
            _ => candle_core::bail!("softmax-bwd: dtypes differ or are not float"),
        };
        Ok((out, l1.shape().clone()))
    }
}

// ---- log-softmax ----

fn log_softmax_rows<T: Fl>(x: &[T], n: usize) -> Vec<T> {
    rows(x, n, |_, r, o| {
        let lse = row_lse(r);
        for (o, &v) in o.iter_mut().zip(r) {
            *o = v.sub(lse);
        }
    })
}

/// `dx = g - exp(y) * sum(g)` per row.
fn log_softmax_bwd_rows<T: Fl>(y: &[T], g: &[T], n: usize) -> Vec<T> {
    rows(y, n, |i, yr, o| {
        let gr = &g[i * n..(i + 1) * n];
        let s = gr.iter().fold(T::zero(), |s, &b| s.add(b));
        for ((o, &yv), &gv) in o.iter_mut().zip(yr).zip(gr) {
            *o = gv.sub(yv.exp().mul(s));
        }
    })
}

/// Log-softmax over the last dim.
pub(crate) struct LogSoftmax;

impl CustomOp1 for LogSoftmax {
    fn name(&self) -> &'static str {
        "weft-log-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l);
        Ok((on_floats!(s, l, "log-softmax", |x| log_softmax_rows(x, n)), l.shape().clone()))
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.contiguous()?.apply_op2_no_bwd(&grad.contiguous()?, &LogSoftmaxBwd)?))
    }
}

struct LogSoftmaxBwd;

impl CustomOp2 for LogSoftmaxBwd {
    fn name(&self) -> &'static str {
        "weft-log-softmax-bwd"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l1);
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => CpuStorage::F32(log_softmax_bwd_rows(
                contiguous(y, l1, "log-softmax-bwd")?,
                contiguous(g, l2, "log-softmax-bwd")?,
                n,
            )),
            (CpuStorage::F64(y), CpuStorage::F64(g)) => CpuStorage::F64(log_softmax_bwd_rows(
                contiguous(y, l1, "log-softmax-bwd")?,
                contiguous(g, l2, "log-softmax-bwd")?,
                n,
            )),
            _ => candle_core::bail!("log-softmax-bwd: dtypes differ or are not float"),
        };
        Ok((out, l1.shape().clone()))
    }
}

// ---- cross-entropy ----

/// Per-row token cross-entropy of logits [.., V] against i64 labels [..]:
/// `lse(x) - x[label]`, 0 where the label is `ignore` (labels are range-checked by the
/// caller).
pub(crate) struct CrossEntropyRows {
    pub ignore: i64,
}

fn labels_of<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [i64]> {
    match s {
        CpuStorage::I64(v) => contiguous(v, l, "cross-entropy labels"),
        other => candle_core::bail!("cross-entropy: labels must be i64, got {:?}", other.dtype()),
    }
}

fn ce_rows<T: Fl>(x: &[T], labels: &[i64], v: usize, ignore: i64) -> Vec<T> {
    let f = |(i, o): (usize, &mut T)| {
        let l = labels[i];
        *o = if l == ignore { T::zero() } else {
            let r = &x[i * v..(i + 1) * v];
            row_lse(r).sub(r[l as usize])
        };
    };
    let mut out = vec![T::zero(); labels.len()];
    if x.len() >= PAR_MIN {
        out.par_iter_mut().enumerate().for_each(f);
    } else {
        out.iter_mut().enumerate().for_each(f);
    }
    out
}

/// `dx[i] = g[i] * (softmax(x[i]) - onehot(label[i]))`, 0 for ignored rows.
fn ce_bwd_rows<T: Fl>(x: &[T], labels: &[i64], g: &[T], v: usize, ignore: i64) -> Vec<T> {
    rows(x, v, |i, r, o| {
        let l = labels[i];
        if l == ignore {
            return;
        }
        let m = row_max(r);
        let mut s = T::zero();
        for (o, &xv) in o.iter_mut().zip(r) {
            *o = xv.sub(m).exp();
            s = s.add(*o);
        }
        let gi = g[i];
        let scale = gi.div(s);
        for o in o.iter_mut() {
            *o = o.mul(scale);
        }
        o[l as usize] = o[l as usize].sub(gi);
    })
}

impl CustomOp2 for CrossEntropyRows {
    fn name(&self) -> &'static str {
        "weft-cross-entropy"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = last_dim(l1);
        let labels = labels_of(s2, l2)?;
        if labels.len() * v != l1.shape().elem_count() || l1.dims()[..l1.dims().len() - 1] != *l2.dims() {
            candle_core::bail!("cross-entropy: labels {:?} do not fit logits {:?}", l2.dims(), l1.dims());
        }
        let out = on_floats!(s1, l1, "cross-entropy", |x| ce_rows(x, labels, v, self.ignore));
        Ok((out, l2.shape().clone()))
    }
    fn bwd(&self, logits: &Tensor, labels: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = logits.contiguous()?.apply_op3_no_bwd(
            &labels.contiguous()?,
            &grad.contiguous()?,
            &CrossEntropyBwd { ignore: self.ignore },
        )?;
        Ok((Some(d), None))
    }
}

struct CrossEntropyBwd {
    ignore: i64,
}

impl CustomOp3 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "weft-cross-entropy-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let v = last_dim(l1);
        let labels = labels_of(s2, l2)?;
        let out = match (s1, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(ce_bwd_rows(
                contiguous(x, l1, "cross-entropy-bwd")?,
                labels,
                contiguous(g, l3, "cross-entropy-bwd")?,
                v,
                self.ignore,
            )),
            (CpuStorage::F64(x), CpuStorage::F64(g)) => CpuStorage::F64(ce_bwd_rows(
                contiguous(x, l1, "cross-entropy-bwd")?,
                labels,
                contiguous(g, l3, "cross-entropy-bwd")?,
                v,
                self.ignore,
            )),
            _ => candle_core::bail!("cross-entropy-bwd: dtypes differ or are not float"),
        };
        Ok((out, l1.shape().clone()))
    }
}

// ---- linear ----

/// `dst[m, n] = a[m, k] @ b[k, n]` for row-major `dst`, with `a` and `b` given by
/// their element strides (row, column), through the gemm crate candle also uses.
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: Fl>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    a: &[T],
    (a_rs, a_cs): (usize, usize),
    b: &[T],
    (b_rs, b_cs): (usize, usize),
    parallel: bool,
) {
    assert!(dst.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        dst[..m * n].iter_mut().for_each(|v| *v = T::zero());
        return;
    }
    assert!(a.len() > (m - 1) * a_rs + (k - 1) * a_cs && b.len() > (k - 1) * b_rs + (n - 1) * b_cs);
    let par = if parallel { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    // SAFETY: the bounds of every operand were checked above; dst is not aliased.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            T::zero(),
            T::one(),
            false,
            false,
            false,
            par,
        )
    }
}

fn linear_fwd<T: Fl>(x: &[T], w: &[T], b: Option<&[T]>, n: usize, k: usize) -> Vec<T> {
    let m = if k == 0 { 0 } else { x.len() / k };
    let mut out = vec![T::zero(); m * n];
    // w^T: element (p, j) is w[j, p]
    gemm_into(&mut out, (m, n, k), x, (k, 1), w, (1, k), true);
    if let Some(b) = b {
        let add = |row: &mut [T]| row.iter_mut().zip(b).for_each(|(o, &bv)| *o = o.add(bv));
        if out.len() >= PAR_MIN && n > 0 {
            out.par_chunks_mut(n).for_each(add);
        } else if n > 0 {
            out.chunks_mut(n).for_each(add);
        }
    }
    out
}

fn linear_shape(lx: &Layout, lw: &Layout) -> Result<(Shape, usize, usize)> {
    let (n, k) = lw.shape().dims2()?;
    let xd = lx.dims();
    if xd.last() != Some(&k) {
        candle_core::bail!("linear: x {xd:?} does not have the {k} input features of w {:?}", lw.dims());
    }
    let mut od = xd.to_vec();
    *od.last_mut().expect("x has a dim") = n;
    Ok((Shape::from(od), n, k))
}

/// `x @ w^T (+ b)` with `x [.., K]`, `w [N, K]`, `b [N]`: one autograd node where the
/// composed form takes a reshape, a transpose, a matmul and a reshape (each costing a
/// gradient-sized zero-fill and add in candle's backward).
pub(crate) struct Linear;

fn linear_cpu(s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, b: Option<(&CpuStorage, &Layout)>) -> Result<(CpuStorage, Shape)> {
    let (shape, n, k) = linear_shape(l1, l2)?;
    let out = match (s1, s2, b) {
        (CpuStorage::F32(x), CpuStorage::F32(w), None) => CpuStorage::F32(linear_fwd(contiguous(x, l1, "linear")?, contiguous(w, l2, "linear")?, None, n, k)),
        (CpuStorage::F64(x), CpuStorage::F64(w), None) => CpuStorage::F64(linear_fwd(contiguous(x, l1, "linear")?, contiguous(w, l2, "linear")?, None, n, k)),
        (CpuStorage::F32(x), CpuStorage::F32(w), Some((CpuStorage::F32(bv), lb))) => CpuStorage::F32(linear_fwd(
            contiguous(x, l1, "linear")?,
            contiguous(w, l2, "linear")?,
            Some(contiguous(bv, lb, "linear")?),
            n,
            k,
        )),
        (CpuStorage::F64(x), CpuStorage::F64(w), Some((CpuStorage::F64(bv), lb))) => CpuStorage::F64(linear_fwd(
            contiguous(x, l1, "linear")?,
            contiguous(w, l2, "linear")?,
            Some(contiguous(bv, lb, "linear")?),
            n,
            k,
        )),
        _ => candle_core::bail!("linear: operands must share one float dtype"),
    };
    Ok((out, shape))
}

/// `(dx, dw, db)` of `y = x @ w^T + b` for the output gradient `g`.
fn linear_bwd(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, k) = w.dims2()?;
    let m = x.elem_count() / k.max(1);
    let g2 = g.reshape((m, n))?;
    let x2 = x.reshape((m, k))?;
    let dx = g2.matmul(w)?.reshape(x.dims())?;
    let dw = g2.t()?.matmul(&x2)?;
    let db = g2.sum(0)?;
    Ok((dx, dw, db))
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "weft-linear"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        linear_cpu(s1, l1, s2, l2, None)
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = linear_bwd(x, w, g)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// [`Linear`] with a bias.
pub(crate) struct LinearBias;

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        "weft-linear-bias"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        if l3.dims() != [l2.dims()[0]] {
            candle_core::bail!("linear: bias {:?} does not fit w {:?}", l3.dims(), l2.dims());
        }
        linear_cpu(s1, l1, s2, l2, Some((s3, l3)))
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = linear_bwd(x, w, g)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

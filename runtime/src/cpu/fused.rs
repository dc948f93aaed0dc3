//! Fused row kernels with hand-written backward passes, as candle custom ops: softmax,
//! log-softmax and token cross-entropy over the last dim. Composed from candle's
//! elementwise ops these make a dozen full-size temporaries each way (the logits of a
//! 32k vocabulary are the largest tensors of a step); fused they read and write each
//! row once, rows in parallel.
//!
//! Each op works on contiguous f32 or f64 rows and accumulates in that type, as torch
//! does on the CPU.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::sgemm::{self, sgemm};
use super::vexp;

/// The float types rows are computed in.
trait Fl: Copy + Send + Sync + PartialOrd + Gemm + RowExp + 'static {
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn zero() -> Self;
    fn one() -> Self;
    fn of(v: f64) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
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
            fn of(v: f64) -> Self {
                v as $t
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
        }
    };
}
fl!(f32);
fl!(f64);

/// Rows below this many elements in total are done on the calling thread.
const PAR_MIN: usize = 1 << 15;

fn row_max<T: Fl>(r: &[T]) -> T {
    T::row_max(r)
}

/// `log(sum(exp(r)))`, with its max subtracted first.
fn row_lse<T: Fl>(r: &[T]) -> T {
    let m = row_max(r);
    m.add(T::exp_sum(r, m, None).ln())
}

/// The row max (NaN when the row has one) and `sum(exp(r - m))` (also written to `out`
/// when given), per float type: f32 vectorized in [`vexp`].
trait RowExp: Sized {
    fn row_max(r: &[Self]) -> Self;
    fn exp_sum(r: &[Self], m: Self, out: Option<&mut [Self]>) -> Self;
}

impl RowExp for f32 {
    fn row_max(r: &[f32]) -> f32 {
        vexp::max(r)
    }
    fn exp_sum(r: &[f32], m: f32, out: Option<&mut [f32]>) -> f32 {
        vexp::exp_sum(r, m, out)
    }
}

impl RowExp for f64 {
    fn row_max(r: &[f64]) -> f64 {
        r.iter().fold(
            f64::NEG_INFINITY,
            |m, &x| if x > m || x.is_nan() { x } else { m },
        )
    }
    fn exp_sum(r: &[f64], m: f64, out: Option<&mut [f64]>) -> f64 {
        match out {
            Some(o) => o.iter_mut().zip(r).fold(0.0, |s, (o, &x)| {
                *o = (x - m).exp();
                s + *o
            }),
            None => r.iter().fold(0.0, |s, &x| s + (x - m).exp()),
        }
    }
}

/// Applies `f(in_row, out_row)` to every row of `n` elements, in parallel when large.
fn rows<T: Fl>(x: &[T], n: usize, f: impl Fn(usize, &[T], &mut [T]) + Sync) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if n == 0 {
        return out;
    }
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(n)
            .zip(x.par_chunks(n))
            .enumerate()
            .for_each(|(i, (o, r))| f(i, r, o));
    } else {
        out.chunks_mut(n)
            .zip(x.chunks(n))
            .enumerate()
            .for_each(|(i, (o, r))| f(i, r, o));
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
        let s = T::exp_sum(r, m, Some(o));
        for o in o.iter_mut() {
            *o = o.div(s);
        }
    })
}

/// `dx = y * (g - sum(g * y))` per row; `y` and `g` interleaved as one slice pair.
fn softmax_bwd_rows<T: Fl>(y: &[T], g: &[T], n: usize) -> Vec<T> {
    rows(y, n, |i, yr, o| {
        let gr = &g[i * n..(i + 1) * n];
        let dot = yr
            .iter()
            .zip(gr)
            .fold(T::zero(), |s, (&a, &b)| s.add(a.mul(b)));
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
        Ok((
            on_floats!(s, l, "softmax", |x| softmax_rows(x, n)),
            l.shape().clone(),
        ))
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            res.contiguous()?
                .apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBwd)?,
        ))
    }
}

struct SoftmaxBwd;

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "weft-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l1);
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => CpuStorage::F32(softmax_bwd_rows(
                contiguous(y, l1, "softmax-bwd")?,
                contiguous(g, l2, "softmax-bwd")?,
                n,
            )),
            (CpuStorage::F64(y), CpuStorage::F64(g)) => CpuStorage::F64(softmax_bwd_rows(
                contiguous(y, l1, "softmax-bwd")?,
                contiguous(g, l2, "softmax-bwd")?,
                n,
            )),
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
        Ok((
            on_floats!(s, l, "log-softmax", |x| log_softmax_rows(x, n)),
            l.shape().clone(),
        ))
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            res.contiguous()?
                .apply_op2_no_bwd(&grad.contiguous()?, &LogSoftmaxBwd)?,
        ))
    }
}

struct LogSoftmaxBwd;

impl CustomOp2 for LogSoftmaxBwd {
    fn name(&self) -> &'static str {
        "weft-log-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
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
        *o = if l == ignore {
            T::zero()
        } else {
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
        let s = T::exp_sum(r, m, Some(o));
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
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let v = last_dim(l1);
        let labels = labels_of(s2, l2)?;
        if labels.len() * v != l1.shape().elem_count()
            || l1.dims()[..l1.dims().len() - 1] != *l2.dims()
        {
            candle_core::bail!(
                "cross-entropy: labels {:?} do not fit logits {:?}",
                l2.dims(),
                l1.dims()
            );
        }
        let out = on_floats!(s1, l1, "cross-entropy", |x| ce_rows(
            x,
            labels,
            v,
            self.ignore
        ));
        Ok((out, l2.shape().clone()))
    }
    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = logits.contiguous()?.apply_op3_no_bwd(
            &labels.contiguous()?,
            &grad.contiguous()?,
            &CrossEntropyBwd {
                ignore: self.ignore,
            },
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
/// their element strides (row, column): f32 through [`sgemm`], f64 through the gemm crate.
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
    gemm_strided(
        dst,
        n,
        (m, n, k),
        a,
        (a_rs, a_cs),
        b,
        (b_rs, b_cs),
        false,
        parallel,
    )
}

/// `dst[m, n] (+)= a @ b` for `dst` of row stride `dst_rs`; zero sizes handled here.
#[allow(clippy::too_many_arguments)]
fn gemm_strided<T: Fl>(
    dst: &mut [T],
    dst_rs: usize,
    (m, n, k): (usize, usize, usize),
    a: &[T],
    astr: (usize, usize),
    b: &[T],
    bstr: (usize, usize),
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 || k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * dst_rs..r * dst_rs + n]
                    .iter_mut()
                    .for_each(|v| *v = T::zero());
            }
        }
        return;
    }
    assert!(dst.len() >= (m - 1) * dst_rs + n);
    T::gemm(
        dst,
        dst_rs,
        (m, n, k),
        a,
        astr,
        b,
        bstr,
        accumulate,
        parallel,
    )
}

/// The matrix product per float type.
trait Gemm: Sized {
    /// `dst (+)= a @ b` as [`gemm_strided`], for nonzero sizes and checked `dst`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        dst: &mut [Self],
        dst_rs: usize,
        mnk: (usize, usize, usize),
        a: &[Self],
        astr: (usize, usize),
        b: &[Self],
        bstr: (usize, usize),
        accumulate: bool,
        parallel: bool,
    );
}

impl Gemm for f32 {
    fn gemm(
        dst: &mut [f32],
        dst_rs: usize,
        mnk: (usize, usize, usize),
        a: &[f32],
        astr: (usize, usize),
        b: &[f32],
        bstr: (usize, usize),
        accumulate: bool,
        parallel: bool,
    ) {
        sgemm(
            mnk,
            1.0,
            a,
            astr,
            b,
            bstr,
            if accumulate { 1.0 } else { 0.0 },
            dst,
            (dst_rs, 1),
            parallel,
        )
    }
}

impl Gemm for f64 {
    fn gemm(
        dst: &mut [f64],
        dst_rs: usize,
        (m, n, k): (usize, usize, usize),
        a: &[f64],
        (a_rs, a_cs): (usize, usize),
        b: &[f64],
        (b_rs, b_cs): (usize, usize),
        accumulate: bool,
        parallel: bool,
    ) {
        assert!(
            a.len() > (m - 1) * a_rs + (k - 1) * a_cs && b.len() > (k - 1) * b_rs + (n - 1) * b_cs
        );
        let par = if parallel {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the bounds of every operand were checked (dst by the caller); dst is
        // not aliased by a or b.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                dst_rs as isize,
                accumulate,
                a.as_ptr(),
                a_cs as isize,
                a_rs as isize,
                b.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        }
    }
}

fn linear_fwd<T: Fl>(x: &[T], w: &[T], b: Option<&[T]>, n: usize, k: usize) -> Vec<T> {
    let m = x.len().checked_div(k).unwrap_or(0);
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
        candle_core::bail!(
            "linear: x {xd:?} does not have the {k} input features of w {:?}",
            lw.dims()
        );
    }
    let mut od = xd.to_vec();
    *od.last_mut().expect("x has a dim") = n;
    Ok((Shape::from(od), n, k))
}

/// `x @ w^T (+ b)` with `x [.., K]`, `w [N, K]`, `b [N]`: one autograd node where the
/// composed form takes a reshape, a transpose, a matmul and a reshape (each costing a
/// gradient-sized zero-fill and add in candle's backward).
pub(crate) struct Linear;

fn linear_cpu(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    b: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, Shape)> {
    let (shape, n, k) = linear_shape(l1, l2)?;
    let out = match (s1, s2, b) {
        (CpuStorage::F32(x), CpuStorage::F32(w), None) => CpuStorage::F32(linear_fwd(
            contiguous(x, l1, "linear")?,
            contiguous(w, l2, "linear")?,
            None,
            n,
            k,
        )),
        (CpuStorage::F64(x), CpuStorage::F64(w), None) => CpuStorage::F64(linear_fwd(
            contiguous(x, l1, "linear")?,
            contiguous(w, l2, "linear")?,
            None,
            n,
            k,
        )),
        (CpuStorage::F32(x), CpuStorage::F32(w), Some((CpuStorage::F32(bv), lb))) => {
            CpuStorage::F32(linear_fwd(
                contiguous(x, l1, "linear")?,
                contiguous(w, l2, "linear")?,
                Some(contiguous(bv, lb, "linear")?),
                n,
                k,
            ))
        }
        (CpuStorage::F64(x), CpuStorage::F64(w), Some((CpuStorage::F64(bv), lb))) => {
            CpuStorage::F64(linear_fwd(
                contiguous(x, l1, "linear")?,
                contiguous(w, l2, "linear")?,
                Some(contiguous(bv, lb, "linear")?),
                n,
                k,
            ))
        }
        _ => candle_core::bail!("linear: operands must share one float dtype"),
    };
    Ok((out, shape))
}

/// `(dx, dw, db)` of `y = x @ w^T + b` for the output gradient `g` (`db` when asked).
fn linear_bwd(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    bias: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (n, k) = w.dims2()?;
    let m = x.elem_count() / k.max(1);
    let g2 = g.reshape((m, n))?;
    let x2 = x.reshape((m, k))?;
    let dx = sgemm::matmul(&g2, w)?.reshape(x.dims())?;
    let dw = sgemm::matmul(&g2.t()?, &x2)?;
    let db = if bias { Some(g2.sum(0)?) } else { None };
    Ok((dx, dw, db))
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "weft-linear"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        linear_cpu(s1, l1, s2, l2, None)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = linear_bwd(x, w, g, false)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// [`Linear`] with a bias.
pub(crate) struct LinearBias;

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        "weft-linear-bias"
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
        if l3.dims() != [l2.dims()[0]] {
            candle_core::bail!(
                "linear: bias {:?} does not fit w {:?}",
                l3.dims(),
                l2.dims()
            );
        }
        linear_cpu(s1, l1, s2, l2, Some((s3, l3)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = linear_bwd(x, w, g, true)?;
        Ok((Some(dx), Some(dw), db))
    }
}

// ---- attention ----

/// A strided 4-d view `[B, H, S, D]` of a storage slice.
struct View4<'a, T> {
    data: &'a [T],
    start: usize,
    st: [usize; 4],
}

impl<'a, T: Copy> View4<'a, T> {
    fn new(data: &'a [T], l: &Layout, what: &str) -> Result<Self> {
        let (d, s) = (l.dims(), l.stride());
        if d.len() != 4 {
            candle_core::bail!("attention: {what} must be 4-d, got {d:?}");
        }
        Ok(View4 {
            data,
            start: l.start_offset(),
            st: [s[0], s[1], s[2], s[3]],
        })
    }
    /// The `[S, D]` matrix of batch `b`, head `h`, from row `i0`: (slice, row stride, col stride).
    fn mat(&self, b: usize, h: usize, i0: usize) -> (&'a [T], usize, usize) {
        let off = self.start + b * self.st[0] + h * self.st[1] + i0 * self.st[2];
        (&self.data[off..], self.st[2], self.st[3])
    }
}

/// `dst[m, n] (+)= a @ b` like [`gemm_into`], optionally accumulating into `dst`, on the
/// calling thread.
#[allow(clippy::too_many_arguments)]
fn gemm_acc<T: Fl>(
    dst: &mut [T],
    dst_rs: usize,
    mnk: (usize, usize, usize),
    a: &[T],
    astr: (usize, usize),
    b: &[T],
    bstr: (usize, usize),
    accumulate: bool,
) {
    gemm_strided(dst, dst_rs, mnk, a, astr, b, bstr, accumulate, false)
}

/// Scaled dot-product attention of `q [B, Nq, Sq, D]`, `k [B, Nkv, Sk, D]`,
/// `v [B, Nkv, Sk, Dv]` (any strides), as HF's eager path: `q k^T * scale`, soft-capped
/// (`softcap * tanh(s / softcap)`) when asked, plus a bias of the dtype's most negative
/// value at masked positions (query `i` sits at `p = i + Sk - Sq`; causal keeps keys
/// `j <= p`, a window `W` also only `j > p - W`; `bias`: an additive
/// `[B|1, Nq|1, Sq, Sk]` tensor), softmax, `@ v`. Query head `h` reads kv head
/// `h / (Nq / Nkv)`. Blocks of query rows visit only the keys of their band (the rest
/// have probability exactly 0). The backward recomputes the probabilities per block of
/// query rows (as flash attention does) instead of keeping them.
pub(crate) struct Attention {
    pub causal: bool,
    pub scale: f64,
    /// Keys per query of the sliding window (needs `causal`).
    pub window: Option<usize>,
    pub softcap: Option<f64>,
    /// Additive mask, contiguous, in the compute dtype.
    pub bias: Option<Tensor>,
}

/// Query rows per block: bounds the probability scratch to `ROWS x Sk`.
const ROWS: usize = 64;

struct AttnGeom {
    b: usize,
    nq: usize,
    nkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
    /// v's head dim.
    dv: usize,
}

fn attn_geom(q: &Layout, k: &Layout, v: &Layout) -> Result<AttnGeom> {
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if qd.len() != 4
        || kd.len() != 4
        || vd.len() != 4
        || kd[..3] != vd[..3]
        || qd[0] != kd[0]
        || qd[3] != kd[3]
        || kd[1] == 0
        || qd[1] % kd[1] != 0
    {
        candle_core::bail!("attention: q {qd:?}, k {kd:?}, v {vd:?} do not fit together");
    }
    Ok(AttnGeom {
        b: qd[0],
        nq: qd[1],
        nkv: kd[1],
        sq: qd[2],
        sk: kd[2],
        d: qd[3],
        dv: vd[3],
    })
}

/// The bias slice and its dims, when there is one.
fn bias_of<T: candle_core::WithDType>(
    bias: &Option<Tensor>,
    g: &AttnGeom,
) -> Result<Option<(Vec<T>, [usize; 2])>> {
    let Some(t) = bias else { return Ok(None) };
    let d = t.dims();
    if d.len() != 4
        || d[2] != g.sq
        || d[3] != g.sk
        || !(d[0] == 1 || d[0] == g.b)
        || !(d[1] == 1 || d[1] == g.nq)
    {
        candle_core::bail!(
            "attention: mask {d:?} must be [B|1, heads|1, {}, {}]",
            g.sq,
            g.sk
        );
    }
    let v = t.flatten_all()?.to_vec1::<T>()?;
    Ok(Some((v, [d[0], d[1]])))
}

/// Scores of rows `i0..i0+rows` of head `h` against keys `j0..j0+jn`, soft-capped, masked
/// and softmaxed, into `p` (row stride `jn`); with `tcap`, the `tanh(s / softcap)` of
/// every score too (the backward's soft-cap factor).
#[allow(clippy::too_many_arguments)]
fn attn_probs<T: Fl>(
    p: &mut [T],
    mut tcap: Option<&mut [T]>,
    q: &View4<T>,
    k: &View4<T>,
    g: &AttnGeom,
    bias: Option<&(Vec<T>, [usize; 2])>,
    op: &Attention,
    min: T,
    (b, h, i0, rows, j0, jn): (usize, usize, usize, usize, usize, usize),
) {
    let kh = h / (g.nq / g.nkv);
    let (qa, qrs, qcs) = q.mat(b, h, i0);
    let (ka, krs, kcs) = k.mat(b, kh, j0);
    // k^T: element (d, j) is k[j, d]
    gemm_acc(
        p,
        jn,
        (rows, jn, g.d),
        qa,
        (qrs, qcs),
        ka,
        (kcs, krs),
        false,
    );
    let scale = T::of(op.scale);
    let cap = op.softcap.map(T::of);
    let off = g.sk as isize - g.sq as isize;
    for r in 0..rows {
        let i = i0 + r;
        let pos = i as isize + off;
        let row = &mut p[r * jn..r * jn + jn];
        let brow = bias.map(|(bv, [bb, bh])| {
            let base =
                (((if *bb == 1 { 0 } else { b }) * bh + if *bh == 1 { 0 } else { h }) * g.sq + i)
                    * g.sk;
            &bv[base + j0..base + j0 + jn]
        });
        for (jj, s) in row.iter_mut().enumerate() {
            let j = (j0 + jj) as isize;
            let mut x = s.mul(scale);
            if let Some(c) = cap {
                let t = x.div(c).tanh();
                if let Some(tc) = tcap.as_deref_mut() {
                    tc[r * jn + jj] = t;
                }
                x = c.mul(t);
            }
            if let Some(br) = brow {
                x = x.add(br[jj]);
            }
            let dropped =
                op.causal && (j > pos || op.window.is_some_and(|w| j <= pos - w as isize));
            if dropped {
                x = x.add(min);
            }
            *s = x;
        }
        let m = row_max(row);
        let mut z = T::zero();
        for s in row.iter_mut() {
            *s = s.sub(m).exp();
            z = z.add(*s);
        }
        for s in row.iter_mut() {
            *s = s.div(z);
        }
    }
}

/// The keys `j0..j0+jn` rows `i0..i0+rows` can see: all, except for a plain causal mask
/// (and window) whose rows all keep at least one key (then the keys outside the band have
/// probability exactly 0).
fn keys_seen(
    g: &AttnGeom,
    op: &Attention,
    has_bias: bool,
    i0: usize,
    rows: usize,
) -> (usize, usize) {
    let off = g.sk as isize - g.sq as isize;
    if op.causal && !has_bias && off >= 0 {
        let hi = ((i0 + rows) as isize + off).clamp(0, g.sk as isize) as usize;
        let lo = match op.window {
            Some(w) => ((i0 as isize + off + 1 - w as isize).max(0) as usize).min(hi),
            None => 0,
        };
        (lo, hi - lo)
    } else {
        (0, g.sk)
    }
}

fn attn_fwd<T: Fl>(
    op: &Attention,
    (q, k, v): (&View4<T>, &View4<T>, &View4<T>),
    g: &AttnGeom,
    min: T,
    bias: Option<(Vec<T>, [usize; 2])>,
) -> Result<Vec<T>> {
    let mut out = vec![T::zero(); g.b * g.nq * g.sq * g.dv];
    if out.is_empty() {
        return Ok(out);
    }
    let head = g.sq * g.dv;
    out.par_chunks_mut(head).enumerate().for_each(|(bh, oh)| {
        let (b, h) = (bh / g.nq, bh % g.nq);
        let kh = h / (g.nq / g.nkv);
        oh.par_chunks_mut(ROWS * g.dv)
            .enumerate()
            .for_each(|(blk, ob)| {
                let i0 = blk * ROWS;
                let rows = ob.len() / g.dv;
                let (j0, jn) = keys_seen(g, op, bias.is_some(), i0, rows);
                let mut p = vec![T::zero(); rows * jn.max(1)];
                attn_probs(
                    &mut p,
                    None,
                    q,
                    k,
                    g,
                    bias.as_ref(),
                    op,
                    min,
                    (b, h, i0, rows, j0, jn),
                );
                let (va, vrs, vcs) = v.mat(b, kh, j0);
                gemm_acc(
                    ob,
                    g.dv,
                    (rows, g.dv, jn),
                    &p,
                    (jn, 1),
                    va,
                    (vrs, vcs),
                    false,
                );
            });
    });
    Ok(out)
}

/// `[dq | dk | dv]` flattened, for output gradient `go` (contiguous `[B, Nq, Sq, Dv]`).
fn attn_bwd<T: Fl>(
    op: &Attention,
    (q, k, v): (&View4<T>, &View4<T>, &View4<T>),
    go: &[T],
    g: &AttnGeom,
    min: T,
    bias: Option<(Vec<T>, [usize; 2])>,
) -> Result<Vec<T>> {
    let scale = T::of(op.scale);
    let (nq_el, nk_el, nv_el) = (
        g.b * g.nq * g.sq * g.d,
        g.b * g.nkv * g.sk * g.d,
        g.b * g.nkv * g.sk * g.dv,
    );
    let mut all = vec![T::zero(); nq_el + nk_el + nv_el];
    // Per query head, its contribution to its kv head's dk and dv (summed below, in
    // head order, so the result does not depend on scheduling).
    let (k_el, v_el) = (g.sk * g.d, g.sk * g.dv);
    let mut dkp = vec![T::zero(); g.b * g.nq * k_el];
    let mut dvp = vec![T::zero(); g.b * g.nq * v_el];
    let (dq, rest) = all.split_at_mut(nq_el);
    let head = g.sq * g.d;
    let ohead = g.sq * g.dv;
    if nq_el > 0 && k_el > 0 && v_el > 0 {
        dq.par_chunks_mut(head)
            .zip(dkp.par_chunks_mut(k_el))
            .zip(dvp.par_chunks_mut(v_el))
            .enumerate()
            .for_each(|(bh, ((dqh, dkh), dvh))| {
                let (b, h) = (bh / g.nq, bh % g.nq);
                let kh = h / (g.nq / g.nkv);
                for (blk, dqb) in dqh.chunks_mut(ROWS * g.d).enumerate() {
                    let i0 = blk * ROWS;
                    let rows = dqb.len() / g.d;
                    let (j0, jn) = keys_seen(g, op, bias.is_some(), i0, rows);
                    if jn == 0 {
                        continue;
                    }
                    let (ka, krs, kcs) = k.mat(b, kh, j0);
                    let (va, vrs, vcs) = v.mat(b, kh, j0);
                    let mut p = vec![T::zero(); rows * jn];
                    let mut tcap = op.softcap.map(|_| vec![T::zero(); rows * jn]);
                    attn_probs(
                        &mut p,
                        tcap.as_deref_mut(),
                        q,
                        k,
                        g,
                        bias.as_ref(),
                        op,
                        min,
                        (b, h, i0, rows, j0, jn),
                    );
                    let gob = &go[bh * ohead + i0 * g.dv..bh * ohead + (i0 + rows) * g.dv];
                    // dP = dO @ v^T
                    let mut dp = vec![T::zero(); rows * jn];
                    gemm_acc(
                        &mut dp,
                        jn,
                        (rows, jn, g.dv),
                        gob,
                        (g.dv, 1),
                        va,
                        (vcs, vrs),
                        false,
                    );
                    // dS = P * (dP - rowsum(P * dP)) * scale (times 1 - tanh^2 when capped)
                    for r in 0..rows {
                        let (pr, dr) = (&p[r * jn..(r + 1) * jn], &mut dp[r * jn..(r + 1) * jn]);
                        let dot = pr
                            .iter()
                            .zip(dr.iter())
                            .fold(T::zero(), |s, (&a, &b)| s.add(a.mul(b)));
                        for (d, &pv) in dr.iter_mut().zip(pr) {
                            *d = pv.mul(d.sub(dot)).mul(scale);
                        }
                        if let Some(tc) = &tcap {
                            for (d, &t) in dr.iter_mut().zip(&tc[r * jn..(r + 1) * jn]) {
                                *d = d.mul(T::one().sub(t.mul(t)));
                            }
                        }
                    }
                    // dq = dS @ k
                    gemm_acc(
                        dqb,
                        g.d,
                        (rows, g.d, jn),
                        &dp,
                        (jn, 1),
                        ka,
                        (krs, kcs),
                        false,
                    );
                    // dk += dS^T @ q_rows, dv += P^T @ dO
                    let (qa, qrs, qcs) = q.mat(b, h, i0);
                    // (the partial buffers start at zero, so every block accumulates)
                    gemm_acc(
                        &mut dkh[j0 * g.d..],
                        g.d,
                        (jn, g.d, rows),
                        &dp,
                        (1, jn),
                        qa,
                        (qrs, qcs),
                        true,
                    );
                    gemm_acc(
                        &mut dvh[j0 * g.dv..],
                        g.dv,
                        (jn, g.dv, rows),
                        &p,
                        (1, jn),
                        gob,
                        (g.dv, 1),
                        true,
                    );
                }
            });
        let (dk, dv) = rest.split_at_mut(nk_el);
        let rep = g.nq / g.nkv;
        for (dst, part, el) in [(dk, &dkp, k_el), (dv, &dvp, v_el)] {
            dst.par_chunks_mut(el).enumerate().for_each(|(bg, out)| {
                let (b, gk) = (bg / g.nkv, bg % g.nkv);
                for r in 0..rep {
                    let h = gk * rep + r;
                    let src = &part[(b * g.nq + h) * el..(b * g.nq + h + 1) * el];
                    for (o, &s) in out.iter_mut().zip(src) {
                        *o = o.add(s);
                    }
                }
            });
        }
    }
    Ok(all)
}

fn views<'a, T: Copy>(
    q: &'a [T],
    lq: &Layout,
    k: &'a [T],
    lk: &Layout,
    v: &'a [T],
    lv: &Layout,
) -> Result<(View4<'a, T>, View4<'a, T>, View4<'a, T>)> {
    Ok((
        View4::new(q, lq, "q")?,
        View4::new(k, lk, "k")?,
        View4::new(v, lv, "v")?,
    ))
}

impl Attention {
    fn same(&self) -> Attention {
        Attention {
            causal: self.causal,
            scale: self.scale,
            window: self.window,
            softcap: self.softcap,
            bias: self.bias.clone(),
        }
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "weft-attention"
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
        let g = attn_geom(l1, l2, l3)?;
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let (q, k, v) = views(q, l1, k, l2, v, l3)?;
                CpuStorage::F32(attn_fwd(
                    self,
                    (&q, &k, &v),
                    &g,
                    f32::MIN,
                    bias_of::<f32>(&self.bias, &g)?,
                )?)
            }
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => {
                let (q, k, v) = views(q, l1, k, l2, v, l3)?;
                CpuStorage::F64(attn_fwd(
                    self,
                    (&q, &k, &v),
                    &g,
                    f64::MIN,
                    bias_of::<f64>(&self.bias, &g)?,
                )?)
            }
            _ => candle_core::bail!("attention: q, k, v must share one float dtype"),
        };
        Ok((out, Shape::from(vec![g.b, g.nq, g.sq, g.dv])))
    }
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let bwd = AttentionBwd {
            op: self.same(),
            go: grad.contiguous()?,
        };
        let all = q.apply_op3_no_bwd(k, v, &bwd)?;
        let (nq, nk, nv) = (q.elem_count(), k.elem_count(), v.elem_count());
        let dq = all.narrow(0, 0, nq)?.reshape(q.dims())?;
        let dk = all.narrow(0, nq, nk)?.reshape(k.dims())?;
        let dv = all.narrow(0, nq + nk, nv)?.reshape(v.dims())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

struct AttentionBwd {
    op: Attention,
    go: Tensor,
}

impl CustomOp3 for AttentionBwd {
    fn name(&self) -> &'static str {
        "weft-attention-bwd"
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
        let g = attn_geom(l1, l2, l3)?;
        let (gs, gl) = self.go.storage_and_layout();
        let candle_core::Storage::Cpu(gs) = &*gs else {
            candle_core::bail!("attention-bwd: not a CPU tensor")
        };
        let out = match (s1, s2, s3, gs) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v), CpuStorage::F32(go)) => {
                let (q, k, v) = views(q, l1, k, l2, v, l3)?;
                let bias = bias_of::<f32>(&self.op.bias, &g)?;
                CpuStorage::F32(attn_bwd(
                    &self.op,
                    (&q, &k, &v),
                    contiguous(go, gl, "attention-bwd")?,
                    &g,
                    f32::MIN,
                    bias,
                )?)
            }
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v), CpuStorage::F64(go)) => {
                let (q, k, v) = views(q, l1, k, l2, v, l3)?;
                let bias = bias_of::<f64>(&self.op.bias, &g)?;
                CpuStorage::F64(attn_bwd(
                    &self.op,
                    (&q, &k, &v),
                    contiguous(go, gl, "attention-bwd")?,
                    &g,
                    f64::MIN,
                    bias,
                )?)
            }
            _ => candle_core::bail!("attention-bwd: operands must share one float dtype"),
        };
        let n = g.b * g.nq * g.sq * g.d + g.b * g.nkv * g.sk * (g.d + g.dv);
        Ok((out, Shape::from(n)))
    }
}

// ---- rms_norm ----

/// `w * (x / sqrt(mean(x^2, last) + eps))` over the last dim, one row at a time.
pub(crate) struct RmsNorm {
    pub eps: f64,
}

fn rms_fwd<T: Fl>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let h = w.len();
    let (inv_h, eps) = (T::of(1.0 / h as f64), T::of(eps));
    rows(x, h, |_, r, o| {
        let ms = r.iter().fold(T::zero(), |s, &v| s.add(v.mul(v))).mul(inv_h);
        let inv = T::one().div(ms.add(eps).sqrt());
        for ((o, &v), &wv) in o.iter_mut().zip(r).zip(w) {
            *o = wv.mul(v.mul(inv));
        }
    })
}

/// `[dx | dw]` of `rms_norm` for the output gradient `g`.
fn rms_bwd<T: Fl>(x: &[T], w: &[T], g: &[T], eps: f64) -> Vec<T> {
    let h = w.len();
    let (inv_h, eps) = (T::of(1.0 / h as f64), T::of(eps));
    let mut out = vec![T::zero(); x.len() + h];
    let (dx, dw) = out.split_at_mut(x.len());
    // Fixed chunks of rows (not per thread), so dw's summation order is deterministic.
    const CH: usize = 64;
    let partial: Vec<Vec<T>> = dx
        .par_chunks_mut((CH * h).max(1))
        .enumerate()
        .map(|(c, dxc)| {
            let mut dwp = vec![T::zero(); h];
            for (rr, dxr) in dxc.chunks_mut(h.max(1)).enumerate() {
                let row = c * CH + rr;
                let (xr, gr) = (&x[row * h..(row + 1) * h], &g[row * h..(row + 1) * h]);
                let ms = xr
                    .iter()
                    .fold(T::zero(), |s, &v| s.add(v.mul(v)))
                    .mul(inv_h);
                let inv = T::one().div(ms.add(eps).sqrt());
                let dot = xr
                    .iter()
                    .zip(gr)
                    .zip(w)
                    .fold(T::zero(), |s, ((&xv, &gv), &wv)| s.add(gv.mul(wv).mul(xv)));
                let k = inv.mul(inv).mul(inv).mul(dot).mul(inv_h);
                for j in 0..h {
                    dxr[j] = inv.mul(gr[j].mul(w[j])).sub(xr[j].mul(k));
                    dwp[j] = dwp[j].add(gr[j].mul(xr[j]).mul(inv));
                }
            }
            dwp
        })
        .collect();
    for p in partial {
        for (d, v) in dw.iter_mut().zip(p) {
            *d = d.add(v);
        }
    }
    out
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "weft-rms-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l2.dims() != [last_dim(l1)] {
            candle_core::bail!(
                "rms_norm: weight {:?} does not fit x {:?}",
                l2.dims(),
                l1.dims()
            );
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => CpuStorage::F32(rms_fwd(
                contiguous(x, l1, "rms_norm")?,
                contiguous(w, l2, "rms_norm")?,
                self.eps,
            )),
            (CpuStorage::F64(x), CpuStorage::F64(w)) => CpuStorage::F64(rms_fwd(
                contiguous(x, l1, "rms_norm")?,
                contiguous(w, l2, "rms_norm")?,
                self.eps,
            )),
            _ => candle_core::bail!("rms_norm: x and w must share one float dtype"),
        };
        Ok((out, l1.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let all = x.contiguous()?.apply_op3_no_bwd(
            &w.contiguous()?,
            &g.contiguous()?,
            &RmsNormBwd { eps: self.eps },
        )?;
        let n = x.elem_count();
        Ok((
            Some(all.narrow(0, 0, n)?.reshape(x.dims())?),
            Some(all.narrow(0, n, w.elem_count())?),
        ))
    }
}

struct RmsNormBwd {
    eps: f64,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "weft-rms-norm-bwd"
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
        let n = l1.shape().elem_count() + l2.shape().elem_count();
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(g)) => {
                CpuStorage::F32(rms_bwd(
                    contiguous(x, l1, "rms_norm-bwd")?,
                    contiguous(w, l2, "rms_norm-bwd")?,
                    contiguous(g, l3, "rms_norm-bwd")?,
                    self.eps,
                ))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(g)) => {
                CpuStorage::F64(rms_bwd(
                    contiguous(x, l1, "rms_norm-bwd")?,
                    contiguous(w, l2, "rms_norm-bwd")?,
                    contiguous(g, l3, "rms_norm-bwd")?,
                    self.eps,
                ))
            }
            _ => candle_core::bail!("rms_norm-bwd: operands must share one float dtype"),
        };
        Ok((out, Shape::from(n)))
    }
}

// ---- rope ----

/// `x*cos + rotate_half(x)*sin` on the first `r` features of `x [B, N, S, D]` (any
/// strides), `cos`/`sin [B|1, S, r]` contiguous; the other features pass through. Only
/// `x` is differentiated (the tables come from integer positions).
pub(crate) struct Rope {
    /// The backward: `dx = g*cos + rotate_half^T(g*sin)`.
    pub transpose: bool,
}

fn rope_rows<T: Fl>(
    x: &View4<T>,
    dims: [usize; 4],
    cos: &[T],
    sin: &[T],
    bc: usize,
    r: usize,
    transpose: bool,
) -> Vec<T> {
    let [b, n, s, d] = dims;
    let h = r / 2;
    let mut out = vec![T::zero(); b * n * s * d];
    if out.is_empty() {
        return out;
    }
    let f = |row: usize, o: &mut [T]| {
        let (bi, ni, si) = (row / (n * s), (row / s) % n, row % s);
        let (xa, _, cs) = x.mat(bi, ni, si);
        let xv = |j: usize| xa[j * cs];
        let t = ((if bc == 1 { 0 } else { bi }) * s + si) * r;
        let (c, sn) = (&cos[t..t + r], &sin[t..t + r]);
        for j in 0..d {
            o[j] = if j >= r {
                xv(j)
            } else if !transpose {
                let rot = if j < h {
                    T::zero().sub(xv(j + h))
                } else {
                    xv(j - h)
                };
                xv(j).mul(c[j]).add(rot.mul(sn[j]))
            } else if j < h {
                xv(j).mul(c[j]).add(xv(j + h).mul(sn[j + h]))
            } else {
                xv(j).mul(c[j]).sub(xv(j - h).mul(sn[j - h]))
            };
        }
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(d).enumerate().for_each(|(i, o)| f(i, o));
    } else {
        out.chunks_mut(d).enumerate().for_each(|(i, o)| f(i, o));
    }
    out
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "weft-rope"
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
        let xd = l1.dims();
        let cd = l2.dims();
        if xd.len() != 4
            || cd.len() != 3
            || l3.dims() != cd
            || cd[1] != xd[2]
            || cd[2] > xd[3]
            || !cd[2].is_multiple_of(2)
            || !(cd[0] == 1 || cd[0] == xd[0])
        {
            candle_core::bail!("rope: x {xd:?} and cos/sin {cd:?} do not fit");
        }
        let dims = [xd[0], xd[1], xd[2], xd[3]];
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(c), CpuStorage::F32(s)) => {
                CpuStorage::F32(rope_rows(
                    &View4::new(x, l1, "x")?,
                    dims,
                    contiguous(c, l2, "rope")?,
                    contiguous(s, l3, "rope")?,
                    cd[0],
                    cd[2],
                    self.transpose,
                ))
            }
            (CpuStorage::F64(x), CpuStorage::F64(c), CpuStorage::F64(s)) => {
                CpuStorage::F64(rope_rows(
                    &View4::new(x, l1, "x")?,
                    dims,
                    contiguous(c, l2, "rope")?,
                    contiguous(s, l3, "rope")?,
                    cd[0],
                    cd[2],
                    self.transpose,
                ))
            }
            _ => candle_core::bail!("rope: operands must share one float dtype"),
        };
        Ok((out, Shape::from(xd.to_vec())))
    }
    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = g.apply_op3_no_bwd(
            cos,
            sin,
            &Rope {
                transpose: !self.transpose,
            },
        )?;
        Ok((Some(dx), None, None))
    }
}

//! One function per op (collectives aside, see `rank.rs`), written with candle tensor
//! ops that candle can differentiate. Integer work that decides *where* values go
//! (topk order, expert dispatch) is computed on untracked integers; the float values
//! then move with `gather`/`index_select`/`index_add`, so gradients follow them.
//!
//! Every function returns its results in the storage dtypes of `host.rs`: floats in
//! the compute dtype, integers as i64, bools as u8.

use super::fused;
use super::host::{kind, kind_of, values_f64, values_i64, Kind};
use candle_core::{DType as C, Device, Tensor, D};
use weft_ir::attrs::{rope_inv_freq, CmpOp, Reduction};
use weft_ir::shape::norm_dim;
use weft_ir::{Bindings, DType, Dim, HeadLayout, Op};

/// Why an op failed, as a message; the caller names the node and rank.
#[derive(Debug)]
pub(crate) struct KernelError(pub String);

impl From<candle_core::Error> for KernelError {
    fn from(e: candle_core::Error) -> Self {
        KernelError(e.to_string())
    }
}
impl From<String> for KernelError {
    fn from(e: String) -> Self {
        KernelError(e)
    }
}

pub(crate) type KResult<T> = Result<T, KernelError>;

macro_rules! bail {
    ($($t:tt)*) => { return Err(KernelError(format!($($t)*))) };
}

/// What an op needs besides its operands.
pub(crate) struct Cx<'a> {
    pub bindings: &'a Bindings,
    /// The compute dtype of floats.
    pub float: C,
    /// The node's result types, evaluated: graph dtype and concrete shape.
    pub out: &'a [(DType, Vec<usize>)],
}

impl Cx<'_> {
    pub(crate) fn eval(&self, d: &Dim, what: &str) -> KResult<i64> {
        d.eval(self.bindings)
            .map_err(|e| KernelError(format!("cannot evaluate {what} `{d}`: {e}")))
    }
    fn out_shape(&self, i: usize) -> &[usize] {
        &self.out[i].1
    }
    fn out_storage(&self, i: usize) -> C {
        match kind(self.out[i].0) {
            Kind::Float => self.float,
            Kind::Int => C::I64,
            Kind::Bool => C::U8,
        }
    }
}

const DEV: &Device = &Device::Cpu;

fn nd(dim: i64, rank: usize) -> KResult<usize> {
    norm_dim(dim, rank).map_err(KernelError)
}

/// A tensor of `shape` filled with `value`, in storage dtype `dt`.
pub(crate) fn full(value: f64, shape: &[usize], dt: C) -> KResult<Tensor> {
    Ok(match dt {
        C::F32 => Tensor::full(value as f32, shape, DEV)?,
        C::F64 => Tensor::full(value, shape, DEV)?,
        C::I64 => Tensor::full(value as i64, shape, DEV)?,
        C::U8 => Tensor::full((value != 0.0) as u8, shape, DEV)?,
        other => bail!("internal: no fill for {other:?}"),
    })
}

/// A 0-d tensor holding `value` in `dt`, for broadcasting against.
fn scalar(value: f64, dt: C) -> KResult<Tensor> {
    full(value, &[], dt)
}

fn want_float(t: &Tensor, what: &str) -> KResult<()> {
    if kind_of(t.dtype()) != Kind::Float {
        bail!("{what} must be a float tensor, got {:?}", t.dtype());
    }
    Ok(())
}

/// Makes a tensor usable by candle's matmul: its last two dims row- or column-major
/// and its batch dims packed (anything else is copied).
fn mm_ready(t: Tensor) -> KResult<Tensor> {
    let r = t.rank();
    if t.is_contiguous() || t.transpose(r - 2, r - 1)?.is_contiguous() {
        Ok(t)
    } else {
        Ok(t.contiguous()?)
    }
}

/// Matmul of `a [.., m, k]` and `b [.., k, n]` with numpy broadcasting of the batch dims.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> KResult<Tensor> {
    let (ra, rb) = (a.rank(), b.rank());
    if a.dtype() == C::F32 && b.dtype() == C::F32 && ra >= 2 && rb >= 2 {
        // any strides and broadcast batch dims, no copies
        return Ok(super::sgemm::matmul(a, b)?);
    }
    let (m, k) = (a.dims()[ra - 2], a.dims()[ra - 1]);
    let n = b.dims()[rb - 1];
    if b.dims()[rb - 2] != k {
        bail!("contracted dims differ: {:?} @ {:?}", a.dims(), b.dims());
    }
    let (ba, bb) = (&a.dims()[..ra - 2], &b.dims()[..rb - 2]);
    // `b` without real batch dims: fold a's batch into its rows (one big gemm).
    if bb.iter().all(|&d| d == 1) && bb.len() <= ba.len() {
        let rows: usize = ba.iter().product::<usize>() * m;
        let a2 = a.reshape((rows, k))?;
        let b2 = mm_ready(b.reshape((k, n))?)?;
        let mut shape = ba.to_vec();
        shape.extend([m, n]);
        return Ok(a2.matmul(&b2)?.reshape(shape)?);
    }
    let batch = weft_ir::shape::broadcast_shapes(
        &ba.iter().map(|&d| Dim::from(d)).collect::<Vec<_>>(),
        &bb.iter().map(|&d| Dim::from(d)).collect::<Vec<_>>(),
    )
    .map_err(KernelError)?;
    let batch: Vec<usize> = batch
        .iter()
        .map(|d| d.as_const().unwrap_or(0) as usize)
        .collect();
    let fit = |t: &Tensor, rows: usize, cols: usize| -> KResult<Tensor> {
        let mut s = batch.clone();
        s.extend([rows, cols]);
        if t.dims() == s.as_slice() {
            mm_ready(t.clone())
        } else {
            Ok(t.broadcast_as(s)?.contiguous()?)
        }
    };
    let a2 = fit(a, m, k)?;
    let b2 = fit(b, k, n)?;
    Ok(a2.matmul(&b2)?)
}

/// Applies a last-dim row op along `dim` (moved last and back when it is not last).
fn along(
    x: &Tensor,
    dim: usize,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> KResult<Tensor> {
    let last = x.rank() - 1;
    if dim == last {
        return Ok(f(&x.contiguous()?)?);
    }
    let t = x.transpose(dim, last)?.contiguous()?;
    Ok(f(&t)?.transpose(dim, last)?)
}

/// Softmax along `dim` (fused, with its own backward).
pub(crate) fn softmax(x: &Tensor, dim: usize) -> KResult<Tensor> {
    along(x, dim, |t| t.apply_op1(fused::Softmax))
}

pub(crate) fn log_softmax(x: &Tensor, dim: usize) -> KResult<Tensor> {
    along(x, dim, |t| t.apply_op1(fused::LogSoftmax))
}

/// `cond ? a : b` with numpy broadcasting of all three.
fn select(cond: &Tensor, a: &Tensor, b: &Tensor, shape: &[usize]) -> KResult<Tensor> {
    let c = cond.broadcast_as(shape)?;
    let a = a.broadcast_as(shape)?;
    let b = b.broadcast_as(shape)?;
    Ok(c.where_cond(&a, &b)?)
}

fn cast(x: &Tensor, to: DType, float: C) -> KResult<Tensor> {
    let from = kind_of(x.dtype());
    Ok(match (from, kind(to)) {
        (Kind::Float, Kind::Float) | (Kind::Int, Kind::Int) | (Kind::Bool, Kind::Bool) => x.clone(),
        (_, Kind::Float) => x.to_dtype(float)?,
        (Kind::Float, Kind::Int) => x.to_dtype(C::I64)?,
        (Kind::Bool, Kind::Int) => x.to_dtype(C::I64)?,
        (_, Kind::Bool) => x.broadcast_ne(&scalar(0.0, x.dtype())?)?,
    })
}

/// Evaluates one non-collective, non-source op.
pub(crate) fn eval(op: &Op, ins: &[Tensor], cx: &Cx) -> KResult<Vec<Tensor>> {
    if op.head_layout() == Some(HeadLayout::Bshd) {
        return super::head_layout::eval_bshd(op, ins, cx);
    }
    let one = |t: Tensor| Ok(vec![t]);
    let x = || ins[0].clone();
    match op {
        Op::Param { .. } | Op::Input { .. } => bail!("internal: sources are bound by the rank"),
        Op::AllToAll { .. }
        | Op::AllToAllV { .. }
        | Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::Broadcast { .. }
        | Op::RingShift { .. } => {
            bail!("internal: collectives run in the rank")
        }
        Op::Full { value, .. } => one(full(value.0, cx.out_shape(0), cx.out_storage(0))?),
        Op::Arange { start, .. } => {
            let s = cx.eval(start, "start")?;
            let n = cx.out_shape(0)[0] as i64;
            let Some(end) = s.checked_add(n) else {
                bail!("start {s} + {n} positions is past the largest i64")
            };
            let t = Tensor::arange(s, end, DEV)?;
            one(match cx.out_storage(0) {
                C::I64 => t,
                dt => t.to_dtype(dt)?,
            })
        }
        Op::Neg {} => one(x().neg()?),
        Op::Exp {} => one(x().exp()?),
        Op::Log {} => one(x().log()?),
        Op::Sqrt {} => one(x().sqrt()?),
        Op::Rsqrt {} => one(x().sqrt()?.recip()?),
        Op::Tanh {} => one(x().tanh()?),
        Op::Sigmoid {} => one((x().neg()?.exp()? + 1.0)?.recip()?),
        Op::Silu {} => one(x().silu()?),
        // Composed from tanh / erf rather than candle's `gelu`/`gelu_erf`, whose autograd
        // uses constants rounded to 6 digits (a 3e-7 relative gradient error).
        Op::Gelu { tanh_approx } => {
            let x = x();
            let half_one_plus = |t: Tensor| t.affine(0.5, 0.5);
            one(if *tanh_approx {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                let u = (&x * x.sqr()?.affine(0.044715, 1.0)?)?.affine(c, 0.0)?;
                (&x * half_one_plus(u.tanh()?)?)?
            } else {
                let e = x.affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?.erf()?;
                (&x * half_one_plus(e)?)?
            })
        }
        Op::Relu {} => one(x().relu()?),
        Op::Scale { factor } => one(x().affine(factor.0, 0.0)?),
        Op::AddScalar { value } => one(x().affine(1.0, value.0)?),
        Op::PowScalar { exponent } => {
            let e = exponent.0;
            one(if e == 1.0 {
                x()
            } else if e == 2.0 {
                x().sqr()?
            } else if e == 0.5 {
                x().sqrt()?
            } else if e == -1.0 {
                x().recip()?
            } else {
                x().powf(e)?
            })
        }
        Op::Add {} => one(ins[0].broadcast_add(&ins[1])?),
        Op::Sub {} => one(ins[0].broadcast_sub(&ins[1])?),
        Op::Mul {} => one(ins[0].broadcast_mul(&ins[1])?),
        Op::Div {} => one(ins[0].broadcast_div(&ins[1])?),
        Op::Pow {} => one(ins[0].log()?.broadcast_mul(&ins[1])?.exp()?),
        Op::Maximum {} => one(ins[0].broadcast_maximum(&ins[1])?),
        Op::Minimum {} => one(ins[0].broadcast_minimum(&ins[1])?),
        Op::Compare { op } => {
            let (a, b) = (&ins[0], &ins[1]);
            one(match op {
                CmpOp::Eq => a.broadcast_eq(b)?,
                CmpOp::Ne => a.broadcast_ne(b)?,
                CmpOp::Lt => a.broadcast_lt(b)?,
                CmpOp::Le => a.broadcast_le(b)?,
                CmpOp::Gt => a.broadcast_gt(b)?,
                CmpOp::Ge => a.broadcast_ge(b)?,
            })
        }
        Op::Where {} => one(select(&ins[0], &ins[1], &ins[2], cx.out_shape(0))?),
        Op::Cast { dtype } => one(cast(&ins[0], *dtype, cx.float)?),

        Op::Sum { dims, keepdim: _ }
        | Op::Mean { dims, keepdim: _ }
        | Op::Max { dims, keepdim: _ } => {
            let x = x();
            let mut ds: Vec<usize> = dims
                .iter()
                .map(|&d| nd(d, x.rank()))
                .collect::<KResult<_>>()?;
            if ds.is_empty() {
                return one(x);
            }
            ds.sort_unstable();
            let r = match op {
                Op::Sum { .. } => x.sum_keepdim(ds.clone())?,
                Op::Mean { .. } => {
                    want_float(&x, "mean input")?;
                    let n: usize = ds.iter().map(|&d| x.dims()[d]).product();
                    (x.sum_keepdim(ds.clone())? / n as f64)?
                }
                _ => {
                    let mut t = x;
                    for &d in ds.iter().rev() {
                        t = t.max_keepdim(d)?;
                    }
                    t
                }
            };
            one(r.reshape(cx.out_shape(0))?)
        }
        Op::Softmax { dim } => {
            want_float(&ins[0], "softmax input")?;
            one(softmax(&ins[0], nd(*dim, ins[0].rank())?)?)
        }
        Op::LogSoftmax { dim } => {
            want_float(&ins[0], "log_softmax input")?;
            one(log_softmax(&ins[0], nd(*dim, ins[0].rank())?)?)
        }

        Op::Embedding { padding_idx } => {
            let (ids, w) = (&ins[0], &ins[1]);
            let flat = ids.flatten_all()?;
            let vocab = w.dims()[0] as i64;
            check_range(&flat, 0, vocab, "token id", "the embedding's rows")?;
            let rows = w.index_select(&flat, 0)?;
            // The padding row gets no gradient (HF's `padding_idx`): its tokens read a
            // detached copy of the table, so candle's autograd (the reference `check`
            // differentiates) agrees with `embedding_grad`.
            let pad = match padding_idx {
                Some(p) => Some(cx.eval(p, "padding_idx")?),
                None => None,
            };
            let rows = match pad {
                Some(p) if (0..vocab).contains(&p) => {
                    let iv = super::host::values_i64(&flat).map_err(KernelError)?;
                    if iv.contains(&p) {
                        let keep: Vec<u8> = iv.iter().map(|&t| u8::from(t != p)).collect();
                        let keep = Tensor::from_vec(keep, iv.len(), DEV)?
                            .unsqueeze(1)?
                            .broadcast_as(rows.shape())?;
                        keep.where_cond(&rows, &w.detach().index_select(&flat, 0)?)?
                    } else {
                        rows
                    }
                }
                _ => rows,
            };
            one(rows.reshape(cx.out_shape(0))?)
        }
        Op::Linear {} => {
            let (x, w) = (ins[0].contiguous()?, ins[1].contiguous()?);
            one(match ins.get(2) {
                Some(b) => x.apply_op3(&w, &b.contiguous()?, fused::LinearBias)?,
                None => x.apply_op2(&w, fused::Linear)?,
            })
        }
        Op::Matmul {
            transpose_a,
            transpose_b,
        } => {
            let (mut a, mut b) = (ins[0].clone(), ins[1].clone());
            if *transpose_a {
                a = a.transpose(a.rank() - 2, a.rank() - 1)?;
            }
            if *transpose_b {
                b = b.transpose(b.rank() - 2, b.rank() - 1)?;
            }
            one(matmul(&a, &b)?)
        }
        Op::RmsNorm { eps } => {
            let (x, w) = (ins[0].contiguous()?, ins[1].contiguous()?);
            one(x.apply_op2(&w, fused::RmsNorm { eps: eps.0 })?)
        }
        Op::RopeTable {
            theta,
            dim,
            scaling,
        } => {
            let d = *dim as usize;
            let inv = rope_inv_freq(theta.0, d, scaling, cx.float == C::F32);
            let inv = Tensor::from_vec(inv, d / 2, DEV)?.to_dtype(cx.float)?;
            let pos = ins[0].to_dtype(cx.float)?.unsqueeze(D::Minus1)?;
            let freqs = pos.broadcast_mul(&inv)?;
            let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?;
            let (cos, sin) = (emb.cos()?, emb.sin()?);
            // HF multiplies both tables by the rope's attention factor (YaRN).
            match scaling.attention_factor() {
                1.0 => Ok(vec![cos, sin]),
                a => Ok(vec![cos.affine(a, 0.0)?, sin.affine(a, 0.0)?]),
            }
        }
        Op::Rope { .. } => {
            let (x, cos, sin) = (&ins[0], &ins[1], &ins[2]);
            let (hd, r) = (x.dims()[3], cos.dims()[2]);
            if r > hd || r % 2 != 0 {
                bail!("rotary dim {r} must be even and at most the head dim {hd}");
            }
            if !cos.track_op() && !sin.track_op() {
                return one(x.apply_op3(
                    &cos.contiguous()?,
                    &sin.contiguous()?,
                    fused::Rope { transpose: false },
                )?);
            }
            // Tables that need gradients: the composed form.
            let (c, s) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
            let xr = if r < hd {
                x.narrow(3, 0, r)?
            } else {
                x.clone()
            };
            let x1 = xr.narrow(3, 0, r / 2)?;
            let x2 = xr.narrow(3, r / 2, r / 2)?;
            let rot = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
            let y = (xr.broadcast_mul(&c)? + rot.broadcast_mul(&s)?)?;
            one(if r < hd {
                Tensor::cat(&[&y, &x.narrow(3, r, hd - r)?], 3)?
            } else {
                y
            })
        }
        Op::Attention { sinks, lse, .. } => {
            let a = AttnAttrs::of(op)?;
            let slots = op
                .attention_operands(ins.len())
                .expect("an attention")
                .map_err(KernelError)?;
            let mask = slots.mask.map(|i| &ins[i]);
            if sinks.0 || lse.0 {
                let s = slots.sinks.map(|i| &ins[i]);
                let (out, lse_t, _) =
                    attention_dense(&ins[0], &ins[1], &ins[2], mask, s, a, cx.float)?;
                Ok(if lse.0 { vec![out, lse_t] } else { vec![out] })
            } else {
                one(attention(&ins[0], &ins[1], &ins[2], mask, a, cx.float)?)
            }
        }
        Op::ShiftLabels { ignore_index } => {
            let l = &ins[0];
            let last = l
                .rank()
                .checked_sub(1)
                .ok_or_else(|| KernelError("labels must have a dim".into()))?;
            let n = l.dims()[last];
            if n == 0 {
                return one(l.clone());
            }
            let mut pad = l.dims().to_vec();
            pad[last] = 1;
            let fill = full(*ignore_index as f64, &pad, C::I64)?;
            one(Tensor::cat(&[&l.narrow(last, 1, n - 1)?, &fill], last)?)
        }
        Op::CountValid { ignore_index } => {
            let valid = ins[0].broadcast_ne(&scalar(*ignore_index as f64, C::I64)?)?;
            one(valid.to_dtype(cx.float)?.sum_all()?)
        }
        Op::CrossEntropy {
            ignore_index,
            reduction,
        } => one(cross_entropy(
            &ins[0],
            &ins[1],
            *ignore_index,
            *reduction,
            cx.float,
        )?),

        Op::LinearCrossEntropy { .. } => super::linear_ce::forward(
            &ins[0],
            &ins[1],
            &ins[2],
            super::linear_ce::LinearCe::of(op)?,
            cx.float,
        ),
        Op::LinearCrossEntropyGrad { .. } => {
            super::linear_ce::backward(ins, super::linear_ce::LinearCe::of(op)?, cx.float)
        }
        Op::LinearCrossEntropyWithGrad { .. } => {
            super::linear_ce::with_grad(ins, super::linear_ce::LinearCe::of(op)?, cx.float)
        }

        Op::Reshape { .. } => one(x().reshape(cx.out_shape(0))?),
        Op::Permute { perm } => {
            let x = x();
            let p: Vec<usize> = perm
                .iter()
                .map(|&d| nd(d, x.rank()))
                .collect::<KResult<_>>()?;
            one(x.permute(p)?)
        }
        Op::Transpose { dim0, dim1 } => {
            let x = x();
            let (a, b) = (nd(*dim0, x.rank())?, nd(*dim1, x.rank())?);
            one(x.transpose(a, b)?)
        }
        Op::Slice { dim, start, len } => {
            let x = x();
            let d = nd(*dim, x.rank())?;
            let (s, l) = (cx.eval(start, "start")?, cx.eval(len, "len")?);
            let n = x.dims()[d] as i64;
            if s < 0 || l < 0 || s + l > n {
                bail!("slice [{s}, {}) (start `{start}`, len `{len}`) is out of bounds for dim {d} of size {n}", s + l);
            }
            one(x.narrow(d, s as usize, l as usize)?)
        }
        Op::Zigzag {
            dim,
            parts,
            inverse,
        } => {
            let x = x();
            let d = nd(*dim, x.rank())?;
            let (n, k) = (x.dims()[d], 2 * (*parts).max(1) as usize);
            if n % k != 0 {
                bail!("zigzag: dim {d} of size {n} does not split into {k} equal chunks (2 per rank of {parts}); make the sequence a multiple of {k}");
            }
            let c = n / k;
            let order = weft_ir::shape::zigzag_order(*parts as usize, *inverse);
            let chunks: Vec<Tensor> = order
                .iter()
                .map(|&j| x.narrow(d, j * c, c))
                .collect::<Result<_, _>>()?;
            one(if k == 1 { x } else { Tensor::cat(&chunks, d)? })
        }
        Op::Concat { dim } => {
            let d = nd(*dim, ins[0].rank())?;
            let parts: Vec<&Tensor> = ins.iter().filter(|t| t.dims()[d] > 0).collect();
            one(match parts.len() {
                0 => ins[0].clone(),
                1 => parts[0].clone(),
                _ => Tensor::cat(&parts, d)?,
            })
        }
        Op::Split { dim, sizes } => {
            let x = x();
            let d = nd(*dim, x.rank())?;
            let mut at = 0usize;
            let mut out = Vec::with_capacity(sizes.len());
            for s in sizes {
                let l = cx.eval(s, "split size")?;
                if l < 0 || at + l as usize > x.dims()[d] {
                    bail!(
                        "split sizes {sizes:?} exceed dim {d} of size {}",
                        x.dims()[d]
                    );
                }
                out.push(x.narrow(d, at, l as usize)?);
                at += l as usize;
            }
            if at != x.dims()[d] {
                bail!("split sizes sum to {at} but dim {d} has {}", x.dims()[d]);
            }
            Ok(out)
        }
        Op::Expand { .. } => one(x().broadcast_as(cx.out_shape(0))?),
        Op::Gather { dim } => {
            let (x, idx) = (&ins[0], &ins[1]);
            let d = nd(*dim, x.rank())?;
            // torch.gather reads x only where the index has entries: cut x to the index's
            // extent in the other dims (candle's gather backward wants equal extents).
            let mut xs = x.clone();
            for (i, (&xd, &id)) in x.dims().iter().zip(idx.dims()).enumerate() {
                if i != d && id != xd {
                    if id > xd {
                        bail!("index {:?} exceeds x {:?} in dim {i}", idx.dims(), x.dims());
                    }
                    xs = xs.narrow(i, 0, id)?;
                }
            }
            check_range(
                idx,
                0,
                x.dims()[d] as i64,
                "gather index",
                &format!("dim {d}"),
            )?;
            // (narrowing leaves x a strided view, which candle's gather refuses)
            one(xs.contiguous()?.gather(&idx.contiguous()?, d)?)
        }
        Op::IndexSelect { dim } => {
            let (x, idx) = (&ins[0], &ins[1]);
            let d = nd(*dim, x.rank())?;
            check_range(idx, 0, x.dims()[d] as i64, "index", &format!("dim {d}"))?;
            one(x.index_select(idx, d)?)
        }
        Op::Topk { k, dim } => {
            let x = x();
            let d = nd(*dim, x.rank())?;
            let (vals, idx) = topk(&x, *k as usize, d)?;
            Ok(vec![vals, idx])
        }
        Op::OneHot { num_classes, .. } => {
            let idx = &ins[0];
            check_range(idx, 0, *num_classes, "class index", "num_classes")?;
            let classes = Tensor::arange(0i64, *num_classes, DEV)?;
            let hot = idx.unsqueeze(D::Minus1)?.broadcast_eq(&classes)?;
            one(match cx.out_storage(0) {
                C::U8 => hot,
                dt => hot.to_dtype(dt)?,
            })
        }
        Op::ScatterAdd { dim } => one(scatter_add(
            &ins[0],
            &ins[1],
            &ins[2],
            nd(*dim, ins[0].rank())?,
        )?),
        Op::MoeDispatch { num_experts } => moe_dispatch(&ins[0], &ins[1], *num_experts),
        Op::GroupedMatmul { transpose_w } => one(grouped_matmul(
            &ins[0],
            &ins[1],
            &ins[2],
            ins.get(3),
            transpose_w.0,
        )?),
        Op::MoeCombine {} => one(moe_combine(&ins[0], &ins[1], &ins[2], cx.out_shape(0))?),
        Op::RingAttention { .. } | Op::RingAttentionGrad { .. } => bail!(
            "`{}` runs only after `ring-lower` expands it into ring steps (add `ring-lower` to the pipeline)",
            op.name()
        ),
        Op::AttentionGrad { .. }
        | Op::AttentionBlockGrad { .. }
        | Op::RmsNormGrad { .. }
        | Op::CrossEntropyGrad { .. }
        | Op::EmbeddingGrad { .. }
        | Op::SiluGrad {}
        | Op::GeluGrad { .. }
        | Op::SoftmaxGrad { .. }
        | Op::GroupedMatmulGrad { .. }
        | Op::MoeCombineGrad {}
        | Op::AdamW { .. }
        | Op::HostAdamW { .. }
        | Op::AdamWMaster { .. }
        | Op::Sgd { .. }
        | Op::Offload { .. }
        | Op::Reload { .. } => super::backward_kernels::eval(op, ins, cx),
        Op::Glu { .. }
        | Op::GluGrad { .. }
        | Op::AddRmsNorm { .. }
        | Op::AddRmsNormGrad { .. }
        | Op::MatmulAdd { .. } => {
            super::fusions::eval(op, ins, cx)
        }
        Op::Fp8Matmul { .. } => super::fp8::eval(op, ins, cx),
    }
}

/// Fails unless every value of integer tensor `t` is in `[lo, hi)`.
fn check_range(t: &Tensor, lo: i64, hi: i64, what: &str, of: &str) -> KResult<()> {
    if t.elem_count() == 0 {
        return Ok(());
    }
    let v = values_i64(t)?;
    if let Some((i, bad)) = v.iter().enumerate().find(|(_, &x)| x < lo || x >= hi) {
        bail!("{what} {bad} (at flat position {i}) is out of range for {of} (valid: {lo}..{hi})");
    }
    Ok(())
}

/// The keep-mask of `attention` as u8 `[B|1, Nq|1, Sq, Sk]` (1 = kept): the bool `mask`,
/// and with `causal` the keys `j <= p` of query `i` at `p = i + Sk - Sq`, with `window`
/// only `p - window < j <= p`. `None` when nothing is masked.
pub(crate) fn attention_keep(
    mask: Option<&Tensor>,
    causal: bool,
    window: Option<usize>,
    (b, nq, sq, sk): (usize, usize, usize, usize),
) -> KResult<Option<Tensor>> {
    let mut keep: Option<Tensor> = None;
    if causal {
        let off = sk as i64 - sq as i64;
        let rows = (Tensor::arange(0i64, sq as i64, DEV)? + off as f64)?.reshape((sq, 1))?;
        let cols = Tensor::arange(0i64, sk as i64, DEV)?.reshape((1, sk))?;
        let mut band = cols.broadcast_le(&rows)?;
        if let Some(w) = window {
            // j > p - w, i.e. j + w > p
            band = band.mul(&(cols + w as f64)?.broadcast_gt(&rows)?)?;
        }
        keep = Some(band.reshape((1, 1, sq, sk))?);
    }
    if let Some(m) = mask {
        let md = m.dims();
        if md.len() != 4
            || md[2] != sq
            || md[3] != sk
            || !(md[0] == 1 || md[0] == b)
            || !(md[1] == 1 || md[1] == nq)
        {
            bail!("mask {md:?} must be [B|1, heads|1, {sq}, {sk}]");
        }
        let m = m.to_dtype(C::U8)?;
        keep = Some(match keep {
            Some(c) => m.broadcast_mul(&c)?,
            None => m,
        });
    }
    Ok(keep)
}

/// The additive bias of a keep-mask: 0 where kept, the compute dtype's most negative
/// value elsewhere (so a row with nothing kept is uniform, not NaN).
pub(crate) fn keep_to_bias(keep: &Tensor, float: C) -> KResult<Tensor> {
    let min = if float == C::F64 {
        f64::MIN
    } else {
        f32::MIN as f64
    };
    Ok(keep.to_dtype(float)?.affine(-min, min)?.contiguous()?)
}

/// The attributes of one `attention` the CPU kernels read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnAttrs {
    pub causal: bool,
    pub scale: f64,
    pub window: Option<usize>,
    pub softcap: Option<f64>,
}

impl AttnAttrs {
    pub(crate) fn of(op: &Op) -> KResult<AttnAttrs> {
        match op {
            Op::Attention {
                causal,
                scale,
                window,
                softcap,
                ..
            }
            | Op::AttentionGrad {
                causal,
                scale,
                window,
                softcap,
                ..
            } => Ok(AttnAttrs {
                causal: *causal,
                scale: scale.0,
                window: match window {
                    None => None,
                    Some(w) if *w >= 1 => Some(*w as usize),
                    Some(w) => bail!("window must be at least 1, got {w}"),
                },
                softcap: softcap.map(|c| c.0),
            }),
            other => bail!("internal: `{}` is not an attention", other.name()),
        }
    }
}

/// Scaled dot-product attention as HF's eager path computes it (see [`fused::Attention`]):
/// the keep-mask, causal band and window become one additive bias of the dtype's most
/// negative value, so fully masked rows come out uniform rather than NaN. Causal with
/// `Sq != Sk` aligns the queries with the last `Sq` keys (query `i` sees keys
/// `j <= i + Sk - Sq`), as flash-attention and HF's KV cache do. Without a mask the
/// fused kernel applies the band itself and visits only the keys inside it.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    a: AttnAttrs,
    float: C,
) -> KResult<Tensor> {
    let (b, nq, sq, hd) = q.dims4()?;
    let (bk, nkv, sk, hdk) = k.dims4()?;
    let (bv, nv, sv, _) = v.dims4()?;
    if (bv, nv, sv) != (bk, nkv, sk) || bk != b || hdk != hd {
        bail!(
            "q {:?}, k {:?}, v {:?} do not fit together",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if nkv == 0 || nq % nkv != 0 {
        bail!("q heads ({nq}) must be a multiple of kv heads ({nkv})");
    }
    let bias = match mask {
        None => None,
        Some(_) => attention_keep(mask, a.causal, a.window, (b, nq, sq, sk))?
            .map(|keep| keep_to_bias(&keep, float))
            .transpose()?
            .map(|t| t.detach()),
    };
    let folded = bias.is_some();
    let op = fused::Attention {
        causal: a.causal && !folded,
        scale: a.scale,
        window: if folded { None } else { a.window },
        softcap: a.softcap,
        bias,
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// Attention with sinks or a log-sum-exp result, composed of candle ops (their autograd
/// is the backward): the scores `[B, Nq, Sq, Sk]` are materialized, soft-capped, masked,
/// joined by the sink column, and `lse` is taken before the softmax. Returns out and
/// the log-sum-exp `[B, Nq, Sq]`.
pub(crate) fn attention_dense(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    sinks: Option<&Tensor>,
    a: AttnAttrs,
    float: C,
) -> KResult<(Tensor, Tensor, Tensor)> {
    let (b, nq, sq, hd) = q.dims4()?;
    let (bk, nkv, sk, hdk) = k.dims4()?;
    let (bv, nv, sv, dv) = v.dims4()?;
    if (bv, nv, sv) != (bk, nkv, sk) || bk != b || hdk != hd || nkv == 0 || nq % nkv != 0 {
        bail!(
            "q {:?}, k {:?}, v {:?} do not fit together",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let rep = nq / nkv;
    let qg = q.contiguous()?.reshape((b, nkv, rep * sq, hd))?;
    let mut x = matmul(&qg, &k.transpose(2, 3)?)?
        .affine(a.scale, 0.0)?
        .reshape((b, nq, sq, sk))?;
    if let Some(c) = a.softcap {
        x = (x.affine(1.0 / c, 0.0)?.tanh()? * c)?;
    }
    if let Some(keep) = attention_keep(mask, a.causal, a.window, (b, nq, sq, sk))? {
        x = x.broadcast_add(&keep_to_bias(&keep, float)?.detach())?;
    }
    if let Some(s) = sinks {
        if s.dims() != [nq] {
            bail!("sinks {:?} must be [{nq}]", s.dims());
        }
        let col = s
            .to_dtype(float)?
            .reshape((1, nq, 1, 1))?
            .broadcast_as((b, nq, sq, 1))?;
        x = Tensor::cat(&[&x, &col], 3)?;
    }
    let m = x.max_keepdim(3)?.detach();
    let lse = (x.broadcast_sub(&m)?.exp()?.sum_keepdim(3)?.log()? + &m)?;
    let p = x.broadcast_sub(&lse)?.exp()?.narrow(3, 0, sk)?;
    let out =
        matmul(&p.reshape((b, nkv, rep * sq, sk))?, &v.contiguous()?)?.reshape((b, nq, sq, dv))?;
    Ok((out, lse.squeeze(3)?, p))
}

/// Token cross-entropy in the compute dtype: `-log_softmax(logits)[label]`, 0 where the
/// label is `ignore_index`; `mean` divides by the number of valid labels (NaN if none,
/// as torch).
fn cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    ignore: i64,
    reduction: Reduction,
    float: C,
) -> KResult<Tensor> {
    if logits.rank() != labels.rank() + 1 || logits.dims()[..labels.rank()] != *labels.dims() {
        bail!(
            "logits {:?} must be labels {:?} plus a class dim",
            logits.dims(),
            labels.dims()
        );
    }
    let v = *logits.dims().last().unwrap_or(&0);
    let lab = labels.flatten_all()?;
    let lv = values_i64(&lab)?;
    if let Some((i, bad)) = lv
        .iter()
        .enumerate()
        .find(|(_, &l)| l != ignore && (l < 0 || l >= v as i64))
    {
        bail!("label {bad} (at flat position {i}) is out of range for {v} classes and is not ignore_index {ignore}");
    }
    let loss = logits
        .contiguous()?
        .apply_op2(&labels.contiguous()?, fused::CrossEntropyRows { ignore })?;
    Ok(match reduction {
        Reduction::None => loss,
        Reduction::Sum => loss.sum_all()?,
        Reduction::Mean => {
            let valid = lab.broadcast_ne(&scalar(ignore as f64, C::I64)?)?;
            let count = valid.to_dtype(float)?.sum_all()?;
            loss.sum_all()?.div(&count)?
        }
    })
}

/// Largest `k` along `d`, sorted descending, ties to the lower index (torch on CPU);
/// NaN counts as the largest. The order is found on untracked values, the values are
/// then gathered so their gradient flows.
fn topk(x: &Tensor, k: usize, d: usize) -> KResult<(Tensor, Tensor)> {
    let last = x.rank() - 1;
    let n = x.dims()[d];
    if k > n {
        bail!("k = {k} exceeds the dim's size {n}");
    }
    let xt = x.detach().transpose(d, last)?.contiguous()?;
    let vals = values_f64(&xt)?;
    let rows = vals.len().checked_div(n).unwrap_or(0);
    let mut idx: Vec<i64> = Vec::with_capacity(rows * k);
    let mut order: Vec<usize> = (0..n).collect();
    for r in 0..rows {
        let row = &vals[r * n..(r + 1) * n];
        order.clear();
        order.extend(0..n);
        order.sort_by(|&a, &b| {
            let (va, vb) = (row[a], row[b]);
            match (va.is_nan(), vb.is_nan()) {
                (true, true) => std::cmp::Ordering::Equal,
                (true, false) => std::cmp::Ordering::Less,
                (false, true) => std::cmp::Ordering::Greater,
                _ => vb.partial_cmp(&va).unwrap_or(std::cmp::Ordering::Equal),
            }
            .then(a.cmp(&b))
        });
        idx.extend(order[..k].iter().map(|&i| i as i64));
    }
    let mut tshape = xt.dims().to_vec();
    tshape[last] = k;
    let idx = Tensor::from_vec(idx, tshape, DEV)?
        .transpose(d, last)?
        .contiguous()?;
    let values = x.gather(&idx, d)?;
    Ok((values, idx))
}

/// `dst` plus `src` added at `index` along `d` (torch.scatter_add). Done as an
/// `index_add` on the flattened `dst` at flat positions found on the host: candle's own
/// scatter_add backward masks `dst`'s gradient and fails when `src` is shorter than
/// `dst` along `d`; index_add's backward is right (identity for `dst`, index_select
/// for `src`).
fn scatter_add(dst: &Tensor, index: &Tensor, src: &Tensor, d: usize) -> KResult<Tensor> {
    if index.dims() != src.dims() || index.rank() != dst.rank() {
        bail!(
            "index {:?} and src {:?} must match and have the rank of dst {:?}",
            index.dims(),
            src.dims(),
            dst.dims()
        );
    }
    for (i, (&s, &t)) in src.dims().iter().zip(dst.dims()).enumerate() {
        if i != d && s > t {
            bail!(
                "src {:?} exceeds dst {:?} in dim {i}",
                src.dims(),
                dst.dims()
            );
        }
    }
    check_range(
        index,
        0,
        dst.dims()[d] as i64,
        "scatter index",
        &format!("dim {d} of dst"),
    )?;
    let idx = values_i64(index)?;
    let (sd, dd) = (src.dims(), dst.dims());
    let rank = sd.len();
    let mut dstride = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        dstride[i] = dstride[i + 1] * dd[i + 1];
    }
    let mut pos = Vec::with_capacity(idx.len());
    let mut mi = vec![0usize; rank];
    for &v in &idx {
        let mut flat = 0usize;
        for i in 0..rank {
            let c = if i == d { v as usize } else { mi[i] };
            flat += c * dstride[i];
        }
        pos.push(flat as i64);
        // next multi-index of src, row-major
        for i in (0..rank).rev() {
            mi[i] += 1;
            if mi[i] < sd[i] {
                break;
            }
            mi[i] = 0;
        }
    }
    let n = pos.len();
    let out =
        dst.flatten_all()?
            .index_add(&Tensor::from_vec(pos, n, DEV)?, &src.flatten_all()?, 0)?;
    Ok(out.reshape(dd)?)
}

/// `moe_dispatch`: each token row once per selected expert, stable-sorted by expert.
fn moe_dispatch(x: &Tensor, expert_index: &Tensor, num_experts: i64) -> KResult<Vec<Tensor>> {
    let (t, k) = expert_index.dims2()?;
    if x.dims()[0] != t {
        bail!(
            "x {:?} and expert_index {:?} differ in tokens",
            x.dims(),
            expert_index.dims()
        );
    }
    let e = values_i64(expert_index)?;
    if let Some((i, bad)) = e
        .iter()
        .enumerate()
        .find(|(_, &v)| v < 0 || v >= num_experts)
    {
        bail!(
            "expert index {bad} (at flat position {i}) is out of range for {num_experts} experts"
        );
    }
    let mut counts = vec![0i64; num_experts as usize];
    for &v in &e {
        counts[v as usize] += 1;
    }
    // Counting sort: stable, so rows of one expert keep token-major order.
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0usize, |acc, &c| {
            let s = *acc;
            *acc += c as usize;
            Some(s)
        })
        .collect();
    let mut order = vec![0i64; e.len()];
    for (f, &v) in e.iter().enumerate() {
        order[next[v as usize]] = f as i64;
        next[v as usize] += 1;
    }
    let token: Vec<i64> = order.iter().map(|&f| f / k.max(1) as i64).collect();
    let rows = x.index_select(&Tensor::from_vec(token, e.len(), DEV)?, 0)?;
    Ok(vec![
        rows,
        Tensor::from_vec(counts, num_experts as usize, DEV)?,
        Tensor::from_vec(order, e.len(), DEV)?,
    ])
}

/// `grouped_matmul`: rows of group `e` (consecutive, `counts[e]` of them) times `w[e]^T`.
fn grouped_matmul(
    x: &Tensor,
    w: &Tensor,
    counts: &Tensor,
    bias: Option<&Tensor>,
    transpose_w: bool,
) -> KResult<Tensor> {
    let (m, kx) = x.dims2()?;
    let (e, n, kw) = w.dims3()?;
    let (n, kw) = if transpose_w { (kw, n) } else { (n, kw) };
    if kx != kw {
        bail!(
            "x {:?} and w {:?} differ in the contracted dim",
            x.dims(),
            w.dims()
        );
    }
    // counts [E], or [G, E]: G*E groups in row-major order, group (g, e) uses w[e].
    let c = values_i64(counts)?;
    if c.len() % e.max(1) != 0
        || counts.dims().last() != Some(&e)
        || c.iter().any(|&v| v < 0)
        || c.iter().sum::<i64>() != m as i64
    {
        bail!("counts {c:?} must be {e} (or G x {e}) non-negative group sizes summing to the {m} rows");
    }
    let mut parts = Vec::new();
    let mut at = 0usize;
    for (g, &cnt) in c.iter().enumerate() {
        if cnt == 0 {
            continue;
        }
        let xs = x.narrow(0, at, cnt as usize)?;
        let we = w.get(g % e)?;
        let we = if transpose_w { we } else { we.t()? };
        let mut y = super::sgemm::matmul(&xs, &we)?;
        if let Some(b) = bias {
            y = y.broadcast_add(&b.get(g % e)?)?;
        }
        parts.push(y);
        at += cnt as usize;
    }
    Ok(match parts.len() {
        0 => Tensor::zeros((0, n), x.dtype(), DEV)?,
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(&parts, 0)?,
    })
}

/// `moe_combine`: `out[t] = sum over rows r with order[r] = t*k + slot of
/// weights[t, slot] * rows[r]` (rows missing from `order` contribute nothing).
fn moe_combine(
    rows: &Tensor,
    order: &Tensor,
    weights: &Tensor,
    out_shape: &[usize],
) -> KResult<Tensor> {
    let (t, k) = weights.dims2()?;
    let (r, h) = rows.dims2()?;
    if order.dims() != [r] {
        bail!("order {:?} must list the {r} rows", order.dims());
    }
    let o = values_i64(order)?;
    if let Some((i, bad)) = o
        .iter()
        .enumerate()
        .find(|(_, &v)| v < 0 || v >= (t * k) as i64)
    {
        bail!("order entry {bad} (row {i}) is out of range for {t} tokens x {k} slots");
    }
    let tok: Vec<i64> = o.iter().map(|&f| f / k.max(1) as i64).collect();
    let wsel = weights.flatten_all()?.index_select(order, 0)?;
    let scaled = rows.broadcast_mul(&wsel.unsqueeze(1)?)?;
    let zeros = Tensor::zeros((t, h), rows.dtype(), DEV)?;
    let out = zeros.index_add(&Tensor::from_vec(tok, r, DEV)?, &scaled, 0)?;
    if out.dims() != out_shape {
        bail!(
            "internal: combined {:?}, expected {out_shape:?}",
            out.dims()
        );
    }
    Ok(out)
}

//! `linear_cross_entropy` and its gradient on the CPU: the lm_head matmul and the
//! cross-entropy statistics fused and chunked over the vocabulary, so no [tokens, vocab]
//! logits tensor exists beyond one [tokens, chunk] block at a time (the reference for the
//! CUDA kernels, which do the same per chunk with GEMMs into a scratch buffer).
//!
//! Tensors come and go in the storage dtypes of `host.rs` (floats in the compute dtype,
//! labels as i64).

use super::host::values_i64;
use super::kernels::{matmul, KResult, KernelError};
use candle_core::{DType as C, Device, Tensor};
use weft_ir::Op;

macro_rules! bail {
    ($($t:tt)*) => { return Err(KernelError(format!($($t)*))) };
}

const DEV: &Device = &Device::Cpu;

/// The attributes the three ops share.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LinearCe {
    ignore: i64,
    chunk: usize,
    scale: Option<f64>,
    softcap: Option<f64>,
}

impl LinearCe {
    pub(crate) fn of(op: &Op) -> KResult<LinearCe> {
        match op {
            Op::LinearCrossEntropy {
                ignore_index,
                chunk,
                scale,
                softcap,
            }
            | Op::LinearCrossEntropyGrad {
                ignore_index,
                chunk,
                scale,
                softcap,
            } => Ok(LinearCe {
                ignore: *ignore_index,
                chunk: usize::try_from(*chunk)
                    .ok()
                    .filter(|&c| c > 0)
                    .ok_or_else(|| KernelError(format!("chunk {chunk} must be positive")))?,
                scale: scale.map(|s| s.0),
                softcap: softcap.map(|c| c.0),
            }),
            // Chunked over the tokens on the GPU; here over the vocabulary, as the
            // unfused pair is (the math does not depend on the chunking).
            Op::LinearCrossEntropyWithGrad {
                ignore_index,
                rows,
                scale,
                softcap,
            } => {
                if *rows < 1 {
                    bail!("rows {rows} must be positive");
                }
                Ok(LinearCe {
                    ignore: *ignore_index,
                    chunk: 8192,
                    scale: scale.map(|s| s.0),
                    softcap: softcap.map(|c| c.0),
                })
            }
            other => bail!("internal: {} is not a linear_cross_entropy", other.name()),
        }
    }

    /// The chunk's logits `softcap(scale * x w_c^T)` and, with a soft-cap, `tanh` of
    /// them over the cap (the backward's derivative needs it).
    fn logits(&self, x2: &Tensor, wc: &Tensor) -> KResult<(Tensor, Option<Tensor>)> {
        let mut z = matmul(x2, &wc.t()?)?;
        if let Some(s) = self.scale {
            z = z.affine(s, 0.0)?;
        }
        Ok(match self.softcap {
            Some(cap) => {
                let t = z.affine(1.0 / cap, 0.0)?.tanh()?;
                (t.affine(cap, 0.0)?, Some(t))
            }
            None => (z, None),
        })
    }
}

/// x [.., H] as rows [N, H], labels as [N] (checked against the vocabulary `v`).
fn rows(x: &Tensor, w: &Tensor, labels: &Tensor, a: &LinearCe) -> KResult<(Tensor, Tensor, usize)> {
    let h = *x.dims().last().unwrap_or(&0);
    if w.rank() != 2 || w.dims()[1] != h {
        bail!("w {:?} must be [vocab, {h}]", w.dims());
    }
    let v = w.dims()[0];
    let lab = labels.flatten_all()?;
    let n = lab.elem_count();
    if x.elem_count() != n * h {
        bail!(
            "x {:?} must be labels {:?} plus a hidden dim",
            x.dims(),
            labels.dims()
        );
    }
    let lv = values_i64(&lab)?;
    if let Some((i, bad)) = lv
        .iter()
        .enumerate()
        .find(|(_, &l)| l != a.ignore && (l < 0 || l >= v as i64))
    {
        bail!("label {bad} (at flat position {i}) is out of range for {v} classes and is not ignore_index {}", a.ignore);
    }
    Ok((x.reshape((n, h))?.contiguous()?, lab, v))
}

/// Per chunk `[c0, c0+len)`: the [N, 1] column index of each label inside the chunk
/// (clamped) and the [N, 1] mask of the labels that fall in it and are not ignored.
fn chunk_targets(
    lab: &Tensor,
    c0: usize,
    len: usize,
    ignore: i64,
    float: C,
) -> KResult<(Tensor, Tensor)> {
    let lo = lab.ge(c0 as i64)?.to_dtype(float)?;
    let hi = lab.lt((c0 + len) as i64)?.to_dtype(float)?;
    let kept = lab.ne(ignore)?.to_dtype(float)?;
    let inside = lo.mul(&hi)?.mul(&kept)?.unsqueeze(1)?;
    let idx = lab
        .to_dtype(C::F64)?
        .affine(1.0, -(c0 as f64))?
        .clamp(0.0, (len - 1) as f64)?
        .to_dtype(C::I64)?
        .unsqueeze(1)?;
    Ok((idx, inside))
}

/// The forward: per-token log-sum-exp and target logit, each of the labels' shape.
pub(crate) fn forward(
    x: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    a: LinearCe,
    float: C,
) -> KResult<Vec<Tensor>> {
    let (x2, lab, v) = rows(x, w, labels, &a)?;
    let n = lab.elem_count();
    let shape = labels.dims().to_vec();
    if v == 0 {
        bail!("the vocabulary is empty: a cross-entropy needs at least one class");
    }
    let mut m = Tensor::full(f64::NEG_INFINITY, (n, 1), DEV)?.to_dtype(float)?;
    let mut s = Tensor::zeros((n, 1), float, DEV)?;
    let mut target = Tensor::zeros((n, 1), float, DEV)?;
    let mut c0 = 0;
    while c0 < v {
        let len = a.chunk.min(v - c0);
        let (z, _) = a.logits(&x2, &w.narrow(0, c0, len)?)?;
        let mc = z.max_keepdim(1)?;
        let m_new = m.maximum(&mc)?;
        let sc = z.broadcast_sub(&m_new)?.exp()?.sum_keepdim(1)?;
        s = s.mul(&m.sub(&m_new)?.exp()?)?.add(&sc)?;
        m = m_new;
        let (idx, inside) = chunk_targets(&lab, c0, len, a.ignore, float)?;
        target = target.add(&z.gather(&idx, 1)?.mul(&inside)?)?;
        c0 += len;
    }
    let lse = m.add(&s.log()?)?;
    Ok(vec![lse.reshape(shape.clone())?, target.reshape(shape)?])
}

/// The backward: dx [.., H] and dw [V, H], recomputing each chunk's logits.
pub(crate) fn backward(ins: &[Tensor], a: LinearCe, float: C) -> KResult<Vec<Tensor>> {
    let (x, w, labels) = (&ins[0], &ins[1], &ins[2]);
    let (x2, lab, v) = rows(x, w, labels, &a)?;
    let n = lab.elem_count();
    let col = |t: &Tensor| -> KResult<Tensor> { Ok(t.reshape((n, 1))?) };
    let (lse, dlse, dtarget) = (col(&ins[3])?, col(&ins[4])?, col(&ins[5])?);
    let mut dx = Tensor::zeros(x2.dims(), float, DEV)?;
    let mut dws = Vec::new();
    let mut c0 = 0;
    while c0 < v {
        let len = a.chunk.min(v - c0);
        let wc = w.narrow(0, c0, len)?;
        let (z, t) = a.logits(&x2, &wc)?;
        let p = z.broadcast_sub(&lse)?.exp()?;
        let classes = Tensor::arange(c0 as i64, (c0 + len) as i64, DEV)?;
        let kept = lab.ne(a.ignore)?.to_dtype(float)?.unsqueeze(1)?;
        let onehot = lab
            .unsqueeze(1)?
            .broadcast_eq(&classes.unsqueeze(0)?)?
            .to_dtype(float)?
            .broadcast_mul(&kept)?;
        let mut dz = p
            .broadcast_mul(&dlse)?
            .add(&onehot.broadcast_mul(&dtarget)?)?;
        if let Some(t) = t {
            // d(cap tanh(y / cap)) / dy = 1 - tanh^2
            dz = dz.mul(&t.sqr()?.neg()?.affine(1.0, 1.0)?)?;
        }
        if let Some(s) = a.scale {
            dz = dz.affine(s, 0.0)?;
        }
        dx = dx.add(&matmul(&dz, &wc)?)?;
        dws.push(matmul(&dz.t()?, &x2)?);
        c0 += len;
    }
    let dw = if dws.is_empty() {
        Tensor::zeros(w.dims(), float, DEV)?
    } else {
        Tensor::cat(&dws, 0)?
    };
    Ok(vec![dx.reshape(x.dims())?, dw])
}

/// `linear_cross_entropy_with_grad`: the forward's statistics, then its gradient from
/// them: operands x, w, labels, dlse, dtarget; results lse, target, dx, dw.
pub(crate) fn with_grad(ins: &[Tensor], a: LinearCe, float: C) -> KResult<Vec<Tensor>> {
    let mut stats = forward(&ins[0], &ins[1], &ins[2], a, float)?;
    let grads = backward(
        &[
            ins[0].clone(),
            ins[1].clone(),
            ins[2].clone(),
            stats[0].clone(),
            ins[3].clone(),
            ins[4].clone(),
        ],
        a,
        float,
    )?;
    stats.extend(grads);
    Ok(stats)
}

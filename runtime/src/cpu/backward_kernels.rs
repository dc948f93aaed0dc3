//! The training ops: the backward ops `autodiff` makes (each the vector-Jacobian
//! product of one forward op, written out from its formula, not taken from candle's
//! autograd, so that running the joint graph checks the backward independently), the
//! optimizer updates and the host offload copies (identities on the CPU: there is no
//! separate device memory to move between).
//!
//! Each function takes and returns tensors in the storage dtypes of `host.rs` (floats in
//! the compute dtype, integers i64, bools u8).

use super::host::values_i64;
use super::kernels::{self, Cx, KResult, KernelError};
use candle_core::{DType as C, Device, Tensor, D};
use weft_ir::attrs::Reduction;
use weft_ir::shape::norm_dim;
use weft_ir::Op;

macro_rules! bail {
    ($($t:tt)*) => { return Err(KernelError(format!($($t)*))) };
}

const DEV: &Device = &Device::Cpu;

/// Evaluates one training op (the arm of `kernels::eval` for them).
pub(crate) fn eval(op: &Op, ins: &[Tensor], cx: &Cx) -> KResult<Vec<Tensor>> {
    let one = |t: Tensor| Ok(vec![t]);
    match op {
        Op::AttentionGrad { .. } => {
            let slots = op
                .attention_operands(ins.len())
                .expect("an attention_grad")
                .map_err(KernelError)?;
            let at = |i: Option<usize>| i.map(|i| &ins[i]);
            attention_grad(
                &ins[0],
                &ins[1],
                &ins[2],
                &ins[3],
                &ins[4],
                at(slots.mask),
                at(slots.sinks),
                at(slots.dlse),
                None,
                kernels::AttnAttrs::of(op)?,
                cx.float,
            )
        }
        Op::AttentionBlockGrad {
            causal,
            scale,
            softcap,
        } => attention_grad(
            &ins[0],
            &ins[1],
            &ins[2],
            &ins[3],
            &ins[4],
            ins.get(6),
            None,
            None,
            Some(&ins[5]),
            kernels::AttnAttrs {
                causal: *causal,
                scale: scale.0,
                window: None,
                softcap: softcap.map(|c| c.0),
            },
            cx.float,
        ),
        Op::RmsNormGrad { eps } => {
            let (dx, dw) = rms_norm_grad(&ins[0], &ins[1], &ins[2], eps.0)?;
            Ok(vec![dx, dw])
        }
        Op::CrossEntropyGrad {
            ignore_index,
            reduction,
        } => one(cross_entropy_grad(
            &ins[0],
            &ins[1],
            &ins[2],
            *ignore_index,
            *reduction,
            cx.float,
        )?),
        Op::EmbeddingGrad { padding_idx, .. } => {
            let pad = match padding_idx {
                Some(p) => Some(cx.eval(p, "padding_idx")?),
                None => None,
            };
            let rows = embedding_grad(&ins[0], &ins[1], cx.out[0].1[0], pad)?;
            one(match ins.get(2) {
                Some(init) => (init + rows)?,
                None => rows,
            })
        }
        Op::SiluGrad {} => one(silu_grad(&ins[0], &ins[1])?),
        Op::GeluGrad { tanh_approx } => one(gelu_grad(&ins[0], &ins[1], *tanh_approx)?),
        Op::SoftmaxGrad { dim } => {
            let d = norm_dim(*dim, ins[0].rank()).map_err(KernelError)?;
            let (y, dy) = (&ins[0], &ins[1]);
            let dot = (y * dy)?.sum_keepdim(d)?;
            one(y.mul(&dy.broadcast_sub(&dot)?)?)
        }
        Op::GroupedMatmulGrad { transpose_w, bias } => {
            let (dx, dw, db) =
                grouped_matmul_grad(&ins[0], &ins[1], &ins[2], &ins[3], transpose_w.0)?;
            Ok(if bias.0 {
                vec![dx, dw, db]
            } else {
                vec![dx, dw]
            })
        }
        Op::MoeCombineGrad {} => {
            let (drows, dw) = moe_combine_grad(&ins[0], &ins[1], &ins[2], &ins[3])?;
            Ok(vec![drows, dw])
        }
        // The host update (`host_adamw`) and the fused mixed-precision one
        // (`adamw_master`) are the same AdamW on the same values (this
        // runtime computes every float dtype in one precision, so the widening and
        // rounding casts of the device path are identities here as well); it also
        // returns the parameter in its own dtype, to reload.
        Op::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
        }
        | Op::HostAdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
            ..
        }
        | Op::AdamWMaster {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
            ..
        } => {
            let t = ins[4].to_dtype(C::F64)?.to_scalar::<f64>()?;
            let (p, m, v) = adamw(
                &ins[0],
                &ins[1],
                &ins[2],
                &ins[3],
                &ins[4],
                lr.0 * warmup_factor(t, *warmup),
                beta1.0,
                beta2.0,
                eps.0,
                weight_decay.0,
            )?;
            Ok(
                if matches!(op, Op::HostAdamW { .. } | Op::AdamWMaster { .. }) {
                    vec![p.clone(), m, v, p]
                } else {
                    vec![p, m, v]
                },
            )
        }
        Op::Sgd {
            lr,
            momentum,
            weight_decay,
        } => sgd(
            &ins[0],
            &ins[1],
            ins.get(2),
            lr.0,
            momentum.0,
            weight_decay.0,
        ),
        // The CPU has one memory: the copy is the value itself (its operands after the
        // first only order it).
        Op::Offload { .. } | Op::Reload { .. } => one(ins[0].clone()),
        other => bail!("internal: `{}` is not a training op", other.name()),
    }
}

/// dq, dk, dv (and with sinks dsinks) of `attention`: the probabilities are recomputed
/// (soft-capped, masked, with the sink column), `D = rowsum(dout * out) - dlse` and
/// `dS = P * (dout v^T - D)` (the flash-attention backward; a gradient on the
/// log-sum-exp adds `P * dlse`), times `1 - tanh^2` under a soft-cap. GQA: the q heads
/// of one kv head are folded into its rows, so dk and dv sum over them. The sink of
/// head h gets `-sum P_sink * D` over its rows.
///
/// With `row_lse` (`attention_block_grad`: one key block of a larger attention) the
/// probabilities are `exp(s - row_lse)`, the whole row's normalisation, instead of the
/// block's own softmax, and `out` is the merged output of every block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_grad(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    mask: Option<&Tensor>,
    sinks: Option<&Tensor>,
    dlse: Option<&Tensor>,
    row_lse: Option<&Tensor>,
    a: kernels::AttnAttrs,
    float: C,
) -> KResult<Vec<Tensor>> {
    let (b, nq, sq, hd) = q.dims4()?;
    let (bk, nkv, sk, hdk) = k.dims4()?;
    let (bv, nv, sv, dvd) = v.dims4()?;
    if (bv, nv, sv) != (bk, nkv, sk)
        || bk != b
        || hdk != hd
        || out.dims() != [b, nq, sq, dvd]
        || dout.dims() != out.dims()
    {
        bail!(
            "q {:?}, k {:?}, v {:?}, out {:?}, dout {:?} do not fit together",
            q.dims(),
            k.dims(),
            v.dims(),
            out.dims(),
            dout.dims()
        );
    }
    if nkv == 0 || nq % nkv != 0 {
        bail!("q heads ({nq}) must be a multiple of kv heads ({nkv})");
    }
    let rep = nq / nkv;
    let fold = |t: &Tensor, d: usize| -> KResult<Tensor> {
        Ok(t.contiguous()?.reshape((b, nkv, rep * sq, d))?)
    };
    let (qg, og, dog) = (fold(q, hd)?, fold(out, dvd)?, fold(dout, dvd)?);
    let raw = kernels::matmul(&qg, &k.transpose(2, 3)?)?
        .affine(a.scale, 0.0)?
        .reshape((b, nq, sq, sk))?;
    let (mut scores, tcap) = match a.softcap {
        Some(c) => {
            let t = raw.affine(1.0 / c, 0.0)?.tanh()?;
            ((&t * c)?, Some(t))
        }
        None => (raw, None),
    };
    if let Some(keep) = kernels::attention_keep(mask, a.causal, a.window, (b, nq, sq, sk))? {
        scores = scores.broadcast_add(&kernels::keep_to_bias(&keep, float)?)?;
    }
    if let Some(s) = sinks {
        if s.dims() != [nq] {
            bail!("sinks {:?} must be [{nq}]", s.dims());
        }
        let col = s
            .to_dtype(float)?
            .reshape((1, nq, 1, 1))?
            .broadcast_as((b, nq, sq, 1))?;
        scores = Tensor::cat(&[&scores, &col], 3)?;
    }
    let p_all = match row_lse {
        Some(l) => {
            if l.dims() != [b, nq, sq] {
                bail!("lse {:?} must be [{b}, {nq}, {sq}]", l.dims());
            }
            let l = l.to_dtype(float)?.reshape((b, nq, sq, 1))?;
            scores.broadcast_sub(&l)?.exp()?
        }
        None => kernels::softmax(&scores, 3)?,
    };
    let p = p_all
        .narrow(3, 0, sk)?
        .contiguous()?
        .reshape((b, nkv, rep * sq, sk))?;
    let dv = kernels::matmul(&p.transpose(2, 3)?, &dog)?;
    let dp = kernels::matmul(&dog, &v.transpose(2, 3)?)?;
    let mut dsum = (&dog * &og)?.sum_keepdim(3)?;
    if let Some(dl) = dlse {
        if dl.dims() != [b, nq, sq] {
            bail!("dlse {:?} must be [{b}, {nq}, {sq}]", dl.dims());
        }
        dsum = (dsum - dl.to_dtype(float)?.reshape((b, nkv, rep * sq, 1))?)?;
    }
    let mut ds = p.mul(&dp.broadcast_sub(&dsum)?)?;
    if let Some(t) = &tcap {
        let t = t.reshape((b, nkv, rep * sq, sk))?;
        ds = ds.mul(&t.sqr()?.affine(-1.0, 1.0)?)?;
    }
    let dq = kernels::matmul(&ds, &k.contiguous()?)?
        .affine(a.scale, 0.0)?
        .reshape((b, nq, sq, hd))?;
    let dk = kernels::matmul(&ds.transpose(2, 3)?, &qg)?.affine(a.scale, 0.0)?;
    let mut res = vec![dq, dk, dv];
    if sinks.is_some() {
        // d sink = P_sink * (0 - D), summed over batch and rows.
        let ps = p_all.narrow(3, sk, 1)?.reshape((b, nq, sq))?;
        let d = dsum.reshape((b, nq, sq))?;
        res.push((ps * d)?.neg()?.sum(2)?.sum(0)?);
    }
    Ok(res)
}

/// dx, dw of `rms_norm`: with `r = 1/sqrt(mean(x^2) + eps)` and `xh = x r`,
/// `dw = sum_rows(dy xh)` and `dx = r (g - xh mean(g xh))` where `g = dy w`.
pub(crate) fn rms_norm_grad(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> KResult<(Tensor, Tensor)> {
    let h = *x.dims().last().unwrap_or(&0);
    if w.dims() != [h] || dy.dims() != x.dims() {
        bail!(
            "x {:?}, w {:?}, dy {:?} do not fit together",
            x.dims(),
            w.dims(),
            dy.dims()
        );
    }
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let xh = x.broadcast_mul(&r)?;
    let rows = x.elem_count() / h.max(1);
    let dw = (dy * &xh)?.reshape((rows, h))?.sum(0)?;
    let g = dy.broadcast_mul(w)?;
    let m = (&g * &xh)?.mean_keepdim(D::Minus1)?;
    let dx = g.sub(&xh.broadcast_mul(&m)?)?.broadcast_mul(&r)?;
    Ok((dx, dw))
}

/// dlogits of `cross_entropy`: `g_i (softmax(x_i) - onehot(label_i))`, 0 for ignored
/// tokens, where `g_i` is `dloss_i` (none), `dloss` (sum) or `dloss / count` (mean).
pub(crate) fn cross_entropy_grad(
    logits: &Tensor,
    labels: &Tensor,
    dloss: &Tensor,
    ignore: i64,
    reduction: Reduction,
    float: C,
) -> KResult<Tensor> {
    let v = *logits.dims().last().unwrap_or(&0);
    if logits.rank() != labels.rank() + 1 || logits.dims()[..labels.rank()] != *labels.dims() {
        bail!(
            "logits {:?} must be labels {:?} plus a class dim",
            logits.dims(),
            labels.dims()
        );
    }
    let lv = values_i64(labels)?;
    if let Some((i, bad)) = lv
        .iter()
        .enumerate()
        .find(|(_, &l)| l != ignore && (l < 0 || l >= v as i64))
    {
        bail!("label {bad} (at flat position {i}) is out of range for {v} classes and is not ignore_index {ignore}");
    }
    let p = kernels::softmax(logits, logits.rank() - 1)?;
    let classes = Tensor::arange(0i64, v as i64, DEV)?;
    let onehot = labels
        .unsqueeze(D::Minus1)?
        .broadcast_eq(&classes)?
        .to_dtype(float)?;
    let valid = labels.ne(ignore)?.to_dtype(float)?;
    let g = match reduction {
        Reduction::None => valid.mul(dloss)?,
        Reduction::Sum => valid.broadcast_mul(dloss)?,
        Reduction::Mean => {
            let count = valid.sum_all()?;
            valid.broadcast_mul(&dloss.div(&count)?)?
        }
    };
    Ok(p.sub(&onehot)?.broadcast_mul(&g.unsqueeze(D::Minus1)?)?)
}

/// The table gradient of `embedding`: row `ids[i]` gets `dy[i]` added.
/// `padding_idx`: tokens with that id add nothing (HF's `nn.Embedding(padding_idx=..)`).
pub(crate) fn embedding_grad(
    ids: &Tensor,
    dy: &Tensor,
    rows: usize,
    padding_idx: Option<i64>,
) -> KResult<Tensor> {
    let h = *dy.dims().last().unwrap_or(&0);
    let flat = ids.flatten_all()?;
    let iv = values_i64(&flat)?;
    if let Some((i, bad)) = iv
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t >= rows as i64)
    {
        bail!(
            "token id {bad} (at flat position {i}) is out of range for the embedding's {rows} rows"
        );
    }
    let n = flat.elem_count();
    let zeros = Tensor::zeros((rows, h), dy.dtype(), DEV)?;
    let (mut ids, mut dy) = (flat, dy.reshape((n, h))?.contiguous()?);
    if let Some(p) = padding_idx.filter(|p| iv.contains(p)) {
        // Drop the padding tokens' rows (not a multiply by 0, which would keep a NaN).
        let keep: Vec<u32> = (0..n as u32).filter(|&i| iv[i as usize] != p).collect();
        if keep.is_empty() {
            return Ok(zeros);
        }
        let keep = Tensor::from_vec(keep.clone(), keep.len(), DEV)?;
        ids = ids.index_select(&keep, 0)?;
        dy = dy.index_select(&keep, 0)?.contiguous()?;
    }
    Ok(zeros.index_add(&ids, &dy, 0)?)
}

/// `dy * silu'(x)` with `silu'(x) = s (1 + x (1 - s))`, `s = sigmoid(x)`.
pub(crate) fn silu_grad(x: &Tensor, dy: &Tensor) -> KResult<Tensor> {
    let s = (x.neg()?.exp()? + 1.0)?.recip()?;
    let inner = ((x * s.affine(-1.0, 1.0)?)? + 1.0)?;
    Ok(dy.mul(&s.mul(&inner)?)?)
}

/// `dy * gelu'(x)`: exact, `Phi(x) + x phi(x)`; tanh approximation,
/// `0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)` with `t = tanh(c (x + a x^3))`.
pub(crate) fn gelu_grad(x: &Tensor, dy: &Tensor, tanh_approx: bool) -> KResult<Tensor> {
    let d = if tanh_approx {
        let (a, c) = (0.044715, (2.0 / std::f64::consts::PI).sqrt());
        let x2 = x.sqr()?;
        let u = (x * (x2.affine(a, 1.0)?))?.affine(c, 0.0)?;
        let t = u.tanh()?;
        let left = t.affine(0.5, 0.5)?;
        let right = (x * t.sqr()?.affine(-1.0, 1.0)?)?
            .mul(&x2.affine(3.0 * a * c, c)?)?
            .affine(0.5, 0.0)?;
        (left + right)?
    } else {
        let cdf = x
            .affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?
            .erf()?
            .affine(0.5, 0.5)?;
        let pdf = x
            .sqr()?
            .affine(-0.5, 0.0)?
            .exp()?
            .affine(1.0 / (2.0 * std::f64::consts::PI).sqrt(), 0.0)?;
        (cdf + x.mul(&pdf)?)?
    };
    Ok(dy.mul(&d)?)
}

/// dx, dw of `grouped_matmul`: per group `dx_g = dy_g w[e]`, `dw[e] += dy_g^T x_g`
/// (counts [E], or [G, E] with group (g, e) using `w[e]`).
pub(crate) fn grouped_matmul_grad(
    x: &Tensor,
    w: &Tensor,
    counts: &Tensor,
    dy: &Tensor,
    transpose_w: bool,
) -> KResult<(Tensor, Tensor, Tensor)> {
    let (m, kx) = x.dims2()?;
    let (e, n, kw) = w.dims3()?;
    let (n, kw) = if transpose_w { (kw, n) } else { (n, kw) };
    if kx != kw || dy.dims() != [m, n] {
        bail!(
            "x {:?}, w {:?}, dy {:?} do not fit together",
            x.dims(),
            w.dims(),
            dy.dims()
        );
    }
    let c = values_i64(counts)?;
    if c.len() % e.max(1) != 0
        || counts.dims().last() != Some(&e)
        || c.iter().any(|&v| v < 0)
        || c.iter().sum::<i64>() != m as i64
    {
        bail!("counts {c:?} must be {e} (or G x {e}) non-negative group sizes summing to the {m} rows");
    }
    let mut dx_parts = Vec::new();
    let mut dw: Vec<Option<Tensor>> = vec![None; e];
    let mut db: Vec<Option<Tensor>> = vec![None; e];
    let mut at = 0usize;
    for (g, &cnt) in c.iter().enumerate() {
        if cnt == 0 {
            continue;
        }
        let ex = g % e;
        let xs = x.narrow(0, at, cnt as usize)?;
        let gs = dy.narrow(0, at, cnt as usize)?;
        let we = w.get(ex)?;
        let (dxs, part) = if transpose_w {
            // y = x w[e], w[e] [K, N]
            (
                super::sgemm::matmul(&gs, &we.t()?)?,
                super::sgemm::matmul(&xs.t()?, &gs)?,
            )
        } else {
            (
                super::sgemm::matmul(&gs, &we)?,
                super::sgemm::matmul(&gs.t()?, &xs)?,
            )
        };
        dx_parts.push(dxs);
        dw[ex] = Some(match dw[ex].take() {
            Some(acc) => (acc + part)?,
            None => part,
        });
        let bias_part = gs.sum(0)?;
        db[ex] = Some(match db[ex].take() {
            Some(acc) => (acc + bias_part)?,
            None => bias_part,
        });
        at += cnt as usize;
    }
    let dx = match dx_parts.len() {
        0 => Tensor::zeros((0, kx), x.dtype(), DEV)?,
        1 => dx_parts.pop().expect("one part"),
        _ => Tensor::cat(&dx_parts, 0)?,
    };
    let zero = Tensor::zeros(w.dims()[1..].to_vec(), w.dtype(), DEV)?;
    let dw: Vec<Tensor> = dw
        .into_iter()
        .map(|t| t.unwrap_or_else(|| zero.clone()))
        .collect();
    let zero_b = Tensor::zeros(n, dy.dtype(), DEV)?;
    let db: Vec<Tensor> = db
        .into_iter()
        .map(|t| t.unwrap_or_else(|| zero_b.clone()))
        .collect();
    Ok((dx, Tensor::stack(&dw, 0)?, Tensor::stack(&db, 0)?))
}

/// drows, dweights of `moe_combine`: row `r` (token `t`, slot `s` by `order[r]`) gets
/// `weights[t, s] dy[t]`; `dweights[t, s] = rows[r] . dy[t]`.
pub(crate) fn moe_combine_grad(
    rows: &Tensor,
    order: &Tensor,
    weights: &Tensor,
    dy: &Tensor,
) -> KResult<(Tensor, Tensor)> {
    let (t, k) = weights.dims2()?;
    let (r, h) = rows.dims2()?;
    if order.dims() != [r] || dy.dims() != [t, h] {
        bail!(
            "rows {:?}, order {:?}, weights {:?}, dy {:?} do not fit together",
            rows.dims(),
            order.dims(),
            weights.dims(),
            dy.dims()
        );
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
    let dy_rows = dy.index_select(&Tensor::from_vec(tok, r, DEV)?, 0)?;
    let wsel = weights.flatten_all()?.index_select(order, 0)?;
    let drows = dy_rows.broadcast_mul(&wsel.unsqueeze(1)?)?;
    let dots = (rows * &dy_rows)?.sum(1)?;
    let dw = Tensor::zeros(t * k, weights.dtype(), DEV)?
        .index_add(order, &dots, 0)?
        .reshape((t, k))?;
    Ok((drows, dw))
}

/// One AdamW step (torch.optim.AdamW, decoupled weight decay), `step` 1-based:
/// `p -= lr wd p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
/// p -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: &Tensor,
    lr: f64,
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
) -> KResult<(Tensor, Tensor, Tensor)> {
    let t = step.to_dtype(C::F64)?.to_scalar::<f64>()?;
    if t < 1.0 {
        bail!("step must be at least 1 (it counts the updates, the first is 1), got {t}");
    }
    let p = p.affine(1.0 - lr * wd, 0.0)?;
    let m = (m.affine(b1, 0.0)? + g.affine(1.0 - b1, 0.0)?)?;
    let v = (v.affine(b2, 0.0)? + g.sqr()?.affine(1.0 - b2, 0.0)?)?;
    let (c1, c2) = (1.0 - b1.powf(t), 1.0 - b2.powf(t));
    let denom = (v.affine(1.0 / c2, 0.0)?.sqrt()? + eps)?;
    let upd = m.affine(lr / c1, 0.0)?.div(&denom)?;
    Ok(((p - upd)?, m, v))
}

/// The learning rate's factor at 1-based step `t` under a linear warmup of `warmup`
/// steps: `min(1, t / warmup)` (1 without warmup). The CUDA kernels compute it the same
/// way in f32.
pub(crate) fn warmup_factor(t: f64, warmup: Option<i64>) -> f64 {
    match warmup {
        Some(w) if w > 0 => (t / w as f64).min(1.0),
        _ => 1.0,
    }
}

/// One SGD step (torch.optim.SGD): `g += wd p`; with momentum `buf = mu buf + g` and
/// the step uses `buf`.
pub(crate) fn sgd(
    p: &Tensor,
    g: &Tensor,
    buf: Option<&Tensor>,
    lr: f64,
    momentum: f64,
    wd: f64,
) -> KResult<Vec<Tensor>> {
    let g = if wd != 0.0 {
        (g + p.affine(wd, 0.0)?)?
    } else {
        g.clone()
    };
    match buf {
        Some(b) => {
            let nb = (b.affine(momentum, 0.0)? + &g)?;
            Ok(vec![(p - nb.affine(lr, 0.0)?)?, nb])
        }
        None => Ok(vec![(p - g.affine(lr, 0.0)?)?]),
    }
}

//! Shape rules of the training ops: the backward ops `autodiff` makes, the optimizer
//! updates and the host offload copies. Re-exported by [`crate::shape`], which the op
//! table reads.

use crate::attrs::Reduction;
use crate::dim::Dim;
use crate::ops::Op;
use crate::shape::norm_dim;
use crate::types::{DType, TensorType};

type Out = Result<Vec<TensorType>, String>;

fn want_float(t: &TensorType, what: &str) -> Result<(), String> {
    if !t.dtype.is_float() {
        return Err(format!("{what} must be a float tensor, got {t}"));
    }
    Ok(())
}

fn want_int(t: &TensorType, what: &str) -> Result<(), String> {
    if !t.dtype.is_int() {
        return Err(format!("{what} must be an integer tensor, got {t}"));
    }
    Ok(())
}

fn same_type(a: &TensorType, b: &TensorType, what: &str) -> Result<(), String> {
    if a != b {
        return Err(format!("{what} must have the same type, got {a} and {b}"));
    }
    Ok(())
}

/// `attention_grad(q, k, v, out, dout, mask?, sinks?, dlse?)`: dq, dk, dv shaped like q,
/// k, v, and with sinks dsinks [Nq] (f32).
pub fn attention_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::AttentionGrad { sinks, .. } = op else {
        unreachable!()
    };
    // The forward's operands: q, k, v and the optional ones after out and dout.
    let mut fwd: Vec<&TensorType> = vec![ins[0], ins[1], ins[2]];
    let slots = op.attention_operands(ins.len()).expect("an attention op")?;
    for i in [slots.mask, slots.sinks].into_iter().flatten() {
        fwd.push(ins[i]);
    }
    let fwd_op = match op {
        Op::AttentionGrad {
            causal,
            scale,
            window,
            softcap,
            sinks,
            layout,
            ..
        } => Op::Attention {
            causal: *causal,
            scale: *scale,
            window: *window,
            softcap: *softcap,
            sinks: *sinks,
            lse: Default::default(),
            layout: *layout,
        },
        _ => unreachable!(),
    };
    let out_ty = crate::shape::attention_operands_check(&fwd_op, &fwd)?;
    let (q, k, v, out, dout) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
    same_type(&out_ty, out, "the attention output and out")?;
    same_type(out, dout, "out and dout")?;
    if let Some(i) = slots.dlse {
        let want = crate::shape::attention_lse_type(&fwd_op, q);
        same_type(&want, ins[i], "the log-sum-exp and dlse")?;
    }
    let mut res = vec![q.clone(), k.clone(), v.clone()];
    if sinks.0 {
        let heads = q.shape[fwd_op.head_layout().unwrap_or_default().heads_dim()].clone();
        res.push(TensorType::new(DType::F32, vec![heads]));
    }
    Ok(res)
}

/// `ring_attention_grad(q, k, v, out, lse, dout)`: dq, dk, dv shaped like q, k, v; out
/// and lse must be what `ring_attention` of q, k, v gives, dout like out.
pub fn ring_attention_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let fwd = crate::shape::ring_as_attention(op, true);
    let want = crate::shape::attention(&fwd, &ins[..3])?;
    same_type(&want[0], ins[3], "the ring attention output and out")?;
    same_type(&want[1], ins[4], "the ring attention log-sum-exp and lse")?;
    same_type(ins[3], ins[5], "out and dout")?;
    Ok(vec![ins[0].clone(), ins[1].clone(), ins[2].clone()])
}

/// `attention_block_grad(q, k, v, out, dout, lse, mask?)`: dq, dk, dv shaped like q, k,
/// v; out and dout like the attention output of q and v, lse f32 [B, Nq, Sq].
pub fn attention_block_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::AttentionBlockGrad {
        causal,
        scale,
        softcap,
    } = op
    else {
        unreachable!()
    };
    let fwd = Op::Attention {
        causal: *causal,
        scale: *scale,
        window: None,
        softcap: *softcap,
        sinks: false.into(),
        lse: false.into(),
        layout: Default::default(),
    };
    let mut fwd_ins: Vec<&TensorType> = vec![ins[0], ins[1], ins[2]];
    fwd_ins.extend(ins.get(6).copied());
    let out_ty = crate::shape::attention_operands_check(&fwd, &fwd_ins)?;
    let (q, out, dout, lse) = (ins[0], ins[3], ins[4], ins[5]);
    same_type(&out_ty, out, "the attention output and out")?;
    same_type(out, dout, "out and dout")?;
    let want = TensorType::new(DType::F32, q.shape[..3].to_vec());
    same_type(&want, lse, "the log-sum-exp and lse")?;
    Ok(vec![ins[0].clone(), ins[1].clone(), ins[2].clone()])
}

/// `rms_norm_grad(x, w, dy)`: dx like x, dw like w.
pub fn rms_norm_grad(_: &Op, ins: &[&TensorType]) -> Out {
    let (x, w, dy) = (ins[0], ins[1], ins[2]);
    want_float(x, "x")?;
    if x.rank() == 0 || w.shape != [x.shape.last().unwrap().clone()] {
        return Err(format!(
            "rms_norm_grad weight must match the last dim of x: x {x}, w {w}"
        ));
    }
    same_type(x, dy, "x and dy")?;
    Ok(vec![x.clone(), w.clone()])
}

/// `cross_entropy_grad(logits, labels, dloss)`: dlogits like logits.
pub fn cross_entropy_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::CrossEntropyGrad { reduction, .. } = op else {
        unreachable!()
    };
    let (logits, labels, dloss) = (ins[0], ins[1], ins[2]);
    want_float(logits, "logits")?;
    want_int(labels, "labels")?;
    want_float(dloss, "dloss")?;
    if logits.rank() != labels.rank() + 1 || logits.shape[..labels.rank()] != labels.shape[..] {
        return Err(format!(
            "logits {logits} must be labels {labels} plus a class dim"
        ));
    }
    let want: &[Dim] = match reduction {
        Reduction::None => &labels.shape,
        _ => &[],
    };
    if dloss.shape != want {
        return Err(format!(
            "dloss must have the shape of the loss ({} for reduction={}), got {dloss}",
            TensorType::new(dloss.dtype, want.to_vec()),
            reduction.keyword()
        ));
    }
    Ok(vec![logits.clone()])
}

/// `linear_cross_entropy_grad(x, w, labels, lse, dlse, dtarget)`: dx like x, dw like w.
pub fn linear_cross_entropy_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let tok = crate::shape::linear_ce_operands(op, ins)?;
    for (t, what) in [(ins[3], "lse"), (ins[4], "dlse"), (ins[5], "dtarget")] {
        if *t != tok {
            return Err(format!("{what} must be {tok} (one f32 per token), got {t}"));
        }
    }
    Ok(vec![ins[0].clone(), ins[1].clone()])
}

/// `linear_cross_entropy_with_grad(x, w, labels, dlse, dtarget)`: lse and target (one
/// f32 per token), dx like x, dw like w.
pub fn linear_cross_entropy_with_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let tok = crate::shape::linear_ce_operands(op, ins)?;
    for (t, what) in [(ins[3], "dlse"), (ins[4], "dtarget")] {
        if *t != tok {
            return Err(format!("{what} must be {tok} (one f32 per token), got {t}"));
        }
    }
    Ok(vec![tok.clone(), tok, ins[0].clone(), ins[1].clone()])
}

/// `embedding_grad(ids, dy) {num_embeddings}`: the table gradient [num_embeddings, H].
pub fn embedding_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::EmbeddingGrad {
        num_embeddings,
        padding_idx,
    } = op
    else {
        unreachable!()
    };
    let (ids, dy) = (ins[0], ins[1]);
    want_int(ids, "ids")?;
    want_float(dy, "dy")?;
    if dy.rank() != ids.rank() + 1 || dy.shape[..ids.rank()] != ids.shape[..] {
        return Err(format!("dy {dy} must be ids {ids} plus a hidden dim"));
    }
    crate::shape::check_padding_idx(padding_idx.as_ref(), num_embeddings)?;
    let table = dy.with_shape(vec![
        num_embeddings.clone(),
        dy.shape.last().unwrap().clone(),
    ]);
    if let Some(init) = ins.get(2) {
        if **init != table {
            return Err(format!(
                "init {init} must have the table gradient's type {table}"
            ));
        }
    }
    Ok(vec![table])
}

/// `silu_grad` / `gelu_grad (x, dy)`: dx like x.
pub fn elementwise_grad(_: &Op, ins: &[&TensorType]) -> Out {
    want_float(ins[0], "x")?;
    same_type(ins[0], ins[1], "x and dy")?;
    Ok(vec![ins[0].clone()])
}

/// `softmax_grad(y, dy) {dim}`: dx like y.
pub fn softmax_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::SoftmaxGrad { dim } = op else {
        unreachable!()
    };
    want_float(ins[0], "y")?;
    norm_dim(*dim, ins[0].rank())?;
    same_type(ins[0], ins[1], "y and dy")?;
    Ok(vec![ins[0].clone()])
}

/// `grouped_matmul_grad(x, w, counts, dy)`: dx like x, dw like w, and with `bias=true`
/// dbias [E, N] in w's dtype.
pub fn grouped_matmul_grad(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::GroupedMatmulGrad { transpose_w, bias } = op else {
        unreachable!()
    };
    let (x, w, counts, dy) = (ins[0], ins[1], ins[2], ins[3]);
    let forward = Op::GroupedMatmul {
        transpose_w: *transpose_w,
    };
    let y = crate::shape::grouped_matmul(&forward, &[x, w, counts])?;
    same_type(&y[0], dy, "the grouped_matmul output and dy")?;
    let mut out = vec![x.clone(), w.clone()];
    if bias.0 {
        out.push(w.with_shape(vec![w.shape[0].clone(), dy.shape[1].clone()]));
    }
    Ok(out)
}

/// `moe_combine_grad(rows, order, weights, dy)`: drows like rows, dweights like weights.
pub fn moe_combine_grad(_: &Op, ins: &[&TensorType]) -> Out {
    let (rows, order, w, dy) = (ins[0], ins[1], ins[2], ins[3]);
    let y = crate::shape::moe_combine(&Op::MoeCombine {}, &[rows, order, w])?;
    same_type(&y[0], dy, "the moe_combine output and dy")?;
    if w.dtype != rows.dtype {
        return Err(format!("weights {w} and rows {rows} differ in dtype"));
    }
    Ok(vec![rows.clone(), w.clone()])
}

/// `adamw(param, grad, m, v, step)`: new param, m, v.
pub fn adamw(_: &Op, ins: &[&TensorType]) -> Out {
    let (p, g, m, v, step) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
    want_float(p, "param")?;
    for (t, what) in [(g, "grad"), (m, "m"), (v, "v")] {
        if t.shape != p.shape {
            return Err(format!("{what} {t} must have the shape of param {p}"));
        }
        want_float(t, what)?;
    }
    if step.rank() != 0 || !step.dtype.is_float() {
        return Err(format!("step must be a float scalar, got {step}"));
    }
    Ok(vec![p.clone(), m.clone(), v.clone()])
}

/// `host_adamw(master, grad, m, v, step) {dtype}` and `adamw_master` (the same update on
/// the device): new master, m, v, and the master in `dtype`.
pub fn host_adamw(op: &Op, ins: &[&TensorType]) -> Out {
    let (Op::HostAdamW { dtype, .. } | Op::AdamWMaster { dtype, .. }) = op else {
        return Err(format!("internal: host_adamw rule on `{}`", op.name()));
    };
    if !dtype.is_float() {
        return Err(format!("dtype must be a float type, got {dtype}"));
    }
    let g = ins[1];
    if g.shape != ins[0].shape {
        return Err(format!("grad {g} must have the shape of master {}", ins[0]));
    }
    want_float(g, "grad")?;
    let mut widened = g.clone();
    widened.dtype = ins[0].dtype;
    let mut out = adamw(op, &[ins[0], &widened, ins[2], ins[3], ins[4]])?;
    out.push(ins[0].with_dtype(*dtype));
    Ok(out)
}

/// `sgd(param, grad, buf?)`: new param (and new momentum buffer).
pub fn sgd(_: &Op, ins: &[&TensorType]) -> Out {
    let (p, g) = (ins[0], ins[1]);
    want_float(p, "param")?;
    if g.shape != p.shape {
        return Err(format!("grad {g} must have the shape of param {p}"));
    }
    let mut out = vec![p.clone()];
    if let Some(b) = ins.get(2) {
        if b.shape != p.shape {
            return Err(format!(
                "momentum buffer {b} must have the shape of param {p}"
            ));
        }
        out.push((*b).clone());
    }
    Ok(out)
}

/// `offload` / `reload (x, after..)`: a copy of `x`; the other operands only order it.
pub fn offload(_: &Op, ins: &[&TensorType]) -> Out {
    Ok(vec![ins[0].clone()])
}

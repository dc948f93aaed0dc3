//! Shape rules: one function per op kind computes output types from operand types and
//! attributes. They run when a node is created and again in the verifier. Errors are
//! plain messages; the caller locates them at the node.

use crate::attrs::{HeadLayout, Reduction};
use crate::dim::Dim;
use crate::ops::Op;
use crate::types::{DType, TensorType};

type Out = Result<Vec<TensorType>, String>;

#[path = "shape_train.rs"]
mod train;
pub use train::*;

#[path = "shape_fused.rs"]
mod fused;
pub use fused::*;

fn one(t: TensorType) -> Out {
    Ok(vec![t])
}

/// Normalizes a possibly negative dim index against `rank`.
pub fn norm_dim(dim: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(format!("dim {dim} is out of range for rank {rank}"));
    }
    Ok(d as usize)
}

fn same_dtype(a: &TensorType, b: &TensorType, what: &str) -> Result<(), String> {
    if a.dtype != b.dtype {
        return Err(format!(
            "{what}: dtypes differ ({} vs {})",
            a.dtype, b.dtype
        ));
    }
    Ok(())
}

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

/// Numpy-style broadcast of two shapes (right-aligned; a constant 1 stretches).
pub fn broadcast_shapes(a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>, String> {
    let n = a.len().max(b.len());
    let one = Dim::from(1);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let da = if i + a.len() >= n {
            Some(&a[i + a.len() - n])
        } else {
            None
        };
        let db = if i + b.len() >= n {
            Some(&b[i + b.len() - n])
        } else {
            None
        };
        out.push(match (da, db) {
            (Some(x), None) | (None, Some(x)) => x.clone(),
            (Some(x), Some(y)) if x == y => x.clone(),
            (Some(x), Some(y)) if *x == one => y.clone(),
            (Some(x), Some(y)) if *y == one => x.clone(),
            (Some(x), Some(y)) => {
                return Err(format!(
                    "shapes do not broadcast: dim {i} is {x} in one and {y} in the other"
                ))
            }
            (None, None) => unreachable!(),
        });
    }
    Ok(out)
}

fn fmt_shape(s: &[Dim]) -> String {
    let parts: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

pub fn source_type(op: &Op, _: &[&TensorType]) -> Out {
    match op {
        Op::Param { ty, .. } | Op::Input { ty, .. } | Op::Full { ty, .. } => one(ty.clone()),
        _ => unreachable!(),
    }
}

pub fn arange(op: &Op, _: &[&TensorType]) -> Out {
    let Op::Arange { ty, .. } = op else {
        unreachable!()
    };
    if ty.rank() != 1 {
        return Err(format!("arange makes a 1-D tensor, but its type is {ty}"));
    }
    if ty.dtype == DType::Bool {
        return Err("arange cannot make bool".into());
    }
    one(ty.clone())
}

pub fn same(_: &Op, ins: &[&TensorType]) -> Out {
    one(ins[0].clone())
}

pub fn same_dim(op: &Op, ins: &[&TensorType]) -> Out {
    let (Op::Softmax { dim } | Op::LogSoftmax { dim }) = op else {
        unreachable!()
    };
    norm_dim(*dim, ins[0].rank())?;
    want_float(ins[0], "input")?;
    one(ins[0].clone())
}

pub fn broadcast(_: &Op, ins: &[&TensorType]) -> Out {
    same_dtype(ins[0], ins[1], "operands")?;
    one(TensorType::new(
        ins[0].dtype,
        broadcast_shapes(&ins[0].shape, &ins[1].shape)?,
    ))
}

pub fn compare(_: &Op, ins: &[&TensorType]) -> Out {
    same_dtype(ins[0], ins[1], "operands")?;
    one(TensorType::new(
        DType::Bool,
        broadcast_shapes(&ins[0].shape, &ins[1].shape)?,
    ))
}

pub fn select(_: &Op, ins: &[&TensorType]) -> Out {
    if ins[0].dtype != DType::Bool {
        return Err(format!("condition must be bool, got {}", ins[0]));
    }
    same_dtype(ins[1], ins[2], "branches")?;
    let s = broadcast_shapes(&ins[0].shape, &ins[1].shape)?;
    one(TensorType::new(
        ins[1].dtype,
        broadcast_shapes(&s, &ins[2].shape)?,
    ))
}

pub fn cast(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Cast { dtype } = op else {
        unreachable!()
    };
    one(ins[0].with_dtype(*dtype))
}

pub fn reduce(op: &Op, ins: &[&TensorType]) -> Out {
    let (Op::Sum { dims, keepdim } | Op::Mean { dims, keepdim } | Op::Max { dims, keepdim }) = op
    else {
        unreachable!()
    };
    let x = ins[0];
    let mut reduced = vec![false; x.rank()];
    for &d in dims {
        let d = norm_dim(d, x.rank())?;
        if reduced[d] {
            return Err(format!("dim {d} is reduced twice"));
        }
        reduced[d] = true;
    }
    let mut shape = Vec::new();
    for (i, d) in x.shape.iter().enumerate() {
        if !reduced[i] {
            shape.push(d.clone());
        } else if *keepdim {
            shape.push(Dim::from(1));
        }
    }
    if matches!(op, Op::Mean { .. }) {
        want_float(x, "mean input")?;
    }
    one(x.with_shape(shape))
}

pub fn embedding(op: &Op, ins: &[&TensorType]) -> Out {
    let (ids, w) = (ins[0], ins[1]);
    want_int(ids, "ids")?;
    if w.rank() != 2 {
        return Err(format!("embedding weight must be [vocab, hidden], got {w}"));
    }
    if let Op::Embedding { padding_idx } = op {
        check_padding_idx(padding_idx.as_ref(), &w.shape[0])?;
    }
    let mut shape = ids.shape.clone();
    shape.push(w.shape[1].clone());
    one(TensorType::new(w.dtype, shape))
}

/// A constant `padding_idx` must name a row of the table (a per-rank one, set by
/// vocab-parallel tp, may point outside a rank's rows).
pub(crate) fn check_padding_idx(padding_idx: Option<&Dim>, rows: &Dim) -> Result<(), String> {
    let (Some(p), Some(n)) = (padding_idx.and_then(|p| p.as_const()), rows.as_const()) else {
        return Ok(());
    };
    if p < 0 || p >= n {
        return Err(format!(
            "padding_idx {p} is not a row of the embedding's {n} rows"
        ));
    }
    Ok(())
}

pub fn linear(_: &Op, ins: &[&TensorType]) -> Out {
    let (x, w) = (ins[0], ins[1]);
    if w.rank() != 2 || x.rank() == 0 {
        return Err(format!(
            "linear needs x [.., in] and w [out, in], got {x} and {w}"
        ));
    }
    same_dtype(x, w, "x and w")?;
    let k = x.shape.last().unwrap();
    if *k != w.shape[1] {
        return Err(format!(
            "x has {k} input features but w {w} expects {}",
            w.shape[1]
        ));
    }
    if let Some(b) = ins.get(2) {
        if b.shape != [w.shape[0].clone()] {
            return Err(format!("bias must be [{}], got {b}", w.shape[0]));
        }
        same_dtype(x, b, "x and bias")?;
    }
    let mut shape = x.shape.clone();
    *shape.last_mut().unwrap() = w.shape[0].clone();
    one(x.with_shape(shape))
}

pub fn matmul(op: &Op, ins: &[&TensorType]) -> Out {
    let (transpose_a, transpose_b) = match op {
        Op::Matmul {
            transpose_a,
            transpose_b,
        }
        | Op::Fp8Matmul {
            transpose_a,
            transpose_b,
            ..
        } => (transpose_a, transpose_b),
        _ => unreachable!(),
    };
    let (a, b) = (ins[0], ins[1]);
    if a.rank() < 2 || b.rank() < 2 {
        return Err(format!(
            "matmul needs operands of rank >= 2, got {a} and {b}"
        ));
    }
    same_dtype(a, b, "operands")?;
    if matches!(op, Op::Fp8Matmul { .. }) {
        want_float(a, "fp8_matmul operand")?;
    }
    let (ar, br) = (a.rank(), b.rank());
    let (m, ka) = if *transpose_a {
        (&a.shape[ar - 1], &a.shape[ar - 2])
    } else {
        (&a.shape[ar - 2], &a.shape[ar - 1])
    };
    let (kb, n) = if *transpose_b {
        (&b.shape[br - 1], &b.shape[br - 2])
    } else {
        (&b.shape[br - 2], &b.shape[br - 1])
    };
    if ka != kb {
        return Err(format!("contracted dims differ: {ka} vs {kb} ({a} @ {b})"));
    }
    let mut shape = broadcast_shapes(&a.shape[..ar - 2], &b.shape[..br - 2])?;
    shape.push(m.clone());
    shape.push(n.clone());
    one(a.with_shape(shape))
}

pub fn rms_norm(_: &Op, ins: &[&TensorType]) -> Out {
    let (x, w) = (ins[0], ins[1]);
    want_float(x, "x")?;
    if x.rank() == 0 || w.shape != [x.shape.last().unwrap().clone()] {
        return Err(format!(
            "rms_norm weight must match the last dim of x: x {x}, w {w}"
        ));
    }
    one(x.clone())
}

pub fn rope_table(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::RopeTable { dim, .. } = op else {
        unreachable!()
    };
    let p = ins[0];
    want_int(p, "position_ids")?;
    if *dim <= 0 || dim % 2 != 0 {
        return Err(format!("rotary dim must be positive and even, got {dim}"));
    }
    let mut shape = p.shape.clone();
    shape.push(Dim::from(*dim));
    let t = TensorType::new(DType::F32, shape);
    Ok(vec![t.clone(), t])
}

pub fn rope(op: &Op, ins: &[&TensorType]) -> Out {
    let layout = op.head_layout().expect("a rope");
    let (x_in, cos, sin) = (ins[0], ins[1], ins[2]);
    want_float(x_in, "x")?;
    if x_in.rank() != 4 {
        return Err(match layout {
            HeadLayout::Bhsd => format!("rope expects x as [B, heads, S, head_dim], got {x_in}"),
            HeadLayout::Bshd => {
                format!("rope with layout=bshd expects x as [B, S, heads, head_dim], got {x_in}")
            }
        });
    }
    let x = &layout.swap_to_bhsd(x_in);
    if cos != sin || cos.rank() != 3 {
        return Err(format!(
            "cos and sin must be equal-typed [B, S, dim], got {cos} and {sin}"
        ));
    }
    if cos.shape[1] != x.shape[2] {
        return Err(format!(
            "sequence dims differ: x has {}, cos has {}",
            x.shape[2], cos.shape[1]
        ));
    }
    broadcast_shapes(&[x.shape[0].clone()], &[cos.shape[0].clone()])?;
    if let (Some(r), Some(d)) = (cos.shape[2].as_const(), x.shape[3].as_const()) {
        if r > d {
            return Err(format!("rotary dim {r} exceeds head dim {d}"));
        }
    }
    one(x_in.clone())
}

/// `attention(q, k, v, mask?, sinks?)`: out [B, Nq, Sq, Dv], and with `lse=true` the f32
/// log-sum-exp [B, Nq, Sq]. Checks the attributes too (window needs causal and >= 1,
/// softcap > 0), so a program the runtimes would refuse fails at its node.
pub fn attention(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Attention { lse, .. } = op else {
        unreachable!()
    };
    let out = attention_operands_check(op, ins)?;
    let mut res = vec![out];
    if lse.0 {
        res.push(attention_lse_type(op, ins[0]));
    }
    Ok(res)
}

/// The f32 log-sum-exp [B, Nq, Sq] of an attention (of either head layout) with q `q`.
pub(crate) fn attention_lse_type(op: &Op, q: &TensorType) -> TensorType {
    let q = op.head_layout().unwrap_or_default().swap_to_bhsd(q);
    TensorType::new(DType::F32, q.shape[..3].to_vec())
}

/// The plain `attention` a ring attention computes (its attributes, no mask or sinks;
/// `lse` as asked), for the checks they share.
pub(crate) fn ring_as_attention(op: &Op, lse: bool) -> Op {
    match op {
        Op::RingAttention {
            causal,
            scale,
            window,
            softcap,
            ..
        }
        | Op::RingAttentionGrad {
            causal,
            scale,
            window,
            softcap,
            ..
        } => Op::Attention {
            causal: *causal,
            scale: *scale,
            window: *window,
            softcap: *softcap,
            sinks: false.into(),
            lse: lse.into(),
            layout: HeadLayout::Bhsd,
        },
        _ => unreachable!("a ring attention op"),
    }
}

/// `ring_attention(q, k, v)`: out [B, Nq, Sq, Dv] and the f32 log-sum-exp [B, Nq, Sq],
/// checked as `attention` with `lse=true`; the axis must be named.
pub fn ring_attention(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::RingAttention { axis, .. } = op else {
        unreachable!()
    };
    if axis.is_empty() {
        return Err("ring_attention needs the mesh axis of its ring".into());
    }
    attention(&ring_as_attention(op, true), ins)
}

/// The checks `attention` and `attention_grad` share (their first three operands, the
/// mask and the sinks, and the attributes); returns the type of the forward's output.
pub(crate) fn attention_operands_check(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    let (causal, scale, window, softcap) = match op {
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
        } => (*causal, scale.0, *window, *softcap),
        _ => unreachable!(),
    };
    if !scale.is_finite() {
        return Err(format!("scale must be finite, got {scale}"));
    }
    if let Some(w) = window {
        if !causal {
            return Err(format!(
                "window={w} needs causal=true (the band is `p - window < j <= p`)"
            ));
        }
        if w < 1 {
            return Err(format!("window must be at least 1, got {w}"));
        }
    }
    if let Some(c) = softcap {
        if !(c.0.is_finite() && c.0 > 0.0) {
            return Err(format!("softcap must be a positive number, got {}", c.0));
        }
    }
    let slots = op.attention_operands(ins.len()).expect("an attention op")?;
    let layout = op.head_layout().expect("an attention op");
    for (t, n) in [(ins[0], "q"), (ins[1], "k"), (ins[2], "v")] {
        if t.rank() != 4 {
            return Err(match layout {
                HeadLayout::Bhsd => format!("{n} must be [B, heads, S, head_dim], got {t}"),
                HeadLayout::Bshd => {
                    format!("{n} must be [B, S, heads, head_dim] (layout=bshd), got {t}")
                }
            });
        }
        want_float(t, n)?;
    }
    // The checks below read [B, H, S, D]; the output goes back to the op's layout.
    let (q, k, v) = (
        &layout.swap_to_bhsd(ins[0]),
        &layout.swap_to_bhsd(ins[1]),
        &layout.swap_to_bhsd(ins[2]),
    );
    same_dtype(q, k, "q and k")?;
    same_dtype(q, v, "q and v")?;
    if k.shape[..3] != v.shape[..3] {
        return Err(format!(
            "k and v differ in batch, heads or sequence: {k} vs {v}"
        ));
    }
    if q.shape[0] != k.shape[0] || q.shape[3] != k.shape[3] {
        return Err(format!("q {q} and k {k} differ in batch or head_dim"));
    }
    if let (Some(nq), Some(nkv)) = (q.shape[1].as_const(), k.shape[1].as_const()) {
        if nkv == 0 || nq % nkv != 0 {
            return Err(format!(
                "q heads ({nq}) must be a multiple of kv heads ({nkv})"
            ));
        }
    }
    if let Some(i) = slots.mask {
        let m = ins[i];
        if m.rank() != 4 {
            return Err(format!("mask must be [B|1, heads|1, Sq, Sk], got {m}"));
        }
        if m.dtype != DType::Bool {
            return Err(format!("mask must be bool (true = attend), got {m}"));
        }
    }
    if let Some(i) = slots.sinks {
        let s = ins[i];
        want_float(s, "sinks")?;
        if s.shape != [q.shape[1].clone()] {
            return Err(format!(
                "sinks must be one logit per q head [{}], got {s}",
                q.shape[1]
            ));
        }
    }
    let mut out = q.clone();
    out.shape[3] = v.shape[3].clone();
    Ok(layout.swap_to_bhsd(&out))
}

pub fn count_valid(_: &Op, ins: &[&TensorType]) -> Out {
    want_int(ins[0], "labels")?;
    one(TensorType::scalar(DType::F32))
}

pub fn cross_entropy(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::CrossEntropy { reduction, .. } = op else {
        unreachable!()
    };
    let (logits, labels) = (ins[0], ins[1]);
    want_float(logits, "logits")?;
    want_int(labels, "labels")?;
    if logits.rank() != labels.rank() + 1 || logits.shape[..labels.rank()] != labels.shape[..] {
        return Err(format!(
            "logits {logits} must be labels {labels} plus a class dim"
        ));
    }
    one(match reduction {
        Reduction::None => TensorType::new(DType::F32, labels.shape.clone()),
        _ => TensorType::scalar(DType::F32),
    })
}

/// The attributes and operands `linear_cross_entropy` and its gradient share: x [.., H],
/// w [V, H] of x's dtype, integer labels of x's leading shape, a positive chunk, and a
/// finite scale and positive soft-cap when set. Returns the per-token f32 type.
pub(crate) fn linear_ce_operands(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    let (Op::LinearCrossEntropy {
        chunk,
        scale,
        softcap,
        ..
    }
    | Op::LinearCrossEntropyGrad {
        chunk,
        scale,
        softcap,
        ..
    }
    | Op::LinearCrossEntropyWithGrad {
        rows: chunk,
        scale,
        softcap,
        ..
    }) = op
    else {
        unreachable!()
    };
    let chunk_name = if matches!(op, Op::LinearCrossEntropyWithGrad { .. }) {
        "rows"
    } else {
        "chunk"
    };
    let (x, w, labels) = (ins[0], ins[1], ins[2]);
    want_float(x, "x")?;
    want_int(labels, "labels")?;
    same_dtype(x, w, "x and w")?;
    if *chunk < 1 {
        return Err(format!("{chunk_name} must be at least 1, got {chunk}"));
    }
    if let Some(s) = scale {
        if !s.0.is_finite() {
            return Err(format!("scale must be finite, got {}", s.0));
        }
    }
    if let Some(c) = softcap {
        if !(c.0.is_finite() && c.0 > 0.0) {
            return Err(format!("softcap must be positive and finite, got {}", c.0));
        }
    }
    if x.rank() == 0 || w.rank() != 2 || w.shape[1] != x.shape[x.rank() - 1] {
        return Err(format!(
            "w must be [vocab, hidden] with hidden the last dim of x: x {x}, w {w}"
        ));
    }
    if x.shape[..x.rank() - 1] != labels.shape[..] {
        return Err(format!(
            "labels {labels} must be x {x} without its hidden dim"
        ));
    }
    Ok(TensorType::new(DType::F32, labels.shape.clone()))
}

/// `linear_cross_entropy(x, w, labels)`: the per-token log-sum-exp and target logit.
pub fn linear_cross_entropy(op: &Op, ins: &[&TensorType]) -> Out {
    let tok = linear_ce_operands(op, ins)?;
    Ok(vec![tok.clone(), tok])
}

pub fn reshape(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Reshape { shape } = op else {
        unreachable!()
    };
    let t = TensorType::new(ins[0].dtype, shape.clone());
    if t.numel() != ins[0].numel() {
        return Err(format!(
            "reshape from {} to {} changes the element count ({} vs {})",
            fmt_shape(&ins[0].shape),
            fmt_shape(shape),
            ins[0].numel(),
            t.numel()
        ));
    }
    one(t)
}

pub fn permute(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Permute { perm } = op else {
        unreachable!()
    };
    let x = ins[0];
    if perm.len() != x.rank() {
        return Err(format!(
            "permutation {perm:?} has {} entries for rank {}",
            perm.len(),
            x.rank()
        ));
    }
    let mut seen = vec![false; x.rank()];
    let mut shape = Vec::new();
    for &p in perm {
        let d = norm_dim(p, x.rank())?;
        if seen[d] {
            return Err(format!("{perm:?} is not a permutation"));
        }
        seen[d] = true;
        shape.push(x.shape[d].clone());
    }
    one(x.with_shape(shape))
}

pub fn transpose(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Transpose { dim0, dim1 } = op else {
        unreachable!()
    };
    let x = ins[0];
    let (a, b) = (norm_dim(*dim0, x.rank())?, norm_dim(*dim1, x.rank())?);
    let mut shape = x.shape.clone();
    shape.swap(a, b);
    one(x.with_shape(shape))
}

pub fn slice(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Slice { dim, start, len } = op else {
        unreachable!()
    };
    let x = ins[0];
    let d = norm_dim(*dim, x.rank())?;
    if let (Some(s), Some(l), Some(n)) = (start.as_const(), len.as_const(), x.shape[d].as_const()) {
        if s < 0 || l < 0 || s + l > n {
            return Err(format!(
                "slice [{s}, {}) is out of bounds for dim {d} of size {n}",
                s + l
            ));
        }
    }
    let mut shape = x.shape.clone();
    shape[d] = len.clone();
    one(x.with_shape(shape))
}

pub fn concat(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Concat { dim } = op else {
        unreachable!()
    };
    let first = ins[0];
    let d = norm_dim(*dim, first.rank())?;
    let mut total = Dim::zero();
    for (i, t) in ins.iter().enumerate() {
        same_dtype(first, t, "concat operands")?;
        if t.rank() != first.rank() {
            return Err(format!(
                "operand {i} has rank {}, operand 0 has {}",
                t.rank(),
                first.rank()
            ));
        }
        for j in 0..t.rank() {
            if j != d && t.shape[j] != first.shape[j] {
                return Err(format!(
                    "operand {i} differs from operand 0 in dim {j}: {} vs {}",
                    t.shape[j], first.shape[j]
                ));
            }
        }
        total = total + t.shape[d].clone();
    }
    let mut shape = first.shape.clone();
    shape[d] = total;
    one(first.with_shape(shape))
}

pub fn split(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Split { dim, sizes } = op else {
        unreachable!()
    };
    let x = ins[0];
    let d = norm_dim(*dim, x.rank())?;
    let total = sizes.iter().fold(Dim::zero(), |a, s| a + s.clone());
    if total != x.shape[d] {
        return Err(format!(
            "split sizes sum to {total} but dim {d} has {}",
            x.shape[d]
        ));
    }
    Ok(sizes
        .iter()
        .map(|s| {
            let mut shape = x.shape.clone();
            shape[d] = s.clone();
            x.with_shape(shape)
        })
        .collect())
}

pub fn expand(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Expand { shape } = op else {
        unreachable!()
    };
    let x = ins[0];
    if shape.len() < x.rank() {
        return Err(format!(
            "cannot expand {x} to fewer dims {}",
            fmt_shape(shape)
        ));
    }
    let off = shape.len() - x.rank();
    for (i, d) in x.shape.iter().enumerate() {
        if *d != shape[off + i] && *d != Dim::from(1) {
            return Err(format!(
                "cannot expand dim {i} of size {d} to {}",
                shape[off + i]
            ));
        }
    }
    one(x.with_shape(shape.clone()))
}

pub fn gather(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Gather { dim } = op else {
        unreachable!()
    };
    let (x, idx) = (ins[0], ins[1]);
    want_int(idx, "index")?;
    norm_dim(*dim, x.rank())?;
    if idx.rank() != x.rank() {
        return Err(format!("gather index {idx} must have the rank of x {x}"));
    }
    one(x.with_shape(idx.shape.clone()))
}

pub fn index_select(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::IndexSelect { dim } = op else {
        unreachable!()
    };
    let (x, idx) = (ins[0], ins[1]);
    want_int(idx, "index")?;
    if idx.rank() != 1 {
        return Err(format!("index_select index must be 1-D, got {idx}"));
    }
    let d = norm_dim(*dim, x.rank())?;
    let mut shape = x.shape.clone();
    shape[d] = idx.shape[0].clone();
    one(x.with_shape(shape))
}

pub fn topk(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Topk { k, dim } = op else {
        unreachable!()
    };
    let x = ins[0];
    let d = norm_dim(*dim, x.rank())?;
    if let Some(n) = x.shape[d].as_const() {
        if *k < 1 || *k > n {
            return Err(format!("k = {k} is out of range for a dim of size {n}"));
        }
    }
    let mut shape = x.shape.clone();
    shape[d] = Dim::from(*k);
    Ok(vec![
        x.with_shape(shape.clone()),
        TensorType::new(DType::I64, shape),
    ])
}

pub fn one_hot(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::OneHot { num_classes, dtype } = op else {
        unreachable!()
    };
    want_int(ins[0], "index")?;
    let mut shape = ins[0].shape.clone();
    shape.push(Dim::from(*num_classes));
    one(TensorType::new(*dtype, shape))
}

pub fn scatter_add(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::ScatterAdd { dim } = op else {
        unreachable!()
    };
    let (dst, idx, src) = (ins[0], ins[1], ins[2]);
    want_int(idx, "index")?;
    same_dtype(dst, src, "dst and src")?;
    norm_dim(*dim, dst.rank())?;
    if idx.shape != src.shape || idx.rank() != dst.rank() {
        return Err(format!(
            "index {idx} and src {src} must match in shape and have the rank of dst {dst}"
        ));
    }
    one(dst.clone())
}

pub fn moe_dispatch(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::MoeDispatch { num_experts } = op else {
        unreachable!()
    };
    let (x, idx) = (ins[0], ins[1]);
    want_int(idx, "expert_index")?;
    if x.rank() != 2 || idx.rank() != 2 || x.shape[0] != idx.shape[0] {
        return Err(format!(
            "moe_dispatch needs x [T, H] and expert_index [T, k], got {x} and {idx}"
        ));
    }
    let rows = x.shape[0].clone() * idx.shape[1].clone();
    Ok(vec![
        x.with_shape(vec![rows.clone(), x.shape[1].clone()]),
        TensorType::new(DType::I64, vec![Dim::from(*num_experts)]),
        TensorType::new(DType::I64, vec![rows]),
    ])
}

pub fn grouped_matmul(op: &Op, ins: &[&TensorType]) -> Out {
    let transposed = matches!(op, Op::GroupedMatmul { transpose_w } if transpose_w.0);
    let (x, w, counts) = (ins[0], ins[1], ins[2]);
    want_int(counts, "counts")?;
    same_dtype(x, w, "x and w")?;
    let counts_ok = matches!(counts.rank(), 1 | 2) && counts.shape.last() == Some(&w.shape[0]);
    let (n_dim, k_dim) = if transposed { (2, 1) } else { (1, 2) };
    if x.rank() != 2 || w.rank() != 3 || !counts_ok || x.shape[1] != w.shape[k_dim] {
        let layout = if transposed {
            "[E, K, N] (transpose_w)"
        } else {
            "[E, N, K]"
        };
        return Err(format!("grouped_matmul needs x [M, K], w {layout}, counts [E] or [G, E], got {x}, {w}, {counts}"));
    }
    if let Some(b) = ins.get(3) {
        same_dtype(x, b, "x and bias")?;
        if b.shape != [w.shape[0].clone(), w.shape[n_dim].clone()] {
            return Err(format!(
                "grouped_matmul's bias must be [E, N] = [{}, {}], got {b}",
                w.shape[0], w.shape[n_dim]
            ));
        }
    }
    one(x.with_shape(vec![x.shape[0].clone(), w.shape[n_dim].clone()]))
}

pub fn moe_combine(_: &Op, ins: &[&TensorType]) -> Out {
    let (rows, order, w) = (ins[0], ins[1], ins[2]);
    want_int(order, "order")?;
    if rows.rank() != 2 || w.rank() != 2 || order.shape != [rows.shape[0].clone()] {
        return Err(format!("moe_combine needs rows [T*k, H], order [T*k], weights [T, k], got {rows}, {order}, {w}"));
    }
    if w.shape[0].clone() * w.shape[1].clone() != rows.shape[0] {
        return Err(format!(
            "weights {w} do not cover the {} rows",
            rows.shape[0]
        ));
    }
    one(rows.with_shape(vec![w.shape[0].clone(), rows.shape[1].clone()]))
}

fn axis_size(axis: &str) -> Dim {
    Dim::sym(axis)
}

pub fn all_to_all(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::AllToAll {
        axis,
        scatter_dim,
        gather_dim,
    } = op
    else {
        unreachable!()
    };
    let x = ins[0];
    let (s, g) = (
        norm_dim(*scatter_dim, x.rank())?,
        norm_dim(*gather_dim, x.rank())?,
    );
    let mut shape = x.shape.clone();
    shape[s] = shape[s].clone() / axis_size(axis);
    shape[g] = shape[g].clone() * axis_size(axis);
    one(x.with_shape(shape))
}

pub fn all_to_all_v(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::AllToAllV { axis, rows } = op else {
        unreachable!()
    };
    let (x, counts) = (ins[0], ins[1]);
    want_int(counts, "send_counts")?;
    if x.rank() == 0 {
        return Err(format!(
            "all_to_all_v sends rows of x, which must have rank >= 1, got {x}"
        ));
    }
    if counts.shape != [axis_size(axis)] {
        return Err(format!(
            "send_counts must be [{axis}] (rows for each rank of `{axis}`), got {counts}"
        ));
    }
    let mut shape = x.shape.clone();
    shape[0] = rows.clone();
    one(x.with_shape(shape))
}

pub fn all_gather(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::AllGather { axis, dim } = op else {
        unreachable!()
    };
    let x = ins[0];
    let d = norm_dim(*dim, x.rank())?;
    let mut shape = x.shape.clone();
    shape[d] = shape[d].clone() * axis_size(axis);
    one(x.with_shape(shape))
}

pub fn reduce_scatter(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::ReduceScatter { axis, dim, .. } = op else {
        unreachable!()
    };
    let x = ins[0];
    let d = norm_dim(*dim, x.rank())?;
    let mut shape = x.shape.clone();
    shape[d] = shape[d].clone() / axis_size(axis);
    one(x.with_shape(shape))
}

pub fn zigzag(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::Zigzag { dim, parts, .. } = op else {
        unreachable!()
    };
    let x = ins[0];
    let d = norm_dim(*dim, x.rank())?;
    if *parts < 1 {
        return Err(format!("zigzag needs parts >= 1, got {parts}"));
    }
    if let Some(n) = x.shape[d].as_const() {
        if n % (2 * parts) != 0 {
            return Err(format!(
                "zigzag: dim {d} of {x} does not split into {} equal chunks",
                2 * parts
            ));
        }
    }
    one(x.clone())
}

/// For `zigzag` over `2*parts` chunks: output chunk `i` reads input chunk `order[i]`.
pub fn zigzag_order(parts: usize, inverse: bool) -> Vec<usize> {
    let k = 2 * parts.max(1);
    let zz = |i: usize| {
        if i.is_multiple_of(2) {
            i / 2
        } else {
            k - 1 - i / 2
        }
    };
    let order: Vec<usize> = (0..k).map(zz).collect();
    if !inverse {
        return order;
    }
    let mut inv = vec![0usize; k];
    for (i, &z) in order.iter().enumerate() {
        inv[z] = i;
    }
    inv
}

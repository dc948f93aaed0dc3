//! `fuse`: replaces exact patterns of elementwise and norm ops by one fused op each, so
//! a step reads and writes those tensors once instead of once per op. It runs last, on
//! the finished program (after the parallel and training passes), so it sees and fuses
//! whatever they made: sharded ops, backward ops, recomputed copies (checkpoint) and
//! values brought back from the host (offload).
//!
//! The patterns, each fused only where the types are exactly the unfused ones (same
//! type on both operands, no broadcasting), so the fused op computes the same thing:
//! - `glu_grad`: `act_grad(g, mul(dy, u))` and `mul(dy, act(g'))` where `g'` is `g` or
//!   the value `g` was offloaded from (`act` is `silu`, `gelu` or `gelu {tanh}`, and
//!   `act_grad` its `silu_grad` / `gelu_grad`), the first `mul` read only there: one
//!   `glu_grad(g, u, dy)` gives both gradients. The forward's `act(g')` is then no
//!   longer saved for the backward.
//! - `glu`: `mul(act(g), u)` (either operand order) where `act(g)` has no other reader.
//! - `add_rms_norm_grad`: `add(rms_norm_grad(s, w, dn).dx, other)` (either order), the
//!   `dx` read only by that add: the gradient of the residual stream `s` from the norm
//!   plus what it gets from its other readers, and the norm weight's gradient.
//! - `add_rms_norm`: `rms_norm(add(x, y), w)`: the sum stays a result (the next residual
//!   add and the backward read it).
//! - `matmul_add`: `add(matmul(a, b), c)` (either order), the product read only by that
//!   add and `c` of the product's type exactly: one GEMM accumulates into `c` (cuBLASLt's
//!   beta = 1) instead of a second pass over memory. Autodiff makes these sums where a
//!   value has several readers (the residual stream's gradient from q, k and v, from gate
//!   and up). Matched after the norm patterns, so an `add` that `add_rms_norm_grad` takes
//!   stays there. The sum is rounded once (the unfused pair rounds the product first).
//! - `embedding_grad` with an `init`: `add(embedding_grad(ids, dy), c)` (either order),
//!   the table gradient read only by that add and `c` of its type (a tied lm_head's
//!   weight gradient, computed long before the embedding's): the rows are added into
//!   `c`, in its bytes, instead of into zeros that a second pass then adds to `c`.
//! - `adamw_master`: `cast(adamw(master, cast_f32(g), m, v, step).master, low)`, the
//!   mixed-precision update the `optimizer` pass writes for f32 master weights of a
//!   bf16/f16 parameter: the widened gradient read only by that `adamw`, the new master
//!   read by that one cast (and returned, as the next step's master), the gradient and
//!   the cast of one dtype and the moments f32. One pass reads the low-precision
//!   gradient and writes the new master, moments and parameter.
//! - Both norm patterns also where the norm runs in f32 on a bf16/f16 stream between a
//!   widening cast and the cast back (Gemma's `(1 + w)` norms in bf16):
//!   `cast(rms_norm(cast_f32(add(x, y)), w))` and
//!   `add(cast(rms_norm_grad(cast_f32(s), w, cast_f32(dn)).dx), other)`. The fused
//!   kernels compute in f32 from the same values and round once where the casts round;
//!   only the order of the f32 sum of squares may differ from the f32 kernel's.
//!
//! - `linear_cross_entropy_with_grad`: the fused loss's forward op and its gradient op,
//!   where the gradient's inputs do not depend on the forward's statistics (see
//!   [`super::loss_with_grad`]): the logits are computed once, not again in the backward.
//! - `layout=bshd` attention (see [`super::head_layout`]): the transposes between the
//!   q/k/v projections' [B, S, H, D] and the [B, H, S, D] of `rope` and `attention`
//!   (forward and backward) are commuted into those ops and cancelled.
//!
//! The head layout is rewritten before the other patterns (it touches none of their ops).
//! The backward patterns are matched before the forward ones: fusing them frees the
//! forward's activation, which lets its forward pattern fuse. A fused node takes the place of the first node it
//! replaces when its operands are all computed by then, else the place just after its
//! last operand when that is still before every reader of its results; otherwise the
//! pattern stays unfused. Dead nodes left behind (the activation, its offload copies) are
//! removed. Each fused node says so in its provenance.

use crate::canonicalize::dce;
use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::readers::Readers;
use weft_ir::{At, DType, GateAct, Graph, Node, NodeMeta, Op, Provenance, Value};

pub struct Fuse;

pub const NAME: &str = "fuse";

impl Pass for Fuse {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "fuse the lm_head + cross-entropy with its gradient (linear_cross_entropy_with_grad), SwiGLU/GeGLU (glu, glu_grad), residual add + rms_norm (add_rms_norm, add_rms_norm_grad), GEMM accumulation (matmul_add), the mixed-precision AdamW update with its casts (adamw_master), and attention/rope in [B, S, H, D] (layout=bshd) without the transposes around them"
    }
    fn run(&self, g: &mut Graph, _cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        let layout = super::head_layout::attention_to_bshd(g)?;
        let loss_with_grad = super::loss_with_grad::fuse_loss_with_grad(g)?;
        let glu_grad = fuse_glu_grads(g)?;
        let norm_grad = fuse_add_rms_norm_grads(g)?;
        // The activations the fused backward no longer reads (and their offload
        // copies) go first, so that each `act` is read by its `mul` alone.
        let dead = dce(g);
        let glu = fuse_glus(g)?;
        let norm = fuse_add_rms_norms(g)?;
        let matmul_add = fuse_matmul_adds(g)?;
        let embedding_grad = fuse_embedding_grad_adds(g)?;
        let adamw = fuse_adamw_casts(g)?;
        let dead = dead + dce(g);
        res.count("glu", glu as u64)
            .count("linear_cross_entropy_with_grad", loss_with_grad as u64)
            .count("glu_grad", glu_grad as u64)
            .count("add_rms_norm", norm as u64)
            .count("add_rms_norm_grad", norm_grad as u64)
            .count("matmul_add", matmul_add as u64)
            .count("embedding_grad_init", embedding_grad as u64)
            .count("adamw_master", adamw as u64)
            .count("attention_bshd", layout.attention as u64)
            .count("rope_bshd", layout.rope as u64)
            .count("transpose_pairs_cancelled", layout.cancelled as u64)
            .count("dce_removed", dead as u64);
        res.changed = glu
            + loss_with_grad
            + glu_grad
            + norm
            + norm_grad
            + matmul_add
            + embedding_grad
            + adamw
            + layout.attention
            + layout.rope
            + layout.cancelled
            > 0;
        Ok(res)
    }
}

/// The activation a unary op computes, for ops a `glu` can fuse.
fn gate_act(op: &Op) -> Option<GateAct> {
    match op {
        Op::Silu {} => Some(GateAct::Silu),
        Op::Gelu { tanh_approx: false } => Some(GateAct::Gelu),
        Op::Gelu { tanh_approx: true } => Some(GateAct::GeluTanh),
        _ => None,
    }
}

/// The activation whose gradient a backward op computes (`silu_grad`, `gelu_grad`).
fn grad_act(op: &Op) -> Option<GateAct> {
    match op {
        Op::SiluGrad {} => Some(GateAct::Silu),
        Op::GeluGrad { tanh_approx: false } => Some(GateAct::Gelu),
        Op::GeluGrad { tanh_approx: true } => Some(GateAct::GeluTanh),
        _ => None,
    }
}

/// The value `v` is a copy of: through `reload(offload(x))` (host copies keep every
/// bit), else `v` itself.
pub(super) fn origin(g: &Graph, mut v: Value) -> Value {
    loop {
        match g.op_of(v) {
            Op::Reload { .. } | Op::Offload { .. } => v = g.node(g.def(v)).operands[0],
            _ => return v,
        }
    }
}

/// The other operand of a binary node `n` when one of its operands is `v`.
fn other_operand(g: &Graph, n: Node, v: Value) -> Option<Value> {
    match g.node(n).operands.as_slice() {
        [a, b] if *a == v => Some(*b),
        [a, b] if *b == v => Some(*a),
        _ => None,
    }
}

/// Where a node with `operands` that replaces `replaced` (whose results it takes over)
/// can go: before the first replaced node when every operand is computed by then, else
/// just after the last operand's node when that is before every reader of the replaced
/// nodes' results (outside the replaced nodes). `None`: nowhere that keeps the order.
fn placement(g: &Graph, rd: &Readers, operands: &[Value], replaced: &[Node]) -> Option<At> {
    let order = g.nodes();
    let first = replaced.iter().filter_map(|&n| g.position(n)).min()?;
    let last_operand = operands
        .iter()
        .filter_map(|&v| g.position(g.def(v)))
        .max()
        .unwrap_or(0);
    if operands.is_empty() || last_operand < first {
        return Some(At::Before(order[first]));
    }
    let results: Vec<Value> = replaced
        .iter()
        .flat_map(|&n| g.node(n).results.clone())
        .collect();
    let first_reader = rd.first_reader(g, &results, replaced).unwrap_or(usize::MAX);
    (last_operand < first_reader).then(|| At::After(order[last_operand]))
}

/// The metadata of a node `fuse` inserts in place of `template`: its scope, derivation
/// and micro-batch, and a `fuse` provenance giving `reason`.
pub(super) fn fused_meta(g: &Graph, template: Node, reason: String) -> NodeMeta {
    let t = &g.node(template).meta;
    NodeMeta {
        source: t.source.clone(),
        derived: t.derived,
        micro_batch: t.micro_batch,
        provenance: Some(Provenance {
            pass: NAME.into(),
            reason,
        }),
    }
}

/// Inserts the fused node at `at` with `template`'s scope, derivation and micro-batch,
/// and a provenance naming what it replaced.
fn insert_fused(
    g: &mut Graph,
    rd: &mut Readers,
    at: At,
    op: Op,
    operands: &[Value],
    template: Node,
    replaced: &str,
) -> Result<Vec<Value>, PassError> {
    let meta = fused_meta(g, template, format!("fuses {replaced}"));
    let location = g.describe(template);
    rd.insert(g, at, op, operands, meta)
        .map_err(|e| PassError::rewrite(NAME, "cannot insert a fused op", location, e.to_string()))
}

/// `act_grad(g, mul(dy, u))` with `mul(dy, act(g'))`, `g'` a copy of `g` -> `glu_grad`.
fn fuse_glu_grads(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let candidates: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| grad_act(&g.node(n).op).is_some())
        .collect();
    for ag in candidates {
        let d = g.node(ag);
        let act = grad_act(&d.op).expect("a candidate");
        let (gate, dact) = (d.operands[0], d.operands[1]);
        let m1 = g.def(dact);
        if !matches!(g.node(m1).op, Op::Mul {}) || !rd.read_only_by(g, dact, ag) {
            continue;
        }
        let ty = g.ty(gate).clone();
        // mul(dy, u) in either order: try both operands as dy, and every mul(dy, a)
        // with a = act(g') and g' a copy of g, until one has a place in the order.
        let m1_ops = g.node(m1).operands.clone();
        let mut found = None;
        for (dy, up) in [(m1_ops[0], m1_ops[1]), (m1_ops[1], m1_ops[0])] {
            if g.ty(dy) != &ty || g.ty(up) != &ty || g.ty(dact) != &ty {
                continue;
            }
            let mut pairs: Vec<Node> = rd
                .of_value(dy)
                .iter()
                .map(|&(n, _)| n)
                .filter(|&n| {
                    n != m1
                        && matches!(g.node(n).op, Op::Mul {})
                        && other_operand(g, n, dy).is_some_and(|a| {
                            let an = g.node(g.def(origin(g, a)));
                            gate_act(&an.op) == Some(act)
                                && origin(g, an.operands[0]) == origin(g, gate)
                                && g.ty(a) == &ty
                        })
                        && g.ty(g.node(n).results[0]) == &ty
                })
                .collect();
            // Program order, as the first fitting pair is taken.
            pairs.sort_by_key(|&n| g.position(n));
            pairs.dedup();
            for m2 in pairs {
                if let Some(at) = placement(g, &rd, &[gate, up, dy], &[ag, m2]) {
                    found = Some((dy, up, m2, at));
                    break;
                }
            }
            if found.is_some() {
                break;
            }
        }
        let Some((dy, up, m2, at)) = found else {
            continue;
        };
        let operands = [gate, up, dy];
        let r = insert_fused(
            g,
            &mut rd,
            at,
            Op::GluGrad { act },
            &operands,
            ag,
            &format!(
                "`{}` and the two `mul`s of the gated unit's backward",
                g.node(ag).op.name()
            ),
        )?;
        let (dgate, dup) = (g.node(ag).results[0], g.node(m2).results[0]);
        rd.replace_all_uses(g, dgate, r[0]);
        rd.replace_all_uses(g, dup, r[1]);
        rd.remove_nodes(g, &[ag, m1, m2]);
        fused += 1;
    }
    Ok(fused)
}

/// Whether `m` reads operand `slot` only to wait for it: the `after` operands of a host
/// copy (`offload`, `reload`), which read no elements, in any layout.
pub(crate) fn ordering_only(g: &Graph, m: Node, slot: usize) -> bool {
    slot > 0 && matches!(g.node(m).op, Op::Offload { .. } | Op::Reload { .. })
}

/// `mul(act(g), u)` with `act(g)` read only there (and by host copies that wait for it,
/// which then wait for the fused op) -> `glu(g, u)`.
fn fuse_glus(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let candidates: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::Mul {}))
        .collect();
    for m in candidates {
        let ops = g.node(m).operands.clone();
        let ty = g.ty(g.node(m).results[0]).clone();
        let mut found = None;
        for (a, up) in [(ops[0], ops[1]), (ops[1], ops[0])] {
            let an = g.def(a);
            let Some(act) = gate_act(&g.node(an).op) else {
                continue;
            };
            let gate = g.node(an).operands[0];
            let readers = rd.of_value(a);
            if a != up
                && readers.iter().any(|&(r, _)| r == m)
                && readers
                    .iter()
                    .all(|&(r, slot)| r == m || ordering_only(g, r, slot))
                && g.ty(gate) == &ty
                && g.ty(up) == &ty
                && g.ty(a) == &ty
            {
                found = Some((act, an, gate, up));
                break;
            }
        }
        let Some((act, an, gate, up)) = found else {
            continue;
        };
        let operands = [gate, up];
        let Some(at) = placement(g, &rd, &operands, &[an, m]) else {
            continue;
        };
        let what = format!("`{}` and `mul` of a gated unit", g.node(an).op.name());
        let waits: Vec<(Node, usize)> = rd
            .of_value(g.node(an).results[0])
            .iter()
            .copied()
            .filter(|&(r, _)| r != m)
            .collect();
        let r = insert_fused(g, &mut rd, at, Op::Glu { act }, &operands, m, &what)?;
        let y = g.node(m).results[0];
        rd.replace_all_uses(g, y, r[0]);
        if !waits.is_empty() {
            let glu = g.def(r[0]);
            for &(w, slot) in &waits {
                rd.set_operand(g, w, slot, r[0]);
            }
            let moved: Vec<Node> = waits.iter().map(|&(w, _)| w).collect();
            let mut order: Vec<Node> = Vec::with_capacity(g.nodes().len());
            for &n in g.nodes() {
                if moved.contains(&n) {
                    continue;
                }
                order.push(n);
                if n == glu {
                    order.extend(&moved);
                }
            }
            g.set_order(order);
        }
        rd.remove_nodes(g, &[m, an]);
        fused += 1;
    }
    Ok(fused)
}

/// `x` when `v` is `cast(x) {dtype=f32}` of a narrower float `x` (bf16, f16): the
/// widening cast of a norm computed in f32 (Gemma's), exact.
fn widened(g: &Graph, v: Value) -> Option<Value> {
    let d = g.node(g.def(v));
    match d.op {
        Op::Cast { dtype: DType::F32 } => {
            let x = d.operands[0];
            matches!(g.ty(x).dtype, DType::BF16 | DType::F16).then_some(x)
        }
        _ => None,
    }
}

/// The node rounding `v` back to `dtype` when that cast is `v`'s only reader.
fn narrowed(g: &Graph, rd: &Readers, v: Value, dtype: DType) -> Option<Node> {
    let [(c, _)] = rd.of_value(v) else {
        return None;
    };
    (matches!(g.node(*c).op, Op::Cast { dtype: d } if d == dtype) && rd.read_only_by(g, v, *c))
        .then_some(*c)
}

/// `add(rms_norm_grad(s, w, dn).dx, other)` -> `add_rms_norm_grad(s, w, dn, other)`;
/// also with the norm in f32 on a narrower stream (Gemma in bf16):
/// `add(cast(rms_norm_grad(cast_f32(s), w, cast_f32(dn)).dx), other)`.
fn fuse_add_rms_norm_grads(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let candidates: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::RmsNormGrad { .. }))
        .collect();
    for rg in candidates {
        let d = g.node(rg);
        let Op::RmsNormGrad { eps } = d.op else {
            unreachable!("a candidate")
        };
        let (x, w, dy) = (d.operands[0], d.operands[1], d.operands[2]);
        let (dx, dw) = (d.results[0], d.results[1]);
        // (s, dn, the stream's gradient from the norm, the cast that rounds it)
        let (s, dn, dx, round) = match (widened(g, x), widened(g, dy)) {
            (Some(s), Some(dn)) if g.ty(s) == g.ty(dn) => {
                match narrowed(g, &rd, dx, g.ty(s).dtype) {
                    Some(c) => (s, dn, g.node(c).results[0], Some(c)),
                    None => continue,
                }
            }
            _ => (x, dy, dx, None),
        };
        let ty = g.ty(s).clone();
        let [(add, _)] = rd.of_value(dx) else {
            continue;
        };
        let add = *add;
        if !matches!(g.node(add).op, Op::Add {}) || !rd.read_only_by(g, dx, add) {
            continue;
        }
        let Some(other) = other_operand(g, add, dx) else {
            continue;
        };
        let sum = g.node(add).results[0];
        if other == dx || g.ty(other) != &ty || g.ty(sum) != &ty || g.ty(dn) != &ty {
            continue;
        }
        let operands = [s, w, dn, other];
        let mut replaced = vec![rg, add];
        replaced.extend(round);
        let Some(at) = placement(g, &rd, &operands, &replaced) else {
            continue;
        };
        let what = if round.is_some() {
            "`rms_norm_grad` (in f32, between casts) and the `add` of the residual stream's gradient"
        } else {
            "`rms_norm_grad` and the `add` of the residual stream's gradient"
        };
        let r = insert_fused(
            g,
            &mut rd,
            at,
            Op::AddRmsNormGrad { eps },
            &operands,
            rg,
            what,
        )?;
        rd.replace_all_uses(g, sum, r[0]);
        rd.replace_all_uses(g, dw, r[1]);
        rd.remove_nodes(g, &replaced);
        fused += 1;
    }
    Ok(fused)
}

/// `rms_norm(add(x, y), w)` -> `add_rms_norm(x, y, w)` (the sum a result too); also with
/// the norm in f32 on a narrower stream (Gemma in bf16):
/// `cast(rms_norm(cast_f32(add(x, y)), w))`, the cast back to the stream's dtype.
fn fuse_add_rms_norms(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let candidates: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::RmsNorm { .. }))
        .collect();
    for rn in candidates {
        // An earlier fusion may have taken this norm's add (two norms of one sum).
        if g.try_node(rn).is_none() {
            continue;
        }
        let d = g.node(rn);
        let Op::RmsNorm { eps } = d.op else {
            unreachable!("a candidate")
        };
        let (x, w) = (d.operands[0], d.operands[1]);
        let normed = d.results[0];
        // (the sum, the normed value in the stream's dtype, the cast that rounds it)
        let (s, normed, round) = match widened(g, x) {
            Some(s) => match narrowed(g, &rd, normed, g.ty(s).dtype) {
                Some(c) => (s, g.node(c).results[0], Some(c)),
                None => continue,
            },
            None => (x, normed, None),
        };
        let add = g.def(s);
        if !matches!(g.node(add).op, Op::Add {}) {
            continue;
        }
        let (a, b) = (g.node(add).operands[0], g.node(add).operands[1]);
        let ty = g.ty(s).clone();
        if g.ty(a) != &ty || g.ty(b) != &ty || g.ty(normed) != &ty {
            continue;
        }
        let operands = [a, b, w];
        let mut replaced = vec![add, rn];
        replaced.extend(round);
        if round.is_some() && rd.read_only_by(g, x, rn) {
            // the widening cast goes too (the backward, fused first, no longer reads it)
            replaced.push(g.def(x));
        }
        let Some(at) = placement(g, &rd, &operands, &replaced) else {
            continue;
        };
        let what = if round.is_some() {
            "the residual `add` and the `rms_norm` (in f32, between casts) of its sum"
        } else {
            "the residual `add` and the `rms_norm` of its sum"
        };
        let r = insert_fused(g, &mut rd, at, Op::AddRmsNorm { eps }, &operands, rn, what)?;
        rd.replace_all_uses(g, s, r[0]);
        rd.replace_all_uses(g, normed, r[1]);
        // (with a cast, the f32 norm's result was read only by that cast)
        rd.remove_nodes(g, &replaced);
        fused += 1;
    }
    Ok(fused)
}

/// `add(matmul(a, b), c)` -> `matmul_add(a, b, c)` in the product's place, where `c` is
/// computed by then: the GEMM still reads its weight where the unfused one did (before
/// the optimizer updates it in place). Where both operands are products, the later one
/// accumulates into the earlier. A sum of several products, `add(matmul_add(.., c0), p)`
/// with the product `p` computed before that GEMM, is reassociated to
/// `matmul_add(.., add(c0, p))` and its new inner `add` fused in turn, so every product
/// of a sum accumulates into the one before it (the residual stream's gradient from v, k
/// then q: one plain GEMM and two accumulating ones).
fn fuse_matmul_adds(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let mut work: std::collections::VecDeque<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::Add {}))
        .collect();
    while let Some(add) = work.pop_front() {
        if g.position(add).is_none() {
            continue;
        }
        let pos = |g: &Graph, v: Value| g.position(g.def(v)).unwrap_or(0);
        let ops = g.node(add).operands.clone();
        let [x, y] = ops[..] else { continue };
        let sum = g.node(add).results[0];
        let is_product = |v: Value| {
            matches!(g.op_of(v), Op::Matmul { .. })
                && rd.read_only_by(g, v, add)
                && g.ty(v) == g.ty(sum)
        };
        let mut pairs: Vec<(Value, Value)> = [(x, y), (y, x)]
            .into_iter()
            .filter(|&(p, c)| p != c && is_product(p) && g.ty(c) == g.ty(sum))
            .collect();
        pairs.sort_by_key(|&(p, _)| std::cmp::Reverse(pos(g, p)));
        if let Some(&(product, c)) = pairs.iter().find(|&&(p, c)| pos(g, c) < pos(g, p)) {
            let mm = g.def(product);
            let Op::Matmul {
                transpose_a,
                transpose_b,
            } = g.node(mm).op.clone()
            else {
                continue;
            };
            let operands = [g.node(mm).operands[0], g.node(mm).operands[1], c];
            let r = insert_fused(
                g,
                &mut rd,
                At::Before(mm),
                Op::MatmulAdd {
                    transpose_a,
                    transpose_b,
                },
                &operands,
                mm,
                "a `matmul` and the `add` of its product (one GEMM accumulating into the addend)",
            )?;
            rd.replace_all_uses(g, sum, r[0]);
            rd.remove_nodes(g, &[add, mm]);
            fused += 1;
            continue;
        }
        // add(matmul_add(.., c0), p) with p computed first: p joins c0 inside.
        let Some(&(product, acc)) = pairs.first() else {
            continue;
        };
        let m = g.def(acc);
        if !matches!(g.node(m).op, Op::MatmulAdd { .. }) || !rd.read_only_by(g, acc, add) {
            continue;
        }
        let c0 = g.node(m).operands[2];
        if g.ty(c0) != g.ty(product) {
            continue;
        }
        let meta = g.node(add).meta.clone();
        let location = g.describe(add);
        let inner = rd
            .insert(g, At::Before(m), Op::Add {}, &[c0, product], meta)
            .map_err(|e| {
                PassError::rewrite(NAME, "cannot reassociate a sum", location, e.to_string())
            })?[0];
        rd.set_operand(g, m, 2, inner);
        rd.replace_all_uses(g, sum, acc);
        rd.remove_nodes(g, &[add]);
        work.push_front(g.def(inner));
    }
    Ok(fused)
}

/// `add(embedding_grad(ids, dy), c)` -> `embedding_grad(ids, dy, c)` where the embedding's
/// own gradient was (`c`, a tied lm_head's weight gradient, is ready long before).
fn fuse_embedding_grad_adds(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let candidates: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::Add {}))
        .collect();
    for add in candidates {
        let ops = g.node(add).operands.clone();
        let [x, y] = ops[..] else { continue };
        let sum = g.node(add).results[0];
        let found = [(x, y), (y, x)].into_iter().find(|&(e, c)| {
            e != c
                && matches!(g.op_of(e), Op::EmbeddingGrad { .. })
                && g.node(g.def(e)).operands.len() == 2
                && rd.read_only_by(g, e, add)
                && g.ty(c) == g.ty(e)
                && g.ty(sum) == g.ty(e)
        });
        let Some((rows, c)) = found else { continue };
        let eg = g.def(rows);
        let op = g.node(eg).op.clone();
        let operands = [g.node(eg).operands[0], g.node(eg).operands[1], c];
        let Some(at) = placement(g, &rd, &operands, &[eg, add]) else {
            continue;
        };
        let r = insert_fused(
            g,
            &mut rd,
            at,
            op,
            &operands,
            eg,
            "an `embedding_grad` and the `add` of its table gradient (the rows are added into the addend)",
        )?;
        rd.replace_all_uses(g, sum, r[0]);
        rd.remove_nodes(g, &[add, eg]);
        fused += 1;
    }
    Ok(fused)
}

/// `cast(adamw(master, cast_f32(g), m, v, step).master, low)` ->
/// `adamw_master(master, g, m, v, step) {dtype=low}`.
fn fuse_adamw_casts(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let candidates: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::AdamW { .. }))
        .collect();
    for a in candidates {
        let Op::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
        } = g.node(a).op.clone()
        else {
            continue;
        };
        let ops = g.node(a).operands.clone();
        let new_master = g.node(a).results[0];
        if g.ty(ops[0]).dtype != DType::F32 {
            continue;
        }
        let Some(low_grad) = widened(g, ops[1]).filter(|_| rd.read_only_by(g, ops[1], a)) else {
            continue;
        };
        let [(c, _)] = rd.of_value(new_master) else {
            continue;
        };
        let c = *c;
        let Op::Cast { dtype } = g.node(c).op else {
            continue;
        };
        // The fused kernels read the gradient in the parameter's dtype and keep f32
        // moments.
        if !matches!(dtype, DType::BF16 | DType::F16)
            || g.ty(low_grad).dtype != dtype
            || g.ty(ops[2]).dtype != DType::F32
            || g.ty(ops[3]).dtype != DType::F32
        {
            continue;
        }
        let operands = [ops[0], low_grad, ops[2], ops[3], ops[4]];
        let widen = g.def(ops[1]);
        let Some(at) = placement(g, &rd, &operands, &[widen, a, c]) else {
            continue;
        };
        let op = Op::AdamWMaster {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            dtype,
            warmup,
        };
        let what = "the gradient's widening `cast`, `adamw` on the f32 master and the `cast` back";
        let r = insert_fused(g, &mut rd, at, op, &operands, a, what)?;
        let old = g.node(a).results.clone();
        for (o, n) in old.iter().zip(&r) {
            rd.replace_all_uses(g, *o, *n);
        }
        let low = g.node(c).results[0];
        rd.replace_all_uses(g, low, r[3]);
        rd.remove_nodes(g, &[c, a, widen]);
        fused += 1;
    }
    Ok(fused)
}

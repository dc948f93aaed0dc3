//! `fuse`'s loss pattern: `linear_cross_entropy` and its `linear_cross_entropy_grad`
//! become one `linear_cross_entropy_with_grad`, so a training step computes the lm_head's
//! logits once instead of once in the forward and again, chunk by chunk, in the backward.
//!
//! The gradient op reads the forward's lse and the gradients `dlse`, `dtarget` of its
//! statistics. Where those gradients do not depend on the statistics (a plain or a mean
//! cross-entropy: they are the loss's seed over the token count, masked by the labels),
//! they can be computed before the forward op, and the fused op computes everything
//! where the forward op was: the nodes that compute them (after the forward op in the
//! program order, at the start of the backward) move to just before it. Where they do
//! depend on the statistics (a vocabulary split over `tp` ranks: each shard's share of
//! the global log-sum-exp is `exp(lse_shard - lse)`), the pair stays as it is.
//!
//! The forward and gradient ops must agree on their attributes and read the same x, w
//! and labels (x possibly through host copies or a checkpoint recompute of it, w gathered
//! again by ZeRO-3; the copies are then dead). The fused op chunks over the tokens: as many rows as keep
//! one chunk's [rows, vocab] logits under [`ROW_SCRATCH_BYTES`].

use super::fuse::{fused_meta, origin};
use crate::pass::PassError;
use crate::readers::Readers;
use std::collections::HashSet;
use weft_ir::{At, DerivedKind, Graph, Node, Op, Value};

/// Scratch one chunk of whole-vocabulary logits may take, in x's dtype.
pub const ROW_SCRATCH_BYTES: i64 = 512 << 20;
/// The fewest token rows per chunk, and the multiple chunks are rounded down to.
pub const MIN_ROWS: i64 = 64;
/// The most nodes the gradients' computation may take to be moved (a cross-entropy's is
/// about ten); beyond it the pair stays unfused.
const MAX_MOVED: usize = 256;

/// Token rows per chunk for a vocabulary of `vocab` rows (None: symbolic) of `elem`
/// bytes each.
pub fn rows_for(vocab: Option<i64>, elem: i64) -> i64 {
    match vocab {
        Some(v) if v > 0 => {
            (ROW_SCRATCH_BYTES / v.saturating_mul(elem.max(1))) / MIN_ROWS * MIN_ROWS
        }
        _ => ROW_SCRATCH_BYTES / (1 << 20) / MIN_ROWS * MIN_ROWS,
    }
    .max(MIN_ROWS)
}

/// Fuses every forward/gradient pair it can; returns how many.
pub(super) fn fuse_loss_with_grad(g: &mut Graph) -> Result<usize, PassError> {
    let mut fused = 0;
    let mut rd = Readers::of(g);
    let grads: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::LinearCrossEntropyGrad { .. }))
        .collect();
    for grad in grads {
        let Some(fwd) = forward_of(g, grad) else {
            continue;
        };
        let ops = g.node(grad).operands.clone();
        let (dlse, dtarget) = (ops[4], ops[5]);
        let Some(moved) = computed_after(g, &[dlse, dtarget], fwd) else {
            continue;
        };
        let Op::LinearCrossEntropyGrad {
            ignore_index,
            scale,
            softcap,
            ..
        } = g.node(grad).op.clone()
        else {
            continue;
        };
        let f_ops = g.node(fwd).operands.clone();
        let w_ty = g.ty(f_ops[1]).clone();
        let rows = rows_for(w_ty.shape[0].as_const(), w_ty.dtype.size_bytes() as i64);
        // The gradients' computation goes just before the forward op, in its order.
        if !moved.is_empty() {
            let order: Vec<Node> = g.nodes().to_vec();
            let mut reordered = Vec::with_capacity(order.len());
            for &n in &order {
                if n == fwd {
                    reordered.extend(order.iter().copied().filter(|m| moved.contains(m)));
                }
                if !moved.contains(&n) {
                    reordered.push(n);
                }
            }
            g.set_order(reordered);
        }
        let meta = fused_meta(
            g,
            fwd,
            "fuses `linear_cross_entropy` and its `linear_cross_entropy_grad` (the logits computed once, chunked over the tokens)".into(),
        );
        let location = g.describe(fwd);
        let r = rd
            .insert(
                g,
                At::Before(fwd),
                Op::LinearCrossEntropyWithGrad {
                    ignore_index,
                    rows,
                    scale,
                    softcap,
                },
                &[f_ops[0], f_ops[1], f_ops[2], dlse, dtarget],
                meta,
            )
            .map_err(|e| {
                PassError::rewrite(
                    super::fuse::NAME,
                    "cannot insert a fused op",
                    location,
                    e.to_string(),
                )
            })?;
        let (f_res, g_res) = (g.node(fwd).results.clone(), g.node(grad).results.clone());
        for (old, new) in f_res.into_iter().chain(g_res).zip(r) {
            rd.replace_all_uses(g, old, new);
        }
        rd.remove_nodes(g, &[grad, fwd]);
        fused += 1;
    }
    Ok(fused)
}

/// The `linear_cross_entropy` whose lse `grad` reads, when it has the same attributes
/// (the chunk aside) and reads the same x, w and labels.
fn forward_of(g: &Graph, grad: Node) -> Option<Node> {
    let gd = g.node(grad);
    let fwd = g.def(gd.operands[3]);
    let fd = g.node(fwd);
    let (
        Op::LinearCrossEntropy {
            ignore_index: i1,
            scale: s1,
            softcap: c1,
            ..
        },
        Op::LinearCrossEntropyGrad {
            ignore_index: i2,
            scale: s2,
            softcap: c2,
            ..
        },
    ) = (&fd.op, &gd.op)
    else {
        return None;
    };
    let same_attrs = i1 == i2 && s1 == s2 && c1 == c2;
    let same_reads = gd.operands[3] == fd.results[0]
        && (0..3).all(|i| same_value(g, fd.operands[i], gd.operands[i]));
    (same_attrs && same_reads).then_some(fwd)
}

/// `b` holds `a`'s elements: the same value, a host copy of it, a recompute of it, or the
/// same result of the same op on values that hold the same elements (ZeRO-3's backward
/// gathers a parameter again), looking at most [`SAME_DEPTH`] ops back.
fn same_value(g: &Graph, a: Value, b: Value) -> bool {
    same_within(g, a, b, SAME_DEPTH)
}

const SAME_DEPTH: usize = 8;

fn same_within(g: &Graph, a: Value, b: Value, depth: usize) -> bool {
    let (a, b) = (origin(g, a), origin(g, b));
    if a == b {
        return true;
    }
    let (an, bn) = (g.node(g.def(a)), g.node(g.def(b)));
    if matches!(bn.meta.derived, Some(d) if d.kind == DerivedKind::Recompute && d.of == a)
        && bn.results.len() == 1
    {
        return true;
    }
    let index = |n: &weft_ir::NodeData, v: Value| n.results.iter().position(|&r| r == v);
    depth > 0
        && an.op == bn.op
        && !an.operands.is_empty()
        && an.operands.len() == bn.operands.len()
        && index(an, a) == index(bn, b)
        && an
            .operands
            .iter()
            .zip(&bn.operands)
            .all(|(&x, &y)| same_within(g, x, y, depth - 1))
}

/// The nodes after `fwd` in the program order that `values` are computed from (in no
/// particular order), or None when they depend on `fwd` itself, or take more than
/// [`MAX_MOVED`] nodes.
fn computed_after(g: &Graph, values: &[Value], fwd: Node) -> Option<HashSet<Node>> {
    let order = g.nodes();
    let mut pos = vec![usize::MAX; order.iter().map(|n| n.0 as usize + 1).max().unwrap_or(0)];
    for (i, n) in order.iter().enumerate() {
        pos[n.0 as usize] = i;
    }
    let at = pos[fwd.0 as usize];
    let mut found = HashSet::new();
    let mut stack: Vec<Node> = values.iter().map(|&v| g.def(v)).collect();
    while let Some(n) = stack.pop() {
        if n == fwd {
            return None;
        }
        if pos[n.0 as usize] < at || !found.insert(n) {
            continue;
        }
        if found.len() > MAX_MOVED {
            return None;
        }
        stack.extend(g.node(n).operands.iter().map(|&v| g.def(v)));
    }
    Some(found)
}

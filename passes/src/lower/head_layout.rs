//! `fuse`'s head-layout rewrite: the q/k/v projections produce [B, S, H, D], and the
//! imported models transpose them to [B, H, S, D] for `rope` and `attention`, then
//! transpose the attention output back (and the backward mirrors each transpose around
//! `attention_grad` and rope's gradient). `attention`, `attention_grad` and `rope` take
//! `layout=bshd`, so the transposes are commuted into them and cancelled:
//!
//! 1. An `attention` / `attention_grad` of the default layout whose every per-head
//!    operand (q, k, v; and out, dout for the gradient) is a swap of dims 1 and 2 of some
//!    `x` (a `transpose`, or a `permute [0, 2, 1, 3]`), or a default-layout `rope` of
//!    such a value, or a host copy (`reload(offload(.))`, activation offload) of either,
//!    becomes the same op with `layout=bshd` on the `x`s (each such rope becomes a
//!    `layout=bshd` rope of its `x`, made once however many nodes read it; each host
//!    copy the same copies of the [B, S, H, D] value).
//!    Its per-head results (out; dq, dk, dv) are read through a new transpose back to
//!    [B, H, S, D]; the log-sum-exp and dsinks keep their shapes and readers. Only where
//!    this adds no work: those transposes must cancel and the old ropes die (see
//!    `worth_rewriting`).
//! 2. A default-layout `rope` of a swapped `x` whose readers are all swaps back (rope's
//!    gradient between `attention_grad` and the transposes autodiff wrote) becomes a
//!    `layout=bshd` rope of `x` read in their place.
//! 3. A swap of a swap is its operand.
//!
//! Each step is an exact identity (the same elements, computed by the same arithmetic in
//! another memory order), so a value another reader still needs in [B, H, S, D] keeps
//! a transpose. `ring_attention` and `attention_block_grad` are left alone. The dead
//! transposes and ropes are removed by `fuse`'s dead-code pass.

use super::fuse::ordering_only;
use crate::pass::PassError;
use crate::placement::Placement;
use crate::readers::Readers;
use std::collections::{BTreeMap, BTreeSet};
use weft_ir::shape::norm_dim;
use weft_ir::{At, Graph, HeadLayout, Node, Op, Value};

/// What the rewrite changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HeadLayoutCounts {
    /// `attention` and `attention_grad` nodes now reading [B, S, H, D].
    pub attention: usize,
    /// `rope` nodes made in [B, S, H, D].
    pub rope: usize,
    /// Transpose pairs cancelled.
    pub cancelled: usize,
}

/// Runs the three steps over `g` (see the module doc). Uses move through a readers
/// index, and each step's new nodes go to their places in the order at the end of the
/// step (no step reads the order while it rewrites): linear in the step's size.
pub(crate) fn attention_to_bshd(g: &mut Graph) -> Result<HeadLayoutCounts, PassError> {
    let mut counts = HeadLayoutCounts::default();
    let mut bshd_ropes: BTreeMap<Value, Value> = BTreeMap::new();
    let mut rd = Readers::of(g);
    let mut place = Placement::new();
    let mut rewritten = Vec::new();
    for n in worth_rewriting(g) {
        let count = per_head_operands(&g.node(n).op).expect("a candidate");
        let per_head: Vec<Value> = g.node(n).operands[..count].to_vec();
        let mut operands = g.node(n).operands.clone();
        let mut ed = Edit {
            g: &mut *g,
            rd: &mut rd,
            place: &mut place,
        };
        for (i, v) in per_head.into_iter().enumerate() {
            operands[i] = resolve(&mut ed, &mut bshd_ropes, v, &mut counts)?;
        }
        rewrite_attention(&mut ed, n, &operands)?;
        rewritten.push(n);
        counts.attention += 1;
    }
    place.finish(g);
    rd.remove_nodes(g, &rewritten);
    counts.rope += sink_ropes(g, &mut rd)?;
    counts.cancelled += cancel_swaps(g, &mut rd);
    Ok(counts)
}

/// The graph being rewritten, its readers index, and where its new nodes go.
struct Edit<'a> {
    g: &'a mut Graph,
    rd: &'a mut Readers,
    place: &'a mut Placement,
}

/// The attention nodes step 1 rewrites, in program order: those whose per-head operands
/// all resolve to [B, S, H, D] and where the rewrite adds no work. Each per-head result
/// must be read only by swaps (which cancel) or in a per-head slot of another rewritten
/// node, so no transpose is added for it; each rope operand must be read only in
/// per-head slots of rewritten nodes, so its `layout=bshd` twin replaces it rather than
/// running beside it. (Ring attention's blocks fail this: their outputs feed the
/// log-sum-exp merge, and their k/v ropes the ring shifts.) Dropping a node can fail its
/// partners' checks, so the set shrinks until it holds.
fn worth_rewriting(g: &Graph) -> Vec<Node> {
    let mut chosen: BTreeSet<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| per_head_operands(&g.node(n).op).is_some())
        .collect();
    let uses = g.uses();
    let outputs: BTreeSet<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
    // `v` is read only in per-head slots of chosen nodes (and is no output)
    let per_head_slot = |chosen: &BTreeSet<Node>, m: Node, slot: usize| {
        (chosen.contains(&m) && per_head_operands(&g.node(m).op).is_some_and(|count| slot < count))
            || ordering_only(g, m, slot)
    };
    // `m` reads `v` as the value of an `offload` whose every reload is read only in
    // per-head slots of chosen nodes: the copy moves to [B, S, H, D] with them.
    let copied_to_chosen = |chosen: &BTreeSet<Node>, m: Node, slot: usize| {
        let off = g.node(m);
        slot == 0
            && matches!(off.op, Op::Offload { .. })
            && !outputs.contains(&off.results[0])
            && uses[off.results[0].0 as usize].iter().all(|&(rl, rslot)| {
                let rd = g.node(rl);
                rslot == 0
                    && matches!(rd.op, Op::Reload { .. })
                    && !outputs.contains(&rd.results[0])
                    && uses[rd.results[0].0 as usize]
                        .iter()
                        .all(|&(a, aslot)| per_head_slot(chosen, a, aslot))
            })
    };
    let feeds_only_chosen = |chosen: &BTreeSet<Node>, v: Value| {
        !outputs.contains(&v)
            && uses[v.0 as usize].iter().all(|&(m, slot)| {
                per_head_slot(chosen, m, slot) || copied_to_chosen(chosen, m, slot)
            })
    };
    // `m` reads `r` as the x of a default-layout rope read only by swaps: step 2 then
    // moves the rope to [B, S, H, D] and the swaps cancel (rope's gradient)
    let rope_between_swaps = |m: Node, slot: usize| {
        let rope = g.node(m);
        slot == 0
            && matches!(
                rope.op,
                Op::Rope {
                    layout: HeadLayout::Bhsd
                }
            )
            && !outputs.contains(&rope.results[0])
            && uses[rope.results[0].0 as usize].iter().all(|&(t, _)| {
                g.node(t)
                    .results
                    .first()
                    .is_some_and(|&tv| swapped_from(g, tv) == Some(rope.results[0]))
            })
    };
    loop {
        let failing: Vec<Node> = chosen
            .iter()
            .copied()
            .filter(|&n| {
                let d = g.node(n);
                let count = per_head_operands(&d.op).expect("a candidate");
                let per_head_results = if count == 3 { 1 } else { 3 };
                let results_cancel = d.results[..per_head_results].iter().all(|&r| {
                    !outputs.contains(&r)
                        && uses[r.0 as usize].iter().all(|&(m, slot)| {
                            let swap_of_r = g
                                .node(m)
                                .results
                                .first()
                                .is_some_and(|&t| swapped_from(g, t) == Some(r));
                            swap_of_r
                                || ordering_only(g, m, slot)
                                || per_head_slot(&chosen, m, slot)
                                || copied_to_chosen(&chosen, m, slot)
                                || rope_between_swaps(m, slot)
                        })
                });
                let ropes_replaced = d.operands[..count]
                    .iter()
                    .filter(|&&v| bhsd_rope(g, v).is_some())
                    .all(|&v| feeds_only_chosen(&chosen, v));
                let operands_resolve = d.operands[..count]
                    .iter()
                    .all(|&v| resolvable(g, &chosen, v));
                !(operands_resolve && results_cancel && ropes_replaced)
            })
            .collect();
        if failing.is_empty() {
            return g
                .nodes()
                .iter()
                .copied()
                .filter(|n| chosen.contains(n))
                .collect();
        }
        for n in failing {
            chosen.remove(&n);
        }
    }
}

/// How many leading operands of `op` are per-head tensors, for an `attention` or
/// `attention_grad` of the default layout (the ones this rewrite takes).
fn per_head_operands(op: &Op) -> Option<usize> {
    match op {
        Op::Attention {
            layout: HeadLayout::Bhsd,
            ..
        } => Some(3),
        Op::AttentionGrad {
            layout: HeadLayout::Bhsd,
            ..
        } => Some(5),
        _ => None,
    }
}

/// `x` when `v` is `x` with dims 1 and 2 swapped (rank 4): a `transpose` of those dims
/// or a `permute [0, 2, 1, 3]`.
fn swapped_from(g: &Graph, v: Value) -> Option<Value> {
    let d = g.node(g.def(v));
    let x = *d.operands.first()?;
    let rank = g.ty(x).rank();
    if rank != 4 {
        return None;
    }
    let swaps = match &d.op {
        Op::Transpose { dim0, dim1 } => {
            let (a, b) = (norm_dim(*dim0, rank).ok()?, norm_dim(*dim1, rank).ok()?);
            (a.min(b), a.max(b)) == (1, 2)
        }
        Op::Permute { perm } => {
            let p: Option<Vec<usize>> = perm.iter().map(|&d| norm_dim(d, rank).ok()).collect();
            p? == [0, 2, 1, 3]
        }
        _ => false,
    };
    swaps.then_some(x)
}

/// A default-layout `rope` node's operands (x, cos, sin), for `v` its result.
fn bhsd_rope(g: &Graph, v: Value) -> Option<(Value, Value, Value)> {
    let d = g.node(g.def(v));
    match (&d.op, d.operands.as_slice()) {
        (
            Op::Rope {
                layout: HeadLayout::Bhsd,
            },
            [x, cos, sin],
        ) => Some((*x, *cos, *sin)),
        _ => None,
    }
}

/// Whether [`resolve`] will find `v` in [B, S, H, D] without a new transpose, once the
/// `chosen` nodes are rewritten: a swap, a default-layout rope of such a value, or a
/// per-head result of a chosen node (read through the swap the rewrite gives it).
fn resolvable(g: &Graph, chosen: &BTreeSet<Node>, v: Value) -> bool {
    let def = g.def(v);
    let per_head_result = chosen.contains(&def)
        && match per_head_operands(&g.node(def).op) {
            Some(3) => g.value(v).index < 1,
            Some(_) => g.value(v).index < 3,
            None => false,
        };
    per_head_result
        || swapped_from(g, v).is_some()
        || bhsd_rope(g, v).is_some_and(|(x, _, _)| resolvable(g, chosen, x))
        || host_copy_of(g, v).is_some_and(|(x, _, _)| resolvable(g, chosen, x))
}

/// `(x, offload, reload)` when `v` is `reload(offload(x))`: a value saved on the host
/// between its forward and backward readers (the same elements in the same layout).
fn host_copy_of(g: &Graph, v: Value) -> Option<(Value, Node, Node)> {
    let reload = g.def(v);
    if !matches!(g.node(reload).op, Op::Reload { .. }) {
        return None;
    }
    let off = g.def(*g.node(reload).operands.first()?);
    if !matches!(g.node(off).op, Op::Offload { .. }) {
        return None;
    }
    Some((*g.node(off).operands.first()?, off, reload))
}

/// `v` (a [B, H, S, D] value) in [B, S, H, D]: the operand of its swap, or a
/// `layout=bshd` rope (made at the old rope's place, once) of the resolved rope input.
fn resolve(
    ed: &mut Edit,
    bshd_ropes: &mut BTreeMap<Value, Value>,
    v: Value,
    counts: &mut HeadLayoutCounts,
) -> Result<Value, PassError> {
    if let Some(&r) = bshd_ropes.get(&v) {
        return Ok(r);
    }
    if let Some(x) = swapped_from(ed.g, v) {
        return Ok(x);
    }
    if let Some((x, off, reload)) = host_copy_of(ed.g, v) {
        // The same copies, of the [B, S, H, D] value, issued where the old ones were.
        let x = resolve(ed, bshd_ropes, x, counts)?;
        let mut off_ops = ed.g.node(off).operands.clone();
        off_ops[0] = x;
        let off_op = ed.g.node(off).op.clone();
        let host = insert_like(
            ed,
            At::Before(off),
            off_op,
            &off_ops,
            off,
            "copies to the host in [B, S, H, D], as the layout=bshd attention reads it",
        )?[0];
        let mut back_ops = ed.g.node(reload).operands.clone();
        back_ops[0] = host;
        let back_op = ed.g.node(reload).op.clone();
        let r = insert_like(
            ed,
            At::Before(reload),
            back_op,
            &back_ops,
            reload,
            "brings back the [B, S, H, D] copy for the layout=bshd attention_grad",
        )?[0];
        bshd_ropes.insert(v, r);
        return Ok(r);
    }
    let (x, cos, sin) = bhsd_rope(ed.g, v).expect("checked by worth_rewriting");
    let x = resolve(ed, bshd_ropes, x, counts)?;
    let old = ed.g.def(v);
    let r = insert_like(
        ed,
        At::Before(old),
        Op::Rope {
            layout: HeadLayout::Bshd,
        },
        &[x, cos, sin],
        old,
        "rotates q/k in [B, S, H, D] (layout=bshd), as the projections give them",
    )?[0];
    bshd_ropes.insert(v, r);
    counts.rope += 1;
    // A host copy that only waits for the old rope waits for the new one, so the old
    // rope dies with its other readers.
    move_waits(ed, v, r);
    Ok(r)
}

/// Replaces attention node `n` by its `layout=bshd` twin on `operands`; its per-head
/// results are read through transposes back to [B, H, S, D] (which cancel against the
/// transposes their readers apply, or stay for a reader that needs [B, H, S, D]). The
/// caller removes `n`.
fn rewrite_attention(ed: &mut Edit, n: Node, operands: &[Value]) -> Result<(), PassError> {
    let mut op = ed.g.node(n).op.clone();
    let per_head_results = match &mut op {
        Op::Attention { layout, .. } => {
            *layout = HeadLayout::Bshd;
            1
        }
        Op::AttentionGrad { layout, .. } => {
            *layout = HeadLayout::Bshd;
            3
        }
        _ => unreachable!("a candidate"),
    };
    let new = insert_like(
        ed,
        At::Before(n),
        op,
        operands,
        n,
        "reads and writes its per-head tensors in [B, S, H, D] (layout=bshd), as the projections give them",
    )?;
    let new_node = ed.g.def(new[0]);
    let old: Vec<Value> = ed.g.node(n).results.clone();
    let mut at = new_node;
    for (i, (&o, &r)) in old.iter().zip(&new).enumerate() {
        let replacement = if i < per_head_results {
            let t = insert_like(
                ed,
                At::After(at),
                Op::Transpose { dim0: 1, dim1: 2 },
                &[r],
                n,
                "the [B, H, S, D] view of a layout=bshd attention result, for readers that still need it",
            )?[0];
            at = ed.g.def(t);
            t
        } else {
            r
        };
        ed.rd.replace_all_uses(ed.g, o, replacement);
        if replacement != r {
            // A host copy waiting for the old result waits for the new one itself, so
            // the transpose back is not kept alive for it.
            move_waits(ed, replacement, r);
        }
    }
    Ok(())
}

/// Makes every host copy that only waits for `from` (an `after` operand) wait for `to`.
fn move_waits(ed: &mut Edit, from: Value, to: Value) {
    let waits: Vec<(Node, usize)> = ed
        .rd
        .of_value(from)
        .iter()
        .copied()
        .filter(|&(m, slot)| ordering_only(ed.g, m, slot))
        .collect();
    for (m, slot) in waits {
        ed.rd.set_operand(ed.g, m, slot, to);
    }
}

/// Step 2: `swap(rope(swap(x)))` -> `rope {layout=bshd} (x)` where every reader of the
/// rope is a swap. Returns how many ropes moved.
fn sink_ropes(g: &mut Graph, rd: &mut Readers) -> Result<usize, PassError> {
    let mut moved = 0;
    let ropes: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| {
            matches!(
                g.node(n).op,
                Op::Rope {
                    layout: HeadLayout::Bhsd
                }
            )
        })
        .collect();
    let uses = g.uses();
    let mut place = Placement::new();
    for n in ropes {
        let d = g.node(n);
        let (y, cos, sin) = (d.operands[0], d.operands[1], d.operands[2]);
        let r = d.results[0];
        let Some(x) = swapped_from(g, y) else {
            continue;
        };
        let readers = &uses[r.0 as usize];
        let is_output = g.outputs().iter().any(|(_, o)| *o == r);
        if readers.is_empty()
            || is_output
            || !readers.iter().all(|&(m, _)| {
                g.node(m).results.first().and_then(|&t| swapped_from(g, t)) == Some(r)
            })
        {
            continue;
        }
        let mut ed = Edit {
            g: &mut *g,
            rd: &mut *rd,
            place: &mut place,
        };
        let new = insert_like(
            &mut ed,
            At::Before(n),
            Op::Rope {
                layout: HeadLayout::Bshd,
            },
            &[x, cos, sin],
            n,
            "rotates in [B, S, H, D] (layout=bshd), as attention_grad gives the gradient",
        )?[0];
        for &(m, _) in readers {
            let t = g.node(m).results[0];
            rd.replace_all_uses(g, t, new);
        }
        moved += 1;
    }
    place.finish(g);
    Ok(moved)
}

/// Step 3: every swap of a swap reads the inner swap's operand instead. Returns how many
/// pairs were cancelled.
fn cancel_swaps(g: &mut Graph, rd: &mut Readers) -> usize {
    let mut cancelled = 0;
    let order: Vec<Node> = g.nodes().to_vec();
    for n in order {
        let Some(&r) = g.node(n).results.first() else {
            continue;
        };
        let Some(inner) = swapped_from(g, r) else {
            continue;
        };
        if let Some(x) = swapped_from(g, inner) {
            rd.replace_all_uses(g, r, x);
            cancelled += 1;
        }
    }
    cancelled
}

/// Inserts `op` (placed at `at` when the step finishes) with `template`'s scope,
/// derivation and micro-batch and a `fuse` provenance giving `reason`.
fn insert_like(
    ed: &mut Edit,
    at: At,
    op: Op,
    operands: &[Value],
    template: Node,
    reason: &str,
) -> Result<Vec<Value>, PassError> {
    let meta = super::fuse::fused_meta(ed.g, template, reason.into());
    let location = ed.g.describe(template);
    ed.place
        .insert(ed.g, ed.rd, at, op, operands, meta)
        .map_err(|e| {
            PassError::rewrite(
                super::fuse::NAME,
                "cannot write an attention in [B, S, H, D]",
                location,
                e.to_string(),
            )
        })
}

//! `linear-cross-entropy`: the training step never materialises the [tokens, vocab]
//! logits. The lm_head `linear(x, w)` (with Granite's logit scale and Gemma 2's final
//! soft-cap after it) and the cross-entropy that reads it become one
//! `linear_cross_entropy`, chunked over the vocabulary, whose results are the loss's
//! statistics per token: the log-sum-exp and the target logit. The loss is then
//! `sum(valid * (lse - target))` (over the count for a mean), and `autodiff` turns the
//! fused op into `linear_cross_entropy_grad`, which recomputes each chunk.
//!
//! Runs on the parallel forward program (after the sharding passes, before
//! `micro-batches` and `autodiff`), and matches two forms of the loss:
//! - `cross_entropy(logits, labels)` (one rank, and sp/dp/cp after `sp-loss`: each
//!   rank's token sum);
//! - `tensor-parallel`'s vocab-parallel cross-entropy on a vocabulary shard: the max,
//!   sum of exp and target gather of the shard's logits. The fused op on the shard
//!   gives its log-sum-exp and target; the shard max becomes the shard lse (any bound
//!   at least every logit keeps the all_reduce max a valid shift) and the shard sum of
//!   exp becomes `exp(lse_shard - max)`, so the combination over tp is unchanged.
//!
//! Logits that are a program output (eval, check, `--grad-outputs` steps) or that
//! anything else reads are left alone: the rewrite only fires when the loss is their
//! only reader. A linear with a bias, or an elementwise op between the lm_head and the
//! loss other than the scale and soft-cap, is left unfused (never approximated).

use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::util::{build_error, insert1, meta_for};
use std::collections::HashSet;
use weft_ir::{At, DType, Dim, Float, Graph, Node, Op, Value};

pub struct LinearCrossEntropy;

pub const NAME: &str = "linear-cross-entropy";

/// Scratch the chunk's logits may take per rank (f32): the chunk is sized so that
/// tokens x chunk x 4 bytes stays under this, and at least [`MIN_CHUNK`] rows so the
/// GEMMs stay large.
pub const CHUNK_SCRATCH_BYTES: i64 = 256 << 20;
/// The fewest vocabulary rows per chunk (and the multiple chunks are rounded to).
pub const MIN_CHUNK: i64 = 256;
/// The chunk when the number of tokens is not known at compile time.
pub const DEFAULT_CHUNK: i64 = 8192;

/// The chunk for `tokens` tokens per rank (None: unknown) and a vocabulary of `vocab`
/// rows (None: symbolic): the scratch bound, rounded down to a multiple of
/// [`MIN_CHUNK`], at most the vocabulary.
pub fn chunk_for(tokens: Option<i64>, vocab: Option<i64>) -> i64 {
    let c = match tokens {
        Some(t) if t > 0 => (CHUNK_SCRATCH_BYTES / t.saturating_mul(4)) / MIN_CHUNK * MIN_CHUNK,
        _ => DEFAULT_CHUNK,
    }
    .max(MIN_CHUNK);
    match vocab {
        Some(v) if v > 0 => c.min(v),
        _ => c,
    }
}

impl Pass for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "fuse the lm_head linear and the cross-entropy (plain or vocab-parallel) into linear_cross_entropy, chunked over the vocabulary, when nothing else reads the logits"
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        res.count("fused", 0).count("vocab_parallel", 0);
        let opts = &cx.options.train;
        if !opts.fused_loss {
            return Ok(res);
        }
        // Per-rank tokens are at most the global batch's; the bound keeps the scratch
        // under its budget on every rank.
        let tokens = match (opts.batch, opts.seq) {
            (Some(b), Some(s)) => b.checked_mul(s),
            _ => None,
        };
        let mut uses = g.uses();
        let linears: Vec<Node> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&n| matches!(g.node(n).op, Op::Linear {}) && g.node(n).operands.len() == 2)
            .collect();
        for n in linears {
            let Some(head) = LmHead::follow(g, &uses, n) else {
                continue;
            };
            let vocab = g.ty(g.node(n).operands[1]).shape[0].as_const();
            let chunk = opts.loss_chunk.unwrap_or_else(|| chunk_for(tokens, vocab));
            if let Some(ce) = head.single_cross_entropy(g, &uses) {
                fuse_plain(g, &head, ce, chunk)?;
                res.count("fused", 1);
            } else if let Some(vp) = VocabParallel::find(g, &uses, &head) {
                fuse_vocab_parallel(g, &head, &vp, chunk)?;
                res.count("fused", 1).count("vocab_parallel", 1);
            } else {
                continue;
            }
            res.changed = true;
            uses = g.uses();
        }
        if res.changed {
            stable_toposort(g);
        }
        Ok(res)
    }
}

/// An lm_head `linear` and the elementwise chain after it that the fused op absorbs.
struct LmHead {
    linear: Node,
    x: Value,
    w: Value,
    /// Every node of the chain after the linear (scale, soft-cap, f32 cast).
    chain: Vec<Node>,
    /// The logits the loss reads (the chain's last value).
    logits: Value,
    scale: Option<Float>,
    softcap: Option<Float>,
}

impl LmHead {
    /// Follows single-use `scale`s, one soft-cap (`scale {1/c}`, `tanh`, `scale {c}`)
    /// and an f32 `cast` from the linear's result. `None` when it is not such a chain.
    fn follow(g: &Graph, uses: &[Vec<(Node, usize)>], n: Node) -> Option<LmHead> {
        g.try_node(n)?;
        let outputs: HashSet<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
        let single = |v: Value| -> Option<Node> {
            if outputs.contains(&v) {
                return None;
            }
            match uses[v.0 as usize].as_slice() {
                [(u, 0)] => Some(*u),
                _ => None,
            }
        };
        let (x, w) = (g.node(n).operands[0], g.node(n).operands[1]);
        if g.ty(w).rank() != 2 || !g.ty(x).dtype.is_float() {
            return None;
        }
        let mut v = g.node(n).results[0];
        let mut chain = Vec::new();
        let mut pre = 1.0f64;
        let mut softcap = None;
        let mut cast = false;
        // Peek at the next op without committing: the logits may stop at any point.
        while let Some(u) = single(v) {
            let next = g.node(u).results[0];
            match &g.node(u).op {
                Op::Scale { factor } if softcap.is_none() && !cast => {
                    pre *= factor.0;
                }
                Op::Tanh {} if softcap.is_none() && !cast => {
                    // tanh must be followed by `scale {c}`, with the scales before it
                    // holding 1/c (times the logit scale).
                    let after = single(next)?;
                    let Op::Scale { factor } = g.node(after).op else {
                        return None;
                    };
                    if !(factor.0.is_finite() && factor.0 > 0.0) {
                        return None;
                    }
                    chain.push(u);
                    softcap = Some(factor.0);
                    chain.push(after);
                    v = g.node(after).results[0];
                    continue;
                }
                Op::Cast { dtype: DType::F32 } if !cast => cast = true,
                _ => break,
            }
            chain.push(u);
            v = next;
        }
        if outputs.contains(&v) {
            return None;
        }
        // With a soft-cap the scales before tanh are `scale / cap`.
        let scale = match softcap {
            Some(c) => pre * c,
            None => pre,
        };
        let scale = ((scale - 1.0).abs() > 1e-12).then_some(Float(scale));
        Some(LmHead {
            linear: n,
            x,
            w,
            chain,
            logits: v,
            scale,
            softcap: softcap.map(Float),
        })
    }

    /// The `cross_entropy` that is the logits' only reader.
    fn single_cross_entropy(&self, g: &Graph, uses: &[Vec<(Node, usize)>]) -> Option<Node> {
        match uses[self.logits.0 as usize].as_slice() {
            [(u, 0)] if matches!(g.node(*u).op, Op::CrossEntropy { .. }) => Some(*u),
            _ => None,
        }
    }

    fn op(&self, ignore_index: i64, chunk: i64) -> Op {
        Op::LinearCrossEntropy {
            ignore_index,
            chunk,
            scale: self.scale,
            softcap: self.softcap,
        }
    }

    fn nodes(&self) -> Vec<Node> {
        let mut v = self.chain.clone();
        v.reverse();
        v.push(self.linear);
        v
    }
}

/// `cross_entropy(logits, labels)` -> the loss from `linear_cross_entropy`'s statistics.
fn fuse_plain(g: &mut Graph, head: &LmHead, ce: Node, chunk: i64) -> Result<(), PassError> {
    let Op::CrossEntropy {
        ignore_index,
        reduction,
    } = g.node(ce).op.clone()
    else {
        unreachable!("matched a cross_entropy")
    };
    let labels = g.node(ce).operands[1];
    let at = At::Before(ce);
    let m =
        |g: &Graph, r: &str| meta_for(g, ce, NAME, format!("lm_head + cross-entropy fused: {r}"));
    let meta = m(
        g,
        "log-sum-exp and target logit per token, the vocabulary in chunks (no logits tensor)",
    );
    let stats = g
        .insert_with(
            at,
            head.op(ignore_index, chunk),
            &[head.x, head.w, labels],
            meta,
        )
        .map_err(|e| build_error(NAME, e))?;
    let tok = insert1(
        g,
        NAME,
        at,
        Op::Sub {},
        &[stats[0], stats[1]],
        m(g, "token loss lse - target"),
    )?;
    let out =
        crate::util::masked_token_loss(g, NAME, at, tok, labels, ignore_index, reduction, &m)?;
    let old = g.node(ce).results[0];
    g.replace_all_uses(old, out);
    let mut dead = vec![ce];
    dead.extend(head.nodes());
    g.remove_nodes(&dead);
    Ok(())
}

/// The reads of a vocab shard's logits by tp's vocab-parallel cross-entropy.
struct VocabParallel {
    /// `max {dims=[-1], keepdim}` of the shard's logits.
    max: Node,
    /// `sub(logits, global max)`, its `exp` and `sum {dims=[-1], keepdim}`.
    sub: Node,
    exp: Node,
    sum: Node,
    /// `gather {dim=-1}(logits, index)`: the target logit if this rank holds it.
    gather: Node,
}

impl VocabParallel {
    fn find(g: &Graph, uses: &[Vec<(Node, usize)>], head: &LmHead) -> Option<VocabParallel> {
        let users = &uses[head.logits.0 as usize];
        if users.len() != 3 {
            return None;
        }
        let last = |dims: &[i64], keepdim: bool| keepdim && dims == [-1];
        let (mut max, mut sub, mut gather) = (None, None, None);
        for &(u, i) in users {
            match (&g.node(u).op, i) {
                (Op::Max { dims, keepdim }, 0) if last(dims, *keepdim) => max = Some(u),
                (Op::Sub {}, 0) => sub = Some(u),
                (Op::Gather { dim: -1 }, 0) => gather = Some(u),
                _ => return None,
            }
        }
        let (max, sub, gather) = (max?, sub?, gather?);
        let only = |n: Node| -> Option<Node> {
            let v = g.node(n).results[0];
            match uses[v.0 as usize].as_slice() {
                [(u, 0)] => Some(*u),
                _ => None,
            }
        };
        let exp = only(sub).filter(|&e| matches!(g.node(e).op, Op::Exp {}))?;
        let sum = only(exp).filter(
            |&s| matches!(&g.node(s).op, Op::Sum { dims, keepdim } if last(dims, *keepdim)),
        )?;
        // the label index has the logits' shape with a last dim of 1
        let idx = g.node(gather).operands[1];
        let lt = g.ty(head.logits);
        let it = g.ty(idx);
        if it.rank() != lt.rank()
            || it.shape[..lt.rank() - 1] != lt.shape[..lt.rank() - 1]
            || it.shape[lt.rank() - 1] != Dim::from(1)
        {
            return None;
        }
        Some(VocabParallel {
            max,
            sub,
            exp,
            sum,
            gather,
        })
    }
}

/// tp's vocab-parallel cross-entropy with the shard's logits replaced by the fused op's
/// shard statistics (the combination over tp is left as it is).
fn fuse_vocab_parallel(
    g: &mut Graph,
    head: &LmHead,
    vp: &VocabParallel,
    chunk: i64,
) -> Result<(), PassError> {
    let idx = g.node(vp.gather).operands[1];
    let global_max = g.node(vp.sub).operands[1];
    let keep_shape = g.ty(idx).shape.clone();
    let tok_shape = keep_shape[..keep_shape.len() - 1].to_vec();
    let at = At::Before(vp.gather);
    let m = |g: &Graph, r: &str| {
        meta_for(
            g,
            vp.gather,
            NAME,
            format!("lm_head + vocab-parallel cross-entropy fused: {r}"),
        )
    };
    let labels = insert1(
        g,
        NAME,
        at,
        Op::Reshape { shape: tok_shape },
        &[idx],
        m(g, "this rank's label index per token"),
    )?;
    // The index is clamped into the shard (tp masks the target where the rank does not
    // hold the label), so no label is ignored here.
    let ignore = -1;
    let meta = m(
        g,
        "this vocab shard's log-sum-exp and target logit, in chunks (no logits tensor)",
    );
    let stats = g
        .insert_with(at, head.op(ignore, chunk), &[head.x, head.w, labels], meta)
        .map_err(|e| build_error(NAME, e))?;
    let reshape = |g: &mut Graph, v: Value, why: &str| {
        insert1(
            g,
            NAME,
            at,
            Op::Reshape {
                shape: keep_shape.clone(),
            },
            &[v],
            m(g, why),
        )
    };
    let lse = reshape(
        g,
        stats[0],
        "shard log-sum-exp: a bound on the shard's logits for the max over tp",
    )?;
    let target = reshape(g, stats[1], "target logit if this rank holds it")?;
    let shifted = insert1(
        g,
        NAME,
        at,
        Op::Sub {},
        &[lse, global_max],
        m(g, "shard lse - max over tp"),
    )?;
    let sum_exp = insert1(
        g,
        NAME,
        at,
        Op::Exp {},
        &[shifted],
        m(g, "sum of exp over this rank's vocabulary"),
    )?;
    let res = |g: &Graph, n: Node| g.node(n).results[0];
    let (old_max, old_sum, old_target) = (res(g, vp.max), res(g, vp.sum), res(g, vp.gather));
    g.replace_all_uses(old_max, lse);
    g.replace_all_uses(old_sum, sum_exp);
    g.replace_all_uses(old_target, target);
    let mut dead = vec![vp.gather, vp.sum, vp.exp, vp.sub, vp.max];
    dead.extend(head.nodes());
    g.remove_nodes(&dead);
    Ok(())
}

/// Reorders the nodes so every operand is defined before its use, keeping the current
/// order wherever it already is (the rewrite may make an early node read a later one:
/// tp's max over the shard comes before its label index is computed). Iterative.
fn stable_toposort(g: &mut Graph) {
    let order: Vec<Node> = g.nodes().to_vec();
    let mut done: HashSet<Node> = HashSet::with_capacity(order.len());
    let mut out = Vec::with_capacity(order.len());
    for &root in &order {
        if done.contains(&root) {
            continue;
        }
        // (node, operands pushed yet)
        let mut stack = vec![(root, false)];
        while let Some((n, expanded)) = stack.pop() {
            if done.contains(&n) {
                continue;
            }
            if expanded {
                done.insert(n);
                out.push(n);
                continue;
            }
            stack.push((n, true));
            for v in g.node(n).operands.iter().rev() {
                let d = g.def(*v);
                if !done.contains(&d) {
                    stack.push((d, false));
                }
            }
        }
    }
    g.set_order(out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunk_bounds_the_scratch_and_keeps_gemms_large() {
        // 16384 tokens: 256 MiB / (16384 x 4 B) = 4096 rows.
        assert_eq!(chunk_for(Some(16384), Some(128256)), 4096);
        // 262144 tokens would give 256 rows: the floor.
        assert_eq!(chunk_for(Some(262_144), Some(128256)), MIN_CHUNK);
        assert_eq!(chunk_for(Some(1 << 30), None), MIN_CHUNK);
        // Few tokens: the whole (small) vocabulary in one chunk.
        assert_eq!(chunk_for(Some(64), Some(128)), 128);
        assert_eq!(chunk_for(None, None), DEFAULT_CHUNK);
        assert_eq!(chunk_for(Some(0), Some(50_000)), DEFAULT_CHUNK);
    }
}

//! `fp8`: the linear layers' GEMMs in FP8 (`--fp8`). Each `linear(x, w, bias?)` of the
//! forward program becomes `fp8_matmul(x, w^T)` with e4m3 operands (x flattened to
//! `[tokens, in]`, so the weight gradient is one GEMM), then the bias add. `autodiff`
//! differentiates each into FP8 GEMMs whose incoming gradient is e5m2 (straight-through),
//! so the forward, the input gradient and the weight gradient all run in FP8, with
//! per-tensor current scaling (`weft_ir::fp8`). Master weights, optimizer states, norms,
//! attention and everything else keep their dtypes.
//!
//! Left in high precision, as FP8 recipes do: a linear from whose result a loss or a
//! program output is reachable without passing another matmul-class op (the lm_head's
//! logits, an MoE router's auxiliary loss), the MoE experts' grouped GEMMs and attention.
//!
//! Scales are per rank: on a sharded mesh each rank scales its own shard of an operand,
//! so an FP8 program's numbers depend on the mesh within FP8 rounding (as every FP8
//! trainer's do); without `--fp8` nothing changes.
//!
//! Runs on the forward program after the forward passes and `linear-cross-entropy`,
//! before `micro-batches` and `autodiff`.

use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::util::{insert1, meta_for};
use std::collections::HashSet;
use weft_ir::{At, Dim, Fp8Format, Graph, Node, Op};

pub struct Fp8;

pub const NAME: &str = "fp8";

impl Pass for Fp8 {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "run the linear layers' GEMMs in FP8 (e4m3 forward, e5m2 gradients, per-tensor scaling), leaving the lm_head and routers in their dtype"
    }
    fn run(&self, g: &mut Graph, _cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        res.count("linears", 0).count("kept", 0);
        let feeds_loss = feeds_loss(g);
        let linears: Vec<Node> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&n| matches!(g.node(n).op, Op::Linear {}))
            .collect();
        for n in linears {
            let d = g.node(n);
            let (x, w) = (d.operands[0], d.operands[1]);
            let float = g.ty(x).dtype.is_float() && g.ty(w).rank() == 2 && g.ty(x).rank() >= 1;
            if !float || feeds_loss.contains(&n) {
                res.count("kept", 1);
                continue;
            }
            rewrite(g, n)?;
            res.count("linears", 1);
            res.changed = true;
        }
        Ok(res)
    }
}

/// The linears from whose result a loss op or a program output is reachable through
/// ops that are not matmul-class (one pass over the nodes in reverse order).
fn feeds_loss(g: &Graph) -> HashSet<Node> {
    let uses = g.uses();
    let outputs: HashSet<_> = g.outputs().iter().map(|(_, v)| *v).collect();
    let mut reaches = vec![false; uses.len()];
    let mut out = HashSet::new();
    for &n in g.nodes().iter().rev() {
        let d = g.node(n);
        for &r in &d.results {
            let i = r.0 as usize;
            let direct = outputs.contains(&r)
                || uses[i].iter().any(|(u, _)| {
                    let op = &g.node(*u).op;
                    if is_loss(op) {
                        return true;
                    }
                    !stops(op) && g.node(*u).results.iter().any(|v| reaches[v.0 as usize])
                });
            reaches[i] = direct;
            if direct && matches!(d.op, Op::Linear {}) {
                out.insert(n);
            }
        }
    }
    out
}

fn is_loss(op: &Op) -> bool {
    matches!(op, Op::CrossEntropy { .. } | Op::LinearCrossEntropy { .. })
}

/// Ops past which a value no longer counts as a loss's direct input.
fn stops(op: &Op) -> bool {
    matches!(
        op,
        Op::Linear {}
            | Op::Matmul { .. }
            | Op::Fp8Matmul { .. }
            | Op::GroupedMatmul { .. }
            | Op::Attention { .. }
            | Op::RingAttention { .. }
    )
}

/// `linear(x, w, bias?)` -> reshape x to `[tokens, in]`, `fp8_matmul(x2, w, tb)`,
/// reshape back, add the bias.
fn rewrite(g: &mut Graph, n: Node) -> Result<(), PassError> {
    let d = g.node(n).clone();
    let (x, w) = (d.operands[0], d.operands[1]);
    let bias = d.operands.get(2).copied();
    let xt = g.ty(x).clone();
    let k = xt.shape.last().cloned().unwrap_or_else(|| Dim::from(1));
    let nout = g.ty(w).shape[0].clone();
    let lead: Vec<Dim> = xt.shape[..xt.rank().saturating_sub(1)].to_vec();
    let m = lead.iter().fold(Dim::from(1), |a, d| a * d.clone());
    let at = At::Before(n);
    let meta = |g: &Graph, r: &str| meta_for(g, n, NAME, format!("FP8 linear: {r}"));
    let flat = xt.rank() != 2;
    let x2 = if flat {
        insert1(
            g,
            NAME,
            at,
            Op::Reshape {
                shape: vec![m.clone(), k.clone()],
            },
            &[x],
            meta(g, "tokens as rows"),
        )?
    } else {
        x
    };
    let y2 = insert1(
        g,
        NAME,
        at,
        Op::Fp8Matmul {
            transpose_a: false,
            transpose_b: true,
            format_a: Fp8Format::E4m3,
            format_b: Fp8Format::E4m3,
        },
        &[x2, w],
        meta(g, "x @ w^T, both e4m3"),
    )?;
    let mut y = if flat {
        let mut shape = lead.clone();
        shape.push(nout);
        insert1(
            g,
            NAME,
            at,
            Op::Reshape { shape },
            &[y2],
            meta(g, "rows back to tokens"),
        )?
    } else {
        y2
    };
    if let Some(b) = bias {
        y = insert1(
            g,
            NAME,
            at,
            Op::Add {},
            &[y, b],
            meta(g, "the bias, in the dtype"),
        )?;
    }
    g.replace_all_uses(d.results[0], y);
    g.remove_nodes(&[n]);
    Ok(())
}

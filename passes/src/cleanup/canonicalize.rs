//! `canonicalize`: folding, common-subexpression elimination and dead-code elimination,
//! repeated until nothing changes (at most `canonicalize_max_rounds` rounds).
//!
//! - fold: `reshape(reshape(x))` -> `reshape(x)`; transpose/permute chains compose into
//!   one permute (or a transpose, or nothing when they cancel); identity ops vanish:
//!   reshape/expand to the operand's shape, identity permutations, a slice of a whole
//!   dim, `scale` by 1.0, `add_scalar` of 0.0, a cast to the operand's dtype, a one-part
//!   concat.
//! - CSE: nodes with equal ops (ops derive `Eq`/`Hash`) and equal operands are one node;
//!   the first in program order stays.
//! - DCE: keeps nodes an output depends on, plus every `param` and `input` (the
//!   model's interface stays whole even when part of it is unused).

use crate::pass::{Pass, PassContext, PassError, PassResult};
use std::collections::HashMap;
use weft_ir::shape::norm_dim;
use weft_ir::{Graph, Node, Op, Value};

pub struct Canonicalize;

pub const NAME: &str = "canonicalize";

impl Pass for Canonicalize {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "fold reshape/transpose chains and identity ops, merge equal nodes (CSE), drop nodes no output needs (DCE)"
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        res.count("folded", 0)
            .count("identities_removed", 0)
            .count("cse_merged", 0)
            .count("dce_removed", 0);
        for round in 0..cx.options.canonicalize_max_rounds.max(1) {
            let f = fold(g, &mut res);
            let c = cse(g);
            let d = dce(g);
            res.count("cse_merged", c as u64)
                .count("dce_removed", d as u64);
            if !f && c == 0 && d == 0 {
                res.count("rounds", round as u64 + 1);
                return Ok(res);
            }
            res.changed = true;
        }
        res.count("rounds", cx.options.canonicalize_max_rounds.max(1) as u64);
        Ok(res)
    }
}

fn perm_of(op: &Op, rank: usize) -> Option<Vec<usize>> {
    match op {
        Op::Transpose { dim0, dim1 } => {
            let (a, b) = (norm_dim(*dim0, rank).ok()?, norm_dim(*dim1, rank).ok()?);
            let mut p: Vec<usize> = (0..rank).collect();
            p.swap(a, b);
            Some(p)
        }
        Op::Permute { perm } => perm.iter().map(|&x| norm_dim(x, rank).ok()).collect(),
        _ => None,
    }
}

/// The cheapest op for permutation `p`: `None` for the identity.
fn op_for_perm(p: &[usize]) -> Option<Op> {
    let moved: Vec<usize> = (0..p.len()).filter(|&i| p[i] != i).collect();
    match moved.as_slice() {
        [] => None,
        [a, b] if p[*a] == *b && p[*b] == *a => Some(Op::Transpose {
            dim0: *a as i64,
            dim1: *b as i64,
        }),
        _ => Some(Op::Permute {
            perm: p.iter().map(|&x| x as i64).collect(),
        }),
    }
}

/// True when `n` returns its operand unchanged.
fn is_identity(g: &Graph, n: Node) -> bool {
    let d = g.node(n);
    let Some(&x) = d.operands.first() else {
        return false;
    };
    let t = g.ty(x);
    match &d.op {
        Op::Reshape { shape } | Op::Expand { shape } => *shape == t.shape,
        Op::Transpose { .. } | Op::Permute { .. } => {
            perm_of(&d.op, t.rank()).is_some_and(|p| op_for_perm(&p).is_none())
        }
        Op::Slice { dim, start, len } => norm_dim(*dim, t.rank())
            .is_ok_and(|k| start.as_const() == Some(0) && *len == t.shape[k]),
        Op::Scale { factor } => factor.0 == 1.0,
        Op::AddScalar { value } => value.0 == 0.0,
        Op::Cast { dtype } => *dtype == t.dtype,
        Op::Concat { .. } => d.operands.len() == 1,
        Op::Split { sizes, .. } => sizes.len() == 1,
        _ => false,
    }
}

fn fold(g: &mut Graph, res: &mut PassResult) -> bool {
    let mut changed = false;
    let order: Vec<Node> = g.nodes().to_vec();
    for n in order {
        if is_identity(g, n) {
            let (x, r) = (g.node(n).operands[0], g.node(n).results[0]);
            if g.ty(x) == g.ty(r) {
                g.replace_all_uses(r, x);
                g.remove_node(n);
                res.count("identities_removed", 1);
                changed = true;
                continue;
            }
        }
        let d = g.node(n);
        let Some(&x) = d.operands.first() else {
            continue;
        };
        let inner = g.def(x);
        let inner_op = g.node(inner).op.clone();
        let rank = g.ty(x).rank();
        match (&d.op, &inner_op) {
            (Op::Reshape { .. }, Op::Reshape { .. }) => {
                let src = g.node(inner).operands[0];
                g.node_mut(n).operands[0] = src;
            }
            (
                Op::Transpose { .. } | Op::Permute { .. },
                Op::Transpose { .. } | Op::Permute { .. },
            ) => {
                let src = g.node(inner).operands[0];
                let (Some(outer_p), Some(inner_p)) =
                    (perm_of(&d.op, rank), perm_of(&inner_op, rank))
                else {
                    continue;
                };
                let composed: Vec<usize> = outer_p.iter().map(|&i| inner_p[i]).collect();
                match op_for_perm(&composed) {
                    None => {
                        let r = g.node(n).results[0];
                        g.replace_all_uses(r, src);
                        g.remove_node(n);
                    }
                    Some(op) => {
                        let m = g.node_mut(n);
                        m.op = op;
                        m.operands[0] = src;
                    }
                }
            }
            _ => continue,
        }
        res.count("folded", 1);
        changed = true;
    }
    changed
}

/// Merges nodes with equal ops and operands; returns how many were merged.
fn cse(g: &mut Graph) -> usize {
    let mut seen: HashMap<(Op, Vec<Value>), Vec<Value>> = HashMap::new();
    let mut dead = Vec::new();
    let order: Vec<Node> = g.nodes().to_vec();
    for n in order {
        let d = g.node(n);
        let key = (d.op.clone(), d.operands.clone());
        match seen.get(&key) {
            Some(first) => {
                let pairs: Vec<(Value, Value)> = d
                    .results
                    .iter()
                    .copied()
                    .zip(first.iter().copied())
                    .collect();
                for (old, new) in pairs {
                    g.replace_all_uses(old, new);
                }
                dead.push(n);
            }
            None => {
                seen.insert(key, d.results.clone());
            }
        }
    }
    g.remove_nodes(&dead);
    dead.len()
}

/// Removes nodes no output needs (params and inputs stay); returns how many.
pub(crate) fn dce(g: &mut Graph) -> usize {
    let mut needed = vec![false; g.value_capacity()];
    for (_, v) in g.outputs() {
        needed[v.0 as usize] = true;
    }
    let mut dead = Vec::new();
    for &n in g.nodes().iter().rev() {
        let d = g.node(n);
        let interface = matches!(d.op, Op::Param { .. } | Op::Input { .. });
        if interface || d.results.iter().any(|v| needed[v.0 as usize]) {
            for v in &d.operands {
                needed[v.0 as usize] = true;
            }
        } else {
            dead.push(n);
        }
    }
    g.remove_nodes(&dead);
    dead.len()
}

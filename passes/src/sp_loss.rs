//! `sp-loss`: the loss stays the global mean over valid tokens.
//!
//! Each rank's `cross_entropy {reduction=sum}` and `count_valid` cover only its tokens.
//! Both are `all_reduce`d (sum) over `sp` (and `dp`) before the loss divides them, so
//! the result equals the unsharded loss exactly, whatever number of ignored labels each
//! rank holds (averaging per-shard means, as DeepSpeed AutoSP does, is wrong whenever
//! ranks hold different numbers of valid labels). A `reduction=mean` cross-entropy is
//! rewritten to that sum / count form.
//!
//! It also records how each per-rank output is split (`logits`: dim 1 over `sp`, dim 0
//! over `dp`), so runtimes and plans can reassemble it.

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, DP, SP};
use crate::util::{insert1, made_by, meta_for, Layout};
use weft_ir::{At, Graph, Node, Op, ReduceOp, Reduction, Value};

pub struct SpLoss;

pub const NAME: &str = "sp-loss";

impl Pass for SpLoss {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "all_reduce the cross-entropy sum and the valid-label count over sp/dp before the loss divides them; record output splits"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::shard_seq::NAME]
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::AnyOf(&[SP, DP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let layout = Layout::of(g, cx, NAME)?;
        let axes: Vec<&'static str> = layout.splits().iter().map(|(_, s)| s.axis).collect();
        let mut res = PassResult::unchanged();
        res.count("all_reduce", 0).count("mean_rewritten", 0).count("outputs_split", 0);
        let order: Vec<Node> = g.nodes().to_vec();
        for n in order {
            let d = g.node(n);
            let sharded = d.operands.iter().any(|v| g.ty(*v).shape.iter().any(|x| layout.is_sharded(x)));
            if !sharded || already_reduced(g, d.results[0]) {
                continue;
            }
            match d.op.clone() {
                Op::CrossEntropy { reduction: Reduction::Sum, .. } => {
                    let out = d.results[0];
                    let reason = "cross_entropy sum: add every rank's token losses (global sum over valid tokens)";
                    all_reduce_after(g, n, out, &axes, reason, &mut res)?;
                }
                Op::CountValid { .. } => {
                    let out = d.results[0];
                    let reason = "count_valid: the global number of valid labels, so the loss is not a mean of per-shard means";
                    all_reduce_after(g, n, out, &axes, reason, &mut res)?;
                }
                Op::CrossEntropy { reduction: Reduction::Mean, ignore_index } => {
                    rewrite_mean(g, n, ignore_index, &axes, &mut res)?;
                }
                _ => continue,
            }
            res.changed = true;
        }
        let outputs: Vec<(String, Value)> = g.outputs().to_vec();
        for (name, v) in outputs {
            if !g.output_split(&name).is_empty() {
                continue;
            }
            let shape = g.ty(v).shape.clone();
            let mut any = false;
            for (i, dim) in shape.iter().enumerate() {
                for (_, s) in layout.splits() {
                    if dim.mentions(s.axis) {
                        g.add_output_split(&name, i, s.axis);
                        any = true;
                    }
                }
            }
            if any {
                res.count("outputs_split", 1);
                res.changed = true;
            }
        }
        Ok(res)
    }
}

/// True when `v` feeds an all_reduce this pass made (applying twice must not reduce twice).
fn already_reduced(g: &Graph, v: Value) -> bool {
    g.uses()
        .get(v.0 as usize)
        .is_some_and(|u| u.iter().any(|&(m, _)| made_by(g, m, NAME) && matches!(g.node(m).op, Op::AllReduce { .. })))
}

/// Inserts `all_reduce sum` over each axis after `v` and makes every other use of `v`
/// read the reduced value.
fn all_reduce_after(g: &mut Graph, anchor: Node, v: Value, axes: &[&str], reason: &str, res: &mut PassResult) -> Result<Value, PassError> {
    let (first, last) = all_reduce_chain(g, anchor, v, axes, reason, res)?;
    g.replace_uses_except(v, last, first);
    Ok(last)
}

/// `all_reduce sum` of `v` over each axis in turn, right after `v`'s definition:
/// the first node of the chain and the reduced value. Uses of `v` are left alone.
fn all_reduce_chain(g: &mut Graph, anchor: Node, v: Value, axes: &[&str], reason: &str, res: &mut PassResult) -> Result<(Node, Value), PassError> {
    let mut cur = v;
    let mut at = g.def(v);
    let mut first = None;
    for axis in axes {
        let meta = meta_for(g, anchor, NAME, format!("{reason}, over {axis}"));
        cur = insert1(g, NAME, At::After(at), Op::AllReduce { axis: axis.to_string(), op: ReduceOp::Sum }, &[cur], meta)?;
        at = g.def(cur);
        first.get_or_insert(at);
        res.count("all_reduce", 1);
    }
    Ok((first.unwrap_or(at), cur))
}

/// `cross_entropy {mean}` -> `div(all_reduce(cross_entropy {sum}), all_reduce(count_valid))`.
fn rewrite_mean(g: &mut Graph, n: Node, ignore_index: i64, axes: &[&str], res: &mut PassResult) -> Result<(), PassError> {
    let labels = g.node(n).operands[1];
    let out = g.node(n).results[0];
    g.node_mut(n).op = Op::CrossEntropy { ignore_index, reduction: Reduction::Sum };
    let (first, sum_r) = all_reduce_chain(g, n, out, axes, "cross_entropy sum (was mean)", res)?;
    let meta = meta_for(g, n, NAME, "valid labels of this rank: a mean of per-shard means would weight ranks unequally");
    let count = insert1(g, NAME, At::After(g.def(sum_r)), Op::CountValid { ignore_index }, &[labels], meta)?;
    let (_, count_r) = all_reduce_chain(g, n, count, axes, "count_valid (cross_entropy was mean)", res)?;
    let meta = meta_for(g, n, NAME, "global mean over valid tokens");
    let mean = insert1(g, NAME, At::After(g.def(count_r)), Op::Div {}, &[sum_r, count_r], meta)?;
    g.replace_uses_except(out, mean, first);
    res.count("mean_rewritten", 1);
    Ok(())
}

//! `sp-loss`: the loss stays the global mean over valid tokens, computed per rank.
//!
//! After `shard-seq` the loss ops read all_gathered (whole) logits and labels. This pass
//! lets each rank compute `cross_entropy {reduction=sum}` and `count_valid` over its own
//! tokens and `all_reduce`s (sum) both over `sp` (and `dp`) before the loss divides
//! them, so the result equals the unsharded loss exactly, whatever number of ignored
//! labels each rank holds (averaging per-shard means, as DeepSpeed AutoSP does, is wrong
//! whenever ranks hold different numbers of valid labels). A `reduction=mean`
//! cross-entropy becomes that sum / count form.
//!
//! Outputs that shard-seq gathered (`logits`) are returned per rank instead, with their
//! split recorded (`logits`: dim 0 over `dp`, dim 1 over `sp`), so runtimes and plans
//! reassemble them without an all_gather.

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, CP, DP, SP};
use crate::util::{insert1, meta_for, remove_unused, strip_gathers, strip_seq_gathers};
use weft_ir::{At, Graph, Node, Op, ReduceOp, Reduction, Value};

pub struct SpLoss;

/// An operand with shard-seq's gathers stripped: the per-rank value, the gathered
/// `(dim, axis)` and the gather nodes.
type Stripped = (Value, Vec<(usize, String)>, Vec<Node>);

pub const NAME: &str = "sp-loss";

impl Pass for SpLoss {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "compute the cross-entropy sum and valid-label count per rank and all_reduce them over sp/dp before the loss divides; return per-rank outputs with their split"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::shard_seq::NAME]
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::AnyOf(&[SP, CP, DP])
    }
    fn run(&self, g: &mut Graph, _cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        res.count("all_reduce", 0)
            .count("mean_rewritten", 0)
            .count("outputs_split", 0);
        let mut stripped: Vec<Node> = Vec::new();
        let order: Vec<Node> = g.nodes().to_vec();
        for n in order {
            let d = g.node(n);
            let (is_ce, is_count) = (
                matches!(d.op, Op::CrossEntropy { .. }),
                matches!(d.op, Op::CountValid { .. }),
            );
            if !(is_ce || is_count)
                || matches!(
                    d.op,
                    Op::CrossEntropy {
                        reduction: Reduction::None,
                        ..
                    }
                )
            {
                continue;
            }
            // Every operand must be gathered the same way (logits [B, S, V] and labels [B, S]).
            let parts: Vec<Stripped> = d
                .operands
                .iter()
                .map(|&v| strip_seq_gathers(g, v, crate::shard_seq::NAME))
                .collect();
            let dims = &parts[0].1;
            if dims.is_empty() || parts.iter().any(|p| p.1 != *dims) {
                continue;
            }
            let axes: Vec<String> = [SP, CP, DP]
                .iter()
                .filter(|a| dims.iter().any(|(_, x)| x == *a))
                .map(|a| a.to_string())
                .collect();
            g.node_mut(n).operands = parts.iter().map(|p| p.0).collect();
            stripped.extend(parts.into_iter().flat_map(|p| p.2));
            match g.node(n).op.clone() {
                Op::CrossEntropy {
                    reduction: Reduction::Mean,
                    ignore_index,
                } => {
                    rewrite_mean(g, n, ignore_index, &axes, &mut res)?;
                }
                Op::CrossEntropy { .. } => {
                    g.reinfer(n)
                        .map_err(|e| crate::util::build_error(NAME, e))?;
                    let out = g.node(n).results[0];
                    let reason = "cross_entropy sum: add every rank's token losses (global sum over valid tokens)";
                    all_reduce_after(g, n, out, &axes, reason, &mut res)?;
                }
                _ => {
                    g.reinfer(n)
                        .map_err(|e| crate::util::build_error(NAME, e))?;
                    let out = g.node(n).results[0];
                    let reason = "count_valid: the global number of valid labels, so the loss is not a mean of per-shard means";
                    all_reduce_after(g, n, out, &axes, reason, &mut res)?;
                }
            }
            res.changed = true;
        }
        let outputs: Vec<(String, Value)> = g.outputs().to_vec();
        for (name, v) in outputs {
            if !g.output_split(&name).is_empty() {
                continue;
            }
            let (local, dims, nodes) = strip_gathers(g, v, crate::shard_seq::NAME);
            if dims.is_empty() {
                continue;
            }
            g.set_output(&name, local);
            for (dim, axis) in &dims {
                g.add_output_split(&name, *dim, axis);
            }
            stripped.extend(nodes);
            res.count("outputs_split", 1);
            res.changed = true;
        }
        remove_unused(g, &stripped);
        Ok(res)
    }
}

/// Inserts `all_reduce sum` over each axis after `v` and makes every other use of `v`
/// read the reduced value.
fn all_reduce_after(
    g: &mut Graph,
    anchor: Node,
    v: Value,
    axes: &[String],
    reason: &str,
    res: &mut PassResult,
) -> Result<Value, PassError> {
    let (first, last) = all_reduce_chain(g, anchor, v, axes, reason, res)?;
    g.replace_uses_except(v, last, first);
    Ok(last)
}

/// `all_reduce sum` of `v` over each axis in turn, right after `v`'s definition:
/// the first node of the chain and the reduced value. Uses of `v` are left alone.
fn all_reduce_chain(
    g: &mut Graph,
    anchor: Node,
    v: Value,
    axes: &[String],
    reason: &str,
    res: &mut PassResult,
) -> Result<(Node, Value), PassError> {
    let mut cur = v;
    let mut at = g.def(v);
    let mut first = None;
    for axis in axes {
        let meta = meta_for(g, anchor, NAME, format!("{reason}, over {axis}"));
        cur = insert1(
            g,
            NAME,
            At::After(at),
            Op::AllReduce {
                axis: axis.clone(),
                op: ReduceOp::Sum,
            },
            &[cur],
            meta,
        )?;
        at = g.def(cur);
        first.get_or_insert(at);
        res.count("all_reduce", 1);
    }
    Ok((first.unwrap_or(at), cur))
}

/// `cross_entropy {mean}` -> `div(all_reduce(cross_entropy {sum}), all_reduce(count_valid))`.
fn rewrite_mean(
    g: &mut Graph,
    n: Node,
    ignore_index: i64,
    axes: &[String],
    res: &mut PassResult,
) -> Result<(), PassError> {
    let labels = g.node(n).operands[1];
    let out = g.node(n).results[0];
    g.node_mut(n).op = Op::CrossEntropy {
        ignore_index,
        reduction: Reduction::Sum,
    };
    g.reinfer(n)
        .map_err(|e| crate::util::build_error(NAME, e))?;
    let (first, sum_r) = all_reduce_chain(g, n, out, axes, "cross_entropy sum (was mean)", res)?;
    let meta = meta_for(
        g,
        n,
        NAME,
        "valid labels of this rank: a mean of per-shard means would weight ranks unequally",
    );
    let count = insert1(
        g,
        NAME,
        At::After(g.def(sum_r)),
        Op::CountValid { ignore_index },
        &[labels],
        meta,
    )?;
    let (_, count_r) = all_reduce_chain(
        g,
        n,
        count,
        axes,
        "count_valid (cross_entropy was mean)",
        res,
    )?;
    let meta = meta_for(g, n, NAME, "global mean over valid tokens");
    let mean = insert1(
        g,
        NAME,
        At::After(g.def(count_r)),
        Op::Div {},
        &[sum_r, count_r],
        meta,
    )?;
    g.replace_uses_except(out, mean, first);
    res.count("mean_rewritten", 1);
    Ok(())
}

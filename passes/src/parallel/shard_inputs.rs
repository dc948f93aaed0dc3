//! `shard-inputs`: every rank takes its contiguous block of the token inputs.
//!
//! After `input_ids`, `position_ids` and (shifted) `labels` it inserts
//! `slice {dim=1, start=@sp*S/sp, len=S/sp}` and, with a `dp` axis,
//! `slice {dim=0, start=@dp*B/dp, len=B/dp}`. The start is the rank coordinate times
//! the block size, a symbol: one program serves every rank.
//!
//! Every pass preserves meaning, so the slices are followed by `all_gather`s that make
//! the whole tensor again: the program still computes exactly what the unsharded one
//! does (and verifies, and can be run). `shard-seq` then removes these gathers and
//! pushes the per-rank sizes down to the ops that combine tokens.
//!
//! Labels are sliced *after* `shift_labels`: the shift moves the first label of block
//! `r+1` into the last position of block `r`, so no target is lost at a shard boundary
//! (DeepSpeed AutoSP shifts per shard and loses it). An `attention_mask` input keeps its
//! key (and query) dims whole, because Ulysses attention sees the whole sequence; only
//! its batch dim is split over `dp`.

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, CP, DP, SP};
use crate::util::{gather_dims, insert1, made_by, meta_for, Layout, Split};
use weft_ir::{At, Graph, Node, Op, Role, Value};

pub struct ShardInputs;

pub const NAME: &str = "shard-inputs";

impl Pass for ShardInputs {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "slice each rank's block of input_ids, position_ids and shifted labels: sequence by @sp, batch by @dp"
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::AnyOf(&[SP, CP, DP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let layout = Layout::of(g, cx, NAME)?;
        let mut res = PassResult::unchanged();
        res.count("inputs_sliced", 0)
            .count("slices", 0)
            .count("gathers", 0);
        for (name, role, v) in g.inputs() {
            let uses = uses_of(g, v);
            if uses
                .iter()
                .any(|&(n, _)| made_by(g, n, NAME) && matches!(g.node(n).op, Op::Slice { .. }))
            {
                continue; // already sharded: applying twice must not slice twice
            }
            let before = res.counters["slices"];
            match role {
                Role::InputIds | Role::PositionIds => {
                    shard_value(g, v, &layout, false, &name, &uses, &mut res)?;
                }
                Role::Labels => {
                    let (shifts, direct): (Vec<_>, Vec<_>) = uses
                        .iter()
                        .partition(|&&(n, _)| matches!(g.node(n).op, Op::ShiftLabels { .. }));
                    for (n, _) in shifts {
                        let shifted = g.node(n).results[0];
                        let su = uses_of(g, shifted);
                        if su.iter().any(|&(m, _)| made_by(g, m, NAME)) {
                            continue;
                        }
                        shard_value(
                            g,
                            shifted,
                            &layout,
                            false,
                            &format!("{name} (shifted)"),
                            &su,
                            &mut res,
                        )?;
                    }
                    if !direct.is_empty() {
                        shard_value(g, v, &layout, false, &name, &direct, &mut res)?;
                    }
                }
                Role::AttentionMask => {
                    shard_value(g, v, &layout, true, &name, &uses, &mut res)?;
                }
                Role::Other | Role::Buffer => {
                    res.count("inputs_replicated", 1);
                }
            }
            if res.counters["slices"] > before {
                res.count("inputs_sliced", 1);
                res.changed = true;
            }
        }
        Ok(res)
    }
}

fn uses_of(g: &Graph, v: Value) -> Vec<(Node, usize)> {
    g.uses().get(v.0 as usize).cloned().unwrap_or_default()
}

/// Slices `v` (batch dim 0 over dp, sequence dim 1 over sp, where its dims are the
/// token symbols) and makes `uses` read the slice.
fn shard_value(
    g: &mut Graph,
    v: Value,
    layout: &Layout,
    batch_only: bool,
    what: &str,
    uses: &[(Node, usize)],
    res: &mut PassResult,
) -> Result<(), PassError> {
    let ty = g.ty(v).clone();
    let mut cur = v;
    let mut anchor = g.def(v);
    let mut sliced = Vec::new();
    for (dim, split) in layout.splits() {
        if batch_only && dim != 0 {
            continue;
        }
        if dim >= ty.rank() || ty.shape[dim] != weft_ir::Dim::sym(&split.symbol) {
            continue;
        }
        if let Some(cp) = split.ring {
            let meta = meta_for(
                g,
                anchor,
                NAME,
                format!("{what}: zigzag order over cp={cp}, so each rank holds one chunk from each end of the sequence (equal causal work per ring step)"),
            );
            let op = Op::Zigzag {
                dim: dim as i64,
                parts: cp as i64,
                inverse: false,
            };
            cur = insert1(g, NAME, At::After(anchor), op, &[cur], meta)?;
            anchor = g.def(cur);
        }
        let reason = reason(what, dim, split);
        let op = Op::Slice {
            dim: dim as i64,
            start: split.start(),
            len: split.local(),
        };
        let meta = meta_for(g, anchor, NAME, reason);
        cur = insert1(g, NAME, At::After(anchor), op, &[cur], meta)?;
        anchor = g.def(cur);
        sliced.push(dim);
        res.count("slices", 1);
    }
    if cur == v {
        return Ok(());
    }
    let reason =
        format!("{what}: restores the unsharded value until shard-seq propagates the split");
    let whole = gather_dims(g, NAME, layout, cur, &sliced, anchor, &reason)?;
    res.count("gathers", sliced.len() as u64);
    for &(n, i) in uses {
        g.node_mut(n).operands[i] = whole;
    }
    Ok(())
}

fn reason(what: &str, dim: usize, s: &Split) -> String {
    let kind = if dim == 0 { "batch" } else { "sequence" };
    let mut r = format!(
        "{what}: this rank's {kind} block [{}, +{})",
        s.start(),
        s.local()
    );
    if what.ends_with("(shifted)") {
        r.push_str(", after shift_labels so the target crossing each shard boundary is kept");
    }
    r
}

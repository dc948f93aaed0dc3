//! `ulysses-attention`: DeepSpeed-Ulysses sequence parallelism around every attention.
//!
//! After `shard-seq` each rank holds q/k/v for its block of the sequence,
//! `[B, N, S/sp, D]`, all_gathers them whole for the attention and slices its output
//! back. This pass replaces that: an `all_to_all {scatter_dim=1, gather_dim=2}` on each
//! of q, k, v trades heads for sequence, `[B, N/sp, S, D]`: every rank holds whole
//! sequences for `N/sp` heads, so attention (causal masks included) is exact. A second
//! all_to_all on the output (`scatter_dim=2, gather_dim=1`) trades back, in place of
//! the slice.
//!
//! GQA: rank `r` receives q heads `[r*Nq/sp, (r+1)*Nq/sp)`. When the kv heads do not
//! split over `sp`, each kv head is repeated `rep = sp / gcd(Nkv, sp)` times first
//! (reshape, expand, reshape), after which rank `r`'s kv heads are exactly the ones
//! its q heads attend to; the pass checks that head map for every rank before
//! rewriting. The q heads must divide by `sp`, or the layer is a compile-time error
//! naming the layer and the degrees that work.

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, SP};
use crate::util::{divisors, gcd, insert1, meta_for, remove_unused, strip_gathers};
use weft_ir::{At, Dim, Graph, Node, Op, TensorType, Value};

pub struct UlyssesAttention;

pub const NAME: &str = "ulysses-attention";

impl Pass for UlyssesAttention {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "all_to_all q, k, v (heads -> sequence) before each attention and its output (sequence -> heads) after; repeat kv heads when GQA has too few"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::shard_seq::NAME]
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::All(&[SP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let sp = cx.axis_size(NAME, SP)? as i64;
        crate::util::refuse_unsplit_attention(g, NAME)?;
        let mut res = PassResult::unchanged();
        res.count("attention_layers", 0)
            .count("all_to_all", 0)
            .count("kv_heads_repeated", 0);
        res.count("attention_kept_whole", 0);
        // Match every attention first (one use list for all), then rewrite each.
        let uses = g.uses();
        let attns: Vec<(Node, Option<Matched>)> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&n| matches!(g.node(n).op, Op::Attention { .. }))
            .map(|n| (n, sequence_parallel_attention(g, n, &uses)))
            .collect();
        drop(uses);
        let mut dead = Vec::new();
        for (n, m) in attns {
            match m {
                Some(m) => {
                    dead.push(m.slice);
                    dead.extend(m.gathers.iter().copied());
                    rewrite_attention(g, n, m, sp, cx.options.replicate_kv_heads, &mut res)?;
                    res.count("attention_layers", 1);
                    res.changed = true;
                }
                None => {
                    // Not split along the sequence by shard-seq (already rewritten, or
                    // left whole): nothing to trade.
                    res.count("attention_kept_whole", 1);
                }
            }
        }
        remove_unused(g, &dead);
        Ok(res)
    }
}

/// What shard-seq made around an attention: the per-rank q, k, v, the gathers, and
/// the slice of the output.
struct Matched {
    local: [Value; 3],
    gathers: Vec<Node>,
    slice: Node,
}

/// Matches `attention(all_gather_sp(q), all_gather_sp(k), all_gather_sp(v))` whose only
/// use is `slice {dim=2}` back to this rank's block, all made by shard-seq.
fn sequence_parallel_attention(g: &Graph, n: Node, uses: &[Vec<(Node, usize)>]) -> Option<Matched> {
    let ops = &g.node(n).operands;
    let mut local = [ops[0]; 3];
    let mut gathers = Vec::new();
    for i in 0..3 {
        let (x, dims, nodes) = strip_gathers(g, ops[i], crate::shard_seq::NAME);
        if dims != [(2, SP.to_string())] {
            return None;
        }
        local[i] = x;
        gathers.extend(nodes);
    }
    let out = g.node(n).results[0];
    let [(slice, 0)] = uses.get(out.0 as usize)?.as_slice() else {
        return None;
    };
    let is_slice = matches!(g.node(*slice).op, Op::Slice { dim: 2, .. })
        && crate::util::made_by(g, *slice, crate::shard_seq::NAME);
    let is_output = g.outputs().iter().any(|(_, v)| *v == out);
    (is_slice && !is_output).then_some(Matched {
        local,
        gathers,
        slice: *slice,
    })
}

fn bytes(t: &TensorType) -> Dim {
    t.numel() * t.dtype.size_bytes() as i64
}

fn heads_error(g: &Graph, n: Node, what: String, why: String, valid: &[i64]) -> PassError {
    let list: Vec<String> = valid.iter().map(|d| d.to_string()).collect();
    let help = if list.is_empty() {
        "this layer cannot use sequence parallelism over its heads; drop `sp` from the mesh"
            .to_string()
    } else {
        format!(
            "use an sp degree that works for this layer: {}",
            list.join(", ")
        )
    };
    PassError::rewrite(NAME, what, g.describe(n), why).with_help(help)
}

fn rewrite_attention(
    g: &mut Graph,
    n: Node,
    m: Matched,
    sp: i64,
    replicate: bool,
    res: &mut PassResult,
) -> Result<(), PassError> {
    let [q, k, v] = m.local;
    let nd = g.node(n);
    let slots = match nd.op.attention_operands(nd.operands.len()) {
        Some(Ok(s)) => s,
        Some(Err(why)) => {
            return Err(PassError::rewrite(
                NAME,
                "bad attention",
                g.describe(n),
                why,
            ))
        }
        None => unreachable!("an attention"),
    };
    let mask = slots.mask.map(|i| nd.operands[i]);
    let sinks = slots.sinks.map(|i| nd.operands[i]);
    let (qt, kt) = (g.ty(q).clone(), g.ty(k).clone());
    let what = format!("`{NAME}` cannot split the attention heads over sp={sp}");
    let (Some(nq), Some(nkv)) = (qt.shape[1].as_const(), kt.shape[1].as_const()) else {
        return Err(PassError::rewrite(
            NAME,
            what,
            g.describe(n),
            format!("head counts must be constants, got q {qt} and k {kt}"),
        ));
    };
    if nq % sp != 0 {
        let valid: Vec<i64> = divisors(nq);
        let best = valid
            .iter()
            .copied()
            .filter(|d| sp % d == 0)
            .max()
            .unwrap_or(1);
        let list: Vec<String> = valid.iter().map(|d| d.to_string()).collect();
        return Err(PassError::rewrite(
            NAME,
            what,
            g.describe(n),
            format!("its {nq} q heads ({nkv} kv heads) do not divide by sp={sp}"),
        )
        .with_help(format!(
            "use an sp degree that works for this layer ({}), and split the sequence further with context parallelism (ring attention has no head limit): e.g. `{}` in place of `sp={sp}`",
            list.join(", "),
            if best == 1 { format!("cp={sp}") } else { format!("cp={},sp={best}", sp / best) }
        )));
    }
    let rep = if nkv % sp == 0 { 1 } else { sp / gcd(nkv, sp) };
    if rep > 1 && !replicate {
        let valid: Vec<i64> = divisors(gcd(nq, nkv));
        return Err(heads_error(
            g,
            n,
            what,
            format!("its {nkv} kv heads do not divide by sp={sp} and kv-head replication is off ({nq} q heads)"),
            &valid,
        ));
    }
    check_head_map(nq, nkv, rep, sp)
        .map_err(|why| PassError::rewrite(NAME, what.clone(), g.describe(n), why))?;

    let a2a_in = Op::AllToAll {
        axis: SP.into(),
        scatter_dim: 1,
        gather_dim: 2,
    };
    let mut new_ops = Vec::new();
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        let mut x = x;
        if rep > 1 && name != "q" {
            x = repeat_heads(g, n, x, name, nkv, rep, sp)?;
            res.count("kv_heads_repeated", 1);
        }
        let reason = format!(
            "{name}: heads -> sequence, {} bytes per rank",
            bytes(g.ty(x))
        );
        let meta = meta_for(g, n, NAME, reason);
        new_ops.push(insert1(g, NAME, At::Before(n), a2a_in.clone(), &[x], meta)?);
        res.count("all_to_all", 1);
    }
    if let Some(mk) = mask {
        new_ops.push(heads_of_mask(g, n, mk, nq, &qt)?);
    }
    if let Some(s) = sinks {
        new_ops.push(heads_of_sinks(g, n, s, nq)?);
    }
    g.node_mut(n).operands = new_ops;
    g.reinfer(n)
        .map_err(|e| crate::util::build_error(NAME, e))?;
    let out = g.node(n).results[0];
    let reason = format!(
        "attention output: sequence -> heads, {} bytes per rank",
        bytes(g.ty(out))
    );
    let meta = meta_for(g, n, NAME, reason);
    let back = insert1(
        g,
        NAME,
        At::After(n),
        Op::AllToAll {
            axis: SP.into(),
            scatter_dim: 2,
            gather_dim: 1,
        },
        &[out],
        meta,
    )?;
    res.count("all_to_all", 1);
    let sliced = g.node(m.slice).results[0];
    g.replace_all_uses(sliced, back);
    Ok(())
}

/// `[B, Nkv, s, D]` -> `[B, Nkv*rep, s, D]`, each head repeated `rep` times in place.
pub(crate) fn repeat_heads(
    g: &mut Graph,
    n: Node,
    x: Value,
    name: &str,
    nkv: i64,
    rep: i64,
    sp: i64,
) -> Result<Value, PassError> {
    let t = g.ty(x).clone();
    let (b, s, d) = (t.shape[0].clone(), t.shape[2].clone(), t.shape[3].clone());
    let reason = format!("{name}: repeat each of {nkv} kv heads {rep}x so each of the sp={sp} ranks receives the kv heads of its q heads");
    let mut cur = x;
    let steps = [
        Op::Reshape {
            shape: vec![b.clone(), nkv.into(), 1.into(), s.clone(), d.clone()],
        },
        Op::Expand {
            shape: vec![b.clone(), nkv.into(), rep.into(), s.clone(), d.clone()],
        },
        Op::Reshape {
            shape: vec![b, (nkv * rep).into(), s, d],
        },
    ];
    for op in steps {
        let meta = meta_for(g, n, NAME, reason.clone());
        cur = insert1(g, NAME, At::Before(n), op, &[cur], meta)?;
    }
    Ok(cur)
}

/// After the all_to_all each rank attends over the whole sequence for its heads: the
/// mask is already whole along both sequence dims (shard-seq gathers a per-rank one),
/// and a per-head mask keeps this rank's heads.
fn heads_of_mask(
    g: &mut Graph,
    n: Node,
    mk: Value,
    nq: i64,
    qt: &TensorType,
) -> Result<Value, PassError> {
    let mt = g.ty(mk).clone();
    if mt.shape[1] == Dim::from(1) {
        return Ok(mk);
    }
    if mt.shape[1] != qt.shape[1] {
        return Err(PassError::rewrite(
            NAME,
            format!("`{NAME}` cannot split the mask heads"),
            g.describe(n),
            format!("mask {mt} has neither 1 nor {nq} heads"),
        ));
    }
    let local = Dim::from(nq) / Dim::sym(SP);
    let op = Op::Slice {
        dim: 1,
        start: Dim::coord(SP) * local.clone(),
        len: local,
    };
    let meta = meta_for(
        g,
        n,
        NAME,
        "mask: this rank's heads after heads -> sequence",
    );
    insert1(g, NAME, At::Before(n), op, &[mk], meta)
}

/// The sinks [Nq] of this rank's q heads after heads -> sequence (gpt-oss): the
/// gradient of each rank's slice lands in its heads' entries, and grad-sync's sum over
/// sp completes it.
fn heads_of_sinks(g: &mut Graph, n: Node, s: Value, nq: i64) -> Result<Value, PassError> {
    let local = Dim::from(nq) / Dim::sym(SP);
    let op = Op::Slice {
        dim: 0,
        start: Dim::coord(SP) * local.clone(),
        len: local,
    };
    let meta = meta_for(
        g,
        n,
        NAME,
        "sinks: this rank's q heads after heads -> sequence",
    );
    insert1(g, NAME, At::Before(n), op, &[s], meta)
}

/// Checks that on every rank each local q head attends to the kv head it attends to in
/// the unsharded model (GQA group `h / (Nq/Nkv)`), given kv heads repeated `rep` times.
pub(crate) fn check_head_map(nq: i64, nkv: i64, rep: i64, sp: i64) -> Result<(), String> {
    let nkv_rep = nkv * rep;
    if nq % sp != 0 || nkv_rep % sp != 0 || nq % nkv != 0 {
        return Err(format!(
            "{nq} q heads and {nkv} kv heads (x{rep}) do not split over sp={sp}"
        ));
    }
    let (q_local, kv_local) = (nq / sp, nkv_rep / sp);
    if q_local % kv_local != 0 {
        return Err(format!(
            "each rank would get {q_local} q heads and {kv_local} kv heads, which GQA cannot pair"
        ));
    }
    for r in 0..sp {
        for i in 0..q_local {
            let h = r * q_local + i;
            let want = h / (nq / nkv);
            let received = r * kv_local + i / (q_local / kv_local);
            let got = received / rep;
            if got != want {
                return Err(format!(
                    "rank {r}'s q head {h} would attend to kv head {got} instead of {want}"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_head_map;

    #[test]
    fn head_map_holds_whenever_q_heads_divide() {
        for nq in 1..=64 {
            for nkv in (1..=nq).filter(|k| nq % k == 0) {
                for sp in (1..=nq).filter(|s| nq % s == 0) {
                    let rep = if nkv % sp == 0 {
                        1
                    } else {
                        sp / super::gcd(nkv, sp)
                    };
                    assert_eq!(
                        check_head_map(nq, nkv, rep, sp),
                        Ok(()),
                        "nq={nq} nkv={nkv} sp={sp} rep={rep}"
                    );
                }
            }
        }
    }

    #[test]
    fn head_map_catches_a_wrong_repeat() {
        // 4 q heads, 2 kv heads, sp=4: without repeating, rank 1 would get no kv head.
        assert!(check_head_map(4, 2, 1, 4).is_err());
        assert!(check_head_map(4, 2, 2, 4).is_ok());
    }
}

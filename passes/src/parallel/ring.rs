//! `ring-attention`: context parallelism (mesh axis `cp`) around every attention.
//!
//! After `shard-seq` with a `cp` axis each rank holds q, k, v for its two zigzag chunks
//! of the sequence (chunks `r` and `2cp-1-r` of `2cp`; see `Op::Zigzag`), and shard-seq
//! all_gathers them whole (`all_gather` over sp, then cp, then `zigzag {inverse}`) for
//! the attention and takes this rank's block back out of the output. This pass replaces
//! that with one `ring_attention {axis=cp}` of the local q, k, v:
//!
//! - with `sp` as well, q, k, v first trade heads for sequence over sp (Ulysses, the
//!   same `all_to_all`s and kv-head repeats as `ulysses-attention`), so each rank holds
//!   its cp rank's two chunks for `N/sp` heads; the output trades back at the end;
//! - `ring_attention` stays one op through `autodiff` (whose rule is one
//!   `ring_attention_grad`), `checkpoint` and `offload`, so the backward saves only q,
//!   k, v, out and the log-sum-exp; `ring-lower` then expands both into the ring steps
//!   (see `ring_lower.rs` and docs/ring.md);
//! - at cp=1 the ring has one rank and the attention is left as it is.

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, CP, SP};
use crate::util::{gcd, insert1, made_by, meta_for, remove_unused, strip_seq_gathers};
use weft_ir::{At, Dim, Graph, Node, Op, TensorType, Value};

pub struct RingAttention;

pub const NAME: &str = "ring-attention";

impl Pass for RingAttention {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "ring attention over cp: k/v blocks passed around the ring (ring_shift), zigzag causal balance, per-block attention merged by log-sum-exp; Ulysses over sp inside"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::shard_seq::NAME]
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::All(&[CP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let cp = cx.axis_size(NAME, CP)? as i64;
        let sp = cx.mesh.size_or_one(SP) as i64;
        let mut res = PassResult::unchanged();
        for k in [
            "attention_layers",
            "ring_attentions",
            "all_to_all",
            "kv_heads_repeated",
            "attention_kept_whole",
        ] {
            res.count(k, 0);
        }
        let uses = g.uses();
        let attns: Vec<(Node, Option<Matched>)> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&n| matches!(g.node(n).op, Op::Attention { .. }))
            .map(|n| (n, matched(g, n, &uses, sp > 1)))
            .collect();
        drop(uses);
        let mut dead = Vec::new();
        for (n, m) in attns {
            let Some(m) = m else {
                res.count("attention_kept_whole", 1);
                continue;
            };
            if let Op::Attention { sinks, lse, .. } = &g.node(n).op {
                if sinks.0 || lse.0 {
                    return Err(PassError::rewrite(
                        NAME,
                        format!(
                            "`{NAME}` cannot split an attention with {} over the ring yet",
                            if sinks.0 { "sinks (gpt-oss)" } else { "a log-sum-exp result" }
                        ),
                        g.describe(n),
                        "a sink joins each row's softmax once, not once per k/v block, and the merge owns the log-sum-exp",
                    )
                    .with_help("drop `cp` from the mesh (use `sp`, which splits sinks with the heads)"));
                }
            }
            if g.node(n).operands.len() > 3 {
                return Err(PassError::rewrite(
                    NAME,
                    format!("`{NAME}` cannot pass an attention mask around the ring yet"),
                    g.describe(n),
                    "the keep-mask's key columns would have to follow each k/v block",
                )
                .with_help(
                    "drop `cp` from the mesh (use `sp`), or run without the attention_mask input",
                ));
            }
            let out = rewrite(g, n, &m, cp, sp, cx.options.replicate_kv_heads, &mut res)?;
            let sliced = g.node(m.slice).results[0];
            g.replace_all_uses(sliced, out);
            dead.push(m.slice);
            dead.push(m.zigzag);
            dead.push(n);
            dead.extend(m.gathers.iter().copied());
            res.count("attention_layers", 1);
            res.changed = true;
        }
        remove_unused(g, &dead);
        Ok(res)
    }
}

/// What shard-seq made around an attention on a cp mesh.
struct Matched {
    /// Per-rank q, k, v (`[B, N, S/cp/sp, D]`).
    local: [Value; 3],
    /// The gathers and inverse zigzags of q, k, v, outermost first.
    gathers: Vec<Node>,
    /// `zigzag` of the output, and the slice of this rank's block after it.
    zigzag: Node,
    slice: Node,
}

fn matched(g: &Graph, n: Node, uses: &[Vec<(Node, usize)>], sp: bool) -> Option<Matched> {
    let ops = &g.node(n).operands;
    let want: Vec<(usize, String)> = if sp {
        vec![(2, CP.to_string()), (2, SP.to_string())]
    } else {
        vec![(2, CP.to_string())]
    };
    let mut local = [ops[0]; 3];
    let mut gathers = Vec::new();
    for i in 0..3 {
        let (x, dims, nodes) = strip_seq_gathers(g, ops[i], crate::shard_seq::NAME);
        let zig = nodes
            .first()
            .is_some_and(|&z| matches!(g.node(z).op, Op::Zigzag { .. }));
        if dims != want || !zig {
            return None;
        }
        local[i] = x;
        gathers.extend(nodes);
    }
    let out = g.node(n).results[0];
    let single_use = |v: Value| match uses.get(v.0 as usize)?.as_slice() {
        [(m, 0)] => Some(*m),
        _ => None,
    };
    let zigzag = single_use(out)?;
    if !(matches!(
        g.node(zigzag).op,
        Op::Zigzag {
            inverse: false,
            dim: 2,
            ..
        }
    ) && made_by(g, zigzag, crate::shard_seq::NAME))
    {
        return None;
    }
    let slice = single_use(g.node(zigzag).results[0])?;
    let ok = matches!(g.node(slice).op, Op::Slice { dim: 2, .. })
        && made_by(g, slice, crate::shard_seq::NAME)
        && !g.outputs().iter().any(|(_, v)| *v == out);
    ok.then_some(Matched {
        local,
        gathers,
        zigzag,
        slice,
    })
}

fn bytes(t: &TensorType) -> Dim {
    t.numel() * t.dtype.size_bytes() as i64
}

/// Builds nodes before `at` with provenance.
struct Builder<'a> {
    g: &'a mut Graph,
    at: Node,
}

impl Builder<'_> {
    fn op(&mut self, op: Op, ins: &[Value], why: &str) -> Result<Value, PassError> {
        let meta = meta_for(self.g, self.at, NAME, why);
        insert1(self.g, NAME, At::Before(self.at), op, ins, meta)
    }
    fn op2(&mut self, op: Op, ins: &[Value], why: &str) -> Result<(Value, Value), PassError> {
        let meta = meta_for(self.g, self.at, NAME, why);
        let r = self
            .g
            .insert_with(At::Before(self.at), op, ins, meta)
            .map_err(|e| crate::util::build_error(NAME, e))?;
        Ok((r[0], r[1]))
    }
    fn ty(&self, v: Value) -> TensorType {
        self.g.ty(v).clone()
    }
}

#[allow(clippy::too_many_arguments)]
fn rewrite(
    g: &mut Graph,
    n: Node,
    m: &Matched,
    cp: i64,
    sp: i64,
    replicate: bool,
    res: &mut PassResult,
) -> Result<Value, PassError> {
    let Op::Attention {
        causal,
        scale,
        window,
        softcap,
        ..
    } = g.node(n).op.clone()
    else {
        unreachable!("matched attentions only")
    };
    let [mut q, mut k, mut v] = m.local;
    let desc = g.describe(n);
    let mut b = Builder { g, at: n };
    if sp > 1 {
        // Ulysses inside the ring: heads -> sequence over sp (the cp rank's two chunks).
        let (qt, kt) = (b.ty(q), b.ty(k));
        let what = format!("`{NAME}` cannot split the attention heads over sp={sp}");
        let (Some(nq), Some(nkv)) = (qt.shape[1].as_const(), kt.shape[1].as_const()) else {
            return Err(PassError::rewrite(
                NAME,
                what,
                desc,
                format!("head counts must be constants, got q {qt} and k {kt}"),
            ));
        };
        if nq % sp != 0 {
            return Err(PassError::rewrite(
                NAME,
                what,
                desc,
                format!("its {nq} q heads do not divide by sp={sp}"),
            )
            .with_help(format!(
                "use an sp that divides {nq} and a larger cp (ring attention has no head limit)"
            )));
        }
        let rep = if nkv % sp == 0 { 1 } else { sp / gcd(nkv, sp) };
        if rep > 1 && !replicate {
            return Err(PassError::rewrite(
                NAME,
                what,
                desc,
                format!(
                    "its {nkv} kv heads do not divide by sp={sp} and kv-head replication is off"
                ),
            )
            .with_help("use an sp that divides the kv heads and a larger cp"));
        }
        crate::ulysses::check_head_map(nq, nkv, rep, sp)
            .map_err(|why| PassError::rewrite(NAME, what.clone(), desc.clone(), why))?;
        let a2a = Op::AllToAll {
            axis: SP.into(),
            scatter_dim: 1,
            gather_dim: 2,
        };
        let mut traded = Vec::new();
        for (name, x) in [("q", q), ("k", k), ("v", v)] {
            let mut x = x;
            if rep > 1 && name != "q" {
                x = crate::ulysses::repeat_heads(b.g, n, x, name, nkv, rep, sp)?;
                res.count("kv_heads_repeated", 1);
            }
            let why = format!(
                "{name}: heads -> sequence over sp inside the ring, {} bytes per rank",
                bytes(b.g.ty(x))
            );
            traded.push(b.op(a2a.clone(), &[x], &why)?);
            res.count("all_to_all", 1);
        }
        (q, k, v) = (traded[0], traded[1], traded[2]);
    }
    let out = if cp == 1 {
        // A one-rank ring is the attention itself: no ring op, no log-sum-exp.
        b.op(
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal,
                scale,
                window,
                softcap,
                sinks: false.into(),
                lse: false.into(),
            },
            &[q, k, v],
            "cp=1: the ring has one rank, so this rank's tokens are the whole sequence",
        )?
    } else {
        res.count("ring_attentions", 1);
        let why = format!(
            "ring attention over cp={cp}: k/v blocks of {} bytes per rank travel the ring (expanded by `{}`)",
            bytes(b.g.ty(k)),
            crate::ring_lower::NAME
        );
        b.op2(
            Op::RingAttention {
                axis: CP.into(),
                causal,
                scale,
                window,
                softcap,
            },
            &[q, k, v],
            &why,
        )?
        .0
    };
    if sp > 1 {
        let why = format!(
            "attention output: sequence -> heads over sp, {} bytes per rank",
            bytes(b.g.ty(out))
        );
        res.count("all_to_all", 1);
        return b.op(
            Op::AllToAll {
                axis: SP.into(),
                scatter_dim: 2,
                gather_dim: 1,
            },
            &[out],
            &why,
        );
    }
    Ok(out)
}

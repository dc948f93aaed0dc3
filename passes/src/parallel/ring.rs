//! `ring-attention`: context parallelism (mesh axis `cp`) around every attention.
//!
//! After `shard-seq` with a `cp` axis each rank holds q, k, v for its two zigzag chunks
//! of the sequence (chunks `r` and `2cp-1-r` of `2cp`; see `Op::Zigzag`), and shard-seq
//! all_gathers them whole (`all_gather` over sp, then cp, then `zigzag {inverse}`) for
//! the attention and takes this rank's block back out of the output. This pass replaces
//! that with ring attention:
//!
//! - with `sp` as well, q, k, v first trade heads for sequence over sp (Ulysses, the
//!   same `all_to_all`s and kv-head repeats as `ulysses-attention`), so each rank holds
//!   its cp rank's two chunks for `N/sp` heads; the output trades back at the end;
//! - step 0 is causal attention over the rank's own chunks: in zigzag order that is
//!   exactly causal attention over the local `[2c]` tokens (chunk `2cp-1-r` sees all of
//!   chunk `r`, chunk `r` none of chunk `2cp-1-r`);
//! - step `t` (1..cp) receives the k/v of the rank `t` before on the ring
//!   (`ring_shift {shift=1}` of the previous step's k/v: the source is `s = r - t mod cp`).
//!   Of its four chunk pairs, (second q chunk, first k chunk) is always wholly visible,
//!   (first q chunk, second k chunk) never; (first, first) is visible when `s < r`
//!   (`r >= t`) and (second, second) otherwise. So every rank computes two `c x c` blocks
//!   without a mask, the second one choosing its operands by `where(@cp >= t)`: the same
//!   work on every rank, every step (the zigzag balance), and the blocks above the
//!   diagonal are never computed;
//! - each block's attention returns its log-sum-exp (`lse=true`); partial results merge
//!   as `l = log(e^l1 + e^l2)`, `o = o1 e^(l1-l) + o2 e^(l2-l)` (a block that does not
//!   apply to a chunk gets `lse = -1e30`, weight exactly 0);
//! - a sliding window (or a non-causal attention) uses the general form: every step
//!   attends the whole local q to the received k/v under a keep-mask built from the
//!   tokens' global positions (which travel around the ring with k/v), so the band is
//!   exact for any window.
//!
//! Backward: `autodiff` differentiates the ring: the transpose of each `ring_shift` is a
//! `ring_shift {shift=-1}` of the k/v gradients, i.e. dk/dv travel the ring the other
//! way and accumulate on the rank that owns the chunk, and each block's
//! `attention_grad` gets the gradient of its log-sum-exp from the merge (`dlse`).

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult, CP, SP};
use crate::util::{gcd, insert1, made_by, meta_for, remove_unused, strip_seq_gathers};
use weft_ir::{At, CmpOp, DType, Dim, Float, Graph, Node, Op, TensorType, Value};

pub struct RingAttention;

pub const NAME: &str = "ring-attention";

/// The log-sum-exp a block that does not apply to a chunk contributes: its merge weight
/// `e^(-1e30 - l)` is exactly 0.
const ABSENT_LSE: f64 = -1e30;

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
            "ring_steps",
            "ring_shifts",
            "block_attentions",
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
    fn slice(
        &mut self,
        x: Value,
        dim: i64,
        start: Dim,
        len: Dim,
        why: &str,
    ) -> Result<Value, PassError> {
        self.op(Op::Slice { dim, start, len }, &[x], why)
    }
    fn full(&mut self, value: f64, ty: TensorType, why: &str) -> Result<Value, PassError> {
        self.op(
            Op::Full {
                value: Float(value),
                ty,
            },
            &[],
            why,
        )
    }

    /// Merges two partial attentions over disjoint key sets by their log-sum-exp.
    fn merge(
        &mut self,
        a: (Value, Value),
        b: (Value, Value),
        why: &str,
    ) -> Result<(Value, Value), PassError> {
        let why = format!("{why}: log-sum-exp merge of partial attentions");
        let (o1, l1) = a;
        let (o2, l2) = b;
        let m = self.op(Op::Maximum {}, &[l1, l2], &why)?;
        let d1 = self.op(Op::Sub {}, &[l1, m], &why)?;
        let d2 = self.op(Op::Sub {}, &[l2, m], &why)?;
        let e1 = self.op(Op::Exp {}, &[d1], &why)?;
        let e2 = self.op(Op::Exp {}, &[d2], &why)?;
        let s = self.op(Op::Add {}, &[e1, e2], &why)?;
        let ls = self.op(Op::Log {}, &[s], &why)?;
        let l = self.op(Op::Add {}, &[m, ls], &why)?;
        let ot = self.ty(o1);
        let mut shape = self.ty(l).shape;
        shape.push(Dim::from(1));
        let weight = |b: &mut Self, li: Value| -> Result<Value, PassError> {
            let d = b.op(Op::Sub {}, &[li, l], &why)?;
            let w = b.op(Op::Exp {}, &[d], &why)?;
            let w = b.op(
                Op::Reshape {
                    shape: shape.clone(),
                },
                &[w],
                &why,
            )?;
            if b.ty(w).dtype == ot.dtype {
                Ok(w)
            } else {
                b.op(Op::Cast { dtype: ot.dtype }, &[w], &why)
            }
        };
        let w1 = weight(self, l1)?;
        let w2 = weight(self, l2)?;
        let p1 = self.op(Op::Mul {}, &[o1, w1], &why)?;
        let p2 = self.op(Op::Mul {}, &[o2, w2], &why)?;
        let o = self.op(Op::Add {}, &[p1, p2], &why)?;
        Ok((o, l))
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
    let out = if causal && window.is_none() {
        zigzag_causal_ring(&mut b, q, k, v, cp, scale, softcap, res)?
    } else {
        masked_ring(&mut b, q, k, v, cp, causal, window, scale, softcap, res)?
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

/// `ring_shift {shift=1}` of a k/v block, with its bytes in the reason.
fn ring_step(
    b: &mut Builder,
    x: Value,
    name: &str,
    t: i64,
    cp: i64,
    res: &mut PassResult,
) -> Result<Value, PassError> {
    let why = format!(
        "ring step {t}/{}: {name} block from the previous rank on the cp ring, {} bytes per rank (overlaps step {}'s attention)",
        cp - 1,
        bytes(b.g.ty(x)),
        t - 1
    );
    res.count("ring_shifts", 1);
    b.op(
        Op::RingShift {
            axis: CP.into(),
            shift: 1,
        },
        &[x],
        &why,
    )
}

fn block_attention(
    b: &mut Builder,
    ins: &[Value],
    causal: bool,
    scale: Float,
    softcap: Option<Float>,
    why: &str,
    res: &mut PassResult,
) -> Result<(Value, Value), PassError> {
    res.count("block_attentions", 1);
    b.op2(
        Op::Attention {
            causal,
            scale,
            window: None,
            softcap,
            sinks: false.into(),
            lse: true.into(),
        },
        ins,
        why,
    )
}

#[allow(clippy::too_many_arguments)]
fn zigzag_causal_ring(
    b: &mut Builder,
    q: Value,
    k: Value,
    v: Value,
    cp: i64,
    scale: Float,
    softcap: Option<Float>,
    res: &mut PassResult,
) -> Result<Value, PassError> {
    let local = b.ty(q).shape[2].clone();
    let c = local.clone() / 2;
    let zero = Dim::from(0);
    let (o, l) = block_attention(
        b,
        &[q, k, v],
        true,
        scale,
        softcap,
        "ring step 0: causal attention over this rank's own two zigzag chunks",
        res,
    )?;
    res.count("ring_steps", 1);
    let halves = "split into the two zigzag chunks";
    let mut acc0 = (
        b.slice(o, 2, zero.clone(), c.clone(), halves)?,
        b.slice(l, 2, zero.clone(), c.clone(), halves)?,
    );
    let mut acc1 = (
        b.slice(o, 2, c.clone(), c.clone(), halves)?,
        b.slice(l, 2, c.clone(), c.clone(), halves)?,
    );
    if cp == 1 {
        return Ok(o);
    }
    let q0 = b.slice(
        q,
        2,
        zero.clone(),
        c.clone(),
        "q: first zigzag chunk (chunk @cp)",
    )?;
    let q1 = b.slice(
        q,
        2,
        c.clone(),
        c.clone(),
        "q: second zigzag chunk (chunk 2cp-1-@cp)",
    )?;
    let rank = b.op(
        Op::Arange {
            start: Dim::coord(CP),
            ty: TensorType::new(DType::I64, vec![Dim::from(1)]),
        },
        &[],
        "this rank's cp coordinate, to pick the causal block of each ring step",
    )?;
    let lse_ty = b.ty(l);
    let absent = b.full(
        ABSENT_LSE,
        TensorType::new(lse_ty.dtype, vec![Dim::from(1)]),
        "log-sum-exp of a block that does not apply (merge weight 0)",
    )?;
    let (mut kt, mut vt) = (k, v);
    for t in 1..cp {
        kt = ring_step(b, kt, "k", t, cp, res)?;
        vt = ring_step(b, vt, "v", t, cp, res)?;
        res.count("ring_steps", 1);
        let what = format!("ring step {t}");
        let k0 = b.slice(
            kt,
            2,
            zero.clone(),
            c.clone(),
            &format!("{what}: first k chunk of the sender"),
        )?;
        let k1 = b.slice(
            kt,
            2,
            c.clone(),
            c.clone(),
            &format!("{what}: second k chunk of the sender"),
        )?;
        let v0 = b.slice(
            vt,
            2,
            zero.clone(),
            c.clone(),
            &format!("{what}: first v chunk of the sender"),
        )?;
        let v1 = b.slice(
            vt,
            2,
            c.clone(),
            c.clone(),
            &format!("{what}: second v chunk of the sender"),
        )?;
        // (second q chunk, first k chunk): always below the diagonal.
        let ob = block_attention(
            b,
            &[q1, k0, v0],
            false,
            scale,
            softcap,
            &format!("{what}: second q chunk x the sender's first chunk (always wholly visible)"),
            res,
        )?;
        // The sender is s = r - t mod cp: s < r iff r >= t.
        let tt = b.full(
            t as f64,
            TensorType::new(DType::I64, vec![Dim::from(1)]),
            &what,
        )?;
        let earlier = b.op(
            Op::Compare { op: CmpOp::Ge },
            &[rank, tt],
            &format!("{what}: the sender is an earlier rank (@cp >= {t})"),
        )?;
        let pick = format!("{what}: first chunks when the sender is earlier, else second chunks (the other pair is above the diagonal)");
        let qc = b.op(Op::Where {}, &[earlier, q0, q1], &pick)?;
        let kc = b.op(Op::Where {}, &[earlier, k0, k1], &pick)?;
        let vc = b.op(Op::Where {}, &[earlier, v0, v1], &pick)?;
        let (oc, lc) = block_attention(b, &[qc, kc, vc], false, scale, softcap, &pick, res)?;
        let lc0 = b.op(
            Op::Where {},
            &[earlier, lc, absent],
            &format!("{what}: applies to the first q chunk iff the sender is earlier"),
        )?;
        let lc1 = b.op(
            Op::Where {},
            &[earlier, absent, lc],
            &format!("{what}: applies to the second q chunk iff the sender is later"),
        )?;
        acc0 = b.merge(acc0, (oc, lc0), &what)?;
        acc1 = b.merge(acc1, ob, &what)?;
        acc1 = b.merge(acc1, (oc, lc1), &what)?;
    }
    b.op(
        Op::Concat { dim: 2 },
        &[acc0.0, acc1.0],
        "the two zigzag chunks of the ring attention output",
    )
}

/// The general ring: every step attends all local queries to the received block under a
/// keep-mask from global positions (causal, and the window's band).
#[allow(clippy::too_many_arguments)]
fn masked_ring(
    b: &mut Builder,
    q: Value,
    k: Value,
    v: Value,
    cp: i64,
    causal: bool,
    window: Option<i64>,
    scale: Float,
    softcap: Option<Float>,
    res: &mut PassResult,
) -> Result<Value, PassError> {
    let local = b.ty(q).shape[2].clone();
    let whole = local.clone() * Dim::sym(CP);
    // Global positions of this rank's tokens: its block of the zigzag-ordered positions.
    let pos_ty = TensorType::new(DType::I64, vec![whole]);
    let all = b.op(
        Op::Arange {
            start: Dim::from(0),
            ty: pos_ty,
        },
        &[],
        "token positions, for the ring's keep-masks",
    )?;
    let zz = b.op(
        Op::Zigzag {
            dim: 0,
            parts: cp,
            inverse: false,
        },
        &[all],
        "token positions in zigzag order over cp",
    )?;
    let qpos = b.slice(
        zz,
        0,
        Dim::coord(CP) * local.clone(),
        local.clone(),
        "positions of this rank's two zigzag chunks",
    )?;
    let qcol = b.op(
        Op::Reshape {
            shape: vec![local.clone(), Dim::from(1)],
        },
        &[qpos],
        "query positions as a column",
    )?;
    let mut acc: Option<(Value, Value)> = None;
    let (mut kt, mut vt, mut kpos) = (k, v, qpos);
    for t in 0..cp {
        let what = format!("ring step {t}");
        if t > 0 {
            kt = ring_step(b, kt, "k", t, cp, res)?;
            vt = ring_step(b, vt, "v", t, cp, res)?;
            kpos = ring_step(b, kpos, "key positions", t, cp, res)?;
        }
        res.count("ring_steps", 1);
        let krow = b.op(
            Op::Reshape {
                shape: vec![Dim::from(1), local.clone()],
            },
            &[kpos],
            &what,
        )?;
        let mask = if causal {
            let seen = b.op(
                Op::Compare { op: CmpOp::Le },
                &[krow, qcol],
                &format!("{what}: causal keep-mask from global positions"),
            )?;
            match window {
                Some(w) => {
                    let dist = b.op(Op::Sub {}, &[qcol, krow], &what)?;
                    let wt = b.full(w as f64, TensorType::new(DType::I64, vec![]), &what)?;
                    let near = b.op(
                        Op::Compare { op: CmpOp::Lt },
                        &[dist, wt],
                        &format!("{what}: sliding window of {w} keys"),
                    )?;
                    let no = b.full(0.0, TensorType::new(DType::Bool, vec![]), &what)?;
                    b.op(
                        Op::Where {},
                        &[seen, near, no],
                        &format!("{what}: causal and in the window"),
                    )?
                }
                None => seen,
            }
        } else {
            let t1 = TensorType::new(DType::Bool, vec![local.clone(), local.clone()]);
            b.full(1.0, t1, &format!("{what}: every key (not causal)"))?
        };
        let mask = b.op(
            Op::Reshape {
                shape: vec![Dim::from(1), Dim::from(1), local.clone(), local.clone()],
            },
            &[mask],
            &what,
        )?;
        let part = block_attention(
            b,
            &[q, kt, vt, mask],
            false,
            scale,
            softcap,
            &format!("{what}: this rank's queries x the received k/v block"),
            res,
        )?;
        acc = Some(match acc {
            None => part,
            Some(a) => b.merge(a, part, &what)?,
        });
    }
    Ok(acc.expect("cp >= 1").0)
}

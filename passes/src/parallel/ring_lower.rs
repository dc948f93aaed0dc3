//! `ring-lower`: expands every `ring_attention` and `ring_attention_grad` (made by
//! `ring-attention` and `autodiff`) into the ring steps themselves: `ring_shift`s of the
//! k/v blocks over the cp axis, per-block `attention` (forward, merged by log-sum-exp)
//! and per-block `attention_block_grad` (backward). See docs/ring.md.
//!
//! It runs after `autodiff` (and `checkpoint`, `offload`) in a training step, so the
//! backward saves only the ring op's operands and results (q, k, v, out, lse per layer):
//! the forward's received blocks die within the forward, and the backward sends k/v
//! around the ring a second time, with the dk/dv accumulators travelling beside them
//! (the transposed ring). In a forward-only pipeline it runs right after
//! `ring-attention`.
//!
//! Forward, causal without a window (zigzag layout: rank `r` holds chunks `r` and
//! `2cp-1-r` of `2cp`):
//! - step 0: causal attention over the rank's own two chunks (in zigzag order that is
//!   exactly causal attention over the local `[2c]` tokens);
//! - step `t` (1..cp) attends to the k/v of rank `s = r - t mod cp` (received by
//!   `ring_shift {shift=1}` of the previous step's block, issued before the previous
//!   step's attention so the transfer overlaps it; at most two blocks live). Of its four
//!   chunk pairs (second q, first k) is always wholly visible, (first q, second k)
//!   never; (first, first) is visible when `s < r` (`@cp >= t`) and (second, second)
//!   otherwise, so every rank computes two unmasked `c x c` blocks, the second choosing
//!   its operands by `where(@cp >= t)`;
//! - partial results merge as `l = log(e^l1 + e^l2)`, `o = o1 e^(l1-l) + o2 e^(l2-l)`;
//!   a block that does not apply to a chunk gets `lse = -1e30` (weight exactly 0).
//!
//! A sliding window or a non-causal attention uses the masked ring: every step attends
//! all local queries to the received block under a keep-mask from the tokens' global
//! positions. Only k/v travel the ring: each rank computes the key positions of the
//! block it holds at a step from its cp coordinate (the block of rank `s = r - t mod
//! cp` holds zigzag chunks `s` and `2cp-1-s`). A block every rank sees wholly (a
//! non-causal attention's; in the zigzag layout never a causal one's, see
//! `ring_steps::ring_blocks_unmasked`) runs without a mask. With a sliding
//! window and a known training sequence length (`TrainOptions::seq`) the ring stops
//! early: only the steps whose blocks meet the band are sent and computed, the first
//! steps of the forward ring (earlier ranks' first chunks) and of the reverse ring
//! (`ring_shift {shift=-1}`, later ranks' second chunks); see `ring_steps.rs`.
//! Unknown, every step is taken.
//! Each `ring_shift`'s reason ends with the compute it overlaps.
//!
//! With `TrainOptions::cp_kv` = all-gather (`--cp-kv allgather`) it writes the
//! all-gather variant instead (`ring_allgather.rs`): k/v gathered over cp, one masked
//! attention and one gradient against the whole sequence, dk/dv reduce-scattered home.
//!
//! Backward: the same steps and blocks in the same order; each block's
//! `attention_block_grad` takes the merged `out` and the whole row's `lse` (so its
//! probabilities are the final ones, `exp(s - lse)`, with no per-block statistics
//! kept), adds its dq into this rank's accumulator and its dk/dv into the accumulator of
//! the block it read, which travels one step further with the next `ring_shift`; after
//! step `cp-1` one more shift brings each rank's dk/dv home, where the step-0 part is
//! added.

use crate::pass::{Pass, PassContext, PassError, PassResult, CP};
use crate::placement::Placement;
use crate::readers::Readers;
use crate::ring_allgather::{self, CpKv};
use crate::ring_steps::{ring_blocks_unmasked, window_ring, WindowRing};
use crate::util::remove_unused;
use weft_ir::{
    At, CmpOp, DType, Dim, Float, Graph, Node, NodeMeta, Op, Provenance, TensorType, Value,
};

pub struct RingLower;

pub const NAME: &str = "ring-lower";

/// The log-sum-exp a block that does not apply to a chunk contributes: its merge weight
/// `e^(-1e30 - l)` is exactly 0.
const ABSENT_LSE: f64 = -1e30;

/// What the transfer that brings the dk/dv accumulators home overlaps.
const NO_OVERLAP: &str = "no compute (it carries the last step's gradients)";

impl Pass for RingLower {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "expands ring_attention into ring steps (ring_shift of k/v, per-block attention, log-sum-exp merge) and ring_attention_grad into the transposed ring (k/v re-sent, dk/dv accumulators travelling with them, per-block attention_block_grad)"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::ring::NAME]
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        for k in [
            "ring_attentions",
            "ring_attention_grads",
            "ring_steps",
            "ring_shifts",
            "block_attentions",
            "block_grads",
            "kv_all_gathers",
            "kv_reduce_scatters",
        ] {
            res.count(k, 0);
        }
        let todo: Vec<Node> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&n| {
                matches!(
                    g.node(n).op,
                    Op::RingAttention { .. } | Op::RingAttentionGrad { .. }
                )
            })
            .collect();
        let mut dead = Vec::new();
        // The new nodes wait at the end of the order and go before their ring op at
        // once, and uses move through the readers index: linear in the step's size.
        let mut rd = Readers::of(g);
        let mut place = Placement::new();
        for n in todo {
            let d = g.node(n).clone();
            let all_gather = cx.options.train.cp_kv == CpKv::AllGather;
            // The all-gather variant takes no ring steps, so it needs no sequence length.
            let seq = if all_gather {
                None
            } else {
                cx.options.train.seq
            };
            let ring = Ring::of(g, n, &d.op, seq)?;
            let mut b = Builder {
                g,
                at: n,
                res: &mut res,
                rd: &mut rd,
                place: &mut place,
            };
            let new: Vec<Value> = match &d.op {
                Op::RingAttention { .. } => {
                    b.res.count("ring_attentions", 1);
                    let [q, k, v] = [d.operands[0], d.operands[1], d.operands[2]];
                    let (o, l) = if all_gather {
                        ring_allgather::forward(&mut b, &ring, q, k, v)?
                    } else if ring.zigzag_causal() {
                        zigzag_forward(&mut b, &ring, q, k, v)?
                    } else {
                        masked_forward(&mut b, &ring, q, k, v)?
                    };
                    vec![o, l]
                }
                _ => {
                    b.res.count("ring_attention_grads", 1);
                    let x = Saved {
                        q: d.operands[0],
                        k: d.operands[1],
                        v: d.operands[2],
                        out: d.operands[3],
                        lse: d.operands[4],
                        dout: d.operands[5],
                    };
                    let (dq, dk, dv) = if all_gather {
                        ring_allgather::backward(&mut b, &ring, x)?
                    } else if ring.zigzag_causal() {
                        zigzag_backward(&mut b, &ring, x)?
                    } else {
                        masked_backward(&mut b, &ring, x)?
                    };
                    vec![dq, dk, dv]
                }
            };
            for (old, new) in d.results.iter().zip(new) {
                rd.replace_all_uses(g, *old, new);
            }
            dead.push(n);
            res.changed = true;
        }
        place.finish(g);
        remove_unused(g, &dead);
        Ok(res)
    }
}

/// The attributes of one ring op and its ring size.
pub(crate) struct Ring {
    pub(crate) cp: i64,
    pub(crate) causal: bool,
    pub(crate) window: Option<i64>,
    pub(crate) scale: Float,
    pub(crate) softcap: Option<Float>,
    /// The steps a causal sliding window needs, when the sequence length is known
    /// (unknown: every step, which is right for any length).
    pub(crate) window_ring: Option<WindowRing>,
}

impl Ring {
    fn of(g: &Graph, n: Node, op: &Op, seq: Option<i64>) -> Result<Ring, PassError> {
        let (Op::RingAttention {
            axis,
            causal,
            scale,
            window,
            softcap,
        }
        | Op::RingAttentionGrad {
            axis,
            causal,
            scale,
            window,
            softcap,
        }) = op
        else {
            unreachable!("ring ops only")
        };
        if axis != CP {
            return Err(PassError::rewrite(
                NAME,
                format!("`{NAME}` cannot run a ring over axis `{axis}`"),
                g.describe(n),
                "rings run over the context-parallel axis `cp` (its zigzag layout is assumed)",
            ));
        }
        let cp = g.mesh.size(axis).ok_or_else(|| {
            PassError::rewrite(
                NAME,
                format!("`{NAME}` has no ring to expand over"),
                g.describe(n),
                format!("the mesh `{}` has no axis `{axis}`", g.mesh),
            )
        })? as i64;
        let window_ring = match (*window, *causal, seq) {
            (Some(w), true, Some(seq)) if cp > 1 => {
                Some(window_ring(seq, cp, w).map_err(|why| {
                    PassError::rewrite(
                        NAME,
                        format!(
                            "`{NAME}` cannot choose the ring steps of a {w}-key sliding window"
                        ),
                        g.describe(n),
                        why,
                    )
                    .with_help(format!(
                        "give a sequence length (--seq) that is a multiple of 2 x cp = {}",
                        2 * cp
                    ))
                })?)
            }
            _ => None,
        };
        Ok(Ring {
            cp,
            causal: *causal,
            window: *window,
            scale: *scale,
            softcap: *softcap,
            window_ring,
        })
    }
    fn zigzag_causal(&self) -> bool {
        self.causal && self.window.is_none()
    }
}

/// The backward's operands: what the forward saved and the output gradient.
#[derive(Clone, Copy)]
pub(crate) struct Saved {
    pub(crate) q: Value,
    pub(crate) k: Value,
    pub(crate) v: Value,
    pub(crate) out: Value,
    pub(crate) lse: Value,
    pub(crate) dout: Value,
}

pub(crate) fn bytes(t: &TensorType) -> Dim {
    t.numel() * t.dtype.size_bytes() as i64
}

/// Builds nodes before `at` (placed there when the pass finishes) with the lowered
/// node's metadata (its scope, whether it is backward or recompute, its micro-batch) and
/// this pass's provenance.
pub(crate) struct Builder<'a> {
    pub(crate) g: &'a mut Graph,
    pub(crate) at: Node,
    pub(crate) res: &'a mut PassResult,
    rd: &'a mut Readers,
    place: &'a mut Placement,
}

impl Builder<'_> {
    fn meta(&self, why: &str) -> NodeMeta {
        let mut m = self.g.node(self.at).meta.clone();
        m.provenance = Some(Provenance {
            pass: NAME.into(),
            reason: why.into(),
        });
        m
    }
    pub(crate) fn ops(
        &mut self,
        op: Op,
        ins: &[Value],
        why: &str,
    ) -> Result<Vec<Value>, PassError> {
        let meta = self.meta(why);
        self.place
            .insert(self.g, self.rd, At::Before(self.at), op, ins, meta)
            .map_err(|e| crate::util::build_error(NAME, e))
    }
    pub(crate) fn op(&mut self, op: Op, ins: &[Value], why: &str) -> Result<Value, PassError> {
        Ok(self.ops(op, ins, why)?[0])
    }
    pub(crate) fn ty(&self, v: Value) -> TensorType {
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
    /// The two zigzag chunks of `x` along the sequence (dim 2).
    fn halves(&mut self, x: Value, what: &str) -> Result<(Value, Value), PassError> {
        let c = self.ty(x).shape[2].clone() / 2;
        let a = self.slice(
            x,
            2,
            Dim::from(0),
            c.clone(),
            &format!("{what}: first zigzag chunk"),
        )?;
        let b = self.slice(x, 2, c.clone(), c, &format!("{what}: second zigzag chunk"))?;
        Ok((a, b))
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
    fn add(&mut self, a: Value, b: Value, why: &str) -> Result<Value, PassError> {
        self.op(Op::Add {}, &[a, b], why)
    }
    fn pick(&mut self, cond: Value, a: Value, b: Value, why: &str) -> Result<Value, PassError> {
        self.op(Op::Where {}, &[cond, a, b], why)
    }

    /// `ring_shift {shift=1}` of a block for ring step `t`, with its bytes and the
    /// compute it `overlaps` in the reason.
    fn shift(
        &mut self,
        x: Value,
        name: &str,
        t: i64,
        cp: i64,
        overlaps: &str,
    ) -> Result<Value, PassError> {
        let step = format!("ring step {t}/{}", cp - 1);
        self.shift_by(
            x,
            1,
            &format!("{step}: {name} from the previous rank"),
            overlaps,
        )
    }

    /// `ring_shift {shift=by}` of `x` over the cp ring; the reason is `what`, the bytes
    /// per rank and the compute the transfer `overlaps`.
    fn shift_by(
        &mut self,
        x: Value,
        by: i64,
        what: &str,
        overlaps: &str,
    ) -> Result<Value, PassError> {
        let why = format!(
            "{what} on the cp ring, {} bytes per rank; overlaps {overlaps}",
            bytes(self.g.ty(x)),
        );
        self.res.count("ring_shifts", 1);
        self.op(
            Op::RingShift {
                axis: CP.into(),
                shift: by,
            },
            &[x],
            &why,
        )
    }

    pub(crate) fn block_attention(
        &mut self,
        r: &Ring,
        ins: &[Value],
        causal: bool,
        why: &str,
    ) -> Result<(Value, Value), PassError> {
        self.res.count("block_attentions", 1);
        let v = self.ops(
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal,
                scale: r.scale,
                window: None,
                softcap: r.softcap,
                sinks: false.into(),
                lse: true.into(),
            },
            ins,
            why,
        )?;
        Ok((v[0], v[1]))
    }

    /// dq, dk, dv of one block: `ins` = q, k, v, out, dout, lse (, mask).
    pub(crate) fn block_grad(
        &mut self,
        r: &Ring,
        ins: &[Value],
        causal: bool,
        why: &str,
    ) -> Result<(Value, Value, Value), PassError> {
        self.res.count("block_grads", 1);
        let v = self.ops(
            Op::AttentionBlockGrad {
                causal,
                scale: r.scale,
                softcap: r.softcap,
            },
            ins,
            why,
        )?;
        Ok((v[0], v[1], v[2]))
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

    /// `[1]` bool: whether step `t`'s sender (rank `@cp - t mod cp`) is an earlier rank,
    /// i.e. `@cp >= t`.
    fn sender_is_earlier(&mut self, t: i64) -> Result<Value, PassError> {
        let what = format!("ring step {t}");
        let rank = self.op(
            Op::Arange {
                start: Dim::coord(CP),
                ty: TensorType::new(DType::I64, vec![Dim::from(1)]),
            },
            &[],
            "this rank's cp coordinate, to pick the causal block of each ring step",
        )?;
        let tt = self.full(
            t as f64,
            TensorType::new(DType::I64, vec![Dim::from(1)]),
            &what,
        )?;
        self.op(
            Op::Compare { op: CmpOp::Ge },
            &[rank, tt],
            &format!("{what}: the sender is an earlier rank (@cp >= {t})"),
        )
    }
}

/// The zigzag causal ring's forward: out and lse of the rank's two chunks.
fn zigzag_forward(
    b: &mut Builder,
    r: &Ring,
    q: Value,
    k: Value,
    v: Value,
) -> Result<(Value, Value), PassError> {
    let cp = r.cp;
    // Step 1's blocks are on their way while step 0 computes.
    let mut next = if cp > 1 {
        let during = "ring step 0's causal attention over this rank's own two chunks";
        Some((
            b.shift(k, "k block", 1, cp, during)?,
            b.shift(v, "v block", 1, cp, during)?,
        ))
    } else {
        None
    };
    let (o, l) = b.block_attention(
        r,
        &[q, k, v],
        true,
        "ring step 0: causal attention over this rank's own two zigzag chunks",
    )?;
    b.res.count("ring_steps", 1);
    if cp == 1 {
        return Ok((o, l));
    }
    let (o0, o1) = b.halves(o, "step 0 out")?;
    let (l0, l1) = b.halves(l, "step 0 lse")?;
    let (mut acc0, mut acc1) = ((o0, l0), (o1, l1));
    let (q0, q1) = b.halves(q, "q")?;
    let lse_ty = b.ty(l);
    let absent = b.full(
        ABSENT_LSE,
        TensorType::new(lse_ty.dtype, vec![Dim::from(1)]),
        "log-sum-exp of a block that does not apply (merge weight 0)",
    )?;
    for t in 1..cp {
        let (kt, vt) = next.take().expect("the step's blocks were sent");
        if t + 1 < cp {
            let during = format!("ring step {t}'s two block attentions");
            next = Some((
                b.shift(kt, "k block", t + 1, cp, &during)?,
                b.shift(vt, "v block", t + 1, cp, &during)?,
            ));
        }
        b.res.count("ring_steps", 1);
        let what = format!("ring step {t}");
        let (k0, k1) = b.halves(kt, &format!("{what}: the sender's k"))?;
        let (v0, v1) = b.halves(vt, &format!("{what}: the sender's v"))?;
        let ob = b.block_attention(
            r,
            &[q1, k0, v0],
            false,
            &format!("{what}: second q chunk x the sender's first chunk (always wholly visible)"),
        )?;
        let earlier = b.sender_is_earlier(t)?;
        let pick = format!("{what}: first chunks when the sender is earlier, else second chunks (the other pair is above the diagonal)");
        let qc = b.pick(earlier, q0, q1, &pick)?;
        let kc = b.pick(earlier, k0, k1, &pick)?;
        let vc = b.pick(earlier, v0, v1, &pick)?;
        let (oc, lc) = b.block_attention(r, &[qc, kc, vc], false, &pick)?;
        let lc0 = b.pick(
            earlier,
            lc,
            absent,
            &format!("{what}: applies to the first q chunk iff the sender is earlier"),
        )?;
        let lc1 = b.pick(
            earlier,
            absent,
            lc,
            &format!("{what}: applies to the second q chunk iff the sender is later"),
        )?;
        acc0 = b.merge(acc0, (oc, lc0), &what)?;
        acc1 = b.merge(acc1, ob, &what)?;
        acc1 = b.merge(acc1, (oc, lc1), &what)?;
    }
    let why = "the two zigzag chunks of the ring attention";
    let o = b.op(Op::Concat { dim: 2 }, &[acc0.0, acc1.0], why)?;
    let l = b.op(Op::Concat { dim: 2 }, &[acc0.1, acc1.1], why)?;
    Ok((o, l))
}

/// The zigzag causal ring's backward: dq, dk, dv.
fn zigzag_backward(
    b: &mut Builder,
    r: &Ring,
    x: Saved,
) -> Result<(Value, Value, Value), PassError> {
    let cp = r.cp;
    let mut next = if cp > 1 {
        let during = "ring step 0's block gradient of this rank's own two chunks";
        Some((
            b.shift(x.k, "k block (again, for the backward)", 1, cp, during)?,
            b.shift(x.v, "v block (again, for the backward)", 1, cp, during)?,
        ))
    } else {
        None
    };
    let (dq, dk_own, dv_own) = b.block_grad(
        r,
        &[x.q, x.k, x.v, x.out, x.dout, x.lse],
        true,
        "ring step 0 backward: causal block of this rank's own two chunks",
    )?;
    if cp == 1 {
        return Ok((dq, dk_own, dv_own));
    }
    let (mut dq0, mut dq1) = b.halves(dq, "step 0 dq")?;
    let (q0, q1) = b.halves(x.q, "q")?;
    let (o0, o1) = b.halves(x.out, "out")?;
    let (g0, g1) = b.halves(x.dout, "dout")?;
    let (l0, l1) = b.halves(x.lse, "lse")?;
    let zero = b.full(
        0.0,
        TensorType::scalar(b.ty(x.q).dtype),
        "no gradient from a block that does not apply",
    )?;
    // The dk/dv accumulator of the block this rank holds, travelling with it.
    let mut acc: Option<(Value, Value)> = None;
    for t in 1..cp {
        let (kt, vt) = next.take().expect("the step's blocks were sent");
        let during = format!("ring step {t}'s two block gradients");
        if t + 1 < cp {
            next = Some((
                b.shift(kt, "k block (again, for the backward)", t + 1, cp, &during)?,
                b.shift(vt, "v block (again, for the backward)", t + 1, cp, &during)?,
            ));
        }
        // The previous step's dk/dv accumulator moves on while this step computes.
        let moved = match acc.take() {
            None => None,
            Some((dk, dv)) => Some((
                b.shift(dk, "dk accumulator of the block", t, cp, &during)?,
                b.shift(dv, "dv accumulator of the block", t, cp, &during)?,
            )),
        };
        let what = format!("ring step {t} backward");
        let (k0, k1) = b.halves(kt, &format!("{what}: the sender's k"))?;
        let (v0, v1) = b.halves(vt, &format!("{what}: the sender's v"))?;
        let (dq1a, dk0a, dv0a) = b.block_grad(
            r,
            &[q1, k0, v0, o1, g1, l1],
            false,
            &format!("{what}: second q chunk x the sender's first chunk"),
        )?;
        let earlier = b.sender_is_earlier(t)?;
        let pick = format!("{what}: first chunks when the sender is earlier, else second chunks");
        let qc = b.pick(earlier, q0, q1, &pick)?;
        let kc = b.pick(earlier, k0, k1, &pick)?;
        let vc = b.pick(earlier, v0, v1, &pick)?;
        let oc = b.pick(earlier, o0, o1, &pick)?;
        let gc = b.pick(earlier, g0, g1, &pick)?;
        let lc = b.pick(earlier, l0, l1, &pick)?;
        let (dqc, dkc, dvc) = b.block_grad(r, &[qc, kc, vc, oc, gc, lc], false, &pick)?;
        let to_first = format!("{what}: the chosen block's gradient goes to the first chunks iff the sender is earlier");
        let to_second = format!(
            "{what}: the chosen block's gradient goes to the second chunks iff the sender is later"
        );
        let dqc0 = b.pick(earlier, dqc, zero, &to_first)?;
        let dqc1 = b.pick(earlier, zero, dqc, &to_second)?;
        dq0 = b.add(dq0, dqc0, &what)?;
        dq1 = b.add(dq1, dq1a, &what)?;
        dq1 = b.add(dq1, dqc1, &what)?;
        let mut grads = Vec::new();
        for (name, first, chosen) in [("dk", dk0a, dkc), ("dv", dv0a, dvc)] {
            let c0 = b.pick(earlier, chosen, zero, &to_first)?;
            let c1 = b.pick(earlier, zero, chosen, &to_second)?;
            let first = b.add(first, c0, &what)?;
            grads.push(b.op(
                Op::Concat { dim: 2 },
                &[first, c1],
                &format!("{what}: {name} of the sender's two chunks"),
            )?);
        }
        acc = Some(match moved {
            None => (grads[0], grads[1]),
            Some((dk, dv)) => (b.add(dk, grads[0], &what)?, b.add(dv, grads[1], &what)?),
        });
    }
    let (dk, dv) = acc.expect("cp > 1");
    let home = "the dk/dv accumulators back to the rank that owns the block";
    let dk = b.shift_by(dk, 1, home, NO_OVERLAP)?;
    let dv = b.shift_by(dv, 1, home, NO_OVERLAP)?;
    let dk = b.add(dk_own, dk, "this rank's k: the ring's part plus step 0's")?;
    let dv = b.add(dv_own, dv, "this rank's v: the ring's part plus step 0's")?;
    let dq = b.op(
        Op::Concat { dim: 2 },
        &[dq0, dq1],
        "dq of the two zigzag chunks",
    )?;
    Ok((dq, dk, dv))
}

/// Global positions of the keys of the block a rank holds `d` steps along the ring: the
/// k/v of rank `s = @cp - d mod cp` (zigzag chunks `s` and `2cp-1-s`), which is block
/// `@cp` of the whole sequence's zigzag positions `zz` rolled `d` blocks on. Computed on
/// the rank, so no positions travel the ring with the block.
fn sender_positions(
    b: &mut Builder,
    zz: Value,
    local: &Dim,
    d: i64,
    what: &str,
) -> Result<Value, PassError> {
    let why =
        format!("{what}: key positions of the sender's block (@cp - {d} mod cp), computed here");
    let cut = local.clone() * (Dim::sym(CP) + (-d));
    let tail = b.slice(zz, 0, cut.clone(), local.clone() * d, &why)?;
    let head = b.slice(zz, 0, Dim::from(0), cut, &why)?;
    let rolled = b.op(
        Op::Concat { dim: 0 },
        &[tail, head],
        &format!("{what}: the zigzag positions rolled {d} rank block(s) on"),
    )?;
    b.slice(
        rolled,
        0,
        Dim::coord(CP) * local.clone(),
        local.clone(),
        &why,
    )
}

/// The keep-masks of the masked ring, from the positions (the whole sequence's in
/// zigzag order, this rank's queries') made when a step first needs a mask.
struct Masks {
    local: Dim,
    /// The whole sequence's zigzag positions, this rank's and the same as a column.
    positions: Option<(Value, Value, Value)>,
}

impl Masks {
    fn new(local: Dim) -> Masks {
        Masks {
            local,
            positions: None,
        }
    }

    /// The keep-mask of this rank's queries against the block of the rank `d` back on
    /// the ring (`@cp - d mod cp`; 0: its own), or `None` where that block is wholly
    /// visible on every rank (`ring_steps::ring_blocks_unmasked`), whose attention
    /// then runs unmasked.
    fn of(
        &mut self,
        b: &mut Builder,
        r: &Ring,
        d: i64,
        what: &str,
    ) -> Result<Option<Value>, PassError> {
        if ring_blocks_unmasked(r.causal, r.window) {
            return Ok(None);
        }
        let (zz, qpos, qcol) = match self.positions {
            Some(x) => x,
            None => {
                let x = zigzag_positions(b, r, &self.local)?;
                self.positions = Some(x);
                x
            }
        };
        let kpos = if d == 0 {
            qpos
        } else {
            sender_positions(b, zz, &self.local, d, what)?
        };
        Ok(Some(keep_mask(b, r, &self.local, qcol, kpos, what)?))
    }
}

/// `ins` with the keep-mask, if any, appended; and the reason's note for a block run
/// without one.
fn masked(ins: &[Value], mask: Option<Value>) -> (Vec<Value>, &'static str) {
    let mut v = ins.to_vec();
    match mask {
        Some(m) => {
            v.push(m);
            (v, "")
        }
        None => (v, " (wholly visible on every rank: no mask)"),
    }
}

/// The whole sequence's positions in zigzag order over cp (`[local x cp]`, the order
/// of the rank blocks), this rank's block of them and the same as a column, for the
/// keep-masks (every rank computes them; none travel).
///
/// A ring that stops early is right only for sequences of at least `min_seq` tokens
/// (shorter ones have smaller chunks, whose band reaches further ranks), so its
/// positions are made as two ranges, `[0, S - min_seq)` and `[S - min_seq, S)`: the
/// first one's size is negative for a shorter sequence, which binding the sizes
/// (`check_bindings`, the runtimes) refuses as `S` too small, naming the nearest
/// lengths that work.
pub(crate) fn zigzag_positions(
    b: &mut Builder,
    r: &Ring,
    local: &Dim,
) -> Result<(Value, Value, Value), PassError> {
    let cp = r.cp;
    let whole = local.clone() * Dim::sym(CP);
    let positions = |b: &mut Builder, start: Dim, len: Dim, why: &str| {
        b.op(
            Op::Arange {
                start,
                ty: TensorType::new(DType::I64, vec![len]),
            },
            &[],
            why,
        )
    };
    let all = match r.window_ring {
        Some(w) if w.steps() < cp - 1 => {
            let min = Dim::from(w.min_seq);
            let head = whole.clone() - min.clone();
            let why = format!(
                "token positions, for the ring's keep-masks: the ring stops early, so the sequence must hold at least {} tokens (this size is negative otherwise)",
                w.min_seq
            );
            let first = positions(b, Dim::from(0), head.clone(), &why)?;
            let last = positions(
                b,
                head,
                min,
                "token positions, for the ring's keep-masks: the last ones",
            )?;
            b.op(
                Op::Concat { dim: 0 },
                &[first, last],
                "token positions, for the ring's keep-masks",
            )?
        }
        _ => positions(
            b,
            Dim::from(0),
            whole,
            "token positions, for the ring's keep-masks",
        )?,
    };
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
    Ok((zz, qpos, qcol))
}

/// The keep-mask `[1, 1, local, keys]` of this rank's queries against the keys at
/// positions `kpos` (`[keys]`: a ring block's, or the whole gathered sequence's).
pub(crate) fn keep_mask(
    b: &mut Builder,
    r: &Ring,
    local: &Dim,
    qcol: Value,
    kpos: Value,
    what: &str,
) -> Result<Value, PassError> {
    let keys = b.ty(kpos).shape[0].clone();
    let krow = b.op(
        Op::Reshape {
            shape: vec![Dim::from(1), keys.clone()],
        },
        &[kpos],
        what,
    )?;
    let mask = if r.causal {
        let seen = b.op(
            Op::Compare { op: CmpOp::Le },
            &[krow, qcol],
            &format!("{what}: causal keep-mask from global positions"),
        )?;
        match r.window {
            Some(w) => {
                let dist = b.op(Op::Sub {}, &[qcol, krow], what)?;
                let wt = b.full(w as f64, TensorType::new(DType::I64, vec![]), what)?;
                let near = b.op(
                    Op::Compare { op: CmpOp::Lt },
                    &[dist, wt],
                    &format!("{what}: sliding window of {w} keys"),
                )?;
                let no = b.full(0.0, TensorType::new(DType::Bool, vec![]), what)?;
                b.pick(seen, near, no, &format!("{what}: causal and in the window"))?
            }
            None => seen,
        }
    } else {
        let t1 = TensorType::new(DType::Bool, vec![local.clone(), keys.clone()]);
        b.full(1.0, t1, &format!("{what}: every key (not causal)"))?
    };
    b.op(
        Op::Reshape {
            shape: vec![Dim::from(1), Dim::from(1), local.clone(), keys],
        },
        &[mask],
        what,
    )
}

/// One ring of the masked lowering: `steps` steps of `ring_shift {shift=by}`.
#[derive(Clone, Copy)]
struct Direction {
    by: i64,
    steps: i64,
}

impl Direction {
    /// The name of step `t` of this ring in reasons.
    fn step(&self, t: i64) -> String {
        let ring = if self.by > 0 { "ring" } else { "reverse ring" };
        format!("{ring} step {t}/{}", self.steps)
    }
    fn from(&self) -> &'static str {
        if self.by > 0 {
            "from the previous rank"
        } else {
            "from the next rank"
        }
    }
}

/// The rings the masked lowering runs: with a bounded sliding window, the steps of
/// the forward and reverse rings whose blocks meet the band (`ring_steps`); otherwise
/// all `cp - 1` steps of the forward ring.
fn directions(r: &Ring) -> Vec<Direction> {
    let all = match r.window_ring {
        Some(w) => vec![
            Direction {
                by: 1,
                steps: w.from_earlier,
            },
            Direction {
                by: -1,
                steps: w.from_later,
            },
        ],
        None => vec![Direction {
            by: 1,
            steps: r.cp - 1,
        }],
    };
    all.into_iter().filter(|d| d.steps > 0).collect()
}

/// A block on the ring: k and v (each rank computes its keys' positions itself).
type Block = (Value, Value);

/// Sends `block` one step further along ring `d`, for step `t`, while `overlaps`
/// computes.
fn send(
    b: &mut Builder,
    d: Direction,
    block: Block,
    t: i64,
    again: &str,
    overlaps: &str,
) -> Result<Block, PassError> {
    let (k, v) = block;
    let what = |name: &str| format!("{}: {name}{again} {}", d.step(t), d.from());
    Ok((
        b.shift_by(k, d.by, &what("k block"), overlaps)?,
        b.shift_by(v, d.by, &what("v block"), overlaps)?,
    ))
}

/// The masked ring's forward: every step attends all local queries to the received
/// block under a keep-mask from global positions (causal, and the window's band), the
/// key positions computed on the rank; a block every rank sees wholly runs unmasked.
fn masked_forward(
    b: &mut Builder,
    r: &Ring,
    q: Value,
    k: Value,
    v: Value,
) -> Result<(Value, Value), PassError> {
    let local = b.ty(q).shape[2].clone();
    let mut masks = Masks::new(local);
    let dirs = directions(r);
    let during = "ring step 0's attention of this rank's queries to its own block";
    let mut pending = Vec::new();
    for &d in &dirs {
        pending.push(Some(send(b, d, (k, v), 1, "", during)?));
    }
    b.res.count("ring_steps", 1);
    let mask = masks.of(b, r, 0, "ring step 0")?;
    let (ins, note) = masked(&[q, k, v], mask);
    let step0 = match r.window_ring {
        Some(w) => format!(
            "ring step 0: this rank's queries x its own k/v block{note}; the {}-key window's ring takes {w}",
            r.window.unwrap_or_default()
        ),
        None => format!("ring step 0: this rank's queries x its own k/v block{note}"),
    };
    let mut acc = b.block_attention(r, &ins, false, &step0)?;
    for (i, &d) in dirs.iter().enumerate() {
        for t in 1..=d.steps {
            let (kt, vt) = pending[i].take().expect("the step's block was sent");
            let what = d.step(t);
            if t < d.steps {
                let during = format!("{what}'s block attention");
                pending[i] = Some(send(b, d, (kt, vt), t + 1, "", &during)?);
            }
            b.res.count("ring_steps", 1);
            let mask = masks.of(b, r, (d.by * t).rem_euclid(r.cp), &what)?;
            let (ins, note) = masked(&[q, kt, vt], mask);
            let part = b.block_attention(
                r,
                &ins,
                false,
                &format!("{what}: this rank's queries x the received k/v block{note}"),
            )?;
            acc = b.merge(acc, part, &what)?;
        }
    }
    Ok(acc)
}

/// The masked ring's backward: the same steps, each block's gradient from the merged
/// out and lse; each ring's dk/dv accumulator travels with its blocks and goes home
/// after the ring's last step.
fn masked_backward(
    b: &mut Builder,
    r: &Ring,
    x: Saved,
) -> Result<(Value, Value, Value), PassError> {
    let cp = r.cp;
    let local = b.ty(x.q).shape[2].clone();
    let mut masks = Masks::new(local);
    let dirs = directions(r);
    let again = " (again, for the backward)";
    let during = "ring step 0's block gradient of this rank's own block";
    let mut pending = Vec::new();
    for &d in &dirs {
        pending.push(Some(send(b, d, (x.k, x.v), 1, again, during)?));
    }
    let grad = |b: &mut Builder, kt: Value, vt: Value, mask: Option<Value>, what: &str| {
        let (ins, note) = masked(&[x.q, kt, vt, x.out, x.dout, x.lse], mask);
        b.block_grad(
            r,
            &ins,
            false,
            &format!("{what}: this rank's queries x the received k/v block{note}"),
        )
    };
    let mask = masks.of(b, r, 0, "ring step 0 backward")?;
    let (mut dq, mut dk, mut dv) = grad(b, x.k, x.v, mask, "ring step 0 backward")?;
    for (i, &d) in dirs.iter().enumerate() {
        let mut acc: Option<(Value, Value)> = None;
        for t in 1..=d.steps {
            let (kt, vt) = pending[i].take().expect("the step's block was sent");
            let what = format!("{} backward", d.step(t));
            let during = format!("{what}'s block gradient");
            if t < d.steps {
                pending[i] = Some(send(b, d, (kt, vt), t + 1, again, &during)?);
            }
            // The previous step's accumulator moves on with its block while this
            // step computes.
            let moved = match acc.take() {
                None => None,
                Some((ak, av)) => {
                    let name = |n: &str| {
                        format!("{}: {n} accumulator of the block {}", d.step(t), d.from())
                    };
                    Some((
                        b.shift_by(ak, d.by, &name("dk"), &during)?,
                        b.shift_by(av, d.by, &name("dv"), &during)?,
                    ))
                }
            };
            let mask = masks.of(b, r, (d.by * t).rem_euclid(cp), &what)?;
            let (dqt, dkt, dvt) = grad(b, kt, vt, mask, &what)?;
            dq = b.add(dq, dqt, &what)?;
            acc = Some(match moved {
                None => (dkt, dvt),
                Some((ak, av)) => (b.add(ak, dkt, &what)?, b.add(av, dvt, &what)?),
            });
        }
        if let Some((ak, av)) = acc {
            // The accumulator of the block of the rank `by x steps` back goes to it.
            let home_by = (-d.by * d.steps).rem_euclid(cp);
            let home = format!(
                "the {} accumulators back to the rank that owns the block",
                if d.by > 0 {
                    "ring's dk/dv"
                } else {
                    "reverse ring's dk/dv"
                }
            );
            let ak = b.shift_by(ak, home_by, &home, NO_OVERLAP)?;
            let av = b.shift_by(av, home_by, &home, NO_OVERLAP)?;
            dk = b.add(dk, ak, "this rank's k: the ring's part plus step 0's")?;
            dv = b.add(dv, av, "this rank's v: the ring's part plus step 0's")?;
        }
    }
    Ok((dq, dk, dv))
}

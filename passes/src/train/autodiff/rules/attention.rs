//! Backward rules of `attention` (one `attention_grad`, which also takes the
//! log-sum-exp's gradient) and `ring_attention` (one `ring_attention_grad`, which
//! `ring-lower` expands into the backward ring).

use super::super::{err, Ad};
use crate::pass::PassError;
use weft_ir::{DType, Node, NodeData, Op, Value};

impl Ad<'_> {
    /// The gradients of q, k, v (and the sinks) of an `attention`.
    pub(super) fn vjp_attention(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
        want: &[bool],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let Op::Attention {
            causal,
            scale,
            window,
            softcap,
            sinks,
            lse,
            layout,
        } = &d.op
        else {
            return Err(self.no_rule(n, &d.op));
        };
        let ops = &d.operands;
        let y = d.results[0];
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        // out and (lse=true) the log-sum-exp: one attention_grad takes both
        // gradients, a zero one for out when it has none.
        if dy.iter().all(|g| g.is_none()) {
            return Ok(out);
        }
        let slots =
            d.op.attention_operands(ops.len())
                .expect("an attention")
                .map_err(|m| err("`autodiff`: malformed attention", self.g.describe(n), m))?;
        let dout = match dy[0] {
            Some(g) => g,
            None => {
                let t = self.ty(y);
                self.zeros(&t)?
            }
        };
        let mut operands = vec![ops[0], ops[1], ops[2], y, dout];
        operands.extend(slots.mask.map(|i| ops[i]));
        operands.extend(slots.sinks.map(|i| ops[i]));
        // Without a gradient on the log-sum-exp, attention_grad is told there is none.
        let dlse = if lse.0 {
            dy.get(1).copied().flatten()
        } else {
            None
        };
        operands.extend(dlse);
        let r = self.ops(
            Op::AttentionGrad {
                causal: *causal,
                scale: *scale,
                window: *window,
                softcap: *softcap,
                sinks: *sinks,
                lse: dlse.is_some().into(),
                layout: *layout,
            },
            &operands,
        )?;
        let w = |i: usize| want.get(i).copied().unwrap_or(false);
        for i in 0..3 {
            out[i] = w(i).then_some(r[i]);
        }
        if let Some(i) = slots.sinks {
            if w(i) {
                // dsinks comes in f32; the sinks may be stored narrower.
                let st = self.ty(ops[i]);
                out[i] = Some(if st.dtype == DType::F32 {
                    r[3]
                } else {
                    self.op(Op::Cast { dtype: st.dtype }, &[r[3]])?
                });
            }
        }
        Ok(out)
    }

    /// The gradients of q, k and v of a `ring_attention`.
    pub(super) fn vjp_ring_attention(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
        want: &[bool],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let Op::RingAttention {
            axis,
            causal,
            scale,
            window,
            softcap,
        } = &d.op
        else {
            return Err(self.no_rule(n, &d.op));
        };
        let ops = &d.operands;
        let y = d.results[0];
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        // The ring as one unit: its backward re-sends k/v around the ring
        // (`ring-lower` expands it), so only q, k, v, out and lse are saved.
        if dy.get(1).copied().flatten().is_some() {
            return Err(err(
                "`autodiff` cannot differentiate a ring attention's log-sum-exp result",
                self.g.describe(n),
                "ring_attention_grad takes the gradient of out only",
            ));
        }
        let Some(dout) = dy[0] else { return Ok(out) };
        let r = self.ops(
            Op::RingAttentionGrad {
                axis: axis.clone(),
                causal: *causal,
                scale: *scale,
                window: *window,
                softcap: *softcap,
            },
            &[ops[0], ops[1], ops[2], y, d.results[1], dout],
        )?;
        for i in 0..3 {
            out[i] = want[i].then_some(r[i]);
        }
        Ok(out)
    }
}

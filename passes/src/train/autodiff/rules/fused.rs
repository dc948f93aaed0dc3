//! Backward rules of the fused ops that `fuse` makes and that have their own rule:
//! `add_rms_norm` (one `add_rms_norm_grad`, or `rms_norm_grad` without a gradient on
//! the sum). `fuse` runs last, but a fused program (a forward plan, a .weft file) may
//! come back for a training step. `matmul_add` shares `matmul`'s rule (`blocks.rs`).

use super::super::Ad;
use crate::pass::PassError;
use weft_ir::{Node, NodeData, Op, Value};

impl Ad<'_> {
    /// The gradients of `add_rms_norm`'s two addends and weight.
    pub(super) fn vjp_add_rms_norm(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
        want: &[bool],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let Op::AddRmsNorm { eps } = &d.op else {
            return Err(self.no_rule(n, &d.op));
        };
        let ops = &d.operands;
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        let wants = |i: usize| want.get(i).copied().unwrap_or(false);
        let Some(dnorm) = dy[1] else {
            (out[0], out[1]) = (dy[0].filter(|_| wants(0)), dy[0].filter(|_| wants(1)));
            return Ok(out);
        };
        let (sum, w) = (d.results[0], ops[2]);
        let r = match dy[0] {
            Some(dsum) => self.ops(Op::AddRmsNormGrad { eps: *eps }, &[sum, w, dnorm, dsum])?,
            None => self.ops(Op::RmsNormGrad { eps: *eps }, &[sum, w, dnorm])?,
        };
        (out[0], out[1]) = (wants(0).then_some(r[0]), wants(1).then_some(r[0]));
        out[2] = wants(2).then_some(r[1]);
        Ok(out)
    }
}

//! Backward rules of the mixture-of-experts ops: `grouped_matmul` and `moe_combine` by
//! their `*_grad` ops, `moe_dispatch` by a `moe_combine` with unit weights.

use super::super::Ad;
use crate::pass::PassError;
use weft_ir::{Float, Node, NodeData, Op, TensorType, Value};

impl Ad<'_> {
    /// The gradients of the operands of `grouped_matmul` or `moe_combine`.
    /// `None` for an op not of this family.
    pub(super) fn vjp_moe(
        &mut self,
        _n: Node,
        d: &NodeData,
        g: Value,
        want: &[bool],
    ) -> Result<Option<Vec<Option<Value>>>, PassError> {
        let ops = &d.operands;
        let w = |i: usize| want.get(i).copied().unwrap_or(false);
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        match &d.op {
            Op::GroupedMatmul { transpose_w } => {
                let bias = ops.len() > 3;
                let grad = Op::GroupedMatmulGrad {
                    transpose_w: *transpose_w,
                    bias: bias.into(),
                };
                let r = self.ops(grad, &[ops[0], ops[1], ops[2], g])?;
                out[0] = w(0).then_some(r[0]);
                out[1] = w(1).then_some(r[1]);
                if bias {
                    out[3] = w(3).then_some(r[2]);
                }
            }
            Op::MoeCombine {} => {
                let r = self.ops(Op::MoeCombineGrad {}, &[ops[0], ops[1], ops[2], g])?;
                out[0] = w(0).then_some(r[0]);
                out[2] = w(2).then_some(r[1]);
            }
            _ => return Ok(None),
        }
        Ok(Some(out))
    }

    /// The gradient of `moe_dispatch`'s tokens from its rows' gradient.
    pub(super) fn vjp_moe_dispatch(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let Op::MoeDispatch { .. } = &d.op else {
            return Err(self.no_rule(n, &d.op));
        };
        let ops = &d.operands;
        let ty = |s: &Self, i: usize| s.ty(ops[i]);
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        let Some(drows) = dy[0] else { return Ok(out) };
        let (x, ei) = (ty(self, 0), ty(self, 1));
        let ones = self.op(
            Op::Full {
                value: Float(1.0),
                ty: TensorType::new(x.dtype, ei.shape.clone()),
            },
            &[],
        )?;
        out[0] = Some(self.op(Op::MoeCombine {}, &[drows, d.results[2], ones])?);
        Ok(out)
    }
}

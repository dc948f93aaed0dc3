//! Comparisons and masks: `eq`/`ne`/`lt`/`le`/`gt`/`ge`, the boolean `and`/`or`/`not`,
//! `where` (which recognizes additive causal masks) and `masked_fill`.

use super::super::fx::FxNode;
use super::{one, Lower, LR, LV};
use weft_ir::{CmpOp, DType, Op, TensorType};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_logic(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.eq.Tensor" | "aten.eq.Scalar" | "aten.ne.Tensor" | "aten.ne.Scalar"
            | "aten.lt.Tensor" | "aten.lt.Scalar" | "aten.le.Tensor" | "aten.le.Scalar"
            | "aten.gt.Tensor" | "aten.gt.Scalar" | "aten.ge.Tensor" | "aten.ge.Scalar" => {
                self.lower_compare(n)
            }
            "aten.__and__.Tensor"
            | "aten.bitwise_and.Tensor"
            | "aten.logical_and.default"
            | "aten.__or__.Tensor"
            | "aten.bitwise_or.Tensor"
            | "aten.logical_or.default" => self.lower_and_or(n),
            "aten.logical_not.default" | "aten.bitwise_not.default" => self.lower_not(n),
            "aten.where.self" | "aten.where.ScalarOther" | "aten.where.ScalarSelf" => {
                self.lower_where(n)
            }
            "aten.masked_fill.Scalar" | "aten.masked_fill.Tensor" => self.lower_masked_fill(n),
            _ => return None,
        })
    }

    fn lower_compare(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let cmp = match n.base() {
            "eq" => CmpOp::Eq,
            "ne" => CmpOp::Ne,
            "lt" => CmpOp::Lt,
            "le" => CmpOp::Le,
            "gt" => CmpOp::Gt,
            _ => CmpOp::Ge,
        };
        let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
        let dt = self.common_dtype(&a, &b);
        let (a, b) = (self.as_tensor(n, a, dt)?, self.as_tensor(n, b, dt)?);
        one(self.emit(n, Op::Compare { op: cmp }, &[a, b])?)
    }

    fn lower_and_or(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
        let (a, b) = (
            self.as_tensor(n, a, DType::Bool)?,
            self.as_tensor(n, b, DType::Bool)?,
        );
        let is_and = n.base().contains("and");
        let c = self.full(
            n,
            if is_and { 0.0 } else { 1.0 },
            TensorType::scalar(DType::Bool),
        )?;
        let r = if is_and {
            self.emit(n, Op::Where {}, &[a, b, c])?
        } else {
            self.emit(n, Op::Where {}, &[a, c, b])?
        };
        one(r)
    }

    fn lower_not(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        if self.g.ty(x).dtype != DType::Bool {
            return Err(self.unsupported(n, "bitwise not of a non-bool tensor"));
        }
        let f = self.full(n, 0.0, TensorType::scalar(DType::Bool))?;
        one(self.emit(n, Op::Compare { op: CmpOp::Eq }, &[x, f])?)
    }

    fn lower_where(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        if let LV::False = self.arg_lv(n.arg_at(0)) {
            return Ok(vec![self.arg_lv(n.arg_at(2))]);
        }
        if let Some(mask) = self.additive_mask(n)? {
            return one(mask);
        }
        let c = self.tensor(n, n.arg_at(0))?;
        let ty = self.out_ty(n)?;
        let (a, b) = (self.operand(n, n.arg_at(1))?, self.operand(n, n.arg_at(2))?);
        let additive = self.causal.get(&c) == Some(&false)
            && matches!((self.const_of(&a), self.const_of(&b)), (Some(z), Some(m)) if z == 0.0 && m <= -1e30);
        let (a, b) = (
            self.as_tensor(n, a, ty.dtype)?,
            self.as_tensor(n, b, ty.dtype)?,
        );
        let w = self.emit(n, Op::Where {}, &[c, a, b])?;
        if additive {
            self.causal.insert(w, true);
            if let Some(&win) = self.mask_windows.get(&c) {
                self.mask_windows.insert(w, win);
            }
        }
        one(w)
    }

    fn lower_masked_fill(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        if let LV::False = self.arg_lv(n.arg_at(1)) {
            return Ok(vec![self.arg_lv(n.arg_at(0))]);
        }
        let x = self.tensor(n, n.arg_at(0))?;
        let m = self.tensor(n, n.arg_at(1))?;
        let dt = self.g.ty(x).dtype;
        let v = self.operand(n, n.arg_at(2))?;
        let v = self.as_tensor(n, v, dt)?;
        one(self.emit(n, Op::Where {}, &[m, v, x])?)
    }
}

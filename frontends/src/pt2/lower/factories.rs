//! Tensors made from nothing: `full`, `zeros`, `ones` and their `_like`/`new_` forms,
//! `scalar_tensor`, and `arange` (with step 1).

use super::super::fx::FxNode;
use super::{one, Lower, LR, LV};
use weft_ir::{Dim, Op};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_factory(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.full.default"
            | "aten.zeros.default"
            | "aten.ones.default"
            | "aten.new_ones.default"
            | "aten.new_zeros.default"
            | "aten.full_like.default"
            | "aten.zeros_like.default"
            | "aten.ones_like.default"
            | "aten.scalar_tensor.default" => self.lower_filled(n),
            "aten.arange.default" | "aten.arange.start" | "aten.arange.start_step" => {
                self.lower_arange(n)
            }
            _ => return None,
        })
    }

    fn lower_filled(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let mut ty = self.out_ty(n)?;
        ty.shape = match (n.base().ends_with("_like"), self.arg_lv(n.arg_at(0))) {
            (true, LV::T(x)) => self.gen_like(&self.ty(x).shape, &ty.shape),
            _ => self.gen_free(&ty.shape),
        };
        let v = match n.base() {
            "full" | "full_like" => self.float_arg(n, n.arg_at(1))?,
            "scalar_tensor" => self.float_arg(n, n.arg_at(0))?,
            "ones" | "new_ones" | "ones_like" => 1.0,
            _ => 0.0,
        };
        one(self.full(n, v, ty)?)
    }

    fn lower_arange(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let mut ty = self.out_ty(n)?;
        ty.shape = self.gen_free(&ty.shape);
        let start = match n.op.as_str() {
            "aten.arange.default" => Dim::from(0),
            _ => {
                // `Arange` counts from an integer start: a fractional one (`arange(0.5,
                // 4)` = 0.5, 1.5, ...) would be truncated.
                if let LV::Num(x, _) = self.arg_lv(n.arg_at(0)) {
                    if x.fract() != 0.0 {
                        return Err(self.unsupported(
                            n,
                            format!("arange with the fractional start {x} (Weft's arange counts from an integer)"),
                        ));
                    }
                }
                self.dim_arg(n, n.arg_at(0))?
            }
        };
        if n.op == "aten.arange.start_step" && self.float_arg(n, n.arg_at(2))? != 1.0 {
            return Err(self.unsupported(
                n,
                format!(
                    "arange with step {} (only step 1 is lowered)",
                    self.float_arg(n, n.arg_at(2))?
                ),
            ));
        }
        one(self.emit(n, Op::Arange { start, ty }, &[])?)
    }
}

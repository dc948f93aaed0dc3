//! Ops that change no values: dtype conversions (`to`, `_to_copy`, `type_as`) become
//! a `cast`; `clone`, `alias`, `contiguous`, `detach` and eval-mode `dropout` pass
//! their input through.

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{one, Lower, LR, LV};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_alias(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.to.dtype"
            | "aten.to.dtype_layout"
            | "aten.to.device"
            | "aten._to_copy.default"
            | "aten.type_as.default" => self.lower_cast_to(n),
            "aten.clone.default"
            | "aten.alias.default"
            | "aten.contiguous.default"
            | "aten.detach.default"
            | "aten.lift_fresh_copy.default" => Ok(vec![self.arg_lv(n.arg_at(0))]),
            "aten.dropout.default" => self.lower_dropout(n),
            _ => return None,
        })
    }

    fn lower_cast_to(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let ty = self.out_ty(n)?;
        one(self.cast(n, x, ty.dtype)?)
    }

    fn lower_dropout(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let p = self.float_arg(n, n.arg_at(1))?;
        let train = matches!(n.arg_at(2), Arg::Bool(true));
        if p != 0.0 && train {
            return Err(self.unsupported(
                n,
                format!("dropout with p = {p} in training mode (export the model in eval mode)"),
            ));
        }
        Ok(vec![self.arg_lv(n.arg_at(0))])
    }
}

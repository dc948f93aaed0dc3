//! Ops that change no values: dtype conversions (`to`, `_to_copy`, `type_as`) become
//! a `cast`; `clone`, `alias`, `contiguous`, `detach` and eval-mode `dropout` pass
//! their input through.

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{one, Lower, LR, LV};

impl Lower<'_> {
    /// Lowers one op of this family; any other op is refused as by [`Lower::lower_node`].
    pub(super) fn lower_alias(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        match n.op.as_str() {
            "aten.to.dtype"
            | "aten.to.dtype_layout"
            | "aten.to.device"
            | "aten._to_copy.default"
            | "aten.type_as.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let ty = self.out_ty(n)?;
                one(self.cast(n, x, ty.dtype)?)
            }
            "aten.clone.default"
            | "aten.alias.default"
            | "aten.contiguous.default"
            | "aten.detach.default"
            | "aten.lift_fresh_copy.default" => Ok(vec![self.arg_lv(n.arg_at(0))]),
            "aten.dropout.default" => {
                let p = self.float_arg(n, n.arg_at(1))?;
                let train = matches!(n.arg_at(2), Arg::Bool(true));
                if p != 0.0 && train {
                    return Err(self.unsupported(
                        n,
                        format!(
                            "dropout with p = {p} in training mode (export the model in eval mode)"
                        ),
                    ));
                }
                Ok(vec![self.arg_lv(n.arg_at(0))])
            }
            _ => Err(self.unsupported(n, "this op has no Weft lowering")),
        }
    }
}

//! Casts (`to`, `_to_copy`, `type_as`: values rounded through f32 when the result is a
//! float) and the ops that return their argument unchanged (`clone`, `alias`,
//! `contiguous`, `detach`, `lift_fresh_copy`, `copy`).

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{kind_of_code, named_dtype, one, Eval, Kind, CV, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_cast(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.to.dtype"
            | "aten.to.dtype_layout"
            | "aten.to.device"
            | "aten._to_copy.default"
            | "aten.type_as.default" => self.cast_to(n),
            "aten.clone.default"
            | "aten.alias.default"
            | "aten.contiguous.default"
            | "aten.detach.default"
            | "aten.lift_fresh_copy.default"
            | "aten.copy.default" => {
                let i = if n.base() == "copy" { 1 } else { 0 };
                self.tensor_at(n, i).and_then(one)
            }
            _ => return None,
        })
    }

    fn cast_to(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let k = match n.op.as_str() {
            "aten.to.dtype" => match n.arg_at(1) {
                Arg::ScalarType(c) => kind_of_code(*c)?,
                _ => x.kind,
            },
            "aten.to.device" => match n.arg_at(2) {
                Arg::ScalarType(c) => kind_of_code(*c)?,
                _ => x.kind,
            },
            "aten.type_as.default" => self.tensor_at(n, 1)?.kind,
            _ => named_dtype(n, x.kind)?,
        };
        let f32 = k == Kind::Float;
        one(x.map(k, |v| if f32 { v as f32 as f64 } else { v }))
    }
}

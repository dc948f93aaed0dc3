//! Size arithmetic: `sym_size`, `sym_numel` and the Python `_operator` ops on sizes,
//! lowered to symbolic dims ([`LV::Sym`]) rather than to nodes.

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{Lower, LR, LV};
use weft_ir::Dim;

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_size_op(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.sym_size.int" => self.lower_sym_size(n),
            "aten.sym_numel.default" => self.lower_sym_numel(n),
            "_operator.add.default"
            | "_operator.sub.default"
            | "_operator.mul.default"
            | "_operator.floordiv.default" => self.lower_size_arith(n),
            "_operator.neg.default" => self.lower_size_neg(n),
            _ => return None,
        })
    }

    fn lower_sym_size(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let Arg::Tensor(x) = n.arg_at(0) else {
            return Err(self.bad(n, "sym_size of a non-tensor"));
        };
        let d = self.int_arg(n, n.arg_at(1))?;
        let m = self
            .fx
            .tensor_meta
            .get(x)
            .ok_or_else(|| self.bad(n, "input has no recorded type"))?;
        let r = m.sizes.len() as i64;
        let d = if d < 0 { d + r } else { d };
        let s = m
            .sizes
            .get(d as usize)
            .ok_or_else(|| self.bad(n, "dim out of range"))?
            .clone();
        Ok(vec![LV::Sym(
            self.symint_dim(&s, &format!("node `{}`", n.name))?,
        )])
    }

    fn lower_sym_numel(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let Arg::Tensor(x) = n.arg_at(0) else {
            return Err(self.bad(n, "sym_numel of a non-tensor"));
        };
        Ok(vec![LV::Sym(self.meta_ty(x)?.numel())])
    }

    fn lower_size_arith(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (a, b) = (self.arg_lv(n.arg_at(0)), self.arg_lv(n.arg_at(1)));
        let as_dim = |lv: &LV| -> LR<Dim> {
            match lv {
                LV::Sym(d) => Ok(d.clone()),
                LV::Num(x, _) => Ok(Dim::from(*x as i64)),
                LV::Err(e) => Err(e.clone()),
                other => Err(self.bad(n, format!("size arithmetic on {other:?}"))),
            }
        };
        let (a, b) = (as_dim(&a)?, as_dim(&b)?);
        let r = match n.base() {
            "add" => a + b,
            "sub" => a - b,
            "mul" => a * b,
            // Weft's `//` is Euclidean, Python's for a positive divisor (a symbolic
            // divisor is a size): a negative constant one rounds the other way.
            _ => match (a.as_const(), b.as_const()) {
                (Some(x), Some(y)) if y < 0 => {
                    Dim::from(x.div_euclid(y) - (x.rem_euclid(y) != 0) as i64)
                }
                (_, Some(y)) if y < 0 => {
                    return Err(self.unsupported(
                        n,
                        format!(
                        "`({a}) // {y}`: floor division of a symbolic size by a negative number"
                    ),
                    ))
                }
                _ => a.floor_div(&b),
            },
        };
        Ok(vec![LV::Sym(r)])
    }

    fn lower_size_neg(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        Ok(vec![LV::Sym(Dim::from(0) - self.dim_arg(n, n.arg_at(0))?)])
    }
}

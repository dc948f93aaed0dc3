//! Size arithmetic: `sym_size` of a tensor (from the export's recorded sizes, evaluated
//! at the probe's symbol values) and the Python integer ops (`_operator.add`, `sub`,
//! `mul`, `floordiv`, `neg`) that exports use between sizes.

use super::super::fx::FxNode;
use super::super::schema::{Arg, SymInt};
use super::{norm, Eval, Kind, CV, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_size_op(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.sym_size.int" => self.sym_size(n),
            "_operator.add.default"
            | "_operator.sub.default"
            | "_operator.mul.default"
            | "_operator.floordiv.default" => self.int_binary(n),
            "_operator.neg.default" => self
                .int_arg(n.arg_at(0))
                .map(|x| vec![CV::Num(-(x as f64), Kind::Int)]),
            _ => return None,
        })
    }

    fn sym_size(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let Arg::Tensor(x) = n.arg_at(0) else {
            return Err("sym_size of a non-tensor".into());
        };
        let d = self.int_arg(n.arg_at(1))?;
        let meta = self.fx.tensor_meta.get(x).ok_or("no meta")?.clone();
        let d = norm(d, meta.sizes.len())?;
        let v = match &meta.sizes[d] {
            SymInt::Int(i) => *i,
            SymInt::Expr { expr, .. } => self.sym_expr(expr)?,
        };
        Ok(vec![CV::Num(v as f64, Kind::Int)])
    }

    fn int_binary(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (x, y) = (self.int_arg(n.arg_at(0))?, self.int_arg(n.arg_at(1))?);
        let v = match n.base() {
            "add" => x + y,
            "sub" => x - y,
            "mul" => x * y,
            // Python's `//` rounds toward -inf (`7 // -2 == -4`; div_euclid gives -3).
            _ if y != 0 => x.div_euclid(y) - (y < 0 && x.rem_euclid(y) != 0) as i64,
            _ => return Err("division by zero".into()),
        };
        Ok(vec![CV::Num(v as f64, Kind::Int)])
    }
}

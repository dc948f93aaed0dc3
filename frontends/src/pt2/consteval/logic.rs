//! Comparisons (`eq`, `ne`, `lt`, `le`, `gt`, `ge`), boolean `and`/`or`/`not`, `where`
//! and `masked_fill`: the vocabulary of causal-mask builders.

use super::super::fx::FxNode;
use super::{binary, bshape, cast, for_each_index, one, promote, Eval, Kind, CT, CV, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_logic(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.eq.Tensor" | "aten.eq.Scalar" | "aten.ne.Tensor" | "aten.ne.Scalar"
            | "aten.lt.Tensor" | "aten.lt.Scalar" | "aten.le.Tensor" | "aten.le.Scalar"
            | "aten.gt.Tensor" | "aten.gt.Scalar" | "aten.ge.Tensor" | "aten.ge.Scalar" => {
                self.compare(n)
            }
            "aten.__and__.Tensor" | "aten.bitwise_and.Tensor" | "aten.logical_and.default" => {
                self.boolean(n, |p, q| p && q)
            }
            "aten.__or__.Tensor" | "aten.bitwise_or.Tensor" | "aten.logical_or.default" => {
                self.boolean(n, |p, q| p || q)
            }
            "aten.logical_not.default" | "aten.bitwise_not.default" => self
                .tensor_at(n, 0)
                .and_then(|x| one(x.map(Kind::Bool, |v| (v == 0.0) as i64 as f64))),
            "aten.where.self" | "aten.where.ScalarOther" | "aten.where.ScalarSelf" => {
                self.where_(n)
            }
            "aten.masked_fill.Scalar" | "aten.masked_fill.Tensor" => self.masked_fill(n),
            _ => return None,
        })
    }

    fn compare(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (x, y) = (self.tensor_at(n, 0)?, self.tensor_at(n, 1)?);
        let f: fn(f64, f64) -> bool = match n.base() {
            "eq" => |p, q| p == q,
            "ne" => |p, q| p != q,
            "lt" => |p, q| p < q,
            "le" => |p, q| p <= q,
            "gt" => |p, q| p > q,
            _ => |p, q| p >= q,
        };
        one(binary(&x, &y, Kind::Bool, |p, q| f(p, q) as i64 as f64)?)
    }

    /// `f` over the truth values of the broadcast arguments 0 and 1.
    fn boolean(&mut self, n: &FxNode, f: fn(bool, bool) -> bool) -> R<Vec<CV>> {
        let (x, y) = (self.tensor_at(n, 0)?, self.tensor_at(n, 1)?);
        one(binary(&x, &y, Kind::Bool, |p, q| {
            f(p != 0.0, q != 0.0) as i64 as f64
        })?)
    }

    fn where_(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (c, x, y) = (
            self.tensor_at(n, 0)?,
            self.tensor_at(n, 1)?,
            self.tensor_at(n, 2)?,
        );
        let k = promote(x.kind, y.kind);
        let s = bshape(&bshape(&c.shape, &x.shape)?, &y.shape)?;
        let mut data = Vec::new();
        for_each_index(&s, |i| {
            data.push(cast(if c.get(i) != 0.0 { x.get(i) } else { y.get(i) }, k))
        });
        one(CT {
            shape: s,
            data,
            kind: k,
        })
    }

    fn masked_fill(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (x, m, v) = (
            self.tensor_at(n, 0)?,
            self.tensor_at(n, 1)?,
            self.tensor_at(n, 2)?,
        );
        let s = bshape(&x.shape, &m.shape)?;
        let mut data = Vec::new();
        for_each_index(&s, |i| {
            data.push(cast(
                if m.get(i) != 0.0 { v.get(i) } else { x.get(i) },
                x.kind,
            ))
        });
        one(CT {
            shape: s,
            data,
            kind: x.kind,
        })
    }
}

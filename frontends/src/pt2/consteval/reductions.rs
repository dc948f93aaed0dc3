//! Reductions and scans along one dim: `cumsum`, `diff` (with `prepend`/`append`) and
//! `any` (the building blocks of padding-aware and sliding-window masks).

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::indexing::{check_cat, concat};
use super::{cast, for_each_index, named_dtype, norm, one, strides, Eval, Kind, CT, CV, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_reduction(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.cumsum.default" => self.cumsum(n),
            "aten.diff.default" => self.diff(n),
            "aten.any.dim" => self.any_dim(n),
            _ => return None,
        })
    }

    fn cumsum(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let d = norm(self.int_arg(n.arg_at(1))?, x.shape.len())?;
        let k = named_dtype(
            n,
            if x.kind == Kind::Float {
                Kind::Float
            } else {
                Kind::Int
            },
        )?;
        let st = strides(&x.shape);
        let mut data = x.data.clone();
        for_each_index(&x.shape, |i| {
            if i[d] > 0 {
                let off: usize = i.iter().zip(&st).map(|(a, b)| a * b).sum();
                data[off] += data[off - st[d]];
            }
        });
        one(CT {
            shape: x.shape.clone(),
            data: data.into_iter().map(|v| cast(v, k)).collect(),
            kind: k,
        })
    }

    fn diff(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let mut x = self.tensor_at(n, 0)?;
        if self.int_arg(n.arg_at(1))? != 1 {
            return Err("diff with n != 1".into());
        }
        let d = norm(self.int_arg(n.arg_at(2))?, x.shape.len())?;
        let pre = match n.arg_at(3) {
            Arg::None => None,
            o => Some(self.tensor_arg(o)?),
        };
        let app = match n.arg_at(4) {
            Arg::None => None,
            o => Some(self.tensor_arg(o)?),
        };
        if let Some(p) = pre {
            let parts = [p, x];
            check_cat(&parts, d)?;
            x = concat(&parts, d)?;
        }
        if let Some(p) = app {
            let parts = [x, p];
            check_cat(&parts, d)?;
            x = concat(&parts, d)?;
        }
        let mut shape = x.shape.clone();
        shape[d] = shape[d].saturating_sub(1);
        let mut data = Vec::new();
        let k = if x.kind == Kind::Bool {
            Kind::Bool
        } else {
            x.kind
        };
        for_each_index(&shape, |i| {
            let mut j = i.to_vec();
            j[d] += 1;
            data.push(cast(x.get(&j) - x.get(i), k));
        });
        one(CT {
            shape,
            data,
            kind: k,
        })
    }

    fn any_dim(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let d = norm(self.int_arg(n.arg_at(1))?, x.shape.len())?;
        let keep = matches!(n.arg_at(2), Arg::Bool(true));
        let mut shape = x.shape.clone();
        shape[d] = 1;
        let mut data = Vec::new();
        for_each_index(&shape, |i| {
            let mut any = false;
            for k in 0..x.shape[d] {
                let mut j = i.to_vec();
                j[d] = k;
                any |= x.get(&j) != 0.0;
            }
            data.push(any as i64 as f64);
        });
        if !keep {
            shape.remove(d);
        }
        one(CT {
            shape,
            data,
            kind: Kind::Bool,
        })
    }
}

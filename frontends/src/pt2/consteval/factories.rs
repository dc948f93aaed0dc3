//! Tensors made from sizes and scalars: `arange`, `full`, `zeros`, `ones`, `empty` (and
//! their `new_` and `_like` forms), `scalar_tensor`.

use super::super::fx::FxNode;
use super::{cast, named_dtype, numel, one, Eval, Kind, CT, CV, MAX_ELEMS, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_factory(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.arange.default" | "aten.arange.start" | "aten.arange.start_step" => {
                self.arange(n)
            }
            "aten.full.default"
            | "aten.zeros.default"
            | "aten.ones.default"
            | "aten.new_ones.default"
            | "aten.new_zeros.default"
            | "aten.empty.memory_format"
            | "aten.empty_permuted.default" => self.full(n),
            "aten.full_like.default"
            | "aten.zeros_like.default"
            | "aten.ones_like.default"
            | "aten.empty_like.default" => self.full_like(n),
            "aten.scalar_tensor.default" => self.scalar_tensor(n),
            _ => return None,
        })
    }

    fn arange(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (s, e, st) = match n.op.as_str() {
            "aten.arange.default" => (
                CV::Num(0.0, Kind::Int),
                self.scalar_arg(n.arg_at(0))?,
                CV::Num(1.0, Kind::Int),
            ),
            "aten.arange.start" => (
                self.scalar_arg(n.arg_at(0))?,
                self.scalar_arg(n.arg_at(1))?,
                CV::Num(1.0, Kind::Int),
            ),
            _ => (
                self.scalar_arg(n.arg_at(0))?,
                self.scalar_arg(n.arg_at(1))?,
                self.scalar_arg(n.arg_at(2))?,
            ),
        };
        let num = |c: CV| match c {
            CV::Num(v, k) => Ok((v, k)),
            _ => Err("arange bound is not a number".to_string()),
        };
        let ((s, k1), (e, k2), (st, k3)) = (num(s)?, num(e)?, num(st)?);
        let dflt = if [k1, k2, k3].contains(&Kind::Float) {
            Kind::Float
        } else {
            Kind::Int
        };
        let k = named_dtype(n, dflt)?;
        if st == 0.0 {
            return Err("arange step 0".into());
        }
        let cnt = (((e - s) / st).ceil()).max(0.0) as usize;
        if cnt > MAX_ELEMS {
            return Err("too large".into());
        }
        one(CT {
            shape: vec![cnt],
            data: (0..cnt).map(|i| cast(s + st * i as f64, k)).collect(),
            kind: k,
        })
    }

    /// `full`, `zeros`, `ones`, `empty` (read as zeros) and `new_ones`/`new_zeros`.
    fn full(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (size_i, fill) = match n.base() {
            "full" => (0, self.scalar_arg(n.arg_at(1))?),
            "zeros" | "empty" | "empty_permuted" => (0, CV::Num(0.0, Kind::Float)),
            "ones" => (0, CV::Num(1.0, Kind::Float)),
            "new_ones" => (1, CV::Num(1.0, Kind::Float)),
            _ => (1, CV::Num(0.0, Kind::Float)),
        };
        let shape: Vec<usize> = self
            .ints_arg(n.arg_at(size_i))?
            .into_iter()
            .map(|x| x.max(0) as usize)
            .collect();
        let (v, fk) = match fill {
            CV::Num(v, k) => (v, k),
            _ => return Err("fill value is not a number".into()),
        };
        let dflt = if n.base().starts_with("new_") {
            self.tensor_at(n, 0)?.kind
        } else if n.base() == "full" {
            fk
        } else {
            Kind::Float
        };
        let k = named_dtype(n, dflt)?;
        if numel(&shape) > MAX_ELEMS {
            return Err("too large".into());
        }
        one(CT {
            data: vec![cast(v, k); numel(&shape)],
            shape,
            kind: k,
        })
    }

    fn full_like(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let v = match n.base() {
            "full_like" => match self.scalar_arg(n.arg_at(1))? {
                CV::Num(v, _) => v,
                _ => return Err("fill value".into()),
            },
            "ones_like" => 1.0,
            _ => 0.0,
        };
        let k = named_dtype(n, x.kind)?;
        one(CT {
            data: vec![cast(v, k); numel(&x.shape)],
            shape: x.shape,
            kind: k,
        })
    }

    fn scalar_tensor(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (v, fk) = match self.scalar_arg(n.arg_at(0))? {
            CV::Num(v, k) => (v, k),
            _ => return Err("scalar".into()),
        };
        let k = named_dtype(
            n,
            if fk == Kind::Bool {
                Kind::Bool
            } else {
                Kind::Float
            },
        )?;
        one(CT::scalar(cast(v, k), k))
    }
}

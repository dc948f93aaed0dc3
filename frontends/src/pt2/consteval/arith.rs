//! Elementwise arithmetic: the broadcasting binary ops (`add`, `sub`, `rsub`, `mul`,
//! `div`, `pow` by a scalar), `neg`, and the unary math of rotary tables (`cos`, `sin`,
//! `exp`, `sqrt`, `rsqrt`, computed in f32 as torch does).

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{binary, one, promote, Eval, Kind, CT, CV, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_arith(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.add.Tensor" | "aten.add.Scalar" | "aten.sub.Tensor" | "aten.sub.Scalar"
            | "aten.rsub.Scalar" => self.add_sub(n),
            "aten.mul.Tensor" | "aten.mul.Scalar" => {
                self.binary_at(n, |x, y| promote(x.kind, y.kind), |p, q| p * q)
            }
            "aten.div.Tensor" | "aten.div.Scalar" => {
                self.binary_at(n, |_, _| Kind::Float, |p, q| p / q)
            }
            "aten.pow.Tensor_Scalar" => {
                self.binary_at(n, |x, y| promote(x.kind, y.kind), f64::powf)
            }
            "aten.neg.default" => self
                .tensor_at(n, 0)
                .and_then(|x| one(x.map(x.kind, |v| -v))),
            "aten.cos.default" | "aten.sin.default" | "aten.exp.default" | "aten.rsqrt.default"
            | "aten.sqrt.default" => self.unary_math(n),
            _ => return None,
        })
    }

    /// `f` over the broadcast arguments 0 and 1, the result of kind `kind(x, y)`.
    fn binary_at(
        &mut self,
        n: &FxNode,
        kind: impl Fn(&CT, &CT) -> Kind,
        f: impl Fn(f64, f64) -> f64,
    ) -> R<Vec<CV>> {
        let (x, y) = (self.tensor_at(n, 0)?, self.tensor_at(n, 1)?);
        one(binary(&x, &y, kind(&x, &y), f)?)
    }

    fn add_sub(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (x, y) = (self.tensor_at(n, 0)?, self.tensor_at(n, 1)?);
        let alpha = match n.arg_at(2) {
            Arg::Int(i) => *i as f64,
            Arg::Float(f) => *f,
            _ => 1.0,
        };
        let k = promote(x.kind, y.kind);
        let r = match n.base() {
            "add" => binary(&x, &y, k, |p, q| p + alpha * q)?,
            "sub" => binary(&x, &y, k, |p, q| p - alpha * q)?,
            _ => binary(&x, &y, k, |p, q| q - alpha * p)?,
        };
        one(r)
    }

    fn unary_math(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        // f32 arithmetic, as torch computes these tables.
        let f: fn(f64) -> f64 = match n.base() {
            "cos" => |v| (v as f32).cos() as f64,
            "sin" => |v| (v as f32).sin() as f64,
            "exp" => |v| (v as f32).exp() as f64,
            "rsqrt" => |v| 1.0 / (v as f32).sqrt() as f64,
            _ => |v| (v as f32).sqrt() as f64,
        };
        one(x.map(Kind::Float, f))
    }
}

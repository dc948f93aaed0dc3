//! Elementwise arithmetic: the broadcasting binary ops (`add`, `sub`, `rsub`, `mul`,
//! `div`, `maximum`, `minimum`), `pow` by a scalar, `clamp`, and the unary math ops
//! (`exp`, `rsqrt`, `silu`, `gelu`, ...).

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{one, Bin, Lower, Operand, LR, LV};
use weft_ir::{Float, Op};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_arith(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.add.Tensor" | "aten.add.Scalar" | "aten.sub.Tensor" | "aten.sub.Scalar"
            | "aten.rsub.Scalar" => self.lower_add_sub(n),
            "aten.mul.Tensor" | "aten.mul.Scalar" => self.lower_mul(n),
            "aten.div.Tensor" | "aten.div.Scalar" => self.lower_div(n),
            "aten.pow.Tensor_Scalar" => self.lower_pow(n),
            "aten.maximum.default" | "aten.minimum.default" => self.lower_max_min(n),
            "aten.clamp.default" | "aten.clamp_min.default" | "aten.clamp_max.default" => {
                self.lower_clamp(n)
            }
            "aten.neg.default"
            | "aten.exp.default"
            | "aten.log.default"
            | "aten.sqrt.default"
            | "aten.rsqrt.default"
            | "aten.tanh.default"
            | "aten.sigmoid.default"
            | "aten.silu.default"
            | "aten.relu.default"
            | "aten.gelu.default" => self.lower_unary(n),
            _ => return None,
        })
    }

    fn lower_add_sub(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let alpha = self.float_arg(n, n.arg("alpha"))?;
        let (mut a, mut b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
        if n.base() == "rsub" {
            std::mem::swap(&mut a, &mut b);
        }
        if alpha != 1.0 {
            b = match b {
                Operand::Num(x, k) => Operand::Num(x * alpha, k),
                Operand::T(v) => Operand::T(self.emit(
                    n,
                    Op::Scale {
                        factor: Float(alpha),
                    },
                    &[v],
                )?),
            };
        }
        let sub = n.base() != "add";
        self.arith(n, if sub { Bin::Sub } else { Bin::Add }, a, b)
    }

    fn lower_mul(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
        if let Some(table) = self.factored_table(n) {
            return one(table);
        }
        self.arith(n, Bin::Mul, a, b)
    }

    fn lower_div(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
        self.arith(n, Bin::Div, a, b)
    }

    fn lower_pow(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let e = self.float_arg(n, n.arg_at(1))?;
        let ty = self.out_ty(n)?;
        let x = self.cast(n, x, ty.dtype)?;
        if !ty.dtype.is_float() {
            // The runtime's `pow_scalar` is a float op; an integer tensor to a small
            // natural power is exact as repeated products (`i ** 2`).
            if e.fract() != 0.0 || !(0.0..=8.0).contains(&e) {
                return Err(self.unsupported(
                    n,
                    format!("pow of a {} tensor with the exponent {e}", ty.dtype),
                ));
            }
            let mut acc = self.full(n, 1.0, weft_ir::TensorType::scalar(ty.dtype))?;
            for _ in 0..e as i64 {
                acc = self.emit(n, Op::Mul {}, &[acc, x])?;
            }
            if e == 0.0 {
                // `x ** 0` keeps x's shape.
                let zero = self.emit(n, Op::Sub {}, &[x, x])?;
                acc = self.emit(n, Op::Add {}, &[zero, acc])?;
            }
            return one(acc);
        }
        one(self.emit(n, Op::PowScalar { exponent: Float(e) }, &[x])?)
    }

    fn lower_max_min(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
        self.arith(
            n,
            if n.base() == "maximum" {
                Bin::Max
            } else {
                Bin::Min
            },
            a,
            b,
        )
    }

    fn lower_clamp(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let (lo, hi) = match n.base() {
            "clamp" => (n.arg_at(1).clone(), n.arg_at(2).clone()),
            "clamp_min" => (n.arg_at(1).clone(), Arg::None),
            _ => (Arg::None, n.arg_at(1).clone()),
        };
        let mut v = x;
        if !matches!(lo, Arg::None) {
            let o = self.operand(n, &lo)?;
            v = self.arith_v(n, Bin::Max, Operand::T(v), o)?;
        }
        if !matches!(hi, Arg::None) {
            let o = self.operand(n, &hi)?;
            v = self.arith_v(n, Bin::Min, Operand::T(v), o)?;
        }
        one(v)
    }

    fn lower_unary(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let ty = self.out_ty(n)?;
        let x = self.cast(n, x, ty.dtype)?;
        if !ty.dtype.is_float() {
            // The runtime's unary ops are float ops: an integer `neg` is `0 - x`, an
            // integer `relu` is `max(x, 0)`; the others have float results in torch.
            let zero = self.full(n, 0.0, weft_ir::TensorType::scalar(ty.dtype))?;
            return match n.base() {
                "neg" => one(self.emit(n, Op::Sub {}, &[zero, x])?),
                "relu" => one(self.emit(n, Op::Maximum {}, &[x, zero])?),
                b => Err(self.unsupported(n, format!("{b} of a {} tensor", ty.dtype))),
            };
        }
        let op = match n.base() {
            "neg" => Op::Neg {},
            "exp" => Op::Exp {},
            "log" => Op::Log {},
            "sqrt" => Op::Sqrt {},
            "rsqrt" => Op::Rsqrt {},
            "tanh" => Op::Tanh {},
            "sigmoid" => Op::Sigmoid {},
            "silu" => Op::Silu {},
            "relu" => Op::Relu {},
            _ => Op::Gelu {
                tanh_approx: matches!(n.arg("approximate"), Arg::Str(s) if s == "tanh"),
            },
        };
        one(self.emit(n, op, &[x])?)
    }
}

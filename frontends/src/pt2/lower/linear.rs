//! Embedding and matrix products: `embedding`, `linear`, `mm`/`bmm`/`matmul` and
//! `addmm` (a `matmul` plus its bias).

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{one, Lower, LR, LV};
use weft_ir::{Dim, Op};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_linear(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.embedding.default" => self.lower_embedding(n),
            "aten.linear.default" => self.lower_linear_layer(n),
            "aten.mm.default" | "aten.bmm.default" | "aten.matmul.default" => self.lower_matmul(n),
            "aten.addmm.default" => self.lower_addmm(n),
            _ => return None,
        })
    }

    fn lower_embedding(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (w, ids) = (self.tensor(n, n.arg_at(0))?, self.tensor(n, n.arg_at(1))?);
        if matches!(n.arg_at(3), Arg::Bool(true)) {
            return Err(self.unsupported(n, "scale_grad_by_freq=True (each row's gradient divided by its token count) is not implemented"));
        }
        // nn.Embedding passes its padding_idx (made non-negative); -1 is none.
        let padding_idx = match self.int_arg(n, n.arg_at(2))? {
            p if p < 0 => None,
            p => Some(Dim::from(p)),
        };
        one(self.emit(n, Op::Embedding { padding_idx }, &[ids, w])?)
    }

    fn lower_linear_layer(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (x, w) = (self.tensor(n, n.arg_at(0))?, self.tensor(n, n.arg_at(1))?);
        let mut args = vec![x, w];
        if !matches!(n.arg_at(2), Arg::None) {
            args.push(self.tensor(n, n.arg_at(2))?);
        }
        one(self.emit(n, Op::Linear {}, &args)?)
    }

    fn lower_matmul(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (a, b) = (self.tensor(n, n.arg_at(0))?, self.tensor(n, n.arg_at(1))?);
        if self.g.ty(a).rank() < 2 || self.g.ty(b).rank() < 2 {
            return Err(self.unsupported(n, "matmul with a 1-D operand"));
        }
        one(self.emit(
            n,
            Op::Matmul {
                transpose_a: false,
                transpose_b: false,
            },
            &[a, b],
        )?)
    }

    fn lower_addmm(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let (bias, a, b) = (
            self.tensor(n, n.arg_at(0))?,
            self.tensor(n, n.arg_at(1))?,
            self.tensor(n, n.arg_at(2))?,
        );
        if self.float_arg(n, n.arg("beta"))? != 1.0 || self.float_arg(n, n.arg("alpha"))? != 1.0 {
            return Err(self.unsupported(n, "addmm with beta or alpha other than 1"));
        }
        let mm = self.emit(
            n,
            Op::Matmul {
                transpose_a: false,
                transpose_b: false,
            },
            &[a, b],
        )?;
        one(self.emit(n, Op::Add {}, &[mm, bias])?)
    }
}

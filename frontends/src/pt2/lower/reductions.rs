//! Reductions: `mean`, `sum`, `amax`, `any`, `softmax`, `log_softmax`, `topk`, and the
//! values of `max.dim` (its indices stay a deferred error).

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{one, Lower, LR, LV};
use weft_ir::{CmpOp, DType, Op, TensorType};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_reduction(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.mean.dim" | "aten.sum.dim_IntList" | "aten.amax.default" => self.lower_reduce(n),
            "aten.any.dim" => self.lower_any_dim(n),
            "aten.softmax.int"
            | "aten._softmax.default"
            | "aten.log_softmax.int"
            | "aten._log_softmax.default" => self.lower_softmax(n),
            "aten.topk.default" => self.lower_topk(n),
            "aten.max.dim" => self.lower_max_dim(n),
            _ => return None,
        })
    }

    fn lower_reduce(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let ty = self.out_ty(n)?;
        let rank = self.g.ty(x).rank() as i64;
        let dims = match n.arg_at(1) {
            Arg::None => (0..rank).collect(),
            a => {
                let d = self.ints_arg(n, a)?;
                if d.is_empty() {
                    (0..rank).collect()
                } else {
                    d
                }
            }
        };
        let keepdim = matches!(n.arg_at(2), Arg::Bool(true));
        let x = if n.base() == "amax" {
            x
        } else {
            self.cast(n, x, ty.dtype)?
        };
        let op = match n.base() {
            "mean" => Op::Mean { dims, keepdim },
            "sum" => Op::Sum { dims, keepdim },
            _ => Op::Max { dims, keepdim },
        };
        one(self.emit(n, op, &[x])?)
    }

    fn lower_any_dim(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let d = self.int_arg(n, n.arg_at(1))?;
        let keepdim = matches!(n.arg_at(2), Arg::Bool(true));
        // `any` tests for nonzero (negative values and NaN included): the max of the
        // truth values, not of the values.
        let xt = self.ty(x);
        let x = if xt.dtype == DType::Bool {
            x
        } else {
            let z = self.full(n, 0.0, TensorType::scalar(xt.dtype))?;
            self.emit(n, Op::Compare { op: CmpOp::Ne }, &[x, z])?
        };
        let f = self.cast(n, x, DType::F32)?;
        let m = self.emit(
            n,
            Op::Max {
                dims: vec![d],
                keepdim,
            },
            &[f],
        )?;
        let z = self.full(n, 0.0, TensorType::scalar(DType::F32))?;
        one(self.emit(n, Op::Compare { op: CmpOp::Gt }, &[m, z])?)
    }

    fn lower_softmax(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let ty = self.out_ty(n)?;
        let d = self.int_arg(n, n.arg_at(1))?;
        let x = self.cast(n, x, ty.dtype)?;
        let op = if n.base().contains("log") {
            Op::LogSoftmax { dim: d }
        } else {
            Op::Softmax { dim: d }
        };
        one(self.emit(n, op, &[x])?)
    }

    fn lower_topk(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let k = self.int_arg(n, n.arg_at(1))?;
        let d = self.int_arg(n, n.arg_at(2))?;
        if !matches!(n.arg_at(3), Arg::Bool(true)) {
            return Err(self.unsupported(n, "topk of the smallest values"));
        }
        // `sorted=False` leaves the order to the implementation; `topk` sorts,
        // which is one such order (DeepSeek-V3 reads the k results as a set).
        let r = self.emit_multi(n, Op::Topk { k, dim: d }, &[x])?;
        Ok(r.into_iter().map(LV::T).collect())
    }

    fn lower_max_dim(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        // The values (gpt-oss subtracts each row's max before its softmax); the
        // indices (argmax) have no Weft op and stop the import where used.
        let x = self.tensor(n, n.arg_at(0))?;
        let d = self.int_arg(n, n.arg_at(1))?;
        let keepdim = matches!(n.arg_at(2), Arg::Bool(true));
        let values = self.emit(
            n,
            Op::Max {
                dims: vec![d],
                keepdim,
            },
            &[x],
        )?;
        let indices = self.unsupported(n, "the indices (argmax) of max.dim");
        Ok(vec![LV::T(values), LV::Err(indices)])
    }
}

//! Index ops: `index` (one 1-D index tensor), `index_select`, `gather`, `scatter_add`,
//! `scatter` of a value into zeros (as a one-hot test), and `one_hot`.

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{one, Lower, Operand, LR, LV};
use weft_ir::{CmpOp, DType, Dim, Op, TensorType};

impl Lower<'_> {
    /// Lowers one op of this family; `None` for any other op.
    pub(super) fn lower_index(&mut self, n: &FxNode) -> Option<LR<Vec<LV>>> {
        Some(match n.op.as_str() {
            "aten.index.Tensor" => self.lower_index_tensor(n),
            "aten.index_select.default" => self.lower_index_select(n),
            "aten.gather.default" => self.lower_gather(n),
            "aten.scatter_add.default" => self.lower_scatter_add(n),
            "aten.scatter.value" => self.lower_scatter_value(n),
            "aten.one_hot.default" => self.lower_one_hot(n),
            _ => return None,
        })
    }

    fn lower_index_tensor(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let idx: Vec<Option<String>> = match n.arg_at(1) {
            Arg::OptionalTensors(v) => v.clone(),
            Arg::Tensors(v) => v.iter().cloned().map(Some).collect(),
            _ => return Err(self.bad(n, "index without indices")),
        };
        match idx.as_slice() {
            [Some(i)] => {
                let i = self.tensor(n, &Arg::Tensor(i.clone()))?;
                if self.g.ty(i).rank() != 1 {
                    return Err(
                        self.unsupported(n, "advanced indexing with a multi-dimensional index")
                    );
                }
                let idt = self.g.ty(i).dtype;
                if !matches!(idt, DType::I64 | DType::I32) {
                    // a bool (or uint8) index is a mask, whose result's length is data
                    return Err(self.unsupported(
                        n,
                        format!("indexing with a {idt} tensor (a mask: a data-dependent shape)"),
                    ));
                }
                // torch's advanced indexing counts a negative index from the end
                // (`w[arange(3) - 1]`); a dim of unknown size keeps the runtime's range check.
                let i = match self.g.ty(x).shape.first().and_then(|d| d.as_const()) {
                    Some(size) => {
                        let it = TensorType::scalar(self.g.ty(i).dtype);
                        let zero = self.full(n, 0.0, it.clone())?;
                        let size = self.full(n, size as f64, it)?;
                        let negative = self.emit(n, Op::Compare { op: CmpOp::Lt }, &[i, zero])?;
                        let wrapped = self.emit(n, Op::Add {}, &[i, size])?;
                        self.emit(n, Op::Where {}, &[negative, wrapped, i])?
                    }
                    None => i,
                };
                one(self.emit(n, Op::IndexSelect { dim: 0 }, &[x, i])?)
            }
            _ => Err(self.unsupported(n, "advanced indexing with several index tensors")),
        }
    }

    fn lower_index_select(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let d = self.int_arg(n, n.arg_at(1))?;
        let i = self.tensor(n, n.arg_at(2))?;
        one(self.emit(n, Op::IndexSelect { dim: d }, &[x, i])?)
    }

    fn lower_gather(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let d = self.int_arg(n, n.arg_at(1))?;
        let i = self.tensor(n, n.arg_at(2))?;
        one(self.emit(n, Op::Gather { dim: d }, &[x, i])?)
    }

    fn lower_scatter_add(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let d = self.int_arg(n, n.arg_at(1))?;
        let i = self.tensor(n, n.arg_at(2))?;
        let s = self.tensor(n, n.arg_at(3))?;
        one(self.emit(n, Op::ScatterAdd { dim: d }, &[x, i, s])?)
    }

    fn lower_scatter_value(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        // `zeros.scatter_(-1, index, v)` (DeepSeek-V3's mask of the kept expert
        // groups): `v` where some index of the row hits, else 0, read row by row
        // as `where(max(one_hot(index), -2) > 0, v, 0)`. On another base the
        // overwritten values would matter, and other dims mix rows: refused.
        let x = self.tensor(n, n.arg_at(0))?;
        if self.const_of(&Operand::T(x)) != Some(0.0) {
            return Err(
                self.unsupported(n, "scatter of a value into a tensor that is not all zeros")
            );
        }
        let (xt, i) = (self.ty(x), self.tensor(n, n.arg_at(2))?);
        let it = self.ty(i);
        let d = self.norm_dim(n, self.int_arg(n, n.arg_at(1))?, xt.rank())?;
        let classes = xt.shape.last().and_then(Dim::as_const);
        let rows_match = it.rank() == xt.rank()
            && it.shape[..d]
                .iter()
                .zip(&xt.shape[..d])
                .all(|(a, b)| self.same_size(a, b));
        let (Some(classes), true) = (classes.filter(|_| d + 1 == xt.rank()), rows_match) else {
            return Err(self.unsupported(
                n,
                "scatter of a value other than along the last dim of matching rows",
            ));
        };
        let v = self.float_arg(n, n.arg_at(3))?;
        let dt = xt.dtype;
        let hot = self.emit(
            n,
            Op::OneHot {
                num_classes: classes,
                dtype: dt,
            },
            &[i],
        )?;
        let hits = self.emit(
            n,
            Op::Max {
                dims: vec![-2],
                keepdim: false,
            },
            &[hot],
        )?;
        let zero = self.full(n, 0.0, TensorType::scalar(dt))?;
        let hit = self.emit(n, Op::Compare { op: CmpOp::Gt }, &[hits, zero])?;
        let v = self.full(n, v, TensorType::scalar(dt))?;
        one(self.emit(n, Op::Where {}, &[hit, v, zero])?)
    }

    fn lower_one_hot(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let x = self.tensor(n, n.arg_at(0))?;
        let ty = self.out_ty(n)?;
        let k = ty
            .shape
            .last()
            .and_then(Dim::as_const)
            .ok_or_else(|| self.unsupported(n, "one_hot with a symbolic class count"))?;
        one(self.emit(
            n,
            Op::OneHot {
                num_classes: k,
                dtype: ty.dtype,
            },
            &[x],
        )?)
    }
}

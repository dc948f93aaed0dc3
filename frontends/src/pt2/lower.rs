//! Exported nodes → Weft nodes, in program order. Each exported value gets a lowered
//! value ([`LV`]): a Weft tensor, a symbolic size, a Python scalar, a deferred error, or
//! one of the MoE routing tags of [`super::moe`]. Errors are deferred: an op Weft
//! cannot express (the `cumsum` of a mask builder, say) only fails the import if a
//! value the model's outputs need depends on it; unused mask builders and the like are
//! removed afterwards. Every node's result type is checked against the type the export
//! recorded for it.

use super::consteval::Kind;
use super::error::Pt2Error;
use super::fx::{FxGraph, FxNode};
use super::moe::{MoePlan, MoeState};
use super::report::ImportReport;
use super::scatter::Unset;
use super::schema::{Arg, ScalarType, SymArg, SymInt};
use super::sympy;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use weft_ir::{CmpOp, DType, Dim, Float, Graph, HostTensor, Op, TensorType, Value};

pub(crate) type LErr = Rc<Pt2Error>;
pub(crate) type LR<T> = Result<T, LErr>;

/// Pair rows of a MoE block, held in `moe_dispatch` order (sorted by expert).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Rows {
    pub m: usize,
    pub v: Value,
    /// The exported value is in HF pair order (`t*k + slot`) rather than sorted order.
    pub hf: bool,
    /// Routing weights `[T, k]` the rows are (lazily) multiplied by.
    pub scale: Option<Value>,
}

#[derive(Clone, Debug)]
pub(crate) enum LV {
    T(Value),
    Sym(Dim),
    Num(f64, Kind),
    None,
    Err(LErr),
    // ---- MoE routing tags (see moe.rs) ----
    Rows(Rows),
    /// `view(rows, [T, k, H])` of HF-ordered rows, waiting for its `sum(dim=1)`.
    Grouped(Rows),
    /// Routing weights in sorted order (`weights.flatten()[perm]`), as the `[T, k]` tensor.
    PairW {
        m: usize,
        w: Value,
    },
    SortedIds(usize),
    Perm(usize),
    PermTok,
    Counts,
    Offs,
    InvPerm(usize),
    /// A bool tensor known to be all false (the EP sentinel mask of transformers' MoE).
    False,
    /// An empty tensor not yet written everywhere (see scatter.rs).
    Unset(Rc<Unset>),
}

pub(crate) enum Operand {
    T(Value),
    Num(f64, Kind),
}

pub(crate) struct Lower<'a> {
    pub fx: &'a FxGraph,
    pub g: Graph,
    pub env: BTreeMap<String, LV>,
    /// Export symbol → Weft dim (`s70` → `S`).
    pub symmap: BTreeMap<String, Dim>,
    /// Buffers and constants by placeholder name (for evaluation only).
    pub consts: BTreeMap<String, HostTensor>,
    /// Values that depend only on sizes, buffers and constants.
    pub static_vals: BTreeSet<String>,
    pub report: ImportReport,
    /// Values known to be causal masks: `true` for additive (0 / -inf), `false` for bool keep-masks.
    pub causal: BTreeMap<Value, bool>,
    /// Masks rebuilt from `arange` + `compare` (causal or windowed): they broadcast over
    /// batch and heads where the export expanded them.
    pub broadcast_masks: BTreeSet<Value>,
    /// The window of the causal masks in `causal` that have one.
    pub mask_windows: BTreeMap<Value, i64>,
    pub rope_tables: Vec<(String, [Value; 2])>,
    /// Rotary `cos`/`sin` nodes lowered to a `rope_table` that already holds the
    /// scaling's attention factor (YaRN), with that factor: their one use is the
    /// product with it.
    pub factored_tables: BTreeMap<String, f64>,
    pub positions: Option<Value>,
    pub rope_cfg: Option<crate::config::RopeConfig>,
    pub moe: MoePlan,
    pub moe_state: Vec<MoeState>,
    /// The export symbol of the sequence length, for evaluation at probe sizes.
    pub seq_sym: Option<String>,
    pub batch_sym: Option<String>,
    /// Index of the node being lowered.
    pub current: Option<usize>,
    /// The example batch and sequence sizes of the export (hints or constants).
    pub b0: i64,
    pub s0: i64,
    /// The export fixed the sequence length: recorded sizes equal to it become `S`.
    pub generalize_seq: bool,
    /// `(x, dim, step)` → the parts of `x` de-interleaved on `dim` (see strided.rs).
    pub strided: BTreeMap<(Value, i64, i64), Vec<Value>>,
}

pub(crate) fn dup(e: &Pt2Error) -> Pt2Error {
    match e {
        Pt2Error::UnsupportedOp {
            op,
            node,
            layer,
            message,
        } => Pt2Error::UnsupportedOp {
            op: op.clone(),
            node: node.clone(),
            layer: layer.clone(),
            message: message.clone(),
        },
        Pt2Error::Node {
            op,
            node,
            layer,
            message,
        } => Pt2Error::Node {
            op: op.clone(),
            node: node.clone(),
            layer: layer.clone(),
            message: message.clone(),
        },
        Pt2Error::SymExpr {
            expr,
            place,
            message,
        } => Pt2Error::SymExpr {
            expr: expr.clone(),
            place: place.clone(),
            message: message.clone(),
        },
        other => Pt2Error::Signature {
            message: other.to_string(),
        },
    }
}

pub(crate) fn unwrap_err(e: LErr) -> Pt2Error {
    Rc::try_unwrap(e).unwrap_or_else(|rc| dup(&rc))
}

fn dtype_of_code(code: i64) -> Option<DType> {
    ScalarType::dtype(code)
}

fn rank_of(d: DType) -> u8 {
    match d {
        DType::Bool => 0,
        DType::I32 => 1,
        DType::I64 => 2,
        DType::BF16 | DType::F16 => 3,
        DType::F32 => 4,
        DType::F64 => 5,
    }
}

impl<'a> Lower<'a> {
    pub fn new(fx: &'a FxGraph, name: &str) -> Lower<'a> {
        Lower {
            fx,
            g: Graph::new(name),
            env: BTreeMap::new(),
            symmap: BTreeMap::new(),
            consts: BTreeMap::new(),
            static_vals: BTreeSet::new(),
            report: ImportReport::default(),
            causal: BTreeMap::new(),
            broadcast_masks: BTreeSet::new(),
            mask_windows: BTreeMap::new(),
            rope_tables: Vec::new(),
            factored_tables: BTreeMap::new(),
            positions: None,
            rope_cfg: None,
            moe: MoePlan::default(),
            moe_state: Vec::new(),
            strided: BTreeMap::new(),
            seq_sym: None,
            batch_sym: None,
            current: None,
            b0: 1,
            s0: 1,
            generalize_seq: false,
        }
    }

    #[cfg(test)]
    pub fn for_tests(fx: &'a FxGraph, b0: i64, s0: i64, generalize_seq: bool) -> Lower<'a> {
        Lower {
            b0,
            s0,
            generalize_seq,
            ..Lower::new(fx, "t")
        }
    }

    // ---------------------------------------------------------------- errors

    pub fn unsupported(&self, n: &FxNode, msg: impl Into<String>) -> LErr {
        Rc::new(Pt2Error::UnsupportedOp {
            op: n.op.clone(),
            node: n.name.clone(),
            layer: n.scope.clone(),
            message: msg.into(),
        })
    }

    pub fn bad(&self, n: &FxNode, msg: impl Into<String>) -> LErr {
        Rc::new(Pt2Error::Node {
            op: n.op.clone(),
            node: n.name.clone(),
            layer: n.scope.clone(),
            message: msg.into(),
        })
    }

    // ---------------------------------------------------------------- values

    pub fn lv(&self, name: &str) -> LV {
        self.env.get(name).cloned().unwrap_or_else(|| {
            LV::Err(Rc::new(Pt2Error::Node {
                op: "?".into(),
                node: name.into(),
                layer: None,
                message: format!("value `{name}` is used before it is defined"),
            }))
        })
    }

    pub fn arg_lv(&self, a: &Arg) -> LV {
        match a {
            Arg::Tensor(t) => self.lv(t),
            Arg::Int(i) => LV::Num(*i as f64, Kind::Int),
            Arg::Float(f) => LV::Num(*f, Kind::Float),
            Arg::Bool(b) => LV::Num(*b as i64 as f64, Kind::Bool),
            Arg::SymInt(SymArg::Int(i)) => LV::Num(*i as f64, Kind::Int),
            Arg::SymInt(SymArg::Name(n)) => self.lv(n),
            Arg::None => LV::None,
            _ => LV::None,
        }
    }

    pub fn tensor(&self, n: &FxNode, a: &Arg) -> LR<Value> {
        match self.arg_lv(a) {
            LV::T(v) => Ok(v),
            LV::Err(e) => Err(e),
            LV::Rows(_) | LV::Grouped(_) => Err(self.unsupported(
                n,
                "uses the rows of a MoE block in a way the importer does not follow",
            )),
            LV::Unset(u) => Err(self.unset_read(n, &u)),
            other => Err(self.bad(n, format!("expected a tensor argument, found {other:?}"))),
        }
    }

    pub fn operand(&self, n: &FxNode, a: &Arg) -> LR<Operand> {
        match self.arg_lv(a) {
            LV::T(v) => Ok(Operand::T(v)),
            LV::Num(x, k) => Ok(Operand::Num(x, k)),
            LV::Sym(d) => match d.as_const() {
                Some(c) => Ok(Operand::Num(c as f64, Kind::Int)),
                None => Err(self.unsupported(n, format!("a tensor op on the symbolic size `{d}`"))),
            },
            LV::Err(e) => Err(e),
            LV::Unset(u) => Err(self.unset_read(n, &u)),
            other => Err(self.bad(n, format!("expected a tensor or number, found {other:?}"))),
        }
    }

    pub fn dim_arg(&self, n: &FxNode, a: &Arg) -> LR<Dim> {
        match self.arg_lv(a) {
            LV::Num(x, _) => Ok(Dim::from(x as i64)),
            LV::Sym(d) => Ok(d),
            LV::Err(e) => Err(e),
            other => Err(self.bad(n, format!("expected a size, found {other:?}"))),
        }
    }

    pub fn int_arg(&self, n: &FxNode, a: &Arg) -> LR<i64> {
        match a {
            Arg::Int(i) => Ok(*i),
            Arg::SymInt(SymArg::Int(i)) => Ok(*i),
            _ => {
                match self.dim_arg(n, a)?.as_const() {
                    Some(c) => Ok(c),
                    None => Err(self
                        .unsupported(n, "needs a constant where the export has a symbolic size")),
                }
            }
        }
    }

    pub fn ints_arg(&self, n: &FxNode, a: &Arg) -> LR<Vec<i64>> {
        match a {
            Arg::Ints(v) => Ok(v.clone()),
            Arg::Int(i) => Ok(vec![*i]),
            Arg::SymInts(v) => v
                .iter()
                .map(|s| self.int_arg(n, &Arg::SymInt(s.clone())))
                .collect(),
            _ => Err(self.bad(n, format!("expected a list of ints, found {a:?}"))),
        }
    }

    pub fn float_arg(&self, n: &FxNode, a: &Arg) -> LR<f64> {
        match self.arg_lv(a) {
            LV::Num(x, _) => Ok(x),
            LV::Err(e) => Err(e),
            other => Err(self.bad(n, format!("expected a number, found {other:?}"))),
        }
    }

    pub fn sym_to_dim(&self, expr: &str, place: &str) -> LR<Dim> {
        let e = sympy::parse(expr).map_err(|m| {
            Rc::new(Pt2Error::SymExpr {
                expr: expr.into(),
                place: place.into(),
                message: m,
            })
        })?;
        e.to_dim(&self.symmap).map_err(|m| {
            Rc::new(Pt2Error::SymExpr {
                expr: expr.into(),
                place: place.into(),
                message: m,
            })
        })
    }

    pub fn symint_dim(&self, s: &SymInt, place: &str) -> LR<Dim> {
        match s {
            SymInt::Int(i) => Ok(Dim::from(*i)),
            SymInt::Expr { expr, .. } => self.sym_to_dim(expr, place),
        }
    }

    /// The type the export recorded for a value.
    pub fn meta_ty(&self, name: &str) -> LR<TensorType> {
        let m = self.fx.tensor_meta.get(name).ok_or_else(|| {
            Rc::new(Pt2Error::Node {
                op: "?".into(),
                node: name.into(),
                layer: None,
                message: "no recorded tensor type".into(),
            })
        })?;
        let dtype = dtype_of_code(m.dtype).ok_or_else(|| {
            Rc::new(Pt2Error::DType {
                entry: "models/model.json".into(),
                tensor: name.into(),
                code: m.dtype,
                name: ScalarType::name(m.dtype).into(),
            })
        })?;
        let shape = m
            .sizes
            .iter()
            .map(|s| self.symint_dim(s, &format!("the type of `{name}`")))
            .collect::<LR<Vec<_>>>()?;
        Ok(TensorType::new(dtype, shape))
    }

    pub fn out_ty(&self, n: &FxNode) -> LR<TensorType> {
        let o = n.out().ok_or_else(|| self.bad(n, "has no output"))?;
        self.meta_ty(o)
    }

    // ---------------------------------------------------------------- emitting

    pub fn emit(&mut self, n: &FxNode, op: Op, args: &[Value]) -> LR<Value> {
        self.g.add(op, args).map_err(|e| self.bad(n, e.message))
    }

    pub fn emit_multi(&mut self, n: &FxNode, op: Op, args: &[Value]) -> LR<Vec<Value>> {
        self.g
            .add_multi(op, args)
            .map_err(|e| self.bad(n, e.message))
    }

    pub fn ty(&self, v: Value) -> TensorType {
        self.g.ty(v).clone()
    }

    pub fn full(&mut self, n: &FxNode, value: f64, ty: TensorType) -> LR<Value> {
        self.emit(
            n,
            Op::Full {
                value: Float(value),
                ty,
            },
            &[],
        )
    }

    pub fn cast(&mut self, n: &FxNode, v: Value, dtype: DType) -> LR<Value> {
        if self.g.ty(v).dtype == dtype {
            return Ok(v);
        }
        self.emit(n, Op::Cast { dtype }, &[v])
    }

    pub fn reshape(&mut self, n: &FxNode, v: Value, shape: Vec<Dim>) -> LR<Value> {
        if self.g.ty(v).shape == shape {
            return Ok(v);
        }
        self.emit(n, Op::Reshape { shape }, &[v])
    }

    /// A scalar operand as a rank-0 tensor of `dtype`, or a tensor cast to `dtype`.
    pub fn as_tensor(&mut self, n: &FxNode, o: Operand, dtype: DType) -> LR<Value> {
        match o {
            Operand::T(v) => self.cast(n, v, dtype),
            Operand::Num(x, _) => self.full(n, x, TensorType::scalar(dtype)),
        }
    }

    // ---------------------------------------------------------------- driver

    pub fn run(&mut self) {
        for i in 0..self.fx.nodes.len() {
            let n = &self.fx.nodes[i];
            self.current = Some(i);
            self.g.set_scope(n.scope.as_deref());
            // A size-only node whose lowering fails gets a second chance as an
            // evaluated causal mask.
            let is_static = n.out().is_some_and(|o| self.static_vals.contains(o));
            let outs = match self.lower_node(n) {
                Ok(outs) => outs,
                Err(e) if is_static => match self.rescue_static(n, e) {
                    Ok(o) => o,
                    Err(e) => vec![LV::Err(e); n.outputs.len().max(1)],
                },
                Err(e) => vec![LV::Err(e); n.outputs.len().max(1)],
            };
            let outs = self.check_types(n, outs);
            for (o, v) in n.outputs.iter().zip(outs) {
                if let Some(o) = o {
                    self.env.insert(o.clone(), v);
                }
            }
        }
        self.g.set_scope(None);
    }

    /// Checks each lowered tensor's type against the export's record.
    fn check_types(&self, n: &FxNode, outs: Vec<LV>) -> Vec<LV> {
        outs.into_iter()
            .zip(n.outputs.iter().chain(std::iter::repeat(&None)))
            .map(|(lv, name)| match (&lv, name) {
                (LV::T(v), Some(name)) => match self.meta_ty(name) {
                    Ok(want) if !self.fits(&want, self.g.ty(*v), *v) => LV::Err(self.bad(
                        n,
                        format!(
                            "importer produced {} for `{name}`, the export recorded {want}",
                            self.g.ty(*v)
                        ),
                    )),
                    _ => lv,
                },
                _ => lv,
            })
            .collect()
    }

    pub fn norm_dim(&self, n: &FxNode, d: i64, rank: usize) -> LR<usize> {
        let r = rank as i64;
        let v = if d < 0 { d + r } else { d };
        if v < 0 || v >= r {
            return Err(self.bad(n, format!("dim {d} is out of range for rank {rank}")));
        }
        Ok(v as usize)
    }

    /// The value of a scalar operand or of a `full` tensor.
    pub fn const_of(&self, o: &Operand) -> Option<f64> {
        match o {
            Operand::Num(x, _) => Some(*x),
            Operand::T(v) => match &self.g.node(self.g.def(*v)).op {
                Op::Full { value, .. } => Some(value.0),
                _ => None,
            },
        }
    }

    /// The lowered type is the recorded one at the export's example sizes (a causal
    /// mask may broadcast where the recorded one was expanded).
    fn fits(&self, want: &TensorType, got: &TensorType, v: Value) -> bool {
        if want == got {
            return true;
        }
        if want.dtype != got.dtype || want.rank() != got.rank() {
            return false;
        }
        let bcast = self.causal.contains_key(&v) || self.broadcast_masks.contains(&v);
        want.shape
            .iter()
            .zip(&got.shape)
            .all(|(w, g)| self.same_size(w, g) || bcast && *g == Dim::from(1))
    }

    fn lower_node(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        if let Some(r) = self.lower_moe(n) {
            return r;
        }
        let one = |v: Value| Ok(vec![LV::T(v)]);
        let op = n.op.as_str();
        match op {
            "aten.sym_size.int" => {
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
            "aten.sym_numel.default" => {
                let Arg::Tensor(x) = n.arg_at(0) else {
                    return Err(self.bad(n, "sym_numel of a non-tensor"));
                };
                Ok(vec![LV::Sym(self.meta_ty(x)?.numel())])
            }
            "_operator.add.default"
            | "_operator.sub.default"
            | "_operator.mul.default"
            | "_operator.floordiv.default" => {
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
                    _ => a.floor_div(&b),
                };
                Ok(vec![LV::Sym(r)])
            }
            "_operator.neg.default" => {
                Ok(vec![LV::Sym(Dim::from(0) - self.dim_arg(n, n.arg_at(0))?)])
            }
            "aten.embedding.default" => {
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
            "aten.linear.default" => {
                let (x, w) = (self.tensor(n, n.arg_at(0))?, self.tensor(n, n.arg_at(1))?);
                let mut args = vec![x, w];
                if !matches!(n.arg_at(2), Arg::None) {
                    args.push(self.tensor(n, n.arg_at(2))?);
                }
                one(self.emit(n, Op::Linear {}, &args)?)
            }
            "aten.mm.default" | "aten.bmm.default" | "aten.matmul.default" => {
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
            "aten.addmm.default" => {
                let (bias, a, b) = (
                    self.tensor(n, n.arg_at(0))?,
                    self.tensor(n, n.arg_at(1))?,
                    self.tensor(n, n.arg_at(2))?,
                );
                if self.float_arg(n, n.arg("beta"))? != 1.0
                    || self.float_arg(n, n.arg("alpha"))? != 1.0
                {
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
            "aten.scaled_dot_product_attention.default" => self.lower_sdpa(n),
            "aten.cos.default" | "aten.sin.default" => self.lower_rope_table(n),
            "aten.add.Tensor" | "aten.add.Scalar" | "aten.sub.Tensor" | "aten.sub.Scalar"
            | "aten.rsub.Scalar" => {
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
            "aten.mul.Tensor" | "aten.mul.Scalar" => {
                let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
                if let Some(table) = self.factored_table(n) {
                    return one(table);
                }
                self.arith(n, Bin::Mul, a, b)
            }
            "aten.div.Tensor" | "aten.div.Scalar" => {
                let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
                self.arith(n, Bin::Div, a, b)
            }
            "aten.pow.Tensor_Scalar" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let e = self.float_arg(n, n.arg_at(1))?;
                let ty = self.out_ty(n)?;
                let x = self.cast(n, x, ty.dtype)?;
                one(self.emit(n, Op::PowScalar { exponent: Float(e) }, &[x])?)
            }
            "aten.maximum.default" | "aten.minimum.default" => {
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
            "aten.clamp.default" | "aten.clamp_min.default" | "aten.clamp_max.default" => {
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
            "aten.neg.default"
            | "aten.exp.default"
            | "aten.log.default"
            | "aten.sqrt.default"
            | "aten.rsqrt.default"
            | "aten.tanh.default"
            | "aten.sigmoid.default"
            | "aten.silu.default"
            | "aten.relu.default"
            | "aten.gelu.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let ty = self.out_ty(n)?;
                let x = self.cast(n, x, ty.dtype)?;
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
            "aten.eq.Tensor" | "aten.eq.Scalar" | "aten.ne.Tensor" | "aten.ne.Scalar"
            | "aten.lt.Tensor" | "aten.lt.Scalar" | "aten.le.Tensor" | "aten.le.Scalar"
            | "aten.gt.Tensor" | "aten.gt.Scalar" | "aten.ge.Tensor" | "aten.ge.Scalar" => {
                let cmp = match n.base() {
                    "eq" => CmpOp::Eq,
                    "ne" => CmpOp::Ne,
                    "lt" => CmpOp::Lt,
                    "le" => CmpOp::Le,
                    "gt" => CmpOp::Gt,
                    _ => CmpOp::Ge,
                };
                let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
                let dt = self.common_dtype(&a, &b);
                let (a, b) = (self.as_tensor(n, a, dt)?, self.as_tensor(n, b, dt)?);
                one(self.emit(n, Op::Compare { op: cmp }, &[a, b])?)
            }
            "aten.__and__.Tensor"
            | "aten.bitwise_and.Tensor"
            | "aten.logical_and.default"
            | "aten.__or__.Tensor"
            | "aten.bitwise_or.Tensor"
            | "aten.logical_or.default" => {
                let (a, b) = (self.operand(n, n.arg_at(0))?, self.operand(n, n.arg_at(1))?);
                let (a, b) = (
                    self.as_tensor(n, a, DType::Bool)?,
                    self.as_tensor(n, b, DType::Bool)?,
                );
                let is_and = n.base().contains("and");
                let c = self.full(
                    n,
                    if is_and { 0.0 } else { 1.0 },
                    TensorType::scalar(DType::Bool),
                )?;
                let r = if is_and {
                    self.emit(n, Op::Where {}, &[a, b, c])?
                } else {
                    self.emit(n, Op::Where {}, &[a, c, b])?
                };
                one(r)
            }
            "aten.logical_not.default" | "aten.bitwise_not.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                if self.g.ty(x).dtype != DType::Bool {
                    return Err(self.unsupported(n, "bitwise not of a non-bool tensor"));
                }
                let f = self.full(n, 0.0, TensorType::scalar(DType::Bool))?;
                one(self.emit(n, Op::Compare { op: CmpOp::Eq }, &[x, f])?)
            }
            "aten.where.self" | "aten.where.ScalarOther" | "aten.where.ScalarSelf" => {
                if let LV::False = self.arg_lv(n.arg_at(0)) {
                    return Ok(vec![self.arg_lv(n.arg_at(2))]);
                }
                if let Some(mask) = self.additive_mask(n)? {
                    return one(mask);
                }
                let c = self.tensor(n, n.arg_at(0))?;
                let ty = self.out_ty(n)?;
                let (a, b) = (self.operand(n, n.arg_at(1))?, self.operand(n, n.arg_at(2))?);
                let additive = self.causal.get(&c) == Some(&false)
                    && matches!((self.const_of(&a), self.const_of(&b)), (Some(z), Some(m)) if z == 0.0 && m <= -1e30);
                let (a, b) = (
                    self.as_tensor(n, a, ty.dtype)?,
                    self.as_tensor(n, b, ty.dtype)?,
                );
                let w = self.emit(n, Op::Where {}, &[c, a, b])?;
                if additive {
                    self.causal.insert(w, true);
                    if let Some(&win) = self.mask_windows.get(&c) {
                        self.mask_windows.insert(w, win);
                    }
                }
                one(w)
            }
            "aten.masked_fill.Scalar" | "aten.masked_fill.Tensor" => {
                if let LV::False = self.arg_lv(n.arg_at(1)) {
                    return Ok(vec![self.arg_lv(n.arg_at(0))]);
                }
                let x = self.tensor(n, n.arg_at(0))?;
                let m = self.tensor(n, n.arg_at(1))?;
                let dt = self.g.ty(x).dtype;
                let v = self.operand(n, n.arg_at(2))?;
                let v = self.as_tensor(n, v, dt)?;
                one(self.emit(n, Op::Where {}, &[m, v, x])?)
            }
            "aten.to.dtype"
            | "aten.to.dtype_layout"
            | "aten.to.device"
            | "aten._to_copy.default"
            | "aten.type_as.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let ty = self.out_ty(n)?;
                one(self.cast(n, x, ty.dtype)?)
            }
            "aten.clone.default"
            | "aten.alias.default"
            | "aten.contiguous.default"
            | "aten.detach.default"
            | "aten.lift_fresh_copy.default" => Ok(vec![self.arg_lv(n.arg_at(0))]),
            "aten.copy.default" => self.lower_copy(n),
            "aten.slice_scatter.default" => self.lower_slice_scatter(n),
            "aten.empty.memory_format"
            | "aten.empty_like.default"
            | "aten.empty_permuted.default" => self.lower_empty(n),
            "aten.dropout.default" => {
                let p = self.float_arg(n, n.arg_at(1))?;
                let train = matches!(n.arg_at(2), Arg::Bool(true));
                if p != 0.0 && train {
                    return Err(self.unsupported(
                        n,
                        format!(
                            "dropout with p = {p} in training mode (export the model in eval mode)"
                        ),
                    ));
                }
                Ok(vec![self.arg_lv(n.arg_at(0))])
            }
            "aten.mean.dim" | "aten.sum.dim_IntList" | "aten.amax.default" => {
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
            "aten.any.dim" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let d = self.int_arg(n, n.arg_at(1))?;
                let keepdim = matches!(n.arg_at(2), Arg::Bool(true));
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
            "aten.softmax.int"
            | "aten._softmax.default"
            | "aten.log_softmax.int"
            | "aten._log_softmax.default" => {
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
            "aten.full.default"
            | "aten.zeros.default"
            | "aten.ones.default"
            | "aten.new_ones.default"
            | "aten.new_zeros.default"
            | "aten.full_like.default"
            | "aten.zeros_like.default"
            | "aten.ones_like.default"
            | "aten.scalar_tensor.default" => {
                let mut ty = self.out_ty(n)?;
                ty.shape = match (n.base().ends_with("_like"), self.arg_lv(n.arg_at(0))) {
                    (true, LV::T(x)) => self.gen_like(&self.ty(x).shape, &ty.shape),
                    _ => self.gen_free(&ty.shape),
                };
                let v = match n.base() {
                    "full" | "full_like" => self.float_arg(n, n.arg_at(1))?,
                    "scalar_tensor" => self.float_arg(n, n.arg_at(0))?,
                    "ones" | "new_ones" | "ones_like" => 1.0,
                    _ => 0.0,
                };
                one(self.full(n, v, ty)?)
            }
            "aten.arange.default" | "aten.arange.start" | "aten.arange.start_step" => {
                let mut ty = self.out_ty(n)?;
                ty.shape = self.gen_free(&ty.shape);
                let start = match n.op.as_str() {
                    "aten.arange.default" => Dim::from(0),
                    _ => self.dim_arg(n, n.arg_at(0))?,
                };
                if n.op == "aten.arange.start_step" && self.float_arg(n, n.arg_at(2))? != 1.0 {
                    return Err(self.unsupported(n, "arange with a step other than 1"));
                }
                one(self.emit(n, Op::Arange { start, ty }, &[])?)
            }
            "aten.view.default"
            | "aten.reshape.default"
            | "aten._unsafe_view.default"
            | "aten.unsqueeze.default"
            | "aten.squeeze.dim"
            | "aten.squeeze.dims"
            | "aten.squeeze.default"
            | "aten.flatten.using_ints" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let ty = self.out_ty(n)?;
                let shape = self.gen_reshape(&self.ty(x).shape, &ty.shape);
                one(self.reshape(n, x, shape)?)
            }
            "aten.expand.default" | "aten.expand_as.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                if self.causal.contains_key(&x) || self.broadcast_masks.contains(&x) {
                    // A causal mask broadcasts; expanding it over batch and heads adds nothing.
                    return one(x);
                }
                let ty = self.out_ty(n)?;
                let shape = self.gen_expand(&self.ty(x).shape, &ty.shape);
                if self.g.ty(x).shape == shape {
                    return one(x);
                }
                one(self.emit(n, Op::Expand { shape }, &[x])?)
            }
            "aten.permute.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let perm = self.ints_arg(n, n.arg_at(1))?;
                let r = perm.len() as i64;
                let perm: Vec<i64> = perm
                    .into_iter()
                    .map(|p| if p < 0 { p + r } else { p })
                    .collect();
                if perm.iter().enumerate().all(|(i, &p)| i as i64 == p) {
                    return one(x);
                }
                one(self.emit(n, Op::Permute { perm }, &[x])?)
            }
            "aten.transpose.int" | "aten.t.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let r = self.g.ty(x).rank() as i64;
                let (a, b) = if n.base() == "t" {
                    (0, 1)
                } else {
                    (self.int_arg(n, n.arg_at(1))?, self.int_arg(n, n.arg_at(2))?)
                };
                let (a, b) = (if a < 0 { a + r } else { a }, if b < 0 { b + r } else { b });
                if a == b {
                    return one(x);
                }
                one(self.emit(n, Op::Transpose { dim0: a, dim1: b }, &[x])?)
            }
            "aten.slice.Tensor" | "aten.select.int" => {
                if let (LV::Unset(u), "slice") = (self.arg_lv(n.arg_at(0)), n.base()) {
                    return self.slice_unset(n, &u);
                }
                let x = self.tensor(n, n.arg_at(0))?;
                let xt = self.ty(x);
                let ty = self.out_ty(n)?;
                let r = xt.rank() as i64;
                let d = self.int_arg(n, n.arg_at(1))?;
                let d = if d < 0 { d + r } else { d };
                if d < 0 || d >= r {
                    return Err(self.bad(n, format!("dim {d} out of range")));
                }
                let size = xt.shape[d as usize].clone();
                let norm = |s: Dim| -> Dim {
                    match s.as_const() {
                        Some(c) if c < 0 => size.clone() + c,
                        _ => s,
                    }
                };
                if n.base() == "select" {
                    let i = norm(self.dim_arg(n, n.arg_at(2))?);
                    let s = self.emit(
                        n,
                        Op::Slice {
                            dim: d,
                            start: i,
                            len: Dim::from(1),
                        },
                        &[x],
                    )?;
                    let shape = self.gen_reshape(&self.ty(s).shape, &ty.shape);
                    return one(self.reshape(n, s, shape)?);
                }
                let step = self.int_arg(n, n.arg_at(4))?;
                if step != 1 {
                    return one(self.strided_slice(n, x, d, step)?);
                }
                let start = match n.arg_at(2) {
                    Arg::None => Dim::from(0),
                    a => norm(self.dim_arg(n, a)?),
                };
                let mut len = ty.shape[d as usize].clone();
                if self.same_size(&len, &size) {
                    len = size.clone();
                } else {
                    len = self.seq_dim(&len);
                }
                if start == Dim::from(0) && len == size {
                    return one(x);
                }
                one(self.emit(n, Op::Slice { dim: d, start, len }, &[x])?)
            }
            "aten.cat.default" => {
                let Arg::Tensors(names) = n.arg_at(0) else {
                    return Err(self.bad(n, "cat of a non-list"));
                };
                let ty = self.out_ty(n)?;
                let mut vs = Vec::new();
                for nm in names {
                    let v = self.tensor(n, &Arg::Tensor(nm.clone()))?;
                    let t = self.ty(v);
                    if t.rank() == 1 && t.shape[0] == Dim::from(0) {
                        continue;
                    }
                    vs.push(self.cast(n, v, ty.dtype)?);
                }
                if vs.len() == 1 {
                    return one(vs[0]);
                }
                let d = self.int_arg(n, n.arg_at(1))?;
                one(self.emit(n, Op::Concat { dim: d }, &vs)?)
            }
            "aten.split_with_sizes.default"
            | "aten.split.Tensor"
            | "aten.chunk.default"
            | "aten.unbind.int" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let vs = self.split(n, x)?;
                Ok(vs.into_iter().map(LV::T).collect())
            }
            "aten.index.Tensor" => {
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
                            return Err(self.unsupported(
                                n,
                                "advanced indexing with a multi-dimensional index",
                            ));
                        }
                        one(self.emit(n, Op::IndexSelect { dim: 0 }, &[x, i])?)
                    }
                    _ => Err(self.unsupported(n, "advanced indexing with several index tensors")),
                }
            }
            "aten.index_select.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let d = self.int_arg(n, n.arg_at(1))?;
                let i = self.tensor(n, n.arg_at(2))?;
                one(self.emit(n, Op::IndexSelect { dim: d }, &[x, i])?)
            }
            "aten.gather.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let d = self.int_arg(n, n.arg_at(1))?;
                let i = self.tensor(n, n.arg_at(2))?;
                one(self.emit(n, Op::Gather { dim: d }, &[x, i])?)
            }
            "aten.scatter_add.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let d = self.int_arg(n, n.arg_at(1))?;
                let i = self.tensor(n, n.arg_at(2))?;
                let s = self.tensor(n, n.arg_at(3))?;
                one(self.emit(n, Op::ScatterAdd { dim: d }, &[x, i, s])?)
            }
            "aten.scatter.value" => {
                // `zeros.scatter_(-1, index, v)` (DeepSeek-V3's mask of the kept expert
                // groups): `v` where some index of the row hits, else 0, read row by row
                // as `where(max(one_hot(index), -2) > 0, v, 0)`. On another base the
                // overwritten values would matter, and other dims mix rows: refused.
                let x = self.tensor(n, n.arg_at(0))?;
                if self.const_of(&Operand::T(x)) != Some(0.0) {
                    return Err(self
                        .unsupported(n, "scatter of a value into a tensor that is not all zeros"));
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
                let (Some(classes), true) = (classes.filter(|_| d + 1 == xt.rank()), rows_match)
                else {
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
            "aten.one_hot.default" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let ty = self.out_ty(n)?;
                let k =
                    ty.shape.last().and_then(Dim::as_const).ok_or_else(|| {
                        self.unsupported(n, "one_hot with a symbolic class count")
                    })?;
                one(self.emit(
                    n,
                    Op::OneHot {
                        num_classes: k,
                        dtype: ty.dtype,
                    },
                    &[x],
                )?)
            }
            "aten.topk.default" => {
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
            "aten.max.dim" => {
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
            "aten.repeat_interleave.self_int" => {
                let x = self.tensor(n, n.arg_at(0))?;
                let r = self.int_arg(n, n.arg_at(1))?;
                let ty = self.out_ty(n)?;
                let xt = self.ty(x);
                let d = match n.arg_at(2) {
                    Arg::None => return Err(self.unsupported(n, "repeat_interleave without dim")),
                    a => self.int_arg(n, a)?,
                };
                let d = self.norm_dim(n, d, xt.rank())?;
                if r <= 0 {
                    return Err(self.bad(n, "repeat count must be positive"));
                }
                let mut s1 = xt.shape.clone();
                s1.insert(d + 1, Dim::from(1));
                let u = self.reshape(n, x, s1.clone())?;
                s1[d + 1] = Dim::from(r);
                let e = self.emit(n, Op::Expand { shape: s1 }, &[u])?;
                let shape = self.gen_reshape(&self.ty(e).shape, &ty.shape);
                one(self.reshape(n, e, shape)?)
            }
            "_operator.getitem.default" => {
                Err(self.unsupported(n, "getitem on a value the importer does not split"))
            }
            _ => Err(self.unsupported(n, "this op has no Weft lowering")),
        }
    }

    fn split(&mut self, n: &FxNode, x: Value) -> LR<Vec<Value>> {
        let xt = self.ty(x);
        let (d, sizes): (i64, Vec<Dim>) = match n.base() {
            "unbind" => {
                let d = self.int_arg(n, n.arg_at(1))?;
                let du = self.norm_dim(n, d, xt.rank())?;
                let k = xt.shape[du]
                    .as_const()
                    .ok_or_else(|| self.unsupported(n, "unbind of a symbolic dim"))?;
                if !(0..=1 << 16).contains(&k) {
                    return Err(self.bad(n, "unbind of a huge dim"));
                }
                let parts = self.emit_multi(
                    n,
                    Op::Split {
                        dim: d,
                        sizes: vec![Dim::from(1); k as usize],
                    },
                    &[x],
                )?;
                let mut out = Vec::new();
                for (p, o) in parts.into_iter().zip(&n.outputs) {
                    let ty = match o {
                        Some(o) => self.meta_ty(o)?,
                        None => continue,
                    };
                    let shape = self.gen_reshape(&self.ty(p).shape, &ty.shape);
                    out.push(self.reshape(n, p, shape)?);
                }
                return Ok(out);
            }
            "split_with_sizes" => {
                let (Arg::SymInts(_) | Arg::Ints(_)) = n.arg_at(1) else {
                    return Err(self.bad(n, "split sizes"));
                };
                let sizes = match n.arg_at(1) {
                    Arg::Ints(v) => v.iter().map(|&i| Dim::from(i)).collect(),
                    Arg::SymInts(v) => v
                        .iter()
                        .map(|s| self.dim_arg(n, &Arg::SymInt(s.clone())))
                        .collect::<LR<Vec<_>>>()?,
                    _ => unreachable!(),
                };
                (self.int_arg(n, n.arg_at(2))?, sizes)
            }
            _ => {
                let d = self.int_arg(n, n.arg_at(2))?;
                let du = self.norm_dim(n, d, xt.rank())?;
                let total = xt.shape[du].clone();
                let sizes = if n.base() == "chunk" {
                    let c = self.int_arg(n, n.arg_at(1))?;
                    if c <= 0 || c > 1 << 16 {
                        return Err(self.bad(n, format!("chunk into {c} parts")));
                    }
                    match total.as_const() {
                        Some(t) => {
                            let each = (t + c - 1) / c;
                            let mut v = Vec::new();
                            let mut left = t;
                            while left > 0 {
                                v.push(Dim::from(each.min(left)));
                                left -= each;
                            }
                            v
                        }
                        None => vec![total.clone() / c; c as usize],
                    }
                } else {
                    let s = self.int_arg(n, n.arg_at(1))?;
                    let t = total
                        .as_const()
                        .ok_or_else(|| self.unsupported(n, "split of a symbolic dim"))?;
                    if s <= 0 || t / s > 1 << 16 {
                        return Err(self.bad(n, format!("split into pieces of {s}")));
                    }
                    let mut v = Vec::new();
                    let mut left = t;
                    while left > 0 {
                        v.push(Dim::from(s.min(left)));
                        left -= s;
                    }
                    v
                };
                (d, sizes)
            }
        };
        if sizes.len() == 1 {
            return Ok(vec![x]);
        }
        self.emit_multi(n, Op::Split { dim: d, sizes }, &[x])
    }

    pub fn common_dtype(&self, a: &Operand, b: &Operand) -> DType {
        match (a, b) {
            (Operand::T(x), Operand::T(y)) => {
                let (dx, dy) = (self.g.ty(*x).dtype, self.g.ty(*y).dtype);
                if rank_of(dx) >= rank_of(dy) {
                    dx
                } else {
                    dy
                }
            }
            (Operand::T(x), Operand::Num(_, k)) | (Operand::Num(_, k), Operand::T(x)) => {
                let d = self.g.ty(*x).dtype;
                if *k == Kind::Float && !d.is_float() {
                    DType::F32
                } else {
                    d
                }
            }
            (Operand::Num(_, k1), Operand::Num(_, k2)) => {
                if *k1 == Kind::Float || *k2 == Kind::Float {
                    DType::F32
                } else {
                    DType::I64
                }
            }
        }
    }

    fn arith(&mut self, n: &FxNode, op: Bin, a: Operand, b: Operand) -> LR<Vec<LV>> {
        if let (Operand::Num(x, k1), Operand::Num(y, k2)) = (&a, &b) {
            let k = if *k1 == Kind::Float || *k2 == Kind::Float {
                Kind::Float
            } else {
                Kind::Int
            };
            return Ok(vec![LV::Num(op.apply(*x, *y), k)]);
        }
        Ok(vec![LV::T(self.arith_v(n, op, a, b)?)])
    }

    /// `a op b` with torch's promotion to the exported result dtype.
    pub fn arith_v(&mut self, n: &FxNode, op: Bin, a: Operand, b: Operand) -> LR<Value> {
        let want = match self.out_ty(n) {
            Ok(t) => t.dtype,
            Err(_) => self.common_dtype(&a, &b),
        };
        // Identities with scalars need no node.
        match (&a, &b, op) {
            (Operand::T(x), Operand::Num(s, _), Bin::Mul | Bin::Div) if *s == 1.0 => {
                return self.cast(n, *x, want)
            }
            (Operand::T(x), Operand::Num(s, _), Bin::Add | Bin::Sub) if *s == 0.0 => {
                return self.cast(n, *x, want)
            }
            (Operand::Num(s, _), Operand::T(x), Bin::Mul) if *s == 1.0 => {
                return self.cast(n, *x, want)
            }
            (Operand::Num(s, _), Operand::T(x), Bin::Add) if *s == 0.0 => {
                return self.cast(n, *x, want)
            }
            _ => {}
        }
        if want.is_float() {
            match (&a, &b, op) {
                (Operand::T(x), Operand::Num(s, _), Bin::Mul)
                | (Operand::Num(s, _), Operand::T(x), Bin::Mul) => {
                    let x = self.cast(n, *x, want)?;
                    return self.emit(n, Op::Scale { factor: Float(*s) }, &[x]);
                }
                (Operand::T(x), Operand::Num(s, _), Bin::Div) => {
                    let x = self.cast(n, *x, want)?;
                    return self.emit(
                        n,
                        Op::Scale {
                            factor: Float(1.0 / *s),
                        },
                        &[x],
                    );
                }
                (Operand::T(x), Operand::Num(s, _), Bin::Add)
                | (Operand::Num(s, _), Operand::T(x), Bin::Add) => {
                    let x = self.cast(n, *x, want)?;
                    return self.emit(n, Op::AddScalar { value: Float(*s) }, &[x]);
                }
                (Operand::T(x), Operand::Num(s, _), Bin::Sub) => {
                    let x = self.cast(n, *x, want)?;
                    return self.emit(n, Op::AddScalar { value: Float(-*s) }, &[x]);
                }
                _ => {}
            }
        }
        let (x, y) = (self.as_tensor(n, a, want)?, self.as_tensor(n, b, want)?);
        let op = match op {
            Bin::Add => Op::Add {},
            Bin::Sub => Op::Sub {},
            Bin::Mul => Op::Mul {},
            Bin::Div => Op::Div {},
            Bin::Max => Op::Maximum {},
            Bin::Min => Op::Minimum {},
        };
        self.emit(n, op, &[x, y])
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
}

impl Bin {
    fn apply(self, x: f64, y: f64) -> f64 {
        match self {
            Bin::Add => x + y,
            Bin::Sub => x - y,
            Bin::Mul => x * y,
            Bin::Div => x / y,
            Bin::Max => x.max(y),
            Bin::Min => x.min(y),
        }
    }
}

//! Exported nodes → Weft nodes, in program order. Each exported value gets a lowered
//! value ([`LV`]): a Weft tensor, a symbolic size, a Python scalar, a deferred error, or
//! one of the MoE routing tags of [`super::moe`]. Errors are deferred: an op Weft
//! cannot express (the `cumsum` of a mask builder, say) only fails the import if a
//! value the model's outputs need depends on it; unused mask builders and the like are
//! removed afterwards. Every node's result type is checked against the type the export
//! recorded for it.
//!
//! This file holds the lowered values, the [`Lower`] state and its helpers, the driver,
//! and [`Lower::lower_node`], which tries the op families of the sibling files in turn
//! (each answers `None` for an op not its own):
//!
//! - `lower/sizes.rs`: size arithmetic (`sym_size`, `sym_numel`, `_operator.*`);
//! - `lower/linear.rs`: `embedding`, `linear`, `mm`/`bmm`/`matmul`, `addmm`;
//! - `lower/arith.rs`: elementwise arithmetic (`add`, `mul`, `pow`, `clamp`, `exp`, ...);
//! - `lower/logic.rs`: comparisons, `and`/`or`/`not`, `where`, `masked_fill`;
//! - `lower/aliases.rs`: casts and value-preserving ops (`to`, `clone`, `dropout`, ...);
//! - `lower/reductions.rs`: `mean`, `sum`, `amax`, `any`, `softmax`, `topk`, `max.dim`;
//! - `lower/factories.rs`: `full`, `zeros`, `ones` (and `_like`), `arange`;
//! - `lower/layout.rs`: `view`, `expand`, `permute`, `transpose`, `slice`, `cat`, `split`, ...;
//! - `lower/indexing.rs`: `index`, `index_select`, `gather`, `scatter_add`, `scatter`, `one_hot`.
//!
//! Attention, rotary tables, MoE blocks, in-place copies and empty tensors have their
//! own files one level up (`attention.rs`, `moe.rs`, `scatter.rs`, ...).

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
use weft_ir::{DType, Dim, Float, Graph, HostTensor, Op, TensorType, Value};

pub(crate) type LErr = Rc<Pt2Error>;
pub(crate) type LR<T> = Result<T, LErr>;

mod aliases;
mod arith;
mod factories;
mod indexing;
mod layout;
mod linear;
mod logic;
mod reductions;
mod sizes;
#[cfg(test)]
mod tests;

/// An op family's lowering: `None` when the op is not of the family.
type Family<'a> = fn(&mut Lower<'a>, &FxNode) -> Option<LR<Vec<LV>>>;

/// The one-tensor result of a lowered node.
fn one(v: Value) -> LR<Vec<LV>> {
    Ok(vec![LV::T(v)])
}

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

    /// A graph input named as the export names it (unit tests of single lowerings).
    #[cfg(test)]
    pub fn test_input(&mut self, name: &str, ty: TensorType) {
        let v = self
            .g
            .add(
                Op::Input {
                    name: name.to_string(),
                    role: weft_ir::Role::Other,
                    ty,
                },
                &[],
            )
            .unwrap();
        self.env.insert(name.to_string(), LV::T(v));
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

    /// Lowers node `n`: each op family in turn until one takes the op, then the ops
    /// with a file of their own one level up.
    fn lower_node(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let families: [Family<'a>; 10] = [
            Self::lower_moe,
            Self::lower_size_op,
            Self::lower_linear,
            Self::lower_arith,
            Self::lower_logic,
            Self::lower_alias,
            Self::lower_reduction,
            Self::lower_factory,
            Self::lower_layout,
            Self::lower_index,
        ];
        for family in families {
            if let Some(r) = family(self, n) {
                return r;
            }
        }
        match n.op.as_str() {
            "aten.scaled_dot_product_attention.default" => self.lower_sdpa(n),
            "aten.cos.default" | "aten.sin.default" => self.lower_rope_table(n),
            "aten.copy.default" => self.lower_copy(n),
            "aten.slice_scatter.default" => self.lower_slice_scatter(n),
            "aten.empty.memory_format"
            | "aten.empty_like.default"
            | "aten.empty_permuted.default" => self.lower_empty(n),
            "transformers.grouped_mm_fallback.default" => Err(self.unsupported(
                n,
                "a grouped matmul outside a recognised MoE block: its offsets must be cumsum(histc(sort(flat expert ids))), the ids sorted ascending and counted one histc bin per expert (bins=E, min=0, max=E-1)",
            )),
            "_operator.getitem.default" => {
                Err(self.unsupported(n, "getitem on a value the importer does not split"))
            }
            _ => Err(self.unsupported(n, "this op has no Weft lowering")),
        }
    }

    pub fn common_dtype(&self, a: &Operand, b: &Operand) -> DType {
        match (a, b) {
            (Operand::T(x), Operand::T(y)) => {
                let (tx, ty) = (self.g.ty(*x), self.g.ty(*y));
                let (dx, dy) = (tx.dtype, ty.dtype);
                // torch's promotion: a 0-dim tensor beside a dimensioned one of the same
                // category (bool, integer, float) takes the dimensioned one's dtype
                // (`x_bf16 < torch.tensor(0.1)` compares in bf16).
                let category = |d: DType| (d != DType::Bool) as u8 + d.is_float() as u8;
                match (tx.shape.is_empty(), ty.shape.is_empty()) {
                    (true, false) if category(dx) <= category(dy) => return dy,
                    (false, true) if category(dy) <= category(dx) => return dx,
                    _ => {}
                }
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
            // Python true division of two numbers is a float, ints included.
            let k = if *k1 == Kind::Float || *k2 == Kind::Float || op == Bin::Div {
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
        if want == DType::Bool {
            // torch's bool arithmetic is logic: `a + b` and `max` are `or`, `a * b` and
            // `min` are `and` (`True + True` is True, not 2).
            let is_or = match op {
                Bin::Add | Bin::Max => true,
                Bin::Mul | Bin::Min => false,
                Bin::Sub | Bin::Div => {
                    return Err(self.unsupported(n, "subtraction or division of bool tensors"))
                }
            };
            let c = self.full(n, is_or as i64 as f64, TensorType::scalar(DType::Bool))?;
            return if is_or {
                self.emit(n, Op::Where {}, &[x, c, y])
            } else {
                self.emit(n, Op::Where {}, &[x, y, c])
            };
        }
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

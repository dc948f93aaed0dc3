//! A small interpreter for the parts of an exported graph that depend only on sizes and
//! buffers: causal masks (built from `arange`, `le`, `cumsum`, `index` ...) and rotary
//! cos/sin tables (from the `inv_freq` buffer). The importer evaluates such a value at a
//! few sequence lengths and compares the result with what a Weft op computes
//! (`attention {causal}`, `rope_table`), so recognition does not depend on how a given
//! transformers version happens to spell the computation.
//!
//! This file holds the value types, the broadcasting helpers, and [`Eval`] with its
//! argument readers and the dispatcher `Eval::node`, which tries each op family of a
//! sibling file in turn:
//!
//! - `consteval/sizes.rs`: `sym_size` and the `_operator.*` integer ops;
//! - `consteval/arith.rs`: `add`, `sub`, `mul`, `div`, `pow`, `neg`, `cos`, `sin`, ...;
//! - `consteval/logic.rs`: comparisons, `and`/`or`/`not`, `where`, `masked_fill`;
//! - `consteval/factories.rs`: `arange`, `full`, `zeros`, `ones`, `empty` (and `_like`);
//! - `consteval/casts.rs`: `to`, `type_as`, and `clone`-like identities;
//! - `consteval/layout.rs`: `view`, `unsqueeze`, `squeeze`, `expand`, `permute`, ...;
//! - `consteval/indexing.rs`: `slice`, `select`, `cat`, `index`;
//! - `consteval/reductions.rs`: `cumsum`, `diff`, `any`;
//! - `consteval/linear.rs`: `matmul`, `bmm`, `mm`.

use super::fx::{FxGraph, FxNode};
use super::schema::{Arg, ScalarType, SymArg, SymInt};
use super::sympy;
use std::collections::BTreeMap;
use weft_ir::HostTensor;

mod arith;
mod casts;
mod factories;
mod indexing;
mod layout;
mod linear;
mod logic;
mod reductions;
mod sizes;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Float,
    Int,
    Bool,
}

/// A dense row-major tensor, values held as f64.
#[derive(Clone, Debug, PartialEq)]
pub struct CT {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
    pub kind: Kind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum CV {
    T(CT),
    Num(f64, Kind),
    None,
}

type R<T> = Result<T, String>;

/// Element count above which evaluation gives up (a mask at probe sizes is tiny).
const MAX_ELEMS: usize = 1 << 22;

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

fn strides(s: &[usize]) -> Vec<usize> {
    let mut st = vec![1; s.len()];
    for i in (0..s.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * s[i + 1];
    }
    st
}

fn kind_of_code(code: i64) -> R<Kind> {
    match ScalarType::dtype(code) {
        Some(d) if d.is_float() => Ok(Kind::Float),
        Some(weft_ir::DType::Bool) => Ok(Kind::Bool),
        Some(_) => Ok(Kind::Int),
        None => Err(format!("dtype {}", ScalarType::name(code))),
    }
}

fn cast(x: f64, k: Kind) -> f64 {
    match k {
        Kind::Float => x,
        Kind::Int => x.trunc(),
        Kind::Bool => (x != 0.0) as i64 as f64,
    }
}

fn promote(a: Kind, b: Kind) -> Kind {
    match (a, b) {
        (Kind::Float, _) | (_, Kind::Float) => Kind::Float,
        (Kind::Int, _) | (_, Kind::Int) => Kind::Int,
        _ => Kind::Bool,
    }
}

impl CT {
    fn scalar(v: f64, kind: Kind) -> CT {
        CT {
            shape: vec![],
            data: vec![v],
            kind,
        }
    }

    fn get(&self, idx: &[usize]) -> f64 {
        let st = strides(&self.shape);
        let mut off = 0;
        let r = self.shape.len();
        let skip = idx.len() - r;
        for i in 0..r {
            let k = if self.shape[i] == 1 { 0 } else { idx[skip + i] };
            off += k * st[i];
        }
        self.data[off]
    }

    fn map(&self, k: Kind, f: impl Fn(f64) -> f64) -> CT {
        CT {
            shape: self.shape.clone(),
            data: self.data.iter().map(|&x| cast(f(x), k)).collect(),
            kind: k,
        }
    }
}

fn bshape(a: &[usize], b: &[usize]) -> R<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(format!("shapes {a:?} and {b:?} do not broadcast"));
        };
    }
    Ok(out)
}

fn for_each_index(shape: &[usize], mut f: impl FnMut(&[usize])) {
    let n = numel(shape);
    let mut idx = vec![0; shape.len()];
    for _ in 0..n {
        f(&idx);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

fn binary(a: &CT, b: &CT, k: Kind, f: impl Fn(f64, f64) -> f64) -> R<CT> {
    let shape = bshape(&a.shape, &b.shape)?;
    if numel(&shape) > MAX_ELEMS {
        return Err("too large".into());
    }
    let mut data = Vec::with_capacity(numel(&shape));
    for_each_index(&shape, |i| data.push(cast(f(a.get(i), b.get(i)), k)));
    Ok(CT {
        shape,
        data,
        kind: k,
    })
}

fn norm(d: i64, r: usize) -> R<usize> {
    let v = if d < 0 { d + r as i64 } else { d };
    if v < 0 || v as usize >= r.max(1) {
        return Err(format!("dim {d} out of range for rank {r}"));
    }
    Ok(v as usize)
}

pub struct Eval<'a> {
    fx: &'a FxGraph,
    /// Export symbol → value (`s70` → 7).
    syms: BTreeMap<String, i64>,
    /// Placeholder name → tensor (buffers and constants).
    consts: &'a BTreeMap<String, HostTensor>,
    memo: BTreeMap<String, CV>,
    depth: usize,
}

impl<'a> Eval<'a> {
    pub fn new(
        fx: &'a FxGraph,
        syms: BTreeMap<String, i64>,
        consts: &'a BTreeMap<String, HostTensor>,
    ) -> Self {
        Eval {
            fx,
            syms,
            consts,
            memo: BTreeMap::new(),
            depth: 0,
        }
    }

    fn sym_expr(&self, e: &str) -> R<i64> {
        let ex = sympy::parse(e)?;
        let map: BTreeMap<String, weft_ir::Dim> = self
            .syms
            .iter()
            .map(|(k, v)| (k.clone(), weft_ir::Dim::from(*v)))
            .collect();
        ex.to_dim(&map)?
            .as_const()
            .ok_or_else(|| format!("`{e}` did not evaluate"))
    }

    fn int_arg(&mut self, a: &Arg) -> R<i64> {
        match a {
            Arg::Int(i) => Ok(*i),
            Arg::SymInt(SymArg::Int(i)) => Ok(*i),
            Arg::SymInt(SymArg::Name(n)) => match self.value(n)? {
                CV::Num(v, _) => Ok(v as i64),
                _ => Err(format!("`{n}` is not an int")),
            },
            Arg::Float(f) => Ok(*f as i64),
            Arg::Bool(b) => Ok(*b as i64),
            _ => Err(format!("expected an int, found {a:?}")),
        }
    }

    fn ints_arg(&mut self, a: &Arg) -> R<Vec<i64>> {
        match a {
            Arg::Ints(v) => Ok(v.clone()),
            Arg::SymInts(v) => v
                .iter()
                .map(|s| match s {
                    SymArg::Int(i) => Ok(*i),
                    SymArg::Name(n) => self.int_arg(&Arg::SymInt(SymArg::Name(n.clone()))),
                })
                .collect(),
            Arg::Int(i) => Ok(vec![*i]),
            _ => Err(format!("expected ints, found {a:?}")),
        }
    }

    fn scalar_arg(&mut self, a: &Arg) -> R<CV> {
        Ok(match a {
            Arg::Int(i) => CV::Num(*i as f64, Kind::Int),
            Arg::Float(f) => CV::Num(*f, Kind::Float),
            Arg::Bool(b) => CV::Num(*b as i64 as f64, Kind::Bool),
            Arg::SymInt(_) => CV::Num(self.int_arg(a)? as f64, Kind::Int),
            Arg::Tensor(n) => self.value(n)?,
            Arg::None => CV::None,
            _ => return Err(format!("unexpected argument {a:?}")),
        })
    }

    fn tensor_arg(&mut self, a: &Arg) -> R<CT> {
        match self.scalar_arg(a)? {
            CV::T(t) => Ok(t),
            CV::Num(v, k) => Ok(CT::scalar(v, k)),
            CV::None => Err("expected a tensor, found None".into()),
        }
    }

    /// The value named `name` (a node output or placeholder).
    pub fn value(&mut self, name: &str) -> R<CV> {
        if let Some(v) = self.memo.get(name) {
            return Ok(v.clone());
        }
        self.depth += 1;
        if self.depth > 400 {
            return Err("graph too deep".into());
        }
        let r = self.compute(name);
        self.depth -= 1;
        let v = r?;
        self.memo.insert(name.to_string(), v.clone());
        Ok(v)
    }

    fn compute(&mut self, name: &str) -> R<CV> {
        if let Some(t) = self.consts.get(name) {
            let kind = if t.dtype.is_float() {
                Kind::Float
            } else if t.dtype == weft_ir::DType::Bool {
                Kind::Bool
            } else {
                Kind::Int
            };
            return Ok(CV::T(CT {
                shape: t.shape.clone(),
                data: t.to_f64(),
                kind,
            }));
        }
        let Some(&ni) = self.fx.producer.get(name) else {
            if let Some(SymInt::Expr { expr, .. }) = self.fx.sym_values.get(name) {
                return Ok(CV::Num(self.sym_expr(expr)? as f64, Kind::Int));
            }
            return Err(format!("`{name}` depends on a model input"));
        };
        let n = &self.fx.nodes[ni];
        let outs = self.node(ni)?;
        let pos = n
            .outputs
            .iter()
            .position(|o| o.as_deref() == Some(name))
            .unwrap_or(0);
        for (o, v) in n.outputs.iter().zip(outs.iter()) {
            if let Some(o) = o {
                self.memo.insert(o.clone(), v.clone());
            }
        }
        outs.into_iter()
            .nth(pos)
            .ok_or_else(|| format!("`{name}` has no value"))
    }

    /// Evaluates node `ni`: each op family in turn, until one takes the op.
    fn node(&mut self, ni: usize) -> R<Vec<CV>> {
        let n = self.fx.nodes[ni].clone();
        let families: [Family<'a>; 9] = [
            Self::eval_size_op,
            Self::eval_arith,
            Self::eval_logic,
            Self::eval_factory,
            Self::eval_cast,
            Self::eval_layout,
            Self::eval_indexing,
            Self::eval_reduction,
            Self::eval_linear,
        ];
        for family in families {
            if let Some(r) = family(self, &n) {
                return r;
            }
        }
        match n.op.as_str() {
            "_operator.getitem.default" => Err("getitem".into()),
            op => Err(format!("`{op}` is not evaluated")),
        }
    }

    /// Argument `i` of `n` as a tensor (a number becomes a 0-d tensor).
    fn tensor_at(&mut self, n: &FxNode, i: usize) -> R<CT> {
        self.tensor_arg(n.arg_at(i))
    }
}

/// An op family's evaluator: `None` when the op is not of the family.
type Family<'a> = fn(&mut Eval<'a>, &FxNode) -> Option<R<Vec<CV>>>;

/// The one-tensor result of a node, refused above [`MAX_ELEMS`] elements.
fn one(ct: CT) -> R<Vec<CV>> {
    if numel(&ct.shape) > MAX_ELEMS {
        return Err("too large".into());
    }
    Ok(vec![CV::T(ct)])
}

/// The kind named by `n`'s `dtype` keyword argument, else `dflt`.
fn named_dtype(n: &FxNode, dflt: Kind) -> R<Kind> {
    match n.arg("dtype") {
        Arg::ScalarType(c) => kind_of_code(*c),
        _ => Ok(dflt),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_get_and_binary() {
        let a = CT {
            shape: vec![2, 1],
            data: vec![1., 2.],
            kind: Kind::Int,
        };
        let b = CT {
            shape: vec![3],
            data: vec![10., 20., 30.],
            kind: Kind::Int,
        };
        let c = binary(&a, &b, Kind::Int, |p, q| p + q).unwrap();
        assert_eq!(c.shape, vec![2, 3]);
        assert_eq!(c.data, vec![11., 21., 31., 12., 22., 32.]);
        assert!(binary(
            &CT {
                shape: vec![2],
                data: vec![0.; 2],
                kind: Kind::Int
            },
            &b,
            Kind::Int,
            |p, _| p
        )
        .is_err());
    }

    /// An evaluator over an empty graph whose only named value is the int64
    /// placeholder `x` = `[[0, 1, 2], [3, 4, 5]]`.
    fn with_x(f: impl FnOnce(&mut Eval)) {
        let fx = FxGraph::default();
        let consts = BTreeMap::from([(
            "x".to_string(),
            HostTensor::ints(weft_ir::DType::I64, vec![2, 3], (0..6).collect()),
        )]);
        f(&mut Eval::new(&fx, BTreeMap::new(), &consts));
    }

    fn tensor(r: Option<R<Vec<CV>>>) -> CT {
        match r
            .expect("the family takes the op")
            .expect("evaluates")
            .as_slice()
        {
            [CV::T(t)] => t.clone(),
            other => panic!("not one tensor: {other:?}"),
        }
    }

    #[test]
    fn each_family_refuses_ops_of_another() {
        with_x(|ev| {
            let add = FxNode::for_test("aten.add.Tensor", "y", vec![Arg::Int(1), Arg::Int(2)]);
            assert!(ev.eval_size_op(&add).is_none());
            assert!(ev.eval_logic(&add).is_none());
            assert!(ev.eval_factory(&add).is_none());
            assert!(ev.eval_layout(&add).is_none());
            assert!(ev.eval_arith(&add).is_some());
        });
    }

    #[test]
    fn size_ops_use_python_floor_division() {
        with_x(|ev| {
            let div = |a, b| {
                FxNode::for_test(
                    "_operator.floordiv.default",
                    "q",
                    vec![Arg::Int(a), Arg::Int(b)],
                )
            };
            assert_eq!(
                ev.eval_size_op(&div(-7, 2)).unwrap(),
                Ok(vec![CV::Num(-4.0, Kind::Int)])
            );
            // Python rounds toward -inf for a negative divisor too.
            assert_eq!(
                ev.eval_size_op(&div(7, -2)).unwrap(),
                Ok(vec![CV::Num(-4.0, Kind::Int)])
            );
            assert_eq!(
                ev.eval_size_op(&div(-8, -2)).unwrap(),
                Ok(vec![CV::Num(4.0, Kind::Int)])
            );
            assert_eq!(
                ev.eval_size_op(&div(7, 0)).unwrap(),
                Err("division by zero".to_string())
            );
        });
    }

    #[test]
    fn arange_and_comparison_build_a_mask_row() {
        with_x(|ev| {
            let r = FxNode::for_test("aten.arange.start", "r", vec![Arg::Int(2), Arg::Int(5)]);
            let r = tensor(ev.eval_factory(&r));
            assert_eq!(
                (r.shape, r.data, r.kind),
                (vec![3], vec![2., 3., 4.], Kind::Int)
            );
            let le = FxNode::for_test(
                "aten.le.Scalar",
                "m",
                vec![Arg::Tensor("x".into()), Arg::Int(3)],
            );
            let m = tensor(ev.eval_logic(&le));
            assert_eq!(m.kind, Kind::Bool);
            assert_eq!(m.data, vec![1., 1., 1., 1., 0., 0.]);
        });
    }

    #[test]
    fn layout_and_indexing_move_values() {
        with_x(|ev| {
            let t = FxNode::for_test("aten.t.default", "xt", vec![Arg::Tensor("x".into())]);
            let xt = tensor(ev.eval_layout(&t));
            assert_eq!(xt.shape, vec![3, 2]);
            assert_eq!(xt.data, vec![0., 3., 1., 4., 2., 5.]);
            let slice = FxNode::for_test(
                "aten.slice.Tensor",
                "s",
                vec![
                    Arg::Tensor("x".into()),
                    Arg::Int(1),
                    Arg::Int(-2),
                    Arg::None,
                    Arg::Int(1),
                ],
            );
            let s = tensor(ev.eval_indexing(&slice));
            assert_eq!((s.shape, s.data), (vec![2, 2], vec![1., 2., 4., 5.]));
        });
    }

    #[test]
    fn cumsum_scans_along_its_dim() {
        with_x(|ev| {
            let c = FxNode::for_test(
                "aten.cumsum.default",
                "c",
                vec![Arg::Tensor("x".into()), Arg::Int(-1)],
            );
            let c = tensor(ev.eval_reduction(&c));
            assert_eq!(c.data, vec![0., 1., 3., 3., 7., 12.]);
        });
    }
}

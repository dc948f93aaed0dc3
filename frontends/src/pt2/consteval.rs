//! A small interpreter for the parts of an exported graph that depend only on sizes and
//! buffers: causal masks (built from `arange`, `le`, `cumsum`, `index` ...) and rotary
//! cos/sin tables (from the `inv_freq` buffer). The importer evaluates such a value at a
//! few sequence lengths and compares the result with what a Weft op computes
//! (`attention {causal}`, `rope_table`), so recognition does not depend on how a given
//! transformers version happens to spell the computation.

use super::fx::FxGraph;
use super::schema::{Arg, ScalarType, SymArg, SymInt};
use super::sympy;
use std::collections::BTreeMap;
use weft_ir::HostTensor;

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

    fn node(&mut self, ni: usize) -> R<Vec<CV>> {
        let n = self.fx.nodes[ni].clone();
        let a = |i: usize| n.arg_at(i).clone();
        let t = |s: &mut Self, i: usize| s.tensor_arg(&n.arg_at(i).clone());
        let one = |ct: CT| -> R<Vec<CV>> {
            if numel(&ct.shape) > MAX_ELEMS {
                return Err("too large".into());
            }
            Ok(vec![CV::T(ct)])
        };
        let dtype_kind = |s: &Self, i: usize, dflt: Kind| -> R<Kind> {
            let _ = s;
            match n.arg_at(i) {
                Arg::ScalarType(c) => kind_of_code(*c),
                _ => Ok(dflt),
            }
        };
        let named_dtype = |dflt: Kind| -> R<Kind> {
            match n.arg("dtype") {
                Arg::ScalarType(c) => kind_of_code(*c),
                _ => Ok(dflt),
            }
        };
        let _ = dtype_kind;
        match n.op.as_str() {
            "aten.sym_size.int" => {
                let Arg::Tensor(x) = a(0) else {
                    return Err("sym_size of a non-tensor".into());
                };
                let d = self.int_arg(&a(1))?;
                let meta = self.fx.tensor_meta.get(&x).ok_or("no meta")?.clone();
                let d = norm(d, meta.sizes.len())?;
                let v = match &meta.sizes[d] {
                    SymInt::Int(i) => *i,
                    SymInt::Expr { expr, .. } => self.sym_expr(expr)?,
                };
                Ok(vec![CV::Num(v as f64, Kind::Int)])
            }
            "_operator.add.default"
            | "_operator.sub.default"
            | "_operator.mul.default"
            | "_operator.floordiv.default" => {
                let (x, y) = (self.int_arg(&a(0))?, self.int_arg(&a(1))?);
                let v = match n.base() {
                    "add" => x + y,
                    "sub" => x - y,
                    "mul" => x * y,
                    _ if y != 0 => x.div_euclid(y),
                    _ => return Err("division by zero".into()),
                };
                Ok(vec![CV::Num(v as f64, Kind::Int)])
            }
            "_operator.neg.default" => Ok(vec![CV::Num(-(self.int_arg(&a(0))? as f64), Kind::Int)]),
            "aten.arange.default" | "aten.arange.start" | "aten.arange.start_step" => {
                let (s, e, st) = match n.op.as_str() {
                    "aten.arange.default" => (
                        CV::Num(0.0, Kind::Int),
                        self.scalar_arg(&a(0))?,
                        CV::Num(1.0, Kind::Int),
                    ),
                    "aten.arange.start" => (
                        self.scalar_arg(&a(0))?,
                        self.scalar_arg(&a(1))?,
                        CV::Num(1.0, Kind::Int),
                    ),
                    _ => (
                        self.scalar_arg(&a(0))?,
                        self.scalar_arg(&a(1))?,
                        self.scalar_arg(&a(2))?,
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
                let k = named_dtype(dflt)?;
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
            "aten.add.Tensor" | "aten.add.Scalar" | "aten.sub.Tensor" | "aten.sub.Scalar"
            | "aten.rsub.Scalar" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                let alpha = match a(2) {
                    Arg::Int(i) => i as f64,
                    Arg::Float(f) => f,
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
            "aten.mul.Tensor" | "aten.mul.Scalar" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                one(binary(&x, &y, promote(x.kind, y.kind), |p, q| p * q)?)
            }
            "aten.div.Tensor" | "aten.div.Scalar" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                one(binary(&x, &y, Kind::Float, |p, q| p / q)?)
            }
            "aten.pow.Tensor_Scalar" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                one(binary(&x, &y, promote(x.kind, y.kind), f64::powf)?)
            }
            "aten.neg.default" => {
                let x = t(self, 0)?;
                one(x.map(x.kind, |v| -v))
            }
            "aten.cos.default" | "aten.sin.default" | "aten.exp.default" | "aten.rsqrt.default"
            | "aten.sqrt.default" => {
                let x = t(self, 0)?;
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
            "aten.eq.Tensor" | "aten.eq.Scalar" | "aten.ne.Tensor" | "aten.ne.Scalar"
            | "aten.lt.Tensor" | "aten.lt.Scalar" | "aten.le.Tensor" | "aten.le.Scalar"
            | "aten.gt.Tensor" | "aten.gt.Scalar" | "aten.ge.Tensor" | "aten.ge.Scalar" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                let f: fn(f64, f64) -> bool = match n.base() {
                    "eq" => |p, q| p == q,
                    "ne" => |p, q| p != q,
                    "lt" => |p, q| p < q,
                    "le" => |p, q| p <= q,
                    "gt" => |p, q| p > q,
                    _ => |p, q| p >= q,
                };
                one(binary(&x, &y, Kind::Bool, |p, q| f(p, q) as i64 as f64)?)
            }
            "aten.__and__.Tensor" | "aten.bitwise_and.Tensor" | "aten.logical_and.default" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                one(binary(&x, &y, Kind::Bool, |p, q| {
                    ((p != 0.0) && (q != 0.0)) as i64 as f64
                })?)
            }
            "aten.__or__.Tensor" | "aten.bitwise_or.Tensor" | "aten.logical_or.default" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                one(binary(&x, &y, Kind::Bool, |p, q| {
                    ((p != 0.0) || (q != 0.0)) as i64 as f64
                })?)
            }
            "aten.logical_not.default" | "aten.bitwise_not.default" => {
                let x = t(self, 0)?;
                one(x.map(Kind::Bool, |v| (v == 0.0) as i64 as f64))
            }
            "aten.where.self" | "aten.where.ScalarOther" | "aten.where.ScalarSelf" => {
                let (c, x, y) = (t(self, 0)?, t(self, 1)?, t(self, 2)?);
                let k = promote(x.kind, y.kind);
                let s = bshape(&bshape(&c.shape, &x.shape)?, &y.shape)?;
                let mut data = Vec::new();
                for_each_index(&s, |i| {
                    data.push(cast(if c.get(i) != 0.0 { x.get(i) } else { y.get(i) }, k))
                });
                one(CT {
                    shape: s,
                    data,
                    kind: k,
                })
            }
            "aten.masked_fill.Scalar" | "aten.masked_fill.Tensor" => {
                let (x, m, v) = (t(self, 0)?, t(self, 1)?, t(self, 2)?);
                let s = bshape(&x.shape, &m.shape)?;
                let mut data = Vec::new();
                for_each_index(&s, |i| {
                    data.push(cast(
                        if m.get(i) != 0.0 { v.get(i) } else { x.get(i) },
                        x.kind,
                    ))
                });
                one(CT {
                    shape: s,
                    data,
                    kind: x.kind,
                })
            }
            "aten.full.default"
            | "aten.zeros.default"
            | "aten.ones.default"
            | "aten.new_ones.default"
            | "aten.new_zeros.default"
            | "aten.empty.memory_format"
            | "aten.empty_permuted.default" => {
                let (size_i, fill) = match n.base() {
                    "full" => (0, self.scalar_arg(&a(1))?),
                    "zeros" | "empty" | "empty_permuted" => (0, CV::Num(0.0, Kind::Float)),
                    "ones" => (0, CV::Num(1.0, Kind::Float)),
                    "new_ones" => (1, CV::Num(1.0, Kind::Float)),
                    _ => (1, CV::Num(0.0, Kind::Float)),
                };
                let shape: Vec<usize> = self
                    .ints_arg(&a(size_i))?
                    .into_iter()
                    .map(|x| x.max(0) as usize)
                    .collect();
                let (v, fk) = match fill {
                    CV::Num(v, k) => (v, k),
                    _ => return Err("fill value is not a number".into()),
                };
                let dflt = if n.base().starts_with("new_") {
                    t(self, 0)?.kind
                } else if n.base() == "full" {
                    fk
                } else {
                    Kind::Float
                };
                let k = named_dtype(dflt)?;
                if numel(&shape) > MAX_ELEMS {
                    return Err("too large".into());
                }
                one(CT {
                    data: vec![cast(v, k); numel(&shape)],
                    shape,
                    kind: k,
                })
            }
            "aten.full_like.default"
            | "aten.zeros_like.default"
            | "aten.ones_like.default"
            | "aten.empty_like.default" => {
                let x = t(self, 0)?;
                let v = match n.base() {
                    "full_like" => match self.scalar_arg(&a(1))? {
                        CV::Num(v, _) => v,
                        _ => return Err("fill value".into()),
                    },
                    "ones_like" => 1.0,
                    _ => 0.0,
                };
                let k = named_dtype(x.kind)?;
                one(CT {
                    data: vec![cast(v, k); numel(&x.shape)],
                    shape: x.shape,
                    kind: k,
                })
            }
            "aten.scalar_tensor.default" => {
                let (v, fk) = match self.scalar_arg(&a(0))? {
                    CV::Num(v, k) => (v, k),
                    _ => return Err("scalar".into()),
                };
                let k = named_dtype(if fk == Kind::Bool {
                    Kind::Bool
                } else {
                    Kind::Float
                })?;
                one(CT::scalar(cast(v, k), k))
            }
            "aten.to.dtype"
            | "aten.to.dtype_layout"
            | "aten.to.device"
            | "aten._to_copy.default"
            | "aten.type_as.default" => {
                let x = t(self, 0)?;
                let k = match n.op.as_str() {
                    "aten.to.dtype" => match a(1) {
                        Arg::ScalarType(c) => kind_of_code(c)?,
                        _ => x.kind,
                    },
                    "aten.to.device" => match a(2) {
                        Arg::ScalarType(c) => kind_of_code(c)?,
                        _ => x.kind,
                    },
                    "aten.type_as.default" => t(self, 1)?.kind,
                    _ => named_dtype(x.kind)?,
                };
                let f32 = k == Kind::Float;
                one(x.map(k, |v| if f32 { v as f32 as f64 } else { v }))
            }
            "aten.clone.default"
            | "aten.alias.default"
            | "aten.contiguous.default"
            | "aten.detach.default"
            | "aten.lift_fresh_copy.default"
            | "aten.copy.default" => {
                let i = if n.base() == "copy" { 1 } else { 0 };
                one(t(self, i)?)
            }
            "aten.view.default" | "aten.reshape.default" | "aten._unsafe_view.default" => {
                let x = t(self, 0)?;
                let want = self.ints_arg(&a(1))?;
                let known: i64 = want.iter().filter(|&&d| d >= 0).product();
                let total = numel(&x.shape) as i64;
                let shape: Vec<usize> = want
                    .iter()
                    .map(|&d| {
                        if d < 0 {
                            (if known == 0 { 0 } else { total / known }) as usize
                        } else {
                            d as usize
                        }
                    })
                    .collect();
                if numel(&shape) != numel(&x.shape) {
                    return Err(format!("view {:?} -> {shape:?}", x.shape));
                }
                one(CT { shape, ..x })
            }
            "aten.unsqueeze.default" => {
                let mut x = t(self, 0)?;
                let d = self.int_arg(&a(1))?;
                let d = norm(d, x.shape.len() + 1)?;
                x.shape.insert(d, 1);
                one(x)
            }
            "aten.squeeze.dim" | "aten.squeeze.dims" | "aten.squeeze.default" => {
                let mut x = t(self, 0)?;
                let r = x.shape.len();
                let dims: Vec<usize> = match n.op.as_str() {
                    "aten.squeeze.default" => (0..r).collect(),
                    _ => self
                        .ints_arg(&a(1))?
                        .into_iter()
                        .map(|d| norm(d, r))
                        .collect::<R<_>>()?,
                };
                let mut keep = Vec::new();
                for (i, &s) in x.shape.iter().enumerate() {
                    if !(dims.contains(&i) && s == 1) {
                        keep.push(s);
                    }
                }
                x.shape = keep;
                one(x)
            }
            "aten.expand.default" => {
                let x = t(self, 0)?;
                let want = self.ints_arg(&a(1))?;
                if want.len() < x.shape.len() {
                    return Err("expand to fewer dims".into());
                }
                let off = want.len() - x.shape.len();
                let mut shape = Vec::with_capacity(want.len());
                for (i, &d) in want.iter().enumerate() {
                    let src = if i >= off {
                        Some(x.shape[i - off])
                    } else {
                        None
                    };
                    let v = match (d < 0, src) {
                        (true, Some(s)) => s,
                        (true, None) => return Err("expand with -1 in a new dim".into()),
                        (false, _) => d as usize,
                    };
                    if let Some(s) = src {
                        if s != 1 && s != v {
                            return Err(format!("cannot expand {s} to {v}"));
                        }
                    }
                    shape.push(v);
                }
                let mut data = Vec::new();
                if numel(&shape) > MAX_ELEMS {
                    return Err("too large".into());
                }
                for_each_index(&shape, |i| data.push(x.get(i)));
                one(CT {
                    shape,
                    data,
                    kind: x.kind,
                })
            }
            "aten.slice.Tensor" => {
                let x = t(self, 0)?;
                let r = x.shape.len();
                let d = norm(self.int_arg(&a(1))?, r)?;
                let len = x.shape[d] as i64;
                let fix = |v: i64| -> i64 {
                    let v = if v < 0 { v + len } else { v };
                    v.clamp(0, len)
                };
                let s = match a(2) {
                    Arg::None => 0,
                    ref o => fix(self.int_arg(o)?),
                };
                let e = match a(3) {
                    Arg::None => len,
                    ref o => fix(self.int_arg(o)?),
                };
                let step = self.int_arg(&a(4))?.max(1);
                let picks: Vec<usize> = (s..e.max(s))
                    .step_by(step as usize)
                    .map(|v| v as usize)
                    .collect();
                one(take(&x, d, &picks))
            }
            "aten.select.int" => {
                let x = t(self, 0)?;
                let d = norm(self.int_arg(&a(1))?, x.shape.len())?;
                let mut i = self.int_arg(&a(2))?;
                if i < 0 {
                    i += x.shape[d] as i64;
                }
                if i < 0 || i as usize >= x.shape[d] {
                    return Err("select index out of range".into());
                }
                let mut r = take(&x, d, &[i.max(0) as usize]);
                r.shape.remove(d);
                one(r)
            }
            "aten.transpose.int" | "aten.permute.default" | "aten.t.default" => {
                let x = t(self, 0)?;
                let r = x.shape.len();
                let perm: Vec<usize> = match n.base() {
                    "permute" => self
                        .ints_arg(&a(1))?
                        .into_iter()
                        .map(|d| norm(d, r))
                        .collect::<R<_>>()?,
                    _ => {
                        let (d0, d1) = if n.base() == "t" {
                            (0, 1)
                        } else {
                            (
                                norm(self.int_arg(&a(1))?, r)?,
                                norm(self.int_arg(&a(2))?, r)?,
                            )
                        };
                        let mut p: Vec<usize> = (0..r).collect();
                        p.swap(d0, d1);
                        p
                    }
                };
                let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
                let st = strides(&x.shape);
                let mut data = Vec::new();
                for_each_index(&shape, |i| {
                    let off: usize = i.iter().zip(&perm).map(|(&k, &p)| k * st[p]).sum();
                    data.push(x.data[off]);
                });
                one(CT {
                    shape,
                    data,
                    kind: x.kind,
                })
            }
            "aten.cat.default" => {
                let Arg::Tensors(names) = a(0) else {
                    return Err("cat of a non-list".into());
                };
                let parts: Vec<CT> = names
                    .iter()
                    .map(|nm| self.tensor_arg(&Arg::Tensor(nm.clone())))
                    .collect::<R<_>>()?;
                let parts: Vec<CT> = parts
                    .into_iter()
                    .filter(|p| !(p.shape.len() == 1 && p.shape[0] == 0))
                    .collect();
                let first = parts.first().ok_or("empty cat")?.clone();
                let d = norm(self.int_arg(&a(1))?, first.shape.len())?;
                check_cat(&parts, d)?;
                let mut shape = first.shape.clone();
                shape[d] = parts.iter().map(|p| p.shape[d]).sum();
                let mut data = Vec::new();
                let kind = parts.iter().fold(first.kind, |k, p| promote(k, p.kind));
                for_each_index(&shape, |i| {
                    let mut k = i[d];
                    for p in &parts {
                        if k < p.shape[d] {
                            let mut j = i.to_vec();
                            j[d] = k;
                            data.push(p.get(&j));
                            break;
                        }
                        k -= p.shape[d];
                    }
                });
                one(CT { shape, data, kind })
            }
            "aten.cumsum.default" => {
                let x = t(self, 0)?;
                let d = norm(self.int_arg(&a(1))?, x.shape.len())?;
                let k = named_dtype(if x.kind == Kind::Float {
                    Kind::Float
                } else {
                    Kind::Int
                })?;
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
            "aten.diff.default" => {
                let mut x = t(self, 0)?;
                if self.int_arg(&a(1))? != 1 {
                    return Err("diff with n != 1".into());
                }
                let d = norm(self.int_arg(&a(2))?, x.shape.len())?;
                let pre = match a(3) {
                    Arg::None => None,
                    ref o => Some(self.tensor_arg(o)?),
                };
                let app = match a(4) {
                    Arg::None => None,
                    ref o => Some(self.tensor_arg(o)?),
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
            "aten.index.Tensor" => {
                let x = t(self, 0)?;
                let Arg::OptionalTensors(idx) = a(1) else {
                    if let Arg::Tensors(v) = a(1) {
                        let idx: Vec<Option<String>> = v.into_iter().map(Some).collect();
                        return self.index(&x, &idx);
                    }
                    return Err("index without indices".into());
                };
                self.index(&x, &idx)
            }
            "aten.any.dim" => {
                let x = t(self, 0)?;
                let d = norm(self.int_arg(&a(1))?, x.shape.len())?;
                let keep = matches!(a(2), Arg::Bool(true));
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
            "aten.matmul.default" | "aten.bmm.default" | "aten.mm.default" => {
                let (x, y) = (t(self, 0)?, t(self, 1)?);
                if x.shape.len() < 2 || y.shape.len() < 2 {
                    return Err("matmul of vectors".into());
                }
                let (m, k) = (x.shape[x.shape.len() - 2], x.shape[x.shape.len() - 1]);
                let (k2, nn) = (y.shape[y.shape.len() - 2], y.shape[y.shape.len() - 1]);
                if k != k2 {
                    return Err("matmul shapes".into());
                }
                let batch = bshape(&x.shape[..x.shape.len() - 2], &y.shape[..y.shape.len() - 2])?;
                let mut shape = batch.clone();
                shape.extend([m, nn]);
                let mut data = Vec::new();
                for_each_index(&shape, |i| {
                    let mut acc = 0f32;
                    for kk in 0..k {
                        let mut xi = i.to_vec();
                        let r = xi.len();
                        xi[r - 1] = kk;
                        let mut yi = i.to_vec();
                        yi[r - 2] = kk;
                        acc += (x.get(&xi) as f32) * (y.get(&yi) as f32);
                    }
                    data.push(acc as f64);
                });
                one(CT {
                    shape,
                    data,
                    kind: promote(x.kind, y.kind),
                })
            }
            "_operator.getitem.default" => Err("getitem".into()),
            op => Err(format!("`{op}` is not evaluated")),
        }
    }

    fn index(&mut self, x: &CT, idx: &[Option<String>]) -> R<Vec<CV>> {
        if idx.iter().any(Option::is_none) || idx.len() > x.shape.len() {
            return Err("index with None entries".into());
        }
        let its: Vec<CT> = idx
            .iter()
            .map(|n| self.tensor_arg(&Arg::Tensor(n.clone().unwrap())))
            .collect::<R<_>>()?;
        let mut b: Vec<usize> = vec![];
        for i in &its {
            b = bshape(&b, &i.shape)?;
        }
        let k = its.len();
        let mut shape = b.clone();
        shape.extend_from_slice(&x.shape[k..]);
        if numel(&shape) > MAX_ELEMS {
            return Err("too large".into());
        }
        let mut data = Vec::new();
        let mut err = None;
        for_each_index(&shape, |i| {
            let mut j: Vec<usize> = Vec::with_capacity(x.shape.len());
            for (d, it) in its.iter().enumerate() {
                let mut v = it.get(&i[..b.len()]) as i64;
                if v < 0 {
                    v += x.shape[d] as i64;
                }
                if v < 0 || v as usize >= x.shape[d] {
                    err = Some("index out of range".to_string());
                    v = 0;
                }
                j.push(v as usize);
            }
            j.extend_from_slice(&i[b.len()..]);
            data.push(x.get(&j));
        });
        if let Some(e) = err {
            return Err(e);
        }
        Ok(vec![CV::T(CT {
            shape,
            data,
            kind: x.kind,
        })])
    }
}

fn check_cat(parts: &[CT], d: usize) -> R<()> {
    let r = parts[0].shape.len();
    for p in parts {
        if p.shape.len() != r || (0..r).any(|k| k != d && p.shape[k] != parts[0].shape[k]) {
            return Err("cat of mismatched shapes".into());
        }
    }
    Ok(())
}

fn take(x: &CT, d: usize, picks: &[usize]) -> CT {
    let mut shape = x.shape.clone();
    shape[d] = picks.len();
    let mut data = Vec::new();
    for_each_index(&shape, |i| {
        let mut j = i.to_vec();
        j[d] = picks[i[d]];
        data.push(x.get(&j));
    });
    CT {
        shape,
        data,
        kind: x.kind,
    }
}

fn concat(parts: &[CT], d: usize) -> R<CT> {
    let mut shape = parts[0].shape.clone();
    shape[d] = parts.iter().map(|p| p.shape[d]).sum();
    let mut data = Vec::new();
    for_each_index(&shape, |i| {
        let mut k = i[d];
        for p in parts {
            if k < p.shape[d] {
                let mut j = i.to_vec();
                j[d] = k;
                data.push(p.get(&j));
                break;
            }
            k -= p.shape[d];
        }
    });
    Ok(CT {
        shape,
        data,
        kind: parts.iter().fold(Kind::Bool, |k, p| promote(k, p.kind)),
    })
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
}

//! Lowerings of single exported ops, built as the export writes them (arguments
//! matched to the op's schema), with the arguments that change the math checked:
//! implemented exactly, or refused with the op and the argument named.

use super::super::error::Pt2Error;
use super::super::fx::{FxGraph, FxNode};
use super::super::schema::{Arg, SymInt, TensorMeta};
use super::{unwrap_err, Lower, LV};
use weft_ir::{DType, Dim, Graph, Op, TensorType, Value};

/// The export's ScalarType code of a dtype.
fn code(d: DType) -> i64 {
    match d {
        DType::Bool => 12,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::F16 => 6,
        DType::BF16 => 13,
        DType::F32 => 7,
        DType::F64 => 8,
    }
}

fn t(s: &str) -> Arg {
    Arg::Tensor(s.into())
}

/// `op(args)` with one output per name, as the export writes it.
fn node(op: &str, outs: &[&str], args: Vec<(&str, Arg)>) -> FxNode {
    FxNode::exported(op, outs, args).unwrap_or_else(|e| panic!("{op}: {e}"))
}

/// A positional argument.
fn p(a: Arg) -> (&'static str, Arg) {
    ("", a)
}

/// The lowering of `nodes` over the inputs `(name, dtype, shape)`, every value's
/// recorded type given in `types` (constant shapes): the lowered graph and the
/// lowered value of each name in `types`.
struct Lowered {
    g: Graph,
    vals: Vec<(String, LV)>,
}

impl Lowered {
    fn new(
        inputs: &[(&str, DType, &[i64])],
        nodes: Vec<FxNode>,
        types: &[(&str, DType, &[i64])],
    ) -> Lowered {
        let mut fx = FxGraph {
            nodes,
            ..Default::default()
        };
        for (i, n) in fx.nodes.iter().enumerate() {
            for o in n.outputs.iter().flatten() {
                fx.producer.insert(o.clone(), i);
            }
        }
        for (name, dt, shape) in inputs.iter().chain(types) {
            fx.tensor_meta.insert(
                name.to_string(),
                TensorMeta {
                    dtype: code(*dt),
                    sizes: shape.iter().map(|&s| SymInt::Int(s)).collect(),
                    strides: vec![SymInt::Int(1); shape.len()],
                    storage_offset: SymInt::Int(0),
                    requires_grad: false,
                },
            );
        }
        let mut l = Lower::for_tests(&fx, 1, 4, false);
        for (name, dt, shape) in inputs {
            l.test_input(
                name,
                TensorType::new(*dt, shape.iter().map(|&s| Dim::from(s)).collect()),
            );
        }
        l.run();
        let vals = types
            .iter()
            .map(|(n, _, _)| (n.to_string(), l.lv(n)))
            .collect();
        Lowered {
            g: std::mem::take(&mut l.g),
            vals,
        }
    }

    fn lv(&self, name: &str) -> &LV {
        &self.vals.iter().find(|(n, _)| n == name).unwrap().1
    }

    /// The lowered tensor `name` (panics on a refusal, showing it).
    fn value(&self, name: &str) -> Value {
        match self.lv(name) {
            LV::T(v) => *v,
            LV::Err(e) => panic!("`{name}` was refused: {e}"),
            other => panic!("`{name}` is {other:?}"),
        }
    }

    /// The refusal of `name` (panics if it lowered).
    fn refusal(&self, name: &str) -> Pt2Error {
        match self.lv(name) {
            LV::Err(e) => unwrap_err(e.clone()),
            other => panic!("`{name}` lowered to {other:?}, expected a refusal"),
        }
    }

    /// The op defining `v`, and its operands.
    fn def(&self, v: Value) -> (Op, Vec<Value>) {
        let n = self.g.node(self.g.def(v));
        (n.op.clone(), n.operands.clone())
    }

    /// Every op of the graph, in order, without the inputs.
    fn ops(&self) -> Vec<Op> {
        self.g
            .nodes()
            .iter()
            .map(|&n| self.g.node(n).op.clone())
            .filter(|op| !matches!(op, Op::Input { .. }))
            .collect()
    }
}

/// Asserts that `e` is a refusal of `op` in node `node` whose message has each of `parts`.
fn assert_refused(e: &Pt2Error, op: &str, node: &str, parts: &[&str]) {
    match e {
        Pt2Error::UnsupportedOp {
            op: o, node: nd, ..
        } => {
            assert_eq!((o.as_str(), nd.as_str()), (op, node), "{e}");
        }
        _ => panic!("not an unsupported-op refusal: {e}"),
    }
    let s = e.to_string();
    for part in parts {
        assert!(s.contains(part), "`{part}` missing from: {s}");
    }
}

// ---------------------------------------------------------------- attention

fn sdpa(sq: i64, sk: i64, args: Vec<(&'static str, Arg)>) -> Lowered {
    let mut a = vec![p(t("q")), p(t("k")), p(t("v"))];
    a.extend(args);
    Lowered::new(
        &[
            ("q", DType::F32, &[1, 2, sq, 8]),
            ("k", DType::F32, &[1, 2, sk, 8]),
            ("v", DType::F32, &[1, 2, sk, 8]),
        ],
        vec![node("aten.scaled_dot_product_attention.default", &["o"], a)],
        &[("o", DType::F32, &[1, 2, sq, 8])],
    )
}

#[test]
fn sdpa_is_causal_needs_as_many_queries_as_keys() {
    // torch's is_causal is top-left aligned; Weft's causal attention bottom-right.
    let l = sdpa(4, 6, vec![("is_causal", Arg::Bool(true))]);
    assert_refused(
        &l.refusal("o"),
        "aten.scaled_dot_product_attention.default",
        "o",
        &["is_causal=True with 4 queries and 6 keys", "top-left"],
    );
    // Without is_causal the lengths may differ; with equal lengths both agree.
    let l = sdpa(4, 6, vec![]);
    assert!(matches!(
        l.def(l.value("o")).0,
        Op::Attention { causal: false, .. }
    ));
    let l = sdpa(4, 4, vec![("is_causal", Arg::Bool(true))]);
    assert!(matches!(
        l.def(l.value("o")).0,
        Op::Attention { causal: true, .. }
    ));
}

#[test]
fn sdpa_reads_scale_and_refuses_dropout() {
    let l = sdpa(4, 4, vec![("scale", Arg::Float(0.5))]);
    match l.def(l.value("o")).0 {
        Op::Attention { scale, .. } => assert_eq!(scale.0, 0.5),
        op => panic!("{op:?}"),
    }
    let l = sdpa(4, 4, vec![]);
    match l.def(l.value("o")).0 {
        Op::Attention { scale, .. } => assert_eq!(scale.0, 1.0 / 8f64.sqrt()),
        op => panic!("{op:?}"),
    }
    let l = sdpa(4, 4, vec![("dropout_p", Arg::Float(0.1))]);
    assert_refused(
        &l.refusal("o"),
        "aten.scaled_dot_product_attention.default",
        "o",
        &["dropout"],
    );
}

// ---------------------------------------------------------------- reductions

#[test]
fn any_dim_tests_for_nonzero_not_for_positive() {
    // any([-1, 0]) is true: the max of the values (0) is not.
    let l = Lowered::new(
        &[("x", DType::F32, &[2, 3])],
        vec![node(
            "aten.any.dim",
            &["a"],
            vec![p(t("x")), p(Arg::Int(1))],
        )],
        &[("a", DType::Bool, &[2])],
    );
    let ops = l.ops();
    assert!(
        ops.iter().any(|op| matches!(
            op,
            Op::Compare {
                op: weft_ir::CmpOp::Ne
            }
        )),
        "{ops:?}"
    );
    let (op, args) = l.def(l.value("a"));
    assert_eq!(
        op,
        Op::Compare {
            op: weft_ir::CmpOp::Gt
        }
    );
    assert!(matches!(l.def(args[0]).0, Op::Max { .. }));
}

// ---------------------------------------------------------------- factories

#[test]
fn arange_refuses_a_fractional_start_and_a_step() {
    let l = Lowered::new(
        &[],
        vec![
            node(
                "aten.arange.start",
                &["r"],
                vec![p(Arg::Float(0.5)), p(Arg::Int(4))],
            ),
            node(
                "aten.arange.start",
                &["r2"],
                vec![p(Arg::Float(1.0)), p(Arg::Int(4))],
            ),
            node(
                "aten.arange.start_step",
                &["r3"],
                vec![p(Arg::Int(0)), p(Arg::Int(8)), p(Arg::Int(2))],
            ),
        ],
        &[
            ("r", DType::F32, &[4]),
            ("r2", DType::F32, &[3]),
            ("r3", DType::I64, &[4]),
        ],
    );
    assert_refused(
        &l.refusal("r"),
        "aten.arange.start",
        "r",
        &["fractional start 0.5"],
    );
    match l.def(l.value("r2")).0 {
        Op::Arange { start, .. } => assert_eq!(start, Dim::from(1)),
        op => panic!("{op:?}"),
    }
    assert_refused(
        &l.refusal("r3"),
        "aten.arange.start_step",
        "r3",
        &["step 2"],
    );
}

// ---------------------------------------------------------------- arithmetic

#[test]
fn true_division_of_two_ints_is_a_float() {
    let fx = FxGraph {
        nodes: vec![node(
            "aten.div.Tensor",
            &["q"],
            vec![p(Arg::Int(7)), p(Arg::Int(2))],
        )],
        ..Default::default()
    };
    let mut lw = Lower::for_tests(&fx, 1, 4, false);
    lw.run();
    assert!(
        matches!(lw.lv("q"), LV::Num(x, super::Kind::Float) if x == 3.5),
        "{:?}",
        lw.lv("q")
    );
}

// ---------------------------------------------------------------- sizes

#[test]
fn size_floor_division_rounds_toward_minus_infinity() {
    let fx = FxGraph {
        nodes: vec![
            node(
                "_operator.floordiv.default",
                &["q"],
                vec![p(Arg::Int(7)), p(Arg::Int(-2))],
            ),
            node(
                "_operator.floordiv.default",
                &["r"],
                vec![p(Arg::Int(-7)), p(Arg::Int(2))],
            ),
        ],
        ..Default::default()
    };
    let mut lw = Lower::for_tests(&fx, 1, 4, false);
    lw.run();
    for (name, want) in [("q", -4), ("r", -4)] {
        match lw.lv(name) {
            LV::Sym(d) => assert_eq!(d.as_const(), Some(want), "{name}"),
            other => panic!("{name}: {other:?}"),
        }
    }
}

// ---------------------------------------------------------------- schema

#[test]
fn scatter_value_is_matched_to_its_schema() {
    // Passed by name, `value` lands in its slot (a node off the schema would keep
    // the export's order, and the lowering reads by position).
    let n = node(
        "aten.scatter.value",
        &["s"],
        vec![
            p(t("x")),
            ("value", Arg::Float(1.0)),
            ("index", t("i")),
            ("dim", Arg::Int(-1)),
        ],
    );
    let names: Vec<&str> = n.args.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["self", "dim", "index", "value"]);
    assert_eq!(n.arg_at(3), &Arg::Float(1.0));
    assert!(FxNode::exported(
        "aten.scatter.value",
        &["s"],
        vec![p(t("x")), ("reduce", Arg::Str("add".into()))]
    )
    .is_err());
}

// ---------------------------------------------------------------- type promotion

/// A 0-dim tensor beside a dimensioned one of the same category takes its dtype, as
/// torch promotes: a bf16 tensor compared with (or scaled by) a 0-dim f32 tensor stays
/// bf16, where the wider dtype would compare other values (0.1 is not a bf16 number).
#[test]
fn a_zero_dim_tensor_takes_the_dimensioned_ones_dtype() {
    let l = Lowered::new(
        &[("x", DType::BF16, &[4]), ("c", DType::F32, &[])],
        vec![
            node("aten.lt.Tensor", &["m"], vec![p(t("x")), p(t("c"))]),
            node("aten.mul.Tensor", &["y"], vec![p(t("c")), p(t("x"))]),
        ],
        &[("m", DType::Bool, &[4]), ("y", DType::BF16, &[4])],
    );
    let (op, operands) = l.def(l.value("m"));
    assert!(matches!(op, Op::Compare { .. }), "{op:?}");
    for v in operands {
        assert_eq!(l.g.ty(v).dtype, DType::BF16);
    }
    assert_eq!(l.g.ty(l.value("y")).dtype, DType::BF16);
    // A 0-dim tensor of a higher category still promotes: int < 0-dim float is a float
    // comparison.
    let l = Lowered::new(
        &[("i", DType::I64, &[4]), ("c", DType::F32, &[])],
        vec![node("aten.lt.Tensor", &["m"], vec![p(t("i")), p(t("c"))])],
        &[("m", DType::Bool, &[4])],
    );
    let (_, operands) = l.def(l.value("m"));
    for v in operands {
        assert_eq!(l.g.ty(v).dtype, DType::F32);
    }
}

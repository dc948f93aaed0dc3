//! canonicalize: folding, CSE and DCE on small graphs.

use weft_ir::*;
use weft_passes::*;

fn f32(shape: &[i64]) -> TensorType {
    TensorType::new(DType::F32, shape.iter().map(|&d| Dim::from(d)).collect())
}

fn run(g: &mut Graph) -> (PassResult, String) {
    let before = print(g);
    let r = lookup("canonicalize")
        .unwrap()
        .run(g, &PassContext::default())
        .unwrap();
    verify(g).unwrap();
    let diff = similar::TextDiff::from_lines(&before, &print(g))
        .unified_diff()
        .context_radius(1)
        .to_string();
    (r, diff)
}

#[test]
fn folds_chains_and_identities() {
    let mut g = Graph::new("fold");
    let x = g
        .add(
            Op::Input {
                name: "x".into(),
                role: Role::Other,
                ty: f32(&[2, 3, 4]),
            },
            &[],
        )
        .unwrap();
    // reshape∘reshape -> one reshape
    let a = g
        .add(
            Op::Reshape {
                shape: vec![6.into(), 4.into()],
            },
            &[x],
        )
        .unwrap();
    let a = g
        .add(
            Op::Reshape {
                shape: vec![24.into()],
            },
            &[a],
        )
        .unwrap();
    // transpose∘transpose = identity
    let b = g.add(Op::Transpose { dim0: 0, dim1: 2 }, &[x]).unwrap();
    let b = g.add(Op::Transpose { dim0: 2, dim1: 0 }, &[b]).unwrap();
    // permute chain composes
    let c = g
        .add(
            Op::Permute {
                perm: vec![1, 2, 0],
            },
            &[x],
        )
        .unwrap();
    let c = g.add(Op::Transpose { dim0: 0, dim1: 1 }, &[c]).unwrap();
    // identities
    let d = g.add(Op::Scale { factor: Float(1.0) }, &[x]).unwrap();
    let d = g.add(Op::Cast { dtype: DType::F32 }, &[d]).unwrap();
    let d = g
        .add(
            Op::Reshape {
                shape: vec![2.into(), 3.into(), 4.into()],
            },
            &[d],
        )
        .unwrap();
    let d = g
        .add(
            Op::Slice {
                dim: 1,
                start: 0.into(),
                len: 3.into(),
            },
            &[d],
        )
        .unwrap();
    g.set_output("a", a);
    g.set_output("b", b);
    g.set_output("c", c);
    g.set_output("d", d);
    let (r, diff) = run(&mut g);
    assert!(r.changed);
    assert_eq!(g.output("b"), Some(x));
    assert_eq!(g.output("d"), Some(x));
    let cop = g.op_of(g.output("c").unwrap());
    // perm [1,2,0] then swap(0,1): out[i] = in[[1,2,0][[1,0,2][i]]] = in[[2,1,0][i]]
    assert_eq!(*cop, Op::Transpose { dim0: 0, dim1: 2 });
    insta::assert_snapshot!("fold", diff);
    // Fixpoint: a second run changes nothing.
    assert!(!run(&mut g).0.changed);
}

#[test]
fn cse_merges_equal_nodes_and_dce_keeps_the_interface() {
    let mut g = Graph::new("cse");
    let x = g
        .add(
            Op::Input {
                name: "x".into(),
                role: Role::Other,
                ty: f32(&[4]),
            },
            &[],
        )
        .unwrap();
    let unused_in = g
        .add(
            Op::Input {
                name: "unused".into(),
                role: Role::Other,
                ty: f32(&[4]),
            },
            &[],
        )
        .unwrap();
    let w = g
        .add(
            Op::Param {
                name: "w".into(),
                ty: f32(&[4]),
            },
            &[],
        )
        .unwrap();
    let _unused_param = g
        .add(
            Op::Param {
                name: "w2".into(),
                ty: f32(&[4]),
            },
            &[],
        )
        .unwrap();
    let a1 = g.add(Op::Mul {}, &[x, w]).unwrap();
    let a2 = g.add(Op::Mul {}, &[x, w]).unwrap();
    let e1 = g.add(Op::Exp {}, &[a1]).unwrap();
    let e2 = g.add(Op::Exp {}, &[a2]).unwrap();
    let s = g.add(Op::Add {}, &[e1, e2]).unwrap();
    let _dead = g.add(Op::Neg {}, &[unused_in]).unwrap();
    g.set_output("s", s);
    let (r, diff) = run(&mut g);
    assert_eq!(r.counters["cse_merged"], 2);
    assert_eq!(r.counters["dce_removed"], 1);
    assert_eq!(g.params().len(), 2, "params stay");
    assert_eq!(g.inputs().len(), 2, "inputs stay");
    let sum = g.node(g.def(g.output("s").unwrap()));
    assert_eq!(sum.operands[0], sum.operands[1]);
    insta::assert_snapshot!("cse_dce", diff);
}

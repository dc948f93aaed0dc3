//! The egg `simplify` pass: what each rule family does to a small SPMD program, and
//! that the rewritten program computes the same values on every rank.

use std::collections::BTreeMap;
use weft_ir::{DType, Dim, Graph, HostTensor, Mesh, Op, Role, TensorType};
use weft_passes::{PassContext, PassManager};
use weft_runtime::cpu::{run, Precision, RunOptions};

fn input(g: &mut Graph, name: &str, dtype: DType, shape: &[i64]) -> weft_ir::Value {
    let ty = TensorType::new(dtype, shape.iter().map(|&d| Dim::from(d)).collect());
    g.add(
        Op::Input {
            name: name.into(),
            role: Role::Other,
            ty,
        },
        &[],
    )
    .unwrap()
}

fn program() -> Graph {
    let mut g = Graph::new("simplify-cases");
    g.mesh = Mesh::parse("sp=2").unwrap();
    let sp = |g: &mut Graph, op: Op, x| g.add(op, &[x]).unwrap();
    // An all_to_all followed by its inverse.
    let x = input(&mut g, "x", DType::F32, &[2, 8, 4, 8]);
    g.set_scope(Some("case.all_to_all"));
    let a = sp(
        &mut g,
        Op::AllToAll {
            axis: "sp".into(),
            scatter_dim: 1,
            gather_dim: 2,
        },
        x,
    );
    let b = sp(
        &mut g,
        Op::AllToAll {
            axis: "sp".into(),
            scatter_dim: 2,
            gather_dim: 1,
        },
        a,
    );
    let c = sp(&mut g, Op::Silu {}, b);
    g.set_output("a2a", c);
    // This rank's block sliced back out of an all_gather.
    g.set_scope(Some("case.gather_slice"));
    let y = input(&mut g, "y", DType::F32, &[3, 8]);
    let gy = sp(
        &mut g,
        Op::AllGather {
            axis: "sp".into(),
            dim: 0,
        },
        y,
    );
    let s = sp(
        &mut g,
        Op::Slice {
            dim: 0,
            start: Dim::coord("sp") * Dim::from(3),
            len: Dim::from(3),
        },
        gy,
    );
    let e = sp(&mut g, Op::Exp {}, s);
    g.set_output("gather_slice", e);
    // A narrowing cast after an all_gather moves before it (half the bytes on the wire).
    g.set_scope(Some("case.cast"));
    let z = input(&mut g, "z", DType::F32, &[4, 16]);
    let gz = sp(
        &mut g,
        Op::AllGather {
            axis: "sp".into(),
            dim: 1,
        },
        z,
    );
    let cz = sp(&mut g, Op::Cast { dtype: DType::BF16 }, gz);
    g.set_output("cast", cz);
    // Transpose pairs and reshape chains.
    g.set_scope(Some("case.layout"));
    let w = input(&mut g, "w", DType::F32, &[4, 6]);
    let t1 = sp(&mut g, Op::Transpose { dim0: 0, dim1: 1 }, w);
    let t2 = sp(&mut g, Op::Transpose { dim0: 0, dim1: 1 }, t1);
    let r1 = sp(
        &mut g,
        Op::Reshape {
            shape: vec![Dim::from(24)],
        },
        t2,
    );
    let r2 = sp(
        &mut g,
        Op::Reshape {
            shape: vec![Dim::from(2), Dim::from(12)],
        },
        r1,
    );
    g.set_output("layout", r2);
    g
}

fn inputs() -> BTreeMap<String, HostTensor> {
    let mut m = BTreeMap::new();
    for (name, shape) in [
        ("x", vec![2, 8, 4, 8]),
        ("y", vec![3, 8]),
        ("z", vec![4, 16]),
        ("w", vec![4, 6]),
    ] {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 25.0)
            .collect();
        m.insert(
            name.to_string(),
            HostTensor::floats(DType::F32, shape, data),
        );
    }
    m
}

#[test]
fn simplify_rewrites_and_preserves_values() {
    let before = program();
    let mut after = before.clone();
    let cx = PassContext::new(before.mesh.clone());
    let report = PassManager::default()
        .run(
            &mut after,
            &cx,
            &["simplify", "canonicalize"],
            &mut std::io::sink(),
        )
        .unwrap();
    let stats = &report.passes[0];
    assert!(stats.changed);
    let ops: Vec<&str> = after
        .nodes()
        .iter()
        .map(|&n| after.node(n).op.name())
        .collect();
    assert!(!ops.contains(&"all_to_all"), "{ops:?}");
    assert!(!ops.contains(&"slice"), "{ops:?}");
    assert!(!ops.contains(&"transpose"), "{ops:?}");
    assert_eq!(ops.iter().filter(|o| **o == "reshape").count(), 1);
    // The cast now runs before the all_gather.
    let gather = after
        .nodes()
        .iter()
        .find(|&&n| matches!(after.node(n).op, Op::AllGather { dim: 1, .. }))
        .unwrap();
    assert_eq!(after.ty(after.node(*gather).operands[0]).dtype, DType::BF16);
    for rule in [
        "cancel-all-to-all",
        "gather-then-local-slice",
        "cast-across-collective",
        "transpose-involution",
        "reshape-chain",
    ] {
        assert!(
            stats
                .counters
                .get(&format!("rule.{rule}"))
                .copied()
                .unwrap_or(0)
                > 0,
            "{rule} never fired: {:?}",
            stats.counters
        );
    }
    insta::assert_snapshot!("simplify__cases__sp2", weft_ir::print(&after));

    let opts = RunOptions::new(Precision::F64);
    let (r0, r1) = (
        run(&before, &BTreeMap::new(), &inputs(), &opts).unwrap(),
        run(&after, &BTreeMap::new(), &inputs(), &opts).unwrap(),
    );
    for name in ["a2a", "gather_slice", "cast", "layout"] {
        assert_eq!(r0.outputs[name], r1.outputs[name], "{name}");
    }
}

#[test]
fn simplify_leaves_the_sp_program_alone_and_stays_correct() {
    // Ulysses' all_to_alls around attention are not inverse pairs: nothing to cancel.
    let mut g = weft_frontends::load("llama-tiny").unwrap().graph;
    let mesh = Mesh::parse("sp=2").unwrap();
    let cx = PassContext::new(mesh.clone());
    let mut pipeline = weft_passes::default_pipeline(&mesh);
    pipeline.insert(pipeline.len() - 1, "simplify");
    PassManager::default()
        .run(&mut g, &cx, &pipeline, &mut std::io::sink())
        .unwrap();
    let a2a = g
        .nodes()
        .iter()
        .filter(|&&n| matches!(g.node(n).op, Op::AllToAll { .. }))
        .count();
    assert_eq!(a2a, 8);
}

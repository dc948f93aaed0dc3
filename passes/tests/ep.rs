//! `expert-parallel`: one snapshot per (model, mesh), `expert-parallel__<model>__<mesh>`,
//! of the diff the pass makes after the passes before it in the default pipeline and
//! its counters; the whole program for one mesh; and the pass's errors and guards.

mod util;
use util::*;

use weft_ir::*;
use weft_passes::*;

const MESHES: &[(&str, &str)] = &[
    ("ep2", "ep=2"),
    ("ep4", "ep=4"),
    ("dp4-ep2", "dp=4,ep=2"),
    ("dp2-sp2-ep4", "dp=2,sp=2,ep=4"),
];

/// The graph just before `expert-parallel` in the mesh's default pipeline.
fn before_ep(model_name: &str, mesh: &str) -> (Graph, PassContext) {
    before_pass(model_name, mesh, "expert-parallel").expect("ep meshes run expert-parallel")
}

fn pass_diff(model_name: &str, mesh: &str) -> String {
    let (mut g, cx) = before_ep(model_name, mesh);
    diff_of(&mut g, &cx, "expert-parallel")
}

fn cx(mesh: &str) -> PassContext {
    PassContext::new(Mesh::parse(mesh).unwrap())
}

#[test]
fn snapshots() {
    for m in ["mixtral-tiny", "qwen3-moe-tiny"] {
        if weft_frontends::load(m).is_err() {
            continue;
        }
        for (tag, mesh) in MESHES {
            snapshot(&format!("expert-parallel__{m}__{tag}"), &pass_diff(m, mesh));
        }
    }
}

#[test]
fn whole_program() {
    let mut g = preset("mixtral-tiny");
    let cx = cx("dp=4,ep=2");
    run_pipeline(&mut g, &cx, &default_pipeline(&cx.mesh)).unwrap();
    snapshot("pipeline__mixtral-tiny__dp4-ep2", &print(&g));
    assert_eq!(parse(&print(&g)).unwrap(), g);
}

#[test]
fn pipelines_with_ep() {
    let text: Vec<String> = [
        "ep=2",
        "dp=4,ep=2",
        "dp=2,sp=2,ep=4",
        "dp=4,tp=2,ep=4",
        "tp=2,ep=2",
    ]
    .iter()
    .map(|m| {
        let mesh = Mesh::parse(m).unwrap();
        format!(
            "--mesh {m} ({mesh}):\n{}",
            default_pipeline_explained(&mesh)
        )
    })
    .collect();
    snapshot("pipeline__expert-parallel", &text.join("\n"));
}

#[test]
fn runs_once() {
    let (mut g, cx) = before_ep("mixtral-tiny", "dp=2,ep=2");
    let r1 = lookup("expert-parallel").unwrap().run(&mut g, &cx).unwrap();
    assert!(r1.changed);
    assert_eq!(r1.counters["moe_blocks"], 2);
    let once = g.clone();
    let r2 = lookup("expert-parallel").unwrap().run(&mut g, &cx).unwrap();
    assert!(!r2.changed);
    assert_eq!(r2.counters["already_parallel"], 2);
    assert_eq!(g, once);
}

#[test]
fn data_dependent_rows_are_runtime_symbols() {
    let (mut g, cx) = before_ep("mixtral-tiny", "ep=2");
    lookup("expert-parallel").unwrap().run(&mut g, &cx).unwrap();
    let syms = g.runtime_symbols();
    assert_eq!(syms.len(), 2);
    for (s, n) in &syms {
        assert!(s.starts_with('R'));
        let v = g.node(*n).results[0];
        assert_eq!(*s, format!("R{}", v.0), "named after its value");
        assert_eq!(g.ty(v).shape[0], Dim::sym(s));
    }
    // Plan-time checks skip them; B and S still must divide.
    check_bindings(&g, &Bindings::new().with("B", 4).with("S", 8)).unwrap();
    let e = check_bindings(&g, &Bindings::new().with("B", 3).with("S", 8)).unwrap_err();
    assert!(e.to_string().contains("batch size B=3"), "{e}");
    // A use before the definition is a verifier error.
    let (s, n) = syms[0].clone();
    let first = g.nodes()[0];
    let bad = Op::Full {
        value: Float(0.0),
        ty: TensorType::new(DType::F32, vec![Dim::sym(&s)]),
    };
    g.insert(At::Before(first), bad, &[]).unwrap();
    let report = verify(&g).unwrap_err().to_string();
    assert!(
        report.contains(&format!(
            "uses data-dependent size `{s}` before {} defines it",
            g.describe(n)
        )),
        "{report}"
    );
}

#[test]
fn errors() {
    // ep not dividing the experts names both.
    let (mut g, cx) = before_ep("mixtral-tiny", "dp=3,ep=3");
    let e = lookup("expert-parallel")
        .unwrap()
        .run(&mut g, &cx)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("`expert-parallel` cannot split 4 experts over ep=3 in node %"),
        "{e}"
    );
    assert!(
        e.contains("(model.layers.0.mlp.experts): ep=3 does not divide the expert count 4"),
        "{e}"
    );
    assert!(
        e.ends_with("help: use an ep that divides the 4 experts: 2, 4"),
        "{e}"
    );
    // A mesh without ep.
    let mut g = preset("mixtral-tiny");
    let e = run_pipeline(&mut g, &cx_plain("dp=2"), &["expert-parallel"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs mesh axis `ep`"), "{e}");
    // An expert weight read outside the block.
    let (mut g, cx) = before_ep("mixtral-tiny", "ep=2");
    let w = g
        .params()
        .into_iter()
        .find(|(n, _)| n.ends_with("0.mlp.experts.down_proj"))
        .unwrap()
        .1;
    g.add(
        Op::Sum {
            dims: vec![0, 1, 2],
            keepdim: false,
        },
        &[w],
    )
    .unwrap();
    let e = lookup("expert-parallel")
        .unwrap()
        .run(&mut g, &cx)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "it reads expert weight `model.layers.0.mlp.experts.down_proj`, which is split over ep"
        ),
        "{e}"
    );
    // A node that mixes expert rows.
    let (mut g, cx) = before_ep("mixtral-tiny", "ep=2");
    let act = g
        .nodes()
        .iter()
        .copied()
        .find(|&n| matches!(g.node(n).op, Op::Silu {}))
        .unwrap();
    let a = g.node(act).results[0];
    let sm = g
        .insert(At::After(act), Op::Softmax { dim: 0 }, &[a])
        .unwrap()[0];
    g.replace_uses_except(a, sm, g.def(sm));
    let e = lookup("expert-parallel")
        .unwrap()
        .run(&mut g, &cx)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`softmax` reads expert rows"), "{e}");
    assert!(e.contains("not row-local"), "{e}");
}

fn cx_plain(mesh: &str) -> PassContext {
    cx(mesh)
}

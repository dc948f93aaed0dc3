//! Gemma `.pt2` archives (tests/fixtures/pt2/gemma2_eager, gemma3, gemma3_decomposed,
//! from make_pt2.py) import with every block recognised (attention with its soft-cap,
//! Gemma's `(1 + w)` norms, GELU-tanh, the final-logit soft-cap), reproduce HF, agree
//! with the config build, and keep their meaning on sp and tp meshes.

mod common;
use common::*;

use std::collections::BTreeMap;
use std::path::PathBuf;
use weft_frontends::pt2::{import, Pt2Import, Pt2Options};
use weft_ir::{HostTensor, Op};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

const ARCHIVES: &[(&str, &str)] = &[
    ("gemma2_eager", "gemma2"),
    ("gemma2_eager_decomposed", "gemma2"),
    ("gemma3", "gemma3"),
    ("gemma3_decomposed", "gemma3"),
];

fn imp(name: &str, family: &str) -> Pt2Import {
    let opts = Pt2Options {
        config: Some(fixture(family).join("config.json")),
        ..Default::default()
    };
    let path: PathBuf = fixture("pt2").join(format!("{name}.pt2"));
    import(&path, &opts).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn inputs(family: &str) -> BTreeMap<String, HostTensor> {
    weft_frontends::read_safetensors(&fixture(family).join("inputs.safetensors")).unwrap()
}

fn run64(
    g: &weft_ir::Graph,
    w: &BTreeMap<String, HostTensor>,
    ins: &BTreeMap<String, HostTensor>,
) -> RunResult {
    let s = &ins["input_ids"].shape;
    let o = RunOptions::new(Precision::F64)
        .with_grads(true)
        .bind("B", s[0] as i64)
        .bind("S", s[1] as i64);
    run(g, w, ins, &o).unwrap()
}

#[test]
fn gemma_archives_reproduce_pytorch() {
    for (name, family) in ARCHIVES {
        let im = imp(name, family);
        let reference =
            weft_frontends::read_safetensors(&fixture(family).join("reference.safetensors"))
                .unwrap();
        let r = run64(&im.graph, &im.weights, &inputs(family));
        let el = rel_err(&r.outputs["logits"], &reference["logits"]);
        let es = rel_err(&r.outputs["loss"], &reference["loss"]);
        let mut eg: f64 = 0.0;
        for (p, g) in &r.grads {
            eg = eg.max(rel_err(g, &reference[&format!("grad.{p}")]));
        }
        eprintln!("{name}: logits {el:.1e} loss {es:.1e} grads {eg:.1e}");
        assert!(el < 1e-5 && es < 1e-5, "{name}: logits {el} loss {es}");
        assert!(eg < 1e-4, "{name}: grads {eg}");
        assert_eq!(
            r.grads.len(),
            reference.keys().filter(|k| k.starts_with("grad.")).count(),
            "{name}: gradient count"
        );
    }
}

#[test]
fn gemma_archives_recognise_every_block() {
    for (name, family) in ARCHIVES {
        let im = imp(name, family);
        let g = &im.graph;
        let ops: Vec<&Op> = g.nodes().iter().map(|&n| &g.node(n).op).collect();
        let count = |f: &dyn Fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
        let layers = if *family == "gemma2" { 2 } else { 3 };
        let want_cap = (*family == "gemma2").then_some(2.0);
        assert_eq!(
            count(
                &|o| matches!(o, Op::Attention { causal: true, softcap, .. } if softcap.map(|c| c.0) == want_cap)
            ),
            layers,
            "{name}: attention\n{}",
            im.report
        );
        // 4 norms per layer, q/k norms (gemma3), the final norm: each rms_norm(x, 1 + w).
        let norms = 4 * layers + 1 + if *family == "gemma3" { 2 * layers } else { 0 };
        assert_eq!(count(&|o| matches!(o, Op::RmsNorm { .. })), norms, "{name}");
        for &n in g.nodes() {
            if let Op::RmsNorm { .. } = g.node(n).op {
                let w = g.node(n).operands[1];
                assert!(
                    matches!(g.op_of(w), Op::AddScalar { value } if value.0 == 1.0),
                    "{name}"
                );
            }
        }
        assert_eq!(
            count(&|o| matches!(o, Op::Gelu { tanh_approx: true })),
            layers,
            "{name}"
        );
        assert_eq!(count(&|o| matches!(o, Op::Softmax { .. })), 0, "{name}");
        // the embedding scale and the final soft-cap (scale, tanh, scale)
        assert_eq!(count(&|o| matches!(o, Op::Tanh {})), 1, "{name}");
        assert!(
            im.report.unrecognised.is_empty(),
            "{name}: {:?}",
            im.report.unrecognised
        );
    }
}

/// The imported graphs and the graphs built from config.json compute the same thing.
#[test]
fn gemma_import_matches_config_build() {
    for (name, family) in ARCHIVES {
        let im = imp(name, family);
        let (graph, weights, ins) = load_fixture(family);
        for (p, w) in &weights {
            assert_eq!(rel_err(&im.weights[p], w), 0.0, "{name}: weight {p}");
        }
        let (ri, rb) = (
            run64(&im.graph, &im.weights, &ins),
            run64(&graph, &weights, &ins),
        );
        for out in ["loss", "logits"] {
            let e = rel_err(&ri.outputs[out], &rb.outputs[out]);
            assert!(
                e < 1e-9,
                "{name}: {out} differs from the config build by {e}"
            );
        }
        for (p, g) in &rb.grads {
            let e = rel_err(&ri.grads[p], g);
            assert!(e < 1e-8, "{name}: grad {p} differs by {e}");
        }
    }
}

/// sp and tp (vocabulary-parallel loss after the final soft-cap, the soft-capped
/// attention split by heads, gemma3's (1 + w) q/k norms with their gradients summed)
/// keep the imported programs' meaning.
#[test]
fn gemma_imports_on_sp_and_tp_meshes() {
    use weft_ir::Mesh;
    use weft_passes::{default_pipeline, run_pipeline, PassContext};
    for (name, family) in [("gemma2_eager", "gemma2"), ("gemma3", "gemma3")] {
        let im = imp(name, family);
        let ins = inputs(family);
        let reference = run64(&im.graph, &im.weights, &ins);
        for mesh in ["sp=2", "tp=2", "dp=2,sp=2,tp=2"] {
            let mesh = Mesh::parse(mesh).unwrap();
            let mut g = im.graph.clone();
            run_pipeline(
                &mut g,
                &PassContext::new(mesh.clone()),
                &default_pipeline(&mesh),
            )
            .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
            let got = run64(&g, &im.weights, &ins);
            for out in ["loss", "logits"] {
                let e = rel_err(&got.outputs[out], &reference.outputs[out]);
                assert!(e < 1e-10, "{name} {mesh}: {out} rel err {e}");
            }
            for (p, want) in &reference.grads {
                let e = rel_err(&got.grads[p], want);
                assert!(e < 1e-9, "{name} {mesh}: grad {p} rel err {e}");
            }
        }
    }
}

/// transformers' SDPA path drops Gemma 2's attention soft-cap: such an archive imports as
/// the program it is (no cap, so it is not HF's eager model), and the report says so.
#[test]
fn sdpa_archive_without_the_cap_is_noted() {
    let im = imp("gemma2", "gemma2");
    assert!(im.graph.nodes().iter().all(|&n| !matches!(
        im.graph.node(n).op,
        Op::Attention {
            softcap: Some(_),
            ..
        }
    )));
    assert!(
        im.report
            .notes
            .iter()
            .any(|n| n.contains("attn_logit_softcapping 2") && n.contains("eager")),
        "{}",
        im.report
    );
    let reference =
        weft_frontends::read_safetensors(&fixture("gemma2").join("reference.safetensors")).unwrap();
    let r = run64(&im.graph, &im.weights, &inputs("gemma2"));
    assert!(rel_err(&r.outputs["logits"], &reference["logits"]) > 1e-3);
}

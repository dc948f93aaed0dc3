//! Gemma 2 and Gemma 3 (text) reproduce HF: tiny random transformers models
//! (tests/fixtures/make_gemma_fixtures.py) with attention and final-logit soft-capping,
//! sliding windows shorter than the 16-token sequence, Gemma 3's local rope base, the
//! `(1 + w)` norms and uneven -100 labels. The training step alone and on sp=2, tp=2 and
//! sp=2,tp=2 gives HF's logits and loss (1e-5 relative) and every gradient (1e-4); the
//! CLI's `check --train` agrees; and each Gemma feature is shown to matter.

mod common;
use common::*;

use weft_ir::{Graph, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::{run, Precision, RunOptions};

const GEMMA: &[&str] = &["gemma2", "gemma3"];

/// (window, softcap, scale) of each attention, in graph order.
fn attentions(g: &Graph) -> Vec<(Option<i64>, Option<f64>, f64)> {
    ops_where(g, |op| match op {
        Op::Attention {
            window,
            softcap,
            scale,
            ..
        } => Some((*window, softcap.map(|c| c.0), scale.0)),
        _ => None,
    })
}

#[test]
fn config_fields_reach_the_graph() {
    let (g, _, _) = load_fixture("gemma2");
    let s6 = 6f64.powf(-0.5);
    assert_eq!(
        attentions(&g),
        vec![(Some(4), Some(2.0), s6), (None, Some(2.0), s6)]
    );
    let (g, _, _) = load_fixture("gemma3");
    let s10 = 10f64.powf(-0.5);
    assert_eq!(
        attentions(&g),
        vec![
            (Some(5), None, s10),
            (None, None, s10),
            (Some(5), None, s10)
        ]
    );
    // Two rope tables: the global one (theta 1e6, linear x8) and the local one (1e4).
    let tables: Vec<(f64, String)> = ops_where(&g, |op| match op {
        Op::RopeTable { theta, scaling, .. } => Some((theta.0, format!("{scaling:?}"))),
        _ => None,
    });
    assert_eq!(tables.len(), 2, "{tables:?}");
    assert_eq!(tables[0].0, 1e6);
    assert!(tables[0].1.contains("Linear"), "{tables:?}");
    assert_eq!(tables[1], (1e4, "None".to_string()));
    // The final soft-cap: scale(1/3), tanh, scale(3) right before the logits.
    let logits = g.outputs().iter().find(|(n, _)| n == "logits").unwrap().1;
    assert_eq!(
        g.op_of(logits),
        &Op::Scale {
            factor: weft_ir::Float(3.0)
        }
    );
}

#[test]
fn training_step_matches_hf_alone_and_on_sp2_and_tp2() {
    let mut report = Vec::new();
    for fam in GEMMA {
        let (graph, weights, inputs) = load_fixture(fam);
        let reference = hf_reference(fam);
        for mesh in ["", "sp=2", "tp=2", "sp=2,tp=2"] {
            let what = format!("{fam} `{mesh}`");
            let opts = fixture_train_options();
            let (_, r) = run_training_step(&what, &graph, &weights, &inputs, mesh, &opts);
            let worst =
                assert_step_matches_hf(&what, &r, &reference, &["logits", "loss"], 1e-5, 1e-4);
            report.push(format!("{what}: worst rel err {worst:.1e}"));
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// The fixtures are not vacuous: dropping the soft-caps, the window, the local rope or
/// the norms' `+ 1` moves the logits far from HF.
#[test]
fn each_gemma_feature_matters() {
    let far = |fam: &str, what: &str, edit: &dyn Fn(&mut Graph)| {
        let (mut graph, weights, inputs) = load_fixture(fam);
        let reference = hf_reference(fam);
        edit(&mut graph);
        let r = run(&graph, &weights, &inputs, &RunOptions::new(Precision::F64)).unwrap();
        let e = rel_err(&r.outputs["logits"], &reference["logits"]);
        assert!(e > 1e-3, "{fam} without {what}: within {e:e} of HF");
    };
    let each = |g: &mut Graph, f: &dyn Fn(&mut Op)| edit_ops(g, f);
    far("gemma2", "the attention soft-cap", &|g| {
        each(g, &|op| {
            if let Op::Attention { softcap, .. } = op {
                *softcap = None;
            }
        })
    });
    far("gemma2", "the window", &|g| {
        each(g, &|op| {
            if let Op::Attention { window, .. } = op {
                *window = None;
            }
        })
    });
    far("gemma3", "the final soft-cap", &|g| {
        each(g, &|op| {
            if let Op::Tanh {} = op {
                *op = Op::Scale {
                    factor: weft_ir::Float(1.0),
                };
            }
        })
    });
    far("gemma3", "the local rope base", &|g| {
        each(g, &|op| {
            if let Op::RopeTable { theta, scaling, .. } = op {
                *theta = weft_ir::Float(1e6);
                *scaling = weft_ir::RopeScaling::Linear {
                    factor: weft_ir::Float(8.0),
                };
            }
        })
    });
    far("gemma3", "the norms' + 1", &|g| {
        each(g, &|op| {
            if let Op::AddScalar { value } = op {
                *value = weft_ir::Float(0.0);
            }
        })
    });
}

#[test]
fn weft_check_train_on_gemma_meshes() {
    for (model, mesh) in [
        ("tests/fixtures/gemma2", "sp=2"),
        ("tests/fixtures/gemma2", "tp=2"),
        ("tests/fixtures/gemma3", "dp=2,tp=2"),
        ("tests/fixtures/gemma3", "sp=2,tp=2"),
    ] {
        let (code, out, err) = weft(&["check", model, "--mesh", mesh, "--train", "--json"]);
        assert_eq!(code, 0, "{model} {mesh}: {out}{err}");
        let v = json(&out);
        assert_eq!(v["ok"], true, "{model} {mesh}: {v}");
        assert!(v["max_rel_err_grads"].as_f64().unwrap() < 1e-12, "{out}");
    }
    // With recompute, ZeRO-3 (the (1 + w) weights gathered before add_scalar), micro-batches
    // and Ulysses over more ranks than kv heads.
    for (model, mesh, extra) in [
        (
            "tests/fixtures/gemma2",
            "dp=2,sp=2",
            &["--checkpoint", "full", "--zero", "3"][..],
        ),
        (
            "tests/fixtures/gemma3",
            "dp=2,tp=2",
            &["--checkpoint", "selective", "--micro-batches", "2"][..],
        ),
        ("tests/fixtures/gemma2", "sp=4", &[][..]),
    ] {
        let mut args = vec!["check", model, "--mesh", mesh, "--train", "--json"];
        args.extend_from_slice(extra);
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{model} {mesh} {extra:?}: {out}{err}");
        assert_eq!(json(&out)["ok"], true, "{model} {mesh} {extra:?}: {out}");
    }
    // The .pt2 path (tests/gemma_pt2.rs matches these archives to HF).
    for (archive, family, mesh) in [
        ("gemma2_eager", "gemma2", "sp=2"),
        ("gemma2_eager", "gemma2", "tp=2"),
        ("gemma3", "gemma3", "sp=2,tp=2"),
    ] {
        let model = format!("tests/fixtures/pt2/{archive}.pt2");
        let config = format!("tests/fixtures/{family}/config.json");
        let (code, out, err) = weft(&[
            "check", &model, "--config", &config, "--mesh", mesh, "--train", "--json",
        ]);
        assert_eq!(code, 0, "{archive} {mesh}: {out}{err}");
        let v = json(&out);
        assert_eq!(v["ok"], true, "{archive} {mesh}: {v}");
        assert!(v["max_rel_err_grads"].as_f64().unwrap() < 1e-12, "{out}");
    }
}

/// The soft-capped attention through expert parallelism: the mixtral fixture with a
/// soft-cap on every attention, its training step on ep=2 and sp=2,ep=2 against the
/// unsharded program (f64, no HF reference: mixtral has no soft-cap).
#[test]
fn soft_capped_attention_on_expert_parallel_meshes() {
    let (mut graph, weights, inputs) = load_fixture("mixtral");
    edit_ops(&mut graph, |op| {
        if let Op::Attention { softcap, .. } = op {
            *softcap = Some(weft_ir::Float(1.5));
        }
    });
    let want = reference_run(&graph, &weights, &inputs);
    for mesh in ["ep=2", "sp=2,ep=2", "tp=2,ep=2"] {
        let opts = TrainOptions {
            batch: Some(2),
            seq: Some(16),
            ..Default::default()
        };
        let what = format!("`{mesh}`");
        let (g, r) = run_training_step(&what, &graph, &weights, &inputs, mesh, &opts);
        assert!(
            g.nodes().iter().any(|&n| matches!(
                g.node(n).op,
                Op::AttentionGrad {
                    softcap: Some(_),
                    ..
                }
            )),
            "`{mesh}`: the backward keeps the soft-cap"
        );
        assert_step_matches_unsharded(&what, &r, &want, &["logits", "loss"], 1e-10, 1e-9);
    }
}

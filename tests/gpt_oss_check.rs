//! gpt-oss reproduces HF: tiny random `GptOssForCausalLM` models
//! (tests/fixtures/make_gpt_oss.py) with attention sinks, sliding windows shorter than
//! the 16-token sequence, YaRN rope scaling (with and without mscale / truncate), biased
//! attention projections, the top-k-then-softmax router and the clamped-SwiGLU experts
//! with biases (some values past the clamp), with uneven -100 labels. The training step
//! alone and on sp=2, tp=2, ep=2 and sp=2,ep=2 gives HF's logits, loss and every
//! gradient to 1e-4 relative (logits and loss 1e-5).

mod common;
use common::*;

use weft_ir::{Op, RopeScaling};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::{run, Precision, RunOptions};

const FIXTURES: &[&str] = &["gpt_oss", "gpt_oss_aux"];
const MESHES: &[&str] = &["", "sp=2", "tp=2", "ep=2", "sp=2,ep=2"];

#[test]
fn config_reaches_the_graph() {
    let (g, _, _) = load_fixture("gpt_oss");
    let attn: Vec<(Option<i64>, bool)> = ops_where(&g, |op| match op {
        Op::Attention { window, sinks, .. } => Some((*window, sinks.0)),
        _ => None,
    });
    assert_eq!(attn, vec![(Some(5), true), (None, true)]);
    let yarn = g.nodes().iter().find_map(|&n| match &g.node(n).op {
        Op::RopeTable { scaling, .. } => Some(*scaling),
        _ => None,
    });
    assert!(
        matches!(
            yarn,
            Some(RopeScaling::Yarn {
                truncate: false,
                ..
            })
        ),
        "{yarn:?}"
    );
}

#[test]
fn training_step_matches_hf_alone_and_on_every_mesh() {
    let mut report = Vec::new();
    for fam in FIXTURES {
        let (graph, weights, inputs) = load_fixture(fam);
        let reference = hf_reference(fam);
        let fwd = reference_run(&graph, &weights, &inputs);
        assert_autograd_matches_hf(fam, &fwd, &reference);
        for mesh in MESHES {
            let what = format!("{fam} `{mesh}`");
            let opts = fixture_train_options();
            let (_, r) = run_training_step(&what, &graph, &weights, &inputs, mesh, &opts);
            let mut outs = vec!["logits", "loss"];
            if reference.contains_key("aux_loss") {
                outs.extend(["ce_loss", "aux_loss"]);
            }
            let worst = assert_step_matches_hf(&what, &r, &reference, &outs, 1e-5, 1e-4);
            report.push(format!("{what}: worst rel err {worst:.1e}"));
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// The fixtures are not vacuous: without the sinks, or with the yarn attention factor
/// left out, the logits are far from HF's.
#[test]
fn sinks_and_the_yarn_factor_matter() {
    let (graph, weights, inputs) = load_fixture("gpt_oss");
    let reference = hf_reference("gpt_oss");
    let mut no_sinks = graph.clone();
    for n in no_sinks.nodes().to_vec() {
        if let Op::Attention { sinks, .. } = &mut no_sinks.node_mut(n).op {
            sinks.0 = false;
            no_sinks.node_mut(n).operands.truncate(3);
        }
    }
    let mut no_factor = graph.clone();
    edit_ops(&mut no_factor, |op| {
        if let Op::RopeTable {
            scaling: RopeScaling::Yarn {
                attention_factor, ..
            },
            ..
        } = op
        {
            attention_factor.0 = 1.0;
        }
    });
    for (what, g) in [("sinks", no_sinks), ("attention factor", no_factor)] {
        let r = run(&g, &weights, &inputs, &RunOptions::new(Precision::F64)).unwrap();
        let e = rel_err(&r.outputs["logits"], &reference["logits"]);
        assert!(
            e > 1e-3,
            "without the {what} the logits are within {e:e} of HF"
        );
    }
}

/// The meshes split what they should: tp=2 halves the sinks with the q heads and the
/// experts' intermediate dim in (gate, up) pairs with the gate_up bias; ep=2 halves the
/// experts and both their biases; the router stays whole.
#[test]
fn meshes_split_sinks_and_experts() {
    let (graph, _, _) = load_fixture("gpt_oss");
    let shape_of = |g: &weft_ir::Graph, name: &str| -> Vec<String> {
        let (_, v) = g
            .params()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no param {name}"));
        g.ty(v).shape.iter().map(|d| d.to_string()).collect()
    };
    let l = "model.layers.0";
    type Shapes<'a> = &'a [(&'a str, &'a [&'a str])];
    let cases: &[(&str, Shapes)] = &[
        (
            "tp=2",
            &[
                ("self_attn.sinks", &["2"]),
                ("mlp.experts.gate_up_proj", &["4", "32", "64"]),
                ("mlp.experts.gate_up_proj_bias", &["4", "64"]),
                ("mlp.experts.down_proj", &["4", "32", "32"]),
                ("mlp.experts.down_proj_bias", &["4", "32"]),
                ("mlp.router.weight", &["4", "32"]),
            ],
        ),
        (
            "ep=2",
            &[
                ("self_attn.sinks", &["4"]),
                ("mlp.experts.gate_up_proj", &["4/ep", "32", "128"]),
                ("mlp.experts.gate_up_proj_bias", &["4/ep", "128"]),
                ("mlp.experts.down_proj", &["4/ep", "64", "32"]),
                ("mlp.experts.down_proj_bias", &["4/ep", "32"]),
                ("mlp.router.bias", &["4"]),
            ],
        ),
    ];
    for (mesh, want) in cases {
        let (g, _) = training_step(&graph, mesh, &TrainOptions::default()).unwrap();
        for (p, shape) in *want {
            let got = shape_of(&g, &format!("{l}.{p}"));
            assert_eq!(got, shape.to_vec(), "{mesh}: {p}");
        }
    }
}

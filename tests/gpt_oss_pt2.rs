//! gpt-oss through `.pt2` (tests/fixtures/pt2/gpt_oss_batched.pt2, make_pt2.py, from the
//! tiny random `GptOssForCausalLM` of tests/fixtures/gpt_oss: eager attention with
//! sinks, alternating sliding (5) / full layers, biased projections, YaRN rope, MoE with
//! biases and the clamped SwiGLU, `experts_implementation="batched_mm"`) imports with
//! every block recognised as the ops the config path builds, and its training step gives
//! HF's logits, loss and every gradient alone and on sp=2, tp=2, ep=2 and sp=2,ep=2.

mod common;
use common::*;

use weft_frontends::pt2::{import, Pt2Import, Pt2Options};
use weft_ir::{Op, RopeScaling};

const MESHES: &[&str] = &["", "sp=2", "tp=2", "ep=2", "sp=2,ep=2"];

fn imported() -> Pt2Import {
    let opts = Pt2Options {
        config: Some(fixture("gpt_oss").join("config.json")),
        ..Default::default()
    };
    import(&fixture("pt2").join("gpt_oss_batched.pt2"), &opts)
        .unwrap_or_else(|e| panic!("gpt_oss_batched: {e}"))
}

#[test]
fn training_step_matches_hf_alone_and_on_every_mesh() {
    let im = imported();
    let (_, _, inputs) = load_fixture("gpt_oss");
    let reference = hf_reference("gpt_oss");
    let fwd = reference_run(&im.graph, &im.weights, &inputs);
    assert_autograd_matches_hf("gpt_oss.pt2", &fwd, &reference);
    let mut report = Vec::new();
    for mesh in MESHES {
        let what = format!("gpt_oss.pt2 `{mesh}`");
        let opts = fixture_train_options();
        let (_, r) = run_training_step(&what, &im.graph, &im.weights, &inputs, mesh, &opts);
        let worst = assert_step_matches_hf(&what, &r, &reference, &["logits", "loss"], 1e-5, 1e-4);
        report.push(format!("{what}: worst rel err {worst:.1e}"));
    }
    eprintln!("{}", report.join("\n"));
}

/// Every block is the op the config path builds: attention with its sinks and the
/// layer's window (5, then none), the YaRN rope table, rms_norm, linear and the MoE
/// dispatch / biased grouped matmuls / combine; nothing is left unrecognised.
#[test]
fn every_block_is_recognised() {
    let im = imported();
    let g = &im.graph;
    let attn: Vec<(bool, Option<i64>, bool)> = ops_where(g, |op| match op {
        Op::Attention {
            causal,
            window,
            sinks,
            ..
        } => Some((*causal, *window, sinks.0)),
        _ => None,
    });
    assert_eq!(
        attn,
        [(true, Some(5), true), (true, None, true)],
        "{}",
        im.report
    );
    let yarn: Vec<RopeScaling> = ops_where(g, |op| match op {
        Op::RopeTable { scaling, dim, .. } if *dim == 16 => Some(*scaling),
        _ => None,
    });
    assert!(
        matches!(yarn.as_slice(), [RopeScaling::Yarn { .. }]),
        "{yarn:?}"
    );
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::Rope {}).then_some(())).len(),
        4
    );
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::RmsNorm { .. }).then_some(())).len(),
        5
    );
    let grouped: Vec<usize> = g
        .nodes()
        .iter()
        .filter(|&&n| matches!(g.node(n).op, Op::GroupedMatmul { .. }))
        .map(|&n| g.node(n).operands.len())
        .collect();
    assert_eq!(
        grouped,
        [4, 4, 4, 4],
        "every expert matmul carries its bias"
    );
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::Softmax { .. }).then_some(())).len(),
        2
    );
    assert!(
        im.report.unrecognised.is_empty(),
        "{:?}",
        im.report.unrecognised
    );
}

/// The imported layer 0 (attention with sinks and window, the YaRN rope, the MoE with its
/// clamped SwiGLU), as text.
#[test]
fn layer_zero_snapshot() {
    let im = imported();
    let text = im.graph.to_string();
    let layer0: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.ends_with("# model.layers.0")
                || l.contains("# model.layers.0.")
                || l.ends_with("# model.rotary_emb")
        })
        .collect();
    insta::assert_snapshot!("gpt_oss_pt2_layer0", layer0.join("\n"));
}

/// Without `--config` the YaRN table cannot be told from its values (and its attention
/// factor with it): the import stops at the rotary table, naming the node.
#[test]
fn without_the_config_the_yarn_table_is_refused() {
    let e = import(
        &fixture("pt2").join("gpt_oss_batched.pt2"),
        &Pt2Options::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("aten.cos") && e.contains("--config"), "{e}");
}

/// The imported graph and the graph built from config.json compute the same thing (f64):
/// the same weights, losses, logits and gradients up to summation order.
#[test]
fn import_matches_the_config_build() {
    let im = imported();
    let (graph, weights, inputs) = load_fixture("gpt_oss");
    for (p, w) in &weights {
        assert_eq!(rel_err(&im.weights[p], w), 0.0, "weight {p}");
    }
    assert_eq!(im.weights.len(), weights.len());
    let (ri, rb) = (
        reference_run(&im.graph, &im.weights, &inputs),
        reference_run(&graph, &weights, &inputs),
    );
    for out in ["loss", "logits"] {
        let e = rel_err(&ri.outputs[out], &rb.outputs[out]);
        assert!(e < 1e-9, "{out} differs from the config build by {e}");
    }
    assert_eq!(ri.grads.len(), rb.grads.len());
    for (p, g) in &rb.grads {
        let e = rel_err(&ri.grads[p], g);
        assert!(e < 1e-8, "grad {p} differs by {e}");
    }
}

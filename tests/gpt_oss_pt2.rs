//! gpt-oss through `.pt2` (tests/fixtures/pt2/gpt_oss_batched.pt2, make_pt2.py, from the
//! tiny random `GptOssForCausalLM` of tests/fixtures/gpt_oss: eager attention with
//! sinks, alternating sliding (5) / full layers, biased projections, YaRN rope, MoE with
//! biases and the clamped SwiGLU, `experts_implementation="batched_mm"`) imports with
//! every block recognised as the ops the config path builds, and its training step gives
//! HF's logits, loss and every gradient alone and on sp=2, tp=2, ep=2 and sp=2,ep=2.
//! Edits to the program that would change the math unseen (another rotary factor,
//! expert ids clamped to fewer experts: not read as the MoE block) and a missing
//! `--config` are refused or kept generic.

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
    assert_import_matches_hf_on_meshes("gpt_oss.pt2", "gpt_oss", &im.graph, &im.weights, MESHES);
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
        ops_where(g, |op| matches!(op, Op::Rope { .. }).then_some(())).len(),
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

/// The archive with one edit to its program JSON (`from` replaced once by `to`).
fn tampered(from: &str, to: &str) -> Vec<u8> {
    use std::io::{Read, Write};
    let bytes = std::fs::read(fixture("pt2").join("gpt_oss_batched.pt2")).unwrap();
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
    let mut out = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let mut edited = false;
    for i in 0..z.len() {
        let mut f = z.by_index(i).unwrap();
        let name = f.name().to_string();
        let mut data = Vec::new();
        f.read_to_end(&mut data).unwrap();
        if name.ends_with("models/model.json") {
            let text = String::from_utf8(data).unwrap();
            assert!(text.contains(from), "{from}");
            data = text.replacen(from, to, 1).into_bytes();
            edited = true;
        }
        out.start_file(name, opts).unwrap();
        out.write_all(&data).unwrap();
    }
    assert!(edited);
    out.finish().unwrap().into_inner()
}

fn import_tampered(from: &str, to: &str) -> Result<Pt2Import, String> {
    let opts = Pt2Options {
        config: Some(fixture("gpt_oss").join("config.json")),
        ..Default::default()
    };
    weft_frontends::pt2::import_bytes("gpt_oss_tampered", tampered(from, to), &opts)
        .map_err(|e| e.to_string())
}

/// A rotary table scaled by something other than the YaRN attention factor the config
/// gives (`rope_table` holds that factor) is refused at the table, not rescaled.
#[test]
fn a_table_scaled_by_another_factor_is_refused() {
    let e = import_tampered(
        r#""arg": {"as_float": 1.138629436111989}"#,
        r#""arg": {"as_float": 1.25}"#,
    )
    .err()
    .expect("a cos table times 1.25 imported");
    assert!(
        e.contains("node `cos`") && e.contains("attention factor 1.138629436111989"),
        "{e}"
    );
}

/// Expert ids clamped to fewer experts than the block has (expert 3's rows would use
/// expert 2's weights) are not read as the MoE block: layer 0's experts stay the
/// program's own clamp and per-token weight gathers (generic ops, reported as not
/// recognised), and only layer 1 becomes `moe_dispatch`.
#[test]
fn expert_ids_clamped_below_the_last_expert_are_not_read_as_moe() {
    let keep = r#"{"name": "reshape_6"}}, "kind": 1}, {"name": "min", "arg": {"as_int": 0}, "kind": 1}, {"name": "max", "arg": {"as_int": "#;
    let im = import_tampered(&format!("{keep}3}}"), &format!("{keep}2}}"))
        .unwrap_or_else(|e| panic!("expert ids clamped to [0, 2]: {e}"));
    let g = &im.graph;
    let unread: Vec<&str> = im
        .report
        .unrecognised
        .iter()
        .filter(|r| r.pattern == "moe")
        .map(|r| r.layer.as_str())
        .collect();
    assert!(
        !unread.is_empty() && unread.iter().all(|l| *l == "model.layers.0.mlp.experts"),
        "{unread:?}"
    );
    let dispatched: Vec<String> = g
        .nodes()
        .iter()
        .filter(|&&n| matches!(g.node(n).op, Op::MoeDispatch { .. }))
        .filter_map(|&n| g.node(n).meta.source.clone())
        .collect();
    assert_eq!(dispatched, ["model.layers.1.mlp.experts"]);
    let clamped_to_two = g.nodes().iter().any(|&n| {
        let node = g.node(n);
        matches!(node.op, Op::Minimum {})
            && g.ty(node.results[0]).dtype == weft_ir::DType::I64
            && matches!(&g.node(g.def(node.operands[1])).op, Op::Full { value, .. } if value.0 == 2.0)
    });
    assert!(clamped_to_two, "the ids' clamp to 2 is kept");
}

/// The passes shard the imported graph as they shard the config build: tp=2 halves the
/// sinks with the q heads and the experts' intermediate dim in (gate, up) pairs with the
/// gate_up bias; ep=2 halves the experts and both their biases.
#[test]
fn meshes_split_sinks_and_experts_as_for_the_config_build() {
    use weft_passes::training::TrainOptions;
    let im = imported();
    let (built, _, _) = load_fixture("gpt_oss");
    let shapes = |g: &weft_ir::Graph| -> Vec<(String, String)> {
        g.params()
            .into_iter()
            .filter(|(n, _)| n.contains("sinks") || n.contains("experts"))
            .map(|(n, v)| (n, g.ty(v).to_string()))
            .collect()
    };
    for mesh in ["tp=2", "ep=2"] {
        let (gi, _) = training_step(&im.graph, mesh, &TrainOptions::default()).unwrap();
        let (gb, _) = training_step(&built, mesh, &TrainOptions::default()).unwrap();
        let (si, sb) = (shapes(&gi), shapes(&gb));
        assert_eq!(si, sb, "{mesh}");
        let layer0: Vec<&str> = si
            .iter()
            .filter(|(n, _)| n.starts_with("model.layers.0."))
            .map(|(_, t)| t.as_str())
            .collect();
        let want: &[&str] = if mesh == "tp=2" {
            &[
                "f32[2]",
                "f32[4, 32, 64]",
                "f32[4, 64]",
                "f32[4, 32, 32]",
                "f32[4, 32]",
            ]
        } else {
            &[
                "f32[4]",
                "f32[4/ep, 32, 128]",
                "f32[4/ep, 128]",
                "f32[4/ep, 64, 32]",
                "f32[4/ep, 32]",
            ]
        };
        assert_eq!(
            layer0, want,
            "{mesh}: sinks, gate_up, its bias, down, its bias"
        );
    }
}

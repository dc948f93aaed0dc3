//! DeepSeek-V3 through `.pt2` (tests/fixtures/pt2/deepseek_v3_batched.pt2, make_pt2.py,
//! from the tiny random `DeepseekV3ForCausalLM` of tests/fixtures/deepseek_v3:
//! multi-head latent attention with `q_lora_rank`, the interleaved rope on a shared
//! rope key, `v_head_dim` != the q/k head dim, layer 0 dense, group-limited sigmoid
//! routing with its correction-bias buffer and routed scaling, shared experts,
//! `experts_implementation="batched_mm"`) imports with every block recognised as the ops
//! the config path builds, and its training step gives HF's logits, loss and every
//! gradient alone and on sp=2, tp=2, ep=2 and sp=2,ep=2. Edits to the program that
//! would change the math unseen (a gap in the assembled key, a group mask scattered
//! into a non-zero tensor, another rope stride) are refused, naming the node.
//!
//! The same program after `run_decompositions()` (deepseek_v3_batched_decomposed.pt2,
//! core ATen: the key's `copy_` into slices of an `empty` tensor as `slice_scatter`s,
//! attention as `bmm` / `_softmax` / `bmm` with q and k each scaled by `12^-1/4`, SiLU
//! as `x * sigmoid(x)`) imports to the same blocks and matches HF on the same meshes.

mod common;
use common::*;

use weft_frontends::pt2::{import, Pt2Import, Pt2Options};
use weft_ir::{Op, Role};

const MESHES: &[&str] = &["", "sp=2", "tp=2", "ep=2", "sp=2,ep=2"];
const ARCHIVE: &str = "deepseek_v3_batched.pt2";
const DECOMPOSED: &str = "deepseek_v3_batched_decomposed.pt2";

fn options() -> Pt2Options {
    Pt2Options {
        config: Some(fixture("deepseek_v3").join("config.json")),
        ..Default::default()
    }
}

fn imported() -> Pt2Import {
    imported_from(ARCHIVE)
}

fn imported_from(archive: &str) -> Pt2Import {
    import(&fixture("pt2").join(archive), &options()).unwrap_or_else(|e| panic!("{archive}: {e}"))
}

#[test]
fn training_step_matches_hf_alone_and_on_every_mesh() {
    let im = imported();
    assert_import_matches_hf_on_meshes(
        "deepseek_v3.pt2",
        "deepseek_v3",
        &im.graph,
        &im.weights,
        MESHES,
    );
}

#[test]
fn decomposed_training_step_matches_hf_alone_and_on_every_mesh() {
    let im = imported_from(DECOMPOSED);
    assert_import_matches_hf_on_meshes(
        "deepseek_v3_decomposed.pt2",
        "deepseek_v3",
        &im.graph,
        &im.weights,
        MESHES,
    );
}

/// Every block is the op the config path builds: one causal attention per layer with
/// MLA's value head dim (6) below the q/k head dim (12), the rope table and a `rope` on
/// each layer's q and shared k rotary parts, rms_norm (including the q and kv latent
/// norms), the MoE dispatch / grouped matmuls / combine of the two sparse layers, and
/// the correction biases as checkpoint buffers; nothing is left unrecognised.
#[test]
fn every_block_is_recognised() {
    assert_blocks_recognised(&imported(), 0.0);
}

/// The decomposed archive gives the same blocks and counts. Its attention scale is the
/// product of the factors core ATen scales q and k by (`sqrt(12^-1/2)` each), which
/// rounds to within an ulp of `12^-1/2`.
#[test]
fn every_block_of_the_decomposed_archive_is_recognised() {
    let im = imported_from(DECOMPOSED);
    assert_blocks_recognised(&im, 1e-16);
    // MLA's key was assembled by slice_scatter into an empty tensor: a concat of the
    // per-head pass-through part and the shared rope part expanded to every head.
    let key_concats = im
        .graph
        .nodes()
        .iter()
        .filter(|&&n| matches!(im.graph.node(n).op, Op::Attention { .. }))
        .filter(|&&n| {
            let k = im.graph.node(n).operands[1];
            let d = im.graph.node(im.graph.def(k));
            matches!(d.op, Op::Concat { .. })
                && matches!(
                    im.graph.node(im.graph.def(d.operands[1])).op,
                    Op::Expand { .. }
                )
        })
        .count();
    assert_eq!(key_concats, 3, "{}", im.graph);
}

/// The blocks `every_block_is_recognised` lists, with the attention scale within
/// `scale_tol` of `12^-1/2`.
fn assert_blocks_recognised(im: &Pt2Import, scale_tol: f64) {
    let g = &im.graph;
    let attn: Vec<bool> = ops_where(g, |op| match op {
        Op::Attention { causal, scale, .. } => {
            Some(*causal && (scale.0 - 12f64.powf(-0.5)).abs() <= scale_tol)
        }
        _ => None,
    });
    assert_eq!(attn, [true; 3], "{}", im.report);
    let value_dims: Vec<String> = g
        .nodes()
        .iter()
        .filter(|&&n| matches!(g.node(n).op, Op::Attention { .. }))
        .map(|&n| g.ty(g.node(n).operands[2]).to_string())
        .collect();
    assert_eq!(value_dims, ["f32[B, 4, S, 6]"; 3]);
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::RopeTable { .. }).then_some(())).len(),
        1
    );
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::Rope { .. }).then_some(())).len(),
        6
    );
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::RmsNorm { .. }).then_some(())).len(),
        13
    );
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::GroupedMatmul { .. }).then_some(())).len(),
        4
    );
    assert_eq!(
        ops_where(g, |op| matches!(op, Op::MoeCombine {}).then_some(())).len(),
        2
    );
    let buffers: Vec<(String, String)> = g
        .inputs()
        .into_iter()
        .filter(|(_, role, _)| *role == Role::Buffer)
        .map(|(name, _, v)| (name, g.ty(v).to_string()))
        .collect();
    assert_eq!(
        buffers,
        [1, 2].map(|l| (
            format!("model.layers.{l}.mlp.gate.e_score_correction_bias"),
            "f32[8]".to_string()
        ))
    );
    assert!(
        im.report.unrecognised.is_empty(),
        "{:?}",
        im.report.unrecognised
    );
}

/// The imported layer 1 (MLA with its q latent, the de-interleaved rope on the shared
/// rope key, the group-limited router, the experts and the shared experts), as text.
#[test]
fn layer_one_snapshot() {
    let im = imported();
    let text = im.graph.to_string();
    let layer1: Vec<&str> = text
        .lines()
        .filter(|l| l.ends_with("# model.layers.1") || l.contains("# model.layers.1."))
        .collect();
    insta::assert_snapshot!("deepseek_pt2_layer1", layer1.join("\n"));
}

/// The imported graphs (before and after decomposition) and the graph built from
/// config.json compute the same thing (f64): the same weights and buffers, losses,
/// logits and gradients up to summation order.
#[test]
fn import_matches_the_config_build() {
    let (graph, weights, inputs) = load_fixture("deepseek_v3");
    let rb = reference_run(&graph, &weights, &inputs);
    for archive in [ARCHIVE, DECOMPOSED] {
        let im = imported_from(archive);
        for (p, w) in &weights {
            assert_eq!(rel_err(&im.weights[p], w), 0.0, "{archive}: weight {p}");
        }
        assert_eq!(im.weights.len(), weights.len());
        let ri = reference_run(&im.graph, &im.weights, &inputs);
        for out in ["loss", "logits"] {
            let e = rel_err(&ri.outputs[out], &rb.outputs[out]);
            assert!(
                e < 1e-9,
                "{archive}: {out} differs from the config build by {e}"
            );
        }
        assert_eq!(ri.grads.len(), rb.grads.len());
        for (p, g) in &rb.grads {
            let e = rel_err(&ri.grads[p], g);
            assert!(e < 1e-9, "{archive}: grad {p} differs by {e}");
        }
    }
}

/// The passes shard the imported graph as they shard the config build: every parameter
/// (MLA's projections, the router, the experts, the shared experts) gets the same
/// per-rank type on tp=2 and on ep=2.
#[test]
fn meshes_shard_every_parameter_as_for_the_config_build() {
    let (built, _, _) = load_fixture("deepseek_v3");
    for archive in [ARCHIVE, DECOMPOSED] {
        shards_as_the_config_build(&imported_from(archive), &built);
    }
}

fn shards_as_the_config_build(im: &Pt2Import, built: &weft_ir::Graph) {
    use weft_passes::training::TrainOptions;
    let shapes = |g: &weft_ir::Graph| -> Vec<(String, String)> {
        g.params()
            .into_iter()
            .map(|(n, v)| (n, g.ty(v).to_string()))
            .collect()
    };
    for mesh in ["tp=2", "ep=2"] {
        let (gi, _) = training_step(&im.graph, mesh, &TrainOptions::default()).unwrap();
        let (gb, _) = training_step(built, mesh, &TrainOptions::default()).unwrap();
        let (mut si, mut sb) = (shapes(&gi), shapes(&gb));
        si.sort();
        sb.sort();
        assert_eq!(si, sb, "{mesh}");
        let experts: Vec<&str> = si
            .iter()
            .filter(|(n, _)| n == "model.layers.1.mlp.experts.gate_up_proj")
            .map(|(_, t)| t.as_str())
            .collect();
        let want = if mesh == "tp=2" {
            "f32[8, 16, 32]"
        } else {
            "f32[8/ep, 32, 32]"
        };
        assert_eq!(experts, [want], "{mesh}");
    }
}

/// Without `--config` the rotary table is fitted from the exported cos/sin (f32, 4
/// features: the small frequency is loosely pinned by a cos near 1): one table with
/// theta 10000 for both, and the same model as with the config.
#[test]
fn without_the_config_the_rotary_table_is_fitted_exactly() {
    let im = import(&fixture("pt2").join(ARCHIVE), &Pt2Options::default())
        .unwrap_or_else(|e| panic!("deepseek_v3_batched without --config: {e}"));
    let tables: Vec<(f64, i64)> = ops_where(&im.graph, |op| match op {
        Op::RopeTable { theta, dim, .. } => Some((theta.0, *dim)),
        _ => None,
    });
    assert_eq!(tables, [(10000.0, 4)], "{}", im.report);
    let (_, _, inputs) = load_fixture("deepseek_v3");
    let with_config = imported();
    let (a, b) = (
        reference_run(&im.graph, &im.weights, &inputs),
        reference_run(&with_config.graph, &with_config.weights, &inputs),
    );
    assert_eq!(rel_err(&a.outputs["logits"], &b.outputs["logits"]), 0.0);
}

/// `archive` with one edit to its program JSON (`from` replaced once by `to`).
fn tampered(archive: &str, from: &str, to: &str) -> Vec<u8> {
    use std::io::{Read, Write};
    let bytes = std::fs::read(fixture("pt2").join(archive)).unwrap();
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

fn import_tampered(from: &str, to: &str) -> String {
    import_tampered_archive(ARCHIVE, from, to)
}

fn import_tampered_archive(archive: &str, from: &str, to: &str) -> String {
    let bytes = tampered(archive, from, to);
    match weft_frontends::pt2::import_bytes("deepseek_tampered", bytes, &options()) {
        Ok(_) => panic!("the archive with `{from}` -> `{to}` imported"),
        Err(e) => e.to_string(),
    }
}

/// Layer 0's key written as [0, 8) and [9, 12): the slices leave a column of the empty
/// tensor unwritten, so it is no `cat`; the import stops at `new_empty`.
#[test]
fn a_key_with_an_unwritten_column_is_refused() {
    let e = import_tampered(
        r#"{"name": "new_empty"}}, "kind": 1}, {"name": "dim", "arg": {"as_int": 3}, "kind": 1}, {"name": "start", "arg": {"as_int": 8}"#,
        r#"{"name": "new_empty"}}, "kind": 1}, {"name": "dim", "arg": {"as_int": 3}, "kind": 1}, {"name": "start", "arg": {"as_int": 9}"#,
    );
    assert!(
        e.contains("aten.new_empty.default") && e.contains("node `new_empty`"),
        "{e}"
    );
}

/// The kept-group mask scattered into ones instead of zeros would keep every group:
/// refused at the scatter.
#[test]
fn a_group_mask_scattered_into_ones_is_refused() {
    let e = import_tampered(
        "torch.ops.aten.zeros_like.default",
        "torch.ops.aten.ones_like.default",
    );
    assert!(
        e.contains("node `scatter_`") && e.contains("not all zeros"),
        "{e}"
    );
}

/// A rope taking every third feature of its 4 rotary features is no de-interleave:
/// refused at the slice.
#[test]
fn a_rope_slice_with_another_stride_is_refused() {
    let e = import_tampered(
        r#"{"name": "step", "arg": {"as_int": 2}"#,
        r#"{"name": "step", "arg": {"as_int": 3}"#,
    );
    assert!(
        e.contains("node `slice_7`") && e.contains("slice with step 3"),
        "{e}"
    );
}

/// In the decomposed archive, layer 0's second key write (`[..., 8:]`) scattered into
/// the fresh `empty` tensor instead of the one holding the first write: columns [0, 8)
/// are never written, and the first read of the key (its transpose for `bmm`) is
/// refused, naming the empty tensor and the unwritten columns.
#[test]
fn a_decomposed_key_with_unwritten_columns_is_refused() {
    let e = import_tampered_archive(
        DECOMPOSED,
        r#"{"name": "self", "arg": {"as_tensor": {"name": "slice_scatter"}}, "kind": 1}, {"name": "src", "arg": {"as_tensor": {"name": "copy_1"}}"#,
        r#"{"name": "self", "arg": {"as_tensor": {"name": "empty"}}, "kind": 1}, {"name": "src", "arg": {"as_tensor": {"name": "copy_1"}}"#,
    );
    assert!(
        e.contains("node `permute_8`")
            && e.contains("node `empty` (aten.empty.memory_format)")
            && e.contains("[0, 8) of dim 3 never written"),
        "{e}"
    );
}

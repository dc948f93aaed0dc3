//! `tensor-parallel` on the frontends' tiny presets: one snapshot per (model, mesh),
//! `tensor-parallel__<model>__<mesh>`, the unified diff the pass makes (after the
//! passes before it in the default pipeline) and its counters; plus the pipeline
//! order with sp and dp, idempotence and the text round trip.

mod util;
use util::*;

use weft_ir::*;
use weft_passes::*;

const MODELS: &[&str] = &["llama-tiny", "qwen3-tiny", "mixtral-tiny"];
const MESHES: &[(&str, &str)] = &[
    ("tp2", "tp=2"),
    ("tp3", "tp=3"),
    ("dp2-tp2", "dp=2,tp=2"),
    ("sp2-tp2", "sp=2,tp=2"),
];

fn compiled_until(model_name: &str, mesh: &str) -> (Graph, PassContext) {
    before_pass(model_name, mesh, "tensor-parallel").unwrap()
}

#[test]
fn snapshots() {
    for m in MODELS {
        for (tag, mesh) in MESHES {
            let (mut g, cx) = compiled_until(m, mesh);
            let text = diff_of(&mut g, &cx, "tensor-parallel");
            snapshot(&format!("tensor-parallel__{m}__{tag}"), &text);
        }
    }
}

#[test]
fn olmo2_whole_projection_norm_snapshot() {
    // q_norm/k_norm over the split projection: squares summed per rank, all-reduced.
    let (mut g, cx) = compiled_until("olmo2-tiny", "tp=2");
    let text = diff_of(&mut g, &cx, "tensor-parallel");
    snapshot("tensor-parallel__olmo2-tiny__tp2", &text);
}

#[test]
fn gemma3_unit_offset_qk_norm_snapshot() {
    // q_norm/k_norm read their weight through add_scalar(w, 1) on split heads: the
    // weights stay whole and their gradients are summed over tp.
    let (mut g, cx) = compiled_until("gemma3-tiny", "tp=2");
    let text = diff_of(&mut g, &cx, "tensor-parallel");
    snapshot("tensor-parallel__gemma3-tiny__tp2", &text);
    let q_norm = g
        .params()
        .into_iter()
        .find(|(n, _)| n == "model.layers.0.self_attn.q_norm.weight")
        .unwrap()
        .1;
    let why = g
        .node(g.def(q_norm))
        .meta
        .provenance
        .as_ref()
        .map(|p| p.reason.clone());
    assert!(
        why.as_deref().is_some_and(|w| w.contains("grad_allreduce")),
        "{why:?}"
    );
}

#[test]
fn idempotent_and_round_trips() {
    let (mut g, cx) = compiled_until("qwen3-tiny", "tp=3");
    let pass = lookup("tensor-parallel").unwrap();
    assert!(pass.run(&mut g, &cx).unwrap().changed);
    let once = g.clone();
    assert!(
        !pass.run(&mut g, &cx).unwrap().changed,
        "a second run changes nothing"
    );
    assert_eq!(g, once);
    verify(&g).unwrap();
    assert_eq!(parse(&print(&g)).unwrap(), g);
}

#[test]
fn pipeline_order_with_sp_and_dp() {
    let names = |m: &str| default_pipeline(&Mesh::parse(m).unwrap()).join(",");
    assert_eq!(names("tp=2"), "tensor-parallel,canonicalize");
    assert_eq!(
        names("dp=2,tp=2"),
        "shard-inputs,shard-seq,sp-loss,tensor-parallel,canonicalize"
    );
    assert!(names("sp=2,tp=2").contains("sp-loss,tensor-parallel,ulysses-attention"));
}

#[test]
fn layouts_record_everything_to_reshard() {
    let (mut g, cx) = compiled_until("qwen3-tiny", "tp=3");
    lookup("tensor-parallel").unwrap().run(&mut g, &cx).unwrap();
    let layouts = tp::param_layouts(
        &g,
        &[("lm_head.weight".into(), "model.embed_tokens.weight".into())],
    )
    .unwrap();
    let text = serde_json::to_string_pretty(&layouts).unwrap();
    insta::with_settings!({ prepend_module_to_snapshot => false, omit_expression => true }, {
        insta::assert_snapshot!("tensor-parallel__qwen3-tiny__tp3__layouts", text);
    });
}

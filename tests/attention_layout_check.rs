//! `fuse`'s head-layout rewrite (`attention`, `attention_grad` and `rope` reading and
//! writing [B, S, H, D], `layout=bshd`) never changes what a step computes, and leaves no
//! transpose around attention: the training steps of llama (GQA), mistral_sw4 (sliding
//! window, GQA) and gemma2 (soft-cap and window, GQA), alone, with checkpointing and
//! offload, with micro-batches and on sp=2,tp=2, give the same loss and gradients with
//! and without the rewrite on the CPU reference (f64 to 1e-10, f32 to 1e-4). An insta
//! snapshot pins the rewritten attention block of llama-tiny's compiled step, and the
//! attention FLOPs the cost model counts do not change.

mod common;
use common::*;

use weft_ir::{Graph, HeadLayout, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::Precision;

fn is_swap(op: &Op) -> bool {
    matches!(op, Op::Transpose { .. } | Op::Permute { .. })
}

/// The transposes (or permutes) that feed or read an attention, its gradient or a rope.
fn transposes_around_attention(g: &Graph) -> Vec<String> {
    let uses = g.uses();
    let mut found = Vec::new();
    for &n in g.nodes() {
        let d = g.node(n);
        if d.op.head_layout().is_none() {
            continue;
        }
        for &v in &d.operands {
            if is_swap(g.op_of(v)) {
                found.push(format!("{} feeds {}", g.describe(g.def(v)), g.describe(n)));
            }
        }
        for &r in &d.results {
            for &(m, _) in &uses[r.0 as usize] {
                if is_swap(&g.node(m).op) {
                    found.push(format!("{} reads {}", g.describe(m), g.describe(n)));
                }
            }
        }
    }
    found
}

fn count_layout(g: &Graph, name: &str, layout: HeadLayout) -> usize {
    g.nodes()
        .iter()
        .filter(|&&n| {
            let op = &g.node(n).op;
            op.name() == name && op.head_layout() == Some(layout)
        })
        .count()
}

/// The step of `fixture` with and without the rewrite: the same outputs on every
/// (mesh, options) case, and where the mesh is one rank, every attention, attention
/// gradient and rope in [B, S, H, D] with no transpose around them.
fn check_fixture(fixture: &str, layers: usize) {
    let (g, weights, inputs) = load_fixture(fixture);
    let cases: [(&str, TrainOptions); 5] = [
        ("", TrainOptions::default()),
        ("", checkpoint_and_offload()),
        ("", two_micro_batches()),
        ("sp=2,tp=2", TrainOptions::default()),
        ("sp=2,tp=2", checkpoint_and_offload()),
    ];
    for (mesh, opts) in cases {
        let what = case_name(fixture, mesh, &opts);
        let (before, _) = training_step(&g, mesh, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (after, counters) = fused(&before);
        if mesh.is_empty() {
            let attention = count_layout(&before, "attention", HeadLayout::Bhsd);
            let grads = count_layout(&before, "attention_grad", HeadLayout::Bhsd);
            assert!(attention >= layers && grads >= layers, "{what}");
            assert_eq!(
                counters["attention_bshd"] as usize,
                attention + grads,
                "{what}: {counters:?}"
            );
            for name in ["attention", "attention_grad", "rope"] {
                assert_eq!(
                    count_layout(&after, name, HeadLayout::Bhsd),
                    0,
                    "{what}: a `{name}` left in [B, H, S, D]"
                );
            }
            let left = transposes_around_attention(&after);
            assert!(left.is_empty(), "{what}: {left:#?}");
        }
        same_outputs(&what, &before, &after, &weights, &inputs, F64_AND_F32);
    }
}

#[test]
fn llama_gqa_attention_runs_in_bshd() {
    check_fixture("llama", 2);
}

#[test]
fn mistral_sliding_window_attention_runs_in_bshd() {
    check_fixture("mistral_sw4", 2);
}

#[test]
fn gemma2_softcap_window_attention_runs_in_bshd() {
    check_fixture("gemma2", 2);
}

#[test]
fn other_families_compute_the_same() {
    // sinks (gpt-oss), q/k norms (qwen3), MLA's partial rope (DeepSeek-V3), fused qkv
    // (phi3): wherever the rewrite applies, the step is unchanged.
    for fixture in ["gpt_oss", "qwen3", "deepseek_v3", "phi3", "olmo2"] {
        let (g, weights, inputs) = load_fixture(fixture);
        let (before, _) = training_step(&g, "", &TrainOptions::default())
            .unwrap_or_else(|e| panic!("{fixture}: {e}"));
        let (after, counters) = fused(&before);
        let what = format!("{fixture} ({counters:?})");
        same_outputs(
            &what,
            &before,
            &after,
            &weights,
            &inputs,
            &[(Precision::F64, 1e-10)],
        );
    }
}

#[test]
fn llama_tiny_step_loses_its_attention_transposes() {
    let (code, on, err) = weft(&["compile", "llama-tiny"]);
    assert_eq!(code, 0, "{err}");
    let (code, off, err) = weft(&["compile", "llama-tiny", "--fuse=false"]);
    assert_eq!(code, 0, "{err}");
    let transposes = |text: &str| text.matches("= transpose ").count();
    // per layer: q, k, v and the output forward, their mirrors backward
    assert_eq!(transposes(&off), 16, "{off}");
    assert_eq!(transposes(&on), 0, "{on}");
    // Where attention is sharded the rewrite applies or not, but never adds a transpose
    // (ring attention's blocks and Ulysses' all_to_alls keep [B, H, S, D]).
    for (mesh, want) in [("tp=2", 0), ("dp=2,tp=2", 0), ("sp=2", 16), ("cp=2", 16)] {
        let (code, on_mesh, err) = weft(&["compile", "llama-tiny", "--mesh", mesh]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(transposes(&on_mesh), want, "{mesh}:\n{on_mesh}");
    }
    // the lines of layer 0's attention scope (not its projections), in program order
    let block: Vec<&str> = on
        .lines()
        .filter(|l| {
            l.contains("# model.layers.0.self_attn ") || l.ends_with("# model.layers.0.self_attn")
        })
        .collect();
    insta::assert_snapshot!("attention_layout__llama_tiny_layer0", block.join("\n"));
}

#[test]
fn attention_flops_do_not_change_and_the_printed_layout_round_trips() {
    let (g, _, _) = load_fixture("llama");
    let (before, _) = training_step(&g, "", &TrainOptions::default()).unwrap();
    let (after, _) = fused(&before);
    let attention_flops = |g: &Graph| {
        g.nodes()
            .iter()
            .filter(|&&n| g.node(n).op.head_layout().is_some() && g.node(n).op.name() != "rope")
            .map(|&n| weft_ir::flops::node_flops(g, n))
            .fold(weft_ir::Dim::zero(), |a, b| a + b)
    };
    let bind = |d: weft_ir::Dim| {
        d.substitute("B", &weft_ir::Dim::constant(2))
            .substitute("S", &weft_ir::Dim::constant(64))
            .as_const()
    };
    assert_eq!(
        bind(attention_flops(&after)),
        bind(attention_flops(&before))
    );
    assert!(bind(attention_flops(&after)).is_some_and(|f| f > 0));
    let text = weft_ir::print(&after);
    assert!(text.contains("layout=bshd"));
    assert_eq!(
        weft_ir::parse(&text).unwrap(),
        after,
        "the rewritten step round-trips"
    );
}

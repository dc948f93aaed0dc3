//! Sliding-window attention reproduces HF: tiny random transformers models whose window
//! is shorter (or longer) than the 16-token sequence, per family and per layer
//! (tests/fixtures/make_window_fixtures.py), with uneven -100 labels. The training step
//! (autodiff's `attention_grad`) alone, on sp=2 (Ulysses) and on tp=2 gives HF's logits,
//! loss and every gradient to 1e-4 relative (logits and loss 1e-5).

mod common;
use common::*;

use weft_ir::{Dim, Graph, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::{run, Precision, RunOptions};

/// Every window fixture, with the window of each of its two layers.
const WINDOWED: &[(&str, [Option<i64>; 2])] = &[
    ("mistral_sw4", [Some(4), Some(4)]),
    ("mistral_sw13", [Some(13), Some(13)]),
    ("mistral_sw32", [Some(32), Some(32)]),
    ("phi3_sw5", [Some(5), Some(5)]),
    ("qwen2_mwl", [None, Some(3)]),
    ("qwen3_lt", [Some(6), None]),
    ("mixtral_sw5", [Some(5), Some(5)]),
    ("qwen3_moe_sw7", [Some(7), Some(7)]),
];

/// The window of each attention, in graph order.
fn windows(g: &Graph) -> Vec<Option<i64>> {
    ops_where(g, |op| match op {
        Op::Attention { window, .. } => Some(*window),
        _ => None,
    })
}

#[test]
fn config_windows_reach_every_layer() {
    for (fam, want) in WINDOWED {
        let (g, _, _) = load_fixture(fam);
        assert_eq!(windows(&g), want.to_vec(), "{fam}");
    }
}

#[test]
fn training_step_matches_hf_alone_and_on_sp2_and_tp2() {
    let mut report = Vec::new();
    for (fam, _) in WINDOWED {
        let (graph, weights, inputs) = load_fixture(fam);
        let reference = hf_reference(fam);
        // candle's autograd of the forward (the fused kernel's backward) first
        let fwd = reference_run(&graph, &weights, &inputs);
        assert_autograd_matches_hf(fam, &fwd, &reference);
        for mesh in ["", "sp=2", "tp=2"] {
            let what = format!("{fam} `{mesh}`");
            let opts = fixture_train_options();
            let (_, r) = run_training_step(&what, &graph, &weights, &inputs, mesh, &opts);
            let outs = ["logits", "loss"];
            let worst = assert_step_matches_hf(&what, &r, &reference, &outs, 1e-5, 1e-4);
            report.push(format!("{what}: worst rel err {worst:.1e}"));
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// The fixtures are not vacuous: the same model with full causal attention is far from
/// HF wherever the window is shorter than the sequence.
#[test]
fn without_the_window_the_short_ones_differ_from_hf() {
    for (fam, w) in WINDOWED {
        let (mut graph, weights, inputs) = load_fixture(fam);
        let reference = hf_reference(fam);
        edit_ops(&mut graph, |op| {
            if let Op::Attention { window, .. } = op {
                *window = None;
            }
        });
        let r = run(&graph, &weights, &inputs, &RunOptions::new(Precision::F64)).unwrap();
        let e = rel_err(&r.outputs["logits"], &reference["logits"]);
        let short = w.iter().flatten().any(|&w| w < 16);
        if short {
            assert!(e > 1e-3, "{fam}: full causal is within {e:e} of HF");
        } else {
            assert!(
                e < 1e-5,
                "{fam}: a window over the sequence changed the result ({e:e})"
            );
        }
    }
}

/// With Ulysses each rank holds whole sequences for its heads, so the band applies
/// unchanged: after the sp=2 pipeline every attention still has its window and sees the
/// full sequence `S` (its q, k, v come from all_to_alls, not gathers).
#[test]
fn ulysses_attention_keeps_the_band_over_the_whole_sequence() {
    let (graph, _, _) = load_fixture("qwen2_mwl");
    let (g, _) = training_step(&graph, "sp=2", &TrainOptions::default()).unwrap();
    let mut seen = Vec::new();
    for &n in g.nodes() {
        let d = g.node(n);
        if let Op::Attention { window, .. } = &d.op {
            seen.push(*window);
            for (i, &v) in d.operands.iter().take(3).enumerate() {
                assert_eq!(
                    g.ty(v).shape[2],
                    Dim::sym("S"),
                    "operand {i} of {}",
                    g.describe(n)
                );
                let def = g.node(g.def(v));
                assert!(
                    matches!(def.op, Op::AllToAll { .. }),
                    "operand {i} of {} comes from `{}`",
                    g.describe(n),
                    def.op.name()
                );
            }
        }
        if let Op::AttentionGrad { window, .. } = &d.op {
            seen.push(*window);
        }
    }
    // forward then backward of each layer (the backward's order is the graph's)
    assert_eq!(seen.iter().filter(|w| w.is_none()).count(), 2, "{seen:?}");
    assert_eq!(
        seen.iter().filter(|w| **w == Some(3)).count(),
        2,
        "{seen:?}"
    );
}

#[test]
fn presets_carry_their_windows() {
    for (preset, w) in [
        ("mistral-7b", Some(4096)),
        ("phi3-mini", Some(2047)),
        ("llama3-8b", None),
    ] {
        let m = weft_frontends::load(preset).unwrap();
        let ws = windows(&m.graph);
        assert!(
            !ws.is_empty() && ws.iter().all(|x| *x == w),
            "{preset}: {ws:?}"
        );
    }
}

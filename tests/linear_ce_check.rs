//! `linear-cross-entropy`: a training step whose logits are not an output fuses the
//! lm_head and the loss into `linear_cross_entropy` (chunked over the vocabulary, no
//! logits tensor). On the CPU reference runtime its loss and every gradient equal the
//! unsharded model's (candle's autograd, f64: 1e-10 loss, 1e-9 gradients) and the
//! unfused step's in f32 (1e-4), for llama, a tied model with Gemma 2's soft-cap and
//! Granite's logit scale, alone and on tp, sp, sp x tp and dp meshes.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{Graph, HostTensor, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

const MESHES: &[&str] = &["", "tp=2", "sp=2", "sp=2,tp=2", "dp=2"];

fn load(
    name: &str,
) -> (
    Graph,
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
) {
    load_fixture_batch4(name, |i, s| {
        [1, 2, 3, 6, 9].contains(&i) || (s + 12..2 * s).contains(&i)
    })
}

fn opts(fused: bool) -> TrainOptions {
    TrainOptions {
        fused_loss: fused,
        // 128 classes (64 per tp rank): several chunks, the last one partial.
        loss_chunk: Some(48),
        batch: Some(4),
        seq: Some(16),
        ..Default::default()
    }
}

/// The training step with the logits dropped (as `compile --train` does).
fn step(graph: &Graph, mesh: &str, fused: bool) -> Graph {
    let mut g = graph.clone();
    g.remove_output("logits");
    let (g, report) =
        training_step(&g, mesh, &opts(fused)).unwrap_or_else(|e| panic!("{mesh}: {e}"));
    weft_ir::verify(&g).unwrap_or_else(|r| panic!("{mesh}: {r}"));
    assert_eq!(
        weft_ir::parse(&weft_ir::print(&g)).unwrap(),
        g,
        "{mesh}: text round trip"
    );
    let count = |name: &str| {
        g.nodes()
            .iter()
            .filter(|&&n| g.node(n).op.name() == name)
            .count()
    };
    if fused {
        let stats = report
            .passes
            .iter()
            .find(|p| p.pass == weft_passes::linear_ce::NAME)
            .expect("the pass ran");
        assert_eq!(stats.counters["fused"], 1, "{mesh}: {:?}", stats.counters);
        assert_eq!(count("linear_cross_entropy"), 1, "{mesh}");
        assert_eq!(count("linear_cross_entropy_grad"), 1, "{mesh}");
        assert_eq!(
            count("cross_entropy") + count("cross_entropy_grad"),
            0,
            "{mesh}"
        );
        // No value anywhere has the (local) vocabulary as its last dim besides the
        // weight and its gradient: the logits are gone, forward and backward.
        let vocab = g.ty(g.node(lce_node(&g)).operands[1]).shape[0].clone();
        for &n in g.nodes() {
            if matches!(g.node(n).op, Op::Linear {}) {
                for &r in &g.node(n).results {
                    assert_ne!(
                        g.ty(r).shape.last(),
                        Some(&vocab),
                        "{mesh}: a linear still makes logits"
                    );
                }
            }
        }
    } else {
        assert_eq!(count("linear_cross_entropy"), 0, "{mesh}");
    }
    g
}

fn lce_node(g: &Graph) -> weft_ir::Node {
    *g.nodes()
        .iter()
        .find(|&&n| matches!(g.node(n).op, Op::LinearCrossEntropy { .. }))
        .unwrap()
}

fn grads(r: &RunResult) -> BTreeMap<String, HostTensor> {
    r.outputs
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|p| (p.to_string(), v.clone())))
        .collect()
}

fn check(fam: &str) {
    let (graph, weights, inputs) = load(fam);
    let reference = reference_run(&graph, &weights, &inputs);
    for mesh in MESHES {
        let fused = step(&graph, mesh, true);
        let r = run(&fused, &weights, &inputs, &RunOptions::new(Precision::F64))
            .unwrap_or_else(|e| panic!("{fam} {mesh}: {e}"));
        let e = rel_err(&r.outputs["loss"], &reference.outputs["loss"]);
        assert!(e < 1e-10, "{fam} {mesh}: loss rel err {e:e}");
        let got = grads(&r);
        assert_eq!(
            got.len(),
            reference.grads.len(),
            "{fam} {mesh}: gradient count"
        );
        for (p, want) in &reference.grads {
            let have = HostTensor::floats(want.dtype, want.shape.clone(), got[p].to_f64());
            let e = rel_err(&have, want);
            assert!(e < 1e-9, "{fam} {mesh}: grad {p} rel err {e:e}");
        }
        // f32: the fused step against the unfused one.
        let unfused = step(&graph, mesh, false);
        let f32 = |g: &Graph| {
            run(g, &weights, &inputs, &RunOptions::new(Precision::F32))
                .unwrap_or_else(|e| panic!("{fam} {mesh} f32: {e}"))
        };
        let (a, b) = (f32(&fused), f32(&unfused));
        for (k, want) in &b.outputs {
            let e = rel_err(&a.outputs[k], want);
            assert!(e < 1e-4, "{fam} {mesh} f32: {k} rel err {e:e}");
        }
    }
}

#[test]
fn llama_matches_the_unfused_model() {
    check("llama");
}

#[test]
fn gemma2_tied_with_final_softcap_matches() {
    check("gemma2");
}

#[test]
fn granite_logit_scale_matches() {
    check("granite");
}

/// Where the logits are an output (eval, check, `--grad-outputs` of them), nothing is
/// fused: the step still returns them.
#[test]
fn logits_that_are_an_output_stay() {
    let (graph, ..) = load("llama");
    let (g, _) = training_step(&graph, "tp=2", &opts(true)).unwrap();
    assert!(g.output("logits").is_some());
    assert!(!g
        .nodes()
        .iter()
        .any(|&n| matches!(g.node(n).op, Op::LinearCrossEntropy { .. })));
}

/// After `fuse`, the fused loss and its gradient are one `linear_cross_entropy_with_grad`
/// wherever the gradient's inputs do not depend on the statistics (one rank, sp, dp: the
/// logits are computed once), and stay two ops where tp splits the vocabulary (each
/// shard's gradient needs the global log-sum-exp). Either way the step's loss and every
/// gradient equal the unsharded model's on the CPU reference (f64).
#[test]
fn the_fused_loss_computes_its_gradient_with_the_forward() {
    for fam in ["llama", "gemma2"] {
        let (graph, weights, inputs) = load(fam);
        let reference = reference_run(&graph, &weights, &inputs);
        for mesh in MESHES {
            let (g, counters) = fused(&step(&graph, mesh, true));
            let count = |name: &str| {
                g.nodes()
                    .iter()
                    .filter(|&&n| g.node(n).op.name() == name)
                    .count()
            };
            let split = mesh.contains("tp=");
            assert_eq!(
                counters["linear_cross_entropy_with_grad"],
                u64::from(!split),
                "{fam} {mesh}: {counters:?}"
            );
            assert_eq!(count("linear_cross_entropy_with_grad"), usize::from(!split));
            assert_eq!(count("linear_cross_entropy_grad"), usize::from(split));
            assert_eq!(count("linear_cross_entropy"), usize::from(split));
            let r = run(&g, &weights, &inputs, &RunOptions::new(Precision::F64))
                .unwrap_or_else(|e| panic!("{fam} {mesh}: {e}"));
            let e = rel_err(&r.outputs["loss"], &reference.outputs["loss"]);
            assert!(e < 1e-10, "{fam} {mesh}: loss rel err {e:e}");
            let got = grads(&r);
            for (p, want) in &reference.grads {
                let have = got.get(p).unwrap_or_else(|| {
                    panic!("{fam} {mesh}: no gradient of {p}: {:?}", got.keys())
                });
                let have = HostTensor::floats(want.dtype, want.shape.clone(), have.to_f64());
                let e = rel_err(&have, want);
                assert!(e < 1e-9, "{fam} {mesh}: grad {p} rel err {e:e}");
            }
        }
    }
}

/// `weft compile --train` chooses the fused loss where it is predicted faster: the 1.24B
/// model's step on one rank, whose gradient `fuse` computes with the forward (on
/// llama-tiny the loss's few elementwise launches make the unfused step faster);
/// `--fused-loss` fuses over tp too, recomputing chunks; `--unfused-loss` keeps the
/// logits.
#[test]
fn cli_fuses_unless_told_not_to() {
    let (code, out, err) = weft(&["compile", "llama3.2-1b", "--seq", "4096", "--dtype", "bf16"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("= linear_cross_entropy_with_grad "), "{err}");
    let (code, out, err) = weft(&[
        "compile",
        "llama-tiny",
        "--seq",
        "16",
        "--mesh",
        "tp=2",
        "--fused-loss",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("= linear_cross_entropy_grad "), "{out}");
    let (code, out, err) = weft(&["compile", "llama-tiny", "--seq", "16", "--unfused-loss"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        !out.contains("linear_cross_entropy") && out.contains("cross_entropy_grad"),
        "{out}"
    );
}

/// Families the fused-loss fixtures above were not made from (qwen3, phi3, MoE mixtral and
/// DeepSeek-V3, gpt-oss), trained 3 AdamW steps by `weft run` on the CPU reference, alone
/// and on sp=2,tp=2: the fused loss gives the unfused loss at every step.
#[test]
fn other_families_train_the_same_with_the_fused_loss() {
    let losses = |m: &str, mesh: &str, loss: &str| -> Vec<f64> {
        let dir = format!("tests/fixtures/{m}");
        let inputs = format!("{dir}/inputs.safetensors");
        let (code, out, err) = weft(&[
            "run", &dir, "--inputs", &inputs, "--mesh", mesh, "--steps", "3", "--lr", "1e-2", loss,
            "--json",
        ]);
        assert_eq!(code, 0, "{m} {mesh} {loss}: {err}");
        let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
        doc["steps"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["loss"].as_f64())
            .collect()
    };
    for (m, mesh) in [
        ("qwen3", ""),
        ("phi3", ""),
        ("gpt_oss", ""),
        ("deepseek_v3", ""),
        ("qwen3", "sp=2,tp=2"),
        ("mixtral", "sp=2,tp=2"),
    ] {
        let (fused, unfused) = (
            losses(m, mesh, "--fused-loss"),
            losses(m, mesh, "--unfused-loss"),
        );
        assert_eq!(fused.len(), 3, "{m} {mesh}: {fused:?}");
        for (f, u) in fused.iter().zip(&unfused) {
            assert!(
                (f - u).abs() <= 1e-5 * u.abs(),
                "{m} {mesh}: {fused:?} vs {unfused:?}"
            );
        }
    }
}

/// ZeRO-3 gathers the lm_head weight again for the backward, micro-batches repeat the
/// pair and checkpointing recomputes x: the pair still fuses (once per micro-batch), and
/// `weft check` matches the unsharded model.
#[test]
fn zero3_micro_batches_and_checkpointing_fuse_the_loss_with_its_gradient() {
    for (flags, want) in [
        (&["--zero", "3", "--mesh", "dp=2,sp=2"][..], 1),
        (
            &["--zero", "3", "--mesh", "dp=2", "--micro-batches", "2"][..],
            2,
        ),
        (&["--checkpoint", "full", "--offload"][..], 1),
    ] {
        let base = ["llama-tiny", "--fused-loss", "--batch", "4", "--seq", "16"];
        let mut args = vec!["compile"];
        args.extend(base);
        args.extend(flags);
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{flags:?}: {err}");
        assert_eq!(
            out.matches("= linear_cross_entropy_with_grad ").count(),
            want,
            "{flags:?}"
        );
        let mut args = vec!["check", "--train"];
        args.extend(base);
        args.extend(flags);
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{flags:?}: {out}{err}");
    }
}

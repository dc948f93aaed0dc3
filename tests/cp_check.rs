//! Context parallelism (ring attention, `cp`) preserves meaning, checked by running it:
//! the CPU reference executes the unsharded model and the compiled SPMD program over
//! simulated ranks (f64), and the loss, logits and every gradient must agree to 1e-10.
//! The program after each pass is run too (shard-inputs and shard-seq keep it whole
//! with gathers and inverse zigzags until ring-attention replaces them).
//!
//! Labels include -100 spread unevenly, so the loss must be the global mean over valid
//! tokens whatever the zigzag puts on each rank.

mod common;
use common::*;

use weft_ir::{HostTensor, Mesh};
use weft_passes::{default_pipeline, lookup, PassContext};
use weft_runtime::cpu::RunResult;

fn case(name: &str) -> Case {
    let dir = fixture(name);
    let model =
        weft_frontends::load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    let ids = inputs["input_ids"].to_i64();
    let (b, s) = (inputs["input_ids"].shape[0], inputs["input_ids"].shape[1]);
    let mut labels = ids.clone();
    for i in [1, 2, 3, 6, 9] {
        labels[i] = -100;
    }
    for i in [2, 13, 14, 15] {
        labels[s + i] = -100;
    }
    inputs.insert(
        "labels".into(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], labels),
    );
    Case {
        graph: model.graph,
        weights,
        inputs,
    }
}

fn compare(what: &str, want: &RunResult, got: &RunResult) {
    for name in ["loss", "logits"] {
        assert_close(
            &format!("{what}: {name}"),
            &want.outputs[name],
            &got.outputs[name],
        );
    }
    for (p, g) in &want.grads {
        assert_close(&format!("{what}: grad {p}"), g, &got.grads[p]);
    }
}

/// Compiles fixture `name` for `mesh` pass by pass; runs after each pass when
/// `every_pass` (gradients after the last) against the unsharded reference.
fn check(name: &str, mesh: &str, every_pass: bool) -> weft_ir::Graph {
    let c = case(name);
    let reference = execute(&c.graph, &c, true);
    let cx = PassContext::new(Mesh::parse(mesh).unwrap());
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    let pipeline = default_pipeline(&cx.mesh);
    assert!(pipeline.contains(&"ring-attention"), "{pipeline:?}");
    for (i, pass) in pipeline.iter().enumerate() {
        lookup(pass)
            .unwrap()
            .run(&mut g, &cx)
            .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} after {pass}: {r}"));
        let last = i + 1 == pipeline.len();
        if every_pass || last {
            let got = execute(&g, &c, last);
            let mut want = reference.clone();
            if !last {
                want.grads.clear();
            }
            compare(&format!("{name} on {mesh} after {pass}"), &want, &got);
        }
    }
    let text = g.to_string();
    assert!(text.contains("ring_shift"), "no ring step in:\n{text}");
    // Only the logits output is gathered (zigzag order has no output split); no
    // attention reads a gathered sequence.
    for line in text.lines().filter(|l| l.contains("all_gather")) {
        assert!(!line.contains("self_attn"), "an attention gather is left: {line}");
    }
    g
}

#[test]
fn llama_cp2_every_pass() {
    check("llama", "cp=2", true);
}

#[test]
fn llama_cp4() {
    check("llama", "cp=4", false);
}

#[test]
fn llama_one_kv_head_cp4() {
    check("llama_kv1", "cp=4", false);
}

#[test]
fn llama_ulysses_in_ring_sp2_cp2() {
    check("llama", "cp=2,sp=2", true);
    check("llama_kv1", "cp=2,sp=2", false);
}

#[test]
fn llama_dp2_cp2() {
    check("llama", "dp=2,cp=2", false);
}

#[test]
fn llama_cp2_tp2() {
    check("llama", "cp=2,tp=2", false);
}

#[test]
fn mixtral_cp2_ep2() {
    check("mixtral", "cp=2,ep=2", false);
}

#[test]
fn sliding_window_cp2_cp4() {
    // A 4-key window at 16 tokens: the band cuts blocks of every ring step.
    check("mistral_sw4", "cp=2", false);
    check("mistral_sw4", "cp=4", false);
    check("mixtral_sw5", "cp=2,sp=2", false);
}

#[test]
fn qwen3_qk_norm_cp2() {
    check("qwen3", "cp=2", false);
    check("qwen3_moe", "cp=2,sp=2", false);
}

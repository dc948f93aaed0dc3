//! `weft check --train` on programs whose gradients include some that are zero in
//! theory: rounding noise on both sides, which a purely relative error called a
//! failure (inf or ~2). With the floor tied to the largest gradient
//! (weft_ir::tensor::NOISE_FLOOR) they pass and are named as noise-level.

mod common;
use common::*;
use std::collections::BTreeMap;
use weft_ir::{DType, HostTensor};

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("weft-noise-floor-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn noise_level(v: &serde_json::Value) -> Vec<String> {
    v["noise_level_grads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn top1_routing_has_a_zero_router_gradient() {
    // Top-1 routing renormalised: the weight is p/p = 1, so the router gets no gradient.
    let dir = temp_dir("top1");
    let p = weft_frontends::presets::find_preset("mixtral-tiny").unwrap();
    let mut v: serde_json::Value = serde_json::from_str(p.config_json).unwrap();
    v["num_experts_per_tok"] = 1.into();
    // Without the auxiliary loss, which does reach the router.
    v["output_router_logits"] = false.into();
    let config = dir.join("config.json");
    std::fs::write(&config, v.to_string()).unwrap();
    for mesh in ["", "ep=2", "sp=2"] {
        let (code, out, err) = weft(&[
            "check",
            config.to_str().unwrap(),
            "--train",
            "--json",
            "--mesh",
            mesh,
            "--batch",
            "2",
            "--seq",
            "16",
        ]);
        assert_eq!(code, 0, "mesh `{mesh}`: {err}\n{out}");
        let v = json(&out);
        assert_eq!(v["ok"], true);
        assert_eq!(
            noise_level(&v),
            [
                "model.layers.0.mlp.gate.weight",
                "model.layers.1.mlp.gate.weight"
            ],
            "mesh `{mesh}`"
        );
    }
}

#[test]
fn only_the_first_target_valid_gives_zero_query_and_key_gradients() {
    // The one target is predicted at position 0, whose attention has a single key:
    // the softmax is 1 whatever q.k is, so q_proj and k_proj get no gradient.
    let dir = temp_dir("first-label");
    let given =
        weft_frontends::read_safetensors(&fixture("llama").join("inputs.safetensors")).unwrap();
    let ids = &given["input_ids"];
    let mut labels = vec![-100i64; ids.numel()];
    labels[1] = ids.to_i64()[1];
    let inputs = dir.join("inputs.safetensors");
    weft_frontends::save_safetensors(
        &inputs,
        &BTreeMap::from([
            ("input_ids".to_string(), ids.clone()),
            (
                "labels".to_string(),
                HostTensor::ints(DType::I64, ids.shape.clone(), labels),
            ),
        ]),
    )
    .unwrap();
    let (code, out, err) = weft(&[
        "check",
        "tests/fixtures/llama",
        "--inputs",
        inputs.to_str().unwrap(),
        "--train",
        "--mesh",
        "sp=2",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(
        out.contains("noise-level gradients (reference below 1e-3 of the largest gradient, errors measured against that floor): model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.q_proj.weight, model.layers.1.self_attn.k_proj.weight, model.layers.1.self_attn.q_proj.weight"),
        "{out}"
    );
}

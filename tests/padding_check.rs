//! HF's `nn.Embedding(padding_idx=pad_token_id)`: the padding row gets no gradient.
//! The `llama_pad` fixture (tests/fixtures/make_padding_fixture.py: pad_token_id 5,
//! row 1 right-padded, a pad token inside row 0, a random non-zero padding row) matches
//! HF's logits, loss and every gradient alone and on sp=2, tp=2 (vocab-parallel
//! embedding: the padding row is on one rank) and dp=2, from config.json and from the
//! `.pt2` export (`aten.embedding`'s padding_idx).

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{Dim, Graph, HostTensor, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::{run, Precision, RunOptions};

const PAD: i64 = 5;
const MESHES: &[&str] = &["", "sp=2", "tp=2", "dp=2", "sp=2,tp=2"];

fn padding_idx(g: &Graph) -> Vec<Option<Dim>> {
    g.nodes()
        .iter()
        .filter_map(|&n| match &g.node(n).op {
            Op::Embedding { padding_idx } => Some(padding_idx.clone()),
            _ => None,
        })
        .collect()
}

fn pt2_import() -> weft_frontends::pt2::Pt2Import {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    weft_frontends::pt2::import(
        &root.join("tests/fixtures/pt2/llama_pad.pt2"),
        &weft_frontends::pt2::Pt2Options {
            config: Some(fixture("llama_pad").join("config.json")),
            ..Default::default()
        },
    )
    .unwrap()
}

/// The training step of `graph` on every mesh gives HF's outputs and gradients.
fn matches_hf_on_every_mesh(
    what: &str,
    graph: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
) -> Vec<String> {
    let reference =
        weft_frontends::read_safetensors(&fixture("llama_pad").join("reference.safetensors"))
            .unwrap();
    let mut report = Vec::new();
    for mesh in MESHES {
        let opts = TrainOptions {
            batch: Some(2),
            seq: Some(16),
            bucket_bytes: 16_384,
            ..Default::default()
        };
        let (g, _) =
            training_step(graph, mesh, &opts).unwrap_or_else(|e| panic!("{what} `{mesh}`: {e}"));
        let r = run(&g, weights, inputs, &RunOptions::new(Precision::F64))
            .unwrap_or_else(|e| panic!("{what} `{mesh}`: {e}"));
        let mut worst: f64 = 0.0;
        for out in ["logits", "loss"] {
            let e = rel_err(&r.outputs[out], &reference[out]);
            assert!(e < 1e-5, "{what} `{mesh}`: {out} rel err {e:e}");
            worst = worst.max(e);
        }
        let mut count = 0;
        for (k, v) in &r.outputs {
            let Some(p) = k.strip_prefix("grad.") else {
                continue;
            };
            let want = &reference[&format!("grad.{p}")];
            let have = HostTensor::floats(want.dtype, want.shape.clone(), v.to_f64());
            let e = rel_err(&have, want);
            assert!(e < 1e-4, "{what} `{mesh}`: grad {p} rel err {e:e}");
            worst = worst.max(e);
            count += 1;
            if p == "model.embed_tokens.weight" {
                let h = have.shape[1];
                let row = &have.to_f64()[PAD as usize * h..(PAD as usize + 1) * h];
                assert!(
                    row.iter().all(|&x| x == 0.0),
                    "{what} `{mesh}`: the padding row's gradient is not zero"
                );
            }
        }
        assert_eq!(
            count,
            reference.keys().filter(|k| k.starts_with("grad.")).count(),
            "{what} `{mesh}`: gradient count"
        );
        report.push(format!("{what} `{mesh}`: worst rel err {worst:.1e}"));
    }
    report
}

#[test]
fn config_build_matches_hf_alone_and_on_every_mesh() {
    let (graph, weights, inputs) = load_fixture("llama_pad");
    assert_eq!(padding_idx(&graph), vec![Some(Dim::from(PAD))]);
    let report = matches_hf_on_every_mesh("config", &graph, &weights, &inputs);
    eprintln!("{}", report.join("\n"));
}

#[test]
fn pt2_import_matches_hf_alone_and_on_every_mesh() {
    let imported = pt2_import();
    assert_eq!(padding_idx(&imported.graph), vec![Some(Dim::from(PAD))]);
    let (_, _, inputs) = load_fixture("llama_pad");
    let report = matches_hf_on_every_mesh("pt2", &imported.graph, &imported.weights, &inputs);
    eprintln!("{}", report.join("\n"));
}

/// The fixture is not vacuous: without padding_idx the padding row gets a gradient
/// (its tokens are in the inputs) and the embedding gradient is far from HF's.
#[test]
fn padding_idx_matters() {
    let (mut graph, weights, inputs) = load_fixture("llama_pad");
    for n in graph.nodes().to_vec() {
        if let Op::Embedding { padding_idx } = &mut graph.node_mut(n).op {
            *padding_idx = None;
        }
    }
    let reference =
        weft_frontends::read_safetensors(&fixture("llama_pad").join("reference.safetensors"))
            .unwrap();
    let r = reference_run(&graph, &weights, &inputs);
    let name = "model.embed_tokens.weight";
    let e = rel_err(&r.grads[name], &reference[&format!("grad.{name}")]);
    assert!(
        e > 1e-3,
        "without padding_idx the gradient is within {e:e} of HF"
    );
}

#[test]
fn tensor_parallel_puts_the_padding_row_on_one_rank() {
    let (graph, _, _) = load_fixture("llama_pad");
    let (g, _) = training_step(&graph, "tp=2", &TrainOptions::default()).unwrap();
    // vocab 128 over 2 ranks: row 5 is rank 0's row 5; rank 1 holds none (its row count).
    assert_eq!(
        padding_idx(&g),
        vec![Some(Dim::per_rank("tp", vec![PAD, 64]))]
    );
    let text = weft_ir::print(&g);
    let back = weft_ir::parse(&text).unwrap();
    assert_eq!(weft_ir::print(&back), text);
}

fn config_with(extra: &str, model_type: &str) -> Result<weft_frontends::ModelConfig, String> {
    let text = format!(
        r#"{{"model_type": "{model_type}", "vocab_size": 100, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0{extra}}}"#
    );
    weft_frontends::ModelConfig::from_json_str(&text, "config.json").map_err(|e| e.to_string())
}

#[test]
fn pad_token_id_follows_each_config_class() {
    let pad = |extra: &str, ty: &str| config_with(extra, ty).unwrap().padding_idx;
    assert_eq!(pad(r#", "pad_token_id": 7"#, "llama"), Some(7));
    assert_eq!(pad("", "llama"), None);
    assert_eq!(pad(r#", "pad_token_id": null"#, "olmo2"), None);
    // The classes' defaults where the key is absent.
    assert_eq!(pad("", "olmo2"), Some(1));
    // torch counts a negative padding_idx from the end.
    assert_eq!(pad(r#", "pad_token_id": -1"#, "mistral"), Some(99));
    for (extra, ty) in [(r#", "pad_token_id": 100"#, "llama"), ("", "phi3")] {
        let e = config_with(extra, ty).unwrap_err();
        assert!(
            e.contains("pad_token_id") && e.contains("100 rows"),
            "{ty} {extra}: {e}"
        );
    }
}

#[test]
fn autograd_reference_skips_the_padding_row() {
    // `weft check` compares the backward graph with candle's autograd of the unsharded
    // model; that autograd must give the padding row no gradient either (it gave it
    // the pad tokens' gradient, and `check --train` failed on any batch holding one).
    let (graph, weights, inputs) = load_fixture("llama_pad");
    let reference =
        weft_frontends::read_safetensors(&fixture("llama_pad").join("reference.safetensors"))
            .unwrap();
    let r = reference_run(&graph, &weights, &inputs);
    assert_autograd_matches_hf("llama_pad autograd", &r, &reference);
    // Random tokens over 128 rows, 128 of them: the pad token (5) is among them.
    for mesh in ["", "dp=2", "tp=2"] {
        let (code, out, err) = weft(&[
            "check",
            "tests/fixtures/llama_pad",
            "--mesh",
            mesh,
            "--train",
            "--seq",
            "64",
            "--batch",
            "2",
            "--json",
        ]);
        assert_eq!(code, 0, "check --train on `{mesh}`: {out}{err}");
        assert_eq!(json(&out)["ok"], true, "{out}");
    }
}

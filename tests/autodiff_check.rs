//! The backward graph `autodiff` writes computes the gradients: its `grad.<param>`
//! outputs, executed on the CPU reference runtime, equal candle's autograd over the
//! unsharded forward (f64, 1e-9 relative) and the PyTorch reference gradients of every
//! fixture (1e-4), on one rank and on every sp/dp mesh the forward passes cover.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{DType, Graph, HostTensor, Mesh};
use weft_passes::{default_pipeline, lookup, run_pipeline, PassContext};
use weft_runtime::cpu::RunResult;

#[path = "../passes/tests/common/mod.rs"]
mod llama_graph;

fn case(name: &str, uneven_labels: bool) -> Case {
    let dir = fixture(name);
    let model =
        weft_frontends::load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap();
    let mut inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    if uneven_labels {
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
            HostTensor::ints(DType::I64, vec![b, s], labels),
        );
    }
    Case {
        graph: model.graph,
        weights,
        inputs,
    }
}

/// The joint graph's gradient outputs, keyed by param name.
fn graph_grads(r: &RunResult) -> BTreeMap<String, HostTensor> {
    r.outputs
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|p| (p.to_string(), v.clone())))
        .collect()
}

fn differentiate(g: &mut Graph, mesh: &Mesh) {
    let cx = PassContext::new(mesh.clone());
    lookup("autodiff")
        .unwrap()
        .run(g, &cx)
        .unwrap_or_else(|e| panic!("autodiff on {}: {e}", g.name));
    weft_ir::verify(g).unwrap_or_else(|r| panic!("{} after autodiff: {r}", g.name));
    let text = weft_ir::print(g);
    assert_eq!(weft_ir::parse(&text).unwrap(), *g, "joint graph round trip");
}

/// Checks the joint graph for `mesh` against candle's autograd over the unsharded model:
/// after autodiff, and after grad-sync with several buckets (all_reduce, then ZeRO's
/// reduce_scatter).
fn check(name: &str, c: &Case, mesh: &str) {
    let reference = execute(&c.graph, c, true);
    let mesh = Mesh::parse(mesh).unwrap();
    let mut g = c.graph.clone();
    run_pipeline(
        &mut g,
        &PassContext::new(mesh.clone()),
        &default_pipeline(&mesh),
    )
    .unwrap();
    differentiate(&mut g, &mesh);
    let mut variants = vec![("autodiff".to_string(), g.clone())];
    for (bucket, zero) in [(4096u64, false), (1 << 30, false), (4096, true)] {
        let mut cx = PassContext::new(mesh.clone());
        cx.options.train.bucket_bytes = bucket;
        cx.options.train.reduce_scatter = zero;
        let mut h = g.clone();
        lookup("grad-sync")
            .unwrap()
            .run(&mut h, &cx)
            .unwrap_or_else(|e| panic!("grad-sync on {name}: {e}"));
        weft_ir::verify(&h).unwrap_or_else(|r| panic!("{name} after grad-sync: {r}"));
        variants.push((format!("grad-sync bucket={bucket} zero={zero}"), h));
    }
    for (what, g) in &variants {
        let got = execute(g, c, false);
        let grads = graph_grads(&got);
        assert_eq!(
            grads.len(),
            reference.grads.len(),
            "{name} {mesh} {what}: one gradient per param"
        );
        for out in ["loss", "logits"] {
            let e = rel_err(&got.outputs[out], &reference.outputs[out]);
            assert!(e < 1e-10, "{name} {mesh} {what}: {out} rel err {e}");
        }
        for (p, want) in &reference.grads {
            let e = rel_err(&grads[p], want);
            assert!(e < 1e-9, "{name} on {mesh} {what}: grad {p} rel err {e:e}");
        }
    }
}

#[test]
fn every_family_matches_pytorch_gradients_on_one_rank() {
    let mut report = Vec::new();
    for fam in FIXTURE_FAMILIES {
        let c = case(fam, false);
        let dir = fixture(fam);
        let reference =
            weft_frontends::read_safetensors(&dir.join("reference.safetensors")).unwrap();
        let mut g = c.graph.clone();
        differentiate(&mut g, &Mesh::default());
        let r = execute(&g, &c, false);
        let grads = graph_grads(&r);
        let mut worst: f64 = 0.0;
        for (k, want) in reference.iter().filter(|(k, _)| k.starts_with("grad.")) {
            let have = grads
                .get(&k["grad.".len()..])
                .unwrap_or_else(|| panic!("{fam}: no gradient output {k}"));
            worst = worst.max(rel_err(have, want));
        }
        assert_eq!(
            grads.len(),
            reference.keys().filter(|k| k.starts_with("grad.")).count(),
            "{fam}: gradient count"
        );
        report.push(format!("{fam}: grads {worst:.1e}"));
        assert!(worst < 1e-4, "{fam}: grads {worst}");
        // And candle's autograd on the same graph, tightly.
        let auto = execute(&c.graph, &c, true);
        for (p, want) in &auto.grads {
            let e = rel_err(&grads[p], want);
            assert!(e < 1e-9, "{fam}: grad {p} vs autograd rel err {e:e}");
        }
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn sequence_parallel_llama() {
    let c = case("llama", true);
    for mesh in ["sp=2", "sp=4", "dp=2,sp=2", "dp=2"] {
        check("llama", &c, mesh);
    }
}

#[test]
fn sequence_parallel_other_families() {
    for (fam, meshes) in [
        ("llama_kv1", &["sp=4"][..]),
        ("qwen3", &["sp=4", "dp=2,sp=2"][..]),
        ("qwen2", &["sp=2"][..]),
        ("phi3", &["sp=4"][..]),
        ("mixtral", &["sp=2", "dp=2,sp=2"][..]),
        ("qwen3_moe", &["sp=4"][..]),
    ] {
        let c = case(fam, true);
        for mesh in meshes {
            check(fam, &c, mesh);
        }
    }
}

#[test]
fn data_parallel_every_family() {
    for fam in FIXTURE_FAMILIES {
        let c = case(fam, true);
        check(fam, &c, "dp=2");
    }
}

#[test]
fn variants_mask_position_ids_mean_loss() {
    for cfg in [
        llama_graph::Config {
            mask: true,
            ..llama_graph::Config::llama_tiny()
        },
        llama_graph::Config {
            position_ids: true,
            ..llama_graph::Config::llama_tiny()
        },
        llama_graph::Config {
            mean_loss: true,
            ..llama_graph::Config::llama_tiny()
        },
        llama_graph::Config {
            qk_norm: true,
            ..llama_graph::Config::llama_tiny()
        },
    ] {
        let graph = llama_graph::build(&cfg);
        let model = weft_frontends::Model::from_graph(
            graph,
            weft_frontends::Origin::Preset(cfg.name.clone()),
        )
        .unwrap();
        let weights = weft_frontends::random_weights(&model, 7);
        let (b, s) = (2usize, 16usize);
        let ids: Vec<i64> = (0..b * s).map(|i| ((i * 37 + 5) % 127) as i64).collect();
        let labels: Vec<i64> = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                if [0, 5, 6, 7, 20, 29].contains(&i) {
                    -100
                } else {
                    t
                }
            })
            .collect();
        let mut inputs = BTreeMap::new();
        inputs.insert(
            "input_ids".to_string(),
            HostTensor::ints(DType::I64, vec![b, s], ids),
        );
        inputs.insert(
            "labels".to_string(),
            HostTensor::ints(DType::I64, vec![b, s], labels),
        );
        if cfg.mask {
            let m: Vec<i64> = (0..b * s * s)
                .map(|k| {
                    if (k / s) % s == k % s {
                        1
                    } else {
                        (k % 3 != 0) as i64
                    }
                })
                .collect();
            inputs.insert(
                "attention_mask".to_string(),
                HostTensor::ints(DType::Bool, vec![b, 1, s, s], m),
            );
        }
        if cfg.position_ids {
            let p: Vec<i64> = (0..b * s)
                .map(|k| (k % s) as i64 + if k < s { 3 } else { 0 })
                .collect();
            inputs.insert(
                "position_ids".to_string(),
                HostTensor::ints(DType::I64, vec![b, s], p),
            );
        }
        let c = Case {
            graph: model.graph,
            weights,
            inputs,
        };
        for mesh in ["", "sp=4", "dp=2,sp=2"] {
            check(&cfg.name, &c, mesh);
        }
    }
}

#[test]
fn tensor_parallel() {
    for (fam, meshes) in [
        (
            "llama",
            &["tp=2", "tp=3", "tp=4", "dp=2,tp=2", "sp=2,tp=2"][..],
        ),
        ("llama_kv1", &["tp=2"][..]),
        ("qwen3", &["tp=2"][..]),
        ("qwen2", &["tp=2"][..]),
        ("phi3", &["tp=2"][..]),
        ("mixtral", &["tp=2"][..]),
    ] {
        let c = case(fam, true);
        for mesh in meshes {
            check(fam, &c, mesh);
        }
    }
}

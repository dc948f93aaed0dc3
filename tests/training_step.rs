//! A whole training step (forward, autodiff, grad-sync, optimizer) on the CPU runtime:
//! the update equals AdamW/SGD applied to the reference gradients, every mesh and ZeRO
//! stage gives the one-rank update, mixed precision keeps f32 master weights, and
//! repeated steps on a fixed batch lower the loss.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{DType, Graph, HostTensor};
use weft_passes::training::{Optimizer, TrainOptions};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

#[path = "../passes/tests/common/mod.rs"]
mod llama_graph;

fn case(name: &str) -> Case {
    let dir = fixture(name);
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap();
    let inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    Case {
        graph: model.graph,
        weights,
        inputs,
    }
}

fn compile(c: &Case, mesh: &str, opts: &TrainOptions) -> Graph {
    training_step(&c.graph, mesh, opts)
        .unwrap_or_else(|e| panic!("{mesh}: {e}"))
        .0
}

/// Runs one step from `weights` (plus the state it needs), with step number `step`.
fn step(
    g: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
    step: usize,
) -> RunResult {
    let mut w = weights.clone();
    w.extend(weft_passes::optimizer::initial_state(g, weights).unwrap());
    let mut i = inputs.clone();
    i.insert(
        "optim.step".into(),
        HostTensor::floats(DType::F32, vec![], vec![step as f64]),
    );
    run(g, &w, &i, &RunOptions::new(Precision::F64))
        .unwrap_or_else(|e| panic!("{} on {}: {e}", g.name, g.mesh))
}

fn adamw_opts(zero: u8) -> TrainOptions {
    TrainOptions {
        optimizer: Some(Optimizer::adamw(1e-2)),
        zero1: zero >= 1,
        reduce_scatter: zero >= 2,
        bucket_bytes: 4096,
        ..Default::default()
    }
}

#[test]
fn adamw_step_applies_the_reference_gradients() {
    let c = case("llama");
    let reference = run(
        &c.graph,
        &c.weights,
        &c.inputs,
        &RunOptions::new(Precision::F64).with_grads(true),
    )
    .unwrap();
    let g = compile(&c, "", &adamw_opts(0));
    let r = step(&g, &c.weights, &c.inputs, 1);
    let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.999, 1e-8, 0.01);
    for (name, w) in &c.weights {
        let gr = reference.grads[name].to_f64();
        let want: Vec<f64> = w
            .to_f64()
            .iter()
            .zip(&gr)
            .map(|(&p, &gv)| {
                let p = p * (1.0 - lr * wd);
                let (m, v) = ((1.0 - b1) * gv, (1.0 - b2) * gv * gv);
                p - lr * (m / (1.0 - b1)) / ((v / (1.0 - b2)).sqrt() + eps)
            })
            .collect();
        let got = &r.outputs[&format!("param.{name}")];
        let e = rel_err(got, &HostTensor::floats(w.dtype, w.shape.clone(), want));
        assert!(e < 1e-9, "param.{name}: rel err {e:e}");
        let m = &r.outputs[&format!("optim.m.{name}")];
        let want_m: Vec<f64> = gr.iter().map(|g| (1.0 - b1) * g).collect();
        assert!(
            rel_err(m, &HostTensor::floats(DType::F32, w.shape.clone(), want_m)) < 1e-9,
            "optim.m.{name}"
        );
    }
}

#[test]
fn every_mesh_and_zero_stage_gives_the_one_rank_update() {
    let c = case("llama");
    let one = step(&compile(&c, "", &adamw_opts(0)), &c.weights, &c.inputs, 1);
    for (mesh, zero) in [
        ("dp=2", 0),
        ("dp=2", 1),
        ("dp=2", 2),
        ("sp=2", 0),
        ("dp=2,sp=2", 1),
        ("dp=2,sp=2", 2),
        ("tp=2", 0),
        ("dp=2,tp=2", 1),
    ] {
        let g = compile(&c, mesh, &adamw_opts(zero));
        weft_ir::verify(&g).unwrap();
        let r = step(&g, &c.weights, &c.inputs, 1);
        for (k, want) in one
            .outputs
            .iter()
            .filter(|(k, _)| k.starts_with("param.") || k == &"loss")
        {
            let e = rel_err(&r.outputs[k], want);
            assert!(e < 1e-9, "{mesh} zero={zero}: {k} rel err {e:e}");
        }
        for (k, want) in one.outputs.iter().filter(|(k, _)| k.starts_with("optim.")) {
            // ZeRO keeps states flat (padded to a multiple of the group, blocked by
            // tp shard): back in the parameter's layout.
            let have = weft_passes::optimizer::state_as_param(&g, k, &r.outputs[k], &want.shape)
                .unwrap_or_else(|e| panic!("{mesh} zero={zero}: {k}: {e}"));
            let e = rel_err(&have, want);
            assert!(e < 1e-9, "{mesh} zero={zero}: {k} rel err {e:e}");
        }
    }
}

/// The tiny llama with bf16 parameters, random weights and one fixed batch.
fn bf16_llama_tiny() -> Case {
    let cfg = llama_graph::Config {
        dtype: DType::BF16,
        ..llama_graph::Config::llama_tiny()
    };
    let graph = llama_graph::build(&cfg);
    let model =
        weft_frontends::Model::from_graph(graph, weft_frontends::Origin::Preset(cfg.name.clone()))
            .unwrap();
    let weights = weft_frontends::random_weights(&model, 3);
    let (b, s) = (2usize, 8usize);
    let ids: Vec<i64> = (0..b * s).map(|i| ((i * 31 + 7) % 128) as i64).collect();
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "input_ids".to_string(),
        HostTensor::ints(DType::I64, vec![b, s], ids.clone()),
    );
    inputs.insert(
        "labels".to_string(),
        HostTensor::ints(DType::I64, vec![b, s], ids),
    );
    Case {
        graph: model.graph,
        weights,
        inputs,
    }
}

#[test]
fn bf16_params_keep_f32_master_weights() {
    let c = bf16_llama_tiny();
    for (mesh, zero) in [("", 0u8), ("dp=2", 1)] {
        let g = compile(&c, mesh, &adamw_opts(zero));
        let masters: Vec<String> = g
            .params()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.starts_with("optim.master."))
            .collect();
        assert_eq!(
            masters.len(),
            c.weights.len(),
            "{mesh}: one master weight per bf16 param"
        );
        let r = step(&g, &c.weights, &c.inputs, 1);
        for name in c.weights.keys() {
            assert_eq!(r.outputs[&format!("param.{name}")].dtype, DType::BF16);
            assert_eq!(r.outputs[&format!("optim.master.{name}")].dtype, DType::F32);
        }
    }
}

#[test]
fn bf16_adamw_without_master_weights_applies_the_reference_gradients() {
    // torch.optim.AdamW on a bf16 model (`--torch-adamw`): the update on the parameter
    // itself, states in bf16, placed in the backward; one step against AdamW computed
    // here from the unsharded run's gradients, and the same update with master weights.
    let c = bf16_llama_tiny();
    let reference = run(
        &c.graph,
        &c.weights,
        &c.inputs,
        &RunOptions::new(Precision::F64).with_grads(true),
    )
    .unwrap();
    let opts = TrainOptions {
        master_weights: false,
        ..adamw_opts(0)
    };
    let g = compile(&c, "", &opts);
    assert!(!g
        .params()
        .iter()
        .any(|(n, _)| n.starts_with("optim.master.")));
    let r = step(&g, &c.weights, &c.inputs, 1);
    let mixed = step(&compile(&c, "", &adamw_opts(0)), &c.weights, &c.inputs, 1);
    let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.999, 1e-8, 0.01);
    for (name, w) in &c.weights {
        let gr = reference.grads[name].to_f64();
        let want: Vec<f64> = w
            .to_f64()
            .iter()
            .zip(&gr)
            .map(|(&p, &gv)| {
                let p = p * (1.0 - lr * wd);
                let (m, v) = ((1.0 - b1) * gv, (1.0 - b2) * gv * gv);
                p - lr * (m / (1.0 - b1)) / ((v / (1.0 - b2)).sqrt() + eps)
            })
            .collect();
        let got = &r.outputs[&format!("param.{name}")];
        assert_eq!(got.dtype, DType::BF16);
        assert_eq!(r.outputs[&format!("optim.m.{name}")].dtype, DType::BF16);
        let e = rel_err(got, &HostTensor::floats(w.dtype, w.shape.clone(), want));
        assert!(e < 1e-9, "param.{name}: rel err {e:e}");
        let e = rel_err(got, &mixed.outputs[&format!("param.{name}")]);
        assert!(e < 1e-9, "param.{name} vs master weights: rel err {e:e}");
    }
}

/// Steps `n` times on one batch, feeding each step's updated params and state back.
fn train(c: &Case, mesh: &str, opts: &TrainOptions, n: usize) -> Vec<f64> {
    let g = compile(c, mesh, opts);
    let mut w = c.weights.clone();
    w.extend(weft_passes::optimizer::initial_state(&g, &c.weights).unwrap());
    let mut losses = Vec::new();
    for k in 1..=n {
        let r = step(&g, &w, &c.inputs, k);
        losses.push(r.outputs["loss"].to_f64()[0]);
        for (name, t) in &r.outputs {
            if let Some(p) = name.strip_prefix("param.") {
                w.insert(p.to_string(), t.clone());
            } else if name.starts_with("optim.") {
                w.insert(name.clone(), t.clone());
            }
        }
    }
    losses
}

#[test]
fn the_loss_falls_on_a_fixed_batch() {
    let c = case("llama");
    for (mesh, opts) in [
        (
            "",
            TrainOptions {
                optimizer: Some(Optimizer::adamw(1e-2)),
                ..Default::default()
            },
        ),
        (
            "dp=2,sp=2",
            TrainOptions {
                optimizer: Some(Optimizer::adamw(1e-2)),
                zero1: true,
                ..Default::default()
            },
        ),
        (
            "",
            TrainOptions {
                optimizer: Some(Optimizer::sgd(0.5)),
                ..Default::default()
            },
        ),
    ] {
        let l = train(&c, mesh, &opts, 6);
        assert!(l.windows(2).all(|w| w[1] < w[0]), "{mesh}: losses {l:?}");
        assert!(l[5] < l[0] - 0.1, "{mesh}: losses {l:?}");
    }
}

/// `--warmup-steps w`: AdamW's learning rate at step t is `lr * min(1, t / w)`. A step
/// under warmup updates exactly as a step at that reduced rate without warmup (the
/// moments do not depend on the rate), and past the warmup as the plain rate.
#[test]
fn warmup_scales_the_learning_rate_linearly_then_stops() {
    let c = case("llama");
    let with = |lr: f64, warmup: Option<u32>| TrainOptions {
        optimizer: Some(Optimizer::adamw(lr)),
        warmup_steps: warmup,
        ..Default::default()
    };
    let warm = compile(&c, "", &with(1e-2, Some(4)));
    assert!(weft_ir::print(&warm).contains("warmup=4"));
    for (t, lr) in [(1, 2.5e-3), (3, 7.5e-3), (4, 1e-2), (9, 1e-2)] {
        let plain = compile(&c, "", &with(lr, None));
        let (a, b) = (
            step(&warm, &c.weights, &c.inputs, t),
            step(&plain, &c.weights, &c.inputs, t),
        );
        for name in c.weights.keys() {
            let k = format!("param.{name}");
            let e = rel_err(&a.outputs[&k], &b.outputs[&k]);
            assert!(e < 1e-12, "step {t}: {k} rel err {e:e}");
        }
    }
    // SGD has no warmup: refused by name, not ignored.
    let sgd = TrainOptions {
        optimizer: Some(Optimizer::sgd(1e-2)),
        warmup_steps: Some(4),
        ..Default::default()
    };
    let err = training_step(&c.graph, "", &sgd).unwrap_err();
    assert!(err.contains("--warmup-steps"), "{err}");
}

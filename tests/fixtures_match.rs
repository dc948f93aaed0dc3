//! Every HF family reproduces the PyTorch reference of its fixture (logits and loss
//! within 1e-5 relative, gradients within 1e-4), and data-parallel programs match the
//! unsharded model on every fixture.

mod common;
use common::*;

use std::collections::BTreeMap;
use std::path::Path;
use weft_ir::{HostTensor, Mesh};
use weft_passes::{default_pipeline, run_pipeline, PassContext};
use weft_runtime::cpu::{run, Precision, RunOptions};

fn load(
    dir: &Path,
) -> (
    weft_frontends::Model,
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
) {
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap();
    let inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    (model, weights, inputs)
}

fn opts(inputs: &BTreeMap<String, HostTensor>) -> RunOptions {
    let s = &inputs["input_ids"].shape;
    RunOptions::new(Precision::F64)
        .with_grads(true)
        .bind("B", s[0] as i64)
        .bind("S", s[1] as i64)
}

#[test]
fn every_family_reproduces_pytorch() {
    let mut report = Vec::new();
    for fam in FIXTURE_FAMILIES {
        let dir = fixture(fam);
        let (model, weights, inputs) = load(&dir);
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
            "{fam}: gradient count"
        );
        report.push(format!(
            "{fam}: logits {e_logits:.1e} loss {e_loss:.1e} grads {e_grad:.1e}"
        ));
        assert!(
            e_logits < 1e-5 && e_loss < 1e-5,
            "{fam}: logits {e_logits} loss {e_loss}"
        );
        assert!(e_grad < 1e-4, "{fam}: grads {e_grad}");
    }
    eprintln!("{}", report.join("\n"));
}

/// The program for `mesh` gives the unsharded model's loss, logits and gradients.
fn check_mesh(fam: &str, mesh: &str, batch: usize) {
    let dir = fixture(fam);
    let (model, weights, _) = load(&dir);
    let mesh = Mesh::parse(mesh).unwrap();
    let vocab = model
        .graph
        .params()
        .iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .map(|(_, v)| model.graph.ty(*v).shape[0].as_const().unwrap())
        .unwrap();
    let (b, s) = (batch, 16);
    let ids: Vec<i64> = (0..b * s)
        .map(|i| ((i * 7919 + 13) % vocab as usize) as i64)
        .collect();
    // Ignored labels spread unevenly: all of row 0's first half, scattered elsewhere.
    let labels: Vec<i64> = ids
        .iter()
        .enumerate()
        .map(|(i, &t)| if i < s / 2 || i % 5 == 3 { -100 } else { t })
        .collect();
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "input_ids".to_string(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], ids),
    );
    inputs.insert(
        "labels".to_string(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], labels),
    );
    let reference = run(&model.graph, &weights, &inputs, &opts(&inputs)).unwrap();
    let mut g = model.graph.clone();
    run_pipeline(
        &mut g,
        &PassContext::new(mesh.clone()),
        &default_pipeline(&mesh),
    )
    .unwrap();
    let got = run(&g, &weights, &inputs, &opts(&inputs)).unwrap();
    for out in ["loss", "logits"] {
        let e = rel_err(&got.outputs[out], &reference.outputs[out]);
        assert!(e < 1e-10, "{fam} {mesh}: {out} rel err {e}");
    }
    for (name, want) in &reference.grads {
        let e = rel_err(&got.grads[name], want);
        assert!(e < 1e-9, "{fam} {mesh}: grad {name} rel err {e}");
    }
}

#[test]
fn data_parallel_matches_on_every_fixture() {
    for fam in FIXTURE_FAMILIES {
        check_mesh(fam, "dp=2", 2);
        check_mesh(fam, "dp=4", 4);
    }
}

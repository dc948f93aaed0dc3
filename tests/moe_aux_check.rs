//! The MoE load-balancing loss (`output_router_logits: true`) as transformers computes
//! it: fixtures from `tests/fixtures/make_moe_aux.py` (mixtral top-2, mixtral top-1,
//! qwen3_moe with a dense layer between two sparse ones), whose reference loss is
//! cross-entropy + `router_aux_loss_coef` x aux. Weft's `loss`, `ce_loss`, `aux_loss`,
//! logits and every gradient must match PyTorch alone and on sp, tp, ep and dp x ep
//! meshes, both as the forward pipeline (gradients by the runtime's autograd) and as the
//! training step (gradients from the backward graph); with micro-batches the aux term
//! is each micro-batch's own (the mean over micro-batches), checked against the
//! unsharded model run on each micro-batch.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{Float, Graph, HostTensor, Mesh, Op};
use weft_passes::training::TrainOptions;
use weft_passes::{default_pipeline, run_pipeline, PassContext};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

const AUX_FIXTURES: &[&str] = &["mixtral_aux", "mixtral_top1_aux", "qwen3_moe_aux"];
const MESHES: &[&str] = &["sp=2", "tp=2", "ep=2", "dp=2,ep=2", "dp=2,sp=2"];
const LOSSES: &[&str] = &["loss", "ce_loss", "aux_loss"];

fn case(name: &str) -> (Case, BTreeMap<String, HostTensor>) {
    let (graph, weights, inputs) = load_fixture(name);
    let reference =
        weft_frontends::read_safetensors(&fixture(name).join("reference.safetensors")).unwrap();
    (
        Case {
            graph,
            weights,
            inputs,
        },
        reference,
    )
}

/// `got` against the PyTorch reference: outputs to 1e-5, gradients to 1e-4 (relative
/// to each tensor's largest magnitude). Returns the worst errors for the report.
fn against_pytorch(
    what: &str,
    got: &RunResult,
    grads: &BTreeMap<String, HostTensor>,
    reference: &BTreeMap<String, HostTensor>,
) -> (f64, f64) {
    let mut worst_out: f64 = 0.0;
    for out in LOSSES.iter().chain(&["logits"]) {
        let e = rel_err(&got.outputs[*out], &reference[*out]);
        assert!(e < 1e-5, "{what}: {out} rel err {e:e}");
        worst_out = worst_out.max(e);
    }
    let want: Vec<&String> = reference
        .keys()
        .filter(|k| k.starts_with("grad."))
        .collect();
    assert_eq!(grads.len(), want.len(), "{what}: gradient count");
    let mut worst_grad: f64 = 0.0;
    for (name, g) in grads {
        let e = rel_err(g, &reference[&format!("grad.{name}")]);
        assert!(e < 1e-4, "{what}: grad {name} rel err {e:e}");
        worst_grad = worst_grad.max(e);
    }
    (worst_out, worst_grad)
}

/// `got` against the unsharded program in f64: equal up to summation order.
fn against_unsharded(
    what: &str,
    want: &RunResult,
    got: &RunResult,
    grads: &BTreeMap<String, HostTensor>,
) {
    for out in LOSSES.iter().chain(&["logits"]) {
        let e = rel_err(&got.outputs[*out], &want.outputs[*out]);
        assert!(e < 1e-10, "{what}: {out} rel err {e:e}");
    }
    for (name, g) in &want.grads {
        let e = rel_err(&grads[name], g);
        assert!(e < 1e-9, "{what}: grad {name} rel err {e:e}");
    }
}

fn grad_outputs(r: &RunResult) -> BTreeMap<String, HostTensor> {
    r.outputs
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|p| (p.to_string(), v.clone())))
        .collect()
}

#[test]
fn aux_loss_reproduces_pytorch_alone() {
    for name in AUX_FIXTURES {
        let (c, reference) = case(name);
        let r = execute(&c.graph, &c, true);
        let (o, g) = against_pytorch(name, &r, &r.grads, &reference);
        eprintln!("{name}: outputs {o:.1e} grads {g:.1e}");
        // The aux term is not negligible: leaving it out is far outside the tolerance.
        let ce = r.outputs["ce_loss"].to_f64()[0];
        let loss = r.outputs["loss"].to_f64()[0];
        assert!(
            (loss - ce).abs() > 1e-3 * loss.abs(),
            "{name}: aux term too small to test"
        );
    }
}

#[test]
fn top1_router_gradient_comes_from_the_aux_loss() {
    // Top-1: the routing weight is p/p = 1, so the cross-entropy gives the router no
    // gradient; the aux loss does, and it matches PyTorch (checked above). Here: the
    // router gradient of `ce_loss` alone is zero, that of `loss` is not.
    let (c, _) = case("mixtral_top1_aux");
    let mut ce_only = c.graph.clone();
    let ce = ce_only.output("ce_loss").unwrap();
    ce_only.set_output("loss", ce);
    let r_ce = execute(&ce_only, &c, true);
    let r = execute(&c.graph, &c, true);
    for layer in 0..2 {
        let name = format!("model.layers.{layer}.mlp.gate.weight");
        let max = |t: &HostTensor| t.to_f64().iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(
            max(&r_ce.grads[&name]) < 1e-12,
            "{name}: ce gradient {}",
            max(&r_ce.grads[&name])
        );
        assert!(
            max(&r.grads[&name]) > 1e-4,
            "{name}: loss gradient {}",
            max(&r.grads[&name])
        );
    }
}

#[test]
fn aux_loss_on_every_mesh_forward_pipeline() {
    for name in AUX_FIXTURES {
        let (c, reference) = case(name);
        let unsharded = execute(&c.graph, &c, true);
        for mesh in MESHES {
            let mesh = Mesh::parse(mesh).unwrap();
            let mut g = c.graph.clone();
            run_pipeline(
                &mut g,
                &PassContext::new(mesh.clone()),
                &default_pipeline(&mesh),
            )
            .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
            let got = execute(&g, &c, true);
            let what = format!("{name} on {mesh}");
            against_unsharded(&what, &unsharded, &got, &got.grads);
            against_pytorch(&what, &got, &got.grads, &reference);
        }
    }
}

#[test]
fn aux_loss_on_every_mesh_training_step() {
    let base = TrainOptions {
        batch: Some(2),
        seq: Some(16),
        ..Default::default()
    };
    // Full recompute too: the aux path's saved values are recomputed like the rest.
    let full = TrainOptions {
        checkpoint: weft_passes::training::CheckpointPolicy::Full,
        ..base.clone()
    };
    let runs: Vec<(&str, &TrainOptions)> = [""]
        .iter()
        .chain(MESHES)
        .map(|m| (*m, &base))
        .chain([("sp=2", &full), ("dp=2,ep=2", &full)])
        .collect();
    for name in AUX_FIXTURES {
        let (c, reference) = case(name);
        let unsharded = execute(&c.graph, &c, true);
        for &(mesh, opts) in &runs {
            let (g, _) = training_step(&c.graph, mesh, opts)
                .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
            let got = run(&g, &c.weights, &c.inputs, &RunOptions::new(Precision::F64))
                .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
            let grads = grad_outputs(&got);
            let what = format!("{name} training step on `{mesh}` ({:?})", opts.checkpoint);
            against_unsharded(&what, &unsharded, &got, &grads);
            against_pytorch(&what, &got, &grads, &reference);
        }
    }
}

/// The unsharded graph with `loss` replaced by `coef * aux_loss` (the aux part alone).
fn aux_part(g: &Graph, coef: f64) -> Graph {
    let mut g = g.clone();
    let aux = g.output("aux_loss").unwrap();
    let scaled = g
        .add(
            Op::Scale {
                factor: Float(coef),
            },
            &[aux],
        )
        .unwrap();
    g.set_output("loss", scaled);
    g
}

/// The listed rows of every input.
fn rows(inputs: &BTreeMap<String, HostTensor>, which: &[usize]) -> BTreeMap<String, HostTensor> {
    inputs
        .iter()
        .map(|(k, t)| {
            let s = t.shape[1];
            let all = t.to_i64();
            let v = which
                .iter()
                .flat_map(|&r| all[r * s..(r + 1) * s].to_vec())
                .collect();
            (
                k.clone(),
                HostTensor::ints(t.dtype, vec![which.len(), s], v),
            )
        })
        .collect()
}

#[test]
fn micro_batches_take_the_aux_loss_per_micro_batch() {
    // With N micro-batches: loss = ce over the whole batch + coef * mean_m aux(micro-batch m),
    // gradients likewise: gradient accumulation over N forward calls, each with its own
    // token fractions (HF's aux per call), the cross-entropy normalised once over the whole
    // batch as Weft's micro-batches always do. Micro-batch m is the m-th 1/N of each
    // data-parallel rank's rows, all ranks together (their aux statistics are summed over
    // dp): with batch 4, dp=2, N=2 it is rows {m, 2+m}; on one rank rows {2m, 2m+1}.
    let (n, batch) = (2usize, 4usize);
    for name in ["mixtral_aux", "qwen3_moe_aux"] {
        let (graph, weights, inputs) = load_fixture_batch4(name, |i, s| {
            i < 3 || i % 7 == 2 || (2 * s..2 * s + 5).contains(&i)
        });
        let c = Case {
            graph: graph.clone(),
            weights,
            inputs,
        };
        let model = weft_frontends::load(fixture(name).to_str().unwrap()).unwrap();
        let coef = model
            .config
            .and_then(|c| c.moe)
            .and_then(|m| m.aux_loss_coef)
            .unwrap();
        // The ce part on the whole batch.
        let mut ce_only = graph.clone();
        let ce = ce_only.output("ce_loss").unwrap();
        ce_only.set_output("loss", ce);
        let whole = execute(&ce_only, &c, true);
        let aux_graph = aux_part(&graph, coef);
        let opts = TrainOptions {
            batch: Some(batch as i64),
            seq: Some(16),
            micro_batches: n as u32,
            ..Default::default()
        };
        for mesh in ["", "sp=2", "dp=2", "dp=2,ep=2"] {
            let dp = Mesh::parse(mesh).unwrap().size("dp").unwrap_or(1) as usize;
            let per = batch / dp / n;
            // The aux part per micro-batch, on the unsharded model.
            let mut aux_mean = 0.0;
            let mut want_grads: BTreeMap<String, Vec<f64>> = whole
                .grads
                .iter()
                .map(|(k, v)| (k.clone(), v.to_f64()))
                .collect();
            for m in 0..n {
                let which: Vec<usize> = (0..dp)
                    .flat_map(|r| (0..per).map(move |j| r * batch / dp + m * per + j))
                    .collect();
                let part = Case {
                    graph: aux_graph.clone(),
                    weights: c.weights.clone(),
                    inputs: rows(&c.inputs, &which),
                };
                let r = execute(&aux_graph, &part, true);
                aux_mean += r.outputs["aux_loss"].to_f64()[0] / n as f64;
                for (k, g) in &r.grads {
                    for (w, x) in want_grads.get_mut(k).unwrap().iter_mut().zip(g.to_f64()) {
                        *w += x / n as f64;
                    }
                }
            }
            let want_loss = whole.outputs["ce_loss"].to_f64()[0] + coef * aux_mean;
            let (g, _) =
                training_step(&graph, mesh, &opts).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
            let got = run(&g, &c.weights, &c.inputs, &RunOptions::new(Precision::F64))
                .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
            let what = format!("{name} micro-batches {n} on `{mesh}`");
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-10 * b.abs();
            let out = |k: &str| got.outputs[k].to_f64()[0];
            assert!(
                close(out("loss"), want_loss),
                "{what}: loss {} want {want_loss}",
                out("loss")
            );
            assert!(
                close(out("aux_loss"), aux_mean),
                "{what}: aux_loss {} want {aux_mean}",
                out("aux_loss")
            );
            let want_ce = whole.outputs["ce_loss"].to_f64()[0];
            assert!(close(out("ce_loss"), want_ce), "{what}: ce_loss");
            let grads = grad_outputs(&got);
            for (k, want) in &want_grads {
                let w = &whole.grads[k];
                let want = HostTensor::floats(w.dtype, w.shape.clone(), want.clone());
                let e = rel_err(&grads[k], &want);
                assert!(e < 1e-9, "{what}: grad {k} rel err {e:e}");
            }
        }
    }
}

#[test]
fn weft_check_train_compares_the_loss_parts() {
    // The CLI: `weft check --train` on the aux fixtures (the unsharded model against the
    // step's backward graph, f64), ce_loss and aux_loss compared with the loss.
    for (model, mesh) in [
        ("tests/fixtures/mixtral_top1_aux", "tp=2"),
        ("tests/fixtures/mixtral_top1_aux", "dp=2,ep=2"),
        ("tests/fixtures/qwen3_moe_aux", "sp=2"),
    ] {
        let args = ["check", model, "--mesh", mesh, "--train", "--json"];
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{model} {mesh}: {out}{err}");
        let v = json(&out);
        assert_eq!(v["ok"], true, "{model} {mesh}: {v}");
    }
    // With micro-batches the aux loss is per micro-batch: the reference runs the
    // unsharded model on each micro-batch's rows (not one call over the whole batch).
    for mesh in ["", "sp=2"] {
        let (code, out, err) = weft(&[
            "check",
            "tests/fixtures/qwen3_moe_aux",
            "--mesh",
            mesh,
            "--train",
            "--micro-batches",
            "2",
            "--json",
        ]);
        assert_eq!(code, 0, "micro-batches on `{mesh}`: {out}{err}");
        assert_eq!(json(&out)["ok"], true, "{out}");
    }
}

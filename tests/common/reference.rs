//! The checks the HF-reference tests share: a fixture's `reference.safetensors` (HF's
//! outputs and gradients), the training step of a fixture compiled for a mesh and run in
//! f64, and the assertions that a run matches HF or the unsharded model, output by output
//! and gradient by gradient. Also small graph helpers: collecting and editing ops.

use std::collections::BTreeMap;
use weft_ir::{Graph, HostTensor, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

use super::{fixture, rel_err, training_step};

/// `tests/fixtures/<fam>/reference.safetensors`: what the fixture's script saved from
/// transformers (outputs by name, gradients as `grad.<param>`).
pub fn hf_reference(fam: &str) -> BTreeMap<String, HostTensor> {
    weft_frontends::read_safetensors(&fixture(fam).join("reference.safetensors"))
        .unwrap_or_else(|e| panic!("{fam}: reference.safetensors: {e}"))
}

/// The training options the HF fixtures compile with: their batch of 2 x 16 tokens and a
/// 16 KiB grad-sync bucket (several buckets per step).
pub fn fixture_train_options() -> TrainOptions {
    TrainOptions {
        batch: Some(2),
        seq: Some(16),
        bucket_bytes: 16_384,
        ..Default::default()
    }
}

/// The training step of `graph` compiled for `mesh` with `opts`, and its run in f64 on
/// the CPU reference; `what` names the case in a failure.
pub fn run_training_step(
    what: &str,
    graph: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
    mesh: &str,
    opts: &TrainOptions,
) -> (Graph, RunResult) {
    let (g, _) = training_step(graph, mesh, opts).unwrap_or_else(|e| panic!("{what}: {e}"));
    let r = run(&g, weights, inputs, &RunOptions::new(Precision::F64))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    (g, r)
}

/// Asserts a training step's run `r` matches HF's `reference`: each of `outputs` within
/// `out_tol` relative error, and every gradient output (`grad.<param>`, read in the
/// reference's dtype) within `grad_tol`, with as many gradients as the reference has.
/// Returns the worst relative error seen.
pub fn assert_step_matches_hf(
    what: &str,
    r: &RunResult,
    reference: &BTreeMap<String, HostTensor>,
    outputs: &[&str],
    out_tol: f64,
    grad_tol: f64,
) -> f64 {
    let mut worst: f64 = 0.0;
    for out in outputs {
        let e = rel_err(&r.outputs[*out], &reference[*out]);
        assert!(e < out_tol, "{what}: {out} rel err {e:e}");
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
        assert!(e < grad_tol, "{what}: grad {p} rel err {e:e}");
        worst = worst.max(e);
        count += 1;
    }
    assert_eq!(
        count,
        reference.keys().filter(|k| k.starts_with("grad.")).count(),
        "{what}: gradient count"
    );
    worst
}

/// Asserts the unsharded model's own run with gradients (`fwd`, from
/// [`super::reference_run`]) matches HF: logits and loss to 1e-5, each autograd gradient
/// to 1e-4.
pub fn assert_autograd_matches_hf(
    what: &str,
    fwd: &RunResult,
    reference: &BTreeMap<String, HostTensor>,
) {
    for out in ["logits", "loss"] {
        let e = rel_err(&fwd.outputs[out], &reference[out]);
        assert!(e < 1e-5, "{what}: forward {out} rel err {e:e}");
    }
    for (p, gr) in &fwd.grads {
        let e = rel_err(gr, &reference[&format!("grad.{p}")]);
        assert!(e < 1e-4, "{what}: autograd grad {p} rel err {e:e}");
    }
}

/// An imported program of fixture `fam` (`what` names it) matches HF's reference: the
/// autograd of its forward, then its training step alone and on each of `meshes`
/// (logits and loss within 1e-5, every gradient within 1e-4). Prints each mesh's worst
/// relative error.
pub fn assert_import_matches_hf_on_meshes(
    what: &str,
    fam: &str,
    graph: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    meshes: &[&str],
) {
    let (_, _, inputs) = super::load_fixture(fam);
    let reference = hf_reference(fam);
    let fwd = super::reference_run(graph, weights, &inputs);
    assert_autograd_matches_hf(what, &fwd, &reference);
    let mut report = Vec::new();
    for mesh in meshes {
        let on = format!("{what} `{mesh}`");
        let opts = fixture_train_options();
        let (_, r) = run_training_step(&on, graph, weights, &inputs, mesh, &opts);
        let worst = assert_step_matches_hf(&on, &r, &reference, &["logits", "loss"], 1e-5, 1e-4);
        report.push(format!("{on}: worst rel err {worst:.1e}"));
    }
    eprintln!("{}", report.join("\n"));
}

/// Asserts a training step's run `r` matches the unsharded model's run `want` (f64, with
/// gradients): each of `outputs` within `out_tol`, and every gradient of `want` within
/// `grad_tol` of the step's `grad.<param>` output, with as many gradient outputs.
pub fn assert_step_matches_unsharded(
    what: &str,
    r: &RunResult,
    want: &RunResult,
    outputs: &[&str],
    out_tol: f64,
    grad_tol: f64,
) {
    for out in outputs {
        let e = rel_err(&r.outputs[*out], &want.outputs[*out]);
        assert!(e < out_tol, "{what}: {out} rel err {e:e}");
    }
    let grads: BTreeMap<&str, &HostTensor> = r
        .outputs
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|p| (p, v)))
        .collect();
    assert_eq!(grads.len(), want.grads.len(), "{what}: gradient count");
    for (p, w) in &want.grads {
        let got = grads
            .get(p.as_str())
            .unwrap_or_else(|| panic!("{what}: no gradient output for {p}"));
        let e = rel_err(got, w);
        assert!(e < grad_tol, "{what}: grad {p} rel err {e:e}");
    }
}

/// What `pick` returns for each op of `g` it matches, in graph order.
pub fn ops_where<T>(g: &Graph, pick: impl Fn(&Op) -> Option<T>) -> Vec<T> {
    g.nodes()
        .iter()
        .filter_map(|&n| pick(&g.node(n).op))
        .collect()
}

/// Applies `edit` to every op of `g`.
pub fn edit_ops(g: &mut Graph, edit: impl Fn(&mut Op)) {
    for n in g.nodes().to_vec() {
        edit(&mut g.node_mut(n).op);
    }
}

//! `weft check --train` over the whole matrix: every fixture, every mesh the parallel
//! passes cover (sp, dp, tp, ep and mixes), with checkpointing none / selective / full
//! and with host offload. The step's backward graph (autodiff, checkpoint, offload,
//! grad-sync) runs on the CPU reference runtime and its `grad.*` outputs must equal
//! candle's autograd of the unsharded model (f64); recomputation and offload must not
//! change them, and their ops must run.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{DType, Graph, HostTensor, Mesh};
use weft_passes::training::{CheckpointPolicy, OffloadOptions, TrainOptions};
use weft_runtime::cpu::{run, Precision, RunOptions};

/// The fixture with batch 4 (for dp=4 meshes) and unevenly ignored labels.
fn load(
    name: &str,
) -> (
    Graph,
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
) {
    load_fixture_batch4(name, |i, s| {
        [1, 2, 3, 6, 9].contains(&i) || (s + 12..2 * s).contains(&i) || i % 11 == 4
    })
}

fn configs() -> Vec<(&'static str, TrainOptions)> {
    let base = TrainOptions {
        bucket_bytes: 16_384,
        batch: Some(4),
        seq: Some(16),
        ..Default::default()
    };
    let off = Some(OffloadOptions {
        min_bytes: 0,
        ..Default::default()
    });
    vec![
        ("none", base.clone()),
        (
            "selective",
            TrainOptions {
                checkpoint: CheckpointPolicy::Selective,
                ..base.clone()
            },
        ),
        (
            "full",
            TrainOptions {
                checkpoint: CheckpointPolicy::Full,
                ..base.clone()
            },
        ),
        (
            "offload",
            TrainOptions {
                offload: off.clone(),
                ..base.clone()
            },
        ),
        (
            "full+offload",
            TrainOptions {
                checkpoint: CheckpointPolicy::Full,
                offload: off,
                ..base
            },
        ),
    ]
}

fn check(fam: &str, meshes: &[&str]) {
    let (graph, weights, inputs) = load(fam);
    let reference = reference_run(&graph, &weights, &inputs);
    for mesh in meshes {
        let _m = Mesh::parse(mesh).unwrap();
        let mut first: Option<BTreeMap<String, Vec<f64>>> = None;
        for (what, opts) in configs() {
            let (g, _) = training_step(&graph, mesh, &opts)
                .unwrap_or_else(|e| panic!("{fam} {mesh} {what}: {e}"));
            let r = run(&g, &weights, &inputs, &RunOptions::new(Precision::F64))
                .unwrap_or_else(|e| panic!("{fam} {mesh} {what}: {e}"));
            if what.contains("offload") {
                let reloads = r.profile.ops.get("reload").map(|x| x.0).unwrap_or(0);
                let layers = g
                    .nodes()
                    .iter()
                    .filter_map(|&n| {
                        weft_passes::memory::layer_of(g.node(n).meta.source.as_deref())
                    })
                    .collect::<std::collections::BTreeSet<_>>()
                    .len();
                assert!(
                    layers < 2 || reloads > 0,
                    "{fam} {mesh} {what}: no reload ran"
                );
            }
            for out in ["loss", "logits"] {
                let e = rel_err(&r.outputs[out], &reference.outputs[out]);
                assert!(e < 1e-10, "{fam} {mesh} {what}: {out} rel err {e:e}");
            }
            let grads: BTreeMap<String, Vec<f64>> = r
                .outputs
                .iter()
                .filter_map(|(k, v)| k.strip_prefix("grad.").map(|p| (p.to_string(), v.to_f64())))
                .collect();
            assert_eq!(
                grads.len(),
                reference.grads.len(),
                "{fam} {mesh} {what}: gradient count"
            );
            for (p, want) in &reference.grads {
                let have = HostTensor::floats(want.dtype, want.shape.clone(), grads[p].clone());
                let e = rel_err(&have, want);
                assert!(e < 1e-9, "{fam} {mesh} {what}: grad {p} rel err {e:e}");
            }
            match &first {
                None => first = Some(grads),
                Some(f) => assert!(f == &grads, "{fam} {mesh} {what}: gradients differ from the step without recompute or offload"),
            }
        }
    }
}

const DENSE_MESHES: &[&str] = &[
    "sp=2",
    "sp=4",
    "dp=2",
    "dp=4",
    "dp=2,sp=2",
    "tp=2",
    "dp=2,tp=2",
    "sp=2,tp=2",
];

#[test]
fn llama() {
    check("llama", DENSE_MESHES);
}

#[test]
fn llama_rope3_and_kv1() {
    check("llama_rope3", &["sp=4", "dp=2,sp=2", "tp=2"]);
    check("llama_kv1", &["sp=2", "sp=4", "tp=2", "dp=2,sp=2"]);
}

#[test]
fn mistral_qwen2_qwen3_phi3() {
    check("mistral", &["sp=2", "dp=2", "tp=2"]);
    check("qwen2", &["sp=2", "dp=2,sp=2", "tp=2"]);
    check("qwen3", &["sp=4", "dp=2,sp=2", "tp=2", "sp=2,tp=2"]);
    check("phi3", &["sp=4", "dp=2", "tp=2"]);
}

#[test]
fn moe_with_expert_parallelism() {
    let meshes = &[
        "sp=2",
        "dp=2,sp=2",
        "tp=2",
        "ep=2",
        "ep=4",
        "dp=4,ep=2",
        "sp=2,ep=2",
        "dp=2,sp=2,ep=4",
        "tp=2,ep=2",
    ];
    check("mixtral", meshes);
    check("qwen3_moe", meshes);
}

/// A training step with its optimizer updates inside the backward and no gradient
/// outputs (what `weft compile --train` plans) runs on the CPU reference and updates
/// the parameters and states exactly as the step that returns its gradients does.
#[test]
fn updates_in_the_backward_without_gradient_outputs() {
    use weft_passes::training::Optimizer;
    let cases: &[(&str, &str, u8, u32, CheckpointPolicy)] = &[
        ("llama", "", 0, 1, CheckpointPolicy::None),
        ("llama", "dp=2,sp=2", 1, 1, CheckpointPolicy::Selective),
        ("llama", "dp=2", 2, 2, CheckpointPolicy::Full),
        ("llama", "tp=2", 0, 2, CheckpointPolicy::None),
        ("mixtral", "dp=2,sp=2", 1, 1, CheckpointPolicy::Selective),
    ];
    for (fam, mesh, zero, micro, policy) in cases {
        let (graph, weights, inputs) = load(fam);
        let _m = Mesh::parse(mesh).unwrap();
        let mut outs = Vec::new();
        for grad_outputs in [true, false] {
            let opts = TrainOptions {
                optimizer: Some(Optimizer::adamw(1e-2)),
                zero1: *zero >= 1,
                reduce_scatter: *zero >= 2,
                micro_batches: *micro,
                checkpoint: policy.clone(),
                grad_outputs,
                bucket_bytes: 4096,
                batch: Some(4),
                seq: Some(16),
                ..Default::default()
            };
            let (g, _) =
                training_step(&graph, mesh, &opts).unwrap_or_else(|e| panic!("{fam} {mesh}: {e}"));
            // The last update comes before the end of the backward (the embedding's
            // gradient, the last one finished, is updated last).
            let order = g.nodes();
            let first_update = order
                .iter()
                .position(|&n| matches!(g.node(n).op, weft_ir::Op::AdamW { .. }))
                .unwrap();
            let last_backward = order
                .iter()
                .rposition(|&n| {
                    g.node(n)
                        .meta
                        .provenance
                        .as_ref()
                        .is_some_and(|p| p.pass == "autodiff")
                })
                .unwrap();
            assert!(
                first_update < last_backward,
                "{fam} {mesh}: the first update waits for the whole backward"
            );
            assert_eq!(
                g.outputs().iter().any(|(n, _)| n.starts_with("grad.")),
                grad_outputs,
                "{fam} {mesh}"
            );
            let mut w = weights.clone();
            w.extend(weft_passes::optimizer::initial_state(&g, &weights).unwrap());
            let mut i = inputs.clone();
            i.insert(
                "optim.step".into(),
                HostTensor::floats(DType::F32, vec![], vec![1.0]),
            );
            let r = run(&g, &w, &i, &RunOptions::new(Precision::F64))
                .unwrap_or_else(|e| panic!("{fam} {mesh} grad_outputs={grad_outputs}: {e}"));
            outs.push(
                r.outputs
                    .into_iter()
                    .filter(|(k, _)| !k.starts_with("grad."))
                    .map(|(k, v)| (k, v.to_f64()))
                    .collect::<BTreeMap<_, _>>(),
            );
        }
        assert!(
            outs[0].keys().any(|k| k.starts_with("param.")),
            "{fam} {mesh}: no updates"
        );
        assert_eq!(
            outs[0], outs[1],
            "{fam} {mesh}: the updates differ without gradient outputs"
        );
    }
}

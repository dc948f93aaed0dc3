//! Activation checkpointing preserves the gradients: the step's `grad.*` outputs are the
//! same with and without recompute (every policy, sp/dp/tp meshes), equal autograd of
//! the unsharded model, and the saved activations shrink as the policy tightens.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{Graph, HostTensor};
use weft_passes::training::{CheckpointPolicy, TrainOptions};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

pub fn compile(g: &Graph, mesh: &str, opts: &TrainOptions) -> Graph {
    try_compile(g, mesh, opts).unwrap_or_else(|e| panic!("{mesh} {}: {e}", opts.checkpoint))
}

fn try_compile(g: &Graph, mesh: &str, opts: &TrainOptions) -> Result<Graph, String> {
    training_step(g, mesh, opts).map(|(g, _)| g)
}

/// The sequence length the memory-aware passes size activations at (the fixtures'
/// inputs have 16 tokens; at that size the parameter gradients, not the activations,
/// set a tiny model's peak).
const SEQ: i64 = 1024;

fn peak(g: &Graph, opts: &TrainOptions) -> u64 {
    weft_passes::memory::estimate(g, &weft_passes::memory::bindings(g, opts)).peak_live
}

/// The budgets to check on `mesh`: the least peak a budget reaches (what the error for
/// an impossible budget advises) and halfway between it and no recompute's peak.
fn budgets(graph: &Graph, mesh: &str) -> Vec<CheckpointPolicy> {
    let opts = |policy| TrainOptions {
        checkpoint: policy,
        batch: Some(2),
        seq: Some(SEQ),
        ..Default::default()
    };
    let none = peak(
        &compile(graph, mesh, &opts(CheckpointPolicy::None)),
        &opts(CheckpointPolicy::None),
    );
    let err = try_compile(graph, mesh, &opts(CheckpointPolicy::Budget(0)))
        .expect_err("a budget of 0 bytes is impossible");
    let least: u64 = err
        .split("raise the budget to at least ")
        .nth(1)
        .and_then(|t| t.split(',').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{mesh}: {err}"));
    assert!(
        least < none,
        "{mesh}: the least peak {least} is below no recompute's {none}"
    );
    vec![
        CheckpointPolicy::Budget((none + least) / 2),
        CheckpointPolicy::Budget(least),
    ]
}

fn policies(graph: &Graph, mesh: &str) -> Vec<CheckpointPolicy> {
    let mut p = vec![
        CheckpointPolicy::None,
        CheckpointPolicy::Selective,
        CheckpointPolicy::Full,
    ];
    p.extend(budgets(graph, mesh));
    p
}

#[test]
fn gradients_are_equal_with_and_without_recompute() {
    for (fam, meshes) in [
        ("llama", &["", "sp=2", "dp=2,sp=2", "tp=2"][..]),
        ("mixtral", &["", "sp=2"][..]),
        ("qwen3", &["sp=2"][..]),
    ] {
        let (graph, weights, inputs) = load_fixture(fam);
        let reference = reference_run(&graph, &weights, &inputs);
        for mesh in meshes {
            let mut base: Option<BTreeMap<String, HostTensor>> = None;
            for policy in policies(&graph, mesh) {
                let opts = TrainOptions {
                    checkpoint: policy.clone(),
                    batch: Some(2),
                    seq: Some(SEQ),
                    ..Default::default()
                };
                let g = compile(&graph, mesh, &opts);
                if let CheckpointPolicy::Budget(budget) = policy {
                    assert!(
                        peak(&g, &opts) <= budget,
                        "{fam} {mesh} {policy}: peak {} over the budget",
                        peak(&g, &opts)
                    );
                }
                let recomputed = g
                    .nodes()
                    .iter()
                    .filter(|&&n| weft_passes::memory::is_recompute(&g, n))
                    .count();
                if policy != CheckpointPolicy::None {
                    assert!(recomputed > 0, "{fam} {mesh} {policy}: nothing recomputed");
                }
                let r = assert_grads_match(
                    &format!("{fam} {mesh} {policy}"),
                    &g,
                    &weights,
                    &inputs,
                    &reference,
                );
                let grads: BTreeMap<String, HostTensor> = r
                    .outputs
                    .into_iter()
                    .filter(|(k, _)| k.starts_with("grad."))
                    .collect();
                match &base {
                    None => base = Some(grads),
                    Some(b) => {
                        for (k, v) in b {
                            assert_eq!(
                                grads[k].to_f64(),
                                v.to_f64(),
                                "{fam} {mesh} {policy}: {k} differs from no recompute"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn saved_activations_fall_as_the_policy_tightens() {
    let (graph, _, _) = load_fixture("llama");
    let mut rows = Vec::new();
    let mut saved = Vec::new();
    let mut peaks = Vec::new();
    for policy in [
        CheckpointPolicy::None,
        CheckpointPolicy::Selective,
        CheckpointPolicy::Full,
    ] {
        let opts = TrainOptions {
            checkpoint: policy.clone(),
            batch: Some(2),
            seq: Some(SEQ),
            ..Default::default()
        };
        let g = compile(&graph, "sp=2", &opts);
        let e = weft_passes::memory::estimate(&g, &weft_passes::memory::bindings(&g, &opts));
        saved.push(e.saved_activations);
        peaks.push(e.peak_live);
        rows.push(format!("{policy}: {e:?}"));
    }
    assert!(saved[0] > saved[1] && saved[1] > saved[2], "{rows:#?}");
    // A budget on the step's peak between selective's and none's is met, saving less.
    let (none, selective) = (peaks[0], peaks[1]);
    let budget = (none + selective) / 2;
    let opts = TrainOptions {
        checkpoint: CheckpointPolicy::Budget(budget),
        batch: Some(2),
        seq: Some(SEQ),
        ..Default::default()
    };
    let g = compile(&graph, "sp=2", &opts);
    let e = weft_passes::memory::estimate(&g, &weft_passes::memory::bindings(&g, &opts));
    assert!(
        e.peak_live <= budget && e.saved_activations < saved[0],
        "budget {budget}: {e:?}"
    );
}

#[test]
fn offload_runs_and_keeps_the_gradients() {
    use weft_passes::training::OffloadOptions;
    for (fam, mesh) in [
        ("llama", ""),
        ("llama", "dp=2,sp=2"),
        ("mixtral", "sp=2"),
        ("llama", "tp=2"),
    ] {
        let (graph, weights, inputs) = load_fixture(fam);
        let reference = reference_run(&graph, &weights, &inputs);
        for policy in [CheckpointPolicy::None, CheckpointPolicy::Selective] {
            let offload = Some(OffloadOptions {
                min_bytes: 0,
                ..Default::default()
            });
            let opts = TrainOptions {
                checkpoint: policy.clone(),
                offload,
                batch: Some(2),
                seq: Some(SEQ),
                ..Default::default()
            };
            let g = compile(&graph, mesh, &opts);
            let ops = |name: &str| count(&g, |d| d.op.name() == name);
            assert!(
                ops("offload") > 0 && ops("offload") == ops("reload"),
                "{fam} {mesh} {policy}: {} offloads, {} reloads",
                ops("offload"),
                ops("reload")
            );
            let r = assert_grads_match(
                &format!("{fam} {mesh} {policy} offload"),
                &g,
                &weights,
                &inputs,
                &reference,
            );
            assert!(
                r.profile.ops.get("reload").is_some_and(|(n, _)| *n > 0),
                "{fam} {mesh}: reloads ran"
            );
            // Nothing of the last layer is offloaded; the device keeps less.
            let b = weft_passes::memory::bindings(&g, &opts);
            let e = weft_passes::memory::estimate(&g, &b);
            assert!(e.offloaded > 0, "{e:?}");
        }
    }
}

#[test]
fn offload_planner_meets_a_budget_within_the_link_bandwidth() {
    use weft_passes::training::OffloadOptions;
    let model = weft_frontends::load("llama3.2-1b").unwrap();
    let base = TrainOptions {
        batch: Some(1),
        seq: Some(8192),
        ..Default::default()
    };
    let g0 = compile(&model.graph, "", &base);
    let b = weft_passes::memory::bindings(&g0, &base);
    let none = weft_passes::memory::estimate(&g0, &b);
    let budget = none.saved_activations / 2;
    // At 25 GB/s a layer's backward (a few ms) hides far less than its activations:
    // the planner offloads what fits and says the budget is not met.
    let opts = TrainOptions {
        offload: Some(OffloadOptions {
            budget: Some(budget),
            link_bytes_per_s: 25_000_000_000,
            ..Default::default()
        }),
        ..base.clone()
    };
    let g = compile(&model.graph, "", &opts);
    let e = weft_passes::memory::estimate(&g, &b);
    assert!(e.offloaded > 0 && e.saved_activations > budget, "{e:?}");
    assert_eq!(e.saved_activations + e.offloaded, none.saved_activations);
    // With a fast enough link it stops as soon as the budget is met.
    let fast = OffloadOptions {
        budget: Some(budget),
        link_bytes_per_s: 10_000_000_000_000,
        ..Default::default()
    };
    let g = compile(
        &model.graph,
        "",
        &TrainOptions {
            offload: Some(fast),
            ..base
        },
    );
    let e = weft_passes::memory::estimate(&g, &b);
    assert!(
        e.saved_activations <= budget && e.saved_activations > budget / 2,
        "budget {budget}: {e:?}"
    );
    assert_eq!(e.saved_activations + e.offloaded, none.saved_activations);
}

/// `policy` with `--offload` on a device slow enough at matmuls that the fixtures'
/// projections are compute-bound (their FLOPs per byte above its ridge point), so the
/// checkpoint pass moves them to the host instead of recomputing them.
fn offload_instead_opts(policy: CheckpointPolicy) -> TrainOptions {
    use weft_passes::training::{Device, OffloadOptions};
    let mut slow = weft_passes::plan::profile::preset("h200").unwrap();
    slow.matmul_tflops = 0.05;
    slow.attention_tflops = 0.05;
    slow.hbm_gbps = 5.0;
    TrainOptions {
        checkpoint: policy,
        offload: Some(OffloadOptions {
            min_bytes: 0,
            device: Device(slow),
            ..Default::default()
        }),
        batch: Some(2),
        seq: Some(SEQ),
        ..Default::default()
    }
}

/// Nodes of `g` for which `f` holds.
fn count(g: &Graph, f: impl Fn(&weft_ir::NodeData) -> bool) -> usize {
    g.nodes().iter().filter(|&&n| f(g.node(n))).count()
}

/// The offloads the checkpoint pass put in (in place of recompute).
fn offloads_by_checkpoint(g: &Graph) -> usize {
    count(g, |d| {
        d.op.name() == "offload"
            && d.meta
                .provenance
                .as_ref()
                .is_some_and(|p| p.pass == "checkpoint")
    })
}

/// Runs the step `g` on the CPU reference (f64), asserts every parameter gradient
/// equals the unsharded reference's, and returns the run.
fn assert_grads_match(
    what: &str,
    g: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
    reference: &RunResult,
) -> RunResult {
    let r = run(g, weights, inputs, &RunOptions::new(Precision::F64))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    for (p, want) in &reference.grads {
        let e = rel_err(&r.outputs[&format!("grad.{p}")], want);
        assert!(e < 1e-9, "{what}: grad {p} rel err {e:e}");
    }
    r
}

#[test]
fn selective_offload_keeps_the_gradients_and_the_plan_holds_host_copies_on_the_host() {
    use weft_ir::plan::Category;
    for (fam, mesh) in [
        ("llama", ""),
        ("llama", "dp=2,sp=2"),
        ("mixtral", "sp=2"),
        ("llama", "tp=2"),
    ] {
        let (graph, weights, inputs) = load_fixture(fam);
        let reference = reference_run(&graph, &weights, &inputs);
        let opts = offload_instead_opts(CheckpointPolicy::Selective);
        let g = compile(&graph, mesh, &opts);
        let selective = compile(
            &graph,
            mesh,
            &TrainOptions {
                offload: None,
                ..opts.clone()
            },
        );
        let offloads = offloads_by_checkpoint(&g);
        let recomputes = |g: &Graph| {
            count(g, |d| {
                d.meta
                    .derived
                    .is_some_and(|x| x.kind == weft_ir::DerivedKind::Recompute)
            })
        };
        assert!(
            offloads > 0,
            "{fam} {mesh}: nothing offloaded by checkpoint"
        );
        assert!(
            recomputes(&g) < recomputes(&selective),
            "{fam} {mesh}: offload should replace recompute ({} vs {})",
            recomputes(&g),
            recomputes(&selective)
        );
        assert_grads_match(
            &format!("{fam} {mesh} selective+offload"),
            &g,
            &weights,
            &inputs,
            &reference,
        );
        // The plan puts the host copies in the pinned host pool, not the device arena.
        if mesh.is_empty() {
            let plan = weft_passes::plan::lower(
                &g,
                &weft_passes::plan::PlanOptions::new(2, inputs["input_ids"].shape[1] as i64),
            )
            .unwrap();
            plan.check().unwrap();
            let host: Vec<_> = plan
                .buffers
                .iter()
                .filter(|b| b.category == Category::Host)
                .collect();
            assert_eq!(host.len(), offloads);
            assert!(plan.memory.host_bytes >= host.iter().map(|b| b.bytes).sum::<u64>());
            assert!(
                plan.streams.len() == 4,
                "d2h and h2d copies on their own streams"
            );
        }
    }
}

#[test]
fn budget_with_offload_sends_what_it_would_recompute_to_the_host() {
    for (fam, mesh) in [("llama", ""), ("llama", "dp=2,sp=2")] {
        let (graph, weights, inputs) = load_fixture(fam);
        let reference = reference_run(&graph, &weights, &inputs);
        // Halfway between the least reachable peak and no recompute's.
        let policy = budgets(&graph, mesh).pop().unwrap();
        let g = compile(&graph, mesh, &offload_instead_opts(policy.clone()));
        assert!(
            offloads_by_checkpoint(&g) > 0,
            "{fam} {mesh} {policy}: nothing offloaded"
        );
        assert_grads_match(
            &format!("{fam} {mesh} {policy}+offload"),
            &g,
            &weights,
            &inputs,
            &reference,
        );
    }
}

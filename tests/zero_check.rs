//! ZeRO over every data-parallel group on the CPU reference: stages 1, 2 and 3 on dp,
//! sp, dp x sp, with tp and with ep (MoE), with micro-batches, and on groups whose size
//! does not divide the parameters (one axis, or several split over their flattened
//! ranks: dp x sp, dp x cp), and on tp shards whose size differs per tp rank (each
//! split over the group by its own size). Each sharded training step returns the unsharded model's
//! gradients, and after `K` AdamW steps (parameters and states fed back) its parameters
//! and optimizer states, to 1e-9 in f64. Snapshots pin the collectives ZeRO inserts
//! and the group partitions it records; `weft shard --zero` round-trips byte for byte.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{DType, Graph, HostTensor, Op};
use weft_passes::training::{Optimizer, TrainOptions};
use weft_passes::update_timing::DeferUpdates;
use weft_runtime::cpu::{run, Precision, RunOptions};

const K: usize = 3;

fn opts(zero: u8, micro: u32) -> TrainOptions {
    TrainOptions {
        optimizer: Some(Optimizer::adamw(1e-2)),
        zero1: zero >= 1,
        reduce_scatter: zero >= 2,
        zero3: zero >= 3,
        micro_batches: micro,
        bucket_bytes: 4096,
        batch: Some(4),
        seq: Some(16),
        ..Default::default()
    }
}

/// What `K` steps produce: the first step's gradients and loss, the last step's
/// parameters and states (states in their parameter's layout).
struct Trace {
    grads: BTreeMap<String, HostTensor>,
    losses: Vec<f64>,
    params: BTreeMap<String, HostTensor>,
    states: BTreeMap<String, HostTensor>,
}

fn steps(
    g: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
) -> Trace {
    let mut w = weights.clone();
    w.extend(weft_passes::optimizer::initial_state(g, weights).unwrap());
    let mut t = Trace {
        grads: BTreeMap::new(),
        losses: Vec::new(),
        params: BTreeMap::new(),
        states: BTreeMap::new(),
    };
    for k in 1..=K {
        let mut i = inputs.clone();
        i.insert(
            "optim.step".into(),
            HostTensor::floats(DType::F32, vec![], vec![k as f64]),
        );
        let r = run(g, &w, &i, &RunOptions::new(Precision::F64))
            .unwrap_or_else(|e| panic!("{} step {k}: {e}", g.mesh));
        t.losses.push(r.outputs["loss"].to_f64()[0]);
        for (name, v) in &r.outputs {
            if let Some(p) = name.strip_prefix("param.") {
                w.insert(p.to_string(), v.clone());
                t.params.insert(p.to_string(), v.clone());
            } else if name.starts_with("optim.") {
                w.insert(name.clone(), v.clone());
            } else if let (1, Some(p)) = (k, name.strip_prefix("grad.")) {
                t.grads.insert(p.to_string(), v.clone());
            }
        }
        if k == K {
            for (name, v) in &r.outputs {
                if name.starts_with("optim.") {
                    let p = name.split_once('.').unwrap().1.split_once('.').unwrap().1;
                    let shape = weights[p].shape.clone();
                    let s = weft_passes::optimizer::state_as_param(g, name, v, &shape)
                        .unwrap_or_else(|e| panic!("{}: {name}: {e}", g.mesh));
                    t.states.insert(name.clone(), s);
                }
            }
        }
    }
    t
}

fn close(what: &str, a: &HostTensor, b: &HostTensor) {
    let e = rel_err(a, b);
    assert!(e < 1e-9, "{what}: rel err {e:e}");
}

/// Every (mesh, stage, micro-batches) of `cases` matches the one-rank step.
fn check(fam: &str, cases: &[(&str, u8, u32)]) {
    check_batch(fam, 4, cases)
}

/// The batch-4 inputs with rows appended (the first ones again) up to `batch` rows.
fn batch_of(batch: usize, inputs: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    inputs
        .iter()
        .map(|(k, t)| {
            let s = t.shape[1];
            let x = t.to_i64();
            let rows: Vec<i64> = x.iter().cycle().take(batch * s).copied().collect();
            (
                k.clone(),
                HostTensor::ints(DType::I64, vec![batch, s], rows),
            )
        })
        .collect()
}

/// [`check`] with `batch` rows (6 for groups of 3).
fn check_batch(fam: &str, batch: usize, cases: &[(&str, u8, u32)]) {
    check_batch_with(fam, batch, cases, |o| o)
}

/// [`check_batch`] with the sharded steps' options changed by `tweak`.
fn check_batch_with(
    fam: &str,
    batch: usize,
    cases: &[(&str, u8, u32)],
    tweak: impl Fn(TrainOptions) -> TrainOptions,
) {
    let (graph, weights, inputs) = load_fixture_batch4(fam, |i, _| i % 7 == 3);
    let inputs = batch_of(batch, &inputs);
    let one_rank = |zero, micro| TrainOptions {
        batch: Some(batch as i64),
        ..opts(zero, micro)
    };
    let opts = |zero, micro| tweak(one_rank(zero, micro));
    let (one, _) = training_step(&graph, "", &one_rank(0, 1)).unwrap();
    let want = steps(&one, &weights, &inputs);
    for &(mesh, zero, micro) in cases {
        let what = format!("{fam} {mesh} zero={zero} micro={micro}");
        let (g, report) = training_step(&graph, mesh, &opts(zero, micro))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let stat = |pass: &str, k: &str| {
            report
                .passes
                .iter()
                .find(|p| p.pass == pass)
                .and_then(|p| p.counters.get(k).copied())
                .unwrap_or(0)
        };
        let sharded = stat("optimizer", "sharded");
        let m = weft_ir::Mesh::parse(mesh).unwrap();
        let has_group = m
            .axes
            .iter()
            .any(|(a, n)| *n > 1 && ["dp", "sp", "cp", "edp"].contains(&a.as_str()));
        assert_eq!(
            sharded > 0,
            zero >= 1 && has_group,
            "{what}: {sharded} params sharded"
        );
        if zero >= 1 {
            // tp-split parameters are sharded too: every trained parameter with
            // replicas is, but for a local size that differs per rank (an uneven tp
            // shard). One without a gradient (DeepSeek-V3's routing bias) has no
            // optimizer state to shard.
            let want = weights
                .keys()
                .filter(|p| one.output(&weft_ir::role::grad_name(p)).is_some())
                .filter(|p| !weft_passes::zero::ZeroGroup::of_param(&g, p).is_empty())
                .count();
            let whole = stat("optimizer", "unsharded_uneven");
            assert_eq!(sharded + whole, want as u64, "{what}: params sharded");
        }
        let scatters = g
            .nodes()
            .iter()
            .filter(|&&n| matches!(g.node(n).op, Op::ReduceScatter { .. }))
            .filter(|&&n| {
                g.node(n)
                    .meta
                    .provenance
                    .as_ref()
                    .is_some_and(|p| p.pass == "grad-sync")
            })
            .count();
        assert_eq!(
            scatters > 0,
            zero >= 2 && has_group,
            "{what}: {scatters} reduce_scatters"
        );
        if zero >= 3 && has_group {
            // Parameters are rows per rank, gathered before the forward and again before
            // the backward (per micro-batch).
            assert!(
                stat("optimizer", "stage3_params") > 0,
                "{what}: no parameter sharded"
            );
            let gathers = |backward: bool| {
                g.nodes()
                    .iter()
                    .filter(|&&n| {
                        let d = g.node(n);
                        matches!(d.op, Op::AllGather { .. })
                            && d.meta.provenance.as_ref().is_some_and(|p| {
                                p.reason.starts_with("ZeRO-3: gather")
                                    && p.reason.contains(if backward {
                                        "backward"
                                    } else {
                                        "forward"
                                    })
                            })
                    })
                    .count()
            };
            assert!(
                gathers(false) > 0 && gathers(true) > 0,
                "{what}: forward/backward gathers"
            );
        }
        let got = steps(&g, &weights, &inputs);
        for (k, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
            assert!(
                (a - b).abs() < 1e-9 * b.abs(),
                "{what}: loss of step {} {a} vs {b}",
                k + 1
            );
        }
        for (p, v) in &want.grads {
            close(&format!("{what}: grad.{p}"), &got.grads[p], v);
        }
        for (p, v) in &want.params {
            close(
                &format!("{what}: param.{p} after {K} steps"),
                &got.params[p],
                v,
            );
        }
        for (s, v) in &want.states {
            close(&format!("{what}: {s} after {K} steps"), &got.states[s], v);
        }
    }
}

#[test]
fn dense_every_group_and_stage() {
    check(
        "llama",
        &[
            ("dp=2", 1, 1),
            ("dp=2", 2, 2),
            ("sp=2", 1, 1),
            ("sp=2", 2, 1),
            ("dp=2,sp=2", 1, 2),
            ("dp=2,sp=2", 2, 1),
            ("dp=2,sp=2", 2, 2),
            ("tp=2", 2, 1),
            ("dp=2,tp=2", 1, 1),
            ("dp=2,tp=2", 2, 2),
            ("sp=2,tp=2", 2, 1),
            ("dp=2", 3, 1),
            ("sp=2", 3, 2),
            ("dp=2,sp=2", 3, 1),
            ("dp=2,sp=2", 3, 2),
            ("dp=2,tp=2", 3, 1),
            ("sp=2,tp=2", 3, 2),
        ],
    );
}

/// ZeRO-3 (gathers outermost axis first, issued a layer ahead) on families the other
/// cases do not use: gemma3 (sliding windows, q/k norms) over dp x cp with the ring,
/// deepseek_v3 (MLA, its MoE experts over edp) and olmo2 over dp x sp, with
/// micro-batches: gradients and the parameters after the optimizer steps match the
/// unsharded model.
#[test]
fn zero3_on_more_families() {
    check("gemma3", &[("dp=2,cp=2", 3, 2)]);
    check("deepseek_v3", &[("dp=2,sp=2", 3, 1)]);
    check("olmo2", &[("dp=2,sp=2", 3, 2)]);
}

/// Groups of two axes that the sizes do not divide: dp x sp (Ulysses) of 6 ranks
/// (`llama`'s 128-row embedding is 22,22,21,21,21,21 rows), and dp x cp inside an even
/// tp split (`llama` on dp=3,cp=2,tp=2: each q_proj tp shard of 16 rows is
/// 3,3,3,3,2,2 rows over the 6 group ranks), split over the flattened group, at every
/// stage, with micro-batches.
#[test]
fn dense_uneven_groups_of_two_axes() {
    check_batch(
        "llama",
        6,
        &[
            ("dp=3,sp=2", 1, 2),
            ("dp=3,sp=2", 2, 2),
            ("dp=3,sp=2", 3, 2),
            ("dp=3,cp=2,tp=2", 1, 2),
            ("dp=3,cp=2,tp=2", 2, 1),
            ("dp=3,cp=2,tp=2", 3, 2),
        ],
    );
}

#[test]
fn moe_expert_data_parallel_group() {
    check(
        "mixtral",
        &[
            ("dp=2,sp=2", 2, 1),
            ("ep=2", 2, 1),
            ("dp=4,ep=2", 1, 1),
            ("dp=4,ep=2", 2, 1),
            ("dp=2,sp=2", 2, 2),
            ("dp=2,sp=2,ep=2", 1, 1),
            ("dp=2,sp=2,ep=2", 2, 1),
            ("dp=2,tp=2,ep=2", 2, 1),
            ("dp=4,ep=2", 3, 1),
            ("dp=2,sp=2", 3, 2),
        ],
    );
}

/// The updates (and the pieces of the reduced gradients they read) that would stall
/// the compute stream waiting for their reduction run later in the backward
/// (`update_timing`): the programs so reordered still give the one-rank step's
/// gradients, parameters and states, all-reduced, reduce-scattered and at stage 3.
#[test]
fn updates_that_wait_for_their_reduction_move_and_match() {
    let (graph, _, _) = load_fixture("llama");
    for zero in [0, 2] {
        let (_, report) = training_step(&graph, "dp=4", &opts(zero, 1)).unwrap();
        let moved = report.counter("updates_deferred");
        assert!(moved > 0, "zero {zero}: nothing moved");
    }
    check("llama", &[("dp=4", 0, 1), ("dp=4", 2, 1), ("dp=4", 3, 1)]);
}

/// With micro-batches each gradient is the sum of the micro-batches' contributions;
/// `autodiff` places each sum right after its last contribution, so the gradient
/// reductions overlap the last micro-batch's backward and the updates run inside it
/// (they all came after it), and the steps still match the one-rank step.
#[test]
fn micro_batched_gradients_reduce_and_update_inside_the_last_backward() {
    let (graph, _, _) = load_fixture("llama");
    for zero in [0, 1, 2] {
        let (g, _) = training_step(&graph, "dp=2", &opts(zero, 2)).unwrap();
        let order = g.nodes();
        let last_backward = order
            .iter()
            .rposition(|&n| g.node(n).meta.micro_batch == Some(1))
            .unwrap();
        let made_by = |n: weft_ir::Node, pass: &str| {
            g.node(n)
                .meta
                .provenance
                .as_ref()
                .is_some_and(|p| p.pass == pass)
        };
        let inside = |pass: &str, collective: bool| {
            order[..last_backward]
                .iter()
                .filter(|&&n| made_by(n, pass) && g.node(n).op.is_collective() == collective)
                .count()
        };
        assert!(
            inside("grad-sync", true) > 0,
            "zero {zero}: no reduction inside"
        );
        let updates = order
            .iter()
            .filter(|&&n| matches!(g.node(n).op, weft_ir::Op::AdamW { .. }))
            .count();
        let updates_inside = order[..last_backward]
            .iter()
            .filter(|&&n| matches!(g.node(n).op, weft_ir::Op::AdamW { .. }))
            .count();
        assert!(
            updates_inside * 2 > updates,
            "zero {zero}: {updates_inside} of {updates} updates inside"
        );
    }
    check("llama", &[("dp=2", 0, 2), ("dp=2", 1, 2), ("dp=2", 2, 2)]);
}

/// Held within a bound on the reduced gradients they keep alive
/// (`DeferUpdates::Within`, what the driver uses where moving every update does not fit
/// the device), fewer updates move, the bound holds, and the steps still match.
#[test]
fn updates_held_within_a_bound_move_and_match() {
    let (graph, _, _) = load_fixture("llama");
    for zero in [0, 2] {
        let deferred = |defer_updates| {
            let o = TrainOptions {
                defer_updates,
                ..opts(zero, 1)
            };
            let (_, report) = training_step(&graph, "dp=4", &o).unwrap();
            (
                report.counter("updates_deferred"),
                report.counter("deferred_held_bytes"),
            )
        };
        let (moved_all, held_all) = deferred(DeferUpdates::All);
        assert!(moved_all > 0 && held_all > 0, "zero {zero}: nothing held");
        let cap = held_all / 2;
        let (moved, held) = deferred(DeferUpdates::Within(cap));
        assert!(
            moved > 0 && held <= cap,
            "zero {zero}: {moved} moved holding {held} B within {cap} (all: {moved_all}, {held_all} B)"
        );
        assert_eq!(deferred(DeferUpdates::Off), (0, 0), "zero {zero}");
        check_batch_with("llama", 4, &[("dp=4", zero, 1)], |o| TrainOptions {
            defer_updates: DeferUpdates::Within(cap),
            ..o
        });
    }
}

/// ZeRO-3 of stacked experts with fewer local experts than ranks in their group: each
/// rank holds its rows of dim 1 of every local expert (no parameter stays whole), evenly
/// (`dp=8` over 4 experts, `dp=8,ep=2`'s group of 4 over 2, with micro-batches) and
/// unevenly (128 and 32 rows over `dp=6,ep=2`'s group of 3), and the steps match the
/// one-rank model.
#[test]
fn zero3_splits_dim1_of_fewer_experts_than_ranks() {
    let (graph, _, _) = load_fixture_batch4("mixtral", |i, _| i % 7 == 3);
    for (mesh, batch, micro) in [("dp=8", 8, 1), ("dp=8,ep=2", 16, 2), ("dp=6,ep=2", 6, 1)] {
        let o = TrainOptions {
            batch: Some(batch),
            ..opts(3, micro)
        };
        let (g, report) = training_step(&graph, mesh, &o).unwrap();
        let whole = report
            .passes
            .iter()
            .find(|p| p.pass == "optimizer")
            .and_then(|p| p.counters.get("stage3_whole").copied())
            .unwrap_or(0);
        assert_eq!(whole, 0, "{mesh}: parameters left whole");
        let name = "model.layers.0.mlp.experts.gate_up_proj";
        let zero: Vec<_> = g
            .param_partition(name)
            .iter()
            .filter(|p| p.kind == "zero")
            .collect();
        assert!(
            !zero.is_empty() && zero.iter().all(|p| p.dim == 1),
            "{mesh}: {name} split {zero:?}"
        );
    }
    check_batch("mixtral", 8, &[("dp=8", 3, 1), ("dp=8,ep=2", 3, 1)]);
    check_batch("mixtral", 16, &[("dp=8,ep=2", 3, 2)]);
    check_batch("mixtral", 6, &[("dp=6,ep=2", 3, 1)]);
    // Expert kinds the split was not written against: gpt-oss's transposed experts
    // with biases (4 experts over 8 ranks), DeepSeek-V3's routed experts beside
    // shared ones (4 local over an expert group of 8).
    check_batch("gpt_oss", 8, &[("dp=8", 3, 1)]);
    check_batch("deepseek_v3", 16, &[("dp=16,ep=2", 3, 1)]);
}

/// One snapshot line: the op (with its micro-batch tag), operand and result types, why.
fn op_line(g: &weft_ir::Graph, n: weft_ir::Node, tag: &str, reason: &str) -> String {
    let d = g.node(n);
    format!(
        "{}{tag} {} -> {}: {reason}\n",
        d.op.name(),
        g.ty(d.operands[0]),
        g.ty(d.results[0]),
    )
}

/// The collectives of a ZeRO-2 step with micro-batches over dp x sp, and of an
/// expert model over edp: one reduce_scatter per group axis per bucket and
/// micro-batch, hierarchical (innermost first), and the parameter gathers.
#[test]
fn zero_collectives_snapshot() {
    let mut text = String::new();
    for (fam, mesh, micro) in [("llama", "dp=2,sp=2", 2), ("mixtral", "dp=4,ep=2", 1)] {
        let (graph, _, _) = load_fixture(fam);
        let mut o = opts(2, micro);
        o.bucket_bytes = 1 << 20;
        o.grad_outputs = false;
        let (g, _) = training_step(&graph, mesh, &o).unwrap();
        text.push_str(&format!("== {fam} {mesh} zero=2 micro-batches={micro}\n"));
        for &n in g.nodes() {
            let d = g.node(n);
            if !d.op.is_collective() {
                continue;
            }
            let Some(p) = &d.meta.provenance else {
                continue;
            };
            if p.pass != "grad-sync" && p.pass != "optimizer" {
                continue;
            }
            let mb = d
                .meta
                .micro_batch
                .map(|m| format!(" mb{m}"))
                .unwrap_or_default();
            text.push_str(&op_line(&g, n, &mb, &p.reason));
        }
    }
    insta::assert_snapshot!(text);
}

/// ZeRO-3 of a stack of fewer local experts than ranks (`dp=8,ep=2`: 2 experts over an
/// expert group of 4): every node ZeRO makes for one stacked weight, from its shard of
/// dim 1 and its gathers along the inner dim to the gradient's reduce_scatter and the
/// update in the `[R, E, C]` view.
#[test]
fn zero3_dim1_split_snapshot() {
    let (graph, _, _) = load_fixture("mixtral");
    let mut o = opts(3, 1);
    o.batch = Some(8);
    o.grad_outputs = false;
    let (g, _) = training_step(&graph, "dp=8,ep=2", &o).unwrap();
    let name = "model.layers.0.mlp.experts.gate_up_proj";
    let mut text = format!("== mixtral dp=8,ep=2 zero=3: {name}\n");
    for &n in g.nodes() {
        let d = g.node(n);
        let Some(p) = &d.meta.provenance else {
            continue;
        };
        if (p.pass == "grad-sync" || p.pass == "optimizer") && p.reason.contains(name) {
            let ins: Vec<String> = d.operands.iter().map(|v| g.ty(*v).to_string()).collect();
            text.push_str(&format!(
                "{} ({}) -> {}: {}\n",
                d.op.name(),
                ins.join(", "),
                g.ty(d.results[0]),
                p.reason
            ));
        }
    }
    insta::assert_snapshot!(text);
}

/// ZeRO-3's parameter gathers over a group of three axes: outermost axis first, so
/// the outer (slower) links move the fewest bytes and only the innermost axis moves
/// the whole parameter; the forward and the backward each gather their own copy.
#[test]
fn zero3_gathers_outermost_first_snapshot() {
    let (graph, _, _) = load_fixture("llama");
    let mesh = "dp=2,cp=2,sp=2";
    let (g, _) = training_step(&graph, mesh, &opts(3, 1)).unwrap();
    let mut text = format!("== llama {mesh} zero=3: the gathers of one parameter\n");
    let mut name = None;
    for &n in g.nodes() {
        let d = g.node(n);
        let Some(p) = &d.meta.provenance else {
            continue;
        };
        let Some(rest) = p.reason.strip_prefix("ZeRO-3: gather `") else {
            continue;
        };
        let param = rest.split('`').next().unwrap_or_default().to_string();
        if !param.contains("q_proj") || name.get_or_insert_with(|| param.clone()) != &param {
            continue;
        }
        text.push_str(&op_line(&g, n, "", &p.reason));
    }
    insta::assert_snapshot!(text);
}

/// ZeRO-3 issues a layer's parameter gathers while the layer before it still computes
/// (forward) and while the layer after it still computes (backward): every gather of
/// `model.layers.1` in the forward comes before some compute of `model.layers.0`, and
/// every gather of `model.layers.0` in the backward before some backward compute of
/// `model.layers.1`. The values are checked by `dense_every_group_and_stage`.
#[test]
fn zero3_gathers_run_a_layer_ahead() {
    let (graph, _, _) = load_fixture("llama");
    let (g, _) = training_step(&graph, "dp=2,sp=2", &opts(3, 1)).unwrap();
    let order = g.nodes().to_vec();
    let last_compute = |layer: &str, backward: bool| {
        order
            .iter()
            .rposition(|&n| {
                let d = g.node(n);
                !d.op.is_collective()
                    && d.meta.derived.is_some() == backward
                    && d.meta
                        .source
                        .as_deref()
                        .is_some_and(|s| s.starts_with(layer))
                    && d.meta
                        .provenance
                        .as_ref()
                        .is_none_or(|p| !p.reason.starts_with("ZeRO-3"))
            })
            .unwrap()
    };
    let gathers = |layer: &str, phase: &str| -> Vec<usize> {
        order
            .iter()
            .enumerate()
            .filter(|(_, &n)| {
                let d = g.node(n);
                d.op.name() == "all_gather"
                    && d.meta.provenance.as_ref().is_some_and(|p| {
                        p.reason.starts_with(&format!("ZeRO-3: gather `{layer}"))
                            && p.reason.contains(&format!("for its {phase}"))
                    })
            })
            .map(|(i, _)| i)
            .collect()
    };
    let forward = gathers("model.layers.1.", "forward");
    let backward = gathers("model.layers.0.", "backward");
    assert!(!forward.is_empty() && !backward.is_empty());
    let (f0, b1) = (
        last_compute("model.layers.0.", false),
        last_compute("model.layers.1.", true),
    );
    assert!(forward.iter().all(|&i| i < f0), "{forward:?} vs {f0}");
    assert!(backward.iter().all(|&i| i < b1), "{backward:?} vs {b1}");
}

/// Optimizer offload (`--offload-optimizer`): the same step with the master weights
/// and moments on the host and the update run by `host_adamw` gives bit for bit the
/// parameters and moments of the device update after `K` steps, at every ZeRO stage
/// and with micro-batches; the gradients cross the link in their own dtype and the
/// parameters come back through `reload`.
#[test]
fn optimizer_offload_matches_the_device_update_bit_for_bit() {
    offload_matches_the_device_update(
        "llama",
        &[
            ("", 0, 1),
            ("dp=2", 1, 1),
            ("dp=2,sp=2", 2, 2),
            ("dp=2,sp=2", 3, 1),
            ("dp=2,tp=2", 3, 2),
        ],
    );
}

/// The same on uneven shards: the host update of each rank's piece (per-rank widths),
/// also of tp shards whose size differs per tp rank (their master weights start from
/// each tp rank's flattened shard, split over dp).
#[test]
fn optimizer_offload_on_uneven_shards_matches_the_device_update() {
    offload_matches_the_device_update(
        "llama_odd",
        &[
            ("dp=2", 1, 1),
            ("dp=2", 3, 2),
            ("dp=2,tp=2", 2, 2),
            ("dp=2,tp=2", 3, 1),
        ],
    );
}

/// The `optimizer` pass's nodes whose provenance names `needle`, one line each: op,
/// operand and result types, and why.
fn optimizer_lines(g: &Graph, needle: &str) -> String {
    let tys = |vs: &[weft_ir::Value]| {
        vs.iter()
            .map(|v| g.ty(*v).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut text = String::new();
    for &n in g.nodes() {
        let d = g.node(n);
        match &d.meta.provenance {
            Some(p) if p.pass == "optimizer" && p.reason.contains(needle) => {
                text.push_str(&format!(
                    "{} ({}) -> {}: {}\n",
                    d.op.name(),
                    tys(&d.operands),
                    tys(&d.results),
                    p.reason
                ));
            }
            _ => {}
        }
    }
    text
}

fn offload_matches_the_device_update(fam: &str, cases: &[(&str, u8, u32)]) {
    let (graph, weights, inputs) = load_fixture_batch4(fam, |i, _| i % 7 == 3);
    for &(mesh, zero, micro) in cases {
        let what = format!("{fam} {mesh} zero={zero} micro={micro}");
        let device = opts(zero, micro);
        let mut host = device.clone();
        host.offload_optimizer = true;
        let (gd, _) =
            training_step(&graph, mesh, &device).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (gh, report) =
            training_step(&graph, mesh, &host).unwrap_or_else(|e| panic!("{what}: {e}"));
        let count = |op: &str| {
            gh.nodes()
                .iter()
                .filter(|&&n| gh.node(n).op.name() == op)
                .count()
        };
        let params = report
            .passes
            .iter()
            .find(|p| p.pass == "optimizer")
            .and_then(|p| p.counters.get("params").copied())
            .unwrap_or(0) as usize;
        assert!(params > 0, "{what}");
        assert_eq!(
            count("host_adamw"),
            params,
            "{what}: one host update per param"
        );
        assert_eq!(count("adamw"), 0, "{what}: no device update left");
        assert!(
            count("offload") >= params && count("reload") >= params,
            "{what}"
        );
        let a = steps(&gd, &weights, &inputs);
        let b = steps(&gh, &weights, &inputs);
        assert_eq!(a.losses, b.losses, "{what}: losses");
        for (p, v) in &a.params {
            assert_eq!(v.to_f64(), b.params[p].to_f64(), "{what}: param.{p}");
        }
        for (s, v) in &a.states {
            assert_eq!(v.to_f64(), b.states[s].to_f64(), "{what}: {s}");
        }
        // The device update of f32 params has no master copy; the host keeps one.
        assert!(
            b.states.keys().any(|s| s.starts_with("optim.master.")),
            "{what}"
        );
    }
}

/// The plan of an offloaded optimizer: the host update runs on a host stream, the
/// master weights and moments are host bytes (none on the device), the gradient and
/// parameter copies are on the copy streams, the plan validates, and a snapshot pins
/// one parameter's offloaded update.
#[test]
fn optimizer_offload_plan_and_snapshot() {
    let (graph, _, _) = load_fixture("llama");
    let mut o = opts(2, 1);
    o.grad_outputs = false;
    let (gd, _) = training_step(&graph, "dp=2", &o).unwrap();
    o.offload_optimizer = true;
    let (gh, _) = training_step(&graph, "dp=2", &o).unwrap();
    let lower = |g: &Graph| {
        let p = weft_passes::plan::lower(g, &weft_passes::plan::PlanOptions::new(4, 16)).unwrap();
        p.check().unwrap();
        p
    };
    let (pd, ph) = (lower(&gd), lower(&gh));
    assert!(pd.streams.len() == 4 && ph.streams.len() == 5);
    assert_eq!(ph.streams[4].kind, weft_ir::plan::StreamKind::Host);
    assert!(ph
        .instructions
        .iter()
        .all(|i| (i.op == "host_adamw") == (i.stream == 4)));
    let state = |p: &weft_ir::plan::ExecutionPlan| {
        p.memory
            .breakdown
            .get("optimizer_state")
            .copied()
            .unwrap_or(0)
    };
    assert!(
        state(&pd) > 0 && state(&ph) == 0,
        "{:?}",
        ph.memory.breakdown
    );
    assert!(ph.memory.host_bytes > 0 && ph.memory.peak_bytes < pd.memory.peak_bytes);
    let param = "model.layers.0.mlp.down_proj.weight";
    let text = optimizer_lines(&gh, &format!("`{param}`"));
    insta::assert_snapshot!(text);
}

/// Streamed optimizer state (`--stream-optimizer-state`): the state params live on the
/// host and every update reads them through a `reload` and writes them back through an
/// `offload`; the step gives bit for bit the losses, parameters and states of the
/// device-resident update, at every ZeRO stage, with micro-batches, with master
/// weights (streamed too) and without.
#[test]
fn streamed_optimizer_state_matches_the_device_update_bit_for_bit() {
    let (graph, weights, inputs) = load_fixture_batch4("llama", |i, _| i % 7 == 3);
    for &(mesh, zero, micro, master) in &[
        ("", 0, 1, true),
        ("", 0, 1, false),
        ("dp=2", 1, 2, true),
        ("dp=2,sp=2", 3, 1, true),
        ("dp=2,tp=2", 2, 2, false),
    ] {
        let what = format!("{mesh} zero={zero} micro={micro} master={master}");
        let mut device = opts(zero, micro);
        device.master_weights = master;
        let mut streamed = device.clone();
        streamed.stream_optimizer_state = true;
        let (gd, _) =
            training_step(&graph, mesh, &device).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (gs, report) =
            training_step(&graph, mesh, &streamed).unwrap_or_else(|e| panic!("{what}: {e}"));
        let counter = |k: &str| {
            report
                .passes
                .iter()
                .find(|p| p.pass == "optimizer")
                .and_then(|p| p.counters.get(k).copied())
                .unwrap_or(0)
        };
        let states = counter("state_tensors");
        assert!(states > 0, "{what}");
        assert_eq!(counter("streamed_state_tensors"), states, "{what}");
        let kept = counter("states_kept_on_device");
        assert_eq!(counter("prefetched_states") + kept, states, "{what}");
        let reloads = gs
            .nodes()
            .iter()
            .filter(|&&n| matches!(gs.node(n).op, weft_ir::Op::Reload { .. }))
            .count() as u64;
        assert_eq!(
            reloads,
            states - kept,
            "{what}: one reload per streamed state"
        );
        let a = steps(&gd, &weights, &inputs);
        let b = steps(&gs, &weights, &inputs);
        assert_eq!(a.losses, b.losses, "{what}: losses");
        for (p, v) in &a.params {
            assert_eq!(v.to_f64(), b.params[p].to_f64(), "{what}: param.{p}");
        }
        assert_eq!(a.states.len(), b.states.len(), "{what}");
        for (s, v) in &a.states {
            assert_eq!(v.to_f64(), b.states[s].to_f64(), "{what}: {s}");
        }
    }
}

/// Streamed state on a host link too slow for all of it (the h200 profile at
/// `gbps`): the schedule streams what the link brings in by each update and keeps the
/// rest on the device. Some of each, the same losses, parameters and states bit for bit
/// as the device-resident update, a plan that validates, and no update waiting for its
/// state: the step predicts what the unstreamed one does. Brought in late instead, the
/// reloads stalled their updates and queued until all were issued at the backward's
/// start (Llama-3-8B at 8192: 1,291 ms against 814 unstreamed, at twice the memory that
/// the schedule now leaves).
#[test]
fn link_bound_streamed_state_keeps_the_rest_on_the_device() {
    let (graph, weights, inputs) = load_fixture_batch4("llama", |i, _| i % 7 == 3);
    let mut device = opts(0, 1);
    device.grad_outputs = false;
    device.device.0.host_gbps = 1.0;
    device.device.0.host_duplex_gbps = 0.0;
    let mut streamed = device.clone();
    streamed.stream_optimizer_state = true;
    let (gd, _) = training_step(&graph, "", &device).unwrap();
    let (gs, report) = training_step(&graph, "", &streamed).unwrap();
    let counter = |k: &str| report.counter(k);
    let (states, kept) = (counter("state_tensors"), counter("states_kept_on_device"));
    assert!(kept > 0 && kept < states, "{kept} of {states} kept");
    assert_eq!(counter("prefetched_states") + kept, states);
    let a = steps(&gd, &weights, &inputs);
    let b = steps(&gs, &weights, &inputs);
    assert_eq!(a.losses, b.losses);
    for (p, v) in &a.params {
        assert_eq!(v.to_f64(), b.params[p].to_f64(), "param.{p}");
    }
    for (s, v) in &a.states {
        assert_eq!(v.to_f64(), b.states[s].to_f64(), "{s}");
    }
    let lower = |g: &Graph| {
        let mut po = weft_passes::plan::PlanOptions::new(4, 16);
        po.device = device.device.0.clone();
        let p = weft_passes::plan::lower(g, &po).unwrap();
        p.check().unwrap();
        p
    };
    let (pd, ps) = (lower(&gd), lower(&gs));
    assert!(ps.memory.host_bytes > 0 && ps.memory.peak_bytes < pd.memory.peak_bytes);
    assert!(
        ps.cost.step_time_s <= pd.cost.step_time_s * 1.01,
        "{:?} vs {:?}",
        ps.cost,
        pd.cost
    );
}

/// The plan of streamed optimizer state: the streamed states are host bytes, their
/// copies run on the copy streams, the device's optimizer-state bytes and peak drop, the
/// plan validates, each state's reload waits for a compute node ahead of its update,
/// and a snapshot pins one parameter's streamed update. With `--offload-optimizer` it is
/// refused by name.
#[test]
fn streamed_optimizer_state_plan_and_snapshot() {
    let (graph, _, _) = load_fixture("llama");
    let mut o = opts(1, 1);
    o.grad_outputs = false;
    let (gd, _) = training_step(&graph, "dp=2", &o).unwrap();
    o.stream_optimizer_state = true;
    let (gs, _) = training_step(&graph, "dp=2", &o).unwrap();
    let lower = |g: &Graph| {
        let p = weft_passes::plan::lower(g, &weft_passes::plan::PlanOptions::new(4, 16)).unwrap();
        p.check().unwrap();
        p
    };
    let (pd, ps) = (lower(&gd), lower(&gs));
    let state = |p: &weft_ir::plan::ExecutionPlan| {
        p.memory
            .breakdown
            .get("optimizer_state")
            .copied()
            .unwrap_or(0)
    };
    assert!(state(&ps) < state(&pd), "{:?}", ps.memory.breakdown);
    assert!(ps.memory.host_bytes > 0 && ps.memory.peak_bytes < pd.memory.peak_bytes);
    // The memory estimate (`compile --stats`) counts the streamed state on the host, and
    // its copies back are not offloaded activations.
    let b = weft_passes::memory::bindings(&gs, &o);
    let (ed, es) = (
        weft_passes::memory::estimate(&gd, &b),
        weft_passes::memory::estimate(&gs, &b),
    );
    assert!(es.host_optimizer > 0 && ed.host_optimizer == 0, "{es:?}");
    assert_eq!(
        es.optimizer + es.host_optimizer,
        ed.optimizer,
        "{es:?} {ed:?}"
    );
    assert_eq!(es.offloaded, 0, "{es:?}");
    for i in &ps.instructions {
        if i.op == "reload" || i.op == "offload" {
            assert_ne!(i.stream, 0, "{i:?}");
        }
    }
    for &n in gs.nodes() {
        if matches!(gs.node(n).op, weft_ir::Op::Reload { .. }) {
            assert_eq!(
                gs.node(n).operands.len(),
                2,
                "a prefetch waits for one node"
            );
        }
    }
    // On a link whose directions share a duplex rate and whose copies slow compute (the
    // h100 profile, as measured), the streamed step predicts longer than on one without.
    let on = |duplex: f64, slowdown: f64| {
        let mut po = weft_passes::plan::PlanOptions::new(4, 16);
        po.device = weft_passes::plan::profile::preset("h100").unwrap();
        po.device.host_duplex_gbps = duplex;
        po.device.host_copy_compute_slowdown = slowdown;
        weft_passes::plan::lower(&gs, &po).unwrap().cost
    };
    let (plain, measured) = (on(0.0, 0.0), on(72.0, 0.07));
    assert!(
        measured.step_time_s > plain.step_time_s,
        "{measured:?} vs {plain:?}"
    );
    assert!(
        measured.compute_s > plain.compute_s,
        "{measured:?} vs {plain:?}"
    );
    let param = "model.layers.0.mlp.down_proj.weight";
    let text = optimizer_lines(&gs, param);
    insta::assert_snapshot!(text);
    o.offload_optimizer = true;
    let err = training_step(&graph, "dp=2", &o).unwrap_err().to_string();
    assert!(
        err.contains("--stream-optimizer-state") && err.contains("--offload-optimizer"),
        "{err}"
    );
}

/// `weft shard --zero` writes the ZeRO-partitioned training state (parameters and
/// AdamW moments) and `--unshard` reads it back byte for byte in the universal layout
/// (each state shaped as its parameter), so a run resumes on another mesh and stage:
/// dp=2,tp=2 at stage 1, then the unsharded state again on dp=2,sp=2 at stage 3.
#[test]
fn shard_round_trips_the_zero_training_state_across_meshes() {
    let dir = std::env::temp_dir().join(format!("weft-zero-shard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    // A universal checkpoint: the fixture's parameters and non-trivial moments.
    let file = universal_checkpoint(&dir, "llama", |v| v * 0.5 - 0.125, |v| v * v + 0.25);
    // As stored (the moments rounded to f32).
    let ckpt = weft_frontends::read_safetensors(&file).unwrap();
    let mut from = file.clone();
    for (i, (mesh, zero, files)) in [("dp=2,tp=2", "1", 4), ("dp=2,sp=2", "3", 4)]
        .into_iter()
        .enumerate()
    {
        let shards = dir.join(format!("shards{i}"));
        let (code, out, err) = weft(&[
            "shard",
            &s(&fixture("llama")),
            "--weights",
            &s(&from),
            "--mesh",
            mesh,
            "--zero",
            zero,
            "-o",
            &s(&shards),
            "--json",
        ]);
        assert_eq!(code, 0, "{mesh}: {err}");
        assert_eq!(
            json(&out)["files"].as_array().unwrap().len(),
            files,
            "{mesh}: {out}"
        );
        // Each rank holds its chunk of every moment (flat, its share of the local part
        // over the data-parallel group), and at stage 3 its rows of each parameter.
        let rank0 = weft_frontends::read_safetensors(
            &shards.join(json(&out)["files"][0].as_str().unwrap()),
        )
        .unwrap();
        let w = "model.layers.0.mlp.down_proj.weight";
        // tp=2 halves the local part, then the group (dp, or dp x sp) shares it.
        let (local, group) = if mesh.contains("tp") { (2, 2) } else { (1, 4) };
        assert_eq!(
            rank0[&format!("optim.m.{w}")].numel() * group * local,
            ckpt[w].numel(),
            "{mesh}: the moment's chunk"
        );
        if zero == "3" {
            assert_eq!(rank0[w].shape[0] * 4, ckpt[w].shape[0], "{mesh}: the rows");
        }
        let back = dir.join(format!("back{i}.safetensors"));
        unshard_is_byte_exact(&shards, &back, &ckpt, mesh);
        from = back;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft shard --zero 3` of stacked experts split by the rows of dim 1 (2 local experts
/// over `dp=8,ep=2`'s expert group of 4): each rank holds `[2, its rows, C]` of the
/// experts and its flat piece of their moments, and unsharding gives back the universal
/// checkpoint byte for byte.
#[test]
fn shard_round_trips_experts_split_by_dim1() {
    let dir = std::env::temp_dir().join(format!("weft-zero-dim1-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    // The checkpoint in the program's parameter names (the experts stacked).
    let (_, weights, _) = load_fixture("mixtral");
    let mut ckpt = BTreeMap::new();
    for (name, t) in &weights {
        let x = t.to_f64();
        ckpt.insert(name.clone(), t.clone());
        for (state, f) in [("m", 0.5), ("v", 0.25)] {
            let vals: Vec<f64> = x.iter().map(|&e| e * f + 0.125).collect();
            ckpt.insert(
                format!("optim.{state}.{name}"),
                HostTensor::floats(DType::F32, t.shape.clone(), vals),
            );
        }
    }
    let file = dir.join("train.safetensors");
    weft_frontends::save_safetensors(&file, &ckpt).unwrap();
    let ckpt = weft_frontends::read_safetensors(&file).unwrap();
    let shards = dir.join("shards");
    let (code, out, err) = weft(&[
        "shard",
        &s(&fixture("mixtral")),
        "--weights",
        &s(&file),
        "--mesh",
        "dp=8,ep=2",
        "--zero",
        "3",
        "-o",
        &s(&shards),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let rank0 =
        weft_frontends::read_safetensors(&shards.join(json(&out)["files"][0].as_str().unwrap()))
            .unwrap();
    let w = "model.layers.0.mlp.experts.gate_up_proj";
    let full = &ckpt[w].shape;
    assert_eq!(
        rank0[w].shape,
        vec![full[0] / 2, full[1] / 4, full[2]],
        "the rows of dim 1 of the local experts"
    );
    assert_eq!(rank0[&format!("optim.m.{w}")].numel() * 8, ckpt[w].numel());
    unshard_is_byte_exact(&shards, &dir.join("back.safetensors"), &ckpt, "dp=8,ep=2");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The uneven fixture (`llama_odd`: hidden 35, intermediate 67, vocab 131) reproduces
/// its PyTorch reference: logits and loss within 1e-5, gradients within 1e-4.
#[test]
fn uneven_fixture_reproduces_pytorch() {
    let (graph, weights, inputs) = load_fixture("llama_odd");
    let reference =
        weft_frontends::read_safetensors(&fixture("llama_odd").join("reference.safetensors"))
            .unwrap();
    let r = reference_run(&graph, &weights, &inputs);
    for out in ["logits", "loss"] {
        let e = rel_err(&r.outputs[out], &reference[out]);
        assert!(e < 1e-5, "llama_odd: {out} rel err {e:e}");
    }
    assert_eq!(r.grads.len(), weights.len());
    for (name, g) in &r.grads {
        let e = rel_err(g, &reference[&format!("grad.{name}")]);
        assert!(e < 1e-4, "llama_odd: grad.{name} rel err {e:e}");
    }
}

/// The state a step returns holds no padding: every optimizer state (the pieces of all
/// ranks, joined) has exactly its parameter's element count.
fn assert_unpadded_states(g: &Graph, weights: &BTreeMap<String, HostTensor>, what: &str) {
    let mut w = weights.clone();
    w.extend(weft_passes::optimizer::initial_state(g, weights).unwrap());
    for (name, _) in g.params() {
        let Some(p) = name
            .strip_prefix("optim.")
            .and_then(|r| r.split_once('.'))
            .map(|(_, p)| p)
        else {
            continue;
        };
        assert_eq!(
            w[&name].numel(),
            weights[p].numel(),
            "{what}: `{name}` is not exactly its parameter's size"
        );
    }
}

/// ZeRO stages 1, 2 and 3 on groups the fixture's sizes do not divide (dp=2, dp=3,
/// cp=2 (its 5 heads rule out sp=2); the groups of two axes dp x cp of 4 and 6 ranks,
/// split near-evenly over their flattened ranks; dp and dp x cp with tp=2, whose
/// even tp shards are split over the group inside their tp partition and whose
/// per-rank tp shards (5 heads over tp=2) each split their own size over the group;
/// at stage 3 those split by tp on dim 0 shard their state only, those split on their
/// columns (o_proj, down_proj) their rows) match the one-rank step's gradients, parameters and states
/// after `K` steps, and store no padding: a rank's state is exactly its piece, and its
/// rows at stage 3 a per-rank width over the whole group.
#[test]
fn uneven_groups_every_stage() {
    let cases: &[(&str, u8, u32)] = &[
        ("dp=2", 1, 1),
        ("dp=2", 2, 2),
        ("dp=2", 3, 1),
        ("dp=3", 1, 1),
        ("dp=3", 2, 1),
        ("dp=3", 3, 2),
        ("cp=2", 2, 1),
        ("cp=2", 3, 1),
        ("dp=2,cp=2", 1, 2),
        ("dp=2,cp=2", 2, 1),
        ("dp=2,cp=2", 2, 2),
        ("dp=2,cp=2", 3, 2),
        ("dp=3,cp=2", 1, 1),
        ("dp=3,cp=2", 2, 2),
        ("dp=3,cp=2", 3, 2),
        ("dp=2,tp=2", 1, 1),
        ("dp=2,tp=2", 1, 2),
        ("dp=2,tp=2", 2, 2),
        ("dp=2,tp=2", 3, 1),
        ("dp=2,tp=2", 3, 2),
        ("dp=3,tp=2", 1, 2),
        ("dp=3,tp=2", 2, 2),
        ("dp=3,tp=2", 3, 2),
        ("dp=3,cp=2,tp=2", 1, 2),
        ("dp=3,cp=2,tp=2", 2, 2),
        ("dp=3,cp=2,tp=2", 3, 1),
    ];
    let (threes, others): (Vec<_>, Vec<_>) = cases.iter().partition(|c| c.0.starts_with("dp=3"));
    check_batch("llama_odd", 4, &others);
    check_batch("llama_odd", 6, &threes);
    let (graph, weights, _) = load_fixture("llama_odd");
    for &(mesh, zero, micro) in cases {
        let what = format!("llama_odd {mesh} zero={zero} micro={micro}");
        let batch = if mesh.starts_with("dp=3") { 6 } else { 4 };
        let o = TrainOptions {
            batch: Some(batch),
            ..opts(zero, micro)
        };
        let (g, report) = training_step(&graph, mesh, &o).unwrap();
        assert_unpadded_states(&g, &weights, &what);
        // The per-rank widths lower to a plan that validates.
        let plan = weft_passes::plan::lower(&g, &weft_passes::plan::PlanOptions::new(batch, 16))
            .unwrap_or_else(|e| panic!("{what}: plan: {e}"));
        plan.check()
            .unwrap_or_else(|e| panic!("{what}: plan check: {e}"));
        if mesh == "dp=2,tp=2" && zero < 3 {
            // q_proj's moment: 840 and 560 elements on tp ranks 0 and 1, each over dp,
            // in the plan's per-rank bytes (rank = dp * 2 + tp).
            let p = plan
                .params
                .iter()
                .find(|p| p.name == "optim.m.model.layers.0.self_attn.q_proj.weight")
                .unwrap();
            let b = plan.buffers.iter().find(|b| b.id == p.buffer).unwrap();
            let per: Vec<u64> = b
                .per_rank_bytes
                .clone()
                .unwrap_or_else(|| panic!("{what}: {b:?}"))
                .iter()
                .map(|x| x / p.dtype.size_bytes())
                .collect();
            assert_eq!(per, vec![420, 280, 420, 280], "{what}: per-rank elements");
        }
        let stat = |k: &str| {
            report
                .passes
                .iter()
                .find(|p| p.pass == "optimizer")
                .and_then(|p| p.counters.get(k).copied())
                .unwrap_or(0)
        };
        // Every group splits every size, of one axis or several, and so do tp=2's
        // per-rank shards (5 heads, 35 columns): each tp rank its own size.
        let uneven = stat("unsharded_uneven");
        assert_eq!(uneven, 0, "{what}: {uneven} unsharded");
        assert_eq!(
            stat("sharded") + uneven,
            weights.len() as u64,
            "{what}: every parameter accounted for"
        );
        if zero == 3 && mesh.contains("tp") {
            // o_proj's tp shards (35 rows of 24 or 16 columns) are rows over the group;
            // q_proj's (24 or 16 rows) keep their rows and shard their state only.
            let m = weft_ir::Mesh::parse(mesh).unwrap();
            let z = (m.world_size() / 2) as i64;
            let mut want = vec![35 / z; z as usize];
            for w in want.iter_mut().take((35 % z) as usize) {
                *w += 1;
            }
            let o = g.param_partition("model.layers.0.self_attn.o_proj.weight");
            assert!(
                o.iter()
                    .any(|p| p.kind == "zero" && p.dim == 0 && p.pieces == vec![want.clone()]),
                "{what}: o_proj {o:?}"
            );
            let q = g.param_partition("model.layers.0.self_attn.q_proj.weight");
            assert!(!q.iter().any(|p| p.kind == "zero"), "{what}: q_proj {q:?}");
            assert!(stat("stage3_whole") > 0, "{what}");
        }
        if zero == 3 && !mesh.contains("tp") {
            // The embedding's 131 rows are this rank's width of a per-rank table over
            // the whole group (one axis, or several flattened row-major).
            let (_, v) = g
                .params()
                .into_iter()
                .find(|(n, _)| n == "model.embed_tokens.weight")
                .unwrap();
            let rows = &g.ty(v).shape[0];
            let m = weft_ir::Mesh::parse(mesh).unwrap();
            let widths: Vec<i64> = (0..m.world_size())
                .map(|r| {
                    let mut b = weft_ir::Bindings::new();
                    for (i, (a, n)) in m.axes.iter().enumerate() {
                        b = b.with(a, *n as i64).with_coord(a, m.coords(r)[i] as i64);
                    }
                    rows.eval(&b).unwrap()
                })
                .collect();
            assert_eq!(widths.iter().sum::<i64>(), 131, "{what}: rows {rows}");
            let z = m.world_size() as i64;
            let mut want = vec![131 / z; z as usize];
            for w in want.iter_mut().take((131 % z) as usize) {
                *w += 1;
            }
            assert_eq!(widths, want, "{what}: rows {rows}");
            if mesh.contains(',') {
                // Split over the flattened group: one partition over both axes.
                let parts = g.param_partition("model.embed_tokens.weight");
                assert_eq!(parts.len(), 1, "{what}: {parts:?}");
                assert_eq!(parts[0].axes, vec!["dp".to_string(), "cp".to_string()]);
                assert_eq!(parts[0].pieces, vec![want.clone()], "{what}");
            }
        }
    }
}

/// The collectives (and the only padding: zeros in their buffers) of ZeRO-3 over an
/// uneven dp=3 group: grad-sync's reduce_scatters of `[3, chunk]` buffers and the
/// per-use gathers of each parameter's rows.
#[test]
fn zero_uneven_collectives_snapshot() {
    let (graph, _, _) = load_fixture("llama_odd");
    let mut o = opts(3, 1);
    o.bucket_bytes = 1 << 20;
    o.grad_outputs = false;
    let (g, _) = training_step(&graph, "dp=3", &o).unwrap();
    let mut text = String::from("== llama_odd dp=3 zero=3\n");
    for &n in g.nodes() {
        let d = g.node(n);
        if !d.op.is_collective() && !matches!(d.op, Op::Full { .. }) {
            continue;
        }
        let Some(p) = &d.meta.provenance else {
            continue;
        };
        if p.pass != "grad-sync" && p.pass != "optimizer" {
            continue;
        }
        let from = d
            .operands
            .first()
            .map(|v| format!("{} ", g.ty(*v)))
            .unwrap_or_default();
        text.push_str(&format!(
            "{} {from}-> {}: {}\n",
            d.op.name(),
            g.ty(d.results[0]),
            p.reason
        ));
    }
    insta::assert_snapshot!(text);
}

/// The partitions ZeRO records on a group of two axes that the fixture's sizes do not
/// divide (`llama_odd` on dp=2,cp=2 at stage 3): one `zero dp*cp` group partition per
/// parameter and state, one size per group rank, in the printed IR and in the plan,
/// and the per-rank tables over both axes that the parameters' types hold; and the
/// `zero tp*dp` group partition of the flat state of a tp shard whose size differs per
/// tp rank (`llama_odd` on dp=2,tp=2 at stage 2).
#[test]
fn zero_group_partitions_snapshot() {
    let (graph, _, _) = load_fixture("llama_odd");
    let (g, _) = training_step(&graph, "dp=2,cp=2", &opts(3, 1)).unwrap();
    let mut text = String::from("== llama_odd dp=2,cp=2 zero=3: printed IR\n");
    let printed = weft_ir::print(&g);
    for line in printed.lines().filter(|l| l.starts_with("partition ")) {
        if line.contains("layers.1.") {
            continue;
        }
        text.push_str(line);
        text.push('\n');
    }
    assert_eq!(weft_ir::parse(&printed).unwrap(), g, "the IR round-trips");
    text.push_str("== parameter types\n");
    for (name, v) in g.params() {
        if !name.contains("layers.1.") && !name.starts_with("optim.") {
            text.push_str(&format!("{name}: {}\n", g.ty(v)));
        }
    }
    let plan = weft_passes::plan::lower(&g, &weft_passes::plan::PlanOptions::new(4, 16)).unwrap();
    plan.check().unwrap();
    text.push_str("== plan placements\n");
    for p in &plan.params {
        if p.name == "model.embed_tokens.weight" || p.name == "optim.m.model.norm.weight" {
            text.push_str(&format!(
                "{}: {}\n",
                p.name,
                serde_json::to_string(&p.partitions).unwrap()
            ));
        }
    }
    // A tp shard whose size differs per tp rank (q_proj: 24 and 16 rows of 35 over
    // tp=2): its flat state is one group partition over tp and dp.
    let (g, _) = training_step(&graph, "dp=2,tp=2", &opts(2, 1)).unwrap();
    text.push_str("== llama_odd dp=2,tp=2 zero=2: q_proj and its moment\n");
    let printed = weft_ir::print(&g);
    for line in printed
        .lines()
        .filter(|l| l.starts_with("partition ") && l.contains("layers.0.self_attn.q_proj."))
    {
        text.push_str(line);
        text.push('\n');
    }
    assert_eq!(weft_ir::parse(&printed).unwrap(), g, "the IR round-trips");
    insta::assert_snapshot!(text);
}

/// `weft shard --zero` on groups of two axes that the sizes do not divide: each
/// rank's pieces are those of the flattened group (131 rows over dp=2,cp=2 at stage 3
/// are 33, 33, 33, 32), and `--unshard` gives the state back byte for byte; then
/// dp=3,cp=2 at stage 1 from that.
#[test]
fn shard_round_trips_the_zero_state_of_uneven_groups() {
    let dir = std::env::temp_dir().join(format!("weft-zero-group-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let file = universal_checkpoint(&dir, "llama_odd", |v| v * 0.5 + 0.25, |v| v * v + 0.5);
    let ckpt = weft_frontends::read_safetensors(&file).unwrap();
    let w = "model.embed_tokens.weight"; // [131, 35]
    let mut from = file.clone();
    for (i, (mesh, zero, want)) in [
        ("dp=2,cp=2", "3", vec![33 * 35, 33 * 35, 33 * 35, 32 * 35]),
        ("dp=3,cp=2", "1", vec![765, 764, 764, 764, 764, 764]),
    ]
    .into_iter()
    .enumerate()
    {
        let shards = dir.join(format!("shards{i}"));
        let (code, out, err) = weft(&[
            "shard",
            &s(&fixture("llama_odd")),
            "--weights",
            &s(&from),
            "--mesh",
            mesh,
            "--zero",
            zero,
            "-o",
            &s(&shards),
            "--json",
        ]);
        assert_eq!(code, 0, "{mesh}: {err}");
        let files: Vec<String> = json(&out)["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        assert_eq!(files.len(), want.len(), "{mesh}: {out}");
        let held: Vec<_> = files
            .iter()
            .map(|f| weft_frontends::read_safetensors(&shards.join(f)).unwrap())
            .collect();
        let moment: Vec<usize> = held
            .iter()
            .map(|r| r[&format!("optim.v.{w}")].numel())
            .collect();
        assert_eq!(moment, want, "{mesh}: each rank's piece of the moment");
        if zero == "3" {
            let rows: Vec<usize> = held.iter().map(|r| r[w].shape[0]).collect();
            assert_eq!(rows, vec![33, 33, 33, 32], "{mesh}: each rank's rows");
        }
        let back = dir.join(format!("back{i}.safetensors"));
        unshard_is_byte_exact(&shards, &back, &ckpt, mesh);
        from = back;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same round trip where the uneven group split sits inside an even tp split
/// (`llama` on dp=3,cp=2,tp=2 at stage 3: 12 files, each tp shard's rows over the
/// flattened dp x cp group).
#[test]
fn shard_round_trips_an_uneven_group_inside_tp() {
    let dir = std::env::temp_dir().join(format!("weft-zero-group-tp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let file = universal_checkpoint(&dir, "llama", |v| v * 0.5 - 0.25, |v| v * v + 0.75);
    let ckpt = weft_frontends::read_safetensors(&file).unwrap();
    let shards = dir.join("shards");
    let mesh = "dp=3,cp=2,tp=2";
    let (code, out, err) = weft(&[
        "shard",
        &s(&fixture("llama")),
        "--weights",
        &s(&file),
        "--mesh",
        mesh,
        "--zero",
        "3",
        "-o",
        &s(&shards),
        "--json",
    ]);
    assert_eq!(code, 0, "{mesh}: {err}");
    let files = json(&out)["files"].as_array().unwrap().clone();
    assert_eq!(files.len(), 12, "{mesh}: {out}");
    let layout = std::fs::read_to_string(shards.join("layout.json")).unwrap();
    assert!(layout.contains(r#""axis": "dp*cp""#) || layout.contains(r#""axis":"dp*cp""#));
    unshard_is_byte_exact(&shards, &dir.join("back.safetensors"), &ckpt, mesh);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft shard --zero` writes the uneven training state of `llama_odd` padding-free
/// (the ranks' pieces of every moment add up to its parameter, row widths differ by
/// one at stage 3), and `--unshard` reads it back byte for byte, so the run resumes on
/// another mesh: dp=3 at stage 1, then dp=2 at stage 3.
#[test]
fn shard_round_trips_the_uneven_zero_training_state() {
    let dir = std::env::temp_dir().join(format!("weft-zero-odd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let file = universal_checkpoint(&dir, "llama_odd", |v| v * 0.25 + 0.5, |v| v * v + 0.125);
    let ckpt = weft_frontends::read_safetensors(&file).unwrap();
    let w = "model.layers.0.mlp.down_proj.weight"; // [35, 67]
    let mut from = file.clone();
    for (i, (mesh, zero, ranks)) in [("dp=3", "1", 3), ("dp=2", "3", 2)].into_iter().enumerate() {
        let shards = dir.join(format!("shards{i}"));
        let (code, out, err) = weft(&[
            "shard",
            &s(&fixture("llama_odd")),
            "--weights",
            &s(&from),
            "--mesh",
            mesh,
            "--zero",
            zero,
            "-o",
            &s(&shards),
            "--json",
        ]);
        assert_eq!(code, 0, "{mesh}: {err}");
        let files: Vec<String> = json(&out)["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        assert_eq!(files.len(), ranks, "{mesh}: {out}");
        let held: Vec<_> = files
            .iter()
            .map(|f| weft_frontends::read_safetensors(&shards.join(f)).unwrap())
            .collect();
        let moment: Vec<usize> = held
            .iter()
            .map(|r| r[&format!("optim.m.{w}")].numel())
            .collect();
        let want = if zero == "3" {
            // Rows 18 and 17 of 35, each of 67 elements.
            vec![18 * 67, 17 * 67]
        } else {
            vec![782, 782, 781]
        };
        assert_eq!(moment, want, "{mesh}: each rank's piece of the moment");
        if zero == "3" {
            let rows: Vec<usize> = held.iter().map(|r| r[w].shape[0]).collect();
            assert_eq!(rows, vec![18, 17], "{mesh}: each rank's rows");
        }
        let back = dir.join(format!("back{i}.safetensors"));
        unshard_is_byte_exact(&shards, &back, &ckpt, mesh);
        from = back;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft shard --zero` of `llama_odd` on dp=2,tp=2 (5 heads, so tp ranks hold 3 and 2
/// heads of `q_proj`, 24 and 16 rows of 35): each tp rank's flattened shard split
/// over dp by its own size (840 elements as 420 + 420, 560 as 280 + 280), and
/// `--unshard` gives the state back byte for byte; then dp=3,tp=2 from that at stage 2
/// (560 as 187 + 187 + 186), then dp=2,tp=2 at stage 3 (o_proj, split by tp on its
/// columns, 35 rows of 24 or 16, is rows over dp: 18 + 17).
#[test]
fn shard_round_trips_the_zero_state_of_uneven_tp_shards() {
    let dir = std::env::temp_dir().join(format!("weft-zero-tp-odd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let file = universal_checkpoint(&dir, "llama_odd", |v| v * 0.5 + 0.125, |v| v * v + 0.25);
    let ckpt = weft_frontends::read_safetensors(&file).unwrap();
    let w = "model.layers.0.self_attn.q_proj.weight"; // [40, 35], 24 + 16 rows over tp
    let mut from = file.clone();
    // Files in rank order: rank = dp * 2 + tp.
    for (i, (mesh, zero, want)) in [
        ("dp=2,tp=2", "1", vec![420, 280, 420, 280]),
        ("dp=3,tp=2", "2", vec![280, 187, 280, 187, 280, 186]),
        ("dp=2,tp=2", "3", vec![420, 280, 420, 280]),
    ]
    .into_iter()
    .enumerate()
    {
        let shards = dir.join(format!("shards{i}"));
        let (code, out, err) = weft(&[
            "shard",
            &s(&fixture("llama_odd")),
            "--weights",
            &s(&from),
            "--mesh",
            mesh,
            "--zero",
            zero,
            "-o",
            &s(&shards),
            "--json",
        ]);
        assert_eq!(code, 0, "{mesh}: {err}");
        let files: Vec<String> = json(&out)["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        assert_eq!(files.len(), want.len(), "{mesh}: {out}");
        let held: Vec<_> = files
            .iter()
            .map(|f| weft_frontends::read_safetensors(&shards.join(f)).unwrap())
            .collect();
        let moment: Vec<usize> = held
            .iter()
            .map(|r| r[&format!("optim.m.{w}")].numel())
            .collect();
        assert_eq!(moment, want, "{mesh}: each rank's piece of the moment");
        if zero == "3" {
            // o_proj's tp shards, 35 rows of 24 or 16 columns, are rows over dp.
            let o = "model.layers.0.self_attn.o_proj.weight";
            let shapes: Vec<Vec<usize>> = held.iter().map(|r| r[o].shape.clone()).collect();
            assert_eq!(
                shapes,
                vec![vec![18, 24], vec![18, 16], vec![17, 24], vec![17, 16]],
                "{mesh}: each rank's rows of o_proj"
            );
        }
        let back = dir.join(format!("back{i}.safetensors"));
        unshard_is_byte_exact(&shards, &back, &ckpt, mesh);
        from = back;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft shard --unshard` of `shards` into `back` gives every tensor of `ckpt` back, byte
/// for byte, and nothing else.
fn unshard_is_byte_exact(
    shards: &std::path::Path,
    back: &std::path::Path,
    ckpt: &BTreeMap<String, HostTensor>,
    mesh: &str,
) {
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (code, _, err) = weft(&[
        "shard",
        "--unshard",
        "--weights",
        &s(shards),
        "-o",
        &s(back),
    ]);
    assert_eq!(code, 0, "{mesh}: {err}");
    let got = weft_frontends::read_safetensors(back).unwrap();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        ckpt.keys().collect::<Vec<_>>(),
        "{mesh}"
    );
    for (name, t) in ckpt {
        assert_eq!(
            got[name].digest(),
            t.digest(),
            "{mesh}: `{name}` not byte-exact"
        );
    }
}

/// A universal training checkpoint in `dir`: fixture `fam`'s parameters and AdamW
/// moments `m(x)`, `v(x)` of each parameter value `x` (f32), saved as safetensors.
fn universal_checkpoint(
    dir: &std::path::Path,
    fam: &str,
    m: impl Fn(f64) -> f64,
    v: impl Fn(f64) -> f64,
) -> std::path::PathBuf {
    let mut ckpt =
        weft_frontends::read_safetensors(&fixture(fam).join("model.safetensors")).unwrap();
    let params: Vec<(String, HostTensor)> =
        ckpt.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
    for (name, t) in &params {
        let x = t.to_f64();
        for (state, f) in [("m", &m as &dyn Fn(f64) -> f64), ("v", &v)] {
            let vals: Vec<f64> = x.iter().map(|&e| f(e)).collect();
            ckpt.insert(
                format!("optim.{state}.{name}"),
                HostTensor::floats(DType::F32, t.shape.clone(), vals),
            );
        }
    }
    let file = dir.join("train.safetensors");
    weft_frontends::save_safetensors(&file, &ckpt).unwrap();
    file
}

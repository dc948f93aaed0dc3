//! Gradient accumulation: a step of N micro-batches gives the full-batch loss, logits
//! and gradients (the global mean over the valid tokens of the whole batch), issues the
//! same gradient reductions as one micro-batch, and keeps fewer activations alive.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{Graph, HostTensor};
use weft_passes::training::{CheckpointPolicy, TrainOptions};
use weft_passes::RunReport;
use weft_runtime::cpu::{run, Precision, RunOptions};

/// The fixture with a batch of 4, labels unevenly ignored, so the micro-batches hold
/// different numbers of valid tokens.
fn load(
    name: &str,
) -> (
    Graph,
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
) {
    load_fixture_batch4(name, |i, s| {
        i < s / 2 || i % 7 == 3 || (2 * s..3 * s).contains(&i) && i % 2 == 0
    })
}

fn compile(g: &Graph, mesh: &str, opts: &TrainOptions) -> (Graph, RunReport) {
    training_step(g, mesh, opts).unwrap_or_else(|e| panic!("{mesh} N={}: {e}", opts.micro_batches))
}

fn opts(n: u32) -> TrainOptions {
    TrainOptions {
        micro_batches: n,
        bucket_bytes: 8192,
        batch: Some(4),
        seq: Some(16),
        ..Default::default()
    }
}

#[test]
fn accumulated_gradients_equal_the_full_batch() {
    for (fam, meshes) in [
        ("llama", &["", "dp=2", "sp=2", "dp=2,sp=2", "tp=2"][..]),
        ("mixtral", &["", "dp=2,sp=2"][..]),
        ("qwen2", &["sp=2"][..]),
    ] {
        let (graph, weights, inputs) = load(fam);
        let reference = reference_run(&graph, &weights, &inputs);
        for mesh in meshes {
            for n in [2u32, 4] {
                if mesh.contains("dp=2") && n == 4 {
                    continue; // 4 rows: 2 per dp rank
                }
                let (g, _) = compile(&graph, mesh, &opts(n));
                weft_ir::verify(&g).unwrap_or_else(|r| panic!("{fam} {mesh} N={n}: {r}"));
                assert_eq!(weft_ir::parse(&weft_ir::print(&g)).unwrap(), g);
                let r = run(&g, &weights, &inputs, &RunOptions::new(Precision::F64))
                    .unwrap_or_else(|e| panic!("{fam} {mesh} N={n}: {e}"));
                for out in ["loss", "logits"] {
                    let e = rel_err(&r.outputs[out], &reference.outputs[out]);
                    assert!(e < 1e-10, "{fam} {mesh} N={n}: {out} rel err {e:e}");
                }
                for (p, want) in &reference.grads {
                    let e = rel_err(&r.outputs[&format!("grad.{p}")], want);
                    assert!(e < 1e-9, "{fam} {mesh} N={n}: grad {p} rel err {e:e}");
                }
            }
        }
    }
}

#[test]
fn n_micro_batches_issue_the_reductions_of_one() {
    let (graph, _, _) = load("llama");
    for mesh in ["dp=2,sp=2", "sp=2", "dp=2"] {
        let count = |n: u32| {
            let (_, r) = compile(&graph, mesh, &opts(n));
            let gs = r.passes.iter().find(|p| p.pass == "grad-sync").unwrap();
            (gs.counters["buckets"], gs.counters["collectives"])
        };
        let one = count(1);
        assert!(one.1 > 0);
        assert_eq!(count(2), one, "{mesh}");
        if !mesh.contains("dp") {
            assert_eq!(count(4), one, "{mesh}");
        }
    }
}

#[test]
fn micro_batches_keep_fewer_activations_alive() {
    let (graph, _, _) = load("llama");
    let peak = |n: u32, ck: CheckpointPolicy| {
        // At S = 2048 the activations, not the tiny parameters, dominate.
        let o = TrainOptions {
            checkpoint: ck,
            seq: Some(2048),
            ..opts(n)
        };
        let (g, _) = compile(&graph, "sp=2", &o);
        weft_passes::memory::estimate(&g, &weft_passes::memory::bindings(&g, &o))
    };
    let (one, four) = (
        peak(1, CheckpointPolicy::None),
        peak(4, CheckpointPolicy::None),
    );
    assert!(
        four.saved_activations == one.saved_activations,
        "saved over the step: {one:?} {four:?}"
    );
    assert!(
        four.peak_live * 2 < one.peak_live,
        "peak: {one:?} vs {four:?}"
    );
    // Each micro-batch's backward follows its forward: micro-batch 1's forward starts
    // after micro-batch 0's backward has begun.
    let o = opts(2);
    let (g, _) = compile(&graph, "sp=2", &o);
    let pos = |pred: &dyn Fn(&weft_ir::NodeMeta) -> bool| {
        g.nodes()
            .iter()
            .position(|&n| pred(&g.node(n).meta))
            .unwrap()
    };
    let bwd0 = pos(&|m| m.micro_batch == Some(0) && m.derived.is_some());
    let fwd1 = pos(&|m| m.micro_batch == Some(1) && m.derived.is_none());
    assert!(
        bwd0 < fwd1,
        "backward of micro-batch 0 at {bwd0}, forward of 1 at {fwd1}"
    );
}

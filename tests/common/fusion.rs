//! What the `fuse` checks share (fusion_check, attention_layout_check): a program after
//! `fuse` with the pass's counters, the training options each fixture's step is fused
//! under, and the assertion that a rewritten step computes what the original did.

use std::collections::BTreeMap;
use weft_ir::{Graph, HostTensor};
use weft_passes::training::{CheckpointPolicy, OffloadOptions, TrainOptions};
use weft_passes::{PassContext, PassManager};
use weft_runtime::cpu::{run, Precision, RunOptions};

use super::rel_err;

/// `g` after `fuse` (verified after the pass), with the pass's counters.
pub fn fused(g: &Graph) -> (Graph, BTreeMap<String, u64>) {
    let mut f = g.clone();
    let report = PassManager::default()
        .run(
            &mut f,
            &PassContext::new(g.mesh.clone()),
            &["fuse"],
            &mut std::io::sink(),
        )
        .unwrap_or_else(|e| panic!("fuse on {}: {e}", g.name));
    let counters = report.passes[0].counters.clone();
    (f, counters)
}

/// Full activation checkpointing with every saved activation offloaded.
pub fn checkpoint_and_offload() -> TrainOptions {
    let mut opts = TrainOptions::default();
    opts.checkpoint = CheckpointPolicy::Full;
    opts.offload = Some(OffloadOptions {
        min_bytes: 0,
        keep_last: 0,
        ..OffloadOptions::default()
    });
    opts
}

/// Gradient accumulation over two micro-batches.
pub fn two_micro_batches() -> TrainOptions {
    let mut opts = TrainOptions::default();
    opts.micro_batches = 2;
    opts
}

/// `fixture on `mesh` (checkpoint .., offload .., micro-batches ..)`, naming a case.
pub fn case_name(fixture: &str, mesh: &str, opts: &TrainOptions) -> String {
    format!(
        "{fixture} on `{mesh}` (checkpoint {}, offload {}, micro-batches {})",
        opts.checkpoint,
        opts.offload.is_some(),
        opts.micro_batches
    )
}

/// f64 to 1e-10 (a rewrite that only reorders sums) and f32 to 1e-4.
pub const F64_AND_F32: &[(Precision, f64)] = &[(Precision::F64, 1e-10), (Precision::F32, 1e-4)];

/// Runs the program before and after a rewrite in each `(precision, tol)` of `checks`
/// and compares every output (the gradients among them) to `tol` of each one's largest
/// magnitude.
pub fn same_outputs(
    what: &str,
    before: &Graph,
    after: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
    checks: &[(Precision, f64)],
) {
    for &(precision, tol) in checks {
        let opts = RunOptions::new(precision);
        let a =
            run(before, weights, inputs, &opts).unwrap_or_else(|e| panic!("{what} before: {e}"));
        let b = run(after, weights, inputs, &opts).unwrap_or_else(|e| panic!("{what} after: {e}"));
        assert_eq!(
            a.outputs.keys().collect::<Vec<_>>(),
            b.outputs.keys().collect::<Vec<_>>(),
            "{what}: the same outputs"
        );
        assert!(
            a.outputs.keys().any(|k| k.starts_with("grad.")),
            "{what}: gradients compared"
        );
        for (name, want) in &a.outputs {
            let err = rel_err(&b.outputs[name], want);
            assert!(
                err <= tol,
                "{what}: `{name}` differs by {err:e} in {precision:?} (tolerance {tol:e})"
            );
        }
    }
}

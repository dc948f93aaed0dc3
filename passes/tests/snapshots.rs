//! One snapshot per (pass, model, mesh), named `<pass>__<model>__<mesh>`: the unified
//! diff of the graph text the pass made (as `--print-changes` shows it) and the pass's
//! counters. Earlier passes run first; changing another pass only churns its own
//! snapshots and, through context lines, rarely these.
//!
//! `pipeline__<model>__<mesh>` is the whole compiled program, for review.

mod util;
use util::*;

use weft_ir::*;
use weft_passes::*;

const MODELS: &[&str] = &["llama-tiny", "qwen3-tiny", "mixtral-tiny"];
const MESHES: &[(&str, &str)] = &[("sp2", "sp=2"), ("sp4", "sp=4"), ("dp2-sp2", "dp=2,sp=2")];

/// The diff and counters of `pass`, after the passes before it in the default pipeline.
fn pass_diff(model_name: &str, mesh: &str, pass: &str) -> Option<String> {
    let (mut g, cx) = before_pass(model_name, mesh, pass)?;
    Some(diff_of(&mut g, &cx, pass))
}

fn all_meshes_for(pass: &str, models: &[&str]) {
    for m in models {
        for (tag, mesh) in MESHES {
            if let Some(text) = pass_diff(m, mesh, pass) {
                snapshot(&format!("{pass}__{m}__{tag}"), &text);
            }
        }
    }
}

#[test]
fn shard_inputs() {
    all_meshes_for("shard-inputs", &["llama-tiny"]);
}

#[test]
fn shard_seq() {
    all_meshes_for("shard-seq", MODELS);
}

#[test]
fn ulysses_attention() {
    all_meshes_for("ulysses-attention", MODELS);
}

#[test]
fn sp_loss() {
    all_meshes_for("sp-loss", &["llama-tiny"]);
}

#[test]
fn canonicalize() {
    all_meshes_for("canonicalize", &["llama-tiny"]);
}

#[test]
fn whole_programs() {
    for (tag, mesh) in MESHES {
        let mut g = preset("llama-tiny");
        let cx = PassContext::new(Mesh::parse(mesh).unwrap());
        run_pipeline(&mut g, &cx, &default_pipeline(&cx.mesh)).unwrap();
        snapshot(&format!("pipeline__llama-tiny__{tag}"), &print(&g));
    }
}

/// The MoE load-balancing loss (mixtral with `output_router_logits: true`): `shard-seq`
/// turns its one sum over the tokens into this rank's partial sum and an `all_reduce`
/// over sp then dp (the aux collective), so the token fractions stay global.
#[test]
fn shard_seq_moe_aux_loss() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/mixtral_aux");
    for (tag, mesh) in [("sp2", "sp=2"), ("dp2-sp2", "dp=2,sp=2")] {
        let text = pass_diff(model, mesh, "shard-seq").unwrap();
        snapshot(&format!("shard-seq__mixtral-aux__{tag}"), &text);
    }
}

/// gpt-oss (`gpt-oss-tiny`): ulysses-attention slices each layer's sinks to the rank's
/// q heads; tensor-parallel splits the sinks with the heads and the transposed experts
/// in (gate, up) column pairs, with 1/tp of the down bias per rank; expert-parallel
/// carries the expert biases and the row-keeping de-interleave reshapes.
#[test]
fn gpt_oss_sinks_and_experts() {
    for (pass, tag, mesh) in [
        ("ulysses-attention", "sp2", "sp=2"),
        ("tensor-parallel", "tp2", "tp=2"),
        ("expert-parallel", "ep2", "ep=2"),
    ] {
        let text = pass_diff("gpt-oss-tiny", mesh, pass).unwrap();
        snapshot(&format!("{pass}__gpt-oss-tiny__{tag}"), &text);
    }
}

/// Context parallelism: the zigzag input split, the ring rewrite (ring_shift steps,
/// per-block attention with log-sum-exp, the merge) alone and with Ulysses inside.
#[test]
fn ring_attention() {
    for (tag, mesh) in [("cp2", "cp=2"), ("cp2-sp2", "cp=2,sp=2")] {
        for pass in ["shard-inputs", "ring-attention"] {
            if pass == "shard-inputs" && tag != "cp2" {
                continue;
            }
            let text = pass_diff("llama-tiny", mesh, pass).unwrap();
            snapshot(&format!("{pass}__llama-tiny__{tag}"), &text);
        }
    }
}

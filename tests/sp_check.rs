//! Sequence (and data) parallelism preserves meaning, checked by running it: the CPU
//! reference runtime executes the unsharded graph and the compiled SPMD programs on the
//! same weights and inputs (f64), and the loss, logits and gradients must agree.
//!
//! Labels include -100 spread unevenly across ranks (one rank's block of one row is all
//! ignored), so a mean of per-shard means would fail; GQA with fewer kv heads than sp
//! exercises the kv-head repeat. Because every pass preserves meaning (shard-inputs and
//! shard-seq keep the program whole with gathers), the graph after *each* pass is run too.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{HostTensor, Mesh};
use weft_passes::{default_pipeline, lookup, PassContext};
use weft_runtime::cpu::RunResult;

#[path = "../passes/tests/common/mod.rs"]
mod llama_graph;

/// The fixture's model and weights, with its input ids and our uneven labels.
fn case(name: &str) -> Case {
    let dir = fixture(name);
    let model =
        weft_frontends::load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    let ids = inputs["input_ids"].to_i64();
    let (b, s) = (inputs["input_ids"].shape[0], inputs["input_ids"].shape[1]);
    assert_eq!((b, s), (2, 16));
    let mut labels = ids.clone();
    // Row 0: a few ignored labels, unevenly over the blocks. Row 1: labels 13..16
    // ignored, so after the shift positions 12..15 (rank 3's block at sp=4) hold none.
    for i in [1, 2, 3, 6, 9] {
        labels[i] = -100;
    }
    for i in [2, 13, 14, 15] {
        labels[s + i] = -100;
    }
    inputs.insert(
        "labels".into(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], labels),
    );
    Case {
        graph: model.graph,
        weights,
        inputs,
    }
}

/// A hand-built variant (mask input, position_ids input, mean loss) with random
/// weights: 0.2 * normal, so the attention is far from uniform.
fn variant(cfg: llama_graph::Config) -> Case {
    let graph = llama_graph::build(&cfg);
    let model =
        weft_frontends::Model::from_graph(graph, weft_frontends::Origin::Preset(cfg.name.clone()))
            .unwrap();
    let mut weights = weft_frontends::random_weights(&model, 7);
    for w in weights.values_mut() {
        if let weft_ir::HostData::F64(v) = &mut w.data {
            v.iter_mut().for_each(|x| *x *= 10.0);
        }
    }
    let (b, s) = (2usize, 16usize);
    let mut rng = 12345u64;
    let mut next = move || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) as i64
    };
    let ids: Vec<i64> = (0..b * s).map(|_| next() % 127).collect();
    let mut labels = ids.clone();
    for i in [0, 5, 6, 7, 20, 29, 30, 31] {
        labels[i] = -100;
    }
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "input_ids".to_string(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], ids),
    );
    inputs.insert(
        "labels".to_string(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], labels),
    );
    if cfg.mask {
        // Keep-mask [B, 1, S, S]: the diagonal always, other keys at random.
        let m: Vec<i64> = (0..b * s * s)
            .map(|k| {
                if (k / s) % s == k % s {
                    1
                } else {
                    (next() % 3 != 0) as i64
                }
            })
            .collect();
        inputs.insert(
            "attention_mask".to_string(),
            HostTensor::ints(weft_ir::DType::Bool, vec![b, 1, s, s], m),
        );
    }
    if cfg.position_ids {
        // Row 0 starts at 3, row 1 at 0 (left padding / packed sequences).
        let p: Vec<i64> = (0..b * s)
            .map(|k| (k % s) as i64 + if k < s { 3 } else { 0 })
            .collect();
        inputs.insert(
            "position_ids".to_string(),
            HostTensor::ints(weft_ir::DType::I64, vec![b, s], p),
        );
    }
    Case {
        graph: model.graph,
        weights,
        inputs,
    }
}

fn compare(what: &str, want: &RunResult, got: &RunResult) {
    for name in ["loss", "logits"] {
        assert_close(
            &format!("{what}: {name}"),
            &want.outputs[name],
            &got.outputs[name],
        );
    }
    for (p, g) in &want.grads {
        assert_close(&format!("{what}: grad {p}"), g, &got.grads[p]);
    }
}

/// Compiles `c` for `mesh` pass by pass, running the graph after each pass (and its
/// gradients after the last) against the unsharded reference.
fn check(name: &str, mesh: &str, every_pass: bool) {
    check_case(name, case(name), mesh, every_pass)
}

fn check_case(name: &str, c: Case, mesh: &str, every_pass: bool) {
    let reference = execute(&c.graph, &c, true);
    let cx = PassContext::new(Mesh::parse(mesh).unwrap());
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    let pipeline = default_pipeline(&cx.mesh);
    for (i, pass) in pipeline.iter().enumerate() {
        lookup(pass)
            .unwrap()
            .run(&mut g, &cx)
            .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} after {pass}: {r}"));
        let last = i + 1 == pipeline.len();
        if every_pass || last {
            let got = execute(&g, &c, last);
            let mut want = reference.clone();
            if !last {
                want.grads.clear();
            }
            compare(&format!("{name} on {mesh} after {pass}"), &want, &got);
        }
    }
}

#[test]
fn labels_are_uneven_across_ranks() {
    // Valid (shifted) labels per rank at sp=4 differ, one rank has none in row 1.
    let c = case("llama");
    let l = c.inputs["labels"].to_i64();
    let shifted = |row: usize, i: usize| {
        if i + 1 < 16 {
            l[row * 16 + i + 1]
        } else {
            -100
        }
    };
    let counts: Vec<usize> = (0..4)
        .map(|r| {
            (r * 4..r * 4 + 4)
                .filter(|&i| shifted(1, i) != -100)
                .count()
        })
        .collect();
    assert_eq!(counts, [3, 4, 4, 0]);
}

#[test]
fn llama_gqa_sp2_every_pass() {
    check("llama", "sp=2", true);
}

#[test]
fn llama_gqa_sp4_kv_heads_repeated_every_pass() {
    check("llama", "sp=4", true);
}

#[test]
fn llama_dp2_sp2_every_pass() {
    check("llama", "dp=2,sp=2", true);
}

#[test]
fn llama_dp2() {
    check("llama", "dp=2", false);
}

#[test]
fn llama_one_kv_head() {
    check("llama_kv1", "sp=2", false);
    check("llama_kv1", "sp=4", false);
}

#[test]
fn llama3_rope_scaling_sp4() {
    check("llama_rope3", "sp=4", false);
}

#[test]
fn qwen3_qk_norm() {
    check("qwen3", "sp=4", false);
    check("qwen3", "dp=2,sp=2", false);
}

#[test]
fn qwen2_biases_and_tied_embeddings() {
    check("qwen2", "sp=2", false);
}

#[test]
fn phi3_fused_projections() {
    check("phi3", "sp=4", false);
}

#[test]
fn mixtral_moe() {
    check("mixtral", "sp=2", false);
    check("mixtral", "dp=2,sp=2", false);
}

#[test]
fn qwen3_moe() {
    check("qwen3_moe", "sp=4", false);
}

#[test]
fn attention_mask_input() {
    for mesh in ["sp=2", "sp=4", "dp=2,sp=2"] {
        let cfg = llama_graph::Config {
            mask: true,
            ..llama_graph::Config::llama_tiny()
        };
        check_case("llama+mask", variant(cfg), mesh, mesh == "sp=4");
    }
}

#[test]
fn position_ids_input() {
    for mesh in ["sp=4", "dp=2,sp=2"] {
        let cfg = llama_graph::Config {
            position_ids: true,
            ..llama_graph::Config::llama_tiny()
        };
        check_case("llama+position_ids", variant(cfg), mesh, true);
    }
}

#[test]
fn mean_reduced_cross_entropy() {
    for mesh in ["sp=4", "dp=2,sp=2"] {
        let cfg = llama_graph::Config {
            mean_loss: true,
            ..llama_graph::Config::llama_tiny()
        };
        check_case("llama+mean", variant(cfg), mesh, true);
    }
}

#[test]
fn olmo2_post_norms_and_whole_projection_qk_norm() {
    // The q/k norms span every head of the projection: they run before the heads are
    // scattered, on each rank's own tokens, so sequence sharding leaves them whole.
    check("olmo2", "sp=2", false);
    check("olmo2", "dp=2,sp=2", false);
}

#[test]
fn granite_multipliers() {
    check("granite", "sp=2", false);
    check("granite", "sp=4", false);
}

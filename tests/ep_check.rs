//! Expert parallelism preserves meaning, checked by running it: the CPU reference
//! runtime executes the unsharded MoE fixtures (mixtral, qwen3_moe: 4 experts, top-2)
//! and the compiled SPMD programs on the same weights and inputs (f64), and the loss,
//! logits and every gradient must agree. Meshes: ep alone (ep=2, ep=4), ep folded over
//! dp and sp ranks (DeepSpeed's groups), and ep spanning dp and sp blocks at once. A
//! router variant (sigmoid scores, no renormalisation) and a shared expert beside the
//! routed ones check that the pass is blind to what computes the routing.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{DType, Dim, Graph, HostTensor, Mesh, Op, TensorType};
use weft_passes::{default_pipeline, lookup, PassContext};
use weft_runtime::cpu::RunResult;

/// The fixture's model and weights; its two rows of input ids and two more (the same
/// rows rotated by 5 tokens), so dp=4 has a row per rank; labels with a few ignored.
fn case(name: &str) -> Case {
    let dir = fixture(name);
    let model =
        weft_frontends::load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let fixture_inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    let (b, s) = (
        fixture_inputs["input_ids"].shape[0],
        fixture_inputs["input_ids"].shape[1],
    );
    let mut ids = fixture_inputs["input_ids"].to_i64();
    let rotated: Vec<i64> = (0..b * s)
        .map(|k| ids[(k / s) * s + (k % s + 5) % s])
        .collect();
    ids.extend(rotated);
    let mut labels = ids.clone();
    for i in [1, 2, 7, s + 3, s + 14, s + 15, 2 * s + 8, 3 * s] {
        labels[i] = -100;
    }
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "input_ids".to_string(),
        HostTensor::ints(DType::I64, vec![2 * b, s], ids),
    );
    inputs.insert(
        "labels".to_string(),
        HostTensor::ints(DType::I64, vec![2 * b, s], labels),
    );
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

/// Compiles `c` for `mesh` with the default pipeline and compares outputs and
/// gradients with the unsharded graph; returns the program.
fn check_case(name: &str, c: &Case, mesh: &str) -> Graph {
    let reference = execute(&c.graph, c, true);
    let cx = PassContext::new(Mesh::parse(mesh).unwrap());
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    let pipeline = default_pipeline(&cx.mesh);
    assert!(
        pipeline.contains(&"expert-parallel"),
        "{mesh}: {pipeline:?}"
    );
    for pass in &pipeline {
        lookup(pass)
            .unwrap()
            .run(&mut g, &cx)
            .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} after {pass}: {r}"));
    }
    let got = execute(&g, c, true);
    compare(&format!("{name} on {mesh}"), &reference, &got);
    g
}

fn check(name: &str, mesh: &str) -> Graph {
    check_case(name, &case(name), mesh)
}

fn count(g: &Graph, op: &str) -> usize {
    g.nodes()
        .iter()
        .filter(|&&n| g.node(n).op.name() == op)
        .count()
}

#[test]
fn mixtral_ep2_ep4() {
    for mesh in ["ep=2", "ep=4"] {
        let g = check("mixtral", mesh);
        // Two MoE layers: one counts exchange and two row exchanges each.
        assert_eq!(
            (count(&g, "all_to_all"), count(&g, "all_to_all_v")),
            (2, 4),
            "{mesh}"
        );
        assert_eq!(g.runtime_symbols().len(), 2);
    }
}

#[test]
fn qwen3_moe_ep2_ep4() {
    check("qwen3_moe", "ep=2");
    check("qwen3_moe", "ep=4");
}

#[test]
fn ep_folded_over_dp() {
    // ep groups (0,1)(2,3) inside dp=4; edp (0,2)(1,3) holds expert replicas.
    check("mixtral", "dp=4,ep=2");
    check("qwen3_moe", "dp=4,ep=2");
}

#[test]
fn ep_with_sp() {
    // ep groups are the sp pairs: each rank dispatches its sequence block.
    check("mixtral", "sp=2,ep=2");
    // ep=4 spans dp and sp: (0,1,2,3) = {dp0, dp1} x {sp0, sp1}.
    check("qwen3_moe", "dp=2,sp=2,ep=4");
    check("mixtral", "dp=2,sp=2,ep=2");
}

/// The mixtral fixture with sigmoid router scores (no renormalisation) and a shared
/// expert MLP added to the routed output (random weights).
fn sigmoid_and_shared_expert() -> Case {
    let mut c = case("mixtral");
    let g = &mut c.graph;
    let mut seed = 99u64;
    let mut rnd = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.4
            })
            .collect()
    };
    let combines: Vec<_> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::MoeCombine {}))
        .collect();
    for (layer, comb) in combines.into_iter().enumerate() {
        // Router: softmax -> sigmoid, and drop the renormalisation (weights = topk values).
        let weights = g.node(comb).operands[2];
        let div = g.def(weights);
        let topk_vals = g.node(div).operands[0];
        let topk = g.def(topk_vals);
        let soft = g.def(g.node(topk).operands[0]);
        assert!(matches!(g.node(soft).op, Op::Softmax { .. }));
        g.node_mut(soft).op = Op::Sigmoid {};
        g.node_mut(comb).operands[2] = topk_vals;
        // Shared expert: out + down(silu(gate(x)) * up(x)) on the block's input rows.
        let dispatch = g
            .nodes()
            .iter()
            .copied()
            .find(|&n| {
                matches!(g.node(n).op, Op::MoeDispatch { .. })
                    && g.node(n).results[2] == g.node(comb).operands[1]
            })
            .unwrap();
        let x = g.node(dispatch).operands[0];
        let h = g.ty(x).shape[1].as_const().unwrap() as usize;
        let inter = 16usize;
        let out = g.node(comb).results[0];
        let mut names = Vec::new();
        let mut param = |g: &mut Graph, what: &str, shape: [usize; 2]| {
            let name = format!("model.layers.{layer}.mlp.shared_expert.{what}.weight");
            names.push((name.clone(), shape));
            let ty = TensorType::new(
                DType::F32,
                shape.iter().map(|&d| Dim::from(d as i64)).collect(),
            );
            g.insert(weft_ir::At::Before(comb), Op::Param { name, ty }, &[])
                .unwrap()[0]
        };
        let (wg, wu, wd) = (
            param(g, "gate_proj", [inter, h]),
            param(g, "up_proj", [inter, h]),
            param(g, "down_proj", [h, inter]),
        );
        let at = weft_ir::At::After(comb);
        let ins = |g: &mut Graph, at, op, operands: &[weft_ir::Value]| {
            g.insert(at, op, operands).unwrap()[0]
        };
        let a = ins(g, at, Op::Linear {}, &[x, wg]);
        let u = ins(g, weft_ir::At::After(g.def(a)), Op::Linear {}, &[x, wu]);
        let s = ins(g, weft_ir::At::After(g.def(u)), Op::Silu {}, &[a]);
        let m = ins(g, weft_ir::At::After(g.def(s)), Op::Mul {}, &[s, u]);
        let y = ins(g, weft_ir::At::After(g.def(m)), Op::Linear {}, &[m, wd]);
        let sum = ins(g, weft_ir::At::After(g.def(y)), Op::Add {}, &[out, y]);
        g.replace_uses_except(out, sum, g.def(sum));
        for (name, shape) in names {
            c.weights.insert(
                name,
                HostTensor::floats(DType::F32, shape.to_vec(), rnd(shape[0] * shape[1])),
            );
        }
    }
    weft_ir::verify(g).unwrap();
    c
}

#[test]
fn sigmoid_router_and_shared_expert() {
    let c = sigmoid_and_shared_expert();
    check_case("mixtral+sigmoid+shared", &c, "ep=4");
    check_case("mixtral+sigmoid+shared", &c, "dp=2,ep=2");
}

#[test]
fn expert_weights_are_partitioned_over_ep() {
    let g = check("qwen3_moe", "dp=4,ep=2");
    let text = weft_ir::print(&g);
    assert!(
        text.contains(
            "partition \"model.layers.0.mlp.experts.gate_up_proj\" expert ep dim=0 [2 2]"
        ),
        "{text}"
    );
    assert!(
        text.contains("partition \"model.layers.1.mlp.experts.down_proj\" expert ep dim=0 [2 2]"),
        "{text}"
    );
    // Dense weights stay whole (replicated over dp).
    assert!(g
        .param_partition("model.layers.0.mlp.gate.weight")
        .is_empty());
    // The program prints and parses back.
    assert_eq!(weft_ir::parse(&text).unwrap(), g);
}

#[test]
fn ep_not_dividing_the_experts_is_an_error() {
    let c = case("mixtral");
    let cx = PassContext::new(Mesh::parse("dp=3,ep=3").unwrap());
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    let err = weft_passes::run_pipeline(&mut g, &cx, &default_pipeline(&cx.mesh))
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot split 4 experts over ep=3"), "{err}");
    assert!(err.contains("model.layers.0.mlp.experts"), "{err}");
    assert!(
        err.contains("help: use an ep that divides the 4 experts: 2, 4"),
        "{err}"
    );
}

#[test]
fn ep_with_tp() {
    // DeepSpeed's example: world 8, tp 2, ep 4; the ep groups span tp ranks, so the
    // experts stay whole on tp and tp peers dispatch the same tokens.
    check("mixtral", "dp=4,tp=2,ep=4");
    check("qwen3_moe", "tp=2,ep=2");
}

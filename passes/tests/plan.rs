//! Lowering to an ExecutionPlan: consistency, determinism, JSON round trip, the
//! analytic Ulysses communication volume, and the memory limit.

use weft_ir::plan::ExecutionPlan;
use weft_ir::Mesh;
use weft_passes::plan::{lower, LowerError, PlanOptions};
use weft_passes::{default_pipeline, run_pipeline, PassContext};

fn compiled(preset: &str, mesh: &str) -> weft_ir::Graph {
    let mut g = weft_frontends::load(preset).unwrap().graph;
    let mesh = Mesh::parse(mesh).unwrap();
    run_pipeline(&mut g, &PassContext::new(mesh.clone()), &default_pipeline(&mesh)).unwrap();
    g
}

#[test]
fn plan_is_consistent_deterministic_and_round_trips() {
    let g = compiled("llama-tiny", "dp=2,sp=2");
    let a = lower(&g, &PlanOptions::new(4, 64)).unwrap();
    a.check().unwrap();
    let b = lower(&g, &PlanOptions::new(4, 64)).unwrap();
    assert_eq!(a.to_json(), b.to_json(), "same program, same plan bytes");
    let back = ExecutionPlan::from_json(&a.to_json(), "plan.json").unwrap();
    assert!(back == a, "the plan differs after a JSON round trip");
    assert_eq!(weft_ir::parse(&a.program).unwrap(), g);
    // Every cross-stream dependency has an event: collectives wait for their producers.
    let by_node: std::collections::BTreeMap<u32, &weft_ir::plan::Instruction> = a.instructions.iter().map(|i| (i.node, i)).collect();
    for ins in a.instructions.iter().filter(|i| i.op == "all_to_all") {
        assert!(!ins.wait.is_empty(), "all_to_all %{} waits for its operand", ins.node);
        assert_eq!(ins.stream, 1);
        assert!(by_node.contains_key(&ins.node));
    }
    insta::assert_snapshot!(
        "plan_summary__llama-tiny__dp2-sp2",
        format!("{}\n{}", serde_json::to_string_pretty(&a.memory).unwrap(), serde_json::to_string_pretty(&a.cost.collectives).unwrap())
    );
}

#[test]
fn ulysses_moves_the_analytic_bytes() {
    // Llama-3-8B, sp=8, S=131072, B=1, bf16: per layer 4 all_to_alls; each rank sends
    // (P-1)/P of its [B, N, S/P, D] block: q and output with 32 heads, k and v with 8.
    let g = compiled("llama3-8b", "sp=8");
    let plan = lower(&g, &PlanOptions::new(1, 131072)).unwrap();
    let (p, s, d) = (8.0, 131072.0, 128.0);
    let per_layer = (p - 1.0) / p * (s / p) * d * 2.0 * (32.0 + 8.0 + 8.0 + 32.0);
    let a2a: Vec<f64> = plan.instructions.iter().filter(|i| i.op == "all_to_all").map(|i| i.bytes).collect();
    assert_eq!(a2a.len(), 4 * 32);
    let total: f64 = a2a.iter().sum();
    assert_eq!(total, per_layer * 32.0);
    assert_eq!(plan.cost.collectives["all_to_all"], 128);
}

#[test]
fn plan_refuses_what_does_not_fit_and_says_what_would() {
    let g = compiled("llama3-8b", "");
    let mut opts = PlanOptions::new(1, 131072);
    opts.device_memory = 20 << 30;
    let e = lower(&g, &opts).unwrap_err();
    let LowerError::OutOfMemory { peak, breakdown, help, .. } = &e else { panic!("{e}") };
    assert!(*peak > 20 << 30);
    assert!(breakdown["params"] > 14 << 30, "{breakdown:?}");
    assert!(help.contains("sp=2") && help.contains("--checkpoint"), "{help}");
    assert!(e.to_string().contains("help:"), "{e}");
}

#[test]
fn plans_of_other_versions_are_refused() {
    let g = compiled("llama-tiny", "sp=2");
    let text = lower(&g, &PlanOptions::new(2, 32)).unwrap().to_json().replacen("\"version\": 1", "\"version\": 99", 1);
    let e = ExecutionPlan::from_json(&text, "old.json").unwrap_err().to_string();
    assert!(e.contains("version 99") && e.contains("recompile"), "{e}");
}

#[test]
fn sequence_that_does_not_divide_is_refused_at_plan_time() {
    let g = compiled("llama-tiny", "sp=4");
    let e = lower(&g, &PlanOptions::new(1, 30)).unwrap_err().to_string();
    assert!(e.contains("S=28 or S=32"), "{e}");
}

#[test]
fn a_plan_whose_buffers_collide_is_refused() {
    let g = compiled("llama-tiny", "sp=2");
    let mut plan = lower(&g, &PlanOptions::new(2, 32)).unwrap();
    for b in plan.buffers.iter_mut().filter(|b| !b.resident) {
        b.offset = 0;
    }
    let e = plan.check().unwrap_err();
    assert!(e.contains("reuses bytes of buffer") || e.contains("overlap"), "{e}");
    let e = ExecutionPlan::from_json(&plan.to_json(), "bad.json").unwrap_err().to_string();
    assert!(e.starts_with("inconsistent plan bad.json"), "{e}");
}

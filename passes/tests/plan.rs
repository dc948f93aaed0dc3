//! Lowering to an ExecutionPlan: consistency, determinism, JSON round trip, the
//! analytic Ulysses communication volume, and the memory limit.

use weft_ir::plan::ExecutionPlan;
use weft_ir::Mesh;
use weft_passes::plan::{lower, lower_with_views, LowerError, PlanOptions};
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
    let text = lower(&g, &PlanOptions::new(2, 32)).unwrap().to_json().replacen(&format!("\"version\": {}", weft_ir::PLAN_VERSION), "\"version\": 99", 1);
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

#[test]
fn reshapes_are_views_of_their_input_bytes() {
    let g = compiled("llama-tiny", "dp=2,sp=2");
    let opts = PlanOptions::new(4, 64);
    let plan = lower(&g, &opts).unwrap();
    let copies = lower_with_views(&g, &opts, false).unwrap();
    plan.check().unwrap();
    copies.check().unwrap();
    assert!(copies.buffers.iter().all(|b| b.alias_of.is_none()));
    let views: Vec<&weft_ir::plan::Buffer> = plan.buffers.iter().filter(|b| b.alias_of.is_some()).collect();
    assert!(!views.is_empty(), "llama-tiny has reshapes that move no bytes");
    for v in &views {
        let r = &plan.buffers[v.alias_of.unwrap() as usize];
        assert!(r.alias_of.is_none(), "views name their root");
        assert_eq!((v.offset, v.resident, v.bytes), (r.offset, r.resident, r.bytes));
        assert!(r.live.0 <= v.live.0 && v.live.1 <= r.live.1, "the root holds its bytes while buffer {} is live", v.id);
        let made_by: Vec<&str> = plan.instructions.iter().filter(|i| i.outputs.contains(&v.id)).map(|i| i.op.as_str()).collect();
        assert_eq!(made_by, ["reshape"]);
    }
    assert!(plan.memory.arena_bytes < copies.memory.arena_bytes, "{} vs {}", plan.memory.arena_bytes, copies.memory.arena_bytes);
    assert!(plan.memory.peak_bytes < copies.memory.peak_bytes);
    // A group's bytes are counted once: the breakdown at the peak fits in the arena.
    let live: u64 = ["activations", "comm_buffers"].iter().map(|k| plan.memory.breakdown[*k]).sum();
    assert!(live <= plan.memory.arena_bytes, "{:?}", plan.memory);
    assert!(ExecutionPlan::from_json(&plan.to_json(), "plan.json").unwrap() == plan);
}

#[test]
fn malformed_views_are_refused() {
    let g = compiled("llama-tiny", "dp=2,sp=2");
    let plan = lower(&g, &PlanOptions::new(4, 64)).unwrap();
    let v = plan.buffers.iter().find(|b| b.alias_of.is_some() && !b.resident).unwrap().id as usize;
    let r = plan.buffers[v].alias_of.unwrap() as usize;
    let refused = |edit: &dyn Fn(&mut ExecutionPlan), want: &str| {
        let mut p = plan.clone();
        edit(&mut p);
        let e = p.check().unwrap_err();
        assert!(e.contains(want), "wanted `{want}` in: {e}");
        let e = ExecutionPlan::from_json(&p.to_json(), "bad.json").unwrap_err().to_string();
        assert!(e.starts_with("inconsistent plan bad.json") && e.contains(want), "{e}");
    };
    refused(&|p| p.buffers[v].alias_of = Some(1 << 20), "which the plan lacks");
    refused(&|p| p.buffers[r].alias_of = Some(v as u32), "never reaches a buffer with storage");
    refused(&|p| p.buffers[v].bytes += 256, "bytes where its root has");
    refused(&|p| p.buffers[v].offset += 256, "placed at offset");
    // Only a reshape of the same bytes may produce a view.
    let other = plan
        .instructions
        .iter()
        .find(|i| i.op != "reshape" && i.stream == 0 && i.outputs.len() == 1 && !plan.buffers[i.outputs[0] as usize].resident && i.outputs[0] as usize != r)
        .unwrap()
        .outputs[0] as usize;
    refused(
        &|p| {
            let root = p.buffers[r].clone();
            let b = &mut p.buffers[other];
            (b.alias_of, b.offset, b.resident, b.bytes, b.per_rank_bytes) = (Some(r as u32), root.offset, root.resident, root.bytes, root.per_rank_bytes);
        },
        "only a reshape of the same bytes may produce a view",
    );
    // A root holds its bytes over the union of its group's live ranges: a buffer put on
    // them after the root's own last use but while a view of it is live collides.
    let own_last = |b: usize| plan.instructions.iter().filter(|i| i.inputs.contains(&(b as u32)) || i.outputs.contains(&(b as u32))).map(|i| i.id).max().unwrap();
    let (root, clash) = plan
        .buffers
        .iter()
        .filter(|v| v.alias_of.is_some() && !v.resident)
        .find_map(|v| {
            let r = v.alias_of.unwrap() as usize;
            let c = plan.buffers.iter().find(|c| c.alias_of.is_none() && !c.resident && c.bytes > 0 && c.id as usize != r && c.live.0 > own_last(r) && c.live.0 <= v.live.1)?;
            Some((r, c.id as usize))
        })
        .expect("a view outlives its root's own uses");
    let mut p = plan.clone();
    p.buffers[clash].offset = p.buffers[root].offset;
    p.buffers[root].live.1 = own_last(root); // the checker works out the union itself
    let e = p.check().unwrap_err();
    assert!(e.contains(&format!("buffer {root}")) && (e.contains("reuses bytes of buffer") || e.contains("overlap")), "{e}");
}

//! Lowering to an ExecutionPlan: consistency, determinism, JSON round trip, the
//! analytic Ulysses communication volume, and the memory limit.

use weft_ir::plan::ExecutionPlan;
use weft_ir::Mesh;
use weft_passes::plan::{lower, lower_with_views, LowerError, PlanOptions};
use weft_passes::{default_pipeline, run_pipeline, PassContext};

fn compiled(preset: &str, mesh: &str) -> weft_ir::Graph {
    let mut g = weft_frontends::load(preset).unwrap().graph;
    let mesh = Mesh::parse(mesh).unwrap();
    run_pipeline(
        &mut g,
        &PassContext::new(mesh.clone()),
        &default_pipeline(&mesh),
    )
    .unwrap();
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
    let by_node: std::collections::BTreeMap<u32, &weft_ir::plan::Instruction> =
        a.instructions.iter().map(|i| (i.node, i)).collect();
    for ins in a.instructions.iter().filter(|i| i.op == "all_to_all") {
        assert!(
            !ins.wait.is_empty(),
            "all_to_all %{} waits for its operand",
            ins.node
        );
        assert_eq!(ins.stream, 1);
        assert!(by_node.contains_key(&ins.node));
    }
    insta::assert_snapshot!(
        "plan_summary__llama-tiny__dp2-sp2",
        format!(
            "{}\n{}",
            serde_json::to_string_pretty(&a.memory).unwrap(),
            serde_json::to_string_pretty(&a.cost.collectives).unwrap()
        )
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
    let a2a: Vec<f64> = plan
        .instructions
        .iter()
        .filter(|i| i.op == "all_to_all")
        .map(|i| i.bytes)
        .collect();
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
    let LowerError::OutOfMemory {
        peak,
        breakdown,
        help,
        ..
    } = &e
    else {
        panic!("{e}")
    };
    assert!(*peak > 20 << 30);
    assert!(breakdown["params"] > 14 << 30, "{breakdown:?}");
    assert!(
        help.contains("sp=2") && help.contains("--checkpoint"),
        "{help}"
    );
    assert!(e.to_string().contains("help:"), "{e}");
}

#[test]
fn plans_of_other_versions_are_refused() {
    let g = compiled("llama-tiny", "sp=2");
    let text = lower(&g, &PlanOptions::new(2, 32))
        .unwrap()
        .to_json()
        .replacen(
            &format!("\"version\": {}", weft_ir::PLAN_VERSION),
            "\"version\": 99",
            1,
        );
    let e = ExecutionPlan::from_json(&text, "old.json")
        .unwrap_err()
        .to_string();
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
    assert!(
        e.contains("reuses bytes of buffer") || e.contains("overlap"),
        "{e}"
    );
    let e = ExecutionPlan::from_json(&plan.to_json(), "bad.json")
        .unwrap_err()
        .to_string();
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
    let views: Vec<&weft_ir::plan::Buffer> = plan
        .buffers
        .iter()
        .filter(|b| b.alias_of.is_some())
        .collect();
    assert!(
        !views.is_empty(),
        "llama-tiny has reshapes that move no bytes"
    );
    for v in &views {
        let r = &plan.buffers[v.alias_of.unwrap() as usize];
        assert!(r.alias_of.is_none(), "views name their root");
        assert_eq!(
            (v.offset, v.resident, v.bytes),
            (r.offset, r.resident, r.bytes)
        );
        assert!(
            r.live.0 <= v.live.0 && v.live.1 <= r.live.1,
            "the root holds its bytes while buffer {} is live",
            v.id
        );
        let made_by: Vec<&str> = plan
            .instructions
            .iter()
            .filter(|i| i.outputs.contains(&v.id))
            .map(|i| i.op.as_str())
            .collect();
        assert_eq!(made_by, ["reshape"]);
    }
    assert!(
        plan.memory.arena_bytes < copies.memory.arena_bytes,
        "{} vs {}",
        plan.memory.arena_bytes,
        copies.memory.arena_bytes
    );
    assert!(plan.memory.peak_bytes < copies.memory.peak_bytes);
    // A group's bytes are counted once: the breakdown at the peak fits in the arena.
    let live: u64 = ["activations", "comm_buffers"]
        .iter()
        .map(|k| plan.memory.breakdown[*k])
        .sum();
    assert!(live <= plan.memory.arena_bytes, "{:?}", plan.memory);
    assert!(ExecutionPlan::from_json(&plan.to_json(), "plan.json").unwrap() == plan);
}

#[test]
fn malformed_views_are_refused() {
    let g = compiled("llama-tiny", "dp=2,sp=2");
    let plan = lower(&g, &PlanOptions::new(4, 64)).unwrap();
    let v = plan
        .buffers
        .iter()
        .find(|b| b.alias_of.is_some() && !b.resident)
        .unwrap()
        .id as usize;
    let r = plan.buffers[v].alias_of.unwrap() as usize;
    let refused = |edit: &dyn Fn(&mut ExecutionPlan), want: &str| {
        let mut p = plan.clone();
        edit(&mut p);
        let e = p.check().unwrap_err();
        assert!(e.contains(want), "wanted `{want}` in: {e}");
        let e = ExecutionPlan::from_json(&p.to_json(), "bad.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("inconsistent plan bad.json") && e.contains(want),
            "{e}"
        );
    };
    refused(
        &|p| p.buffers[v].alias_of = Some(1 << 20),
        "which the plan lacks",
    );
    refused(
        &|p| p.buffers[r].alias_of = Some(v as u32),
        "never reaches a buffer with storage",
    );
    refused(&|p| p.buffers[v].bytes += 256, "bytes where its root has");
    refused(&|p| p.buffers[v].offset += 256, "placed at offset");
    // Only a reshape of the same bytes may produce a view.
    let other = plan
        .instructions
        .iter()
        .find(|i| {
            i.op != "reshape"
                && i.stream == 0
                && i.outputs.len() == 1
                && !plan.buffers[i.outputs[0] as usize].resident
                && i.outputs[0] as usize != r
        })
        .unwrap()
        .outputs[0] as usize;
    refused(
        &|p| {
            let root = p.buffers[r].clone();
            let b = &mut p.buffers[other];
            (b.alias_of, b.offset, b.resident, b.bytes, b.per_rank_bytes) = (
                Some(r as u32),
                root.offset,
                root.resident,
                root.bytes,
                root.per_rank_bytes,
            );
        },
        "is written in place over buffer",
    );
    // A root holds its bytes over the union of its group's live ranges: a buffer put on
    // them after the root's own last use but while a view of it is live collides.
    let own_last = |b: usize| {
        plan.instructions
            .iter()
            .filter(|i| i.inputs.contains(&(b as u32)) || i.outputs.contains(&(b as u32)))
            .map(|i| i.id)
            .max()
            .unwrap()
    };
    let (root, clash) = plan
        .buffers
        .iter()
        .filter(|v| v.alias_of.is_some() && !v.resident)
        .find_map(|v| {
            let r = v.alias_of.unwrap() as usize;
            let c = plan.buffers.iter().find(|c| {
                c.alias_of.is_none()
                    && !c.resident
                    && c.bytes > 0
                    && c.id as usize != r
                    && c.live.0 > own_last(r)
                    && c.live.0 <= v.live.1
            })?;
            Some((r, c.id as usize))
        })
        .expect("a view outlives its root's own uses");
    let mut p = plan.clone();
    p.buffers[clash].offset = p.buffers[root].offset;
    p.buffers[root].live.1 = own_last(root); // the checker works out the union itself
    let e = p.check().unwrap_err();
    assert!(
        e.contains(&format!("buffer {root}"))
            && (e.contains("reuses bytes of buffer") || e.contains("overlap")),
        "{e}"
    );
}

/// A training step (AdamW, the updates inside the backward, no gradient outputs) of a
/// 1-layer `preset`.
fn train_step(preset: &str, mesh: &str, sgd: bool, zero1: bool) -> weft_ir::Graph {
    use weft_passes::training::{training_pipeline, Optimizer, TrainOptions};
    let p = weft_frontends::presets::find_preset(preset).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(p.config_json).unwrap();
    v.as_object_mut()
        .unwrap()
        .insert("num_hidden_layers".into(), 1.into());
    if let Some(serde_json::Value::Array(t)) = v.as_object_mut().unwrap().get_mut("layer_types") {
        t.truncate(1);
    }
    let cfg = weft_frontends::ModelConfig::from_json(&v, &p.label()).unwrap();
    let mut g = weft_frontends::Model::from_config(
        &format!("{preset}-1l"),
        cfg,
        weft_frontends::Origin::Preset(preset.into()),
    )
    .unwrap()
    .graph;
    let opt = if sgd {
        Optimizer::Sgd {
            lr: weft_ir::Float(1e-2),
            momentum: weft_ir::Float(0.9),
            weight_decay: weft_ir::Float(0.0),
        }
    } else {
        Optimizer::adamw(1e-4)
    };
    let opts = TrainOptions {
        optimizer: Some(opt),
        zero1,
        grad_outputs: false,
        batch: Some(2),
        seq: Some(64),
        ..Default::default()
    };
    let mut cx = PassContext::new(Mesh::parse(mesh).unwrap());
    cx.options.train = opts.clone();
    let pipeline = training_pipeline(&cx.mesh, &opts);
    weft_passes::PassManager::default()
        .run(&mut g, &cx, &pipeline.names(), &mut std::io::sink())
        .unwrap();
    g
}

/// (update output, the input it replaces) buffers, as a driver pairs them.
fn update_pairs(g: &weft_ir::Graph, plan: &ExecutionPlan) -> Vec<(usize, usize)> {
    let buf = |v: weft_ir::Value| plan.buffers.iter().find(|b| b.value == v.0).unwrap().id as usize;
    let params: std::collections::BTreeMap<String, weft_ir::Value> =
        g.params().into_iter().collect();
    g.outputs()
        .iter()
        .filter_map(|(name, v)| {
            let t = match name.strip_prefix("param.") {
                Some(rest) => params.get(rest),
                None if name.starts_with("optim.") => params.get(name.as_str()),
                None => None,
            }?;
            Some((buf(*v), buf(*t)))
        })
        .collect()
}

fn root_of(plan: &ExecutionPlan, b: usize) -> usize {
    plan.storage_roots().unwrap()[b] as usize
}

#[test]
fn updates_are_written_in_place() {
    // bf16 params with f32 masters (AdamW: cast -> adamw -> cast), f32 params (AdamW and
    // SGD with momentum in place over the param), ZeRO-1 (the update gathered back).
    for (preset, mesh, sgd, zero1) in [
        ("llama3.2-1b", "", false, false),
        ("llama-tiny", "", false, false),
        ("llama-tiny", "", true, false),
        ("llama-tiny", "dp=2", false, true),
    ] {
        let what = format!("{preset} {mesh} sgd={sgd} zero1={zero1}");
        let g = train_step(preset, mesh, sgd, zero1);
        let opts = PlanOptions::new(2, 64);
        let plan = lower(&g, &opts).unwrap();
        let copies = lower_with_views(&g, &opts, false).unwrap();
        plan.check().unwrap_or_else(|e| panic!("{what}: {e}"));
        copies.check().unwrap();
        let pairs = update_pairs(&g, &plan);
        assert!(!pairs.is_empty(), "{what}");
        let mut saved = 0;
        for &(o, t) in &pairs {
            assert_eq!(
                root_of(&plan, o),
                root_of(&plan, t),
                "{what}: buffer {o} updates buffer {t} in place"
            );
            let (ob, tb) = (&plan.buffers[o], &plan.buffers[t]);
            assert!(
                ob.resident
                    && tb.resident
                    && ob.offset == tb.offset
                    && ob.alias_of == Some(t as u32),
                "{what}: {ob:?}"
            );
            // The old value's last read is at or before the write.
            let w = plan
                .instructions
                .iter()
                .find(|i| i.outputs.contains(&(o as u32)))
                .unwrap()
                .id;
            assert!(
                plan.instructions
                    .iter()
                    .filter(|i| i.inputs.contains(&(t as u32)))
                    .all(|i| i.id <= w),
                "{what}: buffer {t} is read after {w}"
            );
            assert!(
                ob.live.0 == w
                    && tb.live.0 == 0
                    && tb.live.1 == (plan.instructions.len() - 1) as u32,
                "{what}: the root holds the bytes for the whole step"
            );
            saved += ob.bytes.div_ceil(256) * 256;
        }
        assert_eq!(
            plan.memory.resident_bytes + saved,
            copies.memory.resident_bytes,
            "{what}: each update is held once"
        );
        let states: u64 = ["params", "optimizer_state"]
            .iter()
            .map(|k| plan.memory.breakdown[*k])
            .sum();
        let inputs: u64 = pairs.iter().map(|&(_, t)| plan.buffers[t].bytes).sum();
        assert_eq!(states, inputs, "{what}: {:?}", plan.memory.breakdown);
        assert!(ExecutionPlan::from_json(&plan.to_json(), "plan.json").unwrap() == plan);
    }
}

#[test]
fn cross_entropy_grad_takes_the_logits_bytes_when_they_die() {
    let mut g = train_step("llama-tiny", "", false, false);
    let opts = PlanOptions::new(2, 64);
    let ce = |plan: &ExecutionPlan| {
        plan.instructions
            .iter()
            .find(|i| i.op == "cross_entropy_grad")
            .unwrap()
            .clone()
    };
    // The step returns the logits: their bytes are held to the end, the gradient has its own.
    let kept = lower(&g, &opts).unwrap();
    let i = ce(&kept);
    assert_ne!(
        root_of(&kept, i.outputs[0] as usize),
        root_of(&kept, i.inputs[0] as usize)
    );
    g.remove_output("logits");
    let plan = lower(&g, &opts).unwrap();
    plan.check().unwrap();
    let i = ce(&plan);
    let (o, x) = (i.outputs[0] as usize, i.inputs[0] as usize);
    let r = root_of(&plan, x);
    assert_eq!(
        root_of(&plan, o),
        r,
        "the logits gradient is written over the logits"
    );
    assert!(!plan.buffers[o].resident && plan.buffers[o].offset == plan.buffers[r].offset);
    // One root, held over the union: from the logits' producer to the gradient's last use.
    assert!(
        plan.buffers[r].live.0 <= plan.buffers[x].live.0
            && plan.buffers[o].live.1 <= plan.buffers[r].live.1
    );
    assert!(
        plan.memory.arena_bytes < kept.memory.arena_bytes,
        "{} vs {}",
        plan.memory.arena_bytes,
        kept.memory.arena_bytes
    );
}

#[test]
fn in_place_writes_over_live_values_are_refused() {
    let g = train_step("llama3.2-1b", "", false, false);
    let plan = lower(&g, &PlanOptions::new(2, 64)).unwrap();
    plan.check().unwrap();
    let refused = |p: &ExecutionPlan, want: &str| {
        let e = p.check().unwrap_err();
        assert!(e.contains(want), "wanted `{want}` in: {e}");
        let e = ExecutionPlan::from_json(&p.to_json(), "bad.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("inconsistent plan bad.json") && e.contains(want),
            "{e}"
        );
    };
    let writer = |p: &ExecutionPlan, b: usize| {
        p.instructions
            .iter()
            .find(|i| i.outputs.contains(&(b as u32)))
            .unwrap()
            .id as usize
    };
    // The bf16 param written by the trailing cast, and the AdamW state written by adamw.
    let pairs = update_pairs(&g, &plan);
    let (o, t) = *pairs
        .iter()
        .filter(|&&(o, _)| plan.instructions[writer(&plan, o)].op == "cast")
        .min_by_key(|&&(o, _)| writer(&plan, o))
        .unwrap();
    let w = writer(&plan, o);
    // Something reads the old param after the in-place write.
    let mut p = plan.clone();
    let later = p
        .instructions
        .iter()
        .position(|i| i.id as usize > w && i.stream == 0 && !i.inputs.is_empty())
        .unwrap();
    p.instructions[later].inputs.push(t as u32);
    refused(&p, "reads the value it replaces");
    // The writer reads the old value at an operand it does not compute elementwise.
    let mut p = plan.clone();
    p.instructions[w].inputs.push(t as u32);
    refused(&p, "reads the value it replaces at operand");
    // A second in-place write into a resident value.
    let (m, mt) = *pairs
        .iter()
        .find(|&&(o, _)| plan.instructions[writer(&plan, o)].op == "adamw")
        .unwrap();
    let aw = writer(&plan, m);
    let mut p = plan.clone();
    let other = p.instructions[aw]
        .outputs
        .iter()
        .copied()
        .find(|&b| b as usize != m)
        .unwrap() as usize;
    let root = p.buffers[mt].clone();
    p.buffers[other].alias_of = Some(mt as u32);
    (p.buffers[other].offset, p.buffers[other].resident) = (root.offset, root.resident);
    refused(&p, "in place");
    // An arena result written over an operand by an op not known to be safe in place.
    let mut p = plan.clone();
    let (ins, x) = p
        .instructions
        .iter()
        .filter(|i| {
            !["reshape", "cross_entropy_grad", "adamw", "sgd"].contains(&i.op.as_str())
                && i.outputs.len() == 1
        })
        .find_map(|i| {
            let o = &p.buffers[i.outputs[0] as usize];
            let x = i.inputs.iter().find(|&&x| {
                let xb = &p.buffers[x as usize];
                xb.alias_of.is_none()
                    && !xb.resident
                    && xb.bytes == o.bytes
                    && xb.dtype == o.dtype
                    && xb.live.1 == i.id
            })?;
            (!o.resident && o.alias_of.is_none()).then_some((i.id as usize, *x as usize))
        })
        .expect("an op whose operand dies there");
    let o = p.instructions[ins].outputs[0] as usize;
    let xb = p.buffers[x].clone();
    p.buffers[o].alias_of = Some(x as u32);
    p.buffers[o].offset = xb.offset;
    refused(&p, "only an op computing its result elementwise");
}

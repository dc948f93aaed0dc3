//! Snapshots of the training passes on a 1-layer tiny llama: the whole joint graph
//! (one rank and sp=2), each training pass's diff (`<pass>__<model>__<mesh>`), the
//! collectives of N-micro-batch steps, and the memory estimate per checkpoint policy.

mod util;
use util::*;

use weft_ir::*;
use weft_passes::training::{
    training_pipeline, CheckpointPolicy, OffloadOptions, Optimizer, TrainOptions,
};
use weft_passes::*;

fn model_1l(preset: &str) -> Graph {
    model_layers(preset, 1)
}

fn model_layers(preset: &str, layers: usize) -> Graph {
    let p = weft_frontends::presets::find_preset(preset).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(p.config_json).unwrap();
    v.as_object_mut()
        .unwrap()
        .insert("num_hidden_layers".into(), layers.into());
    if let Some(serde_json::Value::Array(t)) = v.as_object_mut().unwrap().get_mut("layer_types") {
        t.truncate(layers);
    }
    let cfg = weft_frontends::ModelConfig::from_json(&v, &p.label()).unwrap();
    weft_frontends::Model::from_config(
        &format!("{preset}-{layers}l"),
        cfg,
        weft_frontends::Origin::Preset(preset.into()),
    )
    .unwrap()
    .graph
}

fn cx(mesh: &str, opts: &TrainOptions) -> PassContext {
    let mut cx = PassContext::new(Mesh::parse(mesh).unwrap());
    cx.options.train = opts.clone();
    cx
}

fn compile(g: &Graph, mesh: &str, opts: &TrainOptions) -> Graph {
    let cx = cx(mesh, opts);
    let names = training_pipeline(&cx.mesh, opts)
        .names()
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut g = g.clone();
    PassManager::default()
        .run(&mut g, &cx, &refs, &mut std::io::sink())
        .unwrap();
    g
}

/// The diff and counters of `pass` in the training pipeline of `opts`.
fn pass_diff(g: &Graph, mesh: &str, opts: &TrainOptions, pass: &str) -> String {
    let cx = cx(mesh, opts);
    let names = training_pipeline(&cx.mesh, opts)
        .names()
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    let at = names.iter().position(|p| p == pass).unwrap();
    let mut g = g.clone();
    let refs: Vec<&str> = names[..at].iter().map(String::as_str).collect();
    PassManager::default()
        .run(&mut g, &cx, &refs, &mut std::io::sink())
        .unwrap();
    diff_of(&mut g, &cx, pass)
}

#[test]
fn joint_graph_of_a_one_layer_llama() {
    let g = model_1l("llama-tiny");
    for (tag, mesh) in [("one-rank", ""), ("sp2", "sp=2")] {
        let j = compile(&g, mesh, &TrainOptions::default());
        verify(&j).unwrap();
        assert_eq!(parse(&print(&j)).unwrap(), j);
        snapshot(&format!("joint__llama-tiny-1l__{tag}"), &print(&j));
    }
}

/// A device whose matmuls are slow enough (0.05 TFLOP/s against 5 GB/s of memory: a
/// ridge of 10 FLOPs per byte) that a tiny model's projections are compute-bound and
/// its norms and elementwise ops are not, as a 1B model's are on an H200.
fn slow_matmul_device() -> weft_passes::training::Device {
    let mut d = weft_passes::plan::profile::preset("h200").unwrap();
    d.matmul_tflops = 0.05;
    d.attention_tflops = 0.05;
    d.hbm_gbps = 5.0;
    weft_passes::training::Device(d)
}

#[test]
fn selective_offload_diff() {
    // Two layers: the first layer's projections go to the host under the second
    // layer's forward and come back under its backward, instead of being recomputed;
    // its norms and elementwise ops are still recomputed; the last layer stays as is.
    let g = model_layers("llama-tiny", 2);
    let opts = TrainOptions {
        checkpoint: CheckpointPolicy::Selective,
        offload: Some(OffloadOptions {
            min_bytes: 0,
            device: slow_matmul_device(),
            ..Default::default()
        }),
        batch: Some(2),
        seq: Some(16),
        ..Default::default()
    };
    let diff = pass_diff(&g, "sp=2", &opts, "checkpoint");
    let j = compile(&g, "sp=2", &opts);
    verify(&j).unwrap();
    let by_checkpoint = |op: &str| {
        j.nodes()
            .iter()
            .filter(|&&n| {
                let d = j.node(n);
                d.op.name() == op
                    && d.meta
                        .provenance
                        .as_ref()
                        .is_some_and(|p| p.pass == "checkpoint")
            })
            .count()
    };
    assert!(by_checkpoint("offload") > 0, "{diff}");
    assert_eq!(by_checkpoint("offload"), by_checkpoint("reload"));
    // The offload pass adds nothing after checkpoint chose.
    assert!(pass_diff(&g, "sp=2", &opts, "offload").contains("changed=false"));
    snapshot("checkpoint__llama-tiny-2l__sp2-selective-offload", &diff);
}

#[test]
fn training_pass_diffs() {
    let g = model_1l("llama-tiny");
    let small = TrainOptions {
        bucket_bytes: 20_000,
        batch: Some(2),
        seq: Some(16),
        ..Default::default()
    };
    let cases: Vec<(&str, &str, &str, TrainOptions)> = vec![
        ("autodiff", "dp2-sp2", "dp=2,sp=2", small.clone()),
        ("grad-sync", "dp2-sp2", "dp=2,sp=2", small.clone()),
        (
            "grad-sync",
            "dp2-sp2-zero2",
            "dp=2,sp=2",
            TrainOptions {
                reduce_scatter: true,
                ..small.clone()
            },
        ),
        (
            "checkpoint",
            "sp2-selective",
            "sp=2",
            TrainOptions {
                checkpoint: CheckpointPolicy::Selective,
                ..small.clone()
            },
        ),
        (
            "checkpoint",
            "sp2-full",
            "sp=2",
            TrainOptions {
                checkpoint: CheckpointPolicy::Full,
                ..small.clone()
            },
        ),
        (
            "offload",
            "sp2",
            "sp=2",
            TrainOptions {
                offload: Some(OffloadOptions {
                    min_bytes: 0,
                    keep_last: 0,
                    ..Default::default()
                }),
                ..small.clone()
            },
        ),
        (
            "optimizer",
            "dp2-zero1",
            "dp=2",
            TrainOptions {
                optimizer: Some(Optimizer::adamw(1e-3)),
                zero1: true,
                ..small.clone()
            },
        ),
        (
            "micro-batches",
            "dp2",
            "dp=2",
            TrainOptions {
                micro_batches: 2,
                ..small.clone()
            },
        ),
    ];
    for (pass, tag, mesh, opts) in cases {
        snapshot(
            &format!("{pass}__llama-tiny-1l__{tag}"),
            &pass_diff(&g, mesh, &opts, pass),
        );
    }
}

/// Collectives by op of a step, the gradient reductions (grad-sync's) apart.
fn collectives(g: &Graph) -> String {
    let mut by: std::collections::BTreeMap<String, usize> = Default::default();
    let mut grad = 0;
    for &n in g.nodes() {
        let d = g.node(n);
        if d.op.is_collective() {
            *by.entry(d.op.name().to_string()).or_default() += 1;
            if d.meta
                .provenance
                .as_ref()
                .is_some_and(|p| p.pass == "grad-sync")
            {
                grad += 1;
            }
        }
    }
    let parts: Vec<String> = by.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(
        "gradient reductions {grad}; all collectives: {}",
        parts.join(" ")
    )
}

#[test]
fn micro_batch_collectives() {
    let g = model_1l("llama-tiny");
    let mut text = String::new();
    for mesh in ["dp=2", "sp=2", "dp=2,sp=2", "tp=2"] {
        let mut grad = None;
        for n in [1u32, 2, 4] {
            let opts = TrainOptions {
                micro_batches: n,
                bucket_bytes: 20_000,
                ..Default::default()
            };
            let j = compile(&g, mesh, &opts);
            let line = collectives(&j);
            let reductions = j
                .nodes()
                .iter()
                .filter(|&&x| {
                    j.node(x)
                        .meta
                        .provenance
                        .as_ref()
                        .is_some_and(|p| p.pass == "grad-sync")
                        && j.node(x).op.is_collective()
                })
                .count();
            assert_eq!(
                *grad.get_or_insert(reductions),
                reductions,
                "{mesh}: N={n} issues other gradient reductions than N=1"
            );
            text.push_str(&format!("{mesh:<10} N={n}: {line}\n"));
        }
    }
    snapshot("micro-batches__collectives__llama-tiny-1l", &text);
}

/// One row per policy of the memory estimate of a whole step (the optimizer updating
/// each bucket in the backward, gradients not returned), asserting that saved
/// activations and the peak of live values fall strictly as the policy tightens.
fn memory_rows(preset: &str, mesh: &str, base: &TrainOptions) -> String {
    let g = weft_frontends::load(preset).unwrap().graph;
    let mut text = String::new();
    let mut last: Option<memory::MemoryEstimate> = None;
    for policy in [
        CheckpointPolicy::None,
        CheckpointPolicy::Selective,
        CheckpointPolicy::Full,
    ] {
        let opts = TrainOptions {
            checkpoint: policy.clone(),
            ..base.clone()
        };
        let j = compile(&g, mesh, &opts);
        assert!(
            j.outputs().iter().all(|(n, _)| !n.starts_with("grad.")),
            "{preset} {mesh}: a training step returns no gradients"
        );
        let e = memory::estimate(&j, &memory::bindings(&j, &opts));
        if let Some(l) = &last {
            assert!(
                e.saved_activations < l.saved_activations,
                "{preset} {mesh} {policy}: saved {e:?} vs {l:?}"
            );
            assert!(
                e.peak_live < l.peak_live && e.total < l.total,
                "{preset} {mesh} {policy}: peak {e:?} vs {l:?}"
            );
        }
        text.push_str(&format!(
            "{:<10} saved {:>12}  params {:>12}  grads {:>12}  optimizer {:>12}  peak live {:>12}  total {:>12}\n",
            policy.to_string(),
            e.saved_activations,
            e.params,
            e.grads,
            e.optimizer,
            e.peak_live,
            e.total
        ));
        last = Some(e);
    }
    text
}

#[test]
fn memory_falls_as_the_policy_tightens() {
    let adamw = TrainOptions {
        optimizer: Some(Optimizer::adamw(1e-4)),
        grad_outputs: false,
        ..Default::default()
    };
    // Llama 3 8B on dp=2,sp=4 at S=32768, B=2, AdamW with ZeRO-1.
    let base = TrainOptions {
        zero1: true,
        batch: Some(2),
        seq: Some(32768),
        ..adamw.clone()
    };
    let mut text =
        String::from("llama3-8b, dp=2,sp=4, B=2, S=32768, AdamW + ZeRO-1; bytes per rank\n");
    text.push_str(&memory_rows("llama3-8b", "dp=2,sp=4", &base));
    snapshot("memory__llama3-8b__dp2-sp4", &text);
    // Tensor parallel: Llama 3 8B on tp=4,sp=2 at S=16384, B=1.
    let base = TrainOptions {
        batch: Some(1),
        seq: Some(16384),
        ..adamw.clone()
    };
    let mut text = String::from("llama3-8b, tp=4,sp=2, B=1, S=16384, AdamW; bytes per rank\n");
    text.push_str(&memory_rows("llama3-8b", "tp=4,sp=2", &base));
    snapshot("memory__llama3-8b__tp4-sp2", &text);
    // MoE: Mixtral 8x7B, experts over ep=4 (folding dp=2,sp=2), S=16384, B=2.
    let base = TrainOptions {
        zero1: true,
        batch: Some(2),
        seq: Some(16384),
        ..adamw
    };
    let mut text = String::from(
        "mixtral-8x7b, dp=2,sp=2,ep=4, B=2, S=16384, AdamW + ZeRO-1; bytes per rank\n",
    );
    text.push_str(&memory_rows("mixtral-8x7b", "dp=2,sp=2,ep=4", &base));
    snapshot("memory__mixtral-8x7b__dp2-sp2-ep4", &text);
}

#[test]
fn checkpoint_budget_bounds_the_peak() {
    // The estimated peak of the step a budget compiles to is within the budget
    // (recomputed values' lifetimes and gradients in flight included) and falls with
    // it, down to about 13.1 GiB here (recomputing inside the layers, collectives
    // kept); a budget below what recomputing all it can reaches is an error that says
    // what would fit.
    let g = weft_frontends::load("llama3-8b").unwrap().graph;
    let base = TrainOptions {
        optimizer: Some(Optimizer::adamw(1e-4)),
        zero1: true,
        grad_outputs: false,
        batch: Some(2),
        seq: Some(32768),
        ..Default::default()
    };
    let peak = |policy: CheckpointPolicy| {
        let opts = TrainOptions {
            checkpoint: policy,
            ..base.clone()
        };
        let j = compile(&g, "dp=2,sp=4", &opts);
        memory::estimate(&j, &memory::bindings(&j, &opts))
    };
    let (none, selective) = (
        peak(CheckpointPolicy::None),
        peak(CheckpointPolicy::Selective),
    );
    let mut last = none.peak_live;
    for budget in [
        (none.peak_live + selective.peak_live) / 2,
        (none.peak_live + 3 * selective.peak_live) / 4,
        selective.peak_live,
        14 << 30,
    ] {
        let e = peak(CheckpointPolicy::Budget(budget));
        assert!(e.peak_live <= budget, "budget {budget}: {e:?}");
        assert!(
            e.peak_live < last,
            "budget {budget}: the peak falls with the budget ({e:?})"
        );
        last = e.peak_live;
    }
    let opts = TrainOptions {
        checkpoint: CheckpointPolicy::Budget(1 << 30),
        ..base.clone()
    };
    let cx = cx("dp=2,sp=4", &opts);
    let pipeline = training_pipeline(&cx.mesh, &opts);
    let names = pipeline.names();
    let err = PassManager::default()
        .run(&mut g.clone(), &cx, &names, &mut std::io::sink())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("budget=1073741824")
            && err.contains("cannot be met")
            && err.contains("help: raise the budget to at least"),
        "{err}"
    );
}

#[test]
fn offload_planner_times_compute_on_the_device_profile() {
    // Llama 3.2 1B, one rank, S=8192: halve the saved activations by offload at the
    // 25 GB/s (a PCIe Gen4 link). The copies hide under each layer's compute as the plan's cost
    // model times it on the device: a slower device (A100) hides more bytes than the
    // default H200. The plan is deterministic.
    let g = weft_frontends::load("llama3.2-1b").unwrap().graph;
    let base = TrainOptions {
        batch: Some(1),
        seq: Some(8192),
        ..Default::default()
    };
    let j = compile(&g, "", &base);
    let saved = memory::estimate(&j, &memory::bindings(&j, &base)).saved_activations;
    let mut text = format!("llama3.2-1b, one rank, B=1, S=8192, offload budget {} of {saved} saved bytes, link 25 GB/s\n", saved / 2);
    let mut offloaded = Vec::new();
    for device in ["h200", "h100", "a100"] {
        let o = OffloadOptions {
            budget: Some(saved / 2),
            link_bytes_per_s: 25_000_000_000,
            device: weft_passes::training::Device(
                weft_passes::plan::profile::preset(device).unwrap(),
            ),
            ..Default::default()
        };
        let opts = TrainOptions {
            offload: Some(o),
            ..base.clone()
        };
        let diff = pass_diff(&g, "", &opts, "offload");
        let counters = diff.lines().last().unwrap().to_string();
        assert_eq!(
            pass_diff(&g, "", &opts, "offload"),
            diff,
            "{device}: the planner is deterministic"
        );
        let j = compile(&g, "", &opts);
        let e = memory::estimate(&j, &memory::bindings(&j, &opts));
        assert!(
            e.offloaded > 0 && e.saved_activations > saved / 2,
            "{device}: {e:?}"
        );
        offloaded.push(e.offloaded);
        text.push_str(&format!(
            "{device:<5} offloaded {:>11}  on device {:>11}  {}\n",
            e.offloaded,
            e.saved_activations,
            counters.trim_start_matches("// ")
        ));
    }
    assert!(
        offloaded[0] <= offloaded[1] && offloaded[1] < offloaded[2],
        "{offloaded:?}"
    );
    snapshot("offload__planner__llama3.2-1b", &text);
}

#[test]
fn offload_replaces_recompute_in_the_plan_of_a_long_sequence() {
    // Llama 3.2 1B, one rank, S=16384, on the default H200 profile: selective + offload
    // is predicted faster than selective alone at nearly its peak (the offloaded
    // projections sit in the host pool, not the device arena), and no copy is planned
    // past what the link moves in the forward.
    let g = weft_frontends::load("llama3.2-1b").unwrap().graph;
    let opts = |checkpoint, offload| TrainOptions {
        checkpoint,
        offload,
        optimizer: None,
        grad_outputs: true,
        batch: Some(1),
        seq: Some(16384),
        ..Default::default()
    };
    let plan_of = |o: &TrainOptions| {
        let j = compile(&g, "", o);
        weft_passes::plan::lower(&j, &weft_passes::plan::PlanOptions::new(1, 16384)).unwrap()
    };
    let none = plan_of(&opts(CheckpointPolicy::None, None));
    let sel = plan_of(&opts(CheckpointPolicy::Selective, None));
    let off = plan_of(&opts(
        CheckpointPolicy::Selective,
        Some(OffloadOptions::default()),
    ));
    off.check().unwrap();
    let ms = |p: &weft_ir::plan::ExecutionPlan| p.cost.step_time_s * 1e3;
    assert!(
        ms(&none) < ms(&off) && ms(&off) < ms(&sel),
        "{} {} {}",
        ms(&none),
        ms(&off),
        ms(&sel)
    );
    assert!(off.memory.host_bytes > 1 << 30, "{:?}", off.memory);
    assert!(
        off.memory.peak_bytes < sel.memory.peak_bytes + (1 << 30),
        "{} vs {}",
        off.memory.peak_bytes,
        sel.memory.peak_bytes
    );
    // The copies out fit in the forward (the first backward instruction starts after
    // the last offload ends).
    let last_offload_end = off
        .instructions
        .iter()
        .filter(|i| i.op == "offload")
        .map(|i| i.start_s + i.time_s)
        .fold(0.0, f64::max);
    let lm_head = off
        .instructions
        .iter()
        .find(|i| i.source.as_deref() == Some("lm_head"))
        .unwrap()
        .start_s;
    assert!(
        last_offload_end <= lm_head,
        "{last_offload_end} > {lm_head}"
    );
    // Copies out and in run on their own streams, and the compute stream waits for every
    // offload (so the offloaded bytes return to the arena).
    for i in off
        .instructions
        .iter()
        .filter(|i| i.op == "offload" || i.op == "reload")
    {
        assert_eq!(i.stream, if i.op == "offload" { 2 } else { 3 }, "{}", i.id);
    }
    for i in off.instructions.iter().filter(|i| i.op == "offload") {
        let e = i.signal.expect("an offload signals an event");
        assert!(
            off.instructions
                .iter()
                .any(|c| c.stream == 0 && c.wait.contains(&e)),
            "nothing on the compute stream waits for offload {}",
            i.id
        );
    }
}

#[test]
fn adamw_without_master_weights_updates_bf16_params_in_their_dtype_inside_the_backward() {
    // torch.optim.AdamW on a bf16 model: states in bf16, no f32 master, no casts; each
    // update still runs inside the backward, so no gradient is returned.
    let mut g = model_1l("llama-tiny");
    let nodes: Vec<Node> = g.nodes().to_vec();
    for n in nodes {
        if let Op::Param { name, ty } = g.node(n).op.clone() {
            if ty.dtype == DType::F32 {
                g.node_mut(n).op = Op::Param {
                    name,
                    ty: ty.with_dtype(DType::BF16),
                };
            }
        }
        g.reinfer(n).unwrap();
    }
    let opts = |master_weights| TrainOptions {
        optimizer: Some(Optimizer::adamw(1e-3)),
        master_weights,
        grad_outputs: false,
        batch: Some(2),
        seq: Some(16),
        ..Default::default()
    };
    let mixed = compile(&g, "", &opts(true));
    let pure = compile(&g, "", &opts(false));
    verify(&pure).unwrap();
    let states = |j: &Graph| -> Vec<(String, DType)> {
        j.params()
            .into_iter()
            .filter(|(n, _)| n.starts_with("optim."))
            .map(|(n, v)| (n, j.ty(v).dtype))
            .collect()
    };
    assert!(states(&mixed)
        .iter()
        .any(|(n, _)| n.starts_with("optim.master.")));
    assert!(!states(&pure)
        .iter()
        .any(|(n, _)| n.starts_with("optim.master.")));
    assert!(
        states(&pure).iter().all(|(_, d)| *d == DType::BF16),
        "{:?}",
        states(&pure)
    );
    let count = |j: &Graph, op: &str| {
        j.nodes()
            .iter()
            .filter(|&&n| j.node(n).op.name() == op)
            .count()
    };
    assert_eq!(count(&pure, "adamw"), count(&mixed, "adamw"));
    assert!(count(&pure, "cast") < count(&mixed, "cast"));
    assert!(!pure.outputs().iter().any(|(n, _)| n.starts_with("grad.")));
    // Each update sits in the backward: something of the backward follows the first one.
    let order = pure.nodes();
    let first = order
        .iter()
        .position(|&n| pure.node(n).op.name() == "adamw")
        .unwrap();
    assert!(order[first..].iter().any(|&n| pure
        .node(n)
        .meta
        .derived
        .is_some_and(|d| d.kind == DerivedKind::Backward)));
}

//! `fuse` never changes what a step computes: the training steps of the llama, gemma2
//! (GeGLU with the tanh GELU, `(1 + w)` norms) and qwen3_moe (SwiGLU experts) fixtures,
//! alone and on sp=2,tp=2 (and with checkpointing, offload and micro-batches), give the
//! same loss, logits and gradients fused and unfused on the CPU reference (f64 to 1e-10,
//! f32 to 1e-4), and every pattern fuses where the model has it. An insta snapshot pins
//! the rewrite of a two-block program; `check --train` through the CLI (fusion on by
//! default) matches the unsharded model; and a plan's predicted bytes fall.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{Graph, HostTensor, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::Precision;

fn count(g: &Graph, name: &str) -> usize {
    g.nodes()
        .iter()
        .filter(|&&n| g.node(n).op.name() == name)
        .count()
}

fn train_opts() -> TrainOptions {
    TrainOptions::default()
}

/// Fused equals unfused on `fixture` for each (mesh, options); each pattern the model
/// has fuses at least `min` times per layer kind (counters).
fn check_fixture(fixture: &str, expect: &[(&str, u64)]) {
    let (g, weights, inputs) = load_fixture(fixture);
    let cases: [(&str, TrainOptions); 4] = [
        ("", train_opts()),
        ("sp=2,tp=2", train_opts()),
        ("sp=2,tp=2", checkpoint_and_offload()),
        ("", two_micro_batches()),
    ];
    for (mesh, opts) in cases {
        let what = case_name(fixture, mesh, &opts);
        let (unfused, _) = training_step(&g, mesh, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (f, counters) = fused(&unfused);
        for (pattern, min) in expect {
            assert!(
                counters[*pattern] >= *min,
                "{what}: `{pattern}` fused {} times, expected at least {min} ({counters:?})",
                counters[*pattern]
            );
            assert_eq!(
                count(&f, pattern) as u64,
                counters[*pattern],
                "{what}: {pattern}"
            );
        }
        assert!(f.node_count() < unfused.node_count(), "{what}: fewer nodes");
        same_outputs(&what, &unfused, &f, &weights, &inputs, F64_AND_F32);
    }
}

#[test]
fn llama_fused_equals_unfused() {
    // Two layers: a glu and its grad per layer; the residual add + norm twice per layer
    // but the first (the embedding has no add before it).
    check_fixture(
        "llama",
        &[
            ("glu", 2),
            ("glu_grad", 2),
            ("add_rms_norm", 3),
            ("add_rms_norm_grad", 3),
            // The residual stream's gradient summed from q, k, v and from gate, up: two
            // and one GEMMs accumulating per layer.
            ("matmul_add", 6),
        ],
    );
}

#[test]
fn gemma2_fused_equals_unfused() {
    // GeGLU (tanh GELU) and the `(1 + w)` norms, whose weight operand is `w + 1`.
    check_fixture(
        "gemma2",
        &[("glu", 2), ("glu_grad", 2), ("add_rms_norm", 1)],
    );
}

#[test]
fn qwen3_moe_fused_equals_unfused() {
    // The experts' SwiGLU on dispatched rows (a data-dependent row count).
    check_fixture(
        "qwen3_moe",
        &[
            ("glu", 1),
            ("glu_grad", 1),
            ("add_rms_norm", 2),
            ("add_rms_norm_grad", 2),
        ],
    );
}

/// Two residual blocks (SwiGLU MLPs): enough for every pattern, forward and backward.
const BLOCKS: &str = r#"graph "blocks"
%0: i64[B, S] = input {name="input_ids", role=input_ids}
%1: i64[B, S] = input {name="labels", role=labels}
%2: f32[16, 8] = param {name="model.embed_tokens.weight"}
%3: f32[8] = param {name="model.layers.0.norm.weight"}
%4: f32[16, 8] = param {name="model.layers.0.mlp.gate_proj.weight"}
%5: f32[16, 8] = param {name="model.layers.0.mlp.up_proj.weight"}
%6: f32[8, 16] = param {name="model.layers.0.mlp.down_proj.weight"}
%7: f32[8] = param {name="model.layers.1.norm.weight"}
%8: f32[16, 8] = param {name="model.layers.1.mlp.gate_proj.weight"}
%9: f32[16, 8] = param {name="model.layers.1.mlp.up_proj.weight"}
%10: f32[8, 16] = param {name="model.layers.1.mlp.down_proj.weight"}
%11: f32[8] = param {name="model.norm.weight"}
%12: f32[16, 8] = param {name="lm_head.weight"}
%13: f32[B, S, 8] = embedding %0, %2
%14: f32[B, S, 8] = rms_norm %13, %3 {eps=1e-6}
%15: f32[B, S, 16] = linear %14, %4
%16: f32[B, S, 16] = linear %14, %5
%17: f32[B, S, 16] = silu %15
%18: f32[B, S, 16] = mul %17, %16
%19: f32[B, S, 8] = linear %18, %6
%20: f32[B, S, 8] = add %13, %19
%21: f32[B, S, 8] = rms_norm %20, %7 {eps=1e-6}
%22: f32[B, S, 16] = linear %21, %8
%23: f32[B, S, 16] = linear %21, %9
%24: f32[B, S, 16] = gelu %22 {tanh_approx=true}
%25: f32[B, S, 16] = mul %23, %24
%26: f32[B, S, 8] = linear %25, %10
%27: f32[B, S, 8] = add %20, %26
%28: f32[B, S, 8] = rms_norm %27, %11 {eps=1e-6}
%29: f32[B, S, 16] = linear %28, %12
%30: i64[B, S] = shift_labels %1 {ignore_index=-100}
%31: f32[] = cross_entropy %29, %30 {ignore_index=-100, reduction=sum}
%32: f32[] = count_valid %30 {ignore_index=-100}
%33: f32[] = div %31, %32
return loss=%33, logits=%29
"#;

#[test]
fn fuse_rewrite_snapshot_and_values() {
    let g = weft_ir::parse(BLOCKS).unwrap();
    let (unfused, _) = training_step(&g, "", &train_opts()).unwrap();
    let (f, counters) = fused(&unfused);
    let want: BTreeMap<String, u64> = [
        ("adamw_master", 0),
        ("add_rms_norm", 2),
        ("attention_bshd", 0),
        ("add_rms_norm_grad", 2),
        ("dce_removed", 0),
        ("embedding_grad_init", 0),
        ("glu", 2),
        ("glu_grad", 2),
        ("linear_cross_entropy_with_grad", 0),
        ("matmul_add", 2),
        ("rope_bshd", 0),
        ("transpose_pairs_cancelled", 0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // the silu/gelu outputs the unfused backward read are gone with their muls
    assert_eq!(
        counters
            .iter()
            .filter(|(k, _)| *k != "dce_removed")
            .collect::<Vec<_>>(),
        want.iter()
            .filter(|(k, _)| *k != "dce_removed")
            .collect::<Vec<_>>()
    );
    for op in ["silu", "gelu", "silu_grad", "gelu_grad"] {
        assert_eq!(
            count(&f, op),
            0,
            "`{op}` left unfused:\n{}",
            weft_ir::print(&f)
        );
    }
    // Only the first norm (of the embedding, no add before it) stays a plain rms_norm, and
    // only the last one's gradient (its sum has no other reader: no add to fuse with).
    assert_eq!(count(&f, "rms_norm"), 1);
    assert_eq!(count(&f, "rms_norm_grad"), 1);
    let text = weft_ir::print(&f);
    assert_eq!(
        weft_ir::parse(&text).unwrap(),
        f,
        "the fused program round-trips"
    );
    insta::assert_snapshot!("fuse__blocks", text);
    let ids: Vec<i64> = (0..10).map(|i| (i * 7 + 3) % 16).collect();
    let int = |v: Vec<i64>| HostTensor::ints(weft_ir::DType::I64, vec![2, 5], v);
    let inputs = BTreeMap::from([
        ("input_ids".to_string(), int(ids.clone())),
        ("labels".to_string(), int(ids)),
    ]);
    let weights = weights_for(&g, 1.0);
    same_outputs("blocks", &unfused, &f, &weights, &inputs, F64_AND_F32);
}

#[test]
fn fusion_turns_off_and_check_train_passes_with_it() {
    // Fused by default through the driver; --fuse=false leaves the program unfused.
    let (code, on, err) = weft(&["compile", "llama-tiny"]);
    assert_eq!(code, 0, "{err}");
    let (code, off, err) = weft(&["compile", "llama-tiny", "--fuse=false"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        on.contains("= glu_grad ") && on.contains("= add_rms_norm "),
        "{on}"
    );
    assert!(
        !off.contains("glu") && !off.contains("add_rms_norm"),
        "{off}"
    );
    for fixture in ["llama", "gemma2", "qwen3_moe"] {
        let dir = fixture_arg(fixture);
        let (code, out, err) = weft(&["check", &dir, "--mesh", "sp=2,tp=2", "--train"]);
        assert_eq!(code, 0, "{fixture}: {out}\n{err}");
    }
}

fn fixture_arg(name: &str) -> String {
    fixture(name).to_str().unwrap().to_string()
}

/// The plan of a llama-tiny training step (AdamW, nothing recomputed or offloaded),
/// fused or not: (bytes the compute instructions move, predicted step seconds, peak).
fn llama_plan(fuse: bool) -> (f64, f64, u64) {
    use weft_passes::driver::{compile, Request, TrainRequest};
    let model = weft_frontends::load("llama-tiny").unwrap().graph;
    let mut req = Request::new(model, weft_ir::Mesh::parse("").unwrap());
    (req.batch, req.seq, req.plan, req.fuse) = (Some(2), Some(256), true, fuse);
    req.train = Some(TrainRequest {
        options: TrainOptions {
            optimizer: Some(weft_passes::training::Optimizer::adamw(1e-3)),
            grad_outputs: false,
            // the loss compile picks where the logits fit (the fused loss's chunk
            // scratch moves the peak by a few KiB on this tiny model)
            fused_loss: false,
            ..Default::default()
        },
        ..Default::default()
    });
    let plan = compile(&req, &mut std::io::sink()).unwrap().plan.unwrap();
    let bytes = plan
        .instructions
        .iter()
        .filter(|i| i.axis.is_none())
        .map(|i| i.bytes)
        .sum();
    (bytes, plan.cost.step_time_s, plan.memory.peak_bytes)
}

#[test]
fn fused_plan_moves_fewer_bytes_in_less_time_and_memory() {
    let (b0, t0, p0) = llama_plan(false);
    let (b1, t1, p1) = llama_plan(true);
    eprintln!(
        "llama-tiny B=2 S=256: bytes {b0} -> {b1}, step {t0:e} s -> {t1:e} s, peak {p0} -> {p1}"
    );
    assert!(b1 < b0, "bytes {b0} -> {b1}");
    assert!(t1 < t0, "predicted step {t0} -> {t1}");
    assert!(p1 <= p0, "peak {p0} -> {p1}");
}

#[test]
fn only_exact_patterns_fuse() {
    // A broadcasting mul, an activation read twice, a broadcasting add before a norm and
    // a norm of a sum in another dtype stay unfused; the one exact glu fuses.
    let text = r#"graph "near_misses"
%0: f32[2, 4, 16] = param {name="g"}
%1: f32[16] = param {name="u"}
%2: f32[2, 4, 16] = param {name="v"}
%3: f32[2, 4, 16] = silu %0
%4: f32[2, 4, 16] = mul %3, %1
%5: f32[2, 4, 16] = silu %2
%6: f32[2, 4, 16] = mul %5, %2
%7: f32[2, 4, 16] = mul %5, %0
%8: f32[2, 4, 16] = silu %2
%9: f32[2, 4, 16] = mul %8, %0
%10: f32[16] = param {name="w"}
%11: f32[2, 4, 16] = add %0, %1
%12: f32[2, 4, 16] = rms_norm %11, %10 {eps=1e-6}
return a=%4, b=%6, c=%7, d=%9, e=%12
"#;
    let g = weft_ir::parse(text).unwrap();
    let (f, counters) = fused(&g);
    assert_eq!(counters["glu"], 1, "{}", weft_ir::print(&f));
    assert_eq!(counters["add_rms_norm"], 0);
    assert_eq!(
        count(&f, "silu"),
        2,
        "the broadcast one and the one read twice stay"
    );
    assert_eq!(count(&f, "rms_norm"), 1);
}

/// Deterministic weights of `g`'s parameters in their dtypes: norm weights near
/// `norm_center` (1, or 0 for Gemma's `1 + w`), the rest small.
fn weights_for(g: &Graph, norm_center: f64) -> BTreeMap<String, HostTensor> {
    g.params()
        .into_iter()
        .map(|(name, v)| {
            let t = g.ty(v);
            let shape: Vec<usize> = t
                .shape
                .iter()
                .map(|d| d.as_const().unwrap() as usize)
                .collect();
            let n: usize = shape.iter().product();
            let norm = name.contains("norm");
            let data = (0..n)
                .map(|i| {
                    let u = ((i * 2654435761 + name.len() * 97) % 1000) as f64 / 1000.0 - 0.5;
                    if norm {
                        norm_center + 0.2 * u
                    } else {
                        0.6 * u
                    }
                })
                .collect();
            (name, HostTensor::floats(t.dtype, shape, data))
        })
        .collect()
}

#[test]
fn gemma2_in_bf16_fuses_its_f32_norms_between_casts() {
    // Gemma's (1 + w) norms in bf16 run in f32 between a widening cast and the cast back:
    // they fuse too, forward and backward, and the step computes the same (on the CPU
    // reference, which holds bf16 in f64, exactly).
    let dir = fixture("gemma2");
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
    let mut cfg = model.config.clone().unwrap();
    cfg.dtype = weft_ir::DType::BF16;
    let g = weft_frontends::Model::from_config(&model.name, cfg, model.origin.clone())
        .unwrap()
        .graph;
    let (_, _, inputs) = load_fixture("gemma2");
    let weights = weights_for(&g, 0.0);
    for mesh in ["", "sp=2,tp=2"] {
        let (unfused, _) = training_step(&g, mesh, &train_opts()).unwrap();
        let (f, counters) = fused(&unfused);
        let what = format!("gemma2 bf16 on `{mesh}`");
        assert!(counters["add_rms_norm"] >= 3, "{what}: {counters:?}");
        assert!(counters["add_rms_norm_grad"] >= 3, "{what}: {counters:?}");
        assert!(
            counters["glu"] >= 2 && counters["glu_grad"] >= 2,
            "{what}: {counters:?}"
        );
        assert!(
            count(&f, "add_rms_norm") > 0 && count(&f, "cast") < count(&unfused, "cast"),
            "{what}"
        );
        same_outputs(
            &what,
            &unfused,
            &f,
            &weights,
            &inputs,
            &[(Precision::F64, 1e-10)],
        );
    }
}

#[test]
fn mixed_precision_adamw_fuses_with_its_casts() {
    // bf16 parameters with f32 master weights: the optimizer writes cast(grad) -> adamw
    // on the master -> cast back for every parameter; each chain becomes one
    // `adamw_master` (alone, on dp=2 with ZeRO-1 shards, and on tp=2), computing the same
    // step. The f32 program has no such chain.
    use weft_passes::training::Optimizer;
    let dir = fixture("llama");
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
    let mut cfg = model.config.clone().unwrap();
    cfg.dtype = weft_ir::DType::BF16;
    let g = weft_frontends::Model::from_config(&model.name, cfg, model.origin.clone())
        .unwrap()
        .graph;
    let (_, _, inputs) = load_fixture("llama");
    let weights = weights_for(&g, 1.0);
    let mut adamw = train_opts();
    adamw.optimizer = Some(Optimizer::adamw(1e-3));
    let mut zero = adamw.clone();
    zero.zero1 = true;
    for (mesh, opts) in [("", &adamw), ("dp=2", &zero), ("tp=2", &adamw)] {
        let what = format!("llama bf16 on `{mesh}` (zero1 {})", opts.zero1);
        let (unfused, _) = training_step(&g, mesh, opts).unwrap();
        let (f, counters) = fused(&unfused);
        let updates = count(&unfused, "adamw") as u64;
        assert!(updates >= 9, "{what}: {updates} adamw");
        assert_eq!(counters["adamw_master"], updates, "{what}: {counters:?}");
        assert_eq!(count(&f, "adamw"), 0, "{what}");
        assert_eq!(count(&f, "adamw_master") as u64, updates, "{what}");
        let mut state = weights.clone();
        state.extend(weft_passes::optimizer::initial_state(&unfused, &weights).unwrap());
        let mut step_inputs = inputs.clone();
        step_inputs.insert(
            "optim.step".into(),
            HostTensor::floats(weft_ir::DType::F32, vec![], vec![1.0]),
        );
        same_outputs(
            &what,
            &unfused,
            &f,
            &state,
            &step_inputs,
            &[(Precision::F64, 1e-10)],
        );
    }
    let (g32, _, _) = load_fixture("llama");
    let (unfused, _) = training_step(&g32, "", &adamw).unwrap();
    assert_eq!(fused(&unfused).1["adamw_master"], 0, "f32 llama");
}

#[test]
fn a_fused_forward_differentiates_to_the_fused_backward() {
    // A fused forward (a forward-only plan, a .weft file) coming back for a training
    // step: autodiff's rules for glu and add_rms_norm give the same gradients.
    let g = weft_ir::parse(BLOCKS).unwrap();
    let (fwd, counters) = fused(&g);
    assert_eq!((counters["glu"], counters["add_rms_norm"]), (2, 2));
    let (unfused, _) = training_step(&g, "", &train_opts()).unwrap();
    let (from_fused, _) = training_step(&fwd, "", &train_opts()).unwrap();
    assert!(count(&from_fused, "glu_grad") == 2 && count(&from_fused, "add_rms_norm_grad") >= 1);
    let ids: Vec<i64> = (0..10).map(|i| (i * 5 + 1) % 16).collect();
    let int = |v: Vec<i64>| HostTensor::ints(weft_ir::DType::I64, vec![2, 5], v);
    let inputs = BTreeMap::from([
        ("input_ids".to_string(), int(ids.clone())),
        ("labels".to_string(), int(ids)),
    ]);
    let weights = weights_for(&g, 1.0);
    same_outputs(
        "fused forward",
        &unfused,
        &from_fused,
        &weights,
        &inputs,
        &[(Precision::F64, 1e-10)],
    );
}

#[test]
fn tied_embedding_gradient_adds_into_the_lm_head_gradient() {
    // gemma2 ties lm_head to the embedding: the table's gradient is the lm_head GEMM's
    // plus the embedding's rows; `fuse` adds the rows into the first in its bytes.
    let (g, weights, inputs) = load_fixture("gemma2");
    for mesh in ["", "dp=2", "sp=2"] {
        let (unfused, _) = training_step(&g, mesh, &train_opts()).unwrap();
        let (f, counters) = fused(&unfused);
        assert_eq!(counters["embedding_grad_init"], 1, "{mesh}");
        let with_init = f
            .nodes()
            .iter()
            .filter(|&&n| {
                matches!(f.node(n).op, Op::EmbeddingGrad { .. }) && f.node(n).operands.len() == 3
            })
            .count();
        assert_eq!(
            with_init, 1,
            "{mesh}: one embedding_grad adds into its init"
        );
        same_outputs(
            &format!("gemma2 on `{mesh}`"),
            &unfused,
            &f,
            &weights,
            &inputs,
            &[(Precision::F64, 1e-10)],
        );
    }
}

/// Offloading every saved activation puts the q/k rope outputs and the attention output
/// on the host (`reload(offload(.))`, as the budget planner does on real models) and
/// makes the host copies wait for the activation and attention results (their `after`
/// operands): the attention still
/// moves to [B, S, H, D] (its host copies with it, the waits on the new results) and a
/// gated unit whose activation only a copy waits on still fuses (the copy then waits for
/// the `glu`), with the same outputs as unfused, on one rank and on sp=2.
#[test]
fn host_copies_keep_the_head_layout_and_glu_fusions() {
    let (g, weights, inputs) = load_fixture("llama");
    let mut opts = TrainOptions::default();
    opts.offload = Some(weft_passes::training::OffloadOptions {
        min_bytes: 0,
        keep_last: 0,
        ..Default::default()
    });
    for mesh in ["", "sp=2"] {
        let what = case_name("llama", mesh, &opts);
        let (unfused, _) = training_step(&g, mesh, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        let waits_on = |g: &Graph, op: &str| {
            g.nodes().iter().any(|&n| {
                let d = g.node(n);
                matches!(d.op, Op::Offload { .. })
                    && d.operands[1..].iter().any(|&v| g.op_of(v).name() == op)
            })
        };
        assert!(
            waits_on(&unfused, "attention"),
            "{what}: a host copy waits on attention"
        );
        assert!(
            waits_on(&unfused, "silu"),
            "{what}: a host copy waits on silu"
        );
        let copied = |g: &Graph| {
            g.nodes()
                .iter()
                .filter(|&&n| matches!(g.node(n).op, Op::Offload { .. }))
                .count()
        };
        let (f, counters) = fused(&unfused);
        // As many attentions move to [B, S, H, D] as without the copies (on one rank all;
        // under Ulysses sp none: the all_to_all gives their layout).
        let (plain, _) = training_step(&g, mesh, &TrainOptions::default()).unwrap();
        let (_, plain_counters) = fused(&plain);
        assert_eq!(
            counters["attention_bshd"], plain_counters["attention_bshd"],
            "{what}: {counters:?}"
        );
        if mesh.is_empty() {
            let attentions = count(&unfused, "attention") + count(&unfused, "attention_grad");
            assert_eq!(counters["attention_bshd"], attentions as u64, "{what}");
        }
        // A gated unit whose activation is itself saved on the host stays unfused (its
        // backward reads the copy, not a recompute from the gate).
        assert!(counters["glu"] >= 1, "{what}: {counters:?}");
        // No copy is added (one whose reload only the unfused backward read dies).
        assert!(copied(&f) <= copied(&unfused), "{what}: host copies");
        assert!(waits_on(&f, "glu") && waits_on(&f, "attention"), "{what}");
        if mesh.is_empty() {
            // Layer 0's attention, gated unit and their host copies after the rewrite.
            let mut text = String::new();
            for &n in f.nodes() {
                let d = f.node(n);
                let keep = matches!(
                    d.op.name(),
                    "offload" | "reload" | "attention" | "attention_grad" | "glu" | "glu_grad"
                );
                if keep
                    && d.meta
                        .source
                        .as_deref()
                        .is_some_and(|s| s.starts_with("model.layers.0."))
                {
                    let ops: Vec<String> = d
                        .operands
                        .iter()
                        .map(|&v| format!("{} {}", f.op_of(v).name(), f.ty(v)))
                        .collect();
                    text.push_str(&format!("{} ({})\n", d.op.name(), ops.join(", ")));
                }
            }
            insta::assert_snapshot!(text);
        }
        same_outputs(&what, &unfused, &f, &weights, &inputs, F64_AND_F32);
    }
}

//! Context parallelism (ring attention, `cp`) preserves meaning, checked by running it:
//! the CPU reference executes the unsharded model and the compiled SPMD program over
//! simulated ranks (f64), and the loss, logits and every gradient must agree to 1e-10.
//! The program after each pass is run too (shard-inputs and shard-seq keep it whole
//! with gathers and inverse zigzags until ring-attention replaces them; a program that
//! still holds `ring_attention` ops runs with them expanded by `ring-lower`).
//!
//! The training step (autodiff on the unexpanded ring, then `ring-lower` writes the
//! transposed ring) is checked the same way: its `grad.*` outputs against the
//! reference's gradients, with and without recomputation.
//!
//! The all-gather variant (`--cp-kv allgather`: k/v gathered over cp, one masked
//! attention, dk/dv reduce-scattered) is checked the same way, forward and training.
//!
//! Labels include -100 spread unevenly, so the loss must be the global mean over valid
//! tokens whatever the zigzag puts on each rank.

mod common;
use common::*;

use weft_ir::{HostTensor, Mesh, Op};
use weft_passes::ring_allgather::CpKv;
use weft_passes::training::{CheckpointPolicy, TrainOptions};
use weft_passes::{default_pipeline, lookup, PassContext};
use weft_runtime::cpu::RunResult;

fn case(name: &str) -> Case {
    let dir = fixture(name);
    let model =
        weft_frontends::load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    let ids = inputs["input_ids"].to_i64();
    let (b, s) = (inputs["input_ids"].shape[0], inputs["input_ids"].shape[1]);
    let mut labels = ids.clone();
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

/// `g`, with any ring ops expanded (the runtimes run only ring steps).
fn runnable(g: &weft_ir::Graph, cx: &PassContext) -> weft_ir::Graph {
    let mut g = g.clone();
    lookup("ring-lower").unwrap().run(&mut g, cx).unwrap();
    g
}

/// Compiles fixture `name` for `mesh` pass by pass; runs after each pass when
/// `every_pass` (gradients after the last) against the unsharded reference.
fn check(name: &str, mesh: &str, every_pass: bool) -> weft_ir::Graph {
    check_case(name, case(name), mesh, every_pass)
}

/// [`check`] of the model `c` (named `name` in failures).
fn check_case(name: &str, c: Case, mesh: &str, every_pass: bool) -> weft_ir::Graph {
    let reference = execute(&c.graph, &c, true);
    let cx = PassContext::new(Mesh::parse(mesh).unwrap());
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    let pipeline = default_pipeline(&cx.mesh);
    assert!(pipeline.contains(&"ring-attention"), "{pipeline:?}");
    assert!(pipeline.contains(&"ring-lower"), "{pipeline:?}");
    for (i, pass) in pipeline.iter().enumerate() {
        lookup(pass)
            .unwrap()
            .run(&mut g, &cx)
            .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} after {pass}: {r}"));
        let last = i + 1 == pipeline.len();
        if every_pass || last {
            let got = execute(&runnable(&g, &cx), &c, last);
            let mut want = reference.clone();
            if !last {
                want.grads.clear();
            }
            compare(&format!("{name} on {mesh} after {pass}"), &want, &got);
        }
    }
    let text = g.to_string();
    assert!(text.contains("ring_shift"), "no ring step in:\n{text}");
    // Only the logits output is gathered (zigzag order has no output split); no
    // attention reads a gathered sequence.
    for line in text.lines().filter(|l| l.contains("all_gather")) {
        assert!(
            !line.contains("self_attn"),
            "an attention gather is left: {line}"
        );
    }
    check_training(name, mesh, &c, &reference, TrainOptions::default());
    g
}

/// The training step of `c` on `mesh`: every `grad.*` output equals the reference
/// gradient, and the backward has no per-step copy of the forward's ring (autodiff
/// saw one `ring_attention`).
fn check_training(
    name: &str,
    mesh: &str,
    c: &Case,
    reference: &RunResult,
    opts: TrainOptions,
) -> weft_ir::Graph {
    let (g, _) = training_step(&c.graph, mesh, &opts)
        .unwrap_or_else(|e| panic!("{name} {mesh} training: {e}"));
    weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} training: {r}"));
    let text = g.to_string();
    assert!(
        !text.contains("ring_attention"),
        "ring ops left unexpanded:\n{text}"
    );
    // The backward is the explicit ring's (per-block gradients from the merged out and
    // lse), not autodiff's differentiation of the expanded forward.
    assert!(text.contains("attention_block_grad"), "no ring backward");
    assert!(
        !text.contains("attention_grad "),
        "an attention_grad of a ring step is left"
    );
    let got = execute(&g, c, false);
    let what = format!("{name} on {mesh}, training step ({})", opts.summary());
    assert_close(
        &format!("{what}: loss"),
        &reference.outputs["loss"],
        &got.outputs["loss"],
    );
    for (p, want) in &reference.grads {
        assert_close(
            &format!("{what}: grad {p}"),
            want,
            &got.outputs[&format!("grad.{p}")],
        );
    }
    g
}

#[test]
fn recomputed_ring_keeps_the_gradients() {
    for policy in [CheckpointPolicy::Full, CheckpointPolicy::Selective] {
        for (name, mesh) in [("llama", "cp=2"), ("mistral_sw4", "cp=4")] {
            let c = case(name);
            let reference = execute(&c.graph, &c, true);
            let opts = TrainOptions {
                checkpoint: policy.clone(),
                ..Default::default()
            };
            check_training(name, mesh, &c, &reference, opts);
        }
    }
}

#[test]
fn llama_cp2_every_pass() {
    check("llama", "cp=2", true);
}

#[test]
fn llama_cp4() {
    check("llama", "cp=4", false);
}

#[test]
fn llama_one_kv_head_cp4() {
    check("llama_kv1", "cp=4", false);
}

#[test]
fn llama_ulysses_in_ring_sp2_cp2() {
    check("llama", "cp=2,sp=2", true);
    check("llama_kv1", "cp=2,sp=2", false);
}

#[test]
fn llama_dp2_cp2() {
    check("llama", "dp=2,cp=2", false);
}

#[test]
fn llama_cp2_tp2() {
    check("llama", "cp=2,tp=2", false);
}

#[test]
fn mixtral_cp2_ep2() {
    check("mixtral", "cp=2,ep=2", false);
}

#[test]
fn sliding_window_cp2_cp4() {
    // A 4-key window at 16 tokens: the band cuts blocks of every ring step.
    check("mistral_sw4", "cp=2", false);
    check("mistral_sw4", "cp=4", false);
    check("mixtral_sw5", "cp=2,sp=2", false);
}

#[test]
fn qwen3_qk_norm_cp2() {
    check("qwen3", "cp=2", false);
    check("qwen3_moe", "cp=2,sp=2", false);
}

/// Bytes per rank of every `op_name` node of layer 0 in the training step of `fixture`
/// on `mesh`, with B and S bound.
fn layer0_bytes(fixture: &str, mesh: &str, op_name: &str, b: i64, s: i64) -> (usize, i64) {
    let (f, bk) = layer0_bytes_split(
        &case(fixture),
        mesh,
        op_name,
        b,
        s,
        &TrainOptions::default(),
    );
    (f.0 + bk.0, f.1 + bk.1)
}

/// Count and bytes per rank of every `op_name` node of layer 0 in the training step of
/// `c` on `mesh` compiled with `opts`, with B and S bound: (forward, backward).
fn layer0_bytes_split(
    c: &Case,
    mesh: &str,
    op_name: &str,
    b: i64,
    s: i64,
    opts: &TrainOptions,
) -> ((usize, i64), (usize, i64)) {
    let (g, _) = training_step(&c.graph, mesh, opts).unwrap();
    let m = Mesh::parse(mesh).unwrap();
    let mut bind = weft_ir::dim::Bindings::new().with("B", b).with("S", s);
    for (a, n) in &m.axes {
        bind = bind.with(a, *n as i64);
    }
    let (mut forward, mut backward) = ((0, 0), (0, 0));
    for &n in g.nodes() {
        let d = g.node(n);
        let in_layer0 = d
            .meta
            .source
            .as_deref()
            .is_some_and(|s| s.starts_with("model.layers.0.self_attn"));
        if d.op.name() != op_name || !in_layer0 {
            continue;
        }
        let t = g.ty(d.operands[0]);
        let is_backward = d
            .meta
            .derived
            .as_ref()
            .is_some_and(|x| x.kind == weft_ir::DerivedKind::Backward);
        let at = if is_backward {
            &mut backward
        } else {
            &mut forward
        };
        at.0 += 1;
        at.1 += (t.numel() * t.dtype.size_bytes() as i64)
            .eval(&bind)
            .unwrap();
    }
    (forward, backward)
}

/// With a sliding window the ring takes only the steps whose blocks meet the band
/// (`ring_steps`): per layer and rank, forward, `K` steps each moving a k and a v
/// block (each rank computes the block's key positions itself); backward, the same
/// again plus the dk/dv accumulators (one shift per step after each ring's first, and
/// one home per ring), so `2 K kv` forward and `4 K kv` backward.
#[test]
fn window_ring_steps_and_bytes_are_the_analytic_figure() {
    // mistral_sw4: 2 kv heads, head dim 8, f32, a 4-key window.
    let (b, nkv, d, cp) = (2i64, 2i64, 8i64, 4i64);
    let c = case("mistral_sw4");
    // 64 tokens: chunks of 8, the band reaches one chunk back: one step of each ring
    // (2 of cp-1 = 3). 16 tokens: chunks of 2, the band needs every step.
    for (s, want_steps) in [(64i64, (1, 1)), (16, (3, 0))] {
        let steps = weft_passes::ring_steps::window_ring(s, cp, 4).unwrap();
        assert_eq!((steps.from_earlier, steps.from_later), want_steps, "S={s}");
        let k = steps.steps();
        let rings = [steps.from_earlier, steps.from_later]
            .iter()
            .filter(|&&n| n > 0)
            .count() as i64;
        let opts = TrainOptions {
            seq: Some(s),
            ..Default::default()
        };
        let (fwd, bwd) = layer0_bytes_split(&c, &format!("cp={cp}"), "ring_shift", b, s, &opts);
        let kv = b * nkv * (s / cp) * d * 4;
        assert_eq!(fwd, (2 * k as usize, 2 * k * kv), "S={s} forward");
        assert_eq!(
            bwd,
            ((2 * k + 2 * (k - rings) + 2 * rings) as usize, 4 * k * kv),
            "S={s} backward"
        );
    }
    // The hybrid (Ulysses inside the ring) on cp=4,sp=2 at 64 tokens: the ring carries
    // the cp rank's tokens for Nkv/sp heads over the same (1, 1) steps, and q, k, v and
    // the output each go through one all_to_all forward and one backward on top.
    let (s, sp, nq) = (64i64, 2i64, 4i64);
    let opts = TrainOptions {
        seq: Some(s),
        ..Default::default()
    };
    let k = 2;
    let kv = b * (nkv / sp) * (s / cp) * d * 4;
    let (fwd, bwd) = layer0_bytes_split(&c, "cp=4,sp=2", "ring_shift", b, s, &opts);
    assert_eq!(fwd, (4, 2 * k * kv), "cp=4,sp=2 forward");
    assert_eq!(bwd, (8, 4 * k * kv), "cp=4,sp=2 backward");
    let (fwd, bwd) = layer0_bytes_split(&c, "cp=4,sp=2", "all_to_all", b, s, &opts);
    let local = b * (s / cp / sp) * d * 4;
    let one_way = nq * local + 2 * nkv * local + nq * local;
    assert_eq!(
        (fwd, bwd),
        ((4, one_way), (4, one_way)),
        "cp=4,sp=2 all_to_all"
    );
}

/// A sequence the zigzag chunks do not divide cannot bound the window's ring; a ring
/// that stops early for 64 tokens (4-key window, cp=4: right from 24 tokens on) refuses
/// to bind or run 16 (whose band needs every step), naming the length that works.
#[test]
fn window_ring_refuses_a_shorter_sequence() {
    let c = case("mistral_sw4");
    let opts = TrainOptions {
        seq: Some(64),
        ..Default::default()
    };
    let (g, _) = training_step(&c.graph, "cp=4", &opts).unwrap();
    let bind = |s: i64| weft_ir::dim::Bindings::new().with("B", 2).with("S", s);
    weft_passes::check_bindings(&g, &bind(24)).unwrap();
    let err = weft_passes::check_bindings(&g, &bind(16))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("S=16 is too small") && err.contains("S=24"),
        "{err}"
    );
    let run = weft_runtime::cpu::run(
        &g,
        &c.weights,
        &c.inputs,
        &weft_runtime::cpu::RunOptions::new(weft_runtime::cpu::Precision::F64),
    );
    assert!(run.is_err(), "a 64-token ring ran on 16 tokens");
    for seq in [4i64, 12] {
        let opts = TrainOptions {
            seq: Some(seq),
            ..Default::default()
        };
        let err = training_step(&c.graph, "cp=4", &opts).unwrap_err();
        assert!(
            err.contains("ring-lower")
                && err.contains(&format!("{seq} tokens"))
                && err.contains("multiple of 2 x cp = 8"),
            "{err}"
        );
    }
}

/// mistral_sw4 with its window narrowed to 2 keys.
fn narrow_window_case() -> Case {
    with_attentions("mistral_sw4", |op| {
        if let Op::Attention { window, .. } = op {
            *window = Some(2);
        }
    })
}

/// Fixture `name` with `edit` applied to every op (meant for its attentions).
fn with_attentions(name: &str, edit: impl Fn(&mut Op)) -> Case {
    let mut c = case(name);
    for n in c.graph.nodes().to_vec() {
        edit(&mut c.graph.node_mut(n).op);
    }
    c
}

/// With a 2-key window at 16 tokens on cp=4 (chunks of 2) only the first step of each
/// ring meets the band: the ring stops there (k and v sent once each way per layer,
/// not three times; no positions travel), and the logits, loss and every gradient still equal
/// the unsharded model's.
#[test]
fn sliding_window_ring_stops_early() {
    let c = narrow_window_case();
    let reference = execute(&c.graph, &c, true);
    let mut cx = PassContext::new(Mesh::parse("cp=4").unwrap());
    cx.options.train.seq = Some(16);
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    for pass in default_pipeline(&cx.mesh) {
        lookup(pass).unwrap().run(&mut g, &cx).unwrap();
    }
    weft_ir::verify(&g).unwrap();
    let text = g.to_string();
    let layer0_shifts: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("= ring_shift") && l.contains("model.layers.0.self_attn"))
        .collect();
    assert_eq!(layer0_shifts.len(), 4, "{}", layer0_shifts.join("\n"));
    assert_eq!(
        layer0_shifts
            .iter()
            .filter(|l| l.contains("shift=-1"))
            .count(),
        2,
        "{}",
        layer0_shifts.join("\n")
    );
    let mut want = reference.clone();
    want.grads.clear();
    compare("2-key window on cp=4", &want, &execute(&g, &c, false));
    let opts = TrainOptions {
        seq: Some(16),
        ..Default::default()
    };
    let g = check_training("mistral_sw4 (2-key window)", "cp=4", &c, &reference, opts);
    let backward_shifts = g
        .to_string()
        .lines()
        .filter(|l| l.contains("= ring_shift") && l.contains("model.layers.0.self_attn"))
        .count();
    assert_eq!(backward_shifts, 4 + 8);
}

/// No position travels the masked ring: every `ring_shift` of layer 0's windowed ring
/// (mistral_sw4, every step at 16 tokens on cp=4, and the early-stopped rings at 64)
/// carries a k, v, dk or dv block, never an i64 tensor; each step's key positions are
/// computed on the rank (its block of the zigzag positions rolled by the step).
#[test]
fn the_masked_ring_computes_key_positions_locally() {
    let c = case("mistral_sw4");
    for seq in [None, Some(64)] {
        let (g, text) = cp4_training_step(&c, seq);
        let ring = layer0_ring_lines(&text);
        let shifts: Vec<&&str> = ring.iter().filter(|l| l.contains("= ring_shift")).collect();
        assert!(!shifts.is_empty());
        for l in &shifts {
            assert!(
                !l.contains(": i64[") && !l.contains("positions"),
                "{seq:?}: {l}"
            );
        }
        assert!(
            ring.iter()
                .any(|l| l.contains("= slice") && l.contains("key positions of the sender's block")),
            "{seq:?}:\n{}",
            ring.join("\n")
        );
        // The rank-dependent slices print and parse back.
        assert_eq!(weft_ir::parse(&text).unwrap(), g, "{seq:?}: round trip");
    }
}

/// llama with every attention made non-causal (bidirectional).
fn non_causal_case() -> Case {
    with_attentions("llama", |op| {
        if let Op::Attention { causal, .. } = op {
            *causal = false;
        }
    })
}

/// A non-causal attention's ring blocks are wholly visible on every rank
/// (`ring_steps::ring_block_wholly_visible`), so its steps attend and differentiate
/// without a keep-mask (the fused kernels' form): no positions, masks or mask operands
/// in the lowered ring; and the logits, loss and every gradient still equal the
/// unsharded model's, on cp=2, cp=4 and sp=2 x cp=2.
#[test]
fn a_non_causal_ring_runs_unmasked() {
    for mesh in ["cp=2", "cp=4", "cp=2,sp=2"] {
        let g = check_case("llama (non-causal)", non_causal_case(), mesh, false);
        let (tg, _) = training_step(&non_causal_case().graph, mesh, &TrainOptions::default())
            .unwrap_or_else(|e| panic!("{mesh}: {e}"));
        assert_unmasked_blocks(mesh, "forward", &g);
        assert_unmasked_blocks(mesh, "training", &tg);
    }
}

/// The attentions and attention gradients `ring-lower` wrote into `g` take no
/// keep-mask, none is built, and there is at least one.
fn assert_unmasked_blocks(mesh: &str, what: &str, g: &weft_ir::Graph) {
    let mut blocks = 0;
    for &n in g.nodes() {
        let d = g.node(n);
        if d.meta
            .provenance
            .as_ref()
            .is_none_or(|p| p.pass != "ring-lower")
        {
            continue;
        }
        match &d.op {
            Op::Attention { .. } => {
                assert_eq!(d.operands.len(), 3, "{mesh} {what}: a masked block");
                blocks += 1;
            }
            Op::AttentionBlockGrad { .. } => {
                assert_eq!(d.operands.len(), 6, "{mesh} {what}: a masked gradient");
                blocks += 1;
            }
            Op::Compare { .. } | Op::Arange { .. } => {
                panic!("{mesh} {what}: a keep-mask is built: {}", g.describe(n))
            }
            _ => {}
        }
    }
    assert!(blocks > 0, "{mesh} {what}: no ring block");
}

/// The training step of case `c` on cp=4 (the sequence length known or not) and its
/// text.
fn cp4_training_step(c: &Case, seq: Option<i64>) -> (weft_ir::Graph, String) {
    let opts = TrainOptions {
        seq,
        ..Default::default()
    };
    let (g, _) = training_step(&c.graph, "cp=4", &opts).unwrap();
    let text = g.to_string();
    (g, text)
}

/// The lines of layer 0's attention that `ring-lower` wrote.
fn layer0_ring_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| l.contains("model.layers.0.self_attn") && l.contains("<- ring-lower:"))
        .collect()
}

/// Pins the text of layer 0's windowed ring (2-key window, cp=4, 16 tokens) in the
/// training step: one step of the forward ring and one of the reverse ring, forward
/// and backward, each `ring_shift` naming its bytes and the compute it overlaps.
#[test]
fn window_ring_snapshot() {
    let c = narrow_window_case();
    let (_, text) = cp4_training_step(&c, Some(16));
    let ring = layer0_ring_lines(&text);
    for l in ring.iter().filter(|l| l.contains("= ring_shift")) {
        assert!(l.contains("; overlaps "), "{l}");
    }
    insta::assert_snapshot!(ring.join("\n"));
}

/// Per layer and rank, the ring moves `cp-1` k blocks and `cp-1` v blocks forward, and
/// in the backward the same k/v blocks again plus as many dk/dv accumulators (the
/// explicit ring backward re-sends k/v rather than keeping the forward's):
/// `6 (cp-1) x B x Nkv x S/cp x D x bytes`. With
/// Ulysses inside, each of q, k, v and the output goes through one all_to_all forward
/// and one backward (kv heads repeated `sp / gcd(Nkv, sp)` times when they do not split).
#[test]
fn ring_communication_volume_is_the_analytic_figure() {
    // llama fixture: 4 q heads, 2 kv heads, head dim 8, f32.
    let (b, s, nq, nkv, d, bytes) = (2i64, 16i64, 4i64, 2i64, 8i64, 4i64);
    for cp in [2i64, 4] {
        let (steps, moved) = layer0_bytes("llama", &format!("cp={cp}"), "ring_shift", b, s);
        assert_eq!(steps as i64, 6 * (cp - 1), "cp={cp}");
        assert_eq!(
            moved,
            6 * (cp - 1) * b * nkv * (s / cp) * d * bytes,
            "cp={cp}"
        );
    }
    // cp=2,sp=2: the ring carries the cp portion (S/cp tokens) for Nkv/sp heads.
    let (cp, sp) = (2i64, 2i64);
    let (_, moved) = layer0_bytes("llama", "cp=2,sp=2", "ring_shift", b, s);
    assert_eq!(moved, 6 * (cp - 1) * b * (nkv / sp) * (s / cp) * d * bytes);
    let (n, moved) = layer0_bytes("llama", "cp=2,sp=2", "all_to_all", b, s);
    assert_eq!(n, 8);
    let local = b * (s / cp / sp) * d * bytes;
    assert_eq!(moved, 2 * (nq * local + 2 * nkv * local + nq * local));
    // One kv head over sp=2: repeated twice before the all_to_all.
    let (_, moved) = layer0_bytes("llama_kv1", "cp=2,sp=2", "all_to_all", b, s);
    assert_eq!(moved, 2 * (nq * local + 2 * 2 * local + nq * local));
}

/// Pins the text of layer 0's ring on cp=4 in the training step: the forward's ring
/// steps and the transposed ring of the backward (k/v re-sent, per-block
/// `attention_block_grad` from the merged out and lse, dk/dv accumulators shifted with
/// their blocks and home at the end), every node `ring-lower` made for it.
#[test]
fn ring_backward_snapshot() {
    let c = case("llama");
    let (g, _) = training_step(&c.graph, "cp=4", &TrainOptions::default()).unwrap();
    let text = g.to_string();
    let ring: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("model.layers.0.self_attn") && l.contains("<- ring-lower:"))
        .collect();
    let shifts = |backward: bool| {
        ring.iter()
            .filter(|l| l.contains("= ring_shift") && l.contains("backward of") == backward)
            .count()
    };
    // cp-1 steps: k and v forward; k, v and the dk/dv accumulators backward.
    assert_eq!(
        (shifts(false), shifts(true)),
        (6, 12),
        "{}",
        ring.join("\n")
    );
    insta::assert_snapshot!(ring.join("\n"));
}

/// The analytic model's view of a preset (as `weft plan` builds it).
fn shape_of(model: &weft_frontends::Model) -> weft_passes::search::ModelShape {
    let c = model.config.as_ref().expect("a preset has a config");
    weft_passes::search::ModelShape {
        name: model.name.clone(),
        layers: c.num_hidden_layers as u64,
        hidden: c.hidden_size as u64,
        heads: c.num_attention_heads as u64,
        kv_heads: c.num_key_value_heads as u64,
        head_dim: c.head_dim as u64,
        ffn: c.intermediate_size as u64,
        vocab: c.vocab_size as u64,
        moe_layers: 0,
        experts: 0,
        top_k: 0,
        expert_ffn: 0,
        tied: c.tie_word_embeddings,
        param_bytes: model.param_dtype.size_bytes(),
        layer_windows: Vec::new(),
        single_norms: c.norm_placement != weft_frontends::config::NormPlacement::Sandwich,
        logit_softcap: c.final_softcap.is_some(),
        expert_saved: 3,
    }
}

/// Compiled and analytic peak per rank of a llama3.2-1b training step (AdamW, batch 1,
/// 64k tokens, 8 ranks, no ZeRO, recomputation or offload) on `mesh`.
fn peaks(mesh: &str) -> (f64, f64) {
    let model = weft_frontends::load("llama3.2-1b").unwrap();
    let (seq, batch) = (65536i64, 1i64);
    let m = Mesh::parse(mesh).unwrap();
    let mut req = weft_passes::driver::Request::new(model.graph.clone(), m.clone());
    req.batch = Some(batch);
    req.seq = Some(seq);
    req.plan = true;
    // As `weft plan` compiles a candidate: AdamW, no logits output.
    let opts = TrainOptions {
        optimizer: Some(weft_passes::training::Optimizer::adamw(1e-4)),
        grad_outputs: false,
        batch: Some(batch),
        seq: Some(seq),
        ..Default::default()
    };
    let e = weft_passes::driver::evaluate(&req, &opts).unwrap_or_else(|e| panic!("{mesh}: {e}"));
    let spec = weft_passes::search::SearchSpec {
        gpus: m.world_size(),
        gpus_per_node: 8,
        seq: seq as u64,
        batch: batch as u64,
        device: req.device.clone(),
        device_memory: req.memory_limit(),
        host_memory: req.host_memory,
        peak_flops: 989e12,
        grad_outputs: false,
    };
    // As compiled: no checkpointing, the fused loss (TrainOptions' default).
    let c = weft_passes::search::Candidate {
        cp: m.size_or_one("cp"),
        sp: m.size_or_one("sp"),
        ..Default::default()
    };
    let a = weft_passes::search::score(&shape_of(&model), &spec, &c);
    (e.peak_bytes as f64, a.memory.total as f64)
}

/// The compiled ring keeps what the analytic model says: with the same tokens per rank,
/// a cp plan's compiled peak is within 10% of the Ulysses (sp) plan's, and its
/// compiled/analytic ratio within 10% of the sp plan's (the analytic model's other
/// terms, shared by both, are what the ratio measures). Before the explicit ring
/// backward the cp plan needed 1.4-3.4x its analytic peak.
#[test]
fn compiled_ring_peak_follows_the_analytic_model() {
    let (cp_compiled, cp_analytic) = peaks("cp=8");
    let (sp_compiled, sp_analytic) = peaks("sp=8");
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let what = format!(
        "cp=8: compiled {:.2} GiB, analytic {:.2} GiB; sp=8: compiled {:.2} GiB, analytic {:.2} GiB",
        gib(cp_compiled),
        gib(cp_analytic),
        gib(sp_compiled),
        gib(sp_analytic)
    );
    assert!((cp_compiled / sp_compiled - 1.0).abs() < 0.10, "{what}");
    let ratio = (cp_compiled / cp_analytic) / (sp_compiled / sp_analytic);
    assert!((ratio - 1.0).abs() < 0.10, "{what}");
    eprintln!("{what}");
}

/// gemma2 (soft-capped attention, a 4-key window on layer 0, (1 + w) norms, a scaled
/// and tied embedding with a padding row) through the ring: logits, loss and every
/// gradient equal the unsharded model's.
#[test]
fn gemma2_cp2_cp4() {
    check("gemma2", "cp=2", false);
    check("gemma2", "cp=4", false);
}

/// `weft inspect --explain` shows each step of the windowed ring (mistral_sw4 at 64
/// tokens on cp=4: one step of the forward ring and one of the reverse ring) with its
/// bytes and the compute it overlaps.
#[test]
fn inspect_explain_shows_each_windowed_ring_step() {
    let dir = std::env::temp_dir().join(format!("weft-cp-explain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let plan = plan.to_str().unwrap();
    let (code, _, err) = weft(&[
        "compile",
        "tests/fixtures/mistral_sw4",
        "--mesh",
        "cp=4",
        "--seq",
        "64",
        "--batch",
        "2",
        "-o",
        plan,
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = weft(&["inspect", plan, "--explain"]);
    assert_eq!(code, 0, "{err}");
    let steps: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("ring_shift") && l.contains("[model.layers.0.self_attn]"))
        .collect();
    // forward: k and v each way; backward: the same, and each ring's dk/dv home
    assert_eq!(steps.len(), 4 + 8, "{out}");
    for l in &steps {
        assert!(
            l.contains("bytes per rank; overlaps ") && l.contains("KiB"),
            "{l}"
        );
    }
    let reverse = steps
        .iter()
        .filter(|l| l.contains("reverse ring step 1/1"))
        .count();
    assert_eq!(reverse, 4, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft check` at 64 tokens on cp=4 (mistral_sw4's 4-key window: one step of each
/// ring) matches the unsharded model, forward-only and as a training step, and gemma2
/// (soft-caps, a windowed and a full layer) too.
#[test]
fn weft_check_runs_the_early_stopped_ring() {
    for (model, extra) in [
        ("tests/fixtures/mistral_sw4", &[][..]),
        ("tests/fixtures/mistral_sw4", &["--train"][..]),
        ("tests/fixtures/gemma2", &["--train"][..]),
    ] {
        let mut args = vec!["check", model, "--mesh", "cp=4", "--seq", "64", "--json"];
        args.extend_from_slice(extra);
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{model} {extra:?}: {out}{err}");
        assert_eq!(json(&out)["ok"], true, "{model} {extra:?}: {out}");
    }
}

/// Training options that lower context parallelism to the all-gather variant.
fn allgather() -> TrainOptions {
    TrainOptions {
        cp_kv: CpKv::AllGather,
        ..Default::default()
    }
}

/// Fixture `name` on `mesh` with `--cp-kv allgather`: the forward program (logits, loss
/// and the gradients of running it) and the training step (loss and every `grad.*`)
/// match the unsharded model; neither holds a ring step.
fn check_allgather(name: &str, mesh: &str) {
    check_allgather_case(name, case(name), mesh);
}

/// [`check_allgather`] of case `c`; returns the forward program and the training step.
fn check_allgather_case(name: &str, c: Case, mesh: &str) -> (weft_ir::Graph, weft_ir::Graph) {
    let reference = execute(&c.graph, &c, true);
    let mut cx = PassContext::new(Mesh::parse(mesh).unwrap());
    cx.options.train = allgather();
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    for pass in default_pipeline(&cx.mesh) {
        lookup(pass)
            .unwrap()
            .run(&mut g, &cx)
            .unwrap_or_else(|e| panic!("{name} {mesh} allgather: {e}"));
    }
    weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} allgather: {r}"));
    let text = g.to_string();
    assert!(!text.contains("ring_shift"), "a ring step is left:\n{text}");
    assert!(
        !text.contains("ring_attention"),
        "a ring op is left:\n{text}"
    );
    let got = execute(&g, &c, true);
    compare(
        &format!("{name} on {mesh}, cp-kv allgather"),
        &reference,
        &got,
    );
    let tg = check_training(name, mesh, &c, &reference, allgather());
    let text = tg.to_string();
    assert!(!text.contains("ring_shift"), "a ring step is left:\n{text}");
    (g, tg)
}

/// Non-causal attention through the all-gather variant: every key is visible, so the
/// attention against the gathered k/v and its gradient run without a keep-mask.
#[test]
fn a_non_causal_allgather_runs_unmasked() {
    for mesh in ["cp=2", "cp=4"] {
        let (g, tg) = check_allgather_case("llama (non-causal)", non_causal_case(), mesh);
        assert_unmasked_blocks(mesh, "forward", &g);
        assert_unmasked_blocks(mesh, "training", &tg);
    }
}

#[test]
fn allgather_cp_matches_the_unsharded_model() {
    check_allgather("llama", "cp=2");
    check_allgather("llama", "cp=4");
    check_allgather("llama", "sp=2,cp=2");
    check_allgather("llama_kv1", "cp=4");
}

#[test]
fn allgather_cp_sliding_window_matches_the_unsharded_model() {
    // A 4-key window: the mask from global positions cuts the gathered sequence.
    check_allgather("mistral_sw4", "cp=2");
    check_allgather("mistral_sw4", "cp=4");
    check_allgather("gemma2", "cp=2");
}

#[test]
fn recomputed_allgather_cp_keeps_the_gradients() {
    for policy in [CheckpointPolicy::Full, CheckpointPolicy::Selective] {
        for (name, mesh) in [("llama", "cp=2"), ("mistral_sw4", "cp=4")] {
            let c = case(name);
            let reference = execute(&c.graph, &c, true);
            let opts = TrainOptions {
                checkpoint: policy.clone(),
                ..allgather()
            };
            check_training(name, mesh, &c, &reference, opts);
        }
    }
}

/// With `--cp-kv allgather` a layer's attention moves k and v by one all_gather each
/// forward, gathers them again in the backward and reduce-scatters dk and dv home: per
/// layer and rank `2 kv` sent forward, `2 kv` gathered and `2 cp kv` reduce-scattered
/// (the whole sequence's dk, dv) backward, with `kv = B x Nkv x S/cp x D` elements.
#[test]
fn allgather_cp_collectives_are_one_per_tensor_and_layer() {
    // llama fixture: 2 kv heads, head dim 8, f32.
    let (b, s, nkv, d, bytes) = (2i64, 16i64, 2i64, 8i64, 4i64);
    let c = case("llama");
    for cp in [2i64, 4] {
        let mesh = format!("cp={cp}");
        let kv = b * nkv * (s / cp) * d * bytes;
        let split = |op: &str| layer0_bytes_split(&c, &mesh, op, b, s, &allgather());
        assert_eq!(split("all_gather"), ((2, 2 * kv), (2, 2 * kv)), "{mesh}");
        assert_eq!(
            split("reduce_scatter"),
            ((0, 0), (2, 2 * cp * kv)),
            "{mesh}"
        );
        assert_eq!(split("ring_shift"), ((0, 0), (0, 0)), "{mesh}");
    }
}

/// Pins the text of layer 0's all-gather lowering on cp=2 in the training step: the
/// gathers of k and v, the keep-mask from global positions, the one attention and the
/// one gradient against the whole sequence, the reduce_scatters of dk and dv, each
/// collective's reason naming the variant and its bytes.
#[test]
fn allgather_cp_snapshot() {
    let c = case("llama");
    let (g, _) = training_step(&c.graph, "cp=2", &allgather()).unwrap();
    let text = g.to_string();
    let lowered: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("model.layers.0.self_attn") && l.contains("<- ring-lower:"))
        .collect();
    for l in lowered
        .iter()
        .filter(|l| l.contains("= all_gather") || l.contains("= reduce_scatter"))
    {
        assert!(
            l.contains("cp k/v all-gather") && l.contains(" bytes per rank"),
            "{l}"
        );
    }
    insta::assert_snapshot!(lowered.join("\n"));
}

/// `weft check --cp-kv allgather` runs the all-gather variant as a training step and
/// forward-only; an unknown value is refused by name.
#[test]
fn weft_check_runs_the_allgather_variant() {
    for extra in [&["--train"][..], &[][..]] {
        let mut args = vec![
            "check",
            "tests/fixtures/llama",
            "--mesh",
            "cp=2",
            "--cp-kv",
            "allgather",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{extra:?}: {out}{err}");
        assert_eq!(json(&out)["ok"], true, "{extra:?}: {out}");
    }
    let (code, out, err) = weft(&[
        "check",
        "tests/fixtures/llama",
        "--mesh",
        "cp=2",
        "--cp-kv",
        "gather",
    ]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("--cp-kv") && err.contains("gather"), "{err}");
    // Without a ring there is nothing for the option to choose: refused by name.
    let (code, out, err) = weft(&[
        "check",
        "tests/fixtures/llama",
        "--mesh",
        "sp=2",
        "--cp-kv",
        "allgather",
    ]);
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("--cp-kv allgather") && err.contains("no cp axis"),
        "{err}"
    );
}

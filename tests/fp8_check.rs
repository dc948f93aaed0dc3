//! `fp8` (`--fp8`) on the CPU reference runtime:
//! - `fp8_matmul` is the matmul of its operands quantized exactly as `weft_ir::fp8`
//!   defines (per-tensor power-of-two scale from the f32 amax, round to nearest even,
//!   saturating), checked against that definition computed here element by element;
//! - the pass turns every linear but the lm_head (and MoE routers) into an e4m3
//!   `fp8_matmul`, whose backward is two `fp8_matmul`s with e5m2 gradients;
//! - the FP8 step stays within FP8 error of the full-precision model (the unsharded
//!   reference, candle's autograd in f64) and is not equal to it, alone and on tp=2,
//!   sp=2 and dp=2 (each rank scales its own shard, so meshes agree to FP8 error too).

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_ir::{DType, Fp8Format, Graph, HostTensor, Op};
use weft_passes::training::TrainOptions;
use weft_runtime::cpu::{run, Precision, RunOptions};

fn quantized(v: &[f64], f: Fp8Format) -> Vec<f64> {
    let amax = v.iter().fold(0f32, |m, &x| m.max((x as f32).abs()));
    let e = f.scale_exp(amax);
    v.iter()
        .map(|&x| f.quantize_dequantize(x as f32, e) as f64)
        .collect()
}

/// `a [m, k] @ b [k, n]` (row-major) in f64.
fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                c[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    c
}

fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    (0..c * r).map(|i| a[(i % r) * c + i / r]).collect()
}

fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            ((4.0 * u - 2.0) * scale) as f32 as f64
        })
        .collect()
}

#[test]
fn fp8_matmul_is_the_matmul_of_the_quantized_operands() {
    let (m, k, n) = (6, 20, 7);
    for (ta, tb, fa, fb, scale) in [
        (false, true, Fp8Format::E4m3, Fp8Format::E4m3, 1.0),
        (false, false, Fp8Format::E5m2, Fp8Format::E4m3, 1e-5),
        (true, false, Fp8Format::E5m2, Fp8Format::E4m3, 3e3),
    ] {
        let (ash, bsh) = (
            if ta { [k, m] } else { [m, k] },
            if tb { [n, k] } else { [k, n] },
        );
        let text = format!(
            "graph \"t\"\n%0: f32[{}, {}] = param {{name=\"a\"}}\n%1: f32[{}, {}] = param {{name=\"b\"}}\n%2: f32[{m}, {n}] = fp8_matmul %0, %1 {{transpose_a={ta}, transpose_b={tb}, format_a={}, format_b={}}}\nreturn y=%2\n",
            ash[0], ash[1], bsh[0], bsh[1], fa.keyword(), fb.keyword()
        );
        let g = weft_ir::parse(&text).unwrap();
        let (a, b) = (values(m * k, 1, scale), values(k * n, 2, 1.0));
        let w = BTreeMap::from([
            (
                "a".to_string(),
                HostTensor::floats(DType::F32, ash.to_vec(), a.clone()),
            ),
            (
                "b".to_string(),
                HostTensor::floats(DType::F32, bsh.to_vec(), b.clone()),
            ),
        ]);
        let r = run(&g, &w, &BTreeMap::new(), &RunOptions::new(Precision::F64)).unwrap();
        let (qa, qb) = (quantized(&a, fa), quantized(&b, fb));
        let qa = if ta { transpose(&qa, k, m) } else { qa };
        let qb = if tb { transpose(&qb, n, k) } else { qb };
        let want = HostTensor::floats(DType::F32, vec![m, n], matmul(&qa, &qb, m, k, n));
        let e = rel_err(&r.outputs["y"], &want);
        assert!(e < 1e-12, "ta={ta} tb={tb}: rel err {e:e}");
        // And it is not the plain product: the operands were rounded.
        let plain = HostTensor::floats(
            DType::F32,
            vec![m, n],
            matmul(
                &if ta { transpose(&a, k, m) } else { a.clone() },
                &if tb { transpose(&b, n, k) } else { b.clone() },
                m,
                k,
                n,
            ),
        );
        assert!(rel_err(&r.outputs["y"], &plain) > 1e-4);
    }
}

fn opts() -> TrainOptions {
    TrainOptions {
        fp8: true,
        fused_loss: false,
        ..Default::default()
    }
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.nodes().iter().filter(|&&n| f(&g.node(n).op)).count()
}

#[test]
fn every_linear_but_the_lm_head_runs_in_fp8_forward_and_backward() {
    let (graph, ..) = load_fixture("llama");
    let layers = graph
        .params()
        .iter()
        .filter(|(p, _)| p.ends_with("mlp.down_proj.weight"))
        .count();
    let (g, report) = training_step(&graph, "", &opts()).unwrap();
    let fwd = |o: &Op| {
        matches!(
            o,
            Op::Fp8Matmul {
                format_a: Fp8Format::E4m3,
                format_b: Fp8Format::E4m3,
                ..
            }
        )
    };
    let bwd = |o: &Op| {
        matches!(
            o,
            Op::Fp8Matmul {
                format_a: Fp8Format::E5m2,
                ..
            } | Op::Fp8Matmul {
                format_b: Fp8Format::E5m2,
                ..
            }
        )
    };
    assert_eq!(count(&g, fwd), 7 * layers);
    assert_eq!(count(&g, bwd), 14 * layers);
    // The lm_head stays a linear (its gradients plain matmuls).
    assert_eq!(count(&g, |o| matches!(o, Op::Linear {})), 1);
    let stats = report.passes.iter().find(|p| p.pass == "fp8").unwrap();
    assert_eq!(stats.counters["linears"], 7 * layers as u64);
    assert_eq!(stats.counters["kept"], 1);
}

#[test]
fn the_routers_of_a_mixture_of_experts_stay_in_their_dtype() {
    let (graph, ..) = load_fixture("mixtral_aux");
    let (g, report) = training_step(&graph, "", &opts()).unwrap();
    let stats = report.passes.iter().find(|p| p.pass == "fp8").unwrap();
    let layers = graph
        .params()
        .iter()
        .filter(|(p, _)| p.ends_with("mlp.gate.weight"))
        .count();
    assert!(layers > 0);
    // The lm_head and one router a layer (its aux loss is a loss).
    assert_eq!(
        stats.counters["kept"],
        1 + layers as u64,
        "{:?}",
        stats.counters
    );
    assert!(count(&g, |o| matches!(o, Op::Fp8Matmul { .. })) > 0);
}

/// FP8 rounds every linear's operands by up to 6% (e4m3) and its gradients by up to 12%
/// (e5m2), and the errors add up along the layers: on the tiny fixture the gradients are
/// about 25% away from the full-precision model's as a set, but they point the same way
/// (cosine similarity >= 0.9 for every parameter) and the loss is within 1%. Exact
/// agreement is what `fp8_matmul_is_the_matmul_of_the_quantized_operands` checks.
#[test]
fn the_fp8_step_is_within_fp8_error_of_the_model_on_every_mesh() {
    let (graph, weights, inputs) = load_fixture_batch4("llama", |i, s| i % s == 3);
    let reference = reference_run(&graph, &weights, &inputs);
    for mesh in ["", "tp=2", "sp=2", "dp=2"] {
        let (g, _) = training_step(&graph, mesh, &opts()).unwrap();
        let r = run(&g, &weights, &inputs, &RunOptions::new(Precision::F64))
            .unwrap_or_else(|e| panic!("{mesh}: {e}"));
        let e = rel_err(&r.outputs["loss"], &reference.outputs["loss"]);
        assert!(e < 1e-2 && e > 1e-9, "{mesh}: loss rel err {e:e}");
        let (mut num, mut den) = (0.0, 0.0);
        for (p, want) in &reference.grads {
            let have = r.outputs[&format!("grad.{p}")].to_f64();
            let want = want.to_f64();
            let dot: f64 = have.iter().zip(&want).map(|(h, w)| h * w).sum();
            let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
            let cos = dot / (norm(&have) * norm(&want)).max(1e-300);
            assert!(cos > 0.9, "{mesh} {p}: cosine similarity {cos}");
            for (h, w) in have.iter().zip(&want) {
                num += (h - w) * (h - w);
                den += w * w;
            }
        }
        let e = (num / den).sqrt();
        assert!(e < 0.4 && e > 1e-6, "{mesh}: gradients rel err {e:e}");
    }
}

/// `weft check --fp8` compares the FP8 step with the full-precision model within FP8
/// error (it cannot equal it), and says so.
#[test]
fn check_holds_an_fp8_step_to_fp8_error_and_says_so() {
    for mesh in [None, Some("tp=2"), Some("sp=2")] {
        let mut args = vec!["check", "llama-tiny", "--train", "--fp8"];
        if let Some(m) = mesh {
            args.extend(["--mesh", m]);
        }
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{mesh:?}: {out}{err}");
        assert!(out.contains("--fp8: within FP8 rounding"), "{out}");
    }
}

/// Flags that would change nothing are refused by name: `--fp8` (or any training flag) on
/// a forward-only compile, `--warmup-steps` on a step without an optimizer.
#[test]
fn fp8_and_warmup_are_refused_where_they_would_do_nothing() {
    let (code, _, err) = weft(&["compile", "llama-tiny", "--forward-only", "--fp8"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--forward-only compiles no training step"),
        "{err}"
    );
    let (code, _, err) = weft(&[
        "run",
        "llama-tiny",
        "--forward-only",
        "--fp8",
        "--steps",
        "1",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--forward-only"), "{err}");
    let (code, _, err) = weft(&[
        "compile",
        "llama-tiny",
        "--optimizer",
        "none",
        "--warmup-steps",
        "3",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--warmup-steps 3") && err.contains("no optimizer"),
        "{err}"
    );
}

//! A hand-built Llama graph (the shape HF `LlamaForCausalLM` computes), optionally
//! data- and sequence-parallel (Ulysses: all_to_all heads <-> sequence around the
//! attention). Used to check the executor against the HF fixtures, for the parallel
//! gradient tests, and for the speed check.

use super::*;
use weft_ir::attrs::{Float, ReduceOp, Reduction, RopeScaling};
use weft_ir::Mesh;

#[derive(Clone, Debug)]
pub(super) struct Cfg {
    pub vocab: i64,
    pub hidden: i64,
    pub inter: i64,
    pub layers: usize,
    pub heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub eps: f64,
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Mesh axes: `dp` splits the batch, `sp` the sequence (Ulysses attention).
    pub dp: u32,
    pub sp: u32,
}

impl Cfg {
    pub(super) fn tiny() -> Cfg {
        Cfg {
            vocab: 11,
            hidden: 8,
            inter: 12,
            layers: 1,
            heads: 4,
            kv_heads: 2,
            head_dim: 2,
            eps: 1e-6,
            theta: 1e4,
            scaling: RopeScaling::Llama3 {
                factor: Float(8.0),
                low_freq_factor: Float(1.0),
                high_freq_factor: Float(4.0),
                original_max_position_embeddings: 4,
            },
            dp: 1,
            sp: 1,
        }
    }

    /// `(name, shape)` of every param, in HF order.
    pub(super) fn params(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v) = (
            self.hidden as usize,
            self.inter as usize,
            self.vocab as usize,
        );
        let (q, kv) = (
            (self.heads * self.head_dim) as usize,
            (self.kv_heads * self.head_dim) as usize,
        );
        let mut p = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..self.layers {
            let pre = format!("model.layers.{l}");
            p.push((format!("{pre}.self_attn.q_proj.weight"), vec![q, h]));
            p.push((format!("{pre}.self_attn.k_proj.weight"), vec![kv, h]));
            p.push((format!("{pre}.self_attn.v_proj.weight"), vec![kv, h]));
            p.push((format!("{pre}.self_attn.o_proj.weight"), vec![h, q]));
            p.push((format!("{pre}.mlp.gate_proj.weight"), vec![i, h]));
            p.push((format!("{pre}.mlp.up_proj.weight"), vec![i, h]));
            p.push((format!("{pre}.mlp.down_proj.weight"), vec![h, i]));
            p.push((format!("{pre}.input_layernorm.weight"), vec![h]));
            p.push((format!("{pre}.post_attention_layernorm.weight"), vec![h]));
        }
        p.push(("model.norm.weight".to_string(), vec![h]));
        p.push(("lm_head.weight".to_string(), vec![v, h]));
        p
    }

    pub(super) fn random_weights(&self, seed: u64) -> BTreeMap<String, HostTensor> {
        let mut rng = Rng::new(seed);
        self.params()
            .into_iter()
            .map(|(n, s)| {
                let numel = s.iter().product();
                let data = if n.ends_with("norm.weight") {
                    rng.vec(numel, 0.1).into_iter().map(|v| 1.0 + v).collect()
                } else {
                    rng.vec(numel, 0.3)
                };
                (n, hf(&s, data))
            })
            .collect()
    }
}

pub(super) fn random_inputs(
    cfg: &Cfg,
    b: usize,
    s: usize,
    seed: u64,
) -> BTreeMap<String, HostTensor> {
    let mut rng = Rng::new(seed);
    let ids: Vec<i64> = (0..b * s).map(|_| rng.below(cfg.vocab as u64)).collect();
    let mut labels = ids.clone();
    for (i, l) in labels.iter_mut().enumerate() {
        if i % 7 == 3 {
            *l = -100;
        }
    }
    map(vec![
        ("input_ids", hi(&[b, s], ids)),
        ("labels", hi(&[b, s], labels)),
    ])
}

pub(super) fn build(cfg: &Cfg) -> Graph {
    let mut g = Graph::new("llama");
    let mut axes = Vec::new();
    if cfg.dp > 1 {
        axes.push(("dp", cfg.dp));
    }
    if cfg.sp > 1 {
        axes.push(("sp", cfg.sp));
    }
    g.mesh = Mesh::new(&axes);
    let (bsym, ssym) = (Dim::sym("B"), Dim::sym("S"));
    let dp = if cfg.dp > 1 {
        Dim::sym("dp")
    } else {
        Dim::from(1)
    };
    let sp = if cfg.sp > 1 {
        Dim::sym("sp")
    } else {
        Dim::from(1)
    };
    let (bl, sl) = (bsym.clone() / dp.clone(), ssym.clone() / sp.clone());
    let d = |x: i64| Dim::from(x);
    let ity2 = TensorType::new(DType::I64, vec![bsym.clone(), ssym.clone()]);
    let ids = input_role(&mut g, "input_ids", Role::InputIds, ity2.clone());
    let labels = input_role(&mut g, "labels", Role::Labels, ity2);
    let shifted = g
        .add(Op::ShiftLabels { ignore_index: -100 }, &[labels])
        .unwrap();
    let count = g
        .add(Op::CountValid { ignore_index: -100 }, &[shifted])
        .unwrap();
    // This rank's block: batch by @dp, sequence by @sp.
    let local = |g: &mut Graph, v: Value| -> Value {
        let mut v = v;
        if cfg.dp > 1 {
            v = g
                .add(
                    Op::Slice {
                        dim: 0,
                        start: Dim::coord("dp") * bl.clone(),
                        len: bl.clone(),
                    },
                    &[v],
                )
                .unwrap();
        }
        if cfg.sp > 1 {
            v = g
                .add(
                    Op::Slice {
                        dim: 1,
                        start: Dim::coord("sp") * sl.clone(),
                        len: sl.clone(),
                    },
                    &[v],
                )
                .unwrap();
        }
        v
    };
    let ids_l = local(&mut g, ids);
    let lab_l = local(&mut g, shifted);
    let pos = g
        .add(
            Op::Arange {
                start: d(0),
                ty: TensorType::new(DType::I64, vec![ssym.clone()]),
            },
            &[],
        )
        .unwrap();
    let mut pos = g
        .add(
            Op::Reshape {
                shape: vec![d(1), ssym.clone()],
            },
            &[pos],
        )
        .unwrap();
    if cfg.sp > 1 {
        pos = g
            .add(
                Op::Slice {
                    dim: 1,
                    start: Dim::coord("sp") * sl.clone(),
                    len: sl.clone(),
                },
                &[pos],
            )
            .unwrap();
    }
    let cs = g
        .add_multi(
            Op::RopeTable {
                theta: Float(cfg.theta),
                dim: cfg.head_dim,
                scaling: cfg.scaling,
            },
            &[pos],
        )
        .unwrap();
    let (cos, sin) = (cs[0], cs[1]);
    let pm = |g: &mut Graph, name: String, shape: &[i64]| param(g, &name, fty(shape));
    let (h, hd) = (cfg.hidden, cfg.head_dim);
    let emb = pm(&mut g, "model.embed_tokens.weight".into(), &[cfg.vocab, h]);
    let mut x = g
        .add(Op::Embedding { padding_idx: None }, &[ids_l, emb])
        .unwrap();
    let heads = |g: &mut Graph, t: Value, n: i64| -> Value {
        let r = g
            .add(
                Op::Reshape {
                    shape: vec![bl.clone(), sl.clone(), d(n), d(hd)],
                },
                &[t],
            )
            .unwrap();
        g.add(Op::Transpose { dim0: 1, dim1: 2 }, &[r]).unwrap()
    };
    for l in 0..cfg.layers {
        let pre = format!("model.layers.{l}");
        g.set_scope(Some(&format!("{pre}.self_attn")));
        let ln1 = pm(&mut g, format!("{pre}.input_layernorm.weight"), &[h]);
        let hn = g
            .add(
                Op::RmsNorm {
                    eps: Float(cfg.eps),
                },
                &[x, ln1],
            )
            .unwrap();
        let wq = pm(
            &mut g,
            format!("{pre}.self_attn.q_proj.weight"),
            &[cfg.heads * hd, h],
        );
        let wk = pm(
            &mut g,
            format!("{pre}.self_attn.k_proj.weight"),
            &[cfg.kv_heads * hd, h],
        );
        let wv = pm(
            &mut g,
            format!("{pre}.self_attn.v_proj.weight"),
            &[cfg.kv_heads * hd, h],
        );
        let wo = pm(
            &mut g,
            format!("{pre}.self_attn.o_proj.weight"),
            &[h, cfg.heads * hd],
        );
        let q = g.add(Op::Linear {}, &[hn, wq]).unwrap();
        let k = g.add(Op::Linear {}, &[hn, wk]).unwrap();
        let v = g.add(Op::Linear {}, &[hn, wv]).unwrap();
        let q = heads(&mut g, q, cfg.heads);
        let k = heads(&mut g, k, cfg.kv_heads);
        let mut v = heads(&mut g, v, cfg.kv_heads);
        let mut q = g
            .add(
                Op::Rope {
                    layout: weft_ir::HeadLayout::Bhsd,
                },
                &[q, cos, sin],
            )
            .unwrap();
        let mut k = g
            .add(
                Op::Rope {
                    layout: weft_ir::HeadLayout::Bhsd,
                },
                &[k, cos, sin],
            )
            .unwrap();
        if cfg.sp > 1 {
            // Ulysses: trade the sequence split for a head split.
            for t in [&mut q, &mut k, &mut v] {
                *t = g
                    .add(
                        Op::AllToAll {
                            axis: "sp".into(),
                            scatter_dim: 1,
                            gather_dim: 2,
                        },
                        &[*t],
                    )
                    .unwrap();
            }
        }
        let scale = 1.0 / (hd as f64).sqrt();
        let mut a = g
            .add(
                Op::Attention {
                    layout: weft_ir::HeadLayout::Bhsd,
                    causal: true,
                    scale: Float(scale),
                    window: None,
                    softcap: None,
                    sinks: Default::default(),
                    lse: Default::default(),
                },
                &[q, k, v],
            )
            .unwrap();
        if cfg.sp > 1 {
            a = g
                .add(
                    Op::AllToAll {
                        axis: "sp".into(),
                        scatter_dim: 2,
                        gather_dim: 1,
                    },
                    &[a],
                )
                .unwrap();
        }
        let a = g.add(Op::Transpose { dim0: 1, dim1: 2 }, &[a]).unwrap();
        let a = g
            .add(
                Op::Reshape {
                    shape: vec![bl.clone(), sl.clone(), d(cfg.heads * hd)],
                },
                &[a],
            )
            .unwrap();
        let o = g.add(Op::Linear {}, &[a, wo]).unwrap();
        x = g.add(Op::Add {}, &[x, o]).unwrap();
        g.set_scope(Some(&format!("{pre}.mlp")));
        let ln2 = pm(
            &mut g,
            format!("{pre}.post_attention_layernorm.weight"),
            &[h],
        );
        let hn = g
            .add(
                Op::RmsNorm {
                    eps: Float(cfg.eps),
                },
                &[x, ln2],
            )
            .unwrap();
        let wg = pm(
            &mut g,
            format!("{pre}.mlp.gate_proj.weight"),
            &[cfg.inter, h],
        );
        let wu = pm(&mut g, format!("{pre}.mlp.up_proj.weight"), &[cfg.inter, h]);
        let wd = pm(
            &mut g,
            format!("{pre}.mlp.down_proj.weight"),
            &[h, cfg.inter],
        );
        let gt = g.add(Op::Linear {}, &[hn, wg]).unwrap();
        let gt = g.add(Op::Silu {}, &[gt]).unwrap();
        let up = g.add(Op::Linear {}, &[hn, wu]).unwrap();
        let m = g.add(Op::Mul {}, &[gt, up]).unwrap();
        let m = g.add(Op::Linear {}, &[m, wd]).unwrap();
        x = g.add(Op::Add {}, &[x, m]).unwrap();
    }
    g.set_scope(Some("model"));
    let nw = pm(&mut g, "model.norm.weight".into(), &[h]);
    let x = g
        .add(
            Op::RmsNorm {
                eps: Float(cfg.eps),
            },
            &[x, nw],
        )
        .unwrap();
    let head = pm(&mut g, "lm_head.weight".into(), &[cfg.vocab, h]);
    let logits = g.add(Op::Linear {}, &[x, head]).unwrap();
    g.set_scope(Some("loss"));
    let loss = if cfg.dp * cfg.sp == 1 {
        g.add(
            Op::CrossEntropy {
                ignore_index: -100,
                reduction: Reduction::Mean,
            },
            &[logits, lab_l],
        )
        .unwrap()
    } else {
        // The sum of every rank's token losses over the global number of targets.
        let mut s = g
            .add(
                Op::CrossEntropy {
                    ignore_index: -100,
                    reduction: Reduction::Sum,
                },
                &[logits, lab_l],
            )
            .unwrap();
        for (axis, n) in [("dp", cfg.dp), ("sp", cfg.sp)] {
            if n > 1 {
                s = g
                    .add(
                        Op::AllReduce {
                            axis: axis.into(),
                            op: ReduceOp::Sum,
                        },
                        &[s],
                    )
                    .unwrap();
            }
        }
        g.add(Op::Div {}, &[s, count]).unwrap()
    };
    g.set_output("logits", logits);
    g.set_output("loss", loss);
    if cfg.dp > 1 {
        g.add_output_split("logits", 0, "dp");
    }
    if cfg.sp > 1 {
        g.add_output_split("logits", 1, "sp");
    }
    g
}

// ---- HF fixtures ----

fn fixture_dir(name: &str) -> Option<std::path::PathBuf> {
    let d = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name);
    d.join("reference.safetensors").exists().then_some(d)
}

fn load(path: &std::path::Path) -> BTreeMap<String, HostTensor> {
    let ts = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    ts.into_iter()
        .map(|(k, t)| {
            let h = match t.dtype() {
                candle_core::DType::I64 => HostTensor::ints(
                    DType::I64,
                    t.dims().to_vec(),
                    t.flatten_all().unwrap().to_vec1().unwrap(),
                ),
                _ => HostTensor::floats(
                    DType::F32,
                    t.dims().to_vec(),
                    t.flatten_all()
                        .unwrap()
                        .to_dtype(candle_core::DType::F64)
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                ),
            };
            (k, h)
        })
        .collect()
}

fn cfg_of(dir: &std::path::Path) -> Cfg {
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let i = |k: &str| c[k].as_i64().unwrap();
    let rp = &c["rope_parameters"];
    let scaling = match rp["rope_type"].as_str().unwrap() {
        "llama3" => RopeScaling::Llama3 {
            factor: Float(rp["factor"].as_f64().unwrap()),
            low_freq_factor: Float(rp["low_freq_factor"].as_f64().unwrap()),
            high_freq_factor: Float(rp["high_freq_factor"].as_f64().unwrap()),
            original_max_position_embeddings: rp["original_max_position_embeddings"]
                .as_i64()
                .unwrap(),
        },
        "default" => RopeScaling::None,
        other => panic!("rope type {other}"),
    };
    Cfg {
        vocab: i("vocab_size"),
        hidden: i("hidden_size"),
        inter: i("intermediate_size"),
        layers: i("num_hidden_layers") as usize,
        heads: i("num_attention_heads"),
        kv_heads: i("num_key_value_heads"),
        head_dim: i("head_dim"),
        eps: c["rms_norm_eps"].as_f64().unwrap(),
        theta: rp["rope_theta"].as_f64().unwrap(),
        scaling,
        dp: 1,
        sp: 1,
    }
}

fn check_fixture(name: &str, mesh: Option<(u32, u32)>) {
    let Some(dir) = fixture_dir(name) else {
        eprintln!("fixture {name} not found; skipped");
        return;
    };
    let mut cfg = cfg_of(&dir);
    if let Some((dp, sp)) = mesh {
        cfg.dp = dp;
        cfg.sp = sp;
    }
    let g = build(&cfg);
    weft_ir::verify(&g).unwrap_or_else(|e| panic!("{e:?}"));
    let weights = load(&dir.join("model.safetensors"));
    let inputs = load(&dir.join("inputs.safetensors"));
    let reference = load(&dir.join("reference.safetensors"));
    for precision in [Precision::F64, Precision::F32] {
        let opts = RunOptions {
            grads: true,
            ..RunOptions::new(precision)
        };
        let r = run(&g, &weights, &inputs, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let tol = 5e-6;
        let e = weft_ir::tensor::max_rel_err(
            &r.outputs["logits"].to_f64(),
            &reference["logits"].to_f64(),
        );
        eprintln!("{name} {precision:?} mesh {mesh:?}: logits rel err {e:.2e}");
        assert!(e < tol, "{name} {precision:?}: logits differ by {e}");
        let e =
            weft_ir::tensor::max_rel_err(&r.outputs["loss"].to_f64(), &reference["loss"].to_f64());
        assert!(e < tol, "{name} {precision:?}: loss differs by {e}");
        let mut worst = 0.0f64;
        for (p, _) in cfg.params() {
            let want = reference[&format!("grad.{p}")].to_f64();
            let e = weft_ir::tensor::max_rel_err(&r.grads[&p].to_f64(), &want);
            worst = worst.max(e);
            assert!(e < 2e-5, "{name} {precision:?}: grad of {p} differs by {e}");
        }
        eprintln!("{name} {precision:?} mesh {mesh:?}: worst grad rel err {worst:.2e}");
    }
}

#[test]
fn hf_llama_llama3_rope() {
    check_fixture("llama", None);
}

#[test]
fn hf_llama_rope3_all_three_llama3_branches() {
    check_fixture("llama_rope3", None);
}

#[test]
fn hf_llama_one_kv_head() {
    check_fixture("llama_kv1", None);
}

#[test]
fn hf_llama_on_dp2_sp2_matches_the_reference() {
    // B=2, S=16, 4 heads, 2 kv heads: Ulysses over sp=2 and data parallel over dp=2.
    check_fixture("llama", Some((2, 2)));
}

/// The speed check: a 2-layer, 512-hidden Llama (8 heads, vocab 32000, intermediate
/// 1376) at batch 1, sequence 512, forward + backward in f32, weights and gradients
/// converted to and from host tensors included. Run with
/// `cargo test -p weft-runtime -- --ignored --nocapture speed_llama` (the dev profile
/// builds dependencies with opt-level 3, this crate at 1; `--release` builds it at 3 too)
/// with `RAYON_NUM_THREADS=THREADS`; `runtime/bench/torch_llama_512.py THREADS` times the
/// same model in PyTorch. On 2 Zen 5 cores (December 2026): 0.59-0.64 s release, 0.70 s
/// dev, PyTorch 0.50 s. `WEFT_TUNE_ALLOCATOR=1` calls [`crate::cpu::tune_allocator`].
#[test]
#[ignore]
fn speed_llama_512() {
    let cfg = Cfg {
        vocab: 32000,
        hidden: 512,
        inter: 1376,
        layers: 2,
        heads: 8,
        kv_heads: 8,
        head_dim: 64,
        eps: 1e-5,
        theta: 1e4,
        scaling: RopeScaling::None,
        dp: 1,
        sp: 1,
    };
    if std::env::var("WEFT_TUNE_ALLOCATOR").is_ok() {
        eprintln!("tune_allocator: {}", crate::cpu::tune_allocator());
    }
    let g = build(&cfg);
    let w = cfg.random_weights(7);
    let i = random_inputs(&cfg, 1, 512, 8);
    let opts = RunOptions {
        grads: true,
        ..RunOptions::new(Precision::F32)
    };
    for it in 0..3 {
        let t = std::time::Instant::now();
        let r = run(&g, &w, &i, &opts).unwrap();
        eprintln!(
            "run {it}: forward+backward {:.3}s, loss {}",
            t.elapsed().as_secs_f64(),
            r.outputs["loss"].to_f64()[0]
        );
        eprintln!("{}", r.profile.table());
    }
}

/// Matmul throughput at the speed check's shapes: the gemm crate (through candle) and
/// [`crate::cpu::sgemm`], the latter also with `b` transposed (as the linear forward reads
/// `w [N, K]`) and on one thread.
#[test]
#[ignore]
fn speed_gemm() {
    use candle_core::{Device, Tensor};
    // the best of 10 (the machine is shared)
    let time = |f: &mut dyn FnMut()| {
        f();
        (0..10)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    for (m, k, n) in [
        (512usize, 512usize, 512usize),
        (512, 512, 1376),
        (512, 512, 32000),
    ] {
        let gf = |s: f64| 2.0 * (m * k * n) as f64 / s / 1e9;
        let a = Tensor::ones((m, k), candle_core::DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::ones((k, n), candle_core::DType::F32, &Device::Cpu).unwrap();
        let s = time(&mut || drop(a.matmul(&b).unwrap()));
        eprintln!("gemm crate {m}x{k}x{n}: {:.4}s, {:.1} GFLOP/s", s, gf(s));
        let (av, bv) = (vec![1f32; m * k], vec![1f32; k * n]);
        let mut c = vec![0f32; m * n];
        for (what, bs, par) in [
            ("", (n, 1), true),
            (" b^T", (1, k), true),
            (" 1 thread", (n, 1), false),
        ] {
            let s = time(&mut || {
                crate::cpu::sgemm::sgemm(
                    (m, n, k),
                    1.0,
                    &av,
                    (k, 1),
                    &bv,
                    bs,
                    0.0,
                    &mut c,
                    (n, 1),
                    par,
                )
            });
            eprintln!(
                "sgemm{what} {m}x{k}x{n}: {:.4}s, {:.1} GFLOP/s (avx512: {})",
                s,
                gf(s),
                crate::cpu::sgemm::avx512()
            );
        }
    }
    // the lm_head's backward: dx = g @ w (k = vocab) and dw = g^T @ x (m = vocab, a^T)
    for (what, (m, k, n), a_s) in [
        ("dx", (512usize, 32000usize, 512usize), (32000usize, 1usize)),
        ("dw", (32000, 512, 512), (1, 32000)),
    ] {
        let (av, bv) = (vec![1f32; m * k], vec![1f32; k * n]);
        let mut c = vec![0f32; m * n];
        let s = time(&mut || {
            crate::cpu::sgemm::sgemm(
                (m, n, k),
                1.0,
                &av,
                a_s,
                &bv,
                (n, 1),
                0.0,
                &mut c,
                (n, 1),
                true,
            )
        });
        eprintln!(
            "sgemm lm_head {what} {m}x{k}x{n}: {:.4}s, {:.1} GFLOP/s",
            s,
            2.0 * (m * k * n) as f64 / s / 1e9
        );
    }
}

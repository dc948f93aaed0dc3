//! Gradients: candle autograd against central finite differences (f64), and the
//! gradient convention across ranks (backward from the replicated loss, replicas
//! summed) against the one-rank graph.

use super::llama::{build, random_inputs, Cfg};
use super::*;
use weft_ir::attrs::{Float, ReduceOp, Reduction};
use weft_ir::Mesh;

fn loss_of(g: &Graph, w: &BTreeMap<String, HostTensor>, i: &BTreeMap<String, HostTensor>) -> f64 {
    run64(g, w, i).outputs["loss"].to_f64()[0]
}

/// Compares autograd with central differences on up to `per_param` entries of each param.
fn check_fd(
    g: &Graph,
    w: &BTreeMap<String, HostTensor>,
    i: &BTreeMap<String, HostTensor>,
    per_param: usize,
    tol: f64,
) {
    let opts = RunOptions {
        grads: true,
        ..RunOptions::new(Precision::F64)
    };
    let r = run(g, w, i, &opts).unwrap_or_else(|e| panic!("{e}"));
    let eps = 1e-5;
    let mut rng = Rng::new(99);
    let mut checked = 0;
    for (name, t) in w {
        let grad = r.grads[name].to_f64();
        assert_eq!(grad.len(), t.numel());
        let picks: Vec<usize> = if t.numel() <= per_param {
            (0..t.numel()).collect()
        } else {
            (0..per_param)
                .map(|_| rng.below(t.numel() as u64) as usize)
                .collect()
        };
        for k in picks {
            let mut wp = w.clone();
            let mut wm = w.clone();
            let mut vp = t.to_f64();
            let mut vm = t.to_f64();
            vp[k] += eps;
            vm[k] -= eps;
            wp.insert(
                name.clone(),
                HostTensor::floats(t.dtype, t.shape.clone(), vp),
            );
            wm.insert(
                name.clone(),
                HostTensor::floats(t.dtype, t.shape.clone(), vm),
            );
            let fd = (loss_of(g, &wp, i) - loss_of(g, &wm, i)) / (2.0 * eps);
            let ad = grad[k];
            assert!(
                (fd - ad).abs() <= tol * (1.0 + fd.abs()),
                "d loss / d {name}[{k}]: autograd {ad}, finite differences {fd}"
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
}

#[test]
fn llama_grads_match_finite_differences() {
    let cfg = Cfg::tiny();
    let g = build(&cfg);
    check_fd(
        &g,
        &cfg.random_weights(1),
        &random_inputs(&cfg, 2, 5, 2),
        6,
        1e-6,
    );
}

#[test]
fn moe_and_misc_op_grads_match_finite_differences() {
    // router: softmax(x Wr^T) -> topk -> renormalized gates; experts: gelu(x W1[e]^T);
    // plus gather, scatter_add, index_select, where, maximum, mean, log_softmax, rope.
    let (t, h, e, k, n) = (6i64, 4i64, 3i64, 2i64, 5i64);
    let mut g = Graph::new("moe");
    let x = input(&mut g, "x", fty(&[t, h]));
    let wr = param(&mut g, "router", fty(&[e, h]));
    let w1 = param(&mut g, "w1", fty(&[e, n, h]));
    let bias = param(&mut g, "bias", fty(&[n]));
    let logits = g.add(Op::Linear {}, &[x, wr]).unwrap();
    let probs = g.add(Op::Softmax { dim: -1 }, &[logits]).unwrap();
    let tk = g.add_multi(Op::Topk { k, dim: 1 }, &[probs]).unwrap();
    let den = g
        .add(
            Op::Sum {
                dims: vec![1],
                keepdim: true,
            },
            &[tk[0]],
        )
        .unwrap();
    let gates = g.add(Op::Div {}, &[tk[0], den]).unwrap();
    let d = g
        .add_multi(Op::MoeDispatch { num_experts: e }, &[x, tk[1]])
        .unwrap();
    let y = g
        .add(
            Op::GroupedMatmul {
                transpose_w: Default::default(),
            },
            &[d[0], w1, d[1]],
        )
        .unwrap();
    let y = g.add(Op::Gelu { tanh_approx: false }, &[y]).unwrap();
    let y = g.add(Op::MoeCombine {}, &[y, d[2], gates]).unwrap();
    let y = g.add(Op::Add {}, &[y, bias]).unwrap();
    // misc
    let idx = input(&mut g, "idx", ity(&[t, 2]));
    let gathered = g.add(Op::Gather { dim: 1 }, &[y, idx]).unwrap();
    let zeros = g
        .add(
            Op::Full {
                value: Float(0.0),
                ty: fty(&[t, n]),
            },
            &[],
        )
        .unwrap();
    let sc = g
        .add(Op::ScatterAdd { dim: 1 }, &[y, idx, gathered])
        .unwrap();
    let sel = input(&mut g, "sel", ity(&[4]));
    let rows = g.add(Op::IndexSelect { dim: 0 }, &[sc, sel]).unwrap();
    let pos = g
        .add(
            Op::Compare {
                op: weft_ir::CmpOp::Gt,
            },
            &[y, zeros],
        )
        .unwrap();
    let wh = g.add(Op::Where {}, &[pos, y, zeros]).unwrap();
    let mx = g.add(Op::Maximum {}, &[wh, sc]).unwrap();
    let lsm = g.add(Op::LogSoftmax { dim: 1 }, &[mx]).unwrap();
    let m1 = g
        .add(
            Op::Mean {
                dims: vec![0, 1],
                keepdim: false,
            },
            &[lsm],
        )
        .unwrap();
    let m2 = g
        .add(
            Op::Mean {
                dims: vec![0, 1],
                keepdim: false,
            },
            &[rows],
        )
        .unwrap();
    let loss = g.add(Op::Sub {}, &[m2, m1]).unwrap();
    g.set_output("loss", loss);
    let mut rng = Rng::new(3);
    let w = map(vec![
        ("router", hf(&[3, 4], rng.vec(12, 1.0))),
        ("w1", hf(&[3, 5, 4], rng.vec(60, 1.0))),
        ("bias", hf(&[5], rng.vec(5, 0.5))),
    ]);
    let i = map(vec![
        ("x", hf(&[6, 4], rng.vec(24, 1.0))),
        ("idx", hi(&[6, 2], (0..12).map(|_| rng.below(5)).collect())),
        ("sel", hi(&[4], vec![5, 0, 0, 2])),
    ]);
    check_fd(&g, &w, &i, 100, 1e-6);
}

#[test]
fn data_parallel_grads_equal_the_one_rank_grads() {
    let base = Cfg::tiny();
    let dp = Cfg {
        dp: 2,
        ..base.clone()
    };
    let w = base.random_weights(11);
    let i = random_inputs(&base, 4, 6, 12);
    let opts = RunOptions {
        grads: true,
        keep_rank_outputs: true,
        ..RunOptions::new(Precision::F64)
    };
    let one = run(&build(&base), &w, &i, &opts).unwrap();
    let two = run(&build(&dp), &w, &i, &opts).unwrap();
    assert_close(
        &two.outputs["loss"].to_f64(),
        &one.outputs["loss"].to_f64(),
        1e-12,
    );
    assert_close(
        &two.outputs["logits"].to_f64(),
        &one.outputs["logits"].to_f64(),
        1e-12,
    );
    for (name, gw) in &one.grads {
        assert_close(&two.grads[name].to_f64(), &gw.to_f64(), 1e-10);
        // the convention: the full gradient is the sum of the two replicas' gradients,
        // and each replica only sees its own half of the batch.
        let r0 = two.rank_grads[0][name].to_f64();
        let r1 = two.rank_grads[1][name].to_f64();
        let sum: Vec<f64> = r0.iter().zip(&r1).map(|(a, b)| a + b).collect();
        assert_close(&sum, &gw.to_f64(), 1e-10);
    }
    assert_ne!(
        two.rank_grads[0]["lm_head.weight"],
        two.rank_grads[1]["lm_head.weight"]
    );
}

#[test]
fn ulysses_sequence_parallel_grads_equal_the_one_rank_grads() {
    // Gradients flow backward through all_to_all across the ranks.
    let base = Cfg {
        layers: 2,
        ..Cfg::tiny()
    };
    let w = base.random_weights(21);
    let i = random_inputs(&base, 2, 8, 22);
    let opts = RunOptions {
        grads: true,
        ..RunOptions::new(Precision::F64)
    };
    let one = run(&build(&base), &w, &i, &opts).unwrap();
    for (dp, sp) in [(1, 2), (2, 2)] {
        let par = Cfg {
            dp,
            sp,
            ..base.clone()
        };
        let r = run(&build(&par), &w, &i, &opts).unwrap();
        assert_close(
            &r.outputs["loss"].to_f64(),
            &one.outputs["loss"].to_f64(),
            1e-12,
        );
        assert_close(
            &r.outputs["logits"].to_f64(),
            &one.outputs["logits"].to_f64(),
            1e-12,
        );
        for (name, gw) in &one.grads {
            assert_close(&r.grads[name].to_f64(), &gw.to_f64(), 1e-10);
        }
    }
}

#[test]
fn split_params_get_their_piece_and_their_gradient_back_in_place() {
    // Column-parallel linear: w [4, 3] split on dim 0 over tp=2; y = all_gather(x w_r^T).
    let mut g = Graph::new("tp");
    g.mesh = Mesh::parse("tp=2").unwrap();
    let x = input(&mut g, "x", fty(&[2, 3]));
    let w = param(&mut g, "w", fty(&[2, 3]));
    let y = g.add(Op::Linear {}, &[x, w]).unwrap();
    let y = g
        .add(
            Op::AllGather {
                axis: "tp".into(),
                dim: 1,
            },
            &[y],
        )
        .unwrap();
    let sq = g.add(Op::Mul {}, &[y, y]).unwrap();
    let loss = g
        .add(
            Op::Sum {
                dims: vec![0, 1],
                keepdim: false,
            },
            &[sq],
        )
        .unwrap();
    g.set_output("y", y);
    g.set_output("loss", loss);
    let mut one = Graph::new("one");
    let x1 = input(&mut one, "x", fty(&[2, 3]));
    let w1 = param(&mut one, "w", fty(&[4, 3]));
    let y1 = one.add(Op::Linear {}, &[x1, w1]).unwrap();
    let sq1 = one.add(Op::Mul {}, &[y1, y1]).unwrap();
    let l1 = one
        .add(
            Op::Sum {
                dims: vec![0, 1],
                keepdim: false,
            },
            &[sq1],
        )
        .unwrap();
    one.set_output("y", y1);
    one.set_output("loss", l1);
    let mut rng = Rng::new(5);
    let wv = map(vec![("w", hf(&[4, 3], rng.vec(12, 1.0)))]);
    let iv = map(vec![("x", hf(&[2, 3], rng.vec(6, 1.0)))]);
    let mut opts = RunOptions {
        grads: true,
        ..RunOptions::new(Precision::F64)
    };
    let a = run(&one, &wv, &iv, &opts).unwrap();
    opts.param_splits.insert("w".into(), vec![(0, "tp".into())]);
    let b = run(&g, &wv, &iv, &opts).unwrap();
    assert_close(&b.outputs["y"].to_f64(), &a.outputs["y"].to_f64(), 1e-12);
    assert_close(&b.grads["w"].to_f64(), &a.grads["w"].to_f64(), 1e-12);
}

#[test]
fn all_reduce_avg_and_max_are_differentiable() {
    // loss = sum(avg_dp(x_r * w)) + max_dp(sum(x_r * w)) with x sliced by @dp
    let mut g = Graph::new("ar");
    g.mesh = Mesh::parse("dp=2").unwrap();
    let x = input(&mut g, "x", fty(&[4, 3]));
    let xs = g
        .add(
            Op::Slice {
                dim: 0,
                start: Dim::coord("dp") * 2,
                len: Dim::from(2),
            },
            &[x],
        )
        .unwrap();
    let w = param(&mut g, "w", fty(&[3]));
    let p = g.add(Op::Mul {}, &[xs, w]).unwrap();
    let avg = g
        .add(
            Op::AllReduce {
                axis: "dp".into(),
                op: ReduceOp::Avg,
            },
            &[p],
        )
        .unwrap();
    let s1 = g
        .add(
            Op::Sum {
                dims: vec![0, 1],
                keepdim: false,
            },
            &[avg],
        )
        .unwrap();
    let s2 = g
        .add(
            Op::Sum {
                dims: vec![0, 1],
                keepdim: false,
            },
            &[p],
        )
        .unwrap();
    let mx = g
        .add(
            Op::AllReduce {
                axis: "dp".into(),
                op: ReduceOp::Max,
            },
            &[s2],
        )
        .unwrap();
    let loss = g.add(Op::Add {}, &[s1, mx]).unwrap();
    g.set_output("loss", loss);
    let mut rng = Rng::new(8);
    check_fd(
        &g,
        &map(vec![("w", hf(&[3], rng.vec(3, 1.0)))]),
        &map(vec![("x", hf(&[4, 3], rng.vec(12, 1.0)))]),
        3,
        1e-6,
    );
}

#[test]
fn cross_entropy_gradient_by_hand() {
    // d mean-CE / d logits = (softmax - onehot) / count, 0 on ignored rows.
    let mut g = Graph::new("ce");
    let l = param(&mut g, "logits", fty(&[3, 2]));
    let y = input_role(&mut g, "labels", Role::Labels, ity(&[3]));
    let loss = g
        .add(
            Op::CrossEntropy {
                ignore_index: -100,
                reduction: Reduction::Mean,
            },
            &[l, y],
        )
        .unwrap();
    g.set_output("loss", loss);
    let logits = vec![0.0, 1.0, 2.0, 0.0, 0.5, 0.5];
    let r = run(
        &g,
        &map(vec![("logits", hf(&[3, 2], logits.clone()))]),
        &map(vec![("labels", hi(&[3], vec![1, -100, 0]))]),
        &RunOptions {
            grads: true,
            ..RunOptions::new(Precision::F64)
        },
    )
    .unwrap();
    let s = |a: f64, b: f64| (a.exp() / (a.exp() + b.exp()), b.exp() / (a.exp() + b.exp()));
    let (p0, p1) = s(0.0, 1.0);
    let want = vec![
        p0 / 2.0,
        (p1 - 1.0) / 2.0,
        0.0,
        0.0,
        (0.5 - 1.0) / 2.0,
        0.5 / 2.0,
    ];
    assert_close(&r.grads["logits"].to_f64(), &want, 1e-12);
}

/// `loss = sum(attention(q, k, v) * r)` with `q` a transposed (strided) view, over
/// several 64-row blocks, GQA, causal with `Sq != Sk`, and a keep-mask. (Rows that see no
/// key are left out: their probabilities are uniform only through rounding `s + min` to
/// `min`, so finite differences see no dependence on `s` while autograd, like HF's,
/// differentiates through the add.)
fn attention_loss_graph(sq: i64, sk: i64, causal: bool, with_mask: bool) -> Graph {
    let (nq, nkv, d) = (4i64, 2i64, 3i64);
    let mut g = Graph::new("attn");
    let q = param(&mut g, "q", fty(&[1, sq, nq, d]));
    let q = g.add(Op::Transpose { dim0: 1, dim1: 2 }, &[q]).unwrap();
    let k = param(&mut g, "k", fty(&[1, nkv, sk, d]));
    let v = param(&mut g, "v", fty(&[1, nkv, sk, d]));
    let mut ins = vec![q, k, v];
    if with_mask {
        ins.push(input(
            &mut g,
            "mask",
            TensorType::new(DType::Bool, dims(&[1, 1, sq, sk])),
        ));
    }
    let o = g
        .add(
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal,
                scale: Float(0.7),
                window: None,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            },
            &ins,
        )
        .unwrap();
    let r = input(&mut g, "r", fty(&[1, nq, sq, d]));
    let p = g.add(Op::Mul {}, &[o, r]).unwrap();
    let loss = g
        .add(
            Op::Sum {
                dims: vec![0, 1, 2, 3],
                keepdim: false,
            },
            &[p],
        )
        .unwrap();
    g.set_output("loss", loss);
    g
}

#[test]
fn attention_grads_over_many_row_blocks() {
    for (sq, sk, causal, with_mask) in [
        (150, 150, true, false),
        (70, 150, true, false),
        (130, 150, true, true),
        (90, 90, false, true),
    ] {
        let g = attention_loss_graph(sq, sk, causal, with_mask);
        let mut rng = Rng::new(sq as u64 * 7 + sk as u64);
        let (sq, sk) = (sq as usize, sk as usize);
        let w = map(vec![
            ("q", hf(&[1, sq, 4, 3], rng.vec(sq * 12, 1.0))),
            ("k", hf(&[1, 2, sk, 3], rng.vec(sk * 6, 1.0))),
            ("v", hf(&[1, 2, sk, 3], rng.vec(sk * 6, 1.0))),
        ]);
        let mut i = map(vec![("r", hf(&[1, 4, sq, 3], rng.vec(sq * 12, 1.0)))]);
        if with_mask {
            // random holes; key 0 always kept so that every row sees a key
            let m: Vec<i64> = (0..sq * sk)
                .map(|x| {
                    if x % sk == 0 {
                        1
                    } else {
                        (rng.below(5) != 0) as i64
                    }
                })
                .collect();
            i.insert(
                "mask".into(),
                HostTensor::ints(DType::Bool, vec![1, 1, sq, sk], m),
            );
        }
        check_fd(&g, &w, &i, 8, 1e-6);
    }
}

#[test]
fn partial_rope_and_rms_norm_grads_match_finite_differences() {
    // x [B, S, N, D] = [2, 2, 3, 6] viewed as [B, N, S, D] through a transpose; rotary
    // dim 4 of 6; per-batch tables; then rms_norm over the head dim with a weight.
    let mut g = Graph::new("rope");
    let x = param(&mut g, "x", fty(&[2, 2, 3, 6]));
    let xt = g.add(Op::Transpose { dim0: 1, dim1: 2 }, &[x]).unwrap();
    let cos = input(&mut g, "cos", fty(&[2, 2, 4]));
    let sin = input(&mut g, "sin", fty(&[2, 2, 4]));
    let y = g
        .add(
            Op::Rope {
                layout: weft_ir::HeadLayout::Bhsd,
            },
            &[xt, cos, sin],
        )
        .unwrap();
    let w = param(&mut g, "w", fty(&[6]));
    let y = g.add(Op::RmsNorm { eps: Float(1e-5) }, &[y, w]).unwrap();
    let r = input(&mut g, "r", fty(&[2, 3, 2, 6]));
    let p = g.add(Op::Mul {}, &[y, r]).unwrap();
    let loss = g
        .add(
            Op::Sum {
                dims: vec![0, 1, 2, 3],
                keepdim: false,
            },
            &[p],
        )
        .unwrap();
    g.set_output("loss", loss);
    let mut rng = Rng::new(31);
    let w = map(vec![
        ("x", hf(&[2, 2, 3, 6], rng.vec(72, 1.0))),
        ("w", hf(&[6], rng.vec(6, 1.0))),
    ]);
    let i = map(vec![
        ("cos", hf(&[2, 2, 4], rng.vec(16, 1.0))),
        ("sin", hf(&[2, 2, 4], rng.vec(16, 1.0))),
        ("r", hf(&[2, 3, 2, 6], rng.vec(72, 1.0))),
    ]);
    check_fd(&g, &w, &i, 100, 1e-6);
}

#[test]
fn linear_with_bias_grads_match_finite_differences() {
    let mut g = Graph::new("lin");
    let x = param(&mut g, "x", fty(&[2, 3, 4]));
    let w = param(&mut g, "w", fty(&[5, 4]));
    let b = param(&mut g, "b", fty(&[5]));
    let y = g.add(Op::Linear {}, &[x, w, b]).unwrap();
    let y = g.add(Op::Tanh {}, &[y]).unwrap();
    let loss = g
        .add(
            Op::Sum {
                dims: vec![0, 1, 2],
                keepdim: false,
            },
            &[y],
        )
        .unwrap();
    g.set_output("loss", loss);
    let mut rng = Rng::new(41);
    let wv = map(vec![
        ("x", hf(&[2, 3, 4], rng.vec(24, 1.0))),
        ("w", hf(&[5, 4], rng.vec(20, 1.0))),
        ("b", hf(&[5], rng.vec(5, 1.0))),
    ]);
    check_fd(&g, &wv, &BTreeMap::new(), 100, 1e-6);
}

#[test]
fn softmax_along_a_leading_dim_grads_match_finite_differences() {
    let mut g = Graph::new("sm");
    let x = param(&mut g, "x", fty(&[3, 2, 4]));
    let y = g.add(Op::Softmax { dim: 0 }, &[x]).unwrap();
    let z = g.add(Op::LogSoftmax { dim: 1 }, &[x]).unwrap();
    let r = input(&mut g, "r", fty(&[3, 2, 4]));
    let a = g.add(Op::Mul {}, &[y, r]).unwrap();
    let b = g.add(Op::Mul {}, &[z, r]).unwrap();
    let c = g.add(Op::Add {}, &[a, b]).unwrap();
    let loss = g
        .add(
            Op::Sum {
                dims: vec![0, 1, 2],
                keepdim: false,
            },
            &[c],
        )
        .unwrap();
    g.set_output("loss", loss);
    let mut rng = Rng::new(51);
    let w = map(vec![("x", hf(&[3, 2, 4], rng.vec(24, 2.0)))]);
    let i = map(vec![("r", hf(&[3, 2, 4], rng.vec(24, 1.0)))]);
    check_fd(&g, &w, &i, 100, 1e-6);
}

/// `loss = sum(out * r) (+ sum(lse * r2))` of an attention with a window, soft-cap and a
/// value head dim of its own (the fused kernel's backward), and with sinks and the
/// log-sum-exp result (the composed path's autograd), against finite differences.
#[test]
fn attention_window_softcap_sinks_and_lse_grads_match_finite_differences() {
    let (nq, nkv, d, dv, sq, sk) = (4i64, 2i64, 3i64, 5i64, 130i64, 150i64);
    for (window, softcap, sinks, lse) in [
        (Some(9i64), Some(1.3), false, false),
        (Some(70), None, false, false),
        (Some(12), Some(2.0), true, true),
        (None, None, true, false),
        (Some(5), None, false, true),
    ] {
        let mut g = Graph::new("attn");
        let q = param(&mut g, "q", fty(&[1, sq, nq, d]));
        let q = g.add(Op::Transpose { dim0: 1, dim1: 2 }, &[q]).unwrap();
        let k = param(&mut g, "k", fty(&[1, nkv, sk, d]));
        let v = param(&mut g, "v", fty(&[1, nkv, sk, dv]));
        let mut ins = vec![q, k, v];
        if sinks {
            ins.push(param(&mut g, "sinks", fty(&[nq])));
        }
        let res = g
            .add_multi(
                Op::Attention {
                    layout: weft_ir::HeadLayout::Bhsd,
                    causal: true,
                    scale: Float(0.7),
                    window,
                    softcap: softcap.map(Float),
                    sinks: sinks.into(),
                    lse: lse.into(),
                },
                &ins,
            )
            .unwrap();
        let r = input(&mut g, "r", fty(&[1, nq, sq, dv]));
        let p = g.add(Op::Mul {}, &[res[0], r]).unwrap();
        let all = |g: &mut Graph, x: Value, n: i64| {
            g.add(
                Op::Sum {
                    dims: (0..n).collect(),
                    keepdim: false,
                },
                &[x],
            )
            .unwrap()
        };
        let mut loss = all(&mut g, p, 4);
        if lse {
            let r2 = input(&mut g, "r2", fty(&[1, nq, sq]));
            let p2 = g.add(Op::Mul {}, &[res[1], r2]).unwrap();
            let l2 = all(&mut g, p2, 3);
            loss = g.add(Op::Add {}, &[loss, l2]).unwrap();
        }
        g.set_output("loss", loss);
        let mut rng = Rng::new(31 + window.unwrap_or(0) as u64);
        let (sq, sk, nq, nkv, d, dv) = (sq as usize, sk as usize, 4, 2, 3, 5);
        let mut w = map(vec![
            ("q", hf(&[1, sq, nq, d], rng.vec(sq * nq * d, 1.0))),
            ("k", hf(&[1, nkv, sk, d], rng.vec(sk * nkv * d, 1.0))),
            ("v", hf(&[1, nkv, sk, dv], rng.vec(sk * nkv * dv, 1.0))),
        ]);
        if sinks {
            w.insert("sinks".into(), hf(&[nq], rng.vec(nq, 1.0)));
        }
        let mut i = map(vec![(
            "r",
            hf(&[1, nq, sq, dv], rng.vec(sq * nq * dv, 1.0)),
        )]);
        if lse {
            i.insert("r2".into(), hf(&[1, nq, sq], rng.vec(sq * nq, 1.0)));
        }
        check_fd(&g, &w, &i, 8, 1e-6);
    }
}

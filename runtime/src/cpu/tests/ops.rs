//! Each op against values computed by hand or by naive loops, in f64.

use super::*;
use weft_ir::attrs::{CmpOp, Flag, Float, Reduction, RopeScaling};
use weft_ir::Mesh;

/// One-op graph helper: inputs `x0, x1, ...` of the given types and data, one op, output `y`.
fn one_op(op: Op, ins: Vec<(TensorType, HostTensor)>) -> Vec<f64> {
    let mut g = Graph::new("t");
    let mut vs = Vec::new();
    let mut data = BTreeMap::new();
    for (i, (ty, t)) in ins.into_iter().enumerate() {
        let name = format!("x{i}");
        vs.push(input(&mut g, &name, ty));
        data.insert(name, t);
    }
    let y = g.add(op, &vs).unwrap();
    g.set_output("y", y);
    let r = run64(&g, &BTreeMap::new(), &data);
    out(&r, "y")
}

fn naive_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

fn transpose2(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    let mut t = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            t[j * r + i] = a[i * c + j];
        }
    }
    t
}

#[test]
fn matmul_broadcast_and_transposes() {
    let mut rng = Rng::new(1);
    let a = rng.vec(2 * 3 * 4, 1.0);
    let b = rng.vec(4 * 5, 1.0);
    // [2,3,4] @ [4,5]: batch folds into rows
    let y = one_op(
        Op::Matmul {
            transpose_a: false,
            transpose_b: false,
        },
        vec![
            (fty(&[2, 3, 4]), hf(&[2, 3, 4], a.clone())),
            (fty(&[4, 5]), hf(&[4, 5], b.clone())),
        ],
    );
    let mut want = naive_matmul(&a[..12], &b, 3, 4, 5);
    want.extend(naive_matmul(&a[12..], &b, 3, 4, 5));
    assert_close(&y, &want, 1e-12);

    // [2,3,4]^T_b with b [2,5,4] (transpose_b) and a [1,3,4] broadcast over the batch
    let bt = rng.vec(2 * 5 * 4, 1.0);
    let a1 = &a[..12];
    let y = one_op(
        Op::Matmul {
            transpose_a: false,
            transpose_b: true,
        },
        vec![
            (fty(&[1, 3, 4]), hf(&[1, 3, 4], a1.to_vec())),
            (fty(&[2, 5, 4]), hf(&[2, 5, 4], bt.clone())),
        ],
    );
    let mut want = naive_matmul(a1, &transpose2(&bt[..20], 5, 4), 3, 4, 5);
    want.extend(naive_matmul(a1, &transpose2(&bt[20..], 5, 4), 3, 4, 5));
    assert_close(&y, &want, 1e-12);

    // transpose_a: a [4,3] used as [3,4]
    let at = transpose2(a1, 3, 4);
    let y = one_op(
        Op::Matmul {
            transpose_a: true,
            transpose_b: false,
        },
        vec![
            (fty(&[4, 3]), hf(&[4, 3], at)),
            (fty(&[4, 5]), hf(&[4, 5], b.clone())),
        ],
    );
    assert_close(&y, &naive_matmul(a1, &b, 3, 4, 5), 1e-12);
}

#[test]
fn linear_with_bias() {
    let mut rng = Rng::new(2);
    let x = rng.vec(2 * 3 * 4, 1.0);
    let w = rng.vec(5 * 4, 1.0);
    let bias = rng.vec(5, 1.0);
    let y = one_op(
        Op::Linear {},
        vec![
            (fty(&[2, 3, 4]), hf(&[2, 3, 4], x.clone())),
            (fty(&[5, 4]), hf(&[5, 4], w.clone())),
            (fty(&[5]), hf(&[5], bias.clone())),
        ],
    );
    let mut want = naive_matmul(&x, &transpose2(&w, 5, 4), 6, 4, 5);
    for (i, v) in want.iter_mut().enumerate() {
        *v += bias[i % 5];
    }
    assert_close(&y, &want, 1e-12);
}

#[test]
fn rms_norm_matches_formula() {
    let x = vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.0, 2.0];
    let w = vec![1.0, 0.5, 2.0, -1.0];
    let eps = 1e-6;
    let y = one_op(
        Op::RmsNorm { eps: Float(eps) },
        vec![
            (fty(&[2, 4]), hf(&[2, 4], x.clone())),
            (fty(&[4]), hf(&[4], w.clone())),
        ],
    );
    let mut want = Vec::new();
    for r in 0..2 {
        let row = &x[r * 4..r * 4 + 4];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / 4.0;
        let inv = 1.0 / (ms + eps).sqrt();
        want.extend(row.iter().zip(&w).map(|(v, w)| w * (v * inv)));
    }
    assert_close(&y, &want, 1e-12);
    // row 0 by hand: ms = 30/4 = 7.5, 1/sqrt(7.5) = 0.365148...
    assert!((y[0] - 0.3651483716701107).abs() < 1e-6);
}

/// HF `_compute_llama3_parameters`, written out for one frequency.
fn llama3(inv: f64, factor: f64, lo: f64, hi: f64, old: f64) -> f64 {
    let (low_wl, high_wl) = (old / lo, old / hi);
    let wl = 2.0 * std::f64::consts::PI / inv;
    if wl < high_wl {
        inv
    } else if wl > low_wl {
        inv / factor
    } else {
        let s = (old / wl - lo) / (hi - lo);
        (1.0 - s) * inv / factor + s * inv
    }
}

fn rope_table(pos: &[i64], dim: i64, theta: f64, scaling: RopeScaling) -> (Vec<f64>, Vec<f64>) {
    let mut g = Graph::new("t");
    let p = input(&mut g, "p", ity(&[1, pos.len() as i64]));
    let cs = g
        .add_multi(
            Op::RopeTable {
                theta: Float(theta),
                dim,
                scaling,
            },
            &[p],
        )
        .unwrap();
    g.set_output("cos", cs[0]);
    g.set_output("sin", cs[1]);
    let r = run64(
        &g,
        &BTreeMap::new(),
        &map(vec![("p", hi(&[1, pos.len()], pos.to_vec()))]),
    );
    (out(&r, "cos"), out(&r, "sin"))
}

#[test]
fn rope_table_default_linear_and_llama3() {
    let pos = vec![0i64, 1, 5, 37];
    // dim 8, theta 1e4: inv_freq = [1, 0.1, 0.01, 0.001]
    let inv = [1.0, 0.1, 0.01, 0.001];
    let check = |cos: &[f64], sin: &[f64], inv: &[f64], pscale: f64| {
        for (i, &p) in pos.iter().enumerate() {
            for j in 0..8 {
                let f = p as f64 * pscale * inv[j % 4];
                assert!(
                    (cos[i * 8 + j] - f.cos()).abs() < 1e-9,
                    "cos at pos {p}, feature {j}"
                );
                assert!(
                    (sin[i * 8 + j] - f.sin()).abs() < 1e-9,
                    "sin at pos {p}, feature {j}"
                );
            }
        }
    };
    let (c, s) = rope_table(&pos, 8, 1e4, RopeScaling::None);
    check(&c, &s, &inv, 1.0);
    // linear: positions / factor
    let (c, s) = rope_table(&pos, 8, 1e4, RopeScaling::Linear { factor: Float(4.0) });
    check(&c, &s, &inv, 0.25);
    // llama3 with orig 512, low 1, high 16: wavelengths 6.28 (kept), 62.8 (smoothed),
    // 628 and 6283 (divided by the factor 8).
    let sc = RopeScaling::Llama3 {
        factor: Float(8.0),
        low_freq_factor: Float(1.0),
        high_freq_factor: Float(16.0),
        original_max_position_embeddings: 512,
    };
    let scaled: Vec<f64> = inv
        .iter()
        .map(|&f| llama3(f, 8.0, 1.0, 16.0, 512.0))
        .collect();
    assert_eq!(scaled[0], 1.0);
    assert!(
        (scaled[1] - 0.054200943).abs() < 1e-8,
        "smoothed: {}",
        scaled[1]
    );
    assert!((scaled[2] - 0.00125).abs() < 1e-12 && (scaled[3] - 0.000125).abs() < 1e-12);
    let (c, s) = rope_table(&pos, 8, 1e4, sc);
    check(&c, &s, &scaled, 1.0);
}

#[test]
fn rope_rotates_the_first_features_and_passes_the_rest() {
    let (b, n, s, d, r) = (1usize, 2usize, 3usize, 6usize, 4usize);
    let mut rng = Rng::new(3);
    let x = rng.vec(b * n * s * d, 1.0);
    let cos = rng.vec(s * r, 1.0);
    let sin = rng.vec(s * r, 1.0);
    let y = one_op(
        Op::Rope {
            layout: weft_ir::HeadLayout::Bhsd,
        },
        vec![
            (fty(&[1, 2, 3, 6]), hf(&[1, 2, 3, 6], x.clone())),
            (fty(&[1, 3, 4]), hf(&[1, 3, 4], cos.clone())),
            (fty(&[1, 3, 4]), hf(&[1, 3, 4], sin.clone())),
        ],
    );
    let mut want = vec![0.0; x.len()];
    for h in 0..n {
        for t in 0..s {
            let base = (h * s + t) * d;
            for j in 0..d {
                want[base + j] = if j < r {
                    let rot = if j < r / 2 {
                        -x[base + j + r / 2]
                    } else {
                        x[base + j - r / 2]
                    };
                    x[base + j] * cos[t * r + j] + rot * sin[t * r + j]
                } else {
                    x[base + j]
                };
            }
        }
    }
    assert_close(&y, &want, 1e-12);
}

/// Naive attention: per (b, h, i), scores over j, mask, softmax, weighted v.
#[allow(clippy::too_many_arguments)]
fn naive_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (b, nq, nkv, sq, sk, d): (usize, usize, usize, usize, usize, usize),
    causal: bool,
    mask: Option<&[i64]>,
    scale: f64,
) -> Vec<f64> {
    let rep = nq / nkv;
    let mut o = vec![0.0; b * nq * sq * d];
    for bi in 0..b {
        for h in 0..nq {
            let kh = h / rep;
            for i in 0..sq {
                let mut sc = vec![f64::MIN; sk];
                for (j, s) in sc.iter_mut().enumerate() {
                    let keep = (!causal || j + sq <= i + sk)
                        && mask.is_none_or(|m| m[(bi * sq + i) * sk + j] != 0);
                    let dot: f64 = (0..d)
                        .map(|e| {
                            q[((bi * nq + h) * sq + i) * d + e]
                                * k[((bi * nkv + kh) * sk + j) * d + e]
                        })
                        .sum();
                    if keep {
                        *s = dot * scale;
                    }
                }
                let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                let ex: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = ex.iter().sum();
                for e in 0..d {
                    o[((bi * nq + h) * sq + i) * d + e] = (0..sk)
                        .map(|j| ex[j] / z * v[((bi * nkv + kh) * sk + j) * d + e])
                        .sum();
                }
            }
        }
    }
    o
}

#[test]
fn attention_causal_gqa_and_mask_match_a_naive_loop() {
    let (b, nq, nkv, s, d) = (2usize, 4usize, 2usize, 5usize, 3usize);
    let mut rng = Rng::new(4);
    let q = rng.vec(b * nq * s * d, 1.0);
    let k = rng.vec(b * nkv * s * d, 1.0);
    let v = rng.vec(b * nkv * s * d, 1.0);
    let scale = 1.0 / (d as f64).sqrt();
    let qt = fty(&[2, 4, 5, 3]);
    let kt = fty(&[2, 2, 5, 3]);
    let qkv = |q: &[f64], k: &[f64], v: &[f64]| {
        vec![
            (qt.clone(), hf(&[2, 4, 5, 3], q.to_vec())),
            (kt.clone(), hf(&[2, 2, 5, 3], k.to_vec())),
            (kt.clone(), hf(&[2, 2, 5, 3], v.to_vec())),
        ]
    };
    for causal in [true, false] {
        let y = one_op(
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal,
                scale: Float(scale),
                window: None,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            },
            qkv(&q, &k, &v),
        );
        assert_close(
            &y,
            &naive_attention(&q, &k, &v, (b, nq, nkv, s, s, d), causal, None, scale),
            1e-12,
        );
    }
    // keep-mask [B, 1, S, S]: left padding of 2 in batch 1, with a fully masked row
    let mut m = vec![1i64; b * s * s];
    for i in 0..s {
        for j in 0..2 {
            m[(s + i) * s + j] = 0;
        }
    }
    let mut ins = qkv(&q, &k, &v);
    ins.push((
        TensorType::new(DType::Bool, dims(&[2, 1, 5, 5])),
        HostTensor::ints(DType::Bool, vec![2, 1, 5, 5], m.clone()),
    ));
    let y = one_op(
        Op::Attention {
            layout: weft_ir::HeadLayout::Bhsd,
            causal: true,
            scale: Float(scale),
            window: None,
            softcap: None,
            sinks: Default::default(),
            lse: Default::default(),
        },
        ins,
    );
    let want = naive_attention(&q, &k, &v, (b, nq, nkv, s, s, d), true, Some(&m), scale);
    assert_close(&y, &want, 1e-12);
    assert!(
        y.iter().all(|x| x.is_finite()),
        "fully masked rows must not give NaN"
    );

    // several blocks of query rows, causal with fewer queries than keys
    let (b, nq, nkv, sq, sk, d) = (1usize, 2usize, 1usize, 100usize, 160usize, 4usize);
    let q = rng.vec(b * nq * sq * d, 1.0);
    let k = rng.vec(b * nkv * sk * d, 1.0);
    let v = rng.vec(b * nkv * sk * d, 1.0);
    let y = one_op(
        Op::Attention {
            layout: weft_ir::HeadLayout::Bhsd,
            causal: true,
            scale: Float(0.5),
            window: None,
            softcap: None,
            sinks: Default::default(),
            lse: Default::default(),
        },
        vec![
            (fty(&[1, 2, 100, 4]), hf(&[1, 2, 100, 4], q.clone())),
            (fty(&[1, 1, 160, 4]), hf(&[1, 1, 160, 4], k.clone())),
            (fty(&[1, 1, 160, 4]), hf(&[1, 1, 160, 4], v.clone())),
        ],
    );
    assert_close(
        &y,
        &naive_attention(&q, &k, &v, (b, nq, nkv, sq, sk, d), true, None, 0.5),
        1e-12,
    );
}

#[test]
fn cross_entropy_shift_and_count_with_ignored_labels() {
    let (n, v) = (2usize, 3usize);
    let logits = vec![
        0.5, -1.0, 2.0, 1.0, 1.0, 0.0, 0.2, 0.3, -0.4, 3.0, 0.0, 1.0, -2.0, 0.5, 0.25, 1.5, 1.0,
        -1.0,
    ];
    let labels = vec![2i64, -100, 1, 0, -100, 2];
    let lse = |row: &[f64]| row.iter().map(|x| x.exp()).sum::<f64>().ln();
    let per: Vec<f64> = (0..6)
        .map(|t| {
            let row = &logits[t * v..t * v + v];
            if labels[t] == -100 {
                0.0
            } else {
                lse(row) - row[labels[t] as usize]
            }
        })
        .collect();
    let sum: f64 = per.iter().sum();
    let mk = |red| {
        let mut g = Graph::new("t");
        let l = input(&mut g, "logits", fty(&[2, 3, 3]));
        let y = input_role(&mut g, "labels", Role::Labels, ity(&[2, 3]));
        let ce = g
            .add(
                Op::CrossEntropy {
                    ignore_index: -100,
                    reduction: red,
                },
                &[l, y],
            )
            .unwrap();
        let sh = g.add(Op::ShiftLabels { ignore_index: -100 }, &[y]).unwrap();
        let cv = g.add(Op::CountValid { ignore_index: -100 }, &[y]).unwrap();
        g.set_output("ce", ce);
        g.set_output("shifted", sh);
        g.set_output("count", cv);
        let r = run64(
            &g,
            &BTreeMap::new(),
            &map(vec![
                ("logits", hf(&[2, 3, 3], logits.clone())),
                ("labels", hi(&[2, 3], labels.clone())),
            ]),
        );
        (out(&r, "ce"), out(&r, "shifted"), out(&r, "count"))
    };
    let _ = n;
    let (none, shifted, count) = mk(Reduction::None);
    assert_close(&none, &per, 1e-12);
    assert_eq!(shifted, vec![-100.0, 1.0, -100.0, -100.0, 2.0, -100.0]);
    assert_eq!(count, vec![4.0]);
    assert_close(&mk(Reduction::Sum).0, &[sum], 1e-12);
    assert_close(&mk(Reduction::Mean).0, &[sum / 4.0], 1e-12);
}

#[test]
fn topk_sorted_descending_ties_to_lower_index() {
    let x = vec![1.0, 3.0, 3.0, 0.5, 2.0, 2.0, 2.0, -1.0];
    let mut g = Graph::new("t");
    let xi = input(&mut g, "x", fty(&[2, 4]));
    let r = g.add_multi(Op::Topk { k: 3, dim: 1 }, &[xi]).unwrap();
    g.set_output("v", r[0]);
    g.set_output("i", r[1]);
    let res = run64(&g, &BTreeMap::new(), &map(vec![("x", hf(&[2, 4], x))]));
    assert_eq!(out(&res, "v"), vec![3.0, 3.0, 1.0, 2.0, 2.0, 2.0]);
    assert_eq!(res.outputs["i"].to_i64(), vec![1, 2, 0, 0, 1, 2]);
    assert_eq!(res.outputs["i"].dtype, DType::I64);
    // along dim 0
    let mut g = Graph::new("t");
    let xi = input(&mut g, "x", fty(&[3, 2]));
    let r = g.add_multi(Op::Topk { k: 2, dim: 0 }, &[xi]).unwrap();
    g.set_output("i", r[1]);
    let res = run64(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[3, 2], vec![0.0, 5.0, 1.0, 5.0, 1.0, 4.0]))]),
    );
    assert_eq!(res.outputs["i"].to_i64(), vec![1, 0, 2, 1]);
}

#[test]
fn moe_dispatch_grouped_matmul_combine_match_a_per_token_loop() {
    let (t, h, k, e, n) = (5usize, 3usize, 2usize, 3usize, 4usize);
    let mut rng = Rng::new(5);
    let x = rng.vec(t * h, 1.0);
    let w = rng.vec(e * n * h, 1.0);
    let gates = rng.vec(t * k, 1.0);
    let experts = vec![2i64, 0, 0, 1, 2, 1, 0, 2, 2, 0];
    let mut g = Graph::new("moe");
    let xv = input(&mut g, "x", fty(&[5, 3]));
    let iv = input(&mut g, "idx", ity(&[5, 2]));
    let wv = param(&mut g, "w", fty(&[3, 4, 3]));
    let gv = input(&mut g, "gates", fty(&[5, 2]));
    let d = g
        .add_multi(Op::MoeDispatch { num_experts: 3 }, &[xv, iv])
        .unwrap();
    let y = g
        .add(
            Op::GroupedMatmul {
                transpose_w: Default::default(),
            },
            &[d[0], wv, d[1]],
        )
        .unwrap();
    let c = g.add(Op::MoeCombine {}, &[y, d[2], gv]).unwrap();
    g.set_output("rows", d[0]);
    g.set_output("counts", d[1]);
    g.set_output("order", d[2]);
    g.set_output("y", c);
    let r = run64(
        &g,
        &map(vec![("w", hf(&[3, 4, 3], w.clone()))]),
        &map(vec![
            ("x", hf(&[5, 3], x.clone())),
            ("idx", hi(&[5, 2], experts.clone())),
            ("gates", hf(&[5, 2], gates.clone())),
        ]),
    );
    assert_eq!(r.outputs["counts"].to_i64(), vec![4, 2, 4]);
    // stable by expert, token-major within an expert
    assert_eq!(
        r.outputs["order"].to_i64(),
        vec![1, 2, 6, 9, 3, 5, 0, 4, 7, 8]
    );
    let rows = out(&r, "rows");
    assert_eq!(&rows[0..3], &x[0..3]); // flat 1 is token 0
    let mut want = vec![0.0; t * n];
    for ti in 0..t {
        for s in 0..k {
            let ex = experts[ti * k + s] as usize;
            for o in 0..n {
                let dot: f64 = (0..h)
                    .map(|c| x[ti * h + c] * w[(ex * n + o) * h + c])
                    .sum();
                want[ti * n + o] += gates[ti * k + s] * dot;
            }
        }
    }
    assert_close(&out(&r, "y"), &want, 1e-12);
}

#[test]
fn slice_at_rank_coordinate_and_output_split() {
    let mut g = Graph::new("t");
    g.mesh = Mesh::parse("sp=2").unwrap();
    let x = input(&mut g, "x", fty(&[2, 6]));
    let start = Dim::coord("sp") * 3;
    let y = g
        .add(
            Op::Slice {
                dim: 1,
                start,
                len: Dim::from(3),
            },
            &[x],
        )
        .unwrap();
    let z = g.add(Op::Scale { factor: Float(2.0) }, &[y]).unwrap();
    g.set_output("z", z);
    g.add_output_split("z", 1, "sp");
    let data: Vec<f64> = (0..12).map(|v| v as f64).collect();
    let opts = RunOptions {
        keep_rank_outputs: true,
        ..RunOptions::new(Precision::F64)
    };
    let r = run(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[2, 6], data.clone()))]),
        &opts,
    )
    .unwrap();
    assert_eq!(
        out(&r, "z"),
        data.iter().map(|v| v * 2.0).collect::<Vec<_>>()
    );
    assert_eq!(r.rank_outputs[1]["z"].shape, vec![2, 3]);
    assert_eq!(
        r.rank_outputs[1]["z"].to_f64(),
        vec![6.0, 8.0, 10.0, 18.0, 20.0, 22.0]
    );
}

#[test]
fn layout_ops() {
    let data: Vec<f64> = (0..24).map(|v| v as f64).collect();
    let x = || (fty(&[2, 3, 4]), hf(&[2, 3, 4], data.clone()));
    // reshape is row-major
    assert_eq!(
        one_op(
            Op::Reshape {
                shape: dims(&[4, 6])
            },
            vec![x()]
        ),
        data
    );
    // permute [2, 0, 1]: out[k][i][j] = x[i][j][k]
    let y = one_op(
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        vec![x()],
    );
    let mut want = Vec::new();
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                want.push(data[i * 12 + j * 4 + k]);
            }
        }
    }
    assert_eq!(y, want);
    // transpose(0, 2) then reshape to force a copy of the strided view
    let mut g = Graph::new("t");
    let xi = input(&mut g, "x", fty(&[2, 3, 4]));
    let t = g.add(Op::Transpose { dim0: 0, dim1: 2 }, &[xi]).unwrap();
    let r = g.add(Op::Reshape { shape: dims(&[24]) }, &[t]).unwrap();
    g.set_output("r", r);
    let res = run64(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[2, 3, 4], data.clone()))]),
    );
    let mut want = Vec::new();
    for k in 0..4 {
        for j in 0..3 {
            for i in 0..2 {
                want.push(data[i * 12 + j * 4 + k]);
            }
        }
    }
    assert_eq!(out(&res, "r"), want);
    // split into [1, 3] along the last dim, concat back in the other order
    let mut g = Graph::new("t");
    let xi = input(&mut g, "x", fty(&[2, 3, 4]));
    let parts = g
        .add_multi(
            Op::Split {
                dim: -1,
                sizes: dims(&[1, 3]),
            },
            &[xi],
        )
        .unwrap();
    let c = g.add(Op::Concat { dim: 2 }, &[parts[1], parts[0]]).unwrap();
    g.set_output("c", c);
    g.set_output("p0", parts[0]);
    let res = run64(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[2, 3, 4], data.clone()))]),
    );
    assert_eq!(out(&res, "p0"), vec![0.0, 4.0, 8.0, 12.0, 16.0, 20.0]);
    let want: Vec<f64> = (0..6)
        .flat_map(|r| [1.0, 2.0, 3.0, 0.0].map(|c| (r * 4) as f64 + c))
        .collect();
    assert_eq!(out(&res, "c"), want);
    // expand [3, 1] -> [2, 3, 4]
    let y = one_op(
        Op::Expand {
            shape: dims(&[2, 3, 4]),
        },
        vec![(fty(&[3, 1]), hf(&[3, 1], vec![1.0, 2.0, 3.0]))],
    );
    assert_eq!(
        y,
        (0..24)
            .map(|i| ((i / 4) % 3 + 1) as f64)
            .collect::<Vec<_>>()
    );
}

#[test]
fn gather_scatter_add_index_select_one_hot_embedding() {
    let x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    // gather dim 1 with a narrower index: out[i][j] = x[i][idx[i][j]]
    let y = one_op(
        Op::Gather { dim: 1 },
        vec![
            (fty(&[2, 3]), hf(&[2, 3], x.clone())),
            (ity(&[1, 2]), hi(&[1, 2], vec![2, 0])),
        ],
    );
    assert_eq!(y, vec![3.0, 1.0]);
    // scatter_add dim 0: dst[idx[i][j]][j] += src[i][j]
    let y = one_op(
        Op::ScatterAdd { dim: 0 },
        vec![
            (fty(&[2, 3]), hf(&[2, 3], x.clone())),
            (ity(&[2, 3]), hi(&[2, 3], vec![1, 0, 1, 1, 1, 0])),
            (
                fty(&[2, 3]),
                hf(&[2, 3], vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0]),
            ),
        ],
    );
    assert_eq!(y, vec![1.0, 22.0, 63.0, 54.0, 55.0, 36.0]);
    // index_select dim 1
    let y = one_op(
        Op::IndexSelect { dim: 1 },
        vec![
            (fty(&[2, 3]), hf(&[2, 3], x.clone())),
            (ity(&[4]), hi(&[4], vec![2, 2, 0, 1])),
        ],
    );
    assert_eq!(y, vec![3.0, 3.0, 1.0, 2.0, 6.0, 6.0, 4.0, 5.0]);
    // one_hot to f32
    let y = one_op(
        Op::OneHot {
            num_classes: 3,
            dtype: DType::F32,
        },
        vec![(ity(&[2]), hi(&[2], vec![2, 0]))],
    );
    assert_eq!(y, vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    // embedding
    let y = one_op(
        Op::Embedding { padding_idx: None },
        vec![
            (ity(&[1, 2]), hi(&[1, 2], vec![1, 0])),
            (fty(&[3, 2]), hf(&[3, 2], x.clone())),
        ],
    );
    assert_eq!(y, vec![3.0, 4.0, 1.0, 2.0]);
}

#[test]
fn elementwise_reductions_and_softmax() {
    let x = vec![-2.0, -0.5, 0.0, 0.7, 1.5, 3.0];
    let xt = || (fty(&[2, 3]), hf(&[2, 3], x.clone()));
    let each = |op: Op, f: &dyn Fn(f64) -> f64| {
        let y = one_op(op.clone(), vec![xt()]);
        assert_close(&y, &x.iter().map(|&v| f(v)).collect::<Vec<_>>(), 1e-12);
    };
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    each(Op::Neg {}, &|v| -v);
    each(Op::Exp {}, &|v| v.exp());
    each(Op::Tanh {}, &|v| v.tanh());
    each(Op::Sigmoid {}, &sig);
    each(Op::Silu {}, &|v| v * sig(v));
    each(Op::Relu {}, &|v| v.max(0.0));
    each(
        Op::Scale {
            factor: Float(-3.0),
        },
        &|v| -3.0 * v,
    );
    each(Op::AddScalar { value: Float(0.25) }, &|v| v + 0.25);
    each(
        Op::PowScalar {
            exponent: Float(2.0),
        },
        &|v| v * v,
    );
    each(
        Op::PowScalar {
            exponent: Float(3.0),
        },
        &|v| v.powi(3),
    );
    each(Op::Gelu { tanh_approx: true }, &|v| {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
    });
    // exact GELU at a few points: 0.5 x (1 + erf(x / sqrt 2))
    let y = one_op(Op::Gelu { tanh_approx: false }, vec![xt()]);
    let erf_ref = [
        -0.9544997361036416,
        -0.3829249225480262,
        0.0,
        0.5160726955538539,
        0.8663855974622838,
        0.9973002039367398,
    ];
    let want: Vec<f64> = x
        .iter()
        .zip(erf_ref)
        .map(|(v, e)| 0.5 * v * (1.0 + e))
        .collect();
    assert_close(&y, &want, 1e-7);
    let pos = vec![0.5, 1.0, 2.0, 4.0];
    let p = || (fty(&[4]), hf(&[4], pos.clone()));
    assert_close(
        &one_op(Op::Log {}, vec![p()]),
        &pos.iter().map(|v: &f64| v.ln()).collect::<Vec<_>>(),
        1e-12,
    );
    assert_close(
        &one_op(Op::Sqrt {}, vec![p()]),
        &pos.iter().map(|v: &f64| v.sqrt()).collect::<Vec<_>>(),
        1e-12,
    );
    assert_close(
        &one_op(Op::Rsqrt {}, vec![p()]),
        &pos.iter().map(|v: &f64| 1.0 / v.sqrt()).collect::<Vec<_>>(),
        1e-12,
    );

    // broadcasting binaries: [2,3] with [3]
    let b = vec![1.0, 2.0, -1.0];
    let bin = |op: Op| one_op(op, vec![xt(), (fty(&[3]), hf(&[3], b.clone()))]);
    let zip = |f: &dyn Fn(f64, f64) -> f64| {
        x.iter()
            .enumerate()
            .map(|(i, &v)| f(v, b[i % 3]))
            .collect::<Vec<_>>()
    };
    assert_close(&bin(Op::Add {}), &zip(&|a, b| a + b), 1e-12);
    assert_close(&bin(Op::Sub {}), &zip(&|a, b| a - b), 1e-12);
    assert_close(&bin(Op::Mul {}), &zip(&|a, b| a * b), 1e-12);
    assert_close(&bin(Op::Div {}), &zip(&|a, b| a / b), 1e-12);
    assert_close(&bin(Op::Maximum {}), &zip(&|a, b| a.max(b)), 1e-12);
    assert_close(&bin(Op::Minimum {}), &zip(&|a, b| a.min(b)), 1e-12);
    assert_eq!(
        bin(Op::Compare { op: CmpOp::Gt }),
        zip(&|a, b| (a > b) as i64 as f64)
    );
    let y = one_op(Op::Pow {}, vec![p(), (fty(&[1]), hf(&[1], vec![1.5]))]);
    assert_close(
        &y,
        &pos.iter().map(|v: &f64| v.powf(1.5)).collect::<Vec<_>>(),
        1e-12,
    );

    // where + cast
    let mut g = Graph::new("t");
    let xi = input(&mut g, "x", fty(&[2, 3]));
    let zero = g
        .add(
            Op::Full {
                value: Float(0.0),
                ty: fty(&[]),
            },
            &[],
        )
        .unwrap();
    let c = g.add(Op::Compare { op: CmpOp::Ge }, &[xi, zero]).unwrap();
    let w = g.add(Op::Where {}, &[c, xi, zero]).unwrap();
    let ci = g.add(Op::Cast { dtype: DType::I64 }, &[xi]).unwrap();
    let cb = g.add(Op::Cast { dtype: DType::F32 }, &[c]).unwrap();
    let ar = g
        .add(
            Op::Arange {
                start: Dim::from(3),
                ty: ity(&[4]),
            },
            &[],
        )
        .unwrap();
    g.set_output("w", w);
    g.set_output("ci", ci);
    g.set_output("cb", cb);
    g.set_output("ar", ar);
    let r = run64(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[2, 3], x.clone()))]),
    );
    assert_eq!(out(&r, "w"), vec![0.0, 0.0, 0.0, 0.7, 1.5, 3.0]);
    assert_eq!(r.outputs["ci"].to_i64(), vec![-2, 0, 0, 0, 1, 3]);
    assert_eq!(out(&r, "cb"), vec![0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
    assert_eq!(r.outputs["ar"].to_i64(), vec![3, 4, 5, 6]);

    // reductions
    let red = |op: Op| one_op(op, vec![xt()]);
    assert_close(
        &red(Op::Sum {
            dims: vec![1],
            keepdim: false,
        }),
        &[-2.5, 5.2],
        1e-12,
    );
    assert_close(
        &red(Op::Sum {
            dims: vec![0, 1],
            keepdim: true,
        }),
        &[2.7],
        1e-12,
    );
    assert_close(
        &red(Op::Mean {
            dims: vec![0],
            keepdim: false,
        }),
        &[-0.65, 0.5, 1.5],
        1e-12,
    );
    assert_close(
        &red(Op::Max {
            dims: vec![-1],
            keepdim: true,
        }),
        &[0.0, 3.0],
        1e-12,
    );
    // softmax / log_softmax along the last dim
    let sm = red(Op::Softmax { dim: -1 });
    let lsm = red(Op::LogSoftmax { dim: 1 });
    for r in 0..2 {
        let row = &x[r * 3..r * 3 + 3];
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        for j in 0..3 {
            assert!((sm[r * 3 + j] - row[j].exp() / z).abs() < 1e-12);
            assert!((lsm[r * 3 + j] - (row[j] - z.ln())).abs() < 1e-12);
        }
    }
}

#[test]
fn errors_name_what_is_missing_or_wrong() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", fty(&[2, 3]));
    let w = param(&mut g, "w", fty(&[4, 3]));
    let y = g.add(Op::Linear {}, &[x, w]).unwrap();
    g.set_output("y", y);
    let xs = hf(&[2, 3], vec![0.0; 6]);
    let ws = hf(&[4, 3], vec![0.0; 12]);
    let opts = RunOptions::new(Precision::F32);
    let e = run(&g, &BTreeMap::new(), &map(vec![("x", xs.clone())]), &opts).unwrap_err();
    assert_eq!(e, RuntimeError::MissingWeight { name: "w".into() });
    let e = run(&g, &map(vec![("w", ws.clone())]), &BTreeMap::new(), &opts).unwrap_err();
    assert_eq!(e, RuntimeError::MissingInput { name: "x".into() });
    let e = run(
        &g,
        &map(vec![("w", hf(&[3, 4], vec![0.0; 12]))]),
        &map(vec![("x", xs.clone())]),
        &opts,
    )
    .unwrap_err();
    assert!(e.to_string().contains("param `w`: has shape [3, 4]"), "{e}");
    let e = run(
        &g,
        &map(vec![("w", ws.clone())]),
        &map(vec![("x", hi(&[2, 3], vec![0; 6]))]),
        &opts,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("input `x`: is i64 but the graph wants f32"),
        "{e}"
    );

    // a node whose type is wrong (as a broken pass would leave it) is named
    let mut g = Graph::new("t");
    g.set_scope(Some("model.layers.0.mlp"));
    let x = input(&mut g, "x", fty(&[2, 3]));
    let bad = g.insert_typed(
        weft_ir::At::End,
        Op::Neg {},
        &[x],
        vec![fty(&[3, 2])],
        weft_ir::NodeMeta::default(),
    );
    g.set_output("y", bad[0]);
    let e = run(&g, &BTreeMap::new(), &map(vec![("x", xs)]), &opts).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("`neg` failed in node {} on rank 0", bad[0])),
        "{msg}"
    );
    assert!(
        msg.contains("computed shape [2, 3] but the node's type says [3, 2]"),
        "{msg}"
    );
}

#[test]
fn symbols_are_inferred_from_inputs_and_checked() {
    let mut g = Graph::new("t");
    let ty = TensorType::new(DType::I64, vec![Dim::sym("B"), Dim::sym("S")]);
    let ids = input_role(&mut g, "input_ids", Role::InputIds, ty);
    let emb = param(&mut g, "emb", fty(&[10, 2]));
    let y = g
        .add(Op::Embedding { padding_idx: None }, &[ids, emb])
        .unwrap();
    g.set_output("y", y);
    let w = map(vec![(
        "emb",
        hf(&[10, 2], (0..20).map(|v| v as f64).collect()),
    )]);
    let i = map(vec![("input_ids", hi(&[1, 3], vec![9, 0, 4]))]);
    let r = run64(&g, &w, &i);
    assert_eq!(r.bindings.symbols["S"], 3);
    assert_eq!(out(&r, "y"), vec![18.0, 19.0, 0.0, 1.0, 8.0, 9.0]);
    let e = run(&g, &w, &i, &RunOptions::new(Precision::F64).bind("S", 4)).unwrap_err();
    assert!(matches!(e, RuntimeError::Bindings(_)), "{e}");
    // out-of-range token ids are an error naming the node
    let i = map(vec![("input_ids", hi(&[1, 2], vec![3, 10]))]);
    let e = run(&g, &w, &i, &RunOptions::new(Precision::F64)).unwrap_err();
    assert!(e.to_string().contains("token id 10"), "{e}");
}

/// The band, soft-cap, value head dim and sinks of `attention`, one loop per score: HF's
/// sliding window keeps keys `p - window < j <= p`; soft-capping is `c * tanh(s / c)`
/// before the mask; a sink joins each row's softmax and is dropped after it. Also the
/// log-sum-exp result.
#[allow(clippy::too_many_arguments)]
fn naive_attention_ext(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (b, nq, nkv, sq, sk, d, dv): (usize, usize, usize, usize, usize, usize, usize),
    window: Option<usize>,
    softcap: Option<f64>,
    sinks: Option<&[f64]>,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let rep = nq / nkv;
    let mut o = vec![0.0; b * nq * sq * dv];
    let mut lse = vec![0.0; b * nq * sq];
    for bi in 0..b {
        for h in 0..nq {
            let kh = h / rep;
            for i in 0..sq {
                let p = (i + sk) as i64 - sq as i64;
                let mut sc = vec![f64::MIN; sk];
                for (j, s) in sc.iter_mut().enumerate() {
                    let j = j as i64;
                    let keep = j <= p && window.is_none_or(|w| j > p - w as i64);
                    let mut x: f64 = (0..d)
                        .map(|e| {
                            q[((bi * nq + h) * sq + i) * d + e]
                                * k[((bi * nkv + kh) * sk + j as usize) * d + e]
                        })
                        .sum::<f64>()
                        * scale;
                    if let Some(c) = softcap {
                        x = c * (x / c).tanh();
                    }
                    if keep {
                        *s = x;
                    }
                }
                let sink = sinks.map(|s| s[h]);
                let mx = sc
                    .iter()
                    .chain(sink.iter())
                    .cloned()
                    .fold(f64::MIN, f64::max);
                let ex: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = ex.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - mx).exp());
                lse[(bi * nq + h) * sq + i] = mx + z.ln();
                for e in 0..dv {
                    o[((bi * nq + h) * sq + i) * dv + e] = (0..sk)
                        .map(|j| ex[j] / z * v[((bi * nkv + kh) * sk + j) * dv + e])
                        .sum();
                }
            }
        }
    }
    (o, lse)
}

#[test]
fn attention_window_softcap_value_dim_and_sinks_match_a_naive_loop() {
    // 150 queries over 160 keys: several 64-row blocks, each seeing only its band
    let (b, nq, nkv, sq, sk, d, dv) = (1usize, 4usize, 2usize, 150usize, 160usize, 3usize, 5usize);
    let mut rng = Rng::new(9);
    let q = rng.vec(b * nq * sq * d, 1.0);
    let k = rng.vec(b * nkv * sk * d, 1.0);
    let v = rng.vec(b * nkv * sk * dv, 1.0);
    let sinks = rng.vec(nq, 1.0);
    let ins = |with_sinks: bool| {
        let mut v = vec![
            (fty(&[1, 4, 150, 3]), hf(&[1, 4, 150, 3], q.clone())),
            (fty(&[1, 2, 160, 3]), hf(&[1, 2, 160, 3], k.clone())),
            (fty(&[1, 2, 160, 5]), hf(&[1, 2, 160, 5], v.clone())),
        ];
        if with_sinks {
            v.push((fty(&[4]), hf(&[4], sinks.clone())));
        }
        v
    };
    for (window, softcap, with_sinks) in [
        (Some(1), None, false),
        (Some(7), None, false),
        (Some(70), Some(0.8), false),
        (Some(500), None, false),
        (None, Some(2.0), false),
        (Some(20), Some(1.5), true),
        (None, None, true),
    ] {
        let op = |lse: bool| Op::Attention {
            layout: weft_ir::HeadLayout::Bhsd,
            causal: true,
            scale: Float(0.6),
            window: window.map(|w| w as i64),
            softcap: softcap.map(Float),
            sinks: Flag(with_sinks),
            lse: Flag(lse),
        };
        let (want, want_lse) = naive_attention_ext(
            &q,
            &k,
            &v,
            (b, nq, nkv, sq, sk, d, dv),
            window,
            softcap,
            with_sinks.then_some(&sinks[..]),
            0.6,
        );
        let what = format!("window={window:?} softcap={softcap:?} sinks={with_sinks}");
        if !with_sinks {
            let y = one_op(op(false), ins(false));
            assert_close(&y, &want, 1e-12);
        }
        // lse=true: the composed path, both results
        let mut g = Graph::new("t");
        let mut vs = Vec::new();
        let mut data = BTreeMap::new();
        for (i, (ty, t)) in ins(with_sinks).into_iter().enumerate() {
            let name = format!("x{i}");
            vs.push(input(&mut g, &name, ty));
            data.insert(name, t);
        }
        let r = g.add_multi(op(true), &vs).unwrap();
        g.set_output("y", r[0]);
        g.set_output("lse", r[1]);
        let res = run64(&g, &BTreeMap::new(), &data);
        assert_close(&out(&res, "y"), &want, 1e-12);
        assert_close(&out(&res, "lse"), &want_lse, 1e-12);
        eprintln!("{what}: ok");
    }
}

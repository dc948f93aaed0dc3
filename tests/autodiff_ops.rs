//! Every op's backward rule, one small graph at a time: `loss = sum(f(params) * r)` for
//! a fixed random `r`; the gradients `autodiff` writes, executed, must equal candle's
//! autograd of the forward (itself checked against finite differences in the runtime's
//! tests), in f64.

use std::collections::BTreeMap;
use weft_ir::*;
use weft_passes::{lookup, PassContext};
use weft_runtime::cpu::{run, Precision, RunOptions};

struct T {
    g: Graph,
    weights: BTreeMap<String, HostTensor>,
    inputs: BTreeMap<String, HostTensor>,
    seed: u64,
}

fn dims(s: &[i64]) -> Vec<Dim> {
    s.iter().map(|&d| Dim::from(d)).collect()
}

impl T {
    fn new() -> T {
        T {
            g: Graph::new("op"),
            weights: BTreeMap::new(),
            inputs: BTreeMap::new(),
            seed: 17,
        }
    }
    fn rand(&mut self, n: usize) -> Vec<f64> {
        (0..n)
            .map(|_| {
                self.seed = self
                    .seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }
    fn param(&mut self, name: &str, shape: &[i64]) -> Value {
        let n = shape.iter().product::<i64>() as usize;
        let v = self.rand(n);
        self.weights.insert(
            name.into(),
            HostTensor::floats(DType::F32, shape.iter().map(|&d| d as usize).collect(), v),
        );
        self.g
            .add(
                Op::Param {
                    name: name.into(),
                    ty: TensorType::new(DType::F32, dims(shape)),
                },
                &[],
            )
            .unwrap()
    }
    /// A positive param (for log, sqrt, pow bases).
    fn pos_param(&mut self, name: &str, shape: &[i64]) -> Value {
        let v = self.param(name, shape);
        if let Some(HostData::F64(d)) = self.weights.get_mut(name).map(|t| &mut t.data) {
            d.iter_mut().for_each(|x| *x = x.abs() + 0.5);
        }
        v
    }
    fn ints(&mut self, name: &str, shape: &[i64], data: Vec<i64>, dtype: DType) -> Value {
        self.inputs.insert(
            name.into(),
            HostTensor::ints(dtype, shape.iter().map(|&d| d as usize).collect(), data),
        );
        self.g
            .add(
                Op::Input {
                    name: name.into(),
                    role: Role::Other,
                    ty: TensorType::new(dtype, dims(shape)),
                },
                &[],
            )
            .unwrap()
    }
    fn op(&mut self, op: Op, xs: &[Value]) -> Value {
        self.g.add(op, xs).unwrap_or_else(|e| panic!("{e}"))
    }
    fn ops(&mut self, op: Op, xs: &[Value]) -> Vec<Value> {
        self.g.add_multi(op, xs).unwrap()
    }
    /// `loss = sum(y * r)` for each of `ys` (added), then checks the gradients.
    fn check(self, what: &str, ys: &[Value]) {
        self.check_tol(what, ys, 1e-9)
    }

    fn check_tol(mut self, what: &str, ys: &[Value], tol: f64) {
        let mut loss: Option<Value> = None;
        for (i, &y) in ys.iter().enumerate() {
            let ty = self.g.ty(y).with_dtype(DType::F32);
            let y = if self.g.ty(y).dtype != DType::F32 {
                self.op(Op::Cast { dtype: DType::F32 }, &[y])
            } else {
                y
            };
            let mut b = Bindings::new();
            for (a, n) in &self.g.mesh.axes {
                b = b.with(a, *n as i64);
            }
            let shape: Vec<i64> = ty.shape.iter().map(|d| d.eval(&b).unwrap()).collect();
            let n = shape.iter().product::<i64>() as usize;
            let r = self.rand(n);
            let name = format!("r{i}");
            self.inputs.insert(
                name.clone(),
                HostTensor::floats(DType::F32, shape.iter().map(|&d| d as usize).collect(), r),
            );
            let rv = self
                .g
                .add(
                    Op::Input {
                        name,
                        role: Role::Other,
                        ty,
                    },
                    &[],
                )
                .unwrap();
            let p = self.op(Op::Mul {}, &[y, rv]);
            let all: Vec<i64> = (0..shape.len() as i64).collect();
            let mut s = self.op(
                Op::Sum {
                    dims: all,
                    keepdim: false,
                },
                &[p],
            );
            // On a mesh: the same loss on every rank (each rank's sum, added).
            for (a, _) in self.g.mesh.axes.clone() {
                s = self.op(
                    Op::AllReduce {
                        axis: a,
                        op: ReduceOp::Sum,
                    },
                    &[s],
                );
            }
            loss = Some(match loss {
                Some(l) => self.op(Op::Add {}, &[l, s]),
                None => s,
            });
        }
        self.g.set_output("loss", loss.unwrap());
        let reference = run(
            &self.g,
            &self.weights,
            &self.inputs,
            &RunOptions::new(Precision::F64).with_grads(true),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut j = self.g.clone();
        lookup("autodiff")
            .unwrap()
            .run(&mut j, &PassContext::default())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        verify(&j).unwrap_or_else(|r| panic!("{what}: {r}"));
        let got = run(
            &j,
            &self.weights,
            &self.inputs,
            &RunOptions::new(Precision::F64),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}\n{}", print(&j)));
        if tol > 1e-9 {
            // The reference is loose here: central differences decide, tightly.
            let loss = |w: &BTreeMap<String, HostTensor>| {
                run(&self.g, w, &self.inputs, &RunOptions::new(Precision::F64))
                    .unwrap()
                    .outputs["loss"]
                    .to_f64()[0]
            };
            for (p, t) in &self.weights {
                let have = got.outputs[&format!("grad.{p}")].to_f64();
                for k in 0..t.numel().min(6) {
                    let eps = 1e-6;
                    let (mut wp, mut wm) = (self.weights.clone(), self.weights.clone());
                    let bump = |w: &mut BTreeMap<String, HostTensor>, d: f64| {
                        if let HostData::F64(v) = &mut w.get_mut(p).unwrap().data {
                            v[k] += d;
                        }
                    };
                    bump(&mut wp, eps);
                    bump(&mut wm, -eps);
                    let fd = (loss(&wp) - loss(&wm)) / (2.0 * eps);
                    assert!(
                        (fd - have[k]).abs() <= 1e-8 * (1.0 + fd.abs()),
                        "{what}: d loss / d {p}[{k}]: autodiff {}, finite differences {fd}",
                        have[k]
                    );
                }
            }
        }
        for (p, want) in &reference.grads {
            let have = &got.outputs[&format!("grad.{p}")];
            let (a, b) = (have.to_f64(), want.to_f64());
            let scale = b.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
            let err = a
                .iter()
                .zip(&b)
                .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= tol * scale, "{what}: grad {p} max abs err {err:e} (scale {scale:e})\nautodiff {a:?}\nautograd {b:?}");
        }
    }
}

#[test]
fn elementwise_unary() {
    let cases: Vec<(&str, Op, bool)> = vec![
        ("neg", Op::Neg {}, false),
        ("exp", Op::Exp {}, false),
        ("log", Op::Log {}, true),
        ("sqrt", Op::Sqrt {}, true),
        ("rsqrt", Op::Rsqrt {}, true),
        ("tanh", Op::Tanh {}, false),
        ("sigmoid", Op::Sigmoid {}, false),
        ("silu", Op::Silu {}, false),
        ("gelu", Op::Gelu { tanh_approx: false }, false),
        ("gelu_tanh", Op::Gelu { tanh_approx: true }, false),
        ("relu", Op::Relu {}, false),
        (
            "scale",
            Op::Scale {
                factor: Float(-1.5),
            },
            false,
        ),
        ("add_scalar", Op::AddScalar { value: Float(2.0) }, false),
        (
            "pow2",
            Op::PowScalar {
                exponent: Float(2.0),
            },
            false,
        ),
        (
            "pow_half",
            Op::PowScalar {
                exponent: Float(0.5),
            },
            true,
        ),
        (
            "pow3",
            Op::PowScalar {
                exponent: Float(3.0),
            },
            false,
        ),
        (
            "pow_inv",
            Op::PowScalar {
                exponent: Float(-1.0),
            },
            true,
        ),
    ];
    for (what, op, positive) in cases {
        let mut t = T::new();
        let x = if positive {
            t.pos_param("x", &[3, 5])
        } else {
            t.param("x", &[3, 5])
        };
        let y = t.op(op, &[x]);
        // candle's autograd of gelu uses 7-digit constants (0.398942, 0.0535161, ...).
        t.check_tol(
            what,
            &[y],
            if what.starts_with("gelu") { 1e-6 } else { 1e-9 },
        );
    }
}

#[test]
fn elementwise_binary_with_broadcasting() {
    for (what, op) in [
        ("add", Op::Add {}),
        ("sub", Op::Sub {}),
        ("mul", Op::Mul {}),
        ("div", Op::Div {}),
        ("pow", Op::Pow {}),
        ("maximum", Op::Maximum {}),
        ("minimum", Op::Minimum {}),
    ] {
        for (sa, sb) in [
            (&[2, 3, 4][..], &[2, 3, 4][..]),
            (&[2, 3, 4], &[4]),
            (&[2, 1, 4], &[3, 1]),
            (&[1], &[2, 3]),
        ] {
            let mut t = T::new();
            let a = t.pos_param("a", sa);
            let b = t.pos_param("b", sb);
            let y = t.op(op.clone(), &[a, b]);
            t.check(&format!("{what} {sa:?} {sb:?}"), &[y]);
        }
    }
    // Ties split the gradient evenly (torch).
    let mut t = T::new();
    let a = t.param("a", &[4]);
    let y = t.op(Op::Maximum {}, &[a, a]);
    t.check("maximum tie", &[y]);
}

#[test]
fn where_compare_cast() {
    let mut t = T::new();
    let a = t.param("a", &[3, 4]);
    let b = t.param("b", &[4]);
    let c = t.op(Op::Compare { op: CmpOp::Gt }, &[a, b]);
    let y = t.op(Op::Where {}, &[c, a, b]);
    let z = t.op(Op::Cast { dtype: DType::BF16 }, &[y]);
    t.check("where + cast", &[z]);
}

#[test]
fn reductions() {
    for (what, mk) in [
        (
            "sum",
            &(|d: Vec<i64>, k: bool| Op::Sum {
                dims: d,
                keepdim: k,
            }) as &dyn Fn(Vec<i64>, bool) -> Op,
        ),
        ("mean", &|d, k| Op::Mean {
            dims: d,
            keepdim: k,
        }),
        ("max", &|d, k| Op::Max {
            dims: d,
            keepdim: k,
        }),
    ] {
        for (ds, keep) in [
            (vec![1], false),
            (vec![0, 2], true),
            (vec![-1], true),
            (vec![0, 1, 2], false),
        ] {
            let mut t = T::new();
            let x = t.param("x", &[2, 3, 4]);
            let y = t.op(mk(ds.clone(), keep), &[x]);
            t.check(&format!("{what} {ds:?} keepdim={keep}"), &[y]);
        }
    }
    for (what, op) in [
        ("softmax", Op::Softmax { dim: 1 }),
        ("log_softmax", Op::LogSoftmax { dim: -1 }),
        ("softmax0", Op::Softmax { dim: 0 }),
    ] {
        let mut t = T::new();
        let x = t.param("x", &[3, 5]);
        let y = t.op(op, &[x]);
        // candle's autograd of gelu uses 7-digit constants (0.398942, 0.0535161, ...).
        t.check_tol(
            what,
            &[y],
            if what.starts_with("gelu") { 1e-6 } else { 1e-9 },
        );
    }
}

#[test]
fn linear_and_matmul() {
    for (xs, bias) in [(&[5, 4][..], false), (&[2, 3, 4], true), (&[4], true)] {
        let mut t = T::new();
        let x = t.param("x", xs);
        let w = t.param("w", &[6, 4]);
        let mut ops = vec![x, w];
        if bias {
            ops.push(t.param("b", &[6]));
        }
        let y = t.op(Op::Linear {}, &ops);
        t.check(&format!("linear {xs:?} bias={bias}"), &[y]);
    }
    for ta in [false, true] {
        for tb in [false, true] {
            for (sa, sb) in [
                (vec![3, 4], vec![4, 5]),
                (vec![2, 3, 4], vec![4, 5]),
                (vec![2, 1, 3, 4], vec![3, 4, 5]),
            ] {
                let mut t = T::new();
                let mut sa = sa.clone();
                let mut sb = sb.clone();
                let (ra, rb) = (sa.len(), sb.len());
                if ta {
                    sa.swap(ra - 1, ra - 2);
                }
                if tb {
                    sb.swap(rb - 1, rb - 2);
                }
                let a = t.param("a", &sa);
                let b = t.param("b", &sb);
                let y = t.op(
                    Op::Matmul {
                        transpose_a: ta,
                        transpose_b: tb,
                    },
                    &[a, b],
                );
                t.check(&format!("matmul {sa:?} {sb:?} ta={ta} tb={tb}"), &[y]);
            }
        }
    }
}

#[test]
fn transformer_blocks() {
    // rms_norm
    let mut t = T::new();
    let x = t.param("x", &[2, 3, 8]);
    let w = t.param("w", &[8]);
    let y = t.op(Op::RmsNorm { eps: Float(1e-6) }, &[x, w]);
    t.check("rms_norm", &[y]);
    // rope, whole and partial rotary dim
    for rot in [8i64, 4] {
        let mut t = T::new();
        let x = t.param("x", &[2, 3, 5, 8]);
        let pos = t.ints(
            "pos",
            &[2, 5],
            (0..10).map(|i| (i * 3 % 7) as i64).collect(),
            DType::I64,
        );
        let cs = t.ops(
            Op::RopeTable {
                theta: Float(100.0),
                dim: rot,
                scaling: RopeScaling::None,
            },
            &[pos],
        );
        let y = t.op(
            Op::Rope {
                layout: weft_ir::HeadLayout::Bhsd,
            },
            &[x, cs[0], cs[1]],
        );
        t.check(&format!("rope dim {rot}"), &[y]);
    }
    // attention: GQA, causal or not, with a mask
    for (causal, mask) in [(true, false), (false, false), (true, true), (false, true)] {
        let mut t = T::new();
        let q = t.param("q", &[2, 4, 5, 3]);
        let k = t.param("k", &[2, 2, 5, 3]);
        let v = t.param("v", &[2, 2, 5, 3]);
        let mut ops = vec![q, k, v];
        if mask {
            let m: Vec<i64> = (0..2 * 25)
                .map(|i| ((i % 5 == i / 5 % 5) || i % 3 != 0) as i64)
                .collect();
            ops.push(t.ints("mask", &[2, 1, 5, 5], m, DType::Bool));
        }
        let y = t.op(
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal,
                scale: Float(0.6),
                window: None,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            },
            &ops,
        );
        t.check(&format!("attention causal={causal} mask={mask}"), &[y]);
    }
    // attention: window (shorter than the sequence), soft-cap, a value head dim of its
    // own, sinks and the log-sum-exp result (its gradient folds into attention_grad)
    for (window, softcap, dv, sinks, lse) in [
        (Some(2i64), None, 3i64, false, false),
        (Some(3), Some(0.9), 4, false, false),
        (None, Some(1.5), 2, true, false),
        (Some(2), None, 3, true, true),
        (Some(4), Some(2.0), 5, false, true),
    ] {
        let mut t = T::new();
        let q = t.param("q", &[2, 4, 7, 3]);
        let k = t.param("k", &[2, 2, 7, 3]);
        let v = t.param("v", &[2, 2, 7, dv]);
        let mut ops = vec![q, k, v];
        if sinks {
            ops.push(t.param("sinks", &[4]));
        }
        let op = Op::Attention {
            layout: weft_ir::HeadLayout::Bhsd,
            causal: true,
            scale: Float(0.6),
            window,
            softcap: softcap.map(Float),
            sinks: sinks.into(),
            lse: lse.into(),
        };
        let ys = t.g.add_multi(op, &ops).unwrap();
        t.check(
            &format!(
                "attention window={window:?} softcap={softcap:?} dv={dv} sinks={sinks} lse={lse}"
            ),
            &ys,
        );
    }
    // embedding, cross-entropy (none, sum, mean)
    let mut t = T::new();
    let w = t.param("w", &[7, 4]);
    let ids = t.ints("ids", &[2, 3], vec![0, 6, 2, 2, 5, 1], DType::I64);
    let y = t.op(Op::Embedding { padding_idx: None }, &[ids, w]);
    t.check("embedding (repeated ids)", &[y]);
    for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
        let mut t = T::new();
        let x = t.param("x", &[2, 3, 6]);
        let lab = t.ints("labels", &[2, 3], vec![1, -100, 5, 0, 0, -100], DType::I64);
        let y = t.op(
            Op::CrossEntropy {
                ignore_index: -100,
                reduction: red,
            },
            &[x, lab],
        );
        t.check(&format!("cross_entropy {}", red.keyword()), &[y]);
    }
}

#[test]
fn layout_and_indexing() {
    let mut t = T::new();
    let x = t.param("x", &[2, 3, 4]);
    let a = t.op(
        Op::Reshape {
            shape: dims(&[6, 4]),
        },
        &[x],
    );
    let b = t.op(
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        &[x],
    );
    let c = t.op(Op::Transpose { dim0: 0, dim1: 2 }, &[x]);
    let d = t.op(
        Op::Slice {
            dim: 2,
            start: Dim::from(1),
            len: Dim::from(2),
        },
        &[x],
    );
    let e = t.op(
        Op::Slice {
            dim: 0,
            start: Dim::from(0),
            len: Dim::from(1),
        },
        &[x],
    );
    let s = t.ops(
        Op::Split {
            dim: 1,
            sizes: dims(&[1, 2]),
        },
        &[x],
    );
    let f = t.op(Op::Concat { dim: 2 }, &[x, d]);
    let one = t.param("one", &[1, 4]);
    let h = t.op(
        Op::Expand {
            shape: dims(&[2, 3, 4]),
        },
        &[one],
    );
    t.check(
        "reshape, permute, transpose, slice, split (one part used), concat, expand",
        &[a, b, c, d, e, s[1], f, h],
    );

    let mut t = T::new();
    let x = t.param("x", &[3, 5]);
    let idx = t.ints("idx", &[3, 2], vec![0, 4, 4, 4, 2, 1], DType::I64);
    let g1 = t.op(Op::Gather { dim: 1 }, &[x, idx]);
    let sel = t.ints("sel", &[4], vec![2, 0, 2, 1], DType::I64);
    let g2 = t.op(Op::IndexSelect { dim: 0 }, &[x, sel]);
    let tk = t.ops(Op::Topk { k: 2, dim: 1 }, &[x]);
    let dst = t.param("dst", &[3, 5]);
    let src = t.param("src", &[3, 2]);
    let sa = t.op(Op::ScatterAdd { dim: 1 }, &[dst, idx, src]);
    t.check(
        "gather, index_select, topk, scatter_add",
        &[g1, g2, tk[0], sa],
    );
}

#[test]
fn mixture_of_experts() {
    let mut t = T::new();
    let x = t.param("x", &[5, 4]);
    let router = t.param("router", &[3, 4]);
    let w1 = t.param("w1", &[3, 6, 4]);
    let logits = t.op(Op::Linear {}, &[x, router]);
    let probs = t.op(Op::Softmax { dim: -1 }, &[logits]);
    let tk = t.ops(Op::Topk { k: 2, dim: -1 }, &[probs]);
    let d = t.ops(Op::MoeDispatch { num_experts: 3 }, &[x, tk[1]]);
    let h = t.op(
        Op::GroupedMatmul {
            transpose_w: Default::default(),
        },
        &[d[0], w1, d[1]],
    );
    let h = t.op(Op::Silu {}, &[h]);
    let w2 = t.param("w2", &[3, 4, 6]);
    let o = t.op(
        Op::GroupedMatmul {
            transpose_w: Default::default(),
        },
        &[h, w2, d[1]],
    );
    let y = t.op(Op::MoeCombine {}, &[o, d[2], tk[0]]);
    t.check("router, dispatch, grouped matmuls, combine", &[y]);
}

#[test]
fn collectives_transpose_under_replication() {
    // On sp=2: a rank-varying slice, all_gather, reduce_scatter, all_to_all, all_reduce
    // (sum, avg, max) and broadcast, ending in a replicated loss; candle's autograd
    // runs across the simulated ranks and sums replicas, as the gradient of the SPMD
    // program must.
    let mut t = T::new();
    t.g.mesh = Mesh::parse("sp=2").unwrap();
    let sp = |a: &str| a.to_string();
    let x = t.param("x", &[4, 6]);
    let w = t.param("w", &[4, 6]);
    let start = Dim::coord("sp") * Dim::from(2);
    let a = t.op(
        Op::Slice {
            dim: 0,
            start,
            len: Dim::from(2),
        },
        &[x],
    ); // varies over sp
    let a2 = t.op(Op::Mul {}, &[a, a]);
    let b = t.op(
        Op::AllGather {
            axis: sp("sp"),
            dim: 0,
        },
        &[a2],
    ); // replicated, [2*sp, 6]
    let b = t.op(
        Op::Slice {
            dim: 0,
            start: Dim::zero(),
            len: Dim::from(4),
        },
        &[b],
    );
    let bw = t.op(Op::Mul {}, &[b, w]);
    let c = t.op(
        Op::ReduceScatter {
            axis: sp("sp"),
            dim: 1,
            op: ReduceOp::Sum,
        },
        &[bw],
    ); // varies
    let c = t.op(Op::Tanh {}, &[c]);
    let d = t.op(
        Op::AllToAll {
            axis: sp("sp"),
            scatter_dim: 0,
            gather_dim: 1,
        },
        &[c],
    ); // varies
    let e = t.op(
        Op::AllReduce {
            axis: sp("sp"),
            op: ReduceOp::Avg,
        },
        &[d],
    ); // replicated
    let m = t.op(
        Op::AllReduce {
            axis: sp("sp"),
            op: ReduceOp::Max,
        },
        &[d],
    );
    let f = t.op(
        Op::AllGather {
            axis: sp("sp"),
            dim: 1,
        },
        &[c],
    );
    let fx = t.op(Op::Mul {}, &[f, x]);
    let g = t.op(
        Op::Broadcast {
            axis: sp("sp"),
            root: 1,
        },
        &[fx],
    );
    let s = t.op(Op::Add {}, &[e, m]);
    t.check("collectives on sp=2", &[s, g]);
}

//! The backward rule of every non-collective op: given the gradients of its results,
//! the gradient of each operand that needs one. Broadcasting is undone by summing
//! (`unbroadcast`), layout ops by their inverses, `slice` by a zero-padded `concat`,
//! `split` and `concat` by each other, index ops by `scatter_add` into zeros, the
//! top-k values likewise, `moe_dispatch` by a `moe_combine` with unit weights, and
//! `rope` by `rope` with the sine negated (cos and sin are symmetric in their halves).

use super::{err, Ad};
use crate::pass::PassError;
use weft_ir::{CmpOp, DType, Dim, Float, Node, NodeData, Op, TensorType, Value};

impl Ad<'_> {
    fn zeros(&mut self, ty: &TensorType) -> Result<Value, PassError> {
        self.op(
            Op::Full {
                value: Float(0.0),
                ty: ty.clone(),
            },
            &[],
        )
    }

    fn scalar(&mut self, value: f64, dtype: DType) -> Result<Value, PassError> {
        self.op(
            Op::Full {
                value: Float(value),
                ty: TensorType::scalar(dtype),
            },
            &[],
        )
    }

    fn mul(&mut self, a: Value, b: Value) -> Result<Value, PassError> {
        self.op(Op::Mul {}, &[a, b])
    }

    fn reshape(&mut self, x: Value, shape: &[Dim]) -> Result<Value, PassError> {
        if self.g.ty(x).shape == shape {
            return Ok(x);
        }
        self.op(
            Op::Reshape {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }

    fn mask_of(&mut self, cond: Value, dtype: DType) -> Result<Value, PassError> {
        self.op(Op::Cast { dtype }, &[cond])
    }

    /// Sums `g` (the gradient of a broadcast result) down to `target`'s shape: over the
    /// leading dims `target` lacks and the dims where `target` has size 1.
    pub(crate) fn unbroadcast(
        &mut self,
        g: Value,
        target: &TensorType,
    ) -> Result<Value, PassError> {
        let gt = self.ty(g);
        if gt.shape == target.shape {
            return Ok(g);
        }
        let (n, m) = (gt.rank(), target.rank());
        if m > n {
            return Err(err(
                "`autodiff` cannot undo a broadcast",
                self.g.describe(self.g.def(g)),
                format!("{gt} is not a broadcast of {target}"),
            ));
        }
        let lead = n - m;
        let one = Dim::from(1);
        let dims: Vec<i64> = (0..n)
            .filter(|&i| i < lead || (target.shape[i - lead] == one && gt.shape[i] != one))
            .map(|i| i as i64)
            .collect();
        let s = if dims.is_empty() {
            g
        } else {
            self.op(
                Op::Sum {
                    dims,
                    keepdim: false,
                },
                &[g],
            )?
        };
        self.reshape(s, &target.shape)
    }

    /// `reshape(dy)` to `x_ty` with the reduced dims kept as size 1, then expanded.
    fn expand_back(
        &mut self,
        dy: Value,
        x_ty: &TensorType,
        dims: &[usize],
        keepdim: bool,
    ) -> Result<Value, PassError> {
        let kept: Vec<Dim> = x_ty
            .shape
            .iter()
            .enumerate()
            .map(|(i, d)| {
                if dims.contains(&i) {
                    Dim::from(1)
                } else {
                    d.clone()
                }
            })
            .collect();
        let dk = if keepdim {
            dy
        } else {
            self.reshape(dy, &kept)?
        };
        self.op(
            Op::Expand {
                shape: x_ty.shape.clone(),
            },
            &[dk],
        )
    }

    fn norm_dims(&self, n: Node, dims: &[i64], rank: usize) -> Result<Vec<usize>, PassError> {
        dims.iter()
            .map(|&d| {
                weft_ir::shape::norm_dim(d, rank)
                    .map_err(|m| err("`autodiff`: bad dim", self.g.describe(n), m))
            })
            .collect()
    }

    /// The gradient of each operand (`None`: not wanted or zero) of non-collective node
    /// `n` from its results' gradients `dy` (`None`: zero).
    pub(crate) fn vjp(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
        want: &[bool],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let ops = &d.operands;
        let ty = |s: &Self, i: usize| s.ty(ops[i]);
        let y = d.results[0];
        let mut out: Vec<Option<Value>> = vec![None; ops.len()];
        // Ops with several results first; the rest have one result and need its gradient.
        match &d.op {
            Op::Split { dim, .. } => {
                let mut parts = Vec::new();
                for (r, g) in d.results.iter().zip(dy) {
                    parts.push(match g {
                        Some(g) => *g,
                        None => {
                            let t = self.ty(*r);
                            self.zeros(&t)?
                        }
                    });
                }
                out[0] = Some(if parts.len() == 1 {
                    parts[0]
                } else {
                    self.op(Op::Concat { dim: *dim }, &parts)?
                });
                return Ok(out);
            }
            Op::Topk { dim, .. } => {
                let Some(dv) = dy[0] else { return Ok(out) };
                let z = self.zeros(&ty(self, 0))?;
                out[0] = Some(self.op(Op::ScatterAdd { dim: *dim }, &[z, d.results[1], dv])?);
                return Ok(out);
            }
            Op::MoeDispatch { .. } => {
                let Some(drows) = dy[0] else { return Ok(out) };
                let (x, ei) = (ty(self, 0), ty(self, 1));
                let ones = self.op(
                    Op::Full {
                        value: Float(1.0),
                        ty: TensorType::new(x.dtype, ei.shape.clone()),
                    },
                    &[],
                )?;
                out[0] = Some(self.op(Op::MoeCombine {}, &[drows, d.results[2], ones])?);
                return Ok(out);
            }
            Op::LinearCrossEntropy {
                ignore_index,
                chunk,
                scale,
                softcap,
            } => {
                // One gradient op takes both statistics' gradients (zero where one has
                // none) and recomputes the logits chunk by chunk from the saved lse.
                if dy.iter().all(|g| g.is_none()) {
                    return Ok(out);
                }
                let mut grads = Vec::new();
                for (r, g) in d.results.iter().zip(dy) {
                    grads.push(match g {
                        Some(g) => *g,
                        None => {
                            let t = self.ty(*r);
                            self.zeros(&t)?
                        }
                    });
                }
                let r = self.ops(
                    Op::LinearCrossEntropyGrad {
                        ignore_index: *ignore_index,
                        chunk: *chunk,
                        scale: *scale,
                        softcap: *softcap,
                    },
                    &[ops[0], ops[1], ops[2], y, grads[0], grads[1]],
                )?;
                let w = |i: usize| want.get(i).copied().unwrap_or(false);
                out[0] = w(0).then_some(r[0]);
                out[1] = w(1).then_some(r[1]);
                return Ok(out);
            }
            Op::RopeTable { .. } => return Ok(out),
            // `fuse` runs last, but a fused program (a forward plan, a .weft file) may
            // come back for a training step.
            Op::AddRmsNorm { eps } => {
                let wants = |i: usize| want.get(i).copied().unwrap_or(false);
                let Some(dnorm) = dy[1] else {
                    (out[0], out[1]) = (dy[0].filter(|_| wants(0)), dy[0].filter(|_| wants(1)));
                    return Ok(out);
                };
                let (sum, w) = (d.results[0], ops[2]);
                let r = match dy[0] {
                    Some(dsum) => {
                        self.ops(Op::AddRmsNormGrad { eps: *eps }, &[sum, w, dnorm, dsum])?
                    }
                    None => self.ops(Op::RmsNormGrad { eps: *eps }, &[sum, w, dnorm])?,
                };
                (out[0], out[1]) = (wants(0).then_some(r[0]), wants(1).then_some(r[0]));
                out[2] = wants(2).then_some(r[1]);
                return Ok(out);
            }
            Op::Attention {
                causal,
                scale,
                window,
                softcap,
                sinks,
                lse,
            } => {
                // out and (lse=true) the log-sum-exp: one attention_grad takes both
                // gradients, a zero one for out when it has none.
                if dy.iter().all(|g| g.is_none()) {
                    return Ok(out);
                }
                let slots = d
                    .op
                    .attention_operands(ops.len())
                    .expect("an attention")
                    .map_err(|m| err("`autodiff`: malformed attention", self.g.describe(n), m))?;
                let dout = match dy[0] {
                    Some(g) => g,
                    None => {
                        let t = self.ty(y);
                        self.zeros(&t)?
                    }
                };
                let mut operands = vec![ops[0], ops[1], ops[2], y, dout];
                operands.extend(slots.mask.map(|i| ops[i]));
                operands.extend(slots.sinks.map(|i| ops[i]));
                // Without a gradient on the log-sum-exp, attention_grad is told there is none.
                let dlse = if lse.0 {
                    dy.get(1).copied().flatten()
                } else {
                    None
                };
                operands.extend(dlse);
                let r = self.ops(
                    Op::AttentionGrad {
                        causal: *causal,
                        scale: *scale,
                        window: *window,
                        softcap: *softcap,
                        sinks: *sinks,
                        lse: dlse.is_some().into(),
                    },
                    &operands,
                )?;
                let w = |i: usize| want.get(i).copied().unwrap_or(false);
                for i in 0..3 {
                    out[i] = w(i).then_some(r[i]);
                }
                if let Some(i) = slots.sinks {
                    if w(i) {
                        // dsinks comes in f32; the sinks may be stored narrower.
                        let st = self.ty(ops[i]);
                        out[i] = Some(if st.dtype == DType::F32 {
                            r[3]
                        } else {
                            self.op(Op::Cast { dtype: st.dtype }, &[r[3]])?
                        });
                    }
                }
                return Ok(out);
            }
            Op::RingAttention {
                axis,
                causal,
                scale,
                window,
                softcap,
            } => {
                // The ring as one unit: its backward re-sends k/v around the ring
                // (`ring-lower` expands it), so only q, k, v, out and lse are saved.
                if dy.get(1).copied().flatten().is_some() {
                    return Err(err(
                        "`autodiff` cannot differentiate a ring attention's log-sum-exp result",
                        self.g.describe(n),
                        "ring_attention_grad takes the gradient of out only",
                    ));
                }
                let Some(dout) = dy[0] else { return Ok(out) };
                let r = self.ops(
                    Op::RingAttentionGrad {
                        axis: axis.clone(),
                        causal: *causal,
                        scale: *scale,
                        window: *window,
                        softcap: *softcap,
                    },
                    &[ops[0], ops[1], ops[2], y, d.results[1], dout],
                )?;
                for i in 0..3 {
                    out[i] = want[i].then_some(r[i]);
                }
                return Ok(out);
            }
            _ => {}
        }
        if d.results.len() != 1 {
            return Err(err(
                format!("`autodiff` has no backward rule for `{}`", d.op.name()),
                self.g.describe(n),
                "it has several results",
            ));
        }
        let Some(g) = dy[0] else { return Ok(out) };
        let gt = self.ty(g);
        let w = |i: usize| want.get(i).copied().unwrap_or(false);
        match &d.op {
            Op::Param { .. } | Op::Input { .. } | Op::Full { .. } | Op::Arange { .. } => {}
            // ---- elementwise ----
            Op::Neg {} => out[0] = Some(self.op(Op::Neg {}, &[g])?),
            Op::Exp {} => out[0] = Some(self.mul(g, y)?),
            Op::Log {} => out[0] = Some(self.op(Op::Div {}, &[g, ops[0]])?),
            Op::Sqrt {} => {
                // d sqrt(x) = 1 / (2 sqrt(x))
                let h = self.op(Op::Scale { factor: Float(0.5) }, &[g])?;
                out[0] = Some(self.op(Op::Div {}, &[h, y])?);
            }
            Op::Rsqrt {} => {
                // d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
                let y3 = self.op(
                    Op::PowScalar {
                        exponent: Float(3.0),
                    },
                    &[y],
                )?;
                let t = self.mul(g, y3)?;
                out[0] = Some(self.op(
                    Op::Scale {
                        factor: Float(-0.5),
                    },
                    &[t],
                )?);
            }
            Op::Tanh {} => {
                let y2 = self.mul(y, y)?;
                let ny2 = self.op(Op::Neg {}, &[y2])?;
                let d1 = self.op(Op::AddScalar { value: Float(1.0) }, &[ny2])?;
                out[0] = Some(self.mul(g, d1)?);
            }
            Op::Sigmoid {} => {
                let ny = self.op(Op::Neg {}, &[y])?;
                let one_minus = self.op(Op::AddScalar { value: Float(1.0) }, &[ny])?;
                let dsig = self.mul(y, one_minus)?;
                out[0] = Some(self.mul(g, dsig)?);
            }
            Op::Silu {} => out[0] = Some(self.op(Op::SiluGrad {}, &[ops[0], g])?),
            Op::Glu { act } => {
                let r = self.ops(Op::GluGrad { act: *act }, &[ops[0], ops[1], g])?;
                (out[0], out[1]) = (w(0).then_some(r[0]), w(1).then_some(r[1]));
            }
            Op::Gelu { tanh_approx } => {
                out[0] = Some(self.op(
                    Op::GeluGrad {
                        tanh_approx: *tanh_approx,
                    },
                    &[ops[0], g],
                )?)
            }
            Op::Relu {} => {
                let x = ty(self, 0);
                let z = self.scalar(0.0, x.dtype)?;
                let pos = self.op(Op::Compare { op: CmpOp::Gt }, &[ops[0], z])?;
                let m = self.mask_of(pos, x.dtype)?;
                out[0] = Some(self.mul(g, m)?);
            }
            Op::Scale { factor } => out[0] = Some(self.op(Op::Scale { factor: *factor }, &[g])?),
            Op::AddScalar { .. } => out[0] = Some(g),
            Op::PowScalar { exponent } => {
                let e = exponent.0;
                out[0] = Some(if e == 1.0 {
                    g
                } else if e == 2.0 {
                    let t = self.mul(g, ops[0])?;
                    self.op(Op::Scale { factor: Float(2.0) }, &[t])?
                } else {
                    let p = self.op(
                        Op::PowScalar {
                            exponent: Float(e - 1.0),
                        },
                        &[ops[0]],
                    )?;
                    let p = self.op(Op::Scale { factor: Float(e) }, &[p])?;
                    self.mul(g, p)?
                });
            }
            Op::Cast { .. } => {
                let x = ty(self, 0);
                if x.dtype.is_float() {
                    out[0] = Some(if x.dtype == gt.dtype {
                        g
                    } else {
                        self.op(Op::Cast { dtype: x.dtype }, &[g])?
                    });
                }
            }
            Op::Add {} | Op::Sub {} => {
                if w(0) {
                    let t = ty(self, 0);
                    out[0] = Some(self.unbroadcast(g, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let gb = if matches!(d.op, Op::Sub {}) {
                        self.op(Op::Neg {}, &[g])?
                    } else {
                        g
                    };
                    out[1] = Some(self.unbroadcast(gb, &t)?);
                }
            }
            Op::Mul {} => {
                for (i, j) in [(0, 1), (1, 0)] {
                    if w(i) {
                        let t = ty(self, i);
                        let p = self.mul(g, ops[j])?;
                        out[i] = Some(self.unbroadcast(p, &t)?);
                    }
                }
            }
            Op::Div {} => {
                if w(0) {
                    let t = ty(self, 0);
                    let q = self.op(Op::Div {}, &[g, ops[1]])?;
                    out[0] = Some(self.unbroadcast(q, &t)?);
                }
                if w(1) {
                    // d(a/b)/db = -a/b^2 = -y/b
                    let t = ty(self, 1);
                    let q = self.op(Op::Div {}, &[y, ops[1]])?;
                    let p = self.mul(g, q)?;
                    let p = self.op(Op::Neg {}, &[p])?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
            }
            Op::Pow {} => {
                if w(0) {
                    // b a^(b-1) = b y / a
                    let t = ty(self, 0);
                    let q = self.op(Op::Div {}, &[y, ops[0]])?;
                    let q = self.mul(q, ops[1])?;
                    let p = self.mul(g, q)?;
                    out[0] = Some(self.unbroadcast(p, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let l = self.op(Op::Log {}, &[ops[0]])?;
                    let q = self.mul(y, l)?;
                    let p = self.mul(g, q)?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
            }
            Op::Maximum {} | Op::Minimum {} => {
                // torch: the winner takes the gradient, ties split it evenly.
                let dt = gt.dtype;
                let cmp = if matches!(d.op, Op::Maximum {}) {
                    CmpOp::Gt
                } else {
                    CmpOp::Lt
                };
                let win = self.op(Op::Compare { op: cmp }, &[ops[0], ops[1]])?;
                let tie = self.op(Op::Compare { op: CmpOp::Eq }, &[ops[0], ops[1]])?;
                let win = self.mask_of(win, dt)?;
                let tie = self.mask_of(tie, dt)?;
                let half = self.op(Op::Scale { factor: Float(0.5) }, &[tie])?;
                let ma = self.op(Op::Add {}, &[win, half])?;
                if w(0) {
                    let t = ty(self, 0);
                    let p = self.mul(g, ma)?;
                    out[0] = Some(self.unbroadcast(p, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let nm = self.op(Op::Neg {}, &[ma])?;
                    let mb = self.op(Op::AddScalar { value: Float(1.0) }, &[nm])?;
                    let p = self.mul(g, mb)?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
            }
            Op::Where {} => {
                let z = self.scalar(0.0, gt.dtype)?;
                if w(1) {
                    let t = ty(self, 1);
                    let p = self.op(Op::Where {}, &[ops[0], g, z])?;
                    out[1] = Some(self.unbroadcast(p, &t)?);
                }
                if w(2) {
                    let t = ty(self, 2);
                    let p = self.op(Op::Where {}, &[ops[0], z, g])?;
                    out[2] = Some(self.unbroadcast(p, &t)?);
                }
            }
            Op::Compare { .. }
            | Op::ShiftLabels { .. }
            | Op::CountValid { .. }
            | Op::OneHot { .. } => {}

            // ---- reductions ----
            Op::Sum { dims, keepdim } => {
                let x = ty(self, 0);
                let ds = self.norm_dims(n, dims, x.rank())?;
                out[0] = Some(if ds.is_empty() {
                    g
                } else {
                    self.expand_back(g, &x, &ds, *keepdim)?
                });
            }
            Op::Mean { dims, keepdim } => {
                let x = ty(self, 0);
                let ds = self.norm_dims(n, dims, x.rank())?;
                if ds.is_empty() {
                    out[0] = Some(g);
                } else {
                    let count = ds.iter().fold(Dim::from(1), |a, &i| a * x.shape[i].clone());
                    let e = self.expand_back(g, &x, &ds, *keepdim)?;
                    out[0] = Some(match count.as_const() {
                        Some(c) => self.op(
                            Op::Scale {
                                factor: Float(1.0 / c as f64),
                            },
                            &[e],
                        )?,
                        None => {
                            let ones = self.op(
                                Op::Full {
                                    value: Float(1.0),
                                    ty: TensorType::new(
                                        x.dtype,
                                        ds.iter().map(|&i| x.shape[i].clone()).collect(),
                                    ),
                                },
                                &[],
                            )?;
                            let cnt = self.op(
                                Op::Sum {
                                    dims: (0..ds.len() as i64).collect(),
                                    keepdim: false,
                                },
                                &[ones],
                            )?;
                            self.op(Op::Div {}, &[e, cnt])?
                        }
                    });
                }
            }
            Op::Max { dims, keepdim } => {
                // amax: the gradient is shared evenly by the maxima.
                let x = ty(self, 0);
                let ds = self.norm_dims(n, dims, x.rank())?;
                if ds.is_empty() {
                    out[0] = Some(g);
                } else {
                    let kept: Vec<Dim> = x
                        .shape
                        .iter()
                        .enumerate()
                        .map(|(i, d)| {
                            if ds.contains(&i) {
                                Dim::from(1)
                            } else {
                                d.clone()
                            }
                        })
                        .collect();
                    let yk = if *keepdim { y } else { self.reshape(y, &kept)? };
                    let gk = if *keepdim { g } else { self.reshape(g, &kept)? };
                    let hit = self.op(Op::Compare { op: CmpOp::Eq }, &[ops[0], yk])?;
                    let m = self.mask_of(hit, x.dtype)?;
                    let cnt = self.op(
                        Op::Sum {
                            dims: ds.iter().map(|&i| i as i64).collect(),
                            keepdim: true,
                        },
                        &[m],
                    )?;
                    let share = self.op(Op::Div {}, &[gk, cnt])?;
                    out[0] = Some(self.mul(m, share)?);
                }
            }
            Op::Softmax { dim } => out[0] = Some(self.op(Op::SoftmaxGrad { dim: *dim }, &[y, g])?),
            Op::LogSoftmax { dim } => {
                let s = self.op(
                    Op::Sum {
                        dims: vec![*dim],
                        keepdim: true,
                    },
                    &[g],
                )?;
                let p = self.op(Op::Exp {}, &[y])?;
                let ps = self.mul(p, s)?;
                out[0] = Some(self.op(Op::Sub {}, &[g, ps])?);
            }

            // ---- transformer blocks ----
            Op::Embedding { padding_idx } => {
                let wt = ty(self, 1);
                out[1] = Some(self.op(
                    Op::EmbeddingGrad {
                        num_embeddings: wt.shape[0].clone(),
                        padding_idx: padding_idx.clone(),
                    },
                    &[ops[0], g],
                )?);
            }
            Op::Linear {} => {
                let (xt, wt) = (ty(self, 0), ty(self, 1));
                let (nout, kin) = (wt.shape[0].clone(), wt.shape[1].clone());
                let lead: Vec<Dim> = xt.shape[..xt.rank() - 1].to_vec();
                let m = lead.iter().fold(Dim::from(1), |a, d| a * d.clone());
                if w(0) {
                    let g2 = if gt.rank() >= 2 {
                        g
                    } else {
                        self.reshape(g, &[Dim::from(1), nout.clone()])?
                    };
                    let dx = self.op(
                        Op::Matmul {
                            transpose_a: false,
                            transpose_b: false,
                        },
                        &[g2, ops[1]],
                    )?;
                    out[0] = Some(self.reshape(dx, &xt.shape)?);
                }
                if w(1) {
                    let g2 = self.reshape(g, &[m.clone(), nout.clone()])?;
                    let x2 = self.reshape(ops[0], &[m.clone(), kin.clone()])?;
                    out[1] = Some(self.op(
                        Op::Matmul {
                            transpose_a: true,
                            transpose_b: false,
                        },
                        &[g2, x2],
                    )?);
                }
                if ops.len() > 2 && w(2) {
                    let lead_dims: Vec<i64> = (0..gt.rank() as i64 - 1).collect();
                    out[2] = Some(if lead_dims.is_empty() {
                        g
                    } else {
                        self.op(
                            Op::Sum {
                                dims: lead_dims,
                                keepdim: false,
                            },
                            &[g],
                        )?
                    });
                }
            }
            Op::Matmul {
                transpose_a: ta,
                transpose_b: tb,
            }
            | Op::MatmulAdd {
                transpose_a: ta,
                transpose_b: tb,
            } => {
                let (ta, tb) = (*ta, *tb);
                // matmul_add's addend has the sum's type: its gradient is the sum's.
                if matches!(d.op, Op::MatmulAdd { .. }) && w(2) {
                    out[2] = Some(g);
                }
                if w(0) {
                    let t = ty(self, 0);
                    let da = if !ta {
                        self.op(
                            Op::Matmul {
                                transpose_a: false,
                                transpose_b: !tb,
                            },
                            &[g, ops[1]],
                        )?
                    } else {
                        self.op(
                            Op::Matmul {
                                transpose_a: tb,
                                transpose_b: true,
                            },
                            &[ops[1], g],
                        )?
                    };
                    out[0] = Some(self.unbroadcast(da, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let db = if !tb {
                        self.op(
                            Op::Matmul {
                                transpose_a: !ta,
                                transpose_b: false,
                            },
                            &[ops[0], g],
                        )?
                    } else {
                        self.op(
                            Op::Matmul {
                                transpose_a: true,
                                transpose_b: ta,
                            },
                            &[g, ops[0]],
                        )?
                    };
                    out[1] = Some(self.unbroadcast(db, &t)?);
                }
            }
            Op::Fp8Matmul {
                transpose_a: ta,
                transpose_b: tb,
                format_a: fa,
                format_b: fb,
            } => {
                // Straight-through, as matmul's rule, each product an fp8_matmul whose
                // incoming gradient is quantized to e5m2 and whose other operand keeps
                // its forward format.
                let (ta, tb, fa, fb) = (*ta, *tb, *fa, *fb);
                let g8 = weft_ir::Fp8Format::E5m2;
                let fp8 = |transpose_a, transpose_b, format_a, format_b| Op::Fp8Matmul {
                    transpose_a,
                    transpose_b,
                    format_a,
                    format_b,
                };
                if w(0) {
                    let t = ty(self, 0);
                    let da = if !ta {
                        self.op(fp8(false, !tb, g8, fb), &[g, ops[1]])?
                    } else {
                        self.op(fp8(tb, true, fb, g8), &[ops[1], g])?
                    };
                    out[0] = Some(self.unbroadcast(da, &t)?);
                }
                if w(1) {
                    let t = ty(self, 1);
                    let db = if !tb {
                        self.op(fp8(!ta, false, fa, g8), &[ops[0], g])?
                    } else {
                        self.op(fp8(true, ta, g8, fa), &[g, ops[0]])?
                    };
                    out[1] = Some(self.unbroadcast(db, &t)?);
                }
            }
            Op::RmsNorm { eps } => {
                let r = self.ops(Op::RmsNormGrad { eps: *eps }, &[ops[0], ops[1], g])?;
                out[0] = w(0).then_some(r[0]);
                out[1] = w(1).then_some(r[1]);
            }
            Op::Rope {} => {
                if w(1) || w(2) {
                    return Err(err(
                        "`autodiff` cannot differentiate `rope` wrt its tables",
                        self.g.describe(n),
                        "cos and sin depend on a parameter",
                    ));
                }
                let ns = self.op(Op::Neg {}, &[ops[2]])?;
                out[0] = Some(self.op(Op::Rope {}, &[g, ops[1], ns])?);
            }
            Op::CrossEntropy {
                ignore_index,
                reduction,
            } => {
                out[0] = Some(self.op(
                    Op::CrossEntropyGrad {
                        ignore_index: *ignore_index,
                        reduction: *reduction,
                    },
                    &[ops[0], ops[1], g],
                )?);
            }

            // ---- layout ----
            Op::Reshape { .. } => {
                let t = ty(self, 0);
                out[0] = Some(self.op(Op::Reshape { shape: t.shape }, &[g])?);
            }
            Op::Permute { perm } => {
                let r = perm.len();
                let mut inv = vec![0i64; r];
                for (i, &p) in perm.iter().enumerate() {
                    let p = weft_ir::shape::norm_dim(p, r)
                        .map_err(|m| err("`autodiff`: bad permutation", self.g.describe(n), m))?;
                    inv[p] = i as i64;
                }
                out[0] = Some(self.op(Op::Permute { perm: inv }, &[g])?);
            }
            Op::Transpose { dim0, dim1 } => {
                out[0] = Some(self.op(
                    Op::Transpose {
                        dim0: *dim0,
                        dim1: *dim1,
                    },
                    &[g],
                )?)
            }
            Op::Zigzag {
                dim,
                parts,
                inverse,
            } => {
                // A permutation: its transpose is the inverse permutation.
                out[0] = Some(self.op(
                    Op::Zigzag {
                        dim: *dim,
                        parts: *parts,
                        inverse: !*inverse,
                    },
                    &[g],
                )?)
            }
            Op::Slice { dim, start, len } => {
                // Zeros before and after this slice's gradient.
                let x = ty(self, 0);
                let k = weft_ir::shape::norm_dim(*dim, x.rank())
                    .map_err(|m| err("`autodiff`: bad slice", self.g.describe(n), m))?;
                let after = x.shape[k].clone() - start.clone() - len.clone();
                let mut parts = Vec::new();
                for (size, is_g) in [(start.clone(), false), (len.clone(), true), (after, false)] {
                    if is_g {
                        parts.push(g);
                    } else if size.as_const() != Some(0) {
                        let mut shape = x.shape.clone();
                        shape[k] = size;
                        parts.push(self.zeros(&x.with_shape(shape))?);
                    }
                }
                out[0] = Some(if parts.len() == 1 {
                    g
                } else {
                    self.op(Op::Concat { dim: *dim }, &parts)?
                });
            }
            Op::Concat { dim } => {
                let sizes: Vec<Dim> = ops
                    .iter()
                    .map(|v| {
                        let t = self.g.ty(*v);
                        weft_ir::shape::norm_dim(*dim, t.rank()).map(|k| t.shape[k].clone())
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|m| err("`autodiff`: bad concat", self.g.describe(n), m))?;
                let parts = if ops.len() == 1 {
                    vec![g]
                } else {
                    self.ops(Op::Split { dim: *dim, sizes }, &[g])?
                };
                for (i, p) in parts.into_iter().enumerate() {
                    out[i] = w(i).then_some(p);
                }
            }
            Op::Expand { .. } => {
                let t = ty(self, 0);
                out[0] = Some(self.unbroadcast(g, &t)?);
            }
            Op::Gather { dim } => {
                let t = ty(self, 0);
                let z = self.zeros(&t)?;
                out[0] = Some(self.op(Op::ScatterAdd { dim: *dim }, &[z, ops[1], g])?);
            }
            Op::IndexSelect { dim } => {
                let t = ty(self, 0);
                let k = weft_ir::shape::norm_dim(*dim, t.rank())
                    .map_err(|m| err("`autodiff`: bad index_select", self.g.describe(n), m))?;
                let idx_len = self.g.ty(ops[1]).shape[0].clone();
                let col: Vec<Dim> = (0..gt.rank())
                    .map(|i| {
                        if i == k {
                            idx_len.clone()
                        } else {
                            Dim::from(1)
                        }
                    })
                    .collect();
                let idx = self.reshape(ops[1], &col)?;
                let idx = self.op(
                    Op::Expand {
                        shape: gt.shape.clone(),
                    },
                    &[idx],
                )?;
                let z = self.zeros(&t)?;
                out[0] = Some(self.op(Op::ScatterAdd { dim: *dim }, &[z, idx, g])?);
            }
            Op::ScatterAdd { dim } => {
                out[0] = w(0).then_some(g);
                if w(2) {
                    out[2] = Some(self.op(Op::Gather { dim: *dim }, &[g, ops[1]])?);
                }
            }
            Op::GroupedMatmul { transpose_w } => {
                let bias = ops.len() > 3;
                let grad = Op::GroupedMatmulGrad {
                    transpose_w: *transpose_w,
                    bias: bias.into(),
                };
                let r = self.ops(grad, &[ops[0], ops[1], ops[2], g])?;
                out[0] = w(0).then_some(r[0]);
                out[1] = w(1).then_some(r[1]);
                if bias {
                    out[3] = w(3).then_some(r[2]);
                }
            }
            Op::MoeCombine {} => {
                let r = self.ops(Op::MoeCombineGrad {}, &[ops[0], ops[1], ops[2], g])?;
                out[0] = w(0).then_some(r[0]);
                out[2] = w(2).then_some(r[1]);
            }
            Op::Offload { .. } | Op::Reload { .. } => out[0] = Some(g),
            other => {
                return Err(err(
                    format!("`autodiff` has no backward rule for `{}`", other.name()),
                    self.g.describe(n),
                    "it is a backward or optimizer op, or new",
                )
                .with_help(
                    "run autodiff on the forward graph, before grad-sync and the optimizer",
                ))
            }
        }
        Ok(out)
    }
}

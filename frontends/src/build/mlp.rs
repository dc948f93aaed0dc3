//! MLPs. Dense: `down(act(gate(x)) * up(x))` with the config's activation (`hidden_act`:
//! SiLU, GELU or ReLU; Gemma's `hidden_activation`)
//! (phi3: one `gate_up_proj`, split gate first). Sparse (mixtral, qwen3_moe), as transformers 5's router and fused experts:
//! tokens flattened to [B*S, H]; router `linear` → f32 `softmax` → `topk` →
//! renormalise (mixtral always, qwen3_moe with `norm_topk_prob`) → model dtype;
//! `moe_dispatch` → `grouped_matmul` with `gate_up_proj` [E, 2I, H] → split (gate
//! first, as `chunk(2)`) → `act(gate) * up` → `grouped_matmul` with `down_proj`
//! [E, H, I] → `moe_combine` with the routing weights → [B, S, H].
//! Each router's probabilities and top-k indices are kept for the load-balancing loss
//! (see [`super::aux_loss`]).
//!
//! gpt-oss (`GptOssMLP`): router `linear` with bias → `topk` of the logits → `softmax`
//! over the k selected (model dtype); `grouped_matmul {transpose_w}` with `gate_up_proj`
//! [E, H, 2I] and its bias → de-interleave (reshape [R, I, 2], split, gate = even
//! columns, up = odd) → `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with
//! `g = min(gate, 7)` → `grouped_matmul {transpose_w}` with `down_proj` [E, I, H] and
//! its bias → `moe_combine`.
//!
//! deepseek_v3: the router is [`Builder::group_limited_router`] (sigmoid, correction
//! bias for the choice only, group-limited top-k, routed scaling), and the always-on
//! `shared_experts` MLP of the layer's input is added to the routed output.

use super::Builder;
use crate::config::{
    Activation, MoeConfig, MoeKind, Router, GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT,
};
use crate::error::FrontendError;
use weft_ir::{CmpOp, DType, Dim, Float, Op, TensorType, Value};

impl Builder<'_> {
    pub(super) fn mlp(&mut self, layer: usize, h: Value) -> Result<Value, FrontendError> {
        let m = format!("model.layers.{layer}.mlp");
        let cfg = self.cfg;
        if let Some(moe) = cfg.moe.as_ref().filter(|_| cfg.is_sparse_layer(layer)) {
            return match moe.kind {
                MoeKind::Softmax => self.moe(&m, h, moe),
                MoeKind::GptOss => self.gpt_oss_moe(&m, h, moe),
            };
        }
        let inter = Dim::from(self.cfg.intermediate_size);
        let (gate, up) = if self.cfg.fused_projections {
            let gu = self.linear(&format!("{m}.gate_up_proj"), h)?;
            self.scope(&m);
            let parts = self.ops(
                Op::Split {
                    dim: -1,
                    sizes: vec![inter.clone(), inter],
                },
                &[gu],
            )?;
            (parts[0], parts[1])
        } else {
            let gate = self.linear(&format!("{m}.gate_proj"), h)?;
            let up = self.linear(&format!("{m}.up_proj"), h)?;
            (gate, up)
        };
        self.scope(&m);
        let act = self.op(self.activation(), &[gate])?;
        let y = self.op(Op::Mul {}, &[act, up])?;
        self.linear(&format!("{m}.down_proj"), y)
    }

    /// The gate's activation (`hidden_act`, Gemma's `hidden_activation`), in the dense
    /// MLP and the experts alike.
    fn activation(&self) -> Op {
        match self.cfg.activation {
            Activation::Silu => Op::Silu {},
            Activation::GeluTanh => Op::Gelu { tanh_approx: true },
            Activation::Gelu => Op::Gelu { tanh_approx: false },
            Activation::Relu => Op::Relu {},
        }
    }

    fn moe(&mut self, m: &str, h: Value, moe: &MoeConfig) -> Result<Value, FrontendError> {
        let dtype = self.dtype();
        let (b, s, hidden) = (
            Dim::sym("B"),
            Dim::sym("S"),
            Dim::from(self.cfg.hidden_size),
        );
        let inter = Dim::from(moe.expert_intermediate_size);

        self.scope(m);
        let x = self.reshape(h, vec![b.clone() * s.clone(), hidden.clone()])?;

        let router = format!("{m}.gate");
        let (mut weights, index) = match moe.router {
            Router::Softmax => {
                let mut logits = self.linear(&router, x)?;
                if dtype != DType::F32 {
                    logits = self.op(Op::Cast { dtype: DType::F32 }, &[logits])?;
                }
                let probs = self.op(Op::Softmax { dim: -1 }, &[logits])?;
                let top = self.ops(
                    Op::Topk {
                        k: moe.top_k as i64,
                        dim: -1,
                    },
                    &[probs],
                )?;
                self.routers.push((probs, top[1]));
                (top[0], top[1])
            }
            Router::GroupLimitedSigmoid {
                n_group,
                topk_group,
                routed_scaling_factor,
            } => self.group_limited_router(
                &router,
                x,
                moe,
                n_group,
                topk_group,
                routed_scaling_factor,
            )?,
        };
        if moe.norm_topk_prob && moe.router == Router::Softmax {
            let total = self.op(
                Op::Sum {
                    dims: vec![-1],
                    keepdim: true,
                },
                &[weights],
            )?;
            weights = self.op(Op::Div {}, &[weights, total])?;
        }
        if dtype != DType::F32 {
            weights = self.op(Op::Cast { dtype }, &[weights])?;
        }

        let experts = format!("{m}.experts");
        let gate_up = self.param(&format!("{experts}.gate_up_proj"));
        let down = self.param(&format!("{experts}.down_proj"));
        self.scope(&experts);
        let d = self.ops(
            Op::MoeDispatch {
                num_experts: moe.num_experts as i64,
            },
            &[x, index],
        )?;
        let (rows, counts, order) = (d[0], d[1], d[2]);
        let gu = self.op(
            Op::GroupedMatmul {
                transpose_w: Default::default(),
            },
            &[rows, gate_up, counts],
        )?;
        let parts = self.ops(
            Op::Split {
                dim: 1,
                sizes: vec![inter.clone(), inter],
            },
            &[gu],
        )?;
        let act = self.op(self.activation(), &[parts[0]])?;
        let y = self.op(Op::Mul {}, &[act, parts[1]])?;
        let y = self.op(
            Op::GroupedMatmul {
                transpose_w: Default::default(),
            },
            &[y, down, counts],
        )?;
        let out = self.op(Op::MoeCombine {}, &[y, order, weights])?;

        self.scope(m);
        let out = self.reshape(out, vec![b, s, hidden])?;
        if moe.shared_expert_intermediate_size.is_none() {
            return Ok(out);
        }
        let shared = self.dense_mlp(&format!("{m}.shared_experts"), h)?;
        self.scope(m);
        self.op(Op::Add {}, &[out, shared])
    }

    fn gpt_oss_moe(&mut self, m: &str, h: Value, moe: &MoeConfig) -> Result<Value, FrontendError> {
        let dtype = self.dtype();
        let (b, s, hidden) = (
            Dim::sym("B"),
            Dim::sym("S"),
            Dim::from(self.cfg.hidden_size),
        );
        let inter = Dim::from(moe.expert_intermediate_size);

        self.scope(m);
        let x = self.reshape(h, vec![b.clone() * s.clone(), hidden.clone()])?;
        let router = format!("{m}.router");
        let logits = self.linear(&router, x)?;
        let top = self.ops(
            Op::Topk {
                k: moe.top_k as i64,
                dim: -1,
            },
            &[logits],
        )?;
        let (values, index) = (top[0], top[1]);
        let weights = self.op(Op::Softmax { dim: -1 }, &[values])?;
        if moe.aux_loss_coef.is_some() {
            // load_balancing_loss_func: softmax over every expert of the router logits;
            // its top-k picks the experts the logits' top-k picked.
            let mut l = logits;
            if dtype != DType::F32 {
                l = self.op(Op::Cast { dtype: DType::F32 }, &[l])?;
            }
            let probs = self.op(Op::Softmax { dim: -1 }, &[l])?;
            self.routers.push((probs, index));
        }

        let experts = format!("{m}.experts");
        let p = |n: &str| format!("{experts}.{n}");
        let (gate_up, gate_up_bias, down, down_bias) = (
            self.param(&p("gate_up_proj")),
            self.param(&p("gate_up_proj_bias")),
            self.param(&p("down_proj")),
            self.param(&p("down_proj_bias")),
        );
        self.scope(&experts);
        let d = self.ops(
            Op::MoeDispatch {
                num_experts: moe.num_experts as i64,
            },
            &[x, index],
        )?;
        let (rows, counts, order) = (d[0], d[1], d[2]);
        let transposed = Op::GroupedMatmul {
            transpose_w: true.into(),
        };
        let gu = self.op(transposed.clone(), &[rows, gate_up, counts, gate_up_bias])?;
        let r = self.g.ty(gu).shape[0].clone();
        let pairs = self.reshape(gu, vec![r.clone(), inter.clone(), Dim::from(2)])?;
        let parts = self.ops(
            Op::Split {
                dim: 2,
                sizes: vec![Dim::from(1), Dim::from(1)],
            },
            &[pairs],
        )?;
        let gate = self.reshape(parts[0], vec![r.clone(), inter.clone()])?;
        let up = self.reshape(parts[1], vec![r, inter])?;
        let limit = |b: &mut Self, v: f64| {
            b.op(
                Op::Full {
                    value: Float(v),
                    ty: TensorType::new(dtype, vec![]),
                },
                &[],
            )
        };
        let hi = limit(self, GPT_OSS_SWIGLU_LIMIT)?;
        let lo = limit(self, -GPT_OSS_SWIGLU_LIMIT)?;
        let gate = self.op(Op::Minimum {}, &[gate, hi])?;
        let up = self.op(Op::Minimum {}, &[up, hi])?;
        let up = self.op(Op::Maximum {}, &[up, lo])?;
        let slope = self.op(
            Op::Scale {
                factor: Float(GPT_OSS_SWIGLU_ALPHA),
            },
            &[gate],
        )?;
        let sig = self.op(Op::Sigmoid {}, &[slope])?;
        let glu = self.op(Op::Mul {}, &[gate, sig])?;
        let up1 = self.op(Op::AddScalar { value: Float(1.0) }, &[up])?;
        let y = self.op(Op::Mul {}, &[up1, glu])?;
        let y = self.op(transposed, &[y, down, counts, down_bias])?;
        let out = self.op(Op::MoeCombine {}, &[y, order, weights])?;

        self.scope(m);
        self.reshape(out, vec![b, s, hidden])
    }

    /// `down(silu(gate(x)) * up(x))` in `module` with separate projections.
    fn dense_mlp(&mut self, module: &str, h: Value) -> Result<Value, FrontendError> {
        let gate = self.linear(&format!("{module}.gate_proj"), h)?;
        let up = self.linear(&format!("{module}.up_proj"), h)?;
        self.scope(module);
        let act = self.op(self.activation(), &[gate])?;
        let y = self.op(Op::Mul {}, &[act, up])?;
        self.linear(&format!("{module}.down_proj"), y)
    }

    /// DeepSeek-V3's `DeepseekV3TopkRouter` on tokens `x` [T, H]: routing weights [T, k]
    /// (f32, renormalised and scaled) and expert indices [T, k].
    ///
    /// f32 `linear` → `sigmoid` scores; the choice adds `e_score_correction_bias`; with
    /// fewer kept groups than groups, each group's score is the sum of its top-2 biased
    /// scores and the experts of groups scoring below the `topk_group`-th best are masked
    /// (to the lowest f32, below any score); `topk` of the rest gives the indices; the
    /// weights are the *unbiased* scores there (`gather`), over their sum + 1e-20 with
    /// `norm_topk_prob`, times `routed_scaling_factor`. (A tie at the group threshold
    /// keeps every tied group, where torch's `topk` keeps one; real-valued scores tie with
    /// probability zero.)
    fn group_limited_router(
        &mut self,
        router: &str,
        x: Value,
        moe: &MoeConfig,
        n_group: usize,
        topk_group: usize,
        scaling: f64,
    ) -> Result<(Value, Value), FrontendError> {
        let t = Dim::sym("B") * Dim::sym("S");
        let e = moe.num_experts;
        let d = Dim::from;
        let w = self.param(&format!("{router}.weight"));
        let bias = self.param(&format!("{router}.e_score_correction_bias"));
        self.scope(router);
        let (mut xf, mut wf, mut bias) = (x, w, bias);
        if self.dtype() != DType::F32 {
            // HF computes the router in f32; the bias buffer may have been converted to
            // the model dtype (`convert-dtype`), so it is cast back like the operands.
            xf = self.op(Op::Cast { dtype: DType::F32 }, &[x])?;
            wf = self.op(Op::Cast { dtype: DType::F32 }, &[w])?;
            bias = self.op(Op::Cast { dtype: DType::F32 }, &[bias])?;
        }
        let logits = self.op(Op::Linear {}, &[xf, wf])?;
        let scores = self.op(Op::Sigmoid {}, &[logits])?;
        let mut choice = self.op(Op::Add {}, &[scores, bias])?;
        if topk_group < n_group {
            let per = e / n_group;
            let grouped = self.reshape(choice, vec![t.clone(), d(n_group), d(per)])?;
            let top2 = self.ops(Op::Topk { k: 2, dim: -1 }, &[grouped])?;
            let group_scores = self.op(
                Op::Sum {
                    dims: vec![-1],
                    keepdim: false,
                },
                &[top2[0]],
            )?;
            let best = self.ops(
                Op::Topk {
                    k: topk_group as i64,
                    dim: -1,
                },
                &[group_scores],
            )?;
            let threshold = self.op(
                Op::Slice {
                    dim: -1,
                    start: d(topk_group - 1),
                    len: d(1),
                },
                &[best[0]],
            )?;
            let kept = self.op(Op::Compare { op: CmpOp::Ge }, &[group_scores, threshold])?;
            let kept = self.reshape(kept, vec![t.clone(), d(n_group), d(1)])?;
            let kept = self.op(
                Op::Expand {
                    shape: vec![t.clone(), d(n_group), d(per)],
                },
                &[kept],
            )?;
            let kept = self.reshape(kept, vec![t.clone(), d(e)])?;
            let lowest = self.op(
                Op::Full {
                    value: Float(f32::MIN as f64),
                    ty: TensorType::scalar(DType::F32),
                },
                &[],
            )?;
            // (convert-dtype turns fills into the model dtype; the router stays f32)
            let lowest = if self.dtype() != DType::F32 {
                self.op(Op::Cast { dtype: DType::F32 }, &[lowest])?
            } else {
                lowest
            };
            choice = self.op(Op::Where {}, &[kept, choice, lowest])?;
        }
        let top = self.ops(
            Op::Topk {
                k: moe.top_k as i64,
                dim: -1,
            },
            &[choice],
        )?;
        let index = top[1];
        let mut weights = self.op(Op::Gather { dim: -1 }, &[scores, index])?;
        if moe.norm_topk_prob {
            let total = self.op(
                Op::Sum {
                    dims: vec![-1],
                    keepdim: true,
                },
                &[weights],
            )?;
            let total = self.op(
                Op::AddScalar {
                    value: Float(1e-20),
                },
                &[total],
            )?;
            weights = self.op(Op::Div {}, &[weights, total])?;
        }
        if scaling != 1.0 {
            weights = self.op(
                Op::Scale {
                    factor: Float(scaling),
                },
                &[weights],
            )?;
        }
        Ok((weights, index))
    }
}

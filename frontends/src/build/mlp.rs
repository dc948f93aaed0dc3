//! MLPs. Dense: `down(act(gate(x)) * up(x))` with SiLU (Gemma: GELU, `hidden_activation`)
//! (phi3: one `gate_up_proj`, split gate first). Sparse (mixtral, qwen3_moe), as transformers 5's router and fused experts:
//! tokens flattened to [B*S, H]; router `linear` → f32 `softmax` → `topk` →
//! renormalise (mixtral always, qwen3_moe with `norm_topk_prob`) → model dtype;
//! `moe_dispatch` → `grouped_matmul` with `gate_up_proj` [E, 2I, H] → split (gate
//! first, as `chunk(2)`) → `silu(gate) * up` → `grouped_matmul` with `down_proj`
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

use super::Builder;
use crate::config::{Activation, MoeConfig, MoeKind, GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT};
use crate::error::FrontendError;
use weft_ir::{DType, Dim, Float, Op, TensorType, Value};

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
        let act = match self.cfg.activation {
            Activation::Silu => Op::Silu {},
            Activation::GeluTanh => Op::Gelu { tanh_approx: true },
            Activation::Gelu => Op::Gelu { tanh_approx: false },
        };
        let act = self.op(act, &[gate])?;
        let y = self.op(Op::Mul {}, &[act, up])?;
        self.linear(&format!("{m}.down_proj"), y)
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
        let (mut weights, index) = (top[0], top[1]);
        self.routers.push((probs, index));
        if moe.norm_topk_prob {
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
        let act = self.op(Op::Silu {}, &[parts[0]])?;
        let y = self.op(Op::Mul {}, &[act, parts[1]])?;
        let y = self.op(
            Op::GroupedMatmul {
                transpose_w: Default::default(),
            },
            &[y, down, counts],
        )?;
        let out = self.op(Op::MoeCombine {}, &[y, order, weights])?;

        self.scope(m);
        self.reshape(out, vec![b, s, hidden])
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
}

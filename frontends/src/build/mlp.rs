//! MLPs. Dense: `down(act(gate(x)) * up(x))` with SiLU (Gemma: GELU, `hidden_activation`)
//! (phi3: one `gate_up_proj`, split gate first). Sparse (mixtral, qwen3_moe), as transformers 5's router and fused experts:
//! tokens flattened to [B*S, H]; router `linear` → f32 `softmax` → `topk` →
//! renormalise (mixtral always, qwen3_moe with `norm_topk_prob`) → model dtype;
//! `moe_dispatch` → `grouped_matmul` with `gate_up_proj` [E, 2I, H] → split (gate
//! first, as `chunk(2)`) → `silu(gate) * up` → `grouped_matmul` with `down_proj`
//! [E, H, I] → `moe_combine` with the routing weights → [B, S, H].
//! Each router's probabilities and top-k indices are kept for the load-balancing loss
//! (see [`super::aux_loss`]).

use super::Builder;
use crate::config::{Activation, MoeConfig};
use crate::error::FrontendError;
use weft_ir::{DType, Dim, Op, Value};

impl Builder<'_> {
    pub(super) fn mlp(&mut self, layer: usize, h: Value) -> Result<Value, FrontendError> {
        let m = format!("model.layers.{layer}.mlp");
        let cfg = self.cfg;
        if let Some(moe) = cfg.moe.as_ref().filter(|_| cfg.is_sparse_layer(layer)) {
            return self.moe(&m, h, moe);
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
        let gu = self.op(Op::GroupedMatmul {}, &[rows, gate_up, counts])?;
        let parts = self.ops(
            Op::Split {
                dim: 1,
                sizes: vec![inter.clone(), inter],
            },
            &[gu],
        )?;
        let act = self.op(Op::Silu {}, &[parts[0]])?;
        let y = self.op(Op::Mul {}, &[act, parts[1]])?;
        let y = self.op(Op::GroupedMatmul {}, &[y, down, counts])?;
        let out = self.op(Op::MoeCombine {}, &[y, order, weights])?;

        self.scope(m);
        self.reshape(out, vec![b, s, hidden])
    }
}

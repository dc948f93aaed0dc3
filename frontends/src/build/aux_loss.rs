//! The MoE load-balancing loss of transformers' `load_balancing_loss_func` (Switch
//! Transformer eqs. 4-6), as Mixtral and Qwen3-MoE add it with `output_router_logits`.
//!
//! Over the rows of *every* MoE layer together (B*S rows per layer, no attention mask:
//! Weft's inputs have none, which is HF's `attention_mask=None`; labels play no part):
//!
//! ```text
//! tokens[e] = sum_l count of top-k slots routed to e in layer l     # one_hot -> sum
//! probs[e]  = sum_l sum_t softmax(router_logits_l)[t, e]
//! rows      = sum_e tokens[e] / k                                    # = L_moe * B*S, exact
//! aux       = E * sum_e (tokens[e] / rows) * (probs[e] / rows)
//! ```
//!
//! The top-k indices are those the routing uses (HF takes `topk` of the same softmax),
//! so the counts carry no gradient and the gradient reaches the routers through the
//! mean probabilities. The per-layer sums are over the token dim, so after sharding
//! they are per-rank partial sums that `sp-loss` completes with an `all_reduce` over the
//! token axes before the division: the fractions stay global means over every token.

use super::Builder;
use crate::config::MoeConfig;
use crate::error::FrontendError;
use weft_ir::{DType, Float, Op, TensorType, Value};

impl Builder<'_> {
    /// The aux loss over the routers recorded by `moe` (scope `loss.aux`): an f32 scalar.
    pub(super) fn aux_loss(&mut self, moe: &MoeConfig) -> Result<Value, FrontendError> {
        let routers = std::mem::take(&mut self.routers);
        let e = moe.num_experts as i64;
        let sum = |dims: Vec<i64>| Op::Sum {
            dims,
            keepdim: false,
        };
        let mut tokens: Option<Value> = None;
        let mut probs: Option<Value> = None;
        for (p, index) in routers {
            let source = self.g.node(self.g.def(p)).meta.source.clone();
            self.g.set_scope(source.as_deref());
            let hot = self.op(
                Op::OneHot {
                    num_classes: e,
                    dtype: DType::F32,
                },
                &[index],
            )?;
            let counts = self.op(sum(vec![0, 1]), &[hot])?;
            let psum = self.op(sum(vec![0]), &[p])?;
            self.scope("loss.aux");
            tokens = Some(match tokens {
                Some(t) => self.op(Op::Add {}, &[t, counts])?,
                None => counts,
            });
            probs = Some(match probs {
                Some(t) => self.op(Op::Add {}, &[t, psum])?,
                None => psum,
            });
        }
        let (Some(tokens), Some(probs)) = (tokens, probs) else {
            return Err(FrontendError::config(
                &self.model,
                "output_router_logits",
                "is true but the model has no MoE layer to take router logits from",
            ));
        };
        self.scope("loss.aux");
        let slots = self.op(sum(vec![0]), &[tokens])?;
        let k = self.op(
            Op::Full {
                value: Float(moe.top_k as f64),
                ty: TensorType::new(DType::F32, vec![]),
            },
            &[],
        )?;
        let rows = self.op(Op::Div {}, &[slots, k])?;
        let fraction = self.op(Op::Div {}, &[tokens, rows])?;
        let mean_prob = self.op(Op::Div {}, &[probs, rows])?;
        let product = self.op(Op::Mul {}, &[fraction, mean_prob])?;
        let dot = self.op(sum(vec![0]), &[product])?;
        self.op(
            Op::Scale {
                factor: Float(e as f64),
            },
            &[dot],
        )
    }
}

//! The MoE load-balancing loss of transformers' `load_balancing_loss_func` (Switch
//! Transformer eqs. 4-6), as Mixtral and Qwen3-MoE add it with `output_router_logits`.
//!
//! Over the rows of *every* MoE layer together (B*S rows per layer, no attention mask:
//! Weft's inputs have none, which is HF's `attention_mask=None`; labels play no part):
//!
//! ```text
//! tokens[t, e] = sum_l top-k slots of token t routed to e in layer l   # one_hot -> sum
//! probs[t, e]  = sum_l softmax(router_logits_l)[t, e]
//! tokens, probs = split(sum_t concat(tokens, probs))                   # one token sum
//! rows         = sum_e tokens[e] / k                                   # = L_moe * B*S, exact
//! aux          = E * sum_e (tokens[e] / rows) * (probs[e] / rows)
//! ```
//!
//! The top-k indices are those the routing uses (HF takes `topk` of the same softmax),
//! so the counts carry no gradient and the gradient reaches the routers through the
//! mean probabilities. The one sum over the tokens is, after sharding, a per-rank
//! partial sum that `shard-seq` completes with an `all_reduce` over the token axes
//! (dp, sp) before the division: the fractions stay global means over every token, for
//! one collective of 2E floats per step.

use super::Builder;
use crate::config::MoeConfig;
use crate::error::FrontendError;
use weft_ir::{BuildError, DType, Dim, Float, Graph, Op, TensorType, Value};

impl Builder<'_> {
    /// The aux loss over the routers recorded by `moe` (scope `loss.aux`): an f32 scalar.
    pub(super) fn aux_loss(&mut self, moe: &MoeConfig) -> Result<Value, FrontendError> {
        let routers = std::mem::take(&mut self.routers);
        if routers.is_empty() {
            return Err(FrontendError::config(
                &self.model,
                "output_router_logits",
                "is true but the model has no MoE layer to take router logits from",
            ));
        }
        aux_loss(&mut self.g, &routers, moe.num_experts, moe.top_k).map_err(|source| {
            FrontendError::Build {
                model: self.model.clone(),
                source,
            }
        })
    }
}

/// The aux loss over `routers`, each a router's probabilities [T, E] (f32 softmax of its
/// logits) and its top-k indices [T, k], every one over the same T rows: an f32 scalar.
/// The per-layer ops take the scope of the router's probabilities, the rest `loss.aux`.
/// `routers` must not be empty.
pub(crate) fn aux_loss(
    g: &mut Graph,
    routers: &[(Value, Value)],
    num_experts: usize,
    top_k: usize,
) -> Result<Value, BuildError> {
    let e = num_experts as i64;
    let sum = |dims: Vec<i64>| Op::Sum {
        dims,
        keepdim: false,
    };
    // Per token first ([T, E], layers added elementwise), so the sum over the tokens
    // happens once: one reduction (and, sharded, one all_reduce) per step.
    let mut tokens: Option<Value> = None;
    let mut probs: Option<Value> = None;
    for &(p, index) in routers {
        let source = g.node(g.def(p)).meta.source.clone();
        g.set_scope(source.as_deref());
        let hot = g.add(
            Op::OneHot {
                num_classes: e,
                dtype: DType::F32,
            },
            &[index],
        )?;
        let counts = g.add(sum(vec![1]), &[hot])?;
        g.set_scope(Some("loss.aux"));
        tokens = Some(match tokens {
            Some(t) => g.add(Op::Add {}, &[t, counts])?,
            None => counts,
        });
        probs = Some(match probs {
            Some(t) => g.add(Op::Add {}, &[t, p])?,
            None => p,
        });
    }
    let (tokens, probs) = (tokens.expect("routers"), probs.expect("routers"));
    g.set_scope(Some("loss.aux"));
    let per_token = g.add(Op::Concat { dim: 1 }, &[tokens, probs])?;
    let totals = g.add(sum(vec![0]), &[per_token])?;
    let parts = g.add_multi(
        Op::Split {
            dim: 0,
            sizes: vec![Dim::from(e), Dim::from(e)],
        },
        &[totals],
    )?;
    let (tokens, probs) = (parts[0], parts[1]);
    let slots = g.add(sum(vec![0]), &[tokens])?;
    let k = g.add(
        Op::Full {
            value: Float(top_k as f64),
            ty: TensorType::new(DType::F32, vec![]),
        },
        &[],
    )?;
    let rows = g.add(Op::Div {}, &[slots, k])?;
    let fraction = g.add(Op::Div {}, &[tokens, rows])?;
    let mean_prob = g.add(Op::Div {}, &[probs, rows])?;
    let product = g.add(Op::Mul {}, &[fraction, mean_prob])?;
    let dot = g.add(sum(vec![0]), &[product])?;
    g.add(
        Op::Scale {
            factor: Float(e as f64),
        },
        &[dot],
    )
}

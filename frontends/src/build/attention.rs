//! Self-attention as HF writes it: q/k/v projections (phi3: one `qkv_proj`, split q, k,
//! v), olmo2's q/k RMSNorm over the whole projection, view as [B, S, heads, D], qwen3's
//! q/k RMSNorm over D, transpose to [B, heads, S, D], rope on q and k, causal attention
//! with scale `head_dim^-0.5` (granite: `attention_multiplier`; gemma:
//! `query_pre_attn_scalar^-0.5`), the layer's sliding window (`ModelConfig::layer_windows`),
//! gemma2's score soft-cap and, for gpt-oss, the layer's learned per-head `sinks` as the
//! op's sinks operand (GQA inside the op: kv heads are not repeated), back to
//! [B, S, heads*D], `o_proj`.

use super::Builder;
use crate::config::QkNorm;
use crate::error::FrontendError;
use weft_ir::{Dim, Float, Op, Value};

impl Builder<'_> {
    pub(super) fn attention(
        &mut self,
        layer: usize,
        h: Value,
        cos: Value,
        sin: Value,
    ) -> Result<Value, FrontendError> {
        let c = self.cfg;
        if let Some(mla) = &c.mla {
            return self.mla_attention(layer, mla, h, cos, sin);
        }
        let (nq, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let a = format!("model.layers.{layer}.self_attn");
        let (b, s) = (Dim::sym("B"), Dim::sym("S"));
        let heads = |n: usize| vec![b.clone(), s.clone(), Dim::from(n), Dim::from(d)];

        let (q, k, v) = if c.fused_projections {
            let qkv = self.linear(&format!("{a}.qkv_proj"), h)?;
            self.scope(&a);
            let sizes = vec![Dim::from(nq * d), Dim::from(nkv * d), Dim::from(nkv * d)];
            let parts = self.ops(Op::Split { dim: -1, sizes }, &[qkv])?;
            (parts[0], parts[1], parts[2])
        } else {
            let mut q = self.linear(&format!("{a}.q_proj"), h)?;
            let mut k = self.linear(&format!("{a}.k_proj"), h)?;
            let v = self.linear(&format!("{a}.v_proj"), h)?;
            if c.qk_norm == QkNorm::WholeProjection {
                q = self.rms_norm(&format!("{a}.q_norm"), q)?;
                k = self.rms_norm(&format!("{a}.k_norm"), k)?;
            }
            (q, k, v)
        };

        self.scope(&a);
        let mut q = self.reshape(q, heads(nq))?;
        let mut k = self.reshape(k, heads(nkv))?;
        let v = self.reshape(v, heads(nkv))?;
        if c.qk_norm == QkNorm::PerHead {
            q = self.rms_norm(&format!("{a}.q_norm"), q)?;
            k = self.rms_norm(&format!("{a}.k_norm"), k)?;
            self.scope(&a);
        }
        let q = self.transpose(q, 1, 2)?;
        let k = self.transpose(k, 1, 2)?;
        let v = self.transpose(v, 1, 2)?;
        let q = self.op(
            Op::Rope {
                layout: weft_ir::HeadLayout::Bhsd,
            },
            &[q, cos, sin],
        )?;
        let k = self.op(
            Op::Rope {
                layout: weft_ir::HeadLayout::Bhsd,
            },
            &[k, cos, sin],
        )?;
        let scale = Float(
            c.multipliers
                .attention_scale
                .unwrap_or_else(|| (d as f64).powf(-0.5)),
        );
        let mut operands = vec![q, k, v];
        if c.attention_sinks {
            operands.push(self.param(&format!("{a}.sinks")));
            self.scope(&a);
        }
        let o = self.op(
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal: true,
                scale,
                window: c
                    .layer_windows
                    .get(layer)
                    .copied()
                    .flatten()
                    .map(|w| w as i64),
                softcap: c.attn_softcap.map(Float),
                sinks: c.attention_sinks.into(),
                lse: Default::default(),
            },
            &operands,
        )?;
        let o = self.transpose(o, 1, 2)?;
        let o = self.reshape(o, vec![b, s, Dim::from(nq * d)])?;
        self.linear(&format!("{a}.o_proj"), o)
    }
}

//! Multi-head latent attention (DeepSeek-V3), as transformers 5.17's
//! `DeepseekV3Attention` computes it:
//!
//! - q: `q_proj`, or `q_a_proj` → `q_a_layernorm` (eps 1e-6) → `q_b_proj`; viewed as
//!   [B, N, S, nope + rope] and split into the pass-through and rotary parts;
//! - kv: `kv_a_proj_with_mqa` → [latent | shared rope part]; the latent through
//!   `kv_a_layernorm` (eps 1e-6) and `kv_b_proj` to [B, N, S, nope + v], split into the
//!   keys' pass-through part and the values; the rope part [B, 1, S, rope] is one key
//!   part shared by every head (`expand`);
//! - rope on the rotary parts: with `rope_interleave` HF rotates interleaved pairs
//!   `(x0, x1), (x2, x3)...` and returns them de-interleaved (evens then odds); that is
//!   exactly a de-interleave (`[.., r/2, 2]` → transpose → `[.., r]`) followed by the
//!   usual `rotate_half` rope, which is what the graph does;
//! - q = [q_pass | q_rot], k = [k_pass | k_rot], one `attention` with the value head
//!   dim `v_head_dim` (the op's `Dv != D`) and scale `MlaConfig::softmax_scale`;
//! - [B, S, N * v] → `o_proj`.

use super::Builder;
use crate::deepseek::{MlaConfig, LATENT_NORM_EPS};
use crate::error::FrontendError;
use weft_ir::{Dim, Float, Op, Value};

impl Builder<'_> {
    pub(super) fn mla_attention(
        &mut self,
        layer: usize,
        mla: &MlaConfig,
        h: Value,
        cos: Value,
        sin: Value,
    ) -> Result<Value, FrontendError> {
        let c = self.cfg;
        let n = c.num_attention_heads;
        let (nope, rope, vd) = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim);
        let a = format!("model.layers.{layer}.self_attn");
        let (b, s) = (Dim::sym("B"), Dim::sym("S"));
        let d = Dim::from;

        let q = match mla.q_lora_rank {
            None => self.linear(&format!("{a}.q_proj"), h)?,
            Some(_) => {
                let q = self.linear(&format!("{a}.q_a_proj"), h)?;
                let q = self.latent_norm(&format!("{a}.q_a_layernorm"), q)?;
                self.linear(&format!("{a}.q_b_proj"), q)?
            }
        };
        self.scope(&a);
        let q = self.reshape(q, vec![b.clone(), s.clone(), d(n), d(nope + rope)])?;
        let q = self.transpose(q, 1, 2)?;
        let qs = self.ops(
            Op::Split {
                dim: -1,
                sizes: vec![d(nope), d(rope)],
            },
            &[q],
        )?;
        let (q_pass, q_rot) = (qs[0], qs[1]);

        let ckv = self.linear(&format!("{a}.kv_a_proj_with_mqa"), h)?;
        self.scope(&a);
        let parts = self.ops(
            Op::Split {
                dim: -1,
                sizes: vec![d(mla.kv_lora_rank), d(rope)],
            },
            &[ckv],
        )?;
        let (latent, k_rot) = (parts[0], parts[1]);
        let latent = self.latent_norm(&format!("{a}.kv_a_layernorm"), latent)?;
        self.scope(&a);
        let k_rot = self.reshape(k_rot, vec![b.clone(), d(1), s.clone(), d(rope)])?;

        let (q_rot, k_rot) = if mla.rope_interleave {
            (
                self.deinterleave(q_rot, n, rope)?,
                self.deinterleave(k_rot, 1, rope)?,
            )
        } else {
            (q_rot, k_rot)
        };
        let q_rot = self.op(
            Op::Rope {
                layout: weft_ir::HeadLayout::Bhsd,
            },
            &[q_rot, cos, sin],
        )?;
        let k_rot = self.op(
            Op::Rope {
                layout: weft_ir::HeadLayout::Bhsd,
            },
            &[k_rot, cos, sin],
        )?;
        let q = self.op(Op::Concat { dim: -1 }, &[q_pass, q_rot])?;

        let kv = self.linear(&format!("{a}.kv_b_proj"), latent)?;
        self.scope(&a);
        let kv = self.reshape(kv, vec![b.clone(), s.clone(), d(n), d(nope + vd)])?;
        let kv = self.transpose(kv, 1, 2)?;
        let kvs = self.ops(
            Op::Split {
                dim: -1,
                sizes: vec![d(nope), d(vd)],
            },
            &[kv],
        )?;
        let (k_pass, v) = (kvs[0], kvs[1]);
        let k_rot = self.op(
            Op::Expand {
                shape: vec![b.clone(), d(n), s.clone(), d(rope)],
            },
            &[k_rot],
        )?;
        let k = self.op(Op::Concat { dim: -1 }, &[k_pass, k_rot])?;

        let o = self.op(
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal: true,
                scale: Float(mla.softmax_scale),
                window: None,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            },
            &[q, k, v],
        )?;
        let o = self.transpose(o, 1, 2)?;
        let o = self.reshape(o, vec![b, s, d(n * vd)])?;
        self.linear(&format!("{a}.o_proj"), o)
    }

    /// `DeepseekV3RMSNorm(rank)`: HF's default eps, not `rms_norm_eps`.
    fn latent_norm(&mut self, module: &str, x: Value) -> Result<Value, FrontendError> {
        let w = self.param(&format!("{module}.weight"));
        self.scope(module);
        self.op(
            Op::RmsNorm {
                eps: Float(LATENT_NORM_EPS),
            },
            &[x, w],
        )
    }

    /// [B, heads, S, r] with features in pairs `(x0, x1), (x2, x3)...` → evens then odds.
    fn deinterleave(&mut self, x: Value, heads: usize, r: usize) -> Result<Value, FrontendError> {
        let (b, s) = (Dim::sym("B"), Dim::sym("S"));
        let d = Dim::from;
        let pairs = self.reshape(x, vec![b.clone(), d(heads), s.clone(), d(r / 2), d(2)])?;
        let t = self.transpose(pairs, 3, 4)?;
        self.reshape(t, vec![b, d(heads), s, d(r)])
    }
}

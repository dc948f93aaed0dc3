//! The parameters of a config, named and ordered exactly as HF's `named_parameters()`
//! (transformers 5 names: fused `mlp.experts.gate_up_proj` [E, 2I, H] and
//! `mlp.experts.down_proj` [E, H, I], router `mlp.gate.weight`). A tied model has no
//! `lm_head.weight`: the head uses `model.embed_tokens.weight`.

use crate::config::{Family, ModelConfig, MoeKind, NormPlacement, QkNorm};

/// The name of the parameter the output head reads when embeddings are tied.
pub const EMBED: &str = "model.embed_tokens.weight";
/// The name tied models omit.
pub const LM_HEAD: &str = "lm_head.weight";

/// Every parameter as `(name, shape)`, in HF order.
pub fn param_specs(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, nq, nkv, d) = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    );
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    let mut push = |name: String, shape: Vec<usize>| out.push((name, shape));
    push(EMBED.into(), vec![c.vocab_size, h]);
    for i in 0..c.num_hidden_layers {
        let a = format!("model.layers.{i}.self_attn");
        // A module's own parameters come before its submodules' (gpt-oss `sinks`).
        if c.attention_sinks {
            push(format!("{a}.sinks"), vec![nq]);
        }
        if let Some(mla) = &c.mla {
            mla_params(c, mla, &a, &mut push);
        } else if c.fused_projections {
            push(format!("{a}.o_proj.weight"), vec![h, nq * d]);
            push(format!("{a}.qkv_proj.weight"), vec![(nq + 2 * nkv) * d, h]);
        } else {
            for (p, out_features) in [("q_proj", nq * d), ("k_proj", nkv * d), ("v_proj", nkv * d)]
            {
                push(format!("{a}.{p}.weight"), vec![out_features, h]);
                if c.qkv_bias {
                    push(format!("{a}.{p}.bias"), vec![out_features]);
                }
            }
            push(format!("{a}.o_proj.weight"), vec![h, nq * d]);
            if c.o_bias {
                push(format!("{a}.o_proj.bias"), vec![h]);
            }
        }

        match c.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead => {
                push(format!("{a}.q_norm.weight"), vec![d]);
                push(format!("{a}.k_norm.weight"), vec![d]);
            }
            QkNorm::WholeProjection => {
                push(format!("{a}.q_norm.weight"), vec![nq * d]);
                push(format!("{a}.k_norm.weight"), vec![nkv * d]);
            }
        }
        let m = format!("model.layers.{i}.mlp");
        match &c.moe {
            Some(moe) if c.is_sparse_layer(i) && moe.kind == MoeKind::GptOss => {
                // GptOssMLP: router (with bias), then the experts in the transposed layout.
                let (e, inter) = (moe.num_experts, moe.expert_intermediate_size);
                push(format!("{m}.router.weight"), vec![e, h]);
                push(format!("{m}.router.bias"), vec![e]);
                push(format!("{m}.experts.gate_up_proj"), vec![e, h, 2 * inter]);
                push(format!("{m}.experts.gate_up_proj_bias"), vec![e, 2 * inter]);
                push(format!("{m}.experts.down_proj"), vec![e, inter, h]);
                push(format!("{m}.experts.down_proj_bias"), vec![e, h]);
            }
            Some(moe) if c.is_sparse_layer(i) => {
                let (e, inter) = (moe.num_experts, moe.expert_intermediate_size);
                let router = (format!("{m}.gate.weight"), vec![e, h]);
                let experts = [
                    (format!("{m}.experts.gate_up_proj"), vec![e, 2 * inter, h]),
                    (format!("{m}.experts.down_proj"), vec![e, h, inter]),
                ];
                // Module order: mixtral defines the router first, qwen3_moe the experts.
                if c.family == Family::Mixtral {
                    push(router.0, router.1);
                    experts.into_iter().for_each(|(n, s)| push(n, s));
                } else {
                    experts.into_iter().for_each(|(n, s)| push(n, s));
                    push(router.0, router.1);
                }
                if let Some(si) = moe.shared_expert_intermediate_size {
                    let s = format!("{m}.shared_experts");
                    push(format!("{s}.gate_proj.weight"), vec![si, h]);
                    push(format!("{s}.up_proj.weight"), vec![si, h]);
                    push(format!("{s}.down_proj.weight"), vec![h, si]);
                }
            }
            _ => {
                let inter = c.intermediate_size;
                if c.fused_projections {
                    push(format!("{m}.gate_up_proj.weight"), vec![2 * inter, h]);
                    push(format!("{m}.down_proj.weight"), vec![h, inter]);
                } else {
                    for (p, shape) in [
                        ("gate_proj", vec![inter, h]),
                        ("up_proj", vec![inter, h]),
                        ("down_proj", vec![h, inter]),
                    ] {
                        let out_features = shape[0];
                        push(format!("{m}.{p}.weight"), shape);
                        if c.mlp_bias {
                            push(format!("{m}.{p}.bias"), vec![out_features]);
                        }
                    }
                }
            }
        }
        let norms = match c.norm_placement {
            NormPlacement::Pre => ["input_layernorm", "post_attention_layernorm"],
            NormPlacement::Post => ["post_attention_layernorm", "post_feedforward_layernorm"],
            NormPlacement::Sandwich => ["input_layernorm", "post_attention_layernorm"],
        };
        for norm in norms {
            push(format!("model.layers.{i}.{norm}.weight"), vec![h]);
        }
        if c.norm_placement == NormPlacement::Sandwich {
            for norm in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                push(format!("model.layers.{i}.{norm}.weight"), vec![h]);
            }
        }
    }
    push("model.norm.weight".into(), vec![h]);
    if !c.tie_word_embeddings {
        push(LM_HEAD.into(), vec![c.vocab_size, h]);
    }
    out
}

/// Multi-head latent attention's parameters in `DeepseekV3Attention`'s module order;
/// `attention_bias` gives biases to `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` only.
fn mla_params(
    c: &ModelConfig,
    mla: &crate::deepseek::MlaConfig,
    a: &str,
    push: &mut impl FnMut(String, Vec<usize>),
) {
    let (h, nh) = (c.hidden_size, c.num_attention_heads);
    let qk = mla.qk_head_dim();
    let bias = c.qkv_bias;
    match mla.q_lora_rank {
        None => push(format!("{a}.q_proj.weight"), vec![nh * qk, h]),
        Some(r) => {
            push(format!("{a}.q_a_proj.weight"), vec![r, h]);
            if bias {
                push(format!("{a}.q_a_proj.bias"), vec![r]);
            }
            push(format!("{a}.q_a_layernorm.weight"), vec![r]);
            push(format!("{a}.q_b_proj.weight"), vec![nh * qk, r]);
        }
    }
    let kv_a = mla.kv_lora_rank + mla.qk_rope_head_dim;
    push(format!("{a}.kv_a_proj_with_mqa.weight"), vec![kv_a, h]);
    if bias {
        push(format!("{a}.kv_a_proj_with_mqa.bias"), vec![kv_a]);
    }
    push(format!("{a}.kv_a_layernorm.weight"), vec![mla.kv_lora_rank]);
    push(
        format!("{a}.kv_b_proj.weight"),
        vec![
            nh * (mla.qk_nope_head_dim + mla.v_head_dim),
            mla.kv_lora_rank,
        ],
    );
    push(format!("{a}.o_proj.weight"), vec![h, nh * mla.v_head_dim]);
    if c.o_bias {
        push(format!("{a}.o_proj.bias"), vec![h]);
    }
}

/// The persistent buffers a config's checkpoint holds beside its parameters, as
/// `(name, shape)` (f32): deepseek_v3's `mlp.gate.e_score_correction_bias` [E] of each
/// sparse layer. They are graph inputs of role `buffer`, not parameters: no gradient,
/// no optimizer update, not in the parameter count (HF's `named_buffers`).
pub fn buffer_specs(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let Some(moe) = &c.moe else { return vec![] };
    if !matches!(
        moe.router,
        crate::config::Router::GroupLimitedSigmoid { .. }
    ) {
        return vec![];
    }
    (0..c.num_hidden_layers)
        .filter(|&i| c.is_sparse_layer(i))
        .map(|i| {
            (
                format!("model.layers.{i}.mlp.gate.e_score_correction_bias"),
                vec![moe.num_experts],
            )
        })
        .collect()
}

/// The module a parameter belongs to: its name without the last component
/// (`model.layers.0.mlp.experts.gate_up_proj` → `model.layers.0.mlp.experts`).
pub fn module_of(param: &str) -> &str {
    param.rsplit_once('.').map(|(m, _)| m).unwrap_or(param)
}

//! Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`) config fields, as transformers
//! 5.17's `Gemma2Config` / `Gemma3TextConfig` and their modeling code read them:
//!
//! - the classes' defaults for absent keys (a published Gemma 3 `text_config` lists only
//!   what differs from them; `tie_word_embeddings` defaults to true, `layer_types` to the
//!   sliding/full alternation: every 2nd layer full for Gemma 2, every
//!   `sliding_window_pattern`-th (default 6) for Gemma 3);
//! - `hidden_activation` (the MLP's GELU; `hidden_act` is not read by these classes);
//! - `query_pre_attn_scalar` (attention scale `query_pre_attn_scalar^-0.5`);
//! - `attn_logit_softcapping` (Gemma 2 only: Gemma 3's attention never passes it) and
//!   `final_logit_softcapping`;
//! - Gemma 3's rope per layer type (`rope_parameters.full_attention` /
//!   `.sliding_attention`, or the legacy `rope_theta` + `rope_scaling` for global layers
//!   and `rope_local_base_freq` for local ones);
//! - `use_bidirectional_attention` refused (non-causal attention is not implemented).
//!
//! The embedding is scaled by `sqrt(hidden_size)` rounded as HF rounds it (an f32 buffer
//! cast to the weight dtype), and every RMSNorm is Gemma's `x * (1 + w)` in f32.

use crate::config::{Family, RopeConfig};
use crate::error::FrontendError;
use crate::fields::Fields;
use serde_json::{json, Map, Value};
use weft_ir::DType;

/// The MLP's activation (`hidden_act` for most families, Gemma's `hidden_activation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`, `gelu_new`, `gelu_fast`).
    GeluTanh,
    /// Exact (erf) GELU (`gelu`).
    Gelu,
    /// `relu`.
    Relu,
}

/// Gemma's fields that the shared parser has no place for.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GemmaFields {
    pub activation: Activation,
    /// `query_pre_attn_scalar^-0.5`.
    pub attention_scale: f64,
    /// `sqrt(hidden_size)` rounded to f32, then to the parameter dtype.
    pub embedding_scale: f64,
    pub attn_softcap: Option<f64>,
    pub final_softcap: Option<f64>,
    /// Gemma 3: the rope of sliding-window layers (the config's main rope is the global one).
    pub local_rope: Option<RopeConfig>,
}

pub(crate) fn is_gemma(family: Family) -> bool {
    matches!(family, Family::Gemma2 | Family::Gemma3Text)
}

/// `obj` with the HF class defaults of a Gemma config filled in for absent keys (a key
/// given as `null` stays null: HF keeps an explicit None), or `None` for other families.
pub(crate) fn with_defaults(obj: &Map<String, Value>) -> Option<Map<String, Value>> {
    let family = obj
        .get("model_type")
        .and_then(Value::as_str)
        .and_then(Family::from_model_type)?;
    let (defaults, global_theta) = match family {
        Family::Gemma2 => (
            json!({
                "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": 8192, "initializer_range": 0.02,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "attention_bias": false,
                "query_pre_attn_scalar": 256, "sliding_window": 4096,
                "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
            }),
            10000.0,
        ),
        Family::Gemma3Text => (
            json!({
                "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": 131072, "initializer_range": 0.02,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "attention_bias": false,
                "query_pre_attn_scalar": 256, "sliding_window": 4096,
                "final_logit_softcapping": null, "attn_logit_softcapping": null,
            }),
            1_000_000.0,
        ),
        _ => return None,
    };
    let mut out = obj.clone();
    for (k, v) in defaults.as_object().expect("an object literal") {
        out.entry(k.clone()).or_insert_with(|| v.clone());
    }
    if !out.contains_key("rope_parameters") && !out.contains_key("rope_theta") {
        out.insert("rope_theta".into(), json!(global_theta));
    }
    if !matches!(out.get("layer_types"), Some(v) if !v.is_null()) {
        // Gemma 2: sliding when (i + 1) % 2 != 0; Gemma 3: when (i + 1) % pattern != 0.
        let pattern = match family {
            Family::Gemma2 => Some(2),
            _ => match out.get("sliding_window_pattern") {
                None | Some(Value::Null) => Some(6),
                Some(v) => v.as_u64().filter(|&p| p > 0),
            },
        };
        let layers = out.get("num_hidden_layers").and_then(Value::as_u64);
        if let (Some(p), Some(n)) = (pattern, layers) {
            if n <= crate::config::MAX_LAYERS as u64 {
                let types: Vec<Value> = (0..n)
                    .map(|i| {
                        json!(if (i + 1) % p != 0 {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        })
                    })
                    .collect();
                out.insert("layer_types".into(), Value::Array(types));
            }
        }
    }
    Some(out)
}

/// The Gemma fields of a config whose defaults [`with_defaults`] filled in.
pub(crate) fn parse(
    f: &Fields,
    family: Family,
    hidden_size: usize,
    head_dim: usize,
    dtype: DType,
) -> Result<GemmaFields, FrontendError> {
    if f.obj.get("head_dim").is_some_and(Value::is_null) {
        return Err(f.err(
            "head_dim",
            "is null: HF's Gemma attention sizes its projections with head_dim itself (it does not derive it from hidden_size); give the head dimension",
        ));
    }
    if f.opt_bool("use_bidirectional_attention")?.unwrap_or(false) {
        return Err(f.err(
            "use_bidirectional_attention",
            "is true: HF's model then attends to every token (and widens the sliding band both ways); Weft implements causal attention only (set it to false)",
        ));
    }
    if let Some(v) = f.get("sliding_window_pattern") {
        if v.as_u64().is_none_or(|p| p == 0) {
            return Err(f.err(
                "sliding_window_pattern",
                format!("must be a positive integer, got {v}"),
            ));
        }
    }
    if f.has("rope_parameters") && f.has("rope_scaling") {
        // HF merges one into the other (gemma3: rope_scaling into full_attention; gemma2:
        // rope_scaling replaces rope_parameters); one of them is a leftover.
        return Err(f.err(
            "rope_scaling",
            "is given beside rope_parameters; HF merges them by rules that differ between families; keep one (transformers 5 writes rope_parameters)",
        ));
    }
    let activation = parse_activation(f)?;
    let scalar = f.positive_f64("query_pre_attn_scalar")?;
    let softcap = |key: &str| -> Result<Option<f64>, FrontendError> {
        match f.opt_f64(key)? {
            None => Ok(None),
            Some(c) if c.is_finite() && c > 0.0 => Ok(Some(c)),
            Some(c) => Err(f.err(
                key,
                format!(
                    "must be a positive number or null, got {c} (the logits are divided by it)"
                ),
            )),
        }
    };
    let final_softcap = softcap("final_logit_softcapping")?;
    let attn_softcap = softcap("attn_logit_softcapping")?;
    if family == Family::Gemma3Text {
        if let Some(c) = attn_softcap {
            return Err(f.err(
                "attn_logit_softcapping",
                format!("is {c}, but HF's Gemma 3 attention never applies it (only Gemma 2's does); set it to null so the config says what HF computes"),
            ));
        }
    }
    let local_rope = match family {
        Family::Gemma3Text => Some(parse_gemma3_ropes(f, head_dim)?.1),
        _ => None,
    };
    Ok(GemmaFields {
        activation,
        attention_scale: scalar.powf(-0.5),
        embedding_scale: round_to(dtype, (hidden_size as f64).sqrt() as f32),
        attn_softcap,
        final_softcap,
        local_rope,
    })
}

/// Gemma 3's (global, local) ropes: `rope_parameters` keyed by layer type (transformers
/// 5), else `rope_theta` + `rope_scaling` for global layers and `rope_local_base_freq`
/// (default 10000) with no scaling for local ones.
pub(crate) fn parse_gemma3_ropes(
    f: &Fields,
    head_dim: usize,
) -> Result<(RopeConfig, RopeConfig), FrontendError> {
    if let Some(rp) = f.opt_object("rope_parameters")? {
        let p = f.nested("rope_parameters", rp);
        if let Some(k) = rp
            .keys()
            .find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention"))
        {
            return Err(p.err(
                k,
                "is not a layer type: Gemma 3's rope_parameters holds one entry per layer type (`full_attention`, `sliding_attention`)",
            ));
        }
        let entry = |layer_type: &str, default_theta: f64| match p.opt_object(layer_type)? {
            Some(e) => {
                let e = p.nested(layer_type, e);
                check_yarn_truncate(&e)?;
                let theta = e.opt_f64("rope_theta")?.unwrap_or(default_theta);
                crate::config::rope_from(f, Some(e), theta, head_dim, false)
            }
            None => crate::config::rope_from(f, None, default_theta, head_dim, false),
        };
        let theta = f.opt_f64("rope_theta")?.unwrap_or(1_000_000.0);
        let local = f.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0);
        return Ok((
            entry("full_attention", theta)?,
            entry("sliding_attention", local)?,
        ));
    }
    let scaling = f
        .opt_object("rope_scaling")?
        .map(|rs| f.nested("rope_scaling", rs));
    if let Some(s) = &scaling {
        check_yarn_truncate(s)?;
    }
    // A `rope_theta` inside rope_scaling wins over the top-level one, as in HF.
    let theta = match scaling
        .as_ref()
        .map(|s| s.opt_f64("rope_theta"))
        .transpose()?
    {
        Some(Some(t)) => t,
        _ => f.f64("rope_theta")?,
    };
    let global = crate::config::rope_from(f, scaling, theta, head_dim, false)?;
    let local = crate::config::rope_from(
        f,
        None,
        f.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0),
        head_dim,
        false,
    )?;
    Ok((global, local))
}

/// HF's `_compute_yarn_parameters` reads `truncate` from `config.rope_parameters`, which
/// for Gemma 3 is the dict keyed by layer type: a `truncate` inside a layer type's entry
/// (or in the legacy `rope_scaling`, which HF moves into `full_attention`) is never
/// seen, and HF truncates. `false` there is refused rather than computed either way.
fn check_yarn_truncate(p: &Fields) -> Result<(), FrontendError> {
    if p.opt_bool("truncate")? == Some(false) {
        return Err(p.err(
            "truncate",
            "is false, but HF's Gemma 3 rope never reads a per-layer-type `truncate` (its YaRN looks for it beside the layer types and truncates); remove it or set it to true",
        ));
    }
    Ok(())
}

fn parse_activation(f: &Fields) -> Result<Activation, FrontendError> {
    let name = f.opt_str("hidden_activation")?.ok_or_else(|| {
        f.err(
            "hidden_activation",
            "is null; HF's Gemma MLP needs an activation",
        )
    })?;
    let act = activation_named(name).ok_or_else(|| {
        f.err(
            "hidden_activation",
            format!("is `{name}`; Weft implements {ACTIVATIONS}"),
        )
    })?;
    // HF's Gemma classes read only `hidden_activation` (`ACT2FN[config.hidden_activation]`):
    // a `hidden_act` beside it is ignored there, and so it is here.
    Ok(act)
}

pub(crate) fn activation_named(name: &str) -> Option<Activation> {
    Some(match name {
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
        "gelu" => Activation::Gelu,
        "silu" | "swish" => Activation::Silu,
        "relu" => Activation::Relu,
        _ => return None,
    })
}

/// The activations Weft implements, as a refusal names them.
pub(crate) const ACTIVATIONS: &str =
    "silu (swish), gelu_pytorch_tanh, gelu_new, gelu_fast (tanh GELU), gelu (exact) and relu";

/// `x` (an f32) rounded to `dtype` as torch's `.to(dtype)` rounds (nearest even).
pub(crate) fn round_to(dtype: DType, x: f32) -> f64 {
    match dtype {
        DType::BF16 => {
            let bits = x.to_bits();
            let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
            f32::from_bits(rounded) as f64
        }
        DType::F16 => f16_round(x),
        DType::F64 | DType::F32 => x as f64,
        _ => x as f64,
    }
}

/// Round an f32 to the nearest f16 value (ties to even), returned exactly as f64.
fn f16_round(x: f32) -> f64 {
    let x = x as f64;
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    // f16: 10 mantissa bits; normal exponents from -14.
    let e = x.abs().log2().floor().max(-14.0);
    let quantum = (2f64).powf(e - 10.0);
    let q = x / quantum;
    let r = q.round();
    let r = if (q - q.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - q.signum()
    } else {
        r
    };
    r * quantum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModelConfig, NormPlacement, QkNorm};
    use weft_ir::{Float, RopeScaling};

    fn parse(json: &str) -> Result<ModelConfig, String> {
        ModelConfig::from_json_str(json, "config.json").map_err(|e| e.to_string())
    }

    const GEMMA3_LEGACY: &str = r#"{"model_type": "gemma3_text", "num_hidden_layers": 7,
        "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "vocab_size": 100,
        "rope_theta": 500000.0, "rope_local_base_freq": 20000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window": 9,
        "sliding_window_pattern": 3}"#;

    #[test]
    fn gemma3_legacy_keys_and_defaults() {
        let c = parse(GEMMA3_LEGACY).unwrap();
        assert_eq!(c.rope.theta, 500000.0);
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: Float(4.0) });
        let local = c.local_rope.clone().unwrap();
        assert_eq!((local.theta, local.scaling), (20000.0, RopeScaling::None));
        // every 3rd layer global
        let w = Some(9);
        assert_eq!(c.layer_windows, vec![w, w, None, w, w, None, w]);
        // Gemma3TextConfig's defaults
        assert!(c.tie_word_embeddings);
        assert_eq!(c.intermediate_size, 9216);
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
        assert_eq!(c.multipliers.attention_scale, Some(256f64.powf(-0.5)));
        assert_eq!(c.multipliers.embedding, 8.0);
        assert_eq!(c.activation, Activation::GeluTanh);
        assert_eq!(c.qk_norm, QkNorm::PerHead);
        assert_eq!(c.norm_placement, NormPlacement::Sandwich);
        // the transformers 5 form of the same ropes
        let v5 = GEMMA3_LEGACY.replace(
            r#""rope_theta": 500000.0, "rope_local_base_freq": 20000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},"#,
            r#""rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}},"#,
        );
        assert_ne!(v5, GEMMA3_LEGACY);
        assert_eq!(parse(&v5).unwrap(), c);
    }

    /// In bf16 the norm runs as HF's: x and w cast to f32, `1 + w` in f32, one rounding
    /// of the product back to bf16; the embedding scale is sqrt(hidden) rounded to bf16.
    #[test]
    fn bf16_norms_compute_in_f32_and_the_embedding_scale_is_rounded() {
        use weft_ir::Op;
        let c = parse(r#"{"model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 3072, "head_dim": 64, "vocab_size": 10, "intermediate_size": 8, "torch_dtype": "bfloat16"}"#).unwrap();
        let g = crate::build::build_graph("g", &c).unwrap();
        let mut norms = 0;
        for &n in g.nodes() {
            match &g.node(n).op {
                Op::Scale { factor }
                    if g.node(n).meta.source.as_deref() == Some("model.embed_tokens") =>
                {
                    assert_eq!(factor.0, 55.5)
                }
                Op::RmsNorm { .. } => {
                    norms += 1;
                    let (x, w) = (g.node(n).operands[0], g.node(n).operands[1]);
                    assert_eq!((g.ty(x).dtype, g.ty(w).dtype), (DType::F32, DType::F32));
                    assert!(matches!(g.op_of(x), Op::Cast { dtype: DType::F32 }));
                    let w_def = g.node(g.def(w));
                    assert!(matches!(w_def.op, Op::AddScalar { value } if value.0 == 1.0));
                    assert!(matches!(
                        g.op_of(w_def.operands[0]),
                        Op::Cast { dtype: DType::F32 }
                    ));
                    let users: Vec<_> = g
                        .nodes()
                        .iter()
                        .filter(|&&u| g.node(u).operands.contains(&g.node(n).results[0]))
                        .map(|&u| g.node(u).op.clone())
                        .collect();
                    assert_eq!(users, vec![Op::Cast { dtype: DType::BF16 }]);
                }
                _ => {}
            }
        }
        assert_eq!(norms, 2 * 6 + 1);
    }

    #[test]
    fn gemma2_defaults() {
        let c = parse(r#"{"model_type": "gemma2", "num_hidden_layers": 3}"#).unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(c.layer_windows, vec![Some(4096), None, Some(4096)]);
        assert_eq!(
            (c.head_dim, c.vocab_size, c.rope.theta),
            (256, 256000, 10000.0)
        );
        assert!(c.local_rope.is_none() && c.tie_word_embeddings);
        assert_eq!(c.qk_norm, QkNorm::None);
        // null is HF's None, not the default
        let c = parse(r#"{"model_type": "gemma2", "num_hidden_layers": 2, "final_logit_softcapping": null, "attn_logit_softcapping": null}"#).unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
    }

    #[test]
    fn gemma_refusals_name_the_field() {
        let base = r#"{"model_type": "gemma3_text", "num_hidden_layers": 2"#;
        for (extra, field) in [
            (
                r#", "use_bidirectional_attention": true"#,
                "use_bidirectional_attention",
            ),
            (
                r#", "attn_logit_softcapping": 50.0"#,
                "attn_logit_softcapping",
            ),
            (
                r#", "final_logit_softcapping": 0"#,
                "final_logit_softcapping",
            ),
            (
                r#", "hidden_activation": "quick_gelu""#,
                "hidden_activation",
            ),
            (r#", "query_pre_attn_scalar": 0"#, "query_pre_attn_scalar"),
            (r#", "sliding_window_pattern": 0"#, "sliding_window_pattern"),
            (
                r#", "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}"#,
                "rope_parameters.rope_theta",
            ),
            (r#", "sliding_window": null"#, "layer_types"),
            (r#", "attention_dropout": 0.1"#, "attention_dropout"),
            (r#", "head_dim": null"#, "head_dim"),
            (
                r#", "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0, "truncate": false}}"#,
                "rope_parameters.full_attention.truncate",
            ),
            (
                r#", "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "truncate": false}"#,
                "rope_scaling.truncate",
            ),
            (
                r#", "rope_parameters": {"full_attention": {"rope_type": "default"}}, "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
                "rope_scaling",
            ),
        ] {
            let e = parse(&format!("{base}{extra}}}")).unwrap_err();
            assert!(e.contains(&format!("`{field}`")), "{extra}: {e}");
        }
        // hidden_act is not read by HF's Gemma classes: any value builds, and the MLP
        // applies hidden_activation (a config made with another family's defaults says
        // `silu` there and still computes GELU in transformers)
        for act in ["gelu_pytorch_tanh", "silu"] {
            let c = parse(&format!(r#"{base}, "hidden_act": "{act}"}}"#)).unwrap();
            assert_eq!(c.activation, Activation::GeluTanh, "{act}");
        }
    }

    #[test]
    fn embedding_scale_rounds_like_torch() {
        // HF's comment: sqrt(3072) = 55.4256 becomes 55.5 in bfloat16.
        assert_eq!(round_to(DType::BF16, (3072f64).sqrt() as f32), 55.5);
        assert_eq!(round_to(DType::F32, 2.0f32.sqrt()), 2.0f32.sqrt() as f64);
        // f16 of sqrt(3584) = 59.866...: quantum 2^-5 -> 59.875
        assert_eq!(round_to(DType::F16, (3584f64).sqrt() as f32), 59.875);
    }
}

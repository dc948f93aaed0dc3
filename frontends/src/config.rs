//! HF `config.json` → [`ModelConfig`]: the fields the builders need, with HF's defaults
//! and checks. Accepts both the transformers-4 form (`rope_theta` + `rope_scaling`) and
//! the transformers-5 form (`rope_parameters`), `head_dim` absent or null, and the dtype
//! from `dtype` or `torch_dtype` (absent: f32). Errors name the field and the file.

use crate::error::FrontendError;
use crate::fields::Fields;
pub use crate::gemma::Activation;
use serde_json::{Map, Value};
use weft_ir::{DType, Float, RopeScaling};

/// The architecture family, from `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    Mixtral,
    Qwen3Moe,
    Olmo2,
    Granite,
    Gemma2,
    /// Gemma 3's text model (`Gemma3ForCausalLM`).
    Gemma3Text,
    GptOss,
    DeepseekV3,
    /// A graph read from weft text IR (no config).
    WeftIr,
}

impl Family {
    /// The `model_type` values the builders accept.
    pub const MODEL_TYPES: &'static [&'static str] = &[
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "mixtral",
        "qwen3_moe",
        "olmo2",
        "granite",
        "gemma2",
        "gemma3_text",
        "gpt_oss",
        "deepseek_v3",
    ];

    /// The name used in reports: the HF `model_type`, or `weft-ir`.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Phi3 => "phi3",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Olmo2 => "olmo2",
            Family::Granite => "granite",
            Family::Gemma2 => "gemma2",
            Family::Gemma3Text => "gemma3_text",
            Family::GptOss => "gpt_oss",
            Family::DeepseekV3 => "deepseek_v3",
            Family::WeftIr => "weft-ir",
        }
    }

    pub fn from_model_type(s: &str) -> Option<Family> {
        Some(match s {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "phi3" => Family::Phi3,
            "mixtral" => Family::Mixtral,
            "qwen3_moe" => Family::Qwen3Moe,
            "olmo2" => Family::Olmo2,
            "granite" => Family::Granite,
            "gemma2" => Family::Gemma2,
            "gemma3_text" => Family::Gemma3Text,
            "gpt_oss" => Family::GptOss,
            "deepseek_v3" => Family::DeepseekV3,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rotary embedding parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Rotated features per head: `head_dim * partial_rotary_factor`.
    pub rotary_dim: usize,
}

/// Where q and k are RMS-normalised (before rope).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head's `head_dim` features, one weight of `[head_dim]` (qwen3).
    PerHead,
    /// Over the whole projection (`heads * head_dim` features, one weight of that size),
    /// before the view as heads (olmo2).
    WholeProjection,
}

/// Where each layer's RMSNorms sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormPlacement {
    /// `x + attn(norm(x))`, `x + mlp(norm(x))` (`input_layernorm`, `post_attention_layernorm`).
    Pre,
    /// `x + norm(attn(x))`, `x + norm(mlp(x))` (olmo2: `post_attention_layernorm`,
    /// `post_feedforward_layernorm`).
    Post,
    /// Both (gemma2, gemma3): `x + post(attn(input(x)))` with `input_layernorm` and
    /// `post_attention_layernorm`, `x + post(mlp(pre(x)))` with `pre_feedforward_layernorm`
    /// and `post_feedforward_layernorm`.
    Sandwich,
}

/// Granite's scalar multipliers; all 1 (and the attention scale `head_dim^-0.5`) elsewhere.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Multipliers {
    /// Scales the token embeddings (`embedding_multiplier`).
    pub embedding: f64,
    /// Scales each block's output before its residual add (`residual_multiplier`).
    pub residual: f64,
    /// The attention logits' scale in place of `head_dim^-0.5` (`attention_multiplier`).
    pub attention_scale: Option<f64>,
    /// The logits are divided by this (`logits_scaling`).
    pub logits_divisor: f64,
}

impl Multipliers {
    pub const NONE: Multipliers = Multipliers {
        embedding: 1.0,
        residual: 1.0,
        attention_scale: None,
        logits_divisor: 1.0,
    };
}

/// Mixture-of-experts parameters (mixtral, qwen3_moe).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's intermediate size (mixtral: `intermediate_size`, qwen3_moe: `moe_intermediate_size`).
    pub expert_intermediate_size: usize,
    /// Renormalise the top-k routing weights to sum to 1 (mixtral: always).
    pub norm_topk_prob: bool,
    /// Per layer: true when the layer's MLP is sparse (qwen3_moe `mlp_only_layers`, `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
    /// With `output_router_logits`: `router_aux_loss_coef` (HF default 0.001), the weight of
    /// the load-balancing loss HF adds to the cross-entropy. `None`: the loss is the
    /// cross-entropy alone.
    pub aux_loss_coef: Option<f64>,
    /// The router and expert arithmetic (mixtral and qwen3_moe, or gpt-oss's).
    pub kind: MoeKind,
    /// How tokens choose their experts.
    pub router: Router,
    /// The width of the always-on shared experts, one dense MLP beside the routed ones
    /// (deepseek_v3: `moe_intermediate_size * n_shared_experts`); `None`: no shared expert.
    pub shared_expert_intermediate_size: Option<usize>,
}

/// A MoE router's scoring and selection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Router {
    /// f32 softmax over the experts, top-k (mixtral, qwen3_moe).
    Softmax,
    /// DeepSeek-V3: f32 sigmoid scores; the selection adds `e_score_correction_bias`, keeps
    /// the `topk_group` groups (of `n_group`) whose top-2 biased scores sum highest, then
    /// the top-k experts in them; the weights are the unbiased scores of those experts,
    /// renormalised with `norm_topk_prob` (plus 1e-20), times `routed_scaling_factor`.
    GroupLimitedSigmoid {
        n_group: usize,
        topk_group: usize,
        routed_scaling_factor: f64,
    },
}

/// How a MoE layer routes and what its experts compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeKind {
    /// mixtral, qwen3_moe: router `linear` without bias, f32 softmax over every expert,
    /// top-k (renormalised with `norm_topk_prob`); experts `down(silu(gate) * up)` with
    /// `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I], no biases.
    Softmax,
    /// gpt-oss (`GptOssTopKRouter`, `GptOssExperts`): router `linear` with bias, top-k
    /// of the logits, softmax over the k selected; experts with biases in the
    /// transposed layout `gate_up_proj` [E, H, 2I] (gate and up interleaved: even
    /// columns gate, odd up) and `down_proj` [E, I, H], and the clamped SwiGLU
    /// `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)`, `g = min(gate, 7)`.
    GptOss,
}

/// gpt-oss's SwiGLU clamp and sigmoid slope (`self.limit`, `self.alpha` of HF's
/// `GptOssExperts`): hard-coded up to transformers 5.17, read from the config's
/// `swiglu_limit` / `swiglu_alpha` (defaults 7.0 / 1.702) by later versions. Weft
/// implements these values only and refuses others by name.
pub const GPT_OSS_SWIGLU_LIMIT: f64 = 7.0;
pub const GPT_OSS_SWIGLU_ALPHA: f64 = 1.702;

/// The parsed config: everything the graph builders read.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub model_type: String,
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense MLP's intermediate size (0 when every layer is sparse and the config has none).
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    pub max_position_embeddings: Option<usize>,
    pub tie_word_embeddings: bool,
    pub initializer_range: f64,
    /// The parameter dtype (`dtype` / `torch_dtype`, default f32).
    pub dtype: DType,
    /// Biases on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on o_proj.
    pub o_bias: bool,
    /// Biases on the dense MLP's projections (llama `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm of q and k (qwen3 per head, olmo2 over the whole projection).
    pub qk_norm: QkNorm,
    /// Pre-norm (most families), post-norm (olmo2) or both (gemma) blocks.
    pub norm_placement: NormPlacement,
    /// Granite's embedding, residual, attention and logit multipliers; Gemma's embedding
    /// scale (`sqrt(hidden_size)` in the parameter dtype) and `query_pre_attn_scalar^-0.5`.
    pub multipliers: Multipliers,
    /// The MLP's activation (`hidden_act`; Gemma's `hidden_activation`).
    pub activation: Activation,
    /// Gemma's RMSNorm: `x * (1 + w)`, computed in f32 (weights stored around 0).
    pub norm_unit_offset: bool,
    /// `attn_logit_softcapping` (gemma2): attention scores become `c * tanh(s / c)`.
    pub attn_softcap: Option<f64>,
    /// `final_logit_softcapping` (gemma2, gemma3): logits become `c * tanh(logits / c)`.
    pub final_softcap: Option<f64>,
    /// The rope of sliding-window layers where it differs from `rope` (gemma3's
    /// `rope_local_base_freq` / `rope_parameters.sliding_attention`).
    pub local_rope: Option<RopeConfig>,
    /// One `qkv_proj` and one `gate_up_proj` (phi3).
    pub fused_projections: bool,
    pub moe: Option<MoeConfig>,
    /// HF's `config.sliding_window` after its defaults (none unless the family uses it).
    pub sliding_window: Option<usize>,
    /// The attention window of each layer (none: full causal), as HF applies it; see
    /// [`parse_windows`].
    pub layer_windows: Vec<Option<usize>>,
    /// HF `base_model_tp_plan` (module pattern, style), as written; read by the
    /// `tensor-parallel` pass (styles are checked there).
    pub tp_plan: Vec<(String, String)>,
    /// A learned logit per q head joins each attention row's softmax (gpt-oss
    /// `self_attn.sinks`).
    pub attention_sinks: bool,
    /// Multi-head latent attention (deepseek_v3); `None`: q/k/v projections.
    pub mla: Option<crate::deepseek::MlaConfig>,
    /// The embedding row HF's `nn.Embedding(padding_idx=pad_token_id)` gives no gradient
    /// (every family Weft builds passes `pad_token_id`), normalized to `[0, vocab_size)`.
    pub padding_idx: Option<usize>,
}

impl ModelConfig {
    /// Parses config.json text; `file` names it in errors (a path or `preset <name>`).
    pub fn from_json_str(text: &str, file: &str) -> Result<ModelConfig, FrontendError> {
        let v = crate::fields::parse_json_no_duplicates(text).map_err(|message| {
            FrontendError::Json {
                file: file.to_string(),
                message,
            }
        })?;
        ModelConfig::from_json(&v, file)
    }

    pub fn from_json(v: &serde_json::Value, file: &str) -> Result<ModelConfig, FrontendError> {
        let obj = v.as_object().ok_or_else(|| FrontendError::Json {
            file: file.to_string(),
            message: "expected a JSON object at the top level".into(),
        })?;
        // HF's config classes fill absent keys with their own defaults (Gemma's: tied
        // embeddings, the sliding/full pattern, soft-caps; every class: eps, positions).
        let with_defaults = crate::gemma::with_defaults(obj).or_else(|| with_class_defaults(obj));
        parse(&Fields::new(with_defaults.as_ref().unwrap_or(obj), file))
    }

    /// True when layer `i` has a sparse (mixture-of-experts) MLP.
    pub fn is_sparse_layer(&self, i: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.sparse_layers.get(i).copied().unwrap_or(false))
    }
}

/// The most decoder layers a config may ask for: the largest models have ~130, and the
/// graph holds every layer's nodes, so this bounds the memory a config can make Weft use.
pub const MAX_LAYERS: usize = 4096;

fn parse(f: &Fields) -> Result<ModelConfig, FrontendError> {
    let model_type = f
        .opt_str("model_type")?
        .ok_or_else(|| f.err("model_type", "is missing"))?;
    let family =
        Family::from_model_type(model_type).ok_or_else(|| FrontendError::UnknownModelType {
            file: f.file.to_string(),
            model_type: model_type.to_string(),
        })?;

    let vocab_size = f.positive("vocab_size")?;
    let hidden_size = f.positive("hidden_size")?;
    let num_hidden_layers = f.positive("num_hidden_layers")?;
    if num_hidden_layers > MAX_LAYERS {
        return Err(f.err(
            "num_hidden_layers",
            format!("is {num_hidden_layers}, more than the {MAX_LAYERS} layers Weft builds (the graph holds every layer's nodes)"),
        ));
    }
    let num_attention_heads = f.positive("num_attention_heads")?;
    // An absent key takes the config class's default (a fixed count for most classes,
    // see [`kv_heads_class_default`]); an explicit null is `num_attention_heads`.
    let kv_absent = !f.obj.contains_key("num_key_value_heads");
    let num_key_value_heads = match kv_heads_class_default(family) {
        Some(n) if kv_absent => n,
        _ => f
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads),
    };
    if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
        return Err(f.err(
            "num_key_value_heads",
            format!(
                "must divide num_attention_heads ({num_attention_heads}), got {num_key_value_heads}{}",
                if kv_absent {
                    format!(" (HF's {family} config class default, the key being absent; give it)")
                } else {
                    String::new()
                }
            ),
        ));
    }
    let mla = match family {
        Family::DeepseekV3 => {
            crate::deepseek::check_rope_type(f)?;
            Some(crate::deepseek::parse_mla(
                f,
                num_attention_heads,
                num_key_value_heads,
            )?)
        }
        _ => None,
    };
    let head_dim = match f.opt_usize("head_dim")? {
        // deepseek_v3: HF's config.head_dim is qk_rope_head_dim (the rotary tables' width).
        _ if mla.is_some() => crate::deepseek::rope_head_dim(f)?,
        Some(0) => return Err(f.err("head_dim", "must be positive, got 0")),
        Some(d) => d,
        // GptOssConfig's and Qwen3Config's class defaults; only an explicit null derives it.
        None if family == Family::GptOss && !f.obj.contains_key("head_dim") => 64,
        None if family == Family::Qwen3 && !f.obj.contains_key("head_dim") => 128,
        None => {
            if hidden_size % num_attention_heads != 0 {
                return Err(f.err(
                    "head_dim",
                    format!("is absent and hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_attention_heads})"),
                ));
            }
            hidden_size / num_attention_heads
        }
    };
    if f.obj.get("rms_norm_eps").is_some_and(|v| v.is_null()) {
        // (an absent key took the class default in `with_class_defaults`)
        return Err(f.err(
            "rms_norm_eps",
            format!("is null, which HF's {family} config class refuses (`rms_norm_eps: float`); give a number, or remove the key for the class default {}", class_defaults(family).rms_norm_eps),
        ));
    }
    let rms_norm_eps = f.positive_f64("rms_norm_eps")?;
    if !crate::gemma::is_gemma(family) {
        // (gemma's own check says the same with its merge rules)
        check_one_rope_source(f)?;
    }
    if family != Family::Gemma3Text {
        check_flat_rope(f, family)?;
    }
    if !matches!(family, Family::Phi3 | Family::DeepseekV3) {
        // (deepseek_v3 refuses it in `check_rope_type`, naming qk_rope_head_dim)
        check_full_rotary(f, family)?;
    }
    if family == Family::Phi3 {
        check_phi3_rope_type(f)?;
    }
    let rope = match family {
        Family::Gemma3Text => crate::gemma::parse_gemma3_ropes(f, head_dim)?.0,
        Family::GptOss => parse_gpt_oss_rope(f, head_dim)?,
        _ => parse_rope(f, head_dim, class_defaults(family).rope_theta)?,
    };
    let gemma = if crate::gemma::is_gemma(family) {
        Some(crate::gemma::parse(
            f,
            family,
            hidden_size,
            head_dim,
            parse_dtype(f)?,
        )?)
    } else {
        None
    };
    // The attention's q/k head dim (what the cost model and tp size heads by).
    let head_dim = mla.as_ref().map_or(head_dim, |m| m.qk_head_dim());
    // HF's gpt_oss never reads `hidden_act` (`GptOssExperts` hard-codes its clamped
    // SwiGLU, see `MoeKind::GptOss`): any value computes the same, so none is refused.
    let reads_hidden_act = gemma.is_none() && family != Family::GptOss;
    // The other families' MLPs (and MoE experts) apply `ACT2FN[config.hidden_act]`;
    // absent, every one of their config classes defaults to silu.
    let hidden_act = match (reads_hidden_act, f.opt_str("hidden_act")?) {
        (true, Some(act)) => Some(crate::gemma::activation_named(act).ok_or_else(|| {
            f.err(
                "hidden_act",
                format!("is `{act}`; Weft implements {}", crate::gemma::ACTIVATIONS),
            )
        })?),
        _ => None,
    };
    let initializer_range = match f.opt_f64("initializer_range")? {
        None => 0.02,
        Some(x) if x.is_finite() && x >= 0.0 => x,
        Some(x) => {
            return Err(f.err(
                "initializer_range",
                format!("must be a non-negative number, got {x}"),
            ))
        }
    };
    crate::neutral::check_math_fields(f)?;
    check_causal(f)?;
    let dtype = parse_dtype(f)?;
    let tie_word_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    // null: no biases, as transformers 4's `nn.Linear(bias=None)`, even where the class
    // default is true (transformers 5's strict config classes refuse a null here)
    let attention_bias = f.flag("attention_bias", family == Family::GptOss)?;

    let (qkv_bias, o_bias) = match family {
        Family::Llama
        | Family::Qwen3
        | Family::Qwen3Moe
        | Family::Olmo2
        | Family::Granite
        | Family::Gemma2
        | Family::Gemma3Text
        | Family::GptOss
        | Family::DeepseekV3 => (attention_bias, attention_bias),
        Family::Qwen2 => (true, false),
        _ => (false, false),
    };
    let mlp_bias = matches!(family, Family::Llama | Family::Granite)
        && f.opt_bool("mlp_bias")?.unwrap_or(false);
    let multipliers = match (family, &gemma) {
        (Family::Granite, _) => parse_granite_multipliers(f)?,
        (_, Some(g)) => Multipliers {
            embedding: g.embedding_scale,
            attention_scale: Some(g.attention_scale),
            ..Multipliers::NONE
        },
        _ => Multipliers::NONE,
    };
    let moe = parse_moe(f, family, num_hidden_layers)?;
    let needs_dense = moe
        .as_ref()
        .is_none_or(|m| m.sparse_layers.iter().any(|s| !s));
    let intermediate_size = match (family, needs_dense) {
        // mixtral's experts use intermediate_size.
        (Family::Mixtral | Family::GptOss, _) | (_, true) => f.positive("intermediate_size")?,
        (_, false) => f.opt_usize("intermediate_size")?.unwrap_or(0),
    };
    let moe = moe.map(|mut m| {
        if matches!(family, Family::Mixtral | Family::GptOss) {
            m.expert_intermediate_size = intermediate_size;
        }
        m
    });
    let (sliding_window, layer_windows) = parse_windows(f, family, num_hidden_layers)?;

    Ok(ModelConfig {
        model_type: model_type.to_string(),
        family,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps,
        rope,
        max_position_embeddings: f.opt_usize("max_position_embeddings")?,
        tie_word_embeddings,
        initializer_range,
        dtype,
        qkv_bias,
        o_bias,
        mlp_bias,
        qk_norm: match family {
            Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3Text => QkNorm::PerHead,
            Family::Olmo2 => QkNorm::WholeProjection,
            _ => QkNorm::None,
        },
        norm_placement: match family {
            Family::Olmo2 => NormPlacement::Post,
            Family::Gemma2 | Family::Gemma3Text => NormPlacement::Sandwich,
            _ => NormPlacement::Pre,
        },
        multipliers,
        activation: gemma
            .as_ref()
            .map(|g| g.activation)
            .or(hidden_act)
            .unwrap_or(Activation::Silu),
        norm_unit_offset: gemma.is_some(),
        attn_softcap: gemma.as_ref().and_then(|g| g.attn_softcap),
        final_softcap: gemma.as_ref().and_then(|g| g.final_softcap),
        local_rope: gemma.and_then(|g| g.local_rope),
        fused_projections: family == Family::Phi3,
        moe,
        sliding_window,
        layer_windows,
        tp_plan: parse_tp_plan(f)?,
        attention_sinks: family == Family::GptOss,
        mla,
        padding_idx: parse_padding_idx(f, family, vocab_size)?,
    })
}

/// `is_causal`: HF's `masking_utils.create_causal_mask` (and its sliding-window twin)
/// builds a bidirectional mask when `not getattr(config, "is_causal", True)`, so any
/// value but true (false, null, 0) asks for non-causal attention, which Weft does not
/// implement. Absent or true is causal.
fn check_causal(f: &Fields) -> Result<(), FrontendError> {
    match f.obj.get("is_causal") {
        None | Some(serde_json::Value::Bool(true)) => Ok(()),
        Some(v) => Err(f.err(
            "is_causal",
            format!("is {v}: HF's masks then let every token attend to every other (bidirectional attention, `not config.is_causal`); Weft implements causal attention only (remove it or set it to true)"),
        )),
    }
}

/// `num_key_value_heads` of each HF config class when the key is absent from
/// config.json (transformers 5: `MistralConfig` 8, `Qwen2Config` / `Qwen3Config` 32,
/// `MixtralConfig` 8, `Qwen3MoeConfig` 4, `GptOssConfig` 8, `DeepseekV3Config` 128;
/// Gemma's 4 is filled in by [`crate::gemma::with_defaults`]). `None`: the class
/// default is None, which HF turns into `num_attention_heads` (llama, phi3, olmo2,
/// granite).
fn kv_heads_class_default(family: Family) -> Option<usize> {
    match family {
        Family::Mistral | Family::Mixtral | Family::GptOss => Some(8),
        Family::Qwen2 | Family::Qwen3 => Some(32),
        Family::Qwen3Moe => Some(4),
        Family::DeepseekV3 => Some(128),
        Family::Gemma2 | Family::Gemma3Text => Some(4),
        Family::Llama | Family::Phi3 | Family::Olmo2 | Family::Granite | Family::WeftIr => None,
    }
}

/// What an HF config class takes for a key absent from config.json (transformers 5.17,
/// `models/<family>/configuration_<family>.py`: the dataclass field defaults, and the
/// class attribute `default_theta`, `RotaryEmbeddingConfigMixin.default_theta` = 10000
/// unless the class overrides it: mixtral 1e6, gpt_oss 150000; gemma3's global / local
/// bases live in [`crate::gemma`]).
pub(crate) struct ClassDefaults {
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
}

pub(crate) fn class_defaults(family: Family) -> ClassDefaults {
    let (rms_norm_eps, rope_theta, max_position_embeddings) = match family {
        Family::Llama | Family::Granite => (1e-6, 10_000.0, 2048),
        Family::Mistral => (1e-6, 10_000.0, 4096 * 32),
        Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe => (1e-6, 10_000.0, 32768),
        Family::Phi3 => (1e-5, 10_000.0, 4096),
        Family::Mixtral => (1e-5, 1_000_000.0, 4096 * 32),
        Family::Olmo2 => (1e-5, 10_000.0, 2048),
        Family::Gemma2 => (1e-6, 10_000.0, 8192),
        Family::Gemma3Text => (1e-6, 1_000_000.0, 131_072),
        Family::GptOss => (1e-5, 150_000.0, 131_072),
        Family::DeepseekV3 => (1e-6, 10_000.0, 4096),
        Family::WeftIr => (1e-6, 10_000.0, 2048),
    };
    ClassDefaults {
        rms_norm_eps,
        rope_theta,
        max_position_embeddings,
    }
}

/// `obj` with the HF config class's defaults filled in for absent keys that change the
/// math (a key given as `null` stays null: HF's strict config classes refuse a null
/// float or int there), or `None` for Gemma (see [`crate::gemma::with_defaults`]) and
/// unknown model types. `rope_theta` is not filled in here: where HF takes its default
/// depends on the rope dict (see [`rope_source`]).
///
/// - `rms_norm_eps`, `max_position_embeddings` (the default
///   `original_max_position_embeddings` of llama3 and YaRN rope): [`class_defaults`];
/// - the expert counts: mixtral `num_local_experts` 8 and `num_experts_per_tok` 2,
///   qwen3_moe `num_experts` 128, `num_experts_per_tok` 8 and `moe_intermediate_size`
///   768, gpt_oss `num_local_experts` 128 (its `num_experts_per_tok` 4 is read in
///   [`parse_moe`]); the expert count only when neither of its two names is given.
fn with_class_defaults(obj: &Map<String, Value>) -> Option<Map<String, Value>> {
    let family = obj
        .get("model_type")
        .and_then(Value::as_str)
        .and_then(Family::from_model_type)?;
    if crate::gemma::is_gemma(family) || family == Family::WeftIr {
        return None;
    }
    let d = class_defaults(family);
    let mut fill: Vec<(&str, Value)> = vec![
        ("rms_norm_eps", d.rms_norm_eps.into()),
        ("max_position_embeddings", d.max_position_embeddings.into()),
    ];
    let no_expert_count =
        !obj.contains_key("num_local_experts") && !obj.contains_key("num_experts");
    match family {
        Family::Mixtral => {
            if no_expert_count {
                fill.push(("num_local_experts", 8.into()));
            }
            fill.push(("num_experts_per_tok", 2.into()));
        }
        Family::Qwen3Moe => {
            if no_expert_count {
                fill.push(("num_experts", 128.into()));
            }
            fill.push(("num_experts_per_tok", 8.into()));
            fill.push(("moe_intermediate_size", 768.into()));
        }
        Family::GptOss if no_expert_count => fill.push(("num_local_experts", 128.into())),
        _ => {}
    }
    let mut out = obj.clone();
    for (k, v) in fill {
        out.entry(k.to_string()).or_insert(v);
    }
    Some(out)
}

/// `pad_token_id` as the row `nn.Embedding` takes for `padding_idx`: the config class's
/// default when the key is absent (phi3 32000, gemma2/gemma3_text 0, olmo2 1, the
/// others none), none when it is null; torch counts a negative one from the end and
/// refuses one outside `[-vocab_size, vocab_size)`, and so does Weft.
fn parse_padding_idx(
    f: &Fields,
    family: Family,
    vocab_size: usize,
) -> Result<Option<usize>, FrontendError> {
    let key = "pad_token_id";
    let id = match f.obj.get(key) {
        None => match family {
            Family::Phi3 => Some(32000),
            Family::Gemma2 | Family::Gemma3Text => Some(0),
            Family::Olmo2 => Some(1),
            _ => None,
        },
        Some(serde_json::Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| f.err(key, format!("must be an integer or null, got {v}")))?,
        ),
    };
    let Some(id) = id else { return Ok(None) };
    let v = vocab_size as i64;
    if !(-v..v).contains(&id) {
        return Err(f.err(
            key,
            format!(
                "is {id}{}, outside the embedding's {vocab_size} rows: HF's nn.Embedding(padding_idx=pad_token_id) refuses it",
                if f.obj.contains_key(key) { "" } else { " (the class default, the key being absent)" }
            ),
        ));
    }
    Ok(Some(id.rem_euclid(v) as usize))
}

/// Granite's multipliers (HF defaults 1.0 each; `attention_multiplier` replaces the
/// `head_dim^-0.5` scale, so its default 1.0 is a scale of 1).
fn parse_granite_multipliers(f: &Fields) -> Result<Multipliers, FrontendError> {
    let finite = |key: &str| -> Result<f64, FrontendError> {
        match f.opt_f64(key)? {
            None => Ok(1.0),
            Some(x) if x.is_finite() => Ok(x),
            Some(x) => Err(f.err(key, format!("must be a finite number, got {x}"))),
        }
    };
    let logits_divisor = finite("logits_scaling")?;
    if logits_divisor == 0.0 {
        return Err(f.err(
            "logits_scaling",
            "must not be 0 (the logits are divided by it)",
        ));
    }
    Ok(Multipliers {
        embedding: finite("embedding_multiplier")?,
        residual: finite("residual_multiplier")?,
        attention_scale: Some(finite("attention_multiplier")?),
        logits_divisor,
    })
}

/// The attention window of each layer, as HF's modeling code applies it (the band of
/// `masking_utils.sliding_window_overlay`: query `i` keeps keys `i - window < j <= i`).
///
/// - mistral, mixtral, phi3: `sliding_window` on every layer (mistral's default when the
///   key is absent is 4096, the others' none; `null` means none);
/// - qwen2, qwen3: only with `use_sliding_window`, `sliding_window` (default 4096) on the
///   layers `layer_types` marks `sliding_attention`; without `layer_types`, the layers
///   from `max_window_layers` (default 28) on;
/// - qwen3_moe: with `use_sliding_window`, every layer (HF reads neither
///   `max_window_layers` nor `layer_types` for it);
/// - llama: none (HF's Llama has no window).
///
/// `layer_types` on a family whose HF model ignores it must agree with what HF applies,
/// and entries other than full and sliding attention are refused by name.
fn parse_windows(
    f: &Fields,
    family: Family,
    layers: usize,
) -> Result<(Option<usize>, Vec<Option<usize>>), FrontendError> {
    // `sliding_window` with HF's class default when the key is absent; null is none.
    let window_or = |default: Option<usize>| -> Result<Option<usize>, FrontendError> {
        let w = match f.obj.get("sliding_window") {
            None => default,
            Some(_) => f.opt_usize("sliding_window")?,
        };
        if w.is_some_and(|w| i64::try_from(w).is_err()) {
            return Err(f.err(
                "sliding_window",
                "is larger than any sequence Weft can express",
            ));
        }
        if w == Some(0) {
            return Err(f.err(
                "sliding_window",
                "is 0, which keeps no key for any query (HF's softmax gives NaN); use null for no window",
            ));
        }
        Ok(w)
    };
    let use_sliding = |f: &Fields| -> Result<bool, FrontendError> {
        Ok(f.opt_bool("use_sliding_window")?.unwrap_or(false))
    };
    let (window, per_layer_from_types) = match family {
        Family::Mistral => (window_or(Some(4096))?, false),
        Family::Mixtral | Family::Phi3 => (window_or(None)?, false),
        Family::Qwen2 | Family::Qwen3 => {
            let w = window_or(Some(4096))?;
            (if use_sliding(f)? { w } else { None }, true)
        }
        // `layer_types` is always set (crate::gemma fills HF's default pattern).
        Family::Gemma2 | Family::Gemma3Text => (window_or(Some(4096))?, true),
        Family::Qwen3Moe => {
            let w = window_or(Some(4096))?;
            (if use_sliding(f)? { w } else { None }, false)
        }
        Family::GptOss => (window_or(Some(128))?, true),
        Family::Llama | Family::Olmo2 | Family::Granite | Family::DeepseekV3 | Family::WeftIr => {
            (None, false)
        }
    };
    let types = parse_layer_types(f, layers)?;
    if !per_layer_from_types {
        // HF's model for this family applies `window` to every layer whatever
        // `layer_types` says; a disagreeing list means the user expects something else.
        if let Some(types) = &types {
            if let Some((i, t)) = types
                .iter()
                .enumerate()
                .find(|(_, t)| t.is_sliding() != window.is_some())
            {
                return Err(f.err(
                    "layer_types",
                    format!(
                        "marks layer {i} `{}`, but HF's {family} model ignores `layer_types` and applies {} to every layer",
                        t.name(),
                        match window {
                            Some(w) => format!("the sliding window ({w})"),
                            None => "full causal attention".to_string(),
                        }
                    ),
                ));
            }
        }
        return Ok((window, vec![window; layers]));
    }
    let types = match types {
        Some(t) => t,
        // GptOssConfig: sliding on even layers, full on odd ones
        None if family == Family::GptOss => (0..layers)
            .map(|i| {
                if (i + 1) % 2 == 1 {
                    LayerType::Sliding
                } else {
                    LayerType::Full
                }
            })
            .collect(),
        None => {
            // HF's default for qwen2 and qwen3
            let first = f.opt_usize("max_window_layers")?.unwrap_or(28);
            (0..layers)
                .map(|i| {
                    if window.is_some() && i >= first {
                        LayerType::Sliding
                    } else {
                        LayerType::Full
                    }
                })
                .collect()
        }
    };
    let mut per_layer = Vec::with_capacity(layers);
    for (i, t) in types.iter().enumerate() {
        per_layer.push(match (t, window) {
            (LayerType::Full, _) => None,
            (LayerType::Sliding, Some(w)) => Some(w),
            (LayerType::Sliding, None) => {
                return Err(f.err(
                    "layer_types",
                    format!(
                        "marks layer {i} `sliding_attention`, but the config has no window ({}); HF cannot build this model's mask",
                        if use_sliding(f)? || family == Family::GptOss {
                            "sliding_window is null"
                        } else {
                            "use_sliding_window is false"
                        }
                    ),
                ))
            }
        });
    }
    Ok((window, per_layer))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayerType {
    Full,
    Sliding,
}

impl LayerType {
    fn is_sliding(self) -> bool {
        self == LayerType::Sliding
    }
    fn name(self) -> &'static str {
        match self {
            LayerType::Full => "full_attention",
            LayerType::Sliding => "sliding_attention",
        }
    }
}

/// transformers 5's `layer_types` (one entry per layer; the legacy `attention` is full
/// attention), or `None` when absent.
fn parse_layer_types(f: &Fields, layers: usize) -> Result<Option<Vec<LayerType>>, FrontendError> {
    let Some(v) = f.get("layer_types") else {
        return Ok(None);
    };
    let items = v
        .as_array()
        .ok_or_else(|| f.err("layer_types", format!("must be a list of strings, got {v}")))?;
    if items.len() != layers {
        return Err(f.err(
            "layer_types",
            format!(
                "has {} entries but num_hidden_layers is {layers}",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("full_attention") | Some("attention") => Ok(LayerType::Full),
            Some("sliding_attention") => Ok(LayerType::Sliding),
            Some(other) => Err(f.err(
                "layer_types",
                format!("entry {i} is `{other}`; Weft implements `full_attention` and `sliding_attention` only"),
            )),
            None => Err(f.err("layer_types", format!("entry {i} must be a string, got {t}"))),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn parse_tp_plan(f: &Fields) -> Result<Vec<(String, String)>, FrontendError> {
    if f.get("base_model_tp_plan").is_some_and(|v| v.is_null()) {
        return Ok(vec![]);
    }
    let Some(plan) = f.opt_object("base_model_tp_plan")? else {
        return Ok(vec![]);
    };
    plan.iter()
        .map(|(k, v)| match v.as_str() {
            Some(style) => Ok((k.clone(), style.to_string())),
            None => Err(f.err(
                "base_model_tp_plan",
                format!("entry `{k}` must be a style string, got {v}"),
            )),
        })
        .collect()
}

fn parse_dtype(f: &Fields) -> Result<DType, FrontendError> {
    let key = if f.has("dtype") {
        "dtype"
    } else {
        "torch_dtype"
    };
    let Some(s) = f.opt_str(key)? else {
        return Ok(DType::F32);
    };
    let name = s.strip_prefix("torch.").unwrap_or(s);
    Ok(match name {
        "float32" | "float" => DType::F32,
        "bfloat16" => DType::BF16,
        "float16" | "half" => DType::F16,
        "float64" | "double" => DType::F64,
        _ => {
            return Err(f.err(
                key,
                format!("is `{s}`; expected float32, bfloat16, float16 or float64"),
            ))
        }
    })
}

/// Rope from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4).
/// `default_theta`: the config class's `default_theta`, HF's base when no `rope_theta` is
/// given anywhere (see [`rope_source`]).
fn parse_rope(
    f: &Fields,
    head_dim: usize,
    default_theta: f64,
) -> Result<RopeConfig, FrontendError> {
    let (params, theta) = rope_source(f, default_theta)?;
    rope_from(f, params, theta, head_dim, true)
}

/// HF 5.17 reads `rope_scaling` in place of `rope_parameters` when both are given
/// (`rope_scaling or rope_parameters`); a config with both holds a leftover whose
/// meaning depends on that rule. Refused, naming `rope_scaling` (an empty object or null
/// is no rope at all and passes).
fn check_one_rope_source(f: &Fields) -> Result<(), FrontendError> {
    let non_empty = |key: &str| -> Result<bool, FrontendError> {
        Ok(f.opt_object(key)?.is_some_and(|o| !o.is_empty()))
    };
    if non_empty("rope_scaling")? && non_empty("rope_parameters")? {
        return Err(f.err(
            "rope_scaling",
            "is given beside rope_parameters; HF then uses rope_scaling and drops rope_parameters (transformers 5 writes rope_parameters only): keep the one you mean",
        ));
    }
    Ok(())
}

/// A rope dict nested by layer type (`{"full_attention": {...}, "sliding_attention":
/// {...}}`) on a family whose HF rotary embedding reads one flat dict
/// (`config.rope_parameters["rope_type"]`): only Gemma 3 builds one rope per layer type.
/// Refused, naming the nested entry (read as a flat dict it would give the default rope).
fn check_flat_rope(f: &Fields, family: Family) -> Result<(), FrontendError> {
    for outer in ["rope_parameters", "rope_scaling"] {
        let Some(o) = f.opt_object(outer)? else {
            continue;
        };
        if let Some((k, _)) = o.iter().find(|(_, v)| v.is_object()) {
            return Err(f.nested(outer, o).err(
                k,
                format!("is a nested rope dict, but HF's {family} builds one rope for every layer from a flat {outer} (only gemma3_text keys its rope by layer type); give the rope fields directly in {outer}"),
            ));
        }
    }
    Ok(())
}

/// Every `partial_rotary_factor` a config may carry: at the top level, in
/// `rope_parameters` / `rope_scaling`, and in a per-layer-type entry of `rope_parameters`.
fn partial_rotary_fields(f: &Fields) -> Result<Vec<(String, f64)>, FrontendError> {
    const KEY: &str = "partial_rotary_factor";
    let mut out = Vec::new();
    if let Some(x) = f.opt_f64(KEY)? {
        out.push((f.name(KEY), x));
    }
    for outer in ["rope_parameters", "rope_scaling"] {
        let Some(o) = f.opt_object(outer)? else {
            continue;
        };
        let p = f.nested(outer, o);
        if let Some(x) = p.opt_f64(KEY)? {
            out.push((p.name(KEY), x));
        }
        for (k, v) in o {
            if let Some(inner) = v.as_object() {
                let q = p.nested(k, inner);
                if let Some(x) = q.opt_f64(KEY)? {
                    out.push((q.name(KEY), x));
                }
            }
        }
    }
    Ok(out)
}

/// `partial_rotary_factor` other than 1 on a family whose HF attention rotates every
/// head_dim feature. transformers 5.17 moves the field into `rope_parameters`; the default
/// rope of these families ignores it (full rotation), while the scaled ones (linear,
/// llama3, yarn) size their tables with it and the attention then fails on the shapes.
/// Only phi3 rotates the first `head_dim * partial_rotary_factor` features. Refused by
/// name rather than computed either way.
fn check_full_rotary(f: &Fields, family: Family) -> Result<(), FrontendError> {
    if let Some((field, x)) = partial_rotary_fields(f)?
        .into_iter()
        .find(|(_, x)| *x != 1.0)
    {
        return Err(FrontendError::config(
            f.file,
            &field,
            format!("is {x}, but HF's {family} attention rotates all head_dim features: its default rope ignores partial_rotary_factor and its scaled ropes fail on it (only phi3 applies it); set it to 1 or remove it"),
        ));
    }
    Ok(())
}

/// HF's `Phi3Config` renames the rope types `su` and `yarn` to `longrope` (which Weft does
/// not implement) and refuses every type but `default` and `longrope`.
fn check_phi3_rope_type(f: &Fields) -> Result<(), FrontendError> {
    let (Some(p), _) = rope_source(f, class_defaults(Family::Phi3).rope_theta)? else {
        return Ok(());
    };
    let (type_key, t) = match p.opt_str("rope_type")? {
        Some(t) => ("rope_type", t),
        None => ("type", p.opt_str("type")?.unwrap_or("default")),
    };
    match t {
        "default" => Ok(()),
        "su" | "yarn" => Err(p.err(
            type_key,
            format!("is `{t}`, which HF's Phi3Config reads as `longrope` (short_factor / long_factor rescaling); Weft does not implement longrope"),
        )),
        "longrope" => Err(FrontendError::UnsupportedRope {
            file: f.file.to_string(),
            field: p.name(type_key),
            rope_type: t.to_string(),
        }),
        _ => Err(p.err(
            type_key,
            format!("is `{t}`, but HF's Phi3Config accepts only `default` and `longrope` rope"),
        )),
    }
}

/// The top-level `original_max_position_embeddings`, which HF 5.17's
/// `standardize_rope_params` copies over the rope dict's own for llama3, yarn and
/// longrope rope (a config with one global rope dict; not gemma3's per-layer ones).
fn top_level_original(f: &Fields) -> Result<Option<usize>, FrontendError> {
    match f.opt_usize("original_max_position_embeddings")? {
        Some(0) => Err(f.err(
            "original_max_position_embeddings",
            "must be positive, got 0",
        )),
        n => Ok(n),
    }
}

/// Where a config keeps its rope: the parameters object (if any) and theta, as HF
/// 5.17's `convert_rope_params_to_dict` resolves them. The rope dict is `rope_scaling or
/// rope_parameters` (so an empty `rope_parameters` gives way to `rope_scaling`; both
/// non-empty is refused by [`check_one_rope_source`]), and its base is the dict's own
/// `rope_theta`, else the top-level `rope_theta`, else the config class's `default_theta`
/// (`setdefault`). A null `rope_theta` where HF reads it stays None in HF's rope dict and
/// its rotary embedding fails: refused by name.
fn rope_source<'a>(
    f: &Fields<'a>,
    default_theta: f64,
) -> Result<(Option<Fields<'a>>, f64), FrontendError> {
    let params = match f.opt_object("rope_parameters")? {
        Some(rp) if !rp.is_empty() => Some(f.nested("rope_parameters", rp)),
        _ => match f.opt_object("rope_scaling")? {
            Some(rs) => Some(f.nested("rope_scaling", rs)),
            None => f
                .opt_object("rope_parameters")?
                .map(|rp| f.nested("rope_parameters", rp)),
        },
    };
    let null_theta = |g: &Fields| -> Result<(), FrontendError> {
        if g.obj.get("rope_theta").is_some_and(|v| v.is_null()) {
            return Err(g.err(
                "rope_theta",
                "is null: HF keeps the None as the rope base and its rotary embedding fails; give a number, or remove the key for the config class's default",
            ));
        }
        Ok(())
    };
    if let Some(p) = &params {
        null_theta(p)?;
        if let Some(t) = p.opt_f64("rope_theta")? {
            return Ok((params, t));
        }
    }
    null_theta(f)?;
    let theta = f.opt_f64("rope_theta")?.unwrap_or(default_theta);
    Ok((params, theta))
}

/// The rope of `params` (a `rope_parameters` or `rope_scaling` object) with base `theta`;
/// `f` is the config's top level (`partial_rotary_factor`, `max_position_embeddings`).
///
/// `top_level_original`: the top-level `original_max_position_embeddings` overrides the
/// rope dict's (HF does so for a config's one global rope dict, see [`top_level_original`]).
pub(crate) fn rope_from(
    f: &Fields,
    params: Option<Fields>,
    theta: f64,
    head_dim: usize,
    top_level_original: bool,
) -> Result<RopeConfig, FrontendError> {
    let top_original = if top_level_original {
        self::top_level_original(f)?
    } else {
        None
    };
    if !(theta.is_finite() && theta > 0.0) {
        let field = if f.has("rope_theta") {
            "rope_theta".to_string()
        } else {
            "rope_parameters.rope_theta".to_string()
        };
        return Err(FrontendError::config(
            f.file,
            &field,
            format!("must be a positive number, got {theta}"),
        ));
    }

    // partial_rotary_factor: in rope_parameters (5) or at the top level (4).
    let prf_field;
    let prf = match params
        .as_ref()
        .map(|p| p.opt_f64("partial_rotary_factor"))
        .transpose()?
        .flatten()
    {
        Some(x) => {
            prf_field = "rope_parameters.partial_rotary_factor".to_string();
            x
        }
        None => {
            prf_field = "partial_rotary_factor".to_string();
            f.opt_f64("partial_rotary_factor")?.unwrap_or(1.0)
        }
    };
    if !(prf > 0.0 && prf <= 1.0) {
        return Err(FrontendError::config(
            f.file,
            &prf_field,
            format!("must be in (0, 1], got {prf}"),
        ));
    }
    let rotary_dim = (head_dim as f64 * prf) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
        return Err(FrontendError::config(
            f.file,
            &prf_field,
            format!("gives a rotary dim of {rotary_dim} (head_dim {head_dim} x {prf}); it must be positive and even"),
        ));
    }

    let scaling = match &params {
        None => RopeScaling::None,
        Some(p) => {
            let (type_key, rope_type) = match p.opt_str("rope_type")? {
                Some(t) => ("rope_type", t),
                None => ("type", p.opt_str("type")?.unwrap_or("default")),
            };
            match rope_type {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear {
                    factor: Float(p.positive_f64("factor")?),
                },
                "llama3" => {
                    let orig =
                        match top_original.or(p.opt_usize("original_max_position_embeddings")?) {
                            Some(n) => n,
                            None => f.opt_usize("max_position_embeddings")?.ok_or_else(|| {
                                p.err("original_max_position_embeddings", "is missing")
                            })?,
                        };
                    let (lo, hi) = (
                        p.positive_f64("low_freq_factor")?,
                        p.positive_f64("high_freq_factor")?,
                    );
                    if hi <= lo {
                        return Err(p.err(
                            "high_freq_factor",
                            format!("must exceed low_freq_factor ({lo}), got {hi}"),
                        ));
                    }
                    RopeScaling::Llama3 {
                        factor: Float(p.positive_f64("factor")?),
                        low_freq_factor: Float(lo),
                        high_freq_factor: Float(hi),
                        original_max_position_embeddings: orig as i64,
                    }
                }
                "yarn" => parse_yarn(f, p, top_original)?,
                other => {
                    return Err(FrontendError::UnsupportedRope {
                        file: f.file.to_string(),
                        field: p.name(type_key),
                        rope_type: other.to_string(),
                    })
                }
            }
        }
    };
    Ok(RopeConfig {
        theta,
        scaling,
        rotary_dim,
    })
}

/// gpt-oss's rope: `GptOssConfig` defaults `rope_theta` to 150000 and, with no
/// `rope_parameters` / `rope_scaling`, uses YaRN (factor 32, beta_fast 32, beta_slow 1,
/// original_max_position_embeddings 4096, truncate false).
fn parse_gpt_oss_rope(f: &Fields, head_dim: usize) -> Result<RopeConfig, FrontendError> {
    let default_theta = class_defaults(Family::GptOss).rope_theta;
    // HF replaces only a None `rope_parameters` by the YaRN dict (an empty one stays
    // empty: the default rope), and then takes a non-empty `rope_scaling` over either.
    let has_params = f.opt_object("rope_parameters")?.is_some()
        || f.opt_object("rope_scaling")?
            .is_some_and(|rs| !rs.is_empty());
    if !has_params {
        let (_, theta) = rope_source(f, default_theta)?;
        if !(theta.is_finite() && theta > 0.0) {
            return Err(f.err(
                "rope_theta",
                format!("must be a positive number, got {theta}"),
            ));
        }
        return Ok(RopeConfig {
            theta,
            scaling: RopeScaling::Yarn {
                factor: Float(32.0),
                beta_fast: Float(32.0),
                beta_slow: Float(1.0),
                original_max_position_embeddings: 4096,
                attention_factor: Float(weft_ir::yarn_attention_factor(32.0, None, None)),
                truncate: false,
            },
            rotary_dim: head_dim,
        });
    }
    parse_rope(f, head_dim, default_theta)
}

/// YaRN with HF's defaults (`_compute_yarn_parameters`): `factor` (null: the ratio of
/// `max_position_embeddings` to `original_max_position_embeddings`), `beta_fast` 32,
/// `beta_slow` 1 (absent, null or 0 all take the default, as HF's `or`),
/// `original_max_position_embeddings` (default `max_position_embeddings`), `truncate`
/// true, and `attention_factor` from `mscale` / `mscale_all_dim` when absent.
fn parse_yarn(
    f: &Fields,
    p: &Fields,
    top_original: Option<usize>,
) -> Result<RopeScaling, FrontendError> {
    let orig = match top_original.or(p.opt_usize("original_max_position_embeddings")?) {
        Some(0) => {
            return Err(p.err(
                "original_max_position_embeddings",
                "must be positive, got 0",
            ))
        }
        Some(n) => n,
        None => f
            .opt_usize("max_position_embeddings")?
            .ok_or_else(|| p.err("original_max_position_embeddings", "is missing"))?,
    };
    if i64::try_from(orig).is_err() {
        return Err(p.err("original_max_position_embeddings", "is too large"));
    }
    let factor = match p.opt_f64("factor")? {
        Some(x) => x,
        None => match f.opt_usize("max_position_embeddings")? {
            Some(m) if p.obj.contains_key("factor") => m as f64 / orig as f64,
            _ => return Err(p.err("factor", "is missing")),
        },
    };
    if !(factor.is_finite() && factor > 0.0) {
        return Err(p.err("factor", format!("must be a positive number, got {factor}")));
    }
    let finite_or = |key: &str, default: f64| -> Result<f64, FrontendError> {
        match p.opt_f64(key)? {
            None => Ok(default),
            Some(0.0) => Ok(default), // HF: `get(key) or default`
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            Some(x) => Err(p.err(key, format!("must be a positive number, got {x}"))),
        }
    };
    let (beta_fast, beta_slow) = (finite_or("beta_fast", 32.0)?, finite_or("beta_slow", 1.0)?);
    let opt_finite = |key: &str| -> Result<Option<f64>, FrontendError> {
        match p.opt_f64(key)? {
            Some(x) if !x.is_finite() => {
                Err(p.err(key, format!("must be a finite number, got {x}")))
            }
            v => Ok(v),
        }
    };
    let attention_factor = match opt_finite("attention_factor")? {
        Some(a) => a,
        None => weft_ir::yarn_attention_factor(
            factor,
            opt_finite("mscale")?,
            opt_finite("mscale_all_dim")?,
        ),
    };
    Ok(RopeScaling::Yarn {
        factor: Float(factor),
        beta_fast: Float(beta_fast),
        beta_slow: Float(beta_slow),
        original_max_position_embeddings: orig as i64,
        attention_factor: Float(attention_factor),
        // HF: `rope_parameters.get("truncate", True)`, so null does not truncate
        truncate: p.flag("truncate", true)?,
    })
}

fn parse_moe(
    f: &Fields,
    family: Family,
    layers: usize,
) -> Result<Option<MoeConfig>, FrontendError> {
    // Qwen3MoeConfig's field is `num_experts`; some exports spell it as Mixtral does.
    let experts_key = |f: &Fields| {
        if f.has("num_local_experts") && !f.has("num_experts") {
            "num_local_experts"
        } else {
            "num_experts"
        }
    };
    let check_k = |e: usize, k: usize| {
        if k > e {
            Err(f.err(
                "num_experts_per_tok",
                format!("is {k}, more than the {e} experts"),
            ))
        } else {
            Ok(())
        }
    };
    check_expert_count_aliases(f, family)?;
    // MixtralConfig and GptOssConfig map `num_experts` to `num_local_experts`
    // (`attribute_map`): either name gives the count.
    let local_experts_key = |f: &Fields| {
        if !f.has("num_local_experts") && f.has("num_experts") {
            "num_experts"
        } else {
            "num_local_experts"
        }
    };
    let aux_loss_coef = match family {
        Family::Mixtral | Family::Qwen3Moe | Family::GptOss => parse_router_loss(f, family)?,
        _ => None,
    };
    match family {
        Family::Mixtral => {
            let e = f.positive(local_experts_key(f))?;
            let k = f.positive("num_experts_per_tok")?;
            check_k(e, k)?;
            Ok(Some(MoeConfig {
                num_experts: e,
                top_k: k,
                expert_intermediate_size: 0, // set from intermediate_size by the caller
                norm_topk_prob: true,
                sparse_layers: vec![true; layers],
                aux_loss_coef,
                kind: MoeKind::Softmax,
                router: Router::Softmax,
                shared_expert_intermediate_size: None,
            }))
        }
        Family::GptOss => {
            let e = f.positive(local_experts_key(f))?;
            let k = f.opt_usize("num_experts_per_tok")?.unwrap_or(4);
            if k == 0 {
                return Err(f.err("num_experts_per_tok", "must be positive, got 0"));
            }
            check_k(e, k)?;
            // transformers 5.17 hard-codes both (and ignores the fields); later versions
            // read them. Only the values every version computes are accepted.
            for (key, value) in [
                ("swiglu_limit", GPT_OSS_SWIGLU_LIMIT),
                ("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA),
            ] {
                if let Some(x) = f.opt_f64(key)? {
                    if x != value {
                        return Err(f.err(
                            key,
                            format!("is {x}, but Weft implements gpt-oss's clamped SwiGLU with {key} {value} only (transformers up to 5.17 hard-codes {value} and ignores the field; later versions apply it): set it to {value}"),
                        ));
                    }
                }
            }
            Ok(Some(MoeConfig {
                num_experts: e,
                top_k: k,
                expert_intermediate_size: 0, // set from intermediate_size by the caller
                norm_topk_prob: false,
                sparse_layers: vec![true; layers],
                aux_loss_coef,
                kind: MoeKind::GptOss,
                router: Router::Softmax,
                shared_expert_intermediate_size: None,
            }))
        }
        Family::Qwen3Moe => {
            let e = f.usize(experts_key(f))?;
            let only_dense = f.usize_list("mlp_only_layers")?;
            let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(f.err("decoder_sparse_step", "must be positive, got 0"));
            }
            let sparse_layers: Vec<bool> = (0..layers)
                .map(|i| !only_dense.contains(&i) && e > 0 && (i + 1) % step == 0)
                .collect();
            if !sparse_layers.iter().any(|s| *s) {
                if aux_loss_coef.is_some() {
                    // HF's load_balancing_loss_func indexes the (empty) router logits and fails.
                    return Err(f.err(
                        "output_router_logits",
                        "is true but no layer is sparse (mlp_only_layers, decoder_sparse_step): there are no router logits for the load-balancing loss (HF fails there too); set it to false",
                    ));
                }
                return Ok(None);
            }
            let k = f.positive("num_experts_per_tok")?;
            check_k(e, k)?;
            Ok(Some(MoeConfig {
                num_experts: e,
                top_k: k,
                expert_intermediate_size: f.positive("moe_intermediate_size")?,
                norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(false),
                sparse_layers,
                aux_loss_coef,
                kind: MoeKind::Softmax,
                router: Router::Softmax,
                shared_expert_intermediate_size: None,
            }))
        }
        Family::DeepseekV3 => crate::deepseek::parse_moe(f, layers),
        _ => Ok(None),
    }
}

/// HF's config classes alias the expert count (`attribute_map`: mixtral, qwen3_moe and
/// gpt_oss `num_experts` -> `num_local_experts`, deepseek_v3 `num_local_experts` ->
/// `n_routed_experts`); a config giving both names with different values has whichever
/// HF happens to set last. Refused, naming the alias.
fn check_expert_count_aliases(f: &Fields, family: Family) -> Result<(), FrontendError> {
    let (a, b) = match family {
        Family::Mixtral | Family::Qwen3Moe | Family::GptOss => ("num_local_experts", "num_experts"),
        Family::DeepseekV3 => ("n_routed_experts", "num_local_experts"),
        _ => return Ok(()),
    };
    if let (Some(x), Some(y)) = (f.opt_usize(a)?, f.opt_usize(b)?) {
        if x != y {
            return Err(f.err(
                b,
                format!("is {y}, but {a} is {x}: HF's {family} config treats the two names as one field, so the expert count is ambiguous; keep one"),
            ));
        }
    }
    Ok(())
}

/// The router fields that change HF's loss: `output_router_logits` (then
/// `router_aux_loss_coef`), and mixtral's `router_jitter_noise` (refused: HF multiplies
/// the MoE input by uniform noise in training, which Weft does not implement).
fn parse_router_loss(f: &Fields, family: Family) -> Result<Option<f64>, FrontendError> {
    if family == Family::Mixtral {
        let jitter = f.opt_f64("router_jitter_noise")?.unwrap_or(0.0);
        if jitter != 0.0 {
            return Err(f.err(
                "router_jitter_noise",
                format!("is {jitter}: HF multiplies the MoE input by uniform noise in training, which Weft does not implement (set it to 0)"),
            ));
        }
    }
    if !f.opt_bool("output_router_logits")?.unwrap_or(false) {
        return Ok(None);
    }
    match f.opt_f64("router_aux_loss_coef")?.unwrap_or(0.001) {
        c if c.is_finite() => Ok(Some(c)),
        c => Err(f.err(
            "router_aux_loss_coef",
            format!("must be a finite number, got {c}"),
        )),
    }
}

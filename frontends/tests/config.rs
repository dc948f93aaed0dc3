//! Config parsing: both transformers forms, defaults, and errors that name the field.

mod common;

use common::preset_with;
use weft_frontends::{load, Activation, FrontendError, ModelConfig};
use weft_ir::{DType, Float, RopeScaling};

fn parse(json: &str) -> Result<ModelConfig, FrontendError> {
    ModelConfig::from_json_str(json, "test/config.json")
}

const BASE: &str = r#"{"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

fn base_with(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<ModelConfig, FrontendError> {
    let mut v: serde_json::Value = serde_json::from_str(BASE).unwrap();
    edit(v.as_object_mut().unwrap());
    ModelConfig::from_json(&v, "test/config.json")
}

#[test]
fn defaults_of_a_minimal_config() {
    let c = parse(BASE).unwrap();
    assert_eq!(c.head_dim, 8);
    assert_eq!(c.dtype, DType::F32);
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.initializer_range, 0.02);
    assert_eq!(c.rope.scaling, RopeScaling::None);
    assert_eq!(c.rope.rotary_dim, 8);
}

#[test]
fn head_dim_null_is_hidden_over_heads() {
    let c = base_with(|o| {
        o.insert("head_dim".into(), serde_json::Value::Null);
    })
    .unwrap();
    assert_eq!(c.head_dim, 8);
    let c = base_with(|o| {
        o.insert("head_dim".into(), 16.into());
    })
    .unwrap();
    assert_eq!(c.head_dim, 16);
}

#[test]
fn dtype_from_dtype_or_torch_dtype() {
    let c = base_with(|o| {
        o.insert("torch_dtype".into(), "bfloat16".into());
    })
    .unwrap();
    assert_eq!(c.dtype, DType::BF16);
    let c = base_with(|o| {
        o.insert("dtype".into(), "float16".into());
    })
    .unwrap();
    assert_eq!(c.dtype, DType::F16);
    let e = base_with(|o| {
        o.insert("dtype".into(), "int8".into());
    })
    .unwrap_err();
    assert_eq!(e.to_string(), "invalid config in test/config.json: field `dtype` is `int8`; expected float32, bfloat16, float16 or float64");
}

#[test]
fn transformers_4_and_5_rope_forms_agree() {
    let v4 = r#"{"rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;
    let v5 = r#"{"rope_parameters": {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;
    let with = |extra: &str| {
        base_with(|o| {
            o.remove("rope_theta");
            let e: serde_json::Value = serde_json::from_str(extra).unwrap();
            o.extend(e.as_object().unwrap().clone());
        })
        .unwrap()
    };
    let (a, b) = (with(v4), with(v5));
    assert_eq!(a, b);
    assert_eq!(a.rope.theta, 500000.0);
    assert_eq!(
        a.rope.scaling,
        RopeScaling::Llama3 {
            factor: Float(8.0),
            low_freq_factor: Float(1.0),
            high_freq_factor: Float(4.0),
            original_max_position_embeddings: 8192
        }
    );
    // Old configs say `type` instead of `rope_type`.
    let lin = with(r#"{"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}"#);
    assert_eq!(lin.rope.scaling, RopeScaling::Linear { factor: Float(2.0) });
    let default = with(r#"{"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}"#);
    assert_eq!(default.rope.scaling, RopeScaling::None);
}

#[test]
fn other_rope_types_are_a_clear_error() {
    let e = base_with(|o| {
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "longrope", "factor": 4.0}),
        );
    })
    .unwrap_err();
    assert!(
        matches!(&e, FrontendError::UnsupportedRope { field, rope_type, .. } if field == "rope_scaling.rope_type" && rope_type == "longrope")
    );
    assert_eq!(
        e.to_string(),
        "unsupported rope type `longrope` in test/config.json: field `rope_scaling.rope_type`"
    );
    assert_eq!(
        e.help().unwrap(),
        "supported rope types: default, linear, llama3, yarn"
    );
    let e = base_with(|o| {
        o.remove("rope_theta");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
        );
    })
    .unwrap_err();
    assert!(e.to_string().contains("`rope_parameters.rope_type`"), "{e}");
}

/// YaRN with HF's defaults: original_max_position_embeddings from
/// max_position_embeddings, beta_fast 32 / beta_slow 1 (also for 0, HF's `or`), truncate
/// true, the attention factor from the factor or from mscale / mscale_all_dim, an explicit
/// attention_factor as given, and a null factor as max / original positions.
#[test]
fn yarn_fields_and_defaults() {
    let yarn = |params: serde_json::Value| {
        base_with(|o| {
            o.insert("max_position_embeddings".into(), 8192.into());
            o.insert("rope_scaling".into(), params);
        })
    };
    let c = yarn(serde_json::json!({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0})).unwrap();
    assert_eq!(
        c.rope.scaling,
        RopeScaling::Yarn {
            factor: Float(4.0),
            beta_fast: Float(32.0),
            beta_slow: Float(1.0),
            original_max_position_embeddings: 8192,
            attention_factor: Float(0.1 * 4f64.ln() + 1.0),
            truncate: true,
        }
    );
    let c = yarn(
        serde_json::json!({"type": "yarn", "factor": null, "original_max_position_embeddings": 2048,
        "mscale": 0.8, "mscale_all_dim": 0.6, "truncate": false}),
    )
    .unwrap();
    let RopeScaling::Yarn {
        factor,
        attention_factor,
        truncate,
        ..
    } = c.rope.scaling
    else {
        panic!("{:?}", c.rope.scaling)
    };
    assert_eq!(factor, Float(4.0));
    assert_eq!(
        attention_factor,
        Float(weft_ir::yarn_attention_factor(4.0, Some(0.8), Some(0.6)))
    );
    assert!(!truncate);
    let c = yarn(serde_json::json!({"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.5}))
        .unwrap();
    assert_eq!(c.rope.scaling.attention_factor(), 0.5);
    for (params, field) in [
        (
            serde_json::json!({"rope_type": "yarn"}),
            "rope_scaling.factor",
        ),
        (
            serde_json::json!({"rope_type": "yarn", "factor": -1.0}),
            "rope_scaling.factor",
        ),
        (
            serde_json::json!({"rope_type": "yarn", "factor": 2.0, "beta_fast": -3.0}),
            "rope_scaling.beta_fast",
        ),
        (
            serde_json::json!({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}),
            "rope_scaling.original_max_position_embeddings",
        ),
    ] {
        let e = yarn(params.clone()).unwrap_err();
        assert!(
            e.to_string().contains(&format!("`{field}`")),
            "{params}: {e}"
        );
    }
}

const GPT_OSS: &str = r#"{"model_type": "gpt_oss", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
  "num_local_experts": 4}"#;

fn gpt_oss_with(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<ModelConfig, FrontendError> {
    let mut v: serde_json::Value = serde_json::from_str(GPT_OSS).unwrap();
    edit(v.as_object_mut().unwrap());
    ModelConfig::from_json(&v, "test/config.json")
}

/// GptOssConfig's class defaults: head_dim 64 when absent, attention biases, sinks,
/// window 128 on the even layers, rope_theta 150000 with YaRN (factor 32, original
/// 4096, truncate false), top-4 routing of the local experts.
#[test]
fn gpt_oss_defaults() {
    let c = gpt_oss_with(|_| {}).unwrap();
    assert_eq!(c.head_dim, 64);
    assert!(c.qkv_bias && c.o_bias && c.attention_sinks);
    assert_eq!(c.layer_windows, vec![Some(128), None, Some(128), None]);
    assert_eq!(c.rope.theta, 150000.0);
    assert_eq!(
        c.rope.scaling,
        RopeScaling::Yarn {
            factor: Float(32.0),
            beta_fast: Float(32.0),
            beta_slow: Float(1.0),
            original_max_position_embeddings: 4096,
            attention_factor: Float(0.1 * 32f64.ln() + 1.0),
            truncate: false,
        }
    );
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (4, 4, 64)
    );
    assert_eq!(moe.kind, weft_frontends::config::MoeKind::GptOss);
    // head_dim null derives it; attention_bias false drops the biases
    let c = gpt_oss_with(|o| {
        o.insert("head_dim".into(), serde_json::Value::Null);
        o.insert("attention_bias".into(), false.into());
        o.insert("rope_theta".into(), 1e4.into());
        o.insert(
            "layer_types".into(),
            serde_json::json!([
                "full_attention",
                "full_attention",
                "sliding_attention",
                "full_attention"
            ]),
        );
        o.insert("sliding_window".into(), 7.into());
    })
    .unwrap();
    assert_eq!(c.head_dim, 8);
    assert!(!c.qkv_bias && !c.o_bias);
    assert_eq!(c.rope.theta, 1e4);
    assert_eq!(c.layer_windows, vec![None, None, Some(7), None]);
}

#[test]
fn gpt_oss_refusals_name_the_field() {
    for (key, value, field) in [
        ("swiglu_limit", serde_json::json!(5.0), "swiglu_limit"),
        // transformers > 5.17 reads it (GptOssExperts.alpha); Weft implements 1.702 only
        ("swiglu_alpha", serde_json::json!(1.5), "swiglu_alpha"),
        ("sliding_window", serde_json::Value::Null, "layer_types"),
        (
            "num_experts_per_tok",
            serde_json::json!(5),
            "num_experts_per_tok",
        ),
        (
            "attention_dropout",
            serde_json::json!(0.1),
            "attention_dropout",
        ),
    ] {
        let e = gpt_oss_with(|o| {
            o.insert(key.into(), value.clone());
        })
        .unwrap_err();
        assert!(
            e.to_string().contains(&format!("`{field}`")),
            "{key}={value}: {e}"
        );
    }
    assert!(gpt_oss_with(|o| {
        o.insert("swiglu_limit".into(), 7.0.into());
        o.insert("swiglu_alpha".into(), 1.702.into());
    })
    .is_ok());
}

#[test]
fn unknown_model_type_names_it_and_the_file() {
    let e = base_with(|o| {
        o.insert("model_type".into(), "gpt2".into());
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown model_type `gpt2` in test/config.json"
    );
    assert!(e
        .help()
        .unwrap()
        .contains("llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe"));
}

#[test]
fn missing_and_invalid_fields_are_named() {
    for field in [
        "model_type",
        "hidden_size",
        "vocab_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
    ] {
        let e = base_with(|o| {
            o.remove(field);
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("invalid config in test/config.json: field `{field}` is missing"),
            "{field}"
        );
    }
    let e = base_with(|o| {
        o.insert("hidden_size".into(), "big".into());
    })
    .unwrap_err();
    assert_eq!(e.to_string(), "invalid config in test/config.json: field `hidden_size` must be a non-negative integer, got \"big\"");
    let e = base_with(|o| {
        o.insert("num_key_value_heads".into(), 3.into());
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("field `num_key_value_heads` must divide num_attention_heads (4), got 3"),
        "{e}"
    );
    let e = base_with(|o| {
        o.insert("hidden_act".into(), "quick_gelu".into());
    })
    .unwrap_err();
    assert!(
        e.to_string().contains("field `hidden_act` is `quick_gelu`"),
        "{e}"
    );
    // HF's ACT2FN GELUs: exact, and the tanh approximation under its three names.
    for (act, want) in [
        ("gelu", Activation::Gelu),
        ("gelu_pytorch_tanh", Activation::GeluTanh),
        ("gelu_new", Activation::GeluTanh),
        ("gelu_fast", Activation::GeluTanh),
        ("relu", Activation::Relu),
    ] {
        let c = base_with(|o| {
            o.insert("hidden_act".into(), act.into());
        })
        .unwrap();
        assert_eq!(c.activation, want, "{act}");
    }
    // `swish` is HF's alias of SiLU: the same model.
    let swish = base_with(|o| {
        o.insert("hidden_act".into(), "swish".into());
    })
    .unwrap();
    assert_eq!(swish, base_with(|_| {}).unwrap());
    let e = base_with(|o| {
        o.insert("rope_scaling".into(), serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}));
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("field `rope_scaling.high_freq_factor` is missing"),
        "{e}"
    );
    assert!(matches!(parse("[1, 2]"), Err(FrontendError::Json { .. })));
    assert!(matches!(parse("{"), Err(FrontendError::Json { .. })));
}

#[test]
fn moe_fields() {
    let e = preset_with("mixtral-tiny", |_| {});
    let moe = e.moe.unwrap();
    assert_eq!(
        (
            moe.num_experts,
            moe.top_k,
            moe.expert_intermediate_size,
            moe.norm_topk_prob
        ),
        (4, 2, 64, true)
    );
    // qwen3_moe accepts num_experts (Hub) or num_local_experts (transformers 5 save).
    let q = load("qwen3-30b-a3b").unwrap().config.unwrap();
    assert_eq!(q.moe.as_ref().unwrap().num_experts, 128);
    let q = preset_with("qwen3-moe-tiny", |o| {
        let n = o.remove("num_local_experts").unwrap();
        o.insert("num_experts".into(), n);
    });
    assert_eq!(q.moe.as_ref().unwrap().num_experts, 4);
    // Neither present: Qwen3MoeConfig's default, 128.
    let q = preset_with("qwen3-moe-tiny", |o| {
        o.remove("num_local_experts");
    });
    assert_eq!(q.moe.as_ref().unwrap().num_experts, 128);
    // null: the error names Qwen3MoeConfig's own field.
    let mut v: serde_json::Value =
        serde_json::from_str(&load_preset_json("qwen3-moe-tiny")).unwrap();
    v.as_object_mut().unwrap().remove("num_local_experts");
    v["num_experts"] = serde_json::Value::Null;
    let e = ModelConfig::from_json(&v, "x.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`num_experts`") && !e.contains("num_local_experts"),
        "{e}"
    );
    let e = ModelConfig::from_json_str(
        &load_preset_json("qwen3-moe-tiny")
            .replace("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5"),
        "x.json",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("field `num_experts_per_tok` is 5, more than the 4 experts"),
        "{e}"
    );
}

fn load_preset_json(name: &str) -> String {
    weft_frontends::presets::find_preset(name)
        .unwrap()
        .config_json
        .to_string()
}

#[test]
fn qwen3_moe_dense_layers_use_the_dense_mlp() {
    let c = preset_with("qwen3-moe-tiny", |o| {
        o.insert("mlp_only_layers".into(), serde_json::json!([1]));
    });
    assert!(c.is_sparse_layer(0) && !c.is_sparse_layer(1));
    let m = weft_frontends::Model::from_config("q", c, weft_frontends::Origin::Preset("q".into()))
        .unwrap();
    let names: Vec<String> = m.graph.params().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"model.layers.0.mlp.experts.gate_up_proj".to_string()));
    assert!(names.contains(&"model.layers.1.mlp.gate_proj.weight".to_string()));
    assert!(!names.contains(&"model.layers.1.mlp.gate.weight".to_string()));
    weft_ir::verify(&m.graph).unwrap();
    let c = preset_with("qwen3-moe-tiny", |o| {
        o.insert("decoder_sparse_step".into(), 2.into());
    });
    assert!(!c.is_sparse_layer(0) && c.is_sparse_layer(1));
}

#[test]
fn attention_and_mlp_biases_follow_hf() {
    let q2 = load("qwen2-tiny").unwrap();
    let names: Vec<String> = q2.graph.params().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"model.layers.0.self_attn.q_proj.bias".to_string()));
    assert!(!names.contains(&"model.layers.0.self_attn.o_proj.bias".to_string()));
    let c = preset_with("llama-tiny", |o| {
        o.insert("attention_bias".into(), true.into());
        o.insert("mlp_bias".into(), true.into());
    });
    assert!(c.qkv_bias && c.o_bias && c.mlp_bias);
    let m = weft_frontends::Model::from_config("b", c, weft_frontends::Origin::Preset("b".into()))
        .unwrap();
    weft_ir::verify(&m.graph).unwrap();
    let names: Vec<String> = m.graph.params().into_iter().map(|(n, _)| n).collect();
    for n in [
        "self_attn.o_proj.bias",
        "mlp.down_proj.bias",
        "self_attn.k_proj.bias",
    ] {
        assert!(names.contains(&format!("model.layers.0.{n}")), "{n}");
    }
}

#[test]
fn partial_rotary_factor_sets_the_rotary_dim() {
    let c = preset_with("phi3-tiny", |o| {
        o["rope_parameters"]["partial_rotary_factor"] = 0.5.into();
    });
    assert_eq!(c.rope.rotary_dim, 4);
    let m = weft_frontends::Model::from_config("p", c, weft_frontends::Origin::Preset("p".into()))
        .unwrap();
    weft_ir::verify(&m.graph).unwrap();
    assert!(weft_ir::print(&m.graph).contains("{theta=10000.0, dim=4, scaling=none}"));
}

#[test]
fn sliding_window_is_recorded() {
    assert_eq!(
        load("phi3-mini").unwrap().config.unwrap().layer_windows,
        vec![Some(2047); 32]
    );
    assert_eq!(
        load("mistral-7b").unwrap().config.unwrap().sliding_window,
        Some(4096)
    );
    assert_eq!(
        load("qwen2.5-7b").unwrap().config.unwrap().sliding_window,
        None
    ); // use_sliding_window false
    assert_eq!(
        load("llama3-8b").unwrap().config.unwrap().sliding_window,
        None
    );
}

/// `preset_with`, or the error.
fn preset_try(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<ModelConfig, FrontendError> {
    let mut v: serde_json::Value = serde_json::from_str(&load_preset_json(name)).unwrap();
    edit(v.as_object_mut().unwrap());
    ModelConfig::from_json(&v, "test/config.json")
}

#[test]
fn router_fields_that_change_the_loss() {
    // output_router_logits: HF adds router_aux_loss_coef (default 0.001) x the aux loss.
    for name in ["mixtral-tiny", "qwen3-moe-tiny"] {
        let off = preset_try(name, |_| {}).unwrap();
        assert_eq!(off.moe.unwrap().aux_loss_coef, None, "{name}");
        let on = preset_try(name, |o| {
            o.insert("output_router_logits".into(), true.into());
            o.remove("router_aux_loss_coef");
        })
        .unwrap();
        assert_eq!(on.moe.unwrap().aux_loss_coef, Some(0.001), "{name}");
        let c = preset_try(name, |o| {
            o.insert("output_router_logits".into(), true.into());
            o.insert("router_aux_loss_coef".into(), 0.02.into());
        })
        .unwrap();
        assert_eq!(c.moe.unwrap().aux_loss_coef, Some(0.02), "{name}");
    }
    // Mixtral's router jitter multiplies the MoE input by noise in training: refused.
    let e = preset_try("mixtral-tiny", |o| {
        o.insert("router_jitter_noise".into(), 0.01.into());
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("field `router_jitter_noise` is 0.01"), "{e}");
    // No sparse layer: no router logits (HF's aux loss fails on the empty tuple).
    let e = preset_try("qwen3-moe-tiny", |o| {
        o.insert("output_router_logits".into(), true.into());
        o.insert("mlp_only_layers".into(), serde_json::json!([0, 1]));
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("field `output_router_logits` is true but no layer is sparse"),
        "{e}"
    );
    // The graph then has the loss parts as outputs.
    let c = preset_try("qwen3-moe-tiny", |o| {
        o.insert("output_router_logits".into(), true.into());
    })
    .unwrap();
    let m = weft_frontends::Model::from_config("q", c, weft_frontends::Origin::Preset("q".into()))
        .unwrap();
    let outs: Vec<&str> = m.graph.outputs().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(outs, ["loss", "logits", "ce_loss", "aux_loss"]);
    weft_ir::verify(&m.graph).unwrap();
}

/// The BASE config as `model_type` with `edit` applied.
fn family_with(
    model_type: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<ModelConfig, FrontendError> {
    base_with(|o| {
        o.insert("model_type".into(), model_type.into());
        edit(o)
    })
}

#[test]
fn sliding_window_defaults_follow_each_hf_class() {
    use serde_json::{json, Value};
    // the key absent: HF's class default (mistral 4096, mixtral and phi3 none)
    // (phi3's default pad_token_id, 32000, is past this config's vocabulary: HF refuses
    // it, so these set pad_token_id null; the window does not depend on it)
    let absent = |t: &str| {
        family_with(t, |o| {
            o.insert("pad_token_id".into(), Value::Null);
        })
        .unwrap()
        .layer_windows
    };
    assert_eq!(absent("mistral"), vec![Some(4096); 2]);
    assert_eq!(absent("phi3"), vec![None; 2]);
    assert_eq!(absent("llama"), vec![None; 2]);
    // null: no window; a number: every layer
    let with = |t: &str, v: Value| {
        family_with(t, |o| {
            o.insert("pad_token_id".into(), Value::Null);
            o.insert("sliding_window".into(), v);
        })
        .unwrap()
        .layer_windows
    };
    assert_eq!(with("mistral", Value::Null), vec![None; 2]);
    assert_eq!(with("phi3", json!(2047)), vec![Some(2047); 2]);
    // qwen2/qwen3: only with use_sliding_window, and from max_window_layers (default 28) on
    let qwen = |t: &str, extra: Value| {
        family_with(t, |o| {
            o.insert("num_hidden_layers".into(), json!(4));
            for (k, v) in extra.as_object().unwrap() {
                o.insert(k.clone(), v.clone());
            }
        })
        .unwrap()
        .layer_windows
    };
    assert_eq!(qwen("qwen2", json!({"sliding_window": 8})), vec![None; 4]);
    assert_eq!(
        qwen("qwen2", json!({"use_sliding_window": true})),
        vec![None; 4]
    );
    assert_eq!(
        qwen(
            "qwen2",
            json!({"use_sliding_window": true, "max_window_layers": 2})
        ),
        vec![None, None, Some(4096), Some(4096)]
    );
    assert_eq!(
        qwen(
            "qwen3",
            json!({"use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1,
            "layer_types": ["sliding_attention", "full_attention", "attention", "sliding_attention"]})
        ),
        vec![Some(8), None, None, Some(8)],
        "layer_types wins over max_window_layers"
    );
    // qwen3_moe: every layer (HF reads no max_window_layers for it)
    let moe = family_with("qwen3_moe", |o| {
        for (k, v) in
            json!({"use_sliding_window": true, "sliding_window": 7, "max_window_layers": 1,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16})
            .as_object()
            .unwrap()
        {
            o.insert(k.clone(), v.clone());
        }
    })
    .unwrap();
    assert_eq!(moe.layer_windows, vec![Some(7); 2]);
}

#[test]
fn window_fields_weft_cannot_honour_are_refused_by_name() {
    use serde_json::json;
    let err = |t: &str, extra: serde_json::Value| {
        family_with(t, |o| {
            for (k, v) in extra.as_object().unwrap() {
                o.insert(k.clone(), v.clone());
            }
        })
        .unwrap_err()
        .to_string()
    };
    let e = err("mistral", json!({"sliding_window": 0}));
    assert!(e.contains("sliding_window") && e.contains("is 0"), "{e}");
    let e = err(
        "qwen2",
        json!({"use_sliding_window": true, "layer_types": ["full_attention", "chunked_attention"]}),
    );
    assert!(
        e.contains("layer_types") && e.contains("chunked_attention"),
        "{e}"
    );
    let e = err(
        "qwen3",
        json!({"layer_types": ["sliding_attention", "full_attention"]}),
    );
    assert!(
        e.contains("layer_types") && e.contains("use_sliding_window is false"),
        "{e}"
    );
    let e = err(
        "qwen2",
        json!({"use_sliding_window": true, "layer_types": ["full_attention"]}),
    );
    assert!(e.contains("layer_types") && e.contains("1 entries"), "{e}");
    let e = err(
        "mistral",
        json!({"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}),
    );
    assert!(e.contains("layer_types") && e.contains("ignores"), "{e}");
}

/// transformers 5.17 moves `partial_rotary_factor` into `rope_parameters`, but only
/// phi3's attention rotates part of each head: the other families' default rope ignores
/// it (full rotation) and their scaled ropes fail on it. Weft refuses it by name there
/// rather than rotating a part HF does not.
#[test]
fn partial_rotary_factor_is_refused_where_hf_rotates_every_feature() {
    for preset in [
        "llama-tiny",
        "mistral-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
        "mixtral-tiny",
        "qwen3-moe-tiny",
        "olmo2-tiny",
        "granite-tiny",
        "gemma2-tiny",
        "gpt-oss-tiny",
    ] {
        let json = load_preset_json(preset);
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["partial_rotary_factor"] = 0.5.into();
        let e = ModelConfig::from_json(&v, "test/config.json").unwrap_err();
        assert!(
            e.to_string()
                .contains("field `partial_rotary_factor` is 0.5, but HF's"),
            "{preset}: {e}"
        );
        // 1 is neutral.
        v["partial_rotary_factor"] = 1.0.into();
        ModelConfig::from_json(&v, "test/config.json").unwrap_or_else(|e| panic!("{preset}: {e}"));
    }
    // In the transformers-5 rope dict, and in gemma3's per-layer-type dicts.
    let e = base_with(|o| {
        o.remove("rope_theta");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
        );
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("field `rope_parameters.partial_rotary_factor` is 0.25"),
        "{e}"
    );
    let json = load_preset_json("gemma3-tiny");
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    o.remove("rope_local_base_freq");
    o.insert(
        "rope_parameters".into(),
        serde_json::json!({"full_attention": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    );
    let e = ModelConfig::from_json(&v, "test/config.json").unwrap_err();
    assert!(
        e.to_string()
            .contains("field `rope_parameters.full_attention.partial_rotary_factor` is 0.5"),
        "{e}"
    );
}

/// HF's `standardize_rope_params` copies a top-level `original_max_position_embeddings`
/// over the rope dict's own for llama3 and yarn rope (one global rope dict); gemma3's
/// per-layer-type dicts keep theirs.
#[test]
fn top_level_original_max_position_embeddings_wins_as_in_hf() {
    let c = base_with(|o| {
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        );
        o.insert("original_max_position_embeddings".into(), 4.into());
    })
    .unwrap();
    assert!(
        matches!(
            c.rope.scaling,
            RopeScaling::Llama3 {
                original_max_position_embeddings: 4,
                ..
            }
        ),
        "{:?}",
        c.rope.scaling
    );
    let c = base_with(|o| {
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        );
        o.insert("original_max_position_embeddings".into(), 8.into());
    })
    .unwrap();
    assert!(
        matches!(
            c.rope.scaling,
            RopeScaling::Yarn {
                original_max_position_embeddings: 8,
                ..
            }
        ),
        "{:?}",
        c.rope.scaling
    );
    // Without a rope dict field the top-level one also stands in for max_position_embeddings.
    let c = base_with(|o| {
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
        );
        o.insert("max_position_embeddings".into(), 64.into());
        o.insert("original_max_position_embeddings".into(), 8.into());
    })
    .unwrap();
    assert!(matches!(
        c.rope.scaling,
        RopeScaling::Yarn {
            original_max_position_embeddings: 8,
            ..
        }
    ));
    // gemma3: the per-layer-type dict keeps its own.
    let json = load_preset_json("gemma3-tiny");
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("rope_parameters");
    o.insert("rope_theta".into(), 1e6.into());
    o.insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    );
    o.insert("original_max_position_embeddings".into(), 8.into());
    let c = ModelConfig::from_json(&v, "test/config.json").unwrap();
    assert!(
        matches!(
            c.rope.scaling,
            RopeScaling::Yarn {
                original_max_position_embeddings: 32,
                ..
            }
        ),
        "{:?}",
        c.rope.scaling
    );
}

/// HF reads `rope_scaling` in place of `rope_parameters` when both are set; Weft refuses
/// the pair by name (an empty `rope_scaling` is no rope dict and passes).
#[test]
fn rope_scaling_beside_rope_parameters_is_refused() {
    let with = |scaling: serde_json::Value| {
        base_with(|o| {
            o.remove("rope_theta");
            o.insert(
                "rope_parameters".into(),
                serde_json::json!({"rope_type": "default", "rope_theta": 1e4}),
            );
            o.insert("rope_scaling".into(), scaling);
        })
    };
    let e = with(serde_json::json!({"rope_type": "linear", "factor": 4.0})).unwrap_err();
    assert!(
        e.to_string()
            .contains("field `rope_scaling` is given beside rope_parameters"),
        "{e}"
    );
    for neutral in [serde_json::json!({}), serde_json::Value::Null] {
        assert_eq!(with(neutral).unwrap().rope.scaling, RopeScaling::None);
    }
}

/// HF's Phi3Config renames `su` and `yarn` rope to `longrope` and refuses the other
/// types: Weft must not compute YaRN (or linear, llama3) for a phi3 config.
#[test]
fn phi3_rope_types_follow_phi3config() {
    for (t, want) in [
        (
            "yarn",
            "is `yarn`, which HF's Phi3Config reads as `longrope`",
        ),
        ("su", "is `su`, which HF's Phi3Config reads as `longrope`"),
        ("linear", "is `linear`, but HF's Phi3Config accepts only"),
        ("llama3", "is `llama3`, but HF's Phi3Config accepts only"),
    ] {
        let json = load_preset_json("phi3-tiny");
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let o = v.as_object_mut().unwrap();
        let theta = o["rope_parameters"]["rope_theta"].clone();
        o.remove("rope_parameters");
        o.insert("rope_theta".into(), theta);
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": t, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}),
        );
        let e = ModelConfig::from_json(&v, "test/config.json").unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("field `rope_scaling.type` {want}")),
            "{t}: {e}"
        );
    }
    // longrope keeps its unsupported-rope error (and help).
    let json = load_preset_json("phi3-tiny");
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v["rope_parameters"]["rope_type"] = "longrope".into();
    let e = ModelConfig::from_json(&v, "test/config.json").unwrap_err();
    assert!(matches!(e, FrontendError::UnsupportedRope { .. }), "{e}");
}

/// Qwen3Config's `head_dim` defaults to 128, not hidden_size / num_attention_heads (an
/// explicit null still derives it).
#[test]
fn qwen3_head_dim_defaults_to_128() {
    let json = load_preset_json("qwen3-tiny");
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v.as_object_mut().unwrap().remove("head_dim");
    let c = ModelConfig::from_json(&v, "test/config.json").unwrap();
    assert_eq!(c.head_dim, 128);
    v["head_dim"] = serde_json::Value::Null;
    let c = ModelConfig::from_json(&v, "test/config.json").unwrap();
    assert_eq!(c.head_dim, c.hidden_size / c.num_attention_heads);
}

/// HF takes a transformers-4 `rope_scaling` dict as `rope_parameters`, so a `rope_theta`
/// inside it wins over the top-level one (and stands in for it when that is absent).
#[test]
fn rope_theta_inside_rope_scaling_wins_as_in_hf() {
    for top in [Some(500000.0), None] {
        let c = base_with(|o| {
            match top {
                Some(t) => o.insert("rope_theta".into(), t.into()),
                None => o.remove("rope_theta"),
            };
            o.insert(
                "rope_scaling".into(),
                serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}),
            );
        })
        .unwrap();
        assert_eq!(c.rope.theta, 100.0, "top-level {top:?}");
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: Float(2.0) });
    }
    // gemma3's legacy global rope too (its local rope keeps rope_local_base_freq).
    let json = load_preset_json("gemma3-tiny");
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("rope_parameters");
    o.insert("rope_theta".into(), 1e6.into());
    o.insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "linear", "factor": 8.0, "rope_theta": 300.0}),
    );
    let c = ModelConfig::from_json(&v, "test/config.json").unwrap();
    assert_eq!(c.rope.theta, 300.0);
    assert_eq!(c.local_rope.unwrap().theta, 10000.0);
}

/// An absent `num_key_value_heads` takes the HF config class's default, which for most
/// classes is a fixed count (not `num_attention_heads`); an explicit null is
/// `num_attention_heads` in every class.
#[test]
fn num_key_value_heads_absent_takes_the_class_default() {
    use serde_json::{json, Value};
    let kv = |t: &str, heads: usize, value: Option<Value>| {
        family_with(t, |o| {
            o.insert("num_attention_heads".into(), json!(heads));
            o.insert("hidden_size".into(), json!(heads * 8));
            o.insert("pad_token_id".into(), Value::Null);
            o.insert("num_experts".into(), json!(4));
            o.insert("num_local_experts".into(), json!(4));
            o.insert("num_experts_per_tok".into(), json!(2));
            o.insert("moe_intermediate_size".into(), json!(16));
            match value {
                None => {
                    o.remove("num_key_value_heads");
                }
                Some(v) => {
                    o.insert("num_key_value_heads".into(), v);
                }
            }
        })
        .map(|c| c.num_key_value_heads)
        .map_err(|e| e.to_string())
    };
    for (t, default) in [
        ("mistral", Some(8)),
        ("mixtral", Some(8)),
        ("qwen2", Some(32)),
        ("qwen3", Some(32)),
        ("qwen3_moe", Some(4)),
        ("gpt_oss", Some(8)),
        ("llama", None),
        ("phi3", None),
        ("olmo2", None),
        ("granite", None),
    ] {
        // 64 query heads: every class default divides it
        assert_eq!(kv(t, 64, None), Ok(default.unwrap_or(64)), "{t}");
        // null: num_attention_heads, as every class's __post_init__
        assert_eq!(kv(t, 64, Some(Value::Null)), Ok(64), "{t}");
        assert_eq!(kv(t, 64, Some(json!(2))), Ok(2), "{t}");
    }
    // a class default that does not divide the heads is refused by name
    let e = kv("qwen2", 16, None).unwrap_err();
    assert!(
        e.contains("`num_key_value_heads`") && e.contains("class default"),
        "{e}"
    );
    assert_eq!(kv("llama", 16, None), Ok(16));
}

/// `is_causal` other than true makes HF's masking_utils build a bidirectional mask.
#[test]
fn is_causal_other_than_true_is_refused() {
    use serde_json::{json, Value};
    for v in [json!(false), Value::Null, json!(0)] {
        let e = base_with(|o| {
            o.insert("is_causal".into(), v.clone());
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`is_causal`") && e.contains("bidirectional"),
            "{v}: {e}"
        );
    }
    base_with(|o| {
        o.insert("is_causal".into(), json!(true));
    })
    .unwrap();
}

/// HF aliases the expert count (`attribute_map`); two names with different values are
/// ambiguous and refused, the same value under both names is accepted.
#[test]
fn expert_count_aliases_must_agree() {
    use serde_json::json;
    let moe = |t: &str, extra: serde_json::Value| {
        family_with(t, |o| {
            o.insert("pad_token_id".into(), serde_json::Value::Null);
            o.insert("num_experts_per_tok".into(), json!(2));
            o.insert("moe_intermediate_size".into(), json!(16));
            for (k, v) in extra.as_object().unwrap() {
                o.insert(k.clone(), v.clone());
            }
        })
    };
    for t in ["mixtral", "qwen3_moe", "gpt_oss"] {
        let e = moe(t, json!({"num_local_experts": 4, "num_experts": 8}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`num_experts`") && e.contains("ambiguous"),
            "{t}: {e}"
        );
        let c = moe(t, json!({"num_local_experts": 4, "num_experts": 4})).unwrap();
        assert_eq!(c.moe.unwrap().num_experts, 4, "{t}");
    }
    let ds = |edit: serde_json::Value| {
        let mut v: serde_json::Value =
            serde_json::from_str(&load_preset_json("deepseek-v3-tiny")).unwrap();
        for (k, x) in edit.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v, "test/config.json")
    };
    let n = ds(json!({})).unwrap().moe.unwrap().num_experts;
    let e = ds(json!({"num_local_experts": n * 2}))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`num_local_experts`") && e.contains("ambiguous"),
        "{e}"
    );
    ds(json!({"num_local_experts": n})).unwrap();
}

/// A rope dict nested by layer type is Gemma 3's form only; elsewhere HF reads one flat
/// dict (and fails on a nested one), so Weft refuses it by name instead of reading the
/// default rope out of it.
#[test]
fn nested_rope_dicts_are_refused_outside_gemma3() {
    use serde_json::json;
    for t in ["llama", "qwen2", "mistral"] {
        let e = family_with(t, |o| {
            o.insert(
                "rope_parameters".into(),
                json!({"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
            );
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("`rope_parameters.full_attention`"), "{t}: {e}");
    }
}

/// A flag given as null is falsy in HF's `if config.flag:` even where the class default
/// is true: DeepSeek's `rope_interleave` and `norm_topk_prob`, gpt-oss's
/// `attention_bias`, YaRN's `truncate`.
#[test]
fn null_flags_are_false_as_in_hf() {
    use serde_json::{json, Value};
    let ds = |edit: Value| {
        let mut v: Value = serde_json::from_str(&load_preset_json("deepseek-v3-tiny")).unwrap();
        for (k, x) in edit.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v, "test/config.json").unwrap()
    };
    let c = ds(json!({}));
    assert!(c.mla.as_ref().unwrap().rope_interleave);
    assert!(c.moe.as_ref().unwrap().norm_topk_prob);
    let c = ds(json!({"rope_interleave": null, "norm_topk_prob": null}));
    assert!(!c.mla.as_ref().unwrap().rope_interleave);
    assert!(!c.moe.as_ref().unwrap().norm_topk_prob);
    let c = gpt_oss_with(|o| {
        o.insert("attention_bias".into(), Value::Null);
    })
    .unwrap();
    assert!(!c.qkv_bias && !c.o_bias);
    let truncate = |t: Value| {
        let c = base_with(|o| {
            o.insert("max_position_embeddings".into(), json!(4096));
            let mut rs = json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024});
            if !t.is_string() {
                rs["truncate"] = t;
            }
            o.insert("rope_scaling".into(), rs);
        })
        .unwrap();
        match c.rope.scaling {
            RopeScaling::Yarn { truncate, .. } => truncate,
            s => panic!("{s:?}"),
        }
    };
    assert!(truncate(json!("absent")));
    assert!(truncate(json!(true)));
    assert!(!truncate(json!(false)));
    assert!(!truncate(Value::Null));
}

/// Each family's tiny preset and the values its transformers 5.17 config class takes
/// when the key is absent: `rms_norm_eps`, `default_theta` (the global base for
/// gemma3_text), `max_position_embeddings`.
const CLASS_DEFAULTS: [(&str, f64, f64, usize); 13] = [
    ("llama-tiny", 1e-6, 1e4, 2048),
    ("mistral-tiny", 1e-6, 1e4, 131072),
    ("qwen2-tiny", 1e-6, 1e4, 32768),
    ("qwen3-tiny", 1e-6, 1e4, 32768),
    ("phi3-tiny", 1e-5, 1e4, 4096),
    ("mixtral-tiny", 1e-5, 1e6, 131072),
    ("qwen3-moe-tiny", 1e-6, 1e4, 32768),
    ("olmo2-tiny", 1e-5, 1e4, 2048),
    ("granite-tiny", 1e-6, 1e4, 2048),
    ("gemma2-tiny", 1e-6, 1e4, 8192),
    ("gemma3-tiny", 1e-6, 1e6, 131072),
    ("gpt-oss-tiny", 1e-5, 150000.0, 131072),
    ("deepseek-v3-tiny", 1e-6, 1e4, 4096),
];

/// An absent `rms_norm_eps` is the config class's default; a null one is refused by
/// name (HF's strict classes refuse a None float).
#[test]
fn rms_norm_eps_absent_takes_the_class_default() {
    for (preset, eps, _, _) in CLASS_DEFAULTS {
        let c = preset_try(preset, |o| {
            o.remove("rms_norm_eps");
        })
        .unwrap();
        assert_eq!(c.rms_norm_eps, eps, "{preset}");
        let e = preset_try(preset, |o| {
            o.insert("rms_norm_eps".into(), serde_json::Value::Null);
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`rms_norm_eps` is null") && e.contains(&format!("default {eps}")),
            "{preset}: {e}"
        );
    }
}

/// No `rope_theta` anywhere (not in the rope dict, not at the top level): HF's
/// `setdefault` takes the class's `default_theta`, with the rope dict in either form
/// (`rope_parameters`, the legacy `rope_scaling`) or no rope dict at all. A null one is
/// refused by name (HF keeps the None and its rotary embedding fails).
#[test]
fn rope_theta_absent_takes_the_class_default() {
    use serde_json::{json, Value};
    for (preset, _, theta, _) in CLASS_DEFAULTS {
        if preset == "gemma3-tiny" {
            continue; // keyed by layer type: below
        }
        // rope_parameters without rope_theta (gpt-oss-tiny's is YaRN, the others' default)
        let c = preset_try(preset, |o| {
            o["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("rope_theta");
        })
        .unwrap();
        assert_eq!(c.rope.theta, theta, "{preset} rope_parameters");
        // no rope dict (gpt_oss: its YaRN default rope) and no rope_theta
        let c = preset_try(preset, |o| {
            o.remove("rope_parameters");
        })
        .unwrap();
        assert_eq!(c.rope.theta, theta, "{preset} no rope dict");
        // the transformers-4 rope_scaling without rope_theta
        if preset != "phi3-tiny" && preset != "deepseek-v3-tiny" {
            let c = preset_try(preset, |o| {
                o.remove("rope_parameters");
                o.insert(
                    "rope_scaling".into(),
                    json!({"rope_type": "linear", "factor": 2.0}),
                );
            })
            .unwrap();
            assert_eq!(c.rope.theta, theta, "{preset} rope_scaling");
        }
        // null: refused, naming where HF reads it
        let e = preset_try(preset, |o| {
            o["rope_parameters"]["rope_theta"] = Value::Null;
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`rope_parameters.rope_theta` is null"),
            "{preset}: {e}"
        );
        let e = preset_try(preset, |o| {
            o.remove("rope_parameters");
            o.insert("rope_theta".into(), Value::Null);
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("`rope_theta` is null"), "{preset}: {e}");
    }
    // gemma3_text: the global base 1e6 and the local 1e4 (`rope_local_base_freq`)
    let c = preset_try("gemma3-tiny", |o| {
        for t in ["full_attention", "sliding_attention"] {
            o["rope_parameters"][t]
                .as_object_mut()
                .unwrap()
                .remove("rope_theta");
        }
    })
    .unwrap();
    assert_eq!(c.rope.theta, 1e6);
    assert_eq!(c.local_rope.unwrap().theta, 1e4);
    let c = preset_try("gemma3-tiny", |o| {
        o.remove("rope_parameters");
    })
    .unwrap();
    assert_eq!(c.rope.theta, 1e6);
    assert_eq!(c.local_rope.unwrap().theta, 1e4);
}

/// HF's rope dict is `rope_scaling or rope_parameters`: an empty `rope_parameters`
/// gives way to a non-empty `rope_scaling`.
#[test]
fn empty_rope_parameters_gives_way_to_rope_scaling() {
    let c = base_with(|o| {
        o.insert("rope_parameters".into(), serde_json::json!({}));
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "linear", "factor": 2.0}),
        );
    })
    .unwrap();
    assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: Float(2.0) });
    // gpt_oss: an empty rope_parameters is the default rope (only None becomes YaRN),
    // an empty rope_scaling is no rope dict (YaRN)
    let c = gpt_oss_with(|o| {
        o.insert("rope_parameters".into(), serde_json::json!({}));
    })
    .unwrap();
    assert_eq!(c.rope.scaling, RopeScaling::None);
    let c = gpt_oss_with(|o| {
        o.insert("rope_scaling".into(), serde_json::json!({}));
    })
    .unwrap();
    assert!(matches!(c.rope.scaling, RopeScaling::Yarn { .. }));
}

/// An absent `max_position_embeddings` is the class default, which YaRN and llama3 rope
/// take as their `original_max_position_embeddings` when the rope dict has none.
#[test]
fn max_position_embeddings_absent_takes_the_class_default() {
    use serde_json::json;
    for (preset, _, _, max_pos) in CLASS_DEFAULTS {
        let c = preset_try(preset, |o| {
            o.remove("max_position_embeddings");
        })
        .unwrap();
        assert_eq!(c.max_position_embeddings, Some(max_pos), "{preset}");
        if matches!(preset, "phi3-tiny" | "gemma3-tiny") {
            continue; // phi3 refuses YaRN; gemma3 keys its rope dict by layer type
        }
        let c = preset_try(preset, |o| {
            o.remove("max_position_embeddings");
            o.insert(
                "rope_parameters".into(),
                json!({"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
            );
        })
        .unwrap();
        let RopeScaling::Yarn {
            original_max_position_embeddings,
            ..
        } = c.rope.scaling
        else {
            panic!("{preset}: {:?}", c.rope.scaling)
        };
        assert_eq!(original_max_position_embeddings, max_pos as i64, "{preset}");
    }
}

/// The MoE counts absent: mixtral 8 experts, top 2; qwen3_moe 128 experts, top 8, 768
/// wide; gpt_oss 128 experts (top 4: `gpt_oss_defaults`).
#[test]
fn expert_counts_absent_take_the_class_default() {
    let moe = |preset: &str, keys: &[&str]| {
        let c = preset_try(preset, |o| {
            for k in keys {
                o.remove(*k);
            }
        })
        .unwrap();
        let m = c.moe.unwrap();
        (m.num_experts, m.top_k, m.expert_intermediate_size)
    };
    assert_eq!(moe("mixtral-tiny", &["num_experts_per_tok"]).1, 2);
    assert_eq!(
        moe(
            "mixtral-tiny",
            &["num_local_experts", "num_experts_per_tok"]
        )
        .0,
        8
    );
    assert_eq!(
        moe(
            "qwen3-moe-tiny",
            &[
                "num_local_experts",
                "num_experts_per_tok",
                "moe_intermediate_size"
            ]
        ),
        (128, 8, 768)
    );
    assert_eq!(moe("gpt-oss-tiny", &["num_local_experts"]).0, 128);
}

/// MixtralConfig and GptOssConfig map `num_experts` to `num_local_experts`
/// (`attribute_map`): the count under the other name alone is the same count.
#[test]
fn the_expert_count_under_its_alias_alone_is_read() {
    for preset in ["mixtral-tiny", "gpt-oss-tiny"] {
        let local = preset_try(preset, |_| {}).unwrap().moe.unwrap().num_experts;
        let aliased = preset_try(preset, |o| {
            let n = o.remove("num_local_experts").unwrap();
            o.insert("num_experts".into(), n);
        })
        .unwrap()
        .moe
        .unwrap()
        .num_experts;
        assert_eq!(aliased, local, "{preset}");
    }
}

/// HF's gpt_oss never reads `hidden_act` (its experts hard-code the clamped SwiGLU).
#[test]
fn gpt_oss_ignores_hidden_act_as_hf_does() {
    for act in ["gelu", "relu", "silu"] {
        let c = gpt_oss_with(|o| {
            o.insert("hidden_act".into(), act.into());
        })
        .unwrap();
        assert_eq!(c.moe.unwrap().kind, weft_frontends::config::MoeKind::GptOss);
    }
}

//! Config fields that change the math of training when set away from a neutral value and
//! that Weft does not implement (dropout, router noise). One table, checked for every
//! family: a config asking for any of them is refused with the field named, never trained
//! as if the field were absent. A newly met field is one row in [`MATH_FIELDS`].
//!
//! Every family is checked against every row, not only the rows its HF modeling code
//! reads today: a dropout field set above zero says the user expects dropout, and which
//! fields a family applies changes between transformers versions (phi3 applied
//! `embd_pdrop` in transformers 4 and ignores it in 5). Refusing costs the user one edit
//! (set the field to its neutral value); computing something else costs a training run.
//!
//! Beyond the table, any other top-level field whose name says dropout (`dropout`,
//! `pdrop`, `drop_path`) or noise (`jitter`) is refused when numeric and non-zero, so an
//! unknown family's dropout cannot slip through under a new name. The exception is
//! [`HEAD_ONLY_FIELDS`]: dropouts of task heads (classification, QA, summary) that the
//! causal-LM forward never runs.

use crate::error::FrontendError;
use crate::fields::Fields;

/// The value of a [`MathField`] that leaves the math unchanged (absent and `null` are
/// neutral too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Neutral {
    /// A probability or scale: neutral at 0.
    Zero,
}

/// A config field that changes the math when set away from its neutral value.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MathField {
    pub name: &'static str,
    pub neutral: Neutral,
    /// What the field does in HF training, for the error message.
    pub effect: &'static str,
}

const fn zero(name: &'static str, effect: &'static str) -> MathField {
    MathField {
        name,
        neutral: Neutral::Zero,
        effect,
    }
}

const ATTN: &str = "dropout on the attention probabilities";
const RESID: &str = "dropout on the residual branches";
const EMBED: &str = "dropout on the token embeddings";
const HIDDEN: &str = "dropout on the hidden states";
const MLP: &str = "dropout inside the MLP";

/// The fields known to change the math, with their neutral value.
pub(crate) const MATH_FIELDS: &[MathField] = &[
    // Attention-probability dropout: every family of transformers 5 (llama, mistral,
    // qwen2, qwen3, phi3, mixtral, qwen3_moe read it in train mode).
    zero("attention_dropout", ATTN),
    zero("attention_probs_dropout_prob", ATTN),
    zero("attn_pdrop", ATTN),
    zero("attn_dropout", ATTN),
    // Residual / hidden-state dropout: phi3 `resid_pdrop` (after attention and after the
    // MLP), and the names other decoder families use for the same thing.
    zero("resid_pdrop", RESID),
    zero("resid_dropout", RESID),
    zero("residual_dropout", RESID),
    zero("hidden_dropout", HIDDEN),
    zero("hidden_dropout_prob", HIDDEN),
    zero("hidden_dropout_rate", HIDDEN),
    zero("dropout", HIDDEN),
    zero("dropout_rate", HIDDEN),
    zero("dropout_prob", HIDDEN),
    zero("final_dropout", HIDDEN),
    zero(
        "drop_path_rate",
        "stochastic depth (dropping whole residual branches)",
    ),
    // Embedding dropout: phi3 `embd_pdrop` (applied by transformers 4).
    zero("embd_pdrop", EMBED),
    zero("emb_pdrop", EMBED),
    zero("embedding_dropout", EMBED),
    zero("activation_dropout", MLP),
    zero("mlp_dropout", MLP),
    zero("ffn_dropout", MLP),
    zero("ff_dropout", MLP),
    // MoE router noise in train mode: mixtral multiplies the router input by
    // uniform(1 - j, 1 + j) noise.
    zero(
        "router_jitter_noise",
        "multiplicative noise on the MoE router input",
    ),
    zero(
        "input_jitter_noise",
        "multiplicative noise on the MoE input",
    ),
    zero("moe_jitter_eps", "noise on the MoE routing"),
    zero("moe_token_dropout", "dropout of tokens routed to experts"),
];

/// Dropout fields of task heads that a causal-LM forward never runs (sequence
/// classification, question answering, GPT-2's double-heads summary, poolers).
pub(crate) const HEAD_ONLY_FIELDS: &[&str] = &[
    "classifier_dropout",
    "classifier_dropout_prob",
    "classifier_dropout_rate",
    "summary_first_dropout",
    "summary_last_dropout",
    "seq_classif_dropout",
    "qa_dropout",
    "pooler_dropout",
];

/// Name fragments that mark a field as dropout or noise when it is not in the table.
const DROPOUT_LIKE: &[&str] = &["dropout", "pdrop", "drop_path", "jitter"];

/// Refuses the first field (in the table's order, then the config's, sorted) that is set
/// away from its neutral value.
pub(crate) fn check_math_fields(f: &Fields) -> Result<(), FrontendError> {
    for field in MATH_FIELDS {
        check_field(f, field.name, field.neutral, field.effect)?;
    }
    let mut others: Vec<&String> = f
        .obj
        .keys()
        .filter(|k| {
            DROPOUT_LIKE.iter().any(|frag| k.contains(frag))
                && !HEAD_ONLY_FIELDS.contains(&k.as_str())
                && !MATH_FIELDS.iter().any(|m| m.name == k.as_str())
        })
        .collect();
    others.sort();
    for key in others {
        // Unknown dropout-like fields are refused only when numeric and non-zero: a
        // string or object under such a name is not a rate Weft can judge.
        if f.get(key).is_some_and(|v| v.is_number()) {
            check_field(f, key, Neutral::Zero, "dropout or noise in training")?;
        }
    }
    Ok(())
}

fn check_field(f: &Fields, key: &str, neutral: Neutral, effect: &str) -> Result<(), FrontendError> {
    match neutral {
        Neutral::Zero => {
            let Some(x) = f.opt_f64(key)? else {
                return Ok(());
            };
            if x == 0.0 {
                return Ok(());
            }
            Err(f.err(
                key,
                format!(
                    "is {x}: {effect} in training, which Weft does not implement (only 0 is supported)"
                ),
            ))
        }
    }
}

/// True when `field` is one of the neutral-valued fields this module refuses, so the
/// error's help can say how to fix it.
pub(crate) fn is_math_field(field: &str) -> bool {
    MATH_FIELDS.iter().any(|m| m.name == field)
        || (DROPOUT_LIKE.iter().any(|frag| field.contains(frag))
            && !HEAD_ONLY_FIELDS.contains(&field))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::presets::find_preset;

    /// One tiny preset per family, as JSON objects.
    fn family_configs() -> Vec<(&'static str, serde_json::Map<String, serde_json::Value>)> {
        [
            "llama-tiny",
            "mistral-tiny",
            "qwen2-tiny",
            "qwen3-tiny",
            "phi3-tiny",
            "mixtral-tiny",
            "qwen3-moe-tiny",
        ]
        .into_iter()
        .map(|name| {
            let v: serde_json::Value =
                serde_json::from_str(find_preset(name).unwrap().config_json).unwrap();
            (name, v.as_object().unwrap().clone())
        })
        .collect()
    }

    fn parse_with(
        base: &serde_json::Map<String, serde_json::Value>,
        key: &str,
        value: serde_json::Value,
    ) -> Result<ModelConfig, FrontendError> {
        let mut o = base.clone();
        o.insert(key.to_string(), value);
        ModelConfig::from_json(&serde_json::Value::Object(o), "test/config.json")
    }

    #[test]
    fn every_math_field_is_refused_by_name_on_every_family() {
        for (preset, base) in family_configs() {
            for field in MATH_FIELDS {
                let e = parse_with(&base, field.name, 0.1.into()).unwrap_err();
                assert_eq!(
                    e.to_string(),
                    format!(
                        "invalid config in test/config.json: field `{}` is 0.1: {} in training, which Weft does not implement (only 0 is supported)",
                        field.name, field.effect
                    ),
                    "{preset}"
                );
                assert!(e
                    .help()
                    .unwrap()
                    .contains(&format!("set `{}` to 0", field.name)));
                // The neutral value, null and an integer 0 all parse.
                for neutral in [
                    serde_json::json!(0.0),
                    serde_json::json!(0),
                    serde_json::Value::Null,
                ] {
                    parse_with(&base, field.name, neutral.clone())
                        .unwrap_or_else(|e| panic!("{preset} {} = {neutral}: {e}", field.name));
                }
                // A non-number is named, not ignored.
                let e = parse_with(&base, field.name, "high".into()).unwrap_err();
                assert!(
                    e.to_string()
                        .contains(&format!("field `{}` must be a number", field.name)),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn unknown_dropout_like_fields_are_refused_and_head_dropouts_accepted() {
        for (preset, base) in family_configs() {
            for key in [
                "decoder_layerdrop_dropout",
                "lm_pdrop",
                "stochastic_drop_path",
                "gate_jitter",
            ] {
                let e = parse_with(&base, key, 0.25.into()).unwrap_err();
                assert!(
                    e.to_string().contains(&format!(
                        "field `{key}` is 0.25: dropout or noise in training"
                    )),
                    "{preset}: {e}"
                );
                parse_with(&base, key, 0.into()).unwrap();
                // Not a rate: left alone.
                parse_with(&base, key, "none".into()).unwrap();
            }
            for key in HEAD_ONLY_FIELDS {
                parse_with(&base, key, 0.1.into())
                    .unwrap_or_else(|e| panic!("{preset} {key}: {e}"));
            }
        }
    }

    #[test]
    fn published_presets_set_every_math_field_to_neutral() {
        for name in crate::presets::preset_names() {
            let got = find_preset(name).unwrap().config();
            match crate::presets::AWAITING.iter().find(|(n, _)| *n == name) {
                // Refused for another field only (checked without it in tests/presets.rs).
                Some((_, field)) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains(field), "{name}: {e}");
                }
                None => {
                    got.unwrap_or_else(|e| panic!("{name}: {e}"));
                }
            }
        }
    }
}

//! DeepSeek-V3 (`deepseek_v3`) config fields, as transformers 5.17's
//! `DeepseekV3Config` reads them (its class defaults where a key is absent): multi-head
//! latent attention ([`MlaConfig`]) and the DeepSeek MoE router
//! ([`crate::config::Router::GroupLimitedSigmoid`]), with the checks that keep Weft from
//! computing something HF does not (each refusal names its field).
//!
//! The softmax scale is `qk_head_dim^-0.5`, times `mscale^2` when the rope type is not
//! `default` and `mscale_all_dim` is set ([`mla_softmax_scale`], HF's
//! `yarn_apply_mscale`). The YaRN tables themselves are the shared `RopeScaling::Yarn`
//! (with HF's attention factor from `mscale` / `mscale_all_dim`); rope types other than
//! `default` and `yarn` are refused by name.

use crate::config::{MoeConfig, Router};
use crate::error::FrontendError;
use crate::fields::Fields;

/// Multi-head latent attention (DeepSeek-V2/V3).
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    /// `q_a_proj` → `q_a_layernorm` → `q_b_proj` when set; one `q_proj` when `None`.
    pub q_lora_rank: Option<usize>,
    /// The compressed kv width (`kv_a_proj_with_mqa` gives it plus the shared rope part).
    pub kv_lora_rank: usize,
    /// Per-head query/key features without rotary embedding.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key features with rotary embedding (the key's are shared by every head).
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The rotary features come in interleaved pairs (HF `apply_rotary_pos_emb_interleave`).
    pub rope_interleave: bool,
    /// The attention's softmax scale ([`mla_softmax_scale`]).
    pub softmax_scale: f64,
    /// `num_nextn_predict_layers` (`num_mtp_layers`): multi-token-prediction layers that
    /// the checkpoint may hold after the decoder layers. HF's forward never runs them
    /// and its loader drops them; so does Weft's.
    pub mtp_layers: usize,
}

impl MlaConfig {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// The latent projections' RMSNorms (`q_a_layernorm`, `kv_a_layernorm`) use HF's
/// `DeepseekV3RMSNorm` default eps, not `rms_norm_eps`.
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// HF's `yarn_get_mscale`: `0.1 * mscale * ln(scale) + 1` for `scale > 1`, else 1.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// HF's `DeepseekV3Attention.scaling`: `qk_head_dim^-0.5`, times `mscale^2` (from
/// `factor` and `mscale_all_dim`) when the rope type is not `default` and
/// `mscale_all_dim` is non-zero.
pub fn mla_softmax_scale(
    qk_head_dim: usize,
    rope_type: &str,
    factor: Option<f64>,
    mscale_all_dim: Option<f64>,
) -> f64 {
    let base = (qk_head_dim as f64).powf(-0.5);
    match (rope_type, factor, mscale_all_dim) {
        ("default", _, _) => base,
        (_, Some(factor), Some(m)) if m != 0.0 => {
            let s = yarn_get_mscale(factor, m);
            base * s * s
        }
        _ => base,
    }
}

/// The fields HF's class gives defaults to, read with those defaults.
struct Defaults;
impl Defaults {
    const Q_LORA_RANK: usize = 1536;
    const KV_LORA_RANK: usize = 512;
    const QK_ROPE_HEAD_DIM: usize = 64;
    const QK_NOPE_HEAD_DIM: usize = 128;
    const V_HEAD_DIM: usize = 128;
    const N_GROUP: usize = 8;
    const TOPK_GROUP: usize = 4;
    const TOP_K: usize = 8;
    const FIRST_K_DENSE: usize = 3;
    const N_SHARED: usize = 1;
    const N_ROUTED: usize = 256;
    const ROUTED_SCALING: f64 = 2.5;
    const MOE_INTERMEDIATE: usize = 2048;
    const MTP_LAYERS: usize = 1;
}

fn positive_or(f: &Fields, key: &str, default: usize) -> Result<usize, FrontendError> {
    match f.opt_usize(key)? {
        None => Ok(default),
        Some(0) => Err(f.err(key, "must be positive, got 0")),
        Some(n) => Ok(n),
    }
}

/// The rope part's width (HF sets `config.head_dim = qk_rope_head_dim`; the rotary
/// tables are built for it).
pub(crate) fn rope_head_dim(f: &Fields) -> Result<usize, FrontendError> {
    let d = positive_or(f, "qk_rope_head_dim", Defaults::QK_ROPE_HEAD_DIM)?;
    if d % 2 != 0 {
        return Err(f.err(
            "qk_rope_head_dim",
            format!("is {d}; rotary embedding rotates feature pairs, so it must be even"),
        ));
    }
    Ok(d)
}

/// Refuses rope scaling other than YaRN for deepseek_v3 (linear and llama3 scaling are
/// untested with MLA's mscale).
pub(crate) fn check_rope_type(f: &Fields) -> Result<(), FrontendError> {
    let (obj, key) = match f.opt_object("rope_parameters")? {
        Some(o) => (Some(o), "rope_parameters"),
        None => (f.opt_object("rope_scaling")?, "rope_scaling"),
    };
    // HF's deepseek_v3 rotary tables always span qk_rope_head_dim: it ignores
    // partial_rotary_factor, so a config setting it expects something else.
    let prf = [f
        .opt_f64("partial_rotary_factor")?
        .map(|x| (x, f.name("partial_rotary_factor")))];
    let nested_prf = match obj {
        Some(o) => {
            let p = f.nested(key, o);
            p.opt_f64("partial_rotary_factor")?
                .map(|x| (x, p.name("partial_rotary_factor")))
        }
        None => None,
    };
    if let Some((x, field)) = prf
        .into_iter()
        .flatten()
        .chain(nested_prf)
        .find(|(x, _)| *x != 1.0)
    {
        return Err(FrontendError::config(
            f.file,
            &field,
            format!("is {x}, but HF's deepseek_v3 rotates all qk_rope_head_dim features (it ignores partial_rotary_factor); set qk_rope_head_dim instead"),
        ));
    }
    let Some(obj) = obj else { return Ok(()) };
    let p = f.nested(key, obj);
    let (type_key, t) = match p.opt_str("rope_type")? {
        Some(t) => ("rope_type", t),
        None => ("type", p.opt_str("type")?.unwrap_or("default")),
    };
    if t != "default" && t != "yarn" {
        return Err(p.err(
            type_key,
            format!("is `{t}`: deepseek_v3 is built with default or yarn rope (the attention's mscale^2 softmax factor is defined for those); linear and llama3 scaling are untested with multi-head latent attention"),
        ));
    }
    Ok(())
}

/// The rope type and the YaRN fields the softmax scale reads (`factor`,
/// `mscale_all_dim`), from `rope_parameters` (transformers 5) or `rope_scaling` (4).
fn rope_mscale_fields(f: &Fields) -> Result<(String, Option<f64>, Option<f64>), FrontendError> {
    let (obj, key) = match f.opt_object("rope_parameters")? {
        Some(o) => (Some(o), "rope_parameters"),
        None => (f.opt_object("rope_scaling")?, "rope_scaling"),
    };
    let Some(obj) = obj else {
        return Ok(("default".to_string(), None, None));
    };
    let p = f.nested(key, obj);
    let t = match p.opt_str("rope_type")? {
        Some(t) => t,
        None => p.opt_str("type")?.unwrap_or("default"),
    };
    Ok((
        t.to_string(),
        p.opt_f64("factor")?,
        p.opt_f64("mscale_all_dim")?,
    ))
}

/// Parses the MLA fields. `heads`/`kv_heads`: the config's head counts.
pub(crate) fn parse_mla(
    f: &Fields,
    heads: usize,
    kv_heads: usize,
) -> Result<MlaConfig, FrontendError> {
    if kv_heads != heads {
        // HF expands kv_b_proj to num_attention_heads heads, then repeat_kv repeats them
        // num_attention_heads / num_key_value_heads times: the shapes no longer fit.
        return Err(f.err(
            "num_key_value_heads",
            format!("is {kv_heads}, but multi-head latent attention expands the latent to one key and value per query head ({heads}); HF's forward fails for any other value"),
        ));
    }
    let q_lora_rank = match f.obj.get("q_lora_rank") {
        None => Some(Defaults::Q_LORA_RANK),
        Some(v) if v.is_null() => None,
        Some(_) => Some(positive_or(f, "q_lora_rank", 0)?),
    };
    let qk_rope_head_dim = rope_head_dim(f)?;
    let qk_nope_head_dim = positive_or(f, "qk_nope_head_dim", Defaults::QK_NOPE_HEAD_DIM)?;
    let v_head_dim = positive_or(f, "v_head_dim", Defaults::V_HEAD_DIM)?;
    let kv_lora_rank = positive_or(f, "kv_lora_rank", Defaults::KV_LORA_RANK)?;
    // HF: `if self.config.rope_interleave:` (class default true; null is falsy)
    let rope_interleave = f.flag("rope_interleave", true)?;
    let qk = qk_nope_head_dim + qk_rope_head_dim;
    Ok(MlaConfig {
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        rope_interleave,
        softmax_scale: {
            let (rope_type, factor, mscale_all_dim) = rope_mscale_fields(f)?;
            mla_softmax_scale(qk, &rope_type, factor, mscale_all_dim)
        },
        mtp_layers: f
            .opt_usize("num_nextn_predict_layers")?
            .or(f.opt_usize("num_mtp_layers")?)
            .unwrap_or(Defaults::MTP_LAYERS),
    })
}

/// The DeepSeek MoE: routed experts from layer `first_k_dense_replace` on, each with
/// `n_shared_experts` always-on experts (one dense MLP of `moe_intermediate_size *
/// n_shared_experts`). `None` when no layer is sparse.
pub(crate) fn parse_moe(f: &Fields, layers: usize) -> Result<Option<MoeConfig>, FrontendError> {
    check_original_code_fields(f)?;
    let first_dense = match f.opt_usize("first_k_dense_replace")? {
        Some(n) => n,
        None => Defaults::FIRST_K_DENSE,
    };
    let sparse_layers: Vec<bool> = (0..layers).map(|i| i >= first_dense).collect();
    if !sparse_layers.iter().any(|s| *s) {
        return Ok(None);
    }
    let experts_key = if f.has("n_routed_experts") {
        "n_routed_experts"
    } else {
        "num_local_experts"
    };
    let e = positive_or(f, experts_key, Defaults::N_ROUTED)?;
    let k = positive_or(f, "num_experts_per_tok", Defaults::TOP_K)?;
    let n_group = positive_or(f, "n_group", Defaults::N_GROUP)?;
    let topk_group = positive_or(f, "topk_group", Defaults::TOPK_GROUP)?;
    if e % n_group != 0 {
        return Err(f.err(
            "n_group",
            format!("is {n_group}, which does not divide the {e} routed experts (HF views the scores as [tokens, n_group, experts / n_group])"),
        ));
    }
    let per_group = e / n_group;
    if per_group < 2 {
        return Err(f.err(
            "n_group",
            format!("is {n_group}: groups of {per_group} expert(s), but a group's score is the sum of its top-2 experts (HF's topk(2) fails)"),
        ));
    }
    if topk_group > n_group {
        return Err(f.err(
            "topk_group",
            format!("is {topk_group}, more than the {n_group} groups"),
        ));
    }
    if k > topk_group * per_group {
        return Err(f.err(
            "num_experts_per_tok",
            format!("is {k}, more than the {} experts of the {topk_group} selected groups ({per_group} each): HF would pick masked (-inf) experts", topk_group * per_group),
        ));
    }
    let scaling = match f.opt_f64("routed_scaling_factor")? {
        None => Defaults::ROUTED_SCALING,
        Some(x) if x.is_finite() => x,
        Some(x) => {
            return Err(f.err(
                "routed_scaling_factor",
                format!("must be a finite number, got {x}"),
            ))
        }
    };
    let shared = match f.opt_usize("n_shared_experts")? {
        None => Defaults::N_SHARED,
        Some(0) => {
            return Err(f.err(
                "n_shared_experts",
                "is 0: HF then builds a shared MLP of width 0 (empty weights); Weft needs at least one shared expert",
            ))
        }
        Some(n) => n,
    };
    let inter = positive_or(f, "moe_intermediate_size", Defaults::MOE_INTERMEDIATE)?;
    let shared_inter = inter.checked_mul(shared).ok_or_else(|| {
        f.err(
            "n_shared_experts",
            "times moe_intermediate_size overflows the shared experts' width",
        )
    })?;
    Ok(Some(MoeConfig {
        num_experts: e,
        top_k: k,
        expert_intermediate_size: inter,
        // HF's router: `if self.norm_topk_prob:` (class default true; null is falsy)
        norm_topk_prob: f.flag("norm_topk_prob", true)?,
        sparse_layers,
        // HF's DeepseekV3ForCausalLM adds no load-balancing loss (its bias term balances).
        aux_loss_coef: None,
        // mixtral's expert arithmetic (SwiGLU, gate first); the router differs
        kind: crate::config::MoeKind::Softmax,
        router: Router::GroupLimitedSigmoid {
            n_group,
            topk_group,
            routed_scaling_factor: scaling,
        },
        shared_expert_intermediate_size: Some(shared_inter),
    }))
}

/// Fields of DeepSeek's own modeling code that transformers' `deepseek_v3` ignores (it
/// always scores with a sigmoid, selects `noaux_tc`-style with the correction bias and
/// makes every layer from `first_k_dense_replace` on sparse). A config asking for
/// anything else expects a model HF does not build: refused by name.
fn check_original_code_fields(f: &Fields) -> Result<(), FrontendError> {
    for (key, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
        if let Some(v) = f.opt_str(key)? {
            if v != want {
                return Err(f.err(
                    key,
                    format!("is `{v}`, but transformers' deepseek_v3 always routes with `{want}` (a DeepSeek-V2-style router is another model)"),
                ));
            }
        }
    }
    if let Some(n) = f.opt_usize("moe_layer_freq")? {
        if n != 1 {
            return Err(f.err(
                "moe_layer_freq",
                format!("is {n}, but transformers' deepseek_v3 makes every layer from first_k_dense_replace on sparse (frequency 1)"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_scale_follows_hf_yarn_apply_mscale() {
        // DeepSeek-V3's published rope: yarn, factor 40, mscale_all_dim 1.0.
        let m = 0.1 * 40f64.ln() + 1.0;
        let want = 192f64.powf(-0.5) * m * m;
        let got = mla_softmax_scale(192, "yarn", Some(40.0), Some(1.0));
        assert!((got - want).abs() < 1e-15, "{got} vs {want}");
        assert_eq!(
            mla_softmax_scale(192, "default", Some(40.0), Some(1.0)),
            192f64.powf(-0.5)
        );
        // mscale_all_dim 0 (or absent): no factor; a factor <= 1 gives mscale 1.
        assert_eq!(
            mla_softmax_scale(192, "yarn", Some(40.0), Some(0.0)),
            192f64.powf(-0.5)
        );
        assert_eq!(
            mla_softmax_scale(192, "yarn", Some(1.0), Some(1.0)),
            192f64.powf(-0.5)
        );
        assert_eq!(yarn_get_mscale(0.5, 1.0), 1.0);
    }

    fn tiny(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
        let text = include_str!("../presets/deepseek-v3-tiny.json");
        let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
        edit(v.as_object_mut().unwrap());
        match crate::config::ModelConfig::from_json(&v, "config.json") {
            Ok(_) => "ok".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn refusals_name_their_field() {
        use serde_json::json;
        assert_eq!(tiny(|_| {}), "ok");
        type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, serde_json::Value>)>;
        let cases: Vec<(&str, Edit)> = vec![
            (
                "num_key_value_heads",
                Box::new(|m| {
                    m.insert("num_key_value_heads".into(), json!(2));
                }),
            ),
            (
                "n_group",
                Box::new(|m| {
                    m.insert("n_group".into(), json!(3));
                }),
            ),
            (
                "n_group",
                Box::new(|m| {
                    m.insert("n_group".into(), json!(8));
                }),
            ),
            (
                "topk_group",
                Box::new(|m| {
                    m.insert("topk_group".into(), json!(5));
                }),
            ),
            (
                "num_experts_per_tok",
                Box::new(|m| {
                    m.insert("num_experts_per_tok".into(), json!(5));
                }),
            ),
            (
                "n_shared_experts",
                Box::new(|m| {
                    m.insert("n_shared_experts".into(), json!(0));
                }),
            ),
            (
                "qk_rope_head_dim",
                Box::new(|m| {
                    m.insert("qk_rope_head_dim".into(), json!(5));
                }),
            ),
            (
                "scoring_func",
                Box::new(|m| {
                    m.insert("scoring_func".into(), json!("softmax"));
                }),
            ),
            (
                "topk_method",
                Box::new(|m| {
                    m.insert("topk_method".into(), json!("group_limited_greedy"));
                }),
            ),
            (
                "moe_layer_freq",
                Box::new(|m| {
                    m.insert("moe_layer_freq".into(), json!(2));
                }),
            ),
            (
                "partial_rotary_factor",
                Box::new(|m| {
                    m.insert("partial_rotary_factor".into(), json!(0.5));
                }),
            ),
            (
                "rope_parameters.partial_rotary_factor",
                Box::new(|m| {
                    m.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}));
                }),
            ),
            (
                "rope_parameters.rope_type",
                Box::new(|m| {
                    m.insert("rope_parameters".into(), json!({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}));
                }),
            ),
            (
                "rope_scaling.type",
                Box::new(|m| {
                    m.remove("rope_parameters");
                    m.insert("rope_theta".into(), json!(10000.0));
                    m.insert(
                        "rope_scaling".into(),
                        json!({"type": "linear", "factor": 4.0}),
                    );
                }),
            ),
        ];
        for (field, edit) in cases {
            let e = tiny(edit);
            assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
        }
    }

    #[test]
    fn defaults_are_hf_class_defaults() {
        // q_lora_rank absent: HF's default 1536 (not "no q LoRA"); null: one q_proj.
        let text = include_str!("../presets/deepseek-v3-tiny.json");
        let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
        let m = v.as_object_mut().unwrap();
        m.remove("q_lora_rank");
        m.remove("rope_interleave");
        let c = crate::config::ModelConfig::from_json(&v, "c").unwrap();
        let mla = c.mla.unwrap();
        assert_eq!(mla.q_lora_rank, Some(1536));
        assert!(mla.rope_interleave);
        assert_eq!(mla.softmax_scale, 12f64.powf(-0.5));
        assert_eq!(c.rope.rotary_dim, 4);
        assert_eq!(c.head_dim, 12);
        let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
        v["q_lora_rank"] = serde_json::Value::Null;
        let c = crate::config::ModelConfig::from_json(&v, "c").unwrap();
        assert_eq!(c.mla.unwrap().q_lora_rank, None);
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![false, true, true]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(32));
    }
}

//! Every preset builds a graph that verifies and round-trips through the text form, and
//! has exactly the published parameter count.

mod common;

use weft_frontends::{load, presets, Family};
use weft_ir::DType;

#[test]
fn every_preset_builds_verifies_and_round_trips() {
    for p in presets::all_presets() {
        if let Some((_, field)) = presets::AWAITING.iter().find(|(n, _)| *n == p.name) {
            let e = load(p.name).expect_err(p.name).to_string();
            assert!(e.contains(field), "{}: {e}", p.name);
            continue;
        }
        let m = load(p.name).unwrap_or_else(|e| panic!("{}: {e}", p.name));
        assert_eq!(m.graph.name, p.name);
        if let Err(r) = weft_ir::verify(&m.graph) {
            panic!("{}: {r}", p.name);
        }
        let text = weft_ir::print(&m.graph);
        let back = weft_ir::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", p.name));
        assert!(back == m.graph, "{}: parse(print(g)) != g", p.name);
        let outs: Vec<&str> = m.graph.outputs().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(outs, ["loss", "logits"], "{}", p.name);
    }
}

/// Counts published by the model authors / computed by HF (`sum(p.numel())`).
const PUBLISHED: &[(&str, u64)] = &[
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3.1-8b", 8_030_261_248),
    ("llama3.1-405b", 405_853_388_800),
    ("llama3.2-1b", 1_235_814_400),
    ("mistral-7b", 7_241_732_096),
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen2.5-7b", 7_615_616_512),
    ("qwen3-8b", 8_190_735_360),
    ("mixtral-8x7b", 46_702_792_704),
    ("qwen3-30b-a3b", 30_532_122_624),
    ("phi3-mini", 3_821_079_552),
    // frontends/scripts/count_params.py (transformers 5.17 on the meta device).
    ("olmo2-7b", 7_298_617_344),
    ("granite-3-8b", 8_170_864_640),
    // The same script; gemma-3-27b is the text model alone (the published 27B counts
    // the SigLIP vision tower and projector too).
    ("gemma2-9b", 9_241_705_984),
    ("gemma-3-27b", 27_009_346_304),
    ("gpt-oss-20b", 20_914_757_184),
    ("gpt-oss-120b", 116_829_156_672),
];

#[test]
fn published_parameter_counts() {
    let infos = presets();
    for (name, want) in PUBLISHED {
        let info = infos
            .iter()
            .find(|i| i.name == *name)
            .unwrap_or_else(|| panic!("no preset {name}"));
        assert_eq!(info.params, *want, "{name} (presets())");
        assert_eq!(load(name).unwrap().param_count(), *want, "{name} (graph)");
    }
}

#[test]
fn preset_list_counts_match_graphs_and_fixture_counts() {
    // The tiny presets are the fixtures' configs: their counts are HF's.
    let fixture_counts = [
        ("llama-tiny", "llama"),
        ("mistral-tiny", "mistral"),
        ("qwen2-tiny", "qwen2"),
        ("qwen3-tiny", "qwen3"),
        ("phi3-tiny", "phi3"),
        ("mixtral-tiny", "mixtral"),
        ("qwen3-moe-tiny", "qwen3_moe"),
        ("olmo2-tiny", "olmo2"),
        ("granite-tiny", "granite"),
        ("gemma2-tiny", "gemma2"),
        ("gemma3-tiny", "gemma3"),
        ("gpt-oss-tiny", "gpt_oss"),
        ("deepseek-v3-tiny", "deepseek_v3"),
    ];
    for info in presets() {
        assert_eq!(
            load(info.name).unwrap().param_count(),
            info.params,
            "{}",
            info.name
        );
    }
    for (preset, fixture) in fixture_counts {
        let path = common::fixtures().join(fixture).join("params.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let want = v["total_params"].as_u64().unwrap();
        assert_eq!(
            load(preset).unwrap().param_count(),
            want,
            "{preset} vs {}",
            path.display()
        );
    }
}

#[test]
fn preset_families_and_dtypes() {
    let infos = presets();
    let family = |n: &str| infos.iter().find(|i| i.name == n).unwrap().family;
    assert_eq!(family("llama3-8b"), Family::Llama);
    assert_eq!(family("mistral-7b"), Family::Mistral);
    assert_eq!(family("qwen2.5-7b"), Family::Qwen2);
    assert_eq!(family("qwen3-8b"), Family::Qwen3);
    assert_eq!(family("phi3-mini"), Family::Phi3);
    assert_eq!(family("mixtral-8x7b"), Family::Mixtral);
    assert_eq!(family("qwen3-30b-a3b"), Family::Qwen3Moe);
    assert_eq!(family("gemma2-9b"), Family::Gemma2);
    assert_eq!(family("gemma-3-27b"), Family::Gemma3Text);
    assert_eq!(family("gpt-oss-20b"), Family::GptOss);
    for i in &infos {
        let m = load(i.name).unwrap();
        // gpt-oss's published config.json names no dtype (its checkpoint is bf16 with
        // MXFP4 experts): f32, as HF builds it from that config.
        let want = if i.name.ends_with("-tiny") || i.name.starts_with("gpt-oss") {
            DType::F32
        } else {
            DType::BF16
        };
        assert_eq!(m.param_dtype, want, "{}", i.name);
        assert!(
            m.params().iter().all(|(_, t)| t.dtype == want),
            "{}",
            i.name
        );
    }
}

#[test]
fn tied_presets_use_one_embedding_param_twice() {
    for name in ["qwen2-tiny", "llama3.2-1b", "qwen2.5-0.5b"] {
        let m = load(name).unwrap();
        assert_eq!(
            m.tied,
            vec![(
                "lm_head.weight".to_string(),
                "model.embed_tokens.weight".to_string()
            )]
        );
        let params = m.graph.params();
        assert!(params.iter().all(|(n, _)| n != "lm_head.weight"), "{name}");
        let (_, embed) = params
            .iter()
            .find(|(n, _)| n == "model.embed_tokens.weight")
            .unwrap();
        let uses = m.graph.uses();
        let users: Vec<&str> = uses[embed.0 as usize]
            .iter()
            .map(|(n, _)| m.graph.node(*n).op.name())
            .collect();
        assert_eq!(users, ["embedding", "linear"], "{name}");
    }
    assert!(load("llama3-8b").unwrap().tied.is_empty());
}

/// DeepSeek-V3 (671B): transformers 5.17 counts 671,026,404,352 parameters for the
/// published config on the meta device (`frontends/scripts/count_params.py`; the
/// e_score_correction_bias buffers and the MTP layer are not parameters). Its YaRN rope
/// has no parameters.
#[test]
fn deepseek_v3_parameter_count_is_transformers() {
    let p = presets::find_preset("deepseek-v3").unwrap();
    let v: serde_json::Value = serde_json::from_str(p.config_json).unwrap();
    let cfg = weft_frontends::ModelConfig::from_json(&v, "deepseek-v3").unwrap();
    assert_eq!(weft_frontends::param_count(&cfg), 671_026_404_352);
    let m = weft_frontends::Model::from_config(
        "deepseek-v3",
        cfg,
        weft_frontends::Origin::Preset("deepseek-v3".into()),
    )
    .unwrap();
    assert_eq!(m.param_count(), 671_026_404_352);
    assert_eq!(m.param_dtype, DType::BF16);
    assert_eq!(
        m.buffers().len(),
        58,
        "one e_score_correction_bias per MoE layer (61 - 3 dense)"
    );
    let v: serde_json::Value = serde_json::from_str(p.config_json).unwrap();
    let cfg = weft_frontends::ModelConfig::from_json(&v, "deepseek-v3").unwrap();
    assert!(
        matches!(cfg.rope.scaling, weft_ir::RopeScaling::Yarn { .. }),
        "{:?}",
        cfg.rope.scaling
    );
}

//! Built-in presets: the published `config.json` of each model, kept verbatim as JSON
//! under `frontends/presets/`, so the tool runs with no files. The `*-tiny` presets are
//! the configs of the test fixtures in `tests/fixtures/` (2 layers, hidden 32, f32).

use crate::config::{Family, ModelConfig};
use crate::error::FrontendError;

/// A built-in config.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    pub name: &'static str,
    /// Where the config comes from (an HF hub repository or a fixture).
    pub source: &'static str,
    pub config_json: &'static str,
}

macro_rules! presets {
    ($($name:literal => $source:literal),* $(,)?) => {
        const PRESETS: &[Preset] = &[
            $( Preset { name: $name, source: $source, config_json: include_str!(concat!("../presets/", $name, ".json")) } ),*
        ];
    };
}

presets! {
    "llama3-8b" => "meta-llama/Meta-Llama-3-8B",
    "llama3-70b" => "meta-llama/Meta-Llama-3-70B",
    "llama3.1-8b" => "meta-llama/Llama-3.1-8B",
    "llama3.1-405b" => "meta-llama/Llama-3.1-405B",
    "llama3.2-1b" => "meta-llama/Llama-3.2-1B",
    "mistral-7b" => "mistralai/Mistral-7B-v0.1",
    "qwen2.5-0.5b" => "Qwen/Qwen2.5-0.5B",
    "qwen2.5-7b" => "Qwen/Qwen2.5-7B",
    "qwen3-8b" => "Qwen/Qwen3-8B",
    "mixtral-8x7b" => "mistralai/Mixtral-8x7B-v0.1",
    "qwen3-30b-a3b" => "Qwen/Qwen3-30B-A3B",
    "phi3-mini" => "microsoft/Phi-3-mini-4k-instruct",
    "olmo2-7b" => "allenai/OLMo-2-1124-7B",
    "granite-3-8b" => "ibm-granite Granite 3.x 8B (GraniteForCausalLM, vocab 49159, 128k context)",
    "gemma2-9b" => "google/gemma-2-9b (the config.json of google/gemma-2-9b-it, bfloat16)",
    "gemma-3-27b" => "google/gemma-3-27b-pt text_config (Gemma3ForCausalLM; absent keys take Gemma3TextConfig's defaults)",
    "gpt-oss-20b" => "openai/gpt-oss-20b",
    "gpt-oss-120b" => "openai/gpt-oss-120b",
    "deepseek-v3" => "deepseek-ai/DeepSeek-V3",
    "llama-tiny" => "tests/fixtures/llama",
    "mistral-tiny" => "tests/fixtures/mistral",
    "qwen2-tiny" => "tests/fixtures/qwen2",
    "qwen3-tiny" => "tests/fixtures/qwen3",
    "phi3-tiny" => "tests/fixtures/phi3",
    "mixtral-tiny" => "tests/fixtures/mixtral",
    "qwen3-moe-tiny" => "tests/fixtures/qwen3_moe",
    "olmo2-tiny" => "tests/fixtures/olmo2",
    "granite-tiny" => "tests/fixtures/granite",
    "gemma2-tiny" => "tests/fixtures/gemma2",
    "gemma3-tiny" => "tests/fixtures/gemma3",
    "gpt-oss-tiny" => "tests/fixtures/gpt_oss",
    "deepseek-v3-tiny" => "tests/fixtures/deepseek_v3",
}

/// A preset with what `weft presets` reports about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresetInfo {
    pub name: &'static str,
    pub family: Family,
    pub source: &'static str,
    /// Total parameter count (tied weights counted once).
    pub params: u64,
}

/// Every preset in a fixed order.
pub fn all_presets() -> &'static [Preset] {
    PRESETS
}

pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.name).collect()
}

pub fn find_preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

impl Preset {
    /// The `file` errors name for this preset.
    pub fn label(&self) -> String {
        format!("preset `{}`", self.name)
    }

    pub fn config(&self) -> Result<ModelConfig, FrontendError> {
        ModelConfig::from_json_str(self.config_json, &self.label())
    }
}

/// Presets kept verbatim whose config Weft refuses for now, with the field it names
/// (`load` gives the refusal; `presets()` leaves them out). Empty since DeepSeek-V3's YaRN
/// rope was wired.
pub const AWAITING: &[(&str, &str)] = &[];

/// Name, family and parameter count of every preset Weft builds (not [`AWAITING`]).
pub fn presets() -> Vec<PresetInfo> {
    PRESETS
        .iter()
        .filter(|p| !AWAITING.iter().any(|(n, _)| *n == p.name))
        .map(|p| {
            // Every other built-in config parses; `tests::every_preset_builds_verifies_and_round_trips` pins it.
            let cfg = p
                .config()
                .unwrap_or_else(|e| panic!("built-in {}: {e}", p.label()));
            PresetInfo {
                name: p.name,
                family: cfg.family,
                source: p.source,
                params: crate::build::param_count(&cfg),
            }
        })
        .collect()
}

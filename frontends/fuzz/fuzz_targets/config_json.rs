//! Arbitrary text as an HF config.json: the field checks and the graph builder return
//! errors, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_frontends::{Model, ModelConfig, Origin};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(c) = ModelConfig::from_json_str(text, "fuzz") {
            let _ = Model::from_config("fuzz", c, Origin::Preset("fuzz".into()));
        }
    }
});

//! Helpers shared by the frontend tests.
#![allow(dead_code)]

use std::path::PathBuf;
use weft_frontends::{presets, Model, ModelConfig, Origin};

/// The workspace root (fixtures live in `tests/fixtures`).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn fixtures() -> PathBuf {
    root().join("tests/fixtures")
}

/// A fresh, empty temporary directory for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-frontends-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A preset's config with `edit` applied to its JSON.
pub fn preset_with(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> ModelConfig {
    let p = presets::find_preset(name).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(p.config_json).unwrap();
    edit(v.as_object_mut().unwrap());
    ModelConfig::from_json(&v, &p.label()).unwrap()
}

/// A preset cut to `layers` layers, named `<preset>-<layers>l`.
pub fn preset_layers(name: &str, layers: usize) -> Model {
    let cfg = preset_with(name, |o| {
        o.insert("num_hidden_layers".into(), layers.into());
        // a per-layer list follows the cut (HF refuses a layer_types of another length)
        if let Some(serde_json::Value::Array(t)) = o.get_mut("layer_types") {
            t.truncate(layers);
        }
    });
    Model::from_config(
        &format!("{name}-{layers}l"),
        cfg,
        Origin::Preset(name.into()),
    )
    .unwrap()
}

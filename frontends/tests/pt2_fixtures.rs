//! Imports every `.pt2` fixture (tests/fixtures/pt2, made by tests/fixtures/make_pt2.py)
//! and checks what was recognised. Numeric checks against PyTorch live in the top-level
//! `tests/pt2_import.rs` (they need the CPU runtime).

use std::path::PathBuf;
use weft_frontends::pt2::{import, Pt2Options};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/pt2").join(format!("{name}.pt2"))
}

fn config(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(family).join("config.json")
}

#[test]
fn debug_print_all() {
    for name in ["qwen2", "qwen2_decomposed", "llama", "llama_decomposed", "qwen3", "phi3", "mixtral", "mixtral_decomposed", "mixtral_batched", "mixtral_batched_decomposed", "qwen3_moe_batched", "qwen3_moe_batched_decomposed"] {
        let family = name.split('_').next().unwrap();
        let family = if name.starts_with("qwen3_moe") { "qwen3_moe" } else { family };
        let opts = Pt2Options { config: Some(config(family)), ..Default::default() };
        match import(&fixture(name), &opts) {
            Ok(imp) => println!("== {name}\n{}", imp.report),
            Err(e) => println!("== {name}: ERROR {e}"),
        }
    }
}

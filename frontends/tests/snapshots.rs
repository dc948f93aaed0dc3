//! The printed IR of 1-layer tiny models, pinned. Review changes with `cargo insta review`.

mod common;

fn snapshot(preset: &str) -> String {
    snapshot_layers(preset, 1)
}

fn snapshot_layers(preset: &str, layers: usize) -> String {
    let m = common::preset_layers(preset, layers);
    weft_ir::verify(&m.graph).unwrap();
    weft_ir::print(&m.graph)
}

macro_rules! ir_snapshot {
    ($name:literal, $preset:literal) => {
        insta::with_settings!({ snapshot_path => "../../tests/snapshots", prepend_module_to_snapshot => false, omit_expression => true }, {
            insta::assert_snapshot!($name, snapshot($preset));
        });
    };
}

#[test]
fn llama_tiny_1_layer() {
    ir_snapshot!("frontend-llama-tiny-1l", "llama-tiny");
}

#[test]
fn qwen3_tiny_1_layer() {
    ir_snapshot!("frontend-qwen3-tiny-1l", "qwen3-tiny");
}

#[test]
fn mixtral_tiny_1_layer() {
    ir_snapshot!("frontend-mixtral-tiny-1l", "mixtral-tiny");
}

#[test]
fn phi3_tiny_1_layer() {
    ir_snapshot!("frontend-phi3-tiny-1l", "phi3-tiny");
}

#[test]
fn gemma3_tiny_1_layer() {
    // (1 + w) norms around attention and MLP, per-head q/k norms, the embedding scale,
    // the local rope table of a sliding layer, GELU-tanh and the final soft-cap.
    ir_snapshot!("frontend-gemma3-tiny-1l", "gemma3-tiny");
}

#[test]
fn gemma2_tiny_1_layer() {
    // The attention soft-cap and query_pre_attn_scalar's scale on a sliding layer.
    ir_snapshot!("frontend-gemma2-tiny-1l", "gemma2-tiny");
}

/// Layer 0 dense, layer 1 MoE (first_k_dense_replace 1): MLA with q LoRA and interleaved
/// rope, the group-limited router with its correction-bias input, shared experts.
#[test]
fn deepseek_v3_tiny_2_layers() {
    insta::with_settings!({ snapshot_path => "../../tests/snapshots", prepend_module_to_snapshot => false, omit_expression => true }, {
        insta::assert_snapshot!("frontend-deepseek-v3-tiny-2l", snapshot_layers("deepseek-v3-tiny", 2));
    });
}

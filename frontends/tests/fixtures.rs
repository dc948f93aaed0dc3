//! The fixtures in tests/fixtures (tiny HF models saved by transformers 5): our builder
//! accepts their config.json, our graph has exactly HF's parameters (names, shapes,
//! order), and their model.safetensors loads and matches the graph.

mod common;

use weft_frontends::{load, load_weights, read_checkpoint};

fn fixture_dirs() -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<_> = std::fs::read_dir(common::fixtures())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.join("config.json").is_file())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

#[test]
fn fixture_params_match_hf_names_shapes_and_order() {
    let dirs = fixture_dirs();
    assert!(
        dirs.len() >= 7,
        "expected the fixture families in tests/fixtures, found {dirs:?}"
    );
    for dir in dirs {
        let m = load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        weft_ir::verify(&m.graph).unwrap();
        assert_eq!(m.name, dir.file_name().unwrap().to_str().unwrap());
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("params.json")).unwrap())
                .unwrap();
        let want: Vec<(String, Vec<i64>)> = v["params"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["name"].as_str().unwrap().to_string(),
                    p["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_i64().unwrap())
                        .collect(),
                )
            })
            .collect();
        let got: Vec<(String, Vec<i64>)> = m
            .params()
            .into_iter()
            .map(|(n, t)| (n, t.shape.iter().map(|d| d.as_const().unwrap()).collect()))
            .collect();
        assert_eq!(got, want, "{}", dir.display());
        assert_eq!(
            m.param_count(),
            v["total_params"].as_u64().unwrap(),
            "{}",
            dir.display()
        );
        assert_eq!(
            !m.tied.is_empty(),
            v["tied"].as_bool().unwrap(),
            "{}",
            dir.display()
        );
    }
}

#[test]
fn fixture_weights_load_and_match_the_graph() {
    for dir in fixture_dirs() {
        let m = load(dir.to_str().unwrap()).unwrap();
        let w = load_weights(&m, &dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        // Parameters and the checkpoint buffers (deepseek_v3's correction bias).
        let mut names: Vec<String> = m.graph.params().into_iter().map(|(n, _)| n).collect();
        names.extend(m.buffers().into_iter().map(|(n, _)| n));
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(
            w.keys().cloned().collect::<Vec<_>>(),
            sorted,
            "{}",
            dir.display()
        );
        weft_frontends::check_weights(&m, &w).unwrap();
    }
}

#[test]
fn mixtral_fixture_experts_are_fused_gate_first() {
    let dir = common::fixtures().join("mixtral");
    if !dir.is_dir() {
        return;
    }
    let raw = read_checkpoint(&dir).unwrap().tensors;
    assert!(
        raw.contains_key("model.layers.1.block_sparse_moe.experts.2.w1.weight"),
        "the fixture stores per-expert tensors"
    );
    let m = load(dir.to_str().unwrap()).unwrap();
    let w = load_weights(&m, &dir).unwrap();
    let gu = &w["model.layers.1.mlp.experts.gate_up_proj"];
    let dn = &w["model.layers.1.mlp.experts.down_proj"];
    assert_eq!(
        (gu.shape.clone(), dn.shape.clone()),
        (vec![4, 128, 32], vec![4, 32, 64])
    );
    let (gu, dn) = (gu.to_f64(), dn.to_f64());
    let per = 64 * 32;
    for e in 0..4 {
        let w1 = raw[&format!("model.layers.1.block_sparse_moe.experts.{e}.w1.weight")].to_f64();
        let w3 = raw[&format!("model.layers.1.block_sparse_moe.experts.{e}.w3.weight")].to_f64();
        let w2 = raw[&format!("model.layers.1.block_sparse_moe.experts.{e}.w2.weight")].to_f64();
        assert_eq!(
            &gu[e * 2 * per..e * 2 * per + per],
            &w1[..],
            "expert {e} gate"
        );
        assert_eq!(
            &gu[e * 2 * per + per..(e + 1) * 2 * per],
            &w3[..],
            "expert {e} up"
        );
        assert_eq!(&dn[e * per..(e + 1) * per], &w2[..], "expert {e} down");
    }
    assert_eq!(
        w["model.layers.1.mlp.gate.weight"].to_f64(),
        raw["model.layers.1.block_sparse_moe.gate.weight"].to_f64()
    );
}

#[test]
fn fixture_rope_configs() {
    use weft_ir::{Float, RopeScaling};
    let dir = common::fixtures().join("llama_rope3");
    if !dir.is_dir() {
        return;
    }
    let c = load(dir.to_str().unwrap()).unwrap().config.unwrap();
    assert_eq!(
        c.rope.scaling,
        RopeScaling::Llama3 {
            factor: Float(8.0),
            low_freq_factor: Float(0.25),
            high_freq_factor: Float(4.0),
            original_max_position_embeddings: 32
        }
    );
    let c = load(common::fixtures().join("llama_kv1").to_str().unwrap())
        .unwrap()
        .config
        .unwrap();
    assert_eq!(
        (c.num_key_value_heads, c.rope.scaling),
        (1, RopeScaling::None)
    );
}

/// Writes each fixture's graph (`<name>.weft`) and fused weights (`<name>.safetensors`)
/// to `$WEFT_DUMP_DIR`, for `frontends/scripts/eval_ir.py`, an independent torch
/// interpreter of the text IR that compares loss and logits with the HF references:
///
/// ```text
/// WEFT_DUMP_DIR=/tmp/irdump cargo test -p weft-frontends --test fixtures -- --ignored dump
/// /tmp/tv/bin/python frontends/scripts/eval_ir.py /tmp/irdump tests/fixtures
/// ```
#[test]
#[ignore]
fn dump_fixture_graphs_and_weights() {
    let Ok(out) = std::env::var("WEFT_DUMP_DIR") else {
        return;
    };
    let out = std::path::PathBuf::from(out);
    std::fs::create_dir_all(&out).unwrap();
    for dir in fixture_dirs() {
        let m = load(dir.to_str().unwrap()).unwrap();
        std::fs::write(
            out.join(format!("{}.weft", m.name)),
            weft_ir::print(&m.graph),
        )
        .unwrap();
        let w = load_weights(&m, &dir).unwrap();
        weft_frontends::save_safetensors(&out.join(format!("{}.safetensors", m.name)), &w).unwrap();
    }
}

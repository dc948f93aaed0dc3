//! Safetensors in and out: round trips, sharded checkpoints, per-expert MoE layouts,
//! tied heads, and one error listing every mismatch.

mod common;

use common::{preset_with, temp_dir};
use std::collections::BTreeMap;
use std::path::Path;
use weft_frontends::{
    load, load_weights, random_weights, read_safetensors, save_safetensors, FrontendError, Model,
    Origin, WeightProblem,
};
use weft_ir::{DType, HostTensor};

fn save_in(dir: &Path, file: &str, t: &BTreeMap<String, HostTensor>) {
    save_safetensors(&dir.join(file), t).unwrap();
}

#[test]
fn random_weights_round_trip_through_safetensors() {
    let m = load("llama-tiny").unwrap();
    let w = random_weights(&m, 7);
    let dir = temp_dir("roundtrip");
    save_in(&dir, "model.safetensors", &w);
    assert_eq!(load_weights(&m, &dir).unwrap(), w);
    assert_eq!(load_weights(&m, &dir.join("model.safetensors")).unwrap(), w);
}

#[test]
fn random_weights_are_seeded_and_at_hf_scale() {
    let m = load("qwen2-tiny").unwrap();
    let (a, b, c) = (
        random_weights(&m, 1),
        random_weights(&m, 1),
        random_weights(&m, 2),
    );
    assert_eq!(a, b);
    assert_ne!(a, c);
    weft_frontends::check_weights(&m, &a).unwrap();
    assert!(a["model.norm.weight"].to_f64().iter().all(|&x| x == 1.0));
    assert!(a["model.layers.0.self_attn.q_proj.bias"]
        .to_f64()
        .iter()
        .all(|&x| x == 0.0));
    let e = a["model.embed_tokens.weight"].to_f64();
    let std = (e.iter().map(|x| x * x).sum::<f64>() / e.len() as f64).sqrt();
    assert!((std - 0.02).abs() < 0.002, "std {std}");
    // Each parameter has its own stream: layer 0 does not depend on how many layers follow.
    let one = common::preset_layers("qwen2-tiny", 1);
    let w1 = random_weights(&one, 1);
    assert_eq!(
        w1["model.layers.0.mlp.up_proj.weight"],
        a["model.layers.0.mlp.up_proj.weight"]
    );
    // bf16 params get bf16-representable values.
    let cfg = preset_with("llama-tiny", |o| {
        o.insert("dtype".into(), "bfloat16".into());
    });
    let m = Model::from_config("bf", cfg, Origin::Preset("bf".into())).unwrap();
    let w = random_weights(&m, 3);
    let q = &w["model.layers.0.self_attn.q_proj.weight"];
    assert_eq!(q.dtype, DType::BF16);
    assert!(q
        .to_f64()
        .iter()
        .all(|&x| ((x as f32).to_bits() & 0xffff) == 0));
}

#[test]
fn mismatches_are_listed_in_one_error() {
    let m = load("llama-tiny").unwrap();
    let mut w = random_weights(&m, 1);
    w.remove("model.layers.1.mlp.up_proj.weight");
    w.insert(
        "model.layers.9.extra.weight".into(),
        HostTensor::floats(DType::F32, vec![2], vec![0.0, 1.0]),
    );
    w.insert(
        "model.norm.weight".into(),
        HostTensor::floats(DType::F32, vec![31], vec![1.0; 31]),
    );
    let dir = temp_dir("mismatch");
    save_in(&dir, "model.safetensors", &w);
    let e = load_weights(&m, &dir).unwrap_err();
    let FrontendError::WeightMismatch { problems, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(problems.len(), 3);
    let text = e.to_string();
    let body: Vec<&str> = text.lines().skip(1).collect();
    assert!(
        text.lines()
            .next()
            .unwrap()
            .ends_with(": 1 missing, 1 extra, 1 misshaped"),
        "{text}"
    );
    assert_eq!(
        body,
        [
            "  missing: model.layers.1.mlp.up_proj.weight (f32[64, 32])",
            "  extra: model.layers.9.extra.weight in model.safetensors",
            "  misshaped: model.norm.weight in model.safetensors: the file has f32[31], the model wants f32[32]",
        ]
    );
    assert!(e.help().is_some());
}

#[test]
fn dtype_mismatch_is_reported() {
    let cfg = preset_with("llama-tiny", |o| {
        o.insert("dtype".into(), "bfloat16".into());
    });
    let m = Model::from_config("bf", cfg, Origin::Preset("bf".into())).unwrap();
    let dir = temp_dir("dtype");
    save_in(&dir, "model.safetensors", &random_weights(&m, 1)); // written as f32
    let e = load_weights(&m, &dir).unwrap_err().to_string();
    assert!(e.contains("misshaped: model.norm.weight in model.safetensors: the file has f32[32], the model wants bf16[32]"), "{e}");
}

#[test]
fn sharded_checkpoints_load_through_the_index() {
    let m = load("qwen3-tiny").unwrap();
    let w = random_weights(&m, 5);
    let dir = temp_dir("sharded");
    let (a, b): (BTreeMap<_, _>, BTreeMap<_, _>) = w
        .clone()
        .into_iter()
        .partition(|(n, _)| n.contains("layers.0") || n.contains("embed"));
    save_in(&dir, "model-00001-of-00002.safetensors", &a);
    save_in(&dir, "model-00002-of-00002.safetensors", &b);
    let mut map = serde_json::Map::new();
    for n in a.keys() {
        map.insert(n.clone(), "model-00001-of-00002.safetensors".into());
    }
    for n in b.keys() {
        map.insert(n.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_eq!(load_weights(&m, &dir).unwrap(), w);
    // Problems name the shard they are in.
    let mut bad = b.clone();
    bad.insert(
        "stray".into(),
        HostTensor::floats(DType::F32, vec![1], vec![0.0]),
    );
    save_in(&dir, "model-00002-of-00002.safetensors", &bad);
    let e = load_weights(&m, &dir).unwrap_err().to_string();
    assert!(
        e.contains("extra: stray in model-00002-of-00002.safetensors"),
        "{e}"
    );
}

#[test]
fn tied_models_may_include_or_omit_lm_head() {
    let m = load("qwen2-tiny").unwrap();
    let mut w = random_weights(&m, 1);
    let dir = temp_dir("tied");
    save_in(&dir, "model.safetensors", &w);
    assert_eq!(load_weights(&m, &dir).unwrap(), w);
    w.insert(
        "lm_head.weight".into(),
        w["model.embed_tokens.weight"].clone(),
    );
    save_in(&dir, "model.safetensors", &w);
    let got = load_weights(&m, &dir).unwrap();
    assert!(!got.contains_key("lm_head.weight"));
    // A head that differs from the embedding: HF 5 does not tie the two (it keeps both),
    // so the tied model Weft builds would compute something else; refused by name.
    let other = random_weights(&m, 2);
    let mut w2 = w.clone();
    w2.insert(
        "lm_head.weight".into(),
        other["model.embed_tokens.weight"].clone(),
    );
    save_in(&dir, "model.safetensors", &w2);
    let e = load_weights(&m, &dir).unwrap_err().to_string();
    assert!(
        e.contains("`lm_head.weight` differs from `model.embed_tokens.weight`, but the config ties them (tie_word_embeddings)")
            && e.contains("set `tie_word_embeddings` to false"),
        "{e}"
    );
    // Only the head present: it is the embedding.
    let embed = w.remove("model.embed_tokens.weight").unwrap();
    save_in(&dir, "model.safetensors", &w);
    assert_eq!(
        load_weights(&m, &dir).unwrap()["model.embed_tokens.weight"],
        embed
    );
    // An untied model needs its lm_head.
    let m = load("llama-tiny").unwrap();
    let mut w = random_weights(&m, 1);
    w.remove("lm_head.weight");
    save_in(&dir, "model.safetensors", &w);
    assert!(load_weights(&m, &dir)
        .unwrap_err()
        .to_string()
        .contains("missing: lm_head.weight (f32[128, 32])"));
}

/// The fused tensors of `w` split back into the Hub's per-expert layout.
fn per_expert(w: &BTreeMap<String, HostTensor>, mixtral: bool) -> BTreeMap<String, HostTensor> {
    let mut out = BTreeMap::new();
    for (name, t) in w {
        let Some(module) = name.strip_suffix(".gate_up_proj") else {
            if name.ends_with(".experts.down_proj") {
                continue;
            }
            let n = if mixtral {
                name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            } else {
                name.clone()
            };
            out.insert(n, t.clone());
            continue;
        };
        let down = &w[&format!("{module}.down_proj")];
        let (e, i2, h) = (t.shape[0], t.shape[1], t.shape[2]);
        let i = i2 / 2;
        let (gu, dn) = (t.to_f64(), down.to_f64());
        let prefix = if mixtral {
            module.replace(".mlp.", ".block_sparse_moe.")
        } else {
            module.to_string()
        };
        let names = if mixtral {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        };
        for x in 0..e {
            let base = x * i2 * h;
            let part = |lo: usize, len: usize, v: &[f64]| v[lo..lo + len].to_vec();
            out.insert(
                format!("{prefix}.{x}.{}.weight", names[0]),
                HostTensor::floats(t.dtype, vec![i, h], part(base, i * h, &gu)),
            );
            out.insert(
                format!("{prefix}.{x}.{}.weight", names[1]),
                HostTensor::floats(t.dtype, vec![i, h], part(base + i * h, i * h, &gu)),
            );
            out.insert(
                format!("{prefix}.{x}.{}.weight", names[2]),
                HostTensor::floats(t.dtype, vec![h, i], part(x * h * i, h * i, &dn)),
            );
        }
    }
    out
}

#[test]
fn per_expert_checkpoints_are_fused_on_load() {
    for (preset, mixtral) in [("mixtral-tiny", true), ("qwen3-moe-tiny", false)] {
        let m = load(preset).unwrap();
        let w = random_weights(&m, 11);
        let hub = per_expert(&w, mixtral);
        let probe = if mixtral {
            "model.layers.0.block_sparse_moe.experts.3.w3.weight"
        } else {
            "model.layers.0.mlp.experts.3.up_proj.weight"
        };
        assert!(hub.contains_key(probe), "{preset}");
        let dir = temp_dir(&format!("experts-{preset}"));
        // The fused transformers-5 layout loads as is.
        save_in(&dir, "model.safetensors", &w);
        assert_eq!(load_weights(&m, &dir).unwrap(), w, "{preset}");
        save_in(&dir, "model.safetensors", &hub);
        assert_eq!(load_weights(&m, &dir).unwrap(), w, "{preset}");

        // A missing expert tensor and a misshaped one are named in the file's own naming.
        let mut broken = hub.clone();
        broken.remove(probe);
        let other = probe.replace("experts.3", "experts.1");
        broken.insert(
            other.clone(),
            HostTensor::floats(DType::F32, vec![2, 2], vec![0.0; 4]),
        );
        save_in(&dir, "model.safetensors", &broken);
        let e = load_weights(&m, &dir).unwrap_err();
        let FrontendError::WeightMismatch { problems, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(problems.len(), 2, "{e}");
        assert!(
            matches!(&problems[0], WeightProblem::Missing { name, .. } if name == probe),
            "{e}"
        );
        assert!(
            matches!(&problems[1], WeightProblem::Misshaped { name, .. } if *name == other),
            "{e}"
        );
    }
}

#[test]
fn per_expert_tensors_for_a_dense_model_are_extra() {
    let m = load("llama-tiny").unwrap();
    let mut w = random_weights(&m, 1);
    w.insert(
        "model.layers.0.mlp.experts.0.gate_proj.weight".into(),
        HostTensor::floats(DType::F32, vec![1], vec![0.0]),
    );
    let dir = temp_dir("dense-experts");
    save_in(&dir, "model.safetensors", &w);
    let e = load_weights(&m, &dir).unwrap_err().to_string();
    assert!(
        e.contains("extra: model.layers.0.mlp.experts.0.gate_proj.weight in model.safetensors"),
        "{e}"
    );
}

#[test]
fn reads_16_bit_floats_and_integers() {
    use safetensors::tensor::{Dtype, TensorView};
    let dir = temp_dir("dtypes");
    let bf16: Vec<u8> = [0x3f80u16, 0xc040]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let f16: Vec<u8> = [0x3c00u16, 0x0001]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let i32s: Vec<u8> = [-3i32, 7].iter().flat_map(|x| x.to_le_bytes()).collect();
    let views = vec![
        ("a", TensorView::new(Dtype::BF16, vec![2], &bf16).unwrap()),
        ("b", TensorView::new(Dtype::F16, vec![2], &f16).unwrap()),
        ("c", TensorView::new(Dtype::I32, vec![1, 2], &i32s).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, &dir.join("x.safetensors")).unwrap();
    let t = read_safetensors(&dir.join("x.safetensors")).unwrap();
    assert_eq!(
        t["a"],
        HostTensor::floats(DType::BF16, vec![2], vec![1.0, -3.0])
    );
    assert_eq!(
        t["b"],
        HostTensor::floats(DType::F16, vec![2], vec![1.0, 2f64.powi(-24)])
    );
    assert_eq!(
        t["c"],
        HostTensor::ints(DType::I32, vec![1, 2], vec![-3, 7])
    );
    // Written back: floats as f32, integers as i64.
    save_safetensors(&dir.join("y.safetensors"), &t).unwrap();
    let u = read_safetensors(&dir.join("y.safetensors")).unwrap();
    assert_eq!(
        u["a"],
        HostTensor::floats(DType::F32, vec![2], vec![1.0, -3.0])
    );
    assert_eq!(
        u["c"],
        HostTensor::ints(DType::I64, vec![1, 2], vec![-3, 7])
    );
    let u8s = [1u8, 2];
    let v = vec![("d", TensorView::new(Dtype::U8, vec![2], &u8s).unwrap())];
    safetensors::serialize_to_file(v, None, &dir.join("z.safetensors")).unwrap();
    let e = read_safetensors(&dir.join("z.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor `d`: dtype U8 is not supported"), "{e}");
    let e = read_safetensors(&dir.join("none.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("cannot read "), "{e}");
}

/// Writing over the file whose mapping backs the tensors being written: the tensors
/// stay intact (the new file is renamed into place) and the result reads back equal.
#[test]
fn saving_over_the_mapped_source_file() {
    let dir = temp_dir("save-over-mapped");
    let path = dir.join("w.safetensors");
    let t = weft_ir::HostTensor::floats(
        weft_ir::DType::F32,
        vec![2, 3],
        vec![1., 2., 3., 4., 5., 6.],
    );
    let mut m = std::collections::BTreeMap::from([("w".to_string(), t)]);
    weft_frontends::save_safetensors(&path, &m).unwrap();
    let mapped = weft_frontends::read_safetensors(&path).unwrap();
    assert!(matches!(mapped["w"].data, weft_ir::HostData::Raw(_)));
    m.insert(
        "v".to_string(),
        weft_ir::HostTensor::ints(weft_ir::DType::I64, vec![1], vec![7]),
    );
    m.insert("w".to_string(), mapped["w"].clone());
    weft_frontends::save_safetensors(&path, &m).unwrap();
    assert_eq!(mapped["w"].to_f64(), vec![1., 2., 3., 4., 5., 6.]);
    let back = weft_frontends::read_safetensors(&path).unwrap();
    assert_eq!(back, m);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "no temporary file left"
    );
}

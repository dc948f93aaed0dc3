//! The `.pt2` fixtures (tests/fixtures/pt2, made by tests/fixtures/make_pt2.py) import,
//! and broken copies of them fail with their own errors. Numeric checks against
//! PyTorch live in the top-level `tests/pt2_import.rs` (they need the CPU runtime).

use std::io::{Read, Write};
use std::path::PathBuf;
use weft_frontends::pt2::{import, import_bytes, Pt2Error, Pt2Options};
use weft_ir::Op;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/pt2")
        .join(format!("{name}.pt2"))
}

fn config(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(family)
        .join("config.json")
}

/// Rewrites a fixture's entries: `edit(name, bytes)` returns the new bytes or `None` to drop it.
fn rebuild(name: &str, mut edit: impl FnMut(&str, Vec<u8>) -> Option<Vec<u8>>) -> Vec<u8> {
    let bytes = std::fs::read(fixture(name)).unwrap();
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
    let mut out = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..z.len() {
        let mut f = z.by_index(i).unwrap();
        let n = f.name().to_string();
        let mut data = Vec::new();
        f.read_to_end(&mut data).unwrap();
        if let Some(d) = edit(&n, data) {
            out.start_file(n, opts).unwrap();
            out.write_all(&d).unwrap();
        }
    }
    out.finish().unwrap().into_inner()
}

fn replace_in(name: &str, entry_suffix: &str, from: &str, to: &str) -> Vec<u8> {
    rebuild(name, |n, d| {
        if n.ends_with(entry_suffix) {
            let s = String::from_utf8(d).unwrap();
            assert!(s.contains(from), "{n} has no `{from}`");
            Some(s.replacen(from, to, 1).into_bytes())
        } else {
            Some(d)
        }
    })
}

fn err(bytes: Vec<u8>) -> Pt2Error {
    let opts = Pt2Options {
        config: Some(config("qwen2")),
        ..Default::default()
    };
    match import_bytes("broken.pt2", bytes, &opts) {
        Ok(_) => panic!("a broken archive imported"),
        Err(e) => e,
    }
}

#[test]
fn every_fixture_imports_with_its_report() {
    for (name, family) in [
        ("qwen2", "qwen2"),
        ("llama_static", "llama"),
        ("llama_decomposed", "llama"),
        ("mixtral", "mixtral"),
        ("mixtral_batched_decomposed", "mixtral"),
    ] {
        let im = import(
            &fixture(name),
            &Pt2Options {
                config: Some(config(family)),
                ..Default::default()
            },
        )
        .unwrap();
        let r = &im.report;
        assert_eq!(r.count("attention"), 2, "{name}\n{r}");
        assert_eq!(r.count("rope"), 4, "{name}\n{r}");
        assert!(r.unrecognised.is_empty(), "{name}\n{r}");
        let text = r.to_string();
        assert!(text.contains("recognised attention x2"), "{text}");
        let ids = im
            .graph
            .inputs()
            .into_iter()
            .find(|(n, _, _)| n == "input_ids")
            .unwrap();
        assert_eq!(im.graph.ty(ids.2).to_string(), "i64[B, S]", "{name}");
        assert_eq!(im.graph.params().len(), im.weights.len());
        // The stable text form round-trips.
        let text = weft_ir::print(&im.graph);
        assert_eq!(weft_ir::parse(&text).unwrap(), im.graph, "{name}");
        // Every node carries its HF module.
        for &n in im.graph.nodes() {
            let d = im.graph.node(n);
            if matches!(d.op, Op::Attention { .. }) {
                assert!(
                    d.meta.source.as_deref().unwrap().ends_with("self_attn"),
                    "{:?}",
                    d.meta.source
                );
            }
        }
    }
    let im = import(&fixture("qwen2"), &Pt2Options::default()).unwrap();
    assert_eq!(
        im.report.tied,
        ["lm_head.weight -> model.embed_tokens.weight"]
    );
    assert!(!im.weights.contains_key("lm_head.weight"));
}

#[test]
fn truncated_zip() {
    let bytes = std::fs::read(fixture("qwen2")).unwrap();
    let e = err(bytes[..bytes.len() / 2].to_vec());
    assert!(matches!(e, Pt2Error::Zip { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("broken.pt2 is not a readable .pt2 archive"),
        "{e}"
    );
    let e = err(b"not a zip at all".to_vec());
    assert!(matches!(e, Pt2Error::Zip { .. }), "{e}");
}

#[test]
fn missing_model_json() {
    let e = err(rebuild("qwen2", |n, d| {
        (!n.ends_with("models/model.json")).then_some(d)
    }));
    assert!(matches!(e, Pt2Error::MissingEntry { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "broken.pt2 has no entry `qwen2/models/model.json`"
    );
    assert!(e.help().is_some());
}

#[test]
fn wrong_dtype_code() {
    let e = err(replace_in(
        "qwen2",
        "model_weights_config.json",
        "\"dtype\": 7",
        "\"dtype\": 99",
    ));
    assert!(matches!(e, Pt2Error::DType { code: 99, .. }), "{e}");
    let s = e.to_string();
    assert!(
        s.contains("model_weights_config.json") || s.contains("data/weights/weight_"),
        "{s}"
    );
    assert!(s.contains("unknown code"), "{s}");
    // A known torch dtype Weft cannot hold names it.
    let e = err(replace_in(
        "qwen2",
        "model_weights_config.json",
        "\"dtype\": 7",
        "\"dtype\": 29",
    ));
    assert!(e.to_string().contains("float8_e4m3fn"), "{e}");
}

#[test]
fn shape_and_bytes_mismatch() {
    let e = err(rebuild("qwen2", |n, mut d| {
        if n.ends_with("data/weights/weight_1") {
            d.truncate(d.len() - 4);
        }
        Some(d)
    }));
    assert!(matches!(e, Pt2Error::TensorData { .. }), "{e}");
    let s = e.to_string();
    assert!(
        s.contains("qwen2/data/weights/weight_1") && s.contains("storage holds"),
        "{s}"
    );
}

#[test]
fn unknown_op_names_node_and_layer() {
    let e = err(replace_in(
        "qwen2",
        "models/model.json",
        "torch.ops.aten.silu.default",
        "torch.ops.aten.mish.default",
    ));
    match &e {
        Pt2Error::UnsupportedOp {
            op, node, layer, ..
        } => {
            assert_eq!(op, "aten.mish.default");
            assert_eq!(node, "silu");
            assert_eq!(layer.as_deref(), Some("model.layers.0.mlp.act_fn"));
        }
        _ => panic!("{e}"),
    }
    assert!(
        e.to_string().starts_with(
            "unsupported op `aten.mish.default` in node `silu` (model.layers.0.mlp.act_fn)"
        ),
        "{e}"
    );
}

/// The qwen2 fixture with its first `silu` turned into `aten.dropout(x, p, train)`.
fn with_dropout(p: f64, train: bool) -> Vec<u8> {
    rebuild("qwen2", |n, d| {
        if !n.ends_with("models/model.json") {
            return Some(d);
        }
        let mut j: serde_json::Value = serde_json::from_slice(&d).unwrap();
        let nodes = j["graph_module"]["graph"]["nodes"].as_array_mut().unwrap();
        let node = nodes
            .iter_mut()
            .find(|n| n["target"] == "torch.ops.aten.silu.default")
            .unwrap();
        node["target"] = "torch.ops.aten.dropout.default".into();
        let x = node["inputs"][0]["arg"].clone();
        node["inputs"] = serde_json::json!([
            {"name": "input", "arg": x, "kind": 1},
            {"name": "p", "arg": {"as_float": p}, "kind": 1},
            {"name": "train", "arg": {"as_bool": train}, "kind": 1},
        ]);
        Some(serde_json::to_vec(&j).unwrap())
    })
}

#[test]
fn dropout_in_training_mode_is_refused() {
    let e = err(with_dropout(0.1, true));
    assert!(matches!(e, Pt2Error::UnsupportedOp { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("dropout with p = 0.1 in training mode")
            && e.to_string().contains("(model.layers.0.mlp.act_fn)"),
        "{e}"
    );
    // In eval mode, or with p = 0, dropout is the identity.
    let opts = Pt2Options {
        config: Some(config("qwen2")),
        ..Default::default()
    };
    for (p, train) in [(0.1, false), (0.0, true)] {
        import_bytes("dropout.pt2", with_dropout(p, train), &opts)
            .unwrap_or_else(|e| panic!("p {p} train {train}: {e}"));
    }
}

/// The qwen2 fixture over `min_len` bytes: its first weight's storage padded with zeros
/// (the view reads only its start), entries in the fixture's order, weights first as
/// torch writes them, so the entry names lie past the first MiB.
fn padded_archive(min_len: usize) -> Vec<u8> {
    let bytes = rebuild("qwen2", |n, mut d| {
        if n.ends_with("data/weights/weight_0") {
            d.resize(d.len() + min_len, 0);
        }
        Some(d)
    });
    assert!(bytes.len() > min_len);
    bytes
}

#[test]
fn archives_over_a_mib_with_weights_first_import() {
    let big = padded_archive(3 << 20);
    assert!(
        !big[..1 << 20].windows(7).any(|w| w == b"models/"),
        "the case that failed: no entry name in the first MiB"
    );
    assert!(weft_frontends::pt2::looks_like_pt2(&big));
    let dir = std::env::temp_dir().join(format!("weft-pt2-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("qwen2.pt2");
    std::fs::write(&path, &big).unwrap();
    assert!(weft_frontends::pt2::is_pt2_file(&path));
    // Mapped from the file, and the same as the small fixture (the padding is never read).
    let im = import(&path, &Pt2Options::default()).unwrap();
    let small = import(&fixture("qwen2"), &Pt2Options::default()).unwrap();
    assert_eq!(im.weights, small.weights);
    assert_eq!(weft_ir::print(&im.graph), weft_ir::print(&small.graph));
    // Other zips and non-zips are not archives.
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    w.start_file("a/readme.txt", zip::write::SimpleFileOptions::default())
        .unwrap();
    w.write_all(b"models/ is only in the text").unwrap();
    assert!(!weft_frontends::pt2::looks_like_pt2(
        &w.finish().unwrap().into_inner()
    ));
    assert!(!weft_frontends::pt2::looks_like_pt2(b"PK\x03\x04models/"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unused_unsupported_ops_do_not_matter() {
    // The mask builder's `cumsum` and `index` have no Weft op; the causal mask is
    // recognised instead, so the import succeeds (the other tests import these files).
    let im = import(&fixture("qwen2"), &Pt2Options::default()).unwrap();
    assert!(
        im.report
            .notes
            .iter()
            .any(|n| n.contains("rebuilt as a causal")),
        "{}",
        im.report
    );
}

#[test]
fn schema_versions_and_old_archives() {
    let e = err(replace_in(
        "qwen2",
        "models/model.json",
        "\"major\": 8",
        "\"major\": 9",
    ));
    assert!(matches!(e, Pt2Error::SchemaVersion { major: 9, .. }), "{e}");
    assert!(e.to_string().contains("written by torch 2.15.0"), "{e}");
    assert!(e.help().unwrap().contains("re-export"));
    // torch 2.6-2.8: a pickled state dict beside serialized_exported_program.json.
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let o = zip::write::SimpleFileOptions::default();
    for (n, d) in [
        ("m/serialized_exported_program.json", &b"{}"[..]),
        ("m/serialized_state_dict.pt", b"\x80\x02"),
        ("m/version", b"7"),
    ] {
        w.start_file(n, o).unwrap();
        w.write_all(d).unwrap();
    }
    let e = err(w.finish().unwrap().into_inner());
    assert!(matches!(e, Pt2Error::OldArchive { .. }), "{e}");
    assert!(
        e.to_string().contains("torch 2.6-2.8") && e.to_string().contains("pickled"),
        "{e}"
    );
    let e = err(replace_in(
        "qwen2",
        "model_weights_config.json",
        "\"use_pickle\": false",
        "\"use_pickle\": true",
    ));
    assert!(matches!(e, Pt2Error::OldArchive { .. }), "{e}");
    // A newer archive spec than torch 2.9-2.11 writes.
    let e = err(rebuild("qwen2", |n, d| {
        Some(if n.ends_with("/archive_version") {
            b"1".to_vec()
        } else {
            d
        })
    }));
    assert!(matches!(e, Pt2Error::Zip { .. }), "{e}");
    assert!(
        e.to_string().contains("archive_version") && e.to_string().contains("`1`"),
        "{e}"
    );
}

#[test]
fn invalid_json_has_a_position() {
    let e = err(replace_in(
        "qwen2",
        "models/model.json",
        "{\"graph_module\"",
        "{\"graph_module\" ]",
    ));
    match &e {
        Pt2Error::Json {
            entry,
            line,
            column,
            ..
        } => {
            assert_eq!(entry, "qwen2/models/model.json");
            assert!(*line >= 1 && *column > 0);
        }
        _ => panic!("{e}"),
    }
    let e = err(replace_in(
        "qwen2",
        "models/model.json",
        "{\"as_int\": 1}",
        "{\"as_int\": 1, \"as_bool\": true}",
    ));
    assert!(
        matches!(e, Pt2Error::Schema { .. }) && e.to_string().contains("graph_module.graph.nodes["),
        "{e}"
    );
}

/// Imports an archive named by `PT2_ADHOC` (a developer aid; skipped when unset).
#[test]
fn adhoc_archive_from_env() {
    let Ok(p) = std::env::var("PT2_ADHOC") else {
        return;
    };
    let opts = Pt2Options {
        config: std::env::var("PT2_CONFIG").ok().map(PathBuf::from),
        ..Default::default()
    };
    match import(std::path::Path::new(&p), &opts) {
        Ok(im) => println!("{}\n{}", im.report, weft_ir::print(&im.graph)),
        Err(e) => panic!("{e}"),
    }
}

/// The import of a broken copy of a fixture of `family`, which must fail.
fn err_in(family: &str, bytes: Vec<u8>) -> Pt2Error {
    let opts = Pt2Options {
        config: Some(config(family)),
        ..Default::default()
    };
    match import_bytes("broken.pt2", bytes, &opts) {
        Ok(_) => panic!("a broken archive imported"),
        Err(e) => e,
    }
}

#[test]
fn moe_offsets_need_ascending_ids_and_one_histc_bin_per_expert() {
    // The grouped-matmul offsets are `cumsum(histc(sort(ids)))`: with ids sorted
    // descending, or bins that are not one per expert, they are not the per-expert
    // row counts Weft's MoE uses.
    let e = err_in(
        "mixtral",
        replace_in(
            "mixtral",
            "models/model.json",
            r#"aten.sort.default", "inputs": [{"name": "self", "arg": {"as_tensor": {"name": "reshape_5"}}, "kind": 1}]"#,
            r#"aten.sort.default", "inputs": [{"name": "self", "arg": {"as_tensor": {"name": "reshape_5"}}, "kind": 1}, {"name": "descending", "arg": {"as_bool": true}, "kind": 2}]"#,
        ),
    );
    assert!(
        matches!(e, Pt2Error::UnsupportedOp { ref op, .. } if op == "transformers.grouped_mm_fallback.default")
            && e.to_string()
                .contains("ids sorted ascending and counted one histc bin per expert"),
        "{e}"
    );
    let e = err_in(
        "mixtral",
        replace_in(
            "mixtral",
            "models/model.json",
            r#"{"name": "max", "arg": {"as_int": 3}, "kind": 1}"#,
            r#"{"name": "max", "arg": {"as_int": 0}, "kind": 1}"#,
        ),
    );
    assert!(
        matches!(e, Pt2Error::UnsupportedOp { ref op, .. } if op == "transformers.grouped_mm_fallback.default")
            && e.to_string()
                .contains("ids sorted ascending and counted one histc bin per expert"),
        "{e}"
    );
}

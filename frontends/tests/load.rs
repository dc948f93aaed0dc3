//! `load` detects what it is given by content: preset, config.json, model directory,
//! weft text IR; anything else is a clear error.

mod common;

use common::temp_dir;
use weft_frontends::{load, Family, FrontendError, Origin};

#[test]
fn presets_load_by_name() {
    let m = load("llama3-8b").unwrap();
    assert_eq!((m.name.as_str(), m.family), ("llama3-8b", Family::Llama));
    assert_eq!(m.origin, Origin::Preset("llama3-8b".into()));
}

#[test]
fn unknown_names_suggest_presets() {
    let e = load("llama3-8").unwrap_err();
    assert!(matches!(e, FrontendError::UnknownSpec { .. }));
    assert!(e.to_string().contains("did you mean llama3-8b"), "{e}");
    assert!(e.help().unwrap().contains("mixtral-8x7b"));
}

#[test]
fn config_files_and_directories() {
    let dir = temp_dir("configs").join("My-Model");
    std::fs::create_dir_all(&dir).unwrap();
    let json = weft_frontends::presets::find_preset("qwen3-tiny")
        .unwrap()
        .config_json;
    std::fs::write(dir.join("config.json"), json).unwrap();
    let by_dir = load(dir.to_str().unwrap()).unwrap();
    assert_eq!(
        (by_dir.name.as_str(), by_dir.family),
        ("My-Model", Family::Qwen3)
    );
    assert_eq!(by_dir.origin, Origin::Config(dir.join("config.json")));
    assert_eq!(by_dir.dir(), Some(dir.as_path()));
    let by_file = load(dir.join("config.json").to_str().unwrap()).unwrap();
    assert!(by_file.graph == by_dir.graph);
    // Content decides, not the extension.
    std::fs::write(dir.join("settings.txt"), json).unwrap();
    let m = load(dir.join("settings.txt").to_str().unwrap()).unwrap();
    assert_eq!((m.name.as_str(), m.family), ("settings", Family::Qwen3));
    // Errors in a config file name the file.
    std::fs::write(
        dir.join("bad.json"),
        json.replace("\"hidden_size\": 32,", ""),
    )
    .unwrap();
    let e = load(dir.join("bad.json").to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "invalid config in {}: field `hidden_size` is missing",
            dir.join("bad.json").display()
        )
    );
}

#[test]
fn text_ir_files_load_and_verify() {
    let dir = temp_dir("text-ir");
    let m = common::preset_layers("mixtral-tiny", 1);
    let text = weft_ir::print(&m.graph);
    std::fs::write(dir.join("graph"), format!("// a comment\n\n{text}")).unwrap();
    let back = load(dir.join("graph").to_str().unwrap()).unwrap();
    assert!(back.graph == m.graph);
    assert_eq!(
        (back.name.as_str(), back.family, back.param_count()),
        ("mixtral-tiny-1l", Family::WeftIr, m.param_count())
    );
    assert!(back.config.is_none() && back.tied.is_empty());

    // A tied graph lets checkpoints carry lm_head.weight.
    let tied = load("qwen2-tiny").unwrap();
    std::fs::write(dir.join("tied.weft"), weft_ir::print(&tied.graph)).unwrap();
    assert_eq!(
        load(dir.join("tied.weft").to_str().unwrap()).unwrap().tied,
        tied.tied
    );

    // Parse errors carry the line; verifier errors the node.
    std::fs::write(dir.join("broken.weft"), text.replace("= silu", "= silly")).unwrap();
    let e = load(dir.join("broken.weft").to_str().unwrap()).unwrap_err();
    assert!(matches!(e, FrontendError::TextIr { .. }));
    assert!(e.to_string().contains("line "), "{e}");
    assert!(e.to_string().contains("unknown op `silly`"), "{e}");
    std::fs::write(
        dir.join("bad-type.weft"),
        text.replace("f32[B*S, 4] = linear", "f32[B*S, 5] = linear"),
    )
    .unwrap();
    let e = load(dir.join("bad-type.weft").to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("verifier error"), "{e}");
}

#[test]
fn other_files_are_rejected_with_the_reason() {
    let dir = temp_dir("other");
    let cases: [(&str, &[u8], &str); 4] = [
        (
            "plan.json",
            br#"{"steps": []}"#,
            "JSON without `model_type`",
        ),
        (
            "notes.txt",
            b"hello",
            "neither an HF config.json nor weft text IR",
        ),
        ("model.pt2", b"PK\x03\x04rest", "zip archive"),
        ("blob", &[0xff, 0xfe, 0x00, 0x81], "binary file"),
    ];
    for (name, bytes, why) in cases {
        std::fs::write(dir.join(name), bytes).unwrap();
        let e = load(dir.join(name).to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{name}: {e}");
    }
    let empty = temp_dir("empty-dir");
    let e = load(empty.to_str().unwrap()).unwrap_err().to_string();
    assert!(e.contains("the directory has no config.json"), "{e}");
}

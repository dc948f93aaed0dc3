//! Inputs the CLI must refuse as bad input (exit 2) with the field or tensor named,
//! rather than compute something else or blame the parallel program: config fields
//! that change the math (dropout, router noise) and label sets with no valid target.

mod common;
use common::*;
use std::collections::BTreeMap;
use std::path::PathBuf;
use weft_ir::{DType, HostTensor};

/// A fresh, empty temporary directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-input-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn dropout_in_a_config_is_refused_by_name() {
    let dir = temp_dir("dropout");
    for (preset, field) in [
        ("phi3-tiny", "resid_pdrop"),
        ("llama-tiny", "attention_dropout"),
        ("mixtral-tiny", "router_jitter_noise"),
    ] {
        let p = weft_frontends::presets::find_preset(preset).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(p.config_json).unwrap();
        v[field] = 0.1.into();
        let path = dir.join(format!("{preset}.json"));
        std::fs::write(&path, v.to_string()).unwrap();
        let (code, _, err) = weft(&["compile", path.to_str().unwrap()]);
        assert_eq!(code, 2, "{preset}: {err}");
        assert!(
            err.contains(&format!(
                "error: invalid config in {}: field `{field}` is 0.1",
                path.display()
            )) && err.contains(&format!("help: set `{field}` to 0")),
            "{preset}: {err}"
        );
    }
}

/// The llama fixture's inputs with the labels replaced by `labels(row, col, token)`.
fn write_inputs(dir: &std::path::Path, labels: impl Fn(usize, usize, i64) -> i64) -> PathBuf {
    let given =
        weft_frontends::read_safetensors(&fixture("llama").join("inputs.safetensors")).unwrap();
    let ids = &given["input_ids"];
    let s = ids.shape[1];
    let l: Vec<i64> = ids
        .to_i64()
        .iter()
        .enumerate()
        .map(|(i, &t)| labels(i / s, i % s, t))
        .collect();
    let path = dir.join("inputs.safetensors");
    let m = BTreeMap::from([
        ("input_ids".to_string(), ids.clone()),
        (
            "labels".to_string(),
            HostTensor::ints(DType::I64, ids.shape.clone(), l),
        ),
    ]);
    weft_frontends::save_safetensors(&path, &m).unwrap();
    path
}

#[test]
fn all_labels_ignored_is_an_input_error_in_every_command() {
    let dir = temp_dir("labels");
    // Only position 0 of each row is valid: HF shifts the labels, so no token is a target.
    let inputs = write_inputs(&dir, |_, col, t| if col == 0 { t } else { -100 });
    let inputs = inputs.to_str().unwrap();
    let out = dir.join("out.safetensors");
    let model = "tests/fixtures/llama";
    for args in [
        vec!["check", model, "--inputs", inputs, "--train"],
        vec!["check", model, "--inputs", inputs, "--mesh", "sp=2"],
        vec![
            "eval",
            model,
            "--inputs",
            inputs,
            "--grads",
            "-o",
            out.to_str().unwrap(),
        ],
        vec!["run", model, "--inputs", inputs, "--steps", "1"],
    ] {
        let (code, _, err) = weft(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains(&format!(
                "error: no valid label in `labels` of {}",
                if args[0] == "run" {
                    format!("--inputs {inputs}, step 0")
                } else {
                    inputs.to_string()
                }
            )) && err.contains("0/0")
                && err.contains("help: give at least one label that is not -100"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("does not match"), "{args:?}: {err}");
    }
    // One valid target anywhere after position 0 is enough.
    let one = write_inputs(
        &dir,
        |row, col, t| if row == 1 && col == 5 { t } else { -100 },
    );
    let (code, out, err) = weft(&[
        "check",
        model,
        "--inputs",
        one.to_str().unwrap(),
        "--train",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(json(&out)["loss"].as_f64().unwrap().is_finite(), "{out}");
}

#[test]
fn drawn_inputs_with_nothing_to_predict_are_refused() {
    // One token per row: after HF's shift there is no target at all.
    let (code, _, err) = weft(&["check", "llama-tiny", "--batch", "2", "--seq", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("no valid label in `labels` of the drawn inputs")
            && err.contains("one token per row"),
        "{err}"
    );
}

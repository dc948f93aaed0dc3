//! End-to-end tests of the `weft` binary: reports, JSON shapes, errors and exit codes.

mod common;
use common::*;

#[test]
fn stats_json_has_exact_param_counts() {
    for (preset, params) in [
        ("llama3-8b", 8_030_261_248u64),
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen2.5-0.5b", 494_032_768),
    ] {
        let (code, out, err) = weft(&["stats", preset, "--json"]);
        assert_eq!(code, 0, "{err}");
        let v = json(&out);
        assert_eq!(v["params"].as_u64(), Some(params), "{preset}");
        let flops = v["forward_flops_per_token"].as_f64().unwrap();
        if preset == "mixtral-8x7b" {
            // Two of eight experts per token: about 12.9B active parameters.
            assert!(
                flops > 2.0 * 12.5e9 && flops < 2.0 * 14.5e9,
                "{preset}: {flops}"
            );
        } else {
            assert!(
                flops > 2.0 * params as f64 * 0.8 && flops < 2.0 * params as f64 * 1.5,
                "{preset}: {flops}"
            );
        }
    }
}

#[test]
fn models_lists_presets() {
    let (code, out, _) = weft(&["models", "--json"]);
    assert_eq!(code, 0);
    let v = json(&out);
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    for p in [
        "llama3-8b",
        "llama3-70b",
        "llama3.1-405b",
        "mistral-7b",
        "qwen2.5-7b",
        "qwen3-8b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "phi3-mini",
    ] {
        assert!(names.contains(&p), "{p} missing from {names:?}");
    }
}

#[test]
fn import_writes_text_that_imports_back() {
    let dir = std::env::temp_dir().join(format!("weft-cli-import-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("qwen3.weft");
    let (code, _, err) = weft(&["import", "qwen3-tiny", "-o", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = weft(&["import", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, std::fs::read_to_string(&file).unwrap());
}

#[test]
fn check_json_on_fixture_with_sp_and_dp() {
    let (code, out, err) = weft(&[
        "check",
        "tests/fixtures/qwen3",
        "--mesh",
        "dp=2,sp=2",
        "--train",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    let v = json(&out);
    for key in [
        "mesh",
        "loss_ref",
        "loss",
        "max_rel_err_logits",
        "max_rel_err_grads",
        "worst_param",
        "ok",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    assert_eq!(v["ok"], true);
    assert_eq!(v["mesh"], "dp=2,sp=2");
}

#[test]
fn eval_writes_full_outputs_and_grads() {
    let dir = std::env::temp_dir().join(format!("weft-cli-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out.safetensors");
    let (code, _, err) = weft(&[
        "eval",
        "tests/fixtures/llama",
        "--inputs",
        "tests/fixtures/llama/inputs.safetensors",
        "--mesh",
        "sp=2",
        "--grads",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let t = weft_frontends::read_safetensors(&out).unwrap();
    assert_eq!(t["logits"].shape, vec![2, 16, 128]);
    assert!(t.contains_key("grad.model.embed_tokens.weight"));
    let reference = weft_frontends::read_safetensors(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/llama/reference.safetensors"
    )))
    .unwrap();
    let (a, b) = (t["loss"].to_f64()[0], reference["loss"].to_f64()[0]);
    assert!((a - b).abs() < 1e-5 * b.abs(), "loss {a} vs {b}");
}

#[test]
fn bad_input_exits_2_with_located_errors() {
    let (code, _, err) = weft(&["compile", "llama-tiny", "--mesh", "sp=3"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("error:") && err.contains("model.layers.0.self_attn") && err.contains("heads"),
        "{err}"
    );

    let (code, _, err) = weft(&["compile", "llama-tiny", "--mesh", "sp=2", "--seq", "15"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("error:") && err.contains("14") && err.contains("16"),
        "nearest lengths in: {err}"
    );

    let (code, _, err) = weft(&["compile", "llama-tiny", "--mesh", "sp2"]);
    assert_eq!(code, 2);
    assert!(err.contains("`sp2` is not `axis=size`"), "{err}");

    let (code, _, err) = weft(&["compile", "llama-tiny", "--passes", "shard-everything"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("unknown pass `shard-everything`") && err.contains("ulysses-attention"),
        "{err}"
    );

    let (code, _, err) = weft(&["stats", "no-such-model"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("unknown model `no-such-model`") && err.contains("help:"),
        "{err}"
    );

    let (code, _, err) = weft(&[
        "check",
        "tests/fixtures/llama",
        "--inputs",
        "tests/fixtures/llama/config.json",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn plans_are_written_inspected_and_run() {
    let dir = std::env::temp_dir().join(format!("weft-cli-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let p = plan.to_str().unwrap();
    let (code, _, err) = weft(&[
        "compile",
        "tests/fixtures/llama",
        "--forward-only",
        "--mesh",
        "sp=2",
        "--seq",
        "16",
        "--batch",
        "2",
        "-o",
        p,
    ]);
    assert_eq!(code, 0, "{err}");
    let first = std::fs::read(&plan).unwrap();
    let (code, _, _) = weft(&[
        "compile",
        "tests/fixtures/llama",
        "--forward-only",
        "--mesh",
        "sp=2",
        "--seq",
        "16",
        "--batch",
        "2",
        "-o",
        p,
    ]);
    assert_eq!(code, 0);
    assert_eq!(
        first,
        std::fs::read(&plan).unwrap(),
        "the same command writes a byte-identical plan"
    );

    let trace = dir.join("trace.json");
    let svg = dir.join("memory.svg");
    let (code, out, err) = weft(&[
        "inspect",
        p,
        "--json",
        "--trace",
        trace.to_str().unwrap(),
        "--memory",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    for key in [
        "peak_memory_bytes",
        "step_time_s",
        "comm_bytes",
        "collectives",
    ] {
        assert!(v.get(key).is_some(), "inspect --json lacks {key}");
    }
    assert_eq!(v["collectives"]["all_to_all"], 8);
    assert!(
        json(&std::fs::read_to_string(&trace).unwrap())["traceEvents"]
            .as_array()
            .unwrap()
            .len()
            > 10
    );
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let (code, out, _) = weft(&["inspect", p, "--explain"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("ulysses-attention: q: heads -> sequence"),
        "{out}"
    );

    // The plan runs like the model it came from.
    let inputs = "tests/fixtures/llama/inputs.safetensors";
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    assert_eq!(
        weft(&["eval", p, "--inputs", inputs, "-o", a.to_str().unwrap()]).0,
        0
    );
    assert_eq!(
        weft(&[
            "eval",
            "tests/fixtures/llama",
            "--mesh",
            "sp=2",
            "--inputs",
            inputs,
            "-o",
            b.to_str().unwrap()
        ])
        .0,
        0
    );
    let (ta, tb) = (
        weft_frontends::read_safetensors(&a).unwrap(),
        weft_frontends::read_safetensors(&b).unwrap(),
    );
    assert_eq!(ta["loss"], tb["loss"]);
    assert_eq!(ta["logits"], tb["logits"]);
    let (code, out, err) = weft(&["check", p, "--inputs", inputs, "--train", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["ok"], true);

    // A plan that does not fit is refused with the breakdown and what would fit.
    let (code, _, err) = weft(&[
        "compile",
        "llama3-8b",
        "--seq",
        "131072",
        "--device-memory",
        "20",
        "-o",
        p,
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("per rank but the device has 20.00 GiB") && err.contains("help:"),
        "{err}"
    );
}

#[test]
fn pt2_archives_import_and_check() {
    let (code, out, err) = weft(&["import", "tests/fixtures/pt2/qwen2.pt2", "--report"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("graph ") && err.contains("recognised attention"),
        "{err}"
    );
    let (code, _, err) = weft(&["import", "tests/fixtures/pt2/llama.pt2"]);
    assert_eq!(code, 2);
    assert!(err.contains("--config"), "{err}");
    let (code, out, err) = weft(&[
        "check",
        "tests/fixtures/pt2/llama.pt2",
        "--config",
        "tests/fixtures/llama/config.json",
        "--mesh",
        "dp=2,sp=2",
        "--train",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["ok"], true);
}

#[test]
fn ops_columns_align_and_show_the_table_facts() {
    let (code, out, err) = weft(&["ops"]);
    assert_eq!(code, 0, "{err}");
    let width = weft_ir::OP_TABLE
        .iter()
        .map(|i| i.name.len())
        .max()
        .unwrap();
    for line in out.lines() {
        // Every line's second column (signature or doc) starts at the same place.
        let (head, rest) = line.split_at(width + 2);
        assert!(
            !rest.starts_with(' ') && !rest.is_empty(),
            "misaligned: {line:?}"
        );
        let name = head.trim_end();
        assert!(
            name.is_empty() || weft_ir::OP_TABLE.iter().any(|i| i.name == name),
            "{line:?}"
        );
    }
    assert!(out.contains("silu") && out.contains("[elementwise unary, 4 FLOP/element]"));
    let (code, text, _) = weft(&["ops", "--json"]);
    assert_eq!(code, 0);
    let rows = json(&text);
    let add = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "add")
        .unwrap();
    assert_eq!(add["elementwise"], "binary");
    assert_eq!(add["flops_per_element"], 1);
}

/// `--dtype bf16` on a float32 config builds the model in bf16, so what HF computes in f32
/// whatever the model's dtype stays f32: the MoE routers' softmax (mixtral) and
/// DeepSeek-V3's sigmoid scores with their f32 correction bias.
#[test]
fn dtype_flag_rebuilds_config_models_keeping_hf_f32_routers() {
    let dir = std::env::temp_dir().join(format!("weft-cli-dtype-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (fixture, op) in [("mixtral", "= softmax "), ("deepseek_v3", "= sigmoid ")] {
        let out = dir.join(format!("{fixture}.weft"));
        let model = format!("tests/fixtures/{fixture}");
        let (code, _, err) = weft(&[
            "compile",
            &model,
            "--dtype",
            "bf16",
            "--forward-only",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{fixture}: {err}");
        let text = std::fs::read_to_string(&out).unwrap();
        let routers: Vec<&str> = text.lines().filter(|l| l.contains(op)).collect();
        assert!(!routers.is_empty(), "{fixture}: no `{op}` in the program");
        for l in routers {
            assert!(
                l.contains(": f32["),
                "{fixture}: the router runs in bf16: {l}"
            );
        }
        assert!(text.contains(": bf16["), "{fixture}: nothing in bf16");
        for l in text
            .lines()
            .filter(|l| l.contains("e_score_correction_bias"))
        {
            assert!(
                l.contains(": f32["),
                "{fixture}: the bias buffer left f32: {l}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

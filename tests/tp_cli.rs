//! `weft` end to end with tensor parallelism: `check --train` over tp meshes (alone,
//! with sp and dp, uneven, with a DeepSpeed spec file), bad specs, and `weft shard`:
//! a full checkpoint to per-rank shards and back, byte for byte, tp=2 -> tp=3, and a
//! directory sharded again for another mesh.

mod common;
use common::*;

fn check_ok(model: &str, mesh: &str, extra: &[&str]) {
    let mut args = vec!["check", model, "--mesh", mesh, "--train", "--json"];
    args.extend_from_slice(extra);
    let (code, out, err) = weft(&args);
    assert_eq!(code, 0, "{model} {mesh}: {out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true, "{out}");
    assert!(v["max_rel_err_grads"].as_f64().unwrap() < 1e-12, "{out}");
}

#[test]
fn check_train_over_tp_meshes() {
    check_ok("tests/fixtures/llama", "tp=2", &[]);
    check_ok("tests/fixtures/qwen3", "tp=4", &[]);
    check_ok("tests/fixtures/phi3", "tp=3", &[]);
    check_ok("tests/fixtures/qwen2", "dp=2,tp=2", &[]);
    check_ok("tests/fixtures/mixtral", "sp=2,tp=2", &[]);
}

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("weft-tp-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn tp_spec_file_and_its_errors() {
    let d = temp("spec");
    let spec = d.join("ds.json");
    std::fs::write(
        &spec,
        r#"{"tensor_parallel": {"autotp_size": 2, "tp_grain_size": 8, "sequence_parallel": true, "partition_config": {"layer_specs": [
            {"patterns": [".*\\.qkv_proj\\.weight$"], "partition_type": "column", "shape": [[32, 16, 16], -1], "partition_dim": 0},
            {"patterns": [".*\\.gate_up_proj\\.weight$"], "partition_type": "column", "shape": [2, -1], "partition_dim": 0}
        ]}}}"#,
    )
    .unwrap();
    check_ok(
        "tests/fixtures/phi3",
        "tp=2",
        &["--tp-spec", spec.to_str().unwrap()],
    );
    std::fs::write(
        &spec,
        r#"{"layer_specs": [{"patterns": ["[q"], "partition_type": "column"}]}"#,
    )
    .unwrap();
    let (code, _, err) = weft(&[
        "check",
        "tests/fixtures/llama",
        "--mesh",
        "tp=2",
        "--tp-spec",
        spec.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("error: invalid tensor-parallel spec")
            && err.contains("layer_specs[0]")
            && err.contains("does not compile"),
        "{err}"
    );
}

#[test]
fn shard_round_trip_is_byte_identical_and_reshards() {
    let d = temp("shard");
    let (s2, s3) = (d.join("tp2"), d.join("tp3"));
    let (full_a, full_b) = (d.join("a.safetensors"), d.join("b.safetensors"));
    let run = |args: &[&str]| {
        let (code, out, err) = weft(args);
        assert_eq!(code, 0, "{args:?}: {out}{err}");
    };
    run(&[
        "shard",
        "tests/fixtures/qwen3",
        "--mesh",
        "tp=2",
        "-o",
        s2.to_str().unwrap(),
    ]);
    assert!(s2.join("rank-tp0.safetensors").exists() && s2.join("rank-tp1.safetensors").exists());
    let layout: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s2.join("layout.json")).unwrap()).unwrap();
    let q = layout["params"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(
        q["partitions"][0]["rank_sizes"],
        serde_json::json!([16, 16])
    );
    let qn = layout["params"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "model.layers.0.self_attn.q_norm.weight")
        .unwrap();
    assert_eq!(qn["grad_allreduce"], true);
    run(&[
        "shard",
        "x",
        "--unshard",
        "--weights",
        s2.to_str().unwrap(),
        "-o",
        full_a.to_str().unwrap(),
    ]);
    // Reshard: tp=2 -> full -> tp=3 -> full.
    run(&[
        "shard",
        "tests/fixtures/qwen3",
        "--mesh",
        "tp=3",
        "--weights",
        full_a.to_str().unwrap(),
        "-o",
        s3.to_str().unwrap(),
    ]);
    run(&[
        "shard",
        "x",
        "--unshard",
        "--weights",
        s3.to_str().unwrap(),
        "-o",
        full_b.to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read(&full_a).unwrap(),
        std::fs::read(&full_b).unwrap(),
        "byte-identical round trip"
    );
    // And equal, tensor by tensor, to the original checkpoint.
    let orig = weft_frontends::read_safetensors(std::path::Path::new(
        "tests/fixtures/qwen3/model.safetensors",
    ))
    .unwrap();
    let back = weft_frontends::read_safetensors(&full_b).unwrap();
    for (k, t) in &orig {
        assert_eq!(t, &back[k], "{k}");
    }
    // Sharding the tp=3 layout into the tp=2 directory replaces its layout: the new
    // files, none of the old layout's others, and files no layout listed left alone.
    std::fs::write(s3.join("notes.txt"), "mine").unwrap();
    // A layout that lists a file `weft shard` never writes does not remove it.
    std::fs::write(s3.join("model.safetensors"), "mine").unwrap();
    let layout = s3.join("layout.json");
    let mut lf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&layout).unwrap()).unwrap();
    lf["files"]
        .as_array_mut()
        .unwrap()
        .push("model.safetensors".into());
    std::fs::write(&layout, lf.to_string()).unwrap();
    run(&[
        "shard",
        "tests/fixtures/qwen3",
        "--mesh",
        "tp=2",
        "--weights",
        full_a.to_str().unwrap(),
        "-o",
        s3.to_str().unwrap(),
    ]);
    let mut names: Vec<String> = std::fs::read_dir(&s3)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "layout.json",
            "model.safetensors",
            "notes.txt",
            "rank-tp0.safetensors",
            "rank-tp1.safetensors"
        ]
    );
}

/// `weft run` draws token ids over the whole vocabulary, not over one tp rank's slice of
/// the embedding: with random weights, tp=2 trains on the tokens one rank does, so its
/// first loss is one rank's.
#[test]
fn run_draws_tokens_over_the_whole_vocabulary_on_tp() {
    let first_loss = |mesh: &[&str]| -> f64 {
        let mut args = vec!["run", "llama-tiny", "--steps", "1", "--json"];
        args.extend(mesh);
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{mesh:?}: {err}");
        let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
        doc["steps"][0]["loss"]
            .as_f64()
            .unwrap_or_else(|| panic!("{mesh:?}: no loss in {out}"))
    };
    let (one, tp) = (first_loss(&[]), first_loss(&["--mesh", "tp=2"]));
    assert!(
        (one - tp).abs() <= 1e-5 * one.abs(),
        "one rank {one}, tp=2 {tp}"
    );
}

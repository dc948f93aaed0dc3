//! Hostile inputs, by family (issue 16): sizes that would wrap, numbers that would make
//! Weft allocate without bound, inputs that used to panic, inputs that used to be
//! accepted with a wrong meaning, outputs that would destroy inputs, and tampered
//! plans and shard sets. Each test runs the built binary as a user would and asserts
//! a clear error (exit code 2, `error:` naming the value), never a panic or a number.

mod common;
use common::*;
use std::path::{Path, PathBuf};

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-hostile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs weft and asserts a bad-input error (exit 2) containing every `needle`, and no
/// panic.
fn refused(args: &[&str], needles: &[&str]) -> String {
    let (code, out, err) = weft(args);
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    assert_eq!(
        code, 2,
        "{args:?} should be refused\nstdout:\n{out}\nstderr:\n{err}"
    );
    // Progress lines (`loading weights ...`, the options chosen) may come first.
    assert!(
        err.lines().any(|l| l.starts_with("error: ")),
        "{args:?}: {err}"
    );
    for n in needles {
        assert!(err.contains(n), "{args:?}: expected `{n}` in:\n{err}");
    }
    err
}

/// The llama fixture as text IR, written into `dir`.
fn fixture_text(dir: &Path) -> String {
    let out = dir.join("model.weft");
    let (code, _, err) = weft(&["import", s(&fixture("llama")), "-o", s(&out)]);
    assert_eq!(code, 0, "{err}");
    std::fs::read_to_string(out).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

// ---- integer arithmetic that wraps ----

#[test]
fn mesh_sizes_are_checked_not_wrapped() {
    refused(
        &["mesh", "dp=65536,sp=65536"],
        &["4294967296 ranks", "1048576"],
    );
    refused(&["mesh", "dp=4294967295"], &["4294967295 ranks"]);
    refused(
        &["compile", "llama3-8b", "--mesh", "dp=65536,sp=65536"],
        &["ranks is more than"],
    );
    refused(&["mesh", "edp=65536,ep=65536"], &["4294967296 ranks"]);
}

#[test]
fn flops_and_seq_never_wrap() {
    // FLOPs are reported in floating point: larger sequences count more, never fewer.
    let per_token = |seq: &str| {
        let (code, out, err) = weft(&["stats", "llama3-8b", "--seq", seq, "--json"]);
        assert_eq!(code, 0, "{err}");
        json(&out)["forward_flops_per_token"].as_f64().unwrap()
    };
    let (a, b, c) = (
        per_token("4194304"),
        per_token("8388608"),
        per_token("67108864"),
    );
    assert!(a > 0.0 && b > a && c > b, "{a} {b} {c}");
    refused(
        &["stats", "llama3-8b", "--seq", "4611686018427387904"],
        &["--seq 4611686018427387904"],
    );
    refused(
        &[
            "compile",
            "llama3-8b",
            "--seq",
            "4611686018427387904",
            "-o",
            "/dev/null/x.json",
        ],
        &["--seq"],
    );
}

#[test]
fn plan_sizes_overflow_is_an_error_naming_the_size() {
    // S = 2^32 is allowed, but S*S attention FLOPs fit only in floating point and the
    // activations exceed any device: an error, never `0 GiB`.
    let dir = scratch("planoverflow");
    let err = refused(
        &[
            "compile",
            "llama3-8b",
            "--mesh",
            "sp=8",
            "--seq",
            "4294967296",
            "-o",
            s(&dir.join("p.json")),
        ],
        &[],
    );
    assert!(!err.contains("0.00 GiB per rank but"), "{err}");
}

#[test]
fn huge_vocabulary_is_refused_not_counted_wrong() {
    let dir = scratch("vocab");
    let cfg = std::fs::read_to_string(fixture("llama").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["vocab_size"] = serde_json::json!(1u64 << 59);
    let p = write(&dir, "config.json", &v.to_string());
    refused(&["stats", s(&p)], &["vocab_size", "576460752303423488"]);
    // In text IR: a 2^59-row parameter holds more than any rank.
    let text = fixture_text(&dir).replace(
        "f32[128, 32] = param",
        "f32[576460752303423488, 32] = param",
    );
    let p = write(&dir, "big.weft", &text);
    refused(&["stats", s(&p)], &["more than"]);
}

// ---- work and memory that grow without bound ----

#[test]
fn text_ir_dims_are_bounded() {
    // Each used to overflow the stack (nesting) or expand without bound (a product of
    // sums): a few hundred bytes of text.
    let dir = scratch("dims");
    let sums = vec!["(a+b+c+d+e+f+g+h)"; 30].join("*");
    for (name, dim, needle) in [
        (
            "parens.weft",
            format!("{}1{}", "(".repeat(200_000), ")".repeat(200_000)),
            "nests more than 64 levels",
        ),
        (
            "minus.weft",
            format!("{}1", "-".repeat(200_000)),
            "nests more than 64 levels",
        ),
        (
            "floors.weft",
            format!("S{}", "//3".repeat(100_000)),
            "floor divisions",
        ),
        ("sums.weft", sums, "more than 4096 terms"),
    ] {
        let p = write(
            &dir,
            name,
            &format!("graph \"x\"\n%0: f32[{dim}] = param {{name=\"w\"}}\nreturn out=%0\n"),
        );
        refused(&["stats", s(&p)], &[needle, "line 2"]);
    }
}

#[test]
fn sparse_value_ids_do_not_allocate_by_id() {
    let dir = scratch("ids");
    let text = fixture_text(&dir)
        .replace("%81", "%1000000000")
        .replace("%80", "%4000000000");
    let p = write(&dir, "ids.weft", &text);
    let (code, out, err) = weft(&["import", s(&p)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("return loss="), "{out}");
}

#[test]
fn config_counts_are_bounded() {
    let dir = scratch("layers");
    let cfg = std::fs::read_to_string(fixture("llama").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["num_hidden_layers"] = serde_json::json!(1e9);
    let p = write(&dir, "config.json", &v.to_string());
    refused(&["stats", s(&p)], &["num_hidden_layers", "4096"]);
}

#[test]
fn large_meshes_print_a_summary() {
    let (code, out, err) = weft(&["mesh", "dp=1024,sp=1024"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().count() < 10, "{out}");
    assert!(
        out.contains("1048576 ranks")
            && out.contains("sp groups: 1024 groups of 1024 ranks, 1 apart"),
        "{out}"
    );
    let (code, out, _) = weft(&["mesh", "dp=1024,sp=1024", "--json"]);
    assert_eq!(code, 0);
    let v = json(&out);
    assert!(
        v.get("coords").is_none(),
        "no per-rank table for a large mesh"
    );
    assert_eq!(v["summary"][0]["stride"], 1024);
    // Small meshes still list every rank.
    let (_, out, _) = weft(&["mesh", "dp=2,sp=2", "--json"]);
    assert_eq!(json(&out)["coords"].as_array().unwrap().len(), 4);
}

#[test]
fn micro_batches_are_checked_before_unrolling() {
    refused(
        &[
            "compile",
            "llama3-8b",
            "--micro-batches",
            "100000",
            "--batch",
            "3",
            "--seq",
            "16",
        ],
        &["--micro-batches 100000: more than 4096"],
    );
    refused(
        &[
            "compile",
            "tests/fixtures/llama",
            "--micro-batches",
            "2",
            "--batch",
            "3",
            "--seq",
            "16",
        ],
        &["2 micro-batches do not divide"],
    );
}

#[test]
fn huge_batch_times_seq_is_refused_before_allocating() {
    // B*S = 2^56 tokens: the checkpoint pass's sum of saved bytes overflowed (a panic),
    // and eval/check/run drew 2^56 token ids before anything was checked (an abort).
    let dir = scratch("bs");
    let (b, s_) = ("16777216", "4294967296");
    let o = dir.join("p.json");
    for args in [
        &[
            "compile",
            "tests/fixtures/llama",
            "--batch",
            b,
            "--seq",
            s_,
            "-o",
            s(&o),
        ][..],
        &["run", "tests/fixtures/llama", "--batch", b, "--seq", s_],
    ] {
        refused(
            args,
            &["B=16777216 S=4294967296", "more than Weft plans for"],
        );
    }
    // 16 x 2^32 tokens on the CPU reference: its logits alone are 32 TiB of host memory.
    let o = dir.join("o.safetensors");
    for args in [
        &[
            "eval",
            "tests/fixtures/llama",
            "--batch",
            "16",
            "--seq",
            s_,
            "-o",
            s(&o),
        ][..],
        &[
            "check",
            "tests/fixtures/llama",
            "--batch",
            "16",
            "--seq",
            s_,
        ],
        &[
            "run",
            "tests/fixtures/llama",
            "--batch",
            "16",
            "--seq",
            s_,
            "--device-memory",
            "1000000000",
        ],
    ] {
        refused(args, &["host memory", "f32[B, S, 128]", "--batch or --seq"]);
    }
    assert!(!o.exists());
}

#[test]
fn random_weights_are_checked_against_host_memory() {
    // 8B parameters in f64 need 60 GiB: more than this machine, refused before drawing.
    let (code, _, err) = weft(&["eval", "llama3.1-405b", "-o", "/dev/null"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("host memory"), "{err}");
}

// ---- panics ----

#[test]
fn closed_or_full_stdout() {
    for args in [
        &["import", "llama3-8b"][..],
        &["mesh", "dp=8,sp=8"],
        &["ops"],
    ] {
        // A closed pipe ends quietly.
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.is_empty(), "{args:?}: {err}");
        // A full disk is an error.
        let full = std::fs::File::options()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(args)
            .stdout(full)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("No space left on device") && !err.contains("panicked"),
            "{err}"
        );
    }
}

#[test]
fn zero_rows_and_huge_dims_do_not_panic_eval() {
    let dir = scratch("zerorows");
    let text = fixture_text(&dir);
    let zero = write(
        &dir,
        "zero.weft",
        &text.replace("f32[128, 32] = param", "f32[0, 32] = param"),
    );
    let (code, _, err) = weft(&["eval", s(&zero), "-o", s(&dir.join("o.safetensors"))]);
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(code, 0, "{err}");
    let huge = write(
        &dir,
        "huge.weft",
        &text.replace(
            "f32[32, 32] = param",
            "f32[1000000000000000000, 32] = param",
        ),
    );
    refused(
        &["eval", s(&huge), "-o", s(&dir.join("o.safetensors"))],
        &[],
    );
}

// ---- accepted when it should be refused ----

#[test]
fn verifier_refuses_duplicate_outputs_and_a_non_scalar_loss() {
    let dir = scratch("outputs");
    let text = fixture_text(&dir);
    let dup = write(
        &dir,
        "dup.weft",
        &text.replace("return loss=%81, logits=%77", "return loss=%81, loss=%77"),
    );
    refused(&["import", s(&dup)], &["output `loss` is returned twice"]);
    let wide = write(
        &dir,
        "wide.weft",
        &text.replace("return loss=%81, logits=%77", "return loss=%77"),
    );
    refused(&["import", s(&wide)], &["the loss must be a scalar"]);
}

#[test]
fn unknown_mesh_axes_are_refused() {
    for (mesh, needle) in [
        ("foo=2", "`foo`"),
        ("pp=2", "`pp`"),
        ("DP=2", "did you mean `dp`"),
        ("CP=2", "did you mean `cp`"),
    ] {
        refused(
            &["compile", "llama3-8b", "--mesh", mesh],
            &[needle, "no pass implements"],
        );
    }
}

#[test]
fn text_ir_float_attributes_are_checked() {
    let dir = scratch("floats");
    let text = fixture_text(&dir);
    let eps = write(&dir, "eps.weft", &text.replace("eps=1e-6", "eps=-1"));
    let err = refused(
        &["import", s(&eps)],
        &["attribute `eps` is -1", "eps.weft:"],
    );
    // Located: the line and a little context, not the whole program.
    assert!(err.lines().count() < 80, "{err}");
    let nan = write(
        &dir,
        "nan.weft",
        &text.replacen("scale=0.3535533905932738", "scale=NaN", 1),
    );
    refused(&["import", s(&nan)], &["attribute `scale` is NaN"]);
}

#[test]
fn text_ir_duplicate_attributes_and_inputs_are_refused() {
    // `{eps=1e-6, eps=1e-5}` kept the first value and dropped the second without a word;
    // two inputs of one name were both bound to the same tensor.
    let dir = scratch("dupattr");
    let text = fixture_text(&dir);
    let attr = write(
        &dir,
        "attr.weft",
        &text.replacen("{eps=1e-6}", "{eps=1e-6, eps=1e-5}", 1),
    );
    refused(
        &["import", s(&attr)],
        &["attribute `eps` of `rms_norm` is given twice", "attr.weft"],
    );
    let input = write(
        &dir,
        "input.weft",
        &text.replace(
            "name=\"labels\", role=labels",
            "name=\"input_ids\", role=labels",
        ),
    );
    refused(
        &["import", s(&input)],
        &["input `input_ids` is already defined by node %0"],
    );
}

#[test]
fn text_ir_rope_scaling_and_arange_are_checked() {
    // A llama3 factor of 0 or NaN made the loss NaN (exit 0); a start near i64::MAX
    // overflowed in the CPU runtime's arange (a rank's panic).
    let dir = scratch("rope");
    let text = fixture_text(&dir);
    for (to, needle) in [
        ("llama3(0.0, 1.0, 4.0, 16)", "factor is 0"),
        ("llama3(NaN, 1.0, 4.0, 16)", "factor is NaN"),
        ("llama3(8.0, 4.0, 4.0, 16)", "must exceed low_freq_factor"),
        (
            "llama3(8.0, 1.0, 4.0, -16)",
            "original_max_position_embeddings is -16",
        ),
        ("linear(-2.0)", "factor is -2"),
    ] {
        let p = write(
            &dir,
            "rope.weft",
            &text.replace("llama3(8.0, 1.0, 4.0, 16)", to),
        );
        refused(&["import", s(&p)], &["attribute `scaling`", needle]);
    }
    let p = write(
        &dir,
        "arange.weft",
        &text.replace("arange {start=0}", "arange {start=9223372036854775807}"),
    );
    let err = refused(
        &[
            "eval",
            s(&p),
            "--weights",
            s(&fixture("llama").join("model.safetensors")),
            "--seq",
            "8",
            "-o",
            s(&dir.join("o.safetensors")),
        ],
        &["`arange` failed", "past the largest i64"],
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn device_profiles_with_bad_numbers_are_refused() {
    let dir = scratch("profile");
    for (field, value) in [
        ("hbm_gbps", "0"),
        ("matmul_tflops", "-5"),
        ("memory_gib", "1e999"),
        ("attention_bwd_tflops", "-3"),
        ("attention_row_keys", "-1"),
    ] {
        let text = format!(
            r#"{{"name":"bad","matmul_tflops":100,"attention_tflops":100,"vector_tflops":10,"hbm_gbps":1000,"kernel_overhead_us":4,"memory_gib":80,"gpus_per_node":8,"intra_node_gbps":100,"intra_node_latency_us":8,"inter_node_gbps":10,"inter_node_latency_us":25,"host_gbps":20,"{field}":{value}}}"#
        );
        // serde_json keeps the last of a repeated key; the profile reader only sees it.
        let p = write(&dir, "dev.json", &text);
        let (code, _, err) = weft(&[
            "compile",
            "llama3.2-1b",
            "--seq",
            "64",
            "--device",
            s(&p),
            "-o",
            s(&dir.join("p.json")),
        ]);
        assert_eq!(code, 2, "{field}={value}: {err}");
        assert!(err.contains("device profile"), "{err}");
    }
}

#[test]
fn duplicate_config_keys_are_refused() {
    let dir = scratch("dupkeys");
    let cfg = std::fs::read_to_string(fixture("llama").join("config.json")).unwrap();
    let dup = cfg.replacen('{', "{\"hidden_size\": 64, ", 1);
    let p = write(&dir, "config.json", &dup);
    refused(&["stats", s(&p)], &["key `hidden_size` appears twice"]);
}

#[test]
fn run_flags_are_checked() {
    // `--train-passes` is gone (the driver builds the training pipeline): clap refuses it.
    refused(
        &[
            "run",
            "tests/fixtures/llama",
            "--train-passes",
            "nope",
            "--steps",
            "1",
        ],
        &["--train-passes"],
    );
    refused(
        &["run", "tests/fixtures/llama", "--peak-tflops", "0"],
        &["--peak-tflops 0"],
    );
    refused(
        &["run", "tests/fixtures/llama", "--check", "--backend", "cpu"],
        &["--check"],
    );
    // A NaN (or negative) tolerance failed every --check comparison on a GPU.
    for t in ["NaN", "-1e-3", "inf"] {
        refused(
            &[
                "run",
                "tests/fixtures/llama",
                "--steps",
                "0",
                &format!("--tolerance={t}"),
            ],
            &["invalid --tolerance", "non-negative relative tolerance"],
        );
    }
    refused(
        &[
            "run",
            "tests/fixtures/llama",
            "--profile-out",
            "/tmp/weft-never-written.tsv",
        ],
        &["--profile-out", "--backend cuda"],
    );
    let dir = scratch("data");
    let odd = write(&dir, "odd.bin", "abc");
    refused(
        &[
            "run",
            "tests/fixtures/llama",
            "--data",
            s(&odd),
            "--seq",
            "1",
            "--batch",
            "1",
        ],
        &["3 bytes is not a whole number"],
    );
    // A run longer than the data says where it wraps, once.
    let tokens: Vec<u8> = (0..32u16).flat_map(|t| (t % 100).to_le_bytes()).collect();
    let data = dir.join("tokens.bin");
    std::fs::write(&data, tokens).unwrap();
    let (code, _, err) = weft(&[
        "run",
        "tests/fixtures/llama",
        "--data",
        s(&data),
        "--seq",
        "8",
        "--batch",
        "2",
        "--steps",
        "5",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.matches("wraps around").count(), 1, "{err}");
    assert!(err.contains("step 3 wraps around"), "{err}");
}

#[test]
fn data_tokens_are_checked_before_the_first_step() {
    // A token past the vocabulary used to fail only at the step that read it (after the
    // steps before it had trained), named by its place in that step's batch.
    let dir = scratch("datavocab");
    let mut tokens: Vec<u8> = (0..31u16).flat_map(|t| (t % 100).to_le_bytes()).collect();
    tokens.extend(65535u16.to_le_bytes());
    let data = dir.join("tokens.bin");
    std::fs::write(&data, tokens).unwrap();
    refused(
        &[
            "run",
            "tests/fixtures/llama",
            "--data",
            s(&data),
            "--seq",
            "8",
            "--batch",
            "2",
            "--steps",
            "1",
        ],
        &[
            "token 31 (byte 62) is 65535",
            "vocabulary size 128",
            "tokens.bin",
        ],
    );
    // --inputs and --data both name the tokens: one would be ignored.
    refused(
        &[
            "run",
            "tests/fixtures/llama",
            "--data",
            s(&data),
            "--inputs",
            s(&fixture("llama").join("inputs.safetensors")),
            "--steps",
            "0",
        ],
        &["'--data <DATA>' cannot be used with '--inputs <INPUTS>'"],
    );
}

#[test]
fn inputs_fix_batch_and_seq() {
    let inputs = fixture("llama").join("inputs.safetensors");
    refused(
        &[
            "eval",
            "tests/fixtures/llama",
            "--inputs",
            s(&inputs),
            "--seq",
            "999",
            "-o",
            "/dev/null",
        ],
        &["--seq 999 differs from --inputs"],
    );
    // `run` read --inputs without the checks eval and check apply: bool token ids ran
    // (as 0/1), an empty batch was blamed on a `--batch 0` never given, and a --seq
    // other than the inputs' failed only in the runtime's bindings.
    use std::collections::BTreeMap;
    use weft_ir::{DType, HostTensor};
    let dir = scratch("run-inputs");
    let save = |name: &str, ids: HostTensor, labels: HostTensor| {
        let p = dir.join(name);
        let m = BTreeMap::from([
            ("input_ids".to_string(), ids),
            ("labels".to_string(), labels),
        ]);
        weft_frontends::save_safetensors(&p, &m).unwrap();
        p
    };
    let bools = save(
        "bool.safetensors",
        HostTensor::ints(DType::Bool, vec![2, 8], vec![1; 16]),
        HostTensor::ints(DType::I64, vec![2, 8], vec![1; 16]),
    );
    let empty = save(
        "empty.safetensors",
        HostTensor::ints(DType::I64, vec![0, 8], vec![]),
        HostTensor::ints(DType::I64, vec![0, 8], vec![]),
    );
    let run = |p: &Path, extra: &[&str], needles: &[&str]| {
        let mut args = vec![
            "run",
            "tests/fixtures/llama",
            "--inputs",
            s(p),
            "--steps",
            "1",
        ];
        args.extend(extra);
        let err = refused(&args, needles);
        assert!(!err.contains("--batch 0"), "{err}");
    };
    run(
        &bools,
        &[],
        &["`input_ids` in", "must be an integer [batch, seq] tensor"],
    );
    run(&empty, &[], &["has shape [0, 8]: no tokens to run"]);
    run(&inputs, &["--seq", "8"], &["--seq 8 differs from --inputs"]);
}

/// An inputs file holding an `attention_mask` with zeros or `position_ids` other than
/// `0..seq` (what a tokenizer's batch or a packed dataset gives) changes HF's logits and
/// loss; Weft used to run without them and print a number. Refused by name for eval,
/// check and run; an all-ones mask and plain positions are neutral and pass.
#[test]
fn inputs_weft_would_ignore_are_refused() {
    use std::collections::BTreeMap;
    use weft_ir::{DType, HostTensor};
    let dir = scratch("extra-inputs");
    let base =
        weft_frontends::read_safetensors(&fixture("llama").join("inputs.safetensors")).unwrap();
    let (b, sq) = (base["input_ids"].shape[0], base["input_ids"].shape[1]);
    let with = |file: &str, name: &str, t: HostTensor| {
        let mut m: BTreeMap<String, HostTensor> = base.clone();
        m.insert(name.to_string(), t);
        let p = dir.join(format!("{file}.safetensors"));
        weft_frontends::save_safetensors(&p, &m).unwrap();
        p
    };
    let ones = vec![1i64; b * sq];
    let mut padded = ones.clone();
    padded[..3].fill(0);
    let plain: Vec<i64> = (0..b * sq).map(|i| (i % sq) as i64).collect();
    let shifted: Vec<i64> = plain.iter().map(|x| x + 3).collect();
    let ty = vec![b, sq];
    let mask_ok = with(
        "mask_ok",
        "attention_mask",
        HostTensor::ints(DType::I64, ty.clone(), ones),
    );
    let mask_pad = with(
        "mask_pad",
        "attention_mask",
        HostTensor::ints(DType::I64, ty.clone(), padded),
    );
    let pos_ok = with(
        "pos_ok",
        "position_ids",
        HostTensor::ints(DType::I64, ty.clone(), plain),
    );
    let pos_shift = with(
        "pos_shift",
        "position_ids",
        HostTensor::ints(DType::I64, ty, shifted),
    );
    let other = with(
        "other",
        "token_type_ids",
        HostTensor::ints(DType::I64, vec![b, sq], vec![0; b * sq]),
    );
    let out = dir.join("out.safetensors");
    for (inputs, needles) in [
        (
            &mask_pad,
            &["hold `attention_mask`", "only an all-ones mask"][..],
        ),
        (
            &pos_shift,
            &["hold `position_ids`", "0..seq on every row"][..],
        ),
        (
            &other,
            &["hold `token_type_ids`", "Weft would run without it"][..],
        ),
    ] {
        refused(
            &[
                "eval",
                "tests/fixtures/llama",
                "--inputs",
                s(inputs),
                "-o",
                s(&out),
            ],
            needles,
        );
        refused(
            &[
                "check",
                "tests/fixtures/llama",
                "--inputs",
                s(inputs),
                "--mesh",
                "sp=2",
            ],
            needles,
        );
        refused(
            &[
                "run",
                "tests/fixtures/llama",
                "--inputs",
                s(inputs),
                "--steps",
                "1",
            ],
            needles,
        );
    }
    let plain_loss = {
        let (code, out, err) = weft(&[
            "eval",
            "tests/fixtures/llama",
            "--inputs",
            s(&fixture("llama").join("inputs.safetensors")),
            "-o",
            s(&dir.join("plain.safetensors")),
            "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        json(&out)["loss"].as_f64().unwrap()
    };
    for inputs in [&mask_ok, &pos_ok] {
        let (code, out, err) = weft(&[
            "eval",
            "tests/fixtures/llama",
            "--inputs",
            s(inputs),
            "-o",
            s(&dir.join("neutral.safetensors")),
            "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(json(&out)["loss"].as_f64().unwrap(), plain_loss);
    }
}

// ---- tampered plans ----

fn compile_plan(dir: &Path) -> (PathBuf, serde_json::Value) {
    let p = dir.join("plan.json");
    let (code, _, err) = weft(&[
        "compile",
        "tests/fixtures/llama",
        "--mesh",
        "dp=2",
        "--seq",
        "8",
        "--batch",
        "2",
        "-o",
        s(&p),
    ]);
    assert_eq!(code, 0, "{err}");
    let v = json(&std::fs::read_to_string(&p).unwrap());
    (p, v)
}

#[test]
fn tampered_plans_are_refused_on_load() {
    let dir = scratch("plans");
    let (good, plan) = compile_plan(&dir);
    let (code, _, err) = weft(&["inspect", s(&good)]);
    assert_eq!(code, 0, "{err}");
    let tamper = |name: &str, f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = plan.clone();
        f(&mut v);
        write(&dir, name, &v.to_string())
    };
    let cases: Vec<(PathBuf, &str)> = vec![
        (
            tamper("rank99.json", &|v| v["groups"]["dp"][0][1] = 99.into()),
            "groups of axis `dp`",
        ),
        (
            tamper("mesh.json", &|v| v["mesh"]["axes"][0][1] = 4.into()),
            "mesh",
        ),
        (
            tamper("buffer.json", &|v| {
                let n = v["buffers"].as_array().unwrap().len();
                v["instructions"][0]["inputs"][0] = (n as u64 + 7).into();
            }),
            "unknown buffer",
        ),
        (
            tamper("huge.json", &|v| {
                v["buffers"][0]["bytes"] = (1u64 << 63).into()
            }),
            "buffer",
        ),
        (
            tamper("program.json", &|v| {
                let p = v["program"]
                    .as_str()
                    .unwrap()
                    .replace("eps=1e-6", "eps=1e-5");
                v["program"] = p.into();
            }),
            "digest",
        ),
        (
            tamper("bindings.json", &|v| v["bindings"]["S"] = (-1).into()),
            "S=-1",
        ),
        (
            tamper("bindings_big.json", &|v| {
                v["bindings"]["S"] = 1000000000000i64.into()
            }),
            "S=1000000000000",
        ),
        (
            tamper("events.json", &|v| v["events"] = 4000000000u64.into()),
            "events",
        ),
        (
            tamper("device.json", &|v| v["device"]["hbm_gbps"] = 0.into()),
            "hbm_gbps",
        ),
    ];
    for (p, needle) in cases {
        refused(&["inspect", s(&p)], &["inconsistent plan", needle]);
    }
    // Another model's program, with its digest updated: the buffers do not match it.
    let other = dir.join("other.json");
    let (code, _, err) = weft(&[
        "compile",
        "tests/fixtures/qwen3",
        "--mesh",
        "dp=2",
        "--seq",
        "8",
        "--batch",
        "2",
        "-o",
        s(&other),
    ]);
    assert_eq!(code, 0, "{err}");
    let o = json(&std::fs::read_to_string(&other).unwrap());
    let swapped = tamper("swapped.json", &|v| {
        v["program"] = o["program"].clone();
        v["program_digest"] = o["program_digest"].clone();
    });
    refused(&["inspect", s(&swapped)], &["inconsistent plan"]);
}

// ---- data loss and integrity ----

#[test]
fn outputs_never_overwrite_inputs() {
    let dir = scratch("overwrite");
    let model = dir.join("m");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(f), model.join(f)).unwrap();
    }
    let weights = model.join("model.safetensors");
    let before = std::fs::read(&weights).unwrap();
    refused(
        &[
            "eval",
            s(&model),
            "--weights",
            s(&weights),
            "-o",
            s(&weights),
        ],
        &["would destroy the input"],
    );
    // The same file by another spelling.
    let other = model.join(".").join("model.safetensors");
    refused(
        &["eval", s(&model), "-o", s(&other), "--weights", s(&weights)],
        &["would destroy"],
    );
    assert_eq!(std::fs::read(&weights).unwrap(), before);
    let (plan, _) = compile_plan(&dir);
    refused(
        &["inspect", s(&plan), "--trace", s(&plan)],
        &["would destroy"],
    );
    refused(&["import", s(&plan), "-o", s(&plan)], &["would destroy"]);
    // No temporary files are left behind by successful writes.
    let (code, _, err) = weft(&["inspect", s(&plan), "--trace", s(&dir.join("t.json"))]);
    assert_eq!(code, 0, "{err}");
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("weft-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn the_checkpoint_beside_a_config_file_is_an_input() {
    // MODEL as config.json (or .weft) reads the model.safetensors beside it: eval read the
    // weights from it and then wrote its outputs over it; compile, plan, import and
    // run --grads-out replaced it too.
    let dir = scratch("beside");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(f), dir.join(f)).unwrap();
    }
    let (config, weights) = (dir.join("config.json"), dir.join("model.safetensors"));
    let before = std::fs::read(&weights).unwrap();
    let text = dir.join("model.weft");
    let (code, _, err) = weft(&["import", s(&config), "-o", s(&text)]);
    assert_eq!(code, 0, "{err}");
    let (c, w, t) = (s(&config), s(&weights), s(&text));
    for args in [
        &["eval", c, "-o", w][..],
        &["eval", t, "-o", w],
        &["import", c, "-o", w],
        &["compile", c, "--seq", "8", "-o", w],
        &["plan", c, "--gpus", "2", "--seq", "8", "-o", w],
        &["run", c, "--steps", "1", "--grads-out", w],
    ] {
        refused(
            args,
            &["checkpoint beside the MODEL", "would destroy the input"],
        );
    }
    // A plan as MODEL reads the model it was compiled from, and the weights beside it.
    let plan = scratch("beside-plan").join("plan.json");
    let (code, _, err) = weft(&["compile", c, "--seq", "8", "--batch", "2", "-o", s(&plan)]);
    assert_eq!(code, 0, "{err}");
    refused(&["eval", s(&plan), "-o", w], &["would destroy the input"]);
    assert_eq!(std::fs::read(&weights).unwrap(), before);
    // A new file beside them destroys nothing.
    let (code, _, err) = weft(&["eval", c, "-o", s(&dir.join("out.safetensors"))]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_sharded_checkpoint_in_a_model_directory_is_read_by_every_command() {
    // `run DIR` and `shard DIR` looked only for model.safetensors: with HF's sharded
    // layout (an index and its shards) run trained random weights, and said nothing.
    use std::collections::BTreeMap;
    let dir = scratch("sharded");
    std::fs::copy(
        fixture("llama").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let full =
        weft_frontends::read_safetensors(&fixture("llama").join("model.safetensors")).unwrap();
    let names: Vec<&String> = full.keys().collect();
    let mut weight_map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let m: BTreeMap<String, weft_ir::HostTensor> = part
            .iter()
            .map(|n| ((*n).clone(), full[*n].clone()))
            .collect();
        weft_frontends::save_safetensors(&dir.join(&file), &m).unwrap();
        for n in part {
            weight_map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    write(&dir, "model.safetensors.index.json", &index.to_string());
    let inputs = fixture("llama").join("inputs.safetensors");
    let loss = |model: &Path| {
        let (code, out, err) = weft(&[
            "run",
            s(model),
            "--steps",
            "1",
            "--inputs",
            s(&inputs),
            "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        json(&out)["steps"][0]["loss"].as_f64().unwrap()
    };
    assert_eq!(loss(&dir), loss(&fixture("llama")));
    let (code, _, err) = weft(&[
        "shard",
        s(&dir),
        "--mesh",
        "tp=2",
        "-o",
        s(&dir.join("shards")),
    ]);
    assert_eq!(code, 0, "{err}");
    // Each shard the index lists is an input of the commands that read it.
    let shard = dir.join("model-00002-of-00002.safetensors");
    let index = dir.join("model.safetensors.index.json");
    refused(
        &["eval", s(&dir.join("config.json")), "-o", s(&shard)],
        &["would destroy the input"],
    );
    refused(
        &[
            "eval",
            "tests/fixtures/llama/config.json",
            "--weights",
            s(&index),
            "-o",
            s(&shard),
        ],
        &["--weights", "would destroy the input"],
    );
}

#[test]
fn every_output_flag_refuses_its_inputs() {
    // `plan -o`, `run --plan-out` and `compile -o` onto a --tp-spec used to write over
    // the model's config.json, the checkpoint, the token file or the spec.
    let dir = scratch("outflags");
    let model = dir.join("m");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(f), model.join(f)).unwrap();
    }
    let config = model.join("config.json");
    let weights = model.join("model.safetensors");
    let data = write(&dir, "tokens.bin", "abcdabcdabcdabcdabcdabcdabcdabcd");
    let spec = write(&dir, "spec.json", "{}");
    let before: Vec<Vec<u8>> = [&config, &weights, &data, &spec]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    let m = s(&model);
    for args in [
        &["plan", m, "--gpus", "2", "--seq", "8", "-o", s(&config)][..],
        &["run", m, "--steps", "0", "--plan-out", s(&config)],
        &["run", m, "--steps", "1", "--plan-out", s(&weights)],
        &[
            "run",
            m,
            "--data",
            s(&data),
            "--seq",
            "4",
            "--batch",
            "1",
            "--plan-out",
            s(&data),
        ],
        &["compile", m, "--tp-spec", s(&spec), "-o", s(&spec)],
    ] {
        refused(args, &["would destroy the input"]);
    }
    let after: Vec<Vec<u8>> = [&config, &weights, &data, &spec]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    assert!(before == after, "an input was changed");
}

#[test]
fn unshard_checks_digests_and_replicas() {
    let dir = scratch("unshard");
    let shards = dir.join("shards");
    let (code, _, err) = weft(&[
        "shard",
        "tests/fixtures/llama",
        "--mesh",
        "tp=2",
        "-o",
        s(&shards),
    ]);
    assert_eq!(code, 0, "{err}");
    let out = dir.join("full.safetensors");
    let (code, _, err) = weft(&["shard", "--unshard", "--weights", s(&shards), "-o", s(&out)]);
    assert_eq!(code, 0, "{err}");
    // Output into the shard set.
    refused(
        &[
            "shard",
            "--unshard",
            "--weights",
            s(&shards),
            "-o",
            s(&shards.join("rank-tp0.safetensors")),
        ],
        &["would destroy"],
    );
    // Swapped rank files.
    let (a, b) = (
        shards.join("rank-tp0.safetensors"),
        shards.join("rank-tp1.safetensors"),
    );
    let tmp = dir.join("swap");
    std::fs::rename(&a, &tmp).unwrap();
    std::fs::rename(&b, &a).unwrap();
    std::fs::rename(&tmp, &b).unwrap();
    refused(
        &["shard", "--unshard", "--weights", s(&shards), "-o", s(&out)],
        &["does not match its digest"],
    );
    std::fs::rename(&a, &tmp).unwrap();
    std::fs::rename(&b, &a).unwrap();
    std::fs::rename(&tmp, &b).unwrap();
    // A flipped byte near the end (in the data).
    let mut bytes = std::fs::read(&a).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&a, &bytes).unwrap();
    refused(
        &["shard", "--unshard", "--weights", s(&shards), "-o", s(&out)],
        &["digest"],
    );
    bytes[n - 3] ^= 0x40;
    std::fs::write(&a, &bytes).unwrap();
    // Layouts: no params, an out-of-range dim.
    let layout_path = shards.join("layout.json");
    let layout = json(&std::fs::read_to_string(&layout_path).unwrap());
    let mut empty = layout.clone();
    empty["params"] = serde_json::json!([]);
    std::fs::write(&layout_path, empty.to_string()).unwrap();
    refused(
        &["shard", "--unshard", "--weights", s(&shards), "-o", s(&out)],
        &["no parameters"],
    );
    let mut bad_dim = layout.clone();
    let split = bad_dim["params"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| !p["partitions"].as_array().unwrap().is_empty())
        .unwrap();
    split["partitions"][0]["dim"] = 7.into();
    std::fs::write(&layout_path, bad_dim.to_string()).unwrap();
    refused(
        &["shard", "--unshard", "--weights", s(&shards), "-o", s(&out)],
        &["out of range"],
    );
}

#[test]
fn a_tp_program_evaluates_on_its_mesh() {
    let dir = scratch("tpweft");
    let p = dir.join("p.weft");
    let (code, _, err) = weft(&[
        "compile",
        "tests/fixtures/llama",
        "--mesh",
        "tp=2",
        "-o",
        s(&p),
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = weft(&[
        "eval",
        s(&p),
        "--mesh",
        "tp=2",
        "-o",
        s(&dir.join("o.safetensors")),
    ]);
    assert_eq!(code, 0, "{err}");
}

// ---- messages ----

#[test]
fn special_and_binary_files_are_named() {
    refused(&["stats", "/dev/zero"], &["special file"]);
    let dir = scratch("binary");
    let p = dir.join("bin.weft");
    std::fs::write(&p, b"graph \"x\"\n\xff\n").unwrap();
    refused(&["stats", s(&p)], &["byte 10 (line 2) is not UTF-8"]);
}

#[test]
fn inputs_are_regular_files_in_their_places() {
    // `/dev/zero` was read whole (unbounded memory) as --device, --data, --tp-spec or a
    // plan; a FIFO as --weights or a shard blocked the open forever.
    let dir = scratch("special");
    let m = "tests/fixtures/llama";
    let o = dir.join("o.safetensors");
    let p = dir.join("p.json");
    for args in [
        &[
            "compile",
            m,
            "--seq",
            "8",
            "--device",
            "/dev/zero",
            "-o",
            s(&p),
        ][..],
        &["run", m, "--data", "/dev/zero", "--steps", "1"],
        &["compile", m, "--mesh", "tp=2", "--tp-spec", "/dev/zero"],
        &["inspect", "/dev/zero"],
        &["eval", m, "--weights", "/dev/zero", "-o", s(&o)],
    ] {
        refused(args, &["/dev/zero", "special file"]);
    }
    let fifo = dir.join("w.safetensors");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|st| st.success()) {
        refused(
            &["eval", m, "--weights", s(&fifo), "-o", s(&o)],
            &["special file"],
        );
    }
    // An index whose shards lie outside its directory.
    let model = dir.join("m");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        fixture("llama").join("config.json"),
        model.join("config.json"),
    )
    .unwrap();
    std::fs::copy(
        fixture("llama").join("model.safetensors"),
        dir.join("outside.safetensors"),
    )
    .unwrap();
    let ck = weft_frontends::read_safetensors(&dir.join("outside.safetensors")).unwrap();
    for shard in ["../outside.safetensors", "/dev/zero"] {
        let map: serde_json::Map<String, serde_json::Value> =
            ck.keys().map(|k| (k.clone(), shard.into())).collect();
        write(
            &model,
            "model.safetensors.index.json",
            &serde_json::json!({ "weight_map": map }).to_string(),
        );
        refused(
            &["eval", s(&model), "-o", s(&o)],
            &[shard, "not a file in the index's directory"],
        );
    }
    // `--config` beside a MODEL that is its own config was ignored: another model ran.
    refused(
        &[
            "eval",
            m,
            "--config",
            "tests/fixtures/qwen3/config.json",
            "-o",
            s(&o),
        ],
        &["--config", "is for a torch.export .pt2 MODEL"],
    );
    assert!(!o.exists());
}

#[test]
fn a_tensor_named_twice_in_a_safetensors_header_is_refused() {
    // The header was read into a map: the first `lm_head.weight` vanished, exit 0.
    let dir = scratch("dupst");
    let bytes = std::fs::read(fixture("llama").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let v: serde_json::Value = serde_json::from_str(header).unwrap();
    let other = v["model.embed_tokens.weight"].to_string();
    let mut dup = format!("{{\"lm_head.weight\":{other},{}", &header[1..]).into_bytes();
    while dup.len() % 8 != 0 {
        dup.push(b' ');
    }
    let mut file = (dup.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&dup);
    file.extend_from_slice(&bytes[8 + n..]);
    let p = dir.join("dup.safetensors");
    std::fs::write(&p, file).unwrap();
    refused(
        &[
            "eval",
            "tests/fixtures/llama",
            "--weights",
            s(&p),
            "-o",
            s(&dir.join("o.safetensors")),
        ],
        &["dup.safetensors", "key `lm_head.weight` appears twice"],
    );
}

// ---- plan building scales with the program ----

/// A chain of `n` elementwise ops on one parameter, as text IR.
fn chain(n: usize) -> weft_ir::Graph {
    let mut t = String::from("graph \"chain\"\n%0: f32[64, 64] = param {name=\"w\"}\n");
    for i in 1..=n {
        t.push_str(&format!("%{i}: f32[64, 64] = neg %{}\n", i - 1));
    }
    t.push_str(&format!("return out=%{n}\n"));
    weft_ir::parse(&t).unwrap()
}

/// Measures how long lowering a chain to a plan takes as it doubles (and a 1M-node
/// chain): near-linear growth is the goal. Not a timed assertion; run with
/// `cargo test --release --test hostile plan_building_time -- --ignored --nocapture`.
#[test]
#[ignore]
fn plan_building_time() {
    let opts = weft_passes::plan::PlanOptions::new(1, 1);
    let mut last = None;
    for n in [10_000, 20_000, 40_000, 80_000, 1_000_000] {
        let g = chain(n);
        let t = std::time::Instant::now();
        let plan = weft_passes::plan::lower(&g, &opts).unwrap();
        let dt = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let loaded = weft_ir::ExecutionPlan::from_json(&plan.to_json(), "chain").unwrap();
        let load = t.elapsed().as_secs_f64();
        assert_eq!(loaded.instructions.len(), n);
        println!(
            "{n:>8} nodes: lower {dt:.3} s, save+load {load:.3} s{}",
            last.map(|(m, p): (usize, f64)| format!(
                " (x{:.2} for x{:.1} nodes)",
                dt / p,
                n as f64 / m as f64
            ))
            .unwrap_or_default()
        );
        last = Some((n, dt));
    }
}

#[test]
fn print_flags_naming_a_pass_the_pipeline_does_not_run_are_refused() {
    // One rank runs no tensor-parallel pass: asking to print around it printed nothing.
    let (code, _, stderr) = weft(&["compile", "llama-tiny", "--print-before", "tensor-parallel"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--print-before names `tensor-parallel`") && stderr.contains("autodiff"),
        "{stderr}"
    );
    let (code, _, stderr) = weft(&[
        "compile",
        "llama-tiny",
        "--print-after",
        "fuse,tensor-parallel",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--print-after names `tensor-parallel`"),
        "{stderr}"
    );
    // Where it runs, it prints.
    let (code, _, stderr) = weft(&[
        "compile",
        "llama-tiny",
        "--mesh",
        "tp=2",
        "--print-before",
        "tensor-parallel",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("IR before tensor-parallel"), "{stderr}");
}

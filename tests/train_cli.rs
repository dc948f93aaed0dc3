//! The training step from the command line: `weft check --train` with checkpointing,
//! offload and micro-batches, `weft eval --grads` from the backward graph, `weft run`
//! lowering the loss on a fixed batch, and `weft compile --train --stats` memory.

mod common;
use common::*;

#[test]
fn check_train_with_every_training_flag() {
    for extra in [
        &["--checkpoint", "selective"][..],
        &[
            "--checkpoint",
            "full",
            "--offload",
            "--offload-min-bytes",
            "0",
        ][..],
        &["--checkpoint", "budget=300k"][..],
        &["--micro-batches", "2", "--bucket-mb", "0.01"][..],
        &["--zero", "2", "--optimizer", "adamw"][..],
    ] {
        let mut args = vec![
            "check",
            "tests/fixtures/qwen3",
            "--mesh",
            "dp=2,sp=2",
            "--train",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = weft(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        let v = json(&out);
        assert_eq!(v["ok"], true, "{extra:?}: {out}");
        assert_eq!(v["grads_from"], "backward graph");
        assert!(
            v["max_rel_err_grads"].as_f64().unwrap() < 1e-8,
            "{extra:?}: {out}"
        );
    }
    // A budget below the step's least peak (here its parameter gradients alone) says
    // what would fit.
    let (code, _, err) = weft(&[
        "check",
        "tests/fixtures/qwen3",
        "--mesh",
        "dp=2,sp=2",
        "--train",
        "--checkpoint",
        "budget=20k",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("`--checkpoint budget=20000` cannot be met")
            && err.contains("help: raise the budget to at least"),
        "{err}"
    );
    let (code, _, err) = weft(&[
        "check",
        "tests/fixtures/llama",
        "--train",
        "--checkpoint",
        "sometimes",
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("invalid --checkpoint") && err.contains("help:"),
        "{err}"
    );
}

#[test]
fn eval_grads_come_from_the_backward_graph() {
    let dir = std::env::temp_dir().join(format!("weft-train-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("eval.safetensors");
    let inputs = "tests/fixtures/llama/inputs.safetensors";
    let (code, _, err) = weft(&[
        "eval",
        "tests/fixtures/llama",
        "--mesh",
        "sp=2",
        "--inputs",
        inputs,
        "--grads",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert_llama_fixture_grads(&out, false);
}

/// The `grad.*` tensors of `file` against HF autograd's in the llama fixture (each within
/// 1e-4 of its largest element); with `exactly`, `file` holds no other tensor.
fn assert_llama_fixture_grads(file: &std::path::Path, exactly: bool) {
    let got = weft_frontends::read_safetensors(file).unwrap();
    let want = weft_frontends::read_safetensors(std::path::Path::new(
        "tests/fixtures/llama/reference.safetensors",
    ))
    .unwrap();
    let want: Vec<_> = want
        .iter()
        .filter(|(k, _)| k.starts_with("grad."))
        .collect();
    if exactly {
        assert_eq!(
            got.len(),
            want.len(),
            "{:?}",
            got.keys().collect::<Vec<_>>()
        );
    }
    for (k, w) in want {
        let (a, b) = (got[k].to_f64(), w.to_f64());
        assert_eq!(a.len(), b.len(), "{k}");
        let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-4 * scale, "{k}: {diff} vs scale {scale}");
    }
}

#[test]
fn run_writes_the_first_steps_gradients() {
    let dir = std::env::temp_dir().join(format!("weft-grads-out-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("grads.safetensors");
    let inputs = "tests/fixtures/llama/inputs.safetensors";
    // `weft run MODEL --inputs <the llama fixture's batch> ARGS...`
    let run = |model: &str, args: &[&str]| {
        let mut all = vec!["run", model, "--inputs", inputs];
        all.extend_from_slice(args);
        weft(&all)
    };
    let llama = "tests/fixtures/llama";
    let target = out.to_str().unwrap();
    let (code, _, err) = run(llama, &["--steps", "2", "--grads-out", target]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("wrote the first step's gradients of 21 parameters"),
        "{err}"
    );
    // The first step's gradients (before any update) against HF autograd's.
    assert_llama_fixture_grads(&out, true);
    // What it cannot write is refused before anything runs, and an input is never its
    // target.
    let before = std::fs::read(inputs).unwrap();
    for (args, says) in [
        (
            &["--steps", "0", "--grads-out", target][..],
            "--steps 0 runs none",
        ),
        (
            &["--steps", "1", "--mesh", "dp=2", "--grads-out", target][..],
            "the mesh has 2 ranks",
        ),
        (
            &["--steps", "1", "--forward-only", "--grads-out", target][..],
            "--forward-only runs no backward",
        ),
        (
            &["--steps", "1", "--grads-out", inputs][..],
            "would destroy the input",
        ),
    ] {
        let (code, _, err) = run(llama, args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read(inputs).unwrap(), before);
    // A plan keeps the outputs it was compiled with: without gradients, nothing to write.
    let plan = dir.join("plan.json");
    let plan = plan.to_str().unwrap();
    let (code, _, err) = run(llama, &["--steps", "0", "--plan-out", plan]);
    assert_eq!(code, 0, "{err}");
    let weights = "tests/fixtures/llama/model.safetensors";
    let (code, out, err) = run(
        plan,
        &["--weights", weights, "--steps", "1", "--grads-out", target],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("returns no gradients") && out.is_empty(),
        "{out}{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn run_lowers_the_loss_on_a_fixed_batch() {
    for mesh in ["", "dp=2,sp=2"] {
        let (code, out, err) = weft(&[
            "run",
            "tests/fixtures/llama",
            "--inputs",
            "tests/fixtures/llama/inputs.safetensors",
            "--mesh",
            mesh,
            "--backend",
            "cpu",
            "--steps",
            "5",
            "--lr",
            "0.01",
            "--json",
        ]);
        assert_eq!(code, 0, "{mesh}: {err}");
        // One JSON document, its `steps` one object per step.
        let doc = json(&out);
        assert_eq!(doc["backend"], "cpu");
        assert_eq!(doc["training"], true);
        let losses: Vec<f64> = doc["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect();
        assert_eq!(losses.len(), 5);
        assert!(losses.windows(2).all(|w| w[1] < w[0]), "{mesh}: {losses:?}");
    }
}

#[test]
fn compile_stats_prints_memory_per_policy() {
    let (code, _, err) = weft(&[
        "compile",
        "llama-tiny",
        "--mesh",
        "sp=2",
        "--train",
        "--stats",
        "--seq",
        "1024",
        "--batch",
        "2",
        "-o",
        "/dev/null",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("memory per rank of the training step (B=2, S=1024)"),
        "{err}"
    );
    let saved: Vec<f64> = ["none", "selective", "full"]
        .iter()
        .map(|p| {
            let line = err
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{p} ")))
                .unwrap_or_else(|| panic!("no {p} row:\n{err}"));
            line.split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<f64>()
                .unwrap()
        })
        .collect();
    assert!(
        saved[0] > saved[1] && saved[1] > saved[2],
        "{saved:?}\n{err}"
    );
}

#[test]
fn run_with_zero_steps_writes_the_plan_of_the_step_and_runs_nothing() {
    let dir = std::env::temp_dir().join(format!("weft-plan-only-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let (code, out, err) = weft(&[
        "run",
        "llama3.2-1b",
        "--steps",
        "0",
        "--seq",
        "4096",
        "--batch",
        "1",
        "--torch-adamw",
        "--checkpoint",
        "selective",
        "--offload",
        "--plan-out",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("plan (training step) for B=1 S=4096") && out.contains("nothing ran"),
        "{out}"
    );
    // The step as the flags describe it: host copies in the host pool, not the arena.
    let p = weft_ir::plan::ExecutionPlan::from_json(
        &std::fs::read_to_string(&plan).unwrap(),
        "plan.json",
    )
    .unwrap();
    p.check().unwrap();
    assert!(
        p.memory.host_bytes > 0,
        "selective + offload sends projections to the host"
    );
    assert!(p
        .buffers
        .iter()
        .any(|b| b.category == weft_ir::plan::Category::Host));
    std::fs::remove_dir_all(&dir).ok();
}

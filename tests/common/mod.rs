//! Helpers shared by the workspace's numeric tests: fixture paths, a loaded case, running
//! a program on the CPU reference in f64, and the error measures the checks assert on.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use weft_ir::{Graph, HostTensor};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

/// The model fixtures made from `transformers` models (tests/fixtures/make_fixtures.py and
/// make_families.py).
pub const FIXTURE_FAMILIES: &[&str] = &[
    "llama",
    "llama_rope3",
    "llama_legacy_rope",
    "llama_kv1",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "olmo2",
    "granite",
    "gemma2",
    "gemma3",
    "mixtral_aux",
    "qwen3_moe_aux",
];

/// `tests/fixtures/<name>`, from the build's manifest dir or, where the binary runs
/// elsewhere (the device machine), from the current directory.
pub fn fixture(name: &str) -> PathBuf {
    let root = option_env!("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    root.join("tests/fixtures").join(name)
}

/// A model with its weights and one batch of inputs.
pub struct Case {
    pub graph: Graph,
    pub weights: BTreeMap<String, HostTensor>,
    pub inputs: BTreeMap<String, HostTensor>,
}

/// Runs `g` on the case in f64 (with gradients when asked), naming the mesh on failure.
pub fn execute(g: &Graph, c: &Case, grads: bool) -> RunResult {
    let opts = RunOptions::new(Precision::F64).with_grads(grads);
    run(g, &c.weights, &c.inputs, &opts)
        .unwrap_or_else(|e| panic!("{} on mesh `{}`: {e}", g.name, g.mesh))
}

/// Max absolute difference over the max magnitude of `b` (0 when equal; infinite for
/// differing shapes or a NaN in `a`).
pub fn rel_err(a: &HostTensor, b: &HostTensor) -> f64 {
    a.max_rel_err(b)
}

/// Asserts `got` equals `want` to 1e-10 of `want`'s largest magnitude (f64 programs that
/// only reorder sums).
pub fn assert_close(what: &str, want: &HostTensor, got: &HostTensor) {
    assert_eq!(want.shape, got.shape, "{what}: shapes");
    let (a, b) = (want.to_f64(), got.to_f64());
    let scale = a.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    let err = a
        .iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= 1e-10 * scale,
        "{what}: max abs error {err:e} (scale {scale:e})"
    );
}

/// Runs the `weft` binary in the repository root: (exit code, stdout, stderr).
pub fn weft(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("weft runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `text` parsed as JSON, or a panic that shows it.
pub fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

/// A fixture's graph, weights and inputs as `make_fixtures.py` saved them.
pub fn load_fixture(
    name: &str,
) -> (
    Graph,
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
) {
    let dir = fixture(name);
    let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap();
    let inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    (model.graph, weights, inputs)
}

/// The fixture with a batch of 4 (its two rows, then the same tokens reversed) and the
/// labels at flat positions `i` (of rows of `s` tokens) where `ignored(i, s)` set to -100.
pub fn load_fixture_batch4(
    name: &str,
    ignored: impl Fn(usize, usize) -> bool,
) -> (
    Graph,
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
) {
    let (graph, weights, given) = load_fixture(name);
    let ids = given["input_ids"].to_i64();
    let s = given["input_ids"].shape[1];
    let ids4: Vec<i64> = ids.iter().chain(ids.iter().rev()).copied().collect();
    let labels: Vec<i64> = ids4
        .iter()
        .enumerate()
        .map(|(i, &t)| if ignored(i, s) { -100 } else { t })
        .collect();
    let int = |v| HostTensor::ints(weft_ir::DType::I64, vec![4, s], v);
    let inputs = BTreeMap::from([
        ("input_ids".to_string(), int(ids4)),
        ("labels".to_string(), int(labels)),
    ]);
    (graph, weights, inputs)
}

/// The unsharded reference: `g` run in f64 with gradients.
pub fn reference_run(
    g: &Graph,
    weights: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
) -> RunResult {
    run(
        g,
        weights,
        inputs,
        &RunOptions::new(Precision::F64).with_grads(true),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", g.name))
}

/// The training step of `g` on `mesh` (e.g. `"dp=2,sp=2"`, empty for one rank): the
/// forward pipeline and the training passes `opts` asks for, with the pass report.
pub fn training_step(
    g: &Graph,
    mesh: &str,
    opts: &weft_passes::training::TrainOptions,
) -> Result<(Graph, weft_passes::RunReport), String> {
    let mesh = weft_ir::Mesh::parse(mesh).map_err(|e| e.to_string())?;
    let mut cx = weft_passes::PassContext::new(mesh.clone());
    cx.options.train = opts.clone();
    let names: Vec<String> = weft_passes::training::training_pipeline(&mesh, opts)
        .names()
        .into_iter()
        .map(String::from)
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut g = g.clone();
    let report = weft_passes::PassManager::default()
        .run(&mut g, &cx, &refs, &mut std::io::sink())
        .map_err(|e| e.to_string())?;
    Ok((g, report))
}

/// `weft compile`'s arguments for `model`'s bf16 training step at `seq` tokens, batch 1,
/// with torch.optim.AdamW's state (no master weights).
pub fn bf16_adamw_step<'a>(model: &'a str, seq: &'a str) -> Vec<&'a str> {
    vec![
        "compile",
        model,
        "--seq",
        seq,
        "--batch",
        "1",
        "--dtype",
        "bf16",
        "--optimizer",
        "adamw",
        "--no-master-weights",
    ]
}

mod fusion;
mod reference;
#[allow(unused_imports)] // not every test binary uses them
pub use fusion::*;
#[allow(unused_imports)] // not every test binary uses them
pub use reference::*;

//! Filetests: small hand-written `.weft` programs under `tests/filetests/`, each with a
//! header naming the passes to run and the mesh, and the blessed output below it
//! (Cranelift's filetests, rustc's mir-opt tests). A pass can be tested on a 10-line
//! program instead of a preset model.
//!
//! ```text
//! // test: what the file shows (one line)
//! // mesh: sp=2
//! // passes: shard-inputs, shard-seq, ulysses-attention, sp-loss, canonicalize
//! // train: micro_batches=2, checkpoint=full, optimizer=sgd:0.1, zero1, reduce_scatter
//! // check: B=2 S=8
//! graph "name"
//! ...
//! return loss=%9, logits=%8
//! // expected:
//! // graph "name"
//! // mesh sp=2
//! // ...
//! ```
//!
//! `train:` (optional) sets the training passes' options; `check:` (optional, with the
//! sizes to run at) runs the program after the passes on the CPU reference (f64, random
//! weights and inputs) against the unsharded input program: the loss, logits, the
//! gradients (`grad.<param>` outputs, or the runtime's gradients of a forward program)
//! and SGD updates (`param.<param>`) must agree to 1e-10. Every line below
//! `// expected:` is the printed program after the passes; `WEFT_BLESS=1 cargo test
//! --test filetests` rewrites it (review the diff before committing).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use weft_ir::{DType, Graph, HostTensor, Mesh, Op, Role, ValueName};
use weft_passes::training::{CheckpointPolicy, OffloadOptions, Optimizer, TrainOptions};
use weft_passes::{PassContext, PassManager};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

const EXPECTED: &str = "// expected:";

/// One parsed filetest.
struct FileTest {
    path: PathBuf,
    mesh: Mesh,
    passes: Vec<String>,
    train: TrainOptions,
    /// Sizes to run the numeric check at (`B`, `S`), when the file asks for one.
    check: Option<Vec<(String, i64)>>,
    /// The program text (header and all, up to the expected section).
    program: String,
    expected: Option<String>,
}

fn header<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .take_while(|l| !l.starts_with("graph "))
        .find_map(|l| l.strip_prefix("// ")?.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

fn parse_train(spec: &str, where_: &str) -> TrainOptions {
    let mut t = TrainOptions::default();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = match item.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (item, None),
        };
        fn fail(where_: &str, item: &str) -> ! {
            panic!("{where_}: bad train option `{item}`")
        }
        let bad = || -> ! { fail(where_, item) };
        let int = |v: Option<&str>| -> u64 {
            v.and_then(|v| v.parse().ok())
                .unwrap_or_else(|| fail(where_, item))
        };
        match key {
            "micro_batches" => t.micro_batches = int(value) as u32,
            "checkpoint" => {
                t.checkpoint = CheckpointPolicy::parse(value.unwrap_or_else(|| bad()))
                    .unwrap_or_else(|e| panic!("{where_}: {e}"))
            }
            "offload" => {
                let o = t.offload.get_or_insert_with(OffloadOptions::default);
                o.min_bytes = 0;
                o.keep_last = value.map(|v| int(Some(v)) as usize).unwrap_or(0);
            }
            "bucket_bytes" => t.bucket_bytes = int(value),
            "reduce_scatter" => t.reduce_scatter = true,
            "zero1" => t.zero1 = true,
            "zero3" => t.zero3 = true,
            "no_grad_outputs" => t.grad_outputs = false,
            "optimizer" => {
                let v = value.unwrap_or_else(|| bad());
                let (kind, lr) = v.split_once(':').unwrap_or((v, "0.1"));
                let lr: f64 = lr.parse().unwrap_or_else(|_| bad());
                t.optimizer = Some(match kind {
                    "sgd" => Optimizer::sgd(lr),
                    "adamw" => Optimizer::adamw(lr),
                    _ => bad(),
                });
            }
            _ => bad(),
        }
    }
    t
}

fn load(path: &Path) -> FileTest {
    let text = std::fs::read_to_string(path).unwrap();
    let where_ = path.display().to_string();
    let (program, expected) = match text.find(&format!("\n{EXPECTED}\n")) {
        Some(i) => (
            text[..i + 1].to_string(),
            Some(
                text[i + 1 + EXPECTED.len() + 1..]
                    .lines()
                    .map(|l| l.strip_prefix("// ").unwrap_or(l.trim_start_matches("//")))
                    .collect::<Vec<_>>()
                    .join("\n")
                    + "\n",
            ),
        ),
        None => (text.clone(), None),
    };
    let mesh = Mesh::parse(header(&text, "mesh").unwrap_or(""))
        .unwrap_or_else(|e| panic!("{where_}: mesh: {e}"));
    let passes = header(&text, "passes")
        .unwrap_or_else(|| panic!("{where_}: no `// passes:` line"))
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    let train = parse_train(header(&text, "train").unwrap_or(""), &where_);
    let check = header(&text, "check").map(|s| {
        s.split_whitespace()
            .map(|kv| {
                let (k, v) = kv
                    .split_once('=')
                    .unwrap_or_else(|| panic!("{where_}: check: `{kv}` is not SYM=size"));
                (k.to_string(), v.parse().unwrap())
            })
            .collect()
    });
    assert!(
        header(&text, "test").is_some(),
        "{where_}: no `// test:` line saying what the file shows"
    );
    FileTest {
        path: path.to_path_buf(),
        mesh,
        passes,
        train,
        check,
        program,
        expected,
    }
}

/// The program after the file's passes, and its printed text.
fn compile(t: &FileTest) -> (Graph, Graph, String) {
    let where_ = t.path.display();
    let original = weft_ir::parse(&t.program).unwrap_or_else(|e| panic!("{where_}: parse: {e}"));
    weft_ir::verify(&original).unwrap_or_else(|r| panic!("{where_}: input: {r}"));
    let mut g = original.clone();
    g.mesh = t.mesh.clone();
    let mut cx = PassContext::new(t.mesh.clone());
    cx.options.train = t.train.clone();
    if let Some(sizes) = &t.check {
        for (k, v) in sizes {
            match k.as_str() {
                "B" => cx.options.train.batch = Some(*v),
                "S" => cx.options.train.seq = Some(*v),
                _ => {}
            }
        }
    }
    let passes: Vec<&str> = t.passes.iter().map(String::as_str).collect();
    PassManager::default()
        .run(&mut g, &cx, &passes, &mut std::io::sink())
        .unwrap_or_else(|e| panic!("{where_}: {e}"));
    weft_ir::verify(&g).unwrap_or_else(|r| panic!("{where_}: after the passes: {r}"));
    let text = weft_ir::print(&g);
    let back = weft_ir::parse(&text).unwrap_or_else(|e| panic!("{where_}: reparse: {e}"));
    assert_eq!(
        back, g,
        "{where_}: the printed program does not parse back equal"
    );
    (original, g, text)
}

/// Deterministic pseudo-random numbers (an LCG: no dependency, the same on every
/// machine).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn unit(&mut self) -> f64 {
        (self.next() % 2_000_001) as f64 / 1_000_000.0 - 1.0
    }
}

/// The vocabulary size: rows of the table the first `embedding` reads.
fn vocab(g: &Graph) -> i64 {
    g.nodes()
        .iter()
        .find_map(|&n| match g.node(n).op {
            Op::Embedding { .. } => {
                let table = g.node(n).operands[1];
                g.ty(table).shape[0].as_const()
            }
            _ => None,
        })
        .unwrap_or(16)
}

fn random_case(
    g: &Graph,
    sizes: &[(String, i64)],
) -> (BTreeMap<String, HostTensor>, BTreeMap<String, HostTensor>) {
    let mut rng = Lcg(0x5eed);
    let mut bind = weft_ir::Bindings::new();
    for (k, v) in sizes {
        bind = bind.with(k, *v);
    }
    let dims = |ty: &weft_ir::TensorType| -> Vec<usize> {
        ty.shape
            .iter()
            .map(|d| {
                d.bind(&bind)
                    .as_const()
                    .unwrap_or_else(|| panic!("size `{d}` is not bound by `// check:`"))
                    as usize
            })
            .collect()
    };
    let mut weights = BTreeMap::new();
    for (name, v) in g.params() {
        let shape = dims(g.ty(v));
        let n = shape.iter().product();
        // Norm weights near 1, the rest small: a well-conditioned program.
        let data: Vec<f64> = (0..n)
            .map(|_| {
                if shape.len() == 1 {
                    1.0 + 0.1 * rng.unit()
                } else {
                    0.3 * rng.unit()
                }
            })
            .collect();
        weights.insert(name, HostTensor::floats(g.ty(v).dtype, shape, data));
    }
    let vocab = vocab(g);
    let mut inputs = BTreeMap::new();
    for (name, role, v) in g.inputs() {
        let ty = g.ty(v);
        let shape = dims(ty);
        let n: usize = shape.iter().product();
        let t = match role {
            Role::InputIds => HostTensor::ints(
                ty.dtype,
                shape,
                (0..n).map(|_| (rng.next() as i64) % vocab).collect(),
            ),
            // Some ignored labels, unevenly placed.
            Role::Labels => HostTensor::ints(
                ty.dtype,
                shape,
                (0..n)
                    .map(|i| {
                        if i % 5 == 1 {
                            -100
                        } else {
                            (rng.next() as i64) % vocab
                        }
                    })
                    .collect(),
            ),
            _ if ty.dtype.is_float() => {
                HostTensor::floats(ty.dtype, shape, (0..n).map(|_| rng.unit()).collect())
            }
            _ => panic!("filetests draw no input `{name}` of {ty}"),
        };
        inputs.insert(name, t);
    }
    (weights, inputs)
}

fn run_f64(
    g: &Graph,
    w: &BTreeMap<String, HostTensor>,
    i: &BTreeMap<String, HostTensor>,
    grads: bool,
    sizes: &[(String, i64)],
) -> RunResult {
    let mut opts = RunOptions::new(Precision::F64).with_grads(grads);
    for (k, v) in sizes {
        opts.bindings = opts.bindings.clone().with(k, *v);
    }
    run(g, w, i, &opts).unwrap_or_else(|e| panic!("{} on mesh `{}`: {e}", g.name, g.mesh))
}

/// Runs the compiled program against the unsharded input program: returns how many
/// tensors were compared.
fn check_numerically(t: &FileTest, original: &Graph, compiled: &Graph) -> usize {
    let where_ = t.path.display();
    let sizes = t.check.as_deref().unwrap();
    let (weights, mut inputs) = random_case(original, sizes);
    let reference = run_f64(original, &weights, &inputs, true, sizes);
    let mut w = weights.clone();
    w.extend(weft_passes::optimizer::initial_state(compiled, &weights).unwrap());
    if compiled
        .inputs()
        .iter()
        .any(|(n, _, _)| n == weft_ir::role::STEP_NAME)
    {
        inputs.insert(
            weft_ir::role::STEP_NAME.into(),
            HostTensor::floats(DType::F32, vec![], vec![1.0]),
        );
    }
    let trains = compiled
        .outputs()
        .iter()
        .any(|(n, _)| weft_ir::ValueRole::of(n).is_some());
    let got = run_f64(compiled, &w, &inputs, !trains, sizes);
    let mut compared = 0;
    for (name, tensor) in &got.outputs {
        let want = match ValueName::parse(name) {
            ValueName::Grad(p) => reference.grads[p].clone(),
            ValueName::UpdatedParam(p) => {
                let lr = match t.train.optimizer {
                    Some(Optimizer::Sgd {
                        lr,
                        momentum,
                        weight_decay,
                    }) if momentum.0 == 0.0 && weight_decay.0 == 0.0 => lr.0,
                    _ => panic!("{where_}: checks updates of plain SGD only"),
                };
                let (w0, g0) = (weights[p].to_f64(), reference.grads[p].to_f64());
                let data = w0.iter().zip(&g0).map(|(w, g)| w - lr * g).collect();
                HostTensor::floats(DType::F64, weights[p].shape.clone(), data)
            }
            ValueName::Plain(n) if reference.outputs.contains_key(n) => {
                reference.outputs[n].clone()
            }
            _ => continue,
        };
        common::assert_close(&format!("{where_}: {name}"), &want, tensor);
        compared += 1;
    }
    for (p, g) in &got.grads {
        common::assert_close(
            &format!("{where_}: gradient of {p}"),
            &reference.grads[p],
            g,
        );
        compared += 1;
    }
    assert!(
        got.outputs.contains_key("loss"),
        "{where_}: the program returns no loss to compare"
    );
    compared
}

fn files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/filetests");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "weft"))
        .collect();
    out.sort();
    out
}

#[test]
fn filetests() {
    let bless = std::env::var_os("WEFT_BLESS").is_some();
    let files = files();
    assert!(
        files.len() >= 8,
        "tests/filetests/ holds {} files",
        files.len()
    );
    let mut failures = Vec::new();
    for path in &files {
        // Every file runs and reports, so one run shows every failure.
        let outcome = std::panic::catch_unwind(|| one_file(path, bless));
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(m)) => failures.push(m),
            // (the panic message names the file)
            Err(p) => failures.push(
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| format!("{}: panicked", path.display())),
            ),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Compiles, checks and compares (or blesses) one file.
fn one_file(path: &Path, bless: bool) -> Result<(), String> {
    let t = load(path);
    let (original, compiled, text) = compile(&t);
    if t.check.is_some() {
        let n = check_numerically(&t, &original, &compiled);
        assert!(n > 0, "{}: nothing compared", path.display());
        eprintln!(
            "{}: {n} tensors match the unsharded program",
            path.display()
        );
    }
    if bless {
        let mut out = t.program.clone();
        out.push_str(EXPECTED);
        out.push('\n');
        for l in text.lines() {
            out.push_str(&format!("// {l}\n"));
        }
        std::fs::write(path, out).unwrap();
    } else if t.expected.as_deref() != Some(text.as_str()) {
        return Err(format!(
            "{}: the output differs from the blessed one (WEFT_BLESS=1 rewrites it):\n{}",
            path.display(),
            diff(t.expected.as_deref().unwrap_or(""), &text)
        ));
    }
    Ok(())
}

/// The first differing lines, enough to see what moved.
fn diff(want: &str, got: &str) -> String {
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let mut out = String::new();
    let mut shown = 0;
    for i in 0..w.len().max(g.len()) {
        let (a, b) = (w.get(i).copied(), g.get(i).copied());
        if a != b && shown < 12 {
            out.push_str(&format!(
                "line {}:\n- {}\n+ {}\n",
                i + 1,
                a.unwrap_or(""),
                b.unwrap_or("")
            ));
            shown += 1;
        }
    }
    out
}

#[test]
fn the_numeric_check_catches_a_wrong_rewrite() {
    // tp_mlp without the all_reduce after the row-parallel down_proj: each rank keeps
    // its partial sum, which the check must refuse.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/filetests/tp_mlp.weft");
    let t = load(&path);
    let (original, mut compiled, _) = compile(&t);
    let reduce = compiled
        .nodes()
        .iter()
        .copied()
        .find(|&n| matches!(compiled.node(n).op, Op::AllReduce { .. }))
        .expect("tp_mlp has an all_reduce");
    let (partial, summed) = (
        compiled.node(reduce).operands[0],
        compiled.node(reduce).results[0],
    );
    compiled.replace_all_uses(summed, partial);
    let caught = std::panic::catch_unwind(|| check_numerically(&t, &original, &compiled));
    assert!(caught.is_err(), "a dropped all_reduce went unnoticed");
}

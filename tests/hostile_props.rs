//! Property tests over hostile inputs (issue 16, "keep it that way"): mutants of every
//! reader's input never panic the reader, and a mutated program the verifier accepts
//! never panics a pass or the CPU reference runtime. The committed case count is small
//! (CI has 2 cores); a long run: `PROPTEST_CASES=20000 cargo test --test hostile_props`.
//!
//! Mutations replace numbers with edge values (0, -1, 2^31, 2^62, i64::MAX, NaN, inf),
//! delete, duplicate or swap lines, swap value ids and op names, flip bytes.

mod common;
use common::*;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::OnceLock;
use weft_ir::HostTensor;

const EDGE: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "3",
    "7",
    "64",
    "1000000000",
    "2147483648",
    "4294967296",
    "1099511627776",
    "4611686018427387904",
    "9223372036854775807",
    "-9223372036854775808",
    "NaN",
    "inf",
    "-inf",
    "1e-300",
    "1e300",
    "0.5",
    "\"\"",
    "null",
    "[]",
    "{}",
];
const OPS: &[&str] = &[
    "add",
    "mul",
    "matmul",
    "linear",
    "reshape",
    "transpose",
    "slice",
    "concat",
    "softmax",
    "rms_norm",
    "attention",
    "embedding",
    "cross_entropy",
    "all_reduce",
    "param",
    "input",
];

/// One edit of a text: `(kind, where, what)`, positions taken modulo the text.
type Edit = (u8, usize, usize);

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec((0u8..7, any::<usize>(), any::<usize>()), 1..6)
}

/// Byte ranges of the numbers (optionally signed, with fraction/exponent) in `t`.
fn numbers(t: &str) -> Vec<(usize, usize)> {
    let b = t.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let start = if i > 0 && b[i - 1] == b'-' { i - 1 } else { i };
            let mut j = i;
            while j < b.len()
                && (b[j].is_ascii_alphanumeric()
                    || b[j] == b'.'
                    || b[j] == b'-' && b[j - 1] == b'e')
            {
                j += 1;
            }
            out.push((start, j));
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

fn mutate(text: &str, edits: &[Edit]) -> String {
    let mut t = text.to_string();
    for &(kind, at, what) in edits {
        let lines: Vec<&str> = t.lines().collect();
        if lines.is_empty() {
            break;
        }
        let l = at % lines.len();
        t = match kind {
            0 | 1 | 2 => {
                let nums = numbers(&t);
                if nums.is_empty() {
                    continue;
                }
                let (s, e) = nums[at % nums.len()];
                format!("{}{}{}", &t[..s], EDGE[what % EDGE.len()], &t[e..])
            }
            3 => {
                let mut v = lines.clone();
                v.remove(l);
                v.join("\n")
            }
            4 => {
                let mut v = lines.clone();
                v.insert(what % (v.len() + 1), lines[l]);
                v.join("\n")
            }
            5 => {
                let mut v: Vec<String> = lines.iter().map(|x| x.to_string()).collect();
                let op = OPS[what % OPS.len()];
                if let Some(eq) = v[l].find("= ") {
                    let rest = &v[l][eq + 2..];
                    let end = rest.find([' ', '{']).unwrap_or(rest.len());
                    v[l] = format!("{}= {op}{}", &v[l][..eq], &rest[end..]);
                }
                v.join("\n")
            }
            _ => {
                let mut b = t.into_bytes();
                let i = at % b.len().max(1);
                if !b.is_empty() {
                    b[i] = b"%,:=[]{}\"x0 \n"[what % 13];
                }
                String::from_utf8_lossy(&b).into_owned()
            }
        };
    }
    t
}

struct Seeds {
    text: String,
    config: String,
    inputs: BTreeMap<String, HostTensor>,
    safetensors: Vec<u8>,
    plan: String,
    layout: String,
}

fn seeds() -> &'static Seeds {
    static S: OnceLock<Seeds> = OnceLock::new();
    S.get_or_init(|| {
        let dir = fixture("llama");
        let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
        let plan = {
            let mut g = model.graph.clone();
            g.mesh = weft_ir::Mesh::parse("dp=2").unwrap();
            let cx = weft_passes::PassContext::new(g.mesh.clone());
            let names = weft_passes::registry::default_pipeline(&g.mesh);
            weft_passes::PassManager::default()
                .run(&mut g, &cx, &names, &mut std::io::sink())
                .unwrap();
            let opts = weft_passes::plan::PlanOptions::new(2, 8);
            weft_passes::plan::lower(&g, &opts).unwrap().to_json()
        };
        let layout = {
            let mut g = model.graph.clone();
            g.mesh = weft_ir::Mesh::parse("tp=2").unwrap();
            let cx = weft_passes::PassContext::new(g.mesh.clone());
            let names = weft_passes::registry::default_pipeline(&g.mesh);
            weft_passes::PassManager::default()
                .run(&mut g, &cx, &names, &mut std::io::sink())
                .unwrap();
            let l = weft_passes::tp::param_layouts(&g, &model.tied).unwrap();
            serde_json::to_string(&l).unwrap()
        };
        Seeds {
            text: weft_ir::print(&model.graph),
            config: std::fs::read_to_string(dir.join("config.json")).unwrap(),
            inputs: weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap(),
            safetensors: std::fs::read(dir.join("inputs.safetensors")).unwrap(),
            plan,
            layout,
        }
    })
}

/// Elements a program holds with the fixture's inputs bound: the runtime only runs
/// mutants small enough for a test.
fn small_enough(g: &weft_ir::Graph) -> bool {
    let mut b = weft_ir::Bindings::new().with("B", 2).with("S", 8);
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64);
    }
    let mut total: u128 = 0;
    for &n in g.nodes() {
        for v in &g.node(n).results {
            match g.ty(*v).numel().eval(&b) {
                Ok(k) if k >= 0 => total += k as u128,
                _ => return false,
            }
        }
    }
    total < 2_000_000
}

/// Text-IR mutants seen, parsed, verified and run (printed every 5000 mutants with
/// `--nocapture`, to see what a long run covered).
static TALLY: [std::sync::atomic::AtomicUsize; 4] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 4];

fn tally(i: usize) {
    TALLY[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

#[derive(Default)]
struct Count;

impl Drop for Count {
    fn drop(&mut self) {
        let n = TALLY[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if n % 5000 == 0 {
            let t: Vec<usize> = TALLY
                .iter()
                .map(|x| x.load(std::sync::atomic::Ordering::Relaxed))
                .collect();
            eprintln!("text-IR mutants: {} seen, {} parsed, {} verified, {} run through passes and runtime", t[0], t[1], t[2], t[3]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Text IR: parse and verify never panic; a verified mutant runs the passes of a
    /// few meshes and the CPU runtime without panicking (errors are fine).
    #[test]
    fn text_ir_mutants_never_panic(e in edits(), mesh in 0usize..4) {
        let text = mutate(&seeds().text, &e);
        let _count = Count::default();
        let Ok(g) = weft_ir::parse(&text) else { return Ok(()) };
        tally(1);
        if weft_ir::verify(&g).is_err() {
            return Ok(());
        }
        tally(2);
        let Ok(model) = weft_frontends::Model::from_graph(g, weft_frontends::Origin::Preset("mutant".into())) else {
            return Ok(());
        };
        if !small_enough(&model.graph) || model.param_count() > 1_000_000 {
            return Ok(());
        }
        let mut g = model.graph.clone();
        g.mesh = weft_ir::Mesh::parse(["", "dp=2", "sp=2", "tp=2"][mesh]).unwrap();
        let cx = weft_passes::PassContext::new(g.mesh.clone());
        let names = weft_passes::registry::default_pipeline(&g.mesh);
        let passed = weft_passes::PassManager::default().run(&mut g, &cx, &names, &mut std::io::sink());
        tally(3);
        let weights = weft_frontends::random_weights(&model, 1);
        let opts = weft_runtime::cpu::RunOptions::new(weft_runtime::cpu::Precision::F32);
        let _ = weft_runtime::cpu::run(&model.graph, &weights, &seeds().inputs, &opts);
        if passed.is_ok() && small_enough(&g) {
            let _ = weft_runtime::cpu::run(&g, &weights, &seeds().inputs, &opts);
        }
    }

    #[test]
    fn config_mutants_never_panic(e in edits()) {
        let text = mutate(&seeds().config, &e);
        if let Ok(c) = weft_frontends::ModelConfig::from_json_str(&text, "mutant") {
            let _ = weft_frontends::Model::from_config("mutant", c, weft_frontends::Origin::Preset("mutant".into()));
        }
    }

    #[test]
    fn safetensors_mutants_never_panic(flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let mut b = seeds().safetensors.clone();
        let header = 8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        for (at, byte) in flips {
            // Mostly the header (the length and the JSON), sometimes the data.
            let i = if at % 4 == 0 { at % b.len() } else { at % header.min(b.len()) };
            b[i] = byte;
        }
        if cut % 5 == 0 {
            b.truncate(cut % (b.len() + 1));
        }
        let p = std::env::temp_dir().join(format!("weft-prop-st-{}-{:?}.safetensors", std::process::id(), std::thread::current().id()));
        std::fs::write(&p, &b).unwrap();
        let _ = weft_frontends::read_safetensors(&p);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn plan_mutants_never_panic(e in edits()) {
        let text = mutate(&seeds().plan, &e);
        if let Ok(p) = weft_ir::ExecutionPlan::from_json(&text, "mutant") {
            let _ = p.clocks();
            let _ = p.storage_roots();
        }
    }

    #[test]
    fn layout_mutants_never_panic(e in edits()) {
        let text = mutate(&seeds().layout, &e);
        let Ok(layouts) = serde_json::from_str::<Vec<weft_passes::tp::ParamLayout>>(&text) else { return Ok(()) };
        let axes = vec![("tp".to_string(), 2u32)];
        if weft_passes::tp::layout::validate_layouts(&layouts, &axes).is_ok() {
            let dir = fixture("llama");
            let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
            let full = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap();
            if let Ok(shards) = weft_passes::tp::shard_checkpoint(&layouts, &full, &axes) {
                let _ = weft_passes::tp::unshard_checkpoint(&layouts, &shards, &axes);
            }
        }
        let _ = weft_passes::tp::unshard_checkpoint(&layouts, &[BTreeMap::new(), BTreeMap::new()], &axes);
    }
}

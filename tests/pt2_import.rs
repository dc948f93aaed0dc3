//! `.pt2` archives (tests/fixtures/pt2, written by tests/fixtures/make_pt2.py from the
//! same tiny HF models as tests/fixtures/<family>) import into graphs that reproduce
//! PyTorch's logits and loss (1e-5) and gradients (1e-4) on the CPU reference runtime,
//! agree with the graph built from the family's config.json, and survive the passes.

mod common;
use common::*;

use std::collections::BTreeMap;
use std::path::PathBuf;
use weft_frontends::pt2::{import, Pt2Error, Pt2Import, Pt2Options};
use weft_ir::{HostTensor, Mesh, Op};
use weft_runtime::cpu::{run, Precision, RunOptions, RunResult};

fn root() -> PathBuf {
    option_env!("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn fixture_dir(family: &str) -> PathBuf {
    root().join("tests/fixtures").join(family)
}

fn archive(name: &str) -> PathBuf {
    root()
        .join("tests/fixtures/pt2")
        .join(format!("{name}.pt2"))
}

/// `(archive, fixture family)`; every archive of make_pt2.py except the broken-on-purpose ones.
const ARCHIVES: &[(&str, &str)] = &[
    ("llama", "llama"),
    ("llama_decomposed", "llama"),
    ("llama_static", "llama"),
    ("qwen2", "qwen2"),
    ("qwen2_decomposed", "qwen2"),
    ("qwen2_eager_dynbatch", "qwen2"),
    ("qwen3", "qwen3"),
    ("phi3", "phi3"),
    ("mixtral", "mixtral"),
    ("mixtral_decomposed", "mixtral"),
    ("mixtral_batched", "mixtral"),
    ("mixtral_batched_decomposed", "mixtral"),
    ("qwen3_moe_batched", "qwen3_moe"),
    ("qwen3_moe_batched_decomposed", "qwen3_moe"),
    ("olmo2", "olmo2"),
    ("granite", "granite"),
    ("mistral_sw13", "mistral_sw13"),
    ("mistral_sw13_decomposed", "mistral_sw13"),
    ("mistral_sw4", "mistral_sw4"),
];

fn imp(name: &str, family: &str) -> Pt2Import {
    let opts = Pt2Options {
        config: Some(fixture_dir(family).join("config.json")),
        ..Default::default()
    };
    import(&archive(name), &opts).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn inputs(family: &str) -> BTreeMap<String, HostTensor> {
    weft_frontends::read_safetensors(&fixture_dir(family).join("inputs.safetensors")).unwrap()
}

fn run64(
    g: &weft_ir::Graph,
    w: &BTreeMap<String, HostTensor>,
    inputs: &BTreeMap<String, HostTensor>,
) -> RunResult {
    let s = &inputs["input_ids"].shape;
    let o = RunOptions::new(Precision::F64)
        .with_grads(true)
        .bind("B", s[0] as i64)
        .bind("S", s[1] as i64);
    run(g, w, inputs, &o).unwrap()
}

#[test]
fn imported_archives_reproduce_pytorch() {
    let mut lines = Vec::new();
    for (name, family) in ARCHIVES {
        let im = imp(name, family);
        let ins = inputs(family);
        let reference =
            weft_frontends::read_safetensors(&fixture_dir(family).join("reference.safetensors"))
                .unwrap();
        let r = run64(&im.graph, &im.weights, &ins);
        assert_eq!(
            im.graph
                .outputs()
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>(),
            ["loss", "logits"]
        );
        let el = rel_err(&r.outputs["logits"], &reference["logits"]);
        let es = rel_err(&r.outputs["loss"], &reference["loss"]);
        let mut eg: f64 = 0.0;
        for (p, g) in &r.grads {
            let want = reference
                .get(&format!("grad.{p}"))
                .unwrap_or_else(|| panic!("{name}: no reference gradient for {p}"));
            eg = eg.max(rel_err(g, want));
        }
        assert_eq!(
            r.grads.len(),
            reference.keys().filter(|k| k.starts_with("grad.")).count(),
            "{name}: gradient count"
        );
        lines.push(format!(
            "{name:30} logits {el:.1e} loss {es:.1e} grads {eg:.1e}"
        ));
        assert!(el < 1e-5 && es < 1e-5, "{name}: logits {el} loss {es}");
        assert!(eg < 1e-4, "{name}: grads {eg}");
    }
    eprintln!("{}", lines.join("\n"));
}

/// The high-level ops the passes shard are all there, and nothing was left generic.
#[test]
fn imports_recognise_every_block() {
    for (name, family) in ARCHIVES {
        let im = imp(name, family);
        let count = |f: &dyn Fn(&Op) -> bool| {
            im.graph
                .nodes()
                .iter()
                .filter(|&&n| f(&im.graph.node(n).op))
                .count()
        };
        let moe = family.contains("mixtral") || family.contains("moe");
        assert_eq!(
            count(&|o| matches!(o, Op::Attention { causal: true, .. })),
            2,
            "{name}: attention\n{}",
            im.report
        );
        assert_eq!(
            count(&|o| matches!(o, Op::Rope { .. })),
            4,
            "{name}: rope\n{}",
            im.report
        );
        assert_eq!(
            count(&|o| matches!(o, Op::RopeTable { .. })),
            1,
            "{name}: rope_table"
        );
        assert_eq!(
            count(&|o| matches!(o, Op::MoeDispatch { .. })),
            if moe { 2 } else { 0 },
            "{name}: moe\n{}",
            im.report
        );
        assert_eq!(
            count(&|o| matches!(o, Op::Softmax { .. })) > 0,
            moe,
            "{name}: only routers keep a softmax"
        );
        assert!(
            im.report.unrecognised.is_empty(),
            "{name}: {:?}",
            im.report.unrecognised
        );
        // GQA stays inside the op: k and v keep 2 heads.
        for &n in im.graph.nodes() {
            if let Op::Attention { .. } = im.graph.node(n).op {
                let k = im.graph.node(n).operands[1];
                assert_eq!(im.graph.ty(k).shape[1], weft_ir::Dim::from(2), "{name}");
            }
        }
    }
}

/// The graph built from config.json and the imported one agree (same parameters,
/// same outputs and gradients in f64).
#[test]
fn import_matches_config_build() {
    for (name, family) in [
        ("llama", "llama"),
        ("qwen2_decomposed", "qwen2"),
        ("mixtral", "mixtral"),
        ("qwen3_moe_batched", "qwen3_moe"),
        ("phi3", "phi3"),
        ("olmo2", "olmo2"),
        ("granite", "granite"),
    ] {
        let im = imp(name, family);
        let dir = fixture_dir(family);
        let model = weft_frontends::load(dir.to_str().unwrap()).unwrap();
        let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors")).unwrap();
        let a: Vec<(String, String)> = im
            .graph
            .params()
            .iter()
            .map(|(n, v)| (n.clone(), im.graph.ty(*v).to_string()))
            .collect();
        let b: Vec<(String, String)> = model
            .graph
            .params()
            .iter()
            .map(|(n, v)| (n.clone(), model.graph.ty(*v).to_string()))
            .collect();
        let (mut sa, mut sb) = (a.clone(), b.clone());
        sa.sort();
        sb.sort();
        assert_eq!(sa, sb, "{name}: parameters");
        for (p, w) in &weights {
            assert_eq!(rel_err(&im.weights[p], w), 0.0, "{name}: weight {p}");
        }
        let ins = inputs(family);
        let (ri, rb) = (
            run64(&im.graph, &im.weights, &ins),
            run64(&model.graph, &weights, &ins),
        );
        for out in ["loss", "logits"] {
            let e = rel_err(&ri.outputs[out], &rb.outputs[out]);
            assert!(
                e < 1e-9,
                "{name}: {out} differs from the config build by {e}"
            );
        }
        for (p, g) in &rb.grads {
            let e = rel_err(&ri.grads[p], g);
            assert!(e < 1e-8, "{name}: grad {p} differs by {e}");
        }
    }
}

/// The imported archive's default pipeline on each mesh gives the unsharded program's
/// loss, logits and gradients (f64).
fn assert_meshes_match(name: &str, family: &str, meshes: &[&str]) {
    use weft_passes::{default_pipeline, run_pipeline, PassContext};
    let im = imp(name, family);
    let ins = inputs(family);
    let reference = run64(&im.graph, &im.weights, &ins);
    for mesh in meshes {
        let mesh = Mesh::parse(mesh).unwrap();
        let mut g = im.graph.clone();
        run_pipeline(
            &mut g,
            &PassContext::new(mesh.clone()),
            &default_pipeline(&mesh),
        )
        .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        let got = run64(&g, &im.weights, &ins);
        for out in ["loss", "logits"] {
            let e = rel_err(&got.outputs[out], &reference.outputs[out]);
            assert!(e < 1e-10, "{name} {mesh}: {out} rel err {e}");
        }
        for (p, want) in &reference.grads {
            let e = rel_err(&got.grads[p], want);
            assert!(e < 1e-9, "{name} {mesh}: grad {p} rel err {e}");
        }
    }
}

/// The default pipeline runs on imported graphs and keeps their meaning.
#[test]
fn passes_run_on_imported_graphs() {
    for (name, family) in [
        ("llama_decomposed", "llama"),
        ("llama_static", "llama"),
        ("qwen2_eager_dynbatch", "qwen2"),
        ("mixtral", "mixtral"),
        ("qwen3_moe_batched_decomposed", "qwen3_moe"),
    ] {
        assert_meshes_match(name, family, &["dp=2", "sp=2", "dp=2,sp=2"]);
    }
}

/// Tensor parallelism on imported OLMo 2 (q/k norms over the split projection) and
/// Granite (the logit scale before the vocabulary-parallel loss).
#[test]
fn tensor_parallel_on_imported_olmo2_and_granite() {
    for (name, family) in [("olmo2", "olmo2"), ("granite", "granite")] {
        assert_meshes_match(name, family, &["tp=2", "dp=2,tp=2", "sp=2,tp=2"]);
    }
}

#[test]
fn archive_without_weights_takes_them_from_safetensors() {
    let p = archive("llama_noweights");
    let e = import(
        &p,
        &Pt2Options {
            config: Some(fixture_dir("llama").join("config.json")),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Pt2Error::Weights { .. }), "{e}");
    assert!(e.to_string().contains("saved without weights"), "{e}");
    assert!(e.help().unwrap().contains("--weights"));
    let opts = Pt2Options {
        config: Some(fixture_dir("llama").join("config.json")),
        weights: Some(fixture_dir("llama").join("model.safetensors")),
        ..Default::default()
    };
    let im = import(&p, &opts).unwrap();
    let with = imp("llama", "llama");
    let ins = inputs("llama");
    let (a, b) = (
        run64(&im.graph, &im.weights, &ins),
        run64(&with.graph, &with.weights, &ins),
    );
    assert_eq!(rel_err(&a.outputs["loss"], &b.outputs["loss"]), 0.0);
}

#[test]
fn llama3_rope_needs_the_config() {
    let e = import(&archive("llama"), &Pt2Options::default()).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("rotary frequencies not recognised") && s.contains("--config"),
        "{s}"
    );
    assert!(
        s.contains("aten.cos.default") || s.contains("aten.sin.default"),
        "{s}"
    );
    // Default rope is fitted from the table alone.
    import(&archive("qwen2"), &Pt2Options::default()).unwrap();
}

#[test]
fn moe_load_balancing_loss_from_the_router_logits_outputs() {
    // Exported with output_router_logits: true, the program returns aux_loss, the logits
    // and the router logits; with the config (coefficient, top-k) the importer adds HF's
    // aux loss over the router logits and matches transformers' loss and gradients.
    let import_with = |archive_name: &str, config: Option<&str>| {
        let opts = Pt2Options {
            config: config.map(|c| fixture_dir(c).join("config.json")),
            ..Default::default()
        };
        import(&archive(archive_name), &opts)
    };
    let m = import_with("mixtral_aux_batched", Some("mixtral_aux")).unwrap();
    let outs: Vec<&str> = m.graph.outputs().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(outs, ["loss", "logits", "ce_loss", "aux_loss"]);
    let inputs = inputs("mixtral_aux");
    let reference =
        weft_frontends::read_safetensors(&fixture_dir("mixtral_aux").join("reference.safetensors"))
            .unwrap();
    let r = run64(&m.graph, &m.weights, &inputs);
    for out in ["loss", "ce_loss", "aux_loss", "logits"] {
        let e = rel_err(&r.outputs[out], &reference[out]);
        assert!(e < 1e-5, "{out}: {e:e}");
    }
    for (name, g) in &r.grads {
        let e = rel_err(g, &reference[&format!("grad.{name}")]);
        assert!(e < 1e-4, "grad {name}: {e:e}");
    }
    // Data-parallel with expert parallelism: the aux statistics all_reduced over dp.
    let mut g = m.graph.clone();
    let mesh = weft_ir::Mesh::parse("dp=2,ep=2").unwrap();
    weft_passes::run_pipeline(
        &mut g,
        &weft_passes::PassContext::new(mesh.clone()),
        &weft_passes::default_pipeline(&mesh),
    )
    .unwrap();
    let p = run64(&g, &m.weights, &inputs);
    for out in ["loss", "aux_loss"] {
        let e = rel_err(&p.outputs[out], &r.outputs[out]);
        assert!(e < 1e-10, "dp=2,ep=2 {out}: {e:e}");
    }

    // Without the config the coefficient is unknown: refused, naming --config.
    let s = import_with("mixtral_aux_batched", None)
        .unwrap_err()
        .to_string();
    assert!(s.contains("router logits") && s.contains("--config"), "{s}");
    // Archive and config disagree: refused either way.
    let s = import_with("mixtral_aux_batched", Some("mixtral"))
        .unwrap_err()
        .to_string();
    assert!(s.contains("sets it false"), "{s}");
    let s = import_with("mixtral_batched", Some("mixtral_aux"))
        .unwrap_err()
        .to_string();
    assert!(s.contains("returns no router logits"), "{s}");
}

/// A sliding-window mask (HF's `create_sliding_window_causal_mask`, window 13 >= the old
/// probe length 12, and 4) is recognised as such, in the SDPA program and in the
/// decomposed one, and never as a plain causal mask.
#[test]
fn sliding_window_masks_are_recognised() {
    for (name, family, w) in [
        ("mistral_sw13", "mistral_sw13", 13),
        ("mistral_sw13_decomposed", "mistral_sw13", 13),
        ("mistral_sw4", "mistral_sw4", 4),
    ] {
        let im = imp(name, family);
        let windows: Vec<Option<i64>> = im
            .graph
            .nodes()
            .iter()
            .filter_map(|&n| match &im.graph.node(n).op {
                Op::Attention { window, .. } => Some(*window),
                _ => None,
            })
            .collect();
        assert_eq!(windows, [Some(w), Some(w)], "{name}\n{}", im.report);
    }
}

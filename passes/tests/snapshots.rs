//! One snapshot per (pass, model, mesh), named `<pass>__<model>__<mesh>`: the unified
//! diff of the graph text the pass made (as `--print-changes` shows it) and the pass's
//! counters. Earlier passes run first; changing another pass only churns its own
//! snapshots and, through context lines, rarely these.
//!
//! `pipeline__<model>__<mesh>` is the whole compiled program, for review.

use weft_ir::*;
use weft_passes::*;

const MODELS: &[&str] = &["llama-tiny", "qwen3-tiny", "mixtral-tiny"];
const MESHES: &[(&str, &str)] = &[("sp2", "sp=2"), ("sp4", "sp=4"), ("dp2-sp2", "dp=2,sp=2")];

fn model(name: &str) -> Graph {
    weft_frontends::load(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .graph
}

fn snapshot(name: &str, text: &str) {
    insta::with_settings!({ prepend_module_to_snapshot => false, omit_expression => true }, {
        insta::assert_snapshot!(name, text);
    });
}

/// The diff and counters of `pass`, after the passes before it in the default pipeline.
fn pass_diff(model_name: &str, mesh: &str, pass: &str) -> Option<String> {
    let mut g = model(model_name);
    let cx = PassContext::new(Mesh::parse(mesh).unwrap());
    let pipeline = default_pipeline(&cx.mesh);
    let at = pipeline.iter().position(|p| *p == pass)?;
    run_pipeline(&mut g, &cx, &pipeline[..at]).unwrap();
    let ins = Instrumentation {
        print_changes: true,
        check_requires: false,
        ..Default::default()
    };
    let mut sink = Vec::new();
    let r = PassManager::new(ins)
        .run(&mut g, &cx, &[pass], &mut sink)
        .unwrap();
    let mut text = String::from_utf8(sink).unwrap();
    let p = &r.passes[0];
    text.push_str(&format!(
        "// changed={} nodes {} -> {} (+{} -{}), collectives +{}\n// {}\n",
        p.changed,
        p.nodes_before,
        p.nodes_after,
        p.nodes_added,
        p.nodes_removed,
        p.collectives_added,
        p.counters
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    Some(text)
}

fn all_meshes_for(pass: &str, models: &[&str]) {
    for m in models {
        for (tag, mesh) in MESHES {
            if let Some(text) = pass_diff(m, mesh, pass) {
                snapshot(&format!("{pass}__{m}__{tag}"), &text);
            }
        }
    }
}

#[test]
fn shard_inputs() {
    all_meshes_for("shard-inputs", &["llama-tiny"]);
}

#[test]
fn shard_seq() {
    all_meshes_for("shard-seq", MODELS);
}

#[test]
fn ulysses_attention() {
    all_meshes_for("ulysses-attention", MODELS);
}

#[test]
fn sp_loss() {
    all_meshes_for("sp-loss", &["llama-tiny"]);
}

#[test]
fn canonicalize() {
    all_meshes_for("canonicalize", &["llama-tiny"]);
}

#[test]
fn whole_programs() {
    for (tag, mesh) in MESHES {
        let mut g = model("llama-tiny");
        let cx = PassContext::new(Mesh::parse(mesh).unwrap());
        run_pipeline(&mut g, &cx, &default_pipeline(&cx.mesh)).unwrap();
        snapshot(&format!("pipeline__llama-tiny__{tag}"), &print(&g));
    }
}

//! Helpers shared by the pass snapshot tests: presets, insta settings, running a pipeline
//! up to a pass, and the diff-plus-counters text each pass snapshot pins.
#![allow(dead_code)]

use weft_ir::*;
use weft_passes::*;

/// A frontends preset's graph.
pub fn preset(name: &str) -> Graph {
    weft_frontends::load(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .graph
}

/// An insta snapshot named `name` in passes/tests/snapshots (no module prefix, no
/// expression header).
pub fn snapshot(name: &str, text: &str) {
    insta::with_settings!({ prepend_module_to_snapshot => false, omit_expression => true, snapshot_path => "../snapshots" }, {
        insta::assert_snapshot!(name, text);
    });
}

/// The preset on `mesh` after the default pipeline's passes before `pass`; None where the
/// mesh's pipeline does not run `pass`.
pub fn before_pass(model: &str, mesh: &str, pass: &str) -> Option<(Graph, PassContext)> {
    let mut g = preset(model);
    let cx = PassContext::new(Mesh::parse(mesh).unwrap());
    let pipeline = default_pipeline(&cx.mesh);
    let at = pipeline.iter().position(|p| *p == pass)?;
    run_pipeline(&mut g, &cx, &pipeline[..at]).unwrap();
    Some((g, cx))
}

/// Runs `pass` on `g` and returns the unified diff it made (as `--print-changes` shows it)
/// followed by its node/collective counts and counters.
pub fn diff_of(g: &mut Graph, cx: &PassContext, pass: &str) -> String {
    let ins = Instrumentation {
        print_changes: true,
        check_requires: false,
        ..Default::default()
    };
    let mut sink = Vec::new();
    let r = PassManager::new(ins)
        .run(g, cx, &[pass], &mut sink)
        .unwrap();
    let mut text = String::from_utf8(sink).unwrap();
    let p = &r.passes[0];
    let counters: Vec<String> = p.counters.iter().map(|(k, v)| format!("{k}={v}")).collect();
    text.push_str(&format!(
        "// changed={} nodes {} -> {} (+{} -{}), collectives +{}\n// {}\n",
        p.changed,
        p.nodes_before,
        p.nodes_after,
        p.nodes_added,
        p.nodes_removed,
        p.collectives_added,
        counters.join(" ")
    ));
    text
}

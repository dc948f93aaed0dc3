//! The pass manager's instrumentation: printing, diffs, statistics, stop-after, bisect.

mod common;

use weft_ir::*;
use weft_passes::*;

fn cx(mesh: &str) -> PassContext {
    PassContext::new(Mesh::parse(mesh).unwrap())
}

fn run_with(ins: Instrumentation, mesh: &str) -> (Graph, RunReport, String) {
    let mut g = common::llama_tiny();
    let cx = cx(mesh);
    let mut sink = Vec::new();
    let r = PassManager::new(ins)
        .run(&mut g, &cx, &default_pipeline(&cx.mesh), &mut sink)
        .unwrap();
    (g, r, String::from_utf8(sink).unwrap())
}

#[test]
fn stats_table_and_json() {
    let (_, r, out) = run_with(
        Instrumentation {
            stats: true,
            stats_times: false,
            ..Default::default()
        },
        "sp=4",
    );
    insta::assert_snapshot!("stats__llama-tiny__sp4", out);
    let json = r.clone().without_times().to_json();
    insta::assert_snapshot!("stats_json__llama-tiny__sp4", json);
    // With times the table has a time column.
    assert!(r.table(true).lines().next().unwrap().contains("  time  "));
    assert_eq!(
        r.passes.iter().map(|p| p.collectives_added).sum::<usize>(),
        2 + 8 + 8 + 2
    );
}

#[test]
fn print_before_and_after_write_parseable_dumps() {
    let ins = Instrumentation {
        print_before: PassFilter::parse("ulysses-attention").unwrap(),
        print_after: PassFilter::parse("sp-loss").unwrap(),
        ..Default::default()
    };
    let (g, _, out) = run_with(ins, "sp=2");
    let headers: Vec<&str> = out.lines().filter(|l| l.starts_with("// -----")).collect();
    assert_eq!(
        headers,
        [
            "// ----- IR before ulysses-attention ----- //",
            "// ----- IR after sp-loss ----- //"
        ]
    );
    // Each dump is a graph the reader parses back (headers are comments).
    let after = out
        .split("// ----- IR after sp-loss ----- //\n")
        .nth(1)
        .unwrap();
    assert_eq!(
        parse(after).unwrap(),
        g,
        "canonicalize changes nothing after sp-loss here"
    );
    let before = out.split("// ----- IR after sp-loss").next().unwrap();
    verify(&parse(before).unwrap()).unwrap();
}

#[test]
fn print_after_all() {
    let ins = Instrumentation {
        print_after: PassFilter::All,
        ..Default::default()
    };
    let (_, _, out) = run_with(ins, "dp=2");
    let headers: Vec<&str> = out.lines().filter(|l| l.starts_with("// -----")).collect();
    assert_eq!(
        headers,
        [
            "// ----- IR after shard-inputs ----- //",
            "// ----- IR after shard-seq ----- //",
            "// ----- IR after sp-loss ----- //",
            "// ----- IR after canonicalize ----- //"
        ]
    );
}

#[test]
fn print_changes_diffs_only_passes_that_changed_something() {
    let ins = Instrumentation {
        print_changes: true,
        ..Default::default()
    };
    let (_, r, out) = run_with(ins, "sp=2");
    let headers: Vec<&str> = out.lines().filter(|l| l.starts_with("// -----")).collect();
    assert_eq!(
        headers,
        [
            "// ----- IR changes of shard-inputs ----- //",
            "// ----- IR changes of shard-seq ----- //",
            "// ----- IR changes of ulysses-attention ----- //",
            "// ----- IR changes of sp-loss ----- //",
        ]
    );
    assert!(!r.passes.last().unwrap().changed);
    assert!(out.contains("--- before ulysses-attention\n+++ after ulysses-attention\n@@ "));
}

#[test]
fn stop_after_and_bisect() {
    let ins = Instrumentation {
        stop_after: Some("shard-seq".into()),
        ..Default::default()
    };
    let (g, r, _) = run_with(ins, "sp=2");
    assert_eq!(r.stopped_after.as_deref(), Some("shard-seq"));
    assert_eq!(r.passes.len(), 2);
    // After shard-seq attention still reads gathered q/k/v.
    assert!(g
        .nodes()
        .iter()
        .any(|&n| matches!(g.node(n).op, Op::AllGather { .. })));

    let ins = Instrumentation {
        bisect_limit: Some(3),
        ..Default::default()
    };
    let (_, r, _) = run_with(ins, "sp=2");
    assert_eq!(r.passes.len(), 3);
    assert_eq!(r.stopped_after.as_deref(), Some("ulysses-attention"));
}

#[test]
fn pass_filter_parsing() {
    assert_eq!(PassFilter::parse("all").unwrap(), PassFilter::All);
    assert_eq!(
        PassFilter::parse("shard-seq, sp-loss").unwrap(),
        PassFilter::Only(vec!["shard-seq".into(), "sp-loss".into()])
    );
    assert!(matches!(
        PassFilter::parse("shard-seq,bogus"),
        Err(PassError::UnknownPass { .. })
    ));
}

#[test]
fn registry_and_default_pipelines_are_printable() {
    let mut text = String::new();
    for p in passes() {
        let req = p.requires().join(", ");
        text.push_str(&format!(
            "{:<18} needs [{}] after [{}]\n    {}\n",
            p.name(),
            p.mesh_axes(),
            req,
            p.summary()
        ));
    }
    for mesh in ["", "sp=4", "dp=2", "dp=2,sp=4", "tp=2"] {
        let m = Mesh::parse(mesh).unwrap();
        text.push_str(&format!(
            "\nmesh `{mesh}`:\n{}",
            default_pipeline_explained(&m)
        ));
        assert_eq!(default_pipeline(&m), default_pipeline_explained(&m).names());
        check_pipeline(&default_pipeline(&m)).unwrap();
    }
    insta::assert_snapshot!("registry_and_pipelines", text);
}

#[test]
fn verify_is_on_by_default_in_tests() {
    assert!(Instrumentation::default().verify_each);
}

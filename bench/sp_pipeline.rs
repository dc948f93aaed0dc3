//! Times the default sequence-parallel pipelines over Llama 3.1 405B (126 layers,
//! 128 q heads, 8 kv heads): graph build, each pass, and the plan-time size check.
//! The best of several runs is reported per pass.
//!
//! `cargo bench -p weft-passes --bench sp_pipeline [-- RUNS]`

use std::time::{Duration, Instant};
use weft_ir::{Bindings, Mesh};
use weft_passes::{
    check_bindings, default_pipeline, Instrumentation, PassContext, PassManager, RunReport,
};

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    let t = Instant::now();
    let model = weft_frontends::load("llama3.1-405b").expect("preset llama3.1-405b");
    let build = t.elapsed();
    println!(
        "llama3.1-405b: {} nodes, built in {:.2} ms",
        model.graph.node_count(),
        ms(build)
    );
    for mesh in ["sp=8", "sp=16", "dp=4,sp=8", "sp=64"] {
        let cx = PassContext::new(Mesh::parse(mesh).unwrap());
        let pipeline = default_pipeline(&cx.mesh);
        let mut best: Option<(Duration, RunReport)> = None;
        let mut best_check = Duration::MAX;
        for verify_each in [false] {
            for _ in 0..runs {
                let mut g = model.graph.clone();
                let pm = PassManager::new(Instrumentation {
                    verify_each,
                    ..Default::default()
                });
                let t = Instant::now();
                let r = pm
                    .run(&mut g, &cx, &pipeline, &mut std::io::sink())
                    .expect("pipeline");
                let dt = t.elapsed();
                if best.as_ref().is_none_or(|(b, _)| dt < *b) {
                    best = Some((dt, r));
                }
                let t = Instant::now();
                check_bindings(&g, &Bindings::new().with("B", 8).with("S", 131072)).expect("sizes");
                best_check = best_check.min(t.elapsed());
            }
        }
        let (dt, r) = best.unwrap();
        println!(
            "\nmesh {mesh}: pipeline {:.2} ms (best of {runs}, no verify), check_bindings {:.2} ms",
            ms(dt),
            ms(best_check)
        );
        print!("{}", r.table(true));
    }
    // Verification cost, once.
    let cx = PassContext::new(Mesh::parse("sp=8").unwrap());
    let mut g = model.graph.clone();
    let pm = PassManager::new(Instrumentation {
        verify_each: true,
        ..Default::default()
    });
    let t = Instant::now();
    pm.run(
        &mut g,
        &cx,
        &default_pipeline(&cx.mesh),
        &mut std::io::sink(),
    )
    .expect("pipeline");
    println!("\nmesh sp=8 with verify-each: {:.2} ms", ms(t.elapsed()));
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

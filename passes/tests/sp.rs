//! Sequence (and data) parallel pipelines on hand-built llama graphs: what gets
//! inserted, how many, and that passes are idempotent and round-trip through text.

mod common;

use common::Config;
use weft_ir::*;
use weft_passes::*;

fn compile(g: &mut Graph, mesh: &str) -> RunReport {
    let cx = PassContext::new(Mesh::parse(mesh).unwrap());
    run_pipeline(g, &cx, &default_pipeline(&cx.mesh)).unwrap_or_else(|e| panic!("{mesh}: {e}"))
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.nodes().iter().filter(|&&n| f(&g.node(n).op)).count()
}

fn a2a(g: &Graph) -> usize {
    count(g, |op| matches!(op, Op::AllToAll { .. }))
}

#[test]
fn four_all_to_alls_per_attention_layer() {
    for layers in [1, 2, 3, 5] {
        for mesh in ["sp=2", "sp=4", "dp=2,sp=2"] {
            let mut g = common::build(&Config {
                layers,
                ..Config::llama_tiny()
            });
            let r = compile(&mut g, mesh);
            assert_eq!(a2a(&g), 4 * layers, "{layers} layers, {mesh}");
            assert_eq!(r.counter("attention_layers"), layers as u64);
            // No gather or slice of shard-seq survives: attention and loss were rewritten.
            assert_eq!(
                count(&g, |op| matches!(op, Op::AllGather { .. })),
                0,
                "{mesh}"
            );
            verify(&g).unwrap();
        }
    }
}

#[test]
fn loss_reductions_and_output_splits() {
    let mut g = common::llama_tiny();
    compile(&mut g, "sp=2");
    let reduces: Vec<String> = g
        .nodes()
        .iter()
        .filter_map(|&n| match &g.node(n).op {
            Op::AllReduce { axis, op } => Some(format!("{axis}:{}", op.keyword())),
            _ => None,
        })
        .collect();
    assert_eq!(reduces, ["sp:sum", "sp:sum"]);
    assert_eq!(g.output_split("logits"), [(1, "sp".to_string())]);
    assert!(g.output_split("loss").is_empty());

    let mut g = common::llama_tiny();
    compile(&mut g, "dp=2,sp=2");
    assert_eq!(count(&g, |op| matches!(op, Op::AllReduce { .. })), 4);
    assert_eq!(
        g.output_split("logits"),
        [(0, "dp".to_string()), (1, "sp".to_string())]
    );
    assert_eq!(
        g.ty(g.output("logits").unwrap()).to_string(),
        "f32[B/dp, S/sp, 128]"
    );
}

#[test]
fn dp_alone_shards_the_batch_without_all_to_all() {
    let mut g = common::llama_tiny();
    let r = compile(&mut g, "dp=2");
    assert_eq!(
        r.passes.iter().map(|p| p.pass.as_str()).collect::<Vec<_>>(),
        ["shard-inputs", "shard-seq", "sp-loss", "canonicalize"]
    );
    assert_eq!(a2a(&g), 0);
    assert_eq!(
        count(
            &g,
            |op| matches!(op, Op::AllReduce { axis, .. } if axis == "dp")
        ),
        2
    );
    assert_eq!(g.output_split("logits"), [(0, "dp".to_string())]);
    // Positions are not touched without sp.
    assert!(print(&g).contains("arange {start=0}"));
}

#[test]
fn one_rank_mesh_only_canonicalizes() {
    let mut g = common::llama_tiny();
    let before = print(&g);
    let r = compile(&mut g, "");
    assert_eq!(r.passes.len(), 1);
    assert!(!r.passes[0].changed);
    assert_eq!(print(&g), before);
}

#[test]
fn gqa_kv_heads_fewer_than_sp_are_repeated() {
    // 4 q heads, 2 kv heads, sp=4: each kv head repeated twice before the all_to_all.
    let mut g = common::llama_tiny();
    let r = compile(&mut g, "sp=4");
    assert_eq!(r.counter("kv_heads_repeated"), 4); // k and v, two layers
    let text = print(&g);
    assert!(text.contains("f32[B, 2, 2, S/sp, 8] = expand"), "{text}");
    assert!(text.contains("f32[B, 4/sp, S, 8] = attention"), "{text}");
    // 1 kv head, sp=2.
    let mut g = common::build(&Config {
        kv_heads: 1,
        ..Config::llama_tiny()
    });
    let r = compile(&mut g, "sp=2");
    assert_eq!(r.counter("kv_heads_repeated"), 4);
    assert!(print(&g).contains("f32[B, 1, 2, S/sp, 8] = expand"));
}

#[test]
fn every_inserted_collective_says_why() {
    for mesh in ["sp=4", "dp=2,sp=2"] {
        let mut g = common::llama_tiny();
        compile(&mut g, mesh);
        for &n in g.nodes() {
            let d = g.node(n);
            if d.op.is_collective() {
                let p = d
                    .meta
                    .provenance
                    .as_ref()
                    .unwrap_or_else(|| panic!("{} has no provenance", g.describe(n)));
                assert!(
                    ["ulysses-attention", "sp-loss"].contains(&p.pass.as_str()),
                    "{}",
                    p.pass
                );
                if matches!(d.op, Op::AllToAll { .. }) {
                    assert!(p.reason.contains("bytes per rank"), "{}", p.reason);
                }
            }
        }
    }
}

#[test]
fn passes_are_idempotent() {
    for mesh in ["sp=2", "sp=4", "dp=2,sp=2", "dp=2"] {
        let mut g = common::llama_tiny();
        compile(&mut g, mesh);
        let text = print(&g);
        let cx = PassContext::new(Mesh::parse(mesh).unwrap());
        for pass in default_pipeline(&cx.mesh) {
            let r = lookup(pass).unwrap().run(&mut g, &cx).unwrap();
            assert!(!r.changed, "{pass} changed the graph again on {mesh}");
            assert_eq!(print(&g), text, "{pass} on {mesh}");
        }
    }
}

#[test]
fn compiled_programs_round_trip_through_text() {
    for mesh in ["sp=2", "sp=4", "dp=2,sp=2"] {
        let mut g = common::llama_tiny();
        compile(&mut g, mesh);
        let text = print(&g);
        let back = parse(&text).unwrap();
        assert_eq!(back, g, "{mesh}");
        verify(&back).unwrap();
    }
}

#[test]
fn attention_mask_stays_whole_along_the_sequence() {
    let cfg = Config {
        mask: true,
        ..Config::llama_tiny()
    };
    let mut g = common::build(&cfg);
    compile(&mut g, "sp=2");
    let mask = g
        .inputs()
        .into_iter()
        .find(|(_, r, _)| *r == Role::AttentionMask)
        .unwrap()
        .2;
    let uses = g.uses()[mask.0 as usize].clone();
    assert!(
        uses.iter()
            .all(|&(n, _)| matches!(g.node(n).op, Op::Attention { .. })),
        "the mask reaches attention unsliced"
    );
    assert_eq!(a2a(&g), 8);

    let mut g = common::build(&cfg);
    compile(&mut g, "dp=2,sp=2");
    let mask = g
        .inputs()
        .into_iter()
        .find(|(_, r, _)| *r == Role::AttentionMask)
        .unwrap()
        .2;
    let uses = g.uses()[mask.0 as usize].clone();
    let [(slice, 0)] = uses.as_slice() else {
        panic!("{uses:?}")
    };
    assert!(
        matches!(&g.node(*slice).op, Op::Slice { dim: 0, .. }),
        "batch only"
    );
    assert_eq!(
        g.ty(g.node(*slice).results[0]).to_string(),
        "bool[B/dp, 1, S, S]"
    );
}

#[test]
fn mean_cross_entropy_becomes_global_sum_over_global_count() {
    let mut g = common::build(&Config {
        mean_loss: true,
        ..Config::llama_tiny()
    });
    let r = compile(&mut g, "sp=2");
    assert_eq!(r.counter("mean_rewritten"), 1);
    let loss = g.output("loss").unwrap();
    let d = g.node(g.def(loss));
    assert!(matches!(d.op, Op::Div {}));
    for v in &d.operands {
        assert!(matches!(g.op_of(*v), Op::AllReduce { .. }));
    }
}

#[test]
fn labels_are_shifted_before_they_are_sliced() {
    let mut g = common::llama_tiny();
    compile(&mut g, "sp=2");
    let labels = g
        .inputs()
        .into_iter()
        .find(|(_, r, _)| *r == Role::Labels)
        .unwrap()
        .2;
    let uses = g.uses()[labels.0 as usize].clone();
    let [(shift, 0)] = uses.as_slice() else {
        panic!()
    };
    assert!(matches!(g.node(*shift).op, Op::ShiftLabels { .. }));
    let shifted = g.node(*shift).results[0];
    let uses = g.uses()[shifted.0 as usize].clone();
    assert!(matches!(g.node(uses[0].0).op, Op::Slice { dim: 1, .. }));
}

#[test]
fn qk_norm_models_shard_too() {
    let mut g = common::build(&Config {
        qk_norm: true,
        ..Config::llama_tiny()
    });
    compile(&mut g, "sp=4");
    assert_eq!(a2a(&g), 8);
}

#[test]
fn check_bindings_accepts_every_rank() {
    let mut g = common::llama_tiny();
    compile(&mut g, "dp=2,sp=4");
    assert_eq!(
        check_bindings(&g, &Bindings::new().with("B", 4).with("S", 32)),
        Ok(())
    );
}

#[test]
fn position_ids_inputs_are_sliced_like_input_ids() {
    let mut g = common::build(&Config {
        position_ids: true,
        ..Config::llama_tiny()
    });
    let r = compile(&mut g, "dp=2,sp=2");
    assert_eq!(r.counter("positions_rewritten"), 0);
    assert_eq!(r.counter("inputs_sliced"), 3);
    let pos = g
        .inputs()
        .into_iter()
        .find(|(_, r, _)| *r == Role::PositionIds)
        .unwrap()
        .2;
    let uses = g.uses()[pos.0 as usize].clone();
    let [(slice, 0)] = uses.as_slice() else {
        panic!()
    };
    let rope_in = g.uses()[g.node(*slice).results[0].0 as usize][0].0;
    assert_eq!(
        g.ty(g.node(rope_in).results[0]).to_string(),
        "i64[B/dp, S/sp]"
    );
    let table = g
        .nodes()
        .iter()
        .copied()
        .find(|&n| matches!(g.node(n).op, Op::RopeTable { .. }))
        .unwrap();
    assert_eq!(
        g.ty(g.node(table).results[0]).to_string(),
        "f32[B/dp, S/sp, 8]"
    );
    assert_eq!(a2a(&g), 8);
}

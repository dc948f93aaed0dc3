//! The training transforms' node markers (`[backward of %12]`, `[recompute of %12]`,
//! `[micro-batch 2]`) print in the node's comment and parse back to an equal graph.

use weft_ir::*;

#[test]
fn derived_and_micro_batch_tags_round_trip() {
    let mut g = Graph::new("t");
    let f = |s: &[i64]| TensorType::new(DType::F32, s.iter().map(|&d| Dim::from(d)).collect());
    g.set_scope(Some("model.layers.0.mlp"));
    let x = g
        .add(
            Op::Param {
                name: "x".into(),
                ty: f(&[2, 3]),
            },
            &[],
        )
        .unwrap();
    let y = g.add(Op::Silu {}, &[x]).unwrap();
    let meta = |kind, mb, prov: bool| NodeMeta {
        source: Some("model.layers.0.mlp".into()),
        provenance: prov.then(|| Provenance {
            pass: "autodiff".into(),
            reason: "silu".into(),
        }),
        derived: Some(Derived { kind, of: y }),
        micro_batch: mb,
    };
    let dy = g
        .insert_with(
            At::End,
            Op::Neg {},
            &[y],
            meta(DerivedKind::Backward, Some(1), true),
        )
        .unwrap()[0];
    let r = g
        .insert_with(
            At::End,
            Op::Silu {},
            &[x],
            meta(DerivedKind::Recompute, None, false),
        )
        .unwrap()[0];
    // No source: tags alone.
    let bare = NodeMeta {
        micro_batch: Some(0),
        ..Default::default()
    };
    let z = g.insert_with(At::End, Op::Add {}, &[dy, r], bare).unwrap()[0];
    g.set_output("z", z);
    let text = print(&g);
    assert!(
        text.contains("# model.layers.0.mlp [backward of %1] [micro-batch 1] <- autodiff: silu"),
        "{text}"
    );
    assert!(
        text.contains("# model.layers.0.mlp [recompute of %1]\n"),
        "{text}"
    );
    assert!(text.contains("  # [micro-batch 0]\n"), "{text}");
    let back = parse(&text).unwrap();
    assert_eq!(back, g);
    assert_eq!(print(&back), text);
}

#[test]
fn unknown_bracket_text_stays_in_the_source() {
    let text =
        "graph \"t\"\n%0: f32[2] = param {name=\"x\"}  # model.layers[0] [frozen]\nreturn x=%0\n";
    let g = parse(text).unwrap();
    let n = g.def(Value(0));
    assert_eq!(
        g.node(n).meta.source.as_deref(),
        Some("model.layers[0] [frozen]")
    );
    assert_eq!(g.node(n).meta.derived, None);
    assert_eq!(print(&g), text);
}

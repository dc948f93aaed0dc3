//! Verifier and parser errors: each kind of error is caught and located.

use weft_ir::*;

fn tiny() -> Graph {
    let mut g = Graph::new("tiny");
    g.set_scope(Some("model.embed_tokens"));
    let ids = g
        .add(
            Op::Input {
                name: "input_ids".into(),
                role: Role::InputIds,
                ty: TensorType::new(DType::I64, vec![Dim::sym("B"), Dim::sym("S")]),
            },
            &[],
        )
        .unwrap();
    let w = g
        .add(
            Op::Param {
                name: "embed.weight".into(),
                ty: TensorType::new(DType::F32, vec![16.into(), 8.into()]),
            },
            &[],
        )
        .unwrap();
    let x = g
        .add(Op::Embedding { padding_idx: None }, &[ids, w])
        .unwrap();
    g.set_scope(Some("model.mlp"));
    let up = g
        .add(
            Op::Param {
                name: "up.weight".into(),
                ty: TensorType::new(DType::F32, vec![4.into(), 8.into()]),
            },
            &[],
        )
        .unwrap();
    let y = g.add(Op::Linear {}, &[x, up]).unwrap();
    let z = g.add(Op::Silu {}, &[y]).unwrap();
    g.set_output("out", z);
    g
}

#[test]
fn round_trip_keeps_ids_names_and_provenance() {
    let mut g = tiny();
    g.mesh = Mesh::parse("sp=2").unwrap();
    let out = g.output("out").unwrap();
    g.set_provenance(Some(Provenance {
        pass: "test-pass".into(),
        reason: "gather: sequence".into(),
    }));
    let gathered = g
        .add(
            Op::AllGather {
                axis: "sp".into(),
                dim: 1,
            },
            &[out],
        )
        .unwrap();
    g.set_output("gathered", gathered);
    g.add_output_split("out", 1, "sp");
    let text = print(&g);
    let back = parse(&text).unwrap();
    assert_eq!(back, g);
    assert_eq!(print(&back), text);
    verify(&back).unwrap();
    insta::assert_snapshot!(text);
}

#[test]
fn build_errors_name_the_scope() {
    let mut g = tiny();
    let x = g.output("out").unwrap();
    g.set_scope(Some("model.layers.3.mlp"));
    let bad = g
        .add(
            Op::Param {
                name: "w".into(),
                ty: TensorType::new(DType::F32, vec![4.into(), 5.into()]),
            },
            &[],
        )
        .unwrap();
    let e = g.add(Op::Linear {}, &[x, bad]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "linear in model.layers.3.mlp: x has 4 input features but w f32[4, 5] expects 5"
    );
}

fn errors_of(g: &Graph) -> Vec<String> {
    verify(g)
        .unwrap_err()
        .errors
        .into_iter()
        .map(|e| format!("{}: {}", e.location, e.message))
        .collect()
}

#[test]
fn type_mismatch_is_located_and_annotated() {
    let text = print(&tiny()).replace("%5: f32[B, S, 4] = silu", "%5: f32[B, S, 5] = silu");
    let g = parse(&text).unwrap();
    let report = verify(&g).unwrap_err();
    assert_eq!(report.errors.len(), 1);
    assert_eq!(
        format!(
            "{}: {}",
            report.errors[0].location, report.errors[0].message
        ),
        "node %5 (model.mlp): result 0 (%5) has type f32[B, S, 5] but `silu` makes f32[B, S, 4]"
    );
    insta::assert_snapshot!(report.to_string());
}

#[test]
fn wrong_operand_count() {
    let text = print(&tiny()).replace("= silu %4", "= silu %4, %3");
    let errs = errors_of(&parse(&text).unwrap());
    assert_eq!(
        errs,
        vec!["node %5 (model.mlp): `silu` takes 1 operand(s) (x), got 2"]
    );
}

#[test]
fn dangling_and_cyclic_uses() {
    let mut g = tiny();
    let silu = g.def(g.output("out").unwrap());
    let lin = g.nodes()[g.position(silu).unwrap() - 1];
    // A use before its definition: move silu before linear.
    let mut order = g.nodes().to_vec();
    let (i, j) = (g.position(lin).unwrap(), g.position(silu).unwrap());
    order.swap(i, j);
    g.set_order(order);
    assert_eq!(errors_of(&g), vec!["node %5 (model.mlp): operand 0 (%4) is used before its definition (cycle or misordered node)"]);

    let mut g = tiny();
    let lin = g.def(Value(4));
    g.remove_node(lin);
    assert_eq!(
        errors_of(&g),
        vec!["node %5 (model.mlp): operand 0 (%4) is not defined (dangling use)"]
    );
}

#[test]
fn collective_on_unknown_axis() {
    let mut g = tiny();
    g.mesh = Mesh::parse("dp=2").unwrap();
    let x = g.output("out").unwrap();
    let y = g
        .add(
            Op::AllReduce {
                axis: "sp".into(),
                op: ReduceOp::Sum,
            },
            &[x],
        )
        .unwrap();
    g.set_output("out", y);
    assert_eq!(
        errors_of(&g),
        vec!["node %6 (model.mlp): collective on unknown mesh axis `sp` (mesh is dp=2)"]
    );
}

#[test]
fn dims_that_do_not_divide() {
    let mut g = tiny();
    g.mesh = Mesh::parse("tp=3").unwrap();
    let x = g.output("out").unwrap();
    let y = g
        .add(
            Op::AllToAll {
                axis: "tp".into(),
                scatter_dim: 2,
                gather_dim: 1,
            },
            &[x],
        )
        .unwrap();
    g.set_output("out", y);
    assert_eq!(
        errors_of(&g),
        vec![
            "node %6 (model.mlp): dim 2 of %6: `4/tp` does not divide evenly (4/3 with mesh tp=3)"
        ]
    );
}

#[test]
fn duplicate_parameter_and_bad_output() {
    let text = print(&tiny()).replace("\"up.weight\"", "\"embed.weight\"");
    let g = parse(&text).unwrap();
    assert_eq!(
        errors_of(&g),
        vec!["node %3 (model.mlp): parameter `embed.weight` is already defined by node %1 (model.embed_tokens)"]
    );
}

fn parse_err(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

#[test]
fn parse_errors_have_line_and_column() {
    let good = print(&tiny());
    let bad = good.replace("= silu", "= swish");
    assert_eq!(parse_err(&bad), "line 7, column 20: unknown op `swish`");
    let bad = good.replace("%5: f32[B, S, 4]", "%5: f32[B, S, 4$]");
    assert_eq!(
        parse_err(&bad),
        "line 7, column 16: unexpected `$` in dim `4$`"
    );
    let bad = good.replace("silu %4", "silu %9");
    assert_eq!(
        parse_err(&bad),
        "line 7, column 25: %9 is used before it is defined"
    );
    let bad = good.replace("{name=\"up.weight\"}", "{nme=\"up.weight\"}");
    assert!(
        parse_err(&bad)
            .starts_with("line 5, column 24: `param` has no attribute `nme` (it has: name, ty)"),
        "{}",
        parse_err(&bad)
    );
    let bad = good.replace("return out=%5", "return out=%42");
    assert_eq!(
        parse_err(&bad),
        "line 8, column 8: output `out` uses undefined value %42"
    );
    assert_eq!(
        parse_err("%0: f32[] = full {value=1.0}\n"),
        "line 1, column 1: expected `graph \"name\"` first"
    );
    let no_ret = good.replace("return out=%5\n", "");
    assert_eq!(
        parse_err(&no_ret),
        "line 7, column 1: missing `return` line"
    );
    let dup = good.replace("%5: f32", "%4: f32");
    assert_eq!(
        parse_err(&dup),
        "line 7, column 1: value %4 is defined twice"
    );
}

#[test]
fn param_partitions_round_trip_and_verify() {
    let mut g = Graph::new("tp");
    g.mesh = Mesh::parse("tp=2").unwrap();
    let w = g
        .add(
            Op::Param {
                name: "w".into(),
                ty: TensorType::new(DType::F32, vec![Dim::per_rank("tp", vec![3, 2]), 4.into()]),
            },
            &[],
        )
        .unwrap();
    g.set_output("w", w);
    g.add_param_partition("w", Partition::simple("column", "tp", 0, vec![3, 2]));
    let text = print(&g);
    assert!(
        text.contains("partition \"w\" column tp dim=0 [3 2]"),
        "{text}"
    );
    let back = parse(&text).unwrap();
    assert_eq!(back, g);
    verify(&back).unwrap();
    let wrong = parse(&text.replace("dim=0 [3 2]", "dim=0 [2 3]")).unwrap();
    assert_eq!(
        errors_of(&wrong),
        vec![
            "partition of `w`: rank 0 of `tp` holds 2 along dim 0 but the parameter's type f32[tp?[3 2], 4] says 3",
            "partition of `w`: rank 1 of `tp` holds 3 along dim 0 but the parameter's type f32[tp?[3 2], 4] says 2"
        ]
    );
}

/// Every attention attribute and optional operand prints and parses back; a plain
/// attention prints no window, softcap or flags; bad combinations are refused at the node.
#[test]
fn attention_attributes_round_trip_and_are_checked() {
    let text = "graph \"a\"\n%0: f32[2, 4, 9, 8] = param {name=\"q\"}\n%1: f32[2, 2, 9, 8] = param {name=\"k\"}\n%2: f32[2, 2, 9, 6] = param {name=\"v\"}\n%3: f32[4] = param {name=\"sinks\"}\n%4: bool[2, 1, 9, 9] = input {name=\"m\", role=other}\n%5: f32[2, 4, 9, 6], %6: f32[2, 4, 9] = attention %0, %1, %2, %4, %3 {causal=true, scale=0.35, window=4, softcap=30.0, sinks=true, lse=true}\n%7: f32[2, 4, 9, 6] = attention %0, %1, %2 {causal=true, scale=0.35}\n%8: f32[2, 4, 9, 6] = param {name=\"do\"}\n%9: f32[2, 4, 9] = param {name=\"dl\"}\n%10: f32[2, 4, 9, 8], %11: f32[2, 2, 9, 8], %12: f32[2, 2, 9, 6], %13: f32[4] = attention_grad %0, %1, %2, %5, %8, %4, %3, %9 {causal=true, scale=0.35, window=4, softcap=30.0, sinks=true, lse=true}\nreturn o=%5, l=%6, p=%7, dq=%10, dk=%11, dv=%12, ds=%13\n";
    let g = parse(text).unwrap_or_else(|e| panic!("{e}"));
    verify(&g).unwrap_or_else(|r| panic!("{r}"));
    let printed = print(&g);
    assert_eq!(parse(&printed).unwrap(), g);
    assert!(
        printed.contains("{causal=true, scale=0.35, window=4, softcap=30.0, sinks=true, lse=true}"),
        "{printed}"
    );
    assert!(
        printed.contains("attention %0, %1, %2 {causal=true, scale=0.35}\n"),
        "{printed}"
    );
    let slots = Op::from_text(
        "attention_grad",
        &[
            ("causal".into(), "true".into()),
            ("scale".into(), "1.0".into()),
            ("lse".into(), "true".into()),
        ],
    )
    .unwrap()
    .attention_operands(7)
    .unwrap()
    .unwrap();
    assert_eq!(
        (slots.mask, slots.sinks, slots.dlse),
        (Some(5), None, Some(6))
    );
    for (attrs, why) in [
        ("{causal=false, scale=0.35, window=4}", "needs causal=true"),
        ("{causal=true, scale=0.35, window=0}", "at least 1"),
        (
            "{causal=true, scale=0.35, softcap=-1.0}",
            "softcap must be a positive",
        ),
    ] {
        let bad = format!("graph \"a\"\n%0: f32[2, 4, 9, 8] = param {{name=\"q\"}}\n%1: f32[2, 2, 9, 8] = param {{name=\"k\"}}\n%2: f32[2, 4, 9, 8] = attention %0, %1, %1 {attrs}\nreturn o=%2\n");
        let e = errors_of(&parse(&bad).unwrap()).join("\n");
        assert!(e.contains(why), "{attrs}: {e}");
    }
    // sinks=true without the operand (or the wrong shape) names the problem
    let e = errors_of(&parse("graph \"a\"\n%0: f32[2, 4, 9, 8] = param {name=\"q\"}\n%1: f32[2, 2, 9, 8] = param {name=\"k\"}\n%2: f32[2, 4, 9, 8] = attention %0, %1, %1 {causal=true, scale=0.35, sinks=true}\nreturn o=%2\n").unwrap()).join("\n");
    assert!(e.contains("sinks"), "{e}");
}

/// `layout=bshd` on attention, attention_grad and rope prints and parses back (the
/// default layout prints nothing); shapes are read as [B, S, H, D]: GQA heads, sinks per
/// q head, the log-sum-exp and dlse [B, Nq, Sq]; a [B, H, S, D] tensor given to a bshd
/// op is refused at its node.
#[test]
fn bshd_layout_round_trips_and_reads_heads_from_dim_2() {
    let text = "graph \"a\"\n%0: f32[2, 9, 4, 8] = param {name=\"q\"}\n%1: f32[2, 9, 2, 8] = param {name=\"k\"}\n%2: f32[2, 9, 2, 6] = param {name=\"v\"}\n%3: f32[4] = param {name=\"sinks\"}\n%4: f32[1, 9, 8] = param {name=\"cos\"}\n%5: f32[2, 9, 4, 8] = rope %0, %4, %4 {layout=bshd}\n%6: f32[2, 9, 4, 6], %7: f32[2, 4, 9] = attention %5, %1, %2, %3 {causal=true, scale=0.35, window=4, sinks=true, lse=true, layout=bshd}\n%8: f32[2, 9, 4, 6] = param {name=\"do\"}\n%9: f32[2, 4, 9] = param {name=\"dl\"}\n%10: f32[2, 9, 4, 8], %11: f32[2, 9, 2, 8], %12: f32[2, 9, 2, 6], %13: f32[4] = attention_grad %5, %1, %2, %6, %8, %3, %9 {causal=true, scale=0.35, window=4, sinks=true, lse=true, layout=bshd}\nreturn o=%6, l=%7, dq=%10, dk=%11, dv=%12, ds=%13\n";
    let g = parse(text).unwrap_or_else(|e| panic!("{e}"));
    verify(&g).unwrap_or_else(|r| panic!("{r}"));
    let printed = print(&g);
    assert_eq!(parse(&printed).unwrap(), g);
    assert!(
        printed.contains("rope %0, %4, %4 {layout=bshd}\n"),
        "{printed}"
    );
    let default = "graph \"a\"\n%0: f32[2, 4, 9, 8] = param {name=\"q\"}\n%1: f32[2, 4, 9, 8] = attention %0, %0, %0 {causal=true, scale=0.35, layout=bhsd}\nreturn o=%1\n";
    let printed = print(&parse(default).unwrap());
    assert!(
        printed.contains("attention %0, %0, %0 {causal=true, scale=0.35}\n"),
        "{printed}"
    );
    // [B, H, S, D] q (4 heads at dim 1) against [B, S, H, D] k: batch/head_dim agree but
    // the heads do not divide
    let bad = "graph \"a\"\n%0: f32[2, 3, 9, 8] = param {name=\"q\"}\n%1: f32[2, 9, 2, 8] = param {name=\"k\"}\n%2: f32[2, 3, 9, 8] = attention %0, %1, %1 {causal=true, scale=0.35, layout=bshd}\nreturn o=%2\n";
    let e = errors_of(&parse(bad).unwrap()).join("\n");
    assert!(e.contains("multiple of kv heads"), "{e}");
    let e = parse_err("graph \"a\"\n%0: f32[2, 4, 9, 8] = param {name=\"q\"}\n%1: f32[2, 4, 9, 8] = attention %0, %0, %0 {causal=true, scale=0.35, layout=sbhd}\nreturn o=%1\n");
    assert!(e.contains("bhsd or bshd"), "{e}");
}

#[test]
fn partition_sizes_that_overflow_or_go_negative_are_refused() {
    // Used to panic (`attempt to add with overflow`) summing the shard sizes.
    let text = |sizes: &str| {
        format!(
            "graph \"x\"\nmesh tp=1\n%0: f32[4, 2] = param {{name=\"w\"}}\npartition \"w\" column tp dim=0 {sizes}\nreturn out=%0\n"
        )
    };
    let e = parse_err(&text("[9223372036854775807] [9223372036854775807] [2]"));
    assert!(
        e.contains("line 4") && e.contains("more than Weft can count"),
        "{e}"
    );
    let e = parse_err(&text("[-4]"));
    assert!(e.contains("negative size (-4)"), "{e}");
    // A group of many axes is read in linear time (each axis was compared with every
    // one before it) and refused by name.
    let axes: Vec<String> = (0..100_000).map(|i| format!("a{i}")).collect();
    let g = parse(&text("[4]").replace(" tp dim", &format!(" {} dim", axes.join("*")))).unwrap();
    let errs = errors_of(&g);
    assert!(
        errs.iter().any(|e| e.contains("unknown mesh axis `a")),
        "{errs:?}"
    );
    assert!(parse(&text("[4]")).is_ok());
}

#[test]
fn uses_of_one_value_match_the_table_of_all_uses() {
    let g = weft_ir::parse(
        "graph \"u\"\n%0: f32[4] = param {name=\"w\"}\n%1: f32[4] = mul %0, %0\n%2: f32[4] = add %1, %0\nreturn out=%2\n",
    )
    .unwrap();
    let all = g.uses();
    for id in 0..g.value_capacity() {
        let v = weft_ir::Value(id as u32);
        assert_eq!(g.uses_of(v), all[id], "{v}");
    }
    assert_eq!(g.uses_of(weft_ir::Value(0)).len(), 3);
}

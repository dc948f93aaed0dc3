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
    let x = g.add(Op::Embedding {}, &[ids, w]).unwrap();
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

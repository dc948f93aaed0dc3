//! Negative tests: each error names what failed, where, and how to fix it.

mod common;

use weft_ir::*;
use weft_passes::*;

fn cx(mesh: &str) -> PassContext {
    PassContext::new(Mesh::parse(mesh).unwrap())
}

fn compile(g: &mut Graph, mesh: &str) -> Result<RunReport, PassError> {
    let cx = cx(mesh);
    run_pipeline(g, &cx, &default_pipeline(&cx.mesh))
}

fn attention_location(g: &Graph, layer: usize) -> String {
    let n = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::Attention { .. }))
        .nth(layer)
        .unwrap();
    g.describe(n)
}

#[test]
fn heads_not_divisible_names_layer_heads_and_valid_degrees() {
    let mut g = common::llama_tiny(); // 4 q heads, 2 kv heads
    let loc = attention_location(&g, 0);
    let e = compile(&mut g, "sp=3").unwrap_err();
    assert_eq!(e.pass(), Some("ulysses-attention"));
    assert_eq!(
        e.to_string(),
        format!(
            "`ulysses-attention` cannot split the attention heads over sp=3 in {loc}: its 4 q heads (2 kv heads) do not divide by sp=3\n\
             help: use an sp degree that works for this layer (2, 4), and split the sequence further with context parallelism (ring attention has no head limit): e.g. `cp=3` in place of `sp=3`"
        )
    );
    assert!(loc.contains("model.layers.0.self_attn"), "{loc}");

    let mut g = common::llama_tiny();
    let e = compile(&mut g, "sp=8").unwrap_err().to_string();
    assert!(
        e.contains("its 4 q heads (2 kv heads) do not divide by sp=8"),
        "{e}"
    );
    assert!(e.contains("e.g. `cp=2,sp=4` in place of `sp=8`"), "{e}");
}

#[test]
fn kv_heads_not_divisible_without_replication() {
    let mut g = common::llama_tiny();
    let mut cx = cx("sp=4");
    cx.options.replicate_kv_heads = false;
    let e = run_pipeline(&mut g, &cx, &default_pipeline(&cx.mesh))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("`ulysses-attention` cannot split the attention heads over sp=4 in node %"),
        "{e}"
    );
    assert!(e.ends_with(
        "(model.layers.0.self_attn): its 2 kv heads do not divide by sp=4 and kv-head replication is off (4 q heads)\n\
         help: use an sp degree that works for this layer: 2"
    ), "{e}");
}

#[test]
fn sequence_not_divisible_is_a_plan_time_error_with_nearest_lengths() {
    let mut g = common::llama_tiny();
    compile(&mut g, "sp=4").unwrap();
    assert_eq!(
        check_bindings(&g, &Bindings::new().with("B", 2).with("S", 16)),
        Ok(())
    );
    let e = check_bindings(&g, &Bindings::new().with("B", 2).with("S", 10)).unwrap_err();
    assert_eq!(e.symbol.as_deref(), Some("S"));
    assert_eq!(e.suggestions, vec![8, 12]);
    let slice = g
        .nodes()
        .iter()
        .copied()
        .find(|&n| matches!(g.node(n).op, Op::Slice { .. }))
        .unwrap();
    let v = g.node(slice).results[0];
    assert_eq!(
        e.to_string(),
        format!(
            "sequence length S=10 does not divide evenly in {}: dim 1 of {v} is `S/sp` = 5/2 with S=10 on mesh sp=4\n\
             help: use S=8 or S=12, the nearest values every size works with (tokens are never dropped)",
            g.describe(slice)
        )
    );
}

#[test]
fn batch_not_divisible_over_dp() {
    let mut g = common::llama_tiny();
    compile(&mut g, "dp=2,sp=2").unwrap();
    let e = check_bindings(&g, &Bindings::new().with("B", 3).with("S", 8)).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("batch size B=3 does not divide evenly in node %"),
        "{e}"
    );
    assert_eq!(e.suggestions, vec![2, 4]);
}

#[test]
fn unbound_symbol() {
    let mut g = common::llama_tiny();
    compile(&mut g, "sp=2").unwrap();
    let e = check_bindings(&g, &Bindings::new().with("S", 8)).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("batch size B is not bound in node %0"),
        "{e}"
    );
    assert!(
        e.to_string()
            .ends_with("help: give a value for `B` when making the plan"),
        "{e}"
    );
}

#[test]
fn unknown_axis_is_an_error_naming_the_pass_and_mesh() {
    let mut g = common::llama_tiny();
    let cx = cx("dp=2");
    let ins = Instrumentation {
        check_requires: false,
        ..Default::default()
    };
    let e = PassManager::new(ins)
        .run(&mut g, &cx, &["ulysses-attention"], &mut std::io::sink())
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "pass `ulysses-attention` needs mesh axis `sp` but the mesh is `dp=2`\nhelp: add sp to the mesh (e.g. `--mesh dp=2,sp=2`)"
    );
    // Run directly, without the manager's check, the pass says the same.
    let e = weft_passes::ulysses::UlyssesAttention
        .run(&mut g, &cx)
        .unwrap_err();
    assert!(matches!(e, PassError::MissingAxis { .. }), "{e}");

    let mut g = common::llama_tiny();
    let e = compile_with(&mut g, "tp=2", &["shard-inputs"]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "pass `shard-inputs` needs mesh axis `sp`, `cp`, `dp` but the mesh is `tp=2`\nhelp: add sp or cp or dp to the mesh (e.g. `--mesh tp=2,sp=2`)"
    );
}

fn compile_with(g: &mut Graph, mesh: &str, pipeline: &[&str]) -> Result<RunReport, PassError> {
    run_pipeline(g, &cx(mesh), pipeline)
}

#[test]
fn unknown_pass_lists_the_valid_ones() {
    let e = lookup("shard-sequence").err().unwrap();
    assert_eq!(
        e.to_string(),
        format!(
            "unknown pass `shard-sequence`\nhelp: the passes are: {}",
            weft_passes::pass_names().join(", ")
        )
    );
    assert!(e.to_string().contains("shard-seq, ulysses-attention"));
    let e = Pipeline::parse("shard-inputs,shard-sequence").unwrap_err();
    assert!(matches!(e, PassError::UnknownPass { .. }));
    let mut g = common::llama_tiny();
    assert!(matches!(
        compile_with(&mut g, "sp=2", &["shard-inputs", "nope"]),
        Err(PassError::UnknownPass { .. })
    ));
}

#[test]
fn prerequisites_must_come_earlier() {
    let e = Pipeline::parse("shard-inputs, ulysses-attention").unwrap_err();
    assert_eq!(
        e.to_string(),
        "pass `ulysses-attention` must run after `shard-seq`, which does not come earlier in the pipeline [shard-inputs, ulysses-attention]\n\
         help: put `shard-seq` before `ulysses-attention`"
    );
    let mut g = common::llama_tiny();
    assert!(matches!(
        compile_with(&mut g, "sp=2", &["shard-seq"]),
        Err(PassError::Prerequisite { .. })
    ));
}

#[test]
fn mesh_mismatch() {
    let mut g = common::llama_tiny();
    g.mesh = Mesh::parse("sp=2").unwrap();
    let e = compile(&mut g, "sp=4").unwrap_err();
    assert_eq!(
        e.to_string(),
        "the graph's mesh `sp=2` differs from the mesh being compiled for `sp=4`"
    );
}

#[test]
fn stop_after_a_pass_not_in_the_pipeline() {
    let mut g = common::llama_tiny();
    let ins = Instrumentation {
        stop_after: Some("ulysses-attention".into()),
        ..Default::default()
    };
    let e = PassManager::new(ins)
        .run(
            &mut g,
            &cx("dp=2"),
            &default_pipeline(&cx("dp=2").mesh),
            &mut std::io::sink(),
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "`--stop-after ulysses-attention` names a pass that is not in the pipeline [shard-inputs, shard-seq, sp-loss, canonicalize]"
    );
}

/// A pass that breaks the graph, to check the manager names it.
struct Breaker;
impl Pass for Breaker {
    fn name(&self) -> &'static str {
        "break-types"
    }
    fn summary(&self) -> &'static str {
        "changes a reshape target without re-typing (test only)"
    }
    fn run(&self, g: &mut Graph, _: &PassContext) -> Result<PassResult, PassError> {
        let n = g
            .nodes()
            .iter()
            .copied()
            .find(|&n| matches!(g.node(n).op, Op::Reshape { .. }))
            .unwrap();
        g.node_mut(n).op = Op::Reshape {
            shape: vec![Dim::from(7)],
        };
        Ok(PassResult::changed(true))
    }
}

#[test]
fn verify_each_names_the_pass_that_broke_the_graph() {
    let mut g = common::llama_tiny();
    let ins = Instrumentation {
        verify_each: true,
        ..Default::default()
    };
    let e = PassManager::new(ins)
        .run_passes(&mut g, &cx(""), &[&Breaker], &mut std::io::sink())
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("the graph is invalid after pass `break-types`: 1 verifier error(s):\n"),
        "{text}"
    );
    // The annotated report: the error under its line.
    assert!(
        text.contains("= reshape %4 {shape=[7]}  # model.rotary_emb\n    ^ error: "),
        "{text}"
    );
    let PassError::Verify { pass, report } = e else {
        panic!()
    };
    assert_eq!(pass, "break-types");
    assert_eq!(report.errors.len(), 1);

    // Verification off: the manager does not notice.
    let mut g = common::llama_tiny();
    let ins = Instrumentation {
        verify_each: false,
        ..Default::default()
    };
    assert!(PassManager::new(ins)
        .run_passes(&mut g, &cx(""), &[&Breaker], &mut std::io::sink())
        .is_ok());
}

#[test]
fn gathering_a_flattened_token_dim_is_an_error() {
    // softmax over the flattened tokens of [B*S, H]: the per-rank rows B*S/dp/sp have no
    // contiguous global order to gather.
    let (b, s) = (Dim::sym("B"), Dim::sym("S"));
    let mut g = Graph::new("flat");
    g.set_scope(Some("model"));
    let ids = g
        .add(
            Op::Input {
                name: "input_ids".into(),
                role: Role::InputIds,
                ty: TensorType::new(DType::I64, vec![b.clone(), s.clone()]),
            },
            &[],
        )
        .unwrap();
    let w = g
        .add(
            Op::Param {
                name: "w".into(),
                ty: TensorType::new(DType::F32, vec![16.into(), 4.into()]),
            },
            &[],
        )
        .unwrap();
    let x = g
        .add(Op::Embedding { padding_idx: None }, &[ids, w])
        .unwrap();
    let x = g
        .add(
            Op::Reshape {
                shape: vec![b * s, 4.into()],
            },
            &[x],
        )
        .unwrap();
    g.set_scope(Some("model.mix"));
    let y = g.add(Op::Softmax { dim: 0 }, &[x]).unwrap();
    g.set_output("y", y);
    let e = compile(&mut g, "dp=2,sp=2").unwrap_err().to_string();
    assert!(e.starts_with("`shard-seq` cannot gather the whole tokens for `softmax` in node %4 (model.mix): dim 0 of %3"), "{e}");
    assert!(
        e.contains("is `B*S/dp/sp`, a per-rank size mixed with other dims"),
        "{e}"
    );
    // With sp alone the flattened dim B*S/sp is not contiguous either.
    let mut g2 = g.clone();
    g2.mesh = Mesh::default();
    let _ = compile(&mut g2, "sp=2").unwrap_err();
}

//! Tensor parallelism preserves meaning, checked by running it: the CPU reference
//! runtime executes the unsharded graph and the compiled `tp` programs (alone and with
//! `sp` and `dp`) on the same weights and inputs in f64; loss, logits and every
//! parameter gradient must agree. Uneven splits (tp=3: heads [2,1,1] or [1,1,2],
//! MLP [22,21,21], vocabulary [43,43,42]), replicated kv heads (tp=4 with 2 kv heads),
//! fused projections (phi3), qk-norms, tied embeddings (qwen2) and MoE experts are covered.

mod common;
use common::*;

use weft_ir::{Graph, HostTensor, Mesh};
use weft_passes::{default_pipeline, lookup, PassContext};
use weft_runtime::cpu::RunResult;

fn case(name: &str) -> Case {
    let dir = fixture(name);
    let model =
        weft_frontends::load(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors")).unwrap();
    let ids = inputs["input_ids"].to_i64();
    let (b, s) = (inputs["input_ids"].shape[0], inputs["input_ids"].shape[1]);
    let mut labels = ids.clone();
    for i in [1, 2, 3, 6, 9] {
        labels[i] = -100;
    }
    for i in [2, 13, 14, 15] {
        labels[s + i] = -100;
    }
    inputs.insert(
        "labels".into(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], labels),
    );
    Case {
        graph: model.graph,
        weights,
        inputs,
    }
}

fn compare(what: &str, want: &RunResult, got: &RunResult) {
    for name in ["loss", "logits"] {
        assert_close(
            &format!("{what}: {name}"),
            &want.outputs[name],
            &got.outputs[name],
        );
    }
    for (p, g) in &want.grads {
        assert_close(&format!("{what}: grad {p}"), g, &got.grads[p]);
    }
}

fn check_with(name: &str, c: Case, mesh: &str, cx: PassContext) -> Graph {
    let reference = execute(&c.graph, &c, true);
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    for pass in default_pipeline(&cx.mesh) {
        lookup(pass)
            .unwrap()
            .run(&mut g, &cx)
            .unwrap_or_else(|e| panic!("{name} {mesh}: {pass}: {e}"));
        weft_ir::verify(&g).unwrap_or_else(|r| panic!("{name} {mesh} after {pass}: {r}"));
    }
    let text = weft_ir::print(&g);
    assert_eq!(
        weft_ir::parse(&text).unwrap(),
        g,
        "{name} {mesh}: text round trip"
    );
    let got = execute(&g, &c, true);
    compare(&format!("{name} on {mesh}"), &reference, &got);
    g
}

fn check(name: &str, mesh: &str) -> Graph {
    check_with(
        name,
        case(name),
        mesh,
        PassContext::new(Mesh::parse(mesh).unwrap()),
    )
}

#[test]
fn llama_tp2() {
    let g = check("llama", "tp=2");
    assert!(!g
        .param_partition("model.layers.0.self_attn.q_proj.weight")
        .is_empty());
}

#[test]
fn llama_tp3_uneven() {
    let g = check("llama", "tp=3");
    let p = &g.param_partition("model.layers.0.mlp.gate_proj.weight")[0];
    assert_eq!(p.pieces, vec![vec![22, 21, 21]]);
    assert_eq!(
        g.param_partition("model.embed_tokens.weight")[0].pieces,
        vec![vec![43, 43, 42]]
    );
}

#[test]
fn llama_tp4_kv_heads_replicated() {
    check("llama", "tp=4");
    check("llama_kv1", "tp=2");
}

#[test]
fn qwen3_qk_norm_grad_allreduce() {
    let g = check("qwen3", "tp=2");
    let n = g.def(
        g.params()
            .into_iter()
            .find(|(n, _)| n == "model.layers.0.self_attn.q_norm.weight")
            .unwrap()
            .1,
    );
    let why = &g.node(n).meta.provenance.as_ref().unwrap().reason;
    assert!(why.contains("grad_allreduce"), "{why}");
    check("qwen3", "tp=3");
}

#[test]
fn qwen2_tied_embeddings_stay_tied() {
    // One parameter (embedding and head), one gradient, split over the vocabulary.
    let g = check("qwen2", "tp=2");
    assert!(g.params().iter().all(|(n, _)| n != "lm_head.weight"));
    assert_eq!(
        g.param_partition("model.embed_tokens.weight")[0].kind,
        "vocab"
    );
    check("qwen2", "tp=3");
}

#[test]
fn phi3_fused_projections() {
    let g = check("phi3", "tp=2");
    // qkv: q [16 16], k [8 8], v [8 8]; gate_up: [32 32] [32 32].
    assert_eq!(
        g.param_partition("model.layers.0.self_attn.qkv_proj.weight")[0].pieces,
        vec![vec![16, 16], vec![8, 8], vec![8, 8]]
    );
    assert_eq!(
        g.param_partition("model.layers.0.mlp.gate_up_proj.weight")[0].pieces,
        vec![vec![32, 32], vec![32, 32]]
    );
    check("phi3", "tp=3");
    check("phi3", "tp=4");
}

#[test]
fn moe_experts_split_on_their_intermediate_dim() {
    let g = check("mixtral", "tp=2");
    assert_eq!(
        g.param_partition("model.layers.0.mlp.experts.down_proj")[0].dim,
        2
    );
    check("qwen3_moe", "tp=3");
}

#[test]
fn mistral_tp4() {
    check("mistral", "tp=4");
}

#[test]
fn tp_with_sp_and_dp() {
    check("llama", "sp=2,tp=2");
    check("llama", "dp=2,tp=2");
    check("qwen3", "dp=2,sp=2,tp=2");
    check("llama", "tp=2,sp=2");
}

fn cx_with(mesh: &str, f: impl FnOnce(&mut weft_passes::tp::TpOptions)) -> PassContext {
    let mut cx = PassContext::new(Mesh::parse(mesh).unwrap());
    f(&mut cx.options.tp);
    cx
}

#[test]
fn deepspeed_spec_with_gather_output_and_grain() {
    // Only the MLP split (attention whole), the head column-parallel with its output
    // gathered (pad, gather, trim: 128 over 3 ranks with grain 8 is [48, 40, 40]).
    let spec = r#"{"tensor_parallel": {"tp_grain_size": 8, "partition_config": {"use_default_specs": false, "layer_specs": [
        {"patterns": [".*\\.mlp\\.down_proj\\.weight$"], "partition_type": "row"},
        {"patterns": [".*\\.mlp\\.(gate|up)_proj\\.weight$"], "partition_type": "column"},
        {"patterns": ["lm_head\\.weight$"], "partition_type": "column", "gather_output": true}
    ]}}}"#;
    let s = weft_passes::tp::TpSpec::from_deepspeed_json(spec, "spec.json").unwrap();
    let cx = cx_with("tp=3", |o| o.spec = Some(s));
    let g = check_with("llama", case("llama"), "tp=3", cx);
    assert_eq!(
        g.param_partition("lm_head.weight")[0].pieces,
        vec![vec![48, 40, 40]]
    );
    assert_eq!(
        g.param_partition("model.layers.0.mlp.gate_proj.weight")[0].pieces,
        vec![vec![24, 24, 16]]
    );
    assert!(g
        .param_partition("model.layers.0.self_attn.q_proj.weight")
        .is_empty());
    assert!(
        g.output_split("logits").is_empty(),
        "gathered logits are whole"
    );
}

#[test]
fn hf_tp_plan_from_config() {
    let plan = [
        ("layers.*.self_attn.q_proj", "colwise"),
        ("layers.*.self_attn.k_proj", "colwise"),
        ("layers.*.self_attn.v_proj", "colwise"),
        ("layers.*.self_attn.o_proj", "rowwise"),
        (
            "layers.*.self_attn.q_norm",
            "replicated_with_grad_allreduce",
        ),
        (
            "layers.*.self_attn.k_norm",
            "replicated_with_grad_allreduce",
        ),
        ("layers.*.mlp.gate_proj", "colwise"),
        ("layers.*.mlp.up_proj", "colwise"),
        ("layers.*.mlp.down_proj", "rowwise"),
    ];
    let cx = cx_with("tp=2", |o| {
        o.hf_plan = plan
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    });
    check_with("qwen3", case("qwen3"), "tp=2", cx);
}

fn compile_err(name: &str, mesh: &str, cx: PassContext) -> String {
    let c = case(name);
    let mut g = c.graph.clone();
    g.mesh = cx.mesh.clone();
    for pass in default_pipeline(&cx.mesh) {
        if let Err(e) = lookup(pass).unwrap().run(&mut g, &cx) {
            return e.to_string();
        }
    }
    panic!("{name} {mesh}: compiled without an error")
}

#[test]
fn bad_specs_give_clear_errors() {
    let spec = |text: &str| weft_passes::tp::TpSpec::from_deepspeed_json(text, "spec.json");
    // A regex that does not compile.
    let e = spec(r#"{"layer_specs": [{"patterns": ["*.q_proj"], "partition_type": "column"}]}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pattern `*.q_proj` does not compile")
            && e.contains("spec.json: layer_specs[0]"),
        "{e}"
    );
    // A 1-D bias partitioned as row.
    let s = spec(
        r#"{"layer_specs": [{"patterns": [".*\\.q_proj\\.bias$"], "partition_type": "row"}]}"#,
    )
    .unwrap();
    let e = compile_err("qwen2", "tp=2", cx_with("tp=2", |o| o.spec = Some(s)));
    assert!(
        e.contains("param `model.layers.0.self_attn.q_proj.bias`") && e.contains("1-D bias"),
        "{e}"
    );
    // An unknown HF style.
    let e = compile_err(
        "llama",
        "tp=2",
        cx_with("tp=2", |o| {
            o.hf_plan = vec![("layers.*.mlp.down_proj".into(), "rowwise_packed".into())]
        }),
    );
    assert!(
        e.contains("unsupported tensor-parallel style `rowwise_packed`")
            && e.contains("base_model_tp_plan"),
        "{e}"
    );
    // Strict: an unmatched linear is an error.
    let s = spec(r#"{"use_default_specs": false, "strict_mode": true, "layer_specs": [{"patterns": [".*\\.mlp\\..*"], "partition_type": "skip"}]}"#).unwrap();
    let e = compile_err("llama", "tp=2", cx_with("tp=2", |o| o.spec = Some(s)));
    assert!(
        e.contains("no layer spec matches") && e.contains("strict"),
        "{e}"
    );
    // Inconsistent attention: q split, o whole.
    let s = spec(r#"{"layer_specs": [{"patterns": [".*o_proj.*"], "partition_type": "skip"}]}"#)
        .unwrap();
    let e = compile_err("llama", "tp=2", cx_with("tp=2", |o| o.spec = Some(s)));
    assert!(e.contains("split inconsistently"), "{e}");
    // Wrong sub-parameter sizes for a fused layer.
    let s = spec(r#"{"layer_specs": [{"patterns": [".*qkv_proj.*"], "partition_type": "column", "shape": [3, -1]}]}"#).unwrap();
    let e = compile_err("phi3", "tp=2", cx_with("tp=2", |o| o.spec = Some(s)));
    assert!(
        e.contains("sub-parameters") && e.contains("[32, 16, 16]"),
        "{e}"
    );
}

#[test]
fn checkpoint_shards_round_trip_and_reshard() {
    use weft_passes::tp::{layout, param_layouts, shard_checkpoint, unshard_checkpoint};
    let c = case("phi3");
    let layouts = |mesh: &str| {
        let cx = PassContext::new(Mesh::parse(mesh).unwrap());
        let mut g = c.graph.clone();
        g.mesh = cx.mesh.clone();
        weft_passes::run_pipeline(&mut g, &cx, &default_pipeline(&cx.mesh)).unwrap();
        let l = param_layouts(&g, &[]).unwrap();
        (layout::shard_axes(&l, &cx.mesh), l)
    };
    let (a2, l2) = layouts("tp=2");
    let (a3, l3) = layouts("tp=3");
    let shards2 = shard_checkpoint(&l2, &c.weights, &a2).unwrap();
    assert_eq!(shards2.len(), 2);
    let full = unshard_checkpoint(&l2, &shards2, &a2).unwrap();
    // tp=2 -> full -> tp=3 -> full: every tensor bit for bit.
    let shards3 = shard_checkpoint(&l3, &full, &a3).unwrap();
    let back = unshard_checkpoint(&l3, &shards3, &a3).unwrap();
    for (k, t) in &c.weights {
        let b = &back[k];
        assert_eq!(t.shape, b.shape, "{k}");
        assert!(
            t.to_f64()
                .iter()
                .zip(b.to_f64())
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{k}"
        );
    }
    let q = l3
        .iter()
        .find(|l| l.name == "model.layers.0.self_attn.qkv_proj.weight")
        .unwrap();
    assert!(
        q.replicated,
        "phi3 at tp=3 has 2 kv heads: the fused qkv stays whole, sliced per rank"
    );
    let gu = l3
        .iter()
        .find(|l| l.name == "model.layers.0.mlp.gate_up_proj.weight")
        .unwrap();
    assert_eq!(gu.partitions[0].sub_params, vec![64, 64]);
    assert_eq!(gu.partitions[0].rank_sizes, vec![44, 42, 42]);
    assert_eq!(
        gu.partitions[0].sub_shard_widths,
        vec![vec![22, 21, 21], vec![22, 21, 21]]
    );
}

#[test]
fn megatron_sequence_parallel_inside_tp() {
    let sp = |mesh: &str| cx_with(mesh, |o| o.sequence_parallel = true);
    let g = check_with("llama", case("llama"), "tp=2", sp("tp=2"));
    let count = |name: &str| {
        g.nodes()
            .iter()
            .filter(|&&n| g.node(n).op.name() == name)
            .count()
    };
    // Embedding + 2 layers x (attention, MLP): 5 reduce_scatters; the 3 all_reduces left are the loss's.
    assert_eq!(count("reduce_scatter"), 5);
    assert_eq!(count("all_reduce"), 3);
    check_with("qwen3", case("qwen3"), "tp=4", sp("tp=4"));
    check_with(
        "llama",
        case("llama"),
        "dp=2,sp=2,tp=2",
        sp("dp=2,sp=2,tp=2"),
    );
    check_with("mixtral", case("mixtral"), "tp=2", sp("tp=2"));
    check_with("qwen2", case("qwen2"), "tp=2", sp("tp=2"));
}

#[test]
fn uneven_heads_split_on_kv_head_boundaries() {
    // 12 q heads, 6 kv heads of dim 8 over tp=4: kv heads [2, 2, 1, 1] (DeepSpeed's
    // rule), q heads [4, 4, 2, 2]; random weights (0.2 * normal) and the llama inputs.
    let config = r#"{"model_type": "llama", "vocab_size": 128, "hidden_size": 48, "intermediate_size": 72,
        "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 8,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0}"#;
    let cfg = weft_frontends::ModelConfig::from_json_str(config, "uneven.json").unwrap();
    let model = weft_frontends::Model::from_config(
        "uneven",
        cfg,
        weft_frontends::Origin::Preset("uneven".into()),
    )
    .unwrap();
    let mut weights = weft_frontends::random_weights(&model, 3);
    for w in weights.values_mut() {
        if let weft_ir::HostData::F64(v) = &mut w.data {
            v.iter_mut().for_each(|x| *x *= 10.0);
        }
    }
    let inputs = case("llama").inputs;
    let c = Case {
        graph: model.graph.clone(),
        weights,
        inputs,
    };
    let g = check_with(
        "uneven",
        c,
        "tp=4",
        PassContext::new(Mesh::parse("tp=4").unwrap()),
    );
    assert_eq!(
        g.param_partition("model.layers.0.self_attn.q_proj.weight")[0].pieces,
        vec![vec![32, 32, 16, 16]]
    );
    assert_eq!(
        g.param_partition("model.layers.0.self_attn.k_proj.weight")[0].pieces,
        vec![vec![16, 16, 8, 8]]
    );
    assert_eq!(
        g.param_partition("model.layers.0.self_attn.o_proj.weight")[0].pieces,
        vec![vec![32, 32, 16, 16]]
    );
    assert_eq!(
        g.param_partition("model.layers.0.mlp.down_proj.weight")[0].pieces,
        vec![vec![18, 18, 18, 18]]
    );
}

#[test]
fn granite_multipliers_with_vocab_parallel_loss() {
    // Scaled embeddings, residual branches and logits (logits / logits_scaling before the
    // vocabulary-parallel cross-entropy) on even and uneven splits.
    check("granite", "tp=2");
    check("granite", "tp=3");
    check("granite", "dp=2,sp=2,tp=2");
}

#[test]
fn olmo2_whole_projection_qk_norm() {
    // q_norm/k_norm normalise over every head of the projection, which tp splits: the
    // sum of squares is all-reduced over tp before the rsqrt.
    let g = check("olmo2", "tp=2");
    assert_eq!(
        g.param_partition("model.layers.0.self_attn.q_norm.weight")[0].pieces,
        vec![vec![16, 16]]
    );
    check("olmo2", "sp=2,tp=2");
    check("olmo2", "dp=2,tp=2");
}

#[test]
fn olmo2_kv_norm_over_replicated_heads_is_refused() {
    // tp=4 over 2 kv heads replicates each kv head on two ranks; the whole-projection
    // k_norm would count each replica: refused by name rather than computed wrongly.
    let c = case("olmo2");
    let mesh = Mesh::parse("tp=4").unwrap();
    let mut g = c.graph.clone();
    g.mesh = mesh.clone();
    let cx = PassContext::new(mesh.clone());
    let err = default_pipeline(&mesh)
        .iter()
        .try_for_each(|p| lookup(p).unwrap().run(&mut g, &cx).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("k_norm.weight") && err.contains("num_key_value_heads"),
        "{err}"
    );
}

/// A batch of `b` rows (the fixture's rows repeated, each rotated by its index so the
/// rows differ), labels the ids with a few ignored.
fn llama_batch(b: usize) -> Case {
    let mut c = case("llama");
    let ids = c.inputs["input_ids"].to_i64();
    let s = c.inputs["input_ids"].shape[1];
    let rows = ids.len() / s;
    let mut out = Vec::with_capacity(b * s);
    for r in 0..b {
        let row = &ids[(r % rows) * s..(r % rows + 1) * s];
        out.extend((0..s).map(|i| row[(i + r) % s]));
    }
    let mut labels = out.clone();
    for i in (3..labels.len()).step_by(7) {
        labels[i] = -100;
    }
    c.inputs.insert(
        "input_ids".into(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], out),
    );
    c.inputs.insert(
        "labels".into(),
        HostTensor::ints(weft_ir::DType::I64, vec![b, s], labels),
    );
    c
}

/// Issue 17's 405B bug in small: tp follows the attention reshape `[B/dp, S/sp, H] ->
/// [B/dp, S/sp, heads, head_dim]` by evaluating the dims with a stand-in for `B` and
/// `S`; a stand-in not divisible by dp (720720 for dp=32 on 405B's dp=32,sp=16,tp=2)
/// made `B/dp` fractional and every such mesh was refused. dp=17 is the smallest mesh
/// size that did not divide it; the program must match the unsharded model.
#[test]
fn tp_follows_reshapes_on_any_data_parallel_degree() {
    let g = check_with(
        "llama",
        llama_batch(17),
        "dp=17,tp=2",
        PassContext::new(Mesh::parse("dp=17,tp=2").unwrap()),
    );
    assert!(!g
        .param_partition("model.layers.0.self_attn.q_proj.weight")
        .is_empty());
}

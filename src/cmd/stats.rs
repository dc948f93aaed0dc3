//! `weft stats`: parameter count (tied weights once, as HF counts), nodes by op,
//! forward FLOPs per token at a sequence length, and parameter bytes by dtype. Of a
//! plan `.json`: the same for the model it was compiled from, at the plan's sequence
//! length, and what the plan holds (training step or forward only, mesh, sizes).

use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use weft_ir::{Bindings, Op};

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json or model directory, .weft file, or a plan .json.
    model: String,
    /// Sequence length the FLOPs are counted at (attention grows with it; default
    /// 4096, or the plan's).
    #[arg(long)]
    seq: Option<i64>,
    /// Print one JSON object; `params` is the exact parameter count.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    model: String,
    family: String,
    params: u64,
    nodes: usize,
    nodes_by_op: BTreeMap<String, usize>,
    seq: i64,
    /// Forward FLOPs per token at `seq` (batch 1), causal attention counted once.
    forward_flops_per_token: u64,
    /// Forward + backward (3x forward) FLOPs per token.
    train_flops_per_token: u64,
    param_bytes_by_dtype: BTreeMap<String, u64>,
    /// For a plan given as MODEL: what it holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    plan: Option<PlanFacts>,
}

#[derive(serde::Serialize)]
struct PlanFacts {
    /// `training` or `forward`.
    step: weft_ir::plan::StepKind,
    mesh: String,
    bindings: BTreeMap<String, i64>,
    /// Nodes of the compiled program (per rank).
    program_nodes: usize,
    peak_memory_bytes: u64,
    predicted_time_s: f64,
}

pub fn run(a: Args) -> CliResult {
    let plan = super::session::read_plan(&a.model)?;
    let (m, plan_facts, plan_seq) = match &plan {
        Some(p) => {
            if p.source.is_empty() {
                return Err(CliError::input(format!(
                    "plan {} does not record the model it was compiled from",
                    a.model
                )));
            }
            let program = weft_ir::parse(&p.program)
                .map_err(|e| CliError::input(format!("the program of plan {}: {e}", a.model)))?;
            let facts = PlanFacts {
                step: p.step_kind(),
                mesh: p.mesh.to_string(),
                bindings: p.bindings.clone(),
                program_nodes: program.node_count(),
                peak_memory_bytes: p.memory.peak_bytes,
                predicted_time_s: p.cost.step_time_s,
            };
            (
                super::load_model(&p.source)?,
                Some(facts),
                p.bindings.get("S").copied(),
            )
        }
        None => (super::load_model(&a.model)?, None, None),
    };
    let seq = a.seq.or(plan_seq).unwrap_or(4096);
    weft_passes::bindings::check_batch_seq(None, Some(seq)).map_err(CliError::input)?;
    if seq <= 0 {
        return Err(CliError::input(format!(
            "invalid --seq {seq}: must be positive"
        )));
    }
    let g = &m.graph;
    let mut by_op: BTreeMap<String, usize> = BTreeMap::new();
    let mut bytes: BTreeMap<String, u64> = BTreeMap::new();
    for &n in g.nodes() {
        let d = g.node(n);
        *by_op.entry(d.op.name().to_string()).or_default() += 1;
        if let Op::Param { ty, .. } = &d.op {
            let b = ty.size_bytes(&Bindings::new()).map_err(|e| {
                CliError::input(format!("parameter shape in {}: {e}", g.describe(n)))
            })?;
            let total = bytes.entry(ty.dtype.to_string()).or_default();
            *total = total.checked_add(b).ok_or_else(|| {
                CliError::input(format!(
                    "the {} parameter bytes of {} overflow",
                    ty.dtype, m.name
                ))
            })?;
        }
    }
    let b = Bindings::new().with("B", 1).with("S", seq);
    let flops = weft_ir::flops::graph_flops(g).eval_f64(&b).map_err(|e| {
        CliError::input(format!(
            "cannot count FLOPs of {} at seq {seq}: {e}",
            m.name
        ))
    })?;
    let per_token = (flops / seq as f64).round();
    // Below 2^62 so that the training step's 3x still fits a u64.
    if !(per_token.is_finite() && per_token < (1u64 << 62) as f64) {
        return Err(CliError::input(format!(
            "FLOPs per token of {} at --seq {seq} ({per_token:e}) are beyond what Weft counts",
            a.model
        )));
    }
    let per_token = per_token as u64;
    let r = Report {
        model: m.name.clone(),
        family: m.family.as_str().to_string(),
        params: m.param_count(),
        nodes: g.node_count(),
        nodes_by_op: by_op,
        seq,
        forward_flops_per_token: per_token,
        train_flops_per_token: 3 * per_token,
        param_bytes_by_dtype: bytes,
        plan: plan_facts,
    };
    if a.json {
        print!("{}", super::json(&r));
        return Ok(());
    }
    println!("model       {} ({})", r.model, r.family);
    println!("parameters  {}", super::models::group_digits(r.params));
    for (dt, by) in &r.param_bytes_by_dtype {
        println!("  {dt:<9} {:.2} GiB", *by as f64 / (1u64 << 30) as f64);
    }
    let digits = super::models::group_digits;
    println!(
        "FLOPs/token {} forward, {} train (seq {}, batch 1)",
        digits(r.forward_flops_per_token),
        digits(r.train_flops_per_token),
        r.seq
    );
    if let Some(p) = &r.plan {
        println!(
            "plan        {} on mesh {}, sizes {:?}: {} nodes per rank, peak {} per rank, {} {:.3} ms predicted",
            p.step.name(),
            if p.mesh.is_empty() { "(one rank)" } else { &p.mesh },
            p.bindings,
            p.program_nodes,
            weft_passes::plan::gib(p.peak_memory_bytes),
            p.step.time_name(),
            p.predicted_time_s * 1e3
        );
    }
    println!("nodes       {}", r.nodes);
    for (op, c) in &r.nodes_by_op {
        println!("  {op:<15} {c}");
    }
    Ok(())
}

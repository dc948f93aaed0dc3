//! `weft stats`: parameter count (tied weights once, as HF counts), nodes by op,
//! forward FLOPs per token at a sequence length, and parameter bytes by dtype.

use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use weft_ir::{Bindings, Op};

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json, model directory or .weft file.
    model: String,
    /// Sequence length the FLOPs are counted at (attention grows with it).
    #[arg(long, default_value_t = 4096)]
    seq: i64,
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
    forward_flops_per_token: f64,
    /// Forward + backward (3x forward) FLOPs per token.
    train_flops_per_token: f64,
    param_bytes_by_dtype: BTreeMap<String, u64>,
}

pub fn run(a: Args) -> CliResult {
    weft_passes::bindings::check_batch_seq(None, Some(a.seq)).map_err(CliError::input)?;
    let m = super::load_model(&a.model)?;
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
                CliError::input(format!("the {} parameter bytes of {} overflow", ty.dtype, m.name))
            })?;
        }
    }
    let b = Bindings::new().with("B", 1).with("S", a.seq);
    let flops = weft_ir::flops::graph_flops(g).eval_f64(&b).map_err(|e| {
        CliError::input(format!(
            "cannot count FLOPs of {} at seq {}: {e}",
            m.name, a.seq
        ))
    })?;
    let per_token = flops / a.seq as f64;
    let r = Report {
        model: m.name.clone(),
        family: m.family.as_str().to_string(),
        params: m.param_count(),
        nodes: g.node_count(),
        nodes_by_op: by_op,
        seq: a.seq,
        forward_flops_per_token: per_token,
        train_flops_per_token: 3.0 * per_token,
        param_bytes_by_dtype: bytes,
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
    println!(
        "FLOPs/token {:.3} GFLOP forward, {:.3} GFLOP train (seq {}, batch 1)",
        r.forward_flops_per_token / 1e9,
        r.train_flops_per_token / 1e9,
        r.seq
    );
    println!("nodes       {}", r.nodes);
    for (op, c) in &r.nodes_by_op {
        println!("  {op:<15} {c}");
    }
    Ok(())
}

//! `weft inspect PLAN`: what a plan will do — per-rank peak memory with its breakdown,
//! predicted step time (compute, exposed communication, host copies), communication
//! bytes and counts by collective and axis, MFU; `--explain` lists every inserted
//! collective, recompute and offload with the pass that put it there and why;
//! `--trace` writes a Chrome/Perfetto trace of the predicted timeline; `--memory`
//! draws device memory over the step as an SVG; `--buffers` lists every buffer with
//! its placement and live range (a view or an in-place result shows the buffer whose
//! bytes it shares).

use crate::error::{CliError, CliResult};
use std::path::PathBuf;
use weft_ir::plan::{Category, ExecutionPlan};

#[derive(clap::Args)]
pub struct Args {
    /// A plan written by `weft compile ... -o plan.json`.
    plan: PathBuf,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// List every collective, recompute and offload with its provenance and bytes.
    #[arg(long)]
    explain: bool,
    /// Write a Chrome/Perfetto trace (streams as tracks) here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write an SVG of device memory over the step, stacked by category, here.
    #[arg(long)]
    memory: Option<PathBuf>,
    /// List every buffer: value, dtype, size, category, placement, live range; a view
    /// (a reshape sharing its input's bytes) reads `= view of bN`, a result written
    /// over a dead value's bytes (an update, an elementwise op) `= in place of bN`.
    #[arg(long)]
    buffers: bool,
}

#[derive(serde::Serialize)]
struct Summary<'a> {
    model: &'a str,
    /// `training` (forward, backward, gradient sync, optimizer) or `forward`: what
    /// `step_time_s` and `mfu` are the time and utilisation of.
    step: weft_ir::plan::StepKind,
    mesh: String,
    bindings: &'a std::collections::BTreeMap<String, i64>,
    device: &'a str,
    peak_memory_bytes: u64,
    memory_breakdown: &'a std::collections::BTreeMap<String, u64>,
    step_time_s: f64,
    compute_s: f64,
    exposed_comm_s: f64,
    copy_s: f64,
    host_update_s: f64,
    update_s: f64,
    comm_bytes: &'a std::collections::BTreeMap<String, f64>,
    collectives: &'a std::collections::BTreeMap<String, u64>,
    mfu: f64,
    instructions: usize,
    /// Buffers that are views of another's bytes (reshapes that copy nothing).
    views: usize,
    /// Buffers written in place over a dead value's bytes (updates, elementwise ops).
    in_place: usize,
}

/// For each buffer: whether it is written in place over another value's bytes (an
/// alias not made by a reshape of the same bytes).
fn in_place(p: &ExecutionPlan) -> Vec<bool> {
    let root = p
        .storage_roots()
        .unwrap_or_else(|_| (0..p.buffers.len() as u32).collect());
    let mut out = vec![false; p.buffers.len()];
    for ins in &p.instructions {
        for &o in &ins.outputs {
            let r = root[o as usize];
            let view =
                ins.op == "reshape" && ins.inputs.len() == 1 && root[ins.inputs[0] as usize] == r;
            out[o as usize] = r != o && !view;
        }
    }
    out
}

pub fn load_plan(path: &std::path::Path) -> CliResult<ExecutionPlan> {
    let text = weft_ir::files::read_to_string(path)
        .map_err(|e| CliError::input(format!("cannot read {}: {e}", path.display())))?;
    ExecutionPlan::from_json(&text, &path.display().to_string()).map_err(crate::fail)
}

pub fn run(a: Args) -> CliResult {
    for out in [&a.trace, &a.memory].into_iter().flatten() {
        weft_ir::output::refuse_overwriting_input(out, &[("plan", &a.plan)])
            .map_err(CliError::input)?;
    }
    let p = load_plan(&a.plan)?;
    let placed = in_place(&p);
    let kind = p.step_kind();
    let s = Summary {
        model: &p.model,
        step: kind,
        mesh: p.mesh.to_string(),
        bindings: &p.bindings,
        device: &p.device.name,
        peak_memory_bytes: p.memory.peak_bytes,
        memory_breakdown: &p.memory.breakdown,
        step_time_s: p.cost.step_time_s,
        compute_s: p.cost.compute_s,
        exposed_comm_s: p.cost.exposed_comm_s,
        copy_s: p.cost.copy_s,
        host_update_s: p.cost.host_update_s,
        update_s: p.cost.update_s,
        comm_bytes: &p.cost.comm_bytes,
        collectives: &p.cost.collectives,
        mfu: p.cost.mfu,
        instructions: p.instructions.len(),
        views: p.buffers.iter().filter(|b| b.alias_of.is_some()).count()
            - placed.iter().filter(|&&x| x).count(),
        in_place: placed.iter().filter(|&&x| x).count(),
    };
    if let Some(t) = &a.trace {
        super::write_out(Some(t), &trace(&p))?;
    }
    if let Some(m) = &a.memory {
        super::write_out(Some(m), &memory_svg(&p))?;
    }
    if a.json {
        print!("{}", super::json(&s));
        return Ok(());
    }
    let gib = weft_passes::plan::gib;
    println!(
        "plan {} ({}) on mesh {} ({} ranks, {}), sizes {:?}",
        p.model,
        kind.name(),
        if s.mesh.is_empty() {
            "(one rank)"
        } else {
            &s.mesh
        },
        p.mesh.world_size(),
        p.device.name,
        p.bindings
    );
    println!(
        "memory  peak {} per rank (arena {}, resident {})",
        gib(p.memory.peak_bytes),
        gib(p.memory.arena_bytes),
        gib(p.memory.resident_bytes)
    );
    for (k, v) in &p.memory.breakdown {
        println!("        {k:<16} {}", gib(*v));
    }
    if s.views > 0 {
        let bytes: u64 = p
            .buffers
            .iter()
            .filter(|b| b.alias_of.is_some() && !placed[b.id as usize])
            .map(|b| b.bytes)
            .sum();
        println!(
            "views   {} reshapes share their input's bytes ({} not copied)",
            s.views,
            bytes_text(bytes as f64)
        );
    }
    if s.in_place > 0 {
        let bytes: u64 = p
            .buffers
            .iter()
            .filter(|b| placed[b.id as usize])
            .map(|b| b.bytes)
            .sum();
        println!(
            "inplace {} results written over dead values' bytes ({} not held twice)",
            s.in_place,
            bytes_text(bytes as f64)
        );
    }
    println!(
        "time    {} {:.3} ms: compute {:.3} ms, not hidden under compute {:.3} ms (communication {:.3} ms, host copies {:.3} ms{}); MFU {:.1}%{}",
        kind.time_name(),
        p.cost.step_time_s * 1e3,
        p.cost.compute_s * 1e3,
        p.cost.exposed_comm_s * 1e3,
        p.cost.comm_s * 1e3,
        p.cost.copy_s * 1e3,
        if p.cost.host_update_s > 0.0 {
            format!(", host optimizer {:.3} ms", p.cost.host_update_s * 1e3)
        } else if p.cost.update_s > 0.0 {
            format!(", update stream {:.3} ms", p.cost.update_s * 1e3)
        } else {
            String::new()
        },
        p.cost.mfu * 100.0,
        if kind == weft_ir::plan::StepKind::Forward {
            " of the forward pass alone (no backward or optimizer: not a training step)"
        } else {
            ""
        }
    );
    for (k, v) in &p.cost.collectives {
        let bytes: f64 = p
            .cost
            .comm_bytes
            .iter()
            .filter(|(kk, _)| kk.starts_with(&format!("{k}/")))
            .map(|(_, b)| b)
            .sum();
        println!(
            "comm    {k:<15} x{v:<5} {:>14} sent per rank",
            bytes_text(bytes)
        );
    }
    if a.buffers {
        println!("\nbuffers:");
        for b in &p.buffers {
            let place = match b.alias_of {
                Some(r) if placed[b.id as usize] => format!("= in place of b{r}"),
                Some(r) => format!("= view of b{r}"),
                None if b.category == Category::Host => format!("host @{}", b.offset),
                None if b.resident => format!("resident @{}", b.offset),
                None => format!("arena @{}", b.offset),
            };
            println!(
                "  b{:<6} %{:<6} {:<5} {:>12.3} KiB  {:<16} {:<24} live {}..{}",
                b.id,
                b.value,
                b.dtype.to_string(),
                b.bytes as f64 / 1024.0,
                b.category.name(),
                place,
                b.live.0,
                b.live.1
            );
        }
    }
    if a.explain {
        println!("\ninserted by passes:");
        println!(
            "  {:<6} {:<7} {:<15} {:<8} {:>14}  pass: why  [layer]",
            "instr", "value", "op", "axis", "sent per rank"
        );
        for ins in p.instructions.iter().filter(|i| i.provenance.is_some()) {
            println!(
                "  #{:<5} %{:<6} {:<15} {:<8} {:>14}  {}  [{}]",
                ins.id,
                ins.node,
                ins.op,
                ins.axis.as_deref().unwrap_or("-"),
                bytes_text(ins.bytes),
                ins.provenance.as_deref().unwrap_or(""),
                ins.source.as_deref().unwrap_or("")
            );
        }
    }
    Ok(())
}

/// Bytes in the largest binary unit that keeps the number at least 1 (the same
/// rule for every byte count `inspect` prints).
fn bytes_text(b: f64) -> String {
    const K: f64 = 1024.0;
    if b >= K * K * K {
        format!("{:.3} GiB", b / (K * K * K))
    } else if b >= K * K {
        format!("{:.3} MiB", b / (K * K))
    } else {
        format!("{:.3} KiB", b / K)
    }
}

/// Chrome trace-event JSON: one track per stream, one complete event per instruction.
fn trace(p: &ExecutionPlan) -> String {
    let mut events = Vec::new();
    for s in &p.streams {
        events.push(serde_json::json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": s.id, "args": {"name": s.name}}));
    }
    for i in &p.instructions {
        events.push(serde_json::json!({
            "name": i.op, "ph": "X", "pid": 0, "tid": i.stream,
            "ts": i.start_s * 1e6, "dur": i.time_s * 1e6,
            "args": {"node": format!("%{}", i.node), "source": i.source, "bytes": i.bytes, "flops": i.flops, "provenance": i.provenance}
        }));
    }
    serde_json::to_string(&serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}))
        .expect("trace serializes")
        + "\n"
}

/// Stacked areas of live bytes per category over instruction index (resident at the bottom).
fn memory_svg(p: &ExecutionPlan) -> String {
    let n = p.instructions.len().max(1);
    let cats = [
        Category::Param,
        Category::Grad,
        Category::OptimizerState,
        Category::Activation,
        Category::Comm,
    ];
    let colors = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f"];
    let mut live = vec![[0u64; 5]; n];
    for b in p.buffers.iter().filter(|b| b.alias_of.is_none()) {
        let Some(k) = cats.iter().position(|c| *c == b.category) else {
            continue;
        };
        let (lo, hi) = if b.resident {
            (0, n - 1)
        } else {
            (b.live.0 as usize, b.live.1 as usize)
        };
        for row in live.iter_mut().take(hi.min(n - 1) + 1).skip(lo) {
            row[k] += b.bytes;
        }
    }
    let top = live
        .iter()
        .map(|r| r.iter().sum::<u64>())
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let (w, h) = (900.0, 360.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\">\n",
        h + 40.0
    );
    let x = |i: usize| i as f64 / (n.max(2) - 1) as f64 * w;
    let y = |v: f64| h - v / top * h;
    for k in (0..5).rev() {
        let mut pts = String::new();
        for (i, r) in live.iter().enumerate() {
            let v: u64 = r[..=k].iter().sum();
            pts.push_str(&format!("{:.1},{:.1} ", x(i), y(v as f64)));
        }
        pts.push_str(&format!("{:.1},{h} 0,{h}", x(n - 1)));
        out.push_str(&format!(
            "<polygon points=\"{pts}\" fill=\"{}\"/>\n",
            colors[k]
        ));
    }
    for (k, c) in cats.iter().enumerate() {
        out.push_str(&format!("<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\" font-size=\"11\">{}</text>\n", 10 + k * 150, h + 15.0, colors[k], 24 + k * 150, h + 25.0, c.name()));
    }
    out.push_str(&format!("<text x=\"{}\" y=\"12\" font-size=\"11\" text-anchor=\"end\">peak {:.2} GiB live</text>\n</svg>\n", w - 4.0, top / (1u64 << 30) as f64));
    out
}

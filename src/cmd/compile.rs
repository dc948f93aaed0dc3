//! `weft compile`: run the pipeline a mesh needs (or `--passes`) on a model, with the
//! pass manager's instrumentation, check that `--seq`/`--batch` fit the program, and
//! write the parallel program's text.

use crate::error::{CliError, CliResult};
use std::path::PathBuf;
use weft_ir::Bindings;
use weft_passes::{Instrumentation, PassFilter, PassManager};

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json, model directory or .weft file.
    pub model: String,
    /// Mesh axes outermost first, e.g. `dp=2,sp=4` (empty: one rank).
    #[arg(long, default_value = "")]
    pub mesh: String,
    /// Sequence length to bind `S` to (checked against the mesh: `sp` must divide it).
    #[arg(long)]
    pub seq: Option<i64>,
    /// Global batch size to bind `B` to (`dp` must divide it).
    #[arg(long)]
    pub batch: Option<i64>,
    /// Comma-separated pass names instead of the mesh's default pipeline.
    #[arg(long)]
    pub passes: Option<String>,
    /// Print the IR before these passes (`all` or comma-separated names).
    #[arg(long, value_name = "PASS")]
    pub print_before: Option<String>,
    /// Print the IR after these passes (`all` or comma-separated names).
    #[arg(long, value_name = "PASS")]
    pub print_after: Option<String>,
    /// Print a unified diff of the IR for every pass that changed it.
    #[arg(long)]
    pub print_changes: bool,
    /// Print per-pass statistics (time, nodes added/removed, collectives inserted).
    #[arg(long)]
    pub stats: bool,
    /// Stop after this pass.
    #[arg(long, value_name = "PASS")]
    pub stop_after: Option<String>,
    /// Verify the IR after every pass (default: on).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub verify_each: bool,
    /// Write the program here: an ExecutionPlan when the name ends in `.json` (needs
    /// --seq), else the program's text IR (default: text on stdout, unless --json).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Device profile the plan is scheduled and costed for: h200, h100, a100 or a JSON file.
    #[arg(long, default_value = "h200")]
    pub device: String,
    /// Per-rank device memory the plan must fit, in GiB.
    #[arg(long, default_value_t = 80.0)]
    pub device_memory: f64,
    /// Print the pass statistics as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// DeepSpeed `tensor_parallel.partition_config` JSON: layer specs for tp meshes.
    #[arg(long, value_name = "FILE")]
    pub tp_spec: Option<PathBuf>,
    /// Compile a whole training step: forward, autodiff, grad-sync, optimizer (implied
    /// by any training flag). With --stats, also the memory per rank of each
    /// checkpoint policy.
    #[arg(long)]
    pub train: bool,
    /// Keep the parameter gradients as outputs (`grad.*`) of a training step that
    /// updates the parameters. Off by default: a plan for training frees each gradient
    /// once its bucket's update has read it.
    #[arg(long)]
    pub keep_grads: bool,
    #[command(flatten)]
    pub train_args: super::train::TrainArgs,
}

/// Parses `--passes` or picks the mesh's default pipeline.
pub fn pipeline(passes: Option<&str>, mesh: &weft_ir::Mesh) -> CliResult<Vec<String>> {
    match passes {
        Some(p) => {
            let names: Vec<String> = p
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            for n in &names {
                weft_passes::lookup(n).map_err(crate::fail)?;
            }
            Ok(names)
        }
        None => Ok(weft_passes::default_pipeline(mesh)
            .into_iter()
            .map(String::from)
            .collect()),
    }
}

/// Binds `B` and `S` (and the mesh's axis sizes) and checks every size of the program.
/// When only one of the two is given, the other takes the smallest size the mesh
/// allows (one sequence per data-parallel rank, one token per sequence-parallel rank).
pub fn check_sizes(
    g: &weft_ir::Graph,
    batch: Option<i64>,
    seq: Option<i64>,
) -> CliResult<Bindings> {
    weft_passes::bindings::check_batch_seq(batch, seq).map_err(CliError::input)?;
    let mut b = Bindings::new();
    let (batch, seq) = match (batch, seq) {
        (None, None) => (None, None),
        (b, s) => (
            Some(b.unwrap_or(g.mesh.size_or_one("dp") as i64)),
            Some(s.unwrap_or(g.mesh.size_or_one("sp") as i64)),
        ),
    };
    for (flag, sym, v) in [("--batch", "B", batch), ("--seq", "S", seq)] {
        if let Some(v) = v {
            if v <= 0 {
                return Err(CliError::input(format!(
                    "invalid {flag} {v}: must be positive"
                )));
            }
            b = b.with(sym, v);
        }
    }
    if batch.is_some() || seq.is_some() {
        weft_passes::check_bindings(g, &b).map_err(crate::fail)?;
    }
    Ok(b)
}

pub fn run(a: Args) -> CliResult {
    if let Some(out) = &a.output {
        super::refuse_overwrite(out, &[("MODEL", std::path::Path::new(&a.model))])?;
    }
    let mesh = super::parse_mesh(&a.mesh)?;
    let model = super::load_model(&a.model)?;
    let mut cx = super::shard::pass_context(&mesh, &model, a.tp_spec.as_deref())?;
    let mut g = model.graph;
    let mut names = pipeline(a.passes.as_deref(), &mesh)?;
    let training = a.train || a.train_args.any();
    let forward = names.clone();
    let model_graph = if training && a.stats {
        Some(g.clone())
    } else {
        None
    };
    if training {
        cx.options.train = a.train_args.options("adamw")?;
        cx.options.train.batch = a.batch;
        cx.options.train.seq = a.seq;
        cx.options.train.grad_outputs = a.keep_grads;
        weft_passes::micro_batches::check_micro_batches(
            cx.options.train.micro_batches,
            a.batch,
            &mesh,
        )
        .map_err(CliError::input)?;
        // The offload planner hides copies under compute timed on this device.
        if let Some(o) = &mut cx.options.train.offload {
            o.device = weft_passes::training::Device(
                weft_passes::plan::profile::load(&a.device).map_err(CliError::input)?,
            );
            o.link_bytes_per_s = o.device.link_bytes_per_s();
        }
        names.extend(super::train::training_passes(&mesh, &cx.options.train));
    }
    let filter = |t: &Option<String>| -> CliResult<PassFilter> {
        t.as_deref()
            .map(PassFilter::parse)
            .transpose()
            .map(|f| f.unwrap_or_default())
            .map_err(crate::fail)
    };
    let ins = Instrumentation {
        verify_each: a.verify_each,
        print_before: filter(&a.print_before)?,
        print_after: filter(&a.print_after)?,
        print_changes: a.print_changes,
        stats: a.stats && !a.json,
        stop_after: a.stop_after.clone(),
        ..Instrumentation::default()
    };
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let start = std::time::Instant::now();
    let report = PassManager::new(ins)
        .run(&mut g, &cx, &refs, &mut std::io::stderr())
        .map_err(crate::fail)?;
    let bindings = check_sizes(&g, a.batch, a.seq)?;
    if let Some(m) = &model_graph {
        eprint!("{}", super::train::memory_table(m, &cx, &forward)?);
    }
    let wants_plan = a
        .output
        .as_ref()
        .is_some_and(|p| p.extension().is_some_and(|e| e == "json"));
    let mut plan_note = String::new();
    if wants_plan {
        if a.seq.is_none() {
            return Err(CliError::input("a plan needs concrete sizes")
                .with_help("pass --seq (and --batch) to bind S and B"));
        }
        let device = weft_passes::plan::profile::load(&a.device).map_err(CliError::input)?;
        if !(a.device_memory > 0.0) {
            return Err(CliError::input(format!(
                "invalid --device-memory {}: must be positive GiB",
                a.device_memory
            )));
        }
        let opts = weft_passes::plan::PlanOptions {
            device,
            device_memory: (a.device_memory * (1u64 << 30) as f64) as u64,
            bindings,
            source: a.model.clone(),
        };
        let plan = weft_passes::plan::lower(&g, &opts).map_err(crate::fail)?;
        plan_note = format!(
            "; plan: peak {} per rank, step {:.3} ms predicted",
            weft_passes::plan::gib(plan.memory.peak_bytes),
            plan.cost.step_time_s * 1e3
        );
        super::write_out(a.output.as_deref(), &plan.to_json())?;
    }
    let elapsed = start.elapsed();
    let text = weft_ir::print(&g);
    if let Some(p) = &a.output {
        if !wants_plan {
            super::write_out(Some(p), &text)?;
        }
    } else if !a.json {
        print!("{text}");
    }
    if a.json {
        print!("{}", report.to_json());
        println!();
    }
    let collectives = g
        .nodes()
        .iter()
        .filter(|&&n| g.node(n).op.is_collective())
        .count();
    eprintln!(
        "compiled {} for mesh {} ({} ranks): {} nodes, {} collectives, pipeline [{}] in {:.1} ms{}",
        g.name,
        if mesh.axes.is_empty() {
            "(one rank)".to_string()
        } else {
            mesh.to_string()
        },
        mesh.world_size(),
        g.node_count(),
        collectives,
        names.join(", "),
        elapsed.as_secs_f64() * 1e3,
        plan_note
    );
    Ok(())
}

//! `weft compile`: compile a model's training step (or with `--forward-only` its
//! forward pass) for a mesh through the driver, with the pass manager's
//! instrumentation, and write the program's text or its ExecutionPlan.

use crate::error::{CliError, CliResult};
use std::path::PathBuf;
use weft_passes::{Instrumentation, PassFilter};

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json or model directory, torch.export .pt2, or .weft file.
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
    /// Comma-separated forward pass names instead of the mesh's default pipeline (the
    /// training passes still follow, unless --forward-only).
    #[arg(long)]
    pub passes: Option<String>,
    /// Print the pipeline that ran, with the reason for each pass's position.
    #[arg(long)]
    pub print_pipeline: bool,
    /// Print the IR before these passes (`all` or comma-separated names).
    #[arg(long, value_name = "PASS")]
    pub print_before: Option<String>,
    /// Print the IR after these passes (`all` or comma-separated names).
    #[arg(long, value_name = "PASS")]
    pub print_after: Option<String>,
    /// Print a unified diff of the IR for every pass that changed it.
    #[arg(long)]
    pub print_changes: bool,
    /// Print per-pass statistics (time, nodes added/removed, collectives inserted) on
    /// stderr after the program (for a training step also the memory per rank of each
    /// checkpoint policy).
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
    /// Per-rank device memory the plan must fit, in GiB (default: the device profile's:
    /// 139 for h200, 80 for h100 and a100).
    #[arg(long, value_name = "GIB")]
    pub device_memory: Option<f64>,
    /// Pinned host memory per rank the plan may hold, in GiB: offloaded activations, the
    /// host optimizer's state and streamed optimizer state (default: no limit).
    #[arg(long, value_name = "GIB")]
    pub host_memory: Option<f64>,
    /// Float dtype to compile the model in: bf16 or f32 (default: the model's own).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Print a JSON report on stdout: the step kind, the pipeline with reasons, the
    /// pass statistics and any options chosen (the program goes to -o).
    #[arg(long)]
    pub json: bool,
    /// DeepSpeed `tensor_parallel.partition_config` JSON: layer specs for tp meshes.
    #[arg(long, value_name = "FILE")]
    pub tp_spec: Option<PathBuf>,
    /// Compile the forward pass only (no backward, gradients or optimizer). The
    /// default is a whole training step: forward, autodiff, grad-sync, optimizer.
    #[arg(long, conflicts_with = "keep_grads")]
    pub forward_only: bool,
    /// Compile a training step (the default; kept so older command lines still work).
    #[arg(long, hide = true, conflicts_with = "forward_only")]
    pub train: bool,
    /// Keep the parameter gradients as outputs (`grad.*`) of a training step that
    /// updates the parameters. Off by default: a plan for training frees each gradient
    /// once its bucket's update has read it.
    #[arg(long)]
    pub keep_grads: bool,
    #[command(flatten)]
    pub train_args: super::train::TrainArgs,
}

/// `--dtype`: bf16 or f32.
pub fn parse_dtype(text: Option<&str>, flag: &str) -> CliResult<Option<weft_ir::DType>> {
    match text {
        None | Some("keep") => Ok(None),
        Some("bf16") => Ok(Some(weft_ir::DType::BF16)),
        Some("f32") => Ok(Some(weft_ir::DType::F32)),
        Some(d) => {
            Err(CliError::input(format!("invalid {flag} `{d}`")).with_help("use keep, bf16 or f32"))
        }
    }
}

#[derive(serde::Serialize)]
struct Report<'a> {
    model: &'a str,
    mesh: String,
    /// `training` or `forward`.
    step: weft_ir::plan::StepKind,
    bindings: &'a std::collections::BTreeMap<String, i64>,
    /// The training options compiled, as flags.
    #[serde(skip_serializing_if = "Option::is_none")]
    train_options: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chosen: Option<&'a weft_passes::driver::Choice>,
    pipeline: &'a weft_passes::Pipeline,
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_memory_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    predicted_time_s: Option<f64>,
    report: &'a weft_passes::RunReport,
}

pub fn run(a: Args) -> CliResult {
    if let Some(out) = &a.output {
        let mut inputs = vec![("MODEL", std::path::Path::new(&a.model))];
        inputs.extend(a.tp_spec.as_deref().map(|p| ("--tp-spec", p)));
        inputs.extend(super::device_file(&a.device).map(|p| ("--device", p)));
        super::refuse_overwrite(out, &inputs)?;
    }
    let mesh = super::parse_mesh(&a.mesh)?;
    let (model, _) = super::load_model_and_weights(&a.model, None)?;
    weft_passes::bindings::check_batch_seq(a.batch, a.seq).map_err(CliError::input)?;
    let mut req = super::request(&model, &mesh, a.tp_spec.as_deref(), &a.model)?;
    req.batch = a.batch;
    req.seq = a.seq;
    req.passes = super::parse_passes(a.passes.as_deref())?;
    req.dtype = parse_dtype(a.dtype.as_deref(), "--dtype")?;
    req.fuse = a.train_args.fuse();
    req.cp_kv = a.train_args.cp_kv()?;
    req.model = super::graph_in_dtype(&model, req.dtype)?;
    (req.device, req.device_memory) = super::device(&a.device, a.device_memory)?;
    req.host_memory = super::gib_limit("--host-memory", a.host_memory)?;
    if a.forward_only {
        a.train_args.refuse_for_forward_only()?;
    } else {
        let mut t = a.train_args.request("adamw")?;
        weft_passes::micro_batches::check_micro_batches(t.options.micro_batches, a.batch, &mesh)
            .map_err(CliError::input)?;
        t.options.grad_outputs = a.keep_grads;
        req.train = Some(t);
    }
    let wants_plan = a
        .output
        .as_ref()
        .is_some_and(|p| p.extension().is_some_and(|e| e == "json"));
    req.plan = wants_plan;
    let filter = |t: &Option<String>| -> CliResult<PassFilter> {
        t.as_deref()
            .map(PassFilter::parse)
            .transpose()
            .map(|f| f.unwrap_or_default())
            .map_err(crate::fail)
    };
    req.instrumentation = Instrumentation {
        verify_each: a.verify_each,
        print_before: filter(&a.print_before)?,
        print_after: filter(&a.print_after)?,
        print_changes: a.print_changes,
        stop_after: a.stop_after.clone(),
        ..Instrumentation::default()
    };
    let start = std::time::Instant::now();
    let c =
        weft_passes::driver::compile(&req, &mut std::io::stderr()).map_err(super::driver_err)?;
    let elapsed = start.elapsed();
    refuse_unrun_print_passes(&a, &c.pipeline.names())?;
    super::print_choice(&c);
    let g = &c.program;
    let text = weft_ir::print(g);
    let mut wrote = None;
    if let Some(p) = &a.output {
        let body = match &c.plan {
            Some(plan) => plan.to_json(),
            None => text.clone(),
        };
        super::write_out(Some(p), &body)?;
        wrote = Some(format!(
            "{} ({}) to {}",
            if c.plan.is_some() {
                "the ExecutionPlan"
            } else {
                "the program's text IR"
            },
            c.kind.name(),
            p.display()
        ));
    } else if !a.json && a.print_before.is_none() && a.print_after.is_none() && !a.print_changes {
        // The program on stdout, unless the instrumentation already printed the IR.
        print!("{text}");
    }
    if a.print_pipeline {
        eprintln!("pipeline ({}):", c.kind.name());
        eprint!("{}", c.pipeline);
    }
    if a.stats && !a.json {
        eprintln!(
            "// pass statistics (mesh {})",
            if mesh.axes.is_empty() {
                "one rank".to_string()
            } else {
                mesh.to_string()
            }
        );
        eprint!("{}", c.report.table(true));
        if let Some(t) = &c.train {
            eprint!("{}", super::train::memory_table(&req, t)?);
        }
    }
    if a.json {
        let r = Report {
            model: &g.name,
            mesh: mesh.to_string(),
            step: c.kind,
            bindings: &c.bindings.symbols,
            train_options: c.train.as_ref().map(|t| t.summary()),
            chosen: c.choice.as_ref(),
            pipeline: &c.pipeline,
            output: a.output.as_ref().map(|p| p.display().to_string()),
            peak_memory_bytes: c.plan.as_ref().map(|p| p.memory.peak_bytes),
            predicted_time_s: c.plan.as_ref().map(|p| p.cost.step_time_s),
            report: &c.report,
        };
        print!("{}", super::json(&r));
    }
    let collectives = g
        .nodes()
        .iter()
        .filter(|&&n| g.node(n).op.is_collective())
        .count();
    let plan_note = match &c.plan {
        Some(p) => format!(
            "; plan: peak {} per rank, {} {:.3} ms predicted",
            weft_passes::plan::gib(p.memory.peak_bytes),
            c.kind.time_name(),
            p.cost.step_time_s * 1e3
        ),
        None => String::new(),
    };
    eprintln!(
        "compiled the {} of {} for mesh {} ({} ranks){}: {} nodes, {} collectives, pipeline [{}] in {:.1} ms{}",
        c.kind.name(),
        g.name,
        super::mesh_text(&mesh),
        mesh.world_size(),
        c.train
            .as_ref()
            .map(|t| format!(" with {}", t.summary()))
            .unwrap_or_default(),
        g.node_count(),
        collectives,
        c.pipeline.names().join(", "),
        elapsed.as_secs_f64() * 1e3,
        plan_note
    );
    if let Some(w) = wrote {
        eprintln!("wrote {w}");
    }
    Ok(())
}

/// A pass named by --print-before / --print-after that this compile's pipeline does not
/// run printed nothing: refuse it (as --stop-after is) rather than exit 0 silently.
fn refuse_unrun_print_passes(a: &Args, pipeline: &[&str]) -> CliResult {
    for (flag, names) in [
        ("--print-before", &a.print_before),
        ("--print-after", &a.print_after),
    ] {
        let Some(text) = names else { continue };
        if let PassFilter::Only(names) = PassFilter::parse(text).map_err(crate::fail)? {
            if let Some(n) = names.iter().find(|n| !pipeline.contains(&n.as_str())) {
                return Err(CliError::input(format!(
                    "{flag} names `{n}`, which this compile's pipeline does not run, so nothing was printed"
                ))
                .with_help(format!("its passes: {}", pipeline.join(", "))));
            }
        }
    }
    Ok(())
}

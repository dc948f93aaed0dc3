//! `weft passes`: every registered pass with its summary, and the pipeline a mesh gets
//! for a training step (with `--forward-only`, for the forward pass), with the reason
//! for each position.

use crate::error::CliResult;

#[derive(clap::Args)]
pub struct Args {
    /// Show the default pipeline for this mesh.
    #[arg(long, default_value = "dp=2,sp=2")]
    mesh: String,
    /// Print {passes: [{name, summary, requires}], pipeline: [{pass, reason}]} as JSON.
    #[arg(long)]
    json: bool,
    /// The forward pipeline only (the default is a training step's, with AdamW and the
    /// training options' defaults).
    #[arg(long)]
    forward_only: bool,
}

#[derive(serde::Serialize)]
struct PassRow {
    name: &'static str,
    summary: &'static str,
    requires: Vec<&'static str>,
    mesh_axes: String,
}

#[derive(serde::Serialize)]
struct Step {
    pass: String,
    reason: String,
}

#[derive(serde::Serialize)]
struct Report {
    passes: Vec<PassRow>,
    mesh: String,
    /// `training` or `forward`.
    step: weft_ir::plan::StepKind,
    pipeline: Vec<Step>,
}

pub fn run(a: Args) -> CliResult {
    let mesh = super::parse_mesh(&a.mesh)?;
    let passes: Vec<PassRow> = weft_passes::passes()
        .iter()
        .map(|p| PassRow {
            name: p.name(),
            summary: p.summary(),
            requires: p.requires().to_vec(),
            mesh_axes: p.mesh_axes().to_string(),
        })
        .collect();
    let (step, explained) = if a.forward_only {
        (
            weft_ir::plan::StepKind::Forward,
            weft_passes::default_pipeline_explained(&mesh),
        )
    } else {
        let train = weft_passes::training::TrainOptions {
            optimizer: Some(weft_passes::training::Optimizer::adamw(1e-3)),
            ..Default::default()
        };
        (
            weft_ir::plan::StepKind::Training,
            weft_passes::training::training_pipeline(&mesh, &train),
        )
    };
    let pipeline: Vec<Step> = explained
        .steps
        .iter()
        .map(|s| Step {
            pass: s.pass.to_string(),
            reason: s.why.to_string(),
        })
        .collect();
    if a.json {
        print!(
            "{}",
            super::json(&Report {
                passes,
                mesh: mesh.to_string(),
                step,
                pipeline
            })
        );
        return Ok(());
    }
    println!("passes:");
    for p in &passes {
        println!("  {:<20} {}", p.name, p.summary);
        if !p.requires.is_empty() {
            println!("  {:<20}   requires: {}", "", p.requires.join(", "));
        }
    }
    println!("\npipeline of the {} for mesh {mesh}:", step.name());
    for (i, s) in pipeline.iter().enumerate() {
        println!("  {}. {:<20} {}", i + 1, s.pass, s.reason);
    }
    Ok(())
}

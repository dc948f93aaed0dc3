//! `weft passes`: every registered pass with its summary, and the default pipeline a
//! mesh gets, with the reason for each position.

use crate::error::CliResult;

#[derive(clap::Args)]
pub struct Args {
    /// Show the default pipeline for this mesh.
    #[arg(long, default_value = "dp=2,sp=2")]
    mesh: String,
    /// Print {passes: [{name, summary, requires}], pipeline: [{pass, reason}]} as JSON.
    #[arg(long)]
    json: bool,
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
    let pipeline: Vec<Step> = weft_passes::default_pipeline_explained(&mesh)
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
    println!("\ndefault pipeline for mesh {mesh}:");
    for (i, s) in pipeline.iter().enumerate() {
        println!("  {}. {:<20} {}", i + 1, s.pass, s.reason);
    }
    Ok(())
}

//! `weft import`: a model's IR as text (a preset, a config.json or model directory, or
//! a `.weft` file, which is parsed, verified and printed back).

use crate::error::CliResult;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json or model directory, torch.export .pt2, or .weft file.
    model: String,
    /// Write the text here instead of stdout.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// For a .pt2 archive: print what the importer recognised (attention, rope, norms,
    /// MoE) and what stays replicated, on stderr.
    #[arg(long)]
    report: bool,
    /// For a .pt2 archive: the model's HF config.json, for what the export cannot tell
    /// (Llama 3 rope scaling).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print {model, family, params, nodes, output, report} as JSON on stdout (the IR
    /// then needs -o).
    #[arg(long, requires = "output")]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    model: String,
    family: String,
    params: u64,
    nodes: usize,
    output: String,
    /// For a .pt2 archive: what the importer recognised.
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<String>,
}

pub fn run(a: Args) -> CliResult {
    if let Some(out) = &a.output {
        super::refuse_overwrite(out, &[("MODEL", std::path::Path::new(&a.model))])?;
    }
    let (m, imported) = super::load_model_and_weights(&a.model, a.config.as_deref())?;
    if a.report {
        match &imported {
            Some(i) => eprint!("{}", i.report),
            None => {
                eprintln!(
                    "{}: built from its config (nothing to recognise: every op is Weft's own)",
                    m.name
                );
                for note in m.import_notes() {
                    eprintln!("  {note}");
                }
            }
        }
    }
    super::write_out(a.output.as_deref(), &weft_ir::print(&m.graph))?;
    if a.json {
        let r = Report {
            model: m.name.clone(),
            family: m.family.as_str().to_string(),
            params: m.param_count(),
            nodes: m.graph.node_count(),
            output: a
                .output
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            report: imported.map(|i| i.report),
        };
        print!("{}", super::json(&r));
    } else if let Some(p) = &a.output {
        eprintln!(
            "wrote the IR of {} ({} nodes) to {}",
            m.name,
            m.graph.node_count(),
            p.display()
        );
    }
    Ok(())
}

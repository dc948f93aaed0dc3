//! `weft import`: a model's IR as text (a preset, a config.json or model directory, or
//! a `.weft` file, which is parsed, verified and printed back).

use crate::error::CliResult;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Preset name, config.json, model directory or .weft file.
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
}

pub fn run(a: Args) -> CliResult {
    if let Some(out) = &a.output {
        super::refuse_overwrite(out, &[("MODEL", std::path::Path::new(&a.model))])?;
    }
    let (m, imported) = super::load_model_and_weights(&a.model, a.config.as_deref())?;
    if a.report {
        match &imported {
            Some(i) => eprint!("{}", i.report),
            None => eprintln!(
                "{}: built from its config (nothing to recognise: every op is Weft's own)",
                m.name
            ),
        }
    }
    super::write_out(a.output.as_deref(), &weft_ir::print(&m.graph))
}

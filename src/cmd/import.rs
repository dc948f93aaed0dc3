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
}

pub fn run(a: Args) -> CliResult {
    let m = super::load_model(&a.model)?;
    super::write_out(a.output.as_deref(), &weft_ir::print(&m.graph))
}

//! One module per subcommand, plus the helpers they share (loading models, meshes).

pub mod check;
pub mod compile;
pub mod eval;
pub mod import;
pub mod inspect;
pub mod mesh;
pub mod models;
pub mod ops;
pub mod passes;
pub mod run;
pub mod session;
pub mod shard;
pub mod stats;

use crate::error::{CliError, CliResult};
use weft_frontends::{FrontendError, Model};
use weft_ir::Mesh;

/// A frontends error in the CLI's format, with its help line.
pub fn frontend_err(e: FrontendError) -> CliError {
    let help = e.help();
    let mut c = CliError::input(e.to_string());
    c.help = help;
    c
}

pub fn load_model(spec: &str) -> CliResult<Model> {
    weft_frontends::load(spec).map_err(frontend_err)
}

pub fn parse_mesh(text: &str) -> CliResult<Mesh> {
    Mesh::parse(text).map_err(|e| CliError::input(format!("invalid --mesh: {e}")))
}

/// Writes `text` to `path`, or stdout when no path is given.
pub fn write_out(path: Option<&std::path::Path>, text: &str) -> CliResult {
    match path {
        Some(p) => std::fs::write(p, text).map_err(|e| CliError::input(format!("cannot write {}: {e}", p.display()))),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

/// Pretty JSON of a serializable report.
pub fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).expect("reports serialize") + "\n"
}

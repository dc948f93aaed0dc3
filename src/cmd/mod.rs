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
pub mod train;

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
    Ok(load_model_and_weights(spec, None)?.0)
}

/// What `.pt2` archives bring besides the graph: their weights and the import report.
pub struct Imported {
    pub weights: std::collections::BTreeMap<String, weft_ir::HostTensor>,
    pub report: String,
}

/// Loads MODEL; a torch.export `.pt2` archive (detected by content) is imported with
/// its weights (`config`: the HF config.json for what the archive cannot tell, such as
/// Llama 3 rope scaling).
pub fn load_model_and_weights(
    spec: &str,
    config: Option<&std::path::Path>,
) -> CliResult<(Model, Option<Imported>)> {
    let path = std::path::Path::new(spec);
    if path.is_file() {
        let mut head = [0u8; 4];
        let is_zip = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
            .is_ok()
            && &head == b"PK\x03\x04";
        if is_zip {
            let bytes = std::fs::read(path)
                .map_err(|e| CliError::input(format!("cannot read {spec}: {e}")))?;
            if !weft_frontends::pt2::looks_like_pt2(&bytes) {
                return Err(CliError::input(format!(
                    "unknown model `{spec}`: a zip archive that is not a torch.export .pt2"
                )));
            }
            let opts = weft_frontends::pt2::Pt2Options {
                config: config.map(|c| c.to_path_buf()),
                ..Default::default()
            };
            let imp = weft_frontends::pt2::import_bytes(spec, bytes, &opts).map_err(|e| {
                let help = e.help();
                let mut c = CliError::input(e.to_string());
                c.help = help;
                c
            })?;
            let model = Model::from_graph(
                imp.graph,
                weft_frontends::Origin::TextIr(path.to_path_buf()),
            )
            .map_err(frontend_err)?;
            return Ok((
                model,
                Some(Imported {
                    weights: imp.weights,
                    report: imp.report.to_string(),
                }),
            ));
        }
    }
    Ok((weft_frontends::load(spec).map_err(frontend_err)?, None))
}

/// Parses a mesh and refuses axes no pass implements (they would replicate silently).
pub fn parse_mesh(text: &str) -> CliResult<Mesh> {
    let mesh = Mesh::parse(text).map_err(|e| CliError::input(format!("invalid --mesh: {e}")))?;
    weft_passes::registry::check_mesh_axes(&mesh)
        .map_err(|e| CliError::input(format!("invalid --mesh: {e}")))?;
    Ok(mesh)
}

/// Refuses an output path that is one of the command's inputs (or inside one).
pub fn refuse_overwrite(out: &std::path::Path, inputs: &[(&str, &std::path::Path)]) -> CliResult {
    weft_ir::output::refuse_overwriting_input(out, inputs).map_err(CliError::input)
}

/// Writes `text` to `path` (through a temporary renamed into place), or stdout when no
/// path is given.
pub fn write_out(path: Option<&std::path::Path>, text: &str) -> CliResult {
    match path {
        Some(p) => weft_ir::output::write_atomic(p, text.as_bytes())
            .map_err(|e| CliError::input(format!("cannot write {}: {e}", p.display()))),
        None => print_out(text),
    }
}

/// Writes `text` to stdout and flushes it: a closed pipe (`| head -1`) ends the
/// program quietly, any other failure (`> /dev/full`) is an error.
pub fn print_out(text: &str) -> CliResult {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(CliError::input(format!("cannot write to stdout: {e}"))),
    }
}

/// Pretty JSON of a serializable report.
pub fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).expect("reports serialize") + "\n"
}

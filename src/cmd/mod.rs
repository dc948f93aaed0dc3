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
pub mod plan;
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

pub fn parse_mesh(text: &str) -> CliResult<Mesh> {
    Mesh::parse(text).map_err(|e| CliError::input(format!("invalid --mesh: {e}")))
}

/// Writes `text` to `path`, or stdout when no path is given.
pub fn write_out(path: Option<&std::path::Path>, text: &str) -> CliResult {
    match path {
        Some(p) => std::fs::write(p, text)
            .map_err(|e| CliError::input(format!("cannot write {}: {e}", p.display()))),
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

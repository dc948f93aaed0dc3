//! One module per subcommand, plus the helpers they share (loading models, meshes).

pub mod check;
pub mod compile;
pub mod eval;
pub mod import;
pub mod inspect;
pub mod launch;
pub mod mesh;
pub mod models;
pub mod moe_aux_ref;
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
            // By the zip's central directory, wherever it lies (torch writes weights first).
            if !weft_frontends::pt2::is_pt2_file(path) {
                return Err(CliError::input(format!(
                    "unknown model `{spec}`: a zip archive that is not a torch.export .pt2"
                )));
            }
            let opts = weft_frontends::pt2::Pt2Options {
                config: config.map(|c| c.to_path_buf()),
                ..Default::default()
            };
            let pt2_err = |e: weft_frontends::pt2::Pt2Error| {
                let help = e.help();
                let mut c = CliError::input(e.to_string());
                c.help = help;
                c
            };
            let ar = weft_frontends::pt2::Archive::open(path).map_err(pt2_err)?;
            let imp = weft_frontends::pt2::import_archive(ar, &opts).map_err(pt2_err)?;
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
    if let Some(c) = config {
        // Only a .pt2 takes a config beside it; any other MODEL is its own config, and
        // running it while a `--config` the user gave is ignored would run another model.
        return Err(CliError::input(format!(
            "--config {} is for a torch.export .pt2 MODEL, but `{spec}` is not one",
            c.display()
        ))
        .with_help("give the config.json (or its directory) as MODEL instead"));
    }
    Ok((weft_frontends::load(spec).map_err(frontend_err)?, None))
}

/// The driver request every compiling verb starts from: the model, the mesh and the
/// config's facts the passes need (HF tp plan, model type, `--tp-spec`).
pub fn request(
    model: &Model,
    mesh: &Mesh,
    tp_spec: Option<&std::path::Path>,
    source: &str,
) -> CliResult<weft_passes::driver::Request> {
    let mut r = weft_passes::driver::Request::new(model.graph.clone(), mesh.clone());
    r.tp = shard::tp_options(model, tp_spec)?;
    r.source = source.to_string();
    // The analytic search over open training options needs layer sizes (a config).
    r.shape = plan::shape_of(model).ok();
    Ok(r)
}

/// The model's graph in `dtype`: a model built from a config is rebuilt in it, so the ops
/// HF computes in f32 whatever the model's dtype (MoE routers, norms' upcasts) keep their
/// casts; a `.weft` or `.pt2` program is converted by `convert-dtype` instead.
pub fn graph_in_dtype(model: &Model, dtype: Option<weft_ir::DType>) -> CliResult<weft_ir::Graph> {
    match (dtype, &model.config) {
        (Some(d), Some(cfg)) if cfg.dtype != d => {
            let mut cfg = cfg.clone();
            cfg.dtype = d;
            let m =
                Model::from_config(&model.name, cfg, model.origin.clone()).map_err(frontend_err)?;
            Ok(m.graph)
        }
        _ => Ok(model.graph.clone()),
    }
}

/// A driver error in the CLI's format (its `help:` lines are part of the message).
pub fn driver_err(e: weft_passes::driver::DriverError) -> CliError {
    CliError::input(e.to_string())
}

/// `--passes`: a forward pipeline given on the command line.
pub fn parse_passes(text: Option<&str>) -> CliResult<Option<weft_passes::Pipeline>> {
    text.map(weft_passes::Pipeline::parse)
        .transpose()
        .map_err(crate::fail)
}

/// `--device` and `--device-memory` (GiB; default: the profile's memory).
pub fn device(
    name: &str,
    memory_gib: Option<f64>,
) -> CliResult<(weft_ir::plan::DeviceProfile, Option<u64>)> {
    let d = weft_passes::plan::profile::load(name).map_err(CliError::input)?;
    Ok((d, gib_limit("--device-memory", memory_gib)?))
}

/// A memory limit flag given in GiB, in bytes (`None`: not given).
pub fn gib_limit(flag: &str, gib: Option<f64>) -> CliResult<Option<u64>> {
    match gib {
        None => Ok(None),
        Some(g) if g > 0.0 && g.is_finite() => Ok(Some((g * (1u64 << 30) as f64) as u64)),
        Some(g) => Err(CliError::input(format!(
            "invalid {flag} {g}: must be positive GiB"
        ))),
    }
}

/// Says on stderr what the driver chose for training options left open, and why.
pub fn print_choice(c: &weft_passes::driver::Compiled) {
    if let Some(ch) = &c.choice {
        eprintln!("chose {}: {}", ch.chosen, ch.why);
        for t in &ch.tried {
            eprintln!("  tried {t}");
        }
    }
}

/// The mesh as reports print it.
pub fn mesh_text(mesh: &Mesh) -> String {
    if mesh.axes.is_empty() {
        "(one rank)".to_string()
    } else {
        mesh.to_string()
    }
}

/// Parses a mesh and refuses axes no pass implements (they would replicate silently).
pub fn parse_mesh(text: &str) -> CliResult<Mesh> {
    let mesh = Mesh::parse(text).map_err(|e| CliError::input(format!("invalid --mesh: {e}")))?;
    weft_passes::registry::check_mesh_axes(&mesh)
        .map_err(|e| CliError::input(format!("invalid --mesh: {e}")))?;
    Ok(mesh)
}

/// Refuses an output path that is one of the command's inputs (or inside one).
/// A MODEL directory counts as the files in it (config.json, weights, index): a new
/// file written beside them destroys nothing, so only an existing file is refused.
/// A MODEL file (config.json, .weft) counts with the checkpoint beside it, which is its
/// default weights; a `--weights` index with the shards it lists.
pub fn refuse_overwrite(out: &std::path::Path, inputs: &[(&str, &std::path::Path)]) -> CliResult {
    let mut files: Vec<(&str, std::path::PathBuf)> = Vec::new();
    for (what, p) in inputs {
        match std::fs::read_dir(p) {
            Ok(entries) if what.starts_with("MODEL") => {
                if out == *p || out.canonicalize().ok() == p.canonicalize().ok() {
                    files.push((what, p.to_path_buf()));
                }
                files.extend(entries.flatten().map(|e| (*what, e.path())));
            }
            _ => {
                files.push((what, p.to_path_buf()));
                if what.starts_with("MODEL") {
                    // `config.json`'s parent is the empty path: the current directory.
                    let dir = p.parent().map(|d| {
                        if d.as_os_str().is_empty() {
                            std::path::Path::new(".")
                        } else {
                            d
                        }
                    });
                    if let Some(dir) = dir.filter(|_| p.is_file()) {
                        files.extend(
                            weft_frontends::checkpoint_files(dir)
                                .into_iter()
                                .map(|f| ("checkpoint beside the MODEL", f)),
                        );
                    }
                } else if matches!(*what, "--weights" | "checkpoint") {
                    files.extend(
                        weft_frontends::checkpoint_files(p)
                            .into_iter()
                            .map(|f| (*what, f)),
                    );
                }
            }
        }
    }
    let refs: Vec<(&str, &std::path::Path)> =
        files.iter().map(|(w, p)| (*w, p.as_path())).collect();
    weft_ir::output::refuse_overwriting_input(out, &refs).map_err(CliError::input)
}

/// A `--device` given as a profile file (not a preset name): an input to protect.
pub fn device_file(device: &str) -> Option<&std::path::Path> {
    let p = std::path::Path::new(device);
    p.is_file().then_some(p)
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

/// Rows as an aligned text table, two spaces in: the first column left-aligned, the
/// others right-aligned.
pub fn table(rows: Vec<Vec<String>>) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let w: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if i == 0 {
                    format!("{s:<w$}", w = w[i])
                } else {
                    format!("{s:>w$}", w = w[i])
                }
            })
            .collect();
        out.push_str(&format!("  {}\n", cells.join("  ")));
    }
    out
}

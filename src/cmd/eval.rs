//! `weft eval`: run a model (after the passes its mesh implies) on the CPU reference
//! runtime and write `logits`, `loss` and, with `--grads`, `grad.<param>` for every
//! trainable parameter, all gathered back to full, unsharded tensors.

use super::session::{RunArgs, Session};
use crate::error::CliResult;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    run: RunArgs,
    /// Also compute gradients of the loss for every parameter.
    #[arg(long)]
    grads: bool,
    /// Output safetensors file.
    #[arg(short, long)]
    output: PathBuf,
    /// Print {model, mesh, weights, loss, output, tensors} as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    model: String,
    mesh: String,
    weights: String,
    loss: Option<f64>,
    output: String,
    /// The tensors written, by name.
    tensors: Vec<String>,
}

pub fn run(a: Args) -> CliResult {
    // A plan given as MODEL reads the model (and the weights beside it) it was compiled
    // from: those are inputs too.
    let source = super::session::read_plan(&a.run.model)
        .ok()
        .flatten()
        .map(|p| p.source)
        .filter(|s| !s.is_empty());
    let mut inputs = a.run.input_paths();
    if let Some(src) = &source {
        inputs.push((
            "MODEL the plan was compiled from",
            std::path::Path::new(src),
        ));
    }
    super::refuse_overwrite(&a.output, &inputs)?;
    let s = Session::new(&a.run)?;
    // Gradients come from the step's backward graph (`grad.*` outputs of autodiff).
    let training = a.grads || a.run.train.any();
    let train = if training {
        Some(a.run.train.request("none")?)
    } else {
        None
    };
    let g = s.compile(a.run.passes.as_deref(), train)?;
    let mut r = s.run(&g, false)?;
    if training {
        let grads = super::train::graph_grads(&r.outputs);
        r.outputs
            .retain(|k, _| weft_ir::ValueRole::of(k) != Some(weft_ir::ValueRole::Grad));
        r.grads = grads;
    }
    let mut out = BTreeMap::new();
    for (name, t) in r.outputs {
        out.insert(name, t);
    }
    for (name, t) in r.grads {
        out.insert(weft_ir::role::grad_name(&name), t);
    }
    weft_frontends::save_safetensors(&a.output, &out).map_err(super::frontend_err)?;
    let loss = out.get("loss").map(|t| t.to_f64()[0]);
    if a.json {
        let r = Report {
            model: s.model.name.clone(),
            mesh: s.mesh.to_string(),
            weights: s.weights_from.clone(),
            loss,
            output: a.output.display().to_string(),
            tensors: out.keys().cloned().collect(),
        };
        print!("{}", super::json(&r));
        return Ok(());
    }
    eprintln!(
        "evaluated {} on mesh {} ({} weights): loss {} -> {}",
        s.model.name,
        if s.mesh.axes.is_empty() {
            "(one rank)".to_string()
        } else {
            s.mesh.to_string()
        },
        s.weights_from,
        loss.map(|l| format!("{l:.6}"))
            .unwrap_or_else(|| "(none)".into()),
        a.output.display()
    );
    Ok(())
}

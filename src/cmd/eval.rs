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
}

pub fn run(a: Args) -> CliResult {
    let s = Session::new(&a.run)?;
    let g = s.compile(a.run.passes.as_deref())?;
    let r = s.run(&g, a.grads)?;
    let mut out = BTreeMap::new();
    for (name, t) in r.outputs {
        out.insert(name, t);
    }
    for (name, t) in r.grads {
        out.insert(format!("grad.{name}"), t);
    }
    weft_frontends::save_safetensors(&a.output, &out).map_err(super::frontend_err)?;
    let loss = out.get("loss").map(|t| t.to_f64()[0]);
    eprintln!(
        "evaluated {} on mesh {} ({} weights): loss {} -> {}",
        s.model.name,
        if s.mesh.axes.is_empty() { "(one rank)".to_string() } else { s.mesh.to_string() },
        s.weights_from,
        loss.map(|l| format!("{l:.6}")).unwrap_or_else(|| "(none)".into()),
        a.output.display()
    );
    Ok(())
}

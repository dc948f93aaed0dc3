//! `weft check`: run the unsharded model and the parallel program on the same weights
//! and inputs, and compare logits, loss and (with `--train`) every parameter gradient.
//! Relative error of a tensor is max|a - b| / max|reference|; a gradient's is over the
//! larger of max|reference| and a floor of 1e-3 of the largest gradient (gradients that
//! are zero in theory are rounding noise on both sides; they are listed as noise-level).
//! Exit code 1 when a tolerance is exceeded.

use super::session::{RunArgs, Session};
use crate::error::{CliError, CliResult};
use weft_ir::tensor::{set_rel_errs, Measure, NOISE_FLOOR};
use weft_ir::HostTensor;
use weft_runtime::cpu::Precision;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    run: RunArgs,
    /// Also compare the gradients of every parameter.
    #[arg(long)]
    train: bool,
    /// Print one JSON object: {mesh, loss_ref, loss, max_rel_err_logits, max_rel_err_grads, worst_param, noise_level_grads, ok}.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    mesh: String,
    loss_ref: f64,
    loss: f64,
    max_rel_err_loss: f64,
    max_rel_err_logits: f64,
    max_rel_err_grads: f64,
    worst_param: String,
    /// Gradients whose reference is below NOISE_FLOOR x the largest gradient's max |g|
    /// (zero in theory, rounding noise on both sides): measured against that floor.
    noise_level_grads: Vec<String>,
    /// Where the program's gradients come from: `backward graph` (autodiff) or `none`.
    grads_from: String,
    tolerance_outputs: f64,
    tolerance_grads: f64,
    ok: bool,
}

pub fn run(a: Args) -> CliResult {
    let s = Session::new(&a.run)?;
    let (tol_out, tol_grad) = match s.precision {
        // FP8 rounds every linear's operands (up to 6% forward, 12% for gradients), so
        // the program is compared with the full-precision model within that error, not
        // exactly (docs/fp8.md); the op itself is checked exactly by the tests.
        _ if a.run.train.fp8 => (5e-2, 0.5),
        Precision::F64 => (1e-9, 1e-8),
        Precision::F32 => (1e-5, 1e-4),
    };
    // The reference: the unsharded model, gradients by candle's autograd. The program:
    // with --train a whole training step whose backward graph (autodiff, grad-sync and
    // the training passes the flags ask for) computes the `grad.*` outputs compared here.
    let micro = a.run.train.micro_batches.unwrap_or(1) as usize;
    let reference = if micro > 1 && s.model.graph.output("aux_loss").is_some() {
        // The MoE aux loss is per micro-batch: the reference runs each micro-batch.
        super::moe_aux_ref::micro_batch_reference(&s, micro, a.train)?
    } else {
        s.run(&s.model.graph, a.train)?
    };
    let training = a.train || a.run.train.any();
    let train = if training {
        Some(a.run.train.request("none")?)
    } else {
        None
    };
    let program = s.compile(a.run.passes.as_deref(), train)?;
    let mut got = s.run(&program, false)?;
    if training {
        got.grads = super::train::graph_grads(&got.outputs);
    }
    let out = |r: &weft_runtime::cpu::RunResult, name: &str| -> CliResult<HostTensor> {
        r.outputs
            .get(name)
            .cloned()
            .ok_or_else(|| CliError::input(format!("the program has no `{name}` output")))
    };
    let (loss_ref, loss) = (out(&reference, "loss")?, out(&got, "loss")?);
    let mut err_loss = loss.max_rel_err(&loss_ref);
    // The parts of a loss with a MoE aux term are outputs too: compared like the loss.
    for part in ["ce_loss", "aux_loss"] {
        if let Some(want) = reference.outputs.get(part) {
            err_loss = err_loss.max(out(&got, part)?.max_rel_err(want));
        }
    }
    let err_logits = out(&got, "logits")?.max_rel_err(&out(&reference, "logits")?);
    let (mut err_grads, mut worst, mut noise_level) = (0.0f64, String::new(), Vec::new());
    if a.train {
        // One set: a gradient that is zero in theory is held to a floor tied to the
        // largest gradient, not to its own rounding noise (see NOISE_FLOOR).
        for e in set_rel_errs(&got.grads, &reference.grads, Measure::MaxAbs) {
            if e.err > err_grads || worst.is_empty() || e.err.is_nan() {
                err_grads = if e.err.is_nan() {
                    f64::INFINITY
                } else {
                    err_grads.max(e.err)
                };
                worst = e.name.clone();
            }
            if e.noise_level {
                noise_level.push(e.name);
            }
        }
    }
    let ok = err_loss <= tol_out && err_logits <= tol_out && err_grads <= tol_grad;
    let r = Report {
        mesh: s.mesh.to_string(),
        loss_ref: loss_ref.to_f64()[0],
        loss: loss.to_f64()[0],
        max_rel_err_loss: err_loss,
        max_rel_err_logits: err_logits,
        max_rel_err_grads: err_grads,
        worst_param: worst,
        noise_level_grads: noise_level,
        grads_from: if a.train { "backward graph" } else { "none" }.to_string(),
        tolerance_outputs: tol_out,
        tolerance_grads: tol_grad,
        ok,
    };
    if a.json {
        print!("{}", super::json(&r));
    } else {
        println!(
            "check {} on mesh {} ({} ranks, weights {}):",
            s.model.name,
            r.mesh,
            s.mesh.world_size(),
            s.weights_from
        );
        println!(
            "  loss      reference {:.9}  parallel {:.9}  rel err {:.2e}",
            r.loss_ref, r.loss, r.max_rel_err_loss
        );
        println!("  logits    max rel err {:.2e}", r.max_rel_err_logits);
        if a.train {
            println!("  gradients max rel err {:.2e} (worst: {}; from the backward graph, reference: autograd of the unsharded model)", r.max_rel_err_grads, r.worst_param);
            if !r.noise_level_grads.is_empty() {
                println!(
                    "  noise-level gradients (reference below {NOISE_FLOOR:.0e} of the largest gradient, errors measured against that floor): {}",
                    r.noise_level_grads.join(", ")
                );
            }
        }
        println!(
            "  {} (tolerance {:.0e} outputs, {:.0e} gradients{})",
            if ok { "ok" } else { "FAILED" },
            tol_out,
            tol_grad,
            if a.run.train.fp8 {
                "; --fp8: within FP8 rounding of the full-precision model, see docs/fp8.md"
            } else {
                ""
            }
        );
    }
    if ok {
        Ok(())
    } else {
        Err(CliError::failed(format!(
            "the program for mesh {} does not match the unsharded model",
            r.mesh
        )))
    }
}

//! The reference `weft check --train --micro-batches N` compares a step with when the
//! model has a MoE load-balancing loss (`loss = ce + coef * aux`). The step takes the
//! aux per micro-batch (as HF's forward calls under gradient accumulation do), so the
//! unsharded model's single call over the whole batch is not its reference. This one
//! is: the cross-entropy over the whole batch, plus the mean over the micro-batches of
//! the weighted aux loss of the unsharded model run on each micro-batch's rows, where
//! micro-batch `m` is the `m`-th 1/N of every data-parallel rank's block (the rows the
//! `micro-batches` pass gives it); gradients likewise.

use super::session::Session;
use crate::error::{CliError, CliResult};
use std::collections::BTreeMap;
use weft_ir::{Graph, HostTensor, Op, Value};
use weft_runtime::cpu::{self, RunOptions, RunResult};

/// The loss parts of a model with a MoE aux loss: `(ce, coef * aux)` values of `g`.
fn parts(g: &Graph) -> Option<(Value, Value)> {
    let ce = g.output("ce_loss")?;
    let d = g.node(g.def(g.output("loss")?));
    match (&d.op, d.operands.as_slice()) {
        (Op::Add {}, [a, w]) if *a == ce => Some((ce, *w)),
        _ => None,
    }
}

/// The reference for `n` micro-batches on a mesh with `dp` data-parallel ranks.
pub fn micro_batch_reference(s: &Session, n: usize, train: bool) -> CliResult<RunResult> {
    let g = &s.model.graph;
    let (ce, weighted) = parts(g).ok_or_else(|| {
        CliError::input(format!(
            "{}: its loss is not `ce_loss + coef * aux_loss`, so the micro-batch reference cannot be built",
            s.model.name
        ))
    })?;
    let with_loss = |v: Value| {
        let mut h = g.clone();
        h.set_output("loss", v);
        h
    };
    let mut whole = s.run(&with_loss(ce), train)?;
    let aux_graph = with_loss(weighted);
    let (b, seq) = s.input_sizes()?;
    let b = b as usize;
    let dp = s.mesh.size("dp").unwrap_or(1) as usize;
    if !b.is_multiple_of(dp * n) {
        return Err(CliError::input(format!(
            "the batch ({b}) is not a multiple of dp x micro-batches ({dp} x {n})"
        )));
    }
    let per = b / dp / n;
    let scalar = |like: &HostTensor, x: f64| HostTensor::floats(like.dtype, vec![], vec![x]);
    let (mut weighted_mean, mut aux_mean) = (0.0, 0.0);
    let mut grads: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for m in 0..n {
        let rows: Vec<usize> = (0..dp)
            .flat_map(|r| (0..per).map(move |j| r * b / dp + m * per + j))
            .collect();
        let inputs = select_rows(&s.inputs, b, &rows);
        let opts = RunOptions::new(s.precision)
            .with_grads(train)
            .bind("B", rows.len() as i64)
            .bind("S", seq);
        let r = cpu::run(&aux_graph, &s.weights, &inputs, &opts)
            .map_err(|e| CliError::input(format!("running {} on micro-batch {m}: {e}", g.name)))?;
        let get = |k: &str| r.outputs.get(k).map(|t| t.to_f64()[0]).unwrap_or(f64::NAN);
        weighted_mean += get("loss") / n as f64;
        aux_mean += get("aux_loss") / n as f64;
        for (k, t) in &r.grads {
            let acc = grads
                .entry(k.clone())
                .or_insert_with(|| vec![0.0; t.numel()]);
            for (a, x) in acc.iter_mut().zip(t.to_f64()) {
                *a += x / n as f64;
            }
        }
    }
    let ce_value = whole.outputs["loss"].to_f64()[0];
    let like = whole.outputs["loss"].clone();
    whole
        .outputs
        .insert("ce_loss".into(), scalar(&like, ce_value));
    whole
        .outputs
        .insert("aux_loss".into(), scalar(&like, aux_mean));
    whole
        .outputs
        .insert("loss".into(), scalar(&like, ce_value + weighted_mean));
    for (k, t) in whole.grads.iter_mut() {
        if let Some(extra) = grads.get(k) {
            let sum: Vec<f64> = t.to_f64().iter().zip(extra).map(|(a, b)| a + b).collect();
            *t = HostTensor::floats(t.dtype, t.shape.clone(), sum);
        }
    }
    Ok(whole)
}

/// The listed rows (dim 0) of every input whose dim 0 is the batch `b`.
fn select_rows(
    inputs: &BTreeMap<String, HostTensor>,
    b: usize,
    rows: &[usize],
) -> BTreeMap<String, HostTensor> {
    inputs
        .iter()
        .map(|(k, t)| {
            if t.shape.first() != Some(&b) {
                return (k.clone(), t.clone());
            }
            let row = t.shape[1..].iter().product::<usize>();
            let mut shape = t.shape.clone();
            shape[0] = rows.len();
            let pick = |all: &[f64]| -> Vec<f64> {
                rows.iter()
                    .flat_map(|&r| all[r * row..(r + 1) * row].to_vec())
                    .collect()
            };
            let out = if t.dtype.is_float() {
                HostTensor::floats(t.dtype, shape, pick(&t.to_f64()))
            } else {
                let all = t.to_i64();
                let v = rows
                    .iter()
                    .flat_map(|&r| all[r * row..(r + 1) * row].to_vec())
                    .collect();
                HostTensor::ints(t.dtype, shape, v)
            };
            (k.clone(), out)
        })
        .collect()
}

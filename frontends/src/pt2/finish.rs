//! The last steps of an import, once the outputs are set: the rewrites on the Weft
//! graph (dead code, linear, rms_norm, rope, attention, ...), verification, and the
//! weights the graph's parameters and buffer inputs read.

use super::error::Pt2Error;
use super::lower::Lower;
use super::report::ImportReport;
use super::rewrite;
use super::signature::Payload;
use std::collections::BTreeMap;
use std::path::Path;
use weft_ir::{Graph, HostTensor, Op};

/// Runs the rewrites on `g` with what the lowering recorded in `lw` (which gives up its
/// report), notes a `--config` soft-cap the exported attention lacks, and verifies `g`.
pub(crate) fn rewrite(
    g: &mut Graph,
    lw: &mut Lower,
    config_attn_softcap: Option<f64>,
) -> Result<ImportReport, Pt2Error> {
    let causal = std::mem::take(&mut lw.causal);
    let mask_windows = std::mem::take(&mut lw.mask_windows);
    let mut report = std::mem::take(&mut lw.report);
    rewrite::dce(g);
    rewrite::Rewriter {
        report: &mut report,
        causal: &causal,
        windows: &mask_windows,
    }
    .run(g);
    rewrite::leftovers(g, &mut report);
    if let Some(cap) = config_attn_softcap {
        let capped = g.nodes().iter().any(|&n| {
            matches!(
                g.node(n).op,
                Op::Attention {
                    softcap: Some(_),
                    ..
                }
            )
        });
        if !capped {
            // The program is imported as exported; say where it parts from the config.
            report.notes.push(format!(
                "--config sets attn_logit_softcapping {cap}, but the exported attention has no soft-cap (transformers' SDPA path drops it; export with attn_implementation=\"eager\" to keep it)"
            ));
        }
    }
    report.weft_nodes = g.node_count();
    weft_ir::verify(g).map_err(|r| Pt2Error::Verify {
        report: r.to_string(),
    })?;
    Ok(report)
}

/// The weights of `g`: read from `--weights` when given, else the archive's stored
/// tensors for `param_names` (all of them, or an error naming the archive); plus the
/// values of the buffer inputs `g` still has.
pub(crate) fn weights(
    archive: &str,
    weights_path: Option<&Path>,
    g: &Graph,
    param_names: &[String],
    stored: &Payload,
    buffer_values: BTreeMap<String, HostTensor>,
) -> Result<BTreeMap<String, HostTensor>, Pt2Error> {
    let mut weights = match weights_path {
        Some(p) => {
            let m = crate::model::Model::from_graph(
                g.clone(),
                crate::model::Origin::TextIr(p.to_path_buf()),
            )
            .map_err(|e| Pt2Error::Weights {
                archive: archive.into(),
                message: e.to_string(),
            })?;
            crate::weights::load_weights(&m, p).map_err(|e| Pt2Error::Weights {
                archive: archive.into(),
                message: e.to_string(),
            })?
        }
        None => stored_weights(archive, param_names, stored)?,
    };
    for (name, t) in buffer_values {
        if g.inputs().iter().any(|(n, _, _)| *n == name) {
            weights.entry(name).or_insert(t);
        }
    }
    Ok(weights)
}

/// The archive's tensors for `param_names`; an error when any has empty storage.
fn stored_weights(
    archive: &str,
    param_names: &[String],
    stored: &Payload,
) -> Result<BTreeMap<String, HostTensor>, Pt2Error> {
    let mut out = BTreeMap::new();
    let mut absent = Vec::new();
    for pname in param_names {
        match stored.get(pname) {
            Some(Some(t)) => {
                out.insert(pname.clone(), t.clone());
            }
            _ => absent.push(pname.clone()),
        }
    }
    if !absent.is_empty() {
        return Err(Pt2Error::Weights {
            archive: archive.into(),
            message: format!(
                "the archive was saved without weights ({} of {} parameters have empty storage, e.g. `{}`)",
                absent.len(),
                param_names.len(),
                absent[0]
            ),
        });
    }
    Ok(out)
}

//! The program's outputs: the logits (by field name when the output is a named
//! structure) and any router logits, and the loss appended over them: HF's causal-LM
//! loss, plus the MoE load-balancing loss when the program returns router logits.

use super::error::Pt2Error;
use super::lower::{self, Lower, LV};
use super::schema::{Arg, OutputSpec};
use crate::config::MoeConfig;
use weft_ir::{DType, Graph, Op, Reduction, Value};

/// The names of the logits output and of the router logits outputs. Outputs other than
/// user values (mutated buffers, gradients) are refused, as is a program without a
/// tensor output.
pub(crate) fn model_outputs(
    outputs: &[OutputSpec],
    fields: &[(String, usize)],
) -> Result<(String, Vec<String>), Pt2Error> {
    let user_outputs: Vec<Option<String>> = outputs
        .iter()
        .map(|o| match o {
            OutputSpec::User {
                arg: Arg::Tensor(n),
            } => Some(n.clone()),
            _ => None,
        })
        .collect();
    for o in outputs {
        if let OutputSpec::Other { kind, name } = o {
            return Err(Pt2Error::Signature { message: format!("output `{name}` is a {kind}; export the forward only (no buffer mutation or gradients)") });
        }
    }
    // A named output (`MoeCausalLMOutputWithPast`): the logits by name, and the router
    // logits when exported with output_router_logits (HF's loss then has the aux term).
    let (logits_at, routers_at) = output_positions(fields);
    let logits_name = user_outputs
        .get(logits_at.unwrap_or(0))
        .cloned()
        .flatten()
        .or_else(|| user_outputs.iter().flatten().next().cloned())
        .ok_or_else(|| Pt2Error::Signature {
            message: "the program has no tensor output".into(),
        })?;
    let router_names: Vec<String> = routers_at
        .filter_map(|i| user_outputs.get(i).cloned().flatten())
        .collect();
    Ok((logits_name, router_names))
}

/// The lowered logits, which must be a float tensor `[batch, sequence, vocab]`.
pub(crate) fn logits_value(lw: &Lower, logits_name: &str) -> Result<Value, Pt2Error> {
    let logits = match lw.lv(logits_name) {
        LV::T(v) => v,
        LV::Err(e) => return Err(lower::unwrap_err(e)),
        other => {
            return Err(Pt2Error::Signature {
                message: format!("the first output is not a tensor ({other:?})"),
            })
        }
    };
    let lt = lw.g.ty(logits).clone();
    if lt.rank() != 3 || !lt.dtype.is_float() {
        return Err(Pt2Error::Signature {
            message: format!("the first output is {lt}; expected logits [batch, sequence, vocab]"),
        });
    }
    Ok(logits)
}

/// Sets the graph's outputs: `loss` (when there are `labels`), `logits`, and with an
/// aux loss also `ce_loss` and `aux_loss`. `aux` is [`aux_loss_config`]'s answer;
/// `user_inputs` are the program's inputs (an `attention_mask` refuses the aux loss).
pub(crate) fn add_outputs(
    lw: &mut Lower,
    g: &mut Graph,
    labels: Option<Value>,
    logits: Value,
    aux: Option<(f64, MoeConfig)>,
    router_names: &[String],
    user_inputs: &[String],
) -> Result<(), Pt2Error> {
    let mut loss_parts = None;
    if let Some(labels) = labels {
        loss_parts = add_loss(lw, g, labels, logits, aux, router_names, user_inputs)?;
    }
    g.set_scope(None);
    g.set_output("logits", logits);
    if let Some((ce, aux_loss)) = loss_parts {
        g.set_output("ce_loss", ce);
        g.set_output("aux_loss", aux_loss);
    }
    Ok(())
}

/// Adds HF's causal-LM loss over `logits` and `labels` (and the MoE load-balancing loss
/// when `aux` is set) as the output `loss`; returns `(ce_loss, aux_loss)` with an aux loss.
fn add_loss(
    lw: &mut Lower,
    g: &mut Graph,
    labels: Value,
    logits: Value,
    aux: Option<(f64, MoeConfig)>,
    router_names: &[String],
    user_inputs: &[String],
) -> Result<Option<(Value, Value)>, Pt2Error> {
    g.set_scope(Some("loss"));
    let build = |g: &mut Graph| -> Result<weft_ir::Value, weft_ir::BuildError> {
        let shifted = g.add(
            Op::ShiftLabels {
                ignore_index: IGNORE_INDEX,
            },
            &[labels],
        )?;
        let total = g.add(
            Op::CrossEntropy {
                ignore_index: IGNORE_INDEX,
                reduction: Reduction::Sum,
            },
            &[logits, shifted],
        )?;
        let count = g.add(
            Op::CountValid {
                ignore_index: IGNORE_INDEX,
            },
            &[shifted],
        )?;
        g.add(Op::Div {}, &[total, count])
    };
    let ce = build(g).map_err(|e| Pt2Error::Signature {
        message: format!("adding the loss: {e}"),
    })?;
    lw.report.notes.push("HF causal-LM loss added (shift_labels, cross_entropy sum / count_valid, ignore_index -100)".into());
    let Some((coef, moe)) = aux else {
        g.set_output("loss", ce);
        return Ok(None);
    };
    if user_inputs.iter().any(|u| u == "attention_mask") {
        // HF weights each router row by the mask (padding excluded).
        return Err(Pt2Error::Signature {
            message: "the program takes an `attention_mask` and returns router logits: HF's MoE load-balancing loss then weights every router row by the mask, which the importer does not implement; export without attention_mask (Weft's programs are causal over whole rows)".into(),
        });
    }
    let mut routers = Vec::new();
    for name in router_names {
        match lw.lv(name) {
            LV::T(v) => routers.push(v),
            LV::Err(e) => return Err(lower::unwrap_err(e)),
            other => {
                return Err(Pt2Error::Signature {
                    message: format!("router logits output `{name}` is not a tensor ({other:?})"),
                })
            }
        }
    }
    let (loss, aux_loss) =
        add_aux_loss(g, ce, &routers, coef, &moe).map_err(|e| Pt2Error::Signature {
            message: format!("adding the MoE load-balancing loss: {e}"),
        })?;
    g.set_output("loss", loss);
    lw.report.notes.push(format!(
        "HF MoE load-balancing loss added over the {} router logits outputs: loss = ce_loss + {coef} x aux_loss (router_aux_loss_coef, top-{} of {} experts, from --config)",
        routers.len(), moe.top_k, moe.num_experts
    ));
    Ok(Some((ce, aux_loss)))
}

/// The output positions of the `logits` field and of the `router_logits` field's
/// tensors, from the output's field names and leaf counts (none: unnamed output).
pub(crate) fn output_positions(
    fields: &[(String, usize)],
) -> (Option<usize>, std::ops::Range<usize>) {
    let (mut at, mut logits, mut routers) = (0, None, 0..0);
    for (name, leaves) in fields {
        match name.as_str() {
            "logits" => logits = Some(at),
            "router_logits" => routers = at..at + leaves,
            _ => {}
        }
        at += leaves;
    }
    (logits, routers)
}

/// The aux loss to add, `(router_aux_loss_coef, MoE fields)`, when the archive returns
/// router logits; an error where the archive and `--config` disagree or the config is
/// missing (the coefficient and top-k are not in the archive).
pub(crate) fn aux_loss_config(
    config: &Option<(String, Option<MoeConfig>)>,
    routers: usize,
    fields: &[(String, usize)],
) -> Result<Option<(f64, MoeConfig)>, Pt2Error> {
    let names = || {
        fields
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let exported = routers > 0 || fields.iter().any(|(n, _)| n == "aux_loss");
    match (exported, config) {
        (false, Some((file, Some(moe)))) if moe.aux_loss_coef.is_some() => Err(router_loss_refused(&format!(
            "--config {file} sets output_router_logits: true but the program returns no router logits (outputs: {})",
            if fields.is_empty() { "unnamed".to_string() } else { names() }
        ))),
        (false, _) => Ok(None),
        (true, None) => Err(Pt2Error::Signature {
            message: format!(
                "the program returns router logits (outputs: {}): it was exported with output_router_logits: true, and HF's loss then adds router_aux_loss_coef x the MoE load-balancing loss, whose coefficient and top-k are not in the archive; pass the model's config.json with --config",
                names()
            ),
        }),
        (true, Some((file, moe))) => match moe {
            Some(m) if routers > 0 => match m.aux_loss_coef {
                Some(coef) => Ok(Some((coef, m.clone()))),
                None => Err(router_loss_refused(&format!(
                    "the program returns router logits (exported with output_router_logits: true) but --config {file} sets it false"
                ))),
            },
            _ => Err(router_loss_refused(&format!(
                "the program returns `aux_loss` without router logits, or --config {file} has no MoE fields (outputs: {})",
                names()
            ))),
        },
    }
}

/// `loss = ce + coef * aux` with the aux loss of HF's `load_balancing_loss_func` over the
/// router logits (softmax in f32, top-k, as transformers recomputes them): (loss, aux).
fn add_aux_loss(
    g: &mut Graph,
    ce: weft_ir::Value,
    router_logits: &[weft_ir::Value],
    coef: f64,
    moe: &MoeConfig,
) -> Result<(weft_ir::Value, weft_ir::Value), weft_ir::BuildError> {
    let mut routers = Vec::new();
    for &l in router_logits {
        let source = g.node(g.def(l)).meta.source.clone();
        g.set_scope(source.as_deref());
        let mut x = l;
        if g.ty(x).dtype != DType::F32 {
            x = g.add(Op::Cast { dtype: DType::F32 }, &[x])?;
        }
        let probs = g.add(Op::Softmax { dim: -1 }, &[x])?;
        let top = g.add_multi(
            Op::Topk {
                k: moe.top_k as i64,
                dim: -1,
            },
            &[probs],
        )?;
        routers.push((probs, top[1]));
    }
    let aux = crate::build::aux_loss::aux_loss(g, &routers, moe.num_experts, moe.top_k)?;
    g.set_scope(Some("loss"));
    let weighted = g.add(
        Op::Scale {
            factor: weft_ir::Float(coef),
        },
        &[aux],
    )?;
    let loss = g.add(Op::Add {}, &[ce, weighted])?;
    Ok((loss, aux))
}

/// An archive and `--config` that disagree on HF's MoE load-balancing loss: the
/// importer cannot tell which loss HF trains with.
fn router_loss_refused(why: &str) -> Pt2Error {
    Pt2Error::Signature {
        message: format!(
            "{why}; with output_router_logits HF's loss adds router_aux_loss_coef x the MoE load-balancing loss over the router logits the program returns. Export with output_router_logits=True and pass that config.json, or neither"
        ),
    }
}

/// Labels equal to this take no part in the loss (HF's `ignore_index`).
const IGNORE_INDEX: i64 = -100;

#[cfg(test)]
mod tests {
    use super::*;

    fn user(n: &str) -> OutputSpec {
        OutputSpec::User {
            arg: Arg::Tensor(n.into()),
        }
    }

    #[test]
    fn named_outputs_find_logits_and_router_logits() {
        let outputs = [user("aux"), user("lg"), user("r0"), user("r1")];
        let fields = [
            ("aux_loss".to_string(), 1),
            ("logits".to_string(), 1),
            ("router_logits".to_string(), 2),
        ];
        let (logits, routers) = model_outputs(&outputs, &fields).unwrap();
        assert_eq!(logits, "lg");
        assert_eq!(routers, ["r0", "r1"]);
    }

    #[test]
    fn unnamed_outputs_take_the_first_tensor_as_logits() {
        let outputs = [OutputSpec::User { arg: Arg::None }, user("lg")];
        let (logits, routers) = model_outputs(&outputs, &[]).unwrap();
        assert_eq!(logits, "lg");
        assert!(routers.is_empty());
        let err = model_outputs(&[OutputSpec::User { arg: Arg::None }], &[]).unwrap_err();
        assert!(err.to_string().contains("no tensor output"), "{err}");
    }

    #[test]
    fn mutated_buffers_are_refused() {
        let outputs = [
            user("lg"),
            OutputSpec::Other {
                kind: "buffer mutation".into(),
                name: "cache".into(),
            },
        ];
        let err = model_outputs(&outputs, &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("output `cache` is a buffer mutation"),
            "{err}"
        );
    }
}

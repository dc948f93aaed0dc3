//! The Weft graph's sources, added before the nodes are lowered: `input_ids` (and
//! `labels` when the loss is added) and the other user inputs, the parameters (tied
//! ones merged), and the buffers (constants, checkpoint inputs, or deferred errors).
//! Also the set of values that depend only on sizes and buffers.

use super::archive::Archive;
use super::error::Pt2Error;
use super::fx::FxGraph;
use super::lower::{self, Lower, LV};
use super::schema::PayloadMeta;
use super::signature::TokenIds;
use std::collections::{BTreeMap, BTreeSet};
use weft_ir::{DType, Dim, HostTensor, Op, Role, TensorType, Value};

/// The type of the `input_ids` input: `[B, S]` of the recorded dtype, which must be int64.
pub(crate) fn token_ids_type(lw: &Lower, ids: &TokenIds) -> Result<TensorType, Pt2Error> {
    let ids_name = &ids.name;
    let ids_ty = lw.meta_ty(ids_name).map_err(lower::unwrap_err)?;
    let ids_ty = TensorType::new(ids_ty.dtype, vec![Dim::sym("B"), Dim::sym("S")]);
    if ids_ty.dtype != DType::I64 {
        return Err(Pt2Error::Signature {
            message: format!("input `{ids_name}` is {ids_ty}, expected int64 token ids"),
        });
    }
    Ok(ids_ty)
}

/// Adds `input_ids`, `labels` (when `add_loss`; returned) and the other user inputs,
/// whose `[batch, sequence]`-sized types take the symbols of `input_ids`.
pub(crate) fn add_inputs(
    lw: &mut Lower,
    ids_name: &str,
    ids_ty: &TensorType,
    user_inputs: &[String],
    add_loss: bool,
) -> Result<Option<Value>, Pt2Error> {
    lw.g.set_scope(Some("model"));
    let ids =
        lw.g.add(
            Op::Input {
                name: "input_ids".into(),
                role: Role::InputIds,
                ty: ids_ty.clone(),
            },
            &[],
        )
        .unwrap();
    lw.env.insert(ids_name.to_string(), LV::T(ids));
    let labels = if add_loss {
        lw.g.set_scope(Some("loss"));
        Some(
            lw.g.add(
                Op::Input {
                    name: "labels".into(),
                    role: Role::Labels,
                    ty: ids_ty.clone(),
                },
                &[],
            )
            .unwrap(),
        )
    } else {
        None
    };
    for u in user_inputs {
        if u == ids_name {
            continue;
        }
        let mut ty = lw.meta_ty(u).map_err(lower::unwrap_err)?;
        if ty.rank() == 2
            && lw.same_size(&ty.shape[0], &ids_ty.shape[0])
            && lw.same_size(&ty.shape[1], &ids_ty.shape[1])
        {
            ty.shape = ids_ty.shape.clone();
        }
        let role = match u.as_str() {
            "attention_mask" => Role::AttentionMask,
            "position_ids" => Role::PositionIds,
            "labels" => Role::Labels,
            _ => Role::Other,
        };
        lw.g.set_scope(Some("model"));
        let v =
            lw.g.add(
                Op::Input {
                    name: u.clone(),
                    role,
                    ty,
                },
                &[],
            )
            .map_err(|e| Pt2Error::Signature {
                message: e.to_string(),
            })?;
        lw.env.insert(u.clone(), LV::T(v));
    }
    Ok(labels)
}

/// Adds the parameters `(placeholder, state_dict name)`, each scoped to its module;
/// tied ones (same storage record and view in `wcfg`) are merged into the first name.
/// Returns the names of the parameters added.
pub(crate) fn add_params(
    lw: &mut Lower,
    ar: &Archive,
    wcfg: &BTreeMap<String, PayloadMeta>,
    params: &[(String, String)],
) -> Result<Vec<String>, Pt2Error> {
    let mut by_storage: BTreeMap<String, String> = BTreeMap::new();
    let mut param_names: Vec<String> = Vec::new();
    for (ph, target) in params {
        let stored = |p: &PayloadMeta| {
            ar.get(&format!("data/weights/{}", p.path_name))
                .is_some_and(|b| !b.is_empty())
        };
        if let Some(p) = wcfg.get(target).filter(|p| stored(p)) {
            let key = format!("{}|{:?}", p.path_name, p.meta);
            if let Some(first) = by_storage.get(&key) {
                lw.report.tied.push(format!("{target} -> {first}"));
                let v = lw
                    .env
                    .get(&params.iter().find(|(_, t)| t == first).unwrap().0)
                    .cloned()
                    .unwrap();
                lw.env.insert(ph.clone(), v);
                continue;
            }
            by_storage.insert(key, target.clone());
        }
        let ty = lw.meta_ty(ph).map_err(lower::unwrap_err)?;
        lw.g.set_scope(Some(module_of(target)));
        let v =
            lw.g.add(
                Op::Param {
                    name: target.clone(),
                    ty,
                },
                &[],
            )
            .map_err(|e| Pt2Error::Signature {
                message: e.to_string(),
            })?;
        lw.env.insert(ph.clone(), LV::T(v));
        param_names.push(target.clone());
    }
    Ok(param_names)
}

/// Binds each buffer of `lw.consts`: a one-element float buffer as a constant, a
/// persistent float buffer (`persistent`: placeholder → state_dict name) as an input of
/// role `buffer`, any other as a deferred error (it may only feed size-only values).
/// Returns the values of the `buffer` inputs by name.
pub(crate) fn add_buffers(
    lw: &mut Lower,
    persistent: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, HostTensor>, Pt2Error> {
    let mut buffer_values: BTreeMap<String, HostTensor> = BTreeMap::new();
    for (ph, t) in &lw.consts {
        // A one-element float buffer (gemma's `embed_scale`) is a constant: `full`.
        if t.dtype.is_float() && t.numel() == 1 {
            let ty = TensorType::new(t.dtype, t.shape.iter().map(|&d| Dim::from(d)).collect());
            lw.g.set_scope(Some("model"));
            if let Ok(v) = lw.g.add(
                Op::Full {
                    value: weft_ir::Float(t.to_f64()[0]),
                    ty,
                },
                &[],
            ) {
                lw.report.notes.push(format!(
                    "buffer `{ph}` (one element, {}) read as a constant",
                    t.to_f64()[0]
                ));
                lw.env.insert(ph.clone(), LV::T(v));
                continue;
            }
        }
        // A persistent float buffer is a checkpoint tensor: a graph input of role
        // `buffer` (read with the weights, never trained), as the config builders make.
        if let Some(target) = persistent.get(ph).filter(|_| t.dtype.is_float()) {
            let ty = TensorType::new(t.dtype, t.shape.iter().map(|&d| Dim::from(d)).collect());
            lw.g.set_scope(Some(module_of(target)));
            let v =
                lw.g.add(
                    Op::Input {
                        name: target.clone(),
                        role: Role::Buffer,
                        ty,
                    },
                    &[],
                )
                .map_err(|e| Pt2Error::Signature {
                    message: e.to_string(),
                })?;
            buffer_values.insert(target.clone(), t.clone());
            lw.env.insert(ph.clone(), LV::T(v));
            continue;
        }
        lw.env.insert(
            ph.clone(),
            LV::Err(std::rc::Rc::new(Pt2Error::UnsupportedOp {
                op: "buffer".into(),
                node: ph.clone(),
                layer: None,
                message: "a buffer is used as data outside the recognised rotary/mask computations; Weft graphs have no constant tensors".into(),
            })),
        );
    }
    Ok(buffer_values)
}

/// The module path of a state_dict name (`model.norm.weight` → `model.norm`).
fn module_of(target: &str) -> &str {
    target.rsplit_once('.').map(|(m, _)| m).unwrap_or(target)
}

/// The names of the values that depend on no model input: the buffers and constants
/// `consts`, and every node output whose tensor arguments are all such values (size
/// arithmetic, `arange`, ...).
pub(crate) fn size_only_values(
    fx: &FxGraph,
    consts: &BTreeMap<String, HostTensor>,
) -> BTreeSet<String> {
    let mut stat: BTreeSet<String> = consts.keys().cloned().collect();
    for n in &fx.nodes {
        if n.tensor_args().iter().all(|t| stat.contains(*t)) {
            stat.extend(n.outputs.iter().flatten().cloned());
        }
    }
    stat
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pt2::fx::FxNode;
    use crate::pt2::schema::Arg;

    #[test]
    fn size_only_values_follow_buffers_and_sizes_but_not_inputs() {
        let node = |op: &str, out: &str, args: Vec<Arg>| FxNode::for_test(op, out, args);
        let t = |n: &str| Arg::Tensor(n.into());
        let fx = FxGraph {
            nodes: vec![
                node("aten.arange.default", "pos", vec![Arg::Int(8)]),
                node("aten.mul.Tensor", "freqs", vec![t("inv_freq"), t("pos")]),
                node("aten.embedding.default", "h", vec![t("w"), t("input_ids")]),
                node("aten.mul.Tensor", "hs", vec![t("h"), t("freqs")]),
            ],
            ..FxGraph::default()
        };
        let consts = BTreeMap::from([(
            "inv_freq".to_string(),
            HostTensor::floats(DType::F32, vec![1], vec![1.0]),
        )]);
        let stat = size_only_values(&fx, &consts);
        assert_eq!(
            stat.into_iter().collect::<Vec<_>>(),
            ["freqs", "inv_freq", "pos"]
        );
    }

    #[test]
    fn module_of_drops_the_last_name() {
        assert_eq!(module_of("model.layers.0.mlp.weight"), "model.layers.0.mlp");
        assert_eq!(module_of("bias"), "bias");
    }
}

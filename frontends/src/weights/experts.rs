//! Hub MoE checkpoints store one tensor per expert; transformers 5 (and the graph) use
//! one fused tensor per layer. This converts, as transformers' conversion mapping does:
//!
//! - mixtral: `block_sparse_moe.` → `mlp.`; `experts.E.w1` (gate) and `w3` (up), each
//!   [I, H], concatenated per expert along dim 0 and stacked → `experts.gate_up_proj`
//!   [E, 2I, H]; `experts.E.w2` [H, I] stacked → `experts.down_proj` [E, H, I];
//! - qwen3_moe: `mlp.experts.E.gate_proj` / `up_proj` / `down_proj` likewise.
//!
//! Checkpoints already in the fused layout pass through unchanged.

use super::Checkpoint;
use crate::error::WeightProblem;
use std::collections::{BTreeMap, BTreeSet};
use weft_ir::{DType, HostTensor, TensorType};

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Part {
    Gate,
    Up,
    Down,
}

const PARTS: [Part; 3] = [Part::Gate, Part::Up, Part::Down];

/// `(experts module, expert index, part)` of a per-expert tensor name.
fn parse_key(name: &str) -> Option<(&str, usize, Part)> {
    let rest = name.strip_suffix(".weight")?;
    let (head, part) = rest.rsplit_once('.')?;
    let part = match part {
        "w1" | "gate_proj" => Part::Gate,
        "w3" | "up_proj" => Part::Up,
        "w2" | "down_proj" => Part::Down,
        _ => return None,
    };
    let (module, e) = head.rsplit_once('.')?;
    let e = e.parse().ok()?;
    module.ends_with(".experts").then_some((module, e, part))
}

fn part_name(p: Part, mixtral_style: bool) -> &'static str {
    match (p, mixtral_style) {
        (Part::Gate, true) => "w1",
        (Part::Up, true) => "w3",
        (Part::Down, true) => "w2",
        (Part::Gate, false) => "gate_proj",
        (Part::Up, false) => "up_proj",
        (Part::Down, false) => "down_proj",
    }
}

/// Converts per-expert tensors in `ck` to the fused layout. Problems found on the way
/// are pushed; the returned names are fused parameters whose problems are already
/// reported (so they are not reported missing again).
pub(super) fn fuse_experts(
    ck: &mut Checkpoint,
    params: &BTreeMap<String, TensorType>,
    problems: &mut Vec<WeightProblem>,
) -> BTreeSet<String> {
    // Mixtral's module name in Hub checkpoints; remember the file's own name for messages.
    let renames: Vec<String> = ck
        .tensors
        .keys()
        .filter(|k| k.contains(".block_sparse_moe."))
        .cloned()
        .collect();
    let mut original: BTreeMap<String, String> = BTreeMap::new();
    for old in renames {
        let new = old.replace(".block_sparse_moe.", ".mlp.");
        let t = ck.tensors.remove(&old).unwrap();
        let f = ck.files.remove(&old).unwrap_or_default();
        ck.files.insert(new.clone(), f);
        ck.tensors.insert(new.clone(), t);
        original.insert(new, old);
    }

    let mut groups: BTreeMap<String, BTreeMap<(usize, Part), String>> = BTreeMap::new();
    for k in ck.tensors.keys() {
        if let Some((module, e, part)) = parse_key(k) {
            groups
                .entry(module.to_string())
                .or_default()
                .insert((e, part), k.clone());
        }
    }

    let mut accounted = BTreeSet::new();
    for (module, keys) in groups {
        let mut parts: BTreeMap<(usize, Part), (String, HostTensor, String)> = BTreeMap::new();
        for ((e, p), k) in keys {
            let t = ck.tensors.remove(&k).unwrap();
            let f = ck.files.remove(&k).unwrap_or_default();
            let shown = original.get(&k).cloned().unwrap_or(k);
            parts.insert((e, p), (shown, t, f));
        }
        let mixtral_style = parts.values().any(|(n, _, _)| {
            n.ends_with(".w1.weight") || n.ends_with(".w2.weight") || n.ends_with(".w3.weight")
        });
        let shown_module = {
            let (n, _, _) = parts.values().next().unwrap();
            n.rsplitn(3, '.')
                .nth(2)
                .and_then(|s| s.rsplit_once('.'))
                .map(|(m, _)| m.to_string())
                .unwrap_or_else(|| module.clone())
        };
        let (gu_name, dn_name) = (
            format!("{module}.gate_up_proj"),
            format!("{module}.down_proj"),
        );
        let Some(want) = params.get(&gu_name).and_then(fused_dims) else {
            // The model has no fused experts here: every per-expert tensor is extra.
            for (shown, _, f) in parts.into_values() {
                problems.push(WeightProblem::Extra {
                    name: shown,
                    file: f,
                });
            }
            continue;
        };
        let (experts, inter, hidden) = want;
        let dtype = parts
            .values()
            .next()
            .map(|(_, t, _)| t.dtype)
            .unwrap_or(DType::F32);
        let before = problems.len();
        for e in 0..experts {
            for p in PARTS {
                let shape = if p == Part::Down {
                    vec![hidden, inter]
                } else {
                    vec![inter, hidden]
                };
                let want_ty = format!("{dtype}[{}, {}]", shape[0], shape[1]);
                match parts.get(&(e, p)) {
                    None => problems.push(WeightProblem::Missing {
                        name: format!("{shown_module}.{e}.{}.weight", part_name(p, mixtral_style)),
                        want: want_ty,
                    }),
                    Some((shown, t, f)) if t.shape != shape || t.dtype != dtype => {
                        problems.push(WeightProblem::Misshaped {
                            name: shown.clone(),
                            file: f.clone(),
                            got: super::host_type(t),
                            want: want_ty,
                        })
                    }
                    Some(_) => {}
                }
            }
        }
        for ((e, _), (shown, _, f)) in &parts {
            if *e >= experts {
                problems.push(WeightProblem::Extra {
                    name: shown.clone(),
                    file: f.clone(),
                });
            }
        }
        if problems.len() > before {
            accounted.insert(gu_name);
            accounted.insert(dn_name);
            continue;
        }

        let mut files: Vec<String> = parts.values().map(|(_, _, f)| f.clone()).collect();
        files.sort();
        files.dedup();
        let files = files.join(", ");
        let part = |e: usize, p: Part| &parts[&(e, p)].1;
        let gate_up: Vec<&HostTensor> = (0..experts)
            .flat_map(|e| [part(e, Part::Gate), part(e, Part::Up)])
            .collect();
        let down: Vec<&HostTensor> = (0..experts).map(|e| part(e, Part::Down)).collect();
        ck.tensors.insert(
            gu_name.clone(),
            stack(dtype, vec![experts, 2 * inter, hidden], &gate_up),
        );
        ck.tensors.insert(
            dn_name.clone(),
            stack(dtype, vec![experts, hidden, inter], &down),
        );
        ck.files.insert(gu_name, files.clone());
        ck.files.insert(dn_name, files);
    }
    // Renamed tensors that remain (routers) say what the file calls them.
    for (new, old) in &original {
        if let Some(f) = ck.files.get_mut(new) {
            *f = format!("{f} (as {old})");
        }
    }
    accounted
}

/// `parts` one after the other as one tensor of `shape`: their bytes, in the checkpoint's
/// dtype, where all are raw bytes of `dtype` (no widening to f64), else their values.
fn stack(dtype: weft_ir::DType, shape: Vec<usize>, parts: &[&HostTensor]) -> HostTensor {
    let raw: Option<Vec<&[u8]>> = parts
        .iter()
        .map(|t| match &t.data {
            weft_ir::HostData::Raw(b) if t.dtype == dtype => Some(b.bytes()),
            _ => None,
        })
        .collect();
    if let Some(raw) = raw {
        let bytes = weft_ir::RawBytes::owned(raw.concat());
        if let Ok(t) = HostTensor::raw(dtype, shape.clone(), bytes) {
            return t;
        }
    }
    HostTensor::floats(
        dtype,
        shape,
        parts.iter().flat_map(|t| t.to_f64()).collect(),
    )
}

/// `(E, I, H)` of a fused `gate_up_proj` [E, 2I, H] parameter.
fn fused_dims(t: &TensorType) -> Option<(usize, usize, usize)> {
    match t
        .shape
        .iter()
        .map(|d| d.as_const())
        .collect::<Option<Vec<i64>>>()?
        .as_slice()
    {
        [e, i2, h] if i2 % 2 == 0 => Some((*e as usize, (*i2 / 2) as usize, *h as usize)),
        _ => None,
    }
}

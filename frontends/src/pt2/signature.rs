//! The program's signature, read before any node is lowered: which placeholders are
//! user inputs, parameters, buffers and constants (with the stored values of the
//! latter two), and the token-id input whose `[batch, sequence]` symbols become the
//! graph's `B` and `S`.

use super::error::Pt2Error;
use super::fx::FxGraph;
use super::report::ImportReport;
use super::schema::{Arg, InputSpec, SymInt, TensorMeta};
use super::sympy;
use std::collections::BTreeMap;
use weft_ir::{Dim, HostTensor};

/// Decoded payload tensors by name (`None`: saved without storage).
pub(crate) type Payload = BTreeMap<String, Option<HostTensor>>;

/// The placeholders of a program, by role.
#[derive(Debug, Default)]
pub(crate) struct Signature {
    /// User input placeholders that are tensors, in order.
    pub user_inputs: Vec<String>,
    /// Parameters as `(placeholder, state_dict name)`.
    pub params: Vec<(String, String)>,
    /// Buffers and constants with a stored value, by placeholder.
    pub consts: BTreeMap<String, HostTensor>,
    /// Buffer and constant targets without a stored value.
    pub missing_consts: Vec<String>,
    /// Persistent buffers (placeholder -> state_dict name): checkpoint tensors that a
    /// program may read as data (DeepSeek-V3's `e_score_correction_bias`).
    pub persistent: BTreeMap<String, String>,
}

impl Signature {
    /// Sorts the input specs; buffers and constants take their values from `constants`,
    /// else `weights`. Custom objects and tokens are refused.
    pub fn read(
        inputs: &[InputSpec],
        weights: &Payload,
        constants: &Payload,
    ) -> Result<Signature, Pt2Error> {
        let mut sig = Signature::default();
        for spec in inputs {
            match spec {
                InputSpec::User {
                    arg: Arg::Tensor(n),
                } => sig.user_inputs.push(n.clone()),
                InputSpec::User { .. } | InputSpec::ConstantInput { .. } => {}
                InputSpec::Parameter { name, target } => {
                    sig.params.push((name.clone(), target.clone()))
                }
                InputSpec::Buffer {
                    name,
                    target,
                    persistent: keep,
                } if *keep => {
                    sig.persistent.insert(name.clone(), target.clone());
                    sig.bind_const(name, target, weights, constants);
                }
                InputSpec::Buffer { name, target, .. } | InputSpec::Constant { name, target } => {
                    sig.bind_const(name, target, weights, constants);
                }
                InputSpec::Other { kind } => {
                    return Err(Pt2Error::Signature {
                        message: format!(
                            "input kind `{kind}` (custom objects, tokens) is not supported"
                        ),
                    })
                }
            }
        }
        Ok(sig)
    }

    fn bind_const(&mut self, name: &str, target: &str, weights: &Payload, constants: &Payload) {
        match constants.get(target).or_else(|| weights.get(target)) {
            Some(Some(t)) => {
                self.consts.insert(name.to_string(), t.clone());
            }
            _ => self.missing_consts.push(target.to_string()),
        }
    }
}

/// The token-id input and the export symbols of its two dims.
#[derive(Debug)]
pub(crate) struct TokenIds {
    /// Its placeholder (`input_ids`, else the first tensor input).
    pub name: String,
    pub meta: TensorMeta,
    /// Export symbol → Weft dim (`s70` → `S`).
    pub symmap: BTreeMap<String, Dim>,
    /// The export symbols of the sequence and batch dims (`None`: exported static).
    pub seq_sym: Option<String>,
    pub batch_sym: Option<String>,
}

/// Finds the token-id input among `user_inputs` and maps its dims' symbols to `B` and
/// `S`, noting the mapping (and any static dim) in `report`.
pub(crate) fn token_ids(
    fx: &FxGraph,
    user_inputs: &[String],
    report: &mut ImportReport,
) -> Result<TokenIds, Pt2Error> {
    let ids_name = user_inputs
        .iter()
        .find(|n| n.as_str() == "input_ids")
        .or_else(|| user_inputs.first())
        .cloned()
        .ok_or_else(|| Pt2Error::Signature {
            message: "the program has no tensor input (export with kwargs={\"input_ids\": ids})"
                .into(),
        })?;
    let ids_meta = fx
        .tensor_meta
        .get(&ids_name)
        .ok_or_else(|| Pt2Error::Signature {
            message: format!("input `{ids_name}` has no recorded type"),
        })?
        .clone();
    if ids_meta.sizes.len() != 2 {
        return Err(Pt2Error::Signature {
            message: format!(
                "input `{ids_name}` has rank {}, expected [batch, sequence]",
                ids_meta.sizes.len()
            ),
        });
    }
    let mut symmap = BTreeMap::new();
    let (mut seq_sym, mut batch_sym) = (None, None);
    for (i, (weft, slot)) in [("B", &mut batch_sym), ("S", &mut seq_sym)]
        .into_iter()
        .enumerate()
    {
        if let SymInt::Expr { expr, .. } = &ids_meta.sizes[i] {
            match sympy::parse(expr) {
                Ok(sympy::Expr::Sym(s)) => {
                    symmap.insert(s.clone(), Dim::sym(weft));
                    report.symbols.push(format!("{s} -> {weft}"));
                    *slot = Some(s);
                }
                _ => {
                    return Err(Pt2Error::SymExpr {
                        expr: expr.clone(),
                        place: format!("dim {i} of input `{ids_name}`"),
                        message: "an input size must be a plain symbol".into(),
                    })
                }
            }
        }
    }
    if seq_sym.is_none() {
        report.notes.push(format!("static export: sequence length {} recognised as S wherever a shape follows from input_ids", ids_meta.sizes[1].clone().hint_or()));
    }
    if batch_sym.is_none() {
        report.notes.push(format!("the export fixed the batch at {}: the graph's batch is the symbol B, shapes re-derived from input_ids", ids_meta.sizes[0].clone().hint_or()));
    }
    Ok(TokenIds {
        name: ids_name,
        meta: ids_meta,
        symmap,
        seq_sym,
        batch_sym,
    })
}

impl SymInt {
    fn hint_or(self) -> i64 {
        match self {
            SymInt::Int(i) => i,
            SymInt::Expr { hint, .. } => hint.unwrap_or(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_ir::DType;

    fn one_float() -> Option<HostTensor> {
        Some(HostTensor::floats(DType::F32, vec![1], vec![0.5]))
    }

    #[test]
    fn placeholders_are_sorted_by_role() {
        let tensor = |n: &str| InputSpec::User {
            arg: Arg::Tensor(n.into()),
        };
        let buffer = |name: &str, target: &str, persistent| InputSpec::Buffer {
            name: name.into(),
            target: target.into(),
            persistent,
        };
        let inputs = [
            tensor("input_ids"),
            InputSpec::User { arg: Arg::Int(3) },
            InputSpec::Parameter {
                name: "p_w".into(),
                target: "model.w".into(),
            },
            buffer("b_inv", "rope.inv_freq", false),
            buffer("b_bias", "gate.bias", true),
            buffer("b_gone", "gone", false),
            InputSpec::Constant {
                name: "c_k".into(),
                target: "k".into(),
            },
        ];
        let weights = Payload::from([("gate.bias".into(), one_float())]);
        let constants = Payload::from([
            ("rope.inv_freq".into(), one_float()),
            ("k".into(), one_float()),
            ("gone".into(), None),
        ]);
        let sig = Signature::read(&inputs, &weights, &constants).unwrap();
        assert_eq!(sig.user_inputs, ["input_ids"]);
        assert_eq!(sig.params, [("p_w".to_string(), "model.w".to_string())]);
        assert_eq!(
            sig.consts.keys().collect::<Vec<_>>(),
            ["b_bias", "b_inv", "c_k"]
        );
        assert_eq!(sig.missing_consts, ["gone"]);
        assert_eq!(
            sig.persistent,
            BTreeMap::from([("b_bias".to_string(), "gate.bias".to_string())])
        );
    }

    #[test]
    fn custom_object_inputs_are_refused() {
        let inputs = [InputSpec::Other {
            kind: "token".into(),
        }];
        let err = Signature::read(&inputs, &Payload::new(), &Payload::new()).unwrap_err();
        assert!(err.to_string().contains("input kind `token`"), "{err}");
    }

    fn ids_graph(sizes: Vec<SymInt>) -> FxGraph {
        let meta = TensorMeta {
            dtype: 4,
            strides: vec![SymInt::Int(1); sizes.len()],
            sizes,
            storage_offset: SymInt::Int(0),
            requires_grad: false,
        };
        FxGraph {
            tensor_meta: BTreeMap::from([("input_ids".to_string(), meta)]),
            ..FxGraph::default()
        }
    }

    #[test]
    fn token_ids_map_the_sequence_symbol_to_s() {
        let fx = ids_graph(vec![
            SymInt::Int(2),
            SymInt::Expr {
                expr: "Symbol('s70', positive=True, integer=True)".into(),
                hint: Some(7),
            },
        ]);
        let mut report = ImportReport::default();
        let users = ["attention_mask".to_string(), "input_ids".to_string()];
        let ids = token_ids(&fx, &users, &mut report).unwrap();
        assert_eq!(ids.name, "input_ids");
        assert_eq!(ids.symmap, BTreeMap::from([("s70".into(), Dim::sym("S"))]));
        assert_eq!(
            (ids.seq_sym.as_deref(), ids.batch_sym.as_deref()),
            (Some("s70"), None)
        );
        assert_eq!(report.symbols, ["s70 -> S"]);
        assert!(report.notes[0].starts_with("the export fixed the batch at 2"));
    }

    #[test]
    fn token_ids_must_be_rank_two_with_plain_symbols() {
        let mut report = ImportReport::default();
        let users = ["input_ids".to_string()];
        let flat = ids_graph(vec![SymInt::Int(8)]);
        let err = token_ids(&flat, &users, &mut report).unwrap_err();
        assert!(err.to_string().contains("has rank 1"), "{err}");
        let derived = ids_graph(vec![
            SymInt::Int(2),
            SymInt::Expr {
                expr: "Mul(Integer(2), Symbol('s70', positive=True, integer=True))".into(),
                hint: None,
            },
        ]);
        let err = token_ids(&derived, &users, &mut report).unwrap_err();
        assert!(err.to_string().contains("plain symbol"), "{err}");
        let err = token_ids(&derived, &[], &mut report).unwrap_err();
        assert!(err.to_string().contains("no tensor input"), "{err}");
    }
}

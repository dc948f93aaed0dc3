//! Attention, masks and rotary tables.
//!
//! - `scaled_dot_product_attention` becomes Weft's `attention`. Its mask, when it
//!   depends only on the sequence length (HF's `create_causal_mask` chain of `arange`,
//!   `le`, `cumsum`, `index` ...), is evaluated at two probe lengths and recognised as
//!   causal if it keeps exactly `j <= i`; K and V heads repeated by `repeat_kv`
//!   (unsqueeze → expand → reshape) are un-repeated, since Weft's op does GQA itself.
//! - A size-only mask that the decomposed (core ATen) program uses as data is rebuilt
//!   from `arange` + `compare` and remembered as causal, for [`super::rewrite`].
//! - `cos`/`sin` of the rotary embedding are evaluated likewise and matched against
//!   `rope_table` frequencies: from `--config` when given, else fitted (default theta,
//!   linear scaling).

use super::consteval::{Eval, Kind, CT, CV};
use super::fx::FxNode;
use super::lower::{LErr, Lower, LR, LV};
use super::schema::Arg;
use std::collections::BTreeMap;
use weft_ir::attrs::rope_inv_freq;
use weft_ir::{CmpOp, DType, Dim, Float, Graph, Op, RopeScaling, TensorType, Value};

/// Probe lengths a size-only value is evaluated at.
const PROBES: [i64; 2] = [5, 12];

impl Lower<'_> {
    /// Evaluates a size-only value with the sequence length bound to `s`.
    pub fn probe(&self, name: &str, s: i64) -> Result<CT, String> {
        let mut syms = BTreeMap::new();
        if let Some(q) = &self.seq_sym {
            syms.insert(q.clone(), s);
        }
        if let Some(b) = &self.batch_sym {
            syms.insert(b.clone(), 2);
        }
        let mut ev = Eval::new(self.fx, syms, &self.consts);
        match ev.value(name)? {
            CV::T(t) => Ok(t),
            CV::Num(v, k) => Ok(CT {
                shape: vec![],
                data: vec![v],
                kind: k,
            }),
            CV::None => Err("None".into()),
        }
    }

    /// `Some(additive)` if the size-only value `name` is a causal mask at every probe.
    pub fn causal_kind(&self, name: &str) -> Option<bool> {
        if !self.static_vals.contains(name) {
            return None;
        }
        // A static export can only be evaluated at its own length.
        let probes: &[i64] = if self.seq_sym.is_some() {
            &PROBES
        } else {
            std::slice::from_ref(&self.s0)
        };
        let mut kind = None;
        for &s in probes {
            let t = self.probe(name, s).ok()?;
            let k = classify_causal(&t, s as usize)?;
            if kind.is_some_and(|k0| k0 != k) {
                return None;
            }
            kind = Some(k);
        }
        kind
    }

    /// Builds a causal mask of the exported type `ty` from `arange` + `compare`.
    pub fn materialize_causal(&mut self, n: &FxNode, additive: bool, ty: &TensorType) -> LR<Value> {
        let r = ty.rank();
        if r < 2 {
            return Err(self.bad(n, "mask of rank < 2"));
        }
        let (sq, sk) = (
            self.seq_dim(&ty.shape[r - 2]),
            self.seq_dim(&ty.shape[r - 1]),
        );
        if sq != sk {
            return Err(self.unsupported(n, format!("a mask of {sq} queries by {sk} keys")));
        }
        let ar = self.emit(
            n,
            Op::Arange {
                start: Dim::from(0),
                ty: TensorType::new(DType::I64, vec![sq.clone()]),
            },
            &[],
        )?;
        let rows = self.reshape(n, ar, vec![sq.clone(), Dim::from(1)])?;
        let cols = self.reshape(n, ar, vec![Dim::from(1), sq.clone()])?;
        let keep = self.emit(n, Op::Compare { op: CmpOp::Le }, &[cols, rows])?;
        let mut m = keep;
        if additive {
            let z = self.full(n, 0.0, TensorType::scalar(ty.dtype))?;
            let ninf = self.full(n, f64::NEG_INFINITY, TensorType::scalar(ty.dtype))?;
            m = self.emit(n, Op::Where {}, &[keep, z, ninf])?;
        } else if ty.dtype != DType::Bool {
            return Err(self.unsupported(n, format!("a {} keep-mask", ty.dtype)));
        }
        let mut lead = vec![Dim::from(1); r - 2];
        lead.extend([sq.clone(), sk]);
        self.causal.insert(m, additive);
        let m = self.reshape(n, m, lead)?;
        self.causal.insert(m, additive);
        // Leading dims stay 1: the mask broadcasts over batch and heads.
        Ok(m)
    }

    /// A size-only node whose own lowering failed: if it is a causal mask, rebuild it.
    pub fn rescue_static(&mut self, n: &FxNode, err: LErr) -> LR<Vec<LV>> {
        let Some(out) = n.out() else { return Err(err) };
        let Some(additive) = self.causal_kind(out) else {
            return Err(err);
        };
        let ty = self.meta_ty(out)?;
        let m = self.materialize_causal(n, additive, &ty)?;
        self.report.notes.push(format!(
            "node `{}` ({}): size-only mask evaluated at S = {:?} and rebuilt as a causal {} mask",
            n.name,
            n.scope.as_deref().unwrap_or("-"),
            PROBES,
            if additive { "additive" } else { "bool" }
        ));
        Ok(vec![LV::T(m)])
    }

    pub fn lower_sdpa(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let q = self.tensor(n, n.arg_at(0))?;
        let k = self.tensor(n, n.arg_at(1))?;
        let v = self.tensor(n, n.arg_at(2))?;
        if self.float_arg(n, n.arg("dropout_p"))? != 0.0 {
            return Err(self.unsupported(n, "attention dropout (export in eval mode)"));
        }
        let is_causal = matches!(n.arg("is_causal"), Arg::Bool(true));
        let d = self
            .g
            .ty(q)
            .shape
            .last()
            .and_then(Dim::as_const)
            .ok_or_else(|| self.unsupported(n, "symbolic head_dim"))?;
        let scale = match n.arg("scale") {
            Arg::None => 1.0 / (d as f64).sqrt(),
            a => self.float_arg(n, a)?,
        };
        let mut detail = Vec::new();
        let (causal, mask) = match n.arg("attn_mask") {
            Arg::None => {
                detail.push(if is_causal { "is_causal" } else { "no mask" });
                (is_causal, None)
            }
            Arg::Tensor(m) => match self.causal_kind(m) {
                Some(_) => {
                    detail.push("causal mask (evaluated)");
                    (true, None)
                }
                None => {
                    let mv = self.tensor(n, n.arg("attn_mask"))?;
                    if self.g.ty(mv).dtype != DType::Bool {
                        return Err(self.unsupported(n, "a float attention mask that is not causal (only bool keep-masks are supported)"));
                    }
                    if is_causal {
                        return Err(self.unsupported(n, "is_causal together with an explicit mask"));
                    }
                    detail.push("bool mask from the inputs");
                    (false, Some(mv))
                }
            },
            other => return Err(self.bad(n, format!("attn_mask is {other:?}"))),
        };
        let (mut k, mut v) = (k, v);
        if matches!(n.arg("enable_gqa"), Arg::Bool(true)) {
            detail.push("enable_gqa");
        } else if let (Some((k0, rk)), Some((v0, rv))) =
            (strip_repeat_kv(&self.g, k), strip_repeat_kv(&self.g, v))
        {
            if rk == rv {
                k = k0;
                v = v0;
                detail.push("repeat_kv undone (GQA)");
            }
        }
        let mut args = vec![q, k, v];
        args.extend(mask);
        let out = self.emit(
            n,
            Op::Attention {
                causal,
                scale: Float(scale),
                window: None,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            },
            &args,
        )?;
        self.report.recognise(
            "attention",
            n.scope.as_deref(),
            format!("sdpa: {}", detail.join(", ")),
        );
        Ok(vec![LV::T(out)])
    }

    fn positions(&mut self, n: &FxNode, s: &Dim) -> LR<Value> {
        if let Some(p) = self.positions {
            return Ok(p);
        }
        let saved = self.g.scope().map(str::to_string);
        self.g.set_scope(Some("model.rotary_emb"));
        let ar = self.emit(
            n,
            Op::Arange {
                start: Dim::from(0),
                ty: TensorType::new(DType::I64, vec![s.clone()]),
            },
            &[],
        );
        let p = ar.and_then(|ar| self.reshape(n, ar, vec![Dim::from(1), s.clone()]));
        self.g.set_scope(saved.as_deref());
        let p = p?;
        self.positions = Some(p);
        Ok(p)
    }

    /// `cos`/`sin` of the rotary embedding → an output of `rope_table`.
    pub fn lower_rope_table(&mut self, n: &FxNode) -> LR<Vec<LV>> {
        let out = n.out().ok_or_else(|| self.bad(n, "no output"))?.to_string();
        if !self.static_vals.contains(&out) {
            return Err(self.unsupported(n, "cos/sin of model data (only rotary tables, which depend on positions alone, are supported)"));
        }
        let is_cos = n.base() == "cos";
        let ty = self.out_ty(n)?;
        let r = ty.rank();
        let dim = ty
            .shape
            .last()
            .and_then(Dim::as_const)
            .ok_or_else(|| self.unsupported(n, "a rotary table of symbolic width"))?;
        if r < 2 || dim % 2 != 0 {
            return Err(self.unsupported(n, format!("a rotary table of type {ty}")));
        }
        let seq = self.seq_dim(&ty.shape[r - 2]);
        let probe = if self.seq_sym.is_some() {
            PROBES[1]
        } else {
            self.s0
        };
        let t = self
            .probe(&out, probe)
            .map_err(|e| self.unsupported(n, format!("cannot evaluate the rotary table: {e}")))?;
        let rows = table_rows(&t, probe as usize, dim as usize)
            .ok_or_else(|| self.unsupported(n, "the rotary table is not [.., S, dim]"))?;
        let f = |x: f64| if is_cos { x.cos() } else { x.sin() };
        let fits = |freqs: &[f64]| -> bool {
            rows.iter().enumerate().all(|(p, row)| {
                row.iter()
                    .enumerate()
                    .all(|(i, &val)| (val - f(p as f64 * freqs[i % freqs.len()])).abs() < 2e-4)
            })
        };
        // Candidates: the config's rope, then fits of default and linear scaling.
        let mut cands: Vec<(f64, i64, RopeScaling, &str)> = Vec::new();
        if let Some(c) = &self.rope_cfg {
            cands.push((c.theta, c.rotary_dim as i64, c.scaling, "from --config"));
        }
        // f_i from position 1: cos(f) or sin(f), with f_0 <= 1 < pi/2.
        let f1: Vec<f64> = rows
            .get(1)
            .map(|row| {
                row[..dim as usize / 2]
                    .iter()
                    .map(|&x| {
                        if is_cos {
                            x.clamp(-1.0, 1.0).acos()
                        } else {
                            x.clamp(-1.0, 1.0).asin()
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        if f1.len() >= 2 && f1[1] > 0.0 {
            let half = (dim / 2) as f64;
            let theta = (f1[1] / f1[0]).powf(-half);
            if f1[0] > 0.0 && (f1[0] - 1.0).abs() < 1e-4 {
                cands.push((round_theta(theta), dim, RopeScaling::None, "fitted"));
            } else if f1[0] > 0.0 {
                cands.push((
                    round_theta(theta),
                    dim,
                    RopeScaling::Linear {
                        factor: Float(round_sig(1.0 / f1[0])),
                    },
                    "fitted",
                ));
            }
        }
        let mut chosen = None;
        for (theta, rdim, scaling, how) in cands {
            if rdim != dim {
                continue;
            }
            let freqs = rope_inv_freq(theta, rdim as usize, &scaling, false);
            if fits(&freqs) {
                chosen = Some((theta, scaling, how));
                break;
            }
        }
        let Some((theta, scaling, how)) = chosen else {
            return Err(self.unsupported(
                n,
                "rotary frequencies not recognised (llama3/yarn scaling cannot be fitted from the table alone); pass the model's config.json with --config",
            ));
        };
        let key = format!("{theta}/{dim}/{scaling:?}");
        let cs = match self.rope_tables.iter().find(|(k, _)| *k == key) {
            Some((_, cs)) => *cs,
            None => {
                let pos = self.positions(n, &seq)?;
                let saved = self.g.scope().map(str::to_string);
                self.g.set_scope(Some("model.rotary_emb"));
                let r = self.emit_multi(
                    n,
                    Op::RopeTable {
                        theta: Float(theta),
                        dim,
                        scaling,
                    },
                    &[pos],
                );
                self.g.set_scope(saved.as_deref());
                let r = r?;
                self.report.recognise(
                    "rope_table",
                    Some("model.rotary_emb"),
                    format!("theta {theta}, dim {dim}, scaling {scaling:?} ({how})"),
                );
                self.rope_tables.push((key, [r[0], r[1]]));
                [r[0], r[1]]
            }
        };
        let mut v = cs[if is_cos { 0 } else { 1 }];
        let vt = self.ty(v);
        if vt.dtype != ty.dtype {
            v = self.cast(n, v, ty.dtype)?;
        }
        let want = self.gen_expand(&vt.shape, &ty.shape);
        if vt.shape != want {
            v = self.emit(n, Op::Expand { shape: want }, &[v])?;
        }
        Ok(vec![LV::T(v)])
    }
}

fn round_theta(t: f64) -> f64 {
    let r = t.round();
    if (r - t).abs() / t.max(1.0) < 1e-3 {
        r
    } else {
        t
    }
}

fn round_sig(x: f64) -> f64 {
    let r = (x * 1000.0).round() / 1000.0;
    if (r - x).abs() < 1e-3 * x.abs().max(1.0) {
        r
    } else {
        x
    }
}

/// Rows `[p][i]` of a `[.., S, dim]` table (first batch entry).
fn table_rows(t: &CT, s: usize, dim: usize) -> Option<Vec<Vec<f64>>> {
    let r = t.shape.len();
    if r < 2 || t.shape[r - 1] != dim || t.shape[r - 2] != s || t.kind != Kind::Float {
        return None;
    }
    Some(
        (0..s)
            .map(|p| t.data[p * dim..(p + 1) * dim].to_vec())
            .collect(),
    )
}

/// `Some(additive)` if `t` ([.., s, s]) keeps exactly `j <= i` in every leading entry.
fn classify_causal(t: &CT, s: usize) -> Option<bool> {
    let r = t.shape.len();
    if r < 2 || t.shape[r - 1] != s || t.shape[r - 2] != s {
        return None;
    }
    let additive = match t.kind {
        Kind::Bool => false,
        Kind::Float => true,
        Kind::Int => return None,
    };
    for (idx, &v) in t.data.iter().enumerate() {
        let (i, j) = ((idx / s) % s, idx % s);
        let keep = j <= i;
        let ok = if additive {
            if keep {
                v == 0.0
            } else {
                v <= -1e30
            }
        } else {
            (v != 0.0) == keep
        };
        if !ok {
            return None;
        }
    }
    Some(additive)
}

/// `(k0, rep)` if `k` is `repeat_kv(k0, rep)`: reshape [B, N*rep, S, D] of an expand
/// [B, N, rep, S, D] of k0 [B, N, S, D] reshaped to [B, N, 1, S, D].
pub fn strip_repeat_kv(g: &Graph, k: Value) -> Option<(Value, i64)> {
    let r = g.node(g.def(k));
    let Op::Reshape { shape } = &r.op else {
        return None;
    };
    if shape.len() != 4 {
        return None;
    }
    let e = g.node(g.def(r.operands[0]));
    let Op::Expand { shape: es } = &e.op else {
        return None;
    };
    if es.len() != 5 {
        return None;
    }
    let u = g.node(g.def(e.operands[0]));
    let Op::Reshape { shape: us } = &u.op else {
        return None;
    };
    let k0 = u.operands[0];
    let t0 = g.ty(k0);
    if t0.rank() != 4 || us.len() != 5 || us[2] != Dim::from(1) {
        return None;
    }
    let rep = es[2].as_const()?;
    let ok = us[0] == t0.shape[0]
        && us[1] == t0.shape[1]
        && us[3] == t0.shape[2]
        && us[4] == t0.shape[3]
        && shape[1] == t0.shape[1].clone() * rep
        && shape[2] == t0.shape[2]
        && shape[3] == t0.shape[3];
    ok.then_some((k0, rep))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_classification() {
        let s = 3;
        let keep: Vec<f64> = (0..9).map(|i| ((i % 3) <= (i / 3)) as i64 as f64).collect();
        let t = CT {
            shape: vec![2, 1, 3, 3],
            data: [keep.clone(), keep.clone()].concat(),
            kind: Kind::Bool,
        };
        assert_eq!(classify_causal(&t, s), Some(false));
        let add: Vec<f64> = keep
            .iter()
            .map(|&k| if k == 1.0 { 0.0 } else { f64::NEG_INFINITY })
            .collect();
        assert_eq!(
            classify_causal(
                &CT {
                    shape: vec![3, 3],
                    data: add,
                    kind: Kind::Float
                },
                s
            ),
            Some(true)
        );
        let mut bad = keep.clone();
        bad[1] = 1.0;
        assert_eq!(
            classify_causal(
                &CT {
                    shape: vec![3, 3],
                    data: bad,
                    kind: Kind::Bool
                },
                s
            ),
            None
        );
    }

    #[test]
    fn llama3_frequencies_hit_three_bands() {
        let s = RopeScaling::Llama3 {
            factor: Float(8.0),
            low_freq_factor: Float(0.25),
            high_freq_factor: Float(4.0),
            original_max_position_embeddings: 32,
        };
        let f = rope_inv_freq(10000.0, 8, &s, false);
        let base = rope_inv_freq(10000.0, 8, &RopeScaling::None, false);
        assert_eq!(f[0], base[0]);
        assert!((f[3] - base[3] / 8.0).abs() < 1e-12);
        assert!(f[1] < base[1] && f[1] > base[1] / 8.0 || f[2] < base[2] && f[2] > base[2] / 8.0);
    }
}

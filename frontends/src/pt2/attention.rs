//! Attention, masks and rotary tables.
//!
//! - `scaled_dot_product_attention` becomes Weft's `attention`. Its mask, when it
//!   depends only on the sequence length (HF's `create_causal_mask` and
//!   `create_sliding_window_causal_mask` chains of `arange`, `le`, `gt`, `cumsum`,
//!   `index` ...), is evaluated at probe lengths and recognised as causal if it keeps
//!   exactly `j <= i`, or as a sliding window `W` if it keeps exactly
//!   `i - W < j <= i`. The probes are 5 and 12 and, for every integer constant `c` the
//!   mask's arithmetic uses (a window is one), `c + 2`, where a window `c` shows; a
//!   constant too large to probe, or a mask that is neither at some probe, is refused.
//!   K and V heads repeated by `repeat_kv` (unsqueeze → expand → reshape) are
//!   un-repeated, since Weft's op does GQA itself.
//! - A size-only mask that the decomposed (core ATen) program uses as data is rebuilt
//!   from `arange` + `compare` and remembered as causal (with its window), for
//!   [`super::rewrite`].
//! - `cos`/`sin` of the rotary embedding are evaluated likewise and matched against
//!   `rope_table` frequencies: from `--config` when given, else fitted (default theta,
//!   linear scaling). A table half the config's rotary width (gpt-oss: one column per
//!   frequency) is the first half of the full table. The table's product with the
//!   scaling's attention factor (YaRN) is the table itself: `rope_table` includes it.

use super::consteval::{Eval, Kind, CT, CV};
use super::fx::FxNode;
use super::lower::{LErr, Lower, LR, LV};
use super::schema::Arg;
use std::collections::{BTreeMap, BTreeSet};
use weft_ir::attrs::rope_inv_freq;
use weft_ir::{CmpOp, DType, Dim, Float, Graph, Op, RopeScaling, TensorType, Value};

/// Probe lengths a size-only value is evaluated at (more for the constants it uses).
const PROBES: [i64; 2] = [5, 12];

/// The largest window the importer evaluates a mask at (`W + 2` queries by keys): the
/// evaluator holds several `[S, S]` tensors in f64.
pub const MAX_PROBED_WINDOW: i64 = 4096;

/// What a size-only mask keeps, recognised by evaluating it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskKind {
    /// Additive (0 / -inf) rather than a bool keep-mask.
    pub additive: bool,
    /// `Some(W)`: query `i` keeps `i - W < j <= i`; `None`: `j <= i`.
    pub window: Option<i64>,
}

/// Ops whose scalar operands may be a window (arithmetic and comparisons).
const ARITH: &[&str] = &[
    "add",
    "sub",
    "rsub",
    "mul",
    "gt",
    "ge",
    "lt",
    "le",
    "eq",
    "ne",
    "remainder",
    "floor_divide",
    "div",
];

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

    /// `name` and every value it is computed from (the FX graph's tensor arguments,
    /// followed back to placeholders and constants).
    fn ancestry(&self, name: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![name.to_string()];
        while let Some(v) = stack.pop() {
            if !seen.insert(v.clone()) {
                continue;
            }
            if let Some(n) = self.fx.node_of(&v) {
                stack.extend(n.tensor_args().into_iter().map(str::to_string));
            }
        }
        seen
    }

    /// The integer constants of the arithmetic on `name`'s size-only ancestry (sorted):
    /// a window, if the mask has one, is among them.
    fn mask_constants(&self, name: &str) -> Vec<i64> {
        let mut out = BTreeSet::new();
        for v in self.ancestry(name) {
            let Some(n) = self.fx.node_of(&v) else {
                continue;
            };
            if !ARITH.contains(&n.base()) {
                continue;
            }
            for (_, a) in &n.args {
                match a {
                    Arg::Int(c) => {
                        out.insert(*c);
                    }
                    Arg::Float(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => {
                        out.insert(*f as i64);
                    }
                    _ => {}
                }
            }
        }
        out.into_iter().collect()
    }

    /// The 16-bit float constants (buffers) `name` is computed from: a rotary table made
    /// from a bf16 `inv_freq` has frequencies rounded to bf16, which no theta gives.
    fn half_precision_sources(&self, name: &str) -> Vec<String> {
        self.ancestry(name)
            .into_iter()
            .filter_map(|v| {
                let c = self.consts.get(&v)?;
                (matches!(c.dtype, DType::BF16 | DType::F16)
                    && c.shape.iter().product::<usize>() > 1)
                    .then(|| format!("`{v}` ({})", c.dtype))
            })
            .collect()
    }

    /// What the size-only value `name` keeps: `Ok(None)` when it is not size-only or
    /// cannot be evaluated (it is then lowered as data), `Err` when it is a mask Weft
    /// cannot prove causal or banded at every probe length.
    pub fn mask_kind(&self, name: &str) -> Result<Option<MaskKind>, String> {
        if !self.static_vals.contains(name) {
            return Ok(None);
        }
        // A static export can only be evaluated at its own length.
        let mut probes: Vec<i64> = if self.seq_sym.is_some() {
            PROBES.to_vec()
        } else {
            vec![self.s0]
        };
        if self.seq_sym.is_some() {
            for c in self.mask_constants(name) {
                if c > MAX_PROBED_WINDOW {
                    return Err(format!(
                        "the mask's arithmetic uses the constant {c}, which may be a sliding window; Weft evaluates masks at up to {} tokens to tell, so it cannot prove this one causal or banded",
                        MAX_PROBED_WINDOW + 2
                    ));
                }
                if c >= 1 {
                    probes.push(c + 2);
                }
            }
        }
        probes.sort_unstable();
        probes.dedup();
        let mut kind: Option<MaskKind> = None;
        // (probe length, window seen there): a window W shows at every length > W
        let mut seen: Vec<(i64, Option<i64>)> = Vec::new();
        for &s in &probes {
            let Ok(t) = self.probe(name, s) else {
                return Ok(None);
            };
            let Some(k) = classify_band(&t, s as usize) else {
                let r = t.shape.len();
                if r >= 2 && t.shape[r - 1] == s as usize && t.shape[r - 2] == s as usize {
                    return Err(format!(
                        "the mask evaluated at S = {s} is neither causal nor a causal sliding window"
                    ));
                }
                return Ok(None);
            };
            if kind.is_some_and(|k0| k0.additive != k.additive) {
                return Err("the mask changes kind with the sequence length".into());
            }
            seen.push((s, k.window));
            kind = Some(match kind {
                Some(k0) if k0.window.is_some() => k0,
                _ => k,
            });
        }
        let Some(kind) = kind else { return Ok(None) };
        if let Some(w) = kind.window {
            // consistent: no window below or at W, the same W above it
            if let Some((s, got)) = seen.iter().find(|(s, got)| {
                if *s > w {
                    *got != Some(w)
                } else {
                    got.is_some()
                }
            }) {
                return Err(format!(
                    "the mask keeps a window of {w} keys at one length but {} at S = {s}",
                    match got {
                        Some(g) => format!("{g}"),
                        None => "all earlier keys".into(),
                    }
                ));
            }
        }
        Ok(Some(kind))
    }

    /// Builds a causal (or windowed causal) mask of the exported type `ty` from `arange`
    /// + `compare`.
    pub fn materialize_causal(&mut self, n: &FxNode, kind: MaskKind, ty: &TensorType) -> LR<Value> {
        let additive = kind.additive;
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
        let mut keep = self.emit(n, Op::Compare { op: CmpOp::Le }, &[cols, rows])?;
        if let Some(w) = kind.window {
            // j > i - w, as j + w > i
            let shifted = self.emit(
                n,
                Op::Arange {
                    start: Dim::from(w),
                    ty: TensorType::new(DType::I64, vec![sq.clone()]),
                },
                &[],
            )?;
            let shifted = self.reshape(n, shifted, vec![Dim::from(1), sq.clone()])?;
            let band = self.emit(n, Op::Compare { op: CmpOp::Gt }, &[shifted, rows])?;
            keep = self.emit(n, Op::Where {}, &[keep, band, keep])?;
        }
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
        // (both the mask and its reshape: rewrite peels layout ops)
        let inner = m;
        let m = self.reshape(n, m, lead)?;
        for v in [inner, m] {
            self.causal.insert(v, additive);
            if let Some(w) = kind.window {
                self.mask_windows.insert(v, w);
            }
            self.broadcast_masks.insert(v);
        }
        // Leading dims stay 1: the mask broadcasts over batch and heads.
        Ok(m)
    }

    /// A size-only float `where` of [.., S, S] (eager attention's additive mask, HF's
    /// `where(keep, 0, finfo.min)`) evaluated and rebuilt as the causal or sliding-window
    /// mask it is, so that the attention rewrite reads its window; `None` when the node
    /// is not such a value. A size-only [S, S] mask that is neither is refused.
    pub fn additive_mask(&mut self, n: &FxNode) -> LR<Option<Value>> {
        let Some(out) = n.out() else { return Ok(None) };
        if !self.static_vals.contains(out) {
            return Ok(None);
        }
        let ty = self.meta_ty(out)?;
        if !ty.dtype.is_float() || ty.rank() < 2 {
            return Ok(None);
        }
        let kind = match self.mask_kind(out) {
            Ok(Some(k)) if k.additive => k,
            Ok(_) => return Ok(None),
            Err(why) => return Err(self.unsupported(n, format!("attention mask: {why}"))),
        };
        let m = self.materialize_causal(n, kind, &ty)?;
        self.report.notes.push(format!(
            "node `{}` ({}): additive mask evaluated and rebuilt as a {} mask",
            n.name,
            n.scope.as_deref().unwrap_or("-"),
            match kind.window {
                Some(w) => format!("sliding-window ({w})"),
                None => "causal".to_string(),
            },
        ));
        Ok(Some(m))
    }

    /// A size-only node whose own lowering failed: if it is a causal (or windowed) mask,
    /// rebuild it; if it is a mask Weft cannot express, say why.
    pub fn rescue_static(&mut self, n: &FxNode, err: LErr) -> LR<Vec<LV>> {
        let Some(out) = n.out() else { return Err(err) };
        let kind = match self.mask_kind(out) {
            Ok(Some(k)) => k,
            Ok(None) => return Err(err),
            Err(why) => return Err(self.unsupported(n, format!("attention mask: {why}"))),
        };
        let ty = self.meta_ty(out)?;
        let m = self.materialize_causal(n, kind, &ty)?;
        self.report.notes.push(format!(
            "node `{}` ({}): size-only mask evaluated and rebuilt as a {} {} mask",
            n.name,
            n.scope.as_deref().unwrap_or("-"),
            match kind.window {
                Some(w) => format!("sliding-window ({w})"),
                None => "causal".to_string(),
            },
            if kind.additive { "additive" } else { "bool" }
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
        let mut window = None;
        let (causal, mask) = match n.arg("attn_mask") {
            Arg::None => {
                if is_causal {
                    // torch's `is_causal` keeps key `j` for query `i` when `j <= i` (the
                    // mask aligned top-left); Weft's aligns the last query with the last
                    // key. They agree only when there are as many queries as keys.
                    let seq = |t: TensorType| t.rank().checked_sub(2).map(|i| t.shape[i].clone());
                    let (sq, sk) = (seq(self.ty(q)), seq(self.ty(k)));
                    if sq.is_none() || sq != sk {
                        let show = |d: Option<Dim>| d.map_or("?".to_string(), |d| d.to_string());
                        let (sq, sk) = (show(sq), show(sk));
                        return Err(self.unsupported(
                            n,
                            format!(
                                "is_causal=True with {sq} queries and {sk} keys: torch aligns the causal mask top-left (query i sees keys 0..=i), Weft's attention aligns the last query with the last key; they agree only for as many queries as keys"
                            ),
                        ));
                    }
                }
                detail.push(if is_causal { "is_causal" } else { "no mask" });
                (is_causal, None)
            }
            Arg::Tensor(m) => match self.mask_kind(m) {
                Ok(Some(k)) => {
                    if is_causal {
                        return Err(self.unsupported(n, "is_causal together with an explicit mask"));
                    }
                    window = k.window;
                    detail.push(if k.window.is_some() {
                        "sliding-window causal mask (evaluated)"
                    } else {
                        "causal mask (evaluated)"
                    });
                    (true, None)
                }
                found => {
                    // Not provably causal or banded: the mask itself, as data.
                    let mv = self
                        .tensor(n, n.arg("attn_mask"))
                        .map_err(|e| match &found {
                            Err(why) => self.unsupported(n, format!("attention mask: {why}")),
                            Ok(_) => e,
                        })?;
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
                layout: weft_ir::HeadLayout::Bhsd,
                causal,
                scale: Float(scale),
                window,
                softcap: None,
                sinks: Default::default(),
                lse: Default::default(),
            },
            &args,
        )?;
        // torch's SDPA gives 0 for a query row whose keep-mask is all false (its safe
        // softmax); Weft's attention gives that row the mean of v, as HF's eager path
        // does. A mask from the data can have such rows: zero them.
        let out = match mask {
            Some(mv) => {
                let dt = self.g.ty(out).dtype;
                let m = self.cast(n, mv, dt)?;
                let kept = self.emit(
                    n,
                    Op::Max {
                        dims: vec![-1],
                        keepdim: true,
                    },
                    &[m],
                )?;
                self.emit(n, Op::Mul {}, &[out, kept])?
            }
            None => out,
        };
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
        let worst = |freqs: &[f64]| -> f64 {
            rows.iter()
                .enumerate()
                .flat_map(|(p, row)| {
                    row.iter()
                        .enumerate()
                        .map(move |(i, &val)| (val - f(p as f64 * freqs[i % freqs.len()])).abs())
                })
                .fold(0.0, f64::max)
        };
        let fits = |freqs: &[f64]| worst(freqs) < 2e-4;
        // A fitted theta holds a few digits only (an f32 cos near 1 pins a small
        // frequency loosely): of the fit and its roundings to 1-4 significant digits,
        // the one the table fits best (the fewer digits on a tie).
        let best_theta = |theta: f64, scaling: &RopeScaling| -> f64 {
            let mut best = (f64::INFINITY, theta);
            for t in nice_thetas(theta) {
                let e = worst(&rope_inv_freq(t, dim as usize, scaling, false));
                if e < best.0 {
                    best = (e, t);
                }
            }
            best.1
        };
        // Candidates: the config's rope, then fits of default and linear scaling.
        let mut cands: Vec<(f64, i64, RopeScaling, &str)> = Vec::new();
        if let Some(c) = &self.rope_cfg {
            cands.push((c.theta, c.rotary_dim as i64, c.scaling, "from --config"));
        }
        // A table already built that fits this one too (the sin of a cos fitted before):
        // one `rope_table` for both, not a second fit a rounding apart.
        for (_, [cos, _]) in &self.rope_tables {
            if let Op::RopeTable {
                theta,
                dim: rdim,
                scaling,
            } = &self.g.node(self.g.def(*cos)).op
            {
                cands.push((theta.0, *rdim, *scaling, "shared"));
            }
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
                let scaling = RopeScaling::None;
                cands.push((best_theta(theta, &scaling), dim, scaling, "fitted"));
            } else if f1[0] > 0.0 {
                let scaling = RopeScaling::Linear {
                    factor: Float(round_sig(1.0 / f1[0])),
                };
                cands.push((best_theta(theta, &scaling), dim, scaling, "fitted"));
            }
        }
        // gpt-oss's rope keeps the half-width table (one column per frequency) and
        // rotates the halves of `chunk(x, 2)`: a config rotary dim of twice the width.
        let mut half = false;
        let mut chosen = None;
        let mut misses = Vec::new();
        for (theta, rdim, scaling, how) in cands {
            if rdim != dim && !(how != "fitted" && rdim == 2 * dim) {
                continue;
            }
            let freqs = rope_inv_freq(theta, rdim as usize, &scaling, false);
            misses.push(format!("{how} theta {theta}: off by {:.2e}", worst(&freqs)));
            if fits(&freqs) {
                half = rdim != dim;
                chosen = Some((theta, scaling, how));
                break;
            }
        }
        let rdim = if half { 2 * dim } else { dim };
        // Frequencies stored in 16 bits are a theta's only to a few digits: a fit through
        // the probed positions drifts from them over a long sequence.
        let rounded = self.half_precision_sources(&out);
        if !rounded.is_empty() {
            return Err(self.unsupported(
                n,
                format!(
                    "the rotary table is computed from {}: frequencies rounded to 16 bits, which no rope theta and scaling give at every position (Weft computes them in f32{}). Export the model with its rotary buffers in float32: load it with `dtype=torch.bfloat16` (from_pretrained / from_config keep `inv_freq` in float32) rather than calling `.to(torch.bfloat16)` on it",
                    rounded.join(", "),
                    if misses.is_empty() {
                        String::new()
                    } else {
                        format!("; {}", misses.join("; "))
                    }
                ),
            ));
        }
        let Some((theta, scaling, how)) = chosen else {
            return Err(self.unsupported(
                n,
                format!(
                    "rotary frequencies not recognised{} (llama3/yarn scaling cannot be fitted from the table alone); pass the model's config.json with --config",
                    if misses.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", misses.join("; "))
                    }
                ),
            ));
        };
        let key = format!("{theta}/{rdim}/{scaling:?}");
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
                        dim: rdim,
                        scaling,
                    },
                    &[pos],
                );
                self.g.set_scope(saved.as_deref());
                let r = r?;
                self.report.recognise(
                    "rope_table",
                    Some("model.rotary_emb"),
                    format!("theta {theta}, dim {rdim}, scaling {scaling:?} ({how})"),
                );
                self.rope_tables.push((key, [r[0], r[1]]));
                [r[0], r[1]]
            }
        };
        let factor = scaling.attention_factor();
        if factor != 1.0 {
            self.expect_factor_product(n, &out, factor)?;
            self.factored_tables.insert(out.clone(), factor);
        }
        let mut v = cs[if is_cos { 0 } else { 1 }];
        if half {
            let last = self.ty(v).rank() as i64 - 1;
            v = self.emit(
                n,
                Op::Slice {
                    dim: last,
                    start: Dim::from(0),
                    len: Dim::from(dim),
                },
                &[v],
            )?;
        }
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

impl Lower<'_> {
    /// Refuses a rotary table whose scaling has an attention factor unless its only use
    /// is the product with that factor (HF's `cos() * attention_scaling`): the
    /// `rope_table` it becomes already holds the factor.
    fn expect_factor_product(&self, n: &FxNode, out: &str, factor: f64) -> LR<()> {
        let users: Vec<&FxNode> = self
            .fx
            .nodes
            .iter()
            .filter(|u| {
                u.args
                    .iter()
                    .any(|(_, a)| matches!(a, Arg::Tensor(t) if t == out))
            })
            .collect();
        let scaled = |u: &FxNode| {
            matches!(u.op.as_str(), "aten.mul.Tensor" | "aten.mul.Scalar")
                && matches!(u.arg_at(0), Arg::Tensor(t) if t == out)
                && matches!(u.arg_at(1), Arg::Float(c) if same_factor(*c, factor))
        };
        if users.is_empty() || !users.iter().all(|u| scaled(u)) {
            return Err(self.unsupported(
                n,
                format!("a rotary table with attention factor {factor} used other than multiplied by that factor"),
            ));
        }
        Ok(())
    }

    /// The `rope_table` value of `n = mul(table, attention factor)` for a table recorded
    /// in `factored_tables` (the factor is already in it).
    pub fn factored_table(&self, n: &FxNode) -> Option<Value> {
        let Arg::Tensor(t) = n.arg_at(0) else {
            return None;
        };
        let factor = *self.factored_tables.get(t)?;
        match (n.arg_at(1), self.lv(t)) {
            (Arg::Float(c), LV::T(v)) if same_factor(*c, factor) => Some(v),
            _ => None,
        }
    }
}

/// An attention factor as exported (a Python float) and as Weft resolved it.
fn same_factor(exported: f64, factor: f64) -> bool {
    (exported - factor).abs() <= 1e-12 * factor.abs()
}

/// `t` rounded to 1, 2, 3 and 4 significant digits where within 1% of it, then `t`
/// rounded to an integer (within 0.1%) or itself: the thetas a fit of `t` may mean.
fn nice_thetas(t: f64) -> Vec<f64> {
    let mut out = Vec::new();
    if t.is_finite() && t > 0.0 {
        let top = t.log10().floor() as i32;
        for digits in 1..=4 {
            let unit = 10f64.powi(top + 1 - digits);
            let r = (t / unit).round() * unit;
            if (r - t).abs() < 0.01 * t && !out.contains(&r) {
                out.push(r);
            }
        }
    }
    let r = t.round();
    out.push(if (r - t).abs() / t.max(1.0) < 1e-3 {
        r
    } else {
        t
    });
    out
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

/// The kind of `t` ([.., s, s]) if every leading entry keeps exactly `j <= i`
/// (`window: None`) or exactly `i - W < j <= i` for one `W < s`.
fn classify_band(t: &CT, s: usize) -> Option<MaskKind> {
    let r = t.shape.len();
    if r < 2 || t.shape[r - 1] != s || t.shape[r - 2] != s || s == 0 {
        return None;
    }
    let additive = match t.kind {
        Kind::Bool => false,
        Kind::Float => true,
        Kind::Int => return None,
    };
    let kept = |v: f64| -> Option<bool> {
        if additive {
            if v == 0.0 {
                Some(true)
            } else if v <= -1e30 {
                Some(false)
            } else {
                None
            }
        } else {
            Some(v != 0.0)
        }
    };
    // The window from the last row of the first entry: the keys it keeps.
    let last = &t.data[(s - 1) * s..s * s];
    let n_last = last
        .iter()
        .map(|&v| kept(v).unwrap_or(false) as usize)
        .sum::<usize>();
    let window = (n_last < s).then_some(n_last as i64);
    if window == Some(0) {
        return None;
    }
    for (idx, &v) in t.data.iter().enumerate() {
        let (i, j) = ((idx / s) % s, idx % s);
        let keep = j <= i && window.is_none_or(|w| (j as i64) > i as i64 - w);
        if kept(v)? != keep {
            return None;
        }
    }
    Some(MaskKind { additive, window })
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
        assert_eq!(
            classify_band(&t, s),
            Some(MaskKind {
                additive: false,
                window: None
            })
        );
        let add: Vec<f64> = keep
            .iter()
            .map(|&k| if k == 1.0 { 0.0 } else { f64::NEG_INFINITY })
            .collect();
        assert_eq!(
            classify_band(
                &CT {
                    shape: vec![3, 3],
                    data: add,
                    kind: Kind::Float
                },
                s
            ),
            Some(MaskKind {
                additive: true,
                window: None
            })
        );
        let mut bad = keep.clone();
        bad[1] = 1.0;
        assert_eq!(
            classify_band(
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

//! Rewrites on the lowered Weft graph that turn the decompositions HF and
//! `run_decompositions()` leave behind into the high-level ops the passes shard:
//!
//! - `linear`: `matmul(x, permute(W))` (+ bias add, inside `reshape`s) with `W` a
//!   parameter — the core-ATen form of `F.linear` (`view → mm/addmm → view`);
//! - `rms_norm`: `W * cast(cast(x) * rsqrt(mean(cast(x)^2, -1) + eps))`, and Gemma's
//!   `(cast(x) * rsqrt(..)) * (1 + cast(W))` as `rms_norm(cast(x), add_scalar(W, 1))`;
//! - `scale`: a product with a one-element constant (Gemma's `embed_scale` buffer);
//! - `rope`: `x * cos + cat(-x2, x1) * sin` with cos/sin from `rope_table`, and gpt-oss's
//!   `cat(x1*cos - x2*sin, x2*cos + x1*sin)` with the tables' first halves;
//! - `attention`: `softmax(Q K^T * c + causal bias) V` with the batch-folding reshapes of
//!   decomposed `bmm`, the fully-masked-row fix-up `where`, and `repeat_kv` on K and V;
//!   Gemma 2's soft-cap `cap * tanh(s / cap)` on the scores becomes the op's `softcap`;
//!   gpt-oss's sink column in the softmax becomes its `sinks` (see [`super::sinks`]).
//!
//! Plain pattern matching over def-use chains, run to a fixed point in program order:
//! each pattern has one root op and a fixed shape, so an e-graph would add no
//! alternatives worth exploring here (unlike `simplify`). Replaced nodes are left for
//! [`dce`]. Every match is recorded in the [`ImportReport`].

use super::attention::strip_repeat_kv;
use super::report::ImportReport;
use super::sinks::sink_softmax;
use std::collections::{BTreeMap, BTreeSet};
use weft_ir::{At, DType, Dim, Float, Graph, Node, NodeMeta, Op, Value};

fn def(g: &Graph, v: Value) -> (&Op, &[Value]) {
    let n = g.node(g.def(v));
    (&n.op, &n.operands)
}

fn is_param(g: &Graph, v: Value) -> bool {
    matches!(def(g, v).0, Op::Param { .. })
}

fn through_casts(g: &Graph, mut v: Value) -> Value {
    while let (Op::Cast { .. }, [x]) = def(g, v) {
        v = *x;
    }
    v
}

fn is_zero_full(g: &Graph, v: Value) -> bool {
    match def(g, v) {
        (Op::Full { value, .. }, _) => value.0 == 0.0,
        (Op::Expand { .. } | Op::Reshape { .. } | Op::Cast { .. }, [x]) => is_zero_full(g, *x),
        _ => false,
    }
}

/// Replaces `root` by a new node computing `op(operands)` (placed just before it).
fn replace(g: &mut Graph, root: Value, op: Op, operands: &[Value]) -> Option<Value> {
    let n = g.def(root);
    let meta = NodeMeta {
        source: g.node(n).meta.source.clone(),
        provenance: None,
        ..Default::default()
    };
    let new = g.insert_with(At::Before(n), op, operands, meta).ok()?[0];
    let new = if g.ty(new).dtype != g.ty(root).dtype {
        let meta = NodeMeta {
            source: g.node(n).meta.source.clone(),
            provenance: None,
            ..Default::default()
        };
        g.insert_with(
            At::Before(n),
            Op::Cast {
                dtype: g.ty(root).dtype,
            },
            &[new],
            meta,
        )
        .ok()?[0]
    } else {
        new
    };
    if g.ty(new) != g.ty(root) {
        return None;
    }
    g.replace_all_uses(root, new);
    Some(new)
}

fn scope_of(g: &Graph, v: Value) -> Option<String> {
    g.node(g.def(v)).meta.source.clone()
}

pub struct Rewriter<'a> {
    pub report: &'a mut ImportReport,
    /// Values known to be causal additive (`true`) or bool (`false`) masks.
    pub causal: &'a BTreeMap<Value, bool>,
    /// The sliding window of those causal masks that have one.
    pub windows: &'a BTreeMap<Value, i64>,
}

impl Rewriter<'_> {
    pub fn run(&mut self, g: &mut Graph) {
        for _ in 0..4 {
            let mut changed = false;
            let order: Vec<Node> = g.nodes().to_vec();
            for n in order {
                if g.try_node(n).is_none() {
                    continue;
                }
                let Some(&root) = g.node(n).results.first() else {
                    continue;
                };
                changed |= self.linear(g, root)
                    || self.scalar_constant(g, root)
                    || self.rms_norm(g, root)
                    || self.rope(g, root)
                    || self.half_rope(g, root)
                    || self.attention(g, root);
            }
            dce(g);
            if !changed {
                break;
            }
        }
    }

    /// `matmul(x, permute(W, [1, 0]))` → `linear(x, W)`; `linear + b` → `linear(x, W, b)`;
    /// `reshape(linear(reshape(x)))` → `linear(x)`.
    fn linear(&mut self, g: &mut Graph, root: Value) -> bool {
        match def(g, root) {
            (
                Op::Matmul {
                    transpose_a: false,
                    transpose_b,
                },
                [x, t],
            ) => {
                let (x, t, tb) = (*x, *t, *transpose_b);
                // `bmm` of a 3-D input broadcasts the weight over the batch first.
                let t = match def(g, t) {
                    (Op::Expand { .. }, [u]) if g.ty(*u).rank() == 2 => *u,
                    _ => t,
                };
                let w = if tb {
                    Some(t).filter(|&w| is_param(g, w))
                } else {
                    match def(g, t) {
                        (Op::Permute { perm }, [w]) if perm == &[1, 0] && is_param(g, *w) => {
                            Some(*w)
                        }
                        (Op::Transpose { .. }, [w]) if g.ty(*w).rank() == 2 && is_param(g, *w) => {
                            Some(*w)
                        }
                        _ => None,
                    }
                };
                let Some(w) = w else { return false };
                if g.ty(x).rank() < 2 || g.ty(w).rank() != 2 {
                    return false;
                }
                let scope = scope_of(g, root);
                if replace(g, root, Op::Linear {}, &[x, w]).is_some() {
                    self.report.recognise(
                        "linear",
                        scope.as_deref(),
                        "mm with a transposed parameter",
                    );
                    return true;
                }
                false
            }
            (Op::Add {}, [a, b]) => {
                let (a, b) = (*a, *b);
                for (l, bias) in [(a, b), (b, a)] {
                    if let (Op::Linear {}, [x, w]) = def(g, l) {
                        let (x, w) = (*x, *w);
                        let bt = g.ty(bias);
                        if is_param(g, bias)
                            && bt.rank() == 1
                            && bt.shape[0] == g.ty(w).shape[0]
                            && g.ty(root) == g.ty(l)
                        {
                            return replace(g, root, Op::Linear {}, &[x, w, bias]).is_some();
                        }
                    }
                }
                false
            }
            (Op::Reshape { shape }, [l]) => {
                let (shape, l) = (shape.clone(), *l);
                let (Op::Linear {}, ops) = def(g, l) else {
                    return false;
                };
                let ops = ops.to_vec();
                let (Op::Reshape { .. }, [x]) = def(g, ops[0]) else {
                    return false;
                };
                let x = *x;
                let xt = g.ty(x).clone();
                let mut want = xt.shape[..xt.rank().saturating_sub(1)].to_vec();
                want.push(g.ty(ops[1]).shape[0].clone());
                if want != shape || xt.shape.last() != g.ty(ops[0]).shape.last() {
                    return false;
                }
                let mut args = vec![x];
                args.extend_from_slice(&ops[1..]);
                replace(g, root, Op::Linear {}, &args).is_some()
            }
            _ => false,
        }
    }

    /// `mul(x, c)` with `c` a one-element `full` (through casts, reshapes and expands,
    /// rounded as each cast rounds) → `scale(x, c)`.
    fn scalar_constant(&mut self, g: &mut Graph, root: Value) -> bool {
        let (Op::Mul {}, [a, b]) = def(g, root) else {
            return false;
        };
        let (a, b) = (*a, *b);
        for (x, c) in [(a, b), (b, a)] {
            let Some(value) = scalar_value(g, c) else {
                continue;
            };
            if g.ty(x) != g.ty(root) {
                continue;
            }
            let scope = scope_of(g, root);
            let op = Op::Scale {
                factor: Float(value),
            };
            if replace(g, root, op, &[x]).is_some() {
                self.report
                    .recognise("scale", scope.as_deref(), format!("x {value}"));
                return true;
            }
        }
        false
    }

    /// `W * cast(cast(x) * rsqrt(mean(cast(x)^2, [-1], keepdim) + eps))` → `rms_norm(x, W, eps)`;
    /// Gemma's `(xf * rsqrt(..)) * add_scalar(cast(W), 1)` → `rms_norm(xf, add_scalar(..), eps)`
    /// (in f32, the cast back to x's dtype kept after it).
    fn rms_norm(&mut self, g: &mut Graph, root: Value) -> bool {
        let (Op::Mul {}, [a, b]) = def(g, root) else {
            return false;
        };
        let (a, b) = (*a, *b);
        for (w, y) in [(a, b), (b, a)] {
            let unit_offset = is_unit_offset_weight(g, w);
            if !(is_param(g, w) || unit_offset) || g.ty(w).rank() != 1 {
                continue;
            }
            let y = through_casts(g, y);
            let (Op::Mul {}, [p, q]) = def(g, y) else {
                continue;
            };
            let (p, q) = (*p, *q);
            for (xf, r) in [(p, q), (q, p)] {
                let (Op::Rsqrt {}, [s]) = def(g, r) else {
                    continue;
                };
                let (Op::AddScalar { value: eps }, [m]) = def(g, *s) else {
                    continue;
                };
                let eps = *eps;
                let (
                    Op::Mean {
                        dims,
                        keepdim: true,
                    },
                    [sq],
                ) = def(g, *m)
                else {
                    continue;
                };
                let rank = g.ty(xf).rank() as i64;
                if dims.len() != 1 || (dims[0] != -1 && dims[0] != rank - 1) {
                    continue;
                }
                let (Op::PowScalar { exponent }, [x2]) = def(g, *sq) else {
                    continue;
                };
                if exponent.0 != 2.0 || *x2 != xf {
                    continue;
                }
                let x = if unit_offset {
                    if g.ty(xf).dtype != g.ty(w).dtype {
                        continue;
                    }
                    xf
                } else {
                    through_casts(g, xf)
                };
                if g.ty(x).shape.last() != Some(&g.ty(w).shape[0]) || !g.ty(x).dtype.is_float() {
                    continue;
                }
                let scope = scope_of(g, root);
                if replace(g, root, Op::RmsNorm { eps }, &[x, w]).is_some() {
                    let what = if unit_offset {
                        format!("Gemma x * (1 + w), eps {}", eps.0)
                    } else {
                        format!("eps {}", eps.0)
                    };
                    self.report.recognise("rms_norm", scope.as_deref(), what);
                    return true;
                }
            }
        }
        false
    }

    /// `x * cos + cat(-x[.., D/2:], x[.., :D/2]) * sin` → `rope(x, cos, sin)`.
    fn rope(&mut self, g: &mut Graph, root: Value) -> bool {
        let (Op::Add {}, [a, b]) = def(g, root) else {
            return false;
        };
        let (a, b) = (*a, *b);
        for (m1, m2) in [(a, b), (b, a)] {
            let Some((x, cos)) = mul_pair(g, m1, |g, v| table_of(g, v, 0).is_some()) else {
                continue;
            };
            let Some((cat, sin)) = mul_pair(g, m2, |g, v| table_of(g, v, 1).is_some()) else {
                continue;
            };
            let (tc, ts) = (table_of(g, cos, 0).unwrap(), table_of(g, sin, 1).unwrap());
            if g.def(tc) != g.def(ts) || !is_rotate_half(g, cat, x) {
                continue;
            }
            if g.ty(x).rank() != 4 || g.ty(tc).shape[2] != g.ty(x).shape[3] {
                continue;
            }
            let scope = scope_of(g, root);
            if replace(
                g,
                root,
                Op::Rope {
                    layout: weft_ir::HeadLayout::Bhsd,
                },
                &[x, tc, ts],
            )
            .is_some()
            {
                self.report
                    .recognise("rope", scope.as_deref(), "x*cos + rotate_half(x)*sin");
                return true;
            }
        }
        false
    }

    /// gpt-oss's rotation of the halves with half-width tables `c`, `s` (the first
    /// halves of a `rope_table`): `cat(x1*c - x2*s, x2*c + x1*s)` with `x1, x2 =
    /// chunk(x, 2, -1)` → `rope(x, cos, sin)`, which is the same with the full tables.
    fn half_rope(&mut self, g: &mut Graph, root: Value) -> bool {
        let (Op::Concat { dim }, [first, second]) = def(g, root) else {
            return false;
        };
        let (first, second) = (*first, *second);
        let rank = g.ty(root).rank() as i64;
        if rank != 4 || (*dim != -1 && *dim != rank - 1) {
            return false;
        }
        let (Op::Sub {}, [p, q]) = def(g, first) else {
            return false;
        };
        let (p, q) = (*p, *q);
        let (Op::Add {}, [r, t]) = def(g, second) else {
            return false;
        };
        let (r, t) = (*r, *t);
        let cos = |g: &Graph, v: Value| half_table_of(g, v, 0).is_some();
        let sin = |g: &Graph, v: Value| half_table_of(g, v, 1).is_some();
        let (Some((x1, c)), Some((x2, s))) = (mul_pair(g, p, cos), mul_pair(g, q, sin)) else {
            return false;
        };
        let second_ok = [(r, t), (t, r)].into_iter().any(|(u, w)| {
            matches!((mul_pair(g, u, cos), mul_pair(g, w, sin)), (Some((a, c2)), Some((b, s2))) if a == x2 && b == x1 && c2 == c && s2 == s)
        });
        if !second_ok {
            return false;
        }
        let Some(x) = halves_of(g, x1, x2) else {
            return false;
        };
        let (tc, ts) = (
            half_table_of(g, c, 0).unwrap(),
            half_table_of(g, s, 1).unwrap(),
        );
        if g.def(tc) != g.def(ts) || g.ty(tc).shape.last() != g.ty(x).shape.last() {
            return false;
        }
        let scope = scope_of(g, root);
        let what = if is_deinterleaved(g, x) {
            "cat(x1*cos - x2*sin, x2*cos + x1*sin) of x1, x2 = x[..., 0::2], x[..., 1::2] (interleaved pairs, de-interleaved; half-width tables)"
        } else {
            "cat(x1*cos - x2*sin, x2*cos + x1*sin) of chunk(x, 2) (half-width tables)"
        };
        if replace(
            g,
            root,
            Op::Rope {
                layout: weft_ir::HeadLayout::Bhsd,
            },
            &[x, tc, ts],
        )
        .is_some()
        {
            self.report.recognise("rope", scope.as_deref(), what);
            return true;
        }
        false
    }

    /// Decomposed attention: `reshape(matmul(reshape(P), reshape(V)))` with
    /// `P = softmax(reshape(matmul(reshape(Q*c1), reshape(permute(K)*c2))) + causal)`.
    fn attention(&mut self, g: &mut Graph, root: Value) -> bool {
        let rt = g.ty(root).clone();
        if rt.rank() != 4 {
            return false;
        }
        let mm = match def(g, root) {
            (Op::Reshape { .. }, [m]) => *m,
            (Op::Matmul { .. }, _) => root,
            _ => return false,
        };
        let (
            Op::Matmul {
                transpose_a: false,
                transpose_b: false,
            },
            [p3, v3],
        ) = def(g, mm)
        else {
            return false;
        };
        let (p3, v3) = (*p3, *v3);
        let p4 = peel_to_rank4(g, p3);
        let v4 = peel_to_rank4(g, v3);
        let (Some(p4), Some(v4)) = (p4, v4) else {
            return false;
        };
        // Fix-up `where(all_masked, 0, P)` around the softmax.
        let mut psm = through_casts(g, p4);
        if let (Op::Where {}, [c, z, p]) = def(g, p4) {
            let (c, z, p) = (*c, *z, *p);
            if let (Op::Softmax { .. }, [x]) = def(g, p) {
                if is_zero_full(g, z) && cone_only(g, c, *x) {
                    psm = p;
                }
            }
        }
        let (x, sinks) = match sink_softmax(g, psm) {
            Some((x, sinks)) => (x, Some(sinks)),
            None => {
                let (Op::Softmax { dim }, [x]) = def(g, psm) else {
                    return false;
                };
                if *dim != -1 && *dim != 3 {
                    return false;
                }
                (*x, None)
            }
        };
        let x = through_casts(g, x);
        let (scores, causal, window) = match def(g, x) {
            (Op::Add {}, [s, m]) | (Op::Add {}, [m, s]) if self.causal_bias(g, *m).is_some() => {
                (*s, true, self.causal_bias(g, *m).flatten())
            }
            (Op::Add {}, _) => return false,
            _ => (x, false, None),
        };
        // Gemma 2 caps the scores: `cap * tanh(s / cap)` (before the mask).
        let (scores, softcap) = match softcapped(g, scores) {
            Some((s, cap)) => (s, Some(cap)),
            None => (scores, None),
        };
        // Eager attention scales the scores rather than q and k.
        let (scores, c0) = unscale(g, scores);
        let qk = match def(g, scores) {
            (Op::Reshape { .. }, [m]) => *m,
            (Op::Matmul { .. }, _) => scores,
            _ => return false,
        };
        let (
            Op::Matmul {
                transpose_a: false,
                transpose_b: false,
            },
            [q3, k3],
        ) = def(g, qk)
        else {
            return false;
        };
        let (q3, k3) = (*q3, *k3);
        let (Some(qs), Some(kt)) = (peel_to_rank4(g, q3), peel_to_rank4(g, k3)) else {
            return false;
        };
        let (q, c1) = unscale(g, qs);
        let (kt, c2) = unscale(g, kt);
        let k = match def(g, kt) {
            (Op::Permute { perm }, [k]) if perm == &[0, 1, 3, 2] => *k,
            (Op::Transpose { dim0, dim1 }, [k])
                if matches!((dim0, dim1), (2, 3) | (3, 2) | (-1, -2) | (-2, -1)) =>
            {
                *k
            }
            _ => return false,
        };
        let (k, c3) = unscale(g, k);
        let (q, v) = (q, v4);
        let scale = c0 * c1 * c2 * c3;
        let (k, v, gqa) = match (strip_repeat_kv(g, k), strip_repeat_kv(g, v)) {
            (Some((k0, r1)), Some((v0, r2))) if r1 == r2 => (k0, v0, true),
            _ => (k, v, false),
        };
        let (qt, kt_, vt) = (g.ty(q).clone(), g.ty(k).clone(), g.ty(v).clone());
        if qt.rank() != 4 || kt_.rank() != 4 || vt.rank() != 4 {
            return false;
        }
        // The result is [B, heads, S, Dv]: q's shape with V's head dim (MLA's differs).
        if qt.dtype != rt.dtype || qt.shape[..3] != rt.shape[..3] || vt.shape[3] != rt.shape[3] {
            return false;
        }
        if let Some(s) = sinks {
            if g.ty(s).shape[0] != qt.shape[1] {
                return false;
            }
        }
        let scope = scope_of(g, root);
        let operands: Vec<Value> = [q, k, v].into_iter().chain(sinks).collect();
        if replace(
            g,
            root,
            Op::Attention {
                layout: weft_ir::HeadLayout::Bhsd,
                causal,
                scale: Float(scale),
                window,
                softcap: softcap.map(Float),
                sinks: sinks.is_some().into(),
                lse: Default::default(),
            },
            &operands,
        )
        .is_some()
        {
            self.report.recognise(
                "attention",
                scope.as_deref(),
                format!(
                    "{} softmax({}QK^T)V{}{}{}",
                    if c0 != 1.0 { "eager" } else { "decomposed" },
                    match softcap {
                        Some(c) => format!("soft-capped ({c}) "),
                        None => String::new(),
                    },
                    match (causal, window) {
                        (true, Some(w)) => format!(", sliding-window ({w}) causal bias"),
                        (true, None) => ", causal bias".to_string(),
                        _ => ", no mask".to_string(),
                    },
                    if gqa { ", repeat_kv undone (GQA)" } else { "" },
                    if sinks.is_some() {
                        ", sink column in the softmax"
                    } else {
                        ""
                    }
                ),
            );
            return true;
        }
        false
    }
}

impl Rewriter<'_> {
    /// A causal additive bias (remembered as one, or `where(causal keep-mask, 0, -inf)`)
    /// with its window, if it has one: `Some(window)`, or `None` when `v` is not one.
    fn causal_bias(&self, g: &Graph, v: Value) -> Option<Option<i64>> {
        let v = peel_layout(g, v);
        if self.causal.get(&v) == Some(&true) {
            return Some(self.windows.get(&v).copied());
        }
        let (Op::Where {}, [c, z, ninf]) = def(g, v) else {
            return None;
        };
        let is_ninf = match def(g, peel_layout(g, *ninf)) {
            (Op::Full { value, .. }, _) => value.0 == f64::NEG_INFINITY || value.0 <= -1e30,
            _ => false,
        };
        if !(is_ninf && is_zero_full(g, *z)) {
            return None;
        }
        [peel_layout(g, *c), *c]
            .into_iter()
            .find(|m| self.causal.get(m) == Some(&false))
            .map(|m| self.windows.get(&m).copied())
    }
}

/// Through reshapes and expands.
fn peel_layout(g: &Graph, mut v: Value) -> Value {
    for _ in 0..8 {
        match def(g, v) {
            (Op::Reshape { .. } | Op::Expand { .. }, [x]) => v = *x,
            _ => break,
        }
    }
    v
}

/// `(x, t)` if `v = mul(x, t)` (either order) with `pred(t)`.
fn mul_pair(g: &Graph, v: Value, pred: impl Fn(&Graph, Value) -> bool) -> Option<(Value, Value)> {
    let (Op::Mul {}, [a, b]) = def(g, v) else {
        return None;
    };
    if pred(g, *b) {
        Some((*a, *b))
    } else if pred(g, *a) {
        Some((*b, *a))
    } else {
        None
    }
}

/// The `rope_table` result `which` (0 cos, 1 sin) that `v` reshapes/expands/casts.
fn table_of(g: &Graph, mut v: Value, which: u32) -> Option<Value> {
    for _ in 0..6 {
        let d = g.value(v);
        let n = g.node(d.def);
        match &n.op {
            Op::RopeTable { .. } => return (d.index == which).then_some(v),
            Op::Reshape { .. } | Op::Expand { .. } | Op::Cast { .. } => v = n.operands[0],
            _ => return None,
        }
    }
    None
}

/// The `rope_table` result `which` whose first half on the last dim `v` is (through
/// reshapes, expands and casts): gpt-oss's half-width table.
fn half_table_of(g: &Graph, mut v: Value, which: u32) -> Option<Value> {
    for _ in 0..6 {
        match def(g, v) {
            (Op::Reshape { .. } | Op::Expand { .. } | Op::Cast { .. }, [x]) => v = *x,
            (Op::Slice { dim, start, len }, [t]) => {
                let t = *t;
                let tt = g.ty(t);
                let last = tt.rank() as i64 - 1;
                let width = tt.shape.last().and_then(Dim::as_const)?;
                let half = (*dim == -1 || *dim == last)
                    && *start == Dim::from(0)
                    && *len == Dim::from(width / 2)
                    && width % 2 == 0;
                let d = g.value(t);
                let is_table = matches!(g.node(d.def).op, Op::RopeTable { .. });
                return (half && is_table && d.index == which).then_some(t);
            }
            _ => return None,
        }
    }
    None
}

/// `x` when `a, b` are the two results of `split(x, [h, h], -1)`.
fn halves_of(g: &Graph, a: Value, b: Value) -> Option<Value> {
    let (da, db) = (g.value(a), g.value(b));
    if da.def != db.def || da.index != 0 || db.index != 1 {
        return None;
    }
    let n = g.node(da.def);
    let Op::Split { dim, sizes } = &n.op else {
        return None;
    };
    let x = n.operands[0];
    let last = g.ty(x).rank() as i64 - 1;
    ((*dim == -1 || *dim == last) && sizes.len() == 2 && sizes[0] == sizes[1]).then_some(x)
}

/// `v = reshape(transpose(reshape(x, [.., n/2, 2]), -2, -1), [.., n])`: the pairs of
/// `x`'s last dim de-interleaved (strided.rs's form of `x[..., 0::2]`, `x[..., 1::2]`).
fn is_deinterleaved(g: &Graph, v: Value) -> bool {
    let (Op::Reshape { .. }, [t]) = def(g, v) else {
        return false;
    };
    let (Op::Transpose { dim0, dim1 }, [p]) = def(g, *t) else {
        return false;
    };
    let pairs = g.ty(*p);
    let r = pairs.rank() as i64;
    (*dim0, *dim1) == (r - 2, r - 1)
        && pairs.shape.last() == Some(&Dim::from(2))
        && matches!(def(g, *p).0, Op::Reshape { .. })
}

/// `cat(-x[.., h:], x[.., :h])` on the last dim.
fn is_rotate_half(g: &Graph, cat: Value, x: Value) -> bool {
    let (Op::Concat { dim }, [a, b]) = def(g, cat) else {
        return false;
    };
    let r = g.ty(x).rank() as i64;
    let last = r - 1;
    if *dim != -1 && *dim != last {
        return false;
    }
    let d = match g.ty(x).shape.last().and_then(Dim::as_const) {
        Some(d) if d % 2 == 0 => d,
        _ => return false,
    };
    let h = Dim::from(d / 2);
    let (Op::Neg {}, [s2]) = def(g, *a) else {
        return false;
    };
    let is_slice = |v: Value, start: &Dim| match def(g, v) {
        (Op::Slice { dim, start: s, len }, [src]) => {
            (*dim == last || *dim == -1) && s == start && *len == h && *src == x
        }
        _ => false,
    };
    is_slice(*s2, &h) && is_slice(*b, &Dim::from(0))
}

/// The rank-4 value a batch-folded operand reshapes (through expands and reshapes).
fn peel_to_rank4(g: &Graph, v: Value) -> Option<Value> {
    let mut cur = v;
    for _ in 0..6 {
        if g.ty(cur).rank() == 4 && !matches!(def(g, cur).0, Op::Expand { .. }) {
            return Some(cur);
        }
        match def(g, cur) {
            (Op::Reshape { .. } | Op::Expand { .. }, [x]) => cur = *x,
            _ => return None,
        }
    }
    None
}

/// `(s, cap)` for `scale(tanh(scale(s, k)), cap)` with `k = 1 / cap` (to rounding).
fn softcapped(g: &Graph, v: Value) -> Option<(Value, f64)> {
    let (Op::Scale { factor: cap }, [t]) = def(g, v) else {
        return None;
    };
    let (Op::Tanh {}, [u]) = def(g, *t) else {
        return None;
    };
    let (Op::Scale { factor: k }, [s]) = def(g, *u) else {
        return None;
    };
    let cap = cap.0;
    ((cap * k.0 - 1.0).abs() < 1e-6 && cap > 0.0 && cap.is_finite()).then_some((*s, cap))
}

/// `add_scalar(W, 1)` with `W` a parameter (through casts): Gemma's norm weight.
fn is_unit_offset_weight(g: &Graph, v: Value) -> bool {
    matches!(def(g, v), (Op::AddScalar { value }, [w]) if value.0 == 1.0 && is_param(g, through_casts(g, *w)))
}

/// The value of a one-element `full` seen through casts (rounded as they round), reshapes
/// and expands.
fn scalar_value(g: &Graph, v: Value) -> Option<f64> {
    match def(g, v) {
        (Op::Full { value, ty }, _) if ty.shape.iter().all(|d| d.as_const() == Some(1)) => {
            Some(rounded(ty.dtype, value.0))
        }
        (Op::Cast { dtype }, [x]) => scalar_value(g, *x).map(|c| rounded(*dtype, c)),
        (Op::Reshape { .. } | Op::Expand { .. }, [x]) => scalar_value(g, *x),
        _ => None,
    }
}

/// `c` as a value of `dtype` holds it.
fn rounded(dtype: DType, c: f64) -> f64 {
    match dtype {
        DType::F64 => c,
        d => crate::gemma::round_to(d, c as f32),
    }
}

/// `(x, c)` for `scale(x, c)`, else `(v, 1)`.
fn unscale(g: &Graph, v: Value) -> (Value, f64) {
    match def(g, v) {
        (Op::Scale { factor }, [x]) => (*x, factor.0),
        _ => (v, 1.0),
    }
}

/// True if every source of `c`'s cone is `x` or a `full`.
fn cone_only(g: &Graph, c: Value, x: Value) -> bool {
    let mut stack = vec![c];
    let mut seen = BTreeSet::new();
    while let Some(v) = stack.pop() {
        if v == x || !seen.insert(v) {
            continue;
        }
        let (op, ops) = def(g, v);
        match op {
            Op::Full { .. } => {}
            Op::Param { .. } | Op::Input { .. } | Op::Arange { .. } => return false,
            _ => stack.extend_from_slice(ops),
        }
        if seen.len() > 64 {
            return false;
        }
    }
    true
}

/// Removes nodes no output needs (sources — params and inputs — stay).
pub fn dce(g: &mut Graph) {
    let mut live = BTreeSet::new();
    let mut stack: Vec<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
    while let Some(v) = stack.pop() {
        if !live.insert(v) {
            continue;
        }
        if let Some(d) = g.try_value(v) {
            stack.extend_from_slice(&g.node(d.def).operands);
        }
    }
    let dead: Vec<Node> = g
        .nodes()
        .iter()
        .copied()
        .filter(|&n| {
            let d = g.node(n);
            !matches!(d.op, Op::Param { .. } | Op::Input { .. })
                && !d.results.iter().any(|r| live.contains(r))
        })
        .collect();
    g.remove_nodes(&dead);
}

/// Notes patterns left in the graph that the passes cannot shard as high-level ops.
pub fn leftovers(g: &Graph, report: &mut ImportReport) {
    for &n in g.nodes() {
        let d = g.node(n);
        let scope = d.meta.source.as_deref();
        match &d.op {
            Op::Softmax { .. } if g.ty(d.results[0]).rank() == 4 => {
                report.miss("attention", scope, "softmax over [B, heads, S, S] left as generic ops (mask not causal or shape not matched)")
            }
            Op::Rsqrt {} => report.miss("rms_norm", scope, "rsqrt left as generic ops"),
            Op::Concat { .. } if d.operands.iter().any(|&o| matches!(def(g, o).0, Op::Neg {})) => {
                report.miss("rope", scope, "rotate_half left as generic ops")
            }
            Op::IndexSelect { .. } if d.operands.first().is_some_and(|&w| is_param(g, w) && g.ty(w).rank() == 3) => {
                report.miss("moe", scope, "experts gathered per token (batched_mm form not matched): runs, but expert weights stay replicated")
            }
            Op::Matmul { .. } if d.operands.iter().any(|&o| is_param(g, o) || matches!(def(g, o), (Op::Permute { .. } | Op::Transpose { .. }, [w]) if is_param(g, *w))) => {
                report.miss("linear", scope, "matmul with a parameter left as matmul")
            }
            _ => {}
        }
    }
    let _ = DType::F32;
}

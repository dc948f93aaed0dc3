//! Plan-time check of concrete sizes: every dim of every value and attribute must
//! evaluate to a non-negative integer on every rank, and every slice must stay inside
//! its operand. A sequence length that `sp` does not divide is an error naming the dim
//! and the nearest lengths that work, never silently dropped tokens. Sizes that mention
//! a data-dependent symbol ([`Graph::runtime_symbols`], e.g. the rows an expert-parallel
//! `all_to_all_v` receives) have no value before the run and are not checked.

use std::collections::BTreeSet;
use weft_ir::shape::norm_dim;
use weft_ir::{Bindings, Dim, DimError, Graph, Node, Op, Role};

pub use weft_ir::plan::{MAX_BATCH, MAX_SEQ};

/// `--batch` / `--seq` as the CLI takes them: positive and at most [`MAX_BATCH`] /
/// [`MAX_SEQ`]; the error names the flag and the value.
pub fn check_batch_seq(batch: Option<i64>, seq: Option<i64>) -> Result<(), String> {
    for (flag, v, max) in [("--batch", batch, MAX_BATCH), ("--seq", seq, MAX_SEQ)] {
        if let Some(v) = v {
            if v <= 0 || v > max {
                return Err(format!("invalid {flag} {v}: must be between 1 and {max}"));
            }
        }
    }
    Ok(())
}

/// A size that does not work with the given bindings.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} in {location}: {why}{}", .help.as_ref().map(|h| format!("\nhelp: {h}")).unwrap_or_default())]
pub struct BindingError {
    pub what: String,
    /// `node %12 (model.layers.3.self_attn)`.
    pub location: String,
    pub why: String,
    pub help: Option<String>,
    /// The symbol at fault, when one is, and the nearest values that work for it.
    pub symbol: Option<String>,
    pub suggestions: Vec<i64>,
}

/// One size the graph needs to be a non-negative integer: where it is and what it is.
struct Check {
    node: Node,
    label: String,
    dim: Dim,
}

fn collect(g: &Graph) -> Vec<Check> {
    let runtime: BTreeSet<String> = g.runtime_symbols().into_iter().map(|(s, _)| s).collect();
    let mut out = collect_all(g);
    out.retain(|c| !c.dim.symbols().iter().any(|s| runtime.contains(s)));
    out
}

fn collect_all(g: &Graph) -> Vec<Check> {
    let mut out = Vec::new();
    for &n in g.nodes() {
        let d = g.node(n);
        for v in &d.results {
            for (i, dim) in g.ty(*v).shape.iter().enumerate() {
                out.push(Check {
                    node: n,
                    label: format!("dim {i} of {v}"),
                    dim: dim.clone(),
                });
            }
        }
        let mut attr = |name: &str, dim: &Dim| {
            out.push(Check {
                node: n,
                label: format!("attribute `{name}`"),
                dim: dim.clone(),
            })
        };
        match &d.op {
            Op::Reshape { shape } | Op::Expand { shape } => {
                shape.iter().for_each(|x| attr("shape", x))
            }
            Op::Split { sizes, .. } => sizes.iter().for_each(|x| attr("sizes", x)),
            Op::Arange { start, .. } => attr("start", start),
            Op::Slice { dim, start, len } => {
                attr("start", start);
                attr("len", len);
                let t = g.ty(d.operands[0]);
                if let Ok(k) = norm_dim(*dim, t.rank()) {
                    let room = t.shape[k].clone() - start.clone() - len.clone();
                    out.push(Check {
                        node: n,
                        label: format!(
                            "the slice end {} (size {})",
                            start.clone() + len.clone(),
                            t.shape[k]
                        ),
                        dim: room,
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// Every coordinate combination of the axes `d` depends on, as bindings.
fn rank_bindings(g: &Graph, d: &Dim, base: &Bindings) -> Vec<Bindings> {
    let mut out = vec![base.clone()];
    for axis in d.rank_axes() {
        let n = g.mesh.size(&axis).unwrap_or(1) as i64;
        out = out
            .into_iter()
            .flat_map(|b| {
                (0..n)
                    .map(|c| b.clone().with_coord(&axis, c))
                    .collect::<Vec<_>>()
            })
            .collect();
    }
    out
}

/// The first failure of `d` over all ranks: the error and the coordinates it fails at.
fn eval_everywhere(g: &Graph, d: &Dim, base: &Bindings) -> Result<(), (DimError, Bindings)> {
    for b in rank_bindings(g, d, base) {
        match d.eval(&b) {
            Ok(v) if v < 0 => {
                return Err((
                    DimError::NotInteger {
                        dim: d.to_string(),
                        num: v,
                        den: 1,
                    },
                    b,
                ));
            }
            Ok(_) => {}
            Err(e) => return Err((e, b)),
        }
    }
    Ok(())
}

fn with_mesh(g: &Graph, b: &Bindings) -> Bindings {
    let mut full = b.clone();
    for (a, n) in &g.mesh.axes {
        full.symbols.entry(a.clone()).or_insert(*n as i64);
    }
    full
}

/// Refuses sizes at which the program's values, counted whole (before any split over
/// ranks), hold more than [`crate::lower::plan::MAX_PLAN_BYTES`] in all, or one of them
/// more than `u64` counts: the passes that size a step (checkpoint, offload) add
/// values' bytes, and no device or host holds a step near this. Checked before any
/// pass runs; the error names the bindings and the largest value.
#[allow(clippy::result_large_err)] // a cold error path; the fields are what callers print
pub fn check_total_bytes(g: &Graph, b: &Bindings) -> Result<(), BindingError> {
    let limit = crate::lower::plan::MAX_PLAN_BYTES as u128;
    let mut full = with_mesh(g, b);
    for (a, _) in &g.mesh.axes {
        full.coords.entry(a.clone()).or_insert(0);
    }
    let mut total: u128 = 0;
    let mut largest: Option<(u128, Node, weft_ir::Value)> = None;
    for &n in g.nodes() {
        for &v in &g.node(n).results {
            let bytes = match g.ty(v).size_bytes(&full) {
                Ok(x) => x as u128,
                Err(DimError::Overflow(_)) => u128::from(u64::MAX) + 1,
                // Sizes that do not evaluate are `check_bindings`'s to name.
                Err(_) => continue,
            };
            total = total.saturating_add(bytes);
            if largest.is_none_or(|(l, _, _)| bytes > l) {
                largest = Some((bytes, n, v));
            }
        }
    }
    if total <= limit {
        return Ok(());
    }
    let sizes: Vec<String> = b.symbols.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let (bytes, node, v) = largest.expect("a value when the total is positive");
    let count = |x: u128| {
        if x > u64::MAX as u128 {
            "more than 2^64".to_string()
        } else {
            x.to_string()
        }
    };
    Err(BindingError {
        what: format!(
            "{}: the program's values hold {} bytes in all",
            sizes.join(" "),
            count(total)
        ),
        location: g.describe(node),
        why: format!(
            "more than Weft plans for ({limit} bytes); the largest, {v}: {}, holds {} bytes",
            g.ty(v),
            count(bytes)
        ),
        help: Some("give a smaller --batch or --seq".into()),
        symbol: None,
        suggestions: vec![],
    })
}

/// What a symbol is, for messages: `sequence length S`, `batch size B`, `symbol X`.
fn describe_symbol(g: &Graph, s: &str) -> String {
    for (_, role, v) in g.inputs() {
        if matches!(role, Role::InputIds | Role::Labels) {
            let t = g.ty(v);
            if t.rank() == 2 && t.shape[1] == Dim::sym(s) {
                return format!("sequence length {s}");
            }
            if t.rank() == 2 && t.shape[0] == Dim::sym(s) {
                return format!("batch size {s}");
            }
        }
    }
    format!("symbol {s}")
}

/// Checks that every size of `g` works with `b` (mesh axis sizes are taken from the
/// graph's mesh when `b` does not bind them), on every rank.
#[allow(clippy::result_large_err)] // a cold error path; the fields are what callers print
pub fn check_bindings(g: &Graph, b: &Bindings) -> Result<(), BindingError> {
    for (sym, v) in &b.symbols {
        let limit = match sym.as_str() {
            "B" => MAX_BATCH,
            "S" => MAX_SEQ,
            _ => i64::MAX,
        };
        if *v <= 0 || *v > limit {
            return Err(BindingError {
                what: format!("{sym}={v} is out of range"),
                location: format!("the bindings of {}", g.name),
                why: format!("{} must be between 1 and {limit}", describe_symbol(g, sym)),
                help: None,
                symbol: Some(sym.clone()),
                suggestions: vec![],
            });
        }
    }
    let full = with_mesh(g, b);
    let checks = collect(g);
    for c in &checks {
        let Err((e, at)) = eval_everywhere(g, &c.dim, &full) else {
            continue;
        };
        let location = g.describe(c.node);
        let bound: Vec<String> = c
            .dim
            .symbols()
            .iter()
            .filter(|s| !g.mesh.has(s))
            .filter_map(|s| full.symbols.get(s).map(|v| format!("{s}={v}")))
            .chain(at.coords.iter().map(|(a, v)| format!("@{a}={v}")))
            .collect();
        let with = if bound.is_empty() {
            String::new()
        } else {
            format!(" with {}", bound.join(", "))
        };
        match e {
            DimError::Unbound(s) | DimError::UnboundCoord(s) => {
                return Err(BindingError {
                    what: format!("{} is not bound", describe_symbol(g, &s)),
                    location,
                    why: format!("{} is `{}`", c.label, c.dim),
                    help: Some(format!("give a value for `{s}` when making the plan")),
                    symbol: Some(s),
                    suggestions: vec![],
                });
            }
            DimError::NotInteger { num, den, .. } => {
                // The user-bound symbols of the failing dim, and values that would work.
                let culprit = c
                    .dim
                    .symbols()
                    .into_iter()
                    .find(|s| b.symbols.contains_key(s) && !g.mesh.has(s));
                let (what, suggestions, help) = match &culprit {
                    Some(s) => {
                        let v = full.symbols[s];
                        let sugg = nearest_valid(g, &checks, &full, s, v);
                        let verb = if den == 1 {
                            "is too small"
                        } else {
                            "does not divide evenly"
                        };
                        let help = match sugg.as_slice() {
                            [] => None,
                            [one] => Some(format!("use {s}={one}, the nearest value every size works with")),
                            [lo, hi] => Some(format!("use {s}={lo} or {s}={hi}, the nearest values every size works with (tokens are never dropped)")),
                            _ => None,
                        };
                        (format!("{}={v} {verb}", describe_symbol(g, s)), sugg, help)
                    }
                    None => (
                        "a size does not work with the mesh".to_string(),
                        vec![],
                        None,
                    ),
                };
                let value = if den == 1 {
                    format!("{num}")
                } else {
                    format!("{num}/{den}")
                };
                let mesh = if g.mesh.axes.is_empty() {
                    String::new()
                } else {
                    format!(" on mesh {}", g.mesh)
                };
                return Err(BindingError {
                    what,
                    location,
                    why: format!("{} is `{}` = {value}{with}{mesh}", c.label, c.dim),
                    help,
                    symbol: culprit,
                    suggestions,
                });
            }
            other => {
                return Err(BindingError {
                    what: "a size cannot be evaluated".into(),
                    location,
                    why: format!("{}: {other}", c.label),
                    help: None,
                    symbol: None,
                    suggestions: vec![],
                })
            }
        }
    }
    Ok(())
}

/// The nearest values below and above `v` for symbol `s` with which every check passes.
fn nearest_valid(g: &Graph, checks: &[Check], full: &Bindings, s: &str, v: i64) -> Vec<i64> {
    let dims: BTreeSet<&Dim> = checks
        .iter()
        .map(|c| &c.dim)
        .filter(|d| d.mentions(s))
        .collect();
    let ok = |x: i64| {
        let mut b = full.clone();
        b.symbols.insert(s.to_string(), x);
        dims.iter().all(|d| eval_everywhere(g, d, &b).is_ok())
    };
    const LIMIT: i64 = 1 << 16;
    let lower = (1..v.min(LIMIT)).map(|k| v - k).find(|&x| x >= 1 && ok(x));
    let upper = (1..LIMIT).map(|k| v + k).find(|&x| ok(x));
    lower.into_iter().chain(upper).collect()
}

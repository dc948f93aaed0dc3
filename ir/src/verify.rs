//! The verifier: re-checks every node against the op table and shape rules, and the
//! graph's structure. It collects all errors, each located at its node, and renders the
//! graph with every error printed under the line it concerns.

use crate::attrs::RopeScaling;
use crate::dim::{Bindings, Dim};
use crate::graph::{Graph, Node};
use crate::ops::Op;
use crate::print::node_line;
use crate::types::TensorType;
use std::collections::BTreeMap;
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// The node at fault, or `None` for graph-level errors (outputs).
    pub node: Option<Node>,
    /// `node %12 (model.layers.3.mlp)`.
    pub location: String,
    pub message: String,
}

/// All errors of one verification, with the text to show them in context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyReport {
    pub errors: Vec<VerifyError>,
    /// The graph text with each error under its line.
    pub annotated: String,
}

/// The most errors a report lists one by one; the rest are counted.
const SHOWN_ERRORS: usize = 10;
/// Lines of the program shown before and after each error's line.
const CONTEXT_LINES: usize = 2;

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} verifier error(s):", self.errors.len())?;
        for e in self.errors.iter().take(SHOWN_ERRORS) {
            writeln!(f, "error: invalid IR in {}: {}", e.location, e.message)?;
        }
        if self.errors.len() > SHOWN_ERRORS {
            writeln!(f, "... and {} more", self.errors.len() - SHOWN_ERRORS)?;
        }
        write!(f, "\n{}", excerpt(&self.annotated))
    }
}

impl VerifyReport {
    /// The errors located in the source text the graph was parsed from:
    /// `error: <msg> in FILE:LINE (node %N (scope))` and the line with a few lines of
    /// context, numbered as in the file. Errors whose node has no line there (or
    /// graph-level ones) name their location only.
    pub fn in_source(&self, g: &Graph, text: &str, file: &str) -> String {
        let lines: Vec<&str> = text.lines().collect();
        let mut line_of: BTreeMap<u32, usize> = BTreeMap::new();
        for (i, l) in lines.iter().enumerate() {
            let Some(rest) = l.trim_start().strip_prefix('%') else {
                continue;
            };
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(id) = digits.parse::<u32>() {
                line_of.entry(id).or_insert(i);
            }
        }
        let mut out = format!("{} verifier error(s)\n", self.errors.len());
        for e in self.errors.iter().take(SHOWN_ERRORS) {
            let at = e
                .node
                .and_then(|n| g.node(n).results.first().copied())
                .and_then(|v| line_of.get(&v.0).copied());
            match at {
                Some(i) => {
                    out.push_str(&format!(
                        "error: {} in {file}:{} ({})\n",
                        e.message,
                        i + 1,
                        e.location
                    ));
                    let (lo, hi) = (
                        i.saturating_sub(CONTEXT_LINES),
                        (i + CONTEXT_LINES).min(lines.len() - 1),
                    );
                    for (k, l) in lines.iter().enumerate().take(hi + 1).skip(lo) {
                        let shown: String = l.chars().take(160).collect();
                        out.push_str(&format!("{:>6} | {shown}\n", k + 1));
                        if k == i {
                            out.push_str("       | ^ here\n");
                        }
                    }
                }
                None => out.push_str(&format!(
                    "error: {} in {file} ({})\n",
                    e.message, e.location
                )),
            }
        }
        if self.errors.len() > SHOWN_ERRORS {
            out.push_str(&format!(
                "... and {} more\n",
                self.errors.len() - SHOWN_ERRORS
            ));
        }
        out
    }
}

/// The lines of an annotated program near its errors (`^ error:` lines), with `...`
/// for what is left out: a 47 MB program is not printed whole.
fn excerpt(annotated: &str) -> String {
    let lines: Vec<&str> = annotated.lines().collect();
    let marks: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.trim_start().starts_with("^ error"))
        .map(|(i, _)| i)
        .take(SHOWN_ERRORS)
        .collect();
    let mut keep = vec![false; lines.len()];
    for &m in &marks {
        let lo = m.saturating_sub(CONTEXT_LINES + 1);
        let hi = (m + CONTEXT_LINES).min(lines.len().saturating_sub(1));
        keep[lo..=hi].iter_mut().for_each(|k| *k = true);
    }
    let mut out = String::new();
    let mut skipped = false;
    for (l, k) in lines.iter().zip(&keep) {
        if *k {
            out.push_str(l);
            out.push('\n');
            skipped = false;
        } else if !skipped {
            out.push_str("...\n");
            skipped = true;
        }
    }
    out
}

impl std::error::Error for VerifyReport {}

/// Checks the graph; `Ok(())` or every error found.
pub fn verify(g: &Graph) -> Result<(), VerifyReport> {
    let errors = collect_errors(g);
    if errors.is_empty() {
        return Ok(());
    }
    Err(VerifyReport {
        annotated: annotate(g, &errors),
        errors,
    })
}

fn collect_errors(g: &Graph) -> Vec<VerifyError> {
    let mut errors = Vec::new();
    let mut defined = vec![false; g.value_capacity()];
    let mesh_sizes: Bindings = {
        let mut b = Bindings::new();
        for (a, n) in &g.mesh.axes {
            b = b.with(a, *n as i64);
        }
        b
    };
    let mut param_names: BTreeMap<String, Node> = BTreeMap::new();
    let mut input_names: BTreeMap<String, Node> = BTreeMap::new();
    // A type's dims and size check the same wherever it occurs (they depend on the mesh
    // alone), and deep programs repeat a few types thousands of times.
    let mut clean_types: std::collections::HashSet<&TensorType> = Default::default();
    for &n in g.nodes() {
        let d = g.node(n);
        let mut push = |msg: String| {
            errors.push(VerifyError {
                node: Some(n),
                location: g.describe(n),
                message: msg,
            })
        };
        // operands exist and come earlier
        let mut operand_types: Vec<&TensorType> = Vec::new();
        let mut operands_ok = true;
        for (i, v) in d.operands.iter().enumerate() {
            match g.try_value(*v) {
                None => {
                    push(format!("operand {i} ({v}) is not defined (dangling use)"));
                    operands_ok = false;
                }
                Some(_) if !defined.get(v.0 as usize).copied().unwrap_or(false) => {
                    push(format!("operand {i} ({v}) is used before its definition (cycle or misordered node)"));
                    operands_ok = false;
                }
                Some(vd) => operand_types.push(&vd.ty),
            }
        }
        if operands_ok {
            match d.op.infer(&operand_types) {
                Err(m) => push(m),
                Ok(tys) => {
                    if tys.len() != d.results.len() {
                        push(format!(
                            "`{}` makes {} result(s), the node has {}",
                            d.op.name(),
                            tys.len(),
                            d.results.len()
                        ));
                    } else {
                        for (k, (v, t)) in d.results.iter().zip(&tys).enumerate() {
                            let have = g.ty(*v);
                            if have != t {
                                push(format!(
                                    "result {k} ({v}) has type {have} but `{}` makes {t}",
                                    d.op.name()
                                ));
                            }
                        }
                    }
                }
            }
        }
        if let Some(axis) = d.op.axis() {
            if !g.mesh.has(axis) {
                let known = if g.mesh.axes.is_empty() {
                    "the graph has no mesh".to_string()
                } else {
                    format!("mesh is {}", g.mesh)
                };
                push(format!(
                    "collective on unknown mesh axis `{axis}` ({known})"
                ));
            }
        }
        if let Op::Param { name, .. } = &d.op {
            if let Some(prev) = param_names.insert(name.clone(), n) {
                push(format!(
                    "parameter `{name}` is already defined by {}",
                    g.describe(prev)
                ));
            }
        }
        // Inputs are bound by name: two of one name would both take the same tensor.
        if let Op::Input { name, .. } = &d.op {
            if let Some(prev) = input_names.insert(name.clone(), n) {
                push(format!(
                    "input `{name}` is already defined by {}",
                    g.describe(prev)
                ));
            }
        }
        if let Some(m) = check_float_attrs(&d.op) {
            push(m);
        }
        for v in &d.results {
            let ty = g.ty(*v);
            if !clean_types.contains(ty) {
                let mut clean = true;
                for (i, dim) in ty.shape.iter().enumerate() {
                    check_dim(dim, &mesh_sizes, g, &mut |m| {
                        clean = false;
                        push(format!("dim {i} of {v}: {m}"))
                    });
                }
                if let Some(m) = check_value_size(ty, &mesh_sizes) {
                    clean = false;
                    push(format!("{v}: {m}"));
                }
                if clean {
                    clean_types.insert(ty);
                }
            }
            if let Some(slot) = defined.get_mut(v.0 as usize) {
                *slot = true;
            }
        }
        for dim in op_dims(&d.op) {
            check_dim(dim, &mesh_sizes, g, &mut |m| {
                push(format!("attribute: {m}"))
            });
        }
    }
    check_runtime_symbols(g, &mut errors);
    check_partitions(g, &mut errors);
    let outputs: std::collections::HashMap<&str, crate::graph::Value> =
        g.outputs().iter().map(|(n, v)| (n.as_str(), *v)).collect();
    for (name, splits) in g.output_splits() {
        let location = format!("output `{name}`");
        let Some(&v) = outputs.get(name.as_str()) else {
            errors.push(VerifyError {
                node: None,
                location,
                message: "split recorded for an output that does not exist".into(),
            });
            continue;
        };
        let rank = g.try_ty(v).map(|t| t.rank()).unwrap_or(0);
        for (d, a) in splits {
            if *d >= rank {
                errors.push(VerifyError {
                    node: None,
                    location: location.clone(),
                    message: format!("split dim {d} is out of range for rank {rank}"),
                });
            }
            if !g.mesh.has(a) {
                errors.push(VerifyError {
                    node: None,
                    location: location.clone(),
                    message: format!("split over unknown mesh axis `{a}`"),
                });
            }
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for (name, v) in g.outputs() {
        let mut push = |message: String| {
            errors.push(VerifyError {
                node: None,
                location: format!("output `{name}`"),
                message,
            })
        };
        if !names.insert(name.as_str()) {
            push("is returned twice".into());
        }
        match g.try_ty(*v) {
            None => push(format!("{v} is not defined")),
            Some(t) if name == "loss" && t.rank() != 0 => {
                push(format!("the loss must be a scalar, but {v} is {t}"))
            }
            Some(_) => {}
        }
    }
    errors
}

/// The most bytes one value may hold on one rank (1 PiB): far above any device, and
/// low enough that sizes, offsets and costs computed from it never overflow.
pub const MAX_VALUE_BYTES: u64 = 1 << 50;

/// A value's size must be countable: no overflowed dim, and at most
/// [`MAX_VALUE_BYTES`] on one rank with every free size symbol at its smallest (1).
fn check_value_size(ty: &TensorType, mesh: &Bindings) -> Option<String> {
    if ty.shape.iter().any(Dim::is_overflow) || ty.numel().is_overflow() {
        return Some(format!("the size of {ty} overflows"));
    }
    let numel = ty.numel();
    let mut b = mesh.clone();
    for s in numel.symbols() {
        if !b.symbols.contains_key(&s) {
            b = b.with(&s, 1);
        }
    }
    for a in numel.rank_axes() {
        b = b.with_coord(&a, 0);
    }
    let bytes = match numel.eval(&b) {
        Ok(n) => (n.max(0) as u128) * ty.dtype.size_bytes() as u128,
        Err(crate::dim::DimError::Overflow(_)) => u128::MAX,
        Err(_) => return None,
    };
    (bytes > MAX_VALUE_BYTES as u128).then(|| {
        format!(
            "{ty} holds more than {} bytes on one rank (the most Weft plans for is {MAX_VALUE_BYTES})",
            if bytes == u128::MAX { "2^127".to_string() } else { bytes.to_string() }
        )
    })
}

/// Float attributes whose meaning needs them finite (and some positive): `eps` of a
/// norm or of AdamW, a scale, RoPE's theta, optimizer rates. `full` may hold `-inf`
/// (masks).
fn check_float_attrs(op: &Op) -> Option<String> {
    let bad = |name: &str, v: f64, why: &str| Some(format!("attribute `{name}` is {v}: {why}"));
    let finite = |name: &str, v: f64| {
        (!v.is_finite())
            .then(|| bad(name, v, "must be finite"))
            .flatten()
    };
    let positive = |name: &str, v: f64| {
        (!(v.is_finite() && v > 0.0))
            .then(|| bad(name, v, "must be positive and finite"))
            .flatten()
    };
    let unit = |name: &str, v: f64| {
        (!(v.is_finite() && (0.0..1.0).contains(&v)))
            .then(|| bad(name, v, "must be in [0, 1)"))
            .flatten()
    };
    match op {
        Op::Scale { factor } => finite("factor", factor.0),
        Op::AddScalar { value } => finite("value", value.0),
        Op::PowScalar { exponent } => finite("exponent", exponent.0),
        Op::RmsNorm { eps }
        | Op::RmsNormGrad { eps }
        | Op::AddRmsNorm { eps }
        | Op::AddRmsNormGrad { eps } => positive("eps", eps.0),
        Op::RopeTable { theta, scaling, .. } => {
            positive("theta", theta.0).or_else(|| check_rope_scaling(scaling))
        }
        Op::Attention { scale, .. } | Op::AttentionGrad { scale, .. } => finite("scale", scale.0),
        Op::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
        }
        | Op::HostAdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
            ..
        }
        | Op::AdamWMaster {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
            ..
        } => finite("lr", lr.0)
            .or_else(|| {
                warmup
                    .filter(|&w| w < 1)
                    .map(|w| format!("warmup must be at least 1 step, got {w}"))
            })
            .or_else(|| unit("beta1", beta1.0))
            .or_else(|| unit("beta2", beta2.0))
            .or_else(|| positive("eps", eps.0))
            .or_else(|| finite("weight_decay", weight_decay.0)),
        Op::Sgd {
            lr,
            momentum,
            weight_decay,
        } => finite("lr", lr.0)
            .or_else(|| finite("momentum", momentum.0))
            .or_else(|| finite("weight_decay", weight_decay.0)),
        _ => None,
    }
}

/// RoPE scaling parameters as the config reader takes them: factors positive and
/// finite, llama3's `high_freq_factor` above its `low_freq_factor`, original context
/// lengths not negative (positive for YaRN). A factor of 0 or NaN made every
/// frequency NaN and the loss NaN, exit 0.
fn check_rope_scaling(s: &RopeScaling) -> Option<String> {
    let bad = |name: &str, v: String, why: &str| {
        Some(format!("attribute `scaling`: {name} is {v}: {why}"))
    };
    let positive = |name: &str, v: f64| {
        (!(v.is_finite() && v > 0.0))
            .then(|| bad(name, v.to_string(), "must be positive and finite"))
            .flatten()
    };
    let finite = |name: &str, v: f64| {
        (!v.is_finite())
            .then(|| bad(name, v.to_string(), "must be finite"))
            .flatten()
    };
    match *s {
        RopeScaling::None => None,
        RopeScaling::Linear { factor } => positive("factor", factor.0),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_position_embeddings: orig,
        } => positive("factor", factor.0)
            .or_else(|| positive("low_freq_factor", lo.0))
            .or_else(|| positive("high_freq_factor", hi.0))
            .or_else(|| {
                (hi.0 <= lo.0)
                    .then(|| {
                        bad(
                            "high_freq_factor",
                            hi.0.to_string(),
                            &format!("must exceed low_freq_factor ({})", lo.0),
                        )
                    })
                    .flatten()
            })
            .or_else(|| {
                (orig < 0)
                    .then(|| {
                        bad(
                            "original_max_position_embeddings",
                            orig.to_string(),
                            "must not be negative",
                        )
                    })
                    .flatten()
            }),
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings: orig,
            attention_factor,
            ..
        } => positive("factor", factor.0)
            .or_else(|| finite("beta_fast", beta_fast.0))
            .or_else(|| finite("beta_slow", beta_slow.0))
            .or_else(|| positive("attention_factor", attention_factor.0))
            .or_else(|| {
                (orig <= 0)
                    .then(|| {
                        bad(
                            "original_max_position_embeddings",
                            orig.to_string(),
                            "must be positive",
                        )
                    })
                    .flatten()
            }),
    }
}

/// A data-dependent size (see [`Graph::runtime_symbols`]) appears in no type or
/// attribute before the node that defines it: it has no value until that node runs.
fn check_runtime_symbols(g: &Graph, errors: &mut Vec<VerifyError>) {
    let runtime = g.runtime_symbols();
    if runtime.is_empty() {
        return;
    }
    let mut pending: BTreeMap<&str, Node> = runtime.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    for &n in g.nodes() {
        pending.retain(|_, dn| *dn != n);
        if pending.is_empty() {
            break;
        }
        let d = g.node(n);
        let mut dims: Vec<&Dim> = op_dims(&d.op);
        for v in &d.results {
            dims.extend(g.ty(*v).shape.iter());
        }
        for (s, dn) in &pending {
            if dims.iter().any(|x| x.mentions(s)) {
                errors.push(VerifyError {
                    node: Some(n),
                    location: g.describe(n),
                    message: format!(
                        "uses data-dependent size `{s}` before {} defines it",
                        g.describe(*dn)
                    ),
                });
            }
        }
    }
}

/// Each partition names a parameter of the graph, an axis of the mesh (or a group of
/// axes) with one size per rank, and agrees with the parameter's per-rank type along its dim.
fn check_partitions(g: &Graph, errors: &mut Vec<VerifyError>) {
    let params: BTreeMap<String, crate::graph::Value> = g.params().into_iter().collect();
    for (name, parts) in g.param_partitions() {
        let location = format!("partition of `{name}`");
        let mut push = |m: String| {
            errors.push(VerifyError {
                node: None,
                location: location.clone(),
                message: m,
            })
        };
        let Some(&v) = params.get(name) else {
            push("names no parameter of the graph".into());
            continue;
        };
        let ty = g.ty(v);
        for p in parts {
            // A group partition flattens its axes' ranks, outermost first.
            let mut n = 1u32;
            let mut unknown = None;
            for a in &p.axes {
                match g.mesh.size(a) {
                    Some(k) => n *= k,
                    None => unknown = Some(a),
                }
            }
            if let Some(a) = unknown {
                push(format!("splits over unknown mesh axis `{a}`"));
                continue;
            }
            if p.axes.is_empty() {
                push("splits over no axis".into());
                continue;
            }
            if p.pieces.iter().any(|piece| piece.len() != p.ranks()) {
                push("lists pieces of different numbers of ranks".into());
                continue;
            }
            if p.ranks() != n as usize {
                push(format!(
                    "lists {} ranks but {} `{}` has {n}",
                    p.ranks(),
                    if p.is_group() { "group" } else { "axis" },
                    p.axis_name()
                ));
                continue;
            }
            if p.dim >= ty.rank() {
                push(format!("dim {} is out of range for {ty}", p.dim));
                continue;
            }
            if let Err(m) = p.check_sizes() {
                push(m);
                continue;
            }
            // Nested splits of one dim (a ZeRO split inside a tp one): each shard of
            // this partition is what the next one on the dim splits; the last one
            // gives the parameter's type.
            let idx = parts.iter().position(|q| std::ptr::eq(q, p)).unwrap_or(0);
            if let Some(next) = parts[idx + 1..].iter().find(|q| q.dim == p.dim) {
                if (0..n as usize).any(|c| p.shard_size(c) != next.full_size()) {
                    push(format!(
                        "the shards of its `{}` split of dim {} ({:?}) are not what its `{}` split divides ({})",
                        p.axis_name(),
                        p.dim,
                        p.shard_sizes(),
                        next.axis_name(),
                        next.full_size()
                    ));
                }
                continue;
            }
            let d = &ty.shape[p.dim];
            for coord in 0..n {
                // The coordinates of group rank `coord` on each axis, row-major.
                let mut b = Bindings::new();
                let mut rest = coord;
                for a in p.axes.iter().rev() {
                    let k = g.mesh.size(a).unwrap_or(1);
                    b = b.with_coord(a, (rest % k) as i64);
                    rest /= k;
                }
                match d.bind(&b).as_const() {
                    Some(have) if have != p.shard_size(coord as usize) => push(format!(
                        "rank {coord} of `{}` holds {} along dim {} but the parameter's type {ty} says {have}",
                        p.axis_name(),
                        p.shard_size(coord as usize),
                        p.dim
                    )),
                    _ => {}
                }
            }
        }
    }
}

/// Dims appearing in attributes (reshape targets, slice bounds).
fn op_dims(op: &Op) -> Vec<&Dim> {
    match op {
        Op::Reshape { shape } | Op::Expand { shape } => shape.iter().collect(),
        Op::Slice { start, len, .. } => vec![start, len],
        Op::Split { sizes, .. } => sizes.iter().collect(),
        Op::Arange { start, .. } => vec![start],
        Op::Embedding { padding_idx } => padding_idx.iter().collect(),
        Op::EmbeddingGrad { padding_idx, .. } => padding_idx.iter().collect(),
        Op::AllToAllV { rows, .. } => vec![rows],
        _ => vec![],
    }
}

fn check_dim(dim: &Dim, mesh: &Bindings, g: &Graph, push: &mut dyn FnMut(String)) {
    let bound = dim.bind(mesh);
    if bound.is_fractional_const() {
        push(format!(
            "`{dim}` does not divide evenly ({bound} with mesh {})",
            g.mesh
        ));
    }
    if let Some(c) = bound.as_const() {
        if c < 0 {
            push(format!("`{dim}` is negative"));
        }
    }
    for axis in dim.rank_axes() {
        if !g.mesh.has(&axis) {
            push(format!(
                "`{dim}` depends on the rank along unknown mesh axis `{axis}`"
            ));
        }
    }
    check_tables(dim, g, push);
}

fn check_tables(dim: &Dim, g: &Graph, push: &mut dyn FnMut(String)) {
    for (axis, count) in dim.per_rank_tables() {
        if let Some(n) = g.mesh.size(&axis) {
            if count != n as usize {
                push(format!(
                    "per-rank sizes in `{dim}` list {count} ranks but axis `{axis}` has {n}"
                ));
            }
        }
    }
}

fn annotate(g: &Graph, errors: &[VerifyError]) -> String {
    let mut out = String::new();
    out.push_str(&format!("graph {}\n", crate::attrs::quote(&g.name)));
    if !g.mesh.axes.is_empty() {
        out.push_str(&format!("mesh {}\n", g.mesh));
    }
    for &n in g.nodes() {
        out.push_str(&node_line(g, n));
        out.push('\n');
        for e in errors.iter().filter(|e| e.node == Some(n)) {
            out.push_str(&format!("    ^ error: {}\n", e.message));
        }
    }
    let outs: Vec<String> = g
        .outputs()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    out.push_str(&format!("return {}\n", outs.join(", ")));
    for e in errors.iter().filter(|e| e.node.is_none()) {
        out.push_str(&format!("    ^ error: {} in {}\n", e.message, e.location));
    }
    out
}

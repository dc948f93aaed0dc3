//! Sizing a step: the bindings its sizes are evaluated under, which values live in
//! host memory, and one [`Buffer`] per value (bytes, category, residency), checked to
//! fit in [`MAX_PLAN_BYTES`].

// `LowerError` is large, as it is for `lower` itself (its public signature).
#![allow(clippy::result_large_err)]

use super::{LowerError, PlanOptions, MAX_PLAN_BYTES};
use crate::bindings::check_bindings;
use std::collections::{BTreeMap, BTreeSet};
use weft_ir::plan::*;
use weft_ir::{Bindings, Graph, Op, TensorType, Value, ValueRole};

/// The bindings of a step: `sized` gives data-dependent sizes their bound (what the
/// plan allocates), `expected` their value under balanced routing (what the step
/// computes on average, which the cost model prices), `exact` leaves them unbound
/// (what the plan records).
pub(super) struct StepBindings {
    pub sized: Bindings,
    pub expected: Bindings,
    pub exact: Bindings,
}

/// The user's bindings plus the mesh axis sizes, checked against `g`; data-dependent
/// sizes (the rows an expert-parallel all_to_all_v receives) are sized at their bound.
pub(super) fn step_bindings(g: &Graph, opts: &PlanOptions) -> Result<StepBindings, LowerError> {
    let mut b = opts.bindings.clone();
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64);
    }
    check_bindings(g, &b)?;
    // Data-dependent sizes (the rows an expert-parallel all_to_all_v receives) are
    // sized at their bound; the plan's bindings and shapes leave them unbound.
    let exact = b.clone();
    let mut expected = b.clone();
    for (s, n) in g.runtime_symbols() {
        if let Some(v) = g.runtime_symbol_bound(n).and_then(|d| d.eval(&exact).ok()) {
            b = b.with(&s, v);
        }
        if let Some(v) = balanced_rows(g, n).and_then(|d| d.eval(&exact).ok()) {
            expected = expected.with(&s, v);
        }
    }
    Ok(StepBindings {
        sized: b,
        expected,
        exact,
    })
}

/// The rows node `n`'s data-dependent size takes on average: an expert-parallel
/// `all_to_all_v` receives as many rows as it sends when the router spreads tokens
/// evenly over the experts (the bound, every rank's rows, is `ep` times that). The CUDA
/// runtime's grouped GEMMs run over the rows received, so this is what they compute.
fn balanced_rows(g: &Graph, n: weft_ir::Node) -> Option<weft_ir::Dim> {
    let nd = g.node(n);
    match &nd.op {
        Op::AllToAllV { .. } => Some(g.ty(*nd.operands.first()?).shape.first()?.clone()),
        _ => None,
    }
}

/// The names each returned value is returned under.
pub(super) fn output_names(g: &Graph) -> BTreeMap<Value, Vec<String>> {
    let mut output_names: BTreeMap<Value, Vec<String>> = BTreeMap::new();
    for (name, v) in g.outputs() {
        output_names.entry(*v).or_default().push(name.clone());
    }
    output_names
}

/// One buffer per value, in program order, and the buffer of each value.
pub(super) struct BufferTable {
    pub buffers: Vec<Buffer>,
    pub buf_of: BTreeMap<Value, u32>,
}

/// Sizes every value of `g` under `b` (one [`Buffer`] each, at offset 0 with an empty
/// live range and no alias) and refuses steps over [`MAX_PLAN_BYTES`].
pub(super) fn buffer_table(
    g: &Graph,
    b: &Bindings,
    output_names: &BTreeMap<Value, Vec<String>>,
    host: &BTreeSet<Value>,
) -> Result<BufferTable, LowerError> {
    // Buffers: one per value, in program order.
    let mut buffers: Vec<Buffer> = Vec::new();
    let mut buf_of: BTreeMap<Value, u32> = BTreeMap::new();
    for &n in g.nodes() {
        for &v in &g.node(n).results {
            let ty = g.ty(v);
            let (bytes, per_rank) = sizes(ty, b, &g.mesh).map_err(|e| LowerError::Size {
                what: format!("{v}: {ty}"),
                location: g.describe(n),
                why: e.to_string(),
            })?;
            let category = category(g, v, output_names, host);
            let resident = matches!(
                category,
                Category::Param | Category::Grad | Category::OptimizerState
            );
            buf_of.insert(v, buffers.len() as u32);
            buffers.push(Buffer {
                id: buffers.len() as u32,
                value: v.0,
                dtype: ty.dtype,
                bytes,
                per_rank_bytes: per_rank,
                category,
                offset: 0,
                resident,
                live: (0, 0),
                alias_of: None,
            });
        }
    }

    // Every offset and sum below stays exact: the bytes of all buffers fit with room.
    let total = buffers
        .iter()
        .try_fold(0u64, |acc, b| acc.checked_add(b.bytes))
        .filter(|&t| t <= MAX_PLAN_BYTES);
    if total.is_none() {
        return Err(LowerError::Size {
            what: "the buffers of the step".into(),
            location: g.name.clone(),
            why: format!(
                "they hold more than {MAX_PLAN_BYTES} bytes per rank (the most Weft plans)"
            ),
        });
    }
    Ok(BufferTable { buffers, buf_of })
}

/// Bytes of a value on every rank: the largest, and the table when ranks differ.
fn sizes(
    ty: &TensorType,
    b: &Bindings,
    mesh: &weft_ir::Mesh,
) -> Result<(u64, Option<Vec<u64>>), weft_ir::DimError> {
    let axes: Vec<String> = {
        let mut a: Vec<String> = ty.shape.iter().flat_map(|d| d.rank_axes()).collect();
        a.sort();
        a.dedup();
        a
    };
    if axes.is_empty() {
        return Ok((ty.size_bytes(b)?, None));
    }
    let mut per_rank = Vec::with_capacity(mesh.world_size() as usize);
    for r in 0..mesh.world_size() {
        let mut rb = b.clone();
        for (i, (axis, _)) in mesh.axes.iter().enumerate() {
            rb = rb.with_coord(axis, mesh.coords(r)[i] as i64);
        }
        per_rank.push(ty.size_bytes(&rb)?);
    }
    let max = per_rank.iter().copied().max().unwrap_or(0);
    let uniform = per_rank.iter().all(|&x| x == max);
    Ok((max, if uniform { None } else { Some(per_rank) }))
}

/// Category of a value: resident params/grads/optimizer state, host memory (what
/// `offload` copies out, in the pinned host pool), or arena memory.
fn category(
    g: &Graph,
    v: Value,
    output_names: &BTreeMap<Value, Vec<String>>,
    host: &BTreeSet<Value>,
) -> Category {
    let op = g.op_of(v);
    if matches!(op, Op::Offload { .. }) || host.contains(&v) {
        return Category::Host;
    }
    if let Op::Param { name, .. } = op {
        return if ValueRole::of(name).is_some_and(ValueRole::is_optimizer_state) {
            Category::OptimizerState
        } else {
            Category::Param
        };
    }
    if let Some(names) = output_names.get(&v) {
        let roles: Vec<ValueRole> = names.iter().filter_map(|n| ValueRole::of(n)).collect();
        if roles.contains(&ValueRole::Grad) {
            return Category::Grad;
        }
        if roles.iter().any(|r| r.is_optimizer_state()) {
            return Category::OptimizerState;
        }
        if roles.contains(&ValueRole::UpdatedParam) {
            return Category::Param;
        }
    }
    if op.is_collective() {
        Category::Comm
    } else {
        Category::Activation
    }
}

/// The values in host memory besides `offload`'s copies: what a host update reads
/// (master weights and moments; its gradient is an `offload` copy) and writes, and
/// the params only `reload` reads (streamed optimizer state).
pub(super) fn host_values(g: &Graph) -> Result<BTreeSet<Value>, LowerError> {
    let mut out = BTreeSet::new();
    let uses = g.uses();
    for (_, v) in g.params() {
        let readers = &uses[v.0 as usize];
        if !readers.is_empty()
            && readers
                .iter()
                .all(|&(n, i)| i == 0 && matches!(g.node(n).op, Op::Reload { .. }))
        {
            out.insert(v);
        }
    }
    for &n in g.nodes() {
        let nd = g.node(n);
        if !matches!(nd.op, Op::HostAdamW { .. }) {
            continue;
        }
        out.extend(nd.results.iter().copied());
        for (i, &v) in nd.operands.iter().enumerate() {
            let def = g.op_of(v);
            let ok = match i {
                1 => matches!(def, Op::Offload { .. }),
                4 => matches!(def, Op::Input { .. }),
                _ => matches!(def, Op::Param { .. }),
            };
            if !ok {
                return Err(LowerError::Size {
                    what: format!("operand {i} of `host_adamw` ({v})"),
                    location: g.describe(n),
                    why: "a host update reads host state params, an `offload` copy of its gradient and the step input".into(),
                });
            }
            if i != 1 && i != 4 {
                out.insert(v);
            }
        }
    }
    Ok(out)
}

//! ZeRO's data-parallel group of a parameter and the collectives over it.
//!
//! A parameter's data-parallel group is every rank holding the same copy of it after
//! tensor and expert sharding: the `dp`, `sp` and `cp` ranks for a dense parameter
//! (sequence- and context-parallel ranks see different tokens of the same weights), the
//! expert-data-parallel group `edp` for a parameter split over `ep`. ZeRO shards the
//! optimizer state (stage 1), the gradient (stage 2) and the parameter (stage 3) over
//! that group, whether or not tensor parallelism split the parameter first (the state
//! of a tp shard is sharded over its own replicas).
//!
//! A group of several axes is addressed row-major, outermost axis first: the rank with
//! coordinates `(c1, c2)` on axes of sizes `(n1, n2)` holds chunk `c1*n2 + c2`. Its
//! collectives are hierarchical, one per axis: a `[Z, T]` buffer viewed `[n1, n2, T]`
//! is `reduce_scatter`ed over the innermost axis first (the fast link moves the whole
//! buffer, the outer link `1/n2` of it) and `all_gather`ed outermost first; the bytes
//! each rank sends are those of one flat collective over the `Z = n1*n2` ranks.
//!
//! How one parameter is cut over its group (near-evenly, with per-rank widths and no
//! padding in stored state where the group does not divide its size) is
//! [`crate::zero_split`]'s.

use crate::util::build_error;
pub use crate::zero_split::{param_split, stage3_split, ZeroSplit};
use weft_ir::{At, Dim, Graph, Mesh, NodeMeta, Op, Partition, Provenance, ReduceOp, Value};

/// The axes whose ranks see different tokens of the same weights.
pub const DENSE_DATA_AXES: &[&str] = &["dp", "sp", "cp"];

/// The data-parallel group of one parameter: axes (outermost first) and their sizes;
/// axes of size 1 are left out, so an empty group means no sharding.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ZeroGroup {
    pub axes: Vec<(String, i64)>,
}

impl ZeroGroup {
    /// The group of parameter `name` in `g`: `edp` for expert parameters (split over
    /// `ep`), else the dense data axes of the mesh.
    pub fn of_param(g: &Graph, name: &str) -> ZeroGroup {
        let expert = g
            .param_partition(name)
            .iter()
            .any(|p| p.splits_over(weft_ir::mesh::EP));
        ZeroGroup::for_mesh(&g.mesh, expert)
    }

    /// The group of a dense (`expert` false) or expert parameter on `mesh`.
    pub fn for_mesh(mesh: &Mesh, expert: bool) -> ZeroGroup {
        let wanted: &[&str] = if expert {
            &[weft_ir::mesh::EDP]
        } else {
            DENSE_DATA_AXES
        };
        ZeroGroup {
            axes: mesh
                .axes
                .iter()
                .filter(|(a, n)| *n > 1 && wanted.contains(&a.as_str()))
                .map(|(a, n)| (a.clone(), *n as i64))
                .collect(),
        }
    }

    /// Keeps the axes in `axes` only (the axes a gradient is actually summed over).
    pub fn within(mut self, axes: &[String]) -> ZeroGroup {
        self.axes.retain(|(a, _)| axes.iter().any(|x| x == a));
        self
    }

    pub fn size(&self) -> i64 {
        self.axes.iter().map(|(_, n)| n).product()
    }

    /// The group size as the product of its axis symbols (what a gather's type says).
    pub fn size_dim(&self) -> Dim {
        self.axes
            .iter()
            .fold(Dim::from(1), |d, (a, _)| d * Dim::sym(a))
    }

    pub fn is_empty(&self) -> bool {
        self.axes.is_empty()
    }

    pub fn has(&self, axis: &str) -> bool {
        self.axes.iter().any(|(a, _)| a == axis)
    }

    /// This rank's index in the group (row-major over the axes), as a dim.
    pub fn index(&self) -> Dim {
        let mut stride = 1i64;
        let mut out = Dim::zero();
        for (a, n) in self.axes.iter().rev() {
            out = out + Dim::coord(a) * Dim::from(stride);
            stride *= n;
        }
        out
    }

    /// `dp x sp` style name for reports.
    pub fn name(&self) -> String {
        self.axes
            .iter()
            .map(|(a, _)| a.as_str())
            .collect::<Vec<_>>()
            .join("x")
    }

    /// The sizes of the leading dims of the `[n1, .., nk, rest]` view.
    fn view(&self, rest: &[Dim]) -> Vec<Dim> {
        let mut s: Vec<Dim> = self.axes.iter().map(|(_, n)| Dim::from(*n)).collect();
        s.extend_from_slice(rest);
        s
    }
}

/// The partitions of a flat state tensor for a parameter split by `parts`: each of the
/// parameter's split axes becomes a split of the flat tensor's dim 0 into equal blocks
/// of `block` elements (the flattened local shard, exactly), in the same order.
pub fn flat_param_partitions(mesh: &Mesh, parts: &[Partition], block: i64) -> Vec<Partition> {
    let mut axes: Vec<(String, i64)> = Vec::new();
    for a in parts.iter().flat_map(|p| &p.axes) {
        if !axes.iter().any(|(x, _)| x == a) {
            axes.push((a.clone(), mesh.size_or_one(a) as i64));
        }
    }
    let mut inner: i64 = axes.iter().map(|(_, n)| n).product::<i64>() * block;
    axes.into_iter()
        .map(|(a, n)| {
            inner /= n;
            Partition::simple("flat", &a, 0, vec![inner; n as usize])
        })
        .collect()
}

/// The element count of a per-rank type with the mesh sizes bound (`4/ep*2048` is
/// 4096 on `ep=2`); `None` where it differs per rank (an uneven split).
pub fn local_numel(mesh: &Mesh, t: &weft_ir::TensorType) -> Option<i64> {
    let mut b = weft_ir::Bindings::new();
    for (a, n) in &mesh.axes {
        b = b.with(a, *n as i64);
    }
    t.numel().bind(&b).as_const()
}

/// Inserts nodes after `at`, each carrying `pass`'s provenance with its reason.
pub(crate) struct Emitter<'a> {
    pub pass: &'static str,
    pub at: At,
    pub meta: NodeMeta,
    pub g: &'a mut Graph,
}

impl Emitter<'_> {
    pub fn op(&mut self, op: Op, xs: &[Value], reason: &str) -> Result<Value, crate::PassError> {
        Ok(self.ops(op, xs, reason)?[0])
    }
    pub fn ops(
        &mut self,
        op: Op,
        xs: &[Value],
        reason: &str,
    ) -> Result<Vec<Value>, crate::PassError> {
        let mut meta = self.meta.clone();
        meta.provenance = Some(Provenance {
            pass: self.pass.into(),
            reason: reason.into(),
        });
        let v = self
            .g
            .insert_with(self.at, op, xs, meta)
            .map_err(|e| build_error(self.pass, e))?;
        if let At::After(_) = self.at {
            self.at = At::After(self.g.def(v[0]));
        }
        Ok(v)
    }

    /// `x` flattened to `[n]`, `n` its element count as a constant, or as a table where
    /// it differs per rank (a slice of the flat view gives the size so where the type
    /// spells it with mesh sizes).
    pub fn flat_const(&mut self, x: Value, n: Dim, what: &str) -> Result<Value, crate::PassError> {
        let t = self.g.ty(x).clone();
        let sym = t.numel();
        let mut v = x;
        if t.rank() != 1 {
            v = self.op(
                Op::Reshape {
                    shape: vec![sym.clone()],
                },
                &[v],
                &format!("{what}: flatten"),
            )?;
        }
        if !sym.is_const() {
            v = self.op(
                Op::Slice {
                    dim: 0,
                    start: Dim::zero(),
                    len: n.clone(),
                },
                &[v],
                &format!("{what}: its {n} elements"),
            )?;
        }
        Ok(v)
    }

    /// The inverse of [`Emitter::flat_const`]: `[n]` back to `shape`.
    pub fn unflat(
        &mut self,
        x: Value,
        shape: &[Dim],
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let sym = shape.iter().fold(Dim::from(1), |a, d| a * d.clone());
        let mut v = x;
        if !sym.is_const() {
            v = self.op(
                Op::Slice {
                    dim: 0,
                    start: Dim::zero(),
                    len: sym,
                },
                &[v],
                &format!("{what}: as the local size"),
            )?;
        }
        if shape.len() != 1 {
            v = self.op(
                Op::Reshape {
                    shape: shape.to_vec(),
                },
                &[v],
                &format!("{what}: reshape"),
            )?;
        }
        Ok(v)
    }

    /// `[Z, rest..]` (rank-major chunks) reduce-scattered over the group: this rank's
    /// `[rest..]`, summed over the group's ranks. Innermost axis first.
    pub fn reduce_scatter(
        &mut self,
        group: &ZeroGroup,
        x: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let rest: Vec<Dim> = self.g.ty(x).shape[1..].to_vec();
        let k = group.axes.len();
        let mut v = if k == 1 {
            x
        } else {
            self.op(
                Op::Reshape {
                    shape: group.view(&rest),
                },
                &[x],
                &format!("{what}: one dim per axis of the {} group", group.name()),
            )?
        };
        for (i, (a, _)) in group.axes.iter().enumerate().rev() {
            let bytes = crate::grad_sync::value_bytes(self.g, v);
            v = self.op(
                Op::ReduceScatter {
                    axis: a.clone(),
                    dim: i as i64,
                    op: ReduceOp::Sum,
                },
                &[v],
                &format!(
                    "{what}: ZeRO reduce_scatter over {a} (group {}), sum (the loss is the global mean over valid tokens), {bytes} bytes",
                    group.name()
                ),
            )?;
        }
        // Each group dim is now `n/axis` (1 on every rank): slices give it as a constant.
        for i in 0..k {
            v = self.op(
                Op::Slice {
                    dim: i as i64,
                    start: Dim::zero(),
                    len: Dim::from(1),
                },
                &[v],
                &format!("{what}: this rank's row"),
            )?;
        }
        self.op(
            Op::Reshape { shape: rest },
            &[v],
            &format!("{what}: this rank's shard"),
        )
    }

    /// `[rest..]` on every rank of the group all-gathered into `[Z, rest..]`, rank-major.
    /// Outermost axis first.
    pub fn all_gather(
        &mut self,
        group: &ZeroGroup,
        x: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let v = self.gather_source(group, x, 0, what)?;
        Ok(self.all_gather_from(group, v, 0, what)?.0)
    }

    /// `x` `[lead.., rest..]` (`at` leading dims) viewed `[lead.., 1, .., 1, rest..]`,
    /// one dim per axis of the group after the leading dims: what
    /// [`Self::all_gather_from`] gathers.
    pub fn gather_source(
        &mut self,
        group: &ZeroGroup,
        x: Value,
        at: usize,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let shape = &self.g.ty(x).shape;
        let mut view = shape[..at].to_vec();
        view.extend(group.axes.iter().map(|_| Dim::from(1)));
        view.extend_from_slice(&shape[at..]);
        self.op(
            Op::Reshape { shape: view },
            &[x],
            &format!("{what}: one dim per axis of the {} group", group.name()),
        )
    }

    /// A [`Self::gather_source`] view (group dims after `at` leading dims) all-gathered
    /// into `[lead.., Z, rest..]`, outermost axis first, and the `all_gather` nodes in
    /// order. With leading dims the gathers are along inner dims (the runtime lays NCCL's
    /// rank-major blocks out along them).
    pub fn all_gather_from(
        &mut self,
        group: &ZeroGroup,
        source: Value,
        at: usize,
        what: &str,
    ) -> Result<(Value, Vec<weft_ir::Node>), crate::PassError> {
        let shape = self.g.ty(source).shape.clone();
        let k = group.axes.len();
        let mut v = source;
        let mut gathers = Vec::with_capacity(k);
        for (i, (a, _)) in group.axes.iter().enumerate() {
            let bytes = crate::grad_sync::value_bytes(self.g, v);
            v = self.op(
                Op::AllGather {
                    axis: a.clone(),
                    dim: (at + i) as i64,
                },
                &[v],
                &format!(
                    "{what}: ZeRO all_gather over {a} (group {}), {bytes} bytes per rank in",
                    group.name()
                ),
            )?;
            gathers.push(self.g.def(v));
        }
        let mut every = shape[..at].to_vec();
        every.push(group.size_dim());
        every.extend_from_slice(&shape[at + k..]);
        let every = self.op(
            Op::Reshape { shape: every },
            &[v],
            &format!("{what}: every rank's shard"),
        )?;
        Ok((every, gathers))
    }
}

/// Declares output `name` split on dim 0 over `axes`, outermost first (a flat state
/// or gradient shard: [`ZeroSplit::output_axes`], the layout of
/// [`ZeroSplit::state_partitions`]).
pub fn split_output(g: &mut Graph, name: &str, axes: &[String]) {
    for a in axes {
        g.add_output_split(name, 0, a);
    }
}

/// The region of a parameter use that shares one ZeRO-3 gather: the forward or the
/// backward (recomputation included) of one micro-batch.
fn use_region(g: &Graph, n: weft_ir::Node) -> (bool, u32) {
    let m = &g.node(n).meta;
    (m.derived.is_some(), m.micro_batch.unwrap_or(u32::MAX))
}

/// Where one parameter is defined (its `param` nodes) and read (node, operand index),
/// in program order.
#[derive(Default)]
pub struct ParamUse {
    defs: Vec<(weft_ir::Node, Value)>,
    readers: Vec<(weft_ir::Node, usize)>,
}

/// Every parameter's [`ParamUse`], from one scan of the graph: ZeRO-3 shards each
/// parameter in turn, and a scan per parameter made it quadratic in the step's size
/// (minutes for a 405B step). Sharding one parameter rewrites only its own readers, so
/// the index stays valid for the others.
pub struct ParamUses(std::collections::HashMap<String, ParamUse>);

impl ParamUses {
    pub fn of(g: &Graph) -> Self {
        let mut by_name: std::collections::HashMap<String, ParamUse> = Default::default();
        let mut name_of: std::collections::HashMap<Value, &str> = Default::default();
        for &n in g.nodes() {
            if let Op::Param { name, .. } = &g.node(n).op {
                let v = g.node(n).results[0];
                by_name.entry(name.clone()).or_default().defs.push((n, v));
                name_of.insert(v, name);
            }
        }
        for &n in g.nodes() {
            for (i, v) in g.node(n).operands.iter().enumerate() {
                if let Some(name) = name_of.get(v) {
                    if let Some(u) = by_name.get_mut(*name) {
                        u.readers.push((n, i));
                    }
                }
            }
        }
        ParamUses(by_name)
    }

    /// The uses of `name`, handed to [`shard_param`] (which consumes them).
    pub fn take(&mut self, name: &str) -> Option<ParamUse> {
        self.0.remove(name)
    }
}

/// The `all_gather`s of one ZeRO-3 parameter for one region (forward or backward of a
/// micro-batch), in order, the region's first reader of the parameter, and the layer
/// the parameter belongs to.
pub struct GatherChain {
    region: (bool, u32),
    reader: weft_ir::Node,
    gathers: Vec<weft_ir::Node>,
    layer: Option<String>,
}

/// The layer of a parameter from its source path: the path up to its first numeric
/// component (`model.layers.51.mlp.down_proj` -> `model.layers.51`); `None` for
/// parameters outside numbered layers (embeddings, the final norm, the head).
pub fn layer_of(source: &str) -> Option<String> {
    let mut end = 0;
    for part in source.split('.') {
        end += part.len();
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return Some(source[..end].to_string());
        }
        end += 1;
    }
    None
}

/// Issues each region's ZeRO-3 gathers a layer early: in a region (forward or backward
/// of a micro-batch), parameters are grouped by layer in order of first use (a
/// parameter outside numbered layers is a group of its own), and the gathers of a
/// group's `j`-th parameter move to right before the first reader of the previous
/// group's `j`-th (its last, where that group is smaller): each parameter is gathered
/// a layer before its use, in step with the layer before it. On the in-order
/// communication stream the gathers then run while the previous layer computes, and
/// that layer's own collectives (the Ulysses all_to_alls, the ring steps) queue only
/// behind the gathers of the parameters used before them; made at each use, the
/// gathers queued behind those collectives and the compute waited for every gather
/// (a 405B step on dp=32,cp=8,sp=4: 21 s of 38 s compute stalled; with the whole layer
/// issued at its first reader, the all_to_alls waited behind the MLP's gathers). Only
/// the collectives move: the reshapes and slices that finish a parameter stay at its
/// use, so the compute stream never waits for a gather before it needs it. At most
/// about two layers' gathered parameters are alive at once, as the analytic model
/// counts. Values are unchanged: only the program order moves.
pub fn prefetch_gathers(g: &mut Graph, chains: &[GatherChain]) {
    let pos: std::collections::HashMap<weft_ir::Node, usize> =
        g.nodes().iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut by_region: std::collections::BTreeMap<(bool, u32), Vec<&GatherChain>> =
        Default::default();
    // A chain whose reader a later rewrite removed stays where it is.
    for c in chains.iter().filter(|c| pos.contains_key(&c.reader)) {
        by_region.entry(c.region).or_default().push(c);
    }
    let mut place = crate::placement::Placement::new();
    for cs in by_region.values_mut() {
        cs.sort_by_key(|c| pos[&c.reader]);
        // Consecutive chains of one layer form a group.
        let mut groups: Vec<Vec<&GatherChain>> = Vec::new();
        for c in cs.iter() {
            match groups.last_mut() {
                Some(g) if c.layer.is_some() && g[0].layer == c.layer => g.push(c),
                _ => groups.push(vec![c]),
            }
        }
        for pair in groups.windows(2) {
            let (prev, group) = (&pair[0], &pair[1]);
            for (j, c) in group.iter().enumerate() {
                let anchor = prev.get(j).unwrap_or(&prev[prev.len() - 1]).reader;
                for &n in &c.gathers {
                    place.record(n, At::Before(anchor));
                }
            }
        }
    }
    place.finish(g);
}

/// ZeRO stage 3: parameter `name` becomes this rank's rows of dim 0, or of dim 1 where
/// dim 0 has fewer rows than ranks ([`ZeroSplit::dim`]) (the row split `split` over
/// its group, inside its own partitions, outermost axis first; uneven rows are this
/// rank's width of a per-rank table, never padded), and every region
/// that reads it (each micro-batch's forward, each backward) reads its own
/// `all_gather` of the rows, made right before the region's first use: the whole
/// parameter lives only while that region runs. Returns the new parameter value.
pub fn shard_param(
    g: &mut Graph,
    pass: &'static str,
    name: &str,
    split: &ZeroSplit,
    uses: ParamUse,
    chains: &mut Vec<GatherChain>,
) -> Result<Value, crate::PassError> {
    let group = &split.group;
    let rows = split.unit_width();
    let widths = if split.is_even() {
        String::new()
    } else {
        format!(", uneven: {:?} per rank", split.unit_widths())
    };
    let olds = uses.defs;
    if olds.is_empty() {
        return Err(crate::PassError::rewrite(
            pass,
            format!("ZeRO-3 cannot shard `{name}`"),
            "the training step".to_string(),
            "the program has no `param` node of that name".to_string(),
        ));
    }
    let (first, v0) = olds[0];
    let ty = g.ty(v0).clone();
    let d = split.dim;
    let mut shard_ty = ty.clone();
    shard_ty.shape[d] = rows.clone();
    let mut meta = g.node(first).meta.clone();
    meta.provenance = Some(Provenance {
        pass: pass.into(),
        reason: format!(
            "ZeRO-3: this rank's {rows} rows of `{name}` (dim {d} split over {}{widths})",
            group.name()
        ),
    });
    let shard = g
        .insert_with(
            At::Before(first),
            Op::Param {
                name: name.into(),
                ty: shard_ty,
            },
            &[],
            meta.clone(),
        )
        .map_err(|e| build_error(pass, e))?[0];
    let mut regions: std::collections::BTreeMap<(bool, u32), Vec<(weft_ir::Node, usize)>> =
        Default::default();
    for (n, i) in uses.readers {
        regions.entry(use_region(g, n)).or_default().push((n, i));
    }
    let full_rows = ty.shape[d].clone();
    // The gathers' source view is made once, next to the shard: a view at each
    // region's first use would order the gather after the compute before that use, and
    // no prefetch could start it earlier.
    let even_source = if split.is_even() {
        let mut em = Emitter {
            pass,
            at: At::After(g.def(shard)),
            meta: NodeMeta {
                source: meta.source.clone(),
                ..Default::default()
            },
            g: &mut *g,
        };
        Some(em.gather_source(group, shard, d, &format!("ZeRO-3: `{name}`'s shard"))?)
    } else {
        None
    };
    for ((backward, mb), us) in regions {
        // `us` is in program order: its first node is the region's first reader.
        let at = us.first().map(|(n, _)| *n).expect("a use");
        let phase = if backward { "backward" } else { "forward" };
        let mbt = if mb == u32::MAX {
            String::new()
        } else {
            format!(" of micro-batch {mb}")
        };
        let mut em = Emitter {
            pass,
            at: At::Before(at),
            meta: NodeMeta {
                source: meta.source.clone(),
                micro_batch: (mb != u32::MAX).then_some(mb),
                ..Default::default()
            },
            g: &mut *g,
        };
        let v = if let Some(source) = even_source {
            // Outermost axis first: the slow (outer) links move the fewest bytes, the
            // innermost axis the whole parameter.
            let what = format!(
                "ZeRO-3: gather `{name}` for its {phase}{mbt}; freed after its last use there"
            );
            let (every, gathers) = em.all_gather_from(group, source, d, &what)?;
            chains.push(GatherChain {
                region: (backward, mb),
                reader: at,
                gathers,
                layer: meta.source.as_deref().and_then(layer_of),
            });
            let mut shape = ty.shape.clone();
            shape[d] = group.size_dim() * rows.clone();
            let v = em.op(
                Op::Reshape { shape },
                &[every],
                &format!("ZeRO-3: `{name}`'s gathered rows, flat"),
            )?;
            em.op(
                Op::Slice {
                    dim: d as i64,
                    start: Dim::zero(),
                    len: full_rows.clone(),
                },
                &[v],
                &format!("ZeRO-3: `{name}` whole for its {phase}{mbt}"),
            )?
        } else {
            let what = format!(
                "ZeRO-3: gather `{name}` for its {phase}{mbt}; freed after its last use there"
            );
            let flat = if split.is_per_outer() {
                em.flat_const(shard, split.width(), &format!("ZeRO-3: `{name}`'s rows"))?
            } else {
                let rows_first =
                    em.rows_layout(split, shard, &format!("ZeRO-3: `{name}`'s rows"))?;
                em.flat_const(
                    rows_first,
                    split.width(),
                    &format!("ZeRO-3: `{name}`'s rows"),
                )?
            };
            let whole = em.gather_pieces(split, flat, &what)?;
            if split.is_per_outer() {
                em.unflat(
                    whole,
                    &ty.shape,
                    &format!("ZeRO-3: `{name}` whole for its {phase}{mbt}"),
                )?
            } else {
                let whole = em.unflat(
                    whole,
                    &split.rows_view(&ty.shape),
                    &format!("ZeRO-3: `{name}` whole for its {phase}{mbt}"),
                )?;
                em.rows_layout(split, whole, &format!("ZeRO-3: `{name}` whole"))?
            }
        };
        for (n, i) in us {
            g.node_mut(n).operands[i] = v;
        }
    }
    for p in split.row_partitions() {
        g.add_param_partition(name, p);
    }
    let dead: Vec<weft_ir::Node> = olds.iter().map(|(n, _)| *n).collect();
    g.remove_nodes(&dead);
    Ok(shard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_the_path_up_to_the_first_number() {
        assert_eq!(
            layer_of("model.layers.51.mlp.down_proj").as_deref(),
            Some("model.layers.51")
        );
        assert_eq!(
            layer_of("model.layers.3.mlp.experts.7.w1").as_deref(),
            Some("model.layers.3")
        );
        assert_eq!(layer_of("model.embed_tokens"), None);
        assert_eq!(layer_of("lm_head"), None);
        assert_eq!(layer_of("h.0").as_deref(), Some("h.0"));
    }

    #[test]
    fn groups_follow_the_replicas() {
        let m = Mesh::parse("dp=2,sp=2,tp=2").unwrap();
        let d = ZeroGroup::for_mesh(&m, false);
        assert_eq!(d.name(), "dpxsp");
        assert_eq!(d.size(), 4);
        let at = |dp, sp| {
            let b = weft_ir::Bindings::new()
                .with_coord("dp", dp)
                .with_coord("sp", sp)
                .with_coord("tp", 1);
            d.index().eval(&b).unwrap()
        };
        assert_eq!((at(0, 0), at(0, 1), at(1, 0), at(1, 1)), (0, 1, 2, 3));
        let m = Mesh::parse("dp=4,ep=2").unwrap();
        assert_eq!(ZeroGroup::for_mesh(&m, true).name(), "edp");
        assert_eq!(ZeroGroup::for_mesh(&m, false).name(), "dp");
        let m = Mesh::parse("tp=2").unwrap();
        assert!(ZeroGroup::for_mesh(&m, false).is_empty());
    }
}

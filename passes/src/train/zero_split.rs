//! How ZeRO splits one parameter over its data-parallel group, padding-free.
//!
//! A [`ZeroSplit`] cuts a parameter's flattened local elements (stages 1 and 2), or the
//! rows of its dim 0 (stage 3; of dim 1 where dim 0 has fewer rows than the group has
//! ranks, as a stack of a few experts `[E, R, C]`: each rank then holds `[E, its rows
//! of R, C]`, whose flat layout is the `[R, E, C]` view so that every rank's piece is
//! contiguous in the collectives' buffers and the flat optimizer state) near-evenly
//! over the ranks of its group, by tensor parallelism's rule ([`near_even`]): the first
//! `units % Z` ranks take one unit more.
//! The widths are recorded per rank (a per-rank size table where ranks differ), so each
//! rank stores exactly its piece of the parameter, the gradient and the optimizer state.
//! Collectives still move uniform buffers: a piece is padded to the widest piece inside
//! the buffer of a `reduce_scatter` or `all_gather` only, never in stored state.
//!
//! The group's ranks are flattened row-major, outermost axis first (see
//! [`ZeroGroup::index`]), and the split is near-even over that flat order whatever the
//! number of axes: 7 rows over `dp=2, sp=3` are `[2 1 1 1 1 1]`. Where the split is
//! even it is recorded as one nested `zero` partition per axis; where it is not, a
//! group of several axes cannot nest (the inner split would differ per outer rank:
//! `[2 1 1]` on dp rank 0, `[1 1 1]` on dp rank 1), so it is one *group* partition over
//! all of the group's axes (`zero dp*sp dim=0 [2 1 1 1 1 1]`), and a rank's width or
//! offset is a per-rank table over those axes ([`Dim::per_group_rank`]).
//!
//! A local size that already differs per rank of axes outside the group (an uneven tp
//! shard: 5 heads over `tp=2` are 3 and 2) is split by each of those ranks on its own:
//! rank `(t, d)` holds `near_even(numel(t), Z)[d]` elements, its width and offset tables
//! over the outer axes and the group's. Its flat state is every tp rank's flattened
//! shard in tp order, each split over the group: one group partition over the outer
//! axes then the group's (`zero tp*dp dim=0 [368 367 245 245]` for 735 and 490
//! elements over `dp=2`). The collectives'
//! buffers are padded to the widest piece of any rank. At stage 3 such a parameter is
//! rows over the group where tp split another dim (the same rows on every tp rank,
//! rows of different sizes: `o_proj`'s 35 rows of 24 or 16 columns), and shards its
//! state only where tp split dim 0 (its rows differ per tp rank). A parameter is left unsharded
//! ([`param_split`] is `None`, counted `unsharded_uneven` by the optimizer) only where
//! there is nothing to split: fewer units than ranks.

use crate::parallel::tp::sizes::near_even;
use crate::zero::{local_numel, Emitter, ZeroGroup};
use weft_ir::{Dim, Mesh, Op, Partition, TensorType, Value};

/// One parameter's split over its ZeRO group: `units` units of `unit` elements each.
///
/// Where the local size itself differs per rank of other axes (`outer`: an uneven tp
/// shard, 5 heads over `tp=2`), each of those ranks splits its own size over the
/// group: the rank at `(t, d)` holds `near_even(outer_units[t], Z)[d]` units, and the
/// widths and offsets are tables over the outer axes and the group's, flattened
/// row-major (outer axes first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZeroSplit {
    pub group: ZeroGroup,
    /// Elements per unit: 1 for an element split, the row's size for a row split.
    pub unit: i64,
    /// The units split over the group (elements, or rows of dim 0); the most of any
    /// outer rank where `outer` is not empty.
    pub units: i64,
    /// Whether the units are rows (ZeRO-3 shards the parameter itself).
    pub rows: bool,
    /// The dim whose rows a row split cuts: 0, or 1 for a parameter with fewer rows of
    /// dim 0 than ranks (a stack of a few experts, `[E, R, C]`), each rank then holding
    /// `[E, its rows of R, C]`. Its flat layout is the `[R, E, C]` view (dims 0 and 1
    /// swapped, [`ZeroSplit::rows_view`]), so every rank's piece is contiguous there.
    pub dim: usize,
    /// The axes (outermost first, with their sizes) over which the local size differs;
    /// empty where it is the same on every rank.
    pub outer: Vec<(String, i64)>,
    /// The units of each outer rank, row-major (`[units]` where `outer` is empty).
    pub outer_units: Vec<i64>,
    /// The elements per unit of each outer rank, row-major (`[unit]` where `outer` is
    /// empty): 1 for an element split, the row's size for a row split (a row of a tp
    /// shard split on another dim differs per tp rank).
    pub outer_unit: Vec<i64>,
}

impl ZeroSplit {
    fn new(group: &ZeroGroup, unit: i64, units: i64, rows: bool) -> Option<ZeroSplit> {
        ZeroSplit::per_outer(group, Vec::new(), vec![units], vec![unit], rows)
    }

    /// A split whose units differ per rank of `outer` (`outer_units`, row-major).
    fn per_outer(
        group: &ZeroGroup,
        outer: Vec<(String, i64)>,
        outer_units: Vec<i64>,
        outer_unit: Vec<i64>,
        rows: bool,
    ) -> Option<ZeroSplit> {
        let z = group.size();
        let fewest = *outer_units.iter().min()?;
        if group.is_empty() || fewest < z {
            return None;
        }
        Some(ZeroSplit {
            group: group.clone(),
            unit: *outer_unit.iter().max()?,
            units: *outer_units.iter().max()?,
            rows,
            dim: 0,
            outer,
            outer_units,
            outer_unit,
        })
    }

    /// Whether a row split cuts dim 1 (see [`ZeroSplit::dim`]): its flat layout is the
    /// parameter with dims 0 and 1 swapped.
    pub fn swaps_leading_dims(&self) -> bool {
        self.rows && self.dim == 1
    }

    /// `shape` (the parameter's, or a shard's) as the flat layout orders it: dims 0 and
    /// 1 swapped where the split cuts dim 1, unchanged otherwise.
    pub fn rows_view(&self, shape: &[Dim]) -> Vec<Dim> {
        let mut s = shape.to_vec();
        if self.swaps_leading_dims() {
            s.swap(0, 1);
        }
        s
    }

    /// Whether the local size differs per rank of other axes (see [`ZeroSplit::outer`]).
    pub fn is_per_outer(&self) -> bool {
        !self.outer.is_empty()
    }

    /// The axes of the width and offset tables: the outer axes, then the group's.
    pub fn table_axes(&self) -> Vec<(String, i64)> {
        let mut axes = self.outer.clone();
        axes.extend(self.group.axes.iter().cloned());
        axes
    }

    /// Every (outer, group) rank's units, row-major over [`ZeroSplit::table_axes`].
    pub fn unit_table(&self) -> Vec<i64> {
        self.outer_units
            .iter()
            .flat_map(|u| near_even(*u, self.ranks()))
            .collect()
    }

    /// This rank's local element count (before the split), as a dim.
    pub fn numel_dim(&self) -> Dim {
        if !self.is_per_outer() {
            return Dim::from(self.numel());
        }
        let numels: Vec<i64> = self
            .outer_units
            .iter()
            .zip(&self.outer_unit)
            .map(|(n, u)| n * u)
            .collect();
        Dim::per_group_rank(&self.outer, &numels).expect("one size per outer rank")
    }

    pub fn ranks(&self) -> i64 {
        self.group.size()
    }

    /// The local parameter's element count (the sum of every rank's width).
    pub fn numel(&self) -> i64 {
        self.unit * self.units
    }

    /// The units of the narrow ranks.
    fn base(&self) -> i64 {
        self.units / self.ranks()
    }

    /// How many ranks (the first ones) take one unit more than `base`.
    fn wide_ranks(&self) -> i64 {
        self.units % self.ranks()
    }

    pub fn is_even(&self) -> bool {
        !self.is_per_outer() && self.wide_ranks() == 0
    }

    /// Every rank's units, in group order.
    pub fn unit_widths(&self) -> Vec<i64> {
        near_even(self.units, self.ranks())
    }

    /// Every rank's elements, in group order (over the outer axes too, row-major,
    /// where the local size differs per outer rank).
    pub fn widths(&self) -> Vec<i64> {
        let z = self.ranks() as usize;
        self.unit_table()
            .chunks(z)
            .zip(&self.outer_unit)
            .flat_map(|(row, u)| row.iter().map(move |w| w * u))
            .collect()
    }

    /// The widest piece's elements: the row of a collective's buffer.
    pub fn chunk(&self) -> i64 {
        self.widths().into_iter().max().unwrap_or(0)
    }

    /// A per-rank table (one value per rank of [`ZeroSplit::table_axes`], row-major)
    /// as a dim: a constant when every rank has the same value, else a table.
    fn per_rank(&self, table: Vec<i64>) -> Dim {
        Dim::per_group_rank(&self.table_axes(), &table)
            .expect("a ZeroSplit's tables list one value per rank")
    }

    /// This rank's units (rows, for a row split).
    pub fn unit_width(&self) -> Dim {
        self.per_rank(self.unit_table())
    }

    /// Group rank `d`'s width, as a dim over the outer axes (a constant without them).
    fn width_of(&self, d: usize) -> Dim {
        let z = self.ranks() as usize;
        let t: Vec<i64> = self.widths().chunks(z).map(|row| row[d]).collect();
        self.outer_dim(t)
    }

    /// Group rank `d`'s offset in the flat local value, as a dim over the outer axes.
    fn offset_of(&self, d: usize) -> Dim {
        let z = self.ranks() as usize;
        let t: Vec<i64> = self
            .widths()
            .chunks(z)
            .map(|row| row[..d].iter().sum())
            .collect();
        self.outer_dim(t)
    }

    /// One value per outer rank as a dim.
    fn outer_dim(&self, t: Vec<i64>) -> Dim {
        if self.outer.is_empty() {
            return Dim::from(t[0]);
        }
        Dim::per_group_rank(&self.outer, &t).expect("one value per outer rank")
    }

    /// This rank's elements (its units times the unit, so that a row split's flat
    /// width and its rows' element count are the same dim).
    pub fn width(&self) -> Dim {
        if self.is_per_outer() {
            return self.per_rank(self.widths());
        }
        self.unit_width() * Dim::from(self.unit)
    }

    /// The flat index of this rank's first element.
    pub fn offset(&self) -> Dim {
        if self.is_even() {
            return self.group.index() * Dim::from(self.chunk());
        }
        let z = self.ranks() as usize;
        let offsets: Vec<i64> = self
            .widths()
            .chunks(z)
            .flat_map(|row| {
                row.iter()
                    .scan(0, |at, w| {
                        let o = *at;
                        *at += w;
                        Some(o)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        self.per_rank(offsets)
    }

    /// The partitions over the group of `total` (`units` times `scale`) on dim 0,
    /// appended to `before`: an even split nests one partition per axis, outermost
    /// first; an uneven one is a single partition over the whole group (its one axis,
    /// or all of them flattened).
    fn group_partitions(
        &self,
        mut before: Vec<Partition>,
        scale: i64,
        dim: usize,
    ) -> Vec<Partition> {
        if self.is_even() {
            let mut inner = self.units * scale;
            for (a, n) in &self.group.axes {
                inner /= n;
                before.push(Partition::simple("zero", a, dim, vec![inner; *n as usize]));
            }
        } else {
            let axes: Vec<String> = self.group.axes.iter().map(|(a, _)| a.clone()).collect();
            let sizes = self.unit_widths().iter().map(|w| w * scale).collect();
            before.push(Partition::group("zero", &axes, dim, sizes));
        }
        before
    }

    /// The partitions of a flat state tensor of a parameter split by `own`: its dim 0
    /// is first split by the parameter's own split axes (in blocks of its flattened
    /// local shard, [`crate::zero::flat_param_partitions`]), then over the group: each
    /// rank's part is exactly its piece. Where the local size differs per outer rank,
    /// the outer axes and the group are one group partition (outer axes first), whose
    /// sizes are every rank's piece: the full state is every outer rank's flattened
    /// shard, in order, each split over the group.
    pub fn state_partitions(&self, mesh: &Mesh, own: &[Partition]) -> Vec<Partition> {
        if !self.is_per_outer() {
            let flat = crate::zero::flat_param_partitions(mesh, own, self.numel());
            return self.group_partitions(flat, self.unit, 0);
        }
        let rest: Vec<Partition> = own
            .iter()
            .filter(|p| {
                !p.axes
                    .iter()
                    .any(|a| self.outer.iter().any(|(o, _)| o == a))
            })
            .cloned()
            .collect();
        let total: i64 = self.widths().iter().sum();
        let mut parts = crate::zero::flat_param_partitions(mesh, &rest, total);
        let axes: Vec<String> = self.table_axes().into_iter().map(|(a, _)| a).collect();
        parts.push(Partition::group("zero", &axes, 0, self.widths()));
        parts
    }

    /// The axes a flat state or gradient-shard output is split over on dim 0, outermost
    /// first, as [`ZeroSplit::state_partitions`] lays it out: the parameter's own split
    /// axes (`own`; the outer ones last), then the group's.
    pub fn output_axes(&self, own: &[Partition]) -> Vec<String> {
        let mut seen: Vec<String> = Vec::new();
        for a in own.iter().flat_map(|p| &p.axes) {
            if !seen.contains(a) && !self.outer.iter().any(|(o, _)| o == a) {
                seen.push(a.clone());
            }
        }
        seen.extend(self.table_axes().into_iter().map(|(a, _)| a));
        seen
    }

    /// The partitions a row split adds to the parameter's split dim.
    pub fn row_partitions(&self) -> Vec<Partition> {
        self.group_partitions(Vec::new(), 1, self.dim)
    }
}

/// ZeRO stage 3's split of a parameter of local type `ty`: the rows of its dim 0 over
/// `group`, near-evenly (uneven rows allowed on any group; rows whose size differs per
/// tp rank too, where dim 0 is not the dim tp split unevenly). Where dim 0 has fewer
/// rows than the group has ranks (a stack of fewer local experts than ranks), the rows
/// of dim 1 ([`ZeroSplit::dim`]); a stack whose leading dims are too small for either
/// stays whole. `None` where the parameter stays whole on every rank (its state may
/// still be sharded by [`param_split`]).
pub fn stage3_split(mesh: &Mesh, ty: &TensorType, group: &ZeroGroup) -> Option<ZeroSplit> {
    if group.is_empty() || ty.rank() == 0 || !ty.dtype.is_float() {
        return None;
    }
    let mut b = weft_ir::Bindings::new();
    for (a, n) in &mesh.axes {
        b = b.with(a, *n as i64);
    }
    let rows = ty.shape[0].bind(&b).as_const()?;
    if rows == 0 {
        return None;
    }
    if let Some(total) = local_numel(mesh, ty) {
        if let Some(s) = ZeroSplit::new(group, total / rows, rows, true) {
            return Some(s);
        }
        let rows1 = ty.shape.get(1)?.bind(&b).as_const()?;
        if rows1 == 0 {
            return None;
        }
        let mut s = ZeroSplit::new(group, total / rows1, rows1, true)?;
        s.dim = 1;
        return Some(s);
    }
    // A tp shard split on another dim: the same rows on every tp rank, rows of
    // different sizes.
    let (outer, numels) = outer_numels(mesh, ty)?;
    let units = vec![rows; numels.len()];
    let unit = numels.iter().map(|n| n / rows).collect();
    ZeroSplit::per_outer(group, outer, units, unit, true)
}

/// The split of a parameter of local type `ty` over `group`, computed once and used by
/// grad-sync and the optimizer alike: its rows when `stage3` asks and
/// [`stage3_split`] allows, else its flattened elements (where the local size differs
/// per rank of other axes, an uneven tp shard, each of those ranks' own size). `None`:
/// not sharded (no group, fewer elements than ranks).
pub fn param_split(
    mesh: &Mesh,
    ty: &TensorType,
    group: &ZeroGroup,
    stage3: bool,
) -> Option<ZeroSplit> {
    if stage3 {
        if let Some(s) = stage3_split(mesh, ty, group) {
            return Some(s);
        }
    }
    if let Some(n) = local_numel(mesh, ty) {
        return ZeroSplit::new(group, 1, n, false);
    }
    let (outer, units) = outer_numels(mesh, ty)?;
    let unit = vec![1; units.len()];
    ZeroSplit::per_outer(group, outer, units, unit, false)
}

/// The outer axes with their sizes, and the element count on each of their ranks.
type OuterNumels = (Vec<(String, i64)>, Vec<i64>);

/// The axes (mesh order, with their sizes) a per-rank local type's element count
/// differs over, none of them in the ZeRO group, and the count on each of their ranks
/// (row-major); `None` where it cannot be evaluated so.
fn outer_numels(mesh: &Mesh, ty: &TensorType) -> Option<OuterNumels> {
    let mut b = weft_ir::Bindings::new();
    for (a, n) in &mesh.axes {
        b = b.with(a, *n as i64);
    }
    let numel = ty.numel().bind(&b);
    let tables = numel.per_rank_tables();
    let outer: Vec<(String, i64)> = mesh
        .axes
        .iter()
        .filter(|(a, _)| tables.iter().any(|(x, _)| x == a))
        .map(|(a, n)| (a.clone(), *n as i64))
        .collect();
    if outer.is_empty() {
        return None;
    }
    let total: i64 = outer.iter().map(|(_, n)| n).product();
    let mut units = Vec::with_capacity(total as usize);
    for i in 0..total {
        let mut at = b.clone();
        let mut rest = i;
        for (a, n) in outer.iter().rev() {
            at = at.with_coord(a, rest % n);
            rest /= n;
        }
        units.push(numel.eval(&at).ok()?);
    }
    Some((outer, units))
}

impl Emitter<'_> {
    /// `x` (a parameter, its shard or its gradient, in the parameter's layout) in the
    /// layout a row split flattens: dims 0 and 1 swapped where the split cuts dim 1
    /// ([`ZeroSplit::rows_view`]); `x` itself otherwise. Swapping is its own inverse, so
    /// this also takes the flat layout's view back to the parameter's.
    pub fn rows_layout(
        &mut self,
        split: &ZeroSplit,
        x: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        if !split.swaps_leading_dims() {
            return Ok(x);
        }
        self.op(
            Op::Transpose { dim0: 0, dim1: 1 },
            &[x],
            &format!(
                "{what}: dims 0 and 1 swapped (ZeRO-3 splits the rows of dim 1: dim 0 has fewer rows than the {} group has ranks)",
                split.group.name()
            ),
        )
    }

    /// `[numel]`, a whole local value flattened, as the `[Z, chunk]` buffer a
    /// `reduce_scatter` over the group takes: rank `r`'s piece in row `r`, each narrow
    /// piece followed by zeros (padding in the buffer only).
    pub fn split_rows(
        &mut self,
        split: &ZeroSplit,
        flat: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let (z, chunk) = (split.ranks(), split.chunk());
        if split.is_even() {
            return self.op(
                Op::Reshape {
                    shape: vec![Dim::from(z), Dim::from(chunk)],
                },
                &[flat],
                &format!(
                    "{what}: one chunk per rank of the {} group",
                    split.group.name()
                ),
            );
        }
        if split.is_per_outer() {
            return self.split_rows_per_outer(split, flat, what);
        }
        let (wide, narrow) = (split.wide_ranks(), z - split.wide_ranks());
        let nw = split.base() * split.unit;
        let dtype = self.g.ty(flat).dtype;
        let head = self.op(
            Op::Slice {
                dim: 0,
                start: Dim::zero(),
                len: Dim::from(wide * chunk),
            },
            &[flat],
            &format!("{what}: the pieces of the {wide} wide ranks"),
        )?;
        let head = self.op(
            Op::Reshape {
                shape: vec![Dim::from(wide), Dim::from(chunk)],
            },
            &[head],
            &format!("{what}: one row per wide rank"),
        )?;
        let tail = self.op(
            Op::Slice {
                dim: 0,
                start: Dim::from(wide * chunk),
                len: Dim::from(narrow * nw),
            },
            &[flat],
            &format!("{what}: the pieces of the {narrow} narrow ranks"),
        )?;
        let tail = self.op(
            Op::Reshape {
                shape: vec![Dim::from(narrow), Dim::from(nw)],
            },
            &[tail],
            &format!("{what}: one row per narrow rank"),
        )?;
        let pad = self.op(
            Op::Full {
                value: weft_ir::Float(0.0),
                ty: TensorType::new(dtype, vec![Dim::from(narrow), Dim::from(split.unit)]),
            },
            &[],
            &format!(
                "{what}: zeros after each narrow piece, in the collective's buffer only (uneven split {:?} over {})",
                split.widths(),
                split.group.name()
            ),
        )?;
        let tail = self.op(
            Op::Concat { dim: 1 },
            &[tail, pad],
            &format!("{what}: narrow rows padded to {chunk}"),
        )?;
        self.op(
            Op::Concat { dim: 0 },
            &[head, tail],
            &format!(
                "{what}: one row per rank of the {} group",
                split.group.name()
            ),
        )
    }

    /// The inverse of [`Emitter::split_rows`]: gathered `[Z, chunk]` rows back to the
    /// flat `[numel]` value, the buffer's padding dropped.
    pub fn join_rows(
        &mut self,
        split: &ZeroSplit,
        rows: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let (z, chunk) = (split.ranks(), split.chunk());
        if split.is_even() {
            // The gathered rows are `[group size, chunk]` in the group's axis symbols:
            // the slice gives the size as a constant.
            let flat = self.op(
                Op::Reshape {
                    shape: vec![split.group.size_dim() * Dim::from(chunk)],
                },
                &[rows],
                what,
            )?;
            return self.op(
                Op::Slice {
                    dim: 0,
                    start: Dim::zero(),
                    len: Dim::from(z * chunk),
                },
                &[flat],
                &format!("{what} without padding"),
            );
        }
        if split.is_per_outer() {
            return self.join_rows_per_outer(split, rows, what);
        }
        let (wide, narrow) = (split.wide_ranks(), z - split.wide_ranks());
        let nw = split.base() * split.unit;
        let head = self.op(
            Op::Slice {
                dim: 0,
                start: Dim::zero(),
                len: Dim::from(wide),
            },
            &[rows],
            &format!("{what}: the wide ranks' rows"),
        )?;
        let head = self.op(
            Op::Reshape {
                shape: vec![Dim::from(wide * chunk)],
            },
            &[head],
            &format!("{what}: the wide ranks' pieces"),
        )?;
        let tail = self.op(
            Op::Slice {
                dim: 0,
                start: Dim::from(wide),
                len: Dim::from(narrow),
            },
            &[rows],
            &format!("{what}: the narrow ranks' rows"),
        )?;
        let tail = self.op(
            Op::Slice {
                dim: 1,
                start: Dim::zero(),
                len: Dim::from(nw),
            },
            &[tail],
            &format!("{what}: the narrow ranks' pieces without the buffer's padding"),
        )?;
        let tail = self.op(
            Op::Reshape {
                shape: vec![Dim::from(narrow * nw)],
            },
            &[tail],
            &format!("{what}: the narrow ranks' pieces"),
        )?;
        self.op(
            Op::Concat { dim: 0 },
            &[head, tail],
            &format!("{what}: every rank's piece, in order"),
        )
    }

    /// [`Emitter::split_rows`] where the widths differ per outer rank: each group
    /// rank's piece sliced at its offset (tables over the outer axes), padded to the
    /// buffer's `chunk` with zeros (in the buffer only), one row each.
    fn split_rows_per_outer(
        &mut self,
        split: &ZeroSplit,
        flat: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let chunk = split.chunk();
        let dtype = self.g.ty(flat).dtype;
        let zeros = self.op(
            Op::Full {
                value: weft_ir::Float(0.0),
                ty: TensorType::new(dtype, vec![Dim::from(chunk)]),
            },
            &[],
            &format!(
                "{what}: the collective's buffer padding (split {:?} over {} x {})",
                split.widths(),
                split
                    .outer
                    .iter()
                    .map(|(a, _)| a.as_str())
                    .collect::<Vec<_>>()
                    .join("x"),
                split.group.name()
            ),
        )?;
        let mut rows = Vec::new();
        for d in 0..split.ranks() as usize {
            let piece = self.op(
                Op::Slice {
                    dim: 0,
                    start: split.offset_of(d),
                    len: split.width_of(d),
                },
                &[flat],
                &format!("{what}: group rank {d}'s piece"),
            )?;
            let v = self.op(
                Op::Concat { dim: 0 },
                &[piece, zeros],
                &format!("{what}: group rank {d}'s piece, padded"),
            )?;
            let v = self.op(
                Op::Slice {
                    dim: 0,
                    start: Dim::zero(),
                    len: Dim::from(chunk),
                },
                &[v],
                &format!("{what}: group rank {d}'s buffer row of {chunk}"),
            )?;
            rows.push(self.op(
                Op::Reshape {
                    shape: vec![Dim::from(1), Dim::from(chunk)],
                },
                &[v],
                &format!("{what}: group rank {d}'s row"),
            )?);
        }
        self.op(
            Op::Concat { dim: 0 },
            &rows,
            &format!(
                "{what}: one row per rank of the {} group",
                split.group.name()
            ),
        )
    }

    /// [`Emitter::join_rows`] where the widths differ per outer rank.
    fn join_rows_per_outer(
        &mut self,
        split: &ZeroSplit,
        rows: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let chunk = split.chunk();
        let mut pieces = Vec::new();
        for d in 0..split.ranks() as usize {
            let v = self.op(
                Op::Slice {
                    dim: 0,
                    start: Dim::from(d as i64),
                    len: Dim::from(1),
                },
                &[rows],
                &format!("{what}: group rank {d}'s row"),
            )?;
            let v = self.op(
                Op::Reshape {
                    shape: vec![Dim::from(chunk)],
                },
                &[v],
                &format!("{what}: group rank {d}'s buffer row"),
            )?;
            pieces.push(self.op(
                Op::Slice {
                    dim: 0,
                    start: Dim::zero(),
                    len: split.width_of(d),
                },
                &[v],
                &format!("{what}: group rank {d}'s piece without the buffer's padding"),
            )?);
        }
        let v = self.op(
            Op::Concat { dim: 0 },
            &pieces,
            &format!("{what}: every rank's piece, in order"),
        )?;
        self.op(
            Op::Slice {
                dim: 0,
                start: Dim::zero(),
                len: split.numel_dim(),
            },
            &[v],
            &format!("{what}: as this rank's local size"),
        )
    }

    /// This rank's `[chunk]` buffer row (a `reduce_scatter`'s result) cut to its piece.
    pub fn own_piece(
        &mut self,
        split: &ZeroSplit,
        row: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        if split.is_even() {
            return Ok(row);
        }
        self.op(
            Op::Slice {
                dim: 0,
                start: Dim::zero(),
                len: split.width(),
            },
            &[row],
            &format!("{what}: this rank's piece of {:?}", split.widths()),
        )
    }

    /// This rank's piece of a whole flat `[numel]` value (`reason`: the slice's whole
    /// provenance reason).
    pub fn piece_of(
        &mut self,
        split: &ZeroSplit,
        flat: Value,
        reason: &str,
    ) -> Result<Value, crate::PassError> {
        self.op(
            Op::Slice {
                dim: 0,
                start: split.offset(),
                len: split.width(),
            },
            &[flat],
            reason,
        )
    }

    /// Every rank's flat piece gathered into the whole flat `[numel]` value: each piece
    /// padded to the buffer's `chunk` (in the buffer only), `all_gather`ed over the
    /// group, the padding dropped.
    pub fn gather_pieces(
        &mut self,
        split: &ZeroSplit,
        piece: Value,
        what: &str,
    ) -> Result<Value, crate::PassError> {
        let chunk = split.chunk();
        let mut v = piece;
        if !split.is_even() {
            let dtype = self.g.ty(piece).dtype;
            let zeros = self.op(
                Op::Full {
                    value: weft_ir::Float(0.0),
                    ty: TensorType::new(dtype, vec![Dim::from(chunk)]),
                },
                &[],
                &format!("{what}: the collective's buffer padding"),
            )?;
            v = self.op(
                Op::Concat { dim: 0 },
                &[v, zeros],
                &format!("{what}: this rank's piece, padded"),
            )?;
            v = self.op(
                Op::Slice {
                    dim: 0,
                    start: Dim::zero(),
                    len: Dim::from(chunk),
                },
                &[v],
                &format!("{what}: this rank's buffer row of {chunk}"),
            )?;
        }
        let rows = self.all_gather(&split.group, v, what)?;
        self.join_rows(split, rows, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_splits_record_every_rank_and_cover_the_parameter() {
        let m = Mesh::parse("dp=3").unwrap();
        let g = ZeroGroup::for_mesh(&m, false);
        let ty = TensorType::new(weft_ir::DType::F32, vec![Dim::from(131), Dim::from(35)]);
        let rows = param_split(&m, &ty, &g, true).unwrap();
        assert!(rows.rows);
        assert_eq!(rows.unit_widths(), vec![44, 44, 43]);
        assert_eq!(rows.widths().iter().sum::<i64>(), 131 * 35);
        assert_eq!(rows.chunk(), 44 * 35);
        let flat = param_split(&m, &ty, &g, false).unwrap();
        assert_eq!(flat.widths(), vec![1529, 1528, 1528]);
        let at = |d: &Dim, r| {
            d.eval(&weft_ir::Bindings::new().with("dp", 3).with_coord("dp", r))
                .unwrap()
        };
        assert_eq!(
            (0..3).map(|r| at(&flat.offset(), r)).collect::<Vec<_>>(),
            vec![0, 1529, 3057]
        );
        assert_eq!(at(&flat.width(), 2), 1528);
        // Several axes split near-evenly over their flattened ranks; fewer elements than
        // ranks, nothing.
        let m = Mesh::parse("dp=2,sp=3").unwrap();
        let g = ZeroGroup::for_mesh(&m, false);
        let seven = TensorType::new(weft_ir::DType::F32, vec![Dim::from(7), Dim::from(5)]);
        let rows = param_split(&m, &seven, &g, true).unwrap();
        assert_eq!(rows.unit_widths(), vec![2, 1, 1, 1, 1, 1]);
        assert_eq!(
            rows.row_partitions(),
            vec![Partition::group(
                "zero",
                &["dp".into(), "sp".into()],
                0,
                vec![2, 1, 1, 1, 1, 1]
            )]
        );
        let at3 = |d: &Dim, dp, sp| {
            d.eval(
                &weft_ir::Bindings::new()
                    .with_coord("dp", dp)
                    .with_coord("sp", sp),
            )
            .unwrap()
        };
        let flat = param_split(&m, &seven, &g, false).unwrap();
        assert_eq!(flat.widths(), vec![6, 6, 6, 6, 6, 5]);
        let (widths, offsets): (Vec<i64>, Vec<i64>) = (0..6)
            .map(|r| {
                (
                    at3(&flat.width(), r / 3, r % 3),
                    at3(&flat.offset(), r / 3, r % 3),
                )
            })
            .unzip();
        assert_eq!(widths, vec![6, 6, 6, 6, 6, 5]);
        assert_eq!(offsets, vec![0, 6, 12, 18, 24, 30]);
        assert_eq!(at3(&rows.unit_width(), 0, 0), 2);
        assert_eq!(at3(&rows.unit_width(), 1, 0), 1);
        let m = Mesh::parse("dp=2,sp=2").unwrap();
        let g = ZeroGroup::for_mesh(&m, false);
        let even = TensorType::new(weft_ir::DType::F32, vec![Dim::from(8), Dim::from(35)]);
        assert_eq!(
            param_split(&m, &even, &g, true).unwrap().unit_widths(),
            vec![2; 4]
        );
        let tiny = TensorType::new(weft_ir::DType::F32, vec![Dim::from(3)]);
        assert!(param_split(&m, &tiny, &g, false).is_none());
    }

    #[test]
    fn a_local_size_that_differs_per_tp_rank_splits_on_each_tp_rank() {
        // 5 heads of 7 rows over tp=2: 21 and 14 rows of 35.
        let m = Mesh::parse("dp=2,tp=2").unwrap();
        let g = ZeroGroup::for_mesh(&m, false);
        let ty = TensorType::new(
            weft_ir::DType::F32,
            vec![Dim::per_rank("tp", vec![21, 14]), Dim::from(35)],
        );
        assert!(stage3_split(&m, &ty, &g).is_none());
        let s = param_split(&m, &ty, &g, true).unwrap();
        assert!(!s.rows && s.is_per_outer() && !s.is_even());
        assert_eq!(s.outer, vec![("tp".to_string(), 2)]);
        assert_eq!(s.outer_units, vec![735, 490]);
        assert_eq!(s.widths(), vec![368, 367, 245, 245]);
        assert_eq!(s.chunk(), 368);
        let at = |d: &Dim, dp, tp| {
            d.eval(
                &weft_ir::Bindings::new()
                    .with("dp", 2)
                    .with("tp", 2)
                    .with_coord("dp", dp)
                    .with_coord("tp", tp),
            )
            .unwrap()
        };
        let cells = [(0, 0), (1, 0), (0, 1), (1, 1)];
        let w: Vec<i64> = cells.iter().map(|&(d, t)| at(&s.width(), d, t)).collect();
        let o: Vec<i64> = cells.iter().map(|&(d, t)| at(&s.offset(), d, t)).collect();
        assert_eq!((w, o), (vec![368, 367, 245, 245], vec![0, 368, 0, 245]));
        assert_eq!(at(&s.numel_dim(), 1, 1), 490);
        let tp = Partition::simple("column", "tp", 0, vec![21, 14]);
        assert_eq!(
            s.state_partitions(&m, std::slice::from_ref(&tp)),
            vec![Partition::group(
                "zero",
                &["tp".into(), "dp".into()],
                0,
                vec![368, 367, 245, 245]
            )]
        );
        assert_eq!(
            s.output_axes(&[tp]),
            vec!["tp".to_string(), "dp".to_string()]
        );
        // Split by tp on its columns: the same 35 rows on every tp rank, rows of 24 or
        // 16 elements, are rows over the group at stage 3.
        let cols = TensorType::new(
            weft_ir::DType::F32,
            vec![Dim::from(35), Dim::per_rank("tp", vec![24, 16])],
        );
        let r = stage3_split(&m, &cols, &g).unwrap();
        assert!(r.rows && r.is_per_outer());
        assert_eq!(r.unit_widths(), vec![18, 17]);
        assert_eq!(r.widths(), vec![18 * 24, 17 * 24, 18 * 16, 17 * 16]);
        assert_eq!(
            r.row_partitions(),
            vec![Partition::group("zero", &["dp".into()], 0, vec![18, 17])]
        );
        assert_eq!(at(&r.unit_width(), 1, 1), 17);
        assert_eq!(at(&r.width(), 1, 1), 17 * 16);
        // Fewer elements than ranks on any tp rank: nothing to split.
        let m = Mesh::parse("dp=4,tp=2").unwrap();
        let g = ZeroGroup::for_mesh(&m, false);
        let small = TensorType::new(weft_ir::DType::F32, vec![Dim::per_rank("tp", vec![5, 3])]);
        assert!(param_split(&m, &small, &g, false).is_none());
    }
}

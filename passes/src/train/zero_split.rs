//! How ZeRO splits one parameter over its data-parallel group, padding-free.
//!
//! A [`ZeroSplit`] cuts a parameter's flattened local elements (stages 1 and 2), or the
//! rows of its dim 0 (stage 3), near-evenly over the ranks of its group, by tensor
//! parallelism's rule ([`near_even`]): the first `units % Z` ranks take one unit more.
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
//! offset is a per-rank table over those axes ([`Dim::per_group_rank`]). A parameter
//! is left unsharded ([`param_split`] is `None`, counted `unsharded_uneven` by the
//! optimizer) only where there is nothing to split: fewer units than ranks, or a local
//! size that already differs per rank (an uneven tp shard).

use crate::parallel::tp::sizes::near_even;
use crate::zero::{local_numel, Emitter, ZeroGroup};
use weft_ir::{Dim, Mesh, Op, Partition, TensorType, Value};

/// One parameter's split over its ZeRO group: `units` units of `unit` elements each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZeroSplit {
    pub group: ZeroGroup,
    /// Elements per unit: 1 for an element split, the row's size for a row split.
    pub unit: i64,
    /// The units split over the group (elements, or rows of dim 0).
    pub units: i64,
    /// Whether the units are rows of dim 0 (ZeRO-3 shards the parameter itself).
    pub rows: bool,
}

impl ZeroSplit {
    fn new(group: &ZeroGroup, unit: i64, units: i64, rows: bool) -> Option<ZeroSplit> {
        let z = group.size();
        if group.is_empty() || units < z {
            return None;
        }
        Some(ZeroSplit {
            group: group.clone(),
            unit,
            units,
            rows,
        })
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
        self.wide_ranks() == 0
    }

    /// Every rank's units, in group order.
    pub fn unit_widths(&self) -> Vec<i64> {
        near_even(self.units, self.ranks())
    }

    /// Every rank's elements, in group order.
    pub fn widths(&self) -> Vec<i64> {
        self.unit_widths().iter().map(|w| w * self.unit).collect()
    }

    /// The widest piece's elements: the row of a collective's buffer.
    pub fn chunk(&self) -> i64 {
        (self.base() + i64::from(!self.is_even())) * self.unit
    }

    /// A per-rank table (one value per group rank, row-major) as a dim: a constant
    /// when every rank has the same value, else a table over the group's axes.
    fn per_rank(&self, table: Vec<i64>) -> Dim {
        Dim::per_group_rank(&self.group.axes, &table)
            .expect("a ZeroSplit's tables list one value per group rank")
    }

    /// This rank's units (rows, for a row split).
    pub fn unit_width(&self) -> Dim {
        self.per_rank(self.unit_widths())
    }

    /// This rank's elements (its units times the unit, so that a row split's flat
    /// width and its rows' element count are the same dim).
    pub fn width(&self) -> Dim {
        self.unit_width() * Dim::from(self.unit)
    }

    /// The flat index of this rank's first element.
    pub fn offset(&self) -> Dim {
        if self.is_even() {
            return self.group.index() * Dim::from(self.chunk());
        }
        let offsets: Vec<i64> = self
            .widths()
            .iter()
            .scan(0, |at, w| {
                let o = *at;
                *at += w;
                Some(o)
            })
            .collect();
        self.per_rank(offsets)
    }

    /// The partitions over the group of `total` (`units` times `scale`) on dim 0,
    /// appended to `before`: an even split nests one partition per axis, outermost
    /// first; an uneven one is a single partition over the whole group (its one axis,
    /// or all of them flattened).
    fn group_partitions(&self, mut before: Vec<Partition>, scale: i64) -> Vec<Partition> {
        if self.is_even() {
            let mut inner = self.units * scale;
            for (a, n) in &self.group.axes {
                inner /= n;
                before.push(Partition::simple("zero", a, 0, vec![inner; *n as usize]));
            }
        } else {
            let axes: Vec<String> = self.group.axes.iter().map(|(a, _)| a.clone()).collect();
            let sizes = self.unit_widths().iter().map(|w| w * scale).collect();
            before.push(Partition::group("zero", &axes, 0, sizes));
        }
        before
    }

    /// The partitions of a flat state tensor whose dim 0 is first split by `before`
    /// (the parameter's own partitions, in blocks of [`ZeroSplit::numel`]), then over
    /// the group: each rank's part is exactly its piece.
    pub fn state_partitions(&self, before: Vec<Partition>) -> Vec<Partition> {
        self.group_partitions(before, self.unit)
    }

    /// The partitions a row split adds to the parameter's dim 0.
    pub fn row_partitions(&self) -> Vec<Partition> {
        self.group_partitions(Vec::new(), 1)
    }
}

/// ZeRO stage 3's split of a parameter of local type `ty`: the rows of its dim 0 over
/// `group`, near-evenly (uneven rows allowed on any group). `None` where the parameter
/// stays whole on every rank (its state may still be sharded by [`param_split`]).
pub fn stage3_split(mesh: &Mesh, ty: &TensorType, group: &ZeroGroup) -> Option<ZeroSplit> {
    if group.is_empty() || ty.rank() == 0 || !ty.dtype.is_float() {
        return None;
    }
    let total = local_numel(mesh, ty)?;
    let mut b = weft_ir::Bindings::new();
    for (a, n) in &mesh.axes {
        b = b.with(a, *n as i64);
    }
    let rows = ty.shape[0].bind(&b).as_const()?;
    if rows == 0 {
        return None;
    }
    ZeroSplit::new(group, total / rows, rows, true)
}

/// The split of a parameter of local type `ty` over `group`, computed once and used by
/// grad-sync and the optimizer alike: its rows when `stage3` asks and
/// [`stage3_split`] allows, else its flattened elements. `None`: not sharded (no
/// group, a per-rank size, fewer elements than ranks).
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
    ZeroSplit::new(group, 1, local_numel(mesh, ty)?, false)
}

impl Emitter<'_> {
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
}

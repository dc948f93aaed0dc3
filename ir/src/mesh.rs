//! Device mesh: named axes with sizes (`dp=2,sp=4`), outermost first. A rank's
//! coordinates are its row-major digits, so the innermost (last) axis groups contiguous
//! ranks and outer axes group strided ones.
//!
//! Expert parallelism folds over these ranks instead of adding its own (DeepSpeed's
//! expert groups): `ep=K` groups K consecutive ranks of the world, whatever axes they
//! span, and `edp` (expert data parallel) groups the ranks at the same place of every
//! ep group. Both are *derived* axes: they are listed after the others (`edp` always
//! follows `ep`), have coordinates (`@ep` = rank mod K, `@edp` = rank div K) and
//! groups, but do not multiply the world size. `dp=4,tp=2,ep=4` is 8 ranks: tp
//! (0,1)(2,3)(4,5)(6,7), dense dp (0,2,4,6)(1,3,5,7), ep (0-3)(4-7), edp (0,4)(1,5)(2,6)(3,7).
//! Expert parameters are split over `ep` and replicated over `edp`; dense parameters
//! are replicated over `dp`. Without other axes, `ep=K` is short for `dp=K,ep=K` and
//! `edp=M,ep=K` for `dp=M*K,ep=K`.

use std::fmt;

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Mesh {
    pub axes: Vec<(String, u32)>,
}

/// The expert-parallel axis, derived: K consecutive ranks of the world per group.
pub const EP: &str = "ep";
/// The expert-data-parallel axis, derived: the ranks at the same place of every ep group.
pub const EDP: &str = "edp";

/// The most ranks a mesh may have: far above any machine Weft plans for, and low enough
/// that rank numbers, group sizes and per-rank loops stay small and exact.
pub const MAX_RANKS: u64 = 1 << 20;

/// True for the axes that regroup the ranks of the others (`ep`, `edp`).
pub fn is_derived(axis: &str) -> bool {
    axis == EP || axis == EDP
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    #[error("mesh `{text}`: `{part}` is not `axis=size` (e.g. `dp=2,sp=4`)")]
    Syntax { text: String, part: String },
    #[error("mesh `{text}`: size of axis `{axis}` must be a positive integer, got `{size}`")]
    Size {
        text: String,
        axis: String,
        size: String,
    },
    #[error("mesh `{text}`: {ranks} ranks is more than Weft plans for (at most {max})\nhelp: use fewer or smaller axes", max = MAX_RANKS)]
    TooLarge { text: String, ranks: u128 },
    #[error("mesh `{text}`: axis `{axis}` appears twice")]
    Duplicate { text: String, axis: String },
    #[error(
        "mesh `{text}`: axis name `{axis}` must be letters, digits or `_`, starting with a letter"
    )]
    Name { text: String, axis: String },
    #[error("mesh `{text}`: {why}\nhelp: {help}")]
    Expert {
        text: String,
        why: String,
        help: String,
    },
}

impl Mesh {
    /// A mesh from literal axes; `ep`/`edp` are folded as [`Mesh::parse`] does (and a
    /// bad fold panics: use `parse` for meshes that come from users).
    pub fn new(axes: &[(&str, u32)]) -> Mesh {
        let axes: Vec<(String, u32)> = axes.iter().map(|(a, n)| (a.to_string(), *n)).collect();
        if !axes.iter().any(|(a, _)| is_derived(a)) {
            return Mesh { axes };
        }
        let text = Mesh { axes: axes.clone() }.to_string();
        fold_expert_axes(&text, axes).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Parses `dp=2,sp=4`; the empty string is the one-rank mesh.
    pub fn parse(text: &str) -> Result<Mesh, MeshError> {
        let mut axes: Vec<(String, u32)> = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (a, n) = part.split_once('=').ok_or_else(|| MeshError::Syntax {
                text: text.into(),
                part: part.into(),
            })?;
            let (a, n) = (a.trim(), n.trim());
            let ok_name = a.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok_name {
                return Err(MeshError::Name {
                    text: text.into(),
                    axis: a.into(),
                });
            }
            let size: u32 = n
                .parse()
                .ok()
                .filter(|&s| s > 0)
                .ok_or_else(|| MeshError::Size {
                    text: text.into(),
                    axis: a.into(),
                    size: n.into(),
                })?;
            if axes.iter().any(|(x, _)| x == a) {
                return Err(MeshError::Duplicate {
                    text: text.into(),
                    axis: a.into(),
                });
            }
            axes.push((a.to_string(), size));
        }
        // Checked before anything multiplies the sizes in 32 bits (ep/edp fold into
        // the others, so they count only where they stand alone).
        let ranks: u128 = axes
            .iter()
            .filter(|(a, _)| !is_derived(a) || !axes.iter().any(|(x, _)| !is_derived(x)))
            .map(|(_, n)| *n as u128)
            .product();
        if ranks > MAX_RANKS as u128 {
            return Err(MeshError::TooLarge {
                text: text.into(),
                ranks,
            });
        }
        fold_expert_axes(text, axes)
    }

    /// Number of ranks: the product of the axes that are not derived.
    pub fn world_size(&self) -> u32 {
        self.axes
            .iter()
            .filter(|(a, _)| !is_derived(a))
            .map(|(_, n)| *n)
            .product()
    }

    pub fn size(&self, axis: &str) -> Option<u32> {
        self.axes.iter().find(|(a, _)| a == axis).map(|(_, n)| *n)
    }

    /// Size of `axis`, or 1 when the mesh lacks it.
    pub fn size_or_one(&self, axis: &str) -> u32 {
        self.size(axis).unwrap_or(1)
    }

    pub fn has(&self, axis: &str) -> bool {
        self.size(axis).is_some()
    }

    /// Coordinates of `rank` on every axis (derived ones included), in axis order.
    pub fn coords(&self, rank: u32) -> Vec<u32> {
        let mut out = vec![0; self.axes.len()];
        let mut r = rank;
        for (i, (a, n)) in self.axes.iter().enumerate().rev() {
            if is_derived(a) {
                continue;
            }
            out[i] = r % n;
            r /= n;
        }
        let ep = self.size(EP).unwrap_or(1);
        for (i, (a, _)) in self.axes.iter().enumerate() {
            match a.as_str() {
                EP => out[i] = rank % ep,
                EDP => out[i] = rank / ep,
                _ => {}
            }
        }
        out
    }

    pub fn coord(&self, rank: u32, axis: &str) -> Option<u32> {
        let i = self.axes.iter().position(|(a, _)| a == axis)?;
        Some(self.coords(rank)[i])
    }

    /// How `ep` lies over the other axes: `(i, d)` when one ep group holds `d` of the
    /// `axes[i]` coordinates (a divisor of its size) and every coordinate of the axes
    /// after it; the axes before it, and the rest of `axes[i]`, lie across ep groups
    /// (they make `edp`). `None` without `ep`.
    pub fn expert_cut(&self) -> Option<(usize, u32)> {
        let k = self.size(EP)?;
        let product: Vec<(String, u32)> = self
            .axes
            .iter()
            .filter(|(a, _)| !is_derived(a))
            .cloned()
            .collect();
        expert_cut(&product, k)
    }

    /// The lowest rank with the given coordinates (derived axes included), e.g. the
    /// rank holding the same shard as another one: `rank_with(&[("ep", 1)])`.
    pub fn rank_with(&self, fixed: &[(&str, u32)]) -> Option<u32> {
        (0..self.world_size()).find(|&r| fixed.iter().all(|(a, c)| self.coord(r, a) == Some(*c)))
    }

    /// The rank with these coordinates (those of derived axes are ignored).
    pub fn rank_of(&self, coords: &[u32]) -> u32 {
        self.axes
            .iter()
            .zip(coords)
            .filter(|((a, _), _)| !is_derived(a))
            .fold(0, |r, ((_, n), c)| r * n + c)
    }

    /// The process groups `axis` induces: ranks that differ only in their `axis`
    /// coordinate, each group ordered by that coordinate. Groups are sorted by first rank.
    /// `ep`: K consecutive ranks; `edp`: every K-th rank.
    pub fn groups(&self, axis: &str) -> Option<Vec<Vec<u32>>> {
        let i = self.axes.iter().position(|(a, _)| a == axis)?;
        if is_derived(axis) {
            let (world, ep) = (self.world_size(), self.size(EP).unwrap_or(1).max(1));
            return Some(if axis == EP {
                (0..world / ep)
                    .map(|g| (g * ep..(g + 1) * ep).collect())
                    .collect()
            } else {
                (0..ep)
                    .map(|j| (j..world).step_by(ep as usize).collect())
                    .collect()
            });
        }
        let (n, stride) = (self.axes[i].1, self.stride(axis).unwrap_or(1));
        let groups = (0..self.world_size())
            .filter(|r| (r / stride) % n == 0)
            .map(|base| (0..n).map(|k| base + k * stride).collect())
            .collect();
        Some(groups)
    }

    /// How far apart in rank numbers the members of one group of the (product) axis
    /// `axis` are: the product of the sizes of the product axes after it. `None` for
    /// derived axes (`ep` groups are consecutive, `edp` ones `ep` apart) and unknown ones.
    pub fn stride(&self, axis: &str) -> Option<u32> {
        let i = self.axes.iter().position(|(a, _)| a == axis)?;
        if is_derived(axis) {
            return None;
        }
        Some(
            self.axes[i + 1..]
                .iter()
                .filter(|(a, _)| !is_derived(a))
                .map(|(_, n)| *n)
                .product(),
        )
    }

    /// The group of `axis` that contains `rank`.
    pub fn group_of(&self, axis: &str, rank: u32) -> Option<Vec<u32>> {
        if rank >= self.world_size() {
            return None;
        }
        let n = self.size(axis)?;
        match self.stride(axis) {
            Some(stride) => {
                let base = rank - (rank / stride % n) * stride;
                Some((0..n).map(|k| base + k * stride).collect())
            }
            None => self.groups(axis)?.into_iter().find(|g| g.contains(&rank)),
        }
    }

    /// A table of every rank's coordinates and groups, for display and tests.
    pub fn rank_table(&self) -> String {
        let mut out = String::new();
        out.push_str("rank");
        for (a, _) in &self.axes {
            out.push_str(&format!("  {a:>4}"));
        }
        out.push('\n');
        for r in 0..self.world_size() {
            out.push_str(&format!("{r:>4}"));
            for c in self.coords(r) {
                out.push_str(&format!("  {c:>4}"));
            }
            out.push('\n');
        }
        for (a, _) in &self.axes {
            let groups = self.groups(a).unwrap_or_default();
            let text: Vec<String> = groups
                .iter()
                .map(|g| {
                    format!(
                        "({})",
                        g.iter()
                            .map(|r| r.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    )
                })
                .collect();
            out.push_str(&format!("{a} groups: {}\n", text.join(" ")));
        }
        if let Some(k) = self.size(EP) {
            out.push_str(&format!(
                "ep and edp are derived: ep groups {k} consecutive ranks, edp the ranks at the same place of each; expert params are split over ep and replicated over edp\n"
            ));
        }
        out
    }
}

/// Checks and normalizes the expert axes: `ep` divides the world of the other axes and
/// `edp` is what is left; both go last. Without other axes `ep` (and `edp`) make a `dp`.
fn fold_expert_axes(text: &str, axes: Vec<(String, u32)>) -> Result<Mesh, MeshError> {
    let get = |name: &str| axes.iter().find(|(a, _)| a == name).map(|(_, n)| *n);
    let (ep, edp) = (get(EP), get(EDP));
    let err = |why: String, help: String| MeshError::Expert {
        text: text.into(),
        why,
        help,
    };
    let Some(k) = ep else {
        if edp.is_some() {
            return Err(err(
                "`edp` (expert data parallel) needs an `ep` axis".into(),
                "give the expert-parallel degree, e.g. `dp=4,ep=2`".into(),
            ));
        }
        return Ok(Mesh { axes });
    };
    let mut out: Vec<(String, u32)> = axes.into_iter().filter(|(a, _)| !is_derived(a)).collect();
    if out.is_empty() {
        out.push(("dp".into(), k * edp.unwrap_or(1)));
    }
    let world: u32 = out.iter().map(|(_, n)| *n).product();
    if !world.is_multiple_of(k) {
        let others = out
            .iter()
            .map(|(a, n)| format!("{a}={n}"))
            .collect::<Vec<_>>()
            .join(",");
        return Err(err(
            format!("ep={k} must divide the {world} ranks of `{others}` (expert groups are carved out of the ranks, not added to them)"),
            format!("use an ep that divides {world}, or more data-parallel ranks (e.g. `dp={k},ep={k}`)"),
        ));
    }
    if let Some(m) = edp {
        if m * k != world {
            return Err(err(
                format!("edp={m} times ep={k} must be the {world} ranks of the other axes"),
                format!("drop `edp` (it is implied: {})", world / k),
            ));
        }
    }
    if expert_cut(&out, k).is_none() {
        let others = out
            .iter()
            .map(|(a, n)| format!("{a}={n}"))
            .collect::<Vec<_>>()
            .join(",");
        return Err(err(
            format!("ep={k} groups {k} consecutive ranks, which cut the axes of `{others}` unevenly (an ep group must hold whole inner axes times a divisor of the next)"),
            "choose ep as a product of the innermost axis sizes times a divisor of the next axis".into(),
        ));
    }
    out.push((EP.into(), k));
    out.push((EDP.into(), world / k));
    Ok(Mesh { axes: out })
}

/// Where groups of `k` consecutive ranks cut the product axes `axes` (outermost
/// first): the index of the axis they cut and how much of it one group holds (a
/// divisor of its size); the axes after it lie wholly inside a group, those before it
/// across groups. `None` when the groups do not align with the axes.
fn expert_cut(axes: &[(String, u32)], k: u32) -> Option<(usize, u32)> {
    let mut inner = 1u32;
    for (i, (_, n)) in axes.iter().enumerate().rev() {
        if k <= inner * n {
            let d = k / inner;
            return (k % inner == 0 && n % d == 0).then_some((i, d));
        }
        inner *= n;
    }
    None
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.axes.iter().map(|(a, n)| format!("{a}={n}")).collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_contiguous_inner_strided_outer() {
        let m = Mesh::parse("dp=2,sp=4").unwrap();
        assert_eq!(m.world_size(), 8);
        assert_eq!(
            m.groups("sp").unwrap(),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            m.groups("dp").unwrap(),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(m.coord(6, "sp"), Some(2));
        assert_eq!(m.coord(6, "dp"), Some(1));
        insta::assert_snapshot!(m.rank_table());
    }

    #[test]
    fn expert_axes_fold_like_deepspeed() {
        // world 8, tp 2, ep 4 (DeepSpeed's `_create_expert_and_data_parallel`).
        let m = Mesh::parse("dp=4,tp=2,ep=4").unwrap();
        assert_eq!(m.world_size(), 8);
        assert_eq!(m.to_string(), "dp=4,tp=2,ep=4,edp=2");
        assert_eq!(
            m.groups("tp").unwrap(),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            m.groups("dp").unwrap(),
            vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]
        );
        assert_eq!(
            m.groups("ep").unwrap(),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            m.groups("edp").unwrap(),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(
            (
                m.coord(6, "ep"),
                m.coord(6, "edp"),
                m.coord(6, "dp"),
                m.coord(6, "tp")
            ),
            (Some(2), Some(1), Some(3), Some(0))
        );
        for r in 0..8 {
            assert_eq!(m.rank_of(&m.coords(r)), r);
        }
        assert_eq!(Mesh::parse(&m.to_string()).unwrap(), m);
        assert_eq!(m.rank_with(&[("ep", 3)]), Some(3));
        assert_eq!(m.rank_with(&[("edp", 1), ("tp", 1)]), Some(5));
        insta::assert_snapshot!(m.rank_table());
        // Shorthands and equivalent spellings.
        assert_eq!(Mesh::parse("ep=4").unwrap().to_string(), "dp=4,ep=4,edp=1");
        assert_eq!(
            Mesh::parse("edp=2,ep=4").unwrap().to_string(),
            "dp=8,ep=4,edp=2"
        );
        assert_eq!(
            Mesh::parse("ep=2,dp=2,sp=2").unwrap().to_string(),
            "dp=2,sp=2,ep=2,edp=2"
        );
        assert_eq!(
            Mesh::new(&[("dp", 4), ("ep", 2)]),
            Mesh::parse("dp=4,ep=2").unwrap()
        );
    }

    #[test]
    fn expert_axes_errors() {
        let e = Mesh::parse("dp=2,ep=4").unwrap_err().to_string();
        assert!(e.contains("ep=4 must divide the 2 ranks of `dp=2`"), "{e}");
        let e = Mesh::parse("dp=4,ep=2,edp=3").unwrap_err().to_string();
        assert!(e.contains("edp=3 times ep=2 must be the 4 ranks"), "{e}");
        let e = Mesh::parse("dp=4,edp=2").unwrap_err().to_string();
        assert!(e.contains("needs an `ep` axis"), "{e}");
        // 2 consecutive ranks of dp=2,tp=3 straddle tp groups.
        let e = Mesh::parse("dp=2,tp=3,ep=2").unwrap_err().to_string();
        assert!(e.contains("cut the axes of `dp=2,tp=3` unevenly"), "{e}");
        assert_eq!(
            Mesh::parse("dp=4,tp=2,ep=4").unwrap().expert_cut(),
            Some((0, 2))
        );
        assert_eq!(
            Mesh::parse("dp=2,sp=2,ep=2").unwrap().expert_cut(),
            Some((1, 2))
        );
        assert_eq!(
            Mesh::parse("dp=2,tp=3,ep=3").unwrap().expert_cut(),
            Some((1, 3))
        );
    }

    #[test]
    fn parse_errors_name_the_part() {
        assert!(Mesh::parse("sp")
            .unwrap_err()
            .to_string()
            .contains("`sp` is not `axis=size`"));
        assert!(Mesh::parse("sp=0")
            .unwrap_err()
            .to_string()
            .contains("positive integer"));
        assert!(Mesh::parse("sp=2,sp=2")
            .unwrap_err()
            .to_string()
            .contains("appears twice"));
        assert_eq!(Mesh::parse("").unwrap().world_size(), 1);
    }
}

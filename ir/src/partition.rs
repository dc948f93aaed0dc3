//! Parameter partition metadata: how a parameter's full (checkpoint) tensor is cut into
//! per-rank shards along a mesh axis. It is recorded once by the pass that shards the
//! parameter and read by everything that must agree on it: the runtimes (slicing full
//! weights, assembling full gradients), checkpoint resharding and the plan.
//!
//! A fused parameter (phi3's `qkv_proj`, `gate_up_proj`) is made of sub-parameters
//! along the split dim; each is split on its own and a rank's shard is the
//! concatenation of its piece of every sub-parameter, in order.
//!
//! A partition usually splits over one mesh axis. A *group* partition splits over
//! several axes at once (ZeRO's near-even split over a dp x sp group whose size does
//! not divide the dim): the group's ranks are flattened row-major, outermost axis
//! first (the rank at `(c1, c2)` on axes of sizes `(n1, n2)` is group rank
//! `c1*n2 + c2`), and `pieces` lists one size per group rank. Its text form joins the
//! axes with `*`: `zero dp*sp dim=0 [2 1 1 1 1 1]`. Nested per-axis partitions cannot
//! say this: the inner split would differ from one outer rank to the next.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Partition {
    /// What kind of split this is, for reports: `column`, `row`, `vocab`, `expert`, ...
    pub kind: String,
    /// The mesh axes split over, outermost first: one axis, or a group of several
    /// whose ranks are flattened row-major. Serialized as `axis`, joined by `*`.
    #[serde(rename = "axis", with = "axes_text")]
    pub axes: Vec<String>,
    /// The dim of the full tensor that is split.
    pub dim: usize,
    /// For each sub-parameter, its size along `dim` on every rank of the axis (every
    /// rank of the group, flattened), in coordinate order. An unfused parameter has one
    /// sub-parameter.
    pub pieces: Vec<Vec<i64>>,
}

/// `axes` as one string, `dp*sp`, in the serialized forms.
mod axes_text {
    pub fn serialize<S: serde::Serializer>(axes: &[String], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&axes.join("*"))
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        let text = <String as serde::Deserialize>::deserialize(d)?;
        super::parse_axes(&text).map_err(serde::de::Error::custom)
    }
}

/// Parses `tp` or `dp*sp` into its axes; every axis named once, none empty.
pub fn parse_axes(text: &str) -> Result<Vec<String>, String> {
    let axes: Vec<String> = text.split('*').map(str::to_string).collect();
    if axes
        .iter()
        .any(|a| a.is_empty() || a.chars().any(char::is_whitespace))
    {
        return Err(format!(
            "`{text}` is not an axis or a `*`-joined group of axes"
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for a in &axes {
        if !seen.insert(a.as_str()) {
            return Err(format!("`{text}` names axis `{a}` twice"));
        }
    }
    Ok(axes)
}

impl Partition {
    /// An even or near-even split of one sub-parameter over one axis.
    pub fn simple(kind: &str, axis: &str, dim: usize, sizes: Vec<i64>) -> Partition {
        Partition {
            kind: kind.into(),
            axes: vec![axis.into()],
            dim,
            pieces: vec![sizes],
        }
    }

    /// A split of one sub-parameter over the group of `axes` (outermost first), one
    /// size per group rank, flattened row-major.
    pub fn group(kind: &str, axes: &[String], dim: usize, sizes: Vec<i64>) -> Partition {
        Partition {
            kind: kind.into(),
            axes: axes.to_vec(),
            dim,
            pieces: vec![sizes],
        }
    }

    /// The axis or group name, as printed: `tp`, `dp*sp`.
    pub fn axis_name(&self) -> String {
        self.axes.join("*")
    }

    /// True when the partition splits over several axes at once.
    pub fn is_group(&self) -> bool {
        self.axes.len() > 1
    }

    /// True when the partition splits over `axis` (alone or within its group).
    pub fn splits_over(&self, axis: &str) -> bool {
        self.axes.iter().any(|a| a == axis)
    }

    /// The partition's rank index (the coordinate `ranges` and `shard_size` take) of
    /// a rank, from `at`, which gives each axis's `(coordinate, size)`: the coordinate
    /// on a single axis, the row-major group index on a group.
    pub fn coord_with(
        &self,
        mut at: impl FnMut(&str) -> Option<(u32, u32)>,
    ) -> Result<usize, String> {
        let mut idx = 0usize;
        for a in &self.axes {
            let (c, n) = at(a).ok_or_else(|| {
                format!("partition `{self}` splits over axis `{a}`, which has no coordinate here")
            })?;
            if c >= n {
                return Err(format!(
                    "partition `{self}`: coordinate {c} out of range for axis `{a}` of {n}"
                ));
            }
            idx = idx * n as usize + c as usize;
        }
        if idx >= self.ranks() {
            return Err(format!(
                "partition `{self}` lists {} ranks, fewer than its axes hold",
                self.ranks()
            ));
        }
        Ok(idx)
    }

    /// The partition's rank index of `rank` on `mesh` (see [`Partition::coord_with`]).
    pub fn coord_on(&self, mesh: &crate::Mesh, rank: u32) -> Result<usize, String> {
        self.coord_with(|a| Some((mesh.coord(rank, a)?, mesh.size(a)?)))
            .map_err(|e| format!("{e} (mesh `{mesh}`)"))
    }

    pub fn ranks(&self) -> usize {
        self.pieces.first().map(|p| p.len()).unwrap_or(0)
    }

    /// Size of `dim` in the full tensor.
    pub fn full_size(&self) -> i64 {
        self.pieces.iter().flatten().sum()
    }

    /// Size of the shard of rank `coord` along `dim`.
    pub fn shard_size(&self, coord: usize) -> i64 {
        self.pieces.iter().map(|p| p[coord]).sum()
    }

    /// The ranges `[start, end)` of the full tensor's `dim` that make up rank `coord`'s
    /// shard, in the order they are concatenated.
    pub fn ranges(&self, coord: usize) -> Vec<(i64, i64)> {
        let mut out = Vec::new();
        let mut base = 0;
        for p in &self.pieces {
            let start = base + p[..coord].iter().sum::<i64>();
            out.push((start, start + p[coord]));
            base += p.iter().sum::<i64>();
        }
        out
    }

    /// The per-rank shard sizes along `dim`.
    pub fn shard_sizes(&self) -> Vec<i64> {
        (0..self.ranks()).map(|r| self.shard_size(r)).collect()
    }
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} dim={}", self.kind, self.axis_name(), self.dim)?;
        for p in &self.pieces {
            let s: Vec<String> = p.iter().map(|x| x.to_string()).collect();
            write!(f, " [{}]", s.join(" "))?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Partition {
    type Err = String;
    /// Parses `column tp dim=0 [64 64] [32 32]` or `zero dp*sp dim=0 [2 1 1 1 1 1]`.
    fn from_str(s: &str) -> Result<Partition, String> {
        let usage =
            || format!("expected `<kind> <axis>[*<axis>..] dim=<d> [sizes] ...`, found `{s}`");
        let (head, rest) = s
            .split_once('[')
            .map(|(h, r)| (h, format!("[{r}")))
            .ok_or_else(usage)?;
        let words: Vec<&str> = head.split_whitespace().collect();
        let [kind, axis, dim] = words.as_slice() else {
            return Err(usage());
        };
        let dim = dim
            .strip_prefix("dim=")
            .and_then(|d| d.parse().ok())
            .ok_or_else(usage)?;
        let mut pieces = Vec::new();
        for group in rest.split(']').map(str::trim).filter(|g| !g.is_empty()) {
            let inner = group.strip_prefix('[').ok_or_else(usage)?;
            let sizes: Result<Vec<i64>, _> = inner.split_whitespace().map(str::parse).collect();
            pieces.push(sizes.map_err(|_| usage())?);
        }
        if pieces.is_empty()
            || pieces
                .iter()
                .any(|p| p.len() != pieces[0].len() || p.is_empty())
        {
            return Err(format!(
                "partition `{s}`: every sub-parameter needs one size per rank"
            ));
        }
        let axes = parse_axes(axis).map_err(|e| format!("partition `{s}`: {e}"))?;
        let p = Partition {
            kind: kind.to_string(),
            axes,
            dim,
            pieces,
        };
        p.check_sizes()
            .map_err(|e| format!("partition `{s}`: {e}"))?;
        Ok(p)
    }
}

impl Partition {
    /// Every size non-negative and their total (the full dim, the sum every shard size
    /// and range is taken from) within `i64`.
    pub fn check_sizes(&self) -> Result<(), String> {
        if let Some(x) = self.pieces.iter().flatten().find(|&&x| x < 0) {
            return Err(format!("has a negative size ({x})"));
        }
        if self
            .pieces
            .iter()
            .flatten()
            .try_fold(0i64, |a, &x| a.checked_add(x))
            .is_none()
        {
            return Err("its sizes add up to more than Weft can count".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_ranges_and_round_trip() {
        // q 4 rows, k 2, v 2 over 2 ranks.
        let p = Partition {
            kind: "column".into(),
            axes: vec!["tp".into()],
            dim: 0,
            pieces: vec![vec![2, 2], vec![1, 1], vec![1, 1]],
        };
        assert_eq!(p.ranges(0), vec![(0, 2), (4, 5), (6, 7)]);
        assert_eq!(p.ranges(1), vec![(2, 4), (5, 6), (7, 8)]);
        assert_eq!(p.full_size(), 8);
        assert_eq!(p.shard_sizes(), vec![4, 4]);
        let text = p.to_string();
        assert_eq!(text, "column tp dim=0 [2 2] [1 1] [1 1]");
        assert_eq!(text.parse::<Partition>().unwrap(), p);
        assert!("column tp dim=0 [2 2] [1]".parse::<Partition>().is_err());
    }

    #[test]
    fn group_partitions_flatten_their_axes() {
        let p: Partition = "zero dp*sp dim=0 [2 1 1 1 1 1]".parse().unwrap();
        assert_eq!(p.axes, vec!["dp".to_string(), "sp".to_string()]);
        assert!(p.is_group() && p.splits_over("sp") && !p.splits_over("tp"));
        assert_eq!(p.to_string(), "zero dp*sp dim=0 [2 1 1 1 1 1]");
        let m = crate::Mesh::parse("dp=2,sp=3").unwrap();
        let idx: Vec<usize> = (0..6).map(|r| p.coord_on(&m, r).unwrap()).collect();
        assert_eq!(idx, (0..6).collect::<Vec<_>>());
        assert_eq!(p.ranges(3), vec![(4, 5)]);
        let json = serde_json::to_string(&p).unwrap();
        assert!(json.contains(r#""axis":"dp*sp""#), "{json}");
        assert_eq!(serde_json::from_str::<Partition>(&json).unwrap(), p);
        assert!("zero dp*dp dim=0 [1 1 1 1]".parse::<Partition>().is_err());
        assert!("zero dp**sp dim=0 [1 1]".parse::<Partition>().is_err());
        assert!(p.coord_on(&crate::Mesh::parse("dp=2").unwrap(), 0).is_err());
    }
}

//! Device mesh: named axes with sizes (`dp=2,sp=4`), outermost first. A rank's
//! coordinates are its row-major digits, so the innermost (last) axis groups contiguous
//! ranks and outer axes group strided ones.

use std::fmt;

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Mesh {
    pub axes: Vec<(String, u32)>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    #[error("mesh `{text}`: `{part}` is not `axis=size` (e.g. `dp=2,sp=4`)")]
    Syntax { text: String, part: String },
    #[error("mesh `{text}`: size of axis `{axis}` must be a positive integer, got `{size}`")]
    Size { text: String, axis: String, size: String },
    #[error("mesh `{text}`: axis `{axis}` appears twice")]
    Duplicate { text: String, axis: String },
    #[error("mesh `{text}`: axis name `{axis}` must be letters, digits or `_`, starting with a letter")]
    Name { text: String, axis: String },
}

impl Mesh {
    pub fn new(axes: &[(&str, u32)]) -> Mesh {
        Mesh { axes: axes.iter().map(|(a, n)| (a.to_string(), *n)).collect() }
    }

    /// Parses `dp=2,sp=4`; the empty string is the one-rank mesh.
    pub fn parse(text: &str) -> Result<Mesh, MeshError> {
        let mut axes: Vec<(String, u32)> = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (a, n) = part
                .split_once('=')
                .ok_or_else(|| MeshError::Syntax { text: text.into(), part: part.into() })?;
            let (a, n) = (a.trim(), n.trim());
            let ok_name = a.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok_name {
                return Err(MeshError::Name { text: text.into(), axis: a.into() });
            }
            let size: u32 = n
                .parse()
                .ok()
                .filter(|&s| s > 0)
                .ok_or_else(|| MeshError::Size { text: text.into(), axis: a.into(), size: n.into() })?;
            if axes.iter().any(|(x, _)| x == a) {
                return Err(MeshError::Duplicate { text: text.into(), axis: a.into() });
            }
            axes.push((a.to_string(), size));
        }
        Ok(Mesh { axes })
    }

    pub fn world_size(&self) -> u32 {
        self.axes.iter().map(|(_, n)| *n).product()
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

    /// Coordinates of `rank` on every axis, outermost first.
    pub fn coords(&self, rank: u32) -> Vec<u32> {
        let mut out = vec![0; self.axes.len()];
        let mut r = rank;
        for (i, (_, n)) in self.axes.iter().enumerate().rev() {
            out[i] = r % n;
            r /= n;
        }
        out
    }

    pub fn coord(&self, rank: u32, axis: &str) -> Option<u32> {
        let i = self.axes.iter().position(|(a, _)| a == axis)?;
        Some(self.coords(rank)[i])
    }

    pub fn rank_of(&self, coords: &[u32]) -> u32 {
        self.axes.iter().zip(coords).fold(0, |r, ((_, n), c)| r * n + c)
    }

    /// The process groups `axis` induces: ranks that differ only in their `axis`
    /// coordinate, each group ordered by that coordinate. Groups are sorted by first rank.
    pub fn groups(&self, axis: &str) -> Option<Vec<Vec<u32>>> {
        let i = self.axes.iter().position(|(a, _)| a == axis)?;
        let mut groups: Vec<Vec<u32>> = Vec::new();
        for rank in 0..self.world_size() {
            let c = self.coords(rank);
            if c[i] != 0 {
                continue;
            }
            let group = (0..self.axes[i].1)
                .map(|k| {
                    let mut cc = c.clone();
                    cc[i] = k;
                    self.rank_of(&cc)
                })
                .collect();
            groups.push(group);
        }
        Some(groups)
    }

    /// The group of `axis` that contains `rank`.
    pub fn group_of(&self, axis: &str, rank: u32) -> Option<Vec<u32>> {
        self.groups(axis)?.into_iter().find(|g| g.contains(&rank))
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
                .map(|g| format!("({})", g.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",")))
                .collect();
            out.push_str(&format!("{a} groups: {}\n", text.join(" ")));
        }
        out
    }
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
        assert_eq!(m.groups("sp").unwrap(), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(m.groups("dp").unwrap(), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert_eq!(m.coord(6, "sp"), Some(2));
        assert_eq!(m.coord(6, "dp"), Some(1));
        insta::assert_snapshot!(m.rank_table());
    }

    #[test]
    fn parse_errors_name_the_part() {
        assert!(Mesh::parse("sp").unwrap_err().to_string().contains("`sp` is not `axis=size`"));
        assert!(Mesh::parse("sp=0").unwrap_err().to_string().contains("positive integer"));
        assert!(Mesh::parse("sp=2,sp=2").unwrap_err().to_string().contains("appears twice"));
        assert_eq!(Mesh::parse("").unwrap().world_size(), 1);
    }
}

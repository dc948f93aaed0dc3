//! Parameter partition metadata: how a parameter's full (checkpoint) tensor is cut into
//! per-rank shards along a mesh axis. It is recorded once by the pass that shards the
//! parameter and read by everything that must agree on it: the runtimes (slicing full
//! weights, assembling full gradients), checkpoint resharding and the plan.
//!
//! A fused parameter (phi3's `qkv_proj`, `gate_up_proj`) is made of sub-parameters
//! along the split dim; each is split on its own and a rank's shard is the
//! concatenation of its piece of every sub-parameter, in order.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Partition {
    /// What kind of split this is, for reports: `column`, `row`, `vocab`, `expert`, ...
    pub kind: String,
    pub axis: String,
    /// The dim of the full tensor that is split.
    pub dim: usize,
    /// For each sub-parameter, its size along `dim` on every rank of `axis`, in
    /// coordinate order. An unfused parameter has one sub-parameter.
    pub pieces: Vec<Vec<i64>>,
}

impl Partition {
    /// An even or near-even split of one sub-parameter.
    pub fn simple(kind: &str, axis: &str, dim: usize, sizes: Vec<i64>) -> Partition {
        Partition {
            kind: kind.into(),
            axis: axis.into(),
            dim,
            pieces: vec![sizes],
        }
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
        write!(f, "{} {} dim={}", self.kind, self.axis, self.dim)?;
        for p in &self.pieces {
            let s: Vec<String> = p.iter().map(|x| x.to_string()).collect();
            write!(f, " [{}]", s.join(" "))?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Partition {
    type Err = String;
    /// Parses `column tp dim=0 [64 64] [32 32]`.
    fn from_str(s: &str) -> Result<Partition, String> {
        let usage = || format!("expected `<kind> <axis> dim=<d> [sizes] ...`, found `{s}`");
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
        Ok(Partition {
            kind: kind.to_string(),
            axis: axis.to_string(),
            dim,
            pieces,
        })
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
            axis: "tp".into(),
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
}

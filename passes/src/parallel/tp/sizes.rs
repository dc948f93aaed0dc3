//! How a dim is cut over `tp` ranks, with DeepSpeed AutoTP's rules, computed once at
//! compile time and recorded in the graph's parameter partitions.
//!
//! - **kv-head boundaries** (attention projections when the kv-head count divides the
//!   dim): rank `r` takes `nkv/P` kv heads plus one for the first `nkv % P` ranks, and
//!   `total * slices / nkv` entries (DeepSpeed `get_shard_size` with `num_kv_heads`).
//! - **grain** (everything else; DeepSpeed `tp_grain_size`, 1 by default, 64 common for
//!   vocabularies): whole grains near-evenly, the first ranks one grain more, and the
//!   last rank the sub-grain remainder (DeepSpeed drops it; the sizes here always sum to
//!   the total).
//!
//! When there are fewer kv heads than ranks, DeepSpeed's rule gives the ranks past
//! `nkv % P` zero kv heads and zero q heads (they idle in attention). Weft replicates kv
//! heads instead: ranks are dealt out to the kv groups (the first groups take one more),
//! each group's q heads are split near-evenly over its ranks, and every rank holds the
//! one kv head its q heads attend to ([`attention_heads`]).

/// Near-even split: the first `total % ranks` ranks take one more.
pub fn near_even(total: i64, ranks: i64) -> Vec<i64> {
    (0..ranks)
        .map(|r| total / ranks + i64::from(r < total % ranks))
        .collect()
}

/// DeepSpeed's grain rule, with the last rank taking the sub-grain remainder.
pub fn grain_sizes(total: i64, ranks: i64, grain: i64) -> Vec<i64> {
    let grain = grain.max(1);
    if total < grain {
        return near_even(total, ranks);
    }
    let (units, rem) = (total / grain, total % grain);
    let mut v: Vec<i64> = near_even(units, ranks)
        .into_iter()
        .map(|u| u * grain)
        .collect();
    if let Some(last) = v.last_mut() {
        *last += rem;
    }
    v
}

/// DeepSpeed's kv-head rule: `total * slices / nkv` with `slices` kv heads per rank.
/// `None` when `nkv` does not divide `total`.
pub fn kv_head_sizes(total: i64, ranks: i64, nkv: i64) -> Option<Vec<i64>> {
    if nkv <= 0 || total % nkv != 0 {
        return None;
    }
    Some(
        near_even(nkv, ranks)
            .into_iter()
            .map(|s| total * s / nkv)
            .collect(),
    )
}

/// How an attention's heads are dealt to the ranks of `tp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadSplit {
    /// q heads of each rank.
    pub q: Vec<i64>,
    /// kv heads of each rank.
    pub kv: Vec<i64>,
    /// When kv heads are replicated (fewer kv heads than ranks): the kv head each rank
    /// holds (one per rank). `None`: kv heads are split on kv-head boundaries.
    pub kv_replicated: Option<Vec<i64>>,
}

/// Heads per rank for `nq` q heads and `nkv` kv heads over `ranks` ranks, or why they
/// cannot be split (more ranks than q heads).
pub fn attention_heads(nq: i64, nkv: i64, ranks: i64) -> Result<HeadSplit, String> {
    if nkv <= 0 || nq % nkv != 0 {
        return Err(format!("{nq} q heads are not a multiple of {nkv} kv heads"));
    }
    let group = nq / nkv;
    if nkv >= ranks {
        let kv = near_even(nkv, ranks);
        let q = kv.iter().map(|k| k * group).collect();
        return Ok(HeadSplit {
            q,
            kv,
            kv_replicated: None,
        });
    }
    if ranks > nq {
        return Err(format!(
            "{ranks} ranks but only {nq} q heads: some rank would hold no head"
        ));
    }
    // Deal the ranks out to the kv groups, then each group's q heads to its ranks.
    let per_group = near_even(ranks, nkv);
    let (mut q, mut which) = (Vec::new(), Vec::new());
    for (g, &c) in per_group.iter().enumerate() {
        if c > group {
            return Err(format!("kv group {g} has {group} q heads for {c} ranks"));
        }
        for h in near_even(group, c) {
            q.push(h);
            which.push(g as i64);
        }
    }
    Ok(HeadSplit {
        q,
        kv: vec![1; ranks as usize],
        kv_replicated: Some(which),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        assert_eq!(grain_sizes(101, 2, 1), vec![51, 50]);
        assert_eq!(kv_head_sizes(384, 4, 6), Some(vec![128, 128, 64, 64]));
        let mut want = vec![6336];
        want.extend([6272; 6]);
        want.push(6289);
        assert_eq!(grain_sizes(50257, 8, 64), want);
        let mut want = vec![19008; 6];
        want.extend([18944; 2]);
        assert_eq!(grain_sizes(151936, 8, 64), want);
        // Fused GQA qkv: q 4096 (32 heads of 128), kv 1024 (8 kv heads), tp=3.
        assert_eq!(kv_head_sizes(4096, 3, 8), Some(vec![1536, 1536, 1024]));
        assert_eq!(kv_head_sizes(1024, 3, 8), Some(vec![384, 384, 256]));
        let h = attention_heads(32, 8, 3).unwrap();
        assert_eq!(
            h.q.iter().map(|x| x * 128).collect::<Vec<_>>(),
            vec![1536, 1536, 1024]
        );
        assert_eq!(
            h.kv.iter().map(|x| x * 128).collect::<Vec<_>>(),
            vec![384, 384, 256]
        );
    }

    #[test]
    fn sizes_always_sum_to_the_total() {
        for total in 1..300 {
            for ranks in 1..9 {
                for grain in [1, 2, 7, 64] {
                    let v = grain_sizes(total, ranks, grain);
                    assert_eq!(v.iter().sum::<i64>(), total, "{total} {ranks} {grain}");
                    assert_eq!(v.len() as i64, ranks);
                }
            }
        }
    }

    #[test]
    fn replicated_kv_heads_follow_their_q_heads() {
        // 4 q heads, 2 kv heads over 4 ranks: one q head each, kv heads 0 0 1 1.
        let h = attention_heads(4, 2, 4).unwrap();
        assert_eq!(h.q, vec![1, 1, 1, 1]);
        assert_eq!(h.kv_replicated, Some(vec![0, 0, 1, 1]));
        // Over 3 ranks: group 0 gets two ranks, group 1 one.
        let h = attention_heads(4, 2, 3).unwrap();
        assert_eq!(h.q, vec![1, 1, 2]);
        assert_eq!(h.kv_replicated, Some(vec![0, 0, 1]));
        // Every rank's q heads lie in the group of its kv head.
        for nq in 1..=16 {
            for nkv in (1..=nq).filter(|k| nq % k == 0) {
                for p in 1..=nq {
                    let h = attention_heads(nq, nkv, p).unwrap();
                    assert_eq!(h.q.iter().sum::<i64>(), nq);
                    let mut start = 0;
                    for r in 0..p as usize {
                        let first_group = start / (nq / nkv);
                        let last_group = (start + h.q[r] - 1) / (nq / nkv);
                        match &h.kv_replicated {
                            Some(w) => assert!(first_group == w[r] && last_group == w[r]),
                            None => assert!(h.q[r] == h.kv[r] * (nq / nkv)),
                        }
                        start += h.q[r];
                    }
                }
            }
        }
        assert!(attention_heads(2, 1, 4).is_err());
    }
}

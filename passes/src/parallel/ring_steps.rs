//! Which ring steps a sliding-window ring attention needs.
//!
//! In the zigzag layout the sequence of `S` tokens is cut into `2cp` chunks of
//! `c = S / 2cp` tokens and rank `r` holds chunks `r` and `2cp-1-r`. A query of chunk
//! `a` sees a key of chunk `b` under a causal window of `W` keys when `0 <= i - j < W`,
//! so the block `(a, b)` meets the band iff `a == b`, or `a > b` and its nearest pair
//! is closer than `W`: `(a - b - 1) c + 1 < W`.
//!
//! Ring step `d` of the ring that runs forward (`ring_shift {shift=1}`) brings rank `r`
//! the blocks of rank `r - d mod cp`; the ring that runs backward
//! (`ring_shift {shift=-1}`) brings those of rank `r + d mod cp`. A rank's first chunk
//! looks back at the first chunks of earlier ranks, its second chunk at the second
//! chunks of later ranks, so a narrow band needs the first few steps of both rings,
//! and none between: the ring stops there, and the other blocks are neither sent nor
//! computed. Every rank takes the same steps (SPMD): a step is taken when any rank's
//! blocks of it meet the band.

use std::fmt;

/// The ring steps of a sliding-window ring attention beyond step 0 (the rank's own
/// block): `from_earlier` steps of the forward ring, then `from_later` steps of the
/// backward ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowRing {
    pub from_earlier: i64,
    pub from_later: i64,
    /// The shortest sequence (a multiple of `2cp` tokens) these steps still cover; a
    /// shorter one has smaller chunks, whose band reaches further ranks.
    pub min_seq: i64,
}

impl WindowRing {
    /// Ring steps taken beyond step 0, both rings together.
    pub fn steps(&self) -> i64 {
        self.from_earlier + self.from_later
    }
}

impl fmt::Display for WindowRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} step(s) from earlier ranks and {} from later ranks (for sequences of at least {} tokens)",
            self.from_earlier, self.from_later, self.min_seq
        )
    }
}

/// Whether query chunk `a` and key chunk `b` (of `c` tokens each) meet the causal band
/// of `window` keys.
pub fn blocks_meet_band(a: i64, b: i64, c: i64, window: i64) -> bool {
    a == b || (a > b && (a - b - 1) * c + 1 < window)
}

/// Whether every block of the ring is wholly visible on every rank, so its attention
/// and gradient run without a keep-mask (and with the fused kernels): only for a
/// non-causal attention without a window. In the zigzag layout a causal block never is,
/// whatever the window, chunk size or step: a rank's first query chunk `r < cp`
/// precedes the sender's second key chunk `2cp-1-s >= cp`, so part of every block lies
/// above the diagonal (the causal ring splits its blocks into chunk pairs for that
/// reason); a window requires a causal attention (`docs/attention.md`). The test below
/// checks this against the token-level mask.
pub fn ring_blocks_unmasked(causal: bool, window: Option<i64>) -> bool {
    !causal && window.is_none()
}

/// Whether any rank's blocks at ring distance `d` (its sender is `r - d mod cp`) meet
/// the band.
fn distance_needed(d: i64, c: i64, cp: i64, window: i64) -> bool {
    (0..cp).any(|r| {
        let s = (r - d).rem_euclid(cp);
        [r, 2 * cp - 1 - r].into_iter().any(|a| {
            [s, 2 * cp - 1 - s]
                .into_iter()
                .any(|b| blocks_meet_band(a, b, c, window))
        })
    })
}

/// The fewest forward-ring and backward-ring steps covering every needed distance
/// (ties: the most from earlier ranks, then fewest from later); `cp - 1` forward
/// steps when the two rings together would take as many.
fn covering_steps(c: i64, cp: i64, window: i64) -> (i64, i64) {
    let needed: Vec<i64> = (1..cp)
        .filter(|&d| distance_needed(d, c, cp, window))
        .collect();
    let mut best = (cp - 1, 0);
    for earlier in (0..cp).rev() {
        let later = needed
            .iter()
            .filter(|&&d| d > earlier)
            .map(|&d| cp - d)
            .max()
            .unwrap_or(0);
        if earlier + later < best.0 + best.1 {
            best = (earlier, later);
        }
    }
    best
}

/// The ring steps a causal window of `window` keys needs over `cp` ranks at `seq`
/// tokens, or why there is no such ring.
pub fn window_ring(seq: i64, cp: i64, window: i64) -> Result<WindowRing, String> {
    if cp < 1 || window < 1 {
        return Err(format!(
            "a ring of {cp} ranks with a window of {window} keys"
        ));
    }
    let chunks = 2 * cp;
    if seq < chunks || seq % chunks != 0 {
        return Err(format!(
            "the sequence of {seq} tokens is not a positive multiple of the {chunks} zigzag chunks of cp={cp}"
        ));
    }
    let c = seq / chunks;
    let (from_earlier, from_later) = covering_steps(c, cp, window);
    let covers = |c2: i64| {
        (1..cp)
            .filter(|&d| distance_needed(d, c2, cp, window))
            .all(|d| d <= from_earlier || d >= cp - from_later)
    };
    let min_c = (1..=c).find(|&c2| covers(c2)).unwrap_or(c);
    Ok(WindowRing {
        from_earlier,
        from_later,
        min_seq: min_c * chunks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_two_key_window_needs_one_step_each_way() {
        let r = window_ring(16, 4, 2).unwrap();
        assert_eq!((r.from_earlier, r.from_later, r.min_seq), (1, 1, 8));
    }

    #[test]
    fn a_window_as_wide_as_the_sequence_takes_the_whole_ring() {
        let r = window_ring(16, 4, 16).unwrap();
        assert_eq!((r.from_earlier, r.from_later), (3, 0));
    }

    #[test]
    fn longer_sequences_stop_sooner() {
        // 4096-token window over cp=8: chunks of 1024 tokens at 16k, 8192 at 128k.
        let short = window_ring(16384, 8, 4096).unwrap();
        let long = window_ring(131072, 8, 4096).unwrap();
        // 4 steps each way would be 8 > cp-1: the whole forward ring.
        assert_eq!((short.from_earlier, short.from_later), (7, 0));
        assert_eq!((long.from_earlier, long.from_later), (1, 1));
        assert!(long.min_seq <= 131072 && long.min_seq > 16384);
    }

    #[test]
    fn a_sequence_that_does_not_fill_the_chunks_is_refused() {
        assert!(window_ring(12, 4, 2).is_err());
        assert!(window_ring(4, 4, 2).is_err());
    }

    /// The decision to drop a ring block's mask agrees with the mask itself, token by
    /// token: the blocks are unmasked iff every rank's queries see every key of the
    /// block it holds at every ring distance. Causal blocks never are in the zigzag
    /// layout (a window requires causal: `docs/attention.md`); non-causal ones always
    /// are.
    #[test]
    fn ring_blocks_are_unmasked_iff_every_pair_is_visible() {
        for cp in 1..=5i64 {
            for c in 1..=4i64 {
                let chunk_rank = |x: i64| if x < cp { x } else { 2 * cp - 1 - x };
                let mut cases = vec![(false, None), (true, None)];
                cases.extend((1..=2 * cp * c + 1).map(|w| (true, Some(w))));
                for (causal, window) in cases {
                    let visible =
                        |i: i64, j: i64| (!causal || j <= i) && window.is_none_or(|w| i - j < w);
                    let brute = (0..cp).all(|d| {
                        (0..2 * cp * c).all(|i| {
                            let s = (chunk_rank(i / c) - d).rem_euclid(cp);
                            (0..2 * cp * c)
                                .filter(|j| chunk_rank(j / c) == s)
                                .all(|j| visible(i, j))
                        })
                    });
                    assert_eq!(
                        ring_blocks_unmasked(causal, window),
                        brute,
                        "cp={cp} c={c} causal={causal} window={window:?}"
                    );
                }
            }
        }
    }

    /// Every (query, key) pair in the band lies in a block some taken step covers.
    #[test]
    fn the_taken_steps_cover_every_pair_in_the_band() {
        for cp in 2..=6i64 {
            for c in 1..=4i64 {
                for w in 1..=(2 * cp * c) {
                    let r = window_ring(2 * cp * c, cp, w).unwrap();
                    let chunk_rank = |x: i64| if x < cp { x } else { 2 * cp - 1 - x };
                    for i in 0..2 * cp * c {
                        for j in (i + 1 - w).max(0)..=i {
                            let (qr, kr) = (chunk_rank(i / c), chunk_rank(j / c));
                            let d = (qr - kr).rem_euclid(cp);
                            assert!(
                                d == 0 || d <= r.from_earlier || d >= cp - r.from_later,
                                "cp={cp} c={c} w={w}: pair ({i}, {j}) at distance {d}, {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}

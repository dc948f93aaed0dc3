//! Symbolic batch and sequence sizes where the export has constants.
//!
//! `torch.export` specialises every size it was not told is dynamic: exported as HF
//! examples usually are (`dynamic_shapes={"input_ids": {1: Dim.AUTO}}`), the batch is
//! the constant 2 in every shape; a fully static export also fixes the sequence length.
//! Weft's passes need `B` and `S` as symbols, so the importer declares `input_ids` as
//! `[B, S]` and re-derives each result shape from its input's symbolic shape instead of
//! copying the recorded one:
//!
//! - a reshape aligns input and output dims into groups of equal size (evaluated at the
//!   export's own sizes) and gives each output group the input group's symbolic
//!   product, folding the difference into the group's outermost dim (row-major flattening
//!   puts the batch outermost: `[B*S, H] → [2, 16, H]` becomes `[B, S, H]`,
//!   `[2*B*S, H] → [2*16, 2, H]` becomes `[B*S, 2, H]`);
//! - an expand keeps every input dim whose size matches, and a leading dim broadcast
//!   to the batch's size (from nothing or from 1) is `B`;
//! - `*_like` ops take their input's shape;
//! - every result is checked against the recorded type at the export's sizes.

use super::lower::Lower;
use weft_ir::{Bindings, Dim};

impl Lower<'_> {
    /// Bindings of the export's example sizes.
    fn example(&self) -> Bindings {
        let mut b = Bindings::new().with("B", self.b0).with("S", self.s0);
        if let Some(s) = &self.seq_sym {
            b = b.with(s, self.s0);
        }
        b
    }

    pub fn eval(&self, d: &Dim) -> Option<i64> {
        d.eval(&self.example()).ok()
    }

    pub fn same_size(&self, a: &Dim, b: &Dim) -> bool {
        a == b || matches!((self.eval(a), self.eval(b)), (Some(x), Some(y)) if x == y)
    }

    /// The sequence dim for a recorded size that is the sequence length.
    pub fn seq_dim(&self, recorded: &Dim) -> Dim {
        if self.generalize_seq && self.eval(recorded) == Some(self.s0) {
            Dim::sym("S")
        } else {
            recorded.clone()
        }
    }

    /// A recorded shape with no input to follow (`arange`, `full`): the sequence length
    /// of a static export becomes `S`; everything else stays as recorded.
    pub fn gen_free(&self, meta: &[Dim]) -> Vec<Dim> {
        meta.iter()
            .map(|d| {
                if d.as_const() == Some(self.s0) {
                    self.seq_dim(d)
                } else {
                    d.clone()
                }
            })
            .collect()
    }

    pub fn gen_like(&self, input: &[Dim], meta: &[Dim]) -> Vec<Dim> {
        if input.len() == meta.len() && input.iter().zip(meta).all(|(a, b)| self.same_size(a, b)) {
            input.to_vec()
        } else {
            meta.to_vec()
        }
    }

    pub fn gen_expand(&self, input: &[Dim], meta: &[Dim]) -> Vec<Dim> {
        let off = meta.len().saturating_sub(input.len());
        meta.iter()
            .enumerate()
            .map(|(k, m)| match k.checked_sub(off).map(|j| &input[j]) {
                Some(i) if self.same_size(i, m) => i.clone(),
                // A new leading dim of the batch's size (a weight broadcast over the
                // batch for `bmm`), or a leading size-1 dim broadcast to it (a mask or
                // gpt-oss's sinks expanded over the batch), is the batch.
                None if k == 0 && self.batch_sym.is_none() && m.as_const() == Some(self.b0) => {
                    Dim::sym("B")
                }
                Some(i)
                    if k == 0
                        && i.as_const() == Some(1)
                        && self.batch_sym.is_none()
                        && m.as_const() == Some(self.b0) =>
                {
                    Dim::sym("B")
                }
                _ => m.clone(),
            })
            .collect()
    }

    pub fn gen_reshape(&self, input: &[Dim], meta: &[Dim]) -> Vec<Dim> {
        let (Some(iv), Some(ov)) = (
            input
                .iter()
                .map(|d| self.eval(d))
                .collect::<Option<Vec<i64>>>(),
            meta.iter()
                .map(|d| self.eval(d))
                .collect::<Option<Vec<i64>>>(),
        ) else {
            return meta.to_vec();
        };
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::with_capacity(meta.len());
        loop {
            while j < ov.len() && ov[j] == 1 {
                out.push(Dim::from(1));
                j += 1;
                if i < iv.len() && iv[i] == 1 {
                    i += 1;
                }
            }
            while i < iv.len() && iv[i] == 1 {
                i += 1;
            }
            if j == ov.len() {
                return if i == iv.len() { out } else { meta.to_vec() };
            }
            if i == iv.len() || iv[i] == 0 || ov[j] == 0 {
                return meta.to_vec();
            }
            let (i0, j0) = (i, j);
            let (mut pi, mut pj) = (iv[i], ov[j]);
            i += 1;
            j += 1;
            while pi != pj {
                if pi < pj {
                    if i == iv.len() {
                        return meta.to_vec();
                    }
                    pi = pi.saturating_mul(iv[i]);
                    i += 1;
                } else {
                    if j == ov.len() {
                        return meta.to_vec();
                    }
                    pj = pj.saturating_mul(ov[j]);
                    j += 1;
                }
            }
            let sym = input[i0..i].iter().fold(Dim::from(1), |a, d| a * d.clone());
            let mut group = meta[j0..j].to_vec();
            if sym.mentions("S") && group.len() > 1 {
                // A static export's sequence length, split off a symbolic group.
                group = group
                    .iter()
                    .map(|d| {
                        if d.as_const() == Some(self.s0) {
                            self.seq_dim(d)
                        } else {
                            d.clone()
                        }
                    })
                    .collect();
            }
            let rec = group.iter().fold(Dim::from(1), |a, d| a * d.clone());
            if sym != rec {
                group[0] = group[0].clone() * sym.exact_div(&rec);
            }
            out.extend(group);
        }
    }
}

#[cfg(test)]
mod tests {
    use weft_ir::Dim;

    fn b() -> Dim {
        Dim::sym("B")
    }
    fn s() -> Dim {
        Dim::sym("S")
    }

    fn with<R>(f: impl FnOnce(&super::Lower) -> R) -> R {
        let fx = super::super::fx::FxGraph::default();
        let l = super::super::lower::Lower::for_tests(&fx, 2, 16, true);
        f(&l)
    }

    #[test]
    fn reshapes_follow_the_symbolic_input() {
        with(|l| {
            let c = |n: i64| Dim::from(n);
            // [B*S, 32] -> recorded [2, 16, 32]
            assert_eq!(
                l.gen_reshape(&[b() * s(), c(32)], &[c(2), c(16), c(32)]),
                vec![b(), s(), c(32)]
            );
            // [2*B*S, 32] -> recorded [32, 2, 32]: top-k, not batch
            assert_eq!(
                l.gen_reshape(&[b() * s() * 2, c(32)], &[c(32), c(2), c(32)]),
                vec![b() * s(), c(2), c(32)]
            );
            // unsqueeze [B, S] -> [2, 1, 16]
            assert_eq!(
                l.gen_reshape(&[b(), s()], &[c(2), c(1), c(16)]),
                vec![b(), c(1), s()]
            );
            // split heads [B, S, 32] -> [2, 16, 4, 8]
            assert_eq!(
                l.gen_reshape(&[b(), s(), c(32)], &[c(2), c(16), c(4), c(8)]),
                vec![b(), s(), c(4), c(8)]
            );
            // fold batch and heads [B, 4, S, 8] -> [8, 16, 8]
            assert_eq!(
                l.gen_reshape(&[b(), c(4), s(), c(8)], &[c(8), c(16), c(8)]),
                vec![b() * 4, s(), c(8)]
            );
            assert_eq!(
                l.gen_expand(
                    &[b(), c(2), c(1), s(), c(8)],
                    &[c(2), c(2), c(2), c(16), c(8)]
                ),
                vec![b(), c(2), c(2), s(), c(8)]
            );
        });
    }

    #[test]
    fn a_leading_unit_dim_expanded_to_the_batch_is_b() {
        with(|l| {
            let c = |n: i64| Dim::from(n);
            // gpt-oss's sinks [1, 4, 1, 1] -> recorded [2, 4, 16, 1]
            assert_eq!(
                l.gen_expand(&[c(1), c(4), c(1), c(1)], &[c(2), c(4), c(16), c(1)]),
                vec![b(), c(4), c(16), c(1)]
            );
            // a mask [1, 1, S, S] -> recorded [2, 1, 16, 16]
            assert_eq!(
                l.gen_expand(&[c(1), c(1), s(), s()], &[c(2), c(1), c(16), c(16)]),
                vec![b(), c(1), s(), s()]
            );
            // a unit dim expanded to another size, or not leading, stays as recorded
            assert_eq!(
                l.gen_expand(&[c(1), c(1), c(8)], &[c(3), c(2), c(8)]),
                vec![c(3), c(2), c(8)]
            );
        });
    }
}

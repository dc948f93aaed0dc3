//! Step-k slices `x[.., start::k]` over a whole dim of constant size `n` (a multiple
//! of k), as DeepSeek-V3's interleaved rope takes its pairs (`x[..., 0::2]`,
//! `x[..., 1::2]`).
//!
//! The dim is de-interleaved once per `(x, dim, k)`: `reshape` to `[.., n/k, k, ..]`,
//! `transpose` the two, `reshape` back to `[.., n, ..]` (every k-th element first, then
//! the next ...), and `split` into k parts of `n/k`; part `start` is the slice. Both
//! slices of a pair are then halves of one de-interleaved tensor, which is how the
//! config path writes MLA's rope (`deinterleave` then `rope`), so the rotation that
//! follows is recognised as `rope` (rewrite.rs, `half_rope`). Any other strided slice
//! (a partial range, a start past the step, a symbolic or indivisible dim) is refused.

use super::fx::FxNode;
use super::lower::{Lower, LR};
use super::schema::Arg;
use weft_ir::{Dim, Op, Value};

/// The largest step read (one split part per step): rotary pairs use 2.
const MAX_STEP: i64 = 1 << 16;

impl Lower<'_> {
    /// `slice(x, dim, start, end, step)` with `step != 1` (`dim` normalised).
    pub fn strided_slice(&mut self, n: &FxNode, x: Value, dim: i64, step: i64) -> LR<Value> {
        let shape = self.ty(x).shape.clone();
        let d = dim as usize;
        let refuse = |why: String| format!("slice with step {step}: {why}");
        let size = shape[d]
            .as_const()
            .ok_or_else(|| self.unsupported(n, refuse(format!("dim {dim} is symbolic"))))?;
        if !(2..=MAX_STEP).contains(&step) || step > size || size % step != 0 {
            return Err(self.unsupported(
                n,
                refuse(format!(
                    "the dim's size {size} is not a multiple of a step of 2 to {MAX_STEP}"
                )),
            ));
        }
        let start = match n.arg_at(2) {
            Arg::None => 0,
            a => self.int_arg(n, a)?,
        };
        let end = match n.arg_at(3) {
            Arg::None => i64::MAX,
            a => self.int_arg(n, a)?,
        };
        if !(0..step).contains(&start) || end < size {
            return Err(self.unsupported(
                n,
                refuse(format!(
                    "only whole-dim slices `start::{step}` with start below the step are read (start {start}, end {end}, size {size})"
                )),
            ));
        }
        let key = (x, dim, step);
        if let Some(parts) = self.strided.get(&key) {
            return Ok(parts[start as usize]);
        }
        let each = size / step;
        let mut grouped = shape.clone();
        grouped.splice(d..=d, [Dim::from(each), Dim::from(step)]);
        let pairs = self.reshape(n, x, grouped)?;
        let swapped = self.emit(
            n,
            Op::Transpose {
                dim0: dim,
                dim1: dim + 1,
            },
            &[pairs],
        )?;
        let flat = self.reshape(n, swapped, shape)?;
        let parts = self.emit_multi(
            n,
            Op::Split {
                dim,
                sizes: vec![Dim::from(each); step as usize],
            },
            &[flat],
        )?;
        self.strided.insert(key, parts.clone());
        Ok(parts[start as usize])
    }
}

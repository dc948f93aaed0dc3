//! The all-gather variant of context parallelism (`--cp-kv allgather`), which
//! `ring-lower` writes instead of the ring steps when the option asks for it (as
//! PyTorch's context parallel offers an all-gather of k/v beside its ring):
//!
//! - forward: one `all_gather` over `cp` of this rank's k and of its v gives every rank
//!   the whole sequence's k/v in zigzag chunk order (rank blocks in rank order); one
//!   `attention` of the local queries against all keys under a keep-mask from global
//!   positions (causal, and the sliding window's band where the op has one; the
//!   masked ring's mask; none for a non-causal attention without a window, where
//!   every key is visible), with `lse`. Its out and lse are the ring's: the same
//!   attention over the same keys, in one block instead of merged ones. The key
//!   positions are the zigzag order of the whole sequence, which every rank computes
//!   itself, so they are not sent;
//! - backward: k and v gathered again (the forward's copies died within it, as the
//!   ring's blocks do), one `attention_block_grad` of the local queries against all
//!   keys from the saved out and lse under the same mask, then a `reduce_scatter`
//!   (sum) over `cp` of dk and of dv along the sequence, which leaves each rank the sum
//!   of every rank's gradient for its own keys.
//!
//! The collectives run along dim 0 of a sequence-first copy (`permute`), where NCCL
//! gathers and scatters contiguous blocks.
//!
//! Per layer and rank it moves `2 (cp-1)` k/v blocks forward and `4 (cp-1)` backward,
//! as the ring does, in collectives that nothing overlaps, and it holds the whole
//! sequence's k/v (`cp` blocks) where the ring holds two.

use crate::pass::{PassError, CP};
use crate::ring_lower::{bytes, keep_mask, zigzag_positions, Builder, Ring, Saved};
use weft_ir::{Op, ReduceOp, Value};

/// How context parallelism moves k/v between the `cp` ranks (`--cp-kv`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpKv {
    /// Ring steps: each k/v block travels the ring (`ring_shift`), overlapped with the
    /// previous step's attention; two blocks live at a time.
    #[default]
    Ring,
    /// One `all_gather` of k and of v (and a `reduce_scatter` of dk and dv in the
    /// backward): fewer, larger collectives, not overlapped, the whole k/v held.
    AllGather,
}

impl CpKv {
    /// Parses the `--cp-kv` value: `ring` or `allgather`.
    pub fn parse(s: &str) -> Result<CpKv, String> {
        match s {
            "ring" => Ok(CpKv::Ring),
            "allgather" => Ok(CpKv::AllGather),
            _ => Err(format!("unknown k/v exchange `{s}`: use ring or allgather")),
        }
    }

    /// The name `--cp-kv` takes.
    pub fn name(self) -> &'static str {
        match self {
            CpKv::Ring => "ring",
            CpKv::AllGather => "allgather",
        }
    }
}

/// The permutation that brings the sequence (dim 2) of a `[B, N, S, D]` tensor to the
/// front, and its inverse: the collectives run along dim 0, where NCCL gathers and
/// scatters contiguous blocks (an inner dim is refused by the CUDA executor).
const SEQUENCE_FIRST: [i64; 4] = [2, 0, 1, 3];
const SEQUENCE_BACK: [i64; 4] = [1, 2, 0, 3];

fn permute(b: &mut Builder, x: Value, perm: [i64; 4], why: &str) -> Result<Value, PassError> {
    b.op(
        Op::Permute {
            perm: perm.to_vec(),
        },
        &[x],
        why,
    )
}

/// `all_gather` of `x` (`[B, N, S/cp, D]`) over cp along the sequence, in rank order
/// (the zigzag chunk order); the reason names the variant and the bytes a rank sends
/// and receives.
fn gather(b: &mut Builder, r: &Ring, x: Value, what: &str) -> Result<Value, PassError> {
    let block = bytes(&b.ty(x));
    let why = format!(
        "cp k/v all-gather: {what} of every cp rank, {block} bytes per rank sent, {} received; overlaps nothing",
        block.clone() * (r.cp - 1)
    );
    let first = permute(
        b,
        x,
        SEQUENCE_FIRST,
        &format!("cp k/v all-gather: {what} sequence-first for the gather"),
    )?;
    b.res.count("kv_all_gathers", 1);
    let all = b.op(
        Op::AllGather {
            axis: CP.into(),
            dim: 0,
        },
        &[first],
        &why,
    )?;
    permute(
        b,
        all,
        SEQUENCE_BACK,
        &format!("cp k/v all-gather: the whole sequence's {what} back to [B, N, S, D]"),
    )
}

/// `reduce_scatter` (sum) over cp along the sequence of a gradient for the whole
/// sequence's keys (`[B, N, S, D]`): each rank gets the sum over ranks of its own block.
fn scatter(b: &mut Builder, r: &Ring, x: Value, what: &str) -> Result<Value, PassError> {
    let whole = bytes(&b.ty(x));
    let why = format!(
        "cp k/v all-gather backward: {what} summed over the cp ranks and scattered to the rank owning each key block, {whole} bytes per rank in, {} out; overlaps nothing",
        whole.clone() / r.cp
    );
    let first = permute(
        b,
        x,
        SEQUENCE_FIRST,
        &format!("cp k/v all-gather backward: {what} sequence-first for the reduce-scatter"),
    )?;
    b.res.count("kv_reduce_scatters", 1);
    let own = b.op(
        Op::ReduceScatter {
            axis: CP.into(),
            dim: 0,
            op: ReduceOp::Sum,
        },
        &[first],
        &why,
    )?;
    permute(
        b,
        own,
        SEQUENCE_BACK,
        &format!("cp k/v all-gather backward: this rank's {what} back to [B, N, S/cp, D]"),
    )
}

/// The keep-mask of this rank's queries against the whole gathered sequence; none
/// where every key is visible (non-causal attention without a window).
fn whole_sequence_mask(
    b: &mut Builder,
    r: &Ring,
    q: Value,
    what: &str,
) -> Result<Option<Value>, PassError> {
    if crate::ring_steps::ring_blocks_unmasked(r.causal, r.window) {
        return Ok(None);
    }
    let local = b.ty(q).shape[2].clone();
    let (all, _, qcol) = zigzag_positions(b, r, &local)?;
    keep_mask(b, r, &local, qcol, all, what).map(Some)
}

/// The forward: out and lse of this rank's queries against the gathered k/v.
pub(crate) fn forward(
    b: &mut Builder,
    r: &Ring,
    q: Value,
    k: Value,
    v: Value,
) -> Result<(Value, Value), PassError> {
    let kg = gather(b, r, k, "k")?;
    let vg = gather(b, r, v, "v")?;
    let what = "cp k/v all-gather";
    let mut ins = vec![q, kg, vg];
    ins.extend(whole_sequence_mask(b, r, q, what)?);
    b.block_attention(
        r,
        &ins,
        false,
        &format!("{what}: this rank's queries x the whole sequence's k/v"),
    )
}

/// The backward: dq of the local queries and this rank's dk, dv, from one gradient
/// against the gathered k/v and a reduce_scatter of its dk and dv.
pub(crate) fn backward(
    b: &mut Builder,
    r: &Ring,
    x: Saved,
) -> Result<(Value, Value, Value), PassError> {
    let kg = gather(b, r, x.k, "k (again, for the backward)")?;
    let vg = gather(b, r, x.v, "v (again, for the backward)")?;
    let what = "cp k/v all-gather backward";
    let mut ins = vec![x.q, kg, vg, x.out, x.dout, x.lse];
    ins.extend(whole_sequence_mask(b, r, x.q, what)?);
    let (dq, dk_all, dv_all) = b.block_grad(
        r,
        &ins,
        false,
        &format!("{what}: this rank's queries x the whole sequence's k/v"),
    )?;
    let dk = scatter(b, r, dk_all, "dk")?;
    let dv = scatter(b, r, dv_all, "dv")?;
    Ok((dq, dk, dv))
}

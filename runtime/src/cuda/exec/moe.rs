//! Lowering of MoE routing: `moe_dispatch` (expert counts and the token order, then the
//! rows gathered per expert), `moe_combine` (rows weighted back to tokens) and its
//! backward. The grouped GEMMs between them are in `matmul`.

use super::*;

/// `moe_dispatch`: counts, order and the gathered rows.
pub(super) fn moe_dispatch(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    num_experts: &i64,
) -> CudaResult<()> {
    let err = lw.gpu.err_flag.ptr;
    let (x, e) = (&ins[0], &ins[1]);
    let (rows, counts, order) = (&outs[0], &outs[1], &outs[2]);
    let tk = e.numel();
    let k = if e.rank() == 2 { e.shape[1] } else { 1 };
    let ne = *num_experts as u32;
    let lp = lw.gpu.launch(
        "moe_route",
        (1, 1, 1),
        (ne.clamp(32, 1024), 1, 1),
        ne * 8,
        vec![
            Arg::P(counts.ptr),
            Arg::P(order.ptr),
            Arg::P(e.ptr),
            Arg::I64(tk as i64),
            Arg::I32(ne as i32),
            Arg::P(err),
        ],
    )?;
    lw.launch(lp);
    let h = x.shape[1] as i64;
    let name = kname("moe_gather", x.dtype)?;
    lw.n(
        name,
        rows.numel(),
        vec![
            Arg::P(rows.ptr),
            Arg::P(x.ptr),
            Arg::P(order.ptr),
            Arg::I64(tk as i64),
            Arg::I32(k as i32),
            Arg::I64(h),
        ],
    )
}

/// `moe_combine`: each token the weighted sum of its expert rows.
pub(super) fn moe_combine(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (rows, order, w) = (&ins[0], &ins[1], &ins[2]);
    let (t, k) = (w.shape[0], w.shape[1]);
    let tk = (t * k) as u64;
    let inv = lw.ex.scratch(lw.stream, tk * 4);
    lw.n(
        "fill_i32",
        tk,
        vec![Arg::P(inv), Arg::I64(tk as i64), Arg::I32(-1)],
    )?;
    lw.n(
        "moe_inverse",
        rows.shape[0] as u64,
        vec![
            Arg::P(inv),
            Arg::P(order.ptr),
            Arg::I64(rows.shape[0] as i64),
            Arg::I64(tk as i64),
            Arg::P(err),
        ],
    )?;
    let name = kname("moe_combine", o.dtype)?;
    lw.n(
        name,
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(rows.ptr),
            Arg::P(inv),
            Arg::P(w.ptr),
            Arg::I32(code(w.dtype)),
            Arg::I64(t as i64),
            Arg::I32(k as i32),
            Arg::I64(rows.shape[1] as i64),
        ],
    )
}

/// `moe_combine_grad`: d rows and d weights.
pub(super) fn moe_combine_grad(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let (rows, order, w, dy) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    let k = w.shape[1];
    lw.memset(outs[1].ptr, outs[1].bytes());
    let name = kname("moe_combine_bwd", rows.dtype)?;
    lw.warps(
        name,
        rows.shape[0] as u64,
        vec![
            Arg::P(outs[0].ptr),
            Arg::P(outs[1].ptr),
            Arg::P(rows.ptr),
            Arg::P(order.ptr),
            Arg::P(w.ptr),
            Arg::P(dy.ptr),
            Arg::I64(rows.shape[0] as i64),
            Arg::I32(k as i32),
            Arg::I64(rows.shape[1] as i64),
        ],
    )
}

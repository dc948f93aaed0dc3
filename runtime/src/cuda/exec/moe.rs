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
    let route = kernels::MoeRoute {
        counts: counts.ptr,
        order: order.ptr,
        eidx: e.ptr,
        tk: tk as i64,
        e: ne as i32,
        err,
    };
    lw.run_at(
        "moe_route",
        (1, 1, 1),
        (ne.clamp(32, 1024), 1, 1),
        ne * 8,
        route,
    )?;
    let h = x.shape[1] as i64;
    let name = kname("moe_gather", x.dtype)?;
    let gather = kernels::MoeGather {
        rows: rows.ptr,
        x: x.ptr,
        order: order.ptr,
        r: tk as i64,
        k: k as i32,
        h,
    };
    lw.run(name, rows.numel(), gather)
}

/// `moe_combine`: each token the weighted sum of its expert rows.
pub(super) fn moe_combine(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (rows, order, w) = (&ins[0], &ins[1], &ins[2]);
    let (t, k) = (w.shape[0], w.shape[1]);
    let tk = (t * k) as u64;
    let inv = lw.ex.scratch(lw.stream, tk * 4);
    let fill = kernels::FillI32 {
        out: inv,
        n: tk as i64,
        v: -1,
    };
    lw.run("fill_i32", tk, fill)?;
    let inverse = kernels::MoeInverse {
        inv,
        order: order.ptr,
        r: rows.shape[0] as i64,
        tk: tk as i64,
        err,
    };
    lw.run("moe_inverse", rows.shape[0] as u64, inverse)?;
    let name = kname("moe_combine", o.dtype)?;
    let combine = kernels::MoeCombine {
        out: o.ptr,
        rows: rows.ptr,
        inv,
        w: w.ptr,
        wcode: w.dtype,
        ntok: t as i64,
        k: k as i32,
        h: rows.shape[1] as i64,
    };
    lw.run(name, o.numel(), combine)
}

/// `moe_combine_grad`: d rows and d weights.
pub(super) fn moe_combine_grad(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let (rows, order, w, dy) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    let k = w.shape[1];
    lw.memset(outs[1].ptr, outs[1].bytes());
    let name = kname("moe_combine_bwd", rows.dtype)?;
    let bwd = kernels::MoeCombineBwd {
        drows: outs[0].ptr,
        dweights: outs[1].ptr,
        rows: rows.ptr,
        order: order.ptr,
        w: w.ptr,
        dy: dy.ptr,
        r: rows.shape[0] as i64,
        k: k as i32,
        h: rows.shape[1] as i64,
    };
    lw.run(name, rows.shape[0] as u64, bwd)
}

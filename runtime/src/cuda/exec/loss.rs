//! Lowering of the loss ops: label shifting, counting valid labels, and cross-entropy
//! forward (per-row loss and a saved log-sum-exp) and backward (one pass over the logits
//! using that saved log-sum-exp where the forward ran in this plan).

use super::*;

/// `shift_labels`: labels moved one left, the last `ignore_index`.
pub(super) fn shift_labels(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    ignore_index: &i64,
) -> CudaResult<()> {
    let o = &outs[0];
    let l = &ins[0];
    let n = *l.shape.last().unwrap_or(&1) as i64;
    let rows = (l.numel() as i64).checked_div(n).unwrap_or(0);
    let k = kernels::ShiftLabels {
        out: o.ptr,
        l: l.ptr,
        rows,
        n,
        ignore: *ignore_index,
    };
    lw.run("shift_labels", l.numel(), k)
}

/// `count_valid`: how many labels are not `ignore_index`.
pub(super) fn count_valid(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    ignore_index: &i64,
) -> CudaResult<()> {
    let o = &outs[0];
    let l = &ins[0];
    let k = kernels::CountValid {
        out: o.ptr,
        ocode: o.dtype,
        l: l.ptr,
        n: l.numel() as i64,
        ignore: *ignore_index,
    };
    lw.run("count_valid", 1, k)
}

/// `cross_entropy`: per-row losses, then their sum or mean.
pub(super) fn cross_entropy(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    ignore_index: &i64,
    reduction: &Reduction,
) -> CudaResult<()> {
    let o = &outs[0];
    let err = lw.gpu.err_flag.ptr;
    let (x, l) = (&ins[0], &ins[1]);
    let v = *x.shape.last().unwrap() as u64;
    let rows = l.numel();
    let per_row = match reduction {
        Reduction::None if o.dtype == DType::F32 => o.ptr,
        _ => lw.ex.scratch(lw.stream, rows * 4),
    };
    // Keep the per-row log-sum-exp for a one-pass backward.
    let lse = lw.ex.side(rows * 4);
    lw.ce_lse.insert((x.ptr, l.ptr), lse);
    let name = kname("ce_rows", x.dtype)?;
    let k = kernels::CeRows {
        loss: per_row,
        lse,
        logits: x.ptr,
        labels: l.ptr,
        rows: rows as i64,
        v: v as i64,
        ignore: *ignore_index,
        err,
    };
    lw.run(name, rows, k)?;
    match reduction {
        Reduction::None => {
            if per_row != o.ptr {
                let k = kernels::F32To {
                    out: o.ptr,
                    ocode: o.dtype,
                    input: per_row,
                    n: rows as i64,
                };
                lw.run("f32_to_any", rows, k)?;
            }
            Ok(())
        }
        Reduction::Sum | Reduction::Mean => {
            let labels = if *reduction == Reduction::Mean {
                l.ptr
            } else {
                0
            };
            let k = kernels::SumF32 {
                out: o.ptr,
                ocode: o.dtype,
                input: per_row,
                n: rows as i64,
                scale: 1.0,
                labels,
                nl: rows as i64,
                ignore: *ignore_index,
            };
            lw.run("sum_f32", 1, k)
        }
    }
}

/// `cross_entropy_grad`: d logits.
pub(super) fn cross_entropy_grad(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    ignore_index: &i64,
    reduction: &Reduction,
) -> CudaResult<()> {
    let o = &outs[0];
    let (x, l, dl) = (&ins[0], &ins[1], &ins[2]);
    let v = *x.shape.last().unwrap() as u64;
    let rows = l.numel();
    let mode = match reduction {
        Reduction::None => 0,
        Reduction::Sum => 1,
        Reduction::Mean => 2,
    };
    let count = if mode == 2 {
        let c = lw.ex.scratch(lw.stream, 4);
        let k = kernels::CountValid {
            out: c,
            ocode: DType::F32,
            l: l.ptr,
            n: rows as i64,
            ignore: *ignore_index,
        };
        lw.run("count_valid", 1, k)?;
        c
    } else {
        0
    };
    if let (Some(&lse), true) = (
        lw.ce_lse.get(&(x.ptr, l.ptr)),
        vec8(o, &[o, x]) && v.is_multiple_of(8),
    ) {
        let k = kernels::CeBwdLse8 {
            dx: o.ptr,
            logits: x.ptr,
            labels: l.ptr,
            lse,
            dloss: dl.ptr,
            dcode: dl.dtype,
            mode,
            count,
            rows: rows as i64,
            v8: v as i64 / 8,
            ignore: *ignore_index,
        };
        return lw.run("ce_bwd_lse8_bf16", rows, k);
    }
    let name = kname("ce_bwd", x.dtype)?;
    let k = kernels::CeBwd {
        dx: o.ptr,
        logits: x.ptr,
        labels: l.ptr,
        dloss: dl.ptr,
        dcode: dl.dtype,
        mode,
        count,
        rows: rows as i64,
        v: v as i64,
        ignore: *ignore_index,
    };
    lw.run(name, rows, k)
}

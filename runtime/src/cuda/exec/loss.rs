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
    let rows = if n == 0 { 0 } else { l.numel() as i64 / n };
    lw.n(
        "shift_labels",
        l.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(l.ptr),
            Arg::I64(rows),
            Arg::I64(n),
            Arg::I64(*ignore_index),
        ],
    )
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
    let lp = lw.gpu.launch(
        "count_valid",
        (1, 1, 1),
        (1024, 1, 1),
        0,
        vec![
            Arg::P(o.ptr),
            Arg::I32(code(o.dtype)),
            Arg::P(l.ptr),
            Arg::I64(l.numel() as i64),
            Arg::I64(*ignore_index),
        ],
    )?;
    lw.launch(lp);
    Ok(())
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
    lw.rows(
        name,
        rows,
        512,
        0,
        vec![
            Arg::P(per_row),
            Arg::P(lse),
            Arg::P(x.ptr),
            Arg::P(l.ptr),
            Arg::I64(rows as i64),
            Arg::I64(v as i64),
            Arg::I64(*ignore_index),
            Arg::P(err),
        ],
    )?;
    match reduction {
        Reduction::None => {
            if per_row != o.ptr {
                lw.n(
                    "f32_to_any",
                    rows,
                    vec![
                        Arg::P(o.ptr),
                        Arg::I32(code(o.dtype)),
                        Arg::P(per_row),
                        Arg::I64(rows as i64),
                    ],
                )?;
            }
            Ok(())
        }
        Reduction::Sum | Reduction::Mean => {
            let labels = if *reduction == Reduction::Mean {
                l.ptr
            } else {
                0
            };
            let lp = lw.gpu.launch(
                "sum_f32",
                (1, 1, 1),
                (1024, 1, 1),
                0,
                vec![
                    Arg::P(o.ptr),
                    Arg::I32(code(o.dtype)),
                    Arg::P(per_row),
                    Arg::I64(rows as i64),
                    Arg::F32(1.0),
                    Arg::P(labels),
                    Arg::I64(rows as i64),
                    Arg::I64(*ignore_index),
                ],
            )?;
            lw.launch(lp);
            Ok(())
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
        let lp = lw.gpu.launch(
            "count_valid",
            (1, 1, 1),
            (1024, 1, 1),
            0,
            vec![
                Arg::P(c),
                Arg::I32(0),
                Arg::P(l.ptr),
                Arg::I64(rows as i64),
                Arg::I64(*ignore_index),
            ],
        )?;
        lw.launch(lp);
        c
    } else {
        0
    };
    if let (Some(&lse), true) = (
        lw.ce_lse.get(&(x.ptr, l.ptr)),
        vec8(o, &[o, x]) && v.is_multiple_of(8),
    ) {
        return lw.rows(
            "ce_bwd_lse8_bf16",
            rows,
            512,
            0,
            vec![
                Arg::P(o.ptr),
                Arg::P(x.ptr),
                Arg::P(l.ptr),
                Arg::P(lse),
                Arg::P(dl.ptr),
                Arg::I32(code(dl.dtype)),
                Arg::I32(mode),
                Arg::P(count),
                Arg::I64(rows as i64),
                Arg::I64(v as i64 / 8),
                Arg::I64(*ignore_index),
            ],
        );
    }
    let name = kname("ce_bwd", x.dtype)?;
    lw.rows(
        name,
        rows,
        512,
        0,
        vec![
            Arg::P(o.ptr),
            Arg::P(x.ptr),
            Arg::P(l.ptr),
            Arg::P(dl.ptr),
            Arg::I32(code(dl.dtype)),
            Arg::I32(mode),
            Arg::P(count),
            Arg::I64(rows as i64),
            Arg::I64(v as i64),
            Arg::I64(*ignore_index),
        ],
    )
}

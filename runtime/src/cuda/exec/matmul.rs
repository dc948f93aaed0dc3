//! Lowering of `linear`, `matmul` and the MoE `grouped_matmul` (forward and backward) to
//! cuBLASLt GEMMs; grouped GEMMs become one step whose per-expert row counts are read from
//! the device when the step runs.

use super::*;

/// `linear`: `x @ w^T (+ bias)` as one GEMM (a bias broadcast or zeros when k is 0).
pub(super) fn linear(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let (x, w) = (&ins[0], &ins[1]);
    if x.dtype != w.dtype || o.dtype != x.dtype {
        return Err(lw.unsup(
            "linear on mixed dtypes",
            &format!("x {}, w {}", x.dtype, w.dtype),
        ));
    }
    let k = *x.shape.last().unwrap() as u64;
    let n = w.shape[0] as u64;
    let m = x.numel().checked_div(k).unwrap_or(0);
    let bias = ins.get(2);
    let shape = GemmShape {
        dtype: x.dtype,
        m,
        n,
        k,
        ta: false,
        tb: true,
        batch: 1,
        sa: 0,
        sb: 0,
        sc: 0,
        bias: bias.is_some(),
        accumulate: false,
        fp8: None,
    };
    if k == 0 {
        return match bias {
            Some(b) => {
                let bc = layout::bcast(&o.shape, &[&b.shape, &b.shape])
                    .map_err(|m| lw.unsup("broadcast", &m))?;
                lw.strided(
                    o.ptr,
                    b.ptr,
                    esz(o.dtype),
                    &o.shape,
                    &bc.sa[..o.rank()],
                    &layout::strides(&o.shape),
                )
            }
            None => lw.fill(o, 0.0),
        };
    }
    lw.gemm(shape, x.ptr, w.ptr, o.ptr, ptr_or_null(bias));
    Ok(())
}

/// `matmul` of `a` and `b` (either transposed) into `o`: one GEMM where `b` is shared by
/// every batch entry, else a strided batched GEMM. With `addend` (`matmul_add`) the GEMM
/// adds it (beta = 1): it has `o`'s type, so its layout is `o`'s.
pub(super) fn matmul(
    lw: &mut Lower,
    a: &DevT,
    b: &DevT,
    o: &DevT,
    ta: bool,
    tb: bool,
    addend: Option<&DevT>,
) -> CudaResult<()> {
    if addend.is_some_and(|c| c.dtype != o.dtype || c.shape != o.shape) {
        return Err(lw.unsup(
            "matmul_add with an addend of another type",
            "the addend must have the product's type",
        ));
    }
    let (accumulate, c_in) = match addend {
        Some(c) => (true, c.ptr),
        None => (false, o.ptr),
    };
    if a.dtype != b.dtype || a.dtype != o.dtype {
        return Err(lw.unsup(
            "matmul on mixed dtypes",
            "operands and result must share a dtype",
        ));
    }
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(lw.unsup("matmul of vectors", "operands need two dims"));
    }
    let (m, k) = if ta {
        (a.shape[ra - 1], a.shape[ra - 2])
    } else {
        (a.shape[ra - 2], a.shape[ra - 1])
    };
    let n = if tb { b.shape[rb - 2] } else { b.shape[rb - 1] };
    let ba: usize = a.shape[..ra - 2].iter().product();
    let bb: usize = b.shape[..rb - 2].iter().product();
    let bo: usize = o.shape[..o.rank() - 2].iter().product();
    // b shared by every batch entry of a (and a not transposed): one big GEMM.
    if bb == 1 && !ta {
        let shape = GemmShape {
            dtype: a.dtype,
            m: (ba * m) as u64,
            n: n as u64,
            k: k as u64,
            ta,
            tb,
            batch: 1,
            sa: 0,
            sb: 0,
            sc: 0,
            bias: false,
            accumulate,
            fp8: None,
        };
        lw.gemm_adding(shape, a.ptr, b.ptr, c_in, o.ptr, 0);
        return Ok(());
    }
    let ok = |x: usize| x == bo || x == 1;
    if !ok(ba) || !ok(bb) {
        return Err(lw.unsup(
            "matmul with partially broadcast batch dims",
            "expand the operand first",
        ));
    }
    let shape = GemmShape {
        dtype: a.dtype,
        m: m as u64,
        n: n as u64,
        k: k as u64,
        ta,
        tb,
        batch: bo as u64,
        sa: if ba == 1 { 0 } else { (m * k) as i64 },
        sb: if bb == 1 { 0 } else { (k * n) as i64 },
        sc: (m * n) as i64,
        bias: false,
        accumulate,
        fp8: None,
    };
    lw.gemm_adding(shape, a.ptr, b.ptr, c_in, o.ptr, 0);
    Ok(())
}

/// `grouped_matmul`: one GEMM per expert over its rows (counts on the device).
pub(super) fn grouped_matmul(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    transpose_w: &Flag,
) -> CudaResult<()> {
    let o = &outs[0];
    let (x, w, c) = (&ins[0], &ins[1], &ins[2]);
    let bias = ins.get(3);
    if w.dtype != x.dtype || bias.is_some_and(|b| b.dtype != x.dtype) {
        return Err(lw.unsup(
            "grouped_matmul on mixed dtypes",
            &format!(
                "x {}, w {}, bias {:?}",
                x.dtype,
                w.dtype,
                bias.map(|b| b.dtype)
            ),
        ));
    }
    // [E, n, k], or [E, k, n] transposed
    let (n, k) = if transpose_w.0 {
        (w.shape[2], w.shape[1])
    } else {
        (w.shape[1], w.shape[2])
    };
    lw.push(StepKind::Grouped(Box::new(Grouped {
        dtype: x.dtype,
        counts: c.ptr,
        ncounts: c.numel() as usize,
        experts: w.shape[0],
        x: x.ptr,
        w: w.ptr,
        out: o.ptr,
        rows: x.shape[0] as u64,
        n: n as u64,
        k: k as u64,
        grad: None,
        transpose_w: transpose_w.0,
        bias: bias.map_or(0, |b| b.ptr),
        dbias: 0,
        ones: 0,
    })));
    Ok(())
}

/// `grouped_matmul_grad`: dx, dw (and dbias as `ones^T dy`) per expert.
pub(super) fn grouped_matmul_grad(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    transpose_w: &Flag,
    bias: &Flag,
) -> CudaResult<()> {
    let (x, w, c, dy) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    if w.dtype != x.dtype || dy.dtype != x.dtype {
        return Err(lw.unsup(
            "grouped_matmul_grad on mixed dtypes",
            &format!("x {}, w {}, dy {}", x.dtype, w.dtype, dy.dtype),
        ));
    }
    let (n, k) = if transpose_w.0 {
        (w.shape[2], w.shape[1])
    } else {
        (w.shape[1], w.shape[2])
    };
    let rows = x.shape[0] as u64;
    let (dbias, ones) = if bias.0 {
        let db = &outs[2];
        if db.dtype != x.dtype {
            return Err(lw.unsup(
                "grouped_matmul_grad with a dbias in another dtype",
                &format!("x {}, dbias {}", x.dtype, db.dtype),
            ));
        }
        let ones = DevT {
            ptr: lw.ex.scratch(lw.stream, rows.max(1) * esz(x.dtype) as u64),
            dtype: x.dtype,
            shape: vec![rows.max(1) as usize],
        };
        lw.fill(&ones, 1.0)?;
        (db.ptr, ones.ptr)
    } else {
        (0, 0)
    };
    lw.push(StepKind::Grouped(Box::new(Grouped {
        dtype: x.dtype,
        counts: c.ptr,
        ncounts: c.numel() as usize,
        experts: w.shape[0],
        x: x.ptr,
        w: w.ptr,
        out: outs[0].ptr,
        rows,
        n: n as u64,
        k: k as u64,
        grad: Some((dy.ptr, outs[1].ptr)),
        transpose_w: transpose_w.0,
        bias: 0,
        dbias,
        ones,
    })));
    Ok(())
}

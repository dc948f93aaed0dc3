//! Lowering of elementwise ops: fills and ranges, unary and binary arithmetic (with
//! 16-byte bf16 vector kernels where every operand is aligned and unbroadcast), comparisons,
//! `where`, casts, and the elementwise backward ops (silu, gelu).

use super::*;
use kernels::{BinaryCode, CompareCode, UnaryCode};

/// `unary_<f>` (or `unary8_bf16`) computing `code` with scalar `p`.
pub(super) fn unary(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    code: UnaryCode,
    p: f32,
) -> CudaResult<()> {
    let o = &outs[0];
    let (name, n) = if vec8(o, &[o, &ins[0]]) {
        ("unary8_bf16", o.numel() / 8)
    } else {
        (kname("unary", o.dtype)?, o.numel())
    };
    let k = kernels::Unary {
        out: o.ptr,
        input: ins[0].ptr,
        n: n as i64,
        code,
        p,
    };
    lw.run(name, n, k)
}

/// `binary_<f>` (or the contiguous, vector and i64 variants) computing `code`.
pub(super) fn binary(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    code: BinaryCode,
) -> CudaResult<()> {
    let o = &outs[0];
    let same = |a: &DevT, b: &DevT| a.shape == b.shape;
    let (a, b) = (&ins[0], &ins[1]);
    if a.dtype != b.dtype {
        return Err(lw.unsup(
            "a binary op on mixed dtypes",
            &format!("{} and {}", a.dtype, b.dtype),
        ));
    }
    let broadcast = |lw: &mut Lower, name: &'static str| -> CudaResult<()> {
        let bc = layout::bcast(&o.shape, &[&a.shape, &b.shape])
            .map_err(|m| lw.unsup("broadcast", &m))?;
        let k = kernels::BinaryBcast {
            out: o.ptr,
            a: a.ptr,
            b: b.ptr,
            n: o.numel() as i64,
            code,
            bc,
        };
        lw.run(name, o.numel(), k)
    };
    if a.dtype.is_int() && o.dtype == DType::I64 && a.dtype == DType::I64 {
        return broadcast(lw, "binary_i64");
    }
    if same(a, o) && same(b, o) {
        let (name, n) = if vec8(o, &[o, a, b]) {
            ("binary8_bf16", o.numel() / 8)
        } else {
            (kname("binary_c", o.dtype)?, o.numel())
        };
        let k = kernels::BinarySame {
            out: o.ptr,
            a: a.ptr,
            b: b.ptr,
            n: n as i64,
            code,
        };
        return lw.run(name, n, k);
    }
    let name = kname("binary", o.dtype)?;
    broadcast(lw, name)
}

/// `arange`: `start + i` in the output dtype.
pub(super) fn arange(
    lw: &mut Lower,
    outs: &[DevT],
    start: &Dim,
    bindings: &Bindings,
) -> CudaResult<()> {
    let o = &outs[0];
    let s = start
        .eval(bindings)
        .map_err(|e| CudaError::Plan(e.to_string()))?;
    let k = kernels::Arange {
        out: o.ptr,
        code: o.dtype,
        n: o.numel() as i64,
        start: s,
    };
    lw.run("arange_any", o.numel(), k)
}

/// `compare`: a boolean tensor, broadcasting.
pub(super) fn compare(lw: &mut Lower, ins: &[DevT], outs: &[DevT], op: CmpOp) -> CudaResult<()> {
    let o = &outs[0];
    let (a, b) = (&ins[0], &ins[1]);
    let op = match op {
        CmpOp::Eq => CompareCode::Eq,
        CmpOp::Ne => CompareCode::Ne,
        CmpOp::Lt => CompareCode::Lt,
        CmpOp::Le => CompareCode::Le,
        CmpOp::Gt => CompareCode::Gt,
        CmpOp::Ge => CompareCode::Ge,
    };
    let bc =
        layout::bcast(&o.shape, &[&a.shape, &b.shape]).map_err(|m| lw.unsup("broadcast", &m))?;
    let k = kernels::Compare {
        out: o.ptr,
        a: a.ptr,
        b: b.ptr,
        code: a.dtype,
        n: o.numel() as i64,
        op,
        bc,
    };
    lw.run("compare_any", o.numel(), k)
}

/// `where`: `cond ? a : b`, all three broadcast.
pub(super) fn select(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let bc = layout::bcast(&o.shape, &[&ins[0].shape, &ins[1].shape, &ins[2].shape])
        .map_err(|m| lw.unsup("broadcast", &m))?;
    let k = kernels::Where {
        out: o.ptr,
        cond: ins[0].ptr,
        a: ins[1].ptr,
        b: ins[2].ptr,
        esz: esz(o.dtype) as i32,
        n: o.numel() as i64,
        bc,
    };
    lw.run("where_any", o.numel(), k)
}

/// `cast` (a copy where the dtype does not change).
pub(super) fn cast(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    if ins[0].dtype == o.dtype {
        lw.copy(o.ptr, ins[0].ptr, o.bytes());
        return Ok(());
    }
    let k = kernels::Cast {
        out: o.ptr,
        to: o.dtype,
        input: ins[0].ptr,
        from: ins[0].dtype,
        n: o.numel() as i64,
    };
    lw.run("cast_any", o.numel(), k)
}

/// `silu_grad`: dx from x and dy.
pub(super) fn silu_grad(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let (name, n) = if vec8(o, &[o, &ins[0], &ins[1]]) {
        ("silu_bwd8_bf16", o.numel() / 8)
    } else {
        (kname("silu_bwd", o.dtype)?, o.numel())
    };
    let k = kernels::SiluBwd {
        dx: o.ptr,
        x: ins[0].ptr,
        dy: ins[1].ptr,
        n: n as i64,
    };
    lw.run(name, n, k)
}

/// `gelu_grad`: dx from x and dy.
pub(super) fn gelu_grad(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    tanh_approx: bool,
) -> CudaResult<()> {
    let o = &outs[0];
    let name = kname("gelu_bwd", o.dtype)?;
    let k = kernels::GeluBwd {
        dx: o.ptr,
        x: ins[0].ptr,
        dy: ins[1].ptr,
        n: o.numel() as i64,
        tanh_approx: tanh_approx as i32,
    };
    lw.run(name, o.numel(), k)
}

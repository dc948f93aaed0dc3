//! Lowering of elementwise ops: fills and ranges, unary and binary arithmetic (with
//! 16-byte bf16 vector kernels where every operand is aligned and unbroadcast), comparisons,
//! `where`, casts, and the elementwise backward ops (silu, gelu).

use super::*;

/// `unary_<f>` (or `unary8_bf16`) with op code `code_` and scalar `p`.
pub(super) fn unary(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    code_: i32,
    p: f32,
) -> CudaResult<()> {
    let o = &outs[0];
    if vec8(o, &[o, &ins[0]]) {
        return lw.n(
            "unary8_bf16",
            o.numel() / 8,
            vec![
                Arg::P(o.ptr),
                Arg::P(ins[0].ptr),
                Arg::I64(o.numel() as i64 / 8),
                Arg::I32(code_),
                Arg::F32(p),
            ],
        );
    }
    let name = kname("unary", o.dtype)?;
    lw.n(
        name,
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(ins[0].ptr),
            Arg::I64(o.numel() as i64),
            Arg::I32(code_),
            Arg::F32(p),
        ],
    )
}

/// `binary_<f>` (or the contiguous, vector and i64 variants) with op code `code_`.
pub(super) fn binary(lw: &mut Lower, ins: &[DevT], outs: &[DevT], code_: i32) -> CudaResult<()> {
    let o = &outs[0];
    let same = |a: &DevT, b: &DevT| a.shape == b.shape;
    let (a, b) = (&ins[0], &ins[1]);
    if a.dtype != b.dtype {
        return Err(lw.unsup(
            "a binary op on mixed dtypes",
            &format!("{} and {}", a.dtype, b.dtype),
        ));
    }
    if a.dtype.is_int() && o.dtype == DType::I64 && a.dtype == DType::I64 {
        let bc = layout::bcast(&o.shape, &[&a.shape, &b.shape])
            .map_err(|m| lw.unsup("broadcast", &m))?;
        return lw.n(
            "binary_i64",
            o.numel(),
            vec![
                Arg::P(o.ptr),
                Arg::P(a.ptr),
                Arg::P(b.ptr),
                Arg::I64(o.numel() as i64),
                Arg::I32(code_),
                Arg::blob(&bc),
            ],
        );
    }
    if same(a, o) && same(b, o) && vec8(o, &[o, a, b]) {
        return lw.n(
            "binary8_bf16",
            o.numel() / 8,
            vec![
                Arg::P(o.ptr),
                Arg::P(a.ptr),
                Arg::P(b.ptr),
                Arg::I64(o.numel() as i64 / 8),
                Arg::I32(code_),
            ],
        );
    }
    if same(a, o) && same(b, o) {
        let name = kname("binary_c", o.dtype)?;
        return lw.n(
            name,
            o.numel(),
            vec![
                Arg::P(o.ptr),
                Arg::P(a.ptr),
                Arg::P(b.ptr),
                Arg::I64(o.numel() as i64),
                Arg::I32(code_),
            ],
        );
    }
    let bc =
        layout::bcast(&o.shape, &[&a.shape, &b.shape]).map_err(|m| lw.unsup("broadcast", &m))?;
    let name = kname("binary", o.dtype)?;
    lw.n(
        name,
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(a.ptr),
            Arg::P(b.ptr),
            Arg::I64(o.numel() as i64),
            Arg::I32(code_),
            Arg::blob(&bc),
        ],
    )
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
    lw.n(
        "arange_any",
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::I32(code(o.dtype)),
            Arg::I64(o.numel() as i64),
            Arg::I64(s),
        ],
    )
}

/// `compare`: a boolean tensor, broadcasting.
pub(super) fn compare(lw: &mut Lower, ins: &[DevT], outs: &[DevT], op: CmpOp) -> CudaResult<()> {
    let o = &outs[0];
    let (a, b) = (&ins[0], &ins[1]);
    let c = match op {
        CmpOp::Eq => 0,
        CmpOp::Ne => 1,
        CmpOp::Lt => 2,
        CmpOp::Le => 3,
        CmpOp::Gt => 4,
        CmpOp::Ge => 5,
    };
    let bc =
        layout::bcast(&o.shape, &[&a.shape, &b.shape]).map_err(|m| lw.unsup("broadcast", &m))?;
    lw.n(
        "compare_any",
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(a.ptr),
            Arg::P(b.ptr),
            Arg::I32(code(a.dtype)),
            Arg::I64(o.numel() as i64),
            Arg::I32(c),
            Arg::blob(&bc),
        ],
    )
}

/// `where`: `cond ? a : b`, all three broadcast.
pub(super) fn select(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    let bc = layout::bcast(&o.shape, &[&ins[0].shape, &ins[1].shape, &ins[2].shape])
        .map_err(|m| lw.unsup("broadcast", &m))?;
    lw.n(
        "where_any",
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(ins[0].ptr),
            Arg::P(ins[1].ptr),
            Arg::P(ins[2].ptr),
            Arg::I32(esz(o.dtype) as i32),
            Arg::I64(o.numel() as i64),
            Arg::blob(&bc),
        ],
    )
}

/// `cast` (a copy where the dtype does not change).
pub(super) fn cast(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    if ins[0].dtype == o.dtype {
        lw.copy(o.ptr, ins[0].ptr, o.bytes());
        return Ok(());
    }
    lw.n(
        "cast_any",
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::I32(code(o.dtype)),
            Arg::P(ins[0].ptr),
            Arg::I32(code(ins[0].dtype)),
            Arg::I64(o.numel() as i64),
        ],
    )
}

/// `silu_grad`: dx from x and dy.
pub(super) fn silu_grad(lw: &mut Lower, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let o = &outs[0];
    if vec8(o, &[o, &ins[0], &ins[1]]) {
        return lw.n(
            "silu_bwd8_bf16",
            o.numel() / 8,
            vec![
                Arg::P(o.ptr),
                Arg::P(ins[0].ptr),
                Arg::P(ins[1].ptr),
                Arg::I64(o.numel() as i64 / 8),
            ],
        );
    }
    let name = kname("silu_bwd", o.dtype)?;
    lw.n(
        name,
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(ins[0].ptr),
            Arg::P(ins[1].ptr),
            Arg::I64(o.numel() as i64),
        ],
    )
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
    lw.n(
        name,
        o.numel(),
        vec![
            Arg::P(o.ptr),
            Arg::P(ins[0].ptr),
            Arg::P(ins[1].ptr),
            Arg::I64(o.numel() as i64),
            Arg::I32(tanh_approx as i32),
        ],
    )
}

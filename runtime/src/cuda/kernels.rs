//! Typed descriptors of the CUDA kernels in `kernels.cu`, `attention.cu`, `backward.cu`,
//! `fused.cu`, `linear_ce.cu` and `fp8.cu`: one struct per kernel family whose fields are the kernel's parameters
//! in the kernel's order, with their types (a dtype code is a [`DType`], a by-value
//! layout struct is its `#[repr(C)]` twin), and how its grid follows from a count
//! ([`Shape`]). Lowering fills a struct by field name instead of building a positional
//! argument list, and a unit test (no GPU needed) parses the CUDA source and checks every
//! descriptor's parameter names and types against the kernel signatures it launches.
//! The op codes the kernels switch on ([`UnaryCode`], [`BinaryCode`], ...) are enums here,
//! checked against the `case`s of the source the same way.

use super::device::Arg;
use super::layout::{code, Bcast, Red, Strided};
use weft_ir::DType;

/// How a kernel's grid follows from the count its caller gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A grid-stride loop over `count` items, 256 threads a block (`Gpu::launch_n`).
    Items,
    /// One block of this many threads per row (`count` rows).
    Rows(u32),
    /// One warp per item, 8 items per 256-thread block.
    Warps,
    /// One block of this many threads (the count is ignored).
    Single(u32),
    /// Grid, block and shared memory chosen by the call site (`Lower::run_at`).
    Custom,
}

/// The type of one kernel parameter.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Param {
    /// A device pointer (`T*`, `const void*`, ...).
    Ptr,
    I64,
    I32,
    F32,
    U64,
    /// An `int` naming a dtype (`layout::code`).
    Code,
    /// The by-value `Strided` struct.
    Strided,
    /// The by-value `Bcast` struct.
    Bcast,
    /// The by-value `Red` struct.
    Red,
    /// An `int` holding a [`UnaryCode`].
    Unary,
    /// An `int` holding a [`BinaryCode`].
    Binary,
    /// An `int` holding a [`CompareCode`].
    Compare,
    /// An `int` holding a [`ReduceCode`].
    Reduce,
    /// An `int` holding a [`GluAct`].
    GluAct,
}

/// A kernel family: its parameters and launch shape.
pub(crate) trait Kernel {
    /// The kernels this descriptor launches, as the CUDA source names them (`##S`, `##S_`
    /// stand for the dtype suffix); the first one's parameter names are the fields'.
    const SOURCES: &'static [&'static str];
    /// (name, type) of each parameter, in order.
    #[cfg_attr(not(test), allow(dead_code))]
    const PARAMS: &'static [(&'static str, Param)];
    const SHAPE: Shape;
    /// The launch arguments, in the kernel's order.
    fn args(&self) -> Vec<Arg>;
    /// Whether `name` (a concrete kernel name) is one of `SOURCES`.
    fn launches(name: &str) -> bool {
        Self::SOURCES.iter().any(|s| source_matches(s, name))
    }
}

/// Whether the concrete kernel `name` is an instance of the source name `source`, whose
/// `##X` parts are macro parameters (a dtype suffix or a variant number).
pub(crate) fn source_matches(source: &str, name: &str) -> bool {
    match source.find("##") {
        None => source == name,
        Some(at) => name.starts_with(&source[..at]) && name.len() > at,
    }
}

macro_rules! param_type {
    (Ptr) => {
        u64
    };
    (I64) => {
        i64
    };
    (I32) => {
        i32
    };
    (F32) => {
        f32
    };
    (U64) => {
        u64
    };
    (Code) => {
        DType
    };
    (Strided) => {
        Strided
    };
    (Bcast) => {
        Bcast
    };
    (Red) => {
        Red
    };
    (Unary) => {
        UnaryCode
    };
    (Binary) => {
        BinaryCode
    };
    (Compare) => {
        CompareCode
    };
    (Reduce) => {
        ReduceCode
    };
    (GluAct) => {
        GluAct
    };
}

macro_rules! param_arg {
    (Ptr, $v:expr) => {
        Arg::P($v)
    };
    (I64, $v:expr) => {
        Arg::I64($v)
    };
    (I32, $v:expr) => {
        Arg::I32($v)
    };
    (F32, $v:expr) => {
        Arg::F32($v)
    };
    (U64, $v:expr) => {
        Arg::U64($v)
    };
    (Code, $v:expr) => {
        Arg::I32(code($v))
    };
    (Strided, $v:expr) => {
        Arg::blob(&$v)
    };
    (Bcast, $v:expr) => {
        Arg::blob(&$v)
    };
    (Red, $v:expr) => {
        Arg::blob(&$v)
    };
    (Unary, $v:expr) => {
        Arg::I32($v as i32)
    };
    (Binary, $v:expr) => {
        Arg::I32($v as i32)
    };
    (Compare, $v:expr) => {
        Arg::I32($v as i32)
    };
    (Reduce, $v:expr) => {
        Arg::I32($v as i32)
    };
    (GluAct, $v:expr) => {
        Arg::I32($v as i32)
    };
}

macro_rules! kernels {
    ($(
        $(#[$doc:meta])*
        $name:ident [$($src:literal),+ $(,)?] $shape:expr => { $($field:ident: $kind:ident),* $(,)? }
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Debug)]
            pub(crate) struct $name {
                $(pub $field: param_type!($kind),)*
            }
            impl Kernel for $name {
                const SOURCES: &'static [&'static str] = &[$($src),+];
                const PARAMS: &'static [(&'static str, Param)] =
                    &[$((stringify!($field), Param::$kind)),*];
                const SHAPE: Shape = $shape;
                fn args(&self) -> Vec<Arg> {
                    vec![$(param_arg!($kind, self.$field)),*]
                }
            }
        )*
        /// Every descriptor: (sources, parameters), for the signature check.
        #[cfg(test)]
        pub(crate) const ALL: &[(&[&str], &[(&str, Param)])] =
            &[$((<$name as Kernel>::SOURCES, <$name as Kernel>::PARAMS)),*];
    };
}

/// The op codes of `unary_op` in kernels.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum UnaryCode {
    Neg = 0,
    Exp = 1,
    Log = 2,
    Sqrt = 3,
    Rsqrt = 4,
    Tanh = 5,
    Sigmoid = 6,
    Silu = 7,
    Gelu = 8,
    GeluTanh = 9,
    Relu = 10,
    /// `x * p`.
    Scale = 11,
    /// `x + p`.
    AddScalar = 12,
    /// `x ^ p`.
    PowScalar = 13,
}

/// The op codes of `binary_op` (and `binary_op_i`, which has no `Pow`) in kernels.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum BinaryCode {
    Add = 0,
    Sub = 1,
    Mul = 2,
    Div = 3,
    Pow = 4,
    Maximum = 5,
    Minimum = 6,
}

/// The comparison codes of `compare_any`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum CompareCode {
    Eq = 0,
    Ne = 1,
    Lt = 2,
    Le = 3,
    Gt = 4,
    Ge = 5,
}

/// The reduction codes of `reduce_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum ReduceCode {
    Sum = 0,
    Mean = 1,
    Max = 2,
}

kernels! {
    // ------------------------------------------------------------ fills and casts
    /// Fills `n` elements of 1, 2, 4 or 8 bytes with a bit pattern.
    Fill ["fill_b1", "fill_b2", "fill_b4", "fill_b8"] Shape::Items => {
        out: Ptr, n: I64, pat: U64,
    }
    /// Fills `n` i32 with `v`.
    FillI32 ["fill_i32"] Shape::Items => { out: Ptr, n: I64, v: I32 }
    /// `start + i` in dtype `code`.
    Arange ["arange_any"] Shape::Items => { out: Ptr, code: Code, n: I64, start: I64 }
    /// Converts `n` elements between any two dtypes.
    Cast ["cast_any"] Shape::Items => { out: Ptr, to: Code, input: Ptr, from: Code, n: I64 }
    /// Converts `n` f32 to dtype `ocode`.
    F32To ["f32_to_any"] Shape::Items => { out: Ptr, ocode: Code, input: Ptr, n: I64 }
    /// Copies `n` elements of 1..16 bytes along a strided layout.
    CopyStrided [
        "copy_strided_b1", "copy_strided_b2", "copy_strided_b4", "copy_strided_b8",
        "copy_strided_b16",
    ] Shape::Items => { d: Ptr, s: Ptr, n: I64, st: Strided }
    /// normal(mean, stdv) from a counter-based generator seeded per tensor.
    InitNormal ["init_normal_any"] Shape::Items => {
        out: Ptr, code: Code, n: I64, seed: U64, stdv: F32, mean: F32,
    }

    // ------------------------------------------------------------ elementwise
    /// `out = op(in, p)`; the `8` variant counts 16-byte vectors of bf16.
    Unary ["unary_##S", "unary8_bf16"] Shape::Items => {
        out: Ptr, input: Ptr, n: I64, code: Unary, p: F32,
    }
    /// `out = op(a, b)` on same-shape operands; the `8` variant counts bf16 vectors.
    BinarySame ["binary_c_##S", "binary8_bf16"] Shape::Items => {
        out: Ptr, a: Ptr, b: Ptr, n: I64, code: Binary,
    }
    /// `out = op(a, b)`, broadcasting.
    BinaryBcast ["binary_##S", "binary_i64"] Shape::Items => {
        out: Ptr, a: Ptr, b: Ptr, n: I64, code: Binary, bc: Bcast,
    }
    /// `out = a op b` as bool, broadcasting; `a`, `b` of dtype `code`.
    Compare ["compare_any"] Shape::Items => {
        out: Ptr, a: Ptr, b: Ptr, code: Code, n: I64, op: Compare, bc: Bcast,
    }
    /// `out = cond ? a : b`, broadcasting (`sa` of `bc` is cond's), elements of `esz` bytes.
    Where ["where_any"] Shape::Items => {
        out: Ptr, cond: Ptr, a: Ptr, b: Ptr, esz: I32, n: I64, bc: Bcast,
    }
    /// silu backward; the `8` variant counts bf16 vectors.
    SiluBwd ["silu_bwd_##S_", "silu_bwd8_bf16"] Shape::Items => { dx: Ptr, x: Ptr, dy: Ptr, n: I64 }
    /// gelu backward.
    GeluBwd ["gelu_bwd_##S_"] Shape::Items => { dx: Ptr, x: Ptr, dy: Ptr, n: I64, tanh_approx: I32 }

    // ------------------------------------------------------------ fp8 (fp8.cu)
    /// amax (as float bits) of `n` elements into `amax`, zeroed first.
    Fp8Amax ["fp8_amax_##S"] Shape::Items => { amax: Ptr, x: Ptr, n: I64 }
    /// `x` [rows, cols] to fp8 bytes (`[cols, rows]` when `transpose`) with the scale of
    /// `amax`, and its dequantizing factor into `inv_scale`; one 32x32 tile per block.
    Fp8Quantize ["fp8_quantize_##S"] Shape::Custom => {
        out: Ptr, inv_scale: Ptr, x: Ptr, amax: Ptr, rows: I64, cols: I64, transpose: I32, fmt: I32,
    }
    /// bf16 amax over `n8` 16-byte words.
    Fp8Amax8 ["fp8_amax8_bf16"] Shape::Items => { amax: Ptr, x: Ptr, n8: I64 }
    /// bf16 to fp8 bytes in the same layout, 8 a thread (`n8` words).
    Fp8Quantize8 ["fp8_quantize8_bf16"] Shape::Items => {
        out: Ptr, inv_scale: Ptr, x: Ptr, amax: Ptr, n8: I64, fmt: I32,
    }
    /// bf16 `[rows, cols]` (multiples of 64) to fp8 bytes `[cols, rows]`, a 64x64 tile per
    /// block of 256 threads.
    Fp8QuantizeT64 ["fp8_quantize_t64_bf16"] Shape::Custom => {
        out: Ptr, inv_scale: Ptr, x: Ptr, amax: Ptr, rows: I64, cols: I64, fmt: I32,
    }
    /// `x` quantized with the scale of `amax` and dequantized, in its dtype.
    Fp8Qdq ["fp8_qdq_##S"] Shape::Items => { out: Ptr, x: Ptr, amax: Ptr, n: I64, fmt: I32 }

    // ------------------------------------------------------------ reductions
    /// Sum, mean or max over the reduced dims of `rd`, one warp per output.
    Reduce ["reduce_##S", "reduce_i64"] Shape::Warps => {
        out: Ptr, input: Ptr, nout: I64, nred: I64, code: Reduce, rd: Red,
    }
    /// The same with one block per output (few outputs, long reductions).
    ReduceBlock ["reduce_block_##S"] Shape::Rows(1024) => {
        out: Ptr, input: Ptr, nout: I64, nred: I64, code: Reduce, rd: Red,
    }
    /// softmax / log-softmax of rows of `n`.
    Softmax ["softmax_##S"] Shape::Rows(256) => { out: Ptr, input: Ptr, rows: I64, n: I64, logsm: I32 }
    /// softmax backward of rows of `n`.
    SoftmaxBwd ["softmax_bwd_##S_"] Shape::Rows(256) => { dx: Ptr, y: Ptr, dy: Ptr, rows: I64, n: I64 }
    /// Column sums of f32 partials to dtype `ocode`; the call site picks the grid.
    ColsumF32To ["colsum_f32_to"] Shape::Custom => {
        out: Ptr, ocode: Code, part: Ptr, nrows: I64, h: I64,
    }

    // ------------------------------------------------------------ norms
    /// rms_norm of rows of `h` (the weight of dtype `wcode`); `rstd` may be null.
    RmsNorm ["rms_norm_##S"] Shape::Rows(256) => {
        out: Ptr, x: Ptr, w: Ptr, wcode: Code, rows: I64, h: I64, eps: F32, rstd: Ptr,
    }
    /// The 16-byte-vector bf16 rms_norm (`h` a multiple of 8).
    RmsFwd8 ["rms_fwd8_bf16_r##RV"] Shape::Rows(256) => {
        out: Ptr, x: Ptr, w: Ptr, wcode: Code, rows: I64, h: I32, eps: F32, rstd: Ptr,
    }
    /// The 16-byte-vector bf16 rms_norm backward, `rpb` rows per block, dw as per-block
    /// partials.
    RmsBwd8 ["rms_bwd8_bf16_r##RV"] Shape::Rows(256) => {
        dx: Ptr, dw_acc: Ptr, x: Ptr, w: Ptr, wcode: Code, dy: Ptr, rows: I64, h: I32,
        eps: F32, rpb: I32,
    }
    /// rms_norm backward: dx and each row's rstd.
    RmsNormBwd ["rms_norm_bwd_##S_"] Shape::Rows(256) => {
        dx: Ptr, rstd: Ptr, x: Ptr, w: Ptr, wcode: Code, dy: Ptr, rows: I64, h: I64, eps: F32,
    }
    /// rms_norm's dw, accumulated by column over chunks of rows; the call site picks the
    /// grid.
    RmsDwPartial ["rms_dw_partial_##S_"] Shape::Custom => {
        acc: Ptr, x: Ptr, dy: Ptr, rstd: Ptr, rows: I64, h: I64, chunk: I64,
    }

    // ------------------------------------------------------------ rope
    /// cos/sin tables (dtype `ocode`) for `npos` positions of dtype `pcode`.
    RopeTable ["rope_table"] Shape::Items => {
        cosv: Ptr, sinv: Ptr, ocode: Code, pos: Ptr, pcode: Code, npos: I64, half: I32,
        inv: Ptr, scale: F32,
    }
    /// rope over x [B, N, S, D] (`bshd` = 1: [B, S, N, D]), one thread per element.
    Rope ["rope_##S_"] Shape::Items => {
        out: Ptr, x: Ptr, cosv: Ptr, sinv: Ptr, ccode: Code, b: I64, n: I64, s: I64, d: I64,
        r: I64, cbs: I64, bshd: I32,
    }
    /// rope with a (S-tiles, head groups, B) grid of (D/2, rows) blocks, `hp` heads per
    /// block; the call site picks the grid.
    Rope2 ["rope2_##S_"] Shape::Custom => {
        out: Ptr, x: Ptr, cosv: Ptr, sinv: Ptr, ccode: Code, n: I32, s: I32, d: I32, r: I32,
        cbs: I64, bshd: I32, hp: I32,
    }

    // ------------------------------------------------------------ embedding and indexing
    /// Embedding rows for `ntok` ids (out of range: the error flag).
    Embedding ["embedding_##S"] Shape::Rows(128) => {
        out: Ptr, ids: Ptr, w: Ptr, ntok: I64, h: I64, vocab: I64, err: Ptr,
    }
    /// Embedding backward: each id's summed dy rows written into dw (added to dw's row when
    /// `accumulate`), except tokens whose id is `pad` (-1: none).
    EmbeddingBwd ["embedding_bwd_##S_"] Shape::Rows(256) => {
        dw: Ptr, ids: Ptr, dy: Ptr, ntok: I64, h: I64, vocab: I64, pad: I64, accumulate: I32,
        err: Ptr,
    }
    /// `gather` along `d` of elements of `esz` bytes.
    Gather ["gather_any"] Shape::Items => {
        out: Ptr, x: Ptr, idx: Ptr, esz: I32, n: I64, st: Strided, d: I32, xd: I64, err: Ptr,
    }
    /// `index_select` with indices of dtype `icode`.
    IndexSelect ["index_select_any"] Shape::Items => {
        out: Ptr, x: Ptr, idx: Ptr, icode: Code, esz: I32, outer: I64, nx: I64, m: I64,
        inner: I64, err: Ptr,
    }
    /// `scatter_add` of `n` source elements into `out`.
    ScatterAdd ["scatter_add_##S"] Shape::Items => {
        out: Ptr, idx: Ptr, src: Ptr, n: I64, st: Strided, d: I32, od: I64, err: Ptr,
    }
    /// Top `k` of rows of `n`, one thread per row.
    Topk ["topk_any"] Shape::Items => {
        vals: Ptr, vcode: Code, idx: Ptr, x: Ptr, xcode: Code, rows: I64, n: I64, k: I32,
    }
    /// One-hot rows of dtype `ocode`.
    OneHot ["one_hot"] Shape::Items => {
        out: Ptr, ocode: Code, idx: Ptr, n: I64, classes: I64, err: Ptr,
    }

    // ------------------------------------------------------------ loss
    /// Labels shifted one left per row.
    ShiftLabels ["shift_labels"] Shape::Items => { out: Ptr, l: Ptr, rows: I64, n: I64, ignore: I64 }
    /// How many labels are not `ignore`, in dtype `ocode`.
    CountValid ["count_valid"] Shape::Single(1024) => {
        out: Ptr, ocode: Code, l: Ptr, n: I64, ignore: I64,
    }
    /// Per-row cross-entropy and log-sum-exp.
    CeRows ["ce_rows_##S"] Shape::Rows(512) => {
        loss: Ptr, lse: Ptr, logits: Ptr, labels: Ptr, rows: I64, v: I64, ignore: I64, err: Ptr,
    }
    /// `scale` times the sum of `n` f32 (divided by the valid labels' count when
    /// `labels` is not null).
    SumF32 ["sum_f32"] Shape::Single(1024) => {
        out: Ptr, ocode: Code, input: Ptr, n: I64, scale: F32, labels: Ptr, nl: I64, ignore: I64,
    }
    /// Cross-entropy backward recomputing the log-sum-exp.
    CeBwd ["ce_bwd_##S_"] Shape::Rows(512) => {
        dx: Ptr, logits: Ptr, labels: Ptr, dloss: Ptr, dcode: Code, mode: I32, count: Ptr,
        rows: I64, v: I64, ignore: I64,
    }
    /// Cross-entropy backward from the forward's saved log-sum-exp, bf16 vectors.
    CeBwdLse8 ["ce_bwd_lse8_bf16"] Shape::Rows(512) => {
        dx: Ptr, logits: Ptr, labels: Ptr, lse: Ptr, dloss: Ptr, dcode: Code, mode: I32,
        count: Ptr, rows: I64, v8: I64, ignore: I64,
    }

    // ------------------------------------------------------------ MoE
    /// Expert counts and the token order grouped by expert; the call site picks the block.
    MoeRoute ["moe_route"] Shape::Custom => {
        counts: Ptr, order: Ptr, eidx: Ptr, tk: I64, e: I32, err: Ptr,
    }
    /// Rows gathered in expert order.
    MoeGather ["moe_gather_##S"] Shape::Items => {
        rows: Ptr, x: Ptr, order: Ptr, r: I64, k: I32, h: I64,
    }
    /// The inverse of the expert order.
    MoeInverse ["moe_inverse"] Shape::Items => { inv: Ptr, order: Ptr, r: I64, tk: I64, err: Ptr }
    /// Expert rows weighted back to tokens (weights of dtype `wcode`).
    MoeCombine ["moe_combine_##S"] Shape::Items => {
        out: Ptr, rows: Ptr, inv: Ptr, w: Ptr, wcode: Code, ntok: I64, k: I32, h: I64,
    }
    /// `moe_combine` backward, one warp per row.
    MoeCombineBwd ["moe_combine_bwd_##S_"] Shape::Warps => {
        drows: Ptr, dweights: Ptr, rows: Ptr, order: Ptr, w: Ptr, dy: Ptr, r: I64, k: I32,
        h: I64,
    }

    // ------------------------------------------------------------ attention
    /// The generic attention forward (every attribute of the op); the call site picks the
    /// grid. `lstride` is the statistics' row count, `lse_out` the op's own lse result.
    AttnFwdGeneric ["attn_fwd_generic_##S_"] Shape::Custom => {
        out: Ptr, lse: Ptr, q: Ptr, k: Ptr, v: Ptr, mask: Ptr, mb: I32, mh: I32, nq: I32,
        nkv: I32, sq: I64, sk: I64, d: I32, scale: F32, causal: I32, lstride: I64, window: I64,
        dv: I32, softcap: F32, sinks: Ptr, sinks_f32: I32, lse_out: Ptr, bshd: I32,
    }
    /// The generic attention backward: dq, and dk, dv (and d sinks) as f32 accumulators.
    AttnBwdGeneric ["attn_bwd_generic_##S_"] Shape::Custom => {
        dq: Ptr, dk_acc: Ptr, dv_acc: Ptr, q: Ptr, k: Ptr, v: Ptr, dout: Ptr, lse: Ptr,
        delta: Ptr, mask: Ptr, mb: I32, mh: I32, nq: I32, nkv: I32, sq: I64, sk: I64, d: I32,
        scale: F32, causal: I32, lstride: I64, window: I64, dv: I32, softcap: F32, sinks: Ptr,
        sinks_f32: I32, dsinks_acc: Ptr, dlse: Ptr, bshd: I32,
    }
    /// `rowsum(o * dout)` per query row, one warp per row (`bshd` = 1: o, dout [B, S, N, D]).
    AttnDelta ["attn_delta_##S_"] Shape::Warps => {
        delta: Ptr, o: Ptr, dout: Ptr, rows: I64, d: I32, n: I32, s: I64, bshd: I32,
    }
    /// `scale` times `n` f32 converted to the kernel's dtype.
    F32ToScaled ["f32_to_##S_"] Shape::Items => { out: Ptr, input: Ptr, n: I64, scale: F32 }
    /// The tensor-core flash attention forward (bf16, head dim 64 or 128); the call site
    /// picks the grid, block and shared memory of the variant.
    FaFwd ["fa_fwd_d64", "fa_fwd_d128", "fa_fwd_d64_w8", "fa_fwd_d128_w8", "fa_fwd_d64_m2"]
    Shape::Custom => {
        out: Ptr, lse: Ptr, q: Ptr, k: Ptr, v: Ptr, nq: I32, nkv: I32, sq: I64, sk: I64,
        scale_log2: F32, causal: I32, window: I64,
    }
    /// The tensor-core flash attention backward (dq as an f32 accumulator).
    FaBwd ["fa_bwd_d64", "fa_bwd_d128", "fa_bwd_d64_w8", "fa_bwd_d128_w8", "fa_bwd_d64_h"]
    Shape::Custom => {
        dq_acc: Ptr, dk: Ptr, dv: Ptr, q: Ptr, k: Ptr, v: Ptr, dout: Ptr, lse: Ptr, delta: Ptr,
        nq: I32, nkv: I32, sq: I64, sk: I64, scale: F32, causal: I32, window: I64,
    }

    // ------------------------------------------------------------ optimizers
    /// AdamW with param and moments in their own dtypes (`n` elements, or bf16 vectors
    /// for the `8` variant).
    AdamW ["adamw_##SP##_##SM", "adamw8_bf16_bf16"] Shape::Items => {
        po: Ptr, mo: Ptr, vo: Ptr, p: Ptr, g: Ptr, m: Ptr, v: Ptr, step: Ptr, scode: Code,
        n: I64, lr: F32, b1: F32, b2: F32, eps: F32, wd: F32, warmup: F32,
    }
    /// AdamW on an f32 master copy `w` with a low-precision grad, writing the
    /// low-precision param `pout` too.
    AdamWMaster ["adamw_master8_bf16", "adamw_master_##S_"] Shape::Items => {
        pout: Ptr, wo: Ptr, mo: Ptr, vo: Ptr, w: Ptr, g: Ptr, m: Ptr, v: Ptr, step: Ptr,
        scode: Code, n: I64, lr: F32, b1: F32, b2: F32, eps: F32, wd: F32, warmup: F32,
    }
    /// SGD with an optional momentum buffer (`buf`, `bo` null for none).
    Sgd ["sgd_##S_"] Shape::Items => {
        po: Ptr, bo: Ptr, p: Ptr, g: Ptr, buf: Ptr, n: I64, lr: F32, mu: F32, wd: F32,
    }

    // ------------------------------------------------------------ fused.cu
    /// `out = act(gate) * up` (`n`: elements, or 16-byte vectors in `glu8_bf16`).
    Glu ["glu_##S", "glu8_bf16"] Shape::Items => {
        out: Ptr, gate: Ptr, up: Ptr, n: I64, act: GluAct,
    }
    /// glu's gradients dgate and dup.
    GluBwd ["glu_bwd_##S", "glu_bwd8_bf16"] Shape::Items => {
        dgate: Ptr, dup: Ptr, gate: Ptr, up: Ptr, dy: Ptr, n: I64, act: GluAct,
    }
    /// `sum = x + y`, `normed = rms_norm(sum) * w`, one block per row.
    AddRmsNorm ["add_rms_norm_##S"] Shape::Rows(256) => {
        sum: Ptr, normed: Ptr, x: Ptr, y: Ptr, w: Ptr, wcode: Code, rows: I64, h: I64, eps: F32,
    }
    /// add_rms_norm on 16-byte bf16 vectors, rows of at most 8192.
    AddRmsFwd8 ["add_rms_fwd8_bf16_r##RV"] Shape::Rows(256) => {
        sum: Ptr, normed: Ptr, x: Ptr, y: Ptr, w: Ptr, wcode: Code, rows: I64, h: I32, eps: F32,
    }
    /// add_rms_norm_grad on 16-byte bf16 vectors: dsum, and per-block dw partials
    /// (`rpb` rows a block) that `colsum_f32_to` sums.
    AddRmsBwd8 ["add_rms_bwd8_bf16_r##RV"] Shape::Rows(256) => {
        dsum: Ptr, dw_acc: Ptr, x: Ptr, w: Ptr, wcode: Code, dy: Ptr, dres: Ptr, rows: I64,
        h: I32, eps: F32, rpb: I32,
    }

    // ------------------------------------------------------------ linear_ce.cu
    /// Running max -inf, sum 0 and target logit 0 for `rows` tokens.
    LceInit ["lce_init"] Shape::Items => { m: Ptr, s: Ptr, target: Ptr, rows: I64 }
    /// Folds one [rows, len] logits chunk starting at class `c0` into the running max,
    /// sum of exp and target logit (`err`: a label outside [0, V)).
    LceStats ["lce_stats_##S"] Shape::Rows(256) => {
        m: Ptr, s: Ptr, target: Ptr, z: Ptr, labels: Ptr, len: I64, c0: I64, v: I64,
        ignore: I64, scale: F32, cap: F32, err: Ptr,
    }
    /// `lse = m + log(s)`.
    LceFinish ["lce_finish"] Shape::Items => { lse: Ptr, m: Ptr, s: Ptr, rows: I64 }
    /// The logits chunk's gradient, in place over the chunk `z`.
    LceDz ["lce_dz_##S"] Shape::Items => {
        z: Ptr, labels: Ptr, lse: Ptr, dlse: Ptr, dtarget: Ptr, rows: I64, len: I64, c0: I64,
        ignore: I64, scale: F32, cap: F32,
    }
    /// `linear_cross_entropy_with_grad`'s chunk of whole-vocabulary rows: each row's lse
    /// and target logit, then its gradient in place.
    LceRowGrad ["lce_row_grad_##S"] Shape::Rows(256) => {
        z: Ptr, labels: Ptr, lse: Ptr, target: Ptr, dlse: Ptr, dtarget: Ptr, v: I64,
        ignore: I64, scale: F32, cap: F32, err: Ptr,
    }
}

/// The activation codes of `glu_act` in fused.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum GluAct {
    Silu = 0,
    Gelu = 1,
    GeluTanh = 2,
}

impl From<weft_ir::GateAct> for GluAct {
    fn from(a: weft_ir::GateAct) -> GluAct {
        match a {
            weft_ir::GateAct::Silu => GluAct::Silu,
            weft_ir::GateAct::Gelu => GluAct::Gelu,
            weft_ir::GateAct::GeluTanh => GluAct::GeluTanh,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::KERNEL_SOURCE;
    use std::collections::BTreeMap;

    /// Every `__global__` kernel of the source: name as written -> (name, type) params.
    fn signatures(src: &str) -> BTreeMap<String, Vec<(String, Param)>> {
        let mut out = BTreeMap::new();
        let mut rest = src;
        while let Some(at) = rest.find("__global__ void") {
            rest = &rest[at + "__global__ void".len()..];
            let mut head = rest.trim_start();
            if let Some(r) = head.strip_prefix("__launch_bounds__(") {
                head = r[r.find(')').unwrap() + 1..].trim_start();
            }
            let open = head.find('(').unwrap();
            let mut name = head[..open].trim().to_string();
            let close = open + head[open..].find(')').unwrap();
            let params = head[open + 1..close]
                .replace('\\', " ")
                .split(',')
                .map(|p| param(p.split_whitespace().collect::<Vec<_>>().join(" ").as_str()))
                .collect::<Vec<_>>();
            if name == "NAME" {
                // `#define DEF_X(NAME, ...)`: each `DEF_X(name, ...)` line is a kernel.
                let consumed = src.len() - rest.len();
                let def = src[..consumed].rfind("#define ").unwrap() + "#define ".len();
                let mac = &src[def..def + src[def..].find('(').unwrap()];
                for line in src.lines() {
                    if let Some(args) = line.strip_prefix(&format!("{mac}(")) {
                        name = args[..args.find(',').unwrap()].trim().to_string();
                        out.insert(name.clone(), params.clone());
                    }
                }
                continue;
            }
            out.insert(name, params);
        }
        out
    }

    /// One C parameter: its name (lower case; `in` read as `input`) and type.
    fn param(decl: &str) -> (String, Param) {
        let (ty, name) = decl.rsplit_once(' ').unwrap();
        let (ty, name) = match name.strip_prefix('*') {
            Some(n) => (format!("{ty}*"), n),
            None => (ty.to_string(), name),
        };
        let kind = if ty.ends_with('*') {
            Param::Ptr
        } else {
            match ty.as_str() {
                "i64" => Param::I64,
                "int" => Param::I32,
                "float" => Param::F32,
                "u64" => Param::U64,
                "Strided" => Param::Strided,
                "Bcast" => Param::Bcast,
                "Red" => Param::Red,
                other => panic!("unknown parameter type `{other}` in `{decl}`"),
            }
        };
        let name = match name {
            "in" => "input".to_string(),
            n => n.to_lowercase(),
        };
        (name, kind)
    }

    /// The C type an `int`-coded parameter has.
    fn c_kind(p: Param) -> Param {
        match p {
            Param::Code
            | Param::Unary
            | Param::Binary
            | Param::Compare
            | Param::Reduce
            | Param::GluAct => Param::I32,
            p => p,
        }
    }

    #[test]
    fn descriptors_match_the_kernel_signatures() {
        let sigs = signatures(KERNEL_SOURCE);
        assert!(sigs.len() > 50, "parsed only {} kernels", sigs.len());
        for (sources, params) in ALL {
            for (i, s) in sources.iter().enumerate() {
                let sig = sigs
                    .get(*s)
                    .unwrap_or_else(|| panic!("no kernel `{s}` in the CUDA source"));
                let ours: Vec<Param> = params.iter().map(|p| c_kind(p.1)).collect();
                let theirs: Vec<Param> = sig.iter().map(|p| p.1).collect();
                assert_eq!(ours, theirs, "parameter types of `{s}`");
                if i == 0 {
                    // `n8`, `v8`: counts of 16-byte vectors in the vector variants.
                    let plain = |n: &str| n.trim_end_matches('8').to_string();
                    let ours: Vec<String> = params.iter().map(|p| plain(p.0)).collect();
                    let theirs: Vec<String> = sig.iter().map(|p| plain(&p.0)).collect();
                    assert_eq!(ours, theirs, "parameter names of `{s}`");
                }
            }
        }
    }

    /// The `case N: return EXPR;` lines of the device function `func` in the source.
    fn cases(func: &str) -> BTreeMap<i32, String> {
        let src = KERNEL_SOURCE;
        let at = src.find(&format!("{func}(")).unwrap();
        let body = &src[at..];
        let body = &body[..body.find("\n}").unwrap()];
        body.lines()
            .filter_map(|l| {
                let l = l.trim().strip_prefix("case ")?;
                let (n, rest) = l.split_once(':')?;
                Some((n.trim().parse().ok()?, rest.trim().to_string()))
            })
            .collect()
    }

    #[test]
    fn op_codes_match_the_kernel_switches() {
        let unary = cases("unary_op");
        let want = [
            (UnaryCode::Neg, "return -x;"),
            (UnaryCode::Exp, "return __expf(x);"),
            (UnaryCode::Log, "return __logf(x);"),
            (UnaryCode::Sqrt, "return sqrtf(x);"),
            (UnaryCode::Rsqrt, "return rsqrtf(x);"),
            (UnaryCode::Tanh, "return tanhf(x);"),
            (UnaryCode::Sigmoid, "return 1.f / (1.f + __expf(-x));"),
            (UnaryCode::Silu, "return x / (1.f + __expf(-x));"),
            (UnaryCode::Relu, "return x > 0.f ? x : 0.f;"),
            (UnaryCode::Scale, "return x * p;"),
            (UnaryCode::AddScalar, "return x + p;"),
        ];
        for (c, expr) in want {
            assert_eq!(unary[&(c as i32)], expr, "{c:?}");
        }
        assert!(unary[&(UnaryCode::Gelu as i32)].contains("erff"));
        assert!(unary[&(UnaryCode::GeluTanh as i32)].contains("tanhf"));
        assert!(unary[&(UnaryCode::PowScalar as i32)].contains("powf(x, p)"));
        assert_eq!(unary.len(), 14);

        let binary = cases("binary_op");
        let want = [
            (BinaryCode::Add, "return a + b;"),
            (BinaryCode::Sub, "return a - b;"),
            (BinaryCode::Mul, "return a * b;"),
            (BinaryCode::Div, "return a / b;"),
            (BinaryCode::Pow, "return __expf(__logf(a) * b);"),
            (BinaryCode::Maximum, "return fmaxf(a, b);"),
        ];
        for (c, expr) in want {
            assert_eq!(binary[&(c as i32)], expr, "{c:?}");
        }
        // Minimum is binary_op's default.
        assert!(!binary.contains_key(&(BinaryCode::Minimum as i32)));
        assert!(KERNEL_SOURCE.contains("default: return fminf(a, b);"));
        let int = cases("binary_op_i");
        assert_eq!(int[&(BinaryCode::Minimum as i32)], "return a < b ? a : b;");
        assert_eq!(int[&(BinaryCode::Maximum as i32)], "return a > b ? a : b;");

        // compare_any: op 0..5 is ==, !=, <, <=, >, >= in one chained conditional.
        assert!(KERNEL_SOURCE.contains(
            "r = op == 0 ? x == y : op == 1 ? x != y : op == 2 ? x < y : op == 3 ? x <= y : op == 4 ? x > y : x >= y;"
        ));
        assert_eq!(
            [
                CompareCode::Eq,
                CompareCode::Ne,
                CompareCode::Lt,
                CompareCode::Le,
                CompareCode::Gt
            ]
            .map(|c| c as i32),
            [0, 1, 2, 3, 4]
        );
        // reduce: 2 is max, 1 divides by the count, else a sum.
        assert!(KERNEL_SOURCE.contains("acc = code == 2 ? fmaxf(acc, v) : acc + v;"));
        assert!(KERNEL_SOURCE.contains("if (code == 1) acc /= (float)nred;"));
        assert_eq!(
            [ReduceCode::Sum, ReduceCode::Mean, ReduceCode::Max].map(|c| c as i32),
            [0, 1, 2]
        );
    }

    #[test]
    fn glu_act_codes_are_the_unary_codes_they_select() {
        let line = format!(
            "return unary_op(x, act == {} ? {} : (act == {} ? {} : {}), 0.f);",
            GluAct::Silu as i32,
            UnaryCode::Silu as i32,
            GluAct::Gelu as i32,
            UnaryCode::Gelu as i32,
            UnaryCode::GeluTanh as i32
        );
        assert!(KERNEL_SOURCE.contains(&line), "{line}");
        assert_eq!(GluAct::GeluTanh as i32, 2);
    }

    #[test]
    fn source_names_match_their_instances() {
        assert!(Unary::launches("unary_bf16"));
        assert!(Unary::launches("unary8_bf16"));
        assert!(!Unary::launches("binary_bf16"));
        assert!(RmsFwd8::launches("rms_fwd8_bf16_r2"));
        assert!(!source_matches("unary_##S", "unary_"));
    }
}

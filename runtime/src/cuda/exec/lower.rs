//! The lowering state and the dispatch of one op to its family's lowering: `Lower`
//! collects the steps (launches, GEMMs, copies, collectives) of every instruction with
//! its pointers resolved; `Extra` sizes and places the memory lowering asks for beyond
//! the plan (kernel scratch, saved statistics, constants). Each op family lowers in its
//! own module beside this one.

use super::*;

pub(super) fn kname(base: &str, d: DType) -> CudaResult<&'static str> {
    let s = fsuffix(d).ok_or_else(|| {
        CudaError::unsupported(
            format!("`{base}` on {d}"),
            "kernel selection",
            "float dtypes only",
        )
    })?;
    Ok(intern(&format!("{base}_{s}")))
}

pub(super) fn intern(s: &str) -> &'static str {
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let m = NAMES.get_or_init(Default::default);
    let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(v) = g.get(s) {
        return v;
    }
    let v: &'static str = Box::leak(s.to_string().into_boxed_str());
    g.insert(s.to_string(), v);
    v
}

/// HF `rope_init_fn` inverse frequencies in f32 steps: the CPU reference's table.
pub(super) fn rope_inv_freq(theta: f64, dim: usize, scaling: &RopeScaling) -> Vec<f32> {
    weft_ir::attrs::rope_inv_freq(theta, dim, scaling, true)
        .into_iter()
        .map(|x| x as f32)
        .collect()
}

// ---------------------------------------------------------------- lowering

/// Extra memory regions the lowering asks for; two passes: the first (with zero bases)
/// sizes them, the second fills in real pointers.
pub(super) struct Extra {
    pub(super) scratch_base: Vec<u64>,
    pub(super) scratch_need: Vec<u64>,
    pub(super) cur: u64,
    pub(super) side_base: u64,
    pub(super) side_used: u64,
    pub(super) consts_base: u64,
    pub(super) consts: Vec<u8>,
}

pub(super) fn align256(x: u64) -> u64 {
    x.div_ceil(256) * 256
}

impl Extra {
    /// The first lowering pass (sizes only; its pointers are offsets from 0).
    pub(super) fn sizing(&self) -> bool {
        self.side_base == 0
    }
    pub(super) fn scratch(&mut self, stream: usize, bytes: u64) -> u64 {
        let p = self.scratch_base[stream] + self.cur;
        self.cur += align256(bytes.max(1));
        self.scratch_need[stream] = self.scratch_need[stream].max(self.cur);
        p
    }
    pub(super) fn side(&mut self, bytes: u64) -> u64 {
        let p = self.side_base + self.side_used;
        self.side_used += align256(bytes.max(1));
        p
    }
    pub(super) fn constant(&mut self, bytes: &[u8]) -> u64 {
        let off = align256(self.consts.len() as u64);
        self.consts.resize(off as usize, 0);
        self.consts.extend_from_slice(bytes);
        self.consts_base + off
    }
}

pub(super) struct Lower<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) ex: Extra,
    pub(super) steps: Vec<Step>,
    pub(super) stream: usize,
    pub(super) ins: u32,
    pub(super) fast_attention: bool,
    pub(super) tuning: Tuning,
    /// Saved log-sum-exp of attention forwards by output pointer: the output a backward
    /// reads is the one its forward wrote (q, k, v may be recomputed copies elsewhere).
    pub(super) attn_lse: HashMap<u64, u64>,
    /// cuDNN's attention plans and handles (when selected and loadable).
    pub(super) cudnn: Option<&'a RefCell<cudnn_sdpa::Sdpa>>,
    /// The saved statistics (of `attn_lse`) that cuDNN's forward wrote: natural-log f32
    /// log-sum-exp, which only cuDNN's backward reads (Weft's kernels keep log2 units).
    pub(super) cudnn_lse: HashSet<u64>,
    /// Saved per-row log-sum-exp of cross-entropy forwards: (logits, labels) -> lse pointer.
    pub(super) ce_lse: HashMap<(u64, u64), u64>,
    pub(super) location: String,
}

impl Lower<'_> {
    pub(super) fn push(&mut self, kind: StepKind) {
        self.steps.push(Step {
            stream: self.stream,
            ins: self.ins,
            kind,
        });
    }
    pub(super) fn launch(&mut self, l: Launch) {
        self.push(StepKind::Launch(l));
    }
    pub(super) fn n(&mut self, name: &'static str, n: u64, args: Vec<Arg>) -> CudaResult<()> {
        let l = self.gpu.launch_n(name, n, args)?;
        self.launch(l);
        Ok(())
    }
    pub(super) fn rows(
        &mut self,
        name: &'static str,
        rows: u64,
        block: u32,
        smem: u32,
        args: Vec<Arg>,
    ) -> CudaResult<()> {
        if rows == 0 {
            return Ok(());
        }
        if rows > u32::MAX as u64 {
            return Err(self.unsup(name, "more rows than one grid dimension holds"));
        }
        let l = self
            .gpu
            .launch(name, (rows as u32, 1, 1), (block, 1, 1), smem, args)?;
        self.launch(l);
        Ok(())
    }
    pub(super) fn warps(
        &mut self,
        name: &'static str,
        items: u64,
        args: Vec<Arg>,
    ) -> CudaResult<()> {
        let blocks = items.div_ceil(8);
        if blocks == 0 {
            return Ok(());
        }
        let l = self
            .gpu
            .launch(name, (blocks as u32, 1, 1), (256, 1, 1), 0, args)?;
        self.launch(l);
        Ok(())
    }
    /// Launches kernel `name` (an instance of one of `K::SOURCES`) with the arguments of
    /// `k`, its grid from `count` as `K::SHAPE` says.
    pub(super) fn run<K: Kernel>(
        &mut self,
        name: &'static str,
        count: u64,
        k: K,
    ) -> CudaResult<()> {
        debug_assert!(K::launches(name), "`{name}` is not one of {:?}", K::SOURCES);
        match K::SHAPE {
            Shape::Items => self.n(name, count, k.args()),
            Shape::Rows(block) => self.rows(name, count, block, 0, k.args()),
            Shape::Warps => self.warps(name, count, k.args()),
            Shape::Single(block) => {
                let l = self
                    .gpu
                    .launch(name, (1, 1, 1), (block, 1, 1), 0, k.args())?;
                self.launch(l);
                Ok(())
            }
            Shape::Custom => Err(self.unsup(name, "internal: launched without its grid")),
        }
    }
    /// Launches kernel `name` with the arguments of `k` on the grid the call site chose.
    pub(super) fn run_at<K: Kernel>(
        &mut self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        k: K,
    ) -> CudaResult<()> {
        debug_assert!(K::launches(name), "`{name}` is not one of {:?}", K::SOURCES);
        let l = self.gpu.launch(name, grid, block, smem, k.args())?;
        self.launch(l);
        Ok(())
    }
    pub(super) fn unsup(&self, what: &str, why: &str) -> CudaError {
        CudaError::unsupported(what.to_string(), self.location.clone(), why.to_string())
    }
    pub(super) fn copy(&mut self, dst: u64, src: u64, bytes: u64) {
        if bytes > 0 && dst != src {
            self.push(StepKind::Copy {
                dst,
                src,
                bytes,
                kind: CopyKind::D2D,
            });
        }
    }
    pub(super) fn memset(&mut self, dst: u64, bytes: u64) {
        if bytes > 0 {
            self.push(StepKind::Memset { dst, bytes });
        }
    }
    pub(super) fn fill(&mut self, t: &DevT, value: f64) -> CudaResult<()> {
        let pat = layout::fill_pattern(value, t.dtype);
        let name = match t.dtype.size_bytes() {
            1 => "fill_b1",
            2 => "fill_b2",
            4 => "fill_b4",
            _ => "fill_b8",
        };
        let k = kernels::Fill {
            out: t.ptr,
            n: t.numel() as i64,
            pat,
        };
        self.run(name, t.numel(), k)
    }
    /// `dst[ds . i] = src[ss . i]` over `shape` (element offsets applied to the pointers).
    pub(super) fn strided(
        &mut self,
        dst: u64,
        src: u64,
        esz: usize,
        shape: &[usize],
        ss: &[i64],
        ds: &[i64],
    ) -> CudaResult<()> {
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let (st, w, count) = layout::strided_copy(shape, ss, ds, esz, src, dst)
            .map_err(|m| self.unsup("a layout copy", &m))?;
        // A plain contiguous run is a memcpy.
        if st.rank == 1 && st.ss[0] == 1 && st.ds[0] == 1 {
            self.copy(dst, src, count * w as u64);
            return Ok(());
        }
        let name = match w {
            1 => "copy_strided_b1",
            2 => "copy_strided_b2",
            4 => "copy_strided_b4",
            8 => "copy_strided_b8",
            _ => "copy_strided_b16",
        };
        let k = kernels::CopyStrided {
            d: dst,
            s: src,
            n: count as i64,
            st,
        };
        self.run(name, count, k)
    }
    pub(super) fn gemm(&mut self, shape: GemmShape, a: u64, b: u64, c: u64, bias: u64) {
        self.gemm_adding(shape, a, b, c, c, bias);
    }

    /// A GEMM writing `c`; with `shape.accumulate` it adds `addend` (which may be `c`).
    pub(super) fn gemm_adding(
        &mut self,
        shape: GemmShape,
        a: u64,
        b: u64,
        addend: u64,
        c: u64,
        bias: u64,
    ) {
        self.push(StepKind::Gemm {
            shape,
            a,
            b,
            c,
            bias,
            addend,
            fp8_scales: None,
        });
    }

    /// An FP8 GEMM (`shape.fp8` set) of quantized `a`, `b` with their dequantizing
    /// factors `scale_a`, `scale_b` (device f32), writing `c`.
    pub(super) fn gemm_fp8(
        &mut self,
        shape: GemmShape,
        a: u64,
        b: u64,
        scale_a: u64,
        scale_b: u64,
        c: u64,
    ) {
        self.push(StepKind::Gemm {
            shape,
            a,
            b,
            c,
            bias: 0,
            addend: c,
            fp8_scales: Some((scale_a, scale_b)),
        });
    }
}

pub(super) fn esz(d: DType) -> usize {
    d.size_bytes() as usize
}

pub(super) fn norm(d: i64, rank: usize) -> CudaResult<usize> {
    weft_ir::shape::norm_dim(d, rank).map_err(CudaError::Plan)
}

pub(super) fn ptr_or_null(t: Option<&DevT>) -> u64 {
    t.map(|t| t.ptr).unwrap_or(0)
}

/// Whether the 16-byte bf16 vector kernels can run for output `o` and operands `ts`: all
/// bf16, 16-byte aligned, of `o`'s element count, a multiple of 8.
pub(super) fn vec8(o: &DevT, ts: &[&DevT]) -> bool {
    o.dtype == DType::BF16
        && o.numel().is_multiple_of(8)
        && ts
            .iter()
            .all(|t| t.ptr % 16 == 0 && t.dtype == DType::BF16 && t.numel() == o.numel())
}

/// Lowers one op (not a collective) of the instruction being lowered: its operands
/// `ins` and results `outs` are resolved device tensors.
pub(super) fn lower_op(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
    bindings: &Bindings,
) -> CudaResult<()> {
    use elementwise::{binary, unary};
    use kernels::{BinaryCode, ReduceCode, UnaryCode};
    match op {
        Op::Param { .. } | Op::Input { .. } => Ok(()),
        Op::Full { value, .. } => lw.fill(&outs[0], value.0),
        Op::Arange { start, .. } => elementwise::arange(lw, outs, start, bindings),
        Op::Neg {} => unary(lw, ins, outs, UnaryCode::Neg, 0.0),
        Op::Exp {} => unary(lw, ins, outs, UnaryCode::Exp, 0.0),
        Op::Log {} => unary(lw, ins, outs, UnaryCode::Log, 0.0),
        Op::Sqrt {} => unary(lw, ins, outs, UnaryCode::Sqrt, 0.0),
        Op::Rsqrt {} => unary(lw, ins, outs, UnaryCode::Rsqrt, 0.0),
        Op::Tanh {} => unary(lw, ins, outs, UnaryCode::Tanh, 0.0),
        Op::Sigmoid {} => unary(lw, ins, outs, UnaryCode::Sigmoid, 0.0),
        Op::Silu {} => unary(lw, ins, outs, UnaryCode::Silu, 0.0),
        Op::Gelu { tanh_approx } => {
            let code = if *tanh_approx {
                UnaryCode::GeluTanh
            } else {
                UnaryCode::Gelu
            };
            unary(lw, ins, outs, code, 0.0)
        }
        Op::Relu {} => unary(lw, ins, outs, UnaryCode::Relu, 0.0),
        Op::Scale { factor } => unary(lw, ins, outs, UnaryCode::Scale, factor.0 as f32),
        Op::AddScalar { value } => unary(lw, ins, outs, UnaryCode::AddScalar, value.0 as f32),
        Op::PowScalar { exponent } => unary(lw, ins, outs, UnaryCode::PowScalar, exponent.0 as f32),
        Op::Add {} => binary(lw, ins, outs, BinaryCode::Add),
        Op::Sub {} => binary(lw, ins, outs, BinaryCode::Sub),
        Op::Mul {} => binary(lw, ins, outs, BinaryCode::Mul),
        Op::Div {} => binary(lw, ins, outs, BinaryCode::Div),
        Op::Pow {} => binary(lw, ins, outs, BinaryCode::Pow),
        Op::Maximum {} => binary(lw, ins, outs, BinaryCode::Maximum),
        Op::Minimum {} => binary(lw, ins, outs, BinaryCode::Minimum),
        Op::Compare { op } => elementwise::compare(lw, ins, outs, *op),
        Op::Where {} => elementwise::select(lw, ins, outs),
        Op::Cast { .. } => elementwise::cast(lw, ins, outs),
        Op::SiluGrad {} => elementwise::silu_grad(lw, ins, outs),
        Op::GeluGrad { tanh_approx } => elementwise::gelu_grad(lw, ins, outs, *tanh_approx),
        Op::Sum { dims, .. } => reduce::reduce(lw, ins, outs, dims, ReduceCode::Sum),
        Op::Mean { dims, .. } => reduce::reduce(lw, ins, outs, dims, ReduceCode::Mean),
        Op::Max { dims, .. } => reduce::reduce(lw, ins, outs, dims, ReduceCode::Max),
        Op::Softmax { dim } => reduce::softmax(lw, ins, outs, *dim, false),
        Op::LogSoftmax { dim } => reduce::softmax(lw, ins, outs, *dim, true),
        Op::SoftmaxGrad { dim } => reduce::softmax_grad(lw, ins, outs, *dim),
        Op::Linear {} => matmul::linear(lw, ins, outs),
        Op::Matmul {
            transpose_a,
            transpose_b,
        }
        | Op::MatmulAdd {
            transpose_a,
            transpose_b,
        } => {
            // matmul_add's third operand is the addend the GEMM accumulates into.
            let addend = ins.get(2).filter(|_| matches!(op, Op::MatmulAdd { .. }));
            matmul::matmul(
                lw,
                &ins[0],
                &ins[1],
                &outs[0],
                *transpose_a,
                *transpose_b,
                addend,
            )
        }
        Op::Fp8Matmul {
            transpose_a,
            transpose_b,
            format_a,
            format_b,
        } => super::fp8::fp8_matmul(
            lw,
            &ins[0],
            &ins[1],
            &outs[0],
            (*transpose_a, *transpose_b),
            (*format_a, *format_b),
        ),
        Op::GroupedMatmul { transpose_w } => matmul::grouped_matmul(lw, ins, outs, transpose_w),
        Op::GroupedMatmulGrad { transpose_w, bias } => {
            matmul::grouped_matmul_grad(lw, ins, outs, transpose_w, bias)
        }
        Op::RmsNorm { eps } => norm::rms_norm(lw, ins, outs, eps),
        Op::Glu { .. } | Op::GluGrad { .. } | Op::AddRmsNorm { .. } | Op::AddRmsNormGrad { .. } => {
            fused::lower_fused(lw, op, ins, outs)
        }
        Op::RmsNormGrad { eps } => norm::rms_norm_grad(lw, ins, outs, eps),
        Op::RopeTable {
            theta,
            dim,
            scaling,
        } => rope::rope_table(lw, ins, outs, theta, dim, scaling),
        Op::Rope { layout } => rope::rope(lw, ins, outs, *layout),
        Op::Attention {
            causal,
            scale,
            window,
            ..
        } => attention::attention(lw, op, ins, outs, causal, scale, window),
        Op::AttentionGrad {
            causal,
            scale,
            window,
            ..
        } => attention::attention_grad(lw, op, ins, outs, causal, scale, window),
        Op::ShiftLabels { ignore_index } => loss::shift_labels(lw, ins, outs, ignore_index),
        Op::CountValid { ignore_index } => loss::count_valid(lw, ins, outs, ignore_index),
        Op::CrossEntropy {
            ignore_index,
            reduction,
        } => loss::cross_entropy(lw, ins, outs, ignore_index, reduction),
        Op::CrossEntropyGrad {
            ignore_index,
            reduction,
        } => loss::cross_entropy_grad(lw, ins, outs, ignore_index, reduction),
        Op::Reshape { .. } => movement::reshape(lw, ins, outs),
        Op::Permute { perm } => movement::permute(lw, ins, outs, perm),
        Op::Transpose { dim0, dim1 } => movement::transpose(lw, ins, outs, dim0, dim1),
        Op::Slice { dim, start, .. } => movement::slice(lw, ins, outs, dim, start, bindings),
        Op::Split { dim, .. } => movement::split(lw, ins, outs, dim),
        Op::Zigzag {
            dim,
            parts,
            inverse,
        } => movement::zigzag(lw, ins, outs, dim, parts, inverse),
        Op::Concat { dim } => movement::concat(lw, ins, outs, dim),
        Op::Expand { .. } => movement::expand(lw, ins, outs),
        Op::Embedding { .. } => index::embedding(lw, ins, outs),
        Op::EmbeddingGrad { padding_idx, .. } => {
            index::embedding_grad(lw, ins, outs, padding_idx.as_ref(), bindings)
        }
        Op::Gather { dim } => index::gather(lw, ins, outs, dim),
        Op::IndexSelect { dim } => index::index_select(lw, ins, outs, dim),
        Op::ScatterAdd { dim } => index::scatter_add(lw, ins, outs, dim),
        Op::LinearCrossEntropy { .. } => linear_ce::linear_ce_fwd(lw, op, ins, outs),
        Op::LinearCrossEntropyGrad { .. } => linear_ce::linear_ce_bwd(lw, op, ins, outs),
        Op::LinearCrossEntropyWithGrad { .. } => linear_ce::linear_ce_with_grad(lw, op, ins, outs),
        Op::Topk { k, dim } => index::topk(lw, ins, outs, k, dim),
        Op::OneHot { num_classes, .. } => index::one_hot(lw, ins, outs, num_classes),
        Op::MoeDispatch { num_experts } => moe::moe_dispatch(lw, ins, outs, num_experts),
        Op::MoeCombine {} => moe::moe_combine(lw, ins, outs),
        Op::MoeCombineGrad {} => moe::moe_combine_grad(lw, ins, outs),
        Op::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            warmup,
        } => optimizer::adamw(
            lw,
            ins,
            outs,
            [lr, beta1, beta2, eps, weight_decay],
            *warmup,
        ),
        Op::AdamWMaster {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            dtype,
            warmup,
        } => optimizer::adamw_master(
            lw,
            ins,
            outs,
            [lr, beta1, beta2, eps, weight_decay],
            *dtype,
            *warmup,
        ),
        Op::Sgd {
            lr,
            momentum,
            weight_decay,
        } => optimizer::sgd(lw, ins, outs, lr, momentum, weight_decay),
        other if other.is_collective() => Err(lw.unsup(
            other.name(),
            "internal: collectives are lowered by the executor",
        )),
        other => Err(lw.unsup(
            &format!("op `{}`", other.name()),
            "no CUDA kernel for it yet",
        )),
    }
}

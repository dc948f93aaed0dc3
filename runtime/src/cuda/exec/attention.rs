//! Lowering of `attention` and `attention_grad` to launches: cuDNN's fused flash
//! attention where it can run the op (plain causal or banded attention, bf16, Sq == Sk,
//! its own value head dim allowed), else Weft's tensor-core kernels (bf16, head dim 64 or
//! 128, nothing extra), else the generic kernels, which implement every attribute of the
//! op (docs/attention.md). The forward keeps its per-row statistics in a side buffer the
//! backward finds by the output's pointer.
//!
//! `layout=bshd`: every per-head tensor (q, k, v, out, dout, dq, dk, dv) is handled as a
//! [B, H, S, D]-shaped `DevT` whose memory is [B, S, H, D]. cuDNN reads and writes it in
//! place through permuted strides, and the generic kernels take a `bshd` flag; the
//! tensor-core kernels index row-major [B, H, S, D] (their tiles are loaded as
//! contiguous head blocks), so for them the operands are transposed into scratch and
//! the results back: two copies per tensor, the price of not rewriting their loads.

use super::*;
use weft_ir::HeadLayout;

/// What an `attention` / `attention_grad` adds to plain attention (docs/attention.md):
/// soft-capping, sinks, a value head dim different from the query/key one, and the
/// log-sum-exp as a result. Only Weft's generic kernels implement these; plain attention
/// keeps cuDNN and the tensor-core kernels.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct AttnExtras {
    /// 0 for none.
    softcap: f32,
    /// Device pointers, 0 where absent: the sinks operand, the forward's lse result, the
    /// backward's dlse operand, and the backward's dsinks result (with its dtype).
    sinks: u64,
    /// The sinks are f32 (else in q's dtype).
    sinks_f32: bool,
    lse_out: u64,
    dlse: u64,
    dsinks: Option<(u64, DType)>,
}

impl AttnExtras {
    /// None of the attributes only the generic kernels implement (cuDNN also takes a
    /// value head dim of its own).
    fn none(&self) -> bool {
        self.softcap == 0.0 && self.sinks == 0 && self.lse_out == 0 && self.dlse == 0
    }
    /// What Weft's tensor-core kernels take: nothing extra, one head dim.
    fn plain(&self, d: usize, dv: usize) -> bool {
        self.none() && d == dv
    }
}

/// The attention operands and extras of `op` (whose operands are `ins`, results `outs`),
/// or why the CUDA kernels cannot run it.
pub(super) fn attention_parts<'a>(
    op: &Op,
    ins: &'a [DevT],
    outs: &[DevT],
) -> Result<(Option<&'a DevT>, AttnExtras), String> {
    let (softcap, sinks_flag, lse_flag, grad) = match op {
        Op::Attention {
            softcap,
            sinks,
            lse,
            ..
        } => (*softcap, sinks.0, lse.0, false),
        Op::AttentionGrad {
            softcap,
            sinks,
            lse,
            ..
        } => (*softcap, sinks.0, lse.0, true),
        _ => return Err("not an attention".into()),
    };
    let ops = op
        .attention_operands(ins.len())
        .unwrap_or_else(|| Err("not an attention".into()))?;
    let mask = ops.mask.map(|i| &ins[i]);
    let dt = ins[0].dtype;
    let mut ex = AttnExtras {
        softcap: softcap.map(|c| c.0 as f32).unwrap_or(0.0),
        ..Default::default()
    };
    if let Some(i) = ops.sinks {
        if ins[i].dtype != dt && ins[i].dtype != DType::F32 {
            return Err(format!(
                "sinks in {} with q in {} (sinks in f32 or in q's dtype)",
                ins[i].dtype, dt
            ));
        }
        ex.sinks = ins[i].ptr;
        ex.sinks_f32 = ins[i].dtype == DType::F32;
    }
    if let Some(i) = ops.dlse {
        if ins[i].dtype != DType::F32 {
            return Err(format!(
                "a {} log-sum-exp gradient (f32 expected)",
                ins[i].dtype
            ));
        }
        ex.dlse = ins[i].ptr;
    }
    if lse_flag && !grad {
        match outs.get(1) {
            Some(t) if t.dtype == DType::F32 => ex.lse_out = t.ptr,
            _ => return Err("an lse result that is not f32".into()),
        }
    }
    if sinks_flag && grad {
        match outs.get(3) {
            Some(t) => ex.dsinks = Some((t.ptr, t.dtype)),
            None => return Err("attention_grad with sinks=true but no dsinks result".into()),
        }
    }
    let (d, dv) = (
        ins[0].shape.last().copied().unwrap_or(0),
        ins[2].shape.last().copied().unwrap_or(0),
    );
    if d > 256 || dv > 256 {
        return Err(format!("head dims up to 256 (query/key {d}, value {dv})"));
    }
    Ok((mask, ex))
}

fn mask_dims(mask: Option<&DevT>) -> (u64, i32, i32) {
    match mask {
        Some(m) => (m.ptr, m.shape[0] as i32, m.shape[1] as i32),
        None => (0, 1, 1),
    }
}

/// The parameters the generic forward and backward kernels share: the mask and its
/// broadcast dims, head counts, sequence lengths, head dim, scale, causal, the
/// statistics' stride (rows), window, value head dim, soft-cap and sinks.
struct GenericShape {
    mask: u64,
    mb: i32,
    mh: i32,
    nq: i32,
    nkv: i32,
    sq: i64,
    sk: i64,
    d: i32,
    scale: f32,
    causal: i32,
    lstride: i64,
    window: i64,
    dv: i32,
    softcap: f32,
    sinks: u64,
    sinks_f32: i32,
}

#[allow(clippy::too_many_arguments)]
fn generic_shape(
    q: &DevT,
    k: &DevT,
    v: &DevT,
    mask: Option<&DevT>,
    causal: bool,
    scale: f32,
    window: i64,
    extras: &AttnExtras,
) -> GenericShape {
    let (b, nq, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (nkv, sk, dv) = (k.shape[1], k.shape[2], v.shape[3]);
    let (mask, mb, mh) = mask_dims(mask);
    GenericShape {
        mask,
        mb,
        mh,
        nq: nq as i32,
        nkv: nkv as i32,
        sq: sq as i64,
        sk: sk as i64,
        d: d as i32,
        scale,
        causal: causal as i32,
        lstride: (b * nq * sq) as i64,
        window,
        dv: dv as i32,
        softcap: extras.softcap,
        sinks: extras.sinks,
        sinks_f32: extras.sinks_f32 as i32,
    }
}

/// The cuDNN graph for this attention, when cuDNN is selected and can take it: bf16
/// q/k/v (BHSD, or BSHD memory when `bshd`), no mask, Sq == Sk, head dim a multiple of 8
/// up to 256, GQA or MHA.
#[allow(clippy::too_many_arguments)]
fn cudnn_shape(
    lw: &Lower,
    q: &DevT,
    k: &DevT,
    v: &DevT,
    mask: Option<&DevT>,
    causal: bool,
    window: i64,
    scale: f32,
    backward: bool,
    bshd: bool,
) -> Option<cudnn_sdpa::Shape> {
    lw.cudnn?;
    // cuDNN's band is the left edge of a causal mask; a window without causal runs on
    // Weft's kernels, and so does one narrower than FA_MIN_WINDOW (on the H200 with
    // cuDNN 9.14 a window of 1 gave an infinite dK, as Weft's tensor-core backward did).
    if mask.is_some()
        || (window > 0 && (!causal || window < FA_MIN_WINDOW))
        || [q, k, v]
            .iter()
            .any(|t| t.dtype != DType::BF16 || t.rank() != 4)
    {
        return None;
    }
    let (b, nq, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (nkv, sk) = (k.shape[1], k.shape[2]);
    let ok = b > 0
        && sq > 0
        && sq == sk
        && k.shape[0] == b
        && k.shape[3] == d
        && v.shape[..3] == k.shape[..3]
        && nkv > 0
        && nq % nkv == 0
        && d % 8 == 0
        && d <= 256
        && v.shape[3].is_multiple_of(8)
        && v.shape[3] <= 256;
    ok.then_some(cudnn_sdpa::Shape {
        b,
        hq: nq,
        hkv: nkv,
        s: sq,
        d,
        dv: v.shape[3],
        causal,
        window: window.max(0) as usize,
        scale_bits: scale.to_bits(),
        backward,
        bshd,
    })
}

fn cudnn_plan(lw: &Lower, shape: cudnn_sdpa::Shape) -> Option<Arc<cudnn_sdpa::Plan>> {
    lw.cudnn?
        .borrow_mut()
        .plan_or_report(shape, lw.stream, &lw.location)
}

/// Pushes one cuDNN execution (in the second lowering pass; the first only sizes).
fn cudnn_push(lw: &mut Lower, plan: Arc<cudnn_sdpa::Plan>, p: &cudnn_sdpa::Ptrs) -> CudaResult<()> {
    if lw.ex.sizing() {
        return Ok(());
    }
    let e = cudnn_sdpa::Exec::new(plan, p).map_err(|e| {
        CudaError::Plan(format!(
            "cuDNN attention in {}: building the variant pack failed: {e}",
            lw.location
        ))
    })?;
    lw.push(StepKind::Cudnn(Arc::new(e)));
    Ok(())
}

/// cuDNN's forward into `o` and `stats` (f32 natural-log log-sum-exp [B,Hq,S,1]); false
/// when cuDNN cannot run it (nothing emitted).
fn cudnn_fwd(
    lw: &mut Lower,
    q: &DevT,
    k: &DevT,
    v: &DevT,
    o: &DevT,
    stats: u64,
    shape: cudnn_sdpa::Shape,
) -> CudaResult<bool> {
    let Some(plan) = cudnn_plan(lw, shape) else {
        return Ok(false);
    };
    let workspace = lw.ex.scratch(lw.stream, plan.workspace);
    let p = cudnn_sdpa::Ptrs {
        q: q.ptr,
        k: k.ptr,
        v: v.ptr,
        o: o.ptr,
        stats,
        workspace,
        ..Default::default()
    };
    cudnn_push(lw, plan, &p)?;
    Ok(true)
}

/// Attention forward: cuDNN's fused kernel where selected and possible, else Weft's
/// (`bshd`: q, k, v and o lie in memory as [B, S, H, D], see the module doc).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_fwd(
    lw: &mut Lower,
    q: &DevT,
    k: &DevT,
    v: &DevT,
    mask: Option<&DevT>,
    o: &DevT,
    lse: u64,
    causal: bool,
    scale: f32,
    window: i64,
    extras: &AttnExtras,
    bshd: bool,
) -> CudaResult<()> {
    // A window as long as the keys is no band (and may be too large to count with).
    let window = if window as u64 >= k.shape[2] as u64 {
        0
    } else {
        window
    };
    if extras.none() {
        if let Some(sh) = cudnn_shape(lw, q, k, v, mask, causal, window, scale, false, bshd) {
            if cudnn_fwd(lw, q, k, v, o, lse, sh)? {
                lw.cudnn_lse.insert(lse);
                return Ok(());
            }
        }
    }
    attention_fwd_weft(
        lw, q, k, v, mask, o, lse, causal, scale, window, extras, bshd,
    )
}

/// The strides of a [B, H, S, D]-shaped tensor whose memory is [B, S, H, D].
fn bshd_strides(shape: &[usize]) -> Vec<i64> {
    let (h, s, d) = (shape[1] as i64, shape[2] as i64, shape[3] as i64);
    vec![s * h * d, d, h * d, 1]
}

/// `t` as its [B, H, S, D] view: the same memory, dims 1 and 2 swapped (for a tensor of
/// a `layout=bshd` op, whose shape is [B, S, H, D]).
fn bhsd_view(t: &DevT) -> DevT {
    let mut v = t.clone();
    if v.rank() == 4 {
        v.shape.swap(1, 2);
    }
    v
}

/// Scratch for a row-major [B, H, S, D] tensor of `t`'s shape and dtype.
fn bhsd_scratch(lw: &mut Lower, t: &DevT) -> DevT {
    DevT {
        ptr: lw.ex.scratch(lw.stream, t.bytes()),
        dtype: t.dtype,
        shape: t.shape.clone(),
    }
}

/// A row-major [B, H, S, D] scratch copy of `t` ([B, S, H, D] memory).
fn to_bhsd_scratch(lw: &mut Lower, t: &DevT) -> CudaResult<DevT> {
    let out = bhsd_scratch(lw, t);
    lw.strided(
        out.ptr,
        t.ptr,
        esz(t.dtype),
        &t.shape,
        &bshd_strides(&t.shape),
        &layout::strides(&t.shape),
    )?;
    Ok(out)
}

/// Copies the row-major [B, H, S, D] `src` into `dst` ([B, S, H, D] memory).
fn from_bhsd_scratch(lw: &mut Lower, dst: &DevT, src: &DevT) -> CudaResult<()> {
    lw.strided(
        dst.ptr,
        src.ptr,
        esz(dst.dtype),
        &dst.shape,
        &layout::strides(&dst.shape),
        &bshd_strides(&dst.shape),
    )
}

/// The narrowest window the tensor-core kernels and cuDNN take: below it (a band narrower
/// than their 64-key tile) the generic kernels run. On an H200 the tensor-core backward
/// (session 4) and cuDNN 9.14's (session 5) gave non-finite dK for window 1, while
/// windows of 64 and more matched the CPU.
const FA_MIN_WINDOW: i64 = 64;

/// Weft's own attention forward kernels (tensor-core flash or generic; `bshd`: the
/// per-head tensors lie in memory as [B, S, H, D]).
#[allow(clippy::too_many_arguments)]
fn attention_fwd_weft(
    lw: &mut Lower,
    q: &DevT,
    k: &DevT,
    v: &DevT,
    mask: Option<&DevT>,
    o: &DevT,
    lse: u64,
    causal: bool,
    scale: f32,
    window: i64,
    extras: &AttnExtras,
    bshd: bool,
) -> CudaResult<()> {
    let (b, nq, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (nkv, sk, dv) = (k.shape[1], k.shape[2], v.shape[3]);
    if nkv == 0 || nq % nkv != 0 || d > 256 || dv > 256 {
        return Err(lw.unsup(
            "attention",
            "q heads must be a multiple of kv heads, head dim at most 256",
        ));
    }
    if mask.is_some_and(|m| m.dtype != DType::Bool) {
        return Err(lw.unsup(
            "attention with a non-bool mask",
            "the mask is a bool keep-mask",
        ));
    }
    let fast = lw.fast_attention
        && mask.is_none()
        && extras.plain(d, dv)
        && q.dtype == DType::BF16
        && (d == 64 || d == 128)
        && (window == 0 || window >= FA_MIN_WINDOW);
    if fast && bshd {
        let (qs, ks, vs) = (
            to_bhsd_scratch(lw, q)?,
            to_bhsd_scratch(lw, k)?,
            to_bhsd_scratch(lw, v)?,
        );
        let os = bhsd_scratch(lw, o);
        attention_fwd_weft(
            lw, &qs, &ks, &vs, mask, &os, lse, causal, scale, window, extras, false,
        )?;
        return from_bhsd_scratch(lw, o, &os);
    }
    if fast {
        // WEFT_FA_WARPS=8: 128 query rows per block (8 warps) instead of 64.
        // Head dim 64: two 16-row m-tiles per warp (128 rows per block) unless WEFT_FA_FWD=m1.
        let nw = lw.tuning.fa_fwd_warps;
        let mt: usize = if d == 64 && nw == 4 && !lw.tuning.fa_fwd_one_mtile {
            2
        } else {
            1
        };
        let name = match (d, nw, mt) {
            (64, 4, 2) => "fa_fwd_d64_m2",
            (64, 4, _) => "fa_fwd_d64",
            (64, _, _) => "fa_fwd_d64_w8",
            (_, 4, _) => "fa_fwd_d128",
            _ => "fa_fwd_d128_w8",
        };
        let br = 16 * nw * mt;
        let smem = (br + 4 * 64) * (d + 8) * 2;
        let grid = (sq.div_ceil(br) as u32, nq as u32, b as u32);
        let kernel = kernels::FaFwd {
            out: o.ptr,
            lse,
            q: q.ptr,
            k: k.ptr,
            v: v.ptr,
            nq: nq as i32,
            nkv: nkv as i32,
            sq: sq as i64,
            sk: sk as i64,
            scale_log2: scale * std::f32::consts::LOG2_E,
            causal: causal as i32,
            window,
        };
        return lw.run_at(name, grid, (32 * nw as u32, 1, 1), smem as u32, kernel);
    }
    let name = kname("attn_fwd_generic", q.dtype)?;
    let grid = (sq.div_ceil(4) as u32, nq as u32, b as u32);
    let g = generic_shape(q, k, v, mask, causal, scale, window, extras);
    let kernel = kernels::AttnFwdGeneric {
        out: o.ptr,
        lse,
        q: q.ptr,
        k: k.ptr,
        v: v.ptr,
        mask: g.mask,
        mb: g.mb,
        mh: g.mh,
        nq: g.nq,
        nkv: g.nkv,
        sq: g.sq,
        sk: g.sk,
        d: g.d,
        scale: g.scale,
        causal: g.causal,
        lstride: g.lstride,
        window: g.window,
        dv: g.dv,
        softcap: g.softcap,
        sinks: g.sinks,
        sinks_f32: g.sinks_f32,
        lse_out: extras.lse_out,
        bshd: bshd as i32,
    };
    lw.run_at(name, grid, (128, 1, 1), 0, kernel)
}

/// Attention backward: dq, dk, dv (and the extras' gradients) from q, k, v, out, dout
/// (`ins`) and `saved`, the statistics the forward kept for `out` (`bshd`: the per-head
/// tensors lie in memory as [B, S, H, D], see the module doc).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_bwd(
    lw: &mut Lower,
    ins: &[DevT],
    mask: Option<&DevT>,
    outs: &[DevT],
    saved: Option<u64>,
    causal: bool,
    scale: f32,
    window: i64,
    extras: &AttnExtras,
    bshd: bool,
) -> CudaResult<()> {
    let (q, k, v, out, dout) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
    let (dq, dk, dv) = (&outs[0], &outs[1], &outs[2]);
    let (b, nq, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (nkv, sk, vd) = (k.shape[1], k.shape[2], v.shape[3]);
    let plain = extras.plain(d, vd);
    let rows = (b * nq * sq) as u64;
    // cuDNN's backward, from cuDNN's saved statistics (or a cuDNN forward recomputed to
    // scratch when the forward's were not kept): never mixed with Weft's log2 statistics.
    let window = if window as u64 >= k.shape[2] as u64 {
        0
    } else {
        window
    };
    let cudnn = if extras.none() {
        cudnn_shape(lw, q, k, v, mask, causal, window, scale, true, bshd)
    } else {
        None
    };
    if let Some(sh) = cudnn {
        let from_cudnn = saved.is_some_and(|p| lw.cudnn_lse.contains(&p));
        if saved.is_none() || from_cudnn {
            if let Some(plan) = cudnn_plan(lw, sh) {
                let stats = match saved {
                    Some(p) => Some(p),
                    None => {
                        let p = lw.ex.scratch(lw.stream, rows * 4);
                        let tmp = DevT {
                            ptr: lw.ex.scratch(lw.stream, out.bytes()),
                            dtype: out.dtype,
                            shape: out.shape.clone(),
                        };
                        let fsh = cudnn_sdpa::Shape {
                            backward: false,
                            ..sh
                        };
                        cudnn_fwd(lw, q, k, v, &tmp, p, fsh)?.then_some(p)
                    }
                };
                if let Some(stats) = stats {
                    let dsum = lw.ex.scratch(lw.stream, rows * 4);
                    let dq_acc = lw.ex.scratch(lw.stream, rows * d as u64 * 4);
                    let workspace = lw.ex.scratch(lw.stream, plan.workspace);
                    // Before cuDNN 9.6 the caller zeroes the dQ accumulator.
                    if lw.cudnn.is_some_and(|c| c.borrow().version < 90600) {
                        lw.memset(dq_acc, rows * d as u64 * 4);
                    }
                    let p = cudnn_sdpa::Ptrs {
                        q: q.ptr,
                        k: k.ptr,
                        v: v.ptr,
                        o: out.ptr,
                        stats,
                        d_o: dout.ptr,
                        dq: dq.ptr,
                        dk: dk.ptr,
                        dv: dv.ptr,
                        dsum,
                        dq_acc,
                        workspace,
                    };
                    return cudnn_push(lw, plan, &p);
                }
            }
        }
    }
    let fast = lw.fast_attention
        && mask.is_none()
        && plain
        && q.dtype == DType::BF16
        && (d == 64 || d == 128)
        && (window == 0 || window >= FA_MIN_WINDOW);
    if fast && bshd {
        let mut bhsd_ins = ins.to_vec();
        for t in bhsd_ins.iter_mut().take(5) {
            *t = to_bhsd_scratch(lw, t)?;
        }
        let mut bhsd_outs = outs.to_vec();
        for t in bhsd_outs.iter_mut().take(3) {
            *t = bhsd_scratch(lw, t);
        }
        attention_bwd(
            lw, &bhsd_ins, mask, &bhsd_outs, saved, causal, scale, window, extras, false,
        )?;
        for (dst, src) in outs.iter().zip(&bhsd_outs).take(3) {
            from_bhsd_scratch(lw, dst, src)?;
        }
        return Ok(());
    }
    // Weft's kernels: the forward's log-sum-exp, or recompute it (the output goes to
    // scratch), also when the saved one is cuDNN's.
    let lse = match saved {
        Some(p) if !lw.cudnn_lse.contains(&p) => p,
        _ => {
            let p = lw.ex.scratch(lw.stream, rows * 8);
            let tmp = DevT {
                ptr: lw.ex.scratch(lw.stream, out.bytes()),
                dtype: out.dtype,
                shape: out.shape.clone(),
            };
            let recompute = AttnExtras {
                lse_out: 0,
                dlse: 0,
                dsinks: None,
                ..*extras
            };
            attention_fwd_weft(
                lw, q, k, v, mask, &tmp, p, causal, scale, window, &recompute, bshd,
            )?;
            p
        }
    };
    let delta = lw.ex.scratch(lw.stream, rows * 4);
    let name = kname("attn_delta", q.dtype)?;
    let kernel = kernels::AttnDelta {
        delta,
        o: out.ptr,
        dout: dout.ptr,
        rows: rows as i64,
        d: vd as i32,
        n: nq as i32,
        s: sq as i64,
        bshd: bshd as i32,
    };
    lw.run(name, rows, kernel)?;
    if fast {
        let dq_acc = lw.ex.scratch(lw.stream, rows * d as u64 * 4);
        lw.memset(dq_acc, rows * d as u64 * 4);
        // Keys per block: 64 (4 warps) for head dim 64, 128 (8 warps: half the dQ atomics
        // and Q/dO loads per FLOP) for 128, as measured on an H200; WEFT_FA_BWD_WARPS=4|8
        // overrides.
        let nw: usize = match lw.tuning.fa_bwd_warps {
            Some(n) => n,
            None if d == 64 => 4,
            None => 8,
        };
        // Head dim 64, 4 warps: K/V/dS fragments held in registers unless WEFT_FA_BWD=plain.
        let hoist = !lw.tuning.fa_bwd_plain;
        let name = match (d, nw) {
            (64, 4) if hoist => "fa_bwd_d64_h",
            (64, 4) => "fa_bwd_d64",
            (64, _) => "fa_bwd_d64_w8",
            (_, 4) => "fa_bwd_d128",
            _ => "fa_bwd_d128_w8",
        };
        let bk = 16 * nw;
        let smem = (2 * bk * (d + 8) + 4 * 64 * (d + 8) + bk * 72) * 2 + 512;
        let kernel = kernels::FaBwd {
            dq_acc,
            dk: dk.ptr,
            dv: dv.ptr,
            q: q.ptr,
            k: k.ptr,
            v: v.ptr,
            dout: dout.ptr,
            lse,
            delta,
            nq: nq as i32,
            nkv: nkv as i32,
            sq: sq as i64,
            sk: sk as i64,
            scale,
            causal: causal as i32,
            window,
        };
        let grid = ((nkv * b) as u32, sk.div_ceil(bk) as u32, 1);
        lw.run_at(name, grid, (32 * nw as u32, 1, 1), smem as u32, kernel)?;
        return f32_to(lw, dq.ptr, dq.dtype, dq_acc, dq.numel());
    }
    let (kn, vn) = (k.numel(), v.numel());
    let dk_acc = lw.ex.scratch(lw.stream, kn * 4);
    let dv_acc = lw.ex.scratch(lw.stream, vn * 4);
    lw.memset(dk_acc, kn * 4);
    lw.memset(dv_acc, vn * 4);
    let dsinks_acc = match extras.dsinks {
        Some(_) => {
            let p = lw.ex.scratch(lw.stream, nq as u64 * 4);
            lw.memset(p, nq as u64 * 4);
            p
        }
        None => 0,
    };
    let name = kname("attn_bwd_generic", q.dtype)?;
    let g = generic_shape(q, k, v, mask, causal, scale, window, extras);
    let kernel = kernels::AttnBwdGeneric {
        dq: dq.ptr,
        dk_acc,
        dv_acc,
        q: q.ptr,
        k: k.ptr,
        v: v.ptr,
        dout: dout.ptr,
        lse,
        delta,
        mask: g.mask,
        mb: g.mb,
        mh: g.mh,
        nq: g.nq,
        nkv: g.nkv,
        sq: g.sq,
        sk: g.sk,
        d: g.d,
        scale: g.scale,
        causal: g.causal,
        lstride: g.lstride,
        window: g.window,
        dv: g.dv,
        softcap: g.softcap,
        sinks: g.sinks,
        sinks_f32: g.sinks_f32,
        dsinks_acc,
        dlse: extras.dlse,
        bshd: bshd as i32,
    };
    let grid = (sq.div_ceil(4) as u32, nq as u32, b as u32);
    lw.run_at(name, grid, (128, 1, 1), 0, kernel)?;
    f32_to(lw, dk.ptr, dk.dtype, dk_acc, kn)?;
    f32_to(lw, dv.ptr, dv.dtype, dv_acc, vn)?;
    if let Some((p, dt)) = extras.dsinks {
        f32_to(lw, p, dt, dsinks_acc, nq as u64)?;
    }
    Ok(())
}

/// `out` (dtype `dt`) = the `n` f32 of the accumulator `acc`.
fn f32_to(lw: &mut Lower, out: u64, dt: DType, acc: u64, n: u64) -> CudaResult<()> {
    let name = kname("f32_to", dt)?;
    let kernel = kernels::F32ToScaled {
        out,
        input: acc,
        n: n as i64,
        scale: 1.0,
    };
    lw.run(name, n, kernel)
}

/// `attention`: saves its per-row statistics for the backward, then runs the forward.
pub(super) fn attention(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
    causal: &bool,
    scale: &Float,
    window: &Option<i64>,
) -> CudaResult<()> {
    let (mask, extras) = attention_parts(op, ins, outs).map_err(|why| {
        lw.unsup(
            "this attention",
            &format!("its kernels do not implement {why}\nhelp: run with `--backend cpu`"),
        )
    })?;
    let bshd = op.head_layout() == Some(HeadLayout::Bshd);
    let view = |t: &DevT| if bshd { bhsd_view(t) } else { t.clone() };
    let (q, k, v, o) = (view(&ins[0]), view(&ins[1]), view(&ins[2]), view(&outs[0]));
    // Per query row: the log-sum-exp (tensor-core path) or the max and the sum (generic).
    let lse = lw
        .ex
        .side(8 * q.shape[0] as u64 * q.shape[1] as u64 * q.shape[2] as u64);
    lw.attn_lse.insert(o.ptr, lse);
    attention_fwd(
        lw,
        &q,
        &k,
        &v,
        mask,
        &o,
        lse,
        *causal,
        scale.0 as f32,
        window.unwrap_or(0),
        &extras,
        bshd,
    )
}

/// `attention_grad`: dq, dk, dv (and the extras' gradients).
pub(super) fn attention_grad(
    lw: &mut Lower,
    op: &Op,
    ins: &[DevT],
    outs: &[DevT],
    causal: &bool,
    scale: &Float,
    window: &Option<i64>,
) -> CudaResult<()> {
    let (mask, extras) = attention_parts(op, ins, outs).map_err(|why| {
        lw.unsup(
            "this attention_grad",
            &format!("its kernels do not implement {why}\nhelp: run with `--backend cpu`"),
        )
    })?;
    let bshd = op.head_layout() == Some(HeadLayout::Bshd);
    let (mut ins, mut outs) = (ins.to_vec(), outs.to_vec());
    if bshd {
        // q, k, v, out, dout and dq, dk, dv as [B, H, S, D] views of their memory
        for t in ins.iter_mut().take(5).chain(outs.iter_mut().take(3)) {
            *t = bhsd_view(t);
        }
    }
    let saved = lw.attn_lse.get(&ins[3].ptr).copied();
    attention_bwd(
        lw,
        &ins,
        mask,
        &outs,
        saved,
        *causal,
        scale.0 as f32,
        window.unwrap_or(0),
        &extras,
        bshd,
    )
}

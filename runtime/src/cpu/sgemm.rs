//! A packed, cache-blocked f32 GEMM, `C = alpha * A @ B + beta * C`, with an AVX-512F
//! micro-kernel. The gemm crate (0.19) that candle uses only reaches AVX2 without its
//! nightly feature; on an AVX-512 machine that leaves half the FMA width unused and made
//! the CPU executor's llama step 4x slower than PyTorch.
//!
//! Every operand is given by element strides (row, column), so a transposed operand costs
//! nothing beyond the packing every block does anyway. The blocking is the usual one
//! (Goto/BLIS): a `KC x NC` panel of B is packed into `NR`-column micro-panels (L3), an
//! `MB x KC` block of A into `MR`-row micro-panels, and the `MR x NR` kernel keeps its
//! tile of C in 24 zmm accumulators, broadcasting A and FMA-ing rows of B. The tiles of C
//! within a packed block are split into `MC x NT` tasks that rayon runs in parallel (when
//! asked); a task's A rows (`MC x KC`) stay in L2 while it sweeps its B micro-panels.
//! `KC` is 512 so that at the hidden sizes of interest C is written once, not
//! read-modified-written per depth block (measured: 380-410 GFLOP/s on 2 Zen 5 cores at
//! the llama shapes, against 300-330 with `KC` 256).
//!
//! The packing buffers are kept per calling thread between calls (11 MiB at most).
//!
//! Without AVX-512F (checked at run time) the call goes to the gemm crate, which is also
//! what f64 uses (f64 only serves tight reference checks).
//!
//! Safety: the `unsafe` here is the intrinsics (run only after the feature check) and the
//! raw pointers into C. The public entry checks that every element the strides reach lies
//! inside its slice; tasks then write disjoint tiles of C through one raw pointer.

use candle_core::{CpuStorage, Result, Storage, Tensor};
use rayon::prelude::*;

/// Rows of the micro-kernel's tile (A broadcasts).
const MR: usize = 12;
/// Columns of the micro-kernel's tile: two zmm registers.
const NR: usize = 32;
/// Depth of a packed block.
const KC: usize = 512;
/// Columns of B packed at once (a multiple of `NR`).
const NC: usize = 4096;
/// Rows of A packed at once (a multiple of `MR`).
const MB: usize = 1536;
/// Rows of one parallel task (a multiple of `MR`).
const MC: usize = 96;
/// Columns of one parallel task (a multiple of `NR`).
const NT: usize = 256;
/// Below this many multiply-adds a call stays on the calling thread.
const PAR_MIN_FLOPS: usize = 1 << 18;

/// Whether the AVX-512 kernel runs on this machine.
pub(crate) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("avx512f") && std::env::var_os("WEFT_NO_AVX512").is_none()
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `c = alpha * a @ b + beta * c` for `a [m, k]`, `b [k, n]`, `c [m, n]`, each given by
/// its slice and its element strides (row, column). With `beta == 0` `c` is only written
/// (never read, so it may hold NaN). `parallel` lets rayon split the work.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
    beta: f32,
    c: &mut [f32],
    (c_rs, c_cs): (usize, usize),
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        c.len() > (m - 1) * c_rs + (n - 1) * c_cs,
        "sgemm: c is too short for its strides"
    );
    if k == 0 || alpha == 0.0 {
        for i in 0..m {
            for j in 0..n {
                let v = &mut c[i * c_rs + j * c_cs];
                *v = if beta == 0.0 { 0.0 } else { beta * *v };
            }
        }
        return;
    }
    assert!(
        a.len() > (m - 1) * a_rs + (k - 1) * a_cs,
        "sgemm: a is too short for its strides"
    );
    assert!(
        b.len() > (k - 1) * b_rs + (n - 1) * b_cs,
        "sgemm: b is too short for its strides"
    );
    let parallel = parallel && m * n * k >= PAR_MIN_FLOPS;
    if avx512() {
        let p = Problem {
            m,
            n,
            k,
            alpha,
            beta,
            a,
            a_rs,
            a_cs,
            b,
            b_rs,
            b_cs,
            c: CPtr(c.as_mut_ptr()),
            c_rs,
            c_cs,
        };
        // SAFETY: AVX-512F was detected; the bounds of a, b and c were checked above and
        // `c` stays mutably borrowed for the whole call.
        unsafe { p.run(parallel) };
    } else {
        // SAFETY: bounds checked above; c is not aliased. The gemm crate computes
        // dst = alpha * dst + beta * lhs @ rhs (its names are the other way round).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                c_cs as isize,
                c_rs as isize,
                beta != 0.0,
                a.as_ptr(),
                a_cs as isize,
                a_rs as isize,
                b.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                beta,
                alpha,
                false,
                false,
                false,
                if parallel {
                    gemm::Parallelism::Rayon(0)
                } else {
                    gemm::Parallelism::None
                },
            )
        }
    }
}

/// Matmul `a [.., m, k] @ b [.., k, n]` with numpy broadcasting of the batch dims (any
/// strides, no copies) through [`sgemm`] for f32 CPU tensors; other dtypes go to candle.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2
        || rb < 2
        || a.dtype() != candle_core::DType::F32
        || b.dtype() != candle_core::DType::F32
    {
        return a.matmul(b);
    }
    let (m, k) = (a.dims()[ra - 2], a.dims()[ra - 1]);
    let n = b.dims()[rb - 1];
    if b.dims()[rb - 2] != k {
        candle_core::bail!(
            "matmul: contracted dims differ: {:?} @ {:?}",
            a.dims(),
            b.dims()
        );
    }
    // the broadcast batch shape
    let r = ra.max(rb) - 2;
    let pad = |d: &[usize]| -> Vec<usize> {
        let mut v = vec![1; r - (d.len() - 2)];
        v.extend_from_slice(&d[..d.len() - 2]);
        v
    };
    let (ba, bb) = (pad(a.dims()), pad(b.dims()));
    let mut batch = Vec::with_capacity(r);
    for (&x, &y) in ba.iter().zip(&bb) {
        batch.push(match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => candle_core::bail!(
                "matmul: batch dims of {:?} and {:?} do not broadcast",
                a.dims(),
                b.dims()
            ),
        });
    }
    let nb: usize = batch.iter().product();
    let ab = a.broadcast_as([batch.as_slice(), &[m, k]].concat())?;
    let bbc = b.broadcast_as([batch.as_slice(), &[k, n]].concat())?;
    let (sta, al) = ab.storage_and_layout();
    let (stb, bl) = bbc.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(av)), Storage::Cpu(CpuStorage::F32(bv))) = (&*sta, &*stb)
    else {
        drop((sta, stb));
        return a.matmul(b);
    };
    let (sa, sb) = (al.stride(), bl.stride());
    // the storage offset of batch entry `i` (row-major over `batch`)
    let off = |st: &[usize], start: usize, mut i: usize| -> usize {
        let mut o = start;
        for d in (0..r).rev() {
            o += (i % batch[d]) * st[d];
            i /= batch[d];
        }
        o
    };
    let one = |i: usize, dst: &mut [f32], par: bool| {
        let (oa, ob) = (off(sa, al.start_offset(), i), off(sb, bl.start_offset(), i));
        sgemm(
            (m, n, k),
            1.0,
            &av[oa..],
            (sa[r], sa[r + 1]),
            &bv[ob..],
            (sb[r], sb[r + 1]),
            0.0,
            dst,
            (n, 1),
            par,
        );
    };
    // `b` the same for every batch entry and `a`'s batch dims folding into its rows (each
    // batch stride is the extent of the dims after it): one GEMM of nb * m rows
    let b_shared = sb[..r]
        .iter()
        .zip(&batch)
        .all(|(&st, &d)| st == 0 || d == 1);
    let a_folds = {
        let (mut ok, mut extent) = (true, m * sa[r]);
        for d in (0..r).rev().filter(|&d| batch[d] != 1) {
            ok &= sa[d] == extent;
            extent = batch[d] * sa[d];
        }
        ok
    };
    let mut out = vec![0f32; nb * m * n];
    if m * n == 0 {
    } else if nb == 1 || (b_shared && a_folds) {
        let (oa, ob) = (al.start_offset(), bl.start_offset());
        sgemm(
            (nb * m, n, k),
            1.0,
            &av[oa..],
            (sa[r], sa[r + 1]),
            &bv[ob..],
            (sb[r], sb[r + 1]),
            0.0,
            &mut out,
            (n, 1),
            true,
        );
    } else if nb >= rayon::current_num_threads() && m * n * k >= 1 << 14 {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(i, d)| one(i, d, false));
    } else {
        out.chunks_mut(m * n)
            .enumerate()
            .for_each(|(i, d)| one(i, d, true));
    }
    drop((sta, stb));
    let mut full = batch;
    full.extend([m, n]);
    Tensor::from_vec(out, full, &candle_core::Device::Cpu)
}

/// The raw pointer to C that tasks share; each task writes its own tiles.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: tasks write disjoint tiles of C (see `Problem::run`), and the slice it points
// into outlives the parallel section.
unsafe impl Send for CPtr {}
unsafe impl Sync for CPtr {}

struct Problem<'a> {
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    a: &'a [f32],
    a_rs: usize,
    a_cs: usize,
    b: &'a [f32],
    b_rs: usize,
    b_cs: usize,
    c: CPtr,
    c_rs: usize,
    c_cs: usize,
}

/// A cache line of floats, so packed panels start 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

thread_local! {
    /// Packing buffers kept between calls (taken out while in use, so a nested call on
    /// the same thread, as rayon's work stealing can make, just allocates its own).
    static BUFS: std::cell::Cell<(Vec<Line>, Vec<Line>)> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

fn floats(v: &mut Vec<Line>, len: usize) -> &mut [f32] {
    let lines = len.div_ceil(16);
    if v.len() < lines {
        v.resize(lines, Line([0.0; 16]));
    }
    // SAFETY: `Line` is 16 f32s with no padding; the vec holds at least `len` floats.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut f32, len) }
}

/// Packs rows `i0..i0 + mr` (`mr <= MR`), depth `p0..p0 + kc` of A as `dst[p * MR + i]`,
/// zero-padding rows past `mr`.
fn pack_a(
    dst: &mut [f32],
    a: &[f32],
    (rs, cs): (usize, usize),
    i0: usize,
    mr: usize,
    p0: usize,
    kc: usize,
) {
    let dst = &mut dst[..kc * MR];
    if rs == 1 && mr > 1 {
        for (p, d) in dst.chunks_exact_mut(MR).enumerate() {
            let s = i0 + (p0 + p) * cs;
            d[..mr].copy_from_slice(&a[s..s + mr]);
            d[mr..].iter_mut().for_each(|v| *v = 0.0);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if cs == 1 && avx512() {
        // SAFETY: AVX-512F detected.
        unsafe { transpose_into(dst, MR, 0, a, i0 * rs + p0, rs, mr, kc) };
        return;
    }
    for i in 0..MR {
        if i < mr {
            let s = (i0 + i) * rs + p0 * cs;
            let src = &a[s..=s + (kc - 1) * cs];
            if cs == 1 {
                dst.chunks_exact_mut(MR)
                    .zip(src)
                    .for_each(|(d, &v)| d[i] = v);
            } else {
                dst.chunks_exact_mut(MR)
                    .zip(src.iter().step_by(cs))
                    .for_each(|(d, &v)| d[i] = v);
            }
        } else {
            dst.chunks_exact_mut(MR).for_each(|d| d[i] = 0.0);
        }
    }
}

/// Packs columns `j0..j0 + nr` (`nr <= NR`), depth `p0..p0 + kc` of B as `dst[p * NR + j]`,
/// zero-padding columns past `nr`.
fn pack_b(
    dst: &mut [f32],
    b: &[f32],
    (rs, cs): (usize, usize),
    j0: usize,
    nr: usize,
    p0: usize,
    kc: usize,
) {
    let dst = &mut dst[..kc * NR];
    if cs == 1 && nr > 1 {
        for (p, d) in dst.chunks_exact_mut(NR).enumerate() {
            let s = (p0 + p) * rs + j0;
            d[..nr].copy_from_slice(&b[s..s + nr]);
            d[nr..].iter_mut().for_each(|v| *v = 0.0);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if rs == 1 && avx512() {
        for h in [0, 16] {
            // SAFETY: AVX-512F detected.
            unsafe {
                transpose_into(
                    dst,
                    NR,
                    h,
                    b,
                    (j0 + h) * cs + p0,
                    cs,
                    nr.saturating_sub(h).min(16),
                    kc,
                )
            };
        }
        return;
    }
    for j in 0..NR {
        if j < nr {
            let s = (j0 + j) * cs + p0 * rs;
            let src = &b[s..=s + (kc - 1) * rs];
            if rs == 1 {
                dst.chunks_exact_mut(NR)
                    .zip(src)
                    .for_each(|(d, &v)| d[j] = v);
            } else {
                dst.chunks_exact_mut(NR)
                    .zip(src.iter().step_by(rs))
                    .for_each(|(d, &v)| d[j] = v);
            }
        } else {
            dst.chunks_exact_mut(NR).for_each(|d| d[j] = 0.0);
        }
    }
}

/// `dst[p * w + off + l] = src[base + l * ls + p]` for `p < kc` and `l < lines`, zero for
/// `lines <= l < min(16, w - off)`: `lines` source lines, contiguous along `p`, written
/// across a packed panel of row width `w`, 16 x 16 blocks at a time through registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
fn transpose_into(
    dst: &mut [f32],
    w: usize,
    off: usize,
    src: &[f32],
    base: usize,
    ls: usize,
    lines: usize,
    kc: usize,
) {
    use std::arch::x86_64::*;
    let lanes = 16.min(w - off);
    let mask = ((1u32 << lanes) - 1) as __mmask16;
    let mut p = 0;
    while p + 16 <= kc {
        let mut r = [_mm512_setzero_ps(); 16];
        for (l, r) in r.iter_mut().enumerate().take(lines) {
            let s = &src[base + l * ls + p..][..16];
            // SAFETY: s holds 16 floats.
            *r = unsafe { _mm512_loadu_ps(s.as_ptr()) };
        }
        transpose16(&mut r);
        for (t, r) in r.iter().enumerate() {
            let d = &mut dst[(p + t) * w + off..][..lanes];
            // SAFETY: the mask keeps to d's `lanes` floats.
            unsafe { _mm512_mask_storeu_ps(d.as_mut_ptr(), mask, *r) };
        }
        p += 16;
    }
    for p in p..kc {
        for (l, d) in dst[p * w + off..][..lanes].iter_mut().enumerate() {
            *d = if l < lines {
                src[base + l * ls + p]
            } else {
                0.0
            };
        }
    }
}

/// Transposes a 16 x 16 block held as 16 rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &mut [std::arch::x86_64::__m512; 16]) {
    use std::arch::x86_64::*;
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for g in (0..16).step_by(4) {
        r[g] = _mm512_shuffle_ps::<0x44>(t[g], t[g + 2]);
        r[g + 1] = _mm512_shuffle_ps::<0xEE>(t[g], t[g + 2]);
        r[g + 2] = _mm512_shuffle_ps::<0x44>(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_shuffle_ps::<0xEE>(t[g + 1], t[g + 3]);
    }
    for b in [0, 8] {
        for i in 0..4 {
            t[b + i] = _mm512_shuffle_f32x4::<0x88>(r[b + i], r[b + 4 + i]);
            t[b + 4 + i] = _mm512_shuffle_f32x4::<0xDD>(r[b + i], r[b + 4 + i]);
        }
    }
    for i in 0..8 {
        r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
        r[8 + i] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[8 + i]);
    }
}

fn for_each(parallel: bool, n: usize, f: impl Fn(usize) + Sync + Send) {
    if parallel && n > 1 {
        (0..n).into_par_iter().for_each(f);
    } else {
        (0..n).for_each(f);
    }
}

/// `f` on each `size`-element chunk of `buf` with its index (in rayon tasks when
/// `parallel` and there is more than one chunk).
fn for_each_chunk(
    parallel: bool,
    buf: &mut [f32],
    size: usize,
    f: impl Fn((usize, &mut [f32])) + Sync + Send,
) {
    if parallel && buf.len() > size {
        buf.par_chunks_mut(size).enumerate().for_each(f);
    } else {
        buf.chunks_mut(size).enumerate().for_each(f);
    }
}

impl Problem<'_> {
    /// # Safety
    /// AVX-512F must be available, and `self.c` must point at a live, unaliased buffer
    /// holding every element `i * c_rs + j * c_cs` for `i < m`, `j < n`; `a` and `b` must
    /// hold every element their strides reach.
    unsafe fn run(&self, parallel: bool) {
        let (mut bbuf, mut abuf) = BUFS.with(|b| b.take());
        let bcap = KC * NC.min(self.n.div_ceil(NR) * NR);
        let acap = KC * MB.min(self.m.div_ceil(MR) * MR);
        for jc in (0..self.n).step_by(NC) {
            let nc = NC.min(self.n - jc);
            let npan = nc.div_ceil(NR);
            for pc in (0..self.k).step_by(KC) {
                let kc = KC.min(self.k - pc);
                let beta = if pc == 0 { self.beta } else { 1.0 };
                let bp = &mut floats(&mut bbuf, bcap)[..npan * kc * NR];
                let pb = |(t, d): (usize, &mut [f32])| {
                    pack_b(
                        d,
                        self.b,
                        (self.b_rs, self.b_cs),
                        jc + t * NR,
                        NR.min(nc - t * NR),
                        pc,
                        kc,
                    )
                };
                for_each_chunk(parallel, bp, kc * NR, pb);
                let bp: &[f32] = bp;
                for ic in (0..self.m).step_by(MB) {
                    let mb = MB.min(self.m - ic);
                    let mpan = mb.div_ceil(MR);
                    let ap = &mut floats(&mut abuf, acap)[..mpan * kc * MR];
                    let pa = |(t, d): (usize, &mut [f32])| {
                        pack_a(
                            d,
                            self.a,
                            (self.a_rs, self.a_cs),
                            ic + t * MR,
                            MR.min(mb - t * MR),
                            pc,
                            kc,
                        )
                    };
                    for_each_chunk(parallel, ap, kc * MR, pa);
                    let ap: &[f32] = ap;
                    let (tm, tn) = (mb.div_ceil(MC), nc.div_ceil(NT));
                    for_each(parallel, tm * tn, |t| {
                        let (i0, j0) = ((t / tn) * MC, (t % tn) * NT);
                        let (i1, j1) = ((i0 + MC).min(mb), (j0 + NT).min(nc));
                        for jr in (j0..j1).step_by(NR) {
                            let nr = NR.min(j1 - jr);
                            let bpan = &bp[(jr / NR) * kc * NR..][..kc * NR];
                            for ir in (i0..i1).step_by(MR) {
                                let mr = MR.min(i1 - ir);
                                let apan = &ap[(ir / MR) * kc * MR..][..kc * MR];
                                // SAFETY: tile (ic + ir.., jc + jr..) of mr x nr lies inside C
                                // (mr, nr are clipped to m, n) and no other task writes it.
                                unsafe {
                                    let c =
                                        self.c.0.add((ic + ir) * self.c_rs + (jc + jr) * self.c_cs);
                                    tile(
                                        mr,
                                        kc,
                                        apan.as_ptr(),
                                        bpan.as_ptr(),
                                        c,
                                        self.c_rs,
                                        self.c_cs,
                                        nr,
                                        self.alpha,
                                        beta,
                                    );
                                }
                            }
                        }
                    });
                }
            }
        }
        BUFS.with(|b| b.set((bbuf, abuf)));
    }
}

/// Runs the kernel for an `mr`-row tile (`1 <= mr <= MR`).
///
/// # Safety
/// As the kernels: AVX-512F available; `a` holds `kc * MR` floats, `b` `kc * NR`; `c`
/// reaches `i * c_rs + j * c_cs` for `i < mr`, `j < nr <= NR`, and no one else accesses
/// those elements during the call.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile(
    mr: usize,
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    c_rs: usize,
    c_cs: usize,
    nr: usize,
    alpha: f32,
    beta: f32,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match mr {
            12 => k12(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            11 => k11(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            10 => k10(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            9 => k9(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            8 => k8(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            7 => k7(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            6 => k6(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            5 => k5(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            4 => k4(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            3 => k3(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            2 => k2(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            1 => k1(kc, a, b, c, c_rs, c_cs, nr, alpha, beta),
            _ => unreachable!("tile rows {mr}"),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile(
    _: usize,
    _: usize,
    _: *const f32,
    _: *const f32,
    _: *mut f32,
    _: usize,
    _: usize,
    _: usize,
    _: f32,
    _: f32,
) {
    unreachable!("the AVX-512 kernel only runs on x86_64")
}

/// Writes row `i` of the tile, `alpha * (acc0, acc1) + beta * C`, under the column masks
/// (or element by element when C's columns are strided).
#[cfg(target_arch = "x86_64")]
macro_rules! store_row {
    ($c:ident, $c_rs:ident, $c_cs:ident, $nr:ident, $m0:ident, $m1:ident, $va:ident, $vb:ident, $alpha:ident, $beta:ident, $i:expr, $acc0:expr, $acc1:expr) => {{
        let row = $c.add($i * $c_rs);
        let (mut r0, mut r1) = (_mm512_mul_ps($acc0, $va), _mm512_mul_ps($acc1, $va));
        if $c_cs == 1 {
            if $beta != 0.0 {
                r0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps($m0, row), $vb, r0);
                r1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps($m1, row.add(16)), $vb, r1);
            }
            _mm512_mask_storeu_ps(row, $m0, r0);
            _mm512_mask_storeu_ps(row.add(16), $m1, r1);
        } else {
            let mut t = [0f32; NR];
            _mm512_storeu_ps(t.as_mut_ptr(), r0);
            _mm512_storeu_ps(t.as_mut_ptr().add(16), r1);
            for (j, &v) in t.iter().enumerate().take($nr) {
                let e = row.add(j * $c_cs);
                *e = if $beta == 0.0 { v } else { v + $beta * *e };
            }
        }
    }};
}

/// The micro-kernels, one per tile height: `C[R x nr] = alpha * A_panel @ B_panel +
/// beta * C` for packed panels of depth `kc` (`a[p * MR + i]`, `b[p * NR + j]`). The rows
/// are spelled out (not a loop over an array) so that the accumulators live in
/// registers even where this crate is built at opt-level 1 (the dev profile).
#[cfg(target_arch = "x86_64")]
macro_rules! kernels {
    ($($name:ident [$($i:literal)*];)*) => {$(
        /// # Safety
        /// As [`tile`].
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f")]
        unsafe fn $name(kc: usize, a: *const f32, b: *const f32, c: *mut f32, c_rs: usize, c_cs: usize, nr: usize, alpha: f32, beta: f32) {
            use std::arch::x86_64::*;
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            let (mut ap, mut bp) = (a, b);
            // SAFETY (this block): p < kc, so both panels are read in bounds; the
            // stores keep to the tile (rows i < R, masks or nr for the columns).
            unsafe {
                for _ in 0..kc {
                    let b0 = _mm512_loadu_ps(bp);
                    let b1 = _mm512_loadu_ps(bp.add(16));
                    $(
                        let ai = _mm512_set1_ps(*ap.add($i));
                        acc[$i][0] = _mm512_fmadd_ps(ai, b0, acc[$i][0]);
                        acc[$i][1] = _mm512_fmadd_ps(ai, b1, acc[$i][1]);
                    )*
                    ap = ap.add(MR);
                    bp = bp.add(NR);
                }
                let va = _mm512_set1_ps(alpha);
                let vb = _mm512_set1_ps(beta);
                let m0: __mmask16 = if nr >= 16 { 0xffff } else { ((1u32 << nr) - 1) as u16 };
                let m1: __mmask16 = if nr >= 32 { 0xffff } else if nr > 16 { ((1u32 << (nr - 16)) - 1) as u16 } else { 0 };
                $( store_row!(c, c_rs, c_cs, nr, m0, m1, va, vb, alpha, beta, $i, acc[$i][0], acc[$i][1]); )*
            }
        }
    )*};
}

#[cfg(target_arch = "x86_64")]
kernels! {
    k1 [0];
    k2 [0 1];
    k3 [0 1 2];
    k4 [0 1 2 3];
    k5 [0 1 2 3 4];
    k6 [0 1 2 3 4 5];
    k7 [0 1 2 3 4 5 6];
    k8 [0 1 2 3 4 5 6 7];
    k9 [0 1 2 3 4 5 6 7 8];
    k10 [0 1 2 3 4 5 6 7 8 9];
    k11 [0 1 2 3 4 5 6 7 8 9 10];
    k12 [0 1 2 3 4 5 6 7 8 9 10 11];
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift) of values in [-1, 1).
    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn naive(
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: &[f32],
        (ars, acs): (usize, usize),
        b: &[f32],
        (brs, bcs): (usize, usize),
        beta: f32,
        c: &mut [f32],
        (crs, ccs): (usize, usize),
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    s += a[i * ars + p * acs] as f64 * b[p * brs + j * bcs] as f64;
                }
                let e = &mut c[i * crs + j * ccs];
                *e = (alpha as f64 * s
                    + if beta == 0.0 {
                        0.0
                    } else {
                        beta as f64 * *e as f64
                    }) as f32;
            }
        }
    }

    /// Checks one shape for every combination of operand layouts, beta and parallelism.
    fn check(m: usize, n: usize, k: usize, seed: u64) {
        let a = rand(m * k + 3, seed);
        let b = rand(k * n + 5, seed + 1);
        let c0 = rand(m * n * 2 + 1, seed + 2);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            // row-major [m, k] or its transpose stored [k, m]; offset 1/2 to test starts
            let sa = if ta { (1, m) } else { (k, 1) };
            let sb = if tb { (1, k) } else { (n, 1) };
            for (alpha, beta) in [(1.0, 0.0), (1.0, 1.0), (0.5, -2.0)] {
                for par in [false, true] {
                    // c with a padded row stride, and once column-major
                    for sc in [(n + 1, 1), (1, m + 1)] {
                        let mut want = c0.clone();
                        let mut got = c0.clone();
                        if beta == 0.0 {
                            got.iter_mut().for_each(|v| *v = f32::NAN);
                        }
                        naive(
                            (m, n, k),
                            alpha,
                            &a[1..],
                            sa,
                            &b[2..],
                            sb,
                            beta,
                            &mut want,
                            sc,
                        );
                        sgemm(
                            (m, n, k),
                            alpha,
                            &a[1..],
                            sa,
                            &b[2..],
                            sb,
                            beta,
                            &mut got,
                            sc,
                            par,
                        );
                        let tol = 1e-5 * (k as f32).sqrt().max(1.0) * 4.0;
                        for i in 0..m {
                            for j in 0..n {
                                let (w, g) = (want[i * sc.0 + j * sc.1], got[i * sc.0 + j * sc.1]);
                                assert!(
                                    (w - g).abs() <= tol * (1.0 + w.abs()),
                                    "m{m} n{n} k{k} ta{ta} tb{tb} a{alpha} b{beta} par{par} c{sc:?} at ({i},{j}): {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn sgemm_matches_naive_small() {
        let sizes = [1usize, 2, 3, 5, 11, 12, 13, 16, 17, 31, 32, 33, 47];
        let mut seed = 1;
        for &m in &sizes {
            for &n in &sizes {
                for k in [1usize, 2, 7, 33] {
                    seed += 3;
                    check(m, n, k, seed);
                }
            }
        }
    }

    #[test]
    fn sgemm_matches_naive_blocked() {
        // past KC in depth, several tasks and micro-panels, odd tails everywhere
        for (i, &(m, n, k)) in [
            (97, 131, 300),
            (25, 290, 513),
            (200, 65, 257),
            (130, 300, 64),
            (1, 300, 600),
            (300, 1, 40),
        ]
        .iter()
        .enumerate()
        {
            check(m, n, k, 100 + i as u64);
        }
    }

    #[test]
    fn packing_transposes() {
        // A row-major and B column-major go through the register transpose; every line
        // count and a depth tail
        let src = rand(40 * 40, 7);
        for lines in 0..=MR {
            let mut d = vec![f32::NAN; 37 * MR];
            pack_a(&mut d, &src, (40, 1), 1, lines, 2, 37);
            for p in 0..37 {
                for i in 0..MR {
                    let want = if i < lines {
                        src[(1 + i) * 40 + 2 + p]
                    } else {
                        0.0
                    };
                    assert_eq!(d[p * MR + i], want, "a lines {lines} p {p} i {i}");
                }
            }
        }
        for nr in [1, 5, 16, 17, 31, 32] {
            let mut d = vec![f32::NAN; 37 * NR];
            pack_b(&mut d, &src, (1, 40), 3, nr, 2, 37);
            for p in 0..37 {
                for j in 0..NR {
                    let want = if j < nr {
                        src[(3 + j) * 40 + 2 + p]
                    } else {
                        0.0
                    };
                    assert_eq!(d[p * NR + j], want, "b nr {nr} p {p} j {j}");
                }
            }
        }
    }

    #[test]
    fn sgemm_degenerate() {
        // k = 0: c = beta * c; m or n = 0: nothing
        let mut c = vec![2.0f32; 6];
        sgemm(
            (2, 3, 0),
            1.0,
            &[],
            (0, 1),
            &[],
            (3, 1),
            0.5,
            &mut c,
            (3, 1),
            true,
        );
        assert_eq!(c, vec![1.0; 6]);
        sgemm(
            (2, 3, 0),
            1.0,
            &[],
            (0, 1),
            &[],
            (3, 1),
            0.0,
            &mut c,
            (3, 1),
            false,
        );
        assert_eq!(c, vec![0.0; 6]);
        sgemm(
            (0, 3, 4),
            1.0,
            &[],
            (4, 1),
            &[0.0; 12],
            (3, 1),
            0.0,
            &mut [],
            (3, 1),
            false,
        );
    }

    #[test]
    fn matmul_broadcast_matches_candle() {
        use candle_core::{Device, Tensor};
        let dev = Device::Cpu;
        let t =
            |d: &[usize], seed| Tensor::from_vec(rand(d.iter().product(), seed), d, &dev).unwrap();
        // (a, b, the broadcast batch shape)
        let cases: Vec<(Tensor, Tensor, Vec<usize>)> = vec![
            (t(&[5, 7], 1), t(&[7, 3], 2), vec![]),
            (t(&[2, 3, 5, 7], 3), t(&[7, 4], 4), vec![2, 3]),
            (t(&[2, 3, 5, 7], 5), t(&[3, 7, 4], 6), vec![2, 3]),
            (t(&[2, 1, 5, 7], 7), t(&[1, 4, 7, 6], 8), vec![2, 4]),
            (
                t(&[4, 6, 5], 9).transpose(1, 2).unwrap(),
                t(&[4, 9, 6], 10).transpose(1, 2).unwrap(),
                vec![4],
            ),
            (
                t(&[3, 8, 2, 40], 11).transpose(1, 2).unwrap(),
                t(&[3, 2, 40, 33], 12),
                vec![3, 2],
            ),
            // b shared by the batch: folded into one GEMM when a's rows allow it
            (t(&[3, 1, 5, 7], 13), t(&[7, 4], 14), vec![3, 1]),
            (
                t(&[4, 6, 5], 15).transpose(1, 2).unwrap(),
                t(&[6, 3], 16),
                vec![4],
            ),
            (
                t(&[5, 2, 7], 17).transpose(0, 1).unwrap(),
                t(&[1, 7, 3], 18),
                vec![2],
            ),
            (
                t(&[2, 5, 7], 19).narrow(1, 1, 3).unwrap(),
                t(&[7, 3], 20),
                vec![2],
            ),
        ];
        for (a, b, batch) in cases {
            let full = |x: &Tensor| {
                let r = x.rank();
                x.broadcast_as([batch.as_slice(), &x.dims()[r - 2..]].concat())
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let want = full(&a).matmul(&full(&b)).unwrap();
            let got = matmul(&a, &b).unwrap();
            assert_eq!(got.dims(), want.dims());
            let d = (got - want)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-4, "{d}");
        }
    }
}

// Causal / masked scaled dot-product attention, forward and backward, flash style: no
// S x S matrix, online softmax, GQA (kv head = q head / (Nq / Nkv)), causal alignment to
// the last Sq keys (query i sees keys j <= i + Sk - Sq), and with `window` > 0 (causal
// only) HF's sliding window: only keys i + Sk - Sq - window < j. Every kernel visits only
// the keys (tiles) of the band and masks where a tile is cut by one of its edges.
//
// - attn_fwd_generic_*: one warp per query row, any head dim up to 256, f32/bf16/f16,
//   optional bool keep-mask [Bm, Hm, Sq, Sk] (masked scores get -FLT_MAX added, as the CPU
//   reference does, so fully masked rows come out uniform); the only kernels with the rest
//   of the op's attributes (docs/attention.md): logit soft-capping (before the mask), a
//   value head dim Dv != D, per-head sinks, and the log-sum-exp as a result (and its
//   gradient in the backward).
// - fa_fwd_d64 / fa_fwd_d128: bf16, tensor cores (mma.sync m16n8k16, ldmatrix, cp.async
//   double buffering), 64 queries x 64 keys per tile, 4 warps.
// - attn_bwd_*: FlashAttention-2 backward from the forward's log-sum-exp: dK/dV per key
//   tile in registers, dQ accumulated in f32 with atomics.

// ---------------------------------------------------------------- generic forward

// Element offset of row (b, h, i) of a per-head tensor: [B, N, S, Dx], or [B, S, N, Dx] when bshd
// (`layout=bshd`). The generic kernels read and write either layout; the statistics (lse, delta,
// dlse) are indexed by the [B, N, S] row in both.
__device__ __forceinline__ i64 head_row(int bshd, i64 b, i64 h, i64 i, i64 N, i64 S, i64 Dx) {
    return (bshd ? (b * S + i) * N + h : (b * N + h) * S + i) * Dx;
}

#define DEF_ATTN_GENERIC(S_, T)                                                                           \
    extern "C" __global__ void attn_fwd_generic_##S_(T* out, float* lse, const T* q, const T* k, const T* v, \
            const u8* mask, int mb, int mh, int Nq, int Nkv, i64 Sq, i64 Sk, int D, float scale, int causal, \
            i64 lstride, i64 window, int Dv, float softcap, const void* sinks, int sinks_f32, float* lse_out, \
            int bshd) {                                                                                   \
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;                                             \
        i64 i = (i64)blockIdx.x * (blockDim.x >> 5) + warp;                                               \
        if (i >= Sq) return;                                                                              \
        int h = blockIdx.y, b = blockIdx.z, hk = h / (Nq / Nkv);                                          \
        const T* qr = q + head_row(bshd, b, h, i, Nq, Sq, D);                                             \
        float qv[8], acc[8];                                                                              \
        _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                                   \
            int d = lane + 32 * t;                                                                        \
            qv[t] = d < D ? tof(qr[d]) : 0.f;                                                             \
            acc[t] = 0.f;                                                                                 \
        }                                                                                                 \
        float m = -INFINITY, l = 0.f;                                                                     \
        i64 off = Sk - Sq;                                                                                \
        i64 jend = (causal && !mask) ? (i + off + 1 < Sk ? i + off + 1 : Sk) : Sk;                        \
        i64 jbeg = (causal && window > 0 && !mask && i + off - window + 1 > 0) ? i + off - window + 1 : 0; \
        const u8* mrow = mask ? mask + (((i64)(mb > 1 ? b : 0) * mh + (mh > 1 ? h : 0)) * Sq + i) * Sk : 0; \
        for (i64 j = jbeg; j < jend; ++j) {                                                               \
            const T* kr = k + head_row(bshd, b, hk, j, Nkv, Sk, D);                                       \
            float dot = 0.f;                                                                              \
            _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                               \
                int d = lane + 32 * t;                                                                    \
                if (d < D) dot += qv[t] * tof(kr[d]);                                                     \
            }                                                                                             \
            float s = warp_sum(dot) * scale;                                                              \
            if (softcap > 0.f) s = softcap * tanhf(s / softcap);                                          \
            if (mask) {                                                                                   \
                bool keep = mrow[j] != 0 && (!causal || (j <= i + off && (window <= 0 || j > i + off - window))); \
                if (!keep) s += NEG_BIG;                                                                  \
            }                                                                                             \
            float mn = fmaxf(m, s);                                                                       \
            float corr = __expf(m - mn);                                                                  \
            float p = __expf(s - mn);                                                                     \
            l = l * corr + p;                                                                             \
            const T* vr = v + head_row(bshd, b, hk, j, Nkv, Sk, Dv);                                      \
            _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                               \
                int d = lane + 32 * t;                                                                    \
                if (d < Dv) acc[t] = acc[t] * corr + p * tof(vr[d]);                                      \
            }                                                                                             \
            m = mn;                                                                                       \
        }                                                                                                 \
        /* a sink joins the row's softmax (its probability is dropped, not its mass) */                   \
        if (sinks) {                                                                                      \
            float sv = sinks_f32 ? ((const float*)sinks)[h] : tof(((const T*)sinks)[h]);                  \
            float mn = fmaxf(m, sv);                                                                      \
            float corr = __expf(m - mn);                                                                  \
            l = l * corr + __expf(sv - mn);                                                               \
            _Pragma("unroll") for (int t = 0; t < 8; ++t) acc[t] *= corr;                                 \
            m = mn;                                                                                       \
        }                                                                                                 \
        T* orow = out + head_row(bshd, b, h, i, Nq, Sq, Dv);                                              \
        float inv = l > 0.f ? 1.f / l : 0.f;                                                              \
        _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                                   \
            int d = lane + 32 * t;                                                                        \
            if (d < Dv) orow[d] = fromf<T>(acc[t] * inv);                                                 \
        }                                                                                                 \
        /* the row max and the sum separately: m + log(l) loses log(l) when m is -FLT_MAX (masked rows) */ \
        if (lse && lane == 0) { lse[((i64)b * Nq + h) * Sq + i] = m; lse[lstride + ((i64)b * Nq + h) * Sq + i] = l; } \
        if (lse_out && lane == 0) lse_out[((i64)b * Nq + h) * Sq + i] = m + logf(l);                      \
    }
FOR_FLOATS(DEF_ATTN_GENERIC)

// ---------------------------------------------------------------- generic backward
// delta[row] = sum_d dO[row, d] * O[row, d] (f32), one warp per [B, N, S] row (o and dout [B, N, S, D],
// or [B, S, N, D] when bshd).
#define DEF_ATTN_DELTA(S_, T)                                                                             \
    extern "C" __global__ void attn_delta_##S_(float* delta, const T* o, const T* dout, i64 rows, int D,   \
                                               int N, i64 S, int bshd) {                                  \
        i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;                                        \
        int lane = threadIdx.x & 31;                                                                      \
        if (r >= rows) return;                                                                            \
        i64 at = bshd ? head_row(1, r / ((i64)N * S), (r / S) % N, r % S, N, S, D) : r * D;               \
        float acc = 0.f;                                                                                  \
        for (int d = lane; d < D; d += 32) acc += tof(o[at + d]) * tof(dout[at + d]);                     \
        acc = warp_sum(acc);                                                                              \
        if (lane == 0) delta[r] = acc;                                                                    \
    }
FOR_FLOATS(DEF_ATTN_DELTA)

// One warp per query row: dq directly; dk, dv accumulated into f32 buffers with atomics.
#define DEF_ATTN_BWD_GENERIC(S_, T)                                                                       \
    extern "C" __global__ void attn_bwd_generic_##S_(T* dq, float* dk_acc, float* dv_acc, const T* q,      \
            const T* k, const T* v, const T* dout, const float* lse, const float* delta, const u8* mask,   \
            int mb, int mh, int Nq, int Nkv, i64 Sq, i64 Sk, int D, float scale, int causal, i64 lstride,  \
            i64 window, int Dv, float softcap, const void* sinks, int sinks_f32, float* dsinks_acc,          \
            const float* dlse, int bshd) {                                                                \
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;                                             \
        i64 i = (i64)blockIdx.x * (blockDim.x >> 5) + warp;                                               \
        if (i >= Sq) return;                                                                              \
        int h = blockIdx.y, b = blockIdx.z, hk = h / (Nq / Nkv);                                          \
        i64 qrow = ((i64)b * Nq + h) * Sq + i;                                                            \
        const T* qr = q + head_row(bshd, b, h, i, Nq, Sq, D);                                             \
        const T* dor = dout + head_row(bshd, b, h, i, Nq, Sq, Dv);                                        \
        float qv[8], dov[8], dqa[8];                                                                      \
        _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                                   \
            int d = lane + 32 * t;                                                                        \
            qv[t] = d < D ? tof(qr[d]) : 0.f;                                                             \
            dov[t] = d < Dv ? tof(dor[d]) : 0.f;                                                          \
            dqa[t] = 0.f;                                                                                 \
        }                                                                                                 \
        /* D = rowsum(dO o O) - dlse: an explicit log-sum-exp result's gradient enters here */            \
        float M = lse[qrow], Linv = 1.f / lse[lstride + qrow], dl = delta[qrow] - (dlse ? dlse[qrow] : 0.f); \
        i64 off = Sk - Sq;                                                                                \
        i64 jend = (causal && !mask) ? (i + off + 1 < Sk ? i + off + 1 : Sk) : Sk;                        \
        i64 jbeg = (causal && window > 0 && !mask && i + off - window + 1 > 0) ? i + off - window + 1 : 0; \
        const u8* mrow = mask ? mask + (((i64)(mb > 1 ? b : 0) * mh + (mh > 1 ? h : 0)) * Sq + i) * Sk : 0; \
        for (i64 j = jbeg; j < jend; ++j) {                                                               \
            const i64 kj = head_row(bshd, b, hk, j, Nkv, Sk, D), vj = head_row(bshd, b, hk, j, Nkv, Sk, Dv); \
            const T* kr = k + kj;                                                                         \
            const T* vr = v + vj;                                                                         \
            float dot = 0.f, dpv = 0.f;                                                                   \
            _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                               \
                int d = lane + 32 * t;                                                                    \
                if (d < D) dot += qv[t] * tof(kr[d]);                                                     \
                if (d < Dv) dpv += dov[t] * tof(vr[d]);                                                   \
            }                                                                                             \
            float s = warp_sum(dot) * scale;                                                              \
            float capped = 0.f;                                                                           \
            if (softcap > 0.f) { capped = tanhf(s / softcap); s = softcap * capped; }                     \
            float dp = warp_sum(dpv);                                                                     \
            if (mask) {                                                                                   \
                bool keep = mrow[j] != 0 && (!causal || (j <= i + off && (window <= 0 || j > i + off - window))); \
                if (!keep) s += NEG_BIG;                                                                  \
            }                                                                                             \
            float p = __expf(s - M) * Linv;                                                               \
            float ds = p * (dp - dl);                                                                     \
            if (softcap > 0.f) ds *= 1.f - capped * capped;                                               \
            _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                               \
                int d = lane + 32 * t;                                                                    \
                if (d < D) {                                                                              \
                    dqa[t] += ds * tof(kr[d]);                                                            \
                    atomicAdd(dk_acc + kj + d, ds * qv[t] * scale);                                       \
                }                                                                                         \
                if (d < Dv) atomicAdd(dv_acc + vj + d, p * dov[t]);                                       \
            }                                                                                             \
        }                                                                                                 \
        _Pragma("unroll") for (int t = 0; t < 8; ++t) {                                                   \
            int d = lane + 32 * t;                                                                        \
            if (d < D) dq[head_row(bshd, b, h, i, Nq, Sq, D) + d] = fromf<T>(dqa[t] * scale);             \
        }                                                                                                 \
        /* the sink's logit: dsink_h = -sum_i P_sink(i) D(i) */                                           \
        if (sinks && lane == 0) {                                                                         \
            float sv = sinks_f32 ? ((const float*)sinks)[h] : tof(((const T*)sinks)[h]);                  \
            atomicAdd(dsinks_acc + h, -__expf(sv - M) * Linv * dl);                                       \
        }                                                                                                 \
    }
FOR_FLOATS(DEF_ATTN_BWD_GENERIC)

// f32 accumulators to storage dtype (optionally scaled).
#define DEF_F32_TO(S_, T)                                                                                 \
    extern "C" __global__ void f32_to_##S_(T* out, const float* in, i64 n, float scale) {                  \
        GRID_STRIDE(i, n) out[i] = fromf<T>(in[i] * scale);                                               \
    }
FOR_FLOATS(DEF_F32_TO)

// ---------------------------------------------------------------- tensor-core helpers

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    u32 d = smem_u32(smem);
    int sz = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gmem), "r"(sz));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(u32*)&v;
}

// Loads `rows` x D bf16 rows starting at global row `row0` (of `total` rows, each D wide)
// into shared memory with row stride LD; rows past the end are zero-filled.
template <int D, int LD, int ROWS>
__device__ __forceinline__ void load_rows(__nv_bfloat16* sm, const __nv_bfloat16* g, i64 row0, i64 total) {
    constexpr int CH = D / 8;
    for (int c = threadIdx.x; c < ROWS * CH; c += blockDim.x) {
        int r = c / CH, cc = c % CH;
        i64 gr = row0 + r;
        bool ok = gr < total;
        cp_async16(sm + r * LD + cc * 8, g + (ok ? gr : 0) * D + cc * 8, ok);
    }
}

// ---------------------------------------------------------------- tensor-core forward

// MT = 16-row m-tiles per warp: with 2, every K and V fragment loaded from shared memory
// feeds two MMAs (shared-memory bandwidth, not the tensor cores, bounds the loop at MT = 1).
template <int D, int NW, int MT>
__device__ __forceinline__ void fa_fwd(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                       const __nv_bfloat16* v, int Nq, int Nkv, i64 Sq, i64 Sk, float scale_log2, int causal,
                                       i64 window) {
    constexpr int LD = D + 8;
    constexpr int BR = 16 * NW * MT; // query rows per block
    extern __shared__ __align__(16) unsigned char fa_smem[];
    __nv_bfloat16* sQ = (__nv_bfloat16*)fa_smem;
    __nv_bfloat16* sK = sQ + BR * LD;
    __nv_bfloat16* sV = sK + 2 * 64 * LD;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int qb = causal ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (Nq / Nkv);
    const i64 q0 = (i64)qb * BR;
    const i64 off = Sk - Sq;
    const __nv_bfloat16* qg = q + ((i64)b * Nq + h) * Sq * D;
    const __nv_bfloat16* kg = k + ((i64)b * Nkv + hk) * Sk * D;
    const __nv_bfloat16* vg = v + ((i64)b * Nkv + hk) * Sk * D;
    i64 nkt = (Sk + 63) / 64;
    if (causal) {
        i64 last = q0 + BR - 1 + off; // last visible key of the block's last row
        i64 lim = last < 0 ? 0 : last / 64 + 1;
        if (lim < nkt) nkt = lim;
    }
    // sliding window: the first key tile the block's first row sees
    i64 kt0 = 0;
    if (causal && window > 0) {
        i64 first = q0 + off - window + 1;
        kt0 = first <= 0 ? 0 : first / 64;
        if (kt0 > nkt) kt0 = nkt;
    }
    load_rows<D, LD, BR>(sQ, qg, q0, Sq);
    if (nkt > kt0) {
        load_rows<D, LD, 64>(sK + (kt0 & 1) * 64 * LD, kg, kt0 * 64, Sk);
        load_rows<D, LD, 64>(sV + (kt0 & 1) * 64 * LD, vg, kt0 * 64, Sk);
    }
    cp_async_commit();

    float o[MT][D / 8][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[t][i][0] = o[t][i][1] = o[t][i][2] = o[t][i][3] = 0.f;
    float mrow[MT][2], lrow[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) mrow[t][0] = mrow[t][1] = -INFINITY, lrow[t][0] = lrow[t][1] = 0.f;
    u32 qf[MT][D / 16][4];
    // row of this thread's first value in m-tile t: q0 + (warp * MT + t) * 16 + lane / 4

    for (i64 kt = kt0; kt < nkt; ++kt) {
        if (kt + 1 < nkt) {
            int nb = (int)((kt + 1) & 1);
            load_rows<D, LD, 64>(sK + nb * 64 * LD, kg, (kt + 1) * 64, Sk);
            load_rows<D, LD, 64>(sV + nb * 64 * LD, vg, (kt + 1) * 64, Sk);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (kt == kt0) {
#pragma unroll
            for (int t = 0; t < MT; ++t)
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks)
                    ldsm_x4(qf[t][ks][0], qf[t][ks][1], qf[t][ks][2], qf[t][ks][3], sQ + ((warp * MT + t) * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
        }
        const __nv_bfloat16* Kb = sK + (kt & 1) * 64 * LD;
        const __nv_bfloat16* Vb = sV + (kt & 1) * 64 * LD;
        float s[MT][8][4];
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int i = 0; i < 8; ++i) s[t][i][0] = s[t][i][1] = s[t][i][2] = s[t][i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, Kb + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma_bf16(s[t][2 * np], qf[t][ks], b0, b1);
                    mma_bf16(s[t][2 * np + 1], qf[t][ks], b2, b3);
                }
            }
        }
        // scale, mask
        const i64 k0 = kt * 64;
        const bool need_mask = (k0 + 64 > Sk) || (causal && k0 + 63 > q0 + off) ||
                               (causal && window > 0 && k0 <= q0 + BR - 1 + off - window);
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[t][nt][e] * scale_log2;
                    if (need_mask) {
                        i64 col = k0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                        i64 qi = q0 + (warp * MT + t) * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
                        if (col >= Sk || (causal && (col > qi + off || (window > 0 && col <= qi + off - window))))
                            x = -INFINITY;
                    }
                    s[t][nt][e] = x;
                }
            }
        // online softmax for the thread's rows
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[t][nt][2 * r], s[t][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
                float mnew = fmaxf(mrow[t][r], mx);
                float msub = mnew == -INFINITY ? 0.f : mnew;
                float corr = exp2f(mrow[t][r] - msub);
                mrow[t][r] = mnew;
                float rs = 0.f;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    float p0 = exp2f(s[t][nt][2 * r] - msub), p1 = exp2f(s[t][nt][2 * r + 1] - msub);
                    s[t][nt][2 * r] = p0;
                    s[t][nt][2 * r + 1] = p1;
                    rs += p0 + p1;
                }
                lrow[t][r] = lrow[t][r] * corr + rs;
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    o[t][dt][2 * r] *= corr;
                    o[t][dt][2 * r + 1] *= corr;
                }
            }
        // O += P V
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            u32 a[MT][4];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                a[t][0] = pack_bf16(s[t][2 * ks][0], s[t][2 * ks][1]);
                a[t][1] = pack_bf16(s[t][2 * ks][2], s[t][2 * ks][3]);
                a[t][2] = pack_bf16(s[t][2 * ks + 1][0], s[t][2 * ks + 1][1]);
                a[t][3] = pack_bf16(s[t][2 * ks + 1][2], s[t][2 * ks + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, Vb + (ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dp * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma_bf16(o[t][2 * dp], a[t], b0, b1);
                    mma_bf16(o[t][2 * dp + 1], a[t], b2, b3);
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    __nv_bfloat16* og = out + ((i64)b * Nq + h) * Sq * D;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = lrow[t][r];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            float inv = l > 0.f ? 1.f / l : 0.f;
            i64 row = q0 + (warp * MT + t) * 16 + (lane >> 2) + r * 8;
            if (row < Sq) {
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    int col = dt * 8 + (lane & 3) * 2;
                    *(u32*)(og + row * D + col) = pack_bf16(o[t][dt][2 * r] * inv, o[t][dt][2 * r + 1] * inv);
                }
                if (lse && (lane & 3) == 0)
                    lse[((i64)b * Nq + h) * Sq + row] = l > 0.f ? (mrow[t][r] + log2f(l)) * 0.69314718055994531f : -INFINITY;
            }
        }
}

#define DEF_FA_FWD(NAME, D, NW, MT)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * NW) NAME(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, \
            const __nv_bfloat16* k, const __nv_bfloat16* v, int Nq, int Nkv, i64 Sq, i64 Sk, float scale_log2, int causal, \
            i64 window) {                                                                                 \
        fa_fwd<D, NW, MT>(out, lse, q, k, v, Nq, Nkv, Sq, Sk, scale_log2, causal, window);                 \
    }
DEF_FA_FWD(fa_fwd_d64, 64, 4, 1)
DEF_FA_FWD(fa_fwd_d128, 128, 4, 1)
DEF_FA_FWD(fa_fwd_d64_w8, 64, 8, 1)
DEF_FA_FWD(fa_fwd_d128_w8, 128, 8, 1)
DEF_FA_FWD(fa_fwd_d64_m2, 64, 4, 2)

// ---------------------------------------------------------------- tensor-core backward
// Grid (Nkv * B, key tiles): blocks are issued x-fastest, so every head's first (for causal,
// heaviest) key tile goes out first and the light tiles fill the tail. NW warps, BK = 16 NW
// keys per block; warp w owns keys [k0 + 16w, k0 + 16w + 16). Loops over the q heads of its kv
// group and over the 64-row query tiles that see its keys. With NW = 8 the dQ atomics and the
// Q/dO tile loads per FLOP halve (each query tile meets 128 keys at once).
// dq_acc: f32 [B, Nq, Sq, D], zeroed before; dk, dv written in storage dtype.
template <int D, int NW, bool HOIST_>
__device__ __forceinline__ void fa_bwd(float* dq_acc, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* dout,
                                       const float* lse, const float* delta, int Nq, int Nkv, i64 Sq, i64 Sk, float scale,
                                       int causal, i64 window) {
    constexpr int BK = 16 * NW;         // keys per block
    constexpr int LD = D + 8;
    constexpr int LDS = 64 + 8;
    constexpr int QG = NW / 4;          // warps sharing one 16-row slice of dQ (split over D)
    constexpr int DPW = D / 16 / QG;    // 16-column dQ slices per warp
    // Head dim 64: the warp's K and V rows (the A operands of S^T and dP^T, the same on
    // every iteration) stay in registers and dS's fragments are loaded once per dQ, not
    // once per column slice: shared-memory loads, not MMAs, bound this loop.
    constexpr bool HOIST = HOIST_ && D <= 64;
    constexpr int KF = HOIST ? D / 16 : 1;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    __nv_bfloat16* sK = (__nv_bfloat16*)fa_smem;
    __nv_bfloat16* sV = sK + BK * LD;
    __nv_bfloat16* sQ2 = sV + BK * LD;     // two Q tiles (double buffered)
    __nv_bfloat16* sO2 = sQ2 + 2 * 64 * LD; // two dO tiles
    __nv_bfloat16* sS = sO2 + 2 * 64 * LD; // dS^T [key][query]
    float* sL = (float*)(sS + BK * LDS);   // lse * log2e
    float* sD = sL + 64;                   // delta
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hk = (int)(blockIdx.x % (unsigned)Nkv), b = (int)(blockIdx.x / (unsigned)Nkv), kvb = blockIdx.y;
    const i64 k0 = (i64)kvb * BK;
    const i64 off = Sk - Sq;
    const float LOG2E = 1.4426950408889634f;
    const float scale_log2 = scale * LOG2E;
    const __nv_bfloat16* kg = k + ((i64)b * Nkv + hk) * Sk * D;
    const __nv_bfloat16* vg = v + ((i64)b * Nkv + hk) * Sk * D;
    const int group = Nq / Nkv;
    i64 qt0 = 0;
    if (causal) {
        i64 first = k0 - off; // first query row that sees key k0
        qt0 = first <= 0 ? 0 : first / 64;
    }
    i64 nqt = (Sq + 63) / 64;
    if (causal && window > 0) {
        // sliding window: the last query row that sees the block's last key
        i64 last = k0 + BK - 1 + window - 1 - off;
        i64 lim = last < 0 ? 0 : last / 64 + 1;
        if (lim < nqt) nqt = lim;
    }
    const i64 per_head = nqt > qt0 ? nqt - qt0 : 0;
    const i64 niter = per_head * group;
    // The warp's keys are all visible to every row of a query tile from this one on
    // (and inside Sk): no per-element mask there.
    const i64 wk_last = k0 + warp * 16 + 15;
    const bool warp_in_bounds = wk_last < Sk;
    auto tile_src = [&](i64 it, const __nv_bfloat16*& qg, const __nv_bfloat16*& og, i64& q0) {
        int hh = (int)(it / per_head);
        i64 qt = qt0 + it % per_head;
        int h = hk * group + hh;
        qg = q + ((i64)b * Nq + h) * Sq * D;
        og = dout + ((i64)b * Nq + h) * Sq * D;
        q0 = qt * 64;
    };
    load_rows<D, LD, BK>(sK, kg, k0, Sk);
    load_rows<D, LD, BK>(sV, vg, k0, Sk);
    if (niter > 0) {
        const __nv_bfloat16 *qg, *og;
        i64 q0;
        tile_src(0, qg, og, q0);
        load_rows<D, LD, 64>(sQ2, qg, q0, Sq);
        load_rows<D, LD, 64>(sO2, og, q0, Sq);
    }
    cp_async_commit();

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        dka[i][0] = dka[i][1] = dka[i][2] = dka[i][3] = 0.f;
        dva[i][0] = dva[i][1] = dva[i][2] = dva[i][3] = 0.f;
    }
    u32 kf[KF][4], vf[KF][4];
    for (i64 it = 0; it < niter; ++it) {
        const int buf = (int)(it & 1);
        const __nv_bfloat16* sQ = sQ2 + buf * 64 * LD;
        const __nv_bfloat16* sO = sO2 + buf * 64 * LD;
        const __nv_bfloat16 *qg, *og;
        i64 q0;
        tile_src(it, qg, og, q0);
        const int h = (int)(hk * group + it / per_head);
        if (it + 1 < niter) {
            const __nv_bfloat16 *qn, *on;
            i64 qn0;
            tile_src(it + 1, qn, on, qn0);
            load_rows<D, LD, 64>(sQ2 + (buf ^ 1) * 64 * LD, qn, qn0, Sq);
            load_rows<D, LD, 64>(sO2 + (buf ^ 1) * 64 * LD, on, qn0, Sq);
            cp_async_commit();
        }
        if (threadIdx.x < 64) {
            i64 r = q0 + threadIdx.x;
            sL[threadIdx.x] = r < Sq ? lse[((i64)b * Nq + h) * Sq + r] * LOG2E : INFINITY;
            sD[threadIdx.x] = r < Sq ? delta[((i64)b * Nq + h) * Sq + r] : 0.f;
        }
        if (it + 1 < niter) cp_async_wait<1>(); else cp_async_wait<0>();
        __syncthreads();
        if (HOIST && it == 0) {
#pragma unroll
            for (int ks = 0; ks < KF; ++ks) {
                ldsm_x4(kf[ks][0], kf[ks][1], kf[ks][2], kf[ks][3], sK + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
                ldsm_x4(vf[ks][0], vf[ks][1], vf[ks][2], vf[ks][3], sV + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
            }
        }
        float* dqg = dq_acc + ((i64)b * Nq + h) * Sq * D;
        // S^T = K Q^T for the warp's 16 keys x 64 queries
        float st[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 a[4];
            if (HOIST) {
                a[0] = kf[ks % KF][0]; a[1] = kf[ks % KF][1]; a[2] = kf[ks % KF][2]; a[3] = kf[ks % KF][3];
            } else {
                ldsm_x4(a[0], a[1], a[2], a[3], sK + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
            }
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, sQ + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
                mma_bf16(st[2 * np], a, b0, b1);
                mma_bf16(st[2 * np + 1], a, b2, b3);
            }
        }
        // P^T (masked only where the tile is cut by the diagonal or an edge)
        const bool masked = !warp_in_bounds || q0 + 64 > Sq || (causal && wk_last > q0 + off) ||
                            (causal && window > 0 && q0 + 63 + off - window >= k0 + warp * 16);
        if (masked) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int col = nt * 8 + (lane & 3) * 2 + (e & 1);
                    i64 qi = q0 + col;
                    i64 kj = k0 + warp * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
                    bool ok = qi < Sq && kj < Sk &&
                              (!causal || (kj <= qi + off && (window <= 0 || kj > qi + off - window)));
                    st[nt][e] = ok ? exp2f(st[nt][e] * scale_log2 - sL[col]) : 0.f;
                }
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int col = nt * 8 + (lane & 3) * 2 + (e & 1);
                    st[nt][e] = exp2f(st[nt][e] * scale_log2 - sL[col]);
                }
            }
        }
        // dV += P^T dO
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            u32 a[4];
            a[0] = pack_bf16(st[2 * ks][0], st[2 * ks][1]);
            a[1] = pack_bf16(st[2 * ks][2], st[2 * ks][3]);
            a[2] = pack_bf16(st[2 * ks + 1][0], st[2 * ks + 1][1]);
            a[3] = pack_bf16(st[2 * ks + 1][2], st[2 * ks + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, sO + (ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dp * 16 + (lane >> 4) * 8);
                mma_bf16(dva[2 * dp], a, b0, b1);
                mma_bf16(dva[2 * dp + 1], a, b2, b3);
            }
        }
        // dP^T = V dO^T, then dS^T = P^T (dP^T - delta), kept in st and staged in smem
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            float dpt[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                u32 a[4];
                if (HOIST) {
                    a[0] = vf[ks % KF][0]; a[1] = vf[ks % KF][1]; a[2] = vf[ks % KF][2]; a[3] = vf[ks % KF][3];
                } else {
                    ldsm_x4(a[0], a[1], a[2], a[3], sV + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
                }
                u32 b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, sO + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
                mma_bf16(dpt[0], a, b0, b1);
                mma_bf16(dpt[1], a, b2, b3);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                int nt = 2 * np + j;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int col = nt * 8 + (lane & 3) * 2 + (e & 1);
                    st[nt][e] = st[nt][e] * (dpt[j][e] - sD[col]);
                }
                int kr = warp * 16 + (lane >> 2);
                int col = nt * 8 + (lane & 3) * 2;
                *(u32*)(sS + kr * LDS + col) = pack_bf16(st[nt][0], st[nt][1]);
                *(u32*)(sS + (kr + 8) * LDS + col) = pack_bf16(st[nt][2], st[nt][3]);
            }
        }
        // dK += dS^T Q
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            u32 a[4];
            a[0] = pack_bf16(st[2 * ks][0], st[2 * ks][1]);
            a[1] = pack_bf16(st[2 * ks][2], st[2 * ks][3]);
            a[2] = pack_bf16(st[2 * ks + 1][0], st[2 * ks + 1][1]);
            a[3] = pack_bf16(st[2 * ks + 1][2], st[2 * ks + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, sQ + (ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dp * 16 + (lane >> 4) * 8);
                mma_bf16(dka[2 * dp], a, b0, b1);
                mma_bf16(dka[2 * dp + 1], a, b2, b3);
            }
        }
        __syncthreads(); // dS^T complete; every warp is done with this Q/dO buffer
        // dQ[q0 + 16 qw .. +16, the warp's columns] += dS K over the block's BK keys,
        // 16 output columns at a time (fewer live registers)
        const int qw = warp & 3, dp0 = (warp >> 2) * DPW;
        constexpr int SF = HOIST ? BK / 16 : 1;
        u32 sf[SF][4];
        if (HOIST) {
#pragma unroll
            for (int ks = 0; ks < SF; ++ks)
                ldsm_x4_t(sf[ks][0], sf[ks][1], sf[ks][2], sf[ks][3], sS + (ks * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + qw * 16 + ((lane >> 3) & 1) * 8);
        }
#pragma unroll
        for (int dj = 0; dj < DPW; ++dj) {
            const int dp = dp0 + dj;
            float dqp[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) dqp[i][0] = dqp[i][1] = dqp[i][2] = dqp[i][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {
                u32 a[4];
                if (HOIST) {
                    a[0] = sf[ks % SF][0]; a[1] = sf[ks % SF][1]; a[2] = sf[ks % SF][2]; a[3] = sf[ks % SF][3];
                } else {
                    ldsm_x4_t(a[0], a[1], a[2], a[3], sS + (ks * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + qw * 16 + ((lane >> 3) & 1) * 8);
                }
                u32 b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, sK + (ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dp * 16 + (lane >> 4) * 8);
                mma_bf16(dqp[0], a, b0, b1);
                mma_bf16(dqp[1], a, b2, b3);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                i64 row = q0 + qw * 16 + (lane >> 2) + r * 8;
                if (row < Sq) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        int col = (2 * dp + j) * 8 + (lane & 3) * 2;
                        atomicAdd((float2*)(dqg + row * D + col), make_float2(dqp[j][2 * r] * scale, dqp[j][2 * r + 1] * scale));
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    // write dK (scaled), dV for the warp's 16 keys
    __nv_bfloat16* dkg = dk + ((i64)b * Nkv + hk) * Sk * D;
    __nv_bfloat16* dvg = dv + ((i64)b * Nkv + hk) * Sk * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        i64 kj = k0 + warp * 16 + (lane >> 2) + r * 8;
        if (kj < Sk) {
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                int col = dt * 8 + (lane & 3) * 2;
                *(u32*)(dkg + kj * D + col) = pack_bf16(dka[dt][2 * r] * scale, dka[dt][2 * r + 1] * scale);
                *(u32*)(dvg + kj * D + col) = pack_bf16(dva[dt][2 * r], dva[dt][2 * r + 1]);
            }
        }
    }
}

#define DEF_FA_BWD(NAME, D, NW, H)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW) NAME(float* dq_acc, __nv_bfloat16* dk, __nv_bfloat16* dv, \
            const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* dout,   \
            const float* lse, const float* delta, int Nq, int Nkv, i64 Sq, i64 Sk, float scale, int causal,        \
            i64 window) {                                                                                        \
        fa_bwd<D, NW, H>(dq_acc, dk, dv, q, k, v, dout, lse, delta, Nq, Nkv, Sq, Sk, scale, causal, window);    \
    }
DEF_FA_BWD(fa_bwd_d64, 64, 4, false)
DEF_FA_BWD(fa_bwd_d128, 128, 4, false)
DEF_FA_BWD(fa_bwd_d64_w8, 64, 8, false)
DEF_FA_BWD(fa_bwd_d128_w8, 128, 8, false)
DEF_FA_BWD(fa_bwd_d64_h, 64, 4, true)

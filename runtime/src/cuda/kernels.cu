// Weft CUDA kernels, compiled once at run time through NVRTC (cached on disk as a
// cubin, keyed by a hash of this text, the options and the device).
//
// Conventions
// - Floats are computed in f32 whatever their storage type; `_f32`, `_bf16`, `_f16`
//   suffixes name the storage type of templated kernels.
// - Dtype codes (dynamic-typed kernels): 0 f32, 1 bf16, 2 f16, 3 i64, 4 i32, 5 bool (u8), 6 f64.
// - Every value has its own contiguous buffer; layout ops are strided copies.
// - `err` points at one int in device memory: kernels that find bad data (a token id
//   out of range, a label out of range) store a nonzero code there instead of
//   reading out of bounds; the host reads it after the step.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned short u16;

#define MAXR 8
#define FULL_MASK 0xffffffffu
#define NEG_BIG (-3.402823466e38f)
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// ---------------------------------------------------------------- helpers

__device__ __forceinline__ float tof(float x) { return x; }
__device__ __forceinline__ float tof(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float tof(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half fromf<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ double ld_any(const void* p, int code, i64 i) {
    switch (code) {
    case 0: return (double)((const float*)p)[i];
    case 1: return (double)__bfloat162float(((const __nv_bfloat16*)p)[i]);
    case 2: return (double)__half2float(((const __half*)p)[i]);
    case 3: return (double)((const i64*)p)[i];
    case 4: return (double)((const int*)p)[i];
    case 5: return (double)((const u8*)p)[i];
    default: return ((const double*)p)[i];
    }
}
__device__ __forceinline__ i64 ldi_any(const void* p, int code, i64 i) {
    switch (code) {
    case 3: return ((const i64*)p)[i];
    case 4: return (i64)((const int*)p)[i];
    case 5: return (i64)((const u8*)p)[i];
    default: return (i64)ld_any(p, code, i);
    }
}
__device__ __forceinline__ void st_any(void* p, int code, i64 i, double v) {
    switch (code) {
    case 0: ((float*)p)[i] = (float)v; break;
    case 1: ((__nv_bfloat16*)p)[i] = __float2bfloat16((float)v); break;
    case 2: ((__half*)p)[i] = __float2half((float)v); break;
    case 3: ((i64*)p)[i] = (i64)v; break;
    case 4: ((int*)p)[i] = (int)v; break;
    case 5: ((u8*)p)[i] = (u8)(v != 0.0); break;
    default: ((double*)p)[i] = v; break;
    }
}
__device__ __forceinline__ void sti_any(void* p, int code, i64 i, i64 v) {
    switch (code) {
    case 3: ((i64*)p)[i] = v; break;
    case 4: ((int*)p)[i] = (int)v; break;
    case 5: ((u8*)p)[i] = (u8)(v != 0); break;
    default: st_any(p, code, i, (double)v); break;
    }
}
__device__ __forceinline__ bool is_int_code(int c) { return c == 3 || c == 4 || c == 5; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
// Block-wide sum; every thread gets the result. `sh` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    float r = (threadIdx.x < nw) ? sh[threadIdx.x] : 0.f;
    if (wid == 0) {
        r = warp_sum(r);
        if (lane == 0) sh[0] = r;
    }
    __syncthreads();
    r = sh[0];
    __syncthreads();
    return r;
}
// Two block sums at once, each reduced in block_sum's order (the same bits), with two
// barriers where two block_sum calls take eight: the warps' partials (sh[0..64)) and the
// totals (sh[64], sh[65]) have slots of their own, so a loop calling it once per row
// needs no barrier to guard the previous call's reads. sh holds at least 66 floats and
// is used by nothing else in between.
__device__ __forceinline__ void block_sum2(float& a, float& b, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
        sh[wid] = a;
        sh[32 + wid] = b;
    }
    __syncthreads();
    if (wid == 0) {
        float ra = lane < nw ? sh[lane] : 0.f;
        float rb = lane < nw ? sh[32 + lane] : 0.f;
        ra = warp_sum(ra);
        rb = warp_sum(rb);
        if (lane == 0) {
            sh[64] = ra;
            sh[65] = rb;
        }
    }
    __syncthreads();
    a = sh[64];
    b = sh[65];
}
__device__ __forceinline__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    float r = (threadIdx.x < nw) ? sh[threadIdx.x] : NEG_BIG;
    if (wid == 0) {
        r = warp_max(r);
        if (lane == 0) sh[0] = r;
    }
    __syncthreads();
    r = sh[0];
    __syncthreads();
    return r;
}
// Online-softmax merge of (m, s) pairs.
__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == -INFINITY) { m = mm; s = 0.f; return; }
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}
__device__ __forceinline__ void warp_ms(float& m, float& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
        ms_merge(m, s, m2, s2);
    }
}
__device__ __forceinline__ void block_ms(float& m, float& s, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    warp_ms(m, s);
    __syncthreads();
    if (lane == 0) { sh[wid] = m; sh[32 + wid] = s; }
    __syncthreads();
    if (wid == 0) {
        float mm = (lane < nw) ? sh[lane] : -INFINITY, ss = (lane < nw) ? sh[32 + lane] : 0.f;
        warp_ms(mm, ss);
        if (lane == 0) { sh[0] = mm; sh[32] = ss; }
    }
    __syncthreads();
    m = sh[0]; s = sh[32];
    __syncthreads();
}

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

#define FOR_FLOATS(M) M(f32, float) M(bf16, __nv_bfloat16) M(f16, __half)

// ---------------------------------------------------------------- fills, arange, casts

extern "C" __global__ void fill_b1(u8* out, i64 n, u64 pat) { GRID_STRIDE(i, n) out[i] = (u8)pat; }
extern "C" __global__ void fill_b2(u16* out, i64 n, u64 pat) { GRID_STRIDE(i, n) out[i] = (u16)pat; }
extern "C" __global__ void fill_b4(u32* out, i64 n, u64 pat) { GRID_STRIDE(i, n) out[i] = (u32)pat; }
extern "C" __global__ void fill_b8(u64* out, i64 n, u64 pat) { GRID_STRIDE(i, n) out[i] = pat; }

extern "C" __global__ void arange_any(void* out, int code, i64 n, i64 start) {
    GRID_STRIDE(i, n) sti_any(out, code, i, start + i);
}

extern "C" __global__ void cast_any(void* out, int to, const void* in, int from, i64 n) {
    if (is_int_code(from) && is_int_code(to)) {
        GRID_STRIDE(i, n) sti_any(out, to, i, ldi_any(in, from, i));
    } else if (to == 5) {
        GRID_STRIDE(i, n) ((u8*)out)[i] = (u8)(ld_any(in, from, i) != 0.0);
    } else {
        GRID_STRIDE(i, n) st_any(out, to, i, ld_any(in, from, i));
    }
}

// ---------------------------------------------------------------- strided copies (layout ops)

struct Strided {
    int rank;
    i64 shape[MAXR];
    i64 ss[MAXR]; // source strides (elements)
    i64 ds[MAXR]; // destination strides (elements)
};

template <typename E>
__device__ __forceinline__ void strided_copy(E* dst, const E* src, i64 n, const Strided& s) {
    GRID_STRIDE(i, n) {
        i64 r = i, so = 0, d = 0;
#pragma unroll
        for (int k = MAXR - 1; k >= 0; --k) {
            if (k < s.rank) {
                i64 c = r % s.shape[k];
                r /= s.shape[k];
                so += c * s.ss[k];
                d += c * s.ds[k];
            }
        }
        dst[d] = src[so];
    }
}
extern "C" __global__ void copy_strided_b1(u8* d, const u8* s, i64 n, Strided st) { strided_copy(d, s, n, st); }
extern "C" __global__ void copy_strided_b2(u16* d, const u16* s, i64 n, Strided st) { strided_copy(d, s, n, st); }
extern "C" __global__ void copy_strided_b4(u32* d, const u32* s, i64 n, Strided st) { strided_copy(d, s, n, st); }
extern "C" __global__ void copy_strided_b8(u64* d, const u64* s, i64 n, Strided st) { strided_copy(d, s, n, st); }
extern "C" __global__ void copy_strided_b16(uint4* d, const uint4* s, i64 n, Strided st) { strided_copy(d, s, n, st); }

// Transpose of the two last dims of a batch of [R, C] tiles: out[b, c, r] = in[b, r, c]
// through shared memory (both sides coalesced). Element size 2 or 4 bytes.
template <typename E>
__device__ __forceinline__ void transpose_tiles(E* out, const E* in, i64 R, i64 C, i64 in_bstride, i64 out_bstride) {
    __shared__ E tile[32][33];
    i64 b = blockIdx.z;
    i64 r0 = (i64)blockIdx.y * 32, c0 = (i64)blockIdx.x * 32;
    const E* ib = in + b * in_bstride;
    E* ob = out + b * out_bstride;
    for (int k = threadIdx.y; k < 32; k += blockDim.y) {
        i64 r = r0 + k, c = c0 + threadIdx.x;
        if (r < R && c < C) tile[k][threadIdx.x] = ib[r * C + c];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += blockDim.y) {
        i64 c = c0 + k, r = r0 + threadIdx.x;
        if (r < R && c < C) ob[c * R + r] = tile[threadIdx.x][k];
    }
}
extern "C" __global__ void transpose2d_b2(u16* out, const u16* in, i64 R, i64 C, i64 ib, i64 ob) { transpose_tiles(out, in, R, C, ib, ob); }
extern "C" __global__ void transpose2d_b4(u32* out, const u32* in, i64 R, i64 C, i64 ib, i64 ob) { transpose_tiles(out, in, R, C, ib, ob); }

// ---------------------------------------------------------------- elementwise

__device__ __forceinline__ float unary_op(float x, int code, float p) {
    switch (code) {
    case 0: return -x;
    case 1: return __expf(x);
    case 2: return __logf(x);
    case 3: return sqrtf(x);
    case 4: return rsqrtf(x);
    case 5: return tanhf(x);
    case 6: return 1.f / (1.f + __expf(-x));
    case 7: return x / (1.f + __expf(-x));
    case 8: return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    case 9: return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    case 10: return x > 0.f ? x : 0.f;
    case 11: return x * p;
    case 12: return x + p;
    case 13: return p == 2.f ? x * x : (p == 0.5f ? sqrtf(x) : (p == -1.f ? 1.f / x : powf(x, p)));
    default: return x;
    }
}
__device__ __forceinline__ float binary_op(float a, float b, int code) {
    switch (code) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4: return __expf(__logf(a) * b);
    case 5: return fmaxf(a, b);
    default: return fminf(a, b);
    }
}
__device__ __forceinline__ i64 binary_op_i(i64 a, i64 b, int code) {
    switch (code) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return b == 0 ? 0 : a / b;
    case 5: return a > b ? a : b;
    case 6: return a < b ? a : b;
    default: return a;
    }
}

struct Bcast {
    int rank;
    i64 shape[MAXR];
    i64 sa[MAXR];
    i64 sb[MAXR];
    i64 sc[MAXR];
};
__device__ __forceinline__ void bc_offsets(const Bcast& bc, i64 i, i64& oa, i64& ob, i64& oc) {
    i64 r = i;
    oa = 0; ob = 0; oc = 0;
#pragma unroll
    for (int k = MAXR - 1; k >= 0; --k) {
        if (k < bc.rank) {
            i64 c = r % bc.shape[k];
            r /= bc.shape[k];
            oa += c * bc.sa[k];
            ob += c * bc.sb[k];
            oc += c * bc.sc[k];
        }
    }
}

#define DEF_ELEMWISE(S, T)                                                                              \
    extern "C" __global__ void unary_##S(T* out, const T* in, i64 n, int code, float p) {               \
        GRID_STRIDE(i, n) out[i] = fromf<T>(unary_op(tof(in[i]), code, p));                            \
    }                                                                                                    \
    extern "C" __global__ void binary_c_##S(T* out, const T* a, const T* b, i64 n, int code) {           \
        GRID_STRIDE(i, n) out[i] = fromf<T>(binary_op(tof(a[i]), tof(b[i]), code));                     \
    }                                                                                                    \
    extern "C" __global__ void binary_##S(T* out, const T* a, const T* b, i64 n, int code, Bcast bc) {   \
        GRID_STRIDE(i, n) {                                                                              \
            i64 oa, ob, oc;                                                                              \
            bc_offsets(bc, i, oa, ob, oc);                                                               \
            out[i] = fromf<T>(binary_op(tof(a[oa]), tof(b[ob]), code));                                  \
        }                                                                                                \
    }                                                                                                    \
    /* silu(a) * b: the SwiGLU product */                                                                \
    extern "C" __global__ void silu_mul_##S(T* out, const T* a, const T* b, i64 n) {                     \
        GRID_STRIDE(i, n) {                                                                              \
            float x = tof(a[i]);                                                                         \
            out[i] = fromf<T>(x / (1.f + __expf(-x)) * tof(b[i]));                                       \
        }                                                                                                \
    }
FOR_FLOATS(DEF_ELEMWISE)

// 8-wide bf16 versions (16-byte loads) of the hot contiguous elementwise kernels; n8 = n / 8.
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
    const __nv_bfloat16* e = (const __nv_bfloat16*)&u;
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = __bfloat162float(e[k]);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 u;
    __nv_bfloat16* e = (__nv_bfloat16*)&u;
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = __float2bfloat16(f[k]);
    return u;
}
extern "C" __global__ void unary8_bf16(uint4* out, const uint4* in, i64 n8, int code, float p) {
    GRID_STRIDE(i, n8) {
        float x[8];
        unpack8(in[i], x);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = unary_op(x[k], code, p);
        out[i] = pack8(x);
    }
}
extern "C" __global__ void binary8_bf16(uint4* out, const uint4* a, const uint4* b, i64 n8, int code) {
    GRID_STRIDE(i, n8) {
        float x[8], y[8];
        unpack8(a[i], x);
        unpack8(b[i], y);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = binary_op(x[k], y[k], code);
        out[i] = pack8(x);
    }
}
extern "C" __global__ void silu_bwd8_bf16(uint4* dx, const uint4* xs, const uint4* dy, i64 n8) {
    GRID_STRIDE(i, n8) {
        float x[8], g[8];
        unpack8(xs[i], x);
        unpack8(dy[i], g);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float s = 1.f / (1.f + __expf(-x[k]));
            x[k] = g[k] * s * (1.f + x[k] * (1.f - s));
        }
        dx[i] = pack8(x);
    }
}

extern "C" __global__ void binary_i64(i64* out, const i64* a, const i64* b, i64 n, int code, Bcast bc) {
    GRID_STRIDE(i, n) {
        i64 oa, ob, oc;
        bc_offsets(bc, i, oa, ob, oc);
        out[i] = binary_op_i(a[oa], b[ob], code);
    }
}

// Comparison of two tensors of dtype `code` to bool, broadcasting.
extern "C" __global__ void compare_any(u8* out, const void* a, const void* b, int code, i64 n, int op, Bcast bc) {
    GRID_STRIDE(i, n) {
        i64 oa, ob, oc;
        bc_offsets(bc, i, oa, ob, oc);
        bool r;
        if (is_int_code(code)) {
            i64 x = ldi_any(a, code, oa), y = ldi_any(b, code, ob);
            r = op == 0 ? x == y : op == 1 ? x != y : op == 2 ? x < y : op == 3 ? x <= y : op == 4 ? x > y : x >= y;
        } else {
            double x = ld_any(a, code, oa), y = ld_any(b, code, ob);
            r = op == 0 ? x == y : op == 1 ? x != y : op == 2 ? x < y : op == 3 ? x <= y : op == 4 ? x > y : x >= y;
        }
        out[i] = (u8)r;
    }
}

// cond ? a : b, all three broadcast (sa: cond, sb: a, sc: b); element size `esz` bytes.
extern "C" __global__ void where_any(u8* out, const u8* cond, const u8* a, const u8* b, int esz, i64 n, Bcast bc) {
    GRID_STRIDE(i, n) {
        i64 oc, oa, ob;
        bc_offsets(bc, i, oc, oa, ob);
        const u8* src = cond[oc] ? a + oa * esz : b + ob * esz;
        for (int k = 0; k < esz; ++k) out[i * esz + k] = src[k];
    }
}

// ---------------------------------------------------------------- reductions

// One warp per output element: reduce `nred` elements at offsets built from
// (rshape, rstride) starting at the base offset of the output index (oshape, ostride).
struct Red {
    int ro;
    int rr;
    i64 oshape[MAXR];
    i64 ostride[MAXR];
    i64 rshape[MAXR];
    i64 rstride[MAXR];
};
#define DEF_REDUCE(S, T)                                                                                 \
    extern "C" __global__ void reduce_##S(T* out, const T* in, i64 nout, i64 nred, int code, Red rd) {   \
        i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;                                       \
        int lane = threadIdx.x & 31;                                                                     \
        if (w >= nout) return;                                                                           \
        i64 r = w, base = 0;                                                                             \
        for (int k = rd.ro - 1; k >= 0; --k) { i64 c = r % rd.oshape[k]; r /= rd.oshape[k]; base += c * rd.ostride[k]; } \
        float acc = code == 2 ? NEG_BIG : 0.f;                                                           \
        for (i64 j = lane; j < nred; j += 32) {                                                          \
            i64 q = j, off = base;                                                                       \
            for (int k = rd.rr - 1; k >= 0; --k) { i64 c = q % rd.rshape[k]; q /= rd.rshape[k]; off += c * rd.rstride[k]; } \
            float v = tof(in[off]);                                                                      \
            acc = code == 2 ? fmaxf(acc, v) : acc + v;                                                   \
        }                                                                                                \
        acc = code == 2 ? warp_max(acc) : warp_sum(acc);                                                 \
        if (code == 1) acc /= (float)nred;                                                               \
        if (lane == 0) out[w] = fromf<T>(acc);                                                           \
    }
FOR_FLOATS(DEF_REDUCE)

// One block per output element, for few outputs of long reductions (a loss summed over every
// token): the same offsets as reduce_*, the block's threads striding over `nred`.
#define DEF_REDUCE_BLOCK(S, T)                                                                           \
    extern "C" __global__ void reduce_block_##S(T* out, const T* in, i64 nout, i64 nred, int code, Red rd) { \
        __shared__ float sh[32];                                                                         \
        i64 w = blockIdx.x;                                                                              \
        if (w >= nout) return;                                                                           \
        i64 r = w, base = 0;                                                                             \
        for (int k = rd.ro - 1; k >= 0; --k) { i64 c = r % rd.oshape[k]; r /= rd.oshape[k]; base += c * rd.ostride[k]; } \
        float acc = code == 2 ? NEG_BIG : 0.f;                                                           \
        for (i64 j = threadIdx.x; j < nred; j += blockDim.x) {                                           \
            i64 q = j, off = base;                                                                       \
            for (int k = rd.rr - 1; k >= 0; --k) { i64 c = q % rd.rshape[k]; q /= rd.rshape[k]; off += c * rd.rstride[k]; } \
            float v = tof(in[off]);                                                                      \
            acc = code == 2 ? fmaxf(acc, v) : acc + v;                                                   \
        }                                                                                                \
        acc = code == 2 ? block_max(acc, sh) : block_sum(acc, sh);                                       \
        if (code == 1) acc /= (float)nred;                                                               \
        if (threadIdx.x == 0) out[w] = fromf<T>(acc);                                                    \
    }
FOR_FLOATS(DEF_REDUCE_BLOCK)

// Sum of integer tensors (i64 out).
extern "C" __global__ void reduce_i64(i64* out, const i64* in, i64 nout, i64 nred, int code, Red rd) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= nout) return;
    i64 r = w, base = 0;
    for (int k = rd.ro - 1; k >= 0; --k) { i64 c = r % rd.oshape[k]; r /= rd.oshape[k]; base += c * rd.ostride[k]; }
    long long acc = code == 2 ? (long long)(-9223372036854775807LL - 1) : 0;
    for (i64 j = lane; j < nred; j += 32) {
        i64 q = j, off = base;
        for (int k = rd.rr - 1; k >= 0; --k) { i64 c = q % rd.rshape[k]; q /= rd.rshape[k]; off += c * rd.rstride[k]; }
        i64 v = in[off];
        acc = code == 2 ? (v > acc ? v : acc) : acc + v;
    }
    for (int o = 16; o > 0; o >>= 1) {
        long long v = __shfl_xor_sync(FULL_MASK, acc, o);
        acc = code == 2 ? (v > acc ? v : acc) : acc + v;
    }
    if (code == 1) acc /= nred;
    if (lane == 0) out[w] = acc;
}

// Softmax / log-softmax over the last dim, one block per row.
#define DEF_SOFTMAX(S, T)                                                                                \
    extern "C" __global__ void softmax_##S(T* out, const T* in, i64 rows, i64 n, int logsm) {           \
        __shared__ float sh[64];                                                                         \
        i64 row = blockIdx.x;                                                                            \
        const T* x = in + row * n;                                                                       \
        T* y = out + row * n;                                                                            \
        float m = -INFINITY, s = 0.f;                                                                    \
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) ms_merge(m, s, tof(x[j]), 1.f);                \
        block_ms(m, s, sh);                                                                              \
        float ls = __logf(s);                                                                            \
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {                                              \
            float v = tof(x[j]) - m;                                                                     \
            y[j] = fromf<T>(logsm ? v - ls : __expf(v) / s);                                             \
        }                                                                                                \
    }
FOR_FLOATS(DEF_SOFTMAX)

// ---------------------------------------------------------------- transformer blocks

// out[t, :] = w[ids[t], :]; an id out of range writes zeros and sets err = 1.
#define DEF_EMBEDDING(S, T)                                                                              \
    extern "C" __global__ void embedding_##S(T* out, const i64* ids, const T* w, i64 ntok, i64 H,        \
                                               i64 vocab, int* err) {                                    \
        i64 t = blockIdx.x;                                                                              \
        i64 id = ids[t];                                                                                 \
        bool bad = id < 0 || id >= vocab;                                                                \
        if (bad && threadIdx.x == 0) atomicExch(err, 1);                                                 \
        T* o = out + t * H;                                                                              \
        const T* src = w + (bad ? 0 : id) * H;                                                           \
        if (!bad && (H * sizeof(T)) % 16 == 0 && ((u64)src % 16) == 0 && ((u64)o % 16) == 0) {          \
            i64 nv = H * sizeof(T) / 16;                                                                 \
            for (i64 j = threadIdx.x; j < nv; j += blockDim.x) ((uint4*)o)[j] = ((const uint4*)src)[j];  \
        } else {                                                                                         \
            for (i64 j = threadIdx.x; j < H; j += blockDim.x) o[j] = bad ? fromf<T>(0.f) : src[j];       \
        }                                                                                                \
    }
FOR_FLOATS(DEF_EMBEDDING)

// RMSNorm over the last dim, one block per row; `rstd` (may be null) keeps 1/rms per row.
#define DEF_RMSNORM(S, T)                                                                                \
    extern "C" __global__ void rms_norm_##S(T* out, const T* x, const void* w, int wcode, i64 rows,     \
                                              i64 H, float eps, float* rstd) {                           \
        __shared__ float sh[64];                                                                         \
        i64 row = blockIdx.x;                                                                            \
        const T* xr = x + row * H;                                                                       \
        T* yr = out + row * H;                                                                           \
        float ss = 0.f;                                                                                  \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) { float v = tof(xr[j]); ss += v * v; }         \
        ss = block_sum(ss, sh);                                                                          \
        float r = rsqrtf(ss / (float)H + eps);                                                           \
        if (rstd && threadIdx.x == 0) rstd[row] = r;                                                     \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) {                                              \
            float wv = wcode == 0 ? ((const float*)w)[j] : (float)ld_any(w, wcode, j);                   \
            yr[j] = fromf<T>(wv * (tof(xr[j]) * r));                                                     \
        }                                                                                                \
    }
FOR_FLOATS(DEF_RMSNORM)

// cos/sin tables [n_pos, 2*half] from positions and inverse frequencies, both times `scale`
// (YaRN's attention factor; 1 otherwise).
extern "C" __global__ void rope_table(void* cosv, void* sinv, int ocode, const void* pos, int pcode, i64 npos,
                                      int half, const float* inv, float scale) {
    i64 n = npos * 2 * half;
    GRID_STRIDE(i, n) {
        i64 p = i / (2 * half);
        int j = (int)(i % (2 * half));
        float f = (float)ld_any(pos, pcode, p) * inv[j % half];
        float s, c;
        sincosf(f, &s, &c);
        st_any(cosv, ocode, i, c * scale);
        st_any(sinv, ocode, i, s * scale);
    }
}

// Rotary embedding on x [B, N, S, D] ([B, S, N, D] when bshd = 1); cos/sin [Bc, S, r] (Bc = 1 or B),
// rotating the first r features (r even).
#define DEF_ROPE(S_, T)                                                                                  \
    extern "C" __global__ void rope_##S_(T* out, const T* x, const void* cosv, const void* sinv,         \
                                           int ccode, i64 B, i64 N, i64 S, i64 D, i64 r, i64 cbs,        \
                                           int bshd) {                                                   \
        i64 n = B * N * S * D;                                                                           \
        GRID_STRIDE(i, n) {                                                                              \
            i64 d = i % D;                                                                               \
            i64 s = bshd ? (i / (D * N)) % S : (i / D) % S;                                              \
            i64 b = i / (D * S * N);                                                                     \
            float xv = tof(x[i]);                                                                        \
            if (d >= r) { out[i] = x[i]; continue; }                                                     \
            i64 h = r / 2;                                                                               \
            i64 ci = b * cbs + s * r + d;                                                                \
            float c = ccode == 0 ? ((const float*)cosv)[ci] : (float)ld_any(cosv, ccode, ci);             \
            float sn = ccode == 0 ? ((const float*)sinv)[ci] : (float)ld_any(sinv, ccode, ci);            \
            float rot = d < h ? -tof(x[i + h]) : tof(x[i - h]);                                          \
            out[i] = fromf<T>(xv * c + rot * sn);                                                        \
        }                                                                                                \
    }
FOR_FLOATS(DEF_ROPE)

// ---------------------------------------------------------------- loss

extern "C" __global__ void shift_labels(i64* out, const i64* l, i64 rows, i64 n, i64 ignore) {
    i64 total = rows * n;
    GRID_STRIDE(i, total) {
        i64 j = i % n;
        out[i] = j + 1 < n ? l[i + 1] : ignore;
    }
}

// Per row: loss = logsumexp(logits) - logits[label] (0 when ignored); lse kept for backward.
// A label out of range (and not ignore) sets err = 2 and counts as ignored.
#define DEF_CE(S, T)                                                                                     \
    extern "C" __global__ void ce_rows_##S(float* loss, float* lse, const T* logits, const i64* labels,  \
                                             i64 rows, i64 V, i64 ignore, int* err) {                    \
        __shared__ float sh[64];                                                                         \
        i64 row = blockIdx.x;                                                                            \
        const T* x = logits + row * V;                                                                   \
        float m = -INFINITY, s = 0.f;                                                                    \
        if ((V % 8) == 0 && sizeof(T) == 2 && ((u64)x % 16) == 0) {                                      \
            const uint4* xv = (const uint4*)x;                                                           \
            for (i64 j = threadIdx.x; j < V / 8; j += blockDim.x) {                                      \
                uint4 u = xv[j];                                                                         \
                const T* e = (const T*)&u;                                                               \
                float mx = tof(e[0]);                                                                    \
                _Pragma("unroll") for (int k = 1; k < 8; ++k) mx = fmaxf(mx, tof(e[k]));                 \
                float sm = 0.f;                                                                          \
                _Pragma("unroll") for (int k = 0; k < 8; ++k) sm += __expf(tof(e[k]) - mx);              \
                ms_merge(m, s, mx, sm);                                                                  \
            }                                                                                            \
        } else {                                                                                         \
            for (i64 j = threadIdx.x; j < V; j += blockDim.x) ms_merge(m, s, tof(x[j]), 1.f);            \
        }                                                                                                \
        block_ms(m, s, sh);                                                                              \
        if (threadIdx.x == 0) {                                                                          \
            float l = m + __logf(s);                                                                     \
            i64 lab = labels[row];                                                                       \
            float out = 0.f;                                                                             \
            if (lab != ignore) {                                                                         \
                if (lab < 0 || lab >= V) atomicExch(err, 2);                                             \
                else out = l - tof(x[lab]);                                                              \
            }                                                                                            \
            loss[row] = out;                                                                             \
            if (lse) lse[row] = l;                                                                       \
        }                                                                                                \
    }
FOR_FLOATS(DEF_CE)

// Deterministic single-block sum of f32 values, times `scale`; with `labels` non-null the
// result is divided by the number of labels != ignore (mean reduction). Result stored with dtype code.
extern "C" __global__ void sum_f32(void* out, int ocode, const float* in, i64 n, float scale, const i64* labels,
                                   i64 nl, i64 ignore) {
    __shared__ float sh[64];
    float acc = 0.f;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) acc += in[j];
    acc = block_sum(acc, sh);
    float cnt = 1.f;
    if (labels) {
        float c = 0.f;
        for (i64 j = threadIdx.x; j < nl; j += blockDim.x) c += labels[j] != ignore ? 1.f : 0.f;
        cnt = block_sum(c, sh);
    }
    if (threadIdx.x == 0) st_any(out, ocode, 0, acc * scale / cnt);
}

extern "C" __global__ void count_valid(void* out, int ocode, const i64* l, i64 n, i64 ignore) {
    __shared__ float sh[64];
    float c = 0.f;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) c += l[j] != ignore ? 1.f : 0.f;
    c = block_sum(c, sh);
    if (threadIdx.x == 0) st_any(out, ocode, 0, c);
}

// ---------------------------------------------------------------- indexing

// Largest k along the last dim, sorted descending, ties to the lower index, NaN largest.
// One thread per row (n small: router logits).
extern "C" __global__ void topk_any(void* vals, int vcode, i64* idx, const void* x, int xcode, i64 rows, i64 n, int k) {
    GRID_STRIDE(row, rows) {
        i64 prev = -1;
        double pv = 0.0;
        for (int s = 0; s < k; ++s) {
            i64 best = -1;
            double bv = 0.0;
            for (i64 j = 0; j < n; ++j) {
                double v = ld_any(x, xcode, row * n + j);
                // strictly after (pv, prev) in the order (value desc, index asc)
                if (prev >= 0) {
                    bool vn = v != v, pn = pv != pv;
                    bool after;
                    if (vn && pn) after = j > prev;
                    else if (vn) after = false;
                    else if (pn) after = true;
                    else after = v < pv || (v == pv && j > prev);
                    if (!after) continue;
                }
                if (best < 0) { best = j; bv = v; continue; }
                bool vn = v != v, bn = bv != bv;
                bool better = (vn && !bn) || (!vn && !bn && v > bv);
                if (better) { best = j; bv = v; }
            }
            idx[row * k + s] = best;
            st_any(vals, vcode, row * k + s, bv);
            prev = best; pv = bv;
        }
    }
}

extern "C" __global__ void one_hot(void* out, int ocode, const i64* idx, i64 n, i64 classes, int* err) {
    i64 total = n * classes;
    GRID_STRIDE(i, total) {
        i64 t = i / classes, c = i % classes;
        i64 v = idx[t];
        if ((v < 0 || v >= classes) && c == 0) atomicExch(err, 3);
        st_any(out, ocode, i, v == c ? 1.0 : 0.0);
    }
}

// x viewed [outer, nx, inner] -> out [outer, m, inner], out[o, j, i] = x[o, idx[j], i].
extern "C" __global__ void index_select_any(u8* out, const u8* x, const void* idx, int icode, int esz, i64 outer,
                                            i64 nx, i64 m, i64 inner, int* err) {
    i64 total = outer * m * inner;
    GRID_STRIDE(i, total) {
        i64 in_ = i % inner, j = (i / inner) % m, o = i / (inner * m);
        i64 s = ldi_any(idx, icode, j);
        if (s < 0 || s >= nx) { if (in_ == 0) atomicExch(err, 4); s = 0; }
        const u8* src = x + ((o * nx + s) * inner + in_) * esz;
        for (int b = 0; b < esz; ++b) out[i * esz + b] = src[b];
    }
}

// torch.gather along dim d: out (shape = index shape) [i] = x[index multi-index with dim d
// replaced by idx[i]]; xs: strides of x.
extern "C" __global__ void gather_any(u8* out, const u8* x, const i64* idx, int esz, i64 n, Strided st, int d,
                                      i64 xd, int* err) {
    GRID_STRIDE(i, n) {
        i64 r = i, off = 0;
        for (int k = st.rank - 1; k >= 0; --k) {
            i64 c = r % st.shape[k];
            r /= st.shape[k];
            if (k == d) {
                c = idx[i];
                if (c < 0 || c >= xd) { atomicExch(err, 5); c = 0; }
            }
            off += c * st.ss[k];
        }
        for (int b = 0; b < esz; ++b) out[i * esz + b] = x[off * esz + b];
    }
}

// out (already a copy of dst) += src at index along d: atomics in f32/bf16/f16.
#define DEF_SCATTER_ADD(S, T)                                                                            \
    extern "C" __global__ void scatter_add_##S(T* out, const i64* idx, const T* src, i64 n, Strided st, int d, \
                                                 i64 od, int* err) {                                    \
        GRID_STRIDE(i, n) {                                                                              \
            i64 r = i, off = 0;                                                                          \
            for (int k = st.rank - 1; k >= 0; --k) {                                                     \
                i64 c = r % st.shape[k];                                                                 \
                r /= st.shape[k];                                                                        \
                if (k == d) {                                                                            \
                    c = idx[i];                                                                          \
                    if (c < 0 || c >= od) { atomicExch(err, 6); c = -1; }                                \
                }                                                                                        \
                if (c < 0) { off = -1; break; }                                                          \
                off += c * st.ds[k];                                                                     \
            }                                                                                            \
            if (off >= 0) atomicAdd(out + off, src[i]);                                                  \
        }                                                                                                \
    }
FOR_FLOATS(DEF_SCATTER_ADD)

// ---------------------------------------------------------------- mixture of experts

// Stable counting sort of the T*k (token, slot) entries by expert. One block; thread e
// handles expert e (looping if E > blockDim). counts i64 [E], order i64 [T*k].
extern "C" __global__ void moe_route(i64* counts, i64* order, const i64* eidx, i64 tk, int E, int* err) {
    extern __shared__ i64 start[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        i64 c = 0;
        for (i64 f = 0; f < tk; ++f) c += eidx[f] == e;
        counts[e] = c;
        start[e] = c;
    }
    if (threadIdx.x == 0) {
        for (i64 f = 0; f < tk; ++f) if (eidx[f] < 0 || eidx[f] >= E) atomicExch(err, 7);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 acc = 0;
        for (int e = 0; e < E; ++e) { i64 c = start[e]; start[e] = acc; acc += c; }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        i64 p = start[e];
        for (i64 f = 0; f < tk; ++f) if (eidx[f] == e) order[p++] = f;
    }
}

// rows[r, :] = x[order[r] / k, :]
#define DEF_MOE(S, T)                                                                                    \
    extern "C" __global__ void moe_gather_##S(T* rows, const T* x, const i64* order, i64 R, int k, i64 H) { \
        i64 n = R * H;                                                                                   \
        GRID_STRIDE(i, n) {                                                                              \
            i64 r = i / H, h = i % H;                                                                    \
            rows[i] = x[(order[r] / k) * H + h];                                                         \
        }                                                                                                \
    }                                                                                                    \
    /* out[t, h] = sum_slot w[t, slot] * rows[inv[t*k+slot], h] */                                       \
    extern "C" __global__ void moe_combine_##S(T* out, const T* rows, const int* inv, const void* w,     \
                                                 int wcode, i64 ntok, int k, i64 H) {                    \
        i64 n = ntok * H;                                                                                \
        GRID_STRIDE(i, n) {                                                                              \
            i64 t = i / H, h = i % H;                                                                    \
            float acc = 0.f;                                                                             \
            for (int s = 0; s < k; ++s) {                                                                \
                int r = inv[t * k + s];                                                                  \
                if (r >= 0) acc += (float)ld_any(w, wcode, t * k + s) * tof(rows[(i64)r * H + h]);        \
            }                                                                                            \
            out[i] = fromf<T>(acc);                                                                      \
        }                                                                                                \
    }
FOR_FLOATS(DEF_MOE)

// inv[order[r]] = r (inv pre-filled with -1).
extern "C" __global__ void moe_inverse(int* inv, const i64* order, i64 R, i64 tk, int* err) {
    GRID_STRIDE(r, R) {
        i64 f = order[r];
        if (f < 0 || f >= tk) atomicExch(err, 8);
        else inv[f] = (int)r;
    }
}

extern "C" __global__ void fill_i32(int* out, i64 n, int v) { GRID_STRIDE(i, n) out[i] = v; }

// Seeded normal(mean, std) values (counter-based: splitmix64 of (seed, i), Box-Muller), for
// initialising large models on the device.
__device__ __forceinline__ u64 splitmix(u64 z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
extern "C" __global__ void init_normal_any(void* out, int code, i64 n, u64 seed, float stdv, float mean) {
    GRID_STRIDE(i, n) {
        u64 a = splitmix(seed ^ (u64)i * 0x2545F4914F6CDD1DULL);
        u64 b = splitmix(a);
        float u1 = ((a >> 40) + 1) * (1.0f / 16777217.0f);
        float u2 = (b >> 40) * (1.0f / 16777216.0f);
        float z = sqrtf(-2.f * __logf(u1)) * __cosf(6.283185307179586f * u2);
        st_any(out, code, i, mean + stdv * z);
    }
}

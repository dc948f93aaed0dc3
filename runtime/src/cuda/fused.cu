// Fused kernels of the ops `fuse` makes: `glu` / `glu_grad` (SwiGLU, GeGLU) and
// `add_rms_norm` / `add_rms_norm_grad` (residual add + RMSNorm). Each computes in f32 and
// rounds to the storage type exactly where the unfused kernels it replaces round (after
// the activation, after each product, after the sum, after the norm's dx), in the same
// expression order, so the fused step equals the unfused one. Appended to kernels.cu and
// backward.cu (their helpers: tof/fromf, unpack8/pack8, block_sum, load_w8, st8f).
//
// `act` codes: 0 silu, 1 gelu (erf), 2 gelu (tanh approximation).

__device__ __forceinline__ float glu_act(float x, int act) {
    return unary_op(x, act == 0 ? 7 : (act == 1 ? 8 : 9), 0.f);
}

// dy * act'(x), as silu_bwd / gelu_bwd write it.
__device__ __forceinline__ float glu_act_bwd(float g, float xv, int act) {
    if (act == 0) {
        float s = 1.f / (1.f + __expf(-xv));
        return g * s * (1.f + xv * (1.f - s));
    }
    float d;
    if (act == 2) {
        const float a = 0.044715f, c = 0.7978845608028654f;
        float x2 = xv * xv;
        float t = tanhf(c * xv * (1.f + a * x2));
        d = 0.5f * (1.f + t) + 0.5f * xv * (1.f - t * t) * c * (1.f + 3.f * a * x2);
    } else {
        d = 0.5f * (1.f + erff(xv * 0.70710678118654752f)) + xv * __expf(-0.5f * xv * xv) * 0.3989422804014327f;
    }
    return g * d;
}

// One element of glu_grad: dgate = act'(gate) * round(dy * up), dup = dy * round(act(gate)).
template <typename T>
__device__ __forceinline__ void glu_bwd1(float gate, float up, float g, int act, float& dgate, float& dup) {
    float dact = tof(fromf<T>(g * up));
    dgate = glu_act_bwd(dact, gate, act);
    dup = g * tof(fromf<T>(glu_act(gate, act)));
}

#define DEF_GLU(S, T)                                                                                    \
    extern "C" __global__ void glu_##S(T* out, const T* gate, const T* up, i64 n, int act) {            \
        GRID_STRIDE(i, n) {                                                                              \
            float a = tof(fromf<T>(glu_act(tof(gate[i]), act)));                                        \
            out[i] = fromf<T>(a * tof(up[i]));                                                           \
        }                                                                                                \
    }                                                                                                    \
    extern "C" __global__ void glu_bwd_##S(T* dgate, T* dup, const T* gate, const T* up, const T* dy,    \
                                            i64 n, int act) {                                            \
        GRID_STRIDE(i, n) {                                                                              \
            float dg, du;                                                                                \
            glu_bwd1<T>(tof(gate[i]), tof(up[i]), tof(dy[i]), act, dg, du);                              \
            dgate[i] = fromf<T>(dg);                                                                     \
            dup[i] = fromf<T>(du);                                                                       \
        }                                                                                                \
    }
FOR_FLOATS(DEF_GLU)

// 8-wide bf16 versions (16-byte loads and stores); n8 = n / 8. glu_bwd8 takes two vectors
// a grid stride apart per iteration, both loaded before either is computed, so twice the
// loads are in flight (elementwise, so the values are those of one vector an iteration):
// 124.0 -> 118.9 us a call at [4096, 8192] on an H100. The same for glu8 (two loads, not
// three, a vector) was slower, 70.9 -> 75.9 us (fewer blocks resident at 48 registers),
// so glu8 keeps one vector an iteration.
extern "C" __global__ void glu8_bf16(uint4* out, const uint4* gate, const uint4* up, i64 n8, int act) {
    GRID_STRIDE(i, n8) {
        float g[8], u[8];
        unpack8(gate[i], g);
        unpack8(up[i], u);
#pragma unroll
        for (int k = 0; k < 8; ++k) g[k] = tof(fromf<__nv_bfloat16>(glu_act(g[k], act))) * u[k];
        out[i] = pack8(g);
    }
}
__device__ __forceinline__ void glu_bwd8_one(uint4 gate, uint4 up, uint4 dy, int act, uint4& dgate, uint4& dup) {
    float g[8], u[8], d[8];
    unpack8(gate, g);
    unpack8(up, u);
    unpack8(dy, d);
#pragma unroll
    for (int k = 0; k < 8; ++k) glu_bwd1<__nv_bfloat16>(g[k], u[k], d[k], act, g[k], u[k]);
    dgate = pack8(g);
    dup = pack8(u);
}
extern "C" __global__ void glu_bwd8_bf16(uint4* dgate, uint4* dup,
                                         const uint4* gate, const uint4* up,
                                         const uint4* dy, i64 n8, int act) {
    const i64 stride = (i64)blockDim.x * gridDim.x;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + stride < n8; i += 2 * stride) {
        uint4 g0 = gate[i], u0 = up[i], d0 = dy[i], g1 = gate[i + stride], u1 = up[i + stride], d1 = dy[i + stride];
        glu_bwd8_one(g0, u0, d0, act, dgate[i], dup[i]);
        glu_bwd8_one(g1, u1, d1, act, dgate[i + stride], dup[i + stride]);
    }
    if (i < n8) glu_bwd8_one(gate[i], up[i], dy[i], act, dgate[i], dup[i]);
}

// ---------------------------------------------------------------- add_rms_norm

// sum = round(x + y); normed = w * (sum * rsqrt(mean(sum^2) + eps)), one block per row.
#define DEF_ADD_RMS(S, T)                                                                                \
    extern "C" __global__ void add_rms_norm_##S(T* sum, T* normed, const T* x, const T* y, const void* w, \
                                                 int wcode, i64 rows, i64 H, float eps) {                \
        __shared__ float sh[64];                                                                         \
        i64 row = blockIdx.x;                                                                            \
        float ss = 0.f;                                                                                  \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) {                                              \
            T s = fromf<T>(tof(x[row * H + j]) + tof(y[row * H + j]));                                   \
            sum[row * H + j] = s;                                                                        \
            float v = tof(s);                                                                            \
            ss += v * v;                                                                                 \
        }                                                                                                \
        ss = block_sum(ss, sh);                                                                          \
        float r = rsqrtf(ss / (float)H + eps);                                                           \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) {                                              \
            float wv = wcode == 0 ? ((const float*)w)[j] : (float)ld_any(w, wcode, j);                   \
            normed[row * H + j] = fromf<T>(wv * (tof(sum[row * H + j]) * r));                            \
        }                                                                                                \
    }
FOR_FLOATS(DEF_ADD_RMS)

// The bf16 row version (rms_fwd8's layout): each thread keeps its chunks of the sum in
// registers, so x and y are read once and sum and normed written once.
template <int RV_MAX>
__device__ __forceinline__ void add_rms_fwd8(uint4* sum, uint4* normed, const uint4* x, const uint4* y,
                                             const void* w, int wcode, int H, float eps) {
    __shared__ float sh[64];
    const int chunks = H >> 3;
    const i64 row = blockIdx.x;
    float sv[RV_MAX][8];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < chunks) {
            float yv[8];
            unpack8(x[row * chunks + c], sv[k]);
            unpack8(y[row * chunks + c], yv);
#pragma unroll
            for (int e = 0; e < 8; ++e) sv[k][e] += yv[e];
            uint4 packed = pack8(sv[k]);
            sum[row * chunks + c] = packed;
            unpack8(packed, sv[k]);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += sv[k][e] * sv[k][e];
        }
    }
    ss = block_sum(ss, sh);
    float r = rsqrtf(ss / (float)H + eps);
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < chunks) {
            float wv[8], o[8];
            load_w8(wv, w, wcode, c);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = wv[e] * (sv[k][e] * r);
            normed[row * chunks + c] = pack8(o);
        }
    }
}

// add_rms_norm_grad: rms_bwd8 on the sum, its dx rounded as the unfused kernel stores it,
// plus the residual gradient dres (rounded once more, as the unfused add). dw as rms_bwd8:
// per-block f32 partials, summed by colsum_f32_to. Each block walks its `rpb` rows with the
// next row's x, dy and dres loaded before this row's reduction, so the loads' latency
// overlaps the block's reduction and stores instead of following them (the kernel is
// bandwidth-bound, and one row in flight a block left HBM idle between rows): 29.7 -> 28.8
// us a call at [4096, 2048] on an H100.
template <int RV_MAX>
__device__ __forceinline__ void add_rms_bwd8(uint4* dsum, float* dw_acc,
                                             const uint4* x, const void* w, int wcode,
                                             const uint4* dy, const uint4* dres,
                                             i64 rows, int H, float eps, int rpb) {
    __shared__ float sh[72];
    const int chunks = H >> 3;
    float wv[RV_MAX][8], acc[RV_MAX][8];
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[k][e] = 0.f;
        if (c < chunks) load_w8(wv[k], w, wcode, c);
    }
    const i64 r0 = (i64)blockIdx.x * rpb;
    const i64 r1 = r0 + rpb < rows ? r0 + rpb : rows;
    uint4 nx[RV_MAX], ng[RV_MAX], nr[RV_MAX];
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < chunks && r0 < r1) {
            nx[k] = x[r0 * chunks + c];
            ng[k] = dy[r0 * chunks + c];
            nr[k] = dres[r0 * chunks + c];
        }
    }
    for (i64 row = r0; row < r1; ++row) {
        // This row is held packed (bf16) across the reduction and unpacked on each side
        // of it; `__launch_bounds__(256, 4 / RV)` caps r1 at 64 registers (four blocks an
        // SM, as before the prefetch), without spills.
        uint4 cx[RV_MAX], cg[RV_MAX], cr[RV_MAX];
        float ss = 0.f, gx = 0.f;
#pragma unroll
        for (int k = 0; k < RV_MAX; ++k) {
            int c = threadIdx.x + k * blockDim.x;
            if (c < chunks) {
                cx[k] = nx[k];
                cg[k] = ng[k];
                cr[k] = nr[k];
                if (row + 1 < r1) {
                    nx[k] = x[(row + 1) * chunks + c];
                    ng[k] = dy[(row + 1) * chunks + c];
                    nr[k] = dres[(row + 1) * chunks + c];
                }
                float xv[8], gv[8];
                unpack8(cx[k], xv);
                unpack8(cg[k], gv);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    ss += xv[e] * xv[e];
                    gx += gv[e] * wv[k][e] * xv[e];
                }
            }
        }
        block_sum2(ss, gx, sh);
        float r = rsqrtf(ss / (float)H + eps);
        float mean = gx * r / (float)H;
#pragma unroll
        for (int k = 0; k < RV_MAX; ++k) {
            int c = threadIdx.x + k * blockDim.x;
            if (c < chunks) {
                float xv[8], gv[8], d[8], rv[8];
                unpack8(cx[k], xv);
                unpack8(cg[k], gv);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    float xh = xv[e] * r;
                    d[e] = r * (gv[e] * wv[k][e] - xh * mean);
                    acc[k][e] += gv[e] * xh;
                }
                unpack8(pack8(d), d);
                unpack8(cr[k], rv);
#pragma unroll
                for (int e = 0; e < 8; ++e) d[e] = rv[e] + d[e];
                dsum[row * chunks + c] = pack8(d);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < chunks) st8f(dw_acc + (i64)blockIdx.x * H + c * 8, acc[k]);
    }
}

#define DEF_ADD_RMS8(RV)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) add_rms_fwd8_bf16_r##RV(uint4* sum, uint4* normed,   \
            const uint4* x, const uint4* y, const void* w, int wcode, i64 rows, int H, float eps) {         \
        add_rms_fwd8<RV>(sum, normed, x, y, w, wcode, H, eps);                                              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 4 / RV) add_rms_bwd8_bf16_r##RV(uint4* dsum,         \
            float* dw_acc,                                                                                  \
            const uint4* x, const void* w, int wcode, const uint4* dy, const uint4* dres, i64 rows, int H,  \
            float eps, int rpb) {                                                                           \
        add_rms_bwd8<RV>(dsum, dw_acc, x, w, wcode, dy, dres, rows, H, eps, rpb);                           \
    }
DEF_ADD_RMS8(1)
DEF_ADD_RMS8(2)
DEF_ADD_RMS8(4)

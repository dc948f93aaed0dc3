// Backward ops (made by `autodiff`) and optimizer updates (made by `optimizer`).
// Formulas follow runtime/src/cpu/backward_kernels.rs, the reference.

// ---------------------------------------------------------------- rms_norm_grad
// Per row: r = rsqrt(mean(x^2) + eps), xh = x r, g = dy w, dx = r (g - xh mean(g xh)).
// rstd[row] = r is kept for the dw column sums.
#define DEF_RMS_BWD(S_, T)                                                                                \
    extern "C" __global__ void rms_norm_bwd_##S_(T* dx, float* rstd, const T* x, const void* w, int wcode,  \
                                                   const T* dy, i64 rows, i64 H, float eps) {              \
        __shared__ float sh[64];                                                                          \
        i64 row = blockIdx.x;                                                                             \
        const T* xr = x + row * H;                                                                        \
        const T* gr = dy + row * H;                                                                       \
        float ss = 0.f;                                                                                   \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) { float v = tof(xr[j]); ss += v * v; }          \
        ss = block_sum(ss, sh);                                                                           \
        float r = rsqrtf(ss / (float)H + eps);                                                            \
        float gx = 0.f;                                                                                   \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) {                                               \
            float wv = wcode == 0 ? ((const float*)w)[j] : (float)ld_any(w, wcode, j);                    \
            gx += tof(gr[j]) * wv * tof(xr[j]) * r;                                                       \
        }                                                                                                 \
        float mean = block_sum(gx, sh) / (float)H;                                                        \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) {                                               \
            float wv = wcode == 0 ? ((const float*)w)[j] : (float)ld_any(w, wcode, j);                    \
            float xh = tof(xr[j]) * r;                                                                    \
            dx[row * H + j] = fromf<T>(r * (tof(gr[j]) * wv - xh * mean));                                \
        }                                                                                                 \
        if (threadIdx.x == 0) rstd[row] = r;                                                              \
    }                                                                                                     \
    /* acc[j] += sum over a chunk of rows of dy[r, j] x[r, j] rstd[r]; block (32, 8) */                   \
    extern "C" __global__ void rms_dw_partial_##S_(float* acc, const T* x, const T* dy, const float* rstd,  \
                                                     i64 rows, i64 H, i64 chunk) {                         \
        __shared__ float sh[8][33];                                                                       \
        i64 j = (i64)blockIdx.x * 32 + threadIdx.x;                                                       \
        i64 r0 = (i64)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;                     \
        float s = 0.f;                                                                                    \
        if (j < H)                                                                                        \
            for (i64 r = r0 + threadIdx.y; r < r1; r += 8) s += tof(dy[r * H + j]) * tof(x[r * H + j]) * rstd[r]; \
        sh[threadIdx.y][threadIdx.x] = s;                                                                 \
        __syncthreads();                                                                                  \
        if (threadIdx.y == 0 && j < H) {                                                                  \
            float t = 0.f;                                                                                \
            _Pragma("unroll") for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];                        \
            atomicAdd(acc + j, t);                                                                        \
        }                                                                                                 \
    }
FOR_FLOATS(DEF_RMS_BWD)

// f32 accumulators to any dtype code.
extern "C" __global__ void f32_to_any(void* out, int ocode, const float* in, i64 n) {
    GRID_STRIDE(i, n) st_any(out, ocode, i, in[i]);
}

// ---------------------------------------------------------------- cross_entropy_grad
// dlogits[row] = g (softmax(x) - onehot(label)), g = valid * (dloss[row] | dloss | dloss / count).
// mode: 0 none, 1 sum, 2 mean; count (mean) precomputed into *count.
#define DEF_CE_BWD(S_, T)                                                                                 \
    extern "C" __global__ void ce_bwd_##S_(T* dx, const T* logits, const i64* labels, const void* dloss,    \
                                             int dcode, int mode, const float* count, i64 rows, i64 V,     \
                                             i64 ignore) {                                                 \
        __shared__ float sh[64];                                                                          \
        i64 row = blockIdx.x;                                                                             \
        const T* x = logits + row * V;                                                                    \
        T* d = dx + row * V;                                                                              \
        i64 lab = labels[row];                                                                            \
        float g = mode == 0 ? (float)ld_any(dloss, dcode, row) : (float)ld_any(dloss, dcode, 0);          \
        if (mode == 2) g /= *count;                                                                       \
        if (lab == ignore || lab < 0 || lab >= V) g = 0.f;                                                \
        if (g == 0.f) {                                                                                   \
            for (i64 j = threadIdx.x; j < V; j += blockDim.x) d[j] = fromf<T>(0.f);                       \
            return;                                                                                       \
        }                                                                                                 \
        float m = -INFINITY, s = 0.f;                                                                     \
        for (i64 j = threadIdx.x; j < V; j += blockDim.x) ms_merge(m, s, tof(x[j]), 1.f);                 \
        block_ms(m, s, sh);                                                                               \
        float inv = 1.f / s;                                                                              \
        for (i64 j = threadIdx.x; j < V; j += blockDim.x) {                                               \
            float p = __expf(tof(x[j]) - m) * inv;                                                        \
            d[j] = fromf<T>(g * (p - (j == lab ? 1.f : 0.f)));                                            \
        }                                                                                                 \
    }
FOR_FLOATS(DEF_CE_BWD)

// ---------------------------------------------------------------- embedding_grad
// dW [V, H] (zeroed first, or holding `init` when `accumulate`): block t handles token t;
// only the first token with a given id sums every token with that id (deterministic, in
// f32) and writes the row (adding it to the row's value when `accumulate`). Tokens whose id
// is `pad` (padding_idx; -1 for none) add nothing: that row keeps its value.
#define DEF_EMB_BWD(S_, T)                                                                                \
    extern "C" __global__ void embedding_bwd_##S_(T* dw, const i64* ids, const T* dy, i64 ntok, i64 H,      \
                                                    i64 vocab, i64 pad, int accumulate, int* err) {        \
        __shared__ int first, ndup;                                                                       \
        __shared__ int dups[1024];                                                                        \
        i64 t = blockIdx.x;                                                                               \
        i64 id = ids[t];                                                                                  \
        if (id < 0 || id >= vocab) { if (threadIdx.x == 0) atomicExch(err, 9); return; }                  \
        if (id == pad) return;                                                                            \
        if (threadIdx.x == 0) { first = 1; ndup = 0; }                                                    \
        __syncthreads();                                                                                  \
        for (i64 u = threadIdx.x; u < ntok; u += blockDim.x) {                                            \
            if (ids[u] != id || u == t) continue;                                                         \
            if (u < t) first = 0;                                                                         \
            else { int k = atomicAdd(&ndup, 1); if (k < 1024) dups[k] = (int)u; }                         \
        }                                                                                                 \
        __syncthreads();                                                                                  \
        if (!first) return;                                                                               \
        int nd = ndup;                                                                                    \
        if (threadIdx.x == 0 && nd > 1 && nd <= 1024) { /* sum in token order: deterministic */          \
            for (int a = 1; a < nd; ++a) { int v = dups[a], b = a - 1; while (b >= 0 && dups[b] > v) { dups[b + 1] = dups[b]; --b; } dups[b + 1] = v; } \
        }                                                                                                 \
        __syncthreads();                                                                                  \
        for (i64 j = threadIdx.x; j < H; j += blockDim.x) {                                               \
            float acc = tof(dy[t * H + j]);                                                               \
            if (nd <= 1024) { for (int k = 0; k < nd; ++k) acc += tof(dy[(i64)dups[k] * H + j]); }        \
            else { for (i64 u = t + 1; u < ntok; ++u) if (ids[u] == id) acc += tof(dy[u * H + j]); }      \
            if (accumulate) acc += tof(dw[id * H + j]);                                                   \
            dw[id * H + j] = fromf<T>(acc);                                                               \
        }                                                                                                 \
    }
FOR_FLOATS(DEF_EMB_BWD)

// ---------------------------------------------------------------- elementwise grads

#define DEF_ACT_BWD(S_, T)                                                                                \
    extern "C" __global__ void silu_bwd_##S_(T* dx, const T* x, const T* dy, i64 n) {                      \
        GRID_STRIDE(i, n) {                                                                               \
            float xv = tof(x[i]);                                                                         \
            float s = 1.f / (1.f + __expf(-xv));                                                          \
            dx[i] = fromf<T>(tof(dy[i]) * s * (1.f + xv * (1.f - s)));                                    \
        }                                                                                                 \
    }                                                                                                     \
    extern "C" __global__ void gelu_bwd_##S_(T* dx, const T* x, const T* dy, i64 n, int tanh_approx) {     \
        GRID_STRIDE(i, n) {                                                                               \
            float xv = tof(x[i]), d;                                                                      \
            if (tanh_approx) {                                                                            \
                const float a = 0.044715f, c = 0.7978845608028654f;                                       \
                float x2 = xv * xv;                                                                       \
                float t = tanhf(c * xv * (1.f + a * x2));                                                 \
                d = 0.5f * (1.f + t) + 0.5f * xv * (1.f - t * t) * c * (1.f + 3.f * a * x2);              \
            } else {                                                                                      \
                d = 0.5f * (1.f + erff(xv * 0.70710678118654752f)) + xv * __expf(-0.5f * xv * xv) * 0.3989422804014327f; \
            }                                                                                             \
            dx[i] = fromf<T>(tof(dy[i]) * d);                                                             \
        }                                                                                                 \
    }                                                                                                     \
    /* softmax_grad over the last dim: y (dy - sum(dy y)) */                                              \
    extern "C" __global__ void softmax_bwd_##S_(T* dx, const T* y, const T* dy, i64 rows, i64 n) {         \
        __shared__ float sh[64];                                                                          \
        i64 row = blockIdx.x;                                                                             \
        float dot = 0.f;                                                                                  \
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) dot += tof(y[row * n + j]) * tof(dy[row * n + j]); \
        dot = block_sum(dot, sh);                                                                         \
        for (i64 j = threadIdx.x; j < n; j += blockDim.x)                                                 \
            dx[row * n + j] = fromf<T>(tof(y[row * n + j]) * (tof(dy[row * n + j]) - dot));               \
    }                                                                                                     \
    /* moe_combine_grad: one warp per row r (token t, slot s from order[r]):                            \
       drows[r] = w[t, s] dy[t]; dweights[t, s] = rows[r] . dy[t] (dweights zeroed first) */             \
    extern "C" __global__ void moe_combine_bwd_##S_(T* drows, T* dweights, const T* rows, const i64* order, \
                                                      const T* w, const T* dy, i64 R, int k, i64 H) {      \
        i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;                                        \
        int lane = threadIdx.x & 31;                                                                      \
        if (r >= R) return;                                                                               \
        i64 f = order[r], t = f / k;                                                                      \
        float wv = tof(w[f]);                                                                             \
        float dot = 0.f;                                                                                  \
        for (i64 j = lane; j < H; j += 32) {                                                              \
            float g = tof(dy[t * H + j]);                                                                 \
            drows[r * H + j] = fromf<T>(wv * g);                                                          \
            dot += tof(rows[r * H + j]) * g;                                                              \
        }                                                                                                 \
        dot = warp_sum(dot);                                                                              \
        if (lane == 0) dweights[f] = fromf<T>(dot);                                                       \
    }
FOR_FLOATS(DEF_ACT_BWD)

// ---------------------------------------------------------------- optimizers

// The learning rate at 1-based step t under a linear warmup of `warmup` steps (0: none).
__device__ __forceinline__ float warmup_lr(float lr, float t, float warmup) {
    return warmup > 0.f ? lr * fminf(1.f, t / warmup) : lr;
}

// One AdamW step (torch.optim.AdamW): p' = p (1 - lr wd) - lr mhat / (sqrt(vhat) + eps).
#define DEF_ADAMW(SP, TP, SM, TM)                                                                         \
    extern "C" __global__ void adamw_##SP##_##SM(TP* po, TM* mo, TM* vo, const TP* p, const TP* g,          \
            const TM* m, const TM* v, const void* step, int scode, i64 n, float lr, float b1, float b2,    \
            float eps, float wd, float warmup) {                                                          \
        float t = (float)ld_any(step, scode, 0);                                                          \
        lr = warmup_lr(lr, t, warmup);                                                                    \
        float c1 = 1.f - powf(b1, t), c2 = 1.f - powf(b2, t);                                             \
        float step_size = lr / c1, rc2 = rsqrtf(c2);                                                      \
        GRID_STRIDE(i, n) {                                                                               \
            float gv = tof(g[i]);                                                                         \
            float mv = b1 * tof(m[i]) + (1.f - b1) * gv;                                                  \
            float vv = b2 * tof(v[i]) + (1.f - b2) * gv * gv;                                             \
            float pv = tof(p[i]) * (1.f - lr * wd);                                                       \
            pv -= step_size * mv / (sqrtf(vv) * rc2 + eps);                                               \
            po[i] = fromf<TP>(pv);                                                                        \
            mo[i] = fromf<TM>(mv);                                                                        \
            vo[i] = fromf<TM>(vv);                                                                        \
        }                                                                                                 \
    }
DEF_ADAMW(f32, float, f32, float)
DEF_ADAMW(bf16, __nv_bfloat16, f32, float)
DEF_ADAMW(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
DEF_ADAMW(f16, __half, f32, float)
DEF_ADAMW(f16, __half, f16, __half)

// SGD (torch.optim.SGD): g += wd p; with momentum buf' = mu buf + g and the step uses buf'.
#define DEF_SGD(S_, T)                                                                                    \
    extern "C" __global__ void sgd_##S_(T* po, T* bo, const T* p, const T* g, const T* buf, i64 n, float lr, \
                                          float mu, float wd) {                                           \
        GRID_STRIDE(i, n) {                                                                               \
            float gv = tof(g[i]) + wd * tof(p[i]);                                                        \
            if (buf) { gv = mu * tof(buf[i]) + gv; bo[i] = fromf<T>(gv); }                                \
            po[i] = fromf<T>(tof(p[i]) - lr * gv);                                                        \
        }                                                                                                 \
    }
FOR_FLOATS(DEF_SGD)

// AdamW on f32 master weights with a low-precision gradient and parameter, fused:
// cast(grad) -> adamw(master, m, v) -> cast(new master) in one pass (28 bytes per
// parameter instead of 40).
#define DEF_ADAMW_MASTER(S_, T)                                                                           \
    extern "C" __global__ void adamw_master_##S_(T* pout, float* mo, float* mo1, float* vo, const float* w,  \
            const T* g, const float* m, const float* v, const void* step, int scode, i64 n, float lr,      \
            float b1, float b2, float eps, float wd, float warmup) {                                      \
        float t = (float)ld_any(step, scode, 0);                                                          \
        lr = warmup_lr(lr, t, warmup);                                                                    \
        float c1 = 1.f - powf(b1, t), c2 = 1.f - powf(b2, t);                                             \
        float step_size = lr / c1, rc2 = rsqrtf(c2);                                                      \
        GRID_STRIDE(i, n) {                                                                               \
            float gv = tof(g[i]);                                                                         \
            float mv = b1 * m[i] + (1.f - b1) * gv;                                                       \
            float vv = b2 * v[i] + (1.f - b2) * gv * gv;                                                  \
            float pv = w[i] * (1.f - lr * wd);                                                            \
            pv -= step_size * mv / (sqrtf(vv) * rc2 + eps);                                              \
            mo[i] = pv;                                                                                   \
            mo1[i] = mv;                                                                                  \
            vo[i] = vv;                                                                                   \
            pout[i] = fromf<T>(pv);                                                                       \
        }                                                                                                 \
    }
DEF_ADAMW_MASTER(bf16, __nv_bfloat16)
DEF_ADAMW_MASTER(f16, __half)

// ---------------------------------------------------------------- bf16 row kernels, 16-byte vectors
// For bf16 rows whose width H is a multiple of 8 and at most 8 * 4 * blockDim (the common
// transformer case): each thread keeps its (up to 4) 8-wide chunks of a row in registers, so
// x and dy are read once. Block 256 threads; w is f32 (wcode 0) or bf16 (wcode 1).

__device__ __forceinline__ void ld8f(const float* p, float* f) {
    float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void st8f(float* p, const float* f) {
    ((float4*)p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    ((float4*)p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void load_w8(float* wv, const void* w, int wcode, int c) {
    if (wcode == 0) {
        const float4* p = (const float4*)((const float*)w + c * 8);
        float4 a = p[0], b = p[1];
        wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w; wv[4] = b.x; wv[5] = b.y; wv[6] = b.z; wv[7] = b.w;
    } else {
        unpack8(((const uint4*)w)[c], wv);
    }
}

// y = w * x * rsqrt(mean(x^2) + eps), one block per row; rstd (may be null) keeps 1/rms.
template <int RV_MAX>
__device__ __forceinline__ void rms_fwd8(uint4* out, const uint4* x, const void* w, int wcode, i64 rows, int H, float eps,
                                         float* rstd) {
    __shared__ float sh[64];
    const int chunks = H >> 3;
    const i64 row = blockIdx.x;
    const uint4* xr = x + row * chunks;
    float xv[RV_MAX][8];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < chunks) {
            unpack8(xr[c], xv[k]);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += xv[k][e] * xv[k][e];
        }
    }
    ss = block_sum(ss, sh);
    float r = rsqrtf(ss / (float)H + eps);
    if (rstd && threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < chunks) {
            float wv[8], y[8];
            load_w8(wv, w, wcode, c);
#pragma unroll
            for (int e = 0; e < 8; ++e) y[e] = wv[e] * (xv[k][e] * r);
            out[row * chunks + c] = pack8(y);
        }
    }
}

// rms_norm backward fused with the dw column sums: a block takes `rpb` consecutive rows,
// writes dx = r (g w - x r mean(g w x r)) for each and accumulates dy x r per column in
// registers, stored as row blockIdx.x of the f32 partials dw_acc [gridDim.x, H] (summed by
// colsum_f32_to: deterministic, no atomics).
template <int RV_MAX>
__device__ __forceinline__ void rms_bwd8(uint4* dx, float* dw_acc, const uint4* x, const void* w, int wcode,
                                         const uint4* dy, i64 rows, int H, float eps, int rpb) {
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
    for (i64 row = r0; row < r1; ++row) {
        float xv[RV_MAX][8], gv[RV_MAX][8];
        float ss = 0.f, gx = 0.f;
#pragma unroll
        for (int k = 0; k < RV_MAX; ++k) {
            int c = threadIdx.x + k * blockDim.x;
            if (c < chunks) {
                unpack8(x[row * chunks + c], xv[k]);
                unpack8(dy[row * chunks + c], gv[k]);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    ss += xv[k][e] * xv[k][e];
                    gx += gv[k][e] * wv[k][e] * xv[k][e];
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
                float d[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    float xh = xv[k][e] * r;
                    d[e] = r * (gv[k][e] * wv[k][e] - xh * mean);
                    acc[k][e] += gv[k][e] * xh;
                }
                dx[row * chunks + c] = pack8(d);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RV_MAX; ++k) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < chunks) st8f(dw_acc + (i64)blockIdx.x * H + c * 8, acc[k]);
    }
}

// RV = chunks per thread (1, 2 or 4: H up to 2048, 4096, 8192 with 256 threads).
#define DEF_RMS8(RV)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) rms_fwd8_bf16_r##RV(uint4* out, const uint4* x,       \
            const void* w, int wcode, i64 rows, int H, float eps, float* rstd) {                            \
        rms_fwd8<RV>(out, x, w, wcode, rows, H, eps, rstd);                                                 \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) rms_bwd8_bf16_r##RV(uint4* dx, float* dw_acc,         \
            const uint4* x, const void* w, int wcode, const uint4* dy, i64 rows, int H, float eps, int rpb) { \
        rms_bwd8<RV>(dx, dw_acc, x, w, wcode, dy, rows, H, eps, rpb);                                       \
    }
DEF_RMS8(1)
DEF_RMS8(2)
DEF_RMS8(4)

// cross_entropy_grad from the forward's per-row log-sum-exp: one pass over the logits,
// dx = g (exp(x - lse) - onehot(label)); V a multiple of 8. Same g as ce_bwd.
extern "C" __global__ void ce_bwd_lse8_bf16(uint4* dx, const uint4* logits, const i64* labels, const float* lse,
                                            const void* dloss, int dcode, int mode, const float* count, i64 rows,
                                            i64 V8, i64 ignore) {
    const i64 row = blockIdx.x;
    const i64 V = V8 * 8;
    const i64 lab = labels[row];
    float g = mode == 0 ? (float)ld_any(dloss, dcode, row) : (float)ld_any(dloss, dcode, 0);
    if (mode == 2) g /= *count;
    if (lab == ignore || lab < 0 || lab >= V) g = 0.f;
    const uint4* x = logits + row * V8;
    uint4* d = dx + row * V8;
    if (g == 0.f) {
        for (i64 j = threadIdx.x; j < V8; j += blockDim.x) d[j] = make_uint4(0, 0, 0, 0);
        return;
    }
    const float l = lse[row];
    for (i64 j = threadIdx.x; j < V8; j += blockDim.x) {
        float v[8];
        unpack8(x[j], v);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = g * (__expf(v[e] - l) - (j * 8 + e == lab ? 1.f : 0.f));
        d[j] = pack8(v);
    }
}

// Rotary embedding without per-element index arithmetic: grid (ceil(S / blockDim.y), ceil(N / hp), B),
// thread x = j < D / 2, each thread over `hp` heads of its position with its cos/sin in registers
// (the table is read once per position, not once per head). j < r/2 rotates the pair (j, j + r/2);
// the rest copy two of the D - r unrotated features each. cos/sin are f32 or bf16 [Bc, S, r]
// (cbs = 0 when Bc = 1). x and out are [B, N, S, D], or [B, S, N, D] when bshd = 1.
#define DEF_ROPE2(S_, T)                                                                                   \
    extern "C" __global__ void rope2_##S_(T* out, const T* x, const void* cosv, const void* sinv, int ccode,  \
                                            int N, int S, int D, int r, i64 cbs, int bshd, int hp) {          \
        const int j = threadIdx.x;                                                                           \
        const int s = blockIdx.x * blockDim.y + threadIdx.y;                                                 \
        if (s >= S || j >= D / 2) return;                                                                    \
        const int b = blockIdx.z;                                                                            \
        const int n0 = blockIdx.y * hp, n1 = min(N, n0 + hp);                                                \
        const i64 hstride = bshd ? (i64)D : (i64)S * D;                                                      \
        const i64 base0 = bshd ? (((i64)b * S + s) * N + n0) * D : (((i64)b * N + n0) * S + s) * D;          \
        const int h = r / 2;                                                                                 \
        if (j < h) {                                                                                         \
            const i64 ci = (i64)b * cbs + (i64)s * r + j;                                                    \
            float c0, s0, c1, s1;                                                                            \
            if (ccode == 0) {                                                                                \
                c0 = ((const float*)cosv)[ci]; c1 = ((const float*)cosv)[ci + h];                            \
                s0 = ((const float*)sinv)[ci]; s1 = ((const float*)sinv)[ci + h];                            \
            } else {                                                                                         \
                c0 = (float)ld_any(cosv, ccode, ci); c1 = (float)ld_any(cosv, ccode, ci + h);                \
                s0 = (float)ld_any(sinv, ccode, ci); s1 = (float)ld_any(sinv, ccode, ci + h);                \
            }                                                                                                \
            _Pragma("unroll 4") for (int n = n0; n < n1; ++n) {                                              \
                const i64 base = base0 + (n - n0) * hstride;                                                 \
                float a = tof(x[base + j]), bb = tof(x[base + j + h]);                                       \
                out[base + j] = fromf<T>(a * c0 - bb * s0);                                                  \
                out[base + j + h] = fromf<T>(bb * c1 + a * s1);                                              \
            }                                                                                                \
        } else {                                                                                             \
            const int d0 = r + 2 * (j - h);                                                                  \
            for (int n = n0; n < n1; ++n) {                                                                  \
                const i64 base = base0 + (n - n0) * hstride;                                                 \
                out[base + d0] = x[base + d0];                                                               \
                if (d0 + 1 < D) out[base + d0 + 1] = x[base + d0 + 1];                                       \
            }                                                                                                \
        }                                                                                                    \
    }
FOR_FLOATS(DEF_ROPE2)

// ---------------------------------------------------------------- optimizers, 8 elements per thread
// The same updates as adamw_* / adamw_master_* with 16-byte loads and stores (n a multiple
// of 8, pointers 16-byte aligned): bandwidth-bound kernels, so access width is what counts.
__device__ __forceinline__ void adam8(float* p, float* m, float* v, const float* g, float lr, float b1, float b2,
                                      float eps, float wd, float step_size, float rc2) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        m[e] = b1 * m[e] + (1.f - b1) * g[e];
        v[e] = b2 * v[e] + (1.f - b2) * g[e] * g[e];
        p[e] = p[e] * (1.f - lr * wd) - step_size * m[e] / (sqrtf(v[e]) * rc2 + eps);
    }
}
// bf16 params, grads and moments (torch.optim.AdamW on a bf16 model).
extern "C" __global__ void adamw8_bf16_bf16(uint4* po, uint4* mo, uint4* vo, const uint4* p, const uint4* g,
                                            const uint4* m, const uint4* v, const void* step, int scode, i64 n8,
                                            float lr, float b1, float b2, float eps, float wd, float warmup) {
    float t = (float)ld_any(step, scode, 0);
    lr = warmup_lr(lr, t, warmup);
    float step_size = lr / (1.f - powf(b1, t)), rc2 = rsqrtf(1.f - powf(b2, t));
    GRID_STRIDE(i, n8) {
        float pv[8], gv[8], mv[8], vv[8];
        unpack8(p[i], pv);
        unpack8(g[i], gv);
        unpack8(m[i], mv);
        unpack8(v[i], vv);
        adam8(pv, mv, vv, gv, lr, b1, b2, eps, wd, step_size, rc2);
        po[i] = pack8(pv);
        mo[i] = pack8(mv);
        vo[i] = pack8(vv);
    }
}
// f32 master weights and moments, bf16 grad in and bf16 param out (adamw_master_bf16).
extern "C" __global__ void adamw_master8_bf16(uint4* pout, float* wo, float* mo, float* vo, const float* w,
                                              const uint4* g, const float* m, const float* v, const void* step,
                                              int scode, i64 n8, float lr, float b1, float b2, float eps, float wd,
                                              float warmup) {
    float t = (float)ld_any(step, scode, 0);
    lr = warmup_lr(lr, t, warmup);
    float step_size = lr / (1.f - powf(b1, t)), rc2 = rsqrtf(1.f - powf(b2, t));
    GRID_STRIDE(i, n8) {
        float pv[8], gv[8], mv[8], vv[8];
        ld8f(w + i * 8, pv);
        unpack8(g[i], gv);
        ld8f(m + i * 8, mv);
        ld8f(v + i * 8, vv);
        adam8(pv, mv, vv, gv, lr, b1, b2, eps, wd, step_size, rc2);
        st8f(wo + i * 8, pv);
        st8f(mo + i * 8, mv);
        st8f(vo + i * 8, vv);
        pout[i] = pack8(pv);
    }
}

// Column sums of f32 partials [nrows, H] to `out` (dtype code): the deterministic second
// half of rms_bwd8's dw. Block (32, 8): 32 columns, 8 row phases summed in a fixed order.
extern "C" __global__ void colsum_f32_to(void* out, int ocode, const float* part, i64 nrows, i64 H) {
    __shared__ float sh[8][33];
    const i64 j = (i64)blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (j < H)
        for (i64 r = threadIdx.y; r < nrows; r += 8) s += part[r * H + j];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < H) {
        float t = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];
        st_any(out, ocode, j, t);
    }
}

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
// dW [V, H] (zeroed first): block t handles token t; only the first token with a given id
// sums every token with that id (deterministic, in f32) and writes the row.
#define DEF_EMB_BWD(S_, T)                                                                                \
    extern "C" __global__ void embedding_bwd_##S_(T* dw, const i64* ids, const T* dy, i64 ntok, i64 H,      \
                                                    i64 vocab, int* err) {                                 \
        __shared__ int first, ndup;                                                                       \
        __shared__ int dups[1024];                                                                        \
        i64 t = blockIdx.x;                                                                               \
        i64 id = ids[t];                                                                                  \
        if (id < 0 || id >= vocab) { if (threadIdx.x == 0) atomicExch(err, 9); return; }                  \
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

// One AdamW step (torch.optim.AdamW): p' = p (1 - lr wd) - lr mhat / (sqrt(vhat) + eps).
#define DEF_ADAMW(SP, TP, SM, TM)                                                                         \
    extern "C" __global__ void adamw_##SP##_##SM(TP* po, TM* mo, TM* vo, const TP* p, const TP* g,          \
            const TM* m, const TM* v, const void* step, int scode, i64 n, float lr, float b1, float b2,    \
            float eps, float wd) {                                                                        \
        float t = (float)ld_any(step, scode, 0);                                                          \
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
            float b1, float b2, float eps, float wd) {                                                    \
        float t = (float)ld_any(step, scode, 0);                                                          \
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

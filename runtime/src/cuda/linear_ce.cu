// ---------------------------------------------------------------- linear_cross_entropy
// The lm_head + cross-entropy fused over vocabulary chunks (lowering in exec/linear_ce.rs).
// Per chunk the executor writes z = x w_c^T [rows, len] with a cuBLASLt GEMM into a
// scratch buffer; these kernels turn it into the running statistics (forward) or, in
// place, into the logits' gradient (backward), which two GEMMs then take to dx and dw_c.

// The logit from the GEMM's raw value: times `scale`, then `cap * tanh(. / cap)` (cap 0: none).
__device__ __forceinline__ float lce_logit(float z, float scale, float cap) {
    z *= scale;
    return cap > 0.f ? cap * tanhf(z / cap) : z;
}

extern "C" __global__ void lce_init(float* m, float* s, float* target, i64 rows) {
    GRID_STRIDE(i, rows) {
        m[i] = -INFINITY;
        s[i] = 0.f;
        target[i] = 0.f;
    }
}

// One block per row: merges the chunk's (max, sum of exp) into the running (m, s) and takes
// the target logit when the row's label falls in [c0, c0 + len). A label out of range (and
// not ignore) sets err = 2.
#define DEF_LCE_STATS(S, T)                                                                              \
    extern "C" __global__ void lce_stats_##S(float* m, float* s, float* target, const T* z,               \
                                             const i64* labels, i64 len, i64 c0, i64 V, i64 ignore,       \
                                             float scale, float cap, int* err) {                          \
        __shared__ float sh[64];                                                                         \
        i64 row = blockIdx.x;                                                                            \
        const T* zr = z + row * len;                                                                     \
        float mm = -INFINITY, ss = 0.f;                                                                  \
        for (i64 j = threadIdx.x; j < len; j += blockDim.x) ms_merge(mm, ss, lce_logit(tof(zr[j]), scale, cap), 1.f); \
        block_ms(mm, ss, sh);                                                                            \
        if (threadIdx.x == 0) {                                                                          \
            float m0 = m[row], s0 = s[row];                                                              \
            ms_merge(m0, s0, mm, ss);                                                                    \
            m[row] = m0;                                                                                 \
            s[row] = s0;                                                                                 \
            i64 lab = labels[row];                                                                       \
            if (lab != ignore) {                                                                         \
                if (lab < 0 || lab >= V) atomicExch(err, 2);                                             \
                else if (lab >= c0 && lab < c0 + len) target[row] = lce_logit(tof(zr[lab - c0]), scale, cap); \
            }                                                                                            \
        }                                                                                                \
    }
FOR_FLOATS(DEF_LCE_STATS)

extern "C" __global__ void lce_finish(float* lse, const float* m, const float* s, i64 rows) {
    GRID_STRIDE(i, rows) lse[i] = m[i] + __logf(s[i]);
}

// In place: the chunk's raw logits z become dz = (dlse * softmax + dtarget * onehot(label))
// times the derivative of the scale and soft-cap, for dx += dz w_c and dw_c = dz^T x.
#define DEF_LCE_DZ(S, T)                                                                                 \
    extern "C" __global__ void lce_dz_##S(T* z, const i64* labels, const float* lse, const float* dlse,  \
                                          const float* dtarget, i64 rows, i64 len, i64 c0, i64 ignore,    \
                                          float scale, float cap) {                                       \
        i64 total = rows * len;                                                                          \
        GRID_STRIDE(i, total) {                                                                          \
            i64 row = i / len, j = i % len;                                                              \
            float y = tof(z[i]) * scale;                                                                 \
            float t = cap > 0.f ? tanhf(y / cap) : 0.f;                                                  \
            float logit = cap > 0.f ? cap * t : y;                                                       \
            float g = dlse[row] * __expf(logit - lse[row]);                                              \
            i64 lab = labels[row];                                                                       \
            if (lab != ignore && lab == c0 + j) g += dtarget[row];                                       \
            if (cap > 0.f) g *= 1.f - t * t;                                                             \
            z[i] = fromf<T>(g * scale);                                                                  \
        }                                                                                                \
    }
FOR_FLOATS(DEF_LCE_DZ)

// The gradient of one raw logit z at column j of a row with log-sum-exp l: dlse * softmax
// plus dtarget at the label, times the derivative of the scale and soft-cap.
__device__ __forceinline__ float lce_grad1(float z, i64 j, float scale, float cap, float l, float dl, float dt,
                                           bool counted, i64 lab) {
    float y = z * scale;
    float t = cap > 0.f ? tanhf(y / cap) : 0.f;
    float logit = cap > 0.f ? cap * t : y;
    float g = dl * __expf(logit - l);
    if (counted && lab == j) g += dt;
    if (cap > 0.f) g *= 1.f - t * t;
    return g * scale;
}

// linear_cross_entropy_with_grad: one block per token row of a [rows, V] chunk holding the
// raw logits over the whole vocabulary. The row's max and sum of exp give its lse; the target
// logit is read before any thread overwrites the row, then the row becomes dz in place, as
// lce_dz forms it. Two-byte rows whose length is a multiple of 8 (and 16-byte aligned) are
// read and written 16 bytes at a time. A label out of range (and not ignore) sets err = 2 and
// counts as ignored.
#define DEF_LCE_ROW_GRAD(S, T)                                                                           \
    extern "C" __global__ void lce_row_grad_##S(T* z, const i64* labels, float* lse, float* target,    \
                                                const float* dlse, const float* dtarget, i64 V,         \
                                                i64 ignore, float scale, float cap, int* err) {          \
        __shared__ float sh[64];                                                                         \
        i64 row = blockIdx.x;                                                                            \
        T* zr = z + row * V;                                                                             \
        bool vec = (V % 8) == 0 && sizeof(T) == 2 && ((u64)zr % 16) == 0;                                \
        float mm = -INFINITY, ss = 0.f;                                                                  \
        if (vec) {                                                                                       \
            const uint4* zv = (const uint4*)zr;                                                          \
            for (i64 j = threadIdx.x; j < V / 8; j += blockDim.x) {                                      \
                uint4 u = zv[j];                                                                         \
                const T* e = (const T*)&u;                                                               \
                float lg[8];                                                                             \
                _Pragma("unroll") for (int k = 0; k < 8; ++k) lg[k] = lce_logit(tof(e[k]), scale, cap);  \
                float mx = lg[0];                                                                        \
                _Pragma("unroll") for (int k = 1; k < 8; ++k) mx = fmaxf(mx, lg[k]);                     \
                if (mx == -INFINITY) continue;                                                           \
                float sm = 0.f;                                                                          \
                _Pragma("unroll") for (int k = 0; k < 8; ++k) sm += __expf(lg[k] - mx);                  \
                ms_merge(mm, ss, mx, sm);                                                                \
            }                                                                                            \
        } else {                                                                                         \
            for (i64 j = threadIdx.x; j < V; j += blockDim.x) {                                          \
                float l = lce_logit(tof(zr[j]), scale, cap);                                             \
                if (l > mm) {                                                                            \
                    ss = ss * __expf(mm - l) + 1.f;                                                      \
                    mm = l;                                                                              \
                } else if (mm != -INFINITY) {                                                            \
                    ss += __expf(l - mm);                                                                \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        block_ms(mm, ss, sh);                                                                            \
        float l = mm + __logf(ss);                                                                       \
        i64 lab = labels[row];                                                                           \
        bool counted = lab != ignore;                                                                    \
        if (counted && (lab < 0 || lab >= V)) {                                                          \
            counted = false;                                                                             \
            if (threadIdx.x == 0) atomicExch(err, 2);                                                    \
        }                                                                                                \
        if (threadIdx.x == 0) {                                                                          \
            lse[row] = l;                                                                                \
            target[row] = counted ? lce_logit(tof(zr[lab]), scale, cap) : 0.f;                           \
        }                                                                                                \
        __syncthreads();                                                                                 \
        float dl = dlse[row], dt = dtarget[row];                                                         \
        if (vec) {                                                                                       \
            uint4* zv = (uint4*)zr;                                                                      \
            for (i64 j = threadIdx.x; j < V / 8; j += blockDim.x) {                                      \
                uint4 u = zv[j];                                                                         \
                T* e = (T*)&u;                                                                           \
                _Pragma("unroll") for (int k = 0; k < 8; ++k)                                            \
                    e[k] = fromf<T>(lce_grad1(tof(e[k]), j * 8 + k, scale, cap, l, dl, dt, counted, lab)); \
                zv[j] = u;                                                                               \
            }                                                                                            \
        } else {                                                                                         \
            for (i64 j = threadIdx.x; j < V; j += blockDim.x)                                            \
                zr[j] = fromf<T>(lce_grad1(tof(zr[j]), j, scale, cap, l, dl, dt, counted, lab));         \
        }                                                                                                \
    }
FOR_FLOATS(DEF_LCE_ROW_GRAD)

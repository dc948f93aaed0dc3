// ---------------------------------------------------------------- fp8 (fp8_matmul)
// Quantization of `fp8_matmul`'s operands, bit for bit as weft_ir::fp8 defines it:
// a per-tensor power-of-two scale 2^e from the operand's amax, round to nearest even
// saturating at the format's largest finite value, in software (any architecture).
// `fmt`: 0 e4m3 (max 448), 1 e5m2 (max 57344).

// Unbiased exponent and 23 mantissa bits of a positive finite float (subnormals normalized).
__device__ __forceinline__ int f8_exp_of(float a, u32& man) {
    u32 b = __float_as_uint(a);
    int e = (int)((b >> 23) & 0xff);
    u32 m = b & 0x7fffffu;
    if (e == 0) {
        int lz = __clz(m) - 8;
        man = (m << (lz + 1)) & 0x7fffffu;
        return -126 - lz;
    }
    man = m;
    return e - 127;
}

__device__ __forceinline__ float f8_max(int fmt) { return fmt == 0 ? 448.f : 57344.f; }

__device__ __forceinline__ int f8_scale_exp(float amax, int fmt) {
    if (!(amax > 0.f) || isinf(amax)) return 0;
    u32 mm, ma;
    int em = f8_exp_of(f8_max(fmt), mm);
    int ea = f8_exp_of(amax, ma);
    int e = em - ea - (ma > mm ? 1 : 0);
    return max(-100, min(100, e));
}

__device__ __forceinline__ float f8_round(float x, int fmt) {
    if (x != x) return x;
    float mx = f8_max(fmt), a = fabsf(x);
    if (a >= mx) return copysignf(mx, x);
    if (a == 0.f) return x;
    u32 m;
    int e = max(f8_exp_of(a, m), fmt == 0 ? -6 : -14);
    int qe = e - (fmt == 0 ? 3 : 2);
    float r = ldexpf(rintf(ldexpf(a, -qe)), qe);
    return copysignf(fminf(r, mx), x);
}

// The byte of a value already on the format's grid.
__device__ __forceinline__ u8 f8_encode(float r, int fmt) {
    if (r != r) return fmt == 0 ? 0x7f : 0x7e;
    u32 sign = (__float_as_uint(r) >> 31) << 7;
    float a = fabsf(r);
    if (a == 0.f) return (u8)sign;
    int mb = fmt == 0 ? 3 : 2, bias = fmt == 0 ? 7 : 15, emin = fmt == 0 ? -6 : -14;
    u32 m;
    int e = f8_exp_of(a, m);
    if (e < emin) return (u8)(sign | (u32)ldexpf(a, mb - emin));
    return (u8)(sign | ((u32)(e + bias) << mb) | (m >> (23 - mb)));
}

// amax (as the bits of a non-negative float, so NaN wins) of n elements into *amax,
// which the caller zeroes first: one atomic per block.
#define F8_AMAX(S, T)                                                                          \
    extern "C" __global__ void fp8_amax_##S(u32* amax, const T* x, i64 n) {                   \
        __shared__ u32 sh[32];                                                                 \
        u32 m = 0;                                                                             \
        GRID_STRIDE(i, n) m = max(m, __float_as_uint(fabsf(tof(x[i]))));                      \
        for (int o = 16; o; o >>= 1) m = max(m, __shfl_xor_sync(FULL_MASK, m, o));            \
        if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = m;                                 \
        __syncthreads();                                                                       \
        if (threadIdx.x == 0) {                                                                \
            for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = max(m, sh[w]);               \
            if (m) atomicMax(amax, m);                                                         \
        }                                                                                      \
    }
FOR_FLOATS(F8_AMAX)

// Quantizes x [R, C] (row-major) to fp8 bytes, as [R, C] or transposed to [C, R]
// (`transpose`), with the scale of *amax; block (0) also writes the dequantizing factor
// 2^-e to *inv_scale. One 32x32 tile per block of 32x8 threads.
#define F8_QUANT(S, T)                                                                         \
    extern "C" __global__ void fp8_quantize_##S(u8* out, float* inv_scale, const T* x,       \
                                                const u32* amax, i64 rows, i64 cols, int transpose, \
                                                int fmt) {                                    \
        __shared__ u8 tile[32][33];                                                            \
        int e = f8_scale_exp(__uint_as_float(*amax), fmt);                                     \
        if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) *inv_scale = ldexpf(1.f, -e); \
        i64 R = rows, C = cols, tiles_c = (C + 31) / 32;                                       \
        i64 r0 = ((i64)blockIdx.x / tiles_c) * 32, c0 = ((i64)blockIdx.x % tiles_c) * 32;      \
        int tx = threadIdx.x, ty = threadIdx.y;                                                \
        for (int dy = ty; dy < 32; dy += 8) {                                                  \
            i64 r = r0 + dy, c = c0 + tx;                                                      \
            u8 q = 0;                                                                          \
            if (r < R && c < C) q = f8_encode(f8_round(ldexpf(tof(x[r * C + c]), e), fmt), fmt); \
            if (!transpose) {                                                                  \
                if (r < R && c < C) out[r * C + c] = q;                                        \
            } else {                                                                           \
                tile[dy][tx] = q;                                                              \
            }                                                                                  \
        }                                                                                      \
        if (!transpose) return;                                                                \
        __syncthreads();                                                                       \
        for (int dy = ty; dy < 32; dy += 8) {                                                  \
            i64 c = c0 + dy, r = r0 + tx;                                                      \
            if (c < C && r < R) out[c * R + r] = tile[tx][dy];                                 \
        }                                                                                      \
    }
FOR_FLOATS(F8_QUANT)

// x quantized and dequantized in its own dtype (the GEMM's operands when cuBLASLt's FP8
// path does not apply): exact, since the scale is a power of two.
#define F8_QDQ(S, T)                                                                           \
    extern "C" __global__ void fp8_qdq_##S(T* out, const T* x, const u32* amax, i64 n, int fmt) { \
        int e = f8_scale_exp(__uint_as_float(*amax), fmt);                                     \
        GRID_STRIDE(i, n) out[i] = fromf<T>(ldexpf(f8_round(ldexpf(tof(x[i]), e), fmt), -e));  \
    }
FOR_FLOATS(F8_QDQ)

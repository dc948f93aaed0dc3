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

// ---- bf16 fast paths: 16-byte loads, the hardware conversion on sm_89+ (the same
// round-to-nearest-even with saturation as f8_round, so the bytes are identical).

// Two floats already scaled to two fp8 bytes (lo in the low byte).
__device__ __forceinline__ u16 f8_pack2(float lo, float hi, int fmt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u16 r;
    if (fmt == 0) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (u16)f8_encode(f8_round(lo, fmt), fmt) | ((u16)f8_encode(f8_round(hi, fmt), fmt) << 8);
#endif
}

// 8 bf16 (one 16-byte word) times 2^e to 8 fp8 bytes.
__device__ __forceinline__ u64 f8_pack8(uint4 u, float s, int fmt) {
    float f[8];
    unpack8(u, f);
    u64 r = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) r |= (u64)f8_pack2(f[2 * i] * s, f[2 * i + 1] * s, fmt) << (16 * i);
    return r;
}

// amax of n8 16-byte words of bf16: the magnitude bits compared as unsigned halves.
extern "C" __global__ void fp8_amax8_bf16(u32* amax, const uint4* x, i64 n8) {
    __shared__ u32 sh[32];
    u32 m2 = 0;
    GRID_STRIDE(i, n8) {
        uint4 u = x[i];
        m2 = __vmaxu2(m2, __vmaxu2(__vmaxu2(u.x & 0x7fff7fffu, u.y & 0x7fff7fffu),
                                   __vmaxu2(u.z & 0x7fff7fffu, u.w & 0x7fff7fffu)));
    }
    u32 m = max(m2 & 0xffffu, m2 >> 16) << 16;
    for (int o = 16; o; o >>= 1) m = max(m, __shfl_xor_sync(FULL_MASK, m, o));
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = max(m, sh[w]);
        if (m) atomicMax(amax, m);
    }
}

// x [rows, cols] bf16 (cols a multiple of 8) to fp8 bytes in the same layout.
extern "C" __global__ void fp8_quantize8_bf16(u64* out, float* inv_scale, const uint4* x,
                                              const u32* amax, i64 n8, int fmt) {
    int e = f8_scale_exp(__uint_as_float(*amax), fmt);
    if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = ldexpf(1.f, -e);
    float s = ldexpf(1.f, e);
    GRID_STRIDE(i, n8) out[i] = f8_pack8(x[i], s, fmt);
}

// x [rows, cols] bf16 (both multiples of 64) to fp8 bytes transposed, [cols, rows]: one
// 64x64 tile per block of 256 threads, quantized into shared memory as it is loaded.
extern "C" __global__ void fp8_quantize_t64_bf16(u8* out, float* inv_scale, const uint4* x,
                                                 const u32* amax, i64 rows, i64 cols, int fmt) {
    __shared__ __align__(16) u8 tile[64][72];
    int e = f8_scale_exp(__uint_as_float(*amax), fmt);
    if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = ldexpf(1.f, -e);
    float s = ldexpf(1.f, e);
    i64 tiles_c = cols / 64;
    i64 r0 = ((i64)blockIdx.x / tiles_c) * 64, c0 = ((i64)blockIdx.x % tiles_c) * 64;
    int t = threadIdx.x;
    // Load: 64 rows x 8 words of 8 bf16; each thread two words.
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int w = t + 256 * k, r = w >> 3, cw = w & 7;
        uint4 u = x[((r0 + r) * cols + c0) / 8 + cw];
        *(u64*)&tile[r][cw * 8] = f8_pack8(u, s, fmt);
    }
    __syncthreads();
    // Store: 64 output rows (tile columns) x 4 words of 16 bytes; one word a thread.
    int c = t >> 2, rw = t & 3;
    u32 v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int r = rw * 16 + j * 4;
        v[j] = (u32)tile[r][c] | ((u32)tile[r + 1][c] << 8) | ((u32)tile[r + 2][c] << 16) |
               ((u32)tile[r + 3][c] << 24);
    }
    *(uint4*)&out[(c0 + c) * rows + r0 + rw * 16] = make_uint4(v[0], v[1], v[2], v[3]);
}

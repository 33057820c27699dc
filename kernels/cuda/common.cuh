// Device helpers shared by every kernel file. Each kernels/cuda/*.cu is compiled as its own NVRTC
// module without CUDA headers; kernels/src/ops/nvrtc.rs (`Source::ptx`) prepends this
// file to each source, so a helper is written once and every module has the same one.
//
// bf16 is handled as its bit pattern (unsigned short).

// bf16 -> f32 (exact).
__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }

// f32 -> bf16, round to nearest even; a NaN stays a quiet NaN with its sign and top payload bits
// (as half's bf16::from_f32, candle's CPU cast, and mt-optim's cast).
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// The eight bf16 values of a 16-byte group, widened to f32.
__device__ __forceinline__ void unpack8(uint4 u, float* out) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        out[2 * e] = bf2f((unsigned short)(w[e] & 0xffffu));
        out[2 * e + 1] = bf2f((unsigned short)(w[e] >> 16));
    }
}

// A thread's N 16-byte groups g0, g0 + step, ... of a row of n groups, all loads issued before any
// is used (those past the row's end are left untouched).
template <int N>
__device__ __forceinline__ void load_groups(const uint4* __restrict__ p, int g0, int step, int n, uint4* u) {
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (g0 + k * step < n) u[k] = p[g0 + k * step];
}

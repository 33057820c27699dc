// Fused causal softmax forward and backward over rows of attention scores, for bf16 compute.
// Compiled at run time with NVRTC (crates/layers/src/cuda_kernels.rs): no CUDA headers are
// included, bf16 is handled as its bit pattern (unsigned short) with round-to-nearest-even.
//
// Layout: `rows` rows of `t` columns, contiguous; row r is query position i = r % t (the rows
// of one [g*t, t] block are g query heads stacked along the time axis). One block per row.
//
// Forward:  P[r, j] = exp(c*S[r,j] - m) / sum_{k<=i} exp(c*S[r,k] - m) for j <= i, else 0,
//           m = max_{k<=i} c*S[r,k]; S bf16 (the raw Q K^T), P f32 (kept for the backward).
// Backward: dS[r, j] = c * P[r,j] * (dP[r,j] - sum_k dP[r,k] P[r,k]); dP bf16, dS bf16.
// (c = 1/sqrt(head_dim) is folded in here, so Q K^T and dS K need no separate scaling pass.)

__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }

__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float block_reduce(float v, float* sh, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sh[lane] : (is_max ? __int_as_float(0xff800000) : 0.0f);
        for (int o = 16; o > 0; o >>= 1) {
            float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = is_max ? fmaxf(v, w) : v + w;
        }
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

extern "C" __global__ void mt_causal_softmax_fwd(const unsigned short* __restrict__ s, float* __restrict__ p,
                                                  int t, float c) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x;
    const int i = (int)(row % (size_t)t);
    const unsigned short* sr = s + row * (size_t)t;
    float* pr = p + row * (size_t)t;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, c * bf2f(sr[j]));
    m = block_reduce(m, sh, true);
    float z = 0.0f;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) z += expf(c * bf2f(sr[j]) - m);
    z = block_reduce(z, sh, false);
    for (int j = threadIdx.x; j < t; j += blockDim.x) pr[j] = j <= i ? expf(c * bf2f(sr[j]) - m) / z : 0.0f;
}

extern "C" __global__ void mt_softmax_bwd(const unsigned short* __restrict__ dp, const float* __restrict__ p,
                                          unsigned short* __restrict__ ds, int t, float c) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x;
    const unsigned short* dpr = dp + row * (size_t)t;
    const float* pr = p + row * (size_t)t;
    unsigned short* dsr = ds + row * (size_t)t;
    float acc = 0.0f;
    for (int j = threadIdx.x; j < t; j += blockDim.x) acc += bf2f(dpr[j]) * pr[j];
    acc = block_reduce(acc, sh, false);
    for (int j = threadIdx.x; j < t; j += blockDim.x) dsr[j] = f2bf(c * pr[j] * (bf2f(dpr[j]) - acc));
}

// AdamW and the gradient's sum of squares for a unit whose optimizer state lives on the GPU (the
// outer unit and the leading decoder layers the planner keeps resident). Compiled at run time with NVRTC
// after common.cuh, no CUDA headers.
//
// mt_adamw evaluates exactly the expressions of mt-optim's fused loop (crates/optim/src/adamw.rs,
// `update_block`), with the f32 scalars `Coeffs::of` derives on the host; NVRTC runs with
// --fmad=false and IEEE division and square root, so every element rounds as on the CPU.
// state = [master | m | v], n elements each. With `w_out` non-zero, the new master weights are
// also written there as bf16 (f2bf: round to nearest even, and a NaN kept quiet with its sign and
// top payload bits, as the host's cast), the unit's device slot: one pass instead of update + cast
// + copy.
struct AdamWCoeffs {
    float grad_scale, decay;
    int lerp_small;
    float lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, step_size;
};

__device__ __forceinline__ void adamw1(float& p, float& m, float& v, float graw, const AdamWCoeffs& c) {
    const float g = graw * c.grad_scale;
    const float mi = m;
    const float base = c.lerp_small ? mi : g;
    const float m_new = base + c.lerp_coeff * (g - mi);
    const float v_new = v * c.beta2 + c.one_minus_beta2 * g * g;
    const float denom = sqrtf(v_new) / c.bc2_sqrt + c.eps;
    p = p * c.decay - c.step_size * m_new / denom;
    m = m_new;
    v = v_new;
}

extern "C" __global__ void mt_adamw(float* __restrict__ state, const float* __restrict__ grad, long long n,
                                    float grad_scale, float decay, int lerp_small, float lerp_coeff, float beta2,
                                    float one_minus_beta2, float bc2_sqrt, float eps, float step_size,
                                    unsigned long long w_out) {
    const AdamWCoeffs c = {grad_scale, decay, lerp_small, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, step_size};
    float* p = state;
    float* m = state + n;
    float* v = state + 2 * n;
    unsigned short* w = (unsigned short*)w_out;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = (n & 3) == 0 && (((unsigned long long)state | (unsigned long long)grad) & 15) == 0 && (w_out & 7) == 0;
    if (vec) {
        // 16-byte loads and stores (8-byte bf16 stores): the same element order of operations.
        float4* p4 = (float4*)p;
        float4* m4 = (float4*)m;
        float4* v4 = (float4*)v;
        const float4* g4 = (const float4*)grad;
        for (long long i = t0; i < (n >> 2); i += stride) {
            float4 pp = p4[i], mm = m4[i], vv = v4[i];
            const float4 gg = g4[i];
            adamw1(pp.x, mm.x, vv.x, gg.x, c);
            adamw1(pp.y, mm.y, vv.y, gg.y, c);
            adamw1(pp.z, mm.z, vv.z, gg.z, c);
            adamw1(pp.w, mm.w, vv.w, gg.w, c);
            p4[i] = pp;
            m4[i] = mm;
            v4[i] = vv;
            if (w) {
                const unsigned lo = (unsigned)f2bf(pp.x) | ((unsigned)f2bf(pp.y) << 16);
                const unsigned hi = (unsigned)f2bf(pp.z) | ((unsigned)f2bf(pp.w) << 16);
                uint2 r;
                r.x = lo;
                r.y = hi;
                ((uint2*)w)[i] = r;
            }
        }
        return;
    }
    for (long long i = t0; i < n; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw1(pi, mi, vi, grad[i], c);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (w) w[i] = f2bf(pi);
    }
}

// partial[blockIdx.x] = the block's `acc` values summed in a fixed tree (blockDim.x == 256, a
// power of two): deterministic for a fixed grid, whatever the timing. The host adds the partials
// in order.
__device__ __forceinline__ void block_sum_into(double acc, double* __restrict__ partial) {
    __shared__ double sh[256];
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// partial[block] = sum of g^2 (f64) over the grid-stride set of `block` (block_sum_into).
extern "C" __global__ void mt_sumsq(const float* __restrict__ g, double* __restrict__ partial, long long n) {
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double x = (double)g[i];
        acc += x * x;
    }
    block_sum_into(acc, partial);
}

// partial[block] = sum of x^2 (f64) of the bf16 values of g over the grid-stride set of `block`
// (block_sum_into, as mt_sumsq).
extern "C" __global__ void mt_sumsq_bf16(const unsigned short* __restrict__ g, double* __restrict__ partial,
                                         long long n) {
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double x = (double)__uint_as_float(((unsigned)g[i]) << 16);
        acc += x * x;
    }
    block_sum_into(acc, partial);
}

// A streamed layer's gradient for a bf16 landing (exact mode, bf16 store gradients): out[i] =
// bf16(g[i]), rounded as the host's land rounds (f2bf: nearest even; a NaN keeps its sign and top
// payload bits, quiet). Its share of the global norm is then mt_sumsq_bf16 of `out`.
extern "C" __global__ void mt_narrow_bf16(const float* __restrict__ g, unsigned short* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        out[i] = f2bf(g[i]);
    }
}

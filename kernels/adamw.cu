// AdamW and the gradient's sum of squares for a unit whose optimizer state lives on the GPU (the
// outer unit when the planner keeps it resident). Compiled at run time with NVRTC, no headers.
//
// mt_adamw evaluates exactly the expressions of mt-optim's fused loop (crates/optim/src/adamw.rs,
// `update_block`), with the f32 scalars `Coeffs::of` derives on the host; NVRTC runs with
// --fmad=false and IEEE division and square root, so every element rounds as on the CPU.
// state = [master | m | v], n elements each.
extern "C" __global__ void mt_adamw(float* __restrict__ state, const float* __restrict__ grad, long long n,
                                    float grad_scale, float decay, int lerp_small, float lerp_coeff, float beta2,
                                    float one_minus_beta2, float bc2_sqrt, float eps, float step_size) {
    float* p = state;
    float* m = state + n;
    float* v = state + 2 * n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float g = grad[i] * grad_scale;
        const float mi = m[i];
        const float base = lerp_small ? mi : g;
        const float m_new = base + lerp_coeff * (g - mi);
        const float v_new = v[i] * beta2 + one_minus_beta2 * g * g;
        const float denom = sqrtf(v_new) / bc2_sqrt + eps;
        p[i] = p[i] * decay - step_size * m_new / denom;
        m[i] = m_new;
        v[i] = v_new;
    }
}

// partial[block] = sum of g^2 (f64) over the grid-stride set of `block`, reduced in a fixed tree:
// deterministic for a fixed grid, whatever the timing. The host adds the partials in order.
extern "C" __global__ void mt_sumsq(const float* __restrict__ g, double* __restrict__ partial, long long n) {
    __shared__ double sh[256];
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double x = (double)g[i];
        acc += x * x;
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

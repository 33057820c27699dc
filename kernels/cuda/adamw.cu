// AdamW and the gradient's sum of squares for a unit whose optimizer state lives on the GPU (the
// outer unit and the leading decoder layers the planner keeps resident; GPU-updated streamed
// layers). Compiled at run time with NVRTC after common.cuh, no CUDA headers.
//
// mt_adamw evaluates exactly the expressions of mt-optim's fused loop (crates/optim/src/adamw/mod.rs,
// `update_block`), with the f32 scalars `Coeffs::of` derives on the host; NVRTC runs with
// --fmad=false and IEEE division and square root, so every element rounds as on the CPU.
// state = [master | m | v], n fp32 elements each (fp32 moments; mt_adamw_bf16 and mt_adamw_q8
// below take the other encodings). With `w_out` non-zero, the new master weights are
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

// ---- Moments in bf16 or 8 bits (`--optim-states`, crates/optim/src/moments/mod.rs) ----
//
// The update is adamw1_coded on the decoded moments (mt-optim's update_block_coded: adamw1 but
// for a product by 1 / bc2_sqrt where adamw1 divides); the new moments are encoded with
// stochastic rounding whose draw for element i (its index in the unit, as a 32-bit unsigned) is
// mix32(i ^ key), key from mt_optim::rounding_key(step, unit): m rounds with its low 16 bits, v
// with its high 16. state = [master: n f32 | m | v], each moment moment_bytes(n) long
// (crates/core/src/states.rs).
//
// Bitwise the host's (mt-optim's scalar definitions and its AVX2 / AVX-512 kernels, which give
// the scalar bits), because every operation below is one the host performs, on the same operands,
// in the same order, and each is exactly rounded the same way on both:
// - add, sub, mul, div and sqrt are IEEE single precision, round to nearest even, on both (NVRTC's
//   defaults --prec-div=true, --prec-sqrt=true; Rust and the x86 vector instructions are IEEE);
// - no multiply-add is fused (NVRTC --fmad=false; Rust never contracts, and the host kernels
//   call one instruction per operation) and nothing is reassociated;
// - subnormals are kept on both (NVRTC's default --ftz=false; the host never sets FTZ/DAZ);
// - fmaxf / fminf return the other operand for a NaN, as Rust's f32::max / min and the operand
//   order the host kernels give vmaxps / vminps; a block's maximum is exact, so the tree order
//   here and the lane order there agree;
// - floorf and the float <-> integer conversions of whole numbers are exact;
// - the host kernels' only inexact instructions (rsqrt / rcp estimates) start a search that an
//   exact comparison finishes, so they find the same code as m_floor / v_floor here.
// A NaN's payload is the one thing that may differ (the GPU makes canonical NaNs); an update
// that makes one is a non-finite step, which the engine skips.

__device__ __forceinline__ unsigned mix32(unsigned h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    return h ^ (h >> 16);
}

// 16 bits of a draw as a uniform in [0, 1) (mt-optim's unit16).
__device__ __forceinline__ float unit16(unsigned r) { return (float)r * (1.0f / 65536.0f); }

// adamw1 over decoded coded moments (mt-optim's update_block_coded): the same expressions but
// sqrt(v) * inv_bc2, inv_bc2 = 1 / bc2_sqrt, for sqrt(v) / bc2_sqrt.
__device__ __forceinline__ void adamw1_coded(float& p, float& m, float& v, float graw, const AdamWCoeffs& c,
                                             float inv_bc2) {
    const float g = graw * c.grad_scale;
    const float mi = m;
    const float base = c.lerp_small ? mi : g;
    const float m_new = base + c.lerp_coeff * (g - mi);
    const float v_new = v * c.beta2 + c.one_minus_beta2 * g * g;
    const float denom = sqrtf(v_new) * inv_bc2 + c.eps;
    p = p * c.decay - c.step_size * m_new / denom;
    m = m_new;
    v = v_new;
}

// f32 -> bf16 rounded stochastically with the draw r (its low 16 bits); a NaN as f2bf keeps it.
__device__ __forceinline__ unsigned short bf16_sr(float x, unsigned r) {
    const unsigned b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
    return (unsigned short)((b + (r & 0xffffu)) >> 16);
}

extern "C" __global__ void mt_adamw_bf16(float* __restrict__ state, const float* __restrict__ grad, long long n,
                                         float grad_scale, float decay, int lerp_small, float lerp_coeff, float beta2,
                                         float one_minus_beta2, float bc2_sqrt, float eps, float step_size,
                                         unsigned key, unsigned long long w_out) {
    const AdamWCoeffs c = {grad_scale, decay, lerp_small, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, step_size};
    const float inv_bc2 = 1.0f / bc2_sqrt;
    unsigned short* m = (unsigned short*)(state + n);
    unsigned short* v = (unsigned short*)((char*)m + ((2 * n + 3) / 4) * 4);
    unsigned short* w = (unsigned short*)w_out;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float pi = state[i], mi = bf2f(m[i]), vi = bf2f(v[i]);
        adamw1_coded(pi, mi, vi, grad[i], c, inv_bc2);
        state[i] = pi;
        const unsigned h = mix32((unsigned)i ^ key);
        m[i] = bf16_sr(mi, h & 0xffffu);
        v[i] = bf16_sr(vi, h >> 16);
        if (w) w[i] = f2bf(pi);
    }
}

#define Q8_BLOCK 256
// 127^2 and 255^4 (the latter rounded to f32, as the host's constant).
#define M_TOP 16129.0f
#define V_TOP 4228250625.0f

// The largest of the block's `x` (each thread's own; 0 where it has none), in a fixed tree.
// fmaxf ignores NaNs, as the host's f32::max does, and max is exact, so any order agrees.
__device__ __forceinline__ float block_max(float x, float* sh) {
    sh[threadIdx.x] = x;
    __syncthreads();
    for (int s = Q8_BLOCK / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    const float r = sh[0];
    __syncthreads();
    return r;
}

// What scales a block's values into code units: top / max, 0 for a block whose step is 0, at
// most FLT_MAX (mt-optim's block_inverse).
__device__ __forceinline__ float block_inverse(float s, float mx, float top) {
    return s == 0.0f ? 0.0f : fminf(top / mx, 3.40282347e38f);
}

// k^4 as the fourth-root code computes it (mt-optim's fourth).
__device__ __forceinline__ float fourth(float k) { return (k * k) * (k * k); }

// The largest k in 0..=126 with k*k <= y, for y >= 0 (mt-optim's m_floor: the same
// operations, though any exact way of finding k gives the same k).
__device__ __forceinline__ float m_floor(float y) {
    const float k = fminf(floorf(sqrtf(y)), 126.0f);
    return k * k > y ? k - 1.0f : k;
}

// The largest k in 0..=254 with fourth(k) <= y, for y >= 0 (mt-optim's v_floor).
__device__ __forceinline__ float v_floor(float y) {
    const float k = fminf(floorf(sqrtf(sqrtf(y))), 254.0f);
    if (fourth(k) > y) return k - 1.0f;
    if (k < 254.0f && fourth(k + 1.0f) <= y) return k + 1.0f;
    return k;
}

// One block of Q8_BLOCK threads per 8-bit block (grid-stride over blocks): decode, update, the
// block's maxima, encode (mt-optim's code_m and code_v: m, square-root code in -127..127, step
// max|m| / 127^2; v, fourth-root code in 0..255, step max v / 255^4; each element scaled by the
// block's inverse step, a NaN as 0, and rounded to one of its two neighbouring codes with the
// probability that keeps its value unbiased).
extern "C" __global__ void mt_adamw_q8(float* __restrict__ state, const float* __restrict__ grad, long long n,
                                       float grad_scale, float decay, int lerp_small, float lerp_coeff, float beta2,
                                       float one_minus_beta2, float bc2_sqrt, float eps, float step_size,
                                       unsigned key, unsigned long long w_out) {
    __shared__ float sh[Q8_BLOCK];
    const AdamWCoeffs c = {grad_scale, decay, lerp_small, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, step_size};
    const float inv_bc2 = 1.0f / bc2_sqrt;
    const long long codes = ((n + 3) / 4) * 4, blocks = (n + Q8_BLOCK - 1) / Q8_BLOCK;
    unsigned char* mc = (unsigned char*)(state + n);
    float* ms = (float*)(mc + codes);
    unsigned char* vc = mc + codes + 4 * blocks;
    float* vs = (float*)(vc + codes);
    unsigned short* w = (unsigned short*)w_out;
    for (long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        const long long i = b * Q8_BLOCK + threadIdx.x;
        const bool in = i < n;
        float pi = 0.0f, mi = 0.0f, vi = 0.0f;
        if (in) {
            // q*|q| is +-q^2, exact.
            const float a = (float)(signed char)mc[i];
            mi = (a * fabsf(a)) * ms[b];
            const float av = (float)vc[i];
            vi = ((av * av) * (av * av)) * vs[b];
            pi = state[i];
            adamw1_coded(pi, mi, vi, grad[i], c, inv_bc2);
            state[i] = pi;
            if (w) w[i] = f2bf(pi);
        }
        const float am = block_max(in ? fabsf(mi) : 0.0f, sh);
        const float vm = block_max(in ? vi : 0.0f, sh);
        const float sm = am / M_TOP, sv = vm / V_TOP;
        if (in) {
            const float ym = fmaxf(fabsf(mi) * block_inverse(sm, am, M_TOP), 0.0f);
            const float lm = m_floor(ym);
            const unsigned h = mix32((unsigned)i ^ key);
            const float um = unit16(h & 0xffffu);
            const int q = (int)(um * (2.0f * lm + 1.0f) < ym - lm * lm ? lm + 1.0f : lm);
            const float yv = fmaxf(vi * block_inverse(sv, vm, V_TOP), 0.0f);
            const float lv = v_floor(yv);
            const float t_lo = fourth(lv), t_hi = fourth(lv + 1.0f);
            const float uv = unit16(h >> 16);
            mc[i] = (unsigned char)(signed char)(mi < 0.0f ? -q : q);
            vc[i] = (unsigned char)(int)(uv * (t_hi - t_lo) < yv - t_lo ? lv + 1.0f : lv);
        }
        if (threadIdx.x == 0) {
            ms[b] = sm;
            vs[b] = sv;
        }
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

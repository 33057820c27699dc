// Fused elementwise kernels of the decoder layer for bf16 compute: RMSNorm forward/backward,
// SwiGLU forward/backward, RoPE (forward; the backward is the same kernel with sin negated).
// Compiled at run time with NVRTC after common.cuh (kernels/src/ops/nvrtc.rs); no CUDA headers.
//
// Each kernel reproduces, in one pass, the roundings of the candle op sequence it replaces
// (crates/layers/src/ops.rs, rope.rs): every intermediate that candle rounds to bf16 is rounded
// here too (f2bf), statistics are f32, every multiply and add is rounded separately (NVRTC runs
// with --fmad=false) and means are sum * (1/n) as candle computes them. What still differs:
// the order of the reductions (sums over a row or over rows) and the exp implementation.

__device__ __forceinline__ float block_sum(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sh[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

// r[row] = 1 / sqrt(mean(x^2) + eps). One block per row.
extern "C" __global__ void mt_rms_stats(const unsigned short* __restrict__ x, float* __restrict__ r, int n, float eps) {
    __shared__ float sh[32];
    const unsigned short* xr = x + (size_t)blockIdx.x * n;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) { float v = bf2f(xr[j]); s += v * v; }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) r[blockIdx.x] = 1.0f / sqrtf(s * (1.0f / (float)n) + eps);  // candle: sum * (1/n)
}

// y = bf16(bf16(x r) w). Grid-stride over rows*n elements.
extern "C" __global__ void mt_rms_apply(const unsigned short* __restrict__ x, const float* __restrict__ r,
                                        const unsigned short* __restrict__ w, unsigned short* __restrict__ y,
                                        long long total, int n) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        int j = (int)(e % n);
        float xhat = rbf(bf2f(x[e]) * r[e / n]);
        y[e] = f2bf(xhat * bf2f(w[j]));
    }
}

// dx = bf16(g r - x r^3 mean(g x)), g = bf16(dy w). One block per row.
extern "C" __global__ void mt_rms_bwd_dx(const unsigned short* __restrict__ dy, const unsigned short* __restrict__ x,
                                         const float* __restrict__ r, const unsigned short* __restrict__ w,
                                         unsigned short* __restrict__ dx, int n) {
    __shared__ float sh[32];
    const size_t off = (size_t)blockIdx.x * n;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += rbf(bf2f(dy[off + j]) * bf2f(w[j])) * bf2f(x[off + j]);
    s = block_sum(s, sh);
    const float rr = r[blockIdx.x];
    const float k = ((rr * rr) * rr) * (s * (1.0f / (float)n));
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float g = rbf(bf2f(dy[off + j]) * bf2f(w[j]));
        dx[off + j] = f2bf(g * rr - bf2f(x[off + j]) * k);
    }
}

// partial[grp, j] = sum over the rows of group grp of dy[row, j] * bf16(x[row, j] r[row]).
// Block (32, 8): 32 columns, 8 row lanes; grid (ceil(n/32), groups). Deterministic (no atomics);
// the caller sums the partials over groups.
extern "C" __global__ void mt_rms_bwd_dw(const unsigned short* __restrict__ dy, const unsigned short* __restrict__ x,
                                         const float* __restrict__ r, float* __restrict__ partial,
                                         int rows, int n) {
    __shared__ float sh[8][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    const int groups = gridDim.y, per = (rows + groups - 1) / groups;
    const int r0 = blockIdx.y * per, r1 = min(rows, r0 + per);
    float acc = 0.0f;
    if (j < n)
        for (int row = r0 + threadIdx.y; row < r1; row += 8)
            acc += bf2f(dy[(size_t)row * n + j]) * rbf(bf2f(x[(size_t)row * n + j]) * r[row]);
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < n) {
        float t = 0.0f;
        for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];
        partial[(size_t)blockIdx.y * n + j] = t;
    }
}

// mid = bf16(bf16(silu(g)) u).
extern "C" __global__ void mt_swiglu_fwd(const unsigned short* __restrict__ g, const unsigned short* __restrict__ u,
                                         unsigned short* __restrict__ mid, long long total) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x)
        mid[e] = f2bf(silu_bf(bf2f(g[e])) * bf2f(u[e]));
}

// out[0] = d_gate = bf16(bf16(d u) bf16(silu'(g))), out[1] = d_up = bf16(d bf16(silu(g))).
extern "C" __global__ void mt_swiglu_bwd(const unsigned short* __restrict__ d, const unsigned short* __restrict__ g,
                                         const unsigned short* __restrict__ u, unsigned short* __restrict__ out,
                                         long long total) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        swiglu_grads(bf2f(d[e]), bf2f(g[e]), bf2f(u[e]), &out[e], &out[total + e]);
    }
}

// y = bf16(bf16(x cos) + bf16(rot(x) (sign sin))), rot(x) = cat(-x2, x1) per head of hd;
// x [b, t, heads, hd], cos/sin [t, hd] bf16. sign = -1 gives the backward.
extern "C" __global__ void mt_rope(const unsigned short* __restrict__ x, const unsigned short* __restrict__ cs,
                                   const unsigned short* __restrict__ sn, unsigned short* __restrict__ y,
                                   long long total, int t, int heads, int hd, float sign) {
    const int half = hd / 2;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        int i = (int)(e % hd);
        int pos = (int)((e / ((long long)hd * heads)) % t);
        float rot = i < half ? -bf2f(x[e + half]) : bf2f(x[e - half]);
        float c = bf2f(cs[(size_t)pos * hd + i]), s = rbf(sign * bf2f(sn[(size_t)pos * hd + i]));
        y[e] = f2bf(rbf(bf2f(x[e]) * c) + rbf(rot * s));
    }
}

// The block's maximum of `v` (every thread gets it), as `block_sum` sums.
__device__ __forceinline__ float block_max(float m, float* sh) {
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) sh[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < nw ? sh[lane] : __int_as_float(0xff800000);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) sh[0] = m;
    }
    __syncthreads();
    m = sh[0];
    __syncthreads();
    return m;
}

// Cross-entropy over one block of logits rows (bf16 [rows, V], from the LM-head GEMM), one
// CUDA block per row, statistics in f32 as the candle path (logits rounded to bf16, then f32):
//   m = max_j l_j, z = sum_j exp(l_j - m), ce = m + ln z - l[target].
__device__ __forceinline__ void row_max_sum(const unsigned short* lr, int V, float* sh, float* m_out, float* z_out) {
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, bf2f(lr[j]));
    m = block_max(m, sh);
    float z = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) z += expf(bf2f(lr[j]) - m);
    z = block_sum(z, sh);
    *m_out = m;
    *z_out = z;
}

// ce[row] = logsumexp(l) - l[target[row]].
extern "C" __global__ void __launch_bounds__(1024) mt_ce_loss(const unsigned short* __restrict__ logits, const unsigned* __restrict__ target,
                                      float* __restrict__ ce, int V) {
    __shared__ float sh[32];
    const unsigned short* lr = logits + (size_t)blockIdx.x * V;
    float m, z;
    row_max_sum(lr, V, sh, &m, &z);
    if (threadIdx.x == 0) ce[blockIdx.x] = (m + logf(z)) - bf2f(lr[target[blockIdx.x]]);
}

// dl[row, j] = bf16(w p_j - w [j == target]), p = softmax(l): d(w ce)/dl.
extern "C" __global__ void __launch_bounds__(1024) mt_ce_grad(const unsigned short* __restrict__ logits, const unsigned* __restrict__ target,
                                      const float* __restrict__ w, unsigned short* __restrict__ dl, int V) {
    __shared__ float sh[32];
    const size_t off = (size_t)blockIdx.x * V;
    float m, z;
    row_max_sum(logits + off, V, sh, &m, &z);
    const float wr = w[blockIdx.x];
    const unsigned tg = target[blockIdx.x];
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float v = (expf(bf2f(logits[off + j]) - m) / z) * wr;
        if ((unsigned)j == tg) v += -wr;
        dl[off + j] = f2bf(v);
    }
}

// ---- The same two kernels for V % 8 == 0 and 16-byte aligned rows (every vocabulary here) ----
// 16-byte loads, four of them in flight per thread before any is used (the one-element loops
// above keep one 2-byte load in flight a thread: a quarter of HBM's bandwidth at V = 128256).
// The statistics are the same formulas in f32, summed in another order (thread t owns the
// 8-element groups t, t + blockDim, ...), so they may differ from the kernels above in the last
// bits; the passes after the first read the row back mostly from L2. Launched with 1024 threads a
// block: `__launch_bounds__(1024)` holds every cross-entropy kernel to the 64 registers a thread
// that allows (mt_ce_grad8 needs 63 with sm_90's ptxas), whichever compiler turns the PTX into
// machine code.

#define CE_UNROLL 4

__device__ __forceinline__ void row_max_sum8(const uint4* __restrict__ lr, int G, float* sh, float* m_out, float* z_out) {
    const int step = blockDim.x;
    float m = __int_as_float(0xff800000);
    for (int g0 = threadIdx.x; g0 < G; g0 += CE_UNROLL * step) {
        uint4 u[CE_UNROLL];
        load_groups<CE_UNROLL>(lr, g0, step, G, u);
#pragma unroll
        for (int k = 0; k < CE_UNROLL; ++k)
            if (g0 + k * step < G) {
                float x[8];
                unpack8(u[k], x);
#pragma unroll
                for (int e = 0; e < 8; ++e) m = fmaxf(m, x[e]);
            }
    }
    m = block_max(m, sh);
    float z = 0.0f;
    for (int g0 = threadIdx.x; g0 < G; g0 += CE_UNROLL * step) {
        uint4 u[CE_UNROLL];
        load_groups<CE_UNROLL>(lr, g0, step, G, u);
#pragma unroll
        for (int k = 0; k < CE_UNROLL; ++k)
            if (g0 + k * step < G) {
                float x[8];
                unpack8(u[k], x);
#pragma unroll
                for (int e = 0; e < 8; ++e) z += expf(x[e] - m);
            }
    }
    z = block_sum(z, sh);
    *m_out = m;
    *z_out = z;
}

// As mt_ce_loss; V % 8 == 0, rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(1024) mt_ce_loss8(const unsigned short* __restrict__ logits, const unsigned* __restrict__ target,
                                       float* __restrict__ ce, int V) {
    __shared__ float sh[32];
    const unsigned short* lr = logits + (size_t)blockIdx.x * V;
    float m, z;
    row_max_sum8(reinterpret_cast<const uint4*>(lr), V / 8, sh, &m, &z);
    if (threadIdx.x == 0) ce[blockIdx.x] = (m + logf(z)) - bf2f(lr[target[blockIdx.x]]);
}

// As mt_ce_grad; V % 8 == 0, rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(1024) mt_ce_grad8(const unsigned short* __restrict__ logits, const unsigned* __restrict__ target,
                                       const float* __restrict__ w, unsigned short* __restrict__ dl, int V) {
    __shared__ float sh[32];
    const size_t off = (size_t)blockIdx.x * V;
    const uint4* lr = reinterpret_cast<const uint4*>(logits + off);
    uint4* dr = reinterpret_cast<uint4*>(dl + off);
    const int G = V / 8, step = blockDim.x;
    float m, z;
    row_max_sum8(lr, G, sh, &m, &z);
    const float wr = w[blockIdx.x];
    const unsigned tg = target[blockIdx.x];
    for (int g0 = threadIdx.x; g0 < G; g0 += CE_UNROLL * step) {
        uint4 u[CE_UNROLL];
        load_groups<CE_UNROLL>(lr, g0, step, G, u);
#pragma unroll
        for (int k = 0; k < CE_UNROLL; ++k) {
            const int g = g0 + k * step;
            if (g < G) {
                float x[8];
                unpack8(u[k], x);
                unsigned o[4];
#pragma unroll
                for (int e = 0; e < 8; e += 2) {
                    float v0 = (expf(x[e] - m) / z) * wr, v1 = (expf(x[e + 1] - m) / z) * wr;
                    if ((unsigned)(8 * g + e) == tg) v0 += -wr;
                    if ((unsigned)(8 * g + e + 1) == tg) v1 += -wr;
                    o[e / 2] = (unsigned)f2bf(v0) | ((unsigned)f2bf(v1) << 16);
                }
                uint4 r;
                r.x = o[0];
                r.y = o[1];
                r.z = o[2];
                r.w = o[3];
                dr[g] = r;
            }
        }
    }
}

// ---- Layout and residual helpers (pure data movement / one rounding), 16 bytes a thread ----

// y[b, i2, i1, :] = x[b, i1, i2, :]: swaps the two middle axes of a contiguous [b, n1, n2, d]
// bf16 tensor (d8 = d / 8 groups of 8 elements; the caller guarantees d % 8 == 0 and 16-byte
// aligned buffers). Indexed by the output's 8-element groups, so writes are coalesced and reads
// are 16-byte runs of d contiguous elements.
extern "C" __global__ void mt_swap12(const uint4* __restrict__ x, uint4* __restrict__ y, long long total8, int n1, int n2,
                                     int d8) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total8; e += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(e % d8);
        long long r = e / d8;
        const int i1 = (int)(r % n1);
        r /= n1;
        const int i2 = (int)(r % n2);
        const long long bb = r / n2;
        y[e] = x[((bb * n1 + i1) * n2 + i2) * d8 + c];
    }
}

// Eight bf16 sums of two 16-byte groups: each the sum of two bf16 values in f32, rounded once.
__device__ __forceinline__ uint4 add8_bf16(const uint4 u, const uint4 v) {
    const unsigned ua[4] = {u.x, u.y, u.z, u.w}, va[4] = {v.x, v.y, v.z, v.w};
    unsigned o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const unsigned short lo = f2bf(bf2f((unsigned short)(ua[k] & 0xffffu)) + bf2f((unsigned short)(va[k] & 0xffffu)));
        const unsigned short hi = f2bf(bf2f((unsigned short)(ua[k] >> 16)) + bf2f((unsigned short)(va[k] >> 16)));
        o[k] = (unsigned)lo | ((unsigned)hi << 16);
    }
    uint4 r;
    r.x = o[0];
    r.y = o[1];
    r.z = o[2];
    r.w = o[3];
    return r;
}

// y = bf16(a + b) elementwise over total8 groups of 8 (the sum of two bf16 values in f32, then
// rounded once: the same bits as candle's bf16 add).
extern "C" __global__ void mt_add_bf16(const uint4* __restrict__ a, const uint4* __restrict__ b, uint4* __restrict__ y,
                                       long long total8) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total8; e += (long long)gridDim.x * blockDim.x) {
        y[e] = add8_bf16(a[e], b[e]);
    }
}

// y[r, :] = bf16(a[r, :] + b) over rows of w = 8 · w8 elements, b one row broadcast to all
// (a projection's bias): the same per-element sum and rounding as mt_add_bf16, so the same bits
// as candle's broadcasting bf16 add, at the memory bandwidth.
extern "C" __global__ void mt_add_row_bf16(const uint4* __restrict__ a, const uint4* __restrict__ b, uint4* __restrict__ y,
                                           long long total8, int w8) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total8; e += (long long)gridDim.x * blockDim.x) {
        y[e] = add8_bf16(a[e], b[e % w8]);
    }
}

// mt_rope with 8 elements (16 bytes) a thread, for hd % 16 == 0 and 16-byte aligned buffers:
// the 8 elements of a group share the head, the position and the rotation partner's offset, so
// the index arithmetic runs once per group. Same per-element formula and roundings as mt_rope.
extern "C" __global__ void mt_rope8(const unsigned short* __restrict__ x, const unsigned short* __restrict__ cs,
                                    const unsigned short* __restrict__ sn, unsigned short* __restrict__ y,
                                    long long total, int t, int heads, int hd, float sign) {
    const int half = hd / 2;
    const long long groups = total / 8;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (long long)gridDim.x * blockDim.x) {
        const long long e0 = g * 8;
        const int i0 = (int)(e0 % hd);
        const int pos = (int)((e0 / ((long long)hd * heads)) % t);
        const bool lo = i0 < half;
        const uint4 xv = *reinterpret_cast<const uint4*>(x + e0);
        const uint4 rv = *reinterpret_cast<const uint4*>(x + (lo ? e0 + half : e0 - half));
        const uint4 cv = *reinterpret_cast<const uint4*>(cs + (size_t)pos * hd + i0);
        const uint4 sv = *reinterpret_cast<const uint4*>(sn + (size_t)pos * hd + i0);
        const unsigned xa[4] = {xv.x, xv.y, xv.z, xv.w}, ra[4] = {rv.x, rv.y, rv.z, rv.w};
        const unsigned ca[4] = {cv.x, cv.y, cv.z, cv.w}, sa[4] = {sv.x, sv.y, sv.z, sv.w};
        unsigned o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            unsigned short r[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int sh = 16 * h;
                const float xe = bf2f((unsigned short)((xa[k] >> sh) & 0xffffu));
                const float pe = bf2f((unsigned short)((ra[k] >> sh) & 0xffffu));
                const float rot = lo ? -pe : pe;
                const float c = bf2f((unsigned short)((ca[k] >> sh) & 0xffffu));
                const float s = rbf(sign * bf2f((unsigned short)((sa[k] >> sh) & 0xffffu)));
                r[h] = f2bf(rbf(xe * c) + rbf(rot * s));
            }
            o[k] = (unsigned)r[0] | ((unsigned)r[1] << 16);
        }
        uint4 out;
        out.x = o[0];
        out.y = o[1];
        out.z = o[2];
        out.w = o[3];
        *reinterpret_cast<uint4*>(y + e0) = out;
    }
}

// Column sums of a bf16 [n, w] matrix added into an f32 row (a bias gradient): out[c] += sum_r
// x[r, c], deterministic and without atomics, in two passes: partial[s, c] sums rows
// s·rps .. min(n, (s+1)·rps) in ascending order (a thread per column, so a warp reads 32
// neighbouring columns of a row), then out[c] += the partials in ascending s.
extern "C" __global__ void mt_col_sum_partial_bf16(const unsigned short* __restrict__ x, float* __restrict__ partial,
                                                   long long n, int w, long long rps) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= w) return;
    const long long r0 = (long long)blockIdx.y * rps;
    const long long r1 = r0 + rps < n ? r0 + rps : n;
    float acc = 0.0f;
    for (long long r = r0; r < r1; ++r) acc += bf2f(x[r * w + c]);
    partial[(long long)blockIdx.y * w + c] = acc;
}

extern "C" __global__ void mt_col_sum_finish(const float* __restrict__ partial, float* __restrict__ out, int segs, int w) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= w) return;
    float acc = 0.0f;
    for (int s = 0; s < segs; ++s) acc += partial[(long long)s * w + c];
    out[c] += acc;
}

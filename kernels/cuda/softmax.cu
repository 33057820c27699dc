// Fused causal softmax forward and backward over rows of attention scores, for bf16 compute.
// Compiled at run time with NVRTC after common.cuh (kernels/src/ops/nvrtc.rs): no
// CUDA headers are included, bf16 is handled as its bit pattern (unsigned short) with
// round-to-nearest-even.
//
// Layout: `rows` rows of `t` columns, contiguous; row r is query position i = r % t (the rows
// of one [g*t, t] block are g query heads stacked along the time axis). One block per row.
//
// Forward:  P[r, j] = exp(c*S[r,j] - m) / z for j <= i, else 0, m = max_{k<=i} c*S[r,k],
//           z = sum_{k<=i} exp(c*S[r,k] - m); S bf16 (the raw Q K^T); writes P rounded to bf16
//           (what multiplies V) and the row's (m, z) in f32.
// Backward: dS[r, j] = c * P[r,j] * (dP[r,j] - sum_k dP[r,k] P[r,k]) with the f32 P recomputed
//           from S and (m, z) by the same expression as the forward (so bitwise the forward's
//           f32 P); dP bf16, dS bf16. No f32 [rows, t] tensor is ever stored.
// (c = 1/sqrt(head_dim) is folded in here, so Q K^T and dS K need no separate scaling pass.)

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

// P[r, j] of a row from its raw score and the row's statistics; the forward and the backward both
// evaluate exactly this expression, so the backward's f32 P is the forward's bit for bit.
__device__ __forceinline__ float probf(float s, float c, float m, float z) { return expf(c * s - m) / z; }
__device__ __forceinline__ float prob(unsigned short s, float c, float m, float z) { return probf(bf2f(s), c, m, z); }

extern "C" __global__ void mt_causal_softmax_fwd(const unsigned short* __restrict__ s, unsigned short* __restrict__ pb,
                                                  float* __restrict__ stats, int t, float c) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x;
    const int i = (int)(row % (size_t)t);
    const unsigned short* sr = s + row * (size_t)t;
    unsigned short* pr = pb + row * (size_t)t;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, c * bf2f(sr[j]));
    m = block_reduce(m, sh, true);
    float z = 0.0f;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) z += expf(c * bf2f(sr[j]) - m);
    z = block_reduce(z, sh, false);
    for (int j = threadIdx.x; j < t; j += blockDim.x) pr[j] = j <= i ? f2bf(prob(sr[j], c, m, z)) : (unsigned short)0;
    if (threadIdx.x == 0) {
        stats[2 * row] = m;
        stats[2 * row + 1] = z;
    }
}

extern "C" __global__ void mt_softmax_bwd(const unsigned short* __restrict__ dp, const unsigned short* __restrict__ s,
                                          const float* __restrict__ stats, unsigned short* __restrict__ ds, int t,
                                          float c) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x;
    const int i = (int)(row % (size_t)t);
    const unsigned short* dpr = dp + row * (size_t)t;
    const unsigned short* sr = s + row * (size_t)t;
    unsigned short* dsr = ds + row * (size_t)t;
    const float m = stats[2 * row], z = stats[2 * row + 1];
    float acc = 0.0f;
    for (int j = threadIdx.x; j < t; j += blockDim.x) acc += bf2f(dpr[j]) * (j <= i ? prob(sr[j], c, m, z) : 0.0f);
    acc = block_reduce(acc, sh, false);
    for (int j = threadIdx.x; j < t; j += blockDim.x) {
        const float pj = j <= i ? prob(sr[j], c, m, z) : 0.0f;
        dsr[j] = f2bf(c * pj * (bf2f(dpr[j]) - acc));
    }
}

// ---- Warp-per-row variants, for rows of at most WARP_ROW_MAX elements (the common case) ----
// One warp owns a row and keeps it in registers: each of its 32 lanes holds 8 consecutive
// elements of each 256-element chunk (16-byte loads when t % 8 == 0), so S, dP and P cross
// device memory once, reductions are warp shuffles (no __syncthreads), and chunks entirely
// above the diagonal are not read at all (their outputs are written as zeros). Same formulas
// as the block kernels above; `prob` is shared, so the backward's f32 P is the forward's.
#define WARP_ROW_MAX 2048
#define WARP_CHUNKS (WARP_ROW_MAX / 256)

__device__ __forceinline__ void load8(const unsigned short* __restrict__ p, int j0, int t, bool vec, float* out) {
    if (vec && j0 + 8 <= t) {
        const uint4 u = *reinterpret_cast<const uint4*>(p + j0);
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            out[2 * e] = bf2f((unsigned short)(w[e] & 0xffffu));
            out[2 * e + 1] = bf2f((unsigned short)(w[e] >> 16));
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = j0 + e < t ? bf2f(p[j0 + e]) : 0.0f;
    }
}

__device__ __forceinline__ void store8(unsigned short* __restrict__ p, int j0, int t, bool vec, const unsigned short* v) {
    if (vec && j0 + 8 <= t) {
        uint4 u;
        u.x = (unsigned)v[0] | ((unsigned)v[1] << 16);
        u.y = (unsigned)v[2] | ((unsigned)v[3] << 16);
        u.z = (unsigned)v[4] | ((unsigned)v[5] << 16);
        u.w = (unsigned)v[6] | ((unsigned)v[7] << 16);
        *reinterpret_cast<uint4*>(p + j0) = u;
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (j0 + e < t) p[j0 + e] = v[e];
    }
}

__device__ __forceinline__ float warp_reduce(float v, bool is_max) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    return v;
}

extern "C" __global__ void mt_causal_softmax_fwd_warp(const unsigned short* __restrict__ s, unsigned short* __restrict__ pb,
                                                       float* __restrict__ stats, int t, float c, long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const int i = (int)(row % (long long)t);
    const bool vec = (t & 7) == 0;
    const unsigned short* sr = s + row * (long long)t;
    unsigned short* pr = pb + row * (long long)t;
    float x[WARP_CHUNKS][8];
    float m = __int_as_float(0xff800000);
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (k * 256 <= i && j0 < t) {
            load8(sr, j0, t, vec, x[k]);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x[k][e] = c * x[k][e];
                if (j0 + e <= i) m = fmaxf(m, x[k][e]);
            }
        }
    }
    m = warp_reduce(m, true);
    float z = 0.0f;
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (k * 256 <= i && j0 < t) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x[k][e] = j0 + e <= i ? expf(x[k][e] - m) : 0.0f;
                z += x[k][e];
            }
        }
    }
    z = warp_reduce(z, false);
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (j0 < t) {
            unsigned short o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = (k * 256 <= i && j0 + e <= i) ? f2bf(x[k][e] / z) : (unsigned short)0;
            store8(pr, j0, t, vec, o);
        }
    }
    if (lane == 0) {
        stats[2 * row] = m;
        stats[2 * row + 1] = z;
    }
}

extern "C" __global__ void mt_softmax_bwd_warp(const unsigned short* __restrict__ dp, const unsigned short* __restrict__ s,
                                               const float* __restrict__ stats, unsigned short* __restrict__ ds, int t,
                                               float c, long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const int i = (int)(row % (long long)t);
    const bool vec = (t & 7) == 0;
    const unsigned short* dpr = dp + row * (long long)t;
    const unsigned short* sr = s + row * (long long)t;
    unsigned short* dsr = ds + row * (long long)t;
    const float m = stats[2 * row], z = stats[2 * row + 1];
    float p[WARP_CHUNKS][8], g[WARP_CHUNKS][8];
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (k * 256 <= i && j0 < t) {
            float sv[8];
            load8(sr, j0, t, vec, sv);
            load8(dpr, j0, t, vec, g[k]);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                p[k][e] = j0 + e <= i ? probf(sv[e], c, m, z) : 0.0f;
                acc += g[k][e] * p[k][e];
            }
        }
    }
    acc = warp_reduce(acc, false);
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (j0 < t) {
            unsigned short o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e)
                o[e] = (k * 256 <= i && j0 + e <= i) ? f2bf(c * p[k][e] * (g[k][e] - acc)) : (unsigned short)0;
            store8(dsr, j0, t, vec, o);
        }
    }
}

// ---- Warp-per-row kernels for rows whose length is a multiple of 8 (every attention here) ----
// The same formulas, reductions in the same order and the same roundings as the `_warp` kernels
// above, so the outputs are bit for bit theirs. What differs is how memory is read: all of a
// lane's 16-byte loads of the row are issued before any of them is used, and the row is held as
// raw bf16 bits (4 registers per chunk, not 8 floats), with P recomputed from them where needed
// (expf is cheap next to DRAM). The `_warp` kernels load, convert and reduce one chunk at a time,
// which leaves one or two loads in flight per warp; at 2048 keys their backward held 152
// registers a thread and moved its bytes at about a quarter of HBM's bandwidth.

__device__ __forceinline__ uint4 pack8(const unsigned short* v) {
    uint4 u;
    u.x = (unsigned)v[0] | ((unsigned)v[1] << 16);
    u.y = (unsigned)v[2] | ((unsigned)v[3] << 16);
    u.z = (unsigned)v[4] | ((unsigned)v[5] << 16);
    u.w = (unsigned)v[6] | ((unsigned)v[7] << 16);
    return u;
}

__device__ __forceinline__ uint4 zero4() {
    uint4 u;
    u.x = 0u;
    u.y = 0u;
    u.z = 0u;
    u.w = 0u;
    return u;
}

// Requires t % 8 == 0, t <= WARP_ROW_MAX and 16-byte aligned row starts (checked by the caller).
extern "C" __global__ void mt_causal_softmax_fwd_warp8(const unsigned short* __restrict__ s, unsigned short* __restrict__ pb,
                                                        float* __restrict__ stats, int t, float c, long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const int i = (int)(row % (long long)t);
    const int nk = i / 256 + 1;  // chunks with k * 256 <= i: the only ones read
    const uint4* sr = reinterpret_cast<const uint4*>(s + row * (long long)t);
    uint4* pr = reinterpret_cast<uint4*>(pb + row * (long long)t);
    uint4 raw[WARP_CHUNKS];
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) raw[k] = (k < nk && k * 256 + lane * 8 < t) ? sr[k * 32 + lane] : zero4();
    float m = __int_as_float(0xff800000);
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (k < nk && j0 < t) {
            float x[8];
            unpack8(raw[k], x);
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (j0 + e <= i) m = fmaxf(m, c * x[e]);
        }
    }
    m = warp_reduce(m, true);
    float z = 0.0f;
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (k < nk && j0 < t) {
            float x[8];
            unpack8(raw[k], x);
#pragma unroll
            for (int e = 0; e < 8; ++e) z += j0 + e <= i ? expf(c * x[e] - m) : 0.0f;
        }
    }
    z = warp_reduce(z, false);
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (j0 < t) {
            unsigned short o[8];
            if (k < nk) {
                float x[8];
                unpack8(raw[k], x);
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = j0 + e <= i ? f2bf(probf(x[e], c, m, z)) : (unsigned short)0;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = 0;
            }
            pr[k * 32 + lane] = pack8(o);
        }
    }
    if (lane == 0) {
        stats[2 * row] = m;
        stats[2 * row + 1] = z;
    }
}

// Requires t % 8 == 0, t <= WARP_ROW_MAX and 16-byte aligned row starts (checked by the caller).
extern "C" __global__ void mt_softmax_bwd_warp8(const unsigned short* __restrict__ dp, const unsigned short* __restrict__ s,
                                                const float* __restrict__ stats, unsigned short* __restrict__ ds, int t,
                                                float c, long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const int i = (int)(row % (long long)t);
    const int nk = i / 256 + 1;
    const uint4* dpr = reinterpret_cast<const uint4*>(dp + row * (long long)t);
    const uint4* sr = reinterpret_cast<const uint4*>(s + row * (long long)t);
    uint4* dsr = reinterpret_cast<uint4*>(ds + row * (long long)t);
    const float m = stats[2 * row], z = stats[2 * row + 1];
    uint4 sraw[WARP_CHUNKS], graw[WARP_CHUNKS];
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const bool live = k < nk && k * 256 + lane * 8 < t;
        sraw[k] = live ? sr[k * 32 + lane] : zero4();
        graw[k] = live ? dpr[k * 32 + lane] : zero4();
    }
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (k < nk && j0 < t) {
            float sv[8], g[8];
            unpack8(sraw[k], sv);
            unpack8(graw[k], g);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float p = j0 + e <= i ? probf(sv[e], c, m, z) : 0.0f;
                acc += g[e] * p;
            }
        }
    }
    acc = warp_reduce(acc, false);
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        const int j0 = k * 256 + lane * 8;
        if (j0 < t) {
            unsigned short o[8];
            if (k < nk) {
                float sv[8], g[8];
                unpack8(sraw[k], sv);
                unpack8(graw[k], g);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    o[e] = j0 + e <= i ? f2bf(c * probf(sv[e], c, m, z) * (g[e] - acc)) : (unsigned short)0;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = 0;
            }
            dsr[k * 32 + lane] = pack8(o);
        }
    }
}

// ---- Block-per-row kernels for rows longer than WARP_ROW_MAX whose length is a multiple of 8 ----
// The same formulas as mt_causal_softmax_fwd / mt_softmax_bwd, over 16-byte groups of 8 keys
// (thread x owns the groups x, x + blockDim, ...), BLOCK8_UNROLL loads in flight a thread; only
// groups that reach the diagonal are read. The statistics are summed in another order than the
// one-element kernels (so they may differ in the last bits); the backward recomputes P with
// `probf` from the forward's own (m, z), so within a pair P is the forward's bit for bit.
#define BLOCK8_UNROLL 4

extern "C" __global__ void mt_causal_softmax_fwd_block8(const unsigned short* __restrict__ s, unsigned short* __restrict__ pb,
                                                         float* __restrict__ stats, int t, float c) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x;
    const int i = (int)(row % (size_t)t);
    const uint4* sr = reinterpret_cast<const uint4*>(s + row * (size_t)t);
    uint4* pr = reinterpret_cast<uint4*>(pb + row * (size_t)t);
    const int G = t / 8, live = i / 8 + 1, step = blockDim.x;  // groups 0..live-1 hold keys <= i
    float m = __int_as_float(0xff800000);
    for (int g0 = threadIdx.x; g0 < live; g0 += BLOCK8_UNROLL * step) {
        uint4 u[BLOCK8_UNROLL];
        load_groups<BLOCK8_UNROLL>(sr, g0, step, live, u);
#pragma unroll
        for (int k = 0; k < BLOCK8_UNROLL; ++k) {
            const int g = g0 + k * step;
            if (g < live) {
                float x[8];
                unpack8(u[k], x);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (8 * g + e <= i) m = fmaxf(m, c * x[e]);
            }
        }
    }
    m = block_reduce(m, sh, true);
    float z = 0.0f;
    for (int g0 = threadIdx.x; g0 < live; g0 += BLOCK8_UNROLL * step) {
        uint4 u[BLOCK8_UNROLL];
        load_groups<BLOCK8_UNROLL>(sr, g0, step, live, u);
#pragma unroll
        for (int k = 0; k < BLOCK8_UNROLL; ++k) {
            const int g = g0 + k * step;
            if (g < live) {
                float x[8];
                unpack8(u[k], x);
#pragma unroll
                for (int e = 0; e < 8; ++e) z += 8 * g + e <= i ? expf(c * x[e] - m) : 0.0f;
            }
        }
    }
    z = block_reduce(z, sh, false);
    for (int g = threadIdx.x; g < G; g += step) {
        unsigned short o[8];
        if (g < live) {
            float x[8];
            unpack8(sr[g], x);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = 8 * g + e <= i ? f2bf(probf(x[e], c, m, z)) : (unsigned short)0;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = 0;
        }
        pr[g] = pack8(o);
    }
    if (threadIdx.x == 0) {
        stats[2 * row] = m;
        stats[2 * row + 1] = z;
    }
}

extern "C" __global__ void mt_softmax_bwd_block8(const unsigned short* __restrict__ dp, const unsigned short* __restrict__ s,
                                                 const float* __restrict__ stats, unsigned short* __restrict__ ds, int t,
                                                 float c) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x;
    const int i = (int)(row % (size_t)t);
    const uint4* dpr = reinterpret_cast<const uint4*>(dp + row * (size_t)t);
    const uint4* sr = reinterpret_cast<const uint4*>(s + row * (size_t)t);
    uint4* dsr = reinterpret_cast<uint4*>(ds + row * (size_t)t);
    const float m = stats[2 * row], z = stats[2 * row + 1];
    const int G = t / 8, live = i / 8 + 1, step = blockDim.x;
    float acc = 0.0f;
    for (int g0 = threadIdx.x; g0 < live; g0 += BLOCK8_UNROLL * step) {
        uint4 us[BLOCK8_UNROLL], ug[BLOCK8_UNROLL];
        load_groups<BLOCK8_UNROLL>(sr, g0, step, live, us);
        load_groups<BLOCK8_UNROLL>(dpr, g0, step, live, ug);
#pragma unroll
        for (int k = 0; k < BLOCK8_UNROLL; ++k) {
            const int g = g0 + k * step;
            if (g < live) {
                float sv[8], gv[8];
                unpack8(us[k], sv);
                unpack8(ug[k], gv);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc += gv[e] * (8 * g + e <= i ? probf(sv[e], c, m, z) : 0.0f);
            }
        }
    }
    acc = block_reduce(acc, sh, false);
    for (int g = threadIdx.x; g < G; g += step) {
        unsigned short o[8];
        if (g < live) {
            float sv[8], gv[8];
            unpack8(sr[g], sv);
            unpack8(dpr[g], gv);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float pj = 8 * g + e <= i ? probf(sv[e], c, m, z) : 0.0f;
                o[e] = f2bf(c * pj * (gv[e] - acc));
            }
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = 0;
        }
        dsr[g] = pack8(o);
    }
}

// Flash attention for bf16 training: causal, grouped-query (any heads / KV heads ratio), packed
// documents, head dims 16..128 (multiples of 16), f32 accumulation, O(s) memory, deterministic;
// optionally GPT-OSS's sliding window and per-head sink logits.
// Compiled at run time with NVRTC after common.cuh (crates/layers/src/cuda_kernels/flash.rs);
// written from the FlashAttention-2 paper's algorithm (Dao 2023), not from its code.
//
// Layout (token-major, as the projections write them; no transposes):
//   Q, dQ, O, dO: [B, T, NH, HD] bf16;  K, V, dK, dV: [B, T, NKV, HD] bf16;
//   LSE (natural log of each row's softmax denominator, scale applied), D: [B, NH, T] f32;
//   seg_lo / seg_hi (optional, null = one document per row): [B, T] int, the first and one past
//   the last position of the token's document. Query i sees key j iff seg_lo[i] <= j <= i.
//   window (0 = none): query i sees only keys j > i - window (its last `window`, itself included).
//   sinks (optional, null = none): [NH] f32, one logit per query head (natural log, unscaled):
//   one more term e^{sink} in each of the head's softmax denominators, with no value vector.
//
// The window bounds every walk: the forward's and dQ's key loops start at the first key tile a
// row of theirs sees, the dK/dV query loop ends at the last query tile that sees a key of its
// tile, so a window w costs O(t w), not O(t^2). A row's lowest visible key, max(seg_lo[i],
// i - window + 1), goes through the one per-element test documents use.
//
// Forward (mt_flash_fwd_hdN): per CTA 128 query rows of one head; K/V tiles of 64 keys stream
//   through shared memory (cp.async, double-buffered); S = Q K^T on the tensor cores (mma.sync
//   m16n8k16, f32 accumulators), online softmax in f32 in the log2 domain, P rounded to bf16
//   (what multiplies V), O rescaled as the row maximum grows. Writes O and LSE. A sink joins a
//   row once, after its last tile, as one more column of the online softmax (max, sum and O
//   rescaled to it), so O and LSE include it.
// Backward, no atomics (every output element is written by one CTA in a fixed order, so two runs
// give the same bits):
//   mt_flash_bwd_dot:     D[i] = sum_d dO[i, d] O[i, d] (f32).
//   mt_flash_bwd_dkdv_hdN: per CTA 64 keys of one KV head; loops over the query heads of its group
//                         and the query tiles that see the keys: P^T = exp(S^T - LSE) recomputed,
//                         dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.
//   mt_flash_bwd_dq_hdN:   per CTA 64 query rows of one head; loops over the key tiles it sees:
//                         S, P, dP = dO V^T, dS, dQ += dS K.
//   The split costs two more matrix products than a dQ accumulated with atomics (7 instead of 5)
//   and buys a deterministic backward with no f32 dQ buffer.
//   Sinks need nothing new in these (LSE includes the sink; it has no value, so its dP is 0 and
//   D is still the row sum of dP P over all columns). mt_flash_sink_grad: dsink[h] =
//   -sum over the rows of head h of exp(sink[h] - LSE) D, one CTA per head, in a fixed order.
// Every offset into a tensor is 64-bit (32 heads x 128 dims x 512k tokens is 2^31 elements).

#define MT_FA_THREADS 128

#ifndef MT_EMU
// (the sm_80 PTX wrappers cp_async16, ldsm_x4, mma16816, ... are in common.cuh)
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
extern __shared__ __align__(128) unsigned char mt_fa_smem[];
#define MT_FA_SMEM mt_fa_smem
#endif

#define MT_NEG_INF __int_as_float(0xff800000)
#define MT_POS_INF __int_as_float(0x7f800000)
#define MT_LOG2E 1.4426950408889634f
#define MT_LN2 0.6931471805599453f

// A shared-memory tile of R rows x HD bf16, in 16-byte chunks (C = HD / 8 per row), chunk c of
// row r stored at chunk (c ^ (r mod min(C, 8))) of that row: ldmatrix reads 8 rows at one chunk
// column, which the XOR spreads over 8 different bank groups (no conflicts for HD >= 64).
template <int HD>
__device__ __forceinline__ unsigned chunk_at(int r, int c) {
    constexpr int C = HD / 8;
    constexpr int S = C < 8 ? C : 8;
    return (unsigned)((r * C + (c ^ (r & (S - 1)))) * 16);
}

// Issues the copies of rows [0, R) of a tile whose row r starts at g + r * ld (elements); rows at
// or past `valid` are zero-filled and read nothing.
template <int R, int HD>
__device__ __forceinline__ void load_tile(unsigned dst, const unsigned short* g, long long ld, int valid) {
    constexpr int C = HD / 8;
    for (int i = threadIdx.x; i < R * C; i += MT_FA_THREADS) {
        const int r = i / C, c = i % C;
        const bool ok = r < valid;
        const unsigned short* src = ok ? g + (long long)r * ld + c * 8 : g;
        cp_async16(dst + chunk_at<HD>(r, c), src, ok ? 16 : 0);
    }
}

// A fragments (16 rows x 16 cols) of rows [row0, row0 + 16), columns [16 kk, 16 kk + 16) of a
// row-major tile.
template <int HD>
__device__ __forceinline__ void frag_a(unsigned* a, unsigned tile, int row0, int kk) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    ldsm_x4(a, tile + chunk_at<HD>(row0 + (mi & 1) * 8 + (lane & 7), kk * 2 + (mi >> 1)));
}
// B fragments of two n-tiles (n rows [n0, n0 + 16) of the tile, k columns [16 kk, 16 kk + 16)):
// the tile is stored n-major (each row one n, k contiguous), as K for S = Q K^T.
// b[0], b[1]: n-tile n0; b[2], b[3]: n-tile n0 + 8.
template <int HD>
__device__ __forceinline__ void frag_b_nk(unsigned* b, unsigned tile, int n0, int kk) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    ldsm_x4(b, tile + chunk_at<HD>(n0 + (mi >> 1) * 8 + (lane & 7), kk * 2 + (mi & 1)));
}
// B fragments of two n-tiles (columns [16 np, 16 np + 16) of the tile) over k rows
// [k0, k0 + 16): the tile is stored k-major (each row one k, n contiguous), as V for O = P V.
template <int HD>
__device__ __forceinline__ void frag_b_kn(unsigned* b, unsigned tile, int k0, int np) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    ldsm_x4_t(b, tile + chunk_at<HD>(k0 + (mi & 1) * 8 + (lane & 7), np * 2 + (mi >> 1)));
}

// The A fragment (16 x 16, bf16) of columns [16 kk, 16 kk + 16) of an f32 accumulator tile
// c[n-tile][4] of 16 rows: the accumulator layout of two n-tiles is the A layout of one k-tile.
__device__ __forceinline__ void acc_to_a(unsigned* a, const float (*c)[4], int kk) {
    a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// acc[WM][NTN][4] (WM x 16 rows x 8 NTN cols) += A (rows [a0, a0 + 16 WM) of `ta`) x B^T where B
// is the n-major tile `tb` rows [0, 8 NTN): a product over the HD columns of both. Each B
// fragment is loaded once for the WM row tiles.
template <int HD, int NTN, int WM>
__device__ __forceinline__ void mma_abt(float (*acc)[NTN][4], unsigned ta, int a0, unsigned tb) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        unsigned a[WM][4];
#pragma unroll
        for (int mt = 0; mt < WM; ++mt) frag_a<HD>(a[mt], ta, a0 + 16 * mt, kk);
#pragma unroll
        for (int np = 0; np < NTN / 2; ++np) {
            unsigned b[4];
            frag_b_nk<HD>(b, tb, np * 16, kk);
#pragma unroll
            for (int mt = 0; mt < WM; ++mt) {
                mma16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc[WM][HD/8][4] (WM x 16 rows x HD) += P x the k-major tile `tb` rows [0, KN), P in registers
// in the accumulator layout (p[WM][KN/8][4], WM x 16 rows x KN).
template <int HD, int KN, int WM>
__device__ __forceinline__ void mma_pv(float (*acc)[HD / 8][4], const float (*p)[KN / 8][4], unsigned tb) {
#pragma unroll
    for (int kk = 0; kk < KN / 16; ++kk) {
        unsigned a[WM][4];
#pragma unroll
        for (int mt = 0; mt < WM; ++mt) acc_to_a(a[mt], p[mt], kk);
#pragma unroll
        for (int np = 0; np < HD / 16; ++np) {
            unsigned b[4];
            frag_b_kn<HD>(b, tb, kk * 16, np);
#pragma unroll
            for (int mt = 0; mt < WM; ++mt) {
                mma16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Writes a 16 x HD accumulator tile times `mul` (per row half) as bf16 rows row0, row0 + 8 of
// `out` (row stride ld), skipping rows at or past `valid`.
template <int HD>
__device__ __forceinline__ void store_rows(unsigned short* out, long long ld, int row0, int valid,
                                           const float (*acc)[4], float mul0, float mul1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = row0 + g + 8 * hh;
        if (r >= valid) continue;
        const float mul = hh ? mul1 : mul0;
        unsigned* dst = (unsigned*)(out + (long long)r * ld);
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt)
            dst[nt * 4 + tig] = pack_bf16(acc[nt][2 * hh] * mul, acc[nt][2 * hh + 1] * mul);
    }
}

// ---------------------------------------------------------------------------------------------
// Forward.
template <int HD>
__device__ __forceinline__ void flash_fwd(const unsigned short* __restrict__ Q, const unsigned short* __restrict__ K,
                                          const unsigned short* __restrict__ V, unsigned short* __restrict__ O,
                                          float* __restrict__ LSE, const int* __restrict__ seg_lo,
                                          const float* __restrict__ sinks, int window, int T, int NH, int NKV,
                                          float scale_log2) {
    constexpr int BR = 128, BC = 64, WR = 32;  // rows per CTA, keys per tile, rows per warp
    constexpr int TQ = BR * HD * 2, TK = BC * HD * 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (NH / NKV);
    const int q0 = qt * BR;
    const long long ldq = (long long)NH * HD, ldk = (long long)NKV * HD;
    const unsigned short* Qb = Q + ((long long)b * T + q0) * ldq + (long long)h * HD;
    const unsigned short* Kb = K + (long long)b * T * ldk + (long long)kvh * HD;
    const unsigned short* Vb = V + (long long)b * T * ldk + (long long)kvh * HD;
    const int* seg = seg_lo ? seg_lo + (long long)b * T : nullptr;

    const unsigned sQ = smem_addr(MT_FA_SMEM);
    const unsigned sK0 = sQ + TQ, sV0 = sK0 + 2 * TK;

    const int q_last = min(q0 + BR, T) - 1;
    // The lowest key any row of the CTA sees, and the highest of the rows' lowest keys (below it
    // a tile needs the per-element test).
    const int kv_lo = max(seg ? seg[q0] : 0, window > 0 ? q0 - window + 1 : 0);
    const int lo_max = max(seg ? seg[q_last] : 0, window > 0 ? q_last - window + 1 : 0);
    const int jt_lo = kv_lo / BC;
    int jt = q_last / BC;

    load_tile<BR, HD>(sQ, Qb, ldq, T - q0);
    load_tile<BC, HD>(sK0, Kb + (long long)jt * BC * ldk, ldk, T - jt * BC);
    load_tile<BC, HD>(sV0, Vb + (long long)jt * BC * ldk, ldk, T - jt * BC);
    cp_async_commit();

    // This thread's rows: q0 + warp * 32 + mt * 16 + g + 8 hh; rseg: each one's lowest key.
    const int row0 = q0 + warp * WR + g;  // + mt * 16 + 8 hh
    int rseg[2][2];
    float m_i[2][2], l_i[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = q0 + warp * WR + mt * 16 + g + 8 * hh;
            rseg[mt][hh] = max(seg ? seg[min(r, T - 1)] : 0, window > 0 ? r - window + 1 : 0);
            m_i[mt][hh] = MT_NEG_INF;
            l_i[mt][hh] = 0.0f;
        }
    float acc[2][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;

    for (int buf = 0; jt >= jt_lo; --jt, buf ^= 1) {
        cp_async_wait_all();
        __syncthreads();
        if (jt > jt_lo) {  // prefetch the next (lower) tile into the other buffer
            const long long off = (long long)(jt - 1) * BC * ldk;
            load_tile<BC, HD>(sK0 + (buf ^ 1) * TK, Kb + off, ldk, T - (jt - 1) * BC);
            load_tile<BC, HD>(sV0 + (buf ^ 1) * TK, Vb + off, ldk, T - (jt - 1) * BC);
        }
        cp_async_commit();
        const unsigned sK = sK0 + buf * TK, sV = sV0 + buf * TK;
        const int j0 = jt * BC;
        const bool masked = j0 + BC - 1 > q0 + warp * WR || j0 < lo_max;

        float s[2][BC / 8][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
        mma_abt<HD, BC / 8, 2>(s, sQ, warp * WR, sK);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = row0 + mt * 16 + 8 * hh, lo = rseg[mt][hh];
                float mx = MT_NEG_INF;
#pragma unroll
                for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float x = s[mt][nt][2 * hh + e] * scale_log2;
                        if (masked) {
                            const int j = j0 + nt * 8 + tig * 2 + e;
                            if (j > r || j < lo) x = MT_NEG_INF;
                        }
                        s[mt][nt][2 * hh + e] = x;
                        mx = fmaxf(mx, x);
                    }
                mx = quad_max(mx);
                const float m_new = fmaxf(m_i[mt][hh], mx);
                const float m_use = m_new == MT_NEG_INF ? 0.0f : m_new;
                const float alpha = fast_exp2(m_i[mt][hh] - m_use);
                m_i[mt][hh] = m_new;
                float sum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = fast_exp2(s[mt][nt][2 * hh + e] - m_use);
                        s[mt][nt][2 * hh + e] = p;
                        sum += p;
                    }
                l_i[mt][hh] = l_i[mt][hh] * alpha + sum;
#pragma unroll
                for (int nt = 0; nt < HD / 8; ++nt) {
                    acc[mt][nt][2 * hh] *= alpha;
                    acc[mt][nt][2 * hh + 1] *= alpha;
                }
            }
        mma_pv<HD, BC, 2>(acc, s, sV);
    }
    cp_async_wait_all();

    unsigned short* Ob = O + ((long long)b * T + q0) * ldq + (long long)h * HD;
    if (sinks) {
        // The sink joins each row once, as one more column of the online softmax: the max
        // becomes max(m, sink), the sum and O are rescaled to it, and the sum gains
        // e^{sink - max} (in the quad's first thread: the quad's partial sums are added below).
        const float sink2 = sinks[h] * MT_LOG2E;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float m_f = fmaxf(m_i[mt][hh], sink2);
                const float m_use = m_f == MT_NEG_INF ? 0.0f : m_f;
                const float alpha = fast_exp2(m_i[mt][hh] - m_use);
                l_i[mt][hh] = l_i[mt][hh] * alpha + (tig == 0 ? fast_exp2(sink2 - m_use) : 0.0f);
                m_i[mt][hh] = m_f;
#pragma unroll
                for (int nt = 0; nt < HD / 8; ++nt) {
                    acc[mt][nt][2 * hh] *= alpha;
                    acc[mt][nt][2 * hh + 1] *= alpha;
                }
            }
    }

    float* L = LSE + ((long long)b * NH + h) * T;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        float inv[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float l = quad_sum(l_i[mt][hh]);
            inv[hh] = 1.0f / l;
            const int r = row0 + mt * 16 + 8 * hh;
            if (tig == 0 && r < T) {
                const float m = m_i[mt][hh] == MT_NEG_INF ? 0.0f : m_i[mt][hh];
                L[r] = (m + log2f(l)) * MT_LN2;
            }
        }
        store_rows<HD>(Ob, ldq, warp * WR + mt * 16, T - q0, acc[mt], inv[0], inv[1]);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward: D = rowsum(dO * O), one warp per (token, head) row.
extern "C" __global__ void mt_flash_bwd_dot(const unsigned short* __restrict__ dO, const unsigned short* __restrict__ O,
                                            float* __restrict__ D, int T, int NH, int HD, long long rows) {
    const long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w >= rows) return;
    const int lane = threadIdx.x & 31;
    const unsigned short* a = dO + w * HD;
    const unsigned short* c = O + w * HD;
    float acc = 0.0f;
    for (int d = lane; d < HD; d += 32) acc += bf2f(a[d]) * bf2f(c[d]);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
        // w = (b * T + t) * NH + h  ->  D[b, h, t]
        const long long h = w % NH, bt = w / NH, t = bt % T, b = bt / T;
        D[(b * NH + h) * T + t] = acc;
    }
}

// Backward of the sinks: dsink[h] = -sum over (b, t) of exp(sink[h] - LSE[b, h, t]) D[b, h, t]
// (the sink's probability in the row times the row's D). One CTA of MT_FA_THREADS per head h,
// 16 bytes of shared memory: thread i adds rows i, i + MT_FA_THREADS, ... of each sequence in
// turn, then the warps' sums meet in a fixed order, so two runs give the same bits.
extern "C" __global__ void __launch_bounds__(MT_FA_THREADS)
    mt_flash_sink_grad(const float* __restrict__ LSE, const float* __restrict__ D, const float* __restrict__ sinks,
                       float* __restrict__ dsink, int B, int T, int NH) {
    const int h = blockIdx.x;
    const float s = sinks[h];
    float acc = 0.0f;
    for (int b = 0; b < B; ++b) {
        const long long base = ((long long)b * NH + h) * T;
        for (int t = threadIdx.x; t < T; t += MT_FA_THREADS) acc += expf(s - LSE[base + t]) * D[base + t];
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    float* warp_sums = (float*)MT_FA_SMEM;
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int w = 0; w < MT_FA_THREADS / 32; ++w) sum += warp_sums[w];
        dsink[h] = -sum;
    }
}

// Loads `n` f32 of `src` into shared `dst` (zero past `valid`).
__device__ __forceinline__ void load_row_f32(unsigned dst, const float* src, int n, int valid) {
    for (int i = threadIdx.x; i < n; i += MT_FA_THREADS) {
        const bool ok = i < valid;
        cp_async4(dst + 4 * i, ok ? src + i : src, ok ? 4 : 0);
    }
}

// dK, dV: per CTA 64 keys of one KV head; 16 keys per warp.
template <int HD>
__device__ __forceinline__ void flash_bwd_dkdv(const unsigned short* __restrict__ Q, const unsigned short* __restrict__ K,
                                               const unsigned short* __restrict__ V,
                                               const unsigned short* __restrict__ dO, const float* __restrict__ LSE,
                                               const float* __restrict__ D, unsigned short* __restrict__ dK,
                                               unsigned short* __restrict__ dV, const int* __restrict__ seg_lo,
                                               const int* __restrict__ seg_hi, int window, int T, int NH, int NKV,
                                               float scale, float scale_log2) {
    constexpr int BC = 64, BQ = 64;
    constexpr int TT = 64 * HD * 2;  // bytes of one 64-row tile
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const int jt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, G = NH / NKV;
    const int j0 = jt * BC;
    const long long ldq = (long long)NH * HD, ldk = (long long)NKV * HD;
    const int* slo = seg_lo ? seg_lo + (long long)b * T : nullptr;
    const int* shi = seg_hi ? seg_hi + (long long)b * T : nullptr;

    const unsigned sK = smem_addr(MT_FA_SMEM), sV = sK + TT, sQ0 = sV + TT, sO0 = sQ0 + 2 * TT;
    const unsigned sL0 = sO0 + 2 * TT, sD0 = sL0 + 2 * BQ * 4;
    const float* sLf = (const float*)(MT_FA_SMEM + 6 * TT);
    const float* sDf = sLf + 2 * BQ;

    const long long kv_off = (long long)b * T * ldk + (long long)kvh * HD + (long long)j0 * ldk;
    load_tile<BC, HD>(sK, K + kv_off, ldk, T - j0);
    load_tile<BC, HD>(sV, V + kv_off, ldk, T - j0);

    const int k_last = min(j0 + BC, T) - 1;
    // Queries [j0, q_end) see some key of the tile: none past its last key's document or window.
    const int q_end = min(shi ? shi[k_last] : T, window > 0 && window < T ? k_last + window : T);
    const int it_lo = j0 / BQ, n_it = (q_end + BQ - 1) / BQ - it_lo, n_iter = G * n_it;

    // The first (head, query tile) pair.
    auto issue = [&](int n, int buf) {
        const int hq = n / n_it, it = it_lo + n % n_it, h = kvh * G + hq, i0 = it * BQ;
        const long long qo = ((long long)b * T + i0) * ldq + (long long)h * HD;
        load_tile<BQ, HD>(sQ0 + buf * TT, Q + qo, ldq, T - i0);
        load_tile<BQ, HD>(sO0 + buf * TT, dO + qo, ldq, T - i0);
        const long long ro = ((long long)b * NH + h) * T + i0;
        load_row_f32(sL0 + buf * BQ * 4, LSE + ro, BQ, T - i0);
        load_row_f32(sD0 + buf * BQ * 4, D + ro, BQ, T - i0);
    };
    issue(0, 0);
    cp_async_commit();

    float dk[1][HD / 8][4], dv[1][HD / 8][4];
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[0][nt][e] = dv[0][nt][e] = 0.0f;
    // This thread's keys (rows of S^T): j0 + 16 warp + g + 8 hh.
    const int key0 = j0 + warp * 16 + g;

    for (int n = 0, buf = 0; n < n_iter; ++n, buf ^= 1) {
        cp_async_wait_all();
        __syncthreads();
        if (n + 1 < n_iter) issue(n + 1, buf ^ 1);
        cp_async_commit();
        const unsigned sQ = sQ0 + buf * TT, sdO = sO0 + buf * TT;
        const float* lse = sLf + buf * BQ;
        const float* dd = sDf + buf * BQ;
        const int i0 = (it_lo + n % n_it) * BQ;
        const int q_hi_tile = min(i0 + BQ, T) - 1;
        const bool masked = i0 < j0 + BC - 1 || i0 + BQ > T || (slo && slo[q_hi_tile] > j0) ||
                            (window > 0 && q_hi_tile - j0 >= window);

        // S^T = K Q^T: 16 keys x 64 queries; P^T = exp2(S^T scale_log2 - LSE log2e).
        float s[1][BQ / 8][4], dp[1][BQ / 8][4];
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nt][e] = dp[0][nt][e] = 0.0f;
        mma_abt<HD, BQ / 8, 1>(s, sK, warp * 16, sQ);
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ci = nt * 8 + tig * 2 + (e & 1);  // query within the tile
                float p = fast_exp2(s[0][nt][e] * scale_log2 - lse[ci] * MT_LOG2E);
                if (masked) {
                    const int i = i0 + ci, j = key0 + 8 * (e >> 1);
                    if (i < j || i >= T || (slo && slo[min(i, T - 1)] > j) || (window > 0 && i - j >= window))
                        p = 0.0f;
                }
                s[0][nt][e] = p;
            }
        // dV += P^T dO.
        mma_pv<HD, BQ, 1>(dv, s, sdO);
        // dP^T = V dO^T; dS^T = P^T (dP^T - D).
        mma_abt<HD, BQ / 8, 1>(dp, sV, warp * 16, sdO);
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ci = nt * 8 + tig * 2 + (e & 1);
                dp[0][nt][e] = s[0][nt][e] * (dp[0][nt][e] - dd[ci]);
            }
        // dK += dS^T Q.
        mma_pv<HD, BQ, 1>(dk, dp, sQ);
    }
    cp_async_wait_all();

    const long long out = (long long)b * T * ldk + (long long)kvh * HD + (long long)j0 * ldk;
    store_rows<HD>(dK + out, ldk, warp * 16, T - j0, dk[0], scale, scale);
    store_rows<HD>(dV + out, ldk, warp * 16, T - j0, dv[0], 1.0f, 1.0f);
}

// dQ: per CTA 64 query rows of one head; 16 rows per warp.
template <int HD>
__device__ __forceinline__ void flash_bwd_dq(const unsigned short* __restrict__ Q, const unsigned short* __restrict__ K,
                                             const unsigned short* __restrict__ V, const unsigned short* __restrict__ dO,
                                             const float* __restrict__ LSE, const float* __restrict__ D,
                                             unsigned short* __restrict__ dQ, const int* __restrict__ seg_lo,
                                             int window, int T, int NH, int NKV, float scale, float scale_log2) {
    constexpr int BR = 64, BC = 64;
    constexpr int TT = 64 * HD * 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (NH / NKV);
    const int q0 = qt * BR;
    const long long ldq = (long long)NH * HD, ldk = (long long)NKV * HD;
    const int* seg = seg_lo ? seg_lo + (long long)b * T : nullptr;
    const unsigned short* Kb = K + (long long)b * T * ldk + (long long)kvh * HD;
    const unsigned short* Vb = V + (long long)b * T * ldk + (long long)kvh * HD;

    const unsigned sQ = smem_addr(MT_FA_SMEM), sdO = sQ + TT, sK0 = sdO + TT, sV0 = sK0 + 2 * TT;
    const long long qo = ((long long)b * T + q0) * ldq + (long long)h * HD;
    load_tile<BR, HD>(sQ, Q + qo, ldq, T - q0);
    load_tile<BR, HD>(sdO, dO + qo, ldq, T - q0);

    const int q_last = min(q0 + BR, T) - 1;
    // As the forward's: the CTA's lowest key, and the highest of its rows' lowest keys.
    const int kv_lo = max(seg ? seg[q0] : 0, window > 0 ? q0 - window + 1 : 0);
    const int lo_max = max(seg ? seg[q_last] : 0, window > 0 ? q_last - window + 1 : 0);
    const int jt_lo = kv_lo / BC;
    int jt = q_last / BC;
    load_tile<BC, HD>(sK0, Kb + (long long)jt * BC * ldk, ldk, T - jt * BC);
    load_tile<BC, HD>(sV0, Vb + (long long)jt * BC * ldk, ldk, T - jt * BC);
    cp_async_commit();

    int row[2], rseg[2];
    float lse2[2], dd[2];
    const float* L = LSE + ((long long)b * NH + h) * T;
    const float* Dr = D + ((long long)b * NH + h) * T;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = q0 + warp * 16 + g + 8 * hh;
        row[hh] = r;
        const bool ok = r < T;
        rseg[hh] = max(seg ? seg[min(r, T - 1)] : 0, window > 0 ? r - window + 1 : 0);  // its lowest key
        // A row past T gets P = 0 (exp2(x - inf)).
        lse2[hh] = ok ? L[r] * MT_LOG2E : MT_POS_INF;
        dd[hh] = ok ? Dr[r] : 0.0f;
    }
    float dq[1][HD / 8][4];
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[0][nt][e] = 0.0f;

    for (int buf = 0; jt >= jt_lo; --jt, buf ^= 1) {
        cp_async_wait_all();
        __syncthreads();
        if (jt > jt_lo) {
            const long long off = (long long)(jt - 1) * BC * ldk;
            load_tile<BC, HD>(sK0 + (buf ^ 1) * TT, Kb + off, ldk, T - (jt - 1) * BC);
            load_tile<BC, HD>(sV0 + (buf ^ 1) * TT, Vb + off, ldk, T - (jt - 1) * BC);
        }
        cp_async_commit();
        const unsigned sK = sK0 + buf * TT, sV = sV0 + buf * TT;
        const int j0 = jt * BC;
        const bool masked = j0 + BC - 1 > q0 + warp * 16 || j0 < lo_max;

        float s[1][BC / 8][4], dp[1][BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nt][e] = dp[0][nt][e] = 0.0f;
        mma_abt<HD, BC / 8, 1>(s, sQ, warp * 16, sK);
        mma_abt<HD, BC / 8, 1>(dp, sdO, warp * 16, sV);
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hh = e >> 1;
                float p = fast_exp2(s[0][nt][e] * scale_log2 - lse2[hh]);
                if (masked) {
                    const int j = j0 + nt * 8 + tig * 2 + (e & 1);
                    if (j > row[hh] || j < rseg[hh]) p = 0.0f;
                }
                s[0][nt][e] = p * (dp[0][nt][e] - dd[hh]);
            }
        // dQ += dS K (K as the k-major operand: keys are the contraction).
        mma_pv<HD, BC, 1>(dq, s, sK);
    }
    cp_async_wait_all();
    store_rows<HD>(dQ + qo, ldq, warp * 16, T - q0, dq[0], scale, scale);
}

// Shared memory bytes each kernel needs for head dim HD (the launcher uses the same formulas).
//   fwd:  128 x HD (Q) + 2 x 2 x 64 x HD (K, V double-buffered), bf16
//   dkdv: 2 x 64 x HD (K, V) + 2 x 2 x 64 x HD (Q, dO double-buffered) + 2 x 2 x 64 f32
//   dq:   2 x 64 x HD (Q, dO) + 2 x 2 x 64 x HD (K, V double-buffered)

#define MT_FA_KERNELS(HD)                                                                                         \
    extern "C" __global__ void __launch_bounds__(MT_FA_THREADS) mt_flash_fwd_hd##HD(                              \
        const unsigned short* Q, const unsigned short* K, const unsigned short* V, unsigned short* O, float* LSE, \
        const int* seg_lo, const float* sinks, int window, int T, int NH, int NKV, float scale_log2) {            \
        flash_fwd<HD>(Q, K, V, O, LSE, seg_lo, sinks, window, T, NH, NKV, scale_log2);                            \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(MT_FA_THREADS) mt_flash_bwd_dkdv_hd##HD(                         \
        const unsigned short* Q, const unsigned short* K, const unsigned short* V, const unsigned short* dO,       \
        const float* LSE, const float* D, unsigned short* dK, unsigned short* dV, const int* seg_lo,              \
        const int* seg_hi, int window, int T, int NH, int NKV, float scale, float scale_log2) {                   \
        flash_bwd_dkdv<HD>(Q, K, V, dO, LSE, D, dK, dV, seg_lo, seg_hi, window, T, NH, NKV, scale, scale_log2);   \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(MT_FA_THREADS) mt_flash_bwd_dq_hd##HD(                           \
        const unsigned short* Q, const unsigned short* K, const unsigned short* V, const unsigned short* dO,       \
        const float* LSE, const float* D, unsigned short* dQ, const int* seg_lo, int window, int T, int NH,       \
        int NKV, float scale, float scale_log2) {                                                                 \
        flash_bwd_dq<HD>(Q, K, V, dO, LSE, D, dQ, seg_lo, window, T, NH, NKV, scale, scale_log2);                 \
    }

MT_FA_KERNELS(16)
MT_FA_KERNELS(32)
MT_FA_KERNELS(64)
MT_FA_KERNELS(128)

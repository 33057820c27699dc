// Mixture-of-experts on the device: routing, the stable grouping of the routed rows by expert,
// the grouped GEMMs of the experts (forward and backward) and the combine back to token order.
// Compiled at run time with NVRTC after common.cuh; no CUDA headers; every kernel deterministic
// (no float atomics: each output element has one writer, and every sum runs in a fixed order).
//
// Names: T tokens (router rows), E experts, K experts per token, slot s = t K + j (token t, its
// j-th choice in top-k order), R = T K routed rows. The grouping is a stable counting sort of the
// slots by expert: row perm[s] of the permuted ("expert-major") order holds slot s, expert e's
// rows are [off[e], off[e + 1]) in ascending slot (= ascending token) order, row_slot is the
// inverse of perm. This is the order in which the CPU engine (crates/layers/src/moe.rs) visits
// an expert's rows, and its per-token sums run over experts in ascending order, which is
// ascending permuted row: the combine below sums in that order.
//
// Routing (mt_moe_route_*), as the CPU engine: probabilities = softmax of the row's logits in f64
// (max, exps, a sequential sum, each quotient rounded to f32 once); top-k over those f32 values
// in IEEE total order (Rust's f32::total_cmp), ties to the lower expert index; routing weights =
// the chosen probabilities, or (norm_topk_prob) each divided by their sequential f64 sum and
// rounded to f32 once. The only difference left is the f64 exp of the device's library.
//
// Grouping (mt_moe_sort_*): chunks of MT_MOE_CHUNK slots, one warp each, ranked per expert with
// __match_any_sync in slot order; one block scans the chunk counts into per-expert offsets and
// per-chunk bases; a scatter writes perm and row_slot. Integer work only: exact and repeatable.
//
// Grouped GEMMs (mt_moe_gemm_*): bf16 operands, f32 accumulation on the tensor cores (mma.sync
// m16n8k16, ldmatrix, cp.async into a ring of stages; sm_80 and later). By default CTA tile
// 128 x 128, k step 32, 3 stages, 8 warps of 64 x 32, two CTAs an SM (at most 128 registers a
// thread, 2 x 48 KiB of shared memory); other geometries are compile-time switches (the GEMM
// section below); moe_hopper.cu has the same GEMMs on wgmma for Hopper. Two shapes:
//   M-grouped (forward products and the backward's dX): C[p, :] = A[p, :] B_e for the rows p of
//     expert e, B_e = W[e]^T (W stored [N, K], "nk") or W[e] itself (stored [K, N], "kn"). The grid
//     is sized to the bound ceil(R / BM) + E of row tiles; each CTA finds its expert and row tile
//     by walking off[] (read from device memory: no host copy of the counts). A's rows may be
//     gathered from token rows (a_slot[p] / a_div), so the permuted copy of the input is optional.
//   K-grouped (weight gradients): G_e[m, n] += sum over the rows p of expert e of A[p, m] B[p, n],
//     the sum in ascending p, added to the f32 gradient buffer G (one writer per element). The
//     rows of B may be gathered the same way.
//   An expert with no rows gets no row tile (M-grouped) or adds nothing (K-grouped); an expert
//   with most of the rows gets as many row tiles as it needs: no special path either way.
// Epilogues of the M-grouped GEMM: bf16 store (every product the CPU engine rounds to bf16 on the
// GPU); or, for the backward of the down projection, g = bf16(dY W_down[e]) turned into
// d_mid = bf16(g w) with w the slot's routing weight rounded through bf16, and per row and column
// tile the partial sum of g * mid (the routing weight's gradient, finished by mt_moe_router_bwd).
//
// Shapes the launchers guarantee: K and N multiples of 8 (16-byte rows of bf16), E <= 1024,
// K (top-k) <= 32, R < 2^31.

#define MT_MOE_CHUNK 1024
#define MT_MOE_MAX_K 32

// The dynamic shared memory of every kernel here (the CPU emulator, kernels/emu, brings its own).
#ifndef MT_EMU
extern __shared__ __align__(128) unsigned char mt_moe_smem[];
#define MT_MOE_SMEM mt_moe_smem
#endif

// --- routing -------------------------------------------------------------------------------------

// The f32's position in IEEE total order as an unsigned integer (Rust's f32::total_cmp): negative
// NaNs first, then -inf .. -0, +0 .. +inf, positive NaNs last.
__device__ __forceinline__ unsigned total_order_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One warp per token (4 per block); dynamic shared memory: 4 E doubles + 4 E floats.
// logits [T, E] (bf16 or f32) -> probs [T, E] f32, top [T, K] int, weights [T, K] f32.
template <bool BF16>
__device__ void moe_route(const void* __restrict__ logits, float* __restrict__ probs, int* __restrict__ top,
                          float* __restrict__ weights, int T, int E, int K, int normalise) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 4 + warp;
    double* ex = reinterpret_cast<double*>(MT_MOE_SMEM) + (size_t)warp * E;
    float* pr = reinterpret_cast<float*>(reinterpret_cast<double*>(MT_MOE_SMEM) + 4 * (size_t)E) + (size_t)warp * E;
    if (t >= T) return;
    const size_t row = (size_t)t * E;
    // The maximum: f64's max of f32 values is the f32 max (NaNs ignored, as f64::max ignores them).
    float m = __int_as_float(0xff800000);
    for (int e = lane; e < E; e += 32) {
        const float x = BF16 ? bf2f(static_cast<const unsigned short*>(logits)[row + e])
                             : static_cast<const float*>(logits)[row + e];
        pr[e] = x;
        m = fmaxf(m, x);
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    for (int e = lane; e < E; e += 32) ex[e] = exp((double)pr[e] - (double)m);
    __syncwarp();
    double sum = 0.0;
    if (lane == 0)
        for (int e = 0; e < E; ++e) sum += ex[e];  // sequential, as the CPU's
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int e = lane; e < E; e += 32) {
        const float p = (float)(ex[e] / sum);
        pr[e] = p;
        probs[row + e] = p;
    }
    __syncwarp();
    // Top-k: K rounds of a warp arg-max over (total-order key, lower index first).
    unsigned taken = 0;  // bit i: expert lane + 32 i chosen (E <= 1024)
    double wsum = 0.0;
    for (int j = 0; j < K; ++j) {
        unsigned long long best = 0;
        for (int e = lane, i = 0; e < E; e += 32, ++i) {
            if (taken & (1u << i)) continue;
            const unsigned long long key =
                ((unsigned long long)total_order_key(pr[e]) << 32) | (unsigned long long)(0xffffffffu - (unsigned)e);
            best = key > best ? key : best;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
            best = other > best ? other : best;
        }
        const int e = (int)(0xffffffffu - (unsigned)(best & 0xffffffffu));
        if ((e & 31) == lane) taken |= 1u << (e >> 5);
        if (lane == 0) {
            top[(size_t)t * K + j] = e;
            wsum += (double)pr[e];  // sequential in top-k order, as the CPU's
        }
    }
    if (lane == 0)
        for (int j = 0; j < K; ++j) {
            const float p = pr[top[(size_t)t * K + j]];
            weights[(size_t)t * K + j] = normalise ? (float)((double)p / wsum) : p;
        }
}

extern "C" __global__ void mt_moe_route_bf16(const unsigned short* __restrict__ logits, float* __restrict__ probs,
                                             int* __restrict__ top, float* __restrict__ weights, int T, int E, int K,
                                             int normalise) {
    moe_route<true>(logits, probs, top, weights, T, E, K, normalise);
}

extern "C" __global__ void mt_moe_route_f32(const float* __restrict__ logits, float* __restrict__ probs,
                                            int* __restrict__ top, float* __restrict__ weights, int T, int E, int K,
                                            int normalise) {
    moe_route<false>(logits, probs, top, weights, T, E, K, normalise);
}

// sums[e] += sum over the rows of probs[:, e] (f64; the load-balancing loss's P_e). One block of
// 256 threads per expert; a fixed tree, so the same bits every run.
extern "C" __global__ void mt_moe_prob_sums(const float* __restrict__ probs, double* __restrict__ sums, int T, int E) {
    __shared__ double sh[256];
    const int e = blockIdx.x;
    double s = 0.0;
    for (int t = threadIdx.x; t < T; t += 256) s += (double)probs[(size_t)t * E + e];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) sums[e] += sh[0];
}

// --- grouping: a stable counting sort of the slots by expert ------------------------------------

// One warp per chunk of MT_MOE_CHUNK slots: rank[s] = how many earlier slots of the chunk chose
// the same expert; chunk_counts[c E + e] = the chunk's slots of expert e. Shared: E ints.
extern "C" __global__ void mt_moe_sort_count(const int* __restrict__ top, int* __restrict__ rank,
                                             int* __restrict__ chunk_counts, int N, int E) {
    int* cnt = reinterpret_cast<int*>(MT_MOE_SMEM);
    const int lane = threadIdx.x;
    for (int e = lane; e < E; e += 32) cnt[e] = 0;
    __syncwarp();
    const int begin = blockIdx.x * MT_MOE_CHUNK, end = min(N, begin + MT_MOE_CHUNK);
    for (int base = begin; base < end; base += 32) {
        const int s = base + lane;
        const int e = s < end ? top[s] : -1;
        const unsigned same = __match_any_sync(0xffffffffu, e);
        const int cur = e >= 0 ? cnt[e] : 0;
        __syncwarp();  // every lane has read its expert's count before a leader moves it on
        if (e >= 0) {
            rank[s] = cur + __popc(same & ((1u << lane) - 1u));
            if (lane == __ffs(same) - 1) cnt[e] = cur + __popc(same);
        }
        __syncwarp();
    }
    for (int e = lane; e < E; e += 32) chunk_counts[(size_t)blockIdx.x * E + e] = cnt[e];
}

// One block: counts[e] = expert e's rows, off[e] = the first of them (off[E] = N), and
// chunk_base[c E + e] = the row of chunk c's first slot of expert e. Shared: E ints.
extern "C" __global__ void mt_moe_sort_scan(const int* __restrict__ chunk_counts, int* __restrict__ chunk_base,
                                            int* __restrict__ counts, int* __restrict__ off, int chunks, int E) {
    int* start = reinterpret_cast<int*>(MT_MOE_SMEM);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int c = 0; c < chunks; ++c) {
            chunk_base[(size_t)c * E + e] = run;
            run += chunk_counts[(size_t)c * E + e];
        }
        counts[e] = run;
        start[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < E; ++e) {
            const int n = start[e];
            start[e] = run;
            off[e] = run;
            run += n;
        }
        off[E] = run;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        for (int c = 0; c < chunks; ++c) chunk_base[(size_t)c * E + e] += start[e];
}

// perm[s] = the permuted row of slot s, row_slot[perm[s]] = s.
extern "C" __global__ void mt_moe_sort_scatter(const int* __restrict__ top, const int* __restrict__ rank,
                                               const int* __restrict__ chunk_base, int* __restrict__ perm,
                                               int* __restrict__ row_slot, int N, int E) {
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < N; s += gridDim.x * blockDim.x) {
        const int row = chunk_base[(size_t)(s / MT_MOE_CHUNK) * E + top[s]] + rank[s];
        perm[s] = row;
        row_slot[row] = s;
    }
}

// --- permute, SwiGLU, combine ---------------------------------------------------------------------

// out[p] = src[row_slot[p] / K] (token rows gathered into expert order), times the slot's routing
// weight rounded through bf16 when `weights` is given (bf16(f32(x) w), as the CPU engine's scaled
// rows). src [T, H], out [R, H] bf16; H a multiple of 8.
extern "C" __global__ void mt_moe_gather(const unsigned short* __restrict__ src, const int* __restrict__ row_slot,
                                         const float* __restrict__ weights, unsigned short* __restrict__ out, int R,
                                         int H, int K) {
    const int groups = H / 8;
    const long long total = (long long)R * groups;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const int p = (int)(i / groups), g = (int)(i % groups);
        const int slot = row_slot[p];
        uint4 u = reinterpret_cast<const uint4*>(src + (size_t)(slot / K) * H)[g];
        if (weights) {
            const float w = rbf(weights[slot]);
            float v[8];
            unpack8(u, v);
            unsigned short o[8];
            for (int q = 0; q < 8; ++q) o[q] = f2bf(v[q] * w);
            u.x = o[0] | ((unsigned)o[1] << 16);
            u.y = o[2] | ((unsigned)o[3] << 16);
            u.z = o[4] | ((unsigned)o[5] << 16);
            u.w = o[6] | ((unsigned)o[7] << 16);
        }
        reinterpret_cast<uint4*>(out + (size_t)p * H)[g] = u;
    }
}

// mid[p, f] = bf16(bf16(silu(gu[p, f])) gu[p, F + f]) over all rows at once; gu [R, 2F] holds each
// row's gate then up projections (the experts' gate_up matrices stack gate rows over up rows).
extern "C" __global__ void mt_moe_swiglu(const unsigned short* __restrict__ gu, unsigned short* __restrict__ mid,
                                         long long R, int F) {
    const long long total = R * F;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / F;
        const int f = (int)(i % F);
        const unsigned short* row = gu + p * 2 * F;
        mid[i] = f2bf(silu_bf(bf2f(row[f])) * bf2f(row[F + f]));
    }
}

// dgu [R, 2F] = [d_gate | d_up] of each row from d_mid [R, F] (fused.cu's SwiGLU backward).
extern "C" __global__ void mt_moe_swiglu_bwd(const unsigned short* __restrict__ dmid, const unsigned short* __restrict__ gu,
                                             unsigned short* __restrict__ dgu, long long R, int F) {
    const long long total = R * F;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / F;
        const int f = (int)(i % F);
        const size_t r = (size_t)p * 2 * F;
        swiglu_grads(bf2f(dmid[i]), bf2f(gu[r + f]), bf2f(gu[r + F + f]), &dgu[r + f], &dgu[r + F + f]);
    }
}

// out[t] = bf16(base[t] + sum over t's K rows in ascending row order of src[row] (times the slot's
// weight rounded through bf16 when `weights` is given)), the sum in f32 from 0. One block per
// token; src [R, H] bf16, base [T, H] bf16 or null, out [T, H] bf16; H a multiple of 8.
extern "C" __global__ void mt_moe_combine(const unsigned short* __restrict__ src, const int* __restrict__ perm,
                                          const float* __restrict__ weights, const unsigned short* __restrict__ base,
                                          unsigned short* __restrict__ out, int T, int H, int K) {
    __shared__ int rows[MT_MOE_MAX_K];
    __shared__ float ws[MT_MOE_MAX_K];
    const int t = blockIdx.x;
    if (threadIdx.x == 0) {
        // Insertion sort of the token's K rows (ascending row = ascending expert).
        for (int j = 0; j < K; ++j) {
            const int slot = t * K + j, r = perm[slot];
            const float w = weights ? rbf(weights[slot]) : 1.0f;
            int i = j;
            while (i > 0 && rows[i - 1] > r) {
                rows[i] = rows[i - 1];
                ws[i] = ws[i - 1];
                --i;
            }
            rows[i] = r;
            ws[i] = w;
        }
    }
    __syncthreads();
    for (int g = threadIdx.x; g < H / 8; g += blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < K; ++j) {
            float v[8];
            unpack8(reinterpret_cast<const uint4*>(src + (size_t)rows[j] * H)[g], v);
            for (int q = 0; q < 8; ++q) acc[q] = acc[q] + (weights ? v[q] * ws[j] : v[q]);
        }
        if (base) {
            float b[8];
            unpack8(reinterpret_cast<const uint4*>(base + (size_t)t * H)[g], b);
            for (int q = 0; q < 8; ++q) acc[q] = b[q] + acc[q];
        }
        unsigned short o[8];
        for (int q = 0; q < 8; ++q) o[q] = f2bf(acc[q]);
        uint4 u;
        u.x = o[0] | ((unsigned)o[1] << 16);
        u.y = o[2] | ((unsigned)o[3] << 16);
        u.z = o[4] | ((unsigned)o[5] << 16);
        u.w = o[6] | ((unsigned)o[7] << 16);
        reinterpret_cast<uint4*>(out + (size_t)t * H)[g] = u;
    }
}

// --- router backward ---------------------------------------------------------------------------

// f64 -> bf16, rounded to nearest even once (as candle's cast of an f64 tensor): the f32 rounded
// toward zero with a sticky bit for what was dropped, then rounded to bf16.
__device__ __forceinline__ unsigned short f64_to_bf16(double d) {
    float f = __double2float_rz(d);
    if ((double)f != d) f = __uint_as_float(__float_as_uint(f) | 1u);
    return f2bf(f);
}

// dlogit [T, E] (bf16) of each token, as the CPU engine's router backward (f64, sequential sums):
// dw_j = the sum over the column tiles of the partials of the slot's row (the routing weight's
// gradient, from the M-grouped GEMM's d_mid epilogue); dp = aux_dprob (or 0), plus on the chosen
// experts dw_j, or (normalised weights, S = sum of the chosen p) (dw_j - sum_i dw_i p_i / S) / S;
// dlogit = p (dp - sum_e p_e dp_e). dw [T K] f64 is written too. One warp per token (4 a block);
// dynamic shared memory: 4 E doubles.
extern "C" __global__ void mt_moe_router_bwd(const float* __restrict__ probs, const int* __restrict__ top,
                                             const int* __restrict__ perm, const float* __restrict__ partial,
                                             int tiles, const double* __restrict__ aux_dprob, int normalise,
                                             double* __restrict__ dw, unsigned short* __restrict__ dlogit, int T,
                                             int E, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 4 + warp;
    double* dp = reinterpret_cast<double*>(MT_MOE_SMEM) + (size_t)warp * E;
    if (t >= T) return;
    const float* p = probs + (size_t)t * E;
    for (int e = lane; e < E; e += 32) dp[e] = aux_dprob ? aux_dprob[e] : 0.0;
    __syncwarp();
    double dot = 0.0;
    if (lane == 0) {
        const int* tk = top + (size_t)t * K;
        double* dws = dw + (size_t)t * K;  // written here, read back by this thread only
        double sum = 0.0, weighted = 0.0;
        for (int j = 0; j < K; ++j) {
            const float* pt = partial + (size_t)perm[(size_t)t * K + j] * tiles;
            float d = 0.0f;
            for (int i = 0; i < tiles; ++i) d += pt[i];
            dws[j] = (double)d;
            sum += (double)p[tk[j]];
        }
        for (int j = 0; j < K; ++j) weighted += dws[j] * (double)p[tk[j]] / sum;
        for (int j = 0; j < K; ++j) dp[tk[j]] += normalise ? (dws[j] - weighted) / sum : dws[j];
        for (int e = 0; e < E; ++e) dot += (double)p[e] * dp[e];
    }
    __syncwarp();
    dot = __shfl_sync(0xffffffffu, dot, 0);
    for (int e = lane; e < E; e += 32) dlogit[(size_t)t * E + e] = f64_to_bf16((double)p[e] * (dp[e] - dot));
}

// --- grouped GEMMs -----------------------------------------------------------------------------

// Geometry and variants, each a -D define. The defaults are what the launchers
// (kernels/src/ops/moe/) and scripts/moe_bench.py launch; another set is compiled for a
// measurement (moe_bench.py --variants) and becomes the default only once a GPU says it is faster.
//   BM x BN: the CTA tile; BK: the k step; STAGES: the depth of the cp.async ring;
//   WARPS_M x WARPS_N warps, each owning a (BM / WARPS_M) x (BN / WARPS_N) warp tile;
//   MIN_CTAS: the CTAs an SM is promised (__launch_bounds__: what caps the registers).
//   HOIST 1: the CTA's setup done once instead of per k step: one warp scans the offsets for the
//     CTA's expert, each thread finds its gathered A rows' sources once, and the weight
//     gradient's per-step gather divides by a multiplier computed once (FastDiv).
//   GROUP g > 0: the M-grouped CTAs run in groups of g row tiles times every column tile, rather
//     than every row tile of column tile 0 first: an A tile is read by all its column tiles while
//     it is still in L2, instead of once from DRAM per column tile.
#ifndef MT_MOE_BM
#define MT_MOE_BM 128
#endif
#ifndef MT_MOE_BN
#define MT_MOE_BN 128
#endif
#ifndef MT_MOE_BK
#define MT_MOE_BK 32
#endif
#ifndef MT_MOE_STAGES
#define MT_MOE_STAGES 3
#endif
#ifndef MT_MOE_WARPS_M
#define MT_MOE_WARPS_M 2
#endif
#ifndef MT_MOE_WARPS_N
#define MT_MOE_WARPS_N 4
#endif
#ifndef MT_MOE_MIN_CTAS
#define MT_MOE_MIN_CTAS 2
#endif
// HOIST and GROUP on by default: the first GPU sweep (decision 0050) measured them 1.2x the first
// kernel's GEMMs with the same per-tile sums (only addressing and the CTA order change).
#ifndef MT_MOE_HOIST
#define MT_MOE_HOIST 1
#endif
#ifndef MT_MOE_GROUP
#define MT_MOE_GROUP 8
#endif
#define MT_MOE_THREADS (32 * MT_MOE_WARPS_M * MT_MOE_WARPS_N)
#define MT_MOE_WTM (MT_MOE_BM / MT_MOE_WARPS_M)  // a warp tile's rows
#define MT_MOE_WTN (MT_MOE_BN / MT_MOE_WARPS_N)  // and columns
#define MT_MOE_MI (MT_MOE_WTM / 16)              // its m16 fragments
#define MT_MOE_NI (MT_MOE_WTN / 8)               // and n8 fragments
#define MT_MOE_A_BYTES (MT_MOE_BM * MT_MOE_BK * 2)
#define MT_MOE_STAGE_BYTES ((MT_MOE_BM + MT_MOE_BN) * MT_MOE_BK * 2)
#define MT_MOE_GEMM_SMEM_BYTES (MT_MOE_STAGES * MT_MOE_STAGE_BYTES)
static_assert(MT_MOE_WTM % 16 == 0 && MT_MOE_WTN % 16 == 0, "warp tiles are made of 16 x 16 blocks");
static_assert(MT_MOE_BM % 64 == 0 && MT_MOE_BN % 64 == 0, "CTA tiles are multiples of 64 (kr tiles' swizzle)");
static_assert(MT_MOE_BK == 32 || MT_MOE_BK % 64 == 0, "k step 32 or a multiple of 64 (rk tiles' swizzle)");
static_assert(MT_MOE_STAGES >= 2, "a ring of at least two stages");
static_assert(MT_MOE_THREADS % (MT_MOE_BK / 8) == 0 && (MT_MOE_BM * MT_MOE_BK / 8) % MT_MOE_THREADS == 0,
              "each thread copies whole rows' worth of the A tile's chunk columns");
static_assert(4 * MT_MOE_WARPS_N * MT_MOE_BM <= MT_MOE_GEMM_SMEM_BYTES, "the epilogue's reduction fits the ring");
// A launcher that computes the geometry on its own side (scripts/moe_bench.py) passes what it
// will launch with; a difference is a compile error, not a kernel reading past its shared memory.
#if defined(MT_MOE_EXPECT_SMEM) && !defined(MT_MOE_HOPPER)
static_assert(MT_MOE_EXPECT_SMEM == MT_MOE_GEMM_SMEM_BYTES && MT_MOE_EXPECT_THREADS == MT_MOE_THREADS &&
                  MT_MOE_EXPECT_BM == MT_MOE_BM && MT_MOE_EXPECT_BN == MT_MOE_BN,
              "the launcher's GEMM geometry is not the kernels'");
#endif

// Shared-memory tiles: rows of CH 16-byte chunks, a chunk's place XOR-swizzled so that
// ldmatrix's 8 row addresses (8 rows, one chunk column) and a warp's cp.async stores hit 8
// different 16-byte bank groups. "rk" tiles: rows m or n, BK k contiguous (CH = BK / 8); "kr"
// tiles: BK rows of k, m or n contiguous (CH = BM / 8 or BN / 8).
template <int CH>
__device__ __forceinline__ unsigned sw_at(int r, int c) {
    static_assert(CH == 4 || CH % 8 == 0, "4 chunks a row, or a multiple of 8");
    return CH == 4 ? (unsigned)((r * 4 + (c ^ ((r >> 1) & 3))) * 16) : (unsigned)((r * CH + (c ^ (r & 7))) * 16);
}

// n / d for 0 <= n < 2^31 and 1 <= d <= 32 by a multiply-high and a shift (Granlund and
// Montgomery: with l = ceil(log2 d) and m = ceil(2^(31 + l) / d), m d - 2^(31 + l) < d <= 2^l,
// so floor(m n / 2^(31 + l)) = floor(n / d)); d = 1 is n itself.
struct FastDiv {
    unsigned m;
    int shift, d;
};
__device__ __forceinline__ FastDiv fast_div(int d) {
    FastDiv f{0u, 0, d};
    if (d > 1) {
        const int l = 32 - __clz(d - 1);
        f.m = (unsigned)(((1ull << (31 + l)) + (unsigned long long)d - 1ull) / (unsigned long long)d);
        f.shift = l - 1;
    }
    return f;
}
__device__ __forceinline__ int quot(int n, int d) { return n / d; }
__device__ __forceinline__ int quot(int n, FastDiv f) {
    return f.d == 1 ? n : (int)(__umulhi((unsigned)n, f.m) >> f.shift);
}

// Copies of a tile of R rows x C 16-byte chunks: rows [row0, row0 + R) of a row-major [rows, ld]
// matrix, columns [col0, col0 + 8 C); rows at or past `row_end` and columns at or past `cmax` are
// zero-filled. Row r is read from row idx[r] / div of the source when idx is given (token rows
// gathered in permuted order); `div` an int or a FastDiv.
template <int R, int C, class Div>
__device__ __forceinline__ void load_tile(unsigned dst, const unsigned short* __restrict__ src, long long ld, int row0,
                                          int row_end, int col0, int cmax, const int* __restrict__ idx, Div div) {
#pragma unroll
    for (int j = 0; j < (R * C + MT_MOE_THREADS - 1) / MT_MOE_THREADS; ++j) {
        const int i = (int)threadIdx.x + j * MT_MOE_THREADS;
        if ((R * C) % MT_MOE_THREADS != 0 && i >= R * C) break;
        const int r = i / C, c = i % C;
        const int row = row0 + r, col = col0 + c * 8;
        const bool ok = row < row_end && col < cmax;
        const unsigned short* p = src;
        if (ok) p = src + (long long)(idx ? quot(idx[row], div) : row) * ld + col;
        cp_async16(dst + sw_at<C>(r, c), p, ok ? 16 : 0);
    }
}

// MT_MOE_HOIST: a thread's share of the M-grouped A tile (BM rows x BK k, "rk"), found once per
// CTA: chunk column tid % CH of rows tid / CH + j STEP, src[j] the source row of each (through
// idx / div when gathered) or -1 past the expert's rows.
struct ARows {
    static constexpr int CH = MT_MOE_BK / 8, N = MT_MOE_BM * CH / MT_MOE_THREADS, STEP = MT_MOE_THREADS / CH;
    int src[N];
};
__device__ __forceinline__ void a_rows_init(ARows& a, int row0, int row_end, const int* __restrict__ idx, int div) {
#pragma unroll
    for (int j = 0; j < ARows::N; ++j) {
        const int row = row0 + (int)threadIdx.x / ARows::CH + j * ARows::STEP;
        a.src[j] = row < row_end ? (idx ? idx[row] / div : row) : -1;
    }
}
// The copies of k step [k0, k0 + BK) of those rows (A [*, K] row-major).
__device__ __forceinline__ void a_rows_load(const ARows& a, unsigned dst, const unsigned short* __restrict__ src, int K,
                                            int k0) {
    const int c = (int)threadIdx.x % ARows::CH, col = k0 + c * 8;
#pragma unroll
    for (int j = 0; j < ARows::N; ++j) {
        const bool ok = a.src[j] >= 0 && col < K;
        const unsigned short* p = ok ? src + (long long)a.src[j] * K + col : src;
        cp_async16(dst + sw_at<ARows::CH>((int)threadIdx.x / ARows::CH + j * ARows::STEP, c), p, ok ? 16 : 0);
    }
}

// A fragment (16 rows x 16 k) at rows m0.., k step kk of an "rk" tile.
__device__ __forceinline__ void frag_a_rk(unsigned* a, unsigned tile, int m0, int kk) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    ldsm_x4(a, tile + sw_at<MT_MOE_BK / 8>(m0 + (mi & 1) * 8 + (lane & 7), kk * 2 + (mi >> 1)));
}
// A fragment (16 m x 16 k) at m0.., k rows 16 kk.. of a "kr" tile (the tile holds A transposed).
__device__ __forceinline__ void frag_a_kr(unsigned* a, unsigned tile, int m0, int kk) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    ldsm_x4_t(a, tile + sw_at<MT_MOE_BM / 8>(kk * 16 + (mi >> 1) * 8 + (lane & 7), (m0 >> 3) + (mi & 1)));
}
// B fragments of two n-tiles (n0.., n0 + 8..), k step kk, of an "rk" tile holding B^T (n rows).
__device__ __forceinline__ void frag_b_rk(unsigned* b, unsigned tile, int n0, int kk) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    ldsm_x4(b, tile + sw_at<MT_MOE_BK / 8>(n0 + (mi >> 1) * 8 + (lane & 7), kk * 2 + (mi & 1)));
}
// B fragments of two n-tiles (n0.., n0 + 8..), k rows 16 kk.. of a "kr" tile holding B.
__device__ __forceinline__ void frag_b_kr(unsigned* b, unsigned tile, int n0, int kk) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    ldsm_x4_t(b, tile + sw_at<MT_MOE_BN / 8>(kk * 16 + (mi & 1) * 8 + (lane & 7), (n0 >> 3) + (mi >> 1)));
}

// The tensor-core work of one k step of the CTA tile on one stage: warp (wm, wn) owns rows
// [WTM wm, WTM (wm + 1)) and columns [WTN wn, WTN (wn + 1)): acc[MI][NI][4].
// Unrolled by two k16 steps, not more: a longer unroll lets the compiler hoist every step's
// fragments ahead of the mma's, more registers than two CTAs an SM leave a thread.
template <bool A_KR, bool B_KR>
__device__ __forceinline__ void mma_stage(float (*acc)[MT_MOE_NI][4], unsigned ta, unsigned tb, int wm, int wn) {
#pragma unroll 2
    for (int kk = 0; kk < MT_MOE_BK / 16; ++kk) {
        unsigned a[MT_MOE_MI][4], b[MT_MOE_NI / 2][4];
#pragma unroll
        for (int mi = 0; mi < MT_MOE_MI; ++mi) {
            if (A_KR) frag_a_kr(a[mi], ta, wm * MT_MOE_WTM + mi * 16, kk);
            else frag_a_rk(a[mi], ta, wm * MT_MOE_WTM + mi * 16, kk);
        }
#pragma unroll
        for (int np = 0; np < MT_MOE_NI / 2; ++np) {
            if (B_KR) frag_b_kr(b[np], tb, wn * MT_MOE_WTN + np * 16, kk);
            else frag_b_rk(b[np], tb, wn * MT_MOE_WTN + np * 16, kk);
        }
#pragma unroll
        for (int mi = 0; mi < MT_MOE_MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < MT_MOE_NI; ++ni)
                mma16816(acc[mi][ni], a[mi], b[ni >> 1][(ni & 1) * 2], b[ni >> 1][(ni & 1) * 2 + 1]);
    }
}

// The CTA's whole k loop: acc zeroed, then `steps` k steps of BK through the STAGES-deep cp.async
// ring; load(step, tile_a, tile_b) issues the copies of one step's two tiles.
template <bool A_KR, bool B_KR, class Load>
__device__ __forceinline__ void gemm_mainloop(float (*acc)[MT_MOE_NI][4], int steps, Load load) {
    const int warp = threadIdx.x >> 5, wm = warp / MT_MOE_WARPS_N, wn = warp % MT_MOE_WARPS_N;
    const unsigned sbase = smem_addr(MT_MOE_SMEM);
#pragma unroll
    for (int mi = 0; mi < MT_MOE_MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < MT_MOE_NI; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.0f;
#pragma unroll
    for (int s = 0; s < MT_MOE_STAGES - 1; ++s) {
        const unsigned st = sbase + s * MT_MOE_STAGE_BYTES;
        if (s < steps) load(s, st, st + MT_MOE_A_BYTES);
        cp_async_commit();
    }
    int rd = 0, wr = MT_MOE_STAGES - 1;  // the stages read and refilled this step
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<MT_MOE_STAGES - 2>();
        __syncthreads();  // this step's tiles are in; every warp is done with the stage refilled next
        const int next = step + MT_MOE_STAGES - 1;
        const unsigned sw = sbase + wr * MT_MOE_STAGE_BYTES, sr = sbase + rd * MT_MOE_STAGE_BYTES;
        if (next < steps) load(next, sw, sw + MT_MOE_A_BYTES);
        cp_async_commit();
        mma_stage<A_KR, B_KR>(acc, sr, sr + MT_MOE_A_BYTES, wm, wn);
        rd = rd + 1 == MT_MOE_STAGES ? 0 : rd + 1;
        wr = wr + 1 == MT_MOE_STAGES ? 0 : wr + 1;
    }
    cp_async_wait_all();
}

// The expert and row tile of M-grouped row-tile slot `slot` (the tiles of BM rows of experts
// 0, 1, ... in order; e = -1 past the last one) into job[0], job[1], by warp 0 scanning 32 experts
// at a time (the other threads return at once). The caller synchronises.
template <int BM>
__device__ __forceinline__ void find_expert_warp(int* job, int slot, const int* __restrict__ off, int E) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int cum = 0, found = -1, before = 0;
    for (int base = 0; base < E && found < 0; base += 32) {
        const int e = base + lane;
        const int tiles = e < E ? (off[e + 1] - off[e] + BM - 1) / BM : 0;
        int incl = tiles;  // inclusive prefix sum over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, slot < cum + incl);
        if (hit) {
            const int l = __ffs(hit) - 1;
            found = base + l;
            before = cum + __shfl_sync(0xffffffffu, incl - tiles, l);
        } else {
            cum += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    if (lane == 0) {
        job[0] = found;
        job[1] = slot - before;
    }
}

// The same by thread 0 walking the experts one by one (MT_MOE_HOIST 0: the first kernel's way).
__device__ __forceinline__ void find_expert(int* job, int slot, const int* __restrict__ off, int E) {
#if MT_MOE_HOIST
    find_expert_warp<MT_MOE_BM>(job, slot, off, E);
#else
    if (threadIdx.x != 0) return;
    int cum = 0, e = 0, found = -1;
    for (; e < E; ++e) {
        const int tiles = (off[e + 1] - off[e] + MT_MOE_BM - 1) / MT_MOE_BM;
        if (slot < cum + tiles) {
            found = e;
            break;
        }
        cum += tiles;
    }
    job[0] = found;
    job[1] = slot - cum;
#endif
}

// An M-grouped CTA's row-tile slot and column tile: launch order (group 0: every row tile of
// column tile 0 first), or groups of `group` row tiles by every column tile, the column tile
// slowest within a group (grid: row-tile slots x column tiles).
__device__ __forceinline__ void m_tile(int group, int& slot, int& ct) {
    slot = blockIdx.x;
    ct = blockIdx.y;
    if (group > 0) {
        const int lin = (int)(blockIdx.x + gridDim.x * blockIdx.y), per = group * (int)gridDim.y;
        const int g = lin / per, j = lin - g * per, rows = min(group, (int)gridDim.x - g * group);
        slot = g * group + j % rows;
        ct = j / rows;
    }
}

#define MT_MOE_EPI_STORE 0
#define MT_MOE_EPI_DMID 1

// Columns n, n + 1 of row p of an M-grouped product (accumulators v0, v1) into C [*, N]: stored
// as bf16 (EPI_STORE); or (EPI_DMID) g = bf16(v), dot += g * mid[p, n..] in column order, stored
// as bf16(g w) (moe_gemm_m's epilogues; moe_hopper.cu's too).
template <int EPI>
__device__ __forceinline__ void epi_pair(float v0, float v1, long long p, int n, int N, float w,
                                         const unsigned short* __restrict__ mid, unsigned short* __restrict__ C,
                                         float& dot) {
    if (EPI == MT_MOE_EPI_DMID) {
        v0 = rbf(v0);
        v1 = rbf(v1);
        const unsigned mm = *reinterpret_cast<const unsigned*>(mid + p * N + n);
        dot = dot + v0 * bf2f((unsigned short)(mm & 0xffffu));
        dot = dot + v1 * bf2f((unsigned short)(mm >> 16));
        v0 = v0 * w;
        v1 = v1 * w;
    }
    *reinterpret_cast<unsigned*>(C + p * N + n) = (unsigned)f2bf(v0) | ((unsigned)f2bf(v1) << 16);
}

// M-grouped: C[p, n] = sum_k A[p, k] B_e[k, n] for the rows p of expert e. A [*, K] bf16 (row p
// read from row a_idx[p] / a_div when a_idx is given); W: expert e's matrix at W + e N K, stored
// [N, K] (B_KN false: B_e = W[e]^T) or [K, N] (B_KN true). Grid (ceil(R / BM) + E, ceil(N / BN)).
// EPI_STORE: C [R, N] bf16. EPI_DMID: g = bf16(acc), C = bf16(g w(p)) with w(p) =
// bf16(weights[row_slot[p]]), partial[p tiles + column tile] = sum over the tile's columns of
// g * mid[p, n] (mid [R, N] bf16), in a fixed order.
template <bool B_KN, int EPI>
__device__ void moe_gemm_m(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                           const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                           unsigned short* __restrict__ C, const int* __restrict__ row_slot,
                           const float* __restrict__ weights, const unsigned short* __restrict__ mid,
                           float* __restrict__ partial) {
    int slot, ct;
    m_tile(MT_MOE_GROUP, slot, ct);
    // The job goes through the first 8 bytes of the ring (dynamic shared memory): a static
    // __shared__ array would take the CTA past 48 KiB, the most a launch gets without opting in.
    int* job = reinterpret_cast<int*>(MT_MOE_SMEM);
    find_expert(job, slot, off, E);
    __syncthreads();
    const int e = job[0];
    // Past the last expert's last tile (the grid is sized to a bound): the whole CTA leaves.
    const int row0 = e < 0 ? 0 : off[e] + job[1] * MT_MOE_BM, row_end = e < 0 ? 0 : off[e + 1];
    __syncthreads();  // every thread has the job before the ring's first copies overwrite it
    if (e < 0) return;
    const int n0 = ct * MT_MOE_BN;
    const unsigned short* We = W + (size_t)e * N * K;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp / MT_MOE_WARPS_N, wn = warp % MT_MOE_WARPS_N;
    float acc[MT_MOE_MI][MT_MOE_NI][4];
#if MT_MOE_HOIST
    ARows ar;
    a_rows_init(ar, row0, row_end, a_idx, a_div);
#endif
    gemm_mainloop<false, B_KN>(acc, (K + MT_MOE_BK - 1) / MT_MOE_BK, [&](int step, unsigned ta, unsigned tb) {
        const int k0 = step * MT_MOE_BK;
#if MT_MOE_HOIST
        a_rows_load(ar, ta, A, K, k0);
#else
        load_tile<MT_MOE_BM, MT_MOE_BK / 8>(ta, A, K, row0, row_end, k0, K, a_idx, a_div);
#endif
        if (B_KN) load_tile<MT_MOE_BK, MT_MOE_BN / 8>(tb, We, N, k0, K, n0, N, nullptr, 1);
        else load_tile<MT_MOE_BN, MT_MOE_BK / 8>(tb, We, K, n0, N, k0, K, nullptr, 1);
    });
    __syncthreads();  // the ring is free for the epilogue's reduction
    // Epilogue. Thread's elements: rows WTM wm + 16 mi + lane / 4 (+ 8), columns
    // WTN wn + 8 ni + 2 (lane % 4) (+ 1).
    float* red = reinterpret_cast<float*>(MT_MOE_SMEM);  // [WARPS_N][BM]
#pragma unroll
    for (int mi = 0; mi < MT_MOE_MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rl = wm * MT_MOE_WTM + mi * 16 + (lane >> 2) + h * 8;
            const int p = row0 + rl;
            const bool row_ok = p < row_end;
            float w = 1.0f, dot = 0.0f;
            if (EPI == MT_MOE_EPI_DMID && row_ok) w = rbf(weights[row_slot[p]]);
#pragma unroll
            for (int ni = 0; ni < MT_MOE_NI; ++ni) {
                const int n = n0 + wn * MT_MOE_WTN + ni * 8 + (lane & 3) * 2;
                if (row_ok && n < N) epi_pair<EPI>(acc[mi][ni][h * 2], acc[mi][ni][h * 2 + 1], p, n, N, w, mid, C, dot);
            }
            if (EPI == MT_MOE_EPI_DMID) {
                dot += __shfl_xor_sync(0xffffffffu, dot, 1);
                dot += __shfl_xor_sync(0xffffffffu, dot, 2);
                if ((lane & 3) == 0) red[wn * MT_MOE_BM + rl] = dot;
            }
        }
    if (EPI == MT_MOE_EPI_DMID) {
        __syncthreads();
        for (int i = threadIdx.x; i < MT_MOE_BM; i += MT_MOE_THREADS) {
            const int p = row0 + i;
            if (p < row_end) {
                float s = 0.0f;
                for (int q = 0; q < MT_MOE_WARPS_N; ++q) s += red[q * MT_MOE_BM + i];
                partial[(size_t)p * gridDim.y + ct] = s;
            }
        }
    }
}

// X W[e]^T: W stored [N, K] per expert (the forward's gate_up and down projections).
extern "C" __global__ void __launch_bounds__(MT_MOE_THREADS, MT_MOE_MIN_CTAS)
    mt_moe_gemm_nk(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                   const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                   unsigned short* __restrict__ C) {
    moe_gemm_m<false, MT_MOE_EPI_STORE>(A, a_idx, a_div, W, off, E, N, K, C, nullptr, nullptr, nullptr, nullptr);
}

// X W[e]: W stored [K, N] per expert (the backward's dX through gate_up: dgu W_gate_up[e]).
extern "C" __global__ void __launch_bounds__(MT_MOE_THREADS, MT_MOE_MIN_CTAS)
    mt_moe_gemm_kn(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                   const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                   unsigned short* __restrict__ C) {
    moe_gemm_m<true, MT_MOE_EPI_STORE>(A, a_idx, a_div, W, off, E, N, K, C, nullptr, nullptr, nullptr, nullptr);
}

// The backward through the down projection: g = dY W_down[e] (W stored [K = H, N = F]), written
// as d_mid = bf16(g w) with the routing weight's partial dots (EPI_DMID above).
extern "C" __global__ void __launch_bounds__(MT_MOE_THREADS, MT_MOE_MIN_CTAS)
    mt_moe_gemm_kn_dmid(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                        const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                        unsigned short* __restrict__ C, const int* __restrict__ row_slot,
                        const float* __restrict__ weights, const unsigned short* __restrict__ mid,
                        float* __restrict__ partial) {
    moe_gemm_m<true, MT_MOE_EPI_DMID>(A, a_idx, a_div, W, off, E, N, K, C, row_slot, weights, mid, partial);
}

// G[m, n], G[m, n + 1] += a0, a1 (the K-grouped epilogue: an f32 gradient element's one writer).
__device__ __forceinline__ void add_pair(float* __restrict__ G, long long m, int n, int N, float a0, float a1) {
    float2* g = reinterpret_cast<float2*>(G + m * N + n);
    float2 v = *g;
    v.x = v.x + a0;
    v.y = v.y + a1;
    *g = v;
}

// K-grouped weight gradient: G[e][m, n] += sum over the rows p of expert e, ascending, of
// A[p, m] B[p, n]. A [R, M] bf16 (permuted rows); B [*, N] bf16 (row p read from row
// b_idx[p] / b_div when b_idx is given); G [E, M, N] f32. Grid (ceil(M / BM) ceil(N / BN), E).
extern "C" __global__ void __launch_bounds__(MT_MOE_THREADS, MT_MOE_MIN_CTAS)
    mt_moe_gemm_wgrad(const unsigned short* __restrict__ A, const unsigned short* __restrict__ B,
                      const int* __restrict__ b_idx, int b_div, const int* __restrict__ off, int M, int N,
                      float* __restrict__ G) {
    const int e = blockIdx.y;
    const int p0 = off[e], p1 = off[e + 1];
    if (p0 == p1) return;  // no rows: nothing to add
    const int mtiles = (M + MT_MOE_BM - 1) / MT_MOE_BM;
    const int m0 = (blockIdx.x % mtiles) * MT_MOE_BM, n0 = (blockIdx.x / mtiles) * MT_MOE_BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp / MT_MOE_WARPS_N, wn = warp % MT_MOE_WARPS_N;
#if MT_MOE_HOIST
    const FastDiv bdiv = fast_div(b_div);
#else
    const int bdiv = b_div;
#endif
    float acc[MT_MOE_MI][MT_MOE_NI][4];
    gemm_mainloop<true, true>(acc, (p1 - p0 + MT_MOE_BK - 1) / MT_MOE_BK, [&](int step, unsigned ta, unsigned tb) {
        const int k0 = p0 + step * MT_MOE_BK;
        load_tile<MT_MOE_BK, MT_MOE_BM / 8>(ta, A, M, k0, p1, m0, M, nullptr, 1);
        load_tile<MT_MOE_BK, MT_MOE_BN / 8>(tb, B, N, k0, p1, n0, N, b_idx, bdiv);
    });
    float* Ge = G + (size_t)e * M * N;
#pragma unroll
    for (int mi = 0; mi < MT_MOE_MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = m0 + wm * MT_MOE_WTM + mi * 16 + (lane >> 2) + h * 8;
            if (m >= M) continue;
#pragma unroll
            for (int ni = 0; ni < MT_MOE_NI; ++ni) {
                const int n = n0 + wn * MT_MOE_WTN + ni * 8 + (lane & 3) * 2;
                if (n < N) add_pair(Ge, m, n, N, acc[mi][ni][h * 2], acc[mi][ni][h * 2 + 1]);
            }
        }
}

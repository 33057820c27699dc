// The mixture-of-experts' grouped GEMMs on Hopper (compute capability 9.0, `sm_90a`): moe.cu's
// mt_moe_gemm_nk, _kn, _kn_dmid and _wgrad (same arguments, same outputs, the same expert search
// and CTA grouping) on wgmma, the asynchronous warpgroup matrix multiply, instead of mma.sync.
// Compiled after common.cuh, hopper.cuh and moe.cu (whose expert search, CTA order and epilogue
// arithmetic it reuses) into one sm_90a CUBIN.
//
// A CTA computes a 128 x HBN tile (HBN 256 by default), k step 64, with three warpgroups:
// warpgroup 0 copies, warpgroups 1 and 2 multiply (rows 0-63 and 64-127, one m64nHBNk16 wgmma
// per k16 step, the accumulators in registers: HBN / 2 floats a thread), with setmaxnreg moving
// registers from the copier to them.
//
// The copier's 128 threads move each k step with cp.async into one of HSTAGES stages, laid out
// the way wgmma's shared-memory descriptors read them (128-byte swizzle: the 16-byte piece c of a
// 128-byte row r at piece c ^ (r mod 8), every tile 1024-byte aligned). M-grouped: A as
// [128 rows][64 k] (K-major); B as [HBN rows n][64 k] (K-major) when W is stored [N, K] ("nk"),
// as HBN / 64 blocks of [64 k][64 n] (MN-major) when it is stored [K, N] ("kn"). K-grouped (the
// weight gradients): both as blocks of [64 rows p][64 columns] (MN-major). Rows may be gathered
// (a_idx / a_div, b_idx / b_div): TMA cannot gather rows, so cp.async moves every operand. A
// copier thread waits for its own copies of a stage HLAG steps after issuing them
// (cp.async.wait_group), makes them visible to the async proxy through which wgmma reads shared
// memory (fence.proxy.async), and arrives on the stage's "full" mbarrier (128 arrivals); each
// multiplying warp arrives on its "empty" mbarrier once the wgmma that read it has completed.
//
// Epilogues as moe.cu's, from the wgmma accumulator layout: bf16 store; or g = bf16(acc),
// C = bf16(g w) and per row the sum over the tile's columns of g * mid (each row's 64 x HBN
// products live in one quad of lanes: a quad sum, no shared memory), in a fixed order; or the
// f32 gradient's read-modify-write (one writer per element). Deterministic: every sum in a fixed
// order, though not moe.cu's (the tensor cores' order within a k step, 64-row steps).

#ifndef MT_MOE_H_BN
#define MT_MOE_H_BN 256
#endif
#ifndef MT_MOE_H_STAGES
#define MT_MOE_H_STAGES 4
#endif
// k steps a copier thread keeps in flight before it waits for the oldest (at most STAGES - 2:
// the multipliers hold a stage while the next one is read).
#ifndef MT_MOE_H_LAG
#define MT_MOE_H_LAG 2
#endif
// Row tiles per CTA group (moe.cu's m_tile; 0: launch order).
#ifndef MT_MOE_H_GROUP
#define MT_MOE_H_GROUP 8
#endif
// Registers a copier and a multiplier thread keep after setmaxnreg: 128 (P + 2 C) = 384 x 168,
// what __launch_bounds__(384, 1) gives the CTA. HBN 256 takes 128 accumulators a multiplier.
#ifndef MT_MOE_H_COPY_REGS
#define MT_MOE_H_COPY_REGS (MT_MOE_H_BN == 256 ? 56 : 72)
#endif
#define MT_MOE_H_MMA_REGS ((384 * 168 / 128 - MT_MOE_H_COPY_REGS) / 2)
#define MT_MOE_H_THREADS 384

struct MoeH {
    static constexpr int BM = 128, BN = MT_MOE_H_BN, BK = 64, S = MT_MOE_H_STAGES, LAG = MT_MOE_H_LAG;
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
    static constexpr int BAR = S * STAGE;       // full[S], then empty[S]
    static constexpr int JOB = BAR + 16 * S;    // the CTA's expert and row tile
    static constexpr int ROWS = JOB + 16;       // the weight gradient's gathered B rows: [2][BK] ints
    static constexpr int SMEM = ROWS + 8 * BK + 1024;  // + 1 KiB to align the base to 1024 bytes
    static_assert(BN == 128 || BN == 256, "HBN 128 or 256");
    static_assert(LAG >= 1 && LAG <= S - 2, "the copier's lag leaves the multipliers a stage to release");
    static_assert(SMEM <= 232448, "a CTA has at most 227 KiB of shared memory");
    static_assert(MT_MOE_H_COPY_REGS % 8 == 0 && MT_MOE_H_MMA_REGS % 8 == 0, "setmaxnreg takes multiples of 8");
};
// The geometry a launcher computes on its own side (scripts/moe_bench.py), checked (moe.cu's).
#ifdef MT_MOE_EXPECT_SMEM
static_assert(MT_MOE_EXPECT_SMEM == MoeH::SMEM && MT_MOE_EXPECT_THREADS == MT_MOE_H_THREADS &&
                  MT_MOE_EXPECT_BM == MoeH::BM && MT_MOE_EXPECT_BN == MoeH::BN,
              "the launcher's GEMM geometry is not the kernels'");
#endif

// 16 bytes of a [rows][64] bf16 block at row r, piece c (of 8), 128-byte swizzled.
__device__ __forceinline__ unsigned sw128_at(int r, int c) { return (unsigned)(r * 128 + ((c ^ (r & 7)) << 4)); }

// MN-major copies of a [BK rows][W columns] slab (W = 128 or 256: W / 64 blocks of [BK][64]) at
// sb from rows src_row(kr) of a row-major [*, ld] matrix (-1: zeros), columns c0 + 8 piece
// (zeros past cmax). Copier thread t: piece t % (W / 8) of rows t / (W / 8) + (1024 / W) i.
template <int W, class SrcRow>
__device__ __forceinline__ void moe_h_copy_mn(int t, unsigned sb, const unsigned short* __restrict__ src, long long ld,
                                              int c0, int cmax, SrcRow src_row) {
    constexpr int PIECES = W / 8, ROWS = 128 / PIECES;  // pieces of a row; rows a pass
    const int p = t % PIECES, kr0 = t / PIECES, col = c0 + p * 8;
    const bool cin = col < cmax;
    const unsigned blk = (p >> 3) * (MoeH::BK * 128);
    // Unrolled by 4 only: the copier has few registers (MT_MOE_H_COPY_REGS).
#pragma unroll 4
    for (int i = 0; i < MoeH::BK / ROWS; ++i) {
        const int kr = kr0 + ROWS * i, row = src_row(kr);
        const bool ok = cin && row >= 0;
        cp_async16(sb + blk + sw128_at(kr, p & 7), ok ? src + (long long)row * ld + col : src, ok ? 16 : 0);
    }
}

// M-grouped copier thread t (0..127): its copies of k step k0 into stage (sa: A, sb: B). A: piece
// t % 8 of rows t / 8 + 16 i, from source rows asrc[i] (-1: zeros). B (nk): piece t % 8 of rows n
// t / 8 + 16 i; (kn): moe_h_copy_mn of W's rows k0... Past N or K: zeros.
template <bool B_KN>
__device__ __forceinline__ void moe_h_copy(int t, unsigned sa, unsigned sb, const int* asrc,
                                           const unsigned short* __restrict__ A, const unsigned short* __restrict__ We,
                                           int N, int K, int n0, int k0) {
    using L = MoeH;
    const int c = t & 7, r0 = t >> 3, col = k0 + c * 8;
    const bool kin = col < K;
    // Rows r0 + 16 i: the swizzled piece is the same for every i (16 i mod 8 = 0).
    const unsigned pa = sw128_at(r0, c);
#pragma unroll
    for (int i = 0; i < L::BM / 16; ++i) {
        const bool ok = asrc[i] >= 0 && kin;
        cp_async16(sa + pa + i * 16 * 128, ok ? A + (long long)asrc[i] * K + col : A, ok ? 16 : 0);
    }
    if (!B_KN) {
        const unsigned short* g = We + (long long)(n0 + r0) * K + col;
        const long long step = 16ll * K;
#pragma unroll 4
        for (int i = 0; i < L::BN / 16; ++i) {
            const bool ok = n0 + r0 + 16 * i < N && kin;
            cp_async16(sb + pa + i * 16 * 128, ok ? g : We, ok ? 16 : 0);
            g += step;
        }
    } else {
        moe_h_copy_mn<L::BN>(t, sb, We, N, n0, N, [&](int kr) { return k0 + kr < K ? k0 + kr : -1; });
    }
}

// The copier's loop over `steps` k steps: copy(j, stage A, stage B) issues step j's copies; each
// stage waits for its "empty" barrier before it is refilled and arrives on its "full" barrier
// LAG steps later, its copies landed and fenced into the async proxy. `j0`: the steps this CTA
// ran through the ring before (a persistent CTA's earlier tiles), which place step j in it.
template <class Copy>
__device__ __forceinline__ void moe_h_copier(unsigned base, unsigned full, unsigned empty, int steps, Copy copy,
                                             int j0 = 0) {
    using L = MoeH;
    for (int j = 0; j < steps + L::LAG; ++j) {
        if (j < steps) {
            const int jj = j0 + j, s = jj % L::S;
            if (jj >= L::S) mbar_wait(empty + 8 * s, ((jj / L::S) - 1) & 1);
            copy(j, base + s * L::STAGE, base + s * L::STAGE + L::A_BYTES);
        }
        cp_async_commit();  // (empty past the last step: the lag counts groups)
        if (j >= L::LAG) {
            cp_async_wait<L::LAG>();  // this thread's copies of step j - LAG have landed
            fence_async_shared();
            mbar_arrive(full + 8 * ((j0 + j - L::LAG) % L::S));
        }
    }
}

// A multiplying warpgroup's loop over `steps` k steps: acc (64 x BN, zeroed here) += its 64 rows
// of each stage's A times its B. TA / TB: A / B MN-major (1) or K-major (0). Warpgroup w reads
// rows 64 w.. of A: K-major rows at 128 bytes each, or MN-major the w-th block of 64 columns.
// `j0` as the copier's. RELEASE_LAST: the last step's stage is released too (a persistent CTA's
// copier refills it for its next tile).
template <int TA, int TB, bool RELEASE_LAST = false>
__device__ __forceinline__ void moe_h_mma(float* acc, unsigned base, unsigned full, unsigned empty, int steps, int w,
                                          int j0 = 0) {
    using L = MoeH;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < L::BN / 2; ++i) acc[i] = 0.0f;
    for (int j = 0; j < steps; ++j) {
        const int s = (j0 + j) % L::S;
        mbar_wait(full + 8 * s, ((j0 + j) / L::S) & 1);
        const unsigned sa = base + s * L::STAGE + w * 64 * 128, sb = base + s * L::STAGE + L::A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < L::BK / 16; ++kk) {
            const unsigned long long da =
                TA ? desc_sw128(sa + kk * 2048, L::BK * 128, 1024) : desc_sw128(sa + kk * 32, 16, 1024);
            const unsigned long long db =
                TB ? desc_sw128(sb + kk * 2048, L::BK * 128, 1024) : desc_sw128(sb + kk * 32, 16, 1024);
            wgmma_ss<L::BN, TA, TB>(acc, da, db, 1);
        }
        wg_commit();
        wg_wait<1>();  // step j - 1's products are done: its stage may be refilled
        if (j > 0 && lane == 0) mbar_arrive(empty + 8 * ((j0 + j - 1) % L::S));
    }
    wg_wait<0>();
    fence_regs<L::BN / 2>(acc);
    if (RELEASE_LAST && steps > 0 && lane == 0) mbar_arrive(empty + 8 * ((j0 + steps - 1) % L::S));
}

// The CTA's shared memory (1024-byte aligned base) and barriers, initialised by thread 0 (the
// caller synchronises before their first use).
struct MoeHSmem {
    unsigned base, full, empty;
    unsigned char* ptr;  // the base as a generic pointer
};
__device__ __forceinline__ MoeHSmem moe_h_smem() {
    using L = MoeH;
    const unsigned raw = smem_addr(MT_MOE_SMEM), base = (raw + 1023u) & ~1023u;
    MoeHSmem m{base, base + L::BAR, base + L::BAR + 8 * L::S, MT_MOE_SMEM + (base - raw)};
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < L::S; ++s) {
            mbar_init(m.full + 8 * s, 128);  // every copier thread
            mbar_init(m.empty + 8 * s, 8);   // lane 0 of each multiplying warp
        }
        fence_barrier_init();
    }
    return m;
}

// M-grouped as moe_gemm_m (moe.cu) on wgmma. Grid (ceil(R / 128) + E, ceil(N / HBN)), 384 threads,
// MoeH::SMEM bytes of dynamic shared memory.
template <bool B_KN, int EPI>
__device__ void moe_hgemm(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                          const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                          unsigned short* __restrict__ C, const int* __restrict__ row_slot,
                          const float* __restrict__ weights, const unsigned short* __restrict__ mid,
                          float* __restrict__ partial) {
    using L = MoeH;
    const MoeHSmem sm = moe_h_smem();
    int* job = reinterpret_cast<int*>(sm.ptr + L::JOB);
    const int tid = threadIdx.x;
    int slot, ct;
    m_tile(MT_MOE_H_GROUP, slot, ct);
    find_expert_warp<L::BM>(job, slot, off, E);
    __syncthreads();
    const int e = job[0];
    if (e < 0) return;  // past the last expert's last tile (the grid is sized to a bound)
    const int row0 = off[e] + job[1] * L::BM, row_end = off[e + 1], n0 = ct * L::BN;
    const int steps = (K + L::BK - 1) / L::BK;
    const unsigned short* We = W + (size_t)e * N * K;

    if (tid < 128) {
        setmaxnreg_dec<MT_MOE_H_COPY_REGS>();
        int asrc[L::BM / 16];
#pragma unroll
        for (int i = 0; i < L::BM / 16; ++i) {
            const int row = row0 + (tid >> 3) + 16 * i;
            asrc[i] = row < row_end ? (a_idx ? a_idx[row] / a_div : row) : -1;
        }
        moe_h_copier(sm.base, sm.full, sm.empty, steps, [&](int j, unsigned sa, unsigned sb) {
            moe_h_copy<B_KN>(tid, sa, sb, asrc, A, We, N, K, n0, j * L::BK);
        });
        return;
    }
    setmaxnreg_inc<MT_MOE_H_MMA_REGS>();
    // Multiplier warpgroup w: rows 64 w .. 64 w + 63 of the tile; this thread's rows
    // 64 w + 16 wq + lane / 4 + 8 i, columns 8 jb + 2 (lane % 4) + h at acc[4 jb + 2 i + h].
    const int w = (tid >> 7) - 1, wq = (tid >> 5) & 3, lane = tid & 31, tq = lane & 3;
    float acc[L::BN / 2];
    moe_h_mma<0, B_KN ? 1 : 0>(acc, sm.base, sm.full, sm.empty, steps, w);

    // Epilogue.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int p = row0 + 64 * w + 16 * wq + (lane >> 2) + 8 * i;
        const bool row_ok = p < row_end;
        float wt = 1.0f, dot = 0.0f;
        if (EPI == MT_MOE_EPI_DMID && row_ok) wt = rbf(weights[row_slot[p]]);
#pragma unroll
        for (int jb = 0; jb < L::BN / 8; ++jb) {
            const int n = n0 + 8 * jb + 2 * tq;
            if (row_ok && n < N) epi_pair<EPI>(acc[4 * jb + 2 * i], acc[4 * jb + 2 * i + 1], p, n, N, wt, mid, C, dot);
        }
        if (EPI == MT_MOE_EPI_DMID) {
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            dot += __shfl_xor_sync(0xffffffffu, dot, 2);
            if (tq == 0 && row_ok) partial[(size_t)p * gridDim.y + ct] = dot;
        }
    }
}

// X W[e]^T: W stored [N, K] per expert (moe.cu's mt_moe_gemm_nk).
extern "C" __global__ void __launch_bounds__(MT_MOE_H_THREADS, 1)
    mt_moe_hgemm_nk(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                    const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                    unsigned short* __restrict__ C) {
    moe_hgemm<false, MT_MOE_EPI_STORE>(A, a_idx, a_div, W, off, E, N, K, C, nullptr, nullptr, nullptr, nullptr);
}

// X W[e]: W stored [K, N] per expert (moe.cu's mt_moe_gemm_kn).
extern "C" __global__ void __launch_bounds__(MT_MOE_H_THREADS, 1)
    mt_moe_hgemm_kn(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                    const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                    unsigned short* __restrict__ C) {
    moe_hgemm<true, MT_MOE_EPI_STORE>(A, a_idx, a_div, W, off, E, N, K, C, nullptr, nullptr, nullptr, nullptr);
}

// The down projection's backward (moe.cu's mt_moe_gemm_kn_dmid).
extern "C" __global__ void __launch_bounds__(MT_MOE_H_THREADS, 1)
    mt_moe_hgemm_kn_dmid(const unsigned short* __restrict__ A, const int* __restrict__ a_idx, int a_div,
                         const unsigned short* __restrict__ W, const int* __restrict__ off, int E, int N, int K,
                         unsigned short* __restrict__ C, const int* __restrict__ row_slot,
                         const float* __restrict__ weights, const unsigned short* __restrict__ mid,
                         float* __restrict__ partial) {
    moe_hgemm<true, MT_MOE_EPI_DMID>(A, a_idx, a_div, W, off, E, N, K, C, row_slot, weights, mid, partial);
}

// K-grouped weight gradient as moe.cu's mt_moe_gemm_wgrad on wgmma: G[e][m, n] += sum over the
// rows p of expert e of A[p, m] B[p, n] (B's row p read from row b_idx[p] / b_div when b_idx is
// given), f32, one CTA per 128 x HBN tile of G and expert, the rows in steps of 64 in ascending
// order (the products' own order within a step is the tensor cores'). Both operands arrive
// MN-major (rows of p, m or n contiguous). The copier finds each step's gathered B rows one step
// ahead (threads 0-63, one row each) and shares them through shared memory (named barrier 1, the
// copier warpgroup). Grid (ceil(M / 128) ceil(N / HBN), E), 384 threads, MoeH::SMEM bytes.
//
// MT_MOE_H_PERSIST=P (a variant, for measurement; P is the launcher's): grid (P, E), CTA x of
// expert e takes the tiles x, x + P, ... of its expert one after another, its copier filling the
// ring for the next tile while the multipliers add the last one into G (with a CTA a tile, that
// read-modify-write overlaps nothing: one CTA fills an SM).
#ifndef MT_MOE_H_PERSIST
extern "C" __global__ void __launch_bounds__(MT_MOE_H_THREADS, 1)
    mt_moe_hgemm_wgrad(const unsigned short* __restrict__ A, const unsigned short* __restrict__ B,
                       const int* __restrict__ b_idx, int b_div, const int* __restrict__ off, int M, int N,
                       float* __restrict__ G) {
    using L = MoeH;
    const int e = blockIdx.y;
    const int p0 = off[e], p1 = off[e + 1];
    if (p0 == p1) return;  // no rows: nothing to add
    const MoeHSmem sm = moe_h_smem();
    __syncthreads();
    const int mtiles = (M + L::BM - 1) / L::BM;
    const int m0 = (blockIdx.x % mtiles) * L::BM, n0 = (blockIdx.x / mtiles) * L::BN;
    const int steps = (p1 - p0 + L::BK - 1) / L::BK;
    const int tid = threadIdx.x;

    if (tid < 128) {
        setmaxnreg_dec<MT_MOE_H_COPY_REGS>();
        int* rows = reinterpret_cast<int*>(sm.ptr + L::ROWS);  // [2][BK]: step j's in rows[j % 2]
        const FastDiv fd = fast_div(b_div);
        // Threads 0-63: the source of row p (or -1 past the expert's rows).
        auto source = [&](int p) { return p < p1 ? (b_idx ? quot(b_idx[p], fd) : p) : -1; };
        int next = tid < L::BK ? source(p0 + tid) : 0;
        moe_h_copier(sm.base, sm.full, sm.empty, steps, [&](int j, unsigned sa, unsigned sb) {
            const int k0 = p0 + j * L::BK;
            int* rj = rows + (j & 1) * L::BK;
            if (tid < L::BK) {
                rj[tid] = next;
                if (j + 1 < steps) next = source(k0 + L::BK + tid);  // lands while this step copies
            }
            named_sync(1, 128);  // rj is written; everyone is done with step j - 2's
            moe_h_copy_mn<L::BM>(tid, sa, A, M, m0, M, [&](int kr) { return k0 + kr < p1 ? k0 + kr : -1; });
            moe_h_copy_mn<L::BN>(tid, sb, B, N, n0, N, [&](int kr) { return rj[kr]; });
        });
        return;
    }
    setmaxnreg_inc<MT_MOE_H_MMA_REGS>();
    const int w = (tid >> 7) - 1, wq = (tid >> 5) & 3, lane = tid & 31, tq = lane & 3;
    float acc[L::BN / 2];
    moe_h_mma<1, 1>(acc, sm.base, sm.full, sm.empty, steps, w);
    float* Ge = G + (size_t)e * M * N;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int m = m0 + 64 * w + 16 * wq + (lane >> 2) + 8 * i;
        if (m >= M) continue;
#pragma unroll
        for (int jb = 0; jb < L::BN / 8; ++jb) {
            const int n = n0 + 8 * jb + 2 * tq;
            if (n < N) add_pair(Ge, m, n, N, acc[4 * jb + 2 * i], acc[4 * jb + 2 * i + 1]);
        }
    }
}
#else
extern "C" __global__ void __launch_bounds__(MT_MOE_H_THREADS, 1)
    mt_moe_hgemm_wgrad(const unsigned short* __restrict__ A, const unsigned short* __restrict__ B,
                       const int* __restrict__ b_idx, int b_div, const int* __restrict__ off, int M, int N,
                       float* __restrict__ G) {
    using L = MoeH;
    const int e = blockIdx.y;
    const int p0 = off[e], p1 = off[e + 1];
    if (p0 == p1) return;  // no rows: nothing to add
    const MoeHSmem sm = moe_h_smem();
    __syncthreads();
    const int mtiles = (M + L::BM - 1) / L::BM;
    const int steps = (p1 - p0 + L::BK - 1) / L::BK;
    const int tid = threadIdx.x;
    // This CTA's tiles of its expert: blockIdx.x, + gridDim.x, ...; `j0` the ring's steps before each.
    const int tiles = mtiles * ((N + L::BN - 1) / L::BN);
#define MT_MOE_H_TILES for (int t = blockIdx.x, j0 = 0; t < tiles; t += gridDim.x, j0 += steps)

    if (tid < 128) {
        setmaxnreg_dec<MT_MOE_H_COPY_REGS>();
        int* rows = reinterpret_cast<int*>(sm.ptr + L::ROWS);  // [2][BK]: ring step jj's in rows[jj % 2]
        const FastDiv fd = fast_div(b_div);
        // Threads 0-63: the source of row p (or -1 past the expert's rows).
        auto source = [&](int p) { return p < p1 ? (b_idx ? quot(b_idx[p], fd) : p) : -1; };
        int next = tid < L::BK ? source(p0 + tid) : 0;
        MT_MOE_H_TILES {
            const int m0 = (t % mtiles) * L::BM, n0 = (t / mtiles) * L::BN;
            moe_h_copier(
                sm.base, sm.full, sm.empty, steps,
                [&](int j, unsigned sa, unsigned sb) {
                    const int k0 = p0 + j * L::BK;
                    int* rj = rows + ((j0 + j) & 1) * L::BK;
                    if (tid < L::BK) {
                        rj[tid] = next;
                        // The next step's rows land while this step copies; after the last, the
                        // next tile's first (every tile of the expert walks the same rows).
                        next = source(j + 1 < steps ? k0 + L::BK + tid : p0 + tid);
                    }
                    named_sync(1, 128);  // rj is written; everyone is done with step j - 2's
                    moe_h_copy_mn<L::BM>(tid, sa, A, M, m0, M, [&](int kr) { return k0 + kr < p1 ? k0 + kr : -1; });
                    moe_h_copy_mn<L::BN>(tid, sb, B, N, n0, N, [&](int kr) { return rj[kr]; });
                },
                j0);
        }
        return;
    }
    setmaxnreg_inc<MT_MOE_H_MMA_REGS>();
    const int w = (tid >> 7) - 1, wq = (tid >> 5) & 3, lane = tid & 31, tq = lane & 3;
    float acc[L::BN / 2];
    MT_MOE_H_TILES {
        const int m0 = (t % mtiles) * L::BM, n0 = (t / mtiles) * L::BN;
        moe_h_mma<1, 1, true>(acc, sm.base, sm.full, sm.empty, steps, w, j0);
        float* Ge = G + (size_t)e * M * N;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int m = m0 + 64 * w + 16 * wq + (lane >> 2) + 8 * i;
            if (m >= M) continue;
#pragma unroll
            for (int jb = 0; jb < L::BN / 8; ++jb) {
                const int n = n0 + 8 * jb + 2 * tq;
                if (n < N) add_pair(Ge, m, n, N, acc[4 * jb + 2 * i], acc[4 * jb + 2 * i + 1]);
            }
        }
    }
#undef MT_MOE_H_TILES
}
#endif

// Flash attention on Hopper (compute capability 9.0, `sm_90a`): the same operation, layouts and
// outputs as flash_attn.cu (causal, grouped-query, packed documents, head dims 64 and 128, LSE
// saved, deterministic backward), rebuilt around what the H100/H200 has and the Ampere-style
// kernels cannot use:
//   - wgmma: asynchronous warpgroup matrix multiply (64 rows per warpgroup), operands read from
//     shared memory through descriptors (or A from registers), accumulators in registers;
//   - TMA: bulk tensor copies global -> shared (`cp.async.bulk.tensor`), 128-byte swizzled, their
//     completion counted on an mbarrier; a bulk reduce-add shared -> global for the fp32 dQ;
//   - warp specialisation: warpgroup 0 only moves data (a producer warp issues the copies; in the
//     backward a second warp adds the dQ partials to global memory), warpgroups 1 and 2 compute,
//     with `setmaxnreg` moving registers from the producer to the consumers.
// Compiled by NVRTC for `sm_90a` after common.cuh and flash_attn.cu (whose helpers and
// `mt_flash_bwd_dot` it reuses) into a CUBIN, so ptxas's warnings are seen at compile time.
// Written from the PTX ISA and the FlashAttention-2/3 papers' algorithms, not from their code.
//
// Layouts (as flash_attn.cu): Q, O, dO [B, T, NH, HD] bf16; K, V, dK, dV [B, T, NKV, HD] bf16;
// LSE, D [B, NH, T] f32; seg_lo / seg_hi [B, T] int (optional). The host describes Q, K, V and
// dO to the TMA as 4-d tensors {HD, heads, T, B} (innermost first) with a box of {64, 1, rows, 1}
// and 128-byte swizzle, so a tile of `rows` x HD lands in shared memory as HD / 64 "chunks" of
// rows x 64 elements, each row 128 bytes, the 16-byte piece c of row r stored at piece
// c ^ (r mod 8). That is the canonical 128B-swizzled layout wgmma reads both as K-major (the
// contraction along the row: Q and K in S = Q K^T) and as MN-major (the contraction down the
// rows: V in O = P V, dO and Q in dV / dK, K in dQ), by descriptor alone, with no transposes.
//
// Forward (mt_hfa_fwd_hdN): a CTA takes 128 query rows of one head (64 per consumer warpgroup)
//   and walks the key tiles of 128 from the diagonal down; K and V tiles stream through a
//   2-stage ring. Each consumer overlaps its softmax of tile n with the tensor cores' P V of tile
//   n - 1 (S_n = Q K_n^T and O += P_{n-1} V_{n-1} issued back to back, then waited one at a time).
//   Online softmax in f32 in the log2 domain; P rounded to bf16 (what multiplies V). Writes O and
//   LSE.
// Backward (mt_hfa_bwd_hdN), fused: a CTA takes 128 keys of one KV head (64 per consumer) and
//   walks every query tile of 64 that sees them, for each query head of the group, the last tile
//   first: S^T = K Q^T and dP^T = V dO^T, P^T = exp(S^T - LSE), dS^T = P^T (dP^T - D); dV += P^T
//   dO and dK += dS^T Q stay in registers for the whole walk; dS^T goes through shared memory to
//   dQ_partial = dS K (each consumer half of the head dim), which the dQ warp adds into an fp32
//   buffer with one bulk reduce per tile. Deterministic (the default): the adds into each dQ tile
//   happen in key-block order, a per-tile counter saying whose turn it is; otherwise in arrival
//   order. mt_hfa_dq_convert_hdN then writes dQ = scale * buffer as bf16.
// Scheduling: every CTA takes its tile from a global counter when it starts (the host zeroes
//   it), longest work first (the last query tiles forward; the first key blocks backward), so a
//   CTA only ever waits for CTAs that started before it: the ordered dQ adds cannot deadlock.
//
// GPT-OSS (the `_ext` kernels, the plain ones' code with two more arguments): a per-head sink
//   logit joins the forward's running max and sum once per row after the last tile (so O and LSE
//   include it; the backward's P needs nothing new, and the sinks' gradient, -sum_rows P_sink D,
//   is flash_attn.cu's mt_flash_sink_grad); a sliding window w raises each row's lowest key to
//   i - w + 1: it bounds the forward's lowest tile, the backward's last query tile and the dQ
//   turn's first key block, and the tiles it cuts take the per-element test documents use. The
//   plain kernels are the template's EXT = false instance: the same machine code as before.

#define MT_HFA_THREADS 384
#define MT_HFA_BM 128  // forward: query rows per CTA
#define MT_HFA_BN 128  // forward: keys per tile; backward: keys per CTA
#define MT_HFA_BQ 64   // backward: query rows per tile

// The Hopper PTX wrappers (mbarriers, TMA, wgmma, setmaxnreg): hopper.cuh, compiled before this
// file.

// The A operand (bf16 pairs) of k-step kk from an f32 accumulator of N columns: columns
// [16 kk, 16 kk + 16) are its 8-column blocks 2 kk and 2 kk + 1.
template <int N>
__device__ __forceinline__ void acc_to_frag(unsigned* a, const float* c) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        a[4 * kk + 0] = pack_bf16(c[8 * kk + 0], c[8 * kk + 1]);
        a[4 * kk + 1] = pack_bf16(c[8 * kk + 2], c[8 * kk + 3]);
        a[4 * kk + 2] = pack_bf16(c[8 * kk + 4], c[8 * kk + 5]);
        a[4 * kk + 3] = pack_bf16(c[8 * kk + 6], c[8 * kk + 7]);
    }
}

template <int N>
__device__ __forceinline__ void zero(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = 0.0f;
}

// The dynamic shared memory of every kernel here (the CPU emulator, kernels/emu, brings its own).
#ifndef MT_EMU
extern __shared__ __align__(1024) unsigned char mt_hfa_smem[];
#endif

// The dynamic shared memory's first 1024-byte boundary (the launcher asks for 1 KiB more; the
// kernels have no static shared memory, which would be padded to the array's alignment).
__device__ __forceinline__ unsigned hfa_smem_base() { return (smem_addr(mt_hfa_smem) + 1023u) & ~1023u; }

// The lowest key query `i` sees: `doc_lo` (its document's first position, 0 without documents),
// raised with a sliding window (EXT and window > 0) to i - window + 1. Without EXT, `doc_lo`.
template <bool EXT>
__device__ __forceinline__ int hfa_lowest_key(int doc_lo, int i, int window) {
    return EXT && window > 0 ? max(doc_lo, i - window + 1) : doc_lo;
}

// ---------------------------------------------------------------------------------------------
// Forward.

#ifndef MT_HFA_FWD_STAGES
#define MT_HFA_FWD_STAGES 3
#endif

template <int HD>
struct HfaFwd {
    static constexpr int BM = MT_HFA_BM, BN = MT_HFA_BN, STAGES = MT_HFA_FWD_STAGES, NCH = HD / 64;
    static constexpr int TQ = BM * HD * 2, TK = BN * HD * 2;  // tile bytes
    static constexpr int Q = 0, K = TQ, V = K + STAGES * TK, BAR = V + STAGES * TK;
    // barriers: Q, K full [STAGES], V full [STAGES], K empty [STAGES], V empty [STAGES]; then the
    // CTA's tile
    static constexpr int TILE = BAR + 8 * (1 + 4 * STAGES);
    static constexpr int SMEM = TILE + 8 + 1024;
    static_assert(SMEM <= 232448, "a CTA has at most 227 KiB of shared memory");
};

// EXT: the GPT-OSS variant, with `sinks` ([NH] f32 logits or null) and `window` (0: none); without
// it both are constants (null, 0) and the code is the plain kernel's.
template <int HD, bool EXT>
__device__ __forceinline__ void hfa_fwd(const MtTmaMap* tmq, const MtTmaMap* tmk, const MtTmaMap* tmv,
                                        unsigned short* __restrict__ O, float* __restrict__ LSE,
                                        const int* __restrict__ seg_lo, const float* __restrict__ sinks, int window,
                                        int T, int B, int NH, int NKV, float scale_log2, int* counter) {
    using L = HfaFwd<HD>;
    constexpr int BM = L::BM, BN = L::BN, S = L::STAGES, NCH = L::NCH;
    const unsigned base = hfa_smem_base();
    int* s_tile = (int*)(mt_hfa_smem + (base + L::TILE - smem_addr(mt_hfa_smem)));
    const unsigned sQ = base + L::Q, sK = base + L::K, sV = base + L::V;
    // K and V have barriers of their own: a K stage is free once its S = Q K^T is done, a V stage
    // only once P V is, a tile later.
    const unsigned barQ = base + L::BAR, barK = barQ + 8, barV = barK + 8 * S, barEK = barV + 8 * S,
                   barEV = barEK + 8 * S;
    const int tid = threadIdx.x;
    if (tid == 0) {
        mbar_init(barQ, 1);
#pragma unroll
        for (int s = 0; s < S; ++s) {
            mbar_init(barK + 8 * s, 1);
            mbar_init(barV + 8 * s, 1);
            mbar_init(barEK + 8 * s, 8);  // lane 0 of each consumer warp
            mbar_init(barEV + 8 * s, 8);
        }
        fence_barrier_init();
        *s_tile = atomicAdd(counter, 1);
    }
    __syncthreads();

    // Tile -> (query tile, head, batch): the last query tiles (the most keys) first, the heads of
    // one KV group next to each other (they read the same K and V).
    const int nqt = (T + BM - 1) / BM;
    const int t = *s_tile, hb = t % (NH * B);
    const int qt = nqt - 1 - t / (NH * B), h = hb % NH, b = hb / NH;
    const int kvh = h / (NH / NKV), q0 = qt * BM;
    const int* seg = seg_lo ? seg_lo + (long long)b * T : nullptr;
    const int q_last = min(q0 + BM, T) - 1;
    // The lowest tile: that of the lowest key any row of the CTA sees (its first row's: the
    // document's start or, with a window, the window's edge if higher). Tiles below it are not
    // walked: O(t w) with a window.
    const int jt_hi = q_last / BN;
    const int jt_lo = EXT ? hfa_lowest_key<EXT>(seg ? seg[q0] : 0, q0, window) / BN : (seg ? seg[q0] / BN : 0);
    const int ntiles = jt_hi - jt_lo + 1;
    const int wg = tid >> 7;

    if (wg == 0) {
        setmaxnreg_dec<24>();
        if (tid == 0) {
            mbar_expect_tx(barQ, L::TQ);
#pragma unroll
            for (int c = 0; c < NCH; ++c) tma_load_4d(sQ + c * BM * 128, tmq, c * 64, h, q0, b, barQ);
            // In the order the consumers need them: K of tile n, then V of tile n - 1.
            for (int n = 0; n <= ntiles; ++n) {
                if (n < ntiles) {
                    const int s = n % S, j0 = (jt_hi - n) * BN;
                    if (n >= S) mbar_wait(barEK + 8 * s, ((n / S) - 1) & 1);
                    mbar_expect_tx(barK + 8 * s, L::TK);
#pragma unroll
                    for (int c = 0; c < NCH; ++c)
                        tma_load_4d(sK + s * L::TK + c * BN * 128, tmk, c * 64, kvh, j0, b, barK + 8 * s);
                }
                if (n > 0) {
                    const int m = n - 1, s = m % S, j0 = (jt_hi - m) * BN;
                    if (m >= S) mbar_wait(barEV + 8 * s, ((m / S) - 1) & 1);
                    mbar_expect_tx(barV + 8 * s, L::TK);
#pragma unroll
                    for (int c = 0; c < NCH; ++c)
                        tma_load_4d(sV + s * L::TK + c * BN * 128, tmv, c * 64, kvh, j0, b, barV + 8 * s);
                }
            }
        }
        return;
    }
    setmaxnreg_inc<240>();

    // Consumer warpgroup w: rows q0 + 64 w .. + 63; this thread's rows r[i] = row0 + 16 wq + g + 8 i.
    const int w = wg - 1, lt = tid & 127, wq = lt >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int row0 = q0 + 64 * w;
    int r[2], rseg[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        r[i] = row0 + 16 * wq + g + 8 * i;
        rseg[i] = hfa_lowest_key<EXT>(seg ? seg[min(r[i], T - 1)] : 0, r[i], window);  // its lowest key
    }
    // The highest of the warpgroup's rows' lowest keys: a tile starting below it needs the mask.
    const int r_last = min(row0 + 63, T - 1);
    const int seg_max = hfa_lowest_key<EXT>(seg ? seg[r_last] : 0, r_last, window);
    float m[2] = {MT_NEG_INF, MT_NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[HD / 2], s[BN / 2];
    unsigned p[BN / 4];
    zero<HD / 2>(o);
    const unsigned qa = sQ + 64 * w * 128;  // this warpgroup's 64 rows of each Q chunk

    auto issue_qk = [&](int st) {
        fence_regs<BN / 2>(s);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const unsigned off = (kk & 3) * 32;
            const unsigned long long da = desc_sw128(qa + (kk >> 2) * BM * 128 + off, 16, 1024);
            const unsigned long long db = desc_sw128(sK + st * L::TK + (kk >> 2) * BN * 128 + off, 16, 1024);
            wgmma_ss<BN, 0, 0>(s, da, db, kk > 0);
        }
        wg_commit();
    };
    auto issue_pv = [&](int st) {
        fence_regs<HD / 2>(o);
        fence_regs<BN / 4>(p);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned long long db = desc_sw128(sV + st * L::TK + kk * 2048, BN * 128, 1024);
            wgmma_rs<HD, 1>(o, &p[4 * kk], db, 1);
        }
        wg_commit();
    };
    // Masks tile jt's scores, updates the running max and sum, turns s into probabilities (f32)
    // and returns each row's rescale factor for O.
    auto softmax_as = [&](int jt, float* alpha, const bool masked) {
        const int j0 = jt * BN;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = MT_NEG_INF;
#pragma unroll
            for (int jb = 0; jb < BN / 8; ++jb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[4 * jb + 2 * i + e];
                    if (masked) {
                        const int key = j0 + 8 * jb + 2 * tq + e;
                        if (key > r[i] || key < rseg[i]) x = MT_NEG_INF;
                        s[4 * jb + 2 * i + e] = x;
                    }
                    mx = fmaxf(mx, x);
                }
            mx = quad_max(mx) * scale_log2;
            const float m_new = fmaxf(m[i], mx);
            const float m_use = m_new == MT_NEG_INF ? 0.0f : m_new;
            alpha[i] = fast_exp2(m[i] - m_use);
            m[i] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int jb = 0; jb < BN / 8; ++jb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = fast_exp2(fmaf(s[4 * jb + 2 * i + e], scale_log2, -m_use));
                    s[4 * jb + 2 * i + e] = pv;
                    sum += pv;
                }
            l[i] = l[i] * alpha[i] + sum;
        }
    };
    // Only the tiles on the diagonal or before a document's start need the mask. Two call sites
    // with constant flags give two bodies; one body with a run-time flag was if-converted by the
    // compiler into compares and selects on every element of every tile.
    auto softmax = [&](int jt, float* alpha) {
        const int j0 = jt * BN;
        if (j0 + BN - 1 > row0 || j0 < seg_max) softmax_as(jt, alpha, true);
        else softmax_as(jt, alpha, false);
    };

    // Ping-pong: the two consumers take turns issuing their products (named barriers 3 and 4),
    // so one's softmax runs while the other's products keep the tensor cores busy. Turns: the
    // first QK^T, one per later tile, the last PV; consumer 1 gives consumer 0 the first turn and
    // skips its own last hand-back.
#ifdef MT_HFA_PINGPONG
    if (w == 1) named_arrive(3, 256);
    auto turn = [&]() { named_sync(3 + w, 256); };
    auto pass = [&](bool last) {
        if (!(last && w == 1)) named_arrive(4 - w, 256);
    };
#else
    auto turn = [&]() {};
    auto pass = [&](bool) {};
#endif
    mbar_wait(barQ, 0);
    float alpha[2];
    mbar_wait(barK, 0);
    turn();
    issue_qk(0);
    pass(false);
    wg_wait<0>();
    fence_regs<BN / 2>(s);
    if (lane == 0) mbar_arrive(barEK);
    softmax(jt_hi, alpha);
    acc_to_frag<BN>(p, s);
    for (int n = 1; n < ntiles; ++n) {
        const int sc = n % S, sp = (n - 1) % S;
        mbar_wait(barK + 8 * sc, (n / S) & 1);
        mbar_wait(barV + 8 * sp, ((n - 1) / S) & 1);
        turn();
        issue_qk(sc);
        issue_pv(sp);
        pass(false);
        wg_wait<1>();
        fence_regs<BN / 2>(s);
        if (lane == 0) mbar_arrive(barEK + 8 * sc);
        softmax(jt_hi - n, alpha);
        wg_wait<0>();
        fence_regs<HD / 2>(o);
        fence_regs<BN / 4>(p);
        if (lane == 0) mbar_arrive(barEV + 8 * sp);
        // Once the running maxima settle, most tiles leave them unchanged: skip the rescale where
        // no row of the warp moved (alpha = 1 exactly).
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int jb = 0; jb < HD / 8; ++jb)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    o[4 * jb + 2 * i] *= alpha[i];
                    o[4 * jb + 2 * i + 1] *= alpha[i];
                }
        }
        acc_to_frag<BN>(p, s);
    }
    const int sl = (ntiles - 1) % S;
    mbar_wait(barV + 8 * sl, ((ntiles - 1) / S) & 1);
    turn();
    issue_pv(sl);
    pass(true);
    wg_wait<0>();
    fence_regs<HD / 2>(o);

    if (EXT && sinks) {
        // The sink joins each row once, as one more column of the online softmax: the max becomes
        // max(m, sink), the sum and O are rescaled to it, and the sum gains e^{sink - max} (in
        // the quad's first thread: the epilogue adds the quad's partial sums).
        const float sink2 = sinks[h] * MT_LOG2E;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float m_f = fmaxf(m[i], sink2);
            const float m_use = m_f == MT_NEG_INF ? 0.0f : m_f;
            const float a = fast_exp2(m[i] - m_use);
            l[i] = l[i] * a + (tq == 0 ? fast_exp2(sink2 - m_use) : 0.0f);
            m[i] = m_f;
#pragma unroll
            for (int jb = 0; jb < HD / 8; ++jb) {
                o[4 * jb + 2 * i] *= a;
                o[4 * jb + 2 * i + 1] *= a;
            }
        }
    }

    // Epilogue: O = acc / l as bf16, LSE = ln(sum) of the scaled scores (and the sink).
    float* Lrow = LSE + ((long long)b * NH + h) * T;
    const long long ldo = (long long)NH * HD;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float lsum = quad_sum(l[i]);
        if (r[i] >= T) continue;
        const float inv = 1.0f / lsum;
        if (tq == 0) {
            const float mm = m[i] == MT_NEG_INF ? 0.0f : m[i];
            Lrow[r[i]] = (mm + log2f(lsum)) * MT_LN2;
        }
        unsigned* dst = (unsigned*)(O + ((long long)b * T + r[i]) * ldo + (long long)h * HD);
#pragma unroll
        for (int jb = 0; jb < HD / 8; ++jb)
            dst[jb * 4 + tq] = pack_bf16(o[4 * jb + 2 * i] * inv, o[4 * jb + 2 * i + 1] * inv);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Registers per thread after `setmaxnreg`: 128 x producer + 256 x consumer must equal the 384 x 168
// a CTA starts with (anything else hangs the CTA). The load warp's and the dQ warp's loops fit
// in 40; the consumers' 232 hold dK, dV, S^T, dP^T and the dQ partial without a spill (24 / 240
// compiles too, for experiments, with a small spill in the producer).
#ifndef MT_HFA_BWD_CONSUMER_REGS
#define MT_HFA_BWD_PRODUCER_REGS 40
#define MT_HFA_BWD_CONSUMER_REGS 232
#endif
static_assert(128 * MT_HFA_BWD_PRODUCER_REGS + 256 * MT_HFA_BWD_CONSUMER_REGS == 384 * 168, "register split");

// Per head dim, measured on an H200 (decision 0055): at 128 the consumers issue dQ before dK and
// store the dQ partial while dK runs (+3-5.5% backward; at 64 it was 2-17% slower, the Q/dO
// stage then freed later than its loads need); at 64 they compute P while dP^T runs (+1%; neutral
// to -1% at 128). Another value (0: none) compiles the other order, for measurement.
#ifndef MT_HFA_BWD_DQ_MID_HD
#define MT_HFA_BWD_DQ_MID_HD 128
#endif
#ifndef MT_HFA_BWD_P_EARLY_HD
#define MT_HFA_BWD_P_EARLY_HD 64
#endif

template <int HD>
struct HfaBwd {
    static constexpr int BN = MT_HFA_BN, BQ = MT_HFA_BQ, NCH = HD / 64;
    static constexpr int TK = BN * HD * 2, TQ = BQ * HD * 2;  // tile bytes
    static constexpr int DS = BN * BQ * 2;                     // dS^T, bf16, keys x queries
    static constexpr int DQ = BQ * HD * 4;                     // a dQ partial, f32
    static constexpr int K = 0, V = TK, Q = 2 * TK, DO = Q + 2 * TQ, DSO = DO + 2 * TQ, DQO = DSO + 2 * DS;
    static constexpr int LD = DQO + 2 * DQ;  // LSE (log2 domain) and D of a stage's queries, f32
    static constexpr int BAR = LD + 2 * 2 * BQ * 4;
    // barriers: K+V, Q/dO full [2], Q/dO empty [2], dQ partial written [2], dQ partial read [2];
    // then the block
    static constexpr int BLOCK = BAR + 8 * 9;
    static constexpr int SMEM = BLOCK + 8 + 1024;
    static_assert(SMEM <= 232448, "a CTA has at most 227 KiB of shared memory");
    // Registers of a consumer's half of the dQ partial (64 rows x HD / 2) and their float4 groups.
    static constexpr int DQR = HD / 4, DQG = HD / 16;
};

// Item n of a backward CTA's walk (G query heads x n_it query tiles, the last tile first) -> its
// head within the group and its query tile. Every head's tile t comes before tile t - 1: the CTAs
// of one KV head's key blocks then reach each dQ tile in step, so an ordered add waits only for
// the block below it working on the same tile. Walking a whole head before the next
// (MT_HFA_BWD_HEAD_OUTER, kept for measurement) makes block j wait at each head's first tile for
// block j - 1, whose walk is two tiles longer: every block of a wave runs at the pace of the
// lowest one, whatever its own walk's length.
__device__ __forceinline__ void hfa_bwd_item(int n, int G, int n_it, int it_hi, int& hg, int& it) {
#ifdef MT_HFA_BWD_HEAD_OUTER
    hg = n / n_it;
    it = it_hi - n % n_it;
#else
    hg = n % G;
    it = it_hi - n / G;
#endif
}

// What every role of a backward CTA knows: its shared memory and barriers, its key block, KV
// head and batch, and its walk (`n_items` = G heads x `n_it` query tiles, `it_hi` the last).
struct HfaBwdCta {
    unsigned base, sK, sV, sQ, sdO, sdS, sdQ, barKV, barF, barE, barQF, barQE;
    int jb, kvh, b, G, j0, nqt, it_hi, n_it, n_items;
    const int* slo;  // the batch's document starts, or null
};

// The load warp: lane 0 the K/V block once, then each item's Q and dO tiles by TMA into a
// 2-stage ring; every lane two queries' LSE (log2 domain) and D into the stage.
template <int HD>
__device__ __forceinline__ void hfa_bwd_loads(const HfaBwdCta& cta, const MtTmaMap* tmq, const MtTmaMap* tmk,
                                              const MtTmaMap* tmv, const MtTmaMap* tmdo,
                                              const float* __restrict__ LSE, const float* __restrict__ D, int T,
                                              int NH, int lane) {
    using L = HfaBwd<HD>;
    constexpr int BN = L::BN, BQ = L::BQ, NCH = L::NCH;
    const unsigned base = cta.base, sK = cta.sK, sV = cta.sV, sQ = cta.sQ, sdO = cta.sdO;
    const unsigned barKV = cta.barKV, barF = cta.barF, barE = cta.barE;
    const int kvh = cta.kvh, b = cta.b, G = cta.G, j0 = cta.j0, it_hi = cta.it_hi, n_it = cta.n_it, n_items = cta.n_items;
    if (lane == 0) {
        mbar_expect_tx(barKV, 2 * L::TK);
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            tma_load_4d(sK + c * BN * 128, tmk, c * 64, kvh, j0, b, barKV);
            tma_load_4d(sV + c * BN * 128, tmv, c * 64, kvh, j0, b, barKV);
        }
    }
    float* ld = (float*)(mt_hfa_smem + (base + L::LD - smem_addr(mt_hfa_smem)));
    for (int n = 0; n < n_items; ++n) {
        int hg, it;
        hfa_bwd_item(n, G, n_it, it_hi, hg, it);
        const int s = n & 1, h = kvh * G + hg, i0 = it * BQ;
        if (n >= 2) mbar_wait(barE + 8 * s, ((n >> 1) - 1) & 1);
        if (lane == 0) {
            mbar_expect_tx_only(barF + 8 * s, 2 * L::TQ);
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
                tma_load_4d(sQ + s * L::TQ + c * BQ * 128, tmq, c * 64, h, i0, b, barF + 8 * s);
                tma_load_4d(sdO + s * L::TQ + c * BQ * 128, tmdo, c * 64, h, i0, b, barF + 8 * s);
            }
        }
        // A query past T gets P = 0 (exp2(x - inf)) and D = 0.
        const long long ro = ((long long)b * NH + h) * T;
#pragma unroll
        for (int e = 0; e < BQ / 32; ++e) {
            const int qi = lane + 32 * e, q = i0 + qi;
            ld[(2 * s) * BQ + qi] = q < T ? LSE[ro + q] * MT_LOG2E : MT_POS_INF;
            ld[(2 * s + 1) * BQ + qi] = q < T ? D[ro + q] : 0.0f;
        }
        mbar_arrive(barF + 8 * s);
    }
}

// The dQ warp's lane 0: each item's partial into its tile of the fp32 buffer, after the blocks
// below this one when deterministic. A tile's counter is released once the add is done, which
// is waited for only after the next item's add is issued (releasing it at once made the backward
// 2.5-6.5% slower at d128 on an H200: decision 0040).
template <int HD, bool EXT>
__device__ __forceinline__ void hfa_bwd_dq_adds(const HfaBwdCta& cta, float* __restrict__ dq_acc, int* sync,
                                                int window, int NH, int deterministic) {
    using L = HfaBwd<HD>;
    constexpr int BN = L::BN, BQ = L::BQ;
    const unsigned sdQ = cta.sdQ, barQF = cta.barQF, barQE = cta.barQE;
    const int jb = cta.jb, kvh = cta.kvh, b = cta.b, G = cta.G, nqt = cta.nqt, it_hi = cta.it_hi, n_it = cta.n_it;
    const int n_items = cta.n_items;
    const int* slo = cta.slo;
    int* prev_sem = sync;
    for (int n = 0; n < n_items; ++n) {
        int hg, it;
        hfa_bwd_item(n, G, n_it, it_hi, hg, it);
        const int s = n & 1, h = kvh * G + hg;
        mbar_wait(barQF + 8 * s, (n >> 1) & 1);
        const long long tile = ((long long)b * NH + h) * nqt + it;
        int* sem = sync + 1 + tile;
        bool first_adder = false;  // ordered, the tile's first: it stores, the rest add
        if (deterministic) {
            // The lowest key block this tile sees (that of its first query's lowest key).
            const int first = EXT ? hfa_lowest_key<EXT>(slo ? slo[it * BQ] : 0, it * BQ, window) / BN
                                  : (slo ? slo[it * BQ] / BN : 0);
            first_adder = jb == first;
            while (ld_acquire(sem) != jb - first) {
            }
            fence_async_global();
        }
#ifndef MT_HFA_NO_DQ_ADD
        // The first adder writes its whole partial (zeros where masked), so an ordered
        // backward's buffer needs no zeroing.
        if (first_adder) bulk_store(dq_acc + tile * (BQ * HD), sdQ + s * L::DQ, L::DQ);
        else bulk_reduce_add_f32(dq_acc + tile * (BQ * HD), sdQ + s * L::DQ, L::DQ);
#endif
        bulk_commit();
        bulk_wait_read();
        mbar_arrive(barQE + 8 * s);
        if (deterministic) {
            if (n > 0) {
                bulk_wait_all_but_one();
                fence_async_global();
                red_release_add(prev_sem, 1);
            }
            prev_sem = sem;
        }
    }
    bulk_wait_all();
    if (deterministic && n_items > 0) {
        fence_async_global();
        red_release_add(prev_sem, 1);
    }
}

// A consumer warpgroup (1 or 2): per item S^T, dP^T, P and dS, dV and dK (kept in registers),
// its half of the item's dQ partial into shared memory for the dQ warp; at the end dK and dV.
template <int HD, bool EXT>
__device__ __forceinline__ void hfa_bwd_consumer(const HfaBwdCta& cta, unsigned short* __restrict__ dK,
                                                 unsigned short* __restrict__ dV, int window, int T, int NKV,
                                                 float scale, float scale_log2, int tid) {
    using L = HfaBwd<HD>;
    constexpr int BN = L::BN, BQ = L::BQ;
    const unsigned base = cta.base, sK = cta.sK, sV = cta.sV, sQ = cta.sQ, sdO = cta.sdO, sdS = cta.sdS, sdQ = cta.sdQ;
    const unsigned barKV = cta.barKV, barF = cta.barF, barE = cta.barE, barQF = cta.barQF, barQE = cta.barQE;
    const int kvh = cta.kvh, b = cta.b, G = cta.G, j0 = cta.j0, it_hi = cta.it_hi, n_it = cta.n_it, n_items = cta.n_items;
    const int* slo = cta.slo;
    const int wg = tid >> 7, lane = tid & 31;
    // Consumer warpgroup w: keys j0 + 64 w .. + 63; this thread's keys kr[i] (rows of S^T).
    const int w = wg - 1, lt = tid & 127, wq = lt >> 5, g = lane >> 2, tq = lane & 3;
    const int key0 = j0 + 64 * w;
    int kr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) kr[i] = key0 + 16 * wq + g + 8 * i;
    float dk[HD / 2], dv[HD / 2], st[BQ / 2], dp[BQ / 2], dq[L::DQR];
    unsigned pa[BQ / 4], da[BQ / 4];
    zero<HD / 2>(dk);
    zero<HD / 2>(dv);
    const unsigned ka = sK + 64 * w * 128, va = sV + 64 * w * 128;  // this warpgroup's keys
    // dQ half: columns [w HD / 2, (w + 1) HD / 2) of K (a whole chunk for HD 128, half of one
    // chunk's row for HD 64).
    const unsigned kb = sK + (HD == 128 ? w * BN * 128 : w * 64);
    const float* ldsm = (const float*)(mt_hfa_smem + (base + L::LD - smem_addr(mt_hfa_smem)));
    constexpr bool dq_mid = HD == MT_HFA_BWD_DQ_MID_HD, p_early = HD == MT_HFA_BWD_P_EARLY_HD;

    mbar_wait(barKV, 0);
    for (int n = 0; n < n_items; ++n) {
        int hg_unused, it;  // the head matters only to the loads and the dQ adds
        hfa_bwd_item(n, G, n_it, it_hi, hg_unused, it);
        const int s = n & 1, i0 = it * BQ;
        const unsigned ds = sdS + s * L::DS;
        // Laundered so that the descriptors are rebuilt here rather than kept live across the loop.
        const unsigned kan = launder(ka), van = launder(va), q_s = launder(sQ + s * L::TQ), do_s = sdO + s * L::TQ;
        mbar_wait(barF + 8 * s, (n >> 1) & 1);
        // S^T = K Q^T and dP^T = V dO^T (64 keys x 64 queries each), one group.
        fence_regs<BQ / 2>(st);
        fence_regs<BQ / 2>(dp);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const unsigned off = (kk >> 2) * BN * 128 + (kk & 3) * 32, offq = (kk >> 2) * BQ * 128 + (kk & 3) * 32;
            wgmma_ss<BQ, 0, 0>(st, desc_sw128(kan + off, 16, 1024), desc_sw128(q_s + offq, 16, 1024), kk > 0);
        }
        if constexpr (p_early) wg_commit();  // S^T alone: P is computed while dP^T runs
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const unsigned off = (kk >> 2) * BN * 128 + (kk & 3) * 32, offq = (kk >> 2) * BQ * 128 + (kk & 3) * 32;
            wgmma_ss<BQ, 0, 0>(dp, desc_sw128(van + off, 16, 1024), desc_sw128(do_s + offq, 16, 1024), kk > 0);
        }
        wg_commit();
        // This thread's queries: i0 + 8 jq + 2 tq + e; their LSE (log2 domain) and D.
        const float2* lse2 = (const float2*)(ldsm + (2 * s) * BQ) + tq;
        const float2* dd = (const float2*)(ldsm + (2 * s + 1) * BQ) + tq;
        const bool masked = i0 < key0 + 63 || i0 + BQ > T || (slo && slo[min(i0 + BQ - 1, T - 1)] > key0) ||
                            (EXT && window > 0 && min(i0 + BQ - 1, T - 1) - key0 >= window);
        // P^T in place of S^T; only items on the diagonal, past T or across a document's start
        // need the mask (two bodies, as in the forward's softmax).
        auto probs = [&](const bool masked_items) {
#pragma unroll
            for (int jq = 0; jq < BQ / 8; ++jq) {
                const float2 l2 = lse2[4 * jq];
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int x = 4 * jq + 2 * i + e;
                        float pv = fast_exp2(fmaf(st[x], scale_log2, -(e ? l2.y : l2.x)));
                        if (masked_items) {
                            const int q = i0 + 8 * jq + 2 * tq + e;
                            if (q < kr[i] || q >= T || (slo && slo[min(q, T - 1)] > kr[i]) ||
                                (EXT && window > 0 && q - kr[i] >= window))
                                pv = 0.0f;
                        }
                        st[x] = pv;
                    }
            }
        };
        // dS^T = P^T (dP^T - D) in place of dP^T.
        auto grads = [&]() {
#pragma unroll
            for (int jq = 0; jq < BQ / 8; ++jq) {
                const float2 d2 = dd[4 * jq];
#pragma unroll
                for (int x = 4 * jq; x < 4 * jq + 4; ++x) dp[x] = st[x] * (dp[x] - (x & 1 ? d2.y : d2.x));
            }
        };
        if constexpr (p_early) {
            wg_wait<1>();
            fence_regs<BQ / 2>(st);
        } else {
            wg_wait<0>();
            fence_regs<BQ / 2>(st);
            fence_regs<BQ / 2>(dp);
        }
        if (masked) probs(true);
        else probs(false);
        if constexpr (p_early) {
            wg_wait<0>();
            fence_regs<BQ / 2>(dp);
        }
        grads();
        acc_to_frag<BQ>(pa, st);
        acc_to_frag<BQ>(da, dp);
        // dV += P^T dO, dK += dS^T Q (64 keys x HD, contraction over the 64 queries): one group,
        // or (dq_mid) dV now and dK after dQ, so that dQ's partial is stored while dK runs.
        fence_regs<HD / 2>(dv);
        fence_regs<HD / 2>(dk);
        fence_regs<BQ / 4>(pa);
        fence_regs<BQ / 4>(da);
        wg_fence();
        auto issue_dk = [&]() {
#pragma unroll
            for (int kk = 0; kk < BQ / 16; ++kk)
                wgmma_rs<HD, 1>(dk, &da[4 * kk], desc_sw128(q_s + kk * 2048, BQ * 128, 1024), 1);
        };
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk)
            wgmma_rs<HD, 1>(dv, &pa[4 * kk], desc_sw128(do_s + kk * 2048, BQ * 128, 1024), 1);
        if constexpr (!dq_mid) issue_dk();
        wg_commit();
        // dS^T into this item's shared buffer (keys x queries, bf16, swizzled: row = key within the
        // block, 16-byte piece = query / 8). The buffer's last reader, item n - 2's dQ product in
        // both consumers, finished before either passed item n - 1's barrier below.
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int row = 64 * w + 16 * wq + g + 8 * i, piece = 2 * kk + half;
                    const unsigned addr = ds + row * 128 + ((piece ^ (row & 7)) << 4) + tq * 4;
                    st_shared_u32(addr, da[4 * kk + 2 * half + i]);
                }
        fence_async_shared();
        named_sync(1, 256);  // both consumers' halves of dS^T are written
        // dQ half = dS K: 64 queries x HD / 2, contraction over the block's 128 keys: one group.
        fence_regs<L::DQR>(dq);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_ss<HD / 2, 1, 1>(dq, desc_sw128(ds + kk * 2048, BN * 128, 1024),
                                   desc_sw128(kb + kk * 2048, BN * 128, 1024), kk > 0);
        wg_commit();
        if constexpr (dq_mid) {
            issue_dk();
            wg_commit();
            wg_wait<1>();  // dV and dQ done; dK runs under the partial's store
            fence_regs<HD / 2>(dv);
            fence_regs<BQ / 4>(pa);
            fence_regs<L::DQR>(dq);
        } else {
            wg_wait<0>();
            fence_regs<HD / 2>(dv);
            fence_regs<HD / 2>(dk);
            fence_regs<BQ / 4>(pa);
            fence_regs<BQ / 4>(da);
            fence_regs<L::DQR>(dq);
            __syncwarp();
            if (lane == 0) mbar_arrive(barE + 8 * s);  // this stage's Q and dO are free
        }
        // The partial into shared memory in the registers' own order (each warp writes 512
        // contiguous bytes: no bank conflicts), once the dQ warp has read the previous one; the
        // dQ buffer keeps that order, the convert kernel undoes it.
        if (n >= 2) mbar_wait(barQE + 8 * s, ((n >> 1) - 1) & 1);
        float4* part = (float4*)(mt_hfa_smem + (sdQ + s * L::DQ - smem_addr(mt_hfa_smem)));
#pragma unroll
        for (int q4 = 0; q4 < L::DQG; ++q4)
            part[(w * L::DQG + q4) * 128 + lt] = make_float4(dq[4 * q4], dq[4 * q4 + 1], dq[4 * q4 + 2], dq[4 * q4 + 3]);
        fence_async_shared();
        __syncwarp();
        if (lane == 0) mbar_arrive(barQF + 8 * s);
        if constexpr (dq_mid) {
            wg_wait<0>();  // dK, the stage's last reader (of Q)
            fence_regs<HD / 2>(dk);
            fence_regs<BQ / 4>(da);
            __syncwarp();
            if (lane == 0) mbar_arrive(barE + 8 * s);  // this stage's Q and dO are free
        }
    }

    // dK (times the softmax scale) and dV as bf16.
    const long long ldk = (long long)NKV * HD;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (kr[i] >= T) continue;
        const long long off = ((long long)b * T + kr[i]) * ldk + (long long)kvh * HD;
        unsigned* k_out = (unsigned*)(dK + off);
        unsigned* v_out = (unsigned*)(dV + off);
#pragma unroll
        for (int jd = 0; jd < HD / 8; ++jd) {
            k_out[jd * 4 + tq] = pack_bf16(dk[4 * jd + 2 * i] * scale, dk[4 * jd + 2 * i + 1] * scale);
            v_out[jd * 4 + tq] = pack_bf16(dv[4 * jd + 2 * i], dv[4 * jd + 2 * i + 1]);
        }
    }
}


// EXT: with a sliding `window` (0: none; sinks need nothing here: LSE includes them); without it
// the window is the constant 0 and the code is the plain kernel's.
template <int HD, bool EXT>
__device__ __forceinline__ void hfa_bwd(const MtTmaMap* tmq, const MtTmaMap* tmk, const MtTmaMap* tmv,
                                        const MtTmaMap* tmdo, const float* __restrict__ LSE,
                                        const float* __restrict__ D, float* __restrict__ dq_acc, int* sync,
                                        unsigned short* __restrict__ dK, unsigned short* __restrict__ dV,
                                        const int* __restrict__ seg_lo, const int* __restrict__ seg_hi, int window,
                                        int T, int B, int NH, int NKV, float scale, float scale_log2,
                                        int deterministic) {
    using L = HfaBwd<HD>;
    constexpr int BN = L::BN, BQ = L::BQ;
    HfaBwdCta cta;
    cta.base = hfa_smem_base();
    int* s_block = (int*)(mt_hfa_smem + (cta.base + L::BLOCK - smem_addr(mt_hfa_smem)));
    cta.sK = cta.base + L::K, cta.sV = cta.base + L::V, cta.sQ = cta.base + L::Q, cta.sdO = cta.base + L::DO;
    cta.sdS = cta.base + L::DSO, cta.sdQ = cta.base + L::DQO;
    cta.barKV = cta.base + L::BAR, cta.barF = cta.barKV + 8, cta.barE = cta.barF + 16, cta.barQF = cta.barE + 16;
    cta.barQE = cta.barQF + 16;
    const int tid = threadIdx.x;
    if (tid == 0) {
        mbar_init(cta.barKV, 1);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            mbar_init(cta.barF + 8 * s, 32);  // the load warp's lanes
            mbar_init(cta.barE + 8 * s, 8);   // lane 0 of each consumer warp
            mbar_init(cta.barQF + 8 * s, 8);  // lane 0 of each consumer warp
            mbar_init(cta.barQE + 8 * s, 1);  // the dQ warp
        }
        fence_barrier_init();
        *s_block = atomicAdd(sync, 1);
    }
    __syncthreads();

    // Block -> (key block, KV head, batch): the first key blocks (the most query tiles) first.
    const int blk = *s_block, rest = blk % (NKV * B);
    cta.jb = blk / (NKV * B), cta.kvh = rest % NKV, cta.b = rest / NKV;
    cta.G = NH / NKV, cta.j0 = cta.jb * BN;
    cta.nqt = (T + BQ - 1) / BQ;
    cta.slo = seg_lo ? seg_lo + (long long)cta.b * T : nullptr;
    const int* shi = seg_hi ? seg_hi + (long long)cta.b * T : nullptr;
    const int k_last = min(cta.j0 + BN, T) - 1;
    // Queries [j0, q_end) see some key of the block: none past its last key's document or window.
    const int doc_end = shi ? shi[k_last] : T;
    const int q_end = EXT && window > 0 && window < T ? min(doc_end, k_last + window) : doc_end;
    const int it_lo = cta.j0 / BQ;
    cta.it_hi = (q_end - 1) / BQ, cta.n_it = cta.it_hi - it_lo + 1, cta.n_items = cta.G * cta.n_it;
    const int wg = tid >> 7, warp = tid >> 5, lane = tid & 31;

    if (wg == 0) {
        setmaxnreg_dec<MT_HFA_BWD_PRODUCER_REGS>();
        if (warp == 0) hfa_bwd_loads<HD>(cta, tmq, tmk, tmv, tmdo, LSE, D, T, NH, lane);
        else if (warp == 1 && lane == 0) hfa_bwd_dq_adds<HD, EXT>(cta, dq_acc, sync, window, NH, deterministic);
        return;
    }
    setmaxnreg_inc<MT_HFA_BWD_CONSUMER_REGS>();
    hfa_bwd_consumer<HD, EXT>(cta, dK, dV, window, T, NKV, scale, scale_log2, tid);
}

// dQ [B, T, NH, HD] bf16 = scale x the fp32 buffer [B, NH, T / 64 tiles, 64 x HD in the consumers'
// register order]. One thread writes 8 consecutive elements of a row.
template <int HD>
__device__ __forceinline__ void hfa_dq_convert(const float* __restrict__ acc, unsigned short* __restrict__ dQ, int T,
                                               int NH, float scale, long long groups) {
    constexpr int BQ = MT_HFA_BQ, DQG = HD / 16;
    const long long gi = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= groups) return;
    const int c0 = (int)(gi % (HD / 8)) * 8;
    const long long row = gi / (HD / 8);  // (b * T + t) * NH + h
    const int h = (int)(row % NH);
    const long long bt = row / NH;
    const int t = (int)(bt % T);
    const long long b = bt / T;
    const int nqt = (T + BQ - 1) / BQ, it = t / BQ, rr = t % BQ;
    const float* tile = acc + (((long long)b * NH + h) * nqt + it) * (BQ * HD);
    // Element (rr, c) lives in consumer w = c / (HD / 2), thread 32 (rr / 16) + 4 (rr mod 8) + tq,
    // register 4 jb + 2 i + e, where c mod HD / 2 = 8 jb + 2 tq + e and i = (rr / 8) mod 2.
    const int w = c0 / (HD / 2), jb = (c0 % (HD / 2)) / 8, i = (rr >> 3) & 1;
    unsigned out[4];
#pragma unroll
    for (int tq = 0; tq < 4; ++tq) {
        const int lt = 32 * (rr >> 4) + 4 * (rr & 7) + tq;
        const float2 v = *(const float2*)(tile + ((w * DQG + jb) * 128 + lt) * 4 + 2 * i);
        out[tq] = pack_bf16(v.x * scale, v.y * scale);
    }
    *(uint4*)(dQ + row * HD + c0) = make_uint4(out[0], out[1], out[2], out[3]);
}

// The plain kernels (causal, documents) and, `_ext`, GPT-OSS's: the forward with sinks and a
// window, the backward with a window (the sinks' gradient is flash_attn.cu's mt_flash_sink_grad).
#define MT_HFA_KERNELS(HD)                                                                                         \
    extern "C" __global__ void __launch_bounds__(MT_HFA_THREADS, 1) mt_hfa_fwd_hd##HD(                             \
        const __grid_constant__ MtTmaMap tq, const __grid_constant__ MtTmaMap tk,                                   \
        const __grid_constant__ MtTmaMap tv, unsigned short* O, float* LSE, const int* seg_lo, int T, int B, int NH, \
        int NKV, float scale_log2, int* counter) {                                                                 \
        hfa_fwd<HD, false>(&tq, &tk, &tv, O, LSE, seg_lo, nullptr, 0, T, B, NH, NKV, scale_log2, counter);         \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(MT_HFA_THREADS, 1) mt_hfa_fwd_ext_hd##HD(                         \
        const __grid_constant__ MtTmaMap tq, const __grid_constant__ MtTmaMap tk,                                   \
        const __grid_constant__ MtTmaMap tv, unsigned short* O, float* LSE, const int* seg_lo, const float* sinks,   \
        int window, int T, int B, int NH, int NKV, float scale_log2, int* counter) {                               \
        hfa_fwd<HD, true>(&tq, &tk, &tv, O, LSE, seg_lo, sinks, window, T, B, NH, NKV, scale_log2, counter);       \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(MT_HFA_THREADS, 1) mt_hfa_bwd_hd##HD(                             \
        const __grid_constant__ MtTmaMap tq, const __grid_constant__ MtTmaMap tk,                                   \
        const __grid_constant__ MtTmaMap tv, const __grid_constant__ MtTmaMap tdo, const float* LSE, const float* D, \
        float* dq_acc, int* sync, unsigned short* dK, unsigned short* dV, const int* seg_lo, const int* seg_hi,      \
        int T, int B, int NH, int NKV, float scale, float scale_log2, int deterministic) {                          \
        hfa_bwd<HD, false>(&tq, &tk, &tv, &tdo, LSE, D, dq_acc, sync, dK, dV, seg_lo, seg_hi, 0, T, B, NH, NKV,     \
                           scale, scale_log2, deterministic);                                                      \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(MT_HFA_THREADS, 1) mt_hfa_bwd_ext_hd##HD(                         \
        const __grid_constant__ MtTmaMap tq, const __grid_constant__ MtTmaMap tk,                                   \
        const __grid_constant__ MtTmaMap tv, const __grid_constant__ MtTmaMap tdo, const float* LSE, const float* D, \
        float* dq_acc, int* sync, unsigned short* dK, unsigned short* dV, const int* seg_lo, const int* seg_hi,      \
        int window, int T, int B, int NH, int NKV, float scale, float scale_log2, int deterministic) {              \
        hfa_bwd<HD, true>(&tq, &tk, &tv, &tdo, LSE, D, dq_acc, sync, dK, dV, seg_lo, seg_hi, window, T, B, NH, NKV, \
                          scale, scale_log2, deterministic);                                                       \
    }                                                                                                              \
    extern "C" __global__ void mt_hfa_dq_convert_hd##HD(const float* acc, unsigned short* dQ, int T, int NH,       \
                                                        float scale, long long groups) {                           \
        hfa_dq_convert<HD>(acc, dQ, T, NH, scale, groups);                                                         \
    }

MT_HFA_KERNELS(64)
MT_HFA_KERNELS(128)

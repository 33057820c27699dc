// Checks kernels/cuda/moe.cu on the CPU emulator (emu.h): the routing (top-k and weights against
// the CPU engine's rule, evaluated here as crates/layers/src/moe.rs does), the stable grouping
// (counts, offsets, permutation against a stable sort), and the whole MoE MLP forward and backward
// through the grouped GEMMs (output, dX, both expert weight gradients, the routing weights' and
// router logits' gradients) against a float64 evaluation from the same bf16 inputs and the same
// routing. Shapes off the tiles (hidden 72, expert width 40; hidden 264, expert width 136 for
// several column tiles), an expert with no rows, one with
// every token, tied logits, more experts than a warp has lanes, top-1; the routing and grouping
// alone over several sort chunks. Build and run (extra arguments: a GEMM variant's defines;
// -DMT_MOE_CHECK_HOPPER: the GEMMs through moe_hopper.cu's wgmma kernels):
//   kernels/emu/run_moe.sh [-DMT_MOE_CHECK_HOPPER] [-DMT_MOE_BK=64 ...]
#include <math.h>

#include "emu.h"
#define __shared__ static
struct uint4 {
    unsigned x, y, z, w;
};
struct float2 {
    float x, y;
};
#define MT_MOE_SMEM (emu_block->smem.data())
#include "../cuda/common.cuh"
#include "emu_hopper.h"
#include "../cuda/hopper.cuh"
#include "../cuda/moe.cu"
#include "../cuda/moe_hopper.cu"

// The grouped GEMMs through moe.cu's mma.sync kernels, or (-DMT_MOE_CHECK_HOPPER)
// moe_hopper.cu's wgmma kernels.
#ifdef MT_MOE_CHECK_HOPPER
#define GEMM(kind) mt_moe_hgemm_##kind
constexpr int MBM = MoeH::BM, MBN = MoeH::BN, MTHREADS = MT_MOE_H_THREADS;
constexpr size_t MSMEM = MoeH::SMEM;
#else
#define GEMM(kind) mt_moe_gemm_##kind
constexpr int MBM = MT_MOE_BM, MBN = MT_MOE_BN, MTHREADS = MT_MOE_THREADS;
constexpr size_t MSMEM = MT_MOE_GEMM_SMEM_BYTES;
#endif
// CTAs a weight gradient's grid has per expert for `tiles` tiles: one a tile, or with the
// persistent variant (-DMT_MOE_CHECK_HOPPER -DMT_MOE_H_PERSIST=P) P, each walking several.
inline unsigned wgrad_ctas(int tiles) {
#if defined(MT_MOE_CHECK_HOPPER) && defined(MT_MOE_H_PERSIST)
    return (unsigned)std::min(tiles, MT_MOE_H_PERSIST);
#else
    return (unsigned)tiles;
#endif
}

#include <cstdio>
#include <numeric>
#include <random>

using u16 = unsigned short;
static float bf(u16 x) { return __uint_as_float(((unsigned)x) << 16); }
static double silu(double g) { return g / (1.0 + std::exp(-g)); }

// Relative L2 error and the largest error over the largest reference magnitude.
static bool close(const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol) {
    double num = 0, den = 0, mx = 0, mref = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double d = got[i] - want[i];
        num += d * d;
        den += want[i] * want[i];
        mx = std::max(mx, std::fabs(d));
        mref = std::max(mref, std::fabs(want[i]));
        if (!std::isfinite(got[i])) return std::printf("  %s: not finite at %zu\n", what, i), false;
    }
    const double rel = std::sqrt(num / std::max(den, 1e-300)), mrel = mx / std::max(mref, 1e-300);
    const bool ok = rel < tol && mrel < 4 * tol;
    std::printf("  %-16s rel %.2e max %.2e %s\n", what, rel, mrel, ok ? "" : "FAILED");
    return ok;
}

template <class T>
static std::vector<double> widen(const std::vector<T>& v) {
    std::vector<double> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        if constexpr (std::is_same_v<T, u16>)
            r[i] = bf(v[i]);
        else
            r[i] = (double)v[i];
    }
    return r;
}

static bool run_case(const char* name, int T, int E, int K, int H, int F, bool normalise, int kind, unsigned seed,
                     bool gemms = true) {
    std::printf("%s: T=%d E=%d K=%d H=%d F=%d norm=%d\n", name, T, E, K, H, F, (int)normalise);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    auto rbf16 = [&](float s) { return emu_f2bf(nd(rng) * s); };
    const int R = T * K, F2 = 2 * F;
    std::vector<u16> x(T * H), x1(T * H), dout(T * H), wgu((size_t)E * F2 * H), wd((size_t)E * H * F);
    for (auto& v : x) v = rbf16(1.0f);
    for (auto& v : x1) v = rbf16(1.0f);
    for (auto& v : dout) v = rbf16(1.0f);
    for (auto& v : wgu) v = rbf16(1.0f / std::sqrt((float)H));
    for (auto& v : wd) v = rbf16(1.0f / std::sqrt((float)F));
    std::vector<float> logits(T * E);
    for (int t = 0; t < T; ++t)
        for (int e = 0; e < E; ++e) {
            float l = nd(rng);
            if (kind == 1) l = (float)(rng() % 3) * 0.5f;       // ties
            if (kind == 2) l = e == 0 ? -30.0f : e == 1 ? 12.0f : l;  // expert 0 empty, 1 takes all
            logits[t * E + e] = l;
        }
    std::vector<double> aux(E);
    for (auto& a : aux) a = 1e-3 * (rng() % 100);
    bool ok = true;

    // Routing.
    std::vector<float> probs(T * E), w(R);
    std::vector<int> top(R);
    emu_launch({(unsigned)(T + 3) / 4, 1, 1}, 128, 4 * E * 12,
               [&] { mt_moe_route_f32(logits.data(), probs.data(), top.data(), w.data(), T, E, K, normalise); });
    int top_bad = 0, prob_bad = 0, w_bad = 0;
    for (int t = 0; t < T; ++t) {
        // The CPU engine: f64 softmax rounded once; sort by total order descending, lower index first.
        double m = -INFINITY, s = 0;
        for (int e = 0; e < E; ++e) m = std::max(m, (double)logits[t * E + e]);
        std::vector<double> ex(E);
        for (int e = 0; e < E; ++e) s += (ex[e] = std::exp((double)logits[t * E + e] - m));
        std::vector<float> p(E);
        for (int e = 0; e < E; ++e) prob_bad += (p[e] = (float)(ex[e] / s)) != probs[t * E + e];
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        double sum = 0;
        for (int j = 0; j < K; ++j) sum += p[order[j]];
        for (int j = 0; j < K; ++j) {
            top_bad += top[t * K + j] != order[j];
            const float want = normalise ? (float)(p[order[j]] / sum) : p[order[j]];
            w_bad += w[t * K + j] != want;
        }
    }
    std::printf("  routing: top-k mismatches %d, probabilities not bitwise %d, weights not bitwise %d\n", top_bad,
                prob_bad, w_bad);
    ok &= top_bad == 0 && w_bad == 0 && prob_bad == 0;

    // Grouping.
    const int chunks = (R + MT_MOE_CHUNK - 1) / MT_MOE_CHUNK;
    std::vector<int> rank(R), cc(chunks * E), base(chunks * E), counts(E), off(E + 1), perm(R), row_slot(R);
    emu_launch({(unsigned)chunks, 1, 1}, 32, 4 * E, [&] { mt_moe_sort_count(top.data(), rank.data(), cc.data(), R, E); });
    emu_launch({1, 1, 1}, 256, 4 * E,
               [&] { mt_moe_sort_scan(cc.data(), base.data(), counts.data(), off.data(), chunks, E); });
    emu_launch({2, 1, 1}, 256, 0,
               [&] { mt_moe_sort_scatter(top.data(), rank.data(), base.data(), perm.data(), row_slot.data(), R, E); });
    std::vector<int> want_rs(R);
    std::iota(want_rs.begin(), want_rs.end(), 0);
    std::stable_sort(want_rs.begin(), want_rs.end(), [&](int a, int b) { return top[a] < top[b]; });
    bool perm_ok = off[0] == 0 && off[E] == R;
    int empty = 0, most = 0;
    for (int p = 0; p < R; ++p) perm_ok &= row_slot[p] == want_rs[p] && perm[want_rs[p]] == p;
    for (int e = 0; e < E; ++e) {
        perm_ok &= off[e + 1] - off[e] == counts[e] && (int)std::count(top.begin(), top.end(), e) == counts[e];
        empty += counts[e] == 0;
        most = std::max(most, counts[e]);
    }
    std::printf("  grouping: %s (experts without rows %d, largest %d of %d rows)\n", perm_ok ? "exact" : "WRONG",
                empty, most, R);
    ok &= perm_ok;
    if (!gemms) return ok;

    // Forward.
    const dim3e gemm_gu{(unsigned)((R + MBM - 1) / MBM + E), (unsigned)((F2 + MBN - 1) / MBN), 1};
    const dim3e gemm_h{(unsigned)((R + MBM - 1) / MBM + E), (unsigned)((H + MBN - 1) / MBN), 1};
    const dim3e gemm_f{(unsigned)((R + MBM - 1) / MBM + E), (unsigned)((F + MBN - 1) / MBN), 1};
    std::vector<u16> gu((size_t)R * F2), mid((size_t)R * F), y((size_t)R * H), out(T * H);
    emu_launch(gemm_gu, MTHREADS, MSMEM,
               [&] { GEMM(nk)(x.data(), row_slot.data(), K, wgu.data(), off.data(), E, F2, H, gu.data()); });
    emu_launch({8, 1, 1}, 256, 0, [&] { mt_moe_swiglu(gu.data(), mid.data(), R, F); });
    emu_launch(gemm_h, MTHREADS, MSMEM,
               [&] { GEMM(nk)(mid.data(), nullptr, 1, wd.data(), off.data(), E, H, F, y.data()); });
    emu_launch({(unsigned)T, 1, 1}, 256, 0,
               [&] { mt_moe_combine(y.data(), perm.data(), w.data(), x1.data(), out.data(), T, H, K); });

    // Backward.
    const int tiles = (F + MBN - 1) / MBN;
    std::vector<u16> dys((size_t)R * H), dmid((size_t)R * F), dgu((size_t)R * F2), dcp((size_t)R * H), dc(T * H),
        dlogit(T * E);
    std::vector<float> partial((size_t)R * tiles), g_gu((size_t)E * F2 * H, 0.0f), g_d((size_t)E * H * F, 0.0f);
    std::vector<double> dw(R);
    emu_launch({8, 1, 1}, 256, 0,
               [&] { mt_moe_gather(dout.data(), row_slot.data(), w.data(), dys.data(), R, H, K); });
    emu_launch(gemm_f, MTHREADS, MSMEM, [&] {
        GEMM(kn_dmid)(dout.data(), row_slot.data(), K, wd.data(), off.data(), E, F, H, dmid.data(), row_slot.data(),
                        w.data(), mid.data(), partial.data());
    });
    emu_launch({8, 1, 1}, 256, 0, [&] { mt_moe_swiglu_bwd(dmid.data(), gu.data(), dgu.data(), R, F); });
    emu_launch({wgrad_ctas(((H + MBM - 1) / MBM) * ((F + MBN - 1) / MBN)), (unsigned)E, 1}, MTHREADS, MSMEM,
               [&] { GEMM(wgrad)(dys.data(), mid.data(), nullptr, 1, off.data(), H, F, g_d.data()); });
    emu_launch({wgrad_ctas(((F2 + MBM - 1) / MBM) * ((H + MBN - 1) / MBN)), (unsigned)E, 1}, MTHREADS, MSMEM,
               [&] { GEMM(wgrad)(dgu.data(), x.data(), row_slot.data(), K, off.data(), F2, H, g_gu.data()); });
    emu_launch(gemm_h, MTHREADS, MSMEM,
               [&] { GEMM(kn)(dgu.data(), nullptr, 1, wgu.data(), off.data(), E, H, F2, dcp.data()); });
    emu_launch({(unsigned)T, 1, 1}, 256, 0,
               [&] { mt_moe_combine(dcp.data(), perm.data(), nullptr, nullptr, dc.data(), T, H, K); });
    emu_launch({(unsigned)(T + 3) / 4, 1, 1}, 128, 4 * E * 8, [&] {
        mt_moe_router_bwd(probs.data(), top.data(), perm.data(), partial.data(), tiles, aux.data(), normalise,
                          dw.data(), dlogit.data(), T, E, K);
    });

    // float64 reference with the same routing.
    std::vector<double> r_out(T * H), r_dx(T * H, 0), r_gu((size_t)E * F2 * H, 0), r_d((size_t)E * H * F, 0),
        r_dw(R), r_dl(T * E);
    for (int t = 0; t < T; ++t) {
        for (int i = 0; i < H; ++i) r_out[t * H + i] = bf(x1[t * H + i]);
        std::vector<double> dp(aux);
        for (int j = 0; j < K; ++j) {
            const int e = top[t * K + j];
            const double wj = bf(emu_f2bf(w[t * K + j]));
            std::vector<double> g(F), u(F), m(F), gm(F);
            for (int f = 0; f < F; ++f) {
                double a = 0, b = 0;
                for (int i = 0; i < H; ++i) {
                    a += bf(x[t * H + i]) * bf(wgu[((size_t)e * F2 + f) * H + i]);
                    b += bf(x[t * H + i]) * bf(wgu[((size_t)e * F2 + F + f) * H + i]);
                }
                g[f] = a, u[f] = b, m[f] = silu(a) * b;
            }
            double dwj = 0;
            for (int i = 0; i < H; ++i) {
                double yi = 0;
                for (int f = 0; f < F; ++f) yi += m[f] * bf(wd[((size_t)e * H + i) * F + f]);
                r_out[t * H + i] += wj * yi;
                dwj += bf(dout[t * H + i]) * yi;
            }
            r_dw[t * K + j] = dwj;
            for (int f = 0; f < F; ++f) {
                double a = 0;
                for (int i = 0; i < H; ++i) a += bf(dout[t * H + i]) * bf(wd[((size_t)e * H + i) * F + f]);
                gm[f] = a * wj;  // dL/dmid
            }
            for (int i = 0; i < H; ++i)
                for (int f = 0; f < F; ++f) r_d[((size_t)e * H + i) * F + f] += wj * bf(dout[t * H + i]) * m[f];
            for (int f = 0; f < F; ++f) {
                const double s = 1.0 / (1.0 + std::exp(-g[f]));
                const double dg = gm[f] * u[f] * (s * (1.0 + g[f] * (1.0 - s))), du = gm[f] * silu(g[f]);
                for (int i = 0; i < H; ++i) {
                    r_gu[((size_t)e * F2 + f) * H + i] += dg * bf(x[t * H + i]);
                    r_gu[((size_t)e * F2 + F + f) * H + i] += du * bf(x[t * H + i]);
                    r_dx[t * H + i] += dg * bf(wgu[((size_t)e * F2 + f) * H + i]) + du * bf(wgu[((size_t)e * F2 + F + f) * H + i]);
                }
            }
        }
        // The router's backward from the reference dw (the CPU engine's formulas).
        const float* p = &probs[t * E];
        double sum = 0, weighted = 0, dot = 0;
        for (int j = 0; j < K; ++j) sum += p[top[t * K + j]];
        for (int j = 0; j < K; ++j) weighted += r_dw[t * K + j] * p[top[t * K + j]] / sum;
        for (int j = 0; j < K; ++j)
            dp[top[t * K + j]] += normalise ? (r_dw[t * K + j] - weighted) / sum : r_dw[t * K + j];
        for (int e = 0; e < E; ++e) dot += p[e] * dp[e];
        for (int e = 0; e < E; ++e) r_dl[t * E + e] = p[e] * (dp[e] - dot);
    }
    ok &= close("out", widen(out), r_out, 1e-2);
    ok &= close("dx", widen(dc), r_dx, 2e-2);
    ok &= close("dW_gate_up", widen(g_gu), r_gu, 2e-2);
    ok &= close("dW_down", widen(g_d), r_d, 2e-2);
    ok &= close("d_weights", dw, r_dw, 2e-2);
    ok &= close("d_logits", widen(dlogit), r_dl, 2e-2);
    return ok;
}

int main() {
    bool ok = true;
    ok &= run_case("random", 150, 5, 2, 72, 40, true, 0, 1);
    ok &= run_case("ties", 97, 6, 3, 64, 24, false, 1, 2);
    ok &= run_case("skewed", 200, 5, 2, 72, 40, false, 2, 3);
    // Widths past two or three column tiles of every GEMM geometry, k steps with a tail.
    ok &= run_case("wide", 64, 3, 2, 264, 136, true, 0, 8);
    // Several tiles of several k steps an expert (~200 and 300 rows): the persistent weight
    // gradients (-DMT_MOE_H_PERSIST) wrap the ring across tiles with odd and even step counts.
    ok &= run_case("wide-deep", 300, 3, 2, 264, 136, true, 0, 9);
    ok &= run_case("wide-deep-skew", 300, 4, 2, 264, 136, false, 2, 10);
    // More experts than a warp's lanes (the GEMMs' expert search scans 32 at a time), top-1.
    ok &= run_case("many", 48, 40, 1, 16, 24, false, 0, 6);
    // Routing and grouping only, over several sort chunks.
    ok &= run_case("chunks", 1500, 7, 3, 8, 8, true, 0, 4, false);
    ok &= run_case("chunks-skewed", 1100, 9, 2, 8, 8, false, 2, 5, false);
    std::printf("%s\n", ok ? "all ok" : "FAILED");
    return ok ? 0 : 1;
}

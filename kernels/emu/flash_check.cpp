// Checks kernels/cuda/flash_attn.cu on the CPU emulator (emu.h) against a float64 evaluation of
// attention: O, LSE, dQ, dK, dV for causal GQA attention with and without packed documents, head
// dims 16..128, lengths that are and are not multiples of the tiles; with GPT-OSS's sliding
// window (1, 7, 128 and longer than the sequence) and sink logits, also each head's sink gradient.
// Each launch's tile walk is checked too: the number of mma instructions it issued is exactly its
// kernel's count for one tile times the number of tiles that hold a visible (query, key) pair, so
// a kernel that walked a tile outside the window or a document would fail. The Hopper kernels
// (flash_attn_hopper.cu: wgmma, TMA, mbarriers through emu_hopper.h; head dims 64 and 128; the
// plain ones and, with a window or sinks, the `_ext` ones; the backward ordered and not) are
// checked on the same cases the same way. Build and run:
//   kernels/emu/run.sh
#include "emu.h"
struct uint4 {
    unsigned x, y, z, w;
};
struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
#define __grid_constant__
#define mt_hfa_smem (emu_block->smem.data())
#include "../cuda/common.cuh"
#include "../cuda/flash_attn.cu"
#include "emu_hopper.h"
#include "../cuda/hopper.cuh"
#include "../cuda/flash_attn_hopper.cu"

#include <cstdio>
#include <random>
#include <string>

using u16 = unsigned short;

static float bf(u16 x) { return __uint_as_float(((unsigned)x) << 16); }

struct Case {
    int B, T, NH, NKV, HD;
    bool docs;
    int window = 0;  // 0: none
    bool sinks = false;
};

// Reference in float64 from the bf16 inputs.
// Query i sees keys max(lo[i], i - window + 1) <= j <= i; a head's sink is one more softmax term
// with no value; dsink[h] = -sum_i p_sink(i) D(i), and dsink_terms[h] = sum_i |p_sink(i) D(i)|,
// the size of its terms (the sum can cancel far below them).
static void reference(const Case& c, const std::vector<u16>& q, const std::vector<u16>& k,
                      const std::vector<u16>& v, const std::vector<u16>& dout, const std::vector<int>& lo,
                      const std::vector<float>& sinks, std::vector<double>& o, std::vector<double>& lse,
                      std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv,
                      std::vector<double>& dsink, std::vector<double>& dsink_terms) {
    const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HD = c.HD, G = NH / NKV;
    const double scale = 1.0 / std::sqrt((double)HD);
    o.assign((size_t)B * T * NH * HD, 0);
    dq.assign(o.size(), 0);
    dk.assign((size_t)B * T * NKV * HD, 0);
    dv.assign(dk.size(), 0);
    lse.assign((size_t)B * NH * T, 0);
    dsink.assign(NH, 0);
    dsink_terms.assign(NH, 0);
    auto qi = [&](int b, int t, int h, int d) { return (((size_t)b * T + t) * NH + h) * HD + d; };
    auto ki = [&](int b, int t, int h, int d) { return (((size_t)b * T + t) * NKV + h) * HD + d; };
    std::vector<double> p(T), dp(T);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < NH; ++h) {
            const int kh = h / G;
            const double sink = sinks.empty() ? -INFINITY : (double)sinks[h];
            for (int i = 0; i < T; ++i) {
                int j0 = lo.empty() ? 0 : lo[(size_t)b * T + i];
                if (c.window > 0) j0 = std::max(j0, i - c.window + 1);
                double m = sink;
                for (int j = j0; j <= i; ++j) {
                    double s = 0;
                    for (int d = 0; d < HD; ++d) s += (double)bf(q[qi(b, i, h, d)]) * bf(k[ki(b, j, kh, d)]);
                    p[j] = s * scale;
                    m = std::max(m, p[j]);
                }
                double z = std::exp(sink - m);
                for (int j = j0; j <= i; ++j) z += std::exp(p[j] - m);
                lse[((size_t)b * NH + h) * T + i] = m + std::log(z);
                const double p_sink = std::exp(sink - m) / z;
                for (int j = j0; j <= i; ++j) p[j] = std::exp(p[j] - m) / z;
                for (int d = 0; d < HD; ++d) {
                    double acc = 0;
                    for (int j = j0; j <= i; ++j) acc += p[j] * bf(v[ki(b, j, kh, d)]);
                    o[qi(b, i, h, d)] = acc;
                }
                // backward
                double Dd = 0;
                for (int d = 0; d < HD; ++d) Dd += (double)bf(dout[qi(b, i, h, d)]) * o[qi(b, i, h, d)];
                dsink[h] -= p_sink * Dd;
                dsink_terms[h] += std::fabs(p_sink * Dd);
                for (int j = j0; j <= i; ++j) {
                    double acc = 0;
                    for (int d = 0; d < HD; ++d) acc += (double)bf(dout[qi(b, i, h, d)]) * bf(v[ki(b, j, kh, d)]);
                    dp[j] = acc;
                }
                for (int j = j0; j <= i; ++j) {
                    const double ds = p[j] * (dp[j] - Dd) * scale;
                    for (int d = 0; d < HD; ++d) {
                        dq[qi(b, i, h, d)] += ds * bf(k[ki(b, j, kh, d)]);
                        dk[ki(b, j, kh, d)] += ds * bf(q[qi(b, i, h, d)]);
                        dv[ki(b, j, kh, d)] += p[j] * bf(dout[qi(b, i, h, d)]);
                    }
                }
            }
        }
}

static double rel_err(const std::vector<u16>& got, const std::vector<double>& want, bool* nan) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double g = bf(got[i]);
        if (!std::isfinite(g)) *nan = true;
        num += (g - want[i]) * (g - want[i]);
        den += want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}
// Relative to `scale` (the reference itself unless given).
static double rel_err_f(const std::vector<float>& got, const std::vector<double>& want, bool* nan,
                        const std::vector<double>* scale = nullptr) {
    if (want.empty()) return 0;
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        if (!std::isfinite(got[i])) *nan = true;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        const double sc = scale ? (*scale)[i] : want[i];
        den += sc * sc;
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

// Document bounds [B, T]: each token's document's first and one-past-last position.
struct Docs {
    std::vector<int> lo, hi;
};

// Whether query i sees key j (the reference's rule, stated once more for the tile counts).
static bool visible(const Case& c, const Docs& docs, int b, int i, int j) {
    const int lo = docs.lo.empty() ? 0 : docs.lo[(size_t)b * c.T + i];
    return j <= i && j >= lo && (c.window == 0 || i - j < c.window);
}

// The (CTA, tile) steps each kernel should take: pairs of a block of R query rows and a tile of
// C keys (the forward: 128 x 64; dQ: 64 x 64) or of 64 keys and a tile of 64 queries (dK/dV,
// once per query head of the group) that hold at least one visible pair. The Hopper kernels:
// the forward 128 x 128, the fused backward (in `dkdv`) 64 queries x 128 keys; `dq` 0.
struct Walk {
    long long fwd = 0, dkdv = 0, dq = 0;
};
// The (query block, key block) pairs of `rows` x `keys` holding a visible pair, times the heads.
static long long visible_tiles(const Case& c, const Docs& docs, int rows, int keys) {
    const int T = c.T;
    auto any_visible = [&](int b, int i0, int j0) {
        for (int i = i0; i < std::min(T, i0 + rows); ++i)
            for (int j = j0; j < std::min(T, j0 + keys); ++j)
                if (visible(c, docs, b, i, j)) return true;
        return false;
    };
    long long n = 0;
    for (int b = 0; b < c.B; ++b)
        for (int i0 = 0; i0 < T; i0 += rows)
            for (int j0 = 0; j0 < T; j0 += keys) n += any_visible(b, i0, j0) ? c.NH : 0;
    return n;
}
static Walk expected_walk(const Case& c, const Docs& docs, bool hopper) {
    if (hopper) return {visible_tiles(c, docs, 128, 128), visible_tiles(c, docs, 64, 128), 0};
    // dK/dV: NKV CTAs, each over the NH / NKV heads of its group.
    const long long square = visible_tiles(c, docs, 64, 64);
    return {visible_tiles(c, docs, 128, 64), square, square};
}

// Warp mma instructions `f` issues.
static long long mmas(const std::function<void()>& f) {
    emu_mma_count = 0;
    f();
    return emu_mma_count.load();
}
// Warpgroup wgmma instructions `f` issues.
static long long wgmmas(const std::function<void()>& f) {
    emu_wgmma_count = 0;
    f();
    return emu_wgmma_count.load();
}

// The sinks' gradient from the forward's LSE and D: flash_attn.cu's kernel, which both kernel
// sets launch.
static void sink_grad(const Case& c, const std::vector<float>& lse, const std::vector<float>& D,
                      const std::vector<float>& sinks, std::vector<float>& dsink) {
    emu_launch({(unsigned)c.NH, 1, 1}, 128, 16, [&] {
        mt_flash_sink_grad(lse.data(), D.data(), sinks.data(), dsink.data(), c.B, c.T, c.NH);
    });
}

// What `run` (a kernel set's launches, with its usual arguments) counts for a 64-token sequence
// of one head of ones: one tile of each kernel's walk.
template <int HD, class Run>
static Walk one_tile(const Run& run) {
    const Case c{1, 64, 1, 1, HD, false};
    const size_t n = (size_t)64 * HD;
    std::vector<u16> x(n, 0x3f80), o(n), dq(n), dk(n), dv(n);  // ones
    std::vector<float> lse(64), dsink;
    const Docs none;
    const std::vector<float> no_sinks;
    return run(c, x, x, x, x, none, no_sinks, o, lse, dq, dk, dv, dsink);
}

template <int HD>
struct Kernels {
    // One launch of each kernel: forward (O, LSE), D, dK/dV, dQ, and with sinks their gradient;
    // the mma instructions of each of the three tiled kernels.
    static Walk run(const Case& c, const std::vector<u16>& q, const std::vector<u16>& k, const std::vector<u16>& v,
                    const std::vector<u16>& dout, const Docs& docs, const std::vector<float>& sinks,
                    std::vector<u16>& o, std::vector<float>& lse, std::vector<u16>& dq, std::vector<u16>& dk,
                    std::vector<u16>& dv, std::vector<float>& dsink) {
        const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV;
        std::vector<float> D((size_t)B * NH * T, NAN);
        const float scale = 1.0f / std::sqrt((float)HD), sl2 = scale * MT_LOG2E;
        const int* plo = c.docs ? docs.lo.data() : nullptr;
        const int* phi = c.docs ? docs.hi.data() : nullptr;
        const float* psink = c.sinks ? sinks.data() : nullptr;
        Walk w;
        w.fwd = mmas([&] {
            emu_launch({(unsigned)((T + 127) / 128), (unsigned)NH, (unsigned)B}, 128, (size_t)HD * 768, [&] {
                flash_fwd<HD>(q.data(), k.data(), v.data(), o.data(), lse.data(), plo, psink, c.window, T, NH, NKV,
                              sl2);
            });
        });
        const long long rows = (long long)B * T * NH;
        emu_launch({(unsigned)((rows + 3) / 4), 1, 1}, 128, 0,
                   [&] { mt_flash_bwd_dot(dout.data(), o.data(), D.data(), T, NH, HD, rows); });
        w.dkdv = mmas([&] {
            emu_launch({(unsigned)((T + 63) / 64), (unsigned)NKV, (unsigned)B}, 128, (size_t)HD * 768 + 1024, [&] {
                flash_bwd_dkdv<HD>(q.data(), k.data(), v.data(), dout.data(), lse.data(), D.data(), dk.data(),
                                   dv.data(), plo, phi, c.window, T, NH, NKV, scale, sl2);
            });
        });
        w.dq = mmas([&] {
            emu_launch({(unsigned)((T + 63) / 64), (unsigned)NH, (unsigned)B}, 128, (size_t)HD * 768, [&] {
                flash_bwd_dq<HD>(q.data(), k.data(), v.data(), dout.data(), lse.data(), D.data(), dq.data(), plo,
                                 c.window, T, NH, NKV, scale, sl2);
            });
        });
        if (c.sinks) sink_grad(c, lse, D, sinks, dsink);
        return w;
    }

    // Each tiled kernel's mma instructions for one (CTA, tile) step.
    static Walk per_tile() {
        static const Walk once = one_tile<HD>([](auto&&... a) { return run(a...); });
        return once;
    }
};

// The same through the Hopper kernels, launched as kernels/src/ops/flash_hopper.rs launches them
// (the `_ext` instance where the case has a window or sinks); the backward ordered or not.
template <int HD>
struct HopperKernels {
    static Walk run(const Case& c, const std::vector<u16>& q, const std::vector<u16>& k, const std::vector<u16>& v,
                    const std::vector<u16>& dout, const Docs& docs, const std::vector<float>& sinks,
                    std::vector<u16>& o, std::vector<float>& lse, std::vector<u16>& dq, std::vector<u16>& dk,
                    std::vector<u16>& dv, std::vector<float>& dsink, bool ordered) {
        const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, BQ = MT_HFA_BQ;
        std::vector<float> D((size_t)B * NH * T, NAN);
        const float scale = 1.0f / std::sqrt((float)HD), sl2 = scale * MT_LOG2E;
        const int* plo = c.docs ? docs.lo.data() : nullptr;
        const int* phi = c.docs ? docs.hi.data() : nullptr;
        const float* psink = c.sinks ? sinks.data() : nullptr;
        const bool ext = c.window > 0 || c.sinks;
        auto map = [&](const std::vector<u16>& x, int heads, int rows) {
            return MtTmaMap{x.data(), {HD, heads, T, B}, rows};
        };
        Walk w;
        const MtTmaMap fq = map(q, NH, MT_HFA_BM), fk = map(k, NKV, MT_HFA_BN), fv = map(v, NKV, MT_HFA_BN);
        int counter = 0;
        w.fwd = wgmmas([&] {
            emu_launch({(unsigned)((T + MT_HFA_BM - 1) / MT_HFA_BM * NH * B), 1, 1}, MT_HFA_THREADS,
                       HfaFwd<HD>::SMEM, [&] {
                           if (ext)
                               hfa_fwd<HD, true>(&fq, &fk, &fv, o.data(), lse.data(), plo, psink, c.window, T, B, NH,
                                                 NKV, sl2, &counter);
                           else
                               hfa_fwd<HD, false>(&fq, &fk, &fv, o.data(), lse.data(), plo, nullptr, 0, T, B, NH, NKV,
                                                  sl2, &counter);
                       });
        });
        const long long rows = (long long)B * T * NH;
        emu_launch({(unsigned)((rows + 3) / 4), 1, 1}, 128, 0,
                   [&] { mt_flash_bwd_dot(dout.data(), o.data(), D.data(), T, NH, HD, rows); });
        const int nqt = (T + BQ - 1) / BQ;
        // Ordered, each tile's first adder stores: the buffer starts as garbage (NaN), as the
        // engine leaves it uninitialised; unordered it must be zeros.
        std::vector<float> acc((size_t)B * NH * nqt * BQ * HD, ordered ? std::nanf("") : 0.0f);
        std::vector<int> sync(1 + (size_t)B * NH * nqt, 0);
        const MtTmaMap bq = map(q, NH, BQ), bk = map(k, NKV, MT_HFA_BN), bv = map(v, NKV, MT_HFA_BN),
                       bdo = map(dout, NH, BQ);
        w.dkdv = wgmmas([&] {
            emu_launch({(unsigned)((T + MT_HFA_BN - 1) / MT_HFA_BN * NKV * B), 1, 1}, MT_HFA_THREADS,
                       HfaBwd<HD>::SMEM, [&] {
                           if (ext)
                               hfa_bwd<HD, true>(&bq, &bk, &bv, &bdo, lse.data(), D.data(), acc.data(), sync.data(),
                                                 dk.data(), dv.data(), plo, phi, c.window, T, B, NH, NKV, scale, sl2,
                                                 ordered);
                           else
                               hfa_bwd<HD, false>(&bq, &bk, &bv, &bdo, lse.data(), D.data(), acc.data(), sync.data(),
                                                  dk.data(), dv.data(), plo, phi, 0, T, B, NH, NKV, scale, sl2,
                                                  ordered);
                       });
        });
        const long long groups = rows * HD / 8;
        emu_launch({(unsigned)((groups + 255) / 256), 1, 1}, 256, 0,
                   [&] { hfa_dq_convert<HD>(acc.data(), dq.data(), T, NH, scale, groups); });
        if (c.sinks) sink_grad(c, lse, D, sinks, dsink);
        return w;
    }

    // Each kernel's warpgroup products for one (CTA, tile) step.
    static Walk per_tile() {
        static const Walk once = one_tile<HD>([](auto&&... a) { return run(a..., true); });
        return once;
    }
};

// Which kernels a case runs through.
enum class Path { Portable, HopperOrdered, HopperUnordered };

template <int HD>
static bool run_case(const Case& c, std::mt19937& rng, Path path = Path::Portable) {
    const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto rnd = [&](size_t n, float sd) {
        std::vector<u16> x(n);
        for (auto& e : x) e = emu_f2bf(nd(rng) * sd);
        return x;
    };
    const size_t nq = (size_t)B * T * NH * HD, nk = (size_t)B * T * NKV * HD;
    auto q = rnd(nq, 1.0f), k = rnd(nk, 1.0f), v = rnd(nk, 1.0f), dout = rnd(nq, 1.0f);
    Docs docs;
    if (c.docs) {
        docs.lo.resize((size_t)B * T);
        docs.hi.resize((size_t)B * T);
        std::uniform_int_distribution<int> len(1, std::max(2, T / 3));
        for (int b = 0; b < B; ++b) {
            int s = 0;
            while (s < T) {
                const int e = std::min(T, s + len(rng));
                for (int t = s; t < e; ++t) docs.lo[(size_t)b * T + t] = s, docs.hi[(size_t)b * T + t] = e;
                s = e;
            }
        }
    }
    // Sink logits around the scores' scale (some dominate their rows, some hardly count); the
    // last head's is -inf, which must act as no sink.
    std::vector<float> sinks;
    if (c.sinks) {
        for (int h = 0; h < NH; ++h) sinks.push_back(nd(rng) * 2.0f);
        sinks[NH - 1] = -INFINITY;
    }
    std::vector<double> ro, rl, rdq, rdk, rdv, rds, rds_terms;
    reference(c, q, k, v, dout, docs.lo, sinks, ro, rl, rdq, rdk, rdv, rds, rds_terms);

    std::vector<u16> o(nq, 0xffff), dq(nq, 0xffff), dk(nk, 0xffff), dv(nk, 0xffff);  // poisoned (NaN)
    std::vector<float> lse((size_t)B * NH * T, NAN), dsink(NH, NAN);
    const bool hopper = path != Path::Portable;
    Walk got, tile;
    if constexpr (HD == 64 || HD == 128) {
        if (hopper) {
            got = HopperKernels<HD>::run(c, q, k, v, dout, docs, sinks, o, lse, dq, dk, dv, dsink,
                                         path == Path::HopperOrdered);
            tile = HopperKernels<HD>::per_tile();
        }
    }
    if (!hopper) {
        got = Kernels<HD>::run(c, q, k, v, dout, docs, sinks, o, lse, dq, dk, dv, dsink);
        tile = Kernels<HD>::per_tile();
    }
    const Walk want = expected_walk(c, docs, hopper);
    // The forward's and dQ's steps are per query head; dK/dV's per query head of each group.
    auto steps = [](long long n, long long per) { return per ? n / per : 0; };
    const bool walk_ok = got.fwd == want.fwd * tile.fwd && got.dq == want.dq * tile.dq &&
                         got.dkdv == want.dkdv * tile.dkdv;

    bool nan = false;
    const double eo = rel_err(o, ro, &nan), el = rel_err_f(lse, rl, &nan), eq = rel_err(dq, rdq, &nan),
                 ek = rel_err(dk, rdk, &nan), ev = rel_err(dv, rdv, &nan);
    // The sinks' gradient relative to the size of its terms: each term carries O's bf16 rounding
    // (through D), and a head's sum of terms of both signs can cancel far below them.
    const double es = c.sinks ? rel_err_f(dsink, rds, &nan, &rds_terms) : 0.0;
    const bool ok = !nan && walk_ok && eo < 1e-2 && el < 1e-4 && eq < 2e-2 && ek < 2e-2 && ev < 2e-2 && es < 2e-2;
    const char* name = path == Path::Portable ? "portable" : path == Path::HopperOrdered ? "hopper" : "hopper-unord";
    std::printf("%s %-12s B=%d T=%d NH=%d NKV=%d HD=%d docs=%d window=%d sinks=%d: rel err O %.2e LSE %.2e dQ %.2e "
                "dK %.2e dV %.2e dsink %.2e; tiles fwd %lld %s %lld dq %lld%s%s\n",
                ok ? "ok  " : "FAIL", name, B, T, NH, NKV, HD, (int)c.docs, c.window, (int)c.sinks, eo, el, eq, ek, ev,
                es, steps(got.fwd, tile.fwd), hopper ? "bwd" : "dkdv", steps(got.dkdv, tile.dkdv),
                steps(got.dq, tile.dq), walk_ok ? "" : " WRONG TILE WALK", nan ? " NaN" : "");
    if (!walk_ok)
        std::printf("     expected tiles fwd %lld dkdv %lld dq %lld\n", want.fwd, want.dkdv, want.dq);
    return ok;
}

// The portable kernels' cases, then the Hopper kernels' (argument "portable" or "hopper": only
// those).
int main(int argc, char** argv) {
    const std::string only = argc > 1 ? argv[1] : "";
    std::mt19937 rng(1234);
    bool ok = true;
    if (only.empty() || only == "portable") {
        ok &= run_case<64>({1, 64, 2, 1, 64, false}, rng);
        ok &= run_case<64>({1, 200, 4, 2, 64, false}, rng);
        ok &= run_case<128>({1, 130, 2, 2, 128, false}, rng);
        ok &= run_case<16>({2, 77, 4, 2, 16, false}, rng);
        ok &= run_case<32>({1, 150, 4, 1, 32, true}, rng);
        ok &= run_case<64>({2, 257, 3, 1, 64, true}, rng);
        ok &= run_case<128>({1, 192, 2, 1, 128, true}, rng);
        // GPT-OSS: sliding windows and sinks (window 0: none).
        ok &= run_case<64>({1, 200, 4, 2, 64, false, 1, true}, rng);
        ok &= run_case<64>({1, 150, 4, 1, 64, true, 7, true}, rng);
        ok &= run_case<64>({1, 300, 4, 2, 64, false, 128, true}, rng);
        ok &= run_case<128>({1, 300, 2, 1, 128, true, 128, true}, rng);
        ok &= run_case<128>({2, 130, 4, 2, 128, false, 1000, true}, rng);
        ok &= run_case<128>({1, 190, 2, 2, 128, false, 7, true}, rng);
        ok &= run_case<64>({1, 257, 3, 1, 64, true, 0, true}, rng);
        ok &= run_case<64>({1, 200, 4, 2, 64, false, 128, false}, rng);
        ok &= run_case<16>({2, 77, 4, 2, 16, true, 7, true}, rng);
    }
    if (only.empty() || only == "hopper") {
        const Path ord = Path::HopperOrdered, unord = Path::HopperUnordered;
        ok &= run_case<64>({1, 200, 4, 2, 64, false}, rng, ord);
        ok &= run_case<128>({1, 192, 2, 1, 128, true}, rng, ord);
        ok &= run_case<64>({2, 257, 2, 1, 64, true}, rng, unord);
        // Two sequences of packed documents, ordered: each batch's first adders from its own
        // document starts (the buffer starts as NaN).
        ok &= run_case<64>({2, 257, 2, 1, 64, true}, rng, ord);
        // GPT-OSS: the `_ext` kernels.
        ok &= run_case<64>({1, 200, 4, 2, 64, false, 1, true}, rng, ord);
        ok &= run_case<64>({1, 150, 4, 1, 64, true, 7, true}, rng, ord);
        ok &= run_case<64>({1, 300, 4, 2, 64, false, 128, true}, rng, unord);
        ok &= run_case<128>({1, 300, 2, 1, 128, true, 128, true}, rng, ord);
        ok &= run_case<128>({2, 130, 4, 2, 128, false, 1000, true}, rng, ord);
        ok &= run_case<128>({1, 190, 2, 2, 128, false, 7, false}, rng, unord);
        ok &= run_case<64>({1, 257, 3, 1, 64, true, 0, true}, rng, ord);
        ok &= run_case<64>({1, 200, 4, 2, 64, true, 128, false}, rng, ord);
        // A window of 127: a full query tile's last query is exactly `window` past a consumer's
        // first key, the edge of the backward's masked-tile test.
        ok &= run_case<64>({1, 320, 2, 1, 64, false, 127, true}, rng, ord);
    }
    std::printf(ok ? "all ok\n" : "FAILURES\n");
    return ok ? 0 : 1;
}

// Checks kernels/cuda/flash_attn.cu on the CPU emulator (emu.h) against a float64 evaluation of
// attention: O, LSE, dQ, dK, dV for causal GQA attention with and without packed documents, head
// dims 16..128, lengths that are and are not multiples of the tiles; with GPT-OSS's sliding
// window (1, 7, 128 and longer than the sequence) and sink logits, also each head's sink gradient.
// Each launch's tile walk is checked too: the number of mma instructions it issued is exactly its
// kernel's count for one tile times the number of tiles that hold a visible (query, key) pair, so
// a kernel that walked a tile outside the window or a document would fail. Build and run:
//   kernels/emu/run.sh
#include "emu.h"
struct uint4 {
    unsigned x, y, z, w;
};
#include "../cuda/common.cuh"
#include "../cuda/flash_attn.cu"

#include <cstdio>
#include <random>

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
// with no value; dsink[h] = -sum_i p_sink(i) D(i).
static void reference(const Case& c, const std::vector<u16>& q, const std::vector<u16>& k,
                      const std::vector<u16>& v, const std::vector<u16>& dout, const std::vector<int>& lo,
                      const std::vector<float>& sinks, std::vector<double>& o, std::vector<double>& lse,
                      std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv,
                      std::vector<double>& dsink) {
    const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HD = c.HD, G = NH / NKV;
    const double scale = 1.0 / std::sqrt((double)HD);
    o.assign((size_t)B * T * NH * HD, 0);
    dq.assign(o.size(), 0);
    dk.assign((size_t)B * T * NKV * HD, 0);
    dv.assign(dk.size(), 0);
    lse.assign((size_t)B * NH * T, 0);
    dsink.assign(NH, 0);
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
static double rel_err_f(const std::vector<float>& got, const std::vector<double>& want, bool* nan) {
    if (want.empty()) return 0;
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        if (!std::isfinite(got[i])) *nan = true;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
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
// once per query head of the group) that hold at least one visible pair.
struct Walk {
    long long fwd = 0, dkdv = 0, dq = 0;
};
static Walk expected_walk(const Case& c, const Docs& docs) {
    const int T = c.T;
    auto any_visible = [&](int b, int i0, int ni, int j0, int nj) {
        for (int i = i0; i < std::min(T, i0 + ni); ++i)
            for (int j = j0; j < std::min(T, j0 + nj); ++j)
                if (visible(c, docs, b, i, j)) return true;
        return false;
    };
    Walk w;
    for (int b = 0; b < c.B; ++b) {
        for (int i0 = 0; i0 < T; i0 += 128)
            for (int j0 = 0; j0 < T; j0 += 64) w.fwd += any_visible(b, i0, 128, j0, 64) ? c.NH : 0;
        for (int i0 = 0; i0 < T; i0 += 64)
            for (int j0 = 0; j0 < T; j0 += 64) {
                const bool v = any_visible(b, i0, 64, j0, 64);
                w.dq += v ? c.NH : 0;
                w.dkdv += v ? c.NH : 0;  // NKV CTAs, each over the NH / NKV heads of its group
            }
    }
    return w;
}

// Warp mma instructions `f` issues.
static long long mmas(const std::function<void()>& f) {
    emu_mma_count = 0;
    f();
    return emu_mma_count.load();
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
        if (c.sinks)
            emu_launch({(unsigned)NH, 1, 1}, 128, 16, [&] {
                mt_flash_sink_grad(lse.data(), D.data(), sinks.data(), dsink.data(), B, T, NH);
            });
        return w;
    }

    // Each tiled kernel's mma instructions for one (CTA, tile) step: a 64-token sequence of one
    // head walks one tile in each.
    static Walk per_tile() {
        static const Walk once = [] {
            const Case c{1, 64, 1, 1, HD, false};
            const size_t n = (size_t)64 * HD;
            std::vector<u16> x(n, 0x3f80), o(n), dq(n), dk(n), dv(n);  // ones
            std::vector<float> lse(64), dsink;
            return run(c, x, x, x, x, Docs{}, {}, o, lse, dq, dk, dv, dsink);
        }();
        return once;
    }
};

template <int HD>
static bool run_case(const Case& c, std::mt19937& rng) {
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
    std::vector<double> ro, rl, rdq, rdk, rdv, rds;
    reference(c, q, k, v, dout, docs.lo, sinks, ro, rl, rdq, rdk, rdv, rds);

    std::vector<u16> o(nq, 0xffff), dq(nq, 0xffff), dk(nk, 0xffff), dv(nk, 0xffff);  // poisoned (NaN)
    std::vector<float> lse((size_t)B * NH * T, NAN), dsink(NH, NAN);
    const Walk got = Kernels<HD>::run(c, q, k, v, dout, docs, sinks, o, lse, dq, dk, dv, dsink);
    const Walk tile = Kernels<HD>::per_tile(), want = expected_walk(c, docs);
    // The forward's and dQ's steps are per query head; dK/dV's per query head of each group.
    const bool walk_ok = got.fwd == want.fwd * tile.fwd && got.dq == want.dq * tile.dq &&
                         got.dkdv == want.dkdv * tile.dkdv;

    bool nan = false;
    const double eo = rel_err(o, ro, &nan), el = rel_err_f(lse, rl, &nan), eq = rel_err(dq, rdq, &nan),
                 ek = rel_err(dk, rdk, &nan), ev = rel_err(dv, rdv, &nan);
    const double es = c.sinks ? rel_err_f(dsink, rds, &nan) : 0.0;
    const bool ok = !nan && walk_ok && eo < 1e-2 && el < 1e-4 && eq < 2e-2 && ek < 2e-2 && ev < 2e-2 && es < 2e-2;
    std::printf("%s B=%d T=%d NH=%d NKV=%d HD=%d docs=%d window=%d sinks=%d: rel err O %.2e LSE %.2e dQ %.2e dK "
                "%.2e dV %.2e dsink %.2e; tiles fwd %lld dkdv %lld dq %lld%s%s\n",
                ok ? "ok  " : "FAIL", B, T, NH, NKV, HD, (int)c.docs, c.window, (int)c.sinks, eo, el, eq, ek, ev, es,
                got.fwd / tile.fwd, got.dkdv / tile.dkdv, got.dq / tile.dq, walk_ok ? "" : " WRONG TILE WALK",
                nan ? " NaN" : "");
    if (!walk_ok)
        std::printf("     expected tiles fwd %lld dkdv %lld dq %lld\n", want.fwd, want.dkdv, want.dq);
    return ok;
}

int main() {
    std::mt19937 rng(1234);
    bool ok = true;
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
    std::printf(ok ? "all ok\n" : "FAILURES\n");
    return ok ? 0 : 1;
}

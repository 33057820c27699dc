// Checks kernels/cuda/flash_attn.cu on the CPU emulator (emu.h) against a float64 evaluation of
// attention: O, LSE, dQ, dK, dV for causal GQA attention with and without packed documents, head
// dims 16..128, lengths that are and are not multiples of the tiles. Build and run:
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
};

// Reference in float64 from the bf16 inputs.
static void reference(const Case& c, const std::vector<u16>& q, const std::vector<u16>& k,
                      const std::vector<u16>& v, const std::vector<u16>& dout, const std::vector<int>& lo,
                      std::vector<double>& o, std::vector<double>& lse, std::vector<double>& dq,
                      std::vector<double>& dk, std::vector<double>& dv) {
    const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HD = c.HD, G = NH / NKV;
    const double scale = 1.0 / std::sqrt((double)HD);
    o.assign((size_t)B * T * NH * HD, 0);
    dq.assign(o.size(), 0);
    dk.assign((size_t)B * T * NKV * HD, 0);
    dv.assign(dk.size(), 0);
    lse.assign((size_t)B * NH * T, 0);
    auto qi = [&](int b, int t, int h, int d) { return (((size_t)b * T + t) * NH + h) * HD + d; };
    auto ki = [&](int b, int t, int h, int d) { return (((size_t)b * T + t) * NKV + h) * HD + d; };
    std::vector<double> p(T), dp(T);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < NH; ++h) {
            const int kh = h / G;
            for (int i = 0; i < T; ++i) {
                const int j0 = lo.empty() ? 0 : lo[(size_t)b * T + i];
                double m = -INFINITY;
                for (int j = j0; j <= i; ++j) {
                    double s = 0;
                    for (int d = 0; d < HD; ++d) s += (double)bf(q[qi(b, i, h, d)]) * bf(k[ki(b, j, kh, d)]);
                    p[j] = s * scale;
                    m = std::max(m, p[j]);
                }
                double z = 0;
                for (int j = j0; j <= i; ++j) z += std::exp(p[j] - m);
                lse[((size_t)b * NH + h) * T + i] = m + std::log(z);
                for (int j = j0; j <= i; ++j) p[j] = std::exp(p[j] - m) / z;
                for (int d = 0; d < HD; ++d) {
                    double acc = 0;
                    for (int j = j0; j <= i; ++j) acc += p[j] * bf(v[ki(b, j, kh, d)]);
                    o[qi(b, i, h, d)] = acc;
                }
                // backward
                double Dd = 0;
                for (int d = 0; d < HD; ++d) Dd += (double)bf(dout[qi(b, i, h, d)]) * o[qi(b, i, h, d)];
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
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        if (!std::isfinite(got[i])) *nan = true;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

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
    std::vector<int> lo, hi;
    if (c.docs) {
        lo.resize((size_t)B * T);
        hi.resize((size_t)B * T);
        std::uniform_int_distribution<int> len(1, std::max(2, T / 3));
        for (int b = 0; b < B; ++b) {
            int s = 0;
            while (s < T) {
                const int e = std::min(T, s + len(rng));
                for (int t = s; t < e; ++t) lo[(size_t)b * T + t] = s, hi[(size_t)b * T + t] = e;
                s = e;
            }
        }
    }
    std::vector<double> ro, rl, rdq, rdk, rdv;
    reference(c, q, k, v, dout, lo, ro, rl, rdq, rdk, rdv);

    std::vector<u16> o(nq, 0xffff), dq(nq, 0xffff), dk(nk, 0xffff), dv(nk, 0xffff);  // poisoned (NaN)
    std::vector<float> lse((size_t)B * NH * T, NAN), D((size_t)B * NH * T, NAN);
    const float scale = 1.0f / std::sqrt((float)HD), sl2 = scale * MT_LOG2E;
    const int* plo = c.docs ? lo.data() : nullptr;
    const int* phi = c.docs ? hi.data() : nullptr;
    emu_launch({(unsigned)((T + 127) / 128), (unsigned)NH, (unsigned)B}, 128, (size_t)HD * 768, [&] {
        flash_fwd<HD>(q.data(), k.data(), v.data(), o.data(), lse.data(), plo, T, NH, NKV, sl2);
    });
    const long long rows = (long long)B * T * NH;
    emu_launch({(unsigned)((rows + 3) / 4), 1, 1}, 128, 0,
               [&] { mt_flash_bwd_dot(dout.data(), o.data(), D.data(), T, NH, HD, rows); });
    emu_launch({(unsigned)((T + 63) / 64), (unsigned)NKV, (unsigned)B}, 128, (size_t)HD * 768 + 1024, [&] {
        flash_bwd_dkdv<HD>(q.data(), k.data(), v.data(), dout.data(), lse.data(), D.data(), dk.data(), dv.data(),
                           plo, phi, T, NH, NKV, scale, sl2);
    });
    emu_launch({(unsigned)((T + 63) / 64), (unsigned)NH, (unsigned)B}, 128, (size_t)HD * 768, [&] {
        flash_bwd_dq<HD>(q.data(), k.data(), v.data(), dout.data(), lse.data(), D.data(), dq.data(), plo, T, NH,
                         NKV, scale, sl2);
    });
    bool nan = false;
    const double eo = rel_err(o, ro, &nan), el = rel_err_f(lse, rl, &nan), eq = rel_err(dq, rdq, &nan),
                 ek = rel_err(dk, rdk, &nan), ev = rel_err(dv, rdv, &nan);
    const bool ok = !nan && eo < 1e-2 && el < 1e-4 && eq < 2e-2 && ek < 2e-2 && ev < 2e-2;
    std::printf("%s B=%d T=%d NH=%d NKV=%d HD=%d docs=%d: rel err O %.2e LSE %.2e dQ %.2e dK %.2e dV %.2e%s\n",
                ok ? "ok  " : "FAIL", B, T, NH, NKV, HD, (int)c.docs, eo, el, eq, ek, ev, nan ? " NaN" : "");
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
    std::printf(ok ? "all ok\n" : "FAILURES\n");
    return ok ? 0 : 1;
}

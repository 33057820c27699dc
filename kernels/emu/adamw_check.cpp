// Checks kernels/cuda/adamw.cu's kernels for bf16 and 8-bit moments (mt_adamw_bf16, mt_adamw_q8) on the
// CPU emulator (emu.h) against mt-optim's host update: three steps of 845 parameters from
// integer-hash inputs, with the coefficients and stochastic-rounding keys below (the f32 bits and
// keys mt-optim derives for those steps: crates/optim/src/moments/tests.rs asserts they are), and
// the FNV-1a hashes of the final state and weights must be those the same test asserts for
// mt_optim::step_fused: bitwise the host's state. Build and run:
//   kernels/emu/run_adamw.sh
#include <math.h>

#include "emu.h"
#define __shared__ static
struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
struct float4 {
    float x, y, z, w;
};
#include "../cuda/common.cuh"
#include "../cuda/adamw.cu"

#include <cstdio>
#include <vector>

// crates/optim/src/moments/tests.rs: EMU_COEFFS (grad_scale, decay, lerp_small, lerp_coeff, beta2,
// one_minus_beta2, bc2_sqrt, eps, step_size, key of steps 1..=3) and EMU_HASHES.
static const unsigned COEFFS[3][10] = {
    {0x3f400000, 0x3f7ff972, 0x1, 0x3dcccccd, 0x3f7fbe77, 0x3a83126f, 0x3d0186e2, 0x322bcc77, 0x3c23d70a,
     0x155161c7},
    {0x3f400000, 0x3f7ff972, 0x1, 0x3dcccccd, 0x3f7fbe77, 0x3a83126f, 0x3d372205, 0x322bcc77, 0x3bac7692,
     0x4a65eeb5},
    {0x3f400000, 0x3f7ff972, 0x1, 0x3dcccccd, 0x3f7fbe77, 0x3a83126f, 0x3d603c29, 0x322bcc77, 0x3b71d48c,
     0xff484a82},
};
static const unsigned long long HASHES[4] = {0x8f0bfbc5c08d9afbull, 0xdd397977c89c4921ull, 0x21844c0e3b01a3f5ull,
                                            0xc8b5b10175621976ull};

static float input(unsigned i, unsigned salt) {
    return (float)(mix32((i * 2654435761u) ^ salt) >> 8) * (1.0f / 16777216.0f) - 0.5f;
}

static unsigned long long fnv1a(const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p;
    unsigned long long h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static size_t round4(size_t x) { return (x + 3) / 4 * 4; }

int main() {
    const long long n = 3 * 256 + 77;
    const size_t blocks = (n + 255) / 256;
    // StateDtype::state_words: the master, then each moment's moment_bytes / 4.
    const size_t words[2] = {(size_t)n + 2 * round4(2 * n) / 4, (size_t)n + 2 * (round4(n) + 4 * blocks) / 4};
    int failures = 0;
    for (int k = 0; k < 2; ++k) {
        std::vector<float> state(words[k], 0.0f);
        // Block 0's masters as small as their updates, so that every rounding of an update shows.
        for (long long i = 0; i < n; ++i) state[i] = input((unsigned)i, 99) * (i < 256 ? 2e-3f : 2.0f);
        std::vector<unsigned short> w(n, 0);
        std::vector<float> g(n);
        for (unsigned t = 1; t <= 3; ++t) {
            for (long long i = 0; i < n; ++i) {
                // Block 1 all zero, block 2 so small that its inverse steps are clamped.
                const float scale = i % 11 == 0 || i / 256 == 1 ? 0.0f
                                    : i / 256 == 2             ? 1e-36f
                                    : i % 7 == 0               ? 1e-6f
                                                               : 1e-2f;
                g[i] = input((unsigned)i, t) * scale;
            }
            const unsigned* c = COEFFS[t - 1];
            auto f = [&](int j) { return __uint_as_float(c[j]); };
            const unsigned long long w_out = (unsigned long long)w.data();
            if (k == 0)
                emu_launch({2, 1, 1}, 256, 0, [&] {
                    mt_adamw_bf16(state.data(), g.data(), n, f(0), f(1), (int)c[2], f(3), f(4), f(5), f(6), f(7), f(8),
                                  c[9], w_out);
                });
            else
                emu_launch({(unsigned)blocks, 1, 1}, 256, 0, [&] {
                    mt_adamw_q8(state.data(), g.data(), n, f(0), f(1), (int)c[2], f(3), f(4), f(5), f(6), f(7), f(8),
                                c[9], w_out);
                });
        }
        const unsigned long long hs = fnv1a(state.data(), state.size() * 4), hw = fnv1a(w.data(), w.size() * 2);
        const char* name = k == 0 ? "mt_adamw_bf16" : "mt_adamw_q8";
        const bool ok = hs == HASHES[2 * k] && hw == HASHES[2 * k + 1];
        printf("%s: state %#llx, weights %#llx: %s\n", name, hs, hw, ok ? "bitwise the host's" : "DIFFERS from the host's");
        failures += !ok;
    }
    return failures ? 1 : 0;
}

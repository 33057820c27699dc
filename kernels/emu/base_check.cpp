// Checks kernels/cuda/base.cu's dequantisation kernels (mt_base_decode_bf16, mt_base_decode_f32)
// on the CPU emulator (emu.h) against mt-store's reference decoding: a segment of five blocks in
// each code (fp32, bf16, int8, NF4), values and codes from an integer hash, scales of several
// magnitudes, decoded into f32 and bf16 by a grid smaller than the segment (so the grid stride is
// taken); the FNV-1a hashes of the outputs must be those crates/store/src/base/codec/tests.rs
// (`emulator_check_inputs_decode_to_its_hashes`) asserts for the reference. Build and run:
//   kernels/emu/run_base.sh
#include "emu.h"
#define __constant__ static
struct uint4 {
    unsigned x, y, z, w;
};
#include "../cuda/common.cuh"
#include "../cuda/base.cu"

#include <cstdio>
#include <cstring>
#include <vector>

static unsigned emu_hash(unsigned x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}
static float emu_value(unsigned x) { return ((float)(emu_hash(x) >> 8) * (1.0f / 16777216.0f) - 0.5f) * 8.0f; }

static unsigned long long fnv1a(const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p;
    unsigned long long h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

template <typename T>
static void put(std::vector<unsigned char>& v, T x) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &x, sizeof(T));
    v.insert(v.end(), b, b + sizeof(T));
}

int main() {
    const int blocks = 5, n = blocks * MT_BASE_BLOCK;
    const int block_bytes[4] = {4 * 64, 2 * 64, 4 + 64, 4 + 32};
    std::vector<float> f32_out;
    std::vector<unsigned short> bf16_out;
    for (int c = 0; c < 4; ++c) {
        const unsigned salt = 1000u * c;
        std::vector<unsigned char> bytes;
        for (unsigned b = 0; b < (unsigned)blocks; ++b) {
            if (c == 0) {
                for (unsigned j = 0; j < 64; ++j) put(bytes, emu_value(salt + b * 64 + j));
            } else if (c == 1) {
                for (unsigned j = 0; j < 64; ++j) put(bytes, f2bf(emu_value(salt + b * 64 + j)));
            } else {
                const float scale = ((float)(emu_hash(salt + 7 * b) >> 8) * (1.0f / 16777216.0f) + 0.01f) *
                                    std::ldexp(1.0f, (int)b * 3 - 6);
                put(bytes, scale);
                for (unsigned j = 0; j < (unsigned)block_bytes[c] - 4; ++j)
                    bytes.push_back((unsigned char)emu_hash(salt + 500 + b * 64 + j));
            }
        }
        std::vector<float> f(n);
        std::vector<unsigned short> h(n);
        emu_launch({2, 1, 1}, 32, 0, [&] { mt_base_decode_f32(bytes.data(), f.data(), n, c); });
        emu_launch({3, 1, 1}, 32, 0, [&] { mt_base_decode_bf16(bytes.data(), h.data(), n, c); });
        f32_out.insert(f32_out.end(), f.begin(), f.end());
        bf16_out.insert(bf16_out.end(), h.begin(), h.end());
    }
    const unsigned long long hf = fnv1a(f32_out.data(), f32_out.size() * 4), hb = fnv1a(bf16_out.data(), bf16_out.size() * 2);
    const bool ok = hf == 0x29b5471567cf4c2eull && hb == 0xe7edaec4565de8aaull;
    printf("mt_base_decode_f32 %#llx, mt_base_decode_bf16 %#llx: %s\n", hf, hb,
           ok ? "bitwise the reference" : "DIFFER from the reference");
    return ok ? 0 : 1;
}

// A CPU emulator of the few CUDA features kernels/cuda/flash_attn.cu and moe.cu use, to check the kernels'
// logic (tiling, masks, packed documents, GQA, fragment layouts as the PTX ISA documents them)
// on a machine without a GPU. Every CUDA thread is an OS thread; a block's threads run together
// and meet at std::barrier for __syncthreads and for each warp-wide instruction (shuffle,
// ldmatrix, mma), which exchange their operands through per-warp scratch arrays exactly as the
// ISA's fragment tables say. cp.async copies synchronously. Slow, and for small shapes only.
//
// It is a development tool (kernels/emu/README.md), not a substitute for the GPU tests.
#pragma once
#define MT_EMU 1

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __align__(n)

struct dim3e {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3e threadIdx, blockIdx, blockDim, gridDim;

struct EmuBlock {
    std::vector<unsigned char> smem;
    std::barrier<> block_bar;
    std::vector<std::barrier<>*> warp_bar;
    // Warpgroups' (128 threads) barriers, for the warpgroup-wide instructions of emu_hopper.h.
    std::vector<std::barrier<>*> wg_bar;
    // Warpgroups 1 and 2 together (256 threads), for emu_hopper.h's named barriers.
    std::barrier<> pair_bar{256};
    // Per-warp scratch for warp-wide instructions.
    std::vector<std::array<float, 32>> f;
    std::vector<std::array<unsigned, 32 * 6>> u;
    explicit EmuBlock(int threads, size_t smem_bytes)
        : smem(smem_bytes + 16, 0xcd), block_bar(threads), f(threads / 32), u(threads / 32) {
        for (int w = 0; w < threads / 32; ++w) warp_bar.push_back(new std::barrier<>(32));
        for (int w = 0; w < threads / 128; ++w) wg_bar.push_back(new std::barrier<>(128));
    }
    ~EmuBlock() {
        for (auto* b : warp_bar) delete b;
        for (auto* b : wg_bar) delete b;
    }
};
inline thread_local EmuBlock* emu_block = nullptr;
#define MT_FA_SMEM (emu_block->smem.data())

inline unsigned lane_id() { return threadIdx.x & 31; }
inline unsigned warp_id() { return threadIdx.x >> 5; }
inline void warp_sync() { emu_block->warp_bar[warp_id()]->arrive_and_wait(); }
inline void __syncthreads() { emu_block->block_bar.arrive_and_wait(); }

inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    return x;
}
using std::max;
using std::min;

inline float __shfl_xor_sync(unsigned, float v, int m) {
    auto& s = emu_block->f[warp_id()];
    s[lane_id()] = v;
    warp_sync();
    float r = s[lane_id() ^ m];
    warp_sync();
    return r;
}

inline void __syncwarp(unsigned = 0xffffffffu) { warp_sync(); }

// A warp exchange of any value of up to 8 bytes: every lane gives `v`, gets lane `src`'s.
template <class T>
inline T emu_shfl(T v, unsigned src) {
    static_assert(sizeof(T) <= 8);
    auto& s = emu_block->u[warp_id()];
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    s[lane_id()] = (unsigned)b;
    s[32 + lane_id()] = (unsigned)(b >> 32);
    warp_sync();
    const unsigned long long r = s[src] | ((unsigned long long)s[32 + src] << 32);
    warp_sync();
    T out;
    std::memcpy(&out, &r, sizeof(T));
    return out;
}
inline double __shfl_sync(unsigned, double v, int src) { return emu_shfl(v, (unsigned)src); }
inline int __shfl_sync(unsigned, int v, int src) { return emu_shfl(v, (unsigned)src); }
// Lane l gets lane l - d's value (its own where l < d).
inline int __shfl_up_sync(unsigned, int v, unsigned d) { return emu_shfl(v, lane_id() >= d ? lane_id() - d : lane_id()); }
// Bit l: lane l's predicate.
inline unsigned __ballot_sync(unsigned, int pred) {
    auto& s = emu_block->u[warp_id()];
    s[lane_id()] = pred ? 1u : 0u;
    warp_sync();
    unsigned m = 0;
    for (unsigned l = 0; l < 32; ++l) m |= s[l] << l;
    warp_sync();
    return m;
}
inline unsigned long long __shfl_xor_sync(unsigned, unsigned long long v, int m) {
    return emu_shfl(v, lane_id() ^ (unsigned)m);
}
// The lanes whose `v` equals this lane's.
inline unsigned __match_any_sync(unsigned, int v) {
    auto& s = emu_block->u[warp_id()];
    s[lane_id()] = (unsigned)v;
    warp_sync();
    unsigned m = 0;
    for (unsigned l = 0; l < 32; ++l) m |= (s[l] == (unsigned)v ? 1u : 0u) << l;
    warp_sync();
    return m;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline float __double2float_rz(double d) {
    float f = (float)d;
    if (std::fabs((double)f) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    return f;
}

inline unsigned smem_addr(const void* p) { return (unsigned)((const unsigned char*)p - emu_block->smem.data()); }
inline unsigned short smem_u16(unsigned addr) {
    unsigned short v;
    std::memcpy(&v, emu_block->smem.data() + addr, 2);
    return v;
}
inline void cp_async16(unsigned dst, const void* src, int bytes) {
    unsigned char* d = emu_block->smem.data() + dst;
    if (bytes == 16)
        std::memcpy(d, src, 16);
    else
        std::memset(d, 0, 16);
}
inline void cp_async4(unsigned dst, const void* src, int bytes) {
    unsigned char* d = emu_block->smem.data() + dst;
    if (bytes == 4)
        std::memcpy(d, src, 4);
    else
        std::memset(d, 0, 4);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {}
template <int N>
inline void cp_async_wait() {}

// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i; register i of lane l holds
// row l/4, columns 2(l%4), 2(l%4)+1 of matrix i (.trans: rows 2(l%4), 2(l%4)+1 of column l/4).
inline void ldsm_common(unsigned* r, unsigned addr, bool trans) {
    auto& s = emu_block->u[warp_id()];
    const unsigned l = lane_id();
    s[l] = addr;
    warp_sync();
    for (int i = 0; i < 4; ++i) {
        unsigned short e[2];
        for (int k = 0; k < 2; ++k) {
            if (!trans)
                e[k] = smem_u16(s[8 * i + l / 4] + 2 * (2 * (l % 4) + k));
            else
                e[k] = smem_u16(s[8 * i + 2 * (l % 4) + k] + 2 * (l / 4));
        }
        r[i] = (unsigned)e[0] | ((unsigned)e[1] << 16);
    }
    warp_sync();
}
inline void ldsm_x4(unsigned* r, unsigned addr) { ldsm_common(r, addr, false); }
inline void ldsm_x4_t(unsigned* r, unsigned addr) { ldsm_common(r, addr, true); }

inline float bf_lo(unsigned x) { return __uint_as_float((x & 0xffffu) << 16); }
inline float bf_hi(unsigned x) { return __uint_as_float(x & 0xffff0000u); }

// Warp-wide mma instructions issued since the last reset: a check counts the work a launch does
// (which tiles a kernel walks), not only what it computes.
inline std::atomic<long long> emu_mma_count{0};

// mma.m16n8k16 (bf16 in, f32 accumulate). Lane l (g = l/4, t = l%4): a0 = A[g][2t..], a1 =
// A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..][g], b1 = B[2t+8..][g];
// c0, c1 = C[g][2t], C[g][2t+1]; c2, c3 = C[g+8][2t], C[g+8][2t+1].
inline void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    auto& s = emu_block->u[warp_id()];
    const unsigned l = lane_id();
    if (l == 0) emu_mma_count.fetch_add(1, std::memory_order_relaxed);
    for (int i = 0; i < 4; ++i) s[32 + 4 * l + i] = a[i];
    s[32 * 5 + l] = b0;  // 32*5 .. 32*6
    s[l] = b1;
    warp_sync();
    float A[16][16], B[16][8];
    for (unsigned L = 0; L < 32; ++L) {
        const unsigned g = L / 4, t = L % 4;
        const unsigned* ar = &s[32 + 4 * L];
        A[g][2 * t] = bf_lo(ar[0]);
        A[g][2 * t + 1] = bf_hi(ar[0]);
        A[g + 8][2 * t] = bf_lo(ar[1]);
        A[g + 8][2 * t + 1] = bf_hi(ar[1]);
        A[g][2 * t + 8] = bf_lo(ar[2]);
        A[g][2 * t + 9] = bf_hi(ar[2]);
        A[g + 8][2 * t + 8] = bf_lo(ar[3]);
        A[g + 8][2 * t + 9] = bf_hi(ar[3]);
        B[2 * t][g] = bf_lo(s[32 * 5 + L]);
        B[2 * t + 1][g] = bf_hi(s[32 * 5 + L]);
        B[2 * t + 8][g] = bf_lo(s[L]);
        B[2 * t + 9][g] = bf_hi(s[L]);
    }
    warp_sync();
    const unsigned g = l / 4, t = l % 4;
    for (int e = 0; e < 4; ++e) {
        const unsigned row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        double acc = c[e];
        for (int k = 0; k < 16; ++k) acc += (double)A[row][k] * (double)B[k][col];
        c[e] = (float)acc;
    }
}

inline unsigned short emu_f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
inline unsigned pack_bf16(float lo, float hi) { return (unsigned)emu_f2bf(lo) | ((unsigned)emu_f2bf(hi) << 16); }
inline float fast_exp2(float x) { return std::exp2(x); }
inline float quad_max(float v) {
    v = std::fmax(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return std::fmax(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
inline float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Runs `kernel` over `grid` blocks of `threads` threads with `smem` bytes of dynamic shared memory.
inline void emu_launch(dim3e grid, int threads, size_t smem, const std::function<void()>& kernel) {
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                EmuBlock blk(threads, smem);
                std::vector<std::thread> ts;
                for (int t = 0; t < threads; ++t)
                    ts.emplace_back([&, t] {
                        emu_block = &blk;
                        threadIdx = {(unsigned)t, 0, 0};
                        blockIdx = {x, y, z};
                        blockDim = {(unsigned)threads, 1, 1};
                        gridDim = grid;
                        kernel();
                    });
                for (auto& th : ts) th.join();
            }
}

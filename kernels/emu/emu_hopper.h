// The Hopper features kernels/cuda/hopper.cuh wraps, emulated on the CPU for kernels/emu (after
// emu.h): mbarriers (arrivals counted per phase, waits on a phase's parity), wgmma from shared
// memory through 128-byte-swizzled descriptors (kernels/cuda/hopper.cuh's desc_sw128), and the
// fences, setmaxnreg and wgmma groups as no-ops. A wgmma runs when it is issued and reads shared
// memory then, so an early "stage free" arrival is not caught here; the layouts, descriptors,
// accumulator fragments and the barriers' phase logic are.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>

// An mbarrier's 8 bytes of shared memory: bits 0-31 the arrivals the current phase still
// expects, bits 32-62 the arrivals of a phase, bit 63 the current phase's parity.
inline std::atomic_ref<unsigned long long> emu_mbar(unsigned bar) {
    return std::atomic_ref<unsigned long long>(*reinterpret_cast<unsigned long long*>(emu_block->smem.data() + bar));
}
inline void mbar_init(unsigned bar, unsigned count) {
    emu_mbar(bar).store(((unsigned long long)count << 32) | count);
}
inline void mbar_arrive(unsigned bar) {
    auto b = emu_mbar(bar);
    unsigned long long old = b.load(), next;
    do {
        const unsigned left = (unsigned)old - 1u;
        const unsigned long long count = (old >> 32) & 0x7fffffffull;
        next = left == 0 ? ((~old) & (1ull << 63)) | (count << 32) | count : (old & ~0xffffffffull) | left;
    } while (!b.compare_exchange_weak(old, next));
}
// Returns once the phase of this parity has completed: the current phase has the other parity.
inline void mbar_wait(unsigned bar, unsigned parity) {
    while ((unsigned)(emu_mbar(bar).load() >> 63) == (parity & 1u)) std::this_thread::yield();
}
inline void fence_barrier_init() {}
inline void fence_async_shared() {}
template <int N>
inline void setmaxnreg_inc() {}
template <int N>
inline void setmaxnreg_dec() {}
// wgmma.fence and wgmma.wait_group are warpgroup-wide (.sync.aligned): the warpgroup's threads
// meet there, so that no thread runs past a wait (and, say, frees a stage) while another of its
// warpgroup is still in the products it waits for.
inline void wg_sync() { emu_block->wg_bar[threadIdx.x / 128]->arrive_and_wait(); }
inline void wg_fence() { wg_sync(); }
// A named barrier: only a warpgroup's own (128 threads) is emulated.
inline void named_sync(int, int count) {
    if (count != 128) {
        std::fprintf(stderr, "named barrier emulation: only a warpgroup's 128 threads\n");
        std::abort();
    }
    wg_sync();
}
inline void wg_commit() {}
template <int N>
inline void wg_wait() {
    wg_sync();
}
template <int N>
inline void fence_regs(float*) {}

// The bf16 at byte `addr` (before the swizzle) of a 128-byte-swizzled region: bits 4-6 of the
// address XOR bits 7-9.
inline float emu_sw128_at(unsigned addr) {
    return bf_lo(smem_u16(addr ^ (((addr >> 7) & 7u) << 4)));
}
// A descriptor's start, leading and stride byte offsets (desc_sw128's fields).
struct EmuDesc {
    unsigned start, lbo, sbo;
};
inline EmuDesc emu_desc(unsigned long long d) {
    if (((d >> 62) & 3u) != 1u) {
        std::fprintf(stderr, "wgmma emulation: only the 128-byte swizzle is emulated\n");
        std::abort();
    }
    return {(unsigned)(d & 0x3fffu) << 4, (unsigned)((d >> 16) & 0x3fffu) << 4, (unsigned)((d >> 32) & 0x3fffu) << 4};
}
// Element (row r, k) of a K-major operand (rows of 128 bytes, 8-row groups sbo apart), k < 16.
inline float emu_kmajor(const EmuDesc& d, int r, int k) {
    return emu_sw128_at(d.start + (unsigned)(r / 8) * d.sbo + (unsigned)(r % 8) * 128u + 2u * (unsigned)k);
}
// Element (k, column n) of an MN-major operand (k rows of 64 columns, 128 bytes; 64-column blocks
// lbo apart, 8-row groups sbo apart), k < 16.
inline float emu_mnmajor(const EmuDesc& d, int k, int n) {
    return emu_sw128_at(d.start + (unsigned)(n / 64) * d.lbo + (unsigned)(k / 8) * d.sbo + (unsigned)(k % 8) * 128u +
                        2u * (unsigned)(n % 64));
}

// D[64 x N] (+)= A[64 x 16] B[16 x N], both from shared memory: A K-major (TA 0: its rows are the
// 64 rows) or MN-major (TA 1); B K-major (TB 0: its rows are the N columns) or MN-major (TB 1).
// Thread t of the warpgroup (warp w = t / 32, lane l) holds rows 16 w + l / 4 + 8 i, columns
// 8 j + 2 (l mod 4) + e at d[4 j + 2 i + e].
template <int N, int TA, int TB>
inline void wgmma_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    const EmuDesc a = emu_desc(da), b = emu_desc(db);
    const int t = (int)(threadIdx.x & 127u), w = t / 32, l = t % 32;
    for (int j = 0; j < N / 8; ++j)
        for (int i = 0; i < 2; ++i)
            for (int e = 0; e < 2; ++e) {
                const int row = 16 * w + l / 4 + 8 * i, col = 8 * j + 2 * (l % 4) + e;
                double s = accumulate ? d[4 * j + 2 * i + e] : 0.0;
                for (int k = 0; k < 16; ++k)
                    s += (double)(TA ? emu_mnmajor(a, k, row) : emu_kmajor(a, row, k)) *
                         (double)(TB ? emu_mnmajor(b, k, col) : emu_kmajor(b, col, k));
                d[4 * j + 2 * i + e] = (float)s;
            }
}

// The Hopper features kernels/cuda/hopper.cuh wraps, emulated on the CPU for kernels/emu (after
// emu.h): mbarriers (arrivals and the copy engine's bytes counted per phase, waits on a phase's
// parity), TMA tensor loads into 128-byte-swizzled shared memory (MtTmaMap here is a plain
// description of a packed 4-d bf16 tensor, not the driver's opaque one), the bulk f32 reduce-add,
// acquire loads and release adds, named barriers, wgmma from shared memory through 128-byte-
// swizzled descriptors (kernels/cuda/hopper.cuh's desc_sw128) and with A from registers, and the
// fences, setmaxnreg and wgmma and bulk groups as no-ops. A wgmma or a copy runs when it is issued
// and reads memory then, so an early "stage free" arrival is not caught here; the layouts,
// descriptors, accumulator fragments, the barriers' phase logic and the dQ turn order are.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>

// An mbarrier's 8 bytes of shared memory: bits 0-15 the arrivals the current phase still
// expects, bits 16-31 the arrivals of a phase, bits 32-62 the bytes the phase still expects from
// the copy engine, bit 63 the current phase's parity. A phase completes when both are zero.
inline std::atomic_ref<unsigned long long> emu_mbar(unsigned bar) {
    return std::atomic_ref<unsigned long long>(*reinterpret_cast<unsigned long long*>(emu_block->smem.data() + bar));
}
inline void mbar_init(unsigned bar, unsigned count) {
    if (count == 0 || count > 0xffffu) {
        std::fprintf(stderr, "mbarrier emulation: %u arrivals\n", count);
        std::abort();
    }
    emu_mbar(bar).store(((unsigned long long)count << 16) | count);
}
// `arrivals` arrivals and `tx` more (positive) or fewer (negative) expected bytes, in one step.
inline void emu_mbar_update(unsigned bar, unsigned arrivals, long long tx) {
    auto b = emu_mbar(bar);
    unsigned long long old = b.load(), next;
    do {
        const unsigned left = (unsigned)(old & 0xffffu), count = (unsigned)((old >> 16) & 0xffffu);
        const long long bytes = (long long)((old >> 32) & 0x7fffffffull) + tx;
        if (left < arrivals || bytes < 0 || bytes > 0x7fffffffll) {
            std::fprintf(stderr, "mbarrier emulation: more arrivals or bytes than the phase expects\n");
            std::abort();
        }
        const unsigned long long parity = old & (1ull << 63);
        if (left == arrivals && bytes == 0)
            next = (parity ^ (1ull << 63)) | ((unsigned long long)count << 16) | count;
        else
            next = parity | ((unsigned long long)bytes << 32) | ((unsigned long long)count << 16) | (left - arrivals);
    } while (!b.compare_exchange_weak(old, next));
}
inline void mbar_arrive(unsigned bar) { emu_mbar_update(bar, 1, 0); }
inline void mbar_expect_tx(unsigned bar, unsigned bytes) { emu_mbar_update(bar, 1, bytes); }
inline void mbar_expect_tx_only(unsigned bar, unsigned bytes) { emu_mbar_update(bar, 0, bytes); }
// Returns once the phase of this parity has completed: the current phase has the other parity.
inline void mbar_wait(unsigned bar, unsigned parity) {
    while ((unsigned)(emu_mbar(bar).load() >> 63) == (parity & 1u)) std::this_thread::yield();
}
inline void fence_barrier_init() {}
inline void fence_async_shared() {}
inline void fence_async_global() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// The 4-d bf16 tensor {d0 (innermost), d1, d2, d3}, packed, that a TMA load reads boxes of
// {64, 1, rows, 1} from (kernels/src/ops/flash_hopper.rs's tensor_map, described plainly).
struct MtTmaMap {
    const unsigned short* base;
    int dims[4];
    int rows;
};
// The byte of a 128-byte-swizzled region (1024-byte aligned) where the byte at `addr` lives.
inline unsigned emu_sw128(unsigned addr) { return addr ^ (((addr >> 7) & 7u) << 4); }
// Box {c0 .. c0+63, c1, c2 .. c2+rows-1, c3} -> shared memory at dst, 128-byte swizzled, zeros
// outside the tensor; then the box's bytes complete on `bar`.
inline void tma_load_4d(unsigned dst, const MtTmaMap* map, int c0, int c1, int c2, int c3, unsigned bar) {
    const int* d = map->dims;
    for (int r = 0; r < map->rows; ++r)
        for (int e = 0; e < 64; ++e) {
            const int x = c0 + e, z = c2 + r;
            const bool in = x >= 0 && x < d[0] && c1 >= 0 && c1 < d[1] && z >= 0 && z < d[2] && c3 >= 0 && c3 < d[3];
            const unsigned short v = in ? map->base[(((long long)c3 * d[2] + z) * d[1] + c1) * d[0] + x] : 0;
            std::memcpy(emu_block->smem.data() + emu_sw128(dst + (unsigned)r * 128u + 2u * (unsigned)e), &v, 2);
        }
    emu_mbar_update(bar, 0, -(long long)map->rows * 128);
}
// global[dst ..) += shared[src ..) as f32, each add atomic; synchronous, so the groups' waits are
// no-ops.
inline void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
    for (unsigned i = 0; i < bytes / 4; ++i) {
        float v;
        std::memcpy(&v, emu_block->smem.data() + src + 4 * i, 4);
        std::atomic_ref<float>(dst[i]).fetch_add(v);
    }
}
inline void bulk_store(void* dst, unsigned src, unsigned bytes) {
    std::memcpy(dst, emu_block->smem.data() + src, bytes);
}
inline void bulk_commit() {}
inline void bulk_wait_all() {}
inline void bulk_wait_all_but_one() {}
inline void bulk_wait_read() {}
inline int ld_acquire(const int* p) { return std::atomic_ref<int>(*const_cast<int*>(p)).load(std::memory_order_acquire); }
inline void red_release_add(int* p, int v) { std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_release); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned launder(unsigned x) { return x; }
inline void st_shared_u32(unsigned addr, unsigned v) { std::memcpy(emu_block->smem.data() + addr, &v, 4); }
inline bool __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
template <int N>
inline void setmaxnreg_inc() {}
template <int N>
inline void setmaxnreg_dec() {}
// wgmma.fence and wgmma.wait_group are warpgroup-wide (.sync.aligned): the warpgroup's threads
// meet there, so that no thread runs past a wait (and, say, frees a stage) while another of its
// warpgroup is still in the products it waits for.
inline void wg_sync() { emu_block->wg_bar[threadIdx.x / 128]->arrive_and_wait(); }
inline void wg_fence() { wg_sync(); }
// A named barrier: a warpgroup's own (128 threads), or 256 threads (the block's warpgroups 1 and
// 2, as the flash backward's two consumers use it).
inline void named_sync(int, int count) {
    if (count == 128) return wg_sync();
    if (count != 256 || threadIdx.x < 128) {
        std::fprintf(stderr, "named barrier emulation: a warpgroup's 128 threads or warpgroups 1 and 2\n");
        std::abort();
    }
    emu_block->pair_bar.arrive_and_wait();
}
inline void wg_commit() {}
template <int N>
inline void wg_wait() {
    wg_sync();
}
template <int N>
inline void fence_regs(float*) {}
template <int N>
inline void fence_regs(unsigned*) {}

// Warpgroup matrix products issued since the last reset (one per warpgroup-wide instruction): a
// check counts the tiles a launch walks.
inline std::atomic<long long> emu_wgmma_count{0};

// The bf16 at byte `addr` (before the swizzle) of a 128-byte-swizzled region: bits 4-6 of the
// address XOR bits 7-9.
inline float emu_sw128_at(unsigned addr) { return bf_lo(smem_u16(emu_sw128(addr))); }
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
// This thread's accumulators of D[64 x N] (+)= A B, element (row, k) of A and (k, col) of B
// from `a` and `b`; counts the instruction once per warpgroup.
template <int N, class FA, class FB>
inline void emu_wgmma(float* d, int accumulate, const FA& a, const FB& b) {
    const int t = (int)(threadIdx.x & 127u), w = t / 32, l = t % 32;
    if (t == 0) emu_wgmma_count.fetch_add(1, std::memory_order_relaxed);
    for (int j = 0; j < N / 8; ++j)
        for (int i = 0; i < 2; ++i)
            for (int e = 0; e < 2; ++e) {
                const int row = 16 * w + l / 4 + 8 * i, col = 8 * j + 2 * (l % 4) + e;
                double s = accumulate ? d[4 * j + 2 * i + e] : 0.0;
                for (int k = 0; k < 16; ++k) s += (double)a(row, k) * (double)b(k, col);
                d[4 * j + 2 * i + e] = (float)s;
            }
}
template <int N, int TA, int TB>
inline void wgmma_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    const EmuDesc a = emu_desc(da), b = emu_desc(db);
    emu_wgmma<N>(
        d, accumulate, [&](int row, int k) { return TA ? emu_mnmajor(a, k, row) : emu_kmajor(a, row, k); },
        [&](int k, int col) { return TB ? emu_mnmajor(b, k, col) : emu_kmajor(b, col, k); });
}

// D[64 x N] (+)= A[64 x 16] B[16 x N], A from registers (thread t's a[4]: bf16 pairs in the
// accumulator layout of two adjacent 8-column blocks: a[2 jb + i] holds row 16 w + l / 4 + 8 i,
// columns 8 jb + 2 (l mod 4) + {0, 1}), B from shared memory, K-major (TB 0) or MN-major (TB 1).
// The warpgroup's A goes through the warps' scratch arrays.
template <int N, int TB>
inline void wgmma_rs(float* d, const unsigned* a, unsigned long long db, int accumulate) {
    const EmuDesc b = emu_desc(db);
    const int t = (int)(threadIdx.x & 127u), w = t / 32, l = t % 32, wg0 = (int)(threadIdx.x / 128u) * 4;
    for (int k = 0; k < 4; ++k) emu_block->u[wg0 + w][4 * l + k] = a[k];
    wg_sync();
    float A[64][16];
    for (int ww = 0; ww < 4; ++ww)
        for (int ll = 0; ll < 32; ++ll)
            for (int jb = 0; jb < 2; ++jb)
                for (int i = 0; i < 2; ++i) {
                    const unsigned x = emu_block->u[wg0 + ww][4 * ll + 2 * jb + i];
                    const int row = 16 * ww + ll / 4 + 8 * i, col = 8 * jb + 2 * (ll % 4);
                    A[row][col] = bf_lo(x);
                    A[row][col + 1] = bf_hi(x);
                }
    wg_sync();
    emu_wgmma<N>(
        d, accumulate, [&](int row, int k) { return A[row][k]; },
        [&](int k, int col) { return TB ? emu_mnmajor(b, k, col) : emu_kmajor(b, col, k); });
}

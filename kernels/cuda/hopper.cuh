// Hopper (compute capability 9.0, `sm_90a`) PTX wrappers shared by the Hopper kernels
// (flash_attn_hopper.cu, moe_hopper.cu): mbarriers, TMA and bulk copies, proxy fences, named
// barriers, setmaxnreg, and wgmma (asynchronous warpgroup matrix multiply) with its shared-memory
// descriptors. Compiled after common.cuh and before the kernel file that uses it, into an sm_90a
// CUBIN. The CPU emulator (kernels/emu/emu.h, which defines MT_EMU) brings its own versions of
// the wrappers and shares only the descriptor arithmetic.
//
// Written from the PTX ISA.

// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands (contraction along the
// 128-byte rows): lbo unused (16), sbo = 1024 (8 rows); the k16 step inside a 64-element chunk
// moves the start by 32 bytes, the next chunk by its size. MN-major operands (contraction down
// the rows): lbo = bytes from one 64-element chunk to the next along M/N, sbo = 1024; the k16 step
// moves the start by 16 rows (2048 bytes).
__device__ __forceinline__ unsigned long long desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

#ifndef MT_EMU
// A CUtensorMap: 128 opaque bytes made by cuTensorMapEncodeTiled on the host, passed by value.
struct __align__(64) MtTmaMap {
    unsigned long long w[16];
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also tells the barrier to expect `bytes` more from the copy engine.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Tells the barrier to expect `bytes` more from the copy engine, without arriving.
__device__ __forceinline__ void mbar_expect_tx_only(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// Box {c0 .. c0+63, c1, c2 .. c2+rows-1, c3} of a 4-d tensor map -> shared memory at dst
// (1024-byte aligned), completion counted on `bar`. Elements outside the tensor read as zero.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const MtTmaMap* map, int c0, int c1, int c2, int c3,
                                            unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
// global[dst .. dst + bytes) += shared[src ..) as f32, element by element (each add atomic).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
// global[dst .. dst + bytes) = shared[src ..) (a plain bulk copy, the same groups as the reduce).
__device__ __forceinline__ void bulk_store(void* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until every committed bulk operation of this thread has completed (writes performed);
// all but the newest; until every one has finished reading its source.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all_but_one() {
    asm volatile("cp.async.bulk.wait_group 1;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Orders this thread's ordinary shared-memory writes before later async-proxy (wgmma, TMA) reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Orders generic-proxy and async-proxy accesses to global memory (the dQ buffer and its counters).
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Named barrier over `count` threads (barrier 0 is __syncthreads): wait, or arrive only.
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// A 4-byte store to shared memory at a 32-bit shared-window address.
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// The value, opaque to the compiler: what is computed from it is recomputed where it is used
// instead of being kept in a register across a loop.
__device__ __forceinline__ unsigned launder(unsigned x) {
    asm volatile("" : "+r"(x));
    return x;
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// wgmma: a warpgroup's asynchronous 64 x N x 16 product. `wg_fence` before the first of a batch
// (registers it reads or accumulates were written by ordinary instructions), `wg_commit` closes a
// group, `wg_wait<N>` returns once at most N groups are in flight. The accumulators are asm
// operands, so the compiler believes them final right after the mma: `fence_regs` after each wait
// (and before each issue) pins every later use behind the wait.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(unsigned* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#define MT_ACC8(a, i) \
    "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3]), "+f"(a[i + 4]), "+f"(a[i + 5]), "+f"(a[i + 6]), "+f"(a[i + 7])
#define MT_ACC16(a) MT_ACC8(a, 0), MT_ACC8(a, 8)
#define MT_ACC32(a) MT_ACC8(a, 0), MT_ACC8(a, 8), MT_ACC8(a, 16), MT_ACC8(a, 24)
#define MT_ACC64(a)                                                                                            \
    MT_ACC8(a, 0), MT_ACC8(a, 8), MT_ACC8(a, 16), MT_ACC8(a, 24), MT_ACC8(a, 32), MT_ACC8(a, 40), MT_ACC8(a, 48), \
        MT_ACC8(a, 56)
#define MT_ACC128(a)                                                                                          \
    MT_ACC8(a, 0), MT_ACC8(a, 8), MT_ACC8(a, 16), MT_ACC8(a, 24), MT_ACC8(a, 32), MT_ACC8(a, 40), MT_ACC8(a, 48), \
        MT_ACC8(a, 56), MT_ACC8(a, 64), MT_ACC8(a, 72), MT_ACC8(a, 80), MT_ACC8(a, 88), MT_ACC8(a, 96),         \
        MT_ACC8(a, 104), MT_ACC8(a, 112), MT_ACC8(a, 120)

// Accumulator layout of every m64nN product (f32, N / 2 registers a thread): thread t of the
// warpgroup (warp w = t / 32, lane l) holds rows 16 w + l / 4 + 8 i (i = 0, 1) and columns
// 8 j + 2 (l mod 4) + e (e = 0, 1) at register 4 j + 2 i + e. The A operand from registers (four
// bf16 pairs a thread for 64 x 16) has the layout of two adjacent 8-column blocks of it.
// D[64 x 256] (+)= A[64 x 16] B[16 x 256], both from shared memory (descriptors).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n256(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, %131, %132;\n}\n"
        : MT_ACC128(d)
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], both from shared memory (descriptors).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n128(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        : MT_ACC64(d)
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A from registers (a[4], bf16 pairs), B from shared memory.
template <int TB>
__device__ __forceinline__ void wgmma_rs_n128(float* d, const unsigned* a, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : MT_ACC64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(TB));
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], both from shared memory (descriptors).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n64(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : MT_ACC32(d)
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A from registers (a[4], bf16 pairs), B from shared memory.
template <int TB>
__device__ __forceinline__ void wgmma_rs_n64(float* d, const unsigned* a, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : MT_ACC32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(TB));
}

// D[64 x 32] (+)= A[64 x 16] B[16 x 32], both from shared memory (descriptors).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n32(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, %19, %20;\n}\n"
        : MT_ACC16(d)
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

// D[64 x 32] (+)= A[64 x 16] B[16 x 32], A from registers (a[4], bf16 pairs), B from shared memory.
template <int TB>
__device__ __forceinline__ void wgmma_rs_n32(float* d, const unsigned* a, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
        : MT_ACC16(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(TB));
}

template <int N, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    static_assert(N == 256 || N == 128 || N == 64 || N == 32, "wgmma_ss: N is 32, 64, 128 or 256");
    if constexpr (N == 256) wgmma_ss_n256<TA, TB>(d, da, db, accumulate);
    else if constexpr (N == 128) wgmma_ss_n128<TA, TB>(d, da, db, accumulate);
    else if constexpr (N == 64) wgmma_ss_n64<TA, TB>(d, da, db, accumulate);
    else wgmma_ss_n32<TA, TB>(d, da, db, accumulate);
}
template <int N, int TB>
__device__ __forceinline__ void wgmma_rs(float* d, const unsigned* a, unsigned long long db, int accumulate) {
    static_assert(N == 128 || N == 64 || N == 32, "wgmma_rs: N is 32, 64 or 128");
    if constexpr (N == 128) wgmma_rs_n128<TB>(d, a, db, accumulate);
    else if constexpr (N == 64) wgmma_rs_n64<TB>(d, a, db, accumulate);
    else wgmma_rs_n32<TB>(d, a, db, accumulate);
}
#endif  // MT_EMU

// Device helpers shared by every kernel file. Each kernels/cuda/*.cu is compiled as its own NVRTC
// module without CUDA headers; kernels/src/ops/nvrtc.rs (`Source::ptx`) prepends this
// file to each source, so a helper is written once and every module has the same one.
//
// bf16 is handled as its bit pattern (unsigned short).

// bf16 -> f32 (exact).
__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }

// f32 -> bf16, round to nearest even; a NaN stays a quiet NaN with its sign and top payload bits
// (as half's bf16::from_f32, candle's CPU cast, and mt-optim's cast).
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Rounds an f32 through bf16 (what a candle op that writes bf16 does to its result).
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }

// silu(g) rounded to bf16, as candle's `silu` on a bf16 tensor.
__device__ __forceinline__ float silu_bf(float g) { return rbf(g / (1.0f + expf(-g))); }

// SwiGLU's two gradients at one element for d = dL/d(mid), mid = bf16(bf16(silu(g)) u), with the
// bf16 roundings of the candle sequence: d_gate = bf16(bf16(d u) bf16(silu'(g))),
// d_up = bf16(d bf16(silu(g))).
__device__ __forceinline__ void swiglu_grads(float d, float g, float u, unsigned short* dg, unsigned short* du) {
    const float s = 1.0f / (1.0f + expf(-g));
    const float sg = rbf(s * ((g * (1.0f - s)) + 1.0f));
    *dg = f2bf(rbf(d * u) * sg);
    *du = f2bf(d * silu_bf(g));
}

// The eight bf16 values of a 16-byte group, widened to f32.
__device__ __forceinline__ void unpack8(uint4 u, float* out) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        out[2 * e] = bf2f((unsigned short)(w[e] & 0xffffu));
        out[2 * e + 1] = bf2f((unsigned short)(w[e] >> 16));
    }
}

// A thread's N 16-byte groups g0, g0 + step, ... of a row of n groups, all loads issued before any
// is used (those past the row's end are left untouched).
template <int N>
__device__ __forceinline__ void load_groups(const uint4* __restrict__ p, int g0, int step, int n, uint4* u) {
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (g0 + k * step < n) u[k] = p[g0 + k * step];
}

#ifndef MT_EMU
// --- PTX wrappers of sm_80 features (cp.async, ldmatrix, bf16 mma.sync) used by the tensor-core
// kernels (flash_attn.cu, moe.cu). The CPU emulator (kernels/emu/emu.h, which defines MT_EMU)
// brings its own.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// 16 bytes global -> shared, zero-filled past `bytes` (0 or 16).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// 4 bytes global -> shared, zero-filled past `bytes` (0 or 4).
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// c += a b: a 16x16 (row-major fragment), b 16x8 (column-major fragment), c 16x8 f32.
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two f32 -> one register of two bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

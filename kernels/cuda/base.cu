// Dequantisation of a LoRA run's frozen base into a weight slot: one segment of a unit's encoded
// record (whole blocks of 64 elements in one code, as mt-store's base/codec.rs defines them),
// decoded into the slot's elements, bf16 or f32. Launched on the H2D stream right after the
// encoded bytes' upload (kernels/src/ops/base.rs). Bitwise mt-store's `decode`: every value is one
// f32 multiply (or none), rounded once to the slot's dtype (f2bf: nearest even), and NVRTC runs
// with --fmad=false. Compiled at run time with NVRTC after common.cuh, no CUDA headers.
//
// Codes (mt_core::BaseCode, the `code` argument): 0 fp32 (4 bytes an element), 1 bf16 (2 bytes
// an element), 2 int8 ([f32 scale][64 signed bytes]: q * scale), 3 NF4 ([f32 absmax][32 bytes,
// element 2i in the low nibble of byte i]: NF4[idx] * absmax).

#define MT_BASE_BLOCK 64

// QLoRA's NF4 code as f32 bit patterns: mt_store::base_codec::NF4, ascending.
__constant__ unsigned mt_nf4_bits[16] = {0xbf800000u, 0xbf3239b1u, 0xbf066b2eu, 0xbeca329eu, 0xbe91a24bu, 0xbe3d353du,
                                         0xbdba7869u, 0x00000000u, 0x3da2fb01u, 0x3e24cadfu, 0x3e7c04dau, 0x3ead0336u,
                                         0x3ee1a4b5u, 0x3f1007a9u, 0x3f3913b0u, 0x3f800000u};

// Bytes of one block of `code` (mt_core::BaseCode::block_bytes).
__device__ __forceinline__ long long mt_base_block_bytes(int code) {
    return code == 0 ? 4 * MT_BASE_BLOCK : code == 1 ? 2 * MT_BASE_BLOCK : code == 2 ? 4 + MT_BASE_BLOCK : 4 + MT_BASE_BLOCK / 2;
}

// The value element i of the segment at `src` stands for.
__device__ __forceinline__ float mt_base_value(const unsigned char* __restrict__ src, long long i, int code) {
    const unsigned char* blk = src + (i / MT_BASE_BLOCK) * mt_base_block_bytes(code);
    const int j = (int)(i % MT_BASE_BLOCK);
    switch (code) {
        case 0:
            return ((const float*)blk)[j];
        case 1:
            return bf2f(((const unsigned short*)blk)[j]);
        case 2:
            return (float)(signed char)blk[4 + j] * ((const float*)blk)[0];
        default:
            return __uint_as_float(mt_nf4_bits[(blk[4 + j / 2] >> (4 * (j & 1))) & 15u]) * ((const float*)blk)[0];
    }
}

// n elements (whole blocks) of the segment at src into dst, as bf16.
extern "C" __global__ void mt_base_decode_bf16(const unsigned char* __restrict__ src, unsigned short* __restrict__ dst,
                                               long long n, int code) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = f2bf(mt_base_value(src, i, code));
}

// n elements (whole blocks) of the segment at src into dst, as f32.
extern "C" __global__ void mt_base_decode_f32(const unsigned char* __restrict__ src, float* __restrict__ dst, long long n,
                                              int code) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = mt_base_value(src, i, code);
}

//! The lane operations of the coded kernels for AVX-512F (16 lanes) and the kernels expanded
//! over them. Every function here is compiled for AVX-512F; `super` calls the kernels only
//! after `Isa::detect` found it.

use std::arch::x86_64::*;

/// Lanes of a vector.
const L: usize = 16;
/// f32 lanes.
type F = __m512;
/// i32 lanes (u32 where a comment says so).
type I = __m512i;
/// A lane mask.
type M = __mmask16;

#[inline]
#[target_feature(enable = "avx512f")]
fn splat(x: f32) -> F {
    _mm512_set1_ps(x)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn splat_i(x: u32) -> I {
    _mm512_set1_epi32(x as i32)
}

/// `0, 1, …, L − 1`.
#[inline]
#[target_feature(enable = "avx512f")]
fn iota() -> I {
    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn load(a: &[f32; L]) -> F {
    // SAFETY: `a` is 64 readable bytes; the load has no alignment requirement.
    unsafe { _mm512_loadu_ps(a.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn store(a: &mut [f32; L], x: F) {
    // SAFETY: `a` is 64 writable bytes, borrowed exclusively; no alignment requirement.
    unsafe { _mm512_storeu_ps(a.as_mut_ptr(), x) }
}

#[cfg(test)]
#[inline]
#[target_feature(enable = "avx512f")]
fn load_u32(a: &[u32; L]) -> I {
    // SAFETY: `a` is 64 readable bytes; the load has no alignment requirement.
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

/// Bytes sign-extended (`m`'s codes).
#[inline]
#[target_feature(enable = "avx512f")]
fn load_i8(a: &[u8; L]) -> I {
    // SAFETY: `a` is 16 readable bytes; the load has no alignment requirement.
    _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(a.as_ptr().cast()) })
}

/// Bytes zero-extended (`v`'s codes).
#[inline]
#[target_feature(enable = "avx512f")]
fn load_u8(a: &[u8; L]) -> I {
    // SAFETY: `a` is 16 readable bytes; the load has no alignment requirement.
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(a.as_ptr().cast()) })
}

#[inline]
#[target_feature(enable = "avx512f")]
fn load_u16(a: &[u16; L]) -> I {
    // SAFETY: `a` is 32 readable bytes; the load has no alignment requirement.
    _mm512_cvtepu16_epi32(unsafe { _mm256_loadu_si256(a.as_ptr().cast()) })
}

/// The low byte of each lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_u8(a: &mut [u8; L], x: I) {
    // SAFETY: `a` is 16 writable bytes, borrowed exclusively; no alignment requirement.
    unsafe { _mm_storeu_si128(a.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(x)) }
}

/// The low 16 bits of each lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_u16(a: &mut [u16; L], x: I) {
    // SAFETY: `a` is 32 writable bytes, borrowed exclusively; no alignment requirement.
    unsafe { _mm256_storeu_si256(a.as_mut_ptr().cast(), _mm512_cvtepi32_epi16(x)) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn add(a: F, b: F) -> F {
    _mm512_add_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn sub(a: F, b: F) -> F {
    _mm512_sub_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn mul(a: F, b: F) -> F {
    _mm512_mul_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn div(a: F, b: F) -> F {
    _mm512_div_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn sqrt(a: F) -> F {
    _mm512_sqrt_ps(a)
}

/// `vminps`: `b` where either is NaN.
#[inline]
#[target_feature(enable = "avx512f")]
fn min(a: F, b: F) -> F {
    _mm512_min_ps(a, b)
}

/// `vmaxps`: `b` where either is NaN.
#[inline]
#[target_feature(enable = "avx512f")]
fn max(a: F, b: F) -> F {
    _mm512_max_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn abs(a: F) -> F {
    _mm512_abs_ps(a)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn floor(a: F) -> F {
    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(a)
}

/// `1/√a` within `2⁻¹⁴` relative.
#[inline]
#[target_feature(enable = "avx512f")]
fn rsqrt_est(a: F) -> F {
    _mm512_rsqrt14_ps(a)
}

/// `1/a` within `2⁻¹⁴` relative.
#[inline]
#[target_feature(enable = "avx512f")]
fn rcp_est(a: F) -> F {
    _mm512_rcp14_ps(a)
}

/// The largest lane (no lane NaN).
#[inline]
#[target_feature(enable = "avx512f")]
fn hmax(a: F) -> f32 {
    _mm512_reduce_max_ps(a)
}

/// `a < b` (false where either is NaN).
#[inline]
#[target_feature(enable = "avx512f")]
fn lt(a: F, b: F) -> M {
    _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b)
}

/// `a <= b` (false where either is NaN).
#[inline]
#[target_feature(enable = "avx512f")]
fn le(a: F, b: F) -> M {
    _mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, b)
}

/// `m ? a : b`.
#[inline]
#[target_feature(enable = "avx512f")]
fn select(m: M, a: F, b: F) -> F {
    _mm512_mask_blend_ps(m, b, a)
}

/// `m ? a : b`.
#[inline]
#[target_feature(enable = "avx512f")]
fn select_i(m: M, a: I, b: I) -> I {
    _mm512_mask_blend_epi32(m, b, a)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn add_i(a: I, b: I) -> I {
    _mm512_add_epi32(a, b)
}

/// `a + 1` in the lanes of `m`.
#[inline]
#[target_feature(enable = "avx512f")]
fn inc_where(m: M, a: I) -> I {
    _mm512_mask_add_epi32(a, m, a, _mm512_set1_epi32(1))
}

/// `−a` in the lanes whose `x` has its sign bit set.
#[inline]
#[target_feature(enable = "avx512f")]
fn negate_where_negative(a: I, x: F) -> I {
    let neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(x), _mm512_setzero_si512());
    _mm512_mask_sub_epi32(a, neg, _mm512_setzero_si512(), a)
}

/// The low 32 bits of the product (wrapping).
#[inline]
#[target_feature(enable = "avx512f")]
fn mullo(a: I, b: I) -> I {
    _mm512_mullo_epi32(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn xor(a: I, b: I) -> I {
    _mm512_xor_si512(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn and(a: I, b: I) -> I {
    _mm512_and_si512(a, b)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn or(a: I, b: I) -> I {
    _mm512_or_si512(a, b)
}

/// Logical shift right.
#[inline]
#[target_feature(enable = "avx512f")]
fn srl<const N: u32>(a: I) -> I {
    _mm512_srli_epi32::<N>(a)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn sll<const N: u32>(a: I) -> I {
    _mm512_slli_epi32::<N>(a)
}

/// Signed `a > b`.
#[inline]
#[target_feature(enable = "avx512f")]
fn gt_i(a: I, b: I) -> M {
    _mm512_cmpgt_epi32_mask(a, b)
}

/// Signed integers to f32 (exact below 2²⁴).
#[inline]
#[target_feature(enable = "avx512f")]
fn to_f(a: I) -> F {
    _mm512_cvtepi32_ps(a)
}

/// f32 to integers, truncating (whole numbers here).
#[inline]
#[target_feature(enable = "avx512f")]
fn to_i(a: F) -> I {
    _mm512_cvttps_epi32(a)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn bits(a: F) -> I {
    _mm512_castps_si512(a)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn from_bits(a: I) -> F {
    _mm512_castsi512_ps(a)
}

super::kernels::coded_kernels!("avx512f");

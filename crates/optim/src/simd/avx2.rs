//! The lane operations of the coded kernels for AVX2 (8 lanes) and the kernels expanded over
//! them. Every function here is compiled for AVX2; `super` calls the kernels only after
//! `Isa::detect` found it (the build assumes it already: `.cargo/config.toml`).

use std::arch::x86_64::*;

/// Lanes of a vector.
const L: usize = 8;
/// f32 lanes.
type F = __m256;
/// i32 lanes (u32 where a comment says so).
type I = __m256i;
/// A lane mask: all ones or all zeros in each lane.
type M = __m256;

#[inline]
#[target_feature(enable = "avx2")]
fn splat(x: f32) -> F {
    _mm256_set1_ps(x)
}

#[inline]
#[target_feature(enable = "avx2")]
fn splat_i(x: u32) -> I {
    _mm256_set1_epi32(x as i32)
}

/// `0, 1, …, L − 1`.
#[inline]
#[target_feature(enable = "avx2")]
fn iota() -> I {
    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
}

#[inline]
#[target_feature(enable = "avx2")]
fn load(a: &[f32; L]) -> F {
    // SAFETY: `a` is 32 readable bytes; the load has no alignment requirement.
    unsafe { _mm256_loadu_ps(a.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn store(a: &mut [f32; L], x: F) {
    // SAFETY: `a` is 32 writable bytes, borrowed exclusively; no alignment requirement.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), x) }
}

#[cfg(test)]
#[inline]
#[target_feature(enable = "avx2")]
fn load_u32(a: &[u32; L]) -> I {
    // SAFETY: `a` is 32 readable bytes; the load has no alignment requirement.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// Bytes sign-extended (`m`'s codes).
#[inline]
#[target_feature(enable = "avx2")]
fn load_i8(a: &[u8; L]) -> I {
    // SAFETY: `a` is 8 readable bytes, what `_mm_loadl_epi64` reads; no alignment requirement.
    _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(a.as_ptr().cast()) })
}

/// Bytes zero-extended (`v`'s codes).
#[inline]
#[target_feature(enable = "avx2")]
fn load_u8(a: &[u8; L]) -> I {
    // SAFETY: `a` is 8 readable bytes, what `_mm_loadl_epi64` reads; no alignment requirement.
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(a.as_ptr().cast()) })
}

#[inline]
#[target_feature(enable = "avx2")]
fn load_u16(a: &[u16; L]) -> I {
    // SAFETY: `a` is 16 readable bytes; the load has no alignment requirement.
    _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(a.as_ptr().cast()) })
}

/// The low byte of each lane: gathered into the low 4 bytes of each 128-bit half, then the
/// halves' words side by side.
#[inline]
#[target_feature(enable = "avx2")]
fn store_u8(a: &mut [u8; L], x: I) {
    let low = _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, //
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    let b = _mm256_shuffle_epi8(x, low);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    // SAFETY: `a` is 8 writable bytes, borrowed exclusively, what `_mm_storel_epi64` writes.
    unsafe { _mm_storel_epi64(a.as_mut_ptr().cast(), _mm256_castsi256_si128(b)) }
}

/// The low 16 bits of each lane (each lane below 2¹⁶ here: `bf16_sr`'s results).
#[inline]
#[target_feature(enable = "avx2")]
fn store_u16(a: &mut [u16; L], x: I) {
    let w = _mm256_packus_epi32(x, x);
    let w = _mm256_permute4x64_epi64::<0b1000>(w);
    // SAFETY: `a` is 16 writable bytes, borrowed exclusively; no alignment requirement.
    unsafe { _mm_storeu_si128(a.as_mut_ptr().cast(), _mm256_castsi256_si128(w)) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn add(a: F, b: F) -> F {
    _mm256_add_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn sub(a: F, b: F) -> F {
    _mm256_sub_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn mul(a: F, b: F) -> F {
    _mm256_mul_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn div(a: F, b: F) -> F {
    _mm256_div_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn sqrt(a: F) -> F {
    _mm256_sqrt_ps(a)
}

/// `vminps`: `b` where either is NaN.
#[inline]
#[target_feature(enable = "avx2")]
fn min(a: F, b: F) -> F {
    _mm256_min_ps(a, b)
}

/// `vmaxps`: `b` where either is NaN.
#[inline]
#[target_feature(enable = "avx2")]
fn max(a: F, b: F) -> F {
    _mm256_max_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn abs(a: F) -> F {
    _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF)))
}

#[inline]
#[target_feature(enable = "avx2")]
fn floor(a: F) -> F {
    _mm256_floor_ps(a)
}

/// `1/√a` within `1.5·2⁻¹²` relative.
#[inline]
#[target_feature(enable = "avx2")]
fn rsqrt_est(a: F) -> F {
    _mm256_rsqrt_ps(a)
}

/// `1/a` within `1.5·2⁻¹²` relative.
#[inline]
#[target_feature(enable = "avx2")]
fn rcp_est(a: F) -> F {
    _mm256_rcp_ps(a)
}

/// The largest lane (no lane NaN).
#[inline]
#[target_feature(enable = "avx2")]
fn hmax(a: F) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m));
    _mm_cvtss_f32(m)
}

/// `a < b` (false where either is NaN).
#[inline]
#[target_feature(enable = "avx2")]
fn lt(a: F, b: F) -> M {
    _mm256_cmp_ps::<_CMP_LT_OQ>(a, b)
}

/// `a <= b` (false where either is NaN).
#[inline]
#[target_feature(enable = "avx2")]
fn le(a: F, b: F) -> M {
    _mm256_cmp_ps::<_CMP_LE_OQ>(a, b)
}

/// `m ? a : b`.
#[inline]
#[target_feature(enable = "avx2")]
fn select(m: M, a: F, b: F) -> F {
    _mm256_blendv_ps(b, a, m)
}

/// `m ? a : b`.
#[inline]
#[target_feature(enable = "avx2")]
fn select_i(m: M, a: I, b: I) -> I {
    _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(a), m))
}

#[inline]
#[target_feature(enable = "avx2")]
fn add_i(a: I, b: I) -> I {
    _mm256_add_epi32(a, b)
}

/// `a + 1` in the lanes of `m` (a true lane of a mask is −1 as an integer).
#[inline]
#[target_feature(enable = "avx2")]
fn inc_where(m: M, a: I) -> I {
    _mm256_sub_epi32(a, _mm256_castps_si256(m))
}

/// `−a` in the lanes whose `x` has its sign bit set (`vpsignd`, which also gives 0 where `x`'s
/// bits are 0: callers pass an `a` that is 0 there).
#[inline]
#[target_feature(enable = "avx2")]
fn negate_where_negative(a: I, x: F) -> I {
    _mm256_sign_epi32(a, _mm256_castps_si256(x))
}

/// The low 32 bits of the product (wrapping).
#[inline]
#[target_feature(enable = "avx2")]
fn mullo(a: I, b: I) -> I {
    _mm256_mullo_epi32(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn xor(a: I, b: I) -> I {
    _mm256_xor_si256(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn and(a: I, b: I) -> I {
    _mm256_and_si256(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn or(a: I, b: I) -> I {
    _mm256_or_si256(a, b)
}

/// Logical shift right.
#[inline]
#[target_feature(enable = "avx2")]
fn srl<const N: i32>(a: I) -> I {
    _mm256_srli_epi32::<N>(a)
}

#[inline]
#[target_feature(enable = "avx2")]
fn sll<const N: i32>(a: I) -> I {
    _mm256_slli_epi32::<N>(a)
}

/// Signed `a > b`.
#[inline]
#[target_feature(enable = "avx2")]
fn gt_i(a: I, b: I) -> M {
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b))
}

/// Signed integers to f32 (exact below 2²⁴).
#[inline]
#[target_feature(enable = "avx2")]
fn to_f(a: I) -> F {
    _mm256_cvtepi32_ps(a)
}

/// f32 to integers, truncating (whole numbers here).
#[inline]
#[target_feature(enable = "avx2")]
fn to_i(a: F) -> I {
    _mm256_cvttps_epi32(a)
}

#[inline]
#[target_feature(enable = "avx2")]
fn bits(a: F) -> I {
    _mm256_castps_si256(a)
}

#[inline]
#[target_feature(enable = "avx2")]
fn from_bits(a: I) -> F {
    _mm256_castsi256_ps(a)
}

super::kernels::coded_kernels!("avx2");

//! The AdamW moments in the precision a run chose (`mt_core::StateDtype`): fp32, bf16 or 8-bit
//! blockwise, as views of the bytes a store record or a device state slot holds, and the
//! encoding of each.
//!
//! - **fp32**: `m` and `v` as f32; the update is bitwise torch's.
//! - **bf16**: the bits of bf16 `m` and `v`, written with stochastic rounding: the f32 value's
//!   low 16 bits plus a uniform 16-bit draw carry into the kept half with probability equal to
//!   the dropped fraction (unbiased). Round to nearest would lose `v`'s per-step decay (0.1% at
//!   `beta2 = 0.999`, below half a bf16 ulp): `v` then never falls and training drifts
//!   (`docs/decisions/0033-optimizer-state-precision.md`).
//! - **int8**: blocks of [`Q8_BLOCK`] elements, each with one f32 step `s` and one byte per
//!   element. `m` (signed) uses a square-root code: byte `q` in −127..=127 means
//!   `sign(q)·q²·s`, `s = max|m| / 127²`; `v` (non-negative) a fourth-root code: byte `c` in
//!   0..=255 means `c⁴·s`, `s = max v / 255⁴`. Both keep relative precision over many orders of
//!   magnitude, which a linear code does not: it rounds the small `v` of a block to zero and
//!   their updates to `m / eps` (measured: NaN losses). Each element picks one of its two
//!   neighbouring codes stochastically, unbiased in value.
//!
//! Random draws are a pure function of `(step, stream, element)`: the stream is the unit (store
//! record index), so an update is bitwise reproducible across thread counts, on resume, and
//! between the host and the device (`kernels/cuda/adamw.cu` draws the same numbers). One 32-bit
//! draw per element rounds both moments: `m` with its low 16 bits, `v` with its high 16 (one
//! hash instead of two: the update over coded moments is bound by arithmetic on few cores).
//!
//! Every decode and encode is plain IEEE f32 arithmetic (products, quotients, square roots,
//! floor) in a fixed order, so the CUDA kernels, compiled with `--fmad=false`, give the same bits.

use mt_core::{StateDtype, Q8_BLOCK};

use crate::error::{check_len, Error};

/// `127²`: the square-root code's largest magnitude, in steps.
pub(crate) const M_TOP: f32 = 16129.0;
/// `255⁴` (rounded to f32): the fourth-root code's largest value, in steps.
pub(crate) const V_TOP: f32 = 4_228_250_625.0;

/// One 8-bit moment of a range: a byte per element and an f32 step per [`Q8_BLOCK`].
#[derive(Debug)]
pub struct Q8Moment<'a> {
    /// One code per element (`m`: two's-complement `i8`; `v`: `u8`).
    pub codes: &'a mut [u8],
    /// One step per block of [`Q8_BLOCK`] elements.
    pub scales: &'a mut [f32],
}

/// A range's AdamW moments, in one of the [`StateDtype`] encodings.
#[derive(Debug)]
pub enum Moments<'a> {
    /// fp32 `m` and `v`.
    F32 {
        /// First moment.
        m: &'a mut [f32],
        /// Second moment.
        v: &'a mut [f32],
    },
    /// bf16 `m` and `v` (their bits), rounded stochastically with the draws of `stream`.
    Bf16 {
        /// First moment.
        m: &'a mut [u16],
        /// Second moment.
        v: &'a mut [u16],
        /// The draws' stream: the unit's record index.
        stream: u64,
    },
    /// 8-bit blockwise `m` and `v`, rounded stochastically with the draws of `stream`.
    Int8 {
        /// First moment (square-root code).
        m: Q8Moment<'a>,
        /// Second moment (fourth-root code).
        v: Q8Moment<'a>,
        /// The draws' stream: the unit's record index.
        stream: u64,
    },
}

impl<'a> Moments<'a> {
    /// fp32 moments.
    pub fn f32(m: &'a mut [f32], v: &'a mut [f32]) -> Self {
        Moments::F32 { m, v }
    }

    /// The moments of `n` parameters in `m` and `v`, each at least
    /// [`StateDtype::moment_bytes`]`(n)` bytes (a store's page-padded region may be longer) and
    /// 4-byte aligned, laid out as `dtype` says. `stream` picks the stochastic rounding's draws
    /// (the unit's record index).
    ///
    /// # Errors
    /// [`Error::MomentBytes`] when a buffer is too short or misaligned.
    pub fn from_bytes(
        dtype: StateDtype,
        n: usize,
        m: &'a mut [u8],
        v: &'a mut [u8],
        stream: u64,
    ) -> Result<Self, Error> {
        let need = dtype.moment_bytes(n);
        let check = |what: &'static str, b: &[u8]| {
            if b.len() < need || b.as_ptr().align_offset(4) != 0 {
                Err(Error::MomentBytes { moment: what, dtype: dtype.name(), n, needed: need, found: b.len() })
            } else {
                Ok(())
            }
        };
        check("m", m)?;
        check("v", v)?;
        let (m, v) = (&mut m[..need], &mut v[..need]);
        Ok(match dtype {
            StateDtype::F32 => {
                Moments::F32 { m: bytemuck::cast_slice_mut(m), v: bytemuck::cast_slice_mut(v) }
            }
            StateDtype::Bf16 => Moments::Bf16 {
                m: &mut bytemuck::cast_slice_mut(m)[..n],
                v: &mut bytemuck::cast_slice_mut(v)[..n],
                stream,
            },
            StateDtype::Int8 => Moments::Int8 { m: q8_split(m, n), v: q8_split(v, n), stream },
        })
    }

    /// A device state slot's `[master | m | v]` for `n` parameters
    /// ([`StateDtype::state_words`] f32 words) split into the master weights and the moments.
    ///
    /// # Errors
    /// [`Error::MomentBytes`] when `state` is not `state_words(n)` long.
    pub fn split_state(
        dtype: StateDtype,
        n: usize,
        state: &'a mut [f32],
        stream: u64,
    ) -> Result<(&'a mut [f32], Self), Error> {
        let words = dtype.state_words(n);
        if state.len() != words {
            return Err(Error::MomentBytes {
                moment: "state slot",
                dtype: dtype.name(),
                n,
                needed: 4 * words,
                found: 4 * state.len(),
            });
        }
        let (master, rest) = state.split_at_mut(n);
        let (m, v) = bytemuck::cast_slice_mut::<f32, u8>(rest).split_at_mut(dtype.moment_bytes(n));
        Ok((master, Self::from_bytes(dtype, n, m, v, stream)?))
    }

    /// Checks that every buffer covers `n` elements (an 8-bit moment's scales `ceil(n /
    /// Q8_BLOCK)` blocks).
    pub(crate) fn check(&self, n: usize) -> Result<(), Error> {
        let blocks = n.div_ceil(Q8_BLOCK);
        match self {
            Moments::F32 { m, v } => check_len("m", n, m.len()).and(check_len("v", n, v.len())),
            Moments::Bf16 { m, v, .. } => check_len("m", n, m.len()).and(check_len("v", n, v.len())),
            Moments::Int8 { m, v, .. } => check_len("m", n, m.codes.len())
                .and(check_len("v", n, v.codes.len()))
                .and(check_len("m scales", blocks, m.scales.len()))
                .and(check_len("v scales", blocks, v.scales.len())),
        }
    }

    /// Elements covered.
    pub fn len(&self) -> usize {
        match self {
            Moments::F32 { m, .. } => m.len(),
            Moments::Bf16 { m, .. } => m.len(),
            Moments::Int8 { m, .. } => m.codes.len(),
        }
    }

    /// Whether no element is covered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The encoding.
    pub fn dtype(&self) -> StateDtype {
        match self {
            Moments::F32 { .. } => StateDtype::F32,
            Moments::Bf16 { .. } => StateDtype::Bf16,
            Moments::Int8 { .. } => StateDtype::Int8,
        }
    }
}

fn q8_split(b: &mut [u8], n: usize) -> Q8Moment<'_> {
    let (codes, scales) = b.split_at_mut(StateDtype::scales_offset(n));
    Q8Moment { codes: &mut codes[..n], scales: bytemuck::cast_slice_mut(scales) }
}

/// The values `m` and `v` of `n` parameters encode (as [`Moments::from_bytes`] reads them):
/// for tests, tools and comparisons.
///
/// # Errors
/// As [`Moments::from_bytes`].
pub fn decode_moments(
    dtype: StateDtype,
    n: usize,
    m: &[u8],
    v: &[u8],
) -> Result<(Vec<f32>, Vec<f32>), Error> {
    // Copied into 4-aligned buffers (a byte slice need not be).
    let aligned = |b: &[u8]| {
        let mut w = vec![0u32; b.len().div_ceil(4)];
        bytemuck::cast_slice_mut::<u32, u8>(&mut w)[..b.len()].copy_from_slice(b);
        w
    };
    let (mut mw, mut vw) = (aligned(m), aligned(v));
    let mb = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut mw)[..m.len()];
    let vb = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut vw)[..v.len()];
    Ok(match Moments::from_bytes(dtype, n, mb, vb, 0)? {
        Moments::F32 { m, v } => (m.to_vec(), v.to_vec()),
        Moments::Bf16 { m, v, .. } => {
            (m.iter().map(|&b| widen(b)).collect(), v.iter().map(|&b| widen(b)).collect())
        }
        Moments::Int8 { m, v, .. } => {
            let (mut mo, mut vo) = (vec![0.0; n], vec![0.0; n]);
            for (k, (mo, vo)) in mo.chunks_mut(Q8_BLOCK).zip(vo.chunks_mut(Q8_BLOCK)).enumerate() {
                let r = k * Q8_BLOCK..k * Q8_BLOCK + mo.len();
                decode_m(&m.codes[r.clone()], m.scales[k], mo);
                decode_v(&v.codes[r], v.scales[k], vo);
            }
            (mo, vo)
        }
    })
}

/// bf16 bits widened to f32 (exact).
#[inline(always)]
pub(crate) fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `x` rounded to bf16 stochastically with the 16-bit draw `r` ([`m_bits`], [`v_bits`]; bits
/// above them are ignored): up with probability
/// equal to the dropped fraction. A NaN stays a quiet NaN with its sign and top payload bits
/// (as the round-to-nearest cast keeps it).
#[inline(always)]
pub(crate) fn bf16_sr(x: f32, r: u32) -> u16 {
    let b = x.to_bits();
    let is_nan = b & 0x7FFF_FFFF > 0x7F80_0000;
    let rounded = b.wrapping_add(r & 0xFFFF) >> 16;
    (if is_nan { (b >> 16) | 0x40 } else { rounded }) as u16
}

/// murmur3's 32-bit finaliser: the stochastic rounding's draw for element `i` is
/// `mix32(i ^ key)` ([`draw`]).
#[inline(always)]
pub(crate) fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stochastic rounding's key for optimizer step `step` of `stream` (a unit's record index):
/// element `i`'s draw is `mix32(i ^ key)` ([`draw`]). A device kernel takes it as an argument.
pub fn rounding_key(step: u64, stream: u64) -> u32 {
    splitmix64(splitmix64(splitmix64(step) ^ stream) ^ 1) as u32
}

/// Element `i`'s draw under `key` (`i` the element's index in its unit, modulo 2³²).
#[inline(always)]
pub(crate) fn draw(i: u32, key: u32) -> u32 {
    mix32(i ^ key)
}

/// The 16 bits of a draw that round `m`: its low half.
#[inline(always)]
pub(crate) fn m_bits(h: u32) -> u32 {
    h & 0xFFFF
}

/// The 16 bits of a draw that round `v`: its high half.
#[inline(always)]
pub(crate) fn v_bits(h: u32) -> u32 {
    h >> 16
}

/// 16 bits of a draw as a uniform in `[0, 1)` (exact).
#[inline(always)]
pub(crate) fn unit16(r: u32) -> f32 {
    r as f32 * (1.0 / 65_536.0)
}

/// Decodes one block of `m` (square-root code) into `out`: `(q·|q|)·s` (`q·|q|` is `±q²`, exact).
#[inline(always)]
pub(crate) fn decode_m(codes: &[u8], s: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        let a = f32::from(c as i8);
        *o = (a * a.abs()) * s;
    }
}

/// Decodes one block of `v` (fourth-root code) into `out`.
#[inline(always)]
pub(crate) fn decode_v(codes: &[u8], s: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        let a = f32::from(c);
        *o = ((a * a) * (a * a)) * s;
    }
}

/// The largest element of a block, NaNs ignored: `max` of the magnitudes (`m`) or of the values
/// (`v`, never negative). Exact, so any order of evaluation gives it (the vector kernels' lanes,
/// the CUDA kernel's tree).
#[inline(always)]
pub(crate) fn block_max(x: &[f32], magnitude: bool) -> f32 {
    x.iter().fold(0.0f32, |a, &b| a.max(if magnitude { b.abs() } else { b }))
}

/// What scales a block's values into code units: `top / max` (the step `s = max / top` is what is
/// stored), 0 for a block whose step is 0 (every code 0), at most `f32::MAX` (a block whose
/// largest value is so small that `top / max` overflows). One division per block: every element
/// is then scaled by a product, not a quotient.
#[inline(always)]
pub(crate) fn block_inverse(s: f32, max: f32, top: f32) -> f32 {
    if s == 0.0 {
        0.0
    } else {
        (top / max).min(f32::MAX)
    }
}

/// `k⁴` as the fourth-root code computes it: `(k·k)·(k·k)` in f32 (`k·k` exact; the square
/// rounded).
#[inline(always)]
pub(crate) fn fourth(k: f32) -> f32 {
    (k * k) * (k * k)
}

/// The largest `k` in `0..=126` with `k·k <= y`, for `y >= 0` (not NaN). `floor(sqrt(y))` is
/// at least that `k` (a correctly rounded square root of `k²` is `k`) and at most one more (a
/// `y` just below `(k+1)²` may round up to `k + 1`); the comparison takes the one back.
#[inline(always)]
pub(crate) fn m_floor(y: f32) -> f32 {
    let k = y.sqrt().floor().min(126.0);
    if k * k > y {
        k - 1.0
    } else {
        k
    }
}

/// The largest `k` in `0..=254` with [`fourth`]`(k) <= y`, for `y >= 0` (not NaN).
/// `floor(sqrt(sqrt(y)))` is within one of it (two correctly rounded square roots, and the
/// rounding of `k⁴`, move a value by a few units in its last place, never across more than one
/// integer); the comparisons take that one back.
#[inline(always)]
pub(crate) fn v_floor(y: f32) -> f32 {
    let k = y.sqrt().sqrt().floor().min(254.0);
    if fourth(k) > y {
        k - 1.0
    } else if k < 254.0 && fourth(k + 1.0) <= y {
        k + 1.0
    } else {
        k
    }
}

/// One element of `m` in the square-root code, scaled by `inv` ([`block_inverse`]), with the
/// 16-bit draw `r` ([`m_bits`]): `y = |x|·inv` (a NaN as 0), `lo` = [`m_floor`]`(y)`, and the
/// code `lo + 1` when `u·(2·lo + 1) < y − lo²` (`u` = [`unit16`]`(r)` in `[0, 1)`, `2·lo + 1` the
/// distance to the next code's `q²`), else `lo`: unbiased in `q²`, to rounding. The sign is
/// `x`'s.
#[inline(always)]
pub(crate) fn code_m(x: f32, inv: f32, r: u32) -> u8 {
    let y = (x.abs() * inv).max(0.0);
    let lo = m_floor(y);
    let q = if unit16(r) * (2.0 * lo + 1.0) < y - lo * lo { lo + 1.0 } else { lo };
    let q = q as i8;
    (if x < 0.0 { -q } else { q }) as u8
}

/// One element of `v` in the fourth-root code, scaled by `inv` ([`block_inverse`]), with the
/// 16-bit draw `r` ([`v_bits`]): `y = x·inv` (a NaN as 0), `lo` = [`v_floor`]`(y)`, and the code
/// `lo + 1` when `u·(T(lo+1) − T(lo)) < y − T(lo)` (`T` = [`fourth`], `u` = [`unit16`]`(r)`),
/// else `lo`.
#[inline(always)]
pub(crate) fn code_v(x: f32, inv: f32, r: u32) -> u8 {
    let y = (x * inv).max(0.0);
    let lo = v_floor(y);
    let (t_lo, t_hi) = (fourth(lo), fourth(lo + 1.0));
    (if unit16(r) * (t_hi - t_lo) < y - t_lo { lo + 1.0 } else { lo }) as u8
}

/// Encodes one block of `m` (square-root code, stochastic) from `x`; returns its step
/// `max|x| / 127²`. `base` is the block's first element index in the unit.
#[inline(always)]
pub(crate) fn encode_m(x: &[f32], codes: &mut [u8], key: u32, base: usize) -> f32 {
    let amax = block_max(x, true);
    let s = amax / M_TOP;
    let inv = block_inverse(s, amax, M_TOP);
    for (j, (c, &x)) in codes.iter_mut().zip(x).enumerate() {
        *c = code_m(x, inv, m_bits(draw((base + j) as u32, key)));
    }
    s
}

/// Encodes one block of `v` (fourth-root code, stochastic) from `x` (non-negative); returns its
/// step `max x / 255⁴`. `base` is the block's first element index in the unit.
#[inline(always)]
pub(crate) fn encode_v(x: &[f32], codes: &mut [u8], key: u32, base: usize) -> f32 {
    let vmax = block_max(x, false);
    let s = vmax / V_TOP;
    let inv = block_inverse(s, vmax, V_TOP);
    for (j, (c, &x)) in codes.iter_mut().zip(x).enumerate() {
        *c = code_v(x, inv, v_bits(draw((base + j) as u32, key)));
    }
    s
}

#[cfg(test)]
mod tests;

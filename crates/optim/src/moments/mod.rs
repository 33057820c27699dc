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
//! Random draws are a pure function of `(step, stream, moment, element)`: the stream is the
//! unit (store record index), so an update is bitwise reproducible across thread counts, on
//! resume, and between the host and the device (`kernels/cuda/adamw.cu` draws the same numbers).
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

/// `x` rounded to bf16 stochastically with the draw `r` (its low 16 bits): up with probability
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
/// `mix32(i ^ key)`.
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

/// The stochastic rounding's keys of `m` and `v` for optimizer step `step` of `stream` (a
/// unit's record index): element `i`'s draw is `mix32(i ^ key)`. A device kernel takes them as
/// arguments.
pub fn rounding_keys(step: u64, stream: u64) -> [u32; 2] {
    let base = splitmix64(splitmix64(step) ^ stream);
    [splitmix64(base ^ 1) as u32, splitmix64(base ^ 2) as u32]
}

/// A draw as a uniform in `[0, 1)` (its top 24 bits).
#[inline(always)]
pub(crate) fn unit_float(h: u32) -> f32 {
    (h >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Decodes one block of `m` (square-root code) into `out`.
#[inline(always)]
pub(crate) fn decode_m(codes: &[u8], s: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        let q = c as i8;
        let a = f32::from(q.unsigned_abs());
        let x = (a * a) * s;
        *o = if q < 0 { -x } else { x };
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

/// Encodes one block of `m` (square-root code, stochastic) from `x`; returns its step. `base`
/// is the block's first element index in the unit.
#[inline(always)]
pub(crate) fn encode_m(x: &[f32], codes: &mut [u8], key: u32, base: usize) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
    let s = amax / M_TOP;
    if s == 0.0 {
        codes.fill(0);
        return s;
    }
    for (j, (c, &x)) in codes.iter_mut().zip(x).enumerate() {
        let y = x.abs() / s;
        let lo = y.sqrt().floor().min(126.0);
        let hi = lo + 1.0;
        let p = (y - lo * lo) / (hi * hi - lo * lo);
        let u = unit_float(mix32((base + j) as u32 ^ key));
        let q = if u < p { hi } else { lo };
        let q = q as i8;
        *c = (if x < 0.0 { -q } else { q }) as u8;
    }
    s
}

/// Encodes one block of `v` (fourth-root code, stochastic) from `x` (non-negative); returns its
/// step. `base` is the block's first element index in the unit.
#[inline(always)]
pub(crate) fn encode_v(x: &[f32], codes: &mut [u8], key: u32, base: usize) -> f32 {
    let vmax = x.iter().fold(0.0f32, |a, &b| a.max(b));
    let s = vmax / V_TOP;
    if s == 0.0 {
        codes.fill(0);
        return s;
    }
    for (j, (c, &x)) in codes.iter_mut().zip(x).enumerate() {
        let y = x / s;
        let lo = y.sqrt().sqrt().floor().min(254.0);
        let hi = lo + 1.0;
        let (lo4, hi4) = ((lo * lo) * (lo * lo), (hi * hi) * (hi * hi));
        let p = (y - lo4) / (hi4 - lo4);
        let u = unit_float(mix32((base + j) as u32 ^ key));
        *c = (if u < p { hi } else { lo }) as u8;
    }
    s
}

#[cfg(test)]
mod tests;

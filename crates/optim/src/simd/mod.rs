//! The coded update's vector kernels (bf16 and 8-bit moments: decode, update, encode in one pass
//! over a block), written once (`kernels.rs`) over the lane operations of two instruction sets:
//! AVX2 (`avx2.rs`, eight lanes) and AVX-512 (`avx512.rs`, sixteen), the widest the CPU has
//! chosen at run time. Each gives exactly the bits of the scalar definitions in
//! [`crate::moments`] and `adamw::update_block_coded`: the same IEEE operations in the same
//! order (no FMA), and where a kernel takes a shortcut (an approximate reciprocal square root to
//! start the search for an element's code) an exact check after it (tests: `tests.rs`).
//!
//! With the non-temporal stores of `streaming.rs`, this is the one module of `mt-optim` allowed
//! `unsafe`: CPU intrinsics that read or write through pointers, and calls of functions compiled
//! for instruction sets the build does not assume (`#[target_feature]`), made only after the CPU
//! said it has them.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod kernels;
pub(crate) mod streaming;
#[cfg(test)]
mod tests;

use std::sync::OnceLock;

use mt_core::Q8_BLOCK;

use crate::adamw::{update_block_coded, Coeffs};
use crate::moments::{block_max, decode_m, decode_v, encode_m, encode_v};

/// The instruction set the coded kernels run on. Only [`Isa::detect`] and (in tests)
/// [`Isa::available`] make one that names vector instructions, each after the CPU reported them:
/// the safety of calling the kernels rests on that, so the level is private to this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Isa(Level);

/// The levels, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// No vector kernel: the scalar definitions (a CPU other than x86-64, or one without AVX2).
    Scalar,
    /// 8 lanes of 32 bits.
    Avx2,
    /// 16 lanes of 32 bits.
    Avx512,
}

impl Isa {
    /// The scalar definitions, on any CPU.
    #[cfg(test)]
    pub(crate) const SCALAR: Isa = Isa(Level::Scalar);

    /// The widest instruction set this CPU has, or a narrower one named by the environment
    /// variable `MEGATRAIN_HOST_SIMD` (`avx2`, `scalar`: to compare them on one machine; a wider
    /// one than the CPU has, or another word, changes nothing). Decided once per process.
    pub(crate) fn detect() -> Self {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Self::cpu_best();
            let asked = match std::env::var("MEGATRAIN_HOST_SIMD").as_deref() {
                Ok("scalar") => Level::Scalar,
                Ok("avx2") => Level::Avx2,
                _ => best,
            };
            Isa(asked.min(best))
        })
    }

    /// The widest level the CPU has (`std` caches the CPU's answer).
    fn cpu_best() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Level::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Level::Avx2;
            }
        }
        Level::Scalar
    }

    /// Its name: `avx512`, `avx2`, `scalar`.
    pub(crate) fn name(self) -> &'static str {
        match self.0 {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// Every instruction set this CPU can run, narrowest first (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let best = Self::cpu_best();
        [Level::Scalar, Level::Avx2, Level::Avx512].into_iter().filter(|&l| l <= best).map(Isa).collect()
    }
}

/// What every kernel call of one update pass shares: the instruction set, the step's
/// coefficients and its stochastic rounding key.
#[derive(Clone, Copy)]
pub(crate) struct Pass<'a> {
    pub(crate) isa: Isa,
    pub(crate) c: &'a Coeffs,
    pub(crate) key: u32,
}

/// The new moments of one 8-bit block, updated and not yet encoded (the vector kernels encode a
/// block while they update the next), with their largest `|m|` and `v`.
pub(crate) struct Pending {
    pub(crate) m: [f32; Q8_BLOCK],
    pub(crate) v: [f32; Q8_BLOCK],
    pub(crate) am: f32,
    pub(crate) vm: f32,
}

impl Pending {
    pub(crate) fn new() -> Self {
        Pending { m: [0.0; Q8_BLOCK], v: [0.0; Q8_BLOCK], am: 0.0, vm: 0.0 }
    }
}

/// One whole 8-bit block's update: its gradient and master, its moments as stored (codes and
/// step), and where the new moments go.
pub(crate) struct Q8Update<'a> {
    pub(crate) g: &'a [f32; Q8_BLOCK],
    pub(crate) p: &'a mut [f32; Q8_BLOCK],
    pub(crate) m: (&'a [u8; Q8_BLOCK], f32),
    pub(crate) v: (&'a [u8; Q8_BLOCK], f32),
    pub(crate) out: &'a mut Pending,
}

/// One whole 8-bit block's encoding: its new moments, its first element's index in the unit
/// (for the draws), and the codes and steps it writes.
pub(crate) struct Q8Encode<'a> {
    pub(crate) new: &'a Pending,
    pub(crate) base: u32,
    pub(crate) m: (&'a mut [u8; Q8_BLOCK], &'a mut f32),
    pub(crate) v: (&'a mut [u8; Q8_BLOCK], &'a mut f32),
}

/// The fused update over bf16 moments of as many whole vectors of `g` as the pass's instruction
/// set has lanes for (element `j`'s draw is that of index `base + j`); returns how many elements
/// it did (0 for [`Isa::SCALAR`]): the caller does the rest.
pub(crate) fn bf16_span(
    pass: Pass<'_>,
    base: u32,
    g: &[f32],
    p: &mut [f32],
    mv: (&mut [u16], &mut [u16]),
) -> usize {
    let Pass { isa, c, key } = pass;
    match isa.0 {
        Level::Scalar => 0,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx2` is made only after the CPU reported AVX2 (`Isa`).
        Level::Avx2 => unsafe { avx2::bf16_span((c, key, base), g, p, mv) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx512` is made only after the CPU reported AVX-512F (`Isa`).
        Level::Avx512 => unsafe { avx512::bf16_span((c, key, base), g, p, mv) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => 0,
    }
}

/// An update of one whole 8-bit block into its [`Pending`] and the encoding of another's (the
/// previous block of the pass), either of them absent; the vector kernels interleave the two.
pub(crate) fn q8_step(isa: Isa, key: u32, upd: Option<(&Coeffs, Q8Update<'_>)>, enc: Option<Q8Encode<'_>>) {
    match isa.0 {
        Level::Scalar => scalar_q8_step(key, upd, enc),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx2` is made only after the CPU reported AVX2 (`Isa`).
        Level::Avx2 => unsafe { avx2::q8_step(key, upd, enc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx512` is made only after the CPU reported AVX-512F (`Isa`).
        Level::Avx512 => unsafe { avx512::q8_step(key, upd, enc) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => scalar_q8_step(key, upd, enc),
    }
}

/// [`q8_step`] by the scalar definitions, one after the other: what the kernels must give.
fn scalar_q8_step(key: u32, upd: Option<(&Coeffs, Q8Update<'_>)>, enc: Option<Q8Encode<'_>>) {
    if let Some((c, u)) = upd {
        let out = u.out;
        decode_m(u.m.0, u.m.1, &mut out.m);
        decode_v(u.v.0, u.v.1, &mut out.v);
        update_block_coded(c, u.g, u.p, &mut out.m, &mut out.v);
        (out.am, out.vm) = (block_max(&out.m, true), block_max(&out.v, false));
    }
    if let Some(e) = enc {
        *e.m.1 = encode_m(&e.new.m, e.m.0, key, e.base as usize);
        *e.v.1 = encode_v(&e.new.v, e.v.0, key, e.base as usize);
    }
}

/// The codes of `x` as `m` and as `v` ([`crate::moments::code_m`], `code_v`) with scale `inv`
/// and draws `h` (their low and high halves), for as many whole vectors as `isa` has lanes for;
/// returns how many.
#[cfg(test)]
pub(crate) fn codes(isa: Isa, x: &[f32], inv: f32, h: &[u32], m: &mut [u8], v: &mut [u8]) -> usize {
    match isa.0 {
        Level::Scalar => 0,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx2` is made only after the CPU reported AVX2 (`Isa`).
        Level::Avx2 => unsafe { avx2::codes(x, inv, h, m, v) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx512` is made only after the CPU reported AVX-512F (`Isa`).
        Level::Avx512 => unsafe { avx512::codes(x, inv, h, m, v) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => 0,
    }
}

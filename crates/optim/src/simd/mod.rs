//! The coded update's vector kernels (bf16 and 8-bit moments: decode, update, encode in one pass
//! over a block), written once (`kernels.rs`) over the lane operations of two instruction sets:
//! AVX2 (`avx2.rs`, eight lanes) and AVX-512 (`avx512.rs`, sixteen), the widest the CPU has
//! chosen at run time. Each gives exactly the bits of the scalar definitions in
//! [`crate::moments`] and `adamw::update_block`: the same IEEE operations in the same order
//! (no FMA), and where a kernel takes a shortcut (an approximate reciprocal square root to start
//! the search for an element's code) an exact check after it (tests: `tests.rs`).
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

use crate::adamw::Coeffs;

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

/// The fused update over bf16 moments of as many whole vectors of `g` as `isa` has lanes for
/// (element `j`'s draws are those of index `base + j`); returns how many elements it did (0 for
/// [`Isa::SCALAR`]): the caller does the rest.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bf16_span(
    isa: Isa,
    c: &Coeffs,
    keys: [u32; 2],
    base: u32,
    g: &[f32],
    p: &mut [f32],
    m: &mut [u16],
    v: &mut [u16],
) -> usize {
    match isa.0 {
        Level::Scalar => 0,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx2` is made only after the CPU reported AVX2 (`Isa`).
        Level::Avx2 => unsafe { avx2::bf16_span(c, keys, base, g, p, m, v) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` at `Level::Avx512` is made only after the CPU reported AVX-512F (`Isa`).
        Level::Avx512 => unsafe { avx512::bf16_span(c, keys, base, g, p, m, v) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => 0,
    }
}

/// One 8-bit block: the update and the block's new codes and steps (element `j`'s draws are
/// those of index `base + j`). Returns `false`, having done nothing, for a partial block or
/// [`Isa::SCALAR`]: the caller does it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn q8_block(
    isa: Isa,
    c: &Coeffs,
    keys: [u32; 2],
    base: u32,
    g: &[f32],
    p: &mut [f32],
    (mc, ms): (&mut [u8], &mut f32),
    (vc, vs): (&mut [u8], &mut f32),
) -> bool {
    let (Ok(g), Ok(p), Ok(mc), Ok(vc)) = (
        <&[f32; Q8_BLOCK]>::try_from(g),
        <&mut [f32; Q8_BLOCK]>::try_from(p),
        <&mut [u8; Q8_BLOCK]>::try_from(mc),
        <&mut [u8; Q8_BLOCK]>::try_from(vc),
    ) else {
        return false;
    };
    match isa.0 {
        Level::Scalar => false,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => {
            // SAFETY: an `Isa` at `Level::Avx2` is made only after the CPU reported AVX2 (`Isa`).
            unsafe { avx2::q8_block(c, keys, base, g, p, (mc, ms), (vc, vs)) };
            true
        }
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => {
            // SAFETY: an `Isa` at `Level::Avx512` is made only after the CPU reported AVX-512F (`Isa`).
            unsafe { avx512::q8_block(c, keys, base, g, p, (mc, ms), (vc, vs)) };
            true
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// The codes of `x` as `m` and as `v` ([`crate::moments::code_m`], `code_v`) with scale `inv`
/// and draws `h`, for as many whole vectors as `isa` has lanes for; returns how many.
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

//! The frozen base's encodings ([`mt_core::BaseCode`]) block by block, written from their
//! definitions, and their decoding: the CPU reference the GPU's dequantisation
//! (`kernels/cuda/base.cu`) is held to bitwise (decision 0048).
//!
//! - fp32 and bf16: each element alone (bf16 rounded to nearest even).
//! - int8: a block's `absmax` over its 64 elements, `scale = absmax / 127` (f32, [`int8_scale`]),
//!   and each element the `q` in `-127..=127` whose `q · scale` is nearest to it; decoded
//!   `q · scale`. Every element is within `absmax / 254` of its value, plus one f32 unit in the
//!   last place of `absmax` (the rounding of the scale and of a product).
//! - NF4 (QLoRA, arXiv 2305.14314): the block's `absmax` and each element the index `i` of the
//!   [`NF4`] code whose `NF4[i] · absmax` is nearest to it; decoded `NF4[i] · absmax`. Every
//!   element is within half the code's widest gap times `absmax` (`0.152 · absmax`), plus one
//!   unit in the last place of `absmax`.
//!
//! A decoded value is one f32 multiply of two f32 numbers, rounded once (to bf16, nearest even,
//! for a bf16 slot): no fused multiply-add, no other arithmetic, so the GPU gives the same bits.
//! Ties go to the lower code (the more negative value).

use half::bf16;
use mt_core::{BaseCode, BASE_BLOCK};
use rayon::prelude::*;

/// QLoRA's 4-bit NormalFloat code, ascending: the quantiles of the standard normal
/// distribution normalised to `[-1, 1]`, with an exact 0. The positive half is the quantile at 8
/// evenly spaced probabilities from `δ` down to (not including) 1/2, the negative half at 7 (one
/// code is 0, so the two halves cannot be alike), and all of them divided by the quantile at `δ`;
/// `δ = (1 − 1/30 + 1 − 1/32) / 2`, the mean of the outermost probabilities of 15- and 16-level
/// quantile grids, QLoRA's choice, which keeps the endpoints finite. Each value is the nearest
/// f32 to its exact value (`tests::nf4_code_is_its_definition` computes them again); QLoRA's
/// published table, which normalises after rounding to f32, differs from these by at most 2 f32
/// units in the last place.
pub const NF4: [f32; 16] = [
    f32::from_bits(0xbf80_0000), // -1.0
    f32::from_bits(0xbf32_39b1), // -0.6961928
    f32::from_bits(0xbf06_6b2e), // -0.52507293
    f32::from_bits(0xbeca_329e), // -0.39491743
    f32::from_bits(0xbe91_a24b), // -0.28444132
    f32::from_bits(0xbe3d_353d), // -0.1847734
    f32::from_bits(0xbdba_7869), // -0.091049977
    0.0,
    f32::from_bits(0x3da2_fb01), // 0.079580314
    f32::from_bits(0x3e24_cadf), // 0.16093014
    f32::from_bits(0x3e7c_04da), // 0.24611226
    f32::from_bits(0x3ead_0336), // 0.33791512
    f32::from_bits(0x3ee1_a4b5), // 0.44070974
    f32::from_bits(0x3f10_07a9), // 0.56261688
    f32::from_bits(0x3f39_13b0), // 0.72295666
    1.0,
];

/// The index of NF4's exact 0 (what an all-zero block holds).
const NF4_ZERO: u8 = 7;

/// Where a decoding writes: the elements of a device slot's weight dtype.
#[derive(Debug)]
pub enum Decoded<'a> {
    /// fp32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements (each value rounded to nearest even).
    Bf16(&'a mut [bf16]),
}

impl Decoded<'_> {
    /// Elements to write.
    pub fn len(&self) -> usize {
        match self {
            Decoded::F32(o) => o.len(),
            Decoded::Bf16(o) => o.len(),
        }
    }

    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The largest magnitude of `v` (0 for an empty or all-zero block).
fn absmax(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// The distance, exact in f64, between `x` and a decoded value `d`.
fn dist(x: f32, d: f32) -> f64 {
    (f64::from(x) - f64::from(d)).abs()
}

/// The int8 scale of a block whose largest magnitude is `a` (> 0): `a / 127`, one unit in the
/// last place more where `127` of it would fall short of `a`, so that the codes reach every
/// element (which also keeps a scale that underflows from being 0), but one less where `127` of
/// it would round past `f32::MAX` (near it the codes then fall short of `a` by a few units in
/// its last place), so that every decoded value is finite.
pub fn int8_scale(a: f32) -> f32 {
    let mut s = a / 127.0;
    if f64::from(s) * 127.0 < f64::from(a) {
        s = s.next_up();
    }
    while (127.0 * s).is_infinite() {
        s = s.next_down();
    }
    s
}

/// `x`'s int8 code under `scale` (> 0): the `q` in `-127..=127` whose decoded value `q · scale`
/// is nearest to `x`.
fn int8_code(x: f32, scale: f32) -> i8 {
    let q0 = (x / scale).round().clamp(-127.0, 127.0) as i32;
    let (lo, hi) = ((q0 - 1).max(-127), (q0 + 1).min(127));
    // `min_by` keeps the first of equals: ties go to the lower code.
    let q = (lo..=hi).min_by(|&a, &b| dist(x, a as f32 * scale).total_cmp(&dist(x, b as f32 * scale)));
    q.unwrap_or(q0) as i8
}

/// `x`'s NF4 index under `absmax` (> 0): the `i` whose decoded value `NF4[i] · absmax` is
/// nearest to `x`.
fn nf4_index(x: f32, absmax: f32) -> u8 {
    // The first code at or above x / absmax, then its neighbours by their decoded values.
    let t = x / absmax;
    let i0 = NF4.partition_point(|&c| c < t).min(15);
    let (lo, hi) = (i0.saturating_sub(1), (i0 + 1).min(15));
    // `min_by` keeps the first of equals: ties go to the lower code.
    (lo..=hi).min_by(|&a, &b| dist(x, NF4[a] * absmax).total_cmp(&dist(x, NF4[b] * absmax))).unwrap_or(i0)
        as u8
}

/// Encodes one block of [`BASE_BLOCK`] finite values in `code` into `out`
/// (`code.block_bytes()` bytes).
pub fn encode_block(code: BaseCode, v: &[f32], out: &mut [u8]) {
    debug_assert_eq!((v.len(), out.len()), (BASE_BLOCK, code.block_bytes()));
    match code {
        BaseCode::F32 => {
            for (o, x) in out.chunks_exact_mut(4).zip(v) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        BaseCode::Bf16 => {
            for (o, x) in out.chunks_exact_mut(2).zip(v) {
                o.copy_from_slice(&bf16::from_f32(*x).to_bits().to_le_bytes());
            }
        }
        BaseCode::Int8 => {
            let a = absmax(v);
            let scale = if a == 0.0 { 0.0 } else { int8_scale(a) };
            out[..4].copy_from_slice(&scale.to_le_bytes());
            for (o, &x) in out[4..].iter_mut().zip(v) {
                *o = if a == 0.0 { 0 } else { int8_code(x, scale) as u8 };
            }
        }
        BaseCode::Nf4 => {
            let a = absmax(v);
            out[..4].copy_from_slice(&a.to_le_bytes());
            let idx = |x: f32| if a == 0.0 { NF4_ZERO } else { nf4_index(x, a) };
            for (o, pair) in out[4..].iter_mut().zip(v.chunks_exact(2)) {
                *o = idx(pair[0]) | (idx(pair[1]) << 4);
            }
        }
    }
}

/// The value element `j` of an encoded block stands for.
#[inline]
fn value(code: BaseCode, block: &[u8], j: usize) -> f32 {
    let word = |at: usize| f32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    match code {
        BaseCode::F32 => word(4 * j),
        BaseCode::Bf16 => bf16::from_bits(u16::from_le_bytes([block[2 * j], block[2 * j + 1]])).to_f32(),
        BaseCode::Int8 => f32::from(block[4 + j] as i8) * word(0),
        BaseCode::Nf4 => NF4[usize::from((block[4 + j / 2] >> (4 * (j % 2))) & 0xf)] * word(0),
    }
}

/// Decodes one block into the f32 values its elements stand for.
pub fn decode_block(code: BaseCode, block: &[u8], out: &mut [f32]) {
    debug_assert_eq!((out.len(), block.len()), (BASE_BLOCK, code.block_bytes()));
    for (j, o) in out.iter_mut().enumerate() {
        *o = value(code, block, j);
    }
}

/// Blocks decoded or encoded per parallel task (1 MiB of fp32 values).
const TASK_BLOCKS: usize = (1 << 18) / BASE_BLOCK;

/// Encodes whole blocks of finite values (`v.len()` a multiple of [`BASE_BLOCK`]) in `code` into
/// `out` (`v.len() / BASE_BLOCK` blocks' bytes), on every core.
pub fn encode(code: BaseCode, v: &[f32], out: &mut [u8]) {
    let bb = code.block_bytes();
    debug_assert_eq!(v.len() / BASE_BLOCK * bb, out.len());
    out.par_chunks_mut(TASK_BLOCKS * bb).zip(v.par_chunks(TASK_BLOCKS * BASE_BLOCK)).for_each(|(o, v)| {
        for (ob, vb) in o.chunks_exact_mut(bb).zip(v.chunks_exact(BASE_BLOCK)) {
            encode_block(code, vb, ob);
        }
    });
}

/// Decodes whole blocks of `code` (`bytes`) into `out` (their elements), on every core: the
/// reference dequantisation.
pub fn decode(code: BaseCode, bytes: &[u8], out: Decoded<'_>) {
    let bb = code.block_bytes();
    debug_assert_eq!(out.len() / BASE_BLOCK * bb, bytes.len());
    let chunks = bytes.par_chunks(TASK_BLOCKS * bb);
    match out {
        Decoded::F32(o) => o.par_chunks_mut(TASK_BLOCKS * BASE_BLOCK).zip(chunks).for_each(|(o, b)| {
            for (ob, bb) in o.chunks_exact_mut(BASE_BLOCK).zip(b.chunks_exact(bb)) {
                decode_block(code, bb, ob);
            }
        }),
        Decoded::Bf16(o) => o.par_chunks_mut(TASK_BLOCKS * BASE_BLOCK).zip(chunks).for_each(|(o, b)| {
            for (ob, blk) in o.chunks_exact_mut(BASE_BLOCK).zip(b.chunks_exact(bb)) {
                for (j, x) in ob.iter_mut().enumerate() {
                    *x = match code {
                        BaseCode::Bf16 => bf16::from_bits(u16::from_le_bytes([blk[2 * j], blk[2 * j + 1]])),
                        _ => bf16::from_f32(value(code, blk, j)),
                    };
                }
            }
        }),
    }
}

#[cfg(test)]
mod tests;

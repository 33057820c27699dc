//! MXFP4 expert weights, as the released GPT-OSS checkpoints store them (OCP microscaling FP4,
//! `quantization_config.quant_method: "mxfp4"`): each expert matrix `NAME` of the layout, a
//! `[E, in, out]` tensor, is stored as
//!
//! - `NAME_blocks` U8 `[E, out, in/32, 16]`: 32 E2M1 values per block, two a byte, the low
//!   nibble first;
//! - `NAME_scales` U8 `[E, out, in/32]`: each block's E8M0 exponent, biased by 127.
//!
//! Value `= E2M1[nibble] · 2^(scale - 127)`, with E2M1 = sign bit (8) and magnitudes 0, 0.5, 1,
//! 1.5, 2, 3, 4, 6. Every such value is exact in f32 (down to `0.5 · 2^-127`, a subnormal), so
//! the import is exact; the stored `[E, out, in]` is transposed into the layout's `[E, in, out]`
//! (transformers' own parameter, what its dequantising loader produces). A scale of 255 (E8M0's
//! NaN) or a value past f32's range is refused.

use crate::header::TensorEntry;

/// Values per block (one scale each).
pub(crate) const BLOCK: usize = 32;
/// Bytes per block.
const BLOCK_BYTES: usize = BLOCK / 2;

/// E2M1 magnitudes by the low three bits of a nibble (the fourth is the sign).
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The suffixes of the two stored tensors of an MXFP4 matrix.
pub(crate) const BLOCKS_SUFFIX: &str = "_blocks";
pub(crate) const SCALES_SUFFIX: &str = "_scales";

/// Whether `config.json` declares MXFP4 weights (`quantization_config.quant_method`).
pub(crate) fn declared(config_json: &serde_json::Value) -> bool {
    config_json.pointer("/quantization_config/quant_method").and_then(|m| m.as_str()) == Some("mxfp4")
}

/// The shapes the stored tensors of a layout matrix `[E, in, out]` must have: blocks
/// `[E, out, in/32, 16]`, scales `[E, out, in/32]`; `None` unless it is 3-D with `in` a multiple
/// of 32.
pub(crate) fn stored_shapes(shape: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    let &[e, inp, out] = shape else { return None };
    if inp == 0 || !inp.is_multiple_of(BLOCK) {
        return None;
    }
    let g = inp / BLOCK;
    Some((vec![e, out, g, BLOCK_BYTES], vec![e, out, g]))
}

/// One MXFP4 matrix of the checkpoint: where its blocks and scales are.
#[derive(Clone, Copy)]
pub(crate) struct Stored<'a> {
    pub(crate) blocks: (usize, &'a TensorEntry),
    pub(crate) scales: (usize, &'a TensorEntry),
}

/// The dimensions of one expert's matrix: `out` rows of `inp` values in the file.
#[derive(Clone, Copy)]
pub(crate) struct ExpertShape {
    pub(crate) inp: usize,
    pub(crate) out: usize,
}

impl ExpertShape {
    /// Bytes of one expert's blocks and of its scales.
    pub(crate) fn bytes(self) -> (usize, usize) {
        let g = self.inp / BLOCK;
        (self.out * g * BLOCK_BYTES, self.out * g)
    }
}

/// Why an expert's bytes do not decode.
#[derive(Debug, PartialEq)]
pub(crate) enum Bad {
    /// A scale byte of 255, at this block (`row · in/32 + group`).
    NanScale { block: usize },
    /// A value past f32's range, at this element of the stored `[out, in]` matrix.
    Overflow { index: usize, value: f32 },
}

/// Decodes one expert's `blocks` and `scales` (its bytes of the stored tensors) into `dst`, the
/// expert's `[in, out]` slice of the layout tensor (transposed as it goes).
pub(crate) fn decode_expert(
    s: ExpertShape,
    blocks: &[u8],
    scales: &[u8],
    dst: &mut [f32],
) -> Result<(), Bad> {
    let ExpertShape { inp, out } = s;
    let g = inp / BLOCK;
    debug_assert_eq!((blocks.len(), scales.len(), dst.len()), (out * g * BLOCK_BYTES, out * g, inp * out));
    for (block, (&scale, bytes)) in scales.iter().zip(blocks.chunks_exact(BLOCK_BYTES)).enumerate() {
        if scale == 255 {
            return Err(Bad::NanScale { block });
        }
        let (row, first) = (block / g, (block % g) * BLOCK);
        // 2^(scale - 127), exact in f64 for every scale 0..=254.
        let factor = f64::from_bits(((i64::from(scale) - 127 + 1023) as u64) << 52);
        for (j, &byte) in bytes.iter().enumerate() {
            for (k, nibble) in [byte & 0x0f, byte >> 4].into_iter().enumerate() {
                let magnitude = f64::from(E2M1[usize::from(nibble & 7)]) * factor;
                let value = if nibble & 8 != 0 { -magnitude } else { magnitude } as f32;
                let col = first + 2 * j + k;
                if !value.is_finite() {
                    return Err(Bad::Overflow { index: row * inp + col, value });
                }
                dst[col * out + row] = value;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `2^(scale - 127)` in f32 (exact: through f64).
    fn pow2(scale: u8) -> f32 {
        2f64.powi(i32::from(scale) - 127) as f32
    }

    /// An independent encoder for the tests: the nibble of a value `m · 2^(scale - 127)`.
    fn nibble(v: f32, scale: u8) -> u8 {
        let m = v / pow2(scale);
        let i = E2M1.iter().position(|&x| x == m.abs()).expect("representable") as u8;
        if v.is_sign_negative() {
            i | 8
        } else {
            i
        }
    }

    #[test]
    fn values_decode_transposed_with_their_block_scale() {
        // One expert, 2 rows (out) of 64 values (in): 4 blocks, scales 127, 0, 130, 120.
        let s = ExpertShape { inp: 64, out: 2 };
        let scales = [127u8, 0, 130, 120];
        let mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let want: Vec<f32> = (0..128)
            .map(|i| {
                let m = mags[i % 8] * if i % 3 == 0 { -1.0 } else { 1.0 };
                m * pow2(scales[i / 32])
            })
            .collect();
        let blocks: Vec<u8> = want
            .chunks_exact(2)
            .enumerate()
            .map(|(p, v)| nibble(v[0], scales[p / 16]) | nibble(v[1], scales[p / 16]) << 4)
            .collect();
        let mut dst = vec![f32::NAN; 128];
        decode_expert(s, &blocks, &scales, &mut dst).unwrap();
        for r in 0..2 {
            for c in 0..64 {
                assert_eq!(dst[c * 2 + r].to_bits(), want[r * 64 + c].to_bits(), "row {r} col {c}");
            }
        }
        // The smallest non-zero value is the subnormal 2^-128 (element 41: 0.5 at scale 0); -0
        // keeps its sign.
        assert_eq!(dst[2 * 41], f32::from_bits(1 << 21));
        assert!(dst[0].is_sign_negative() && dst[0] == 0.0);
    }

    #[test]
    fn a_nan_scale_and_an_overflow_are_refused() {
        let s = ExpertShape { inp: 32, out: 1 };
        let mut dst = vec![0.0; 32];
        assert_eq!(decode_expert(s, &[0; 16], &[255], &mut dst), Err(Bad::NanScale { block: 0 }));
        // 6 · 2^127 is past f32's largest value; 4 · 2^127 = 2^129 too; 1.5 · 2^127 is not.
        let mut blocks = [0u8; 16];
        blocks[0] = 0x03;
        assert!(decode_expert(s, &blocks, &[254], &mut dst).is_ok());
        blocks[3] = 0x70;
        assert_eq!(
            decode_expert(s, &blocks, &[254], &mut dst),
            Err(Bad::Overflow { index: 7, value: f32::INFINITY })
        );
    }
}

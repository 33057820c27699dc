//! Global-norm gradient clipping: a bitwise-reproducible sum of squares and torch's clip coefficient.

use rayon::prelude::*;

use crate::adamw::{UploadElem, CHUNK};
use crate::error::{check_len, Error};
use crate::{Grad, Upload};

/// Independent accumulators per chunk: lets LLVM keep them in SIMD registers while the summation
/// order stays fixed by the source (lane `j` sums elements `j, j + LANES, ...` of the chunk).
const LANES: usize = 8;

/// Sum of squares of `grad` in f64.
///
/// Deterministic: the slice is cut into fixed [`CHUNK`]s, each chunk is summed in a fixed order
/// (each square is exact in f64, since an f32 has a 24-bit significand), the per-chunk partial sums
/// are collected in chunk order and added sequentially. The result is bitwise the same whatever the
/// number of rayon threads. For the global norm over several tensors, add their sums in a fixed
/// order and take the square root.
pub fn sum_squares(grad: Grad<'_>) -> f64 {
    let partials: Vec<f64> = match grad {
        Grad::F32(g) => g.par_chunks(CHUNK).map(|c| chunk_sum_squares(c, |x| x)).collect(),
        Grad::Bf16(g) => g.par_chunks(CHUNK).map(|c| chunk_sum_squares(c, widen_bf16)).collect(),
    };
    partials.iter().fold(0.0, |acc, s| acc + s)
}

/// Writes `src` into `dst` (rounded to `dst`'s type) and returns the sum of squares of the values
/// stored — bitwise [`sum_squares`] of `dst` afterwards (same chunks, same order) — in one pass
/// over memory instead of two: each chunk is summed while it is still in cache. With
/// `Upload::None` nothing is written and the sum is over `src`.
pub fn cast_sum_squares(src: &[f32], dst: Upload<'_>) -> Result<f64, Error> {
    fn go<U: UploadElem>(
        src: &[f32],
        dst: &mut [U],
        to_f32: impl Fn(U) -> f32 + Sync,
    ) -> Result<Vec<f64>, Error> {
        check_len("gradient", src.len(), dst.len())?;
        Ok(dst
            .par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .map(|(d, s)| {
                U::narrow(s, d);
                chunk_sum_squares(d, &to_f32)
            })
            .collect())
    }
    let partials = match dst {
        Upload::None => src.par_chunks(CHUNK).map(|c| chunk_sum_squares(c, |x| x)).collect(),
        Upload::F32(d) => go(src, d, |x| x)?,
        Upload::Bf16(d) => go(src, d, widen_bf16)?,
        Upload::F16(d) => go(src, d, |x| x.to_f32())?,
    };
    Ok(partials.iter().fold(0.0, |acc, s| acc + s))
}

/// bf16 to f32 for a sum of squares: the bits shifted up, without `half`'s branch that quietens a
/// signalling NaN (whose square is NaN either way), so the loop vectorises.
#[inline(always)]
fn widen_bf16(x: half::bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

#[inline(always)]
pub(crate) fn chunk_sum_squares<T: Copy>(chunk: &[T], to_f32: impl Fn(T) -> f32) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut exact = chunk.chunks_exact(LANES);
    for group in &mut exact {
        for (a, &x) in acc.iter_mut().zip(group) {
            let x = f64::from(to_f32(x));
            *a += x * x;
        }
    }
    let mut tail = 0.0f64;
    for &x in exact.remainder() {
        let x = f64::from(to_f32(x));
        tail += x * x;
    }
    acc.iter().fold(0.0, |s, a| s + a) + tail
}

/// The coefficient `torch.nn.utils.clip_grad_norm_` multiplies the gradients by:
/// `min(1, max_norm / (total_norm + 1e-6))`, computed as torch computes it, on a 0-dim f32 tensor:
/// `total_norm + 1e-6` in f32, then `Tensor.__rtruediv__`, which is `reciprocal() * max_norm`, then
/// `clamp(max=1.0)`. Pass the result as [`crate::StepArgs::grad_scale`].
///
/// A NaN norm gives a NaN coefficient (torch's clamp propagates NaN), so non-finite gradients
/// poison the update exactly as they do in torch rather than being silently left unclipped.
/// torch's own `total_norm` is an f32 norm of per-tensor f32 norms; ours comes from f64 sums
/// ([`sum_squares`]), so the two may differ in the last bit of the coefficient.
pub fn clip_coef(total_norm: f64, max_norm: f64) -> f32 {
    let denom = total_norm as f32 + 1e-6_f64 as f32;
    let coef = (1.0 / denom) * max_norm as f32;
    if coef > 1.0 {
        1.0
    } else {
        coef
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn naive(g: impl Iterator<Item = f32>) -> f64 {
        g.map(|x| f64::from(x) * f64::from(x)).sum()
    }

    #[test]
    fn sum_squares_is_reproducible_across_thread_counts_and_matches_a_naive_loop() {
        let mut rng = StdRng::seed_from_u64(21);
        let n = 5 * CHUNK + 1234;
        let g: Vec<f32> =
            (0..n).map(|_| rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-4..4))).collect();
        let gb: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let on = |threads: usize, grad: Grad<'_>| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| sum_squares(grad))
        };
        for (name, grad, want) in [
            ("f32", Grad::F32(&g), naive(g.iter().copied())),
            ("bf16", Grad::Bf16(&gb), naive(gb.iter().map(|x| x.to_f32()))),
        ] {
            let one = on(1, grad);
            for threads in [2, 3, 7] {
                assert_eq!(on(threads, grad).to_bits(), one.to_bits(), "{name}: {threads} threads vs 1");
            }
            assert_eq!(sum_squares(grad).to_bits(), one.to_bits(), "{name}: global pool vs 1 thread");
            let rel = (one - want).abs() / want;
            assert!(rel <= 1e-12, "{name}: {one} vs naive {want} (relative {rel:e})");
        }
        assert_eq!(sum_squares(Grad::F32(&[])), 0.0);
        assert_eq!(sum_squares(Grad::F32(&[3.0, -4.0])), 25.0);
    }

    #[test]
    fn clip_coef_is_one_below_the_max_norm() {
        assert_eq!(clip_coef(0.5, 1.0), 1.0);
        assert_eq!(clip_coef(0.0, 1.0), 1.0);
        assert_eq!(clip_coef(0.999, 1.0), 1.0);
    }

    /// Above the max norm the coefficient is max_norm / (total_norm + 1e-6), bitwise as torch computes
    /// it. Expected values from PyTorch 2.15.0 (CPU):
    ///
    /// ```python
    /// import torch
    /// for tn, mx in [(3.0, 1.0), (1.0, 1.0), (7.123456789, 0.3), (123456.7, 1.0)]:
    ///     t = torch.tensor(tn, dtype=torch.float32)
    ///     print(tn, mx, repr(torch.clamp(mx / (t + 1e-6), max=1.0).item()))
    /// ```
    #[test]
    fn clip_coef_above_the_max_norm_matches_torch_bitwise() {
        let cases = [
            (3.0, 1.0, 0.33333322405815125),
            // At exactly the max norm the 1e-6 makes the coefficient just below 1, as in torch.
            (1.0, 1.0, 0.9999990463256836),
            (7.123456789, 0.3, 0.04211438074707985),
            (123456.7, 1.0, 8.100005288724788e-06),
        ];
        for (total, max, torch) in cases {
            let c = clip_coef(total, max);
            assert_eq!(f64::from(c), torch, "clip_coef({total}, {max})");
            let formula = max / (total + 1e-6);
            assert!((f64::from(c) - formula).abs() <= 1e-6 * formula, "clip_coef({total}, {max}) vs formula");
        }
    }

    #[test]
    fn clip_coef_propagates_nan_like_torch_clamp() {
        assert!(clip_coef(f64::NAN, 1.0).is_nan());
        assert_eq!(clip_coef(f64::INFINITY, 1.0), 0.0);
    }

    #[test]
    fn cast_sum_squares_stores_and_sums_like_the_two_passes() {
        let src: Vec<f32> = (0..100_003).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1.37e-3).collect();
        for kind in 0..3 {
            let (fused, two_pass) = match kind {
                0 => {
                    let mut d = vec![0f32; src.len()];
                    let f = cast_sum_squares(&src, Upload::F32(&mut d)).unwrap();
                    assert_eq!(d, src);
                    (f, sum_squares(Grad::F32(&d)))
                }
                1 => {
                    let mut d = vec![half::bf16::ZERO; src.len()];
                    let f = cast_sum_squares(&src, Upload::Bf16(&mut d)).unwrap();
                    assert!(d.iter().zip(&src).all(|(a, b)| *a == half::bf16::from_f32(*b)));
                    (f, sum_squares(Grad::Bf16(&d)))
                }
                _ => (cast_sum_squares(&src, Upload::None).unwrap(), sum_squares(Grad::F32(&src))),
            };
            assert_eq!(fused.to_bits(), two_pass.to_bits(), "kind {kind}");
        }
        let mut short = vec![0f32; 3];
        assert!(cast_sum_squares(&src, Upload::F32(&mut short)).is_err());
    }
}

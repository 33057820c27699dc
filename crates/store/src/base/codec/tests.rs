//! The encodings against their definitions: the NF4 code computed again from the normal
//! distribution, exact round trips where the format holds a value exactly, and the error bounds
//! on random and adversarial blocks.

use half::bf16;
use mt_core::{BaseCode, BASE_BLOCK};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// The standard normal distribution's CDF: `1/2 + φ(x) Σ x^(2n+1) / (1·3···(2n+1))`, a series
/// that converges for every x (to f64's rounding for |x| < 3, where it is used).
fn normal_cdf(x: f64) -> f64 {
    let (mut term, mut sum, mut n) = (x, x, 1.0);
    while term.abs() > 1e-20 * sum.abs() {
        n += 2.0;
        term *= x * x / n;
        sum += term;
    }
    0.5 + (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt() * sum
}

/// The quantile of probability `p` (bisection on [`normal_cdf`]).
fn normal_quantile(p: f64) -> f64 {
    let (mut lo, mut hi) = (-4.0, 4.0);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// The NF4 table is its definition: quantiles of N(0, 1) at 8 probabilities evenly spaced from
/// δ to 1/2 (1/2 excluded) for the positive half, 7 for the negative one, an exact 0, all
/// divided by the quantile at δ, each rounded to the nearest f32.
#[test]
fn nf4_code_is_its_definition() {
    let delta = 0.5 * (1.0 - 1.0 / 30.0 + 1.0 - 1.0 / 32.0);
    let q = |k: usize, n: usize| normal_quantile(delta - (delta - 0.5) * k as f64 / n as f64);
    let top = q(0, 8);
    let mut code: Vec<f64> = (0..8).map(|k| q(k, 8) / top).collect();
    code.extend((0..7).map(|k| -q(k, 7) / top));
    code.push(0.0);
    code.sort_by(f64::total_cmp);
    for (i, (&c, &t)) in code.iter().zip(&NF4).enumerate() {
        assert_eq!((c as f32).to_bits(), t.to_bits(), "NF4[{i}]: {c} by the definition, {t} in the table");
    }
    assert_eq!((NF4[0], NF4[7], NF4[15]), (-1.0, 0.0, 1.0));
    assert_eq!(NF4[usize::from(NF4_ZERO)], 0.0);
}

/// The largest gap between neighbouring NF4 codes (between -1 and the next: 0.3038).
fn nf4_widest_gap() -> f64 {
    NF4.windows(2).map(|w| f64::from(w[1]) - f64::from(w[0])).fold(0.0, f64::max)
}

fn roundtrip(code: BaseCode, v: &[f32]) -> Vec<f32> {
    let mut bytes = vec![0u8; code.block_bytes()];
    encode_block(code, v, &mut bytes);
    let mut out = vec![0f32; BASE_BLOCK];
    decode_block(code, &bytes, &mut out);
    out
}

/// A block of random values: normal (Box-Muller), uniform, or normal with a few outliers 100
/// times larger, times a random power of ten.
fn random_block(rng: &mut StdRng) -> Vec<f32> {
    let scale = 10f64.powi(rng.random_range(-30..=30));
    let kind = rng.random_range(0..3);
    (0..BASE_BLOCK)
        .map(|_| {
            let normal = (-2.0 * rng.random::<f64>().max(1e-300).ln()).sqrt()
                * (2.0 * std::f64::consts::PI * rng.random::<f64>()).cos();
            let x = match kind {
                0 => normal,
                1 => rng.random_range(-1.0..1.0),
                _ if rng.random_range(0..32) == 0 => 100.0 * normal,
                _ => normal,
            };
            (x * scale) as f32
        })
        .collect()
}

/// The worst error of int8's and NF4's decoding of `v`, each relative to the format's bound
/// (int8 `absmax / 254`, NF4 half the widest gap times `absmax`: 1 where an error equals it);
/// asserts each error is within its bound plus one f32 unit in the last place of `absmax` (f32's
/// rounding of the scale and of a product, which can widen a gap between neighbouring codes).
fn error_ratios(v: &[f32]) -> (f64, f64) {
    let a = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let ulp = f64::from(a.next_up()) - f64::from(a);
    let bound = |code| match code {
        BaseCode::Int8 => f64::from(a) / 254.0,
        _ => 0.5 * nf4_widest_gap() * f64::from(a),
    };
    let worst = |code| {
        let d = roundtrip(code, v);
        assert!(d.iter().all(|x| x.is_finite()), "{code:?} decoded a non-finite value from {v:?}");
        let e = v.iter().zip(&d).map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs()).fold(0.0, f64::max);
        assert!(e <= bound(code) + ulp, "{code:?}: error {e:e} past {:e} + {ulp:e} on {v:?}", bound(code));
        if a == 0.0 {
            0.0
        } else {
            e / bound(code)
        }
    };
    (worst(BaseCode::Int8), worst(BaseCode::Nf4))
}

/// Every element of 20000 random blocks decodes within its bound: int8 `absmax / 254`, NF4 half
/// the widest gap of the code times `absmax`, each plus one unit in the last place of `absmax`
/// (`error_ratios`).
#[test]
fn error_bounds_hold_on_random_blocks() {
    let mut rng = StdRng::seed_from_u64(48);
    let (mut int8, mut nf4) = (0f64, 0f64);
    for _ in 0..20_000 {
        let (i, n) = error_ratios(&random_block(&mut rng));
        (int8, nf4) = (int8.max(i), nf4.max(n));
    }
    eprintln!("SUMMARY worst error / bound on 20000 random blocks: int8 {int8:.7}, NF4 {nf4:.7}");
    // The bounds are tight: random blocks come near them (else they would not test much).
    assert!(int8 > 0.99 && nf4 > 0.9, "int8 {int8}, NF4 {nf4}");
}

/// `127 · int8_scale(a)` is finite and reaches `a` to within half a scale (the top element's
/// error, within the bound), over the top 2^20 f32 values, the subnormals and a sweep between.
#[test]
fn int8_scales_reach_every_element_and_stay_finite() {
    let top = f32::MAX.to_bits();
    let sweep = (top - (1 << 20)..=top).chain(1..1 << 16).chain((1..top).step_by(997));
    for bits in sweep {
        let a = f32::from_bits(bits);
        let s = int8_scale(a);
        let short = f64::from(a) - f64::from(127.0 * s);
        assert!(
            s > 0.0 && (127.0 * s).is_finite() && short <= f64::from(s) / 2.0,
            "absmax {a:e}: scale {s:e}"
        );
    }
}

/// Blocks built to hurt: all zero (decoded as exact zeros, not 0/0), one huge outlier (f32::MAX
/// beside ordinary values: the scale must not overflow, the rest may all go to zero within the
/// bound), the same value everywhere, values at ±absmax, subnormals, and a block whose scale
/// underflows.
#[test]
fn error_bounds_hold_on_adversarial_blocks() {
    let zeros = vec![0f32; BASE_BLOCK];
    for code in [BaseCode::F32, BaseCode::Bf16, BaseCode::Int8, BaseCode::Nf4] {
        assert!(roundtrip(code, &zeros).iter().all(|x| x.to_bits() == 0), "{code:?}: zeros");
    }
    let mut rng = StdRng::seed_from_u64(7);
    let ordinary: Vec<f32> = (0..BASE_BLOCK).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut blocks = vec![zeros.clone()];
    for (at, big) in [(0, f32::MAX), (17, -f32::MAX), (63, 1e30), (5, -3e38)] {
        let mut v = ordinary.clone();
        v[at] = big;
        blocks.push(v);
    }
    blocks.push(vec![0.3; BASE_BLOCK]);
    blocks.push(vec![-f32::MAX; BASE_BLOCK]);
    blocks.push((0..BASE_BLOCK).map(|i| if i % 2 == 0 { 2.5 } else { -2.5 }).collect());
    blocks.push((0..BASE_BLOCK).map(|i| f32::from_bits(i as u32 * 3)).collect());
    blocks.push(
        (0..BASE_BLOCK)
            .map(|i| f32::from_bits(1 + i as u32 % 5) * if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect(),
    );
    blocks.push((0..BASE_BLOCK).map(|i| f32::MIN_POSITIVE * (i as f32 - 31.5)).collect());
    for v in &blocks {
        error_ratios(v);
    }
    // The outlier itself is kept exactly (it is ±absmax: code ±127, NF4 ±1).
    let mut v = ordinary.clone();
    v[9] = 1e30;
    assert_eq!(roundtrip(BaseCode::Nf4, &v)[9], 1e30);
    assert!((roundtrip(BaseCode::Int8, &v)[9] / 1e30 - 1.0).abs() < 1e-6);
}

/// Exact where the format holds the value: bf16 of a bf16 value, fp32 of anything, int8 of
/// values on its grid (`q · s` with the block's absmax `127 · s`, `s` a power of two), NF4 of
/// `code · absmax` with absmax a power of two.
#[test]
fn exact_round_trips() {
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..100 {
        let v: Vec<f32> = (0..BASE_BLOCK).map(|_| bf16::from_bits(rng.random()).to_f32()).collect();
        if v.iter().all(|x| x.is_finite()) {
            assert_eq!(bits(&roundtrip(BaseCode::Bf16, &v)), bits(&v));
        }
        let v: Vec<f32> = (0..BASE_BLOCK).map(|_| f32::from_bits(rng.random_range(0..0x7f80_0000))).collect();
        assert_eq!(bits(&roundtrip(BaseCode::F32, &v)), bits(&v));
        let s = 2f32.powi(rng.random_range(-120..=100));
        let mut v: Vec<f32> = (0..BASE_BLOCK).map(|_| rng.random_range(-127..=127) as f32 * s).collect();
        v[rng.random_range(0..BASE_BLOCK)] = if rng.random() { 127.0 * s } else { -127.0 * s };
        assert_eq!(bits(&roundtrip(BaseCode::Int8, &v)), bits(&v), "int8 on the grid of {s}");
        let a = 2f32.powi(rng.random_range(-120..=120));
        let mut v: Vec<f32> = (0..BASE_BLOCK).map(|_| NF4[rng.random_range(0..16)] * a).collect();
        v[rng.random_range(0..BASE_BLOCK)] = if rng.random() { a } else { -a };
        assert_eq!(bits(&roundtrip(BaseCode::Nf4, &v)), bits(&v), "NF4 codes times {a}");
    }
    // A bf16 encoding of any f32 is its nearest-even rounding.
    let v: Vec<f32> = (0..BASE_BLOCK).map(|i| 1.0 + i as f32 * 1e-3).collect();
    let want: Vec<f32> = v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect();
    assert_eq!(bits(&roundtrip(BaseCode::Bf16, &v)), bits(&want));
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The parallel segment codec is the block codec, and decoding into bf16 rounds the f32 value
/// once (nearest even): what the GPU's kernel writes into a bf16 slot.
#[test]
fn segments_decode_block_by_block() {
    let mut rng = StdRng::seed_from_u64(11);
    let n = BASE_BLOCK * (2 * TASK_BLOCKS + 3);
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    for code in [BaseCode::F32, BaseCode::Bf16, BaseCode::Int8, BaseCode::Nf4] {
        let mut bytes = vec![0u8; n / BASE_BLOCK * code.block_bytes()];
        encode(code, &v, &mut bytes);
        let mut f = vec![0f32; n];
        decode(code, &bytes, Decoded::F32(&mut f));
        let mut b = vec![bf16::ZERO; n];
        decode(code, &bytes, Decoded::Bf16(&mut b));
        for (k, blk) in bytes.chunks_exact(code.block_bytes()).enumerate() {
            let one = roundtrip(code, &v[k * BASE_BLOCK..(k + 1) * BASE_BLOCK]);
            let mut dec = vec![0f32; BASE_BLOCK];
            decode_block(code, blk, &mut dec);
            assert_eq!(bits(&dec), bits(&one), "{code:?} block {k}");
            assert_eq!(bits(&f[k * BASE_BLOCK..(k + 1) * BASE_BLOCK]), bits(&one), "{code:?} block {k}");
        }
        assert!(f.iter().zip(&b).all(|(x, y)| bf16::from_f32(*x).to_bits() == y.to_bits()), "{code:?}");
    }
}

/// The hash the emulator check of `kernels/cuda/base.cu` builds its inputs from (the same in
/// `kernels/emu/base_check.cpp`).
fn emu_hash(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// A value in [-4, 4) from `emu_hash(x)`, exact in f32.
fn emu_value(x: u32) -> f32 {
    ((emu_hash(x) >> 8) as f32 * (1.0 / 16_777_216.0) - 0.5) * 8.0
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

/// The emulator check's inputs (`kernels/emu/base_check.cpp`): a segment of `EMU_BLOCKS` blocks
/// in each code, fp32 and bf16 values and int8 / NF4 codes from [`emu_hash`], scales of several
/// magnitudes; decoded into f32 and into bf16 by the reference, their FNV-1a hashes must be the
/// ones that check asserts for the kernels.
#[test]
fn emulator_check_inputs_decode_to_its_hashes() {
    const EMU_BLOCKS: usize = 5;
    let n = EMU_BLOCKS * BASE_BLOCK;
    let (mut f32_out, mut bf16_out) = (Vec::new(), Vec::new());
    for (c, code) in [BaseCode::F32, BaseCode::Bf16, BaseCode::Int8, BaseCode::Nf4].into_iter().enumerate() {
        let salt = 1000 * c as u32;
        let mut bytes = Vec::new();
        for b in 0..EMU_BLOCKS as u32 {
            match code {
                BaseCode::F32 => {
                    (0..64).for_each(|j| bytes.extend(emu_value(salt + b * 64 + j).to_le_bytes()))
                }
                BaseCode::Bf16 => (0..64).for_each(|j| {
                    bytes.extend(bf16::from_f32(emu_value(salt + b * 64 + j)).to_bits().to_le_bytes())
                }),
                _ => {
                    let scale = ((emu_hash(salt + 7 * b) >> 8) as f32 * (1.0 / 16_777_216.0) + 0.01)
                        * 2f32.powi(b as i32 * 3 - 6);
                    bytes.extend(scale.to_le_bytes());
                    (0..code.block_bytes() as u32 - 4)
                        .for_each(|j| bytes.push(emu_hash(salt + 500 + b * 64 + j) as u8));
                }
            }
        }
        let mut f = vec![0f32; n];
        decode(code, &bytes, Decoded::F32(&mut f));
        let mut h = vec![bf16::ZERO; n];
        decode(code, &bytes, Decoded::Bf16(&mut h));
        f32_out.extend(f.iter().flat_map(|x| x.to_le_bytes()));
        bf16_out.extend(h.iter().flat_map(|x| x.to_bits().to_le_bytes()));
    }
    let hashes = (fnv1a(&f32_out), fnv1a(&bf16_out));
    eprintln!("emulator check hashes: f32 {:#x}, bf16 {:#x}", hashes.0, hashes.1);
    assert_eq!(hashes, (0x29b5_4715_67cf_4c2e, 0xe7ed_aec4_565d_e8aa));
}

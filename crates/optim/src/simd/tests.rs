//! The vector kernels against the scalar definitions, bit for bit, on every instruction set this
//! CPU has: whole passes over awkward lengths and special values, and the codes of values at and
//! around every code boundary.

use half::bf16;
use mt_core::{StateDtype, Q8_BLOCK};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{Isa, Pass};
use crate::adamw::Coeffs;
use crate::coded::{mom_chunks, run_coded, update_coded};
use crate::moments::{code_m, code_v, fourth, m_bits, v_bits, Moments, M_TOP, V_TOP};
use crate::{AdamW, StepArgs, CHUNK};

/// Values over many orders of magnitude, both signs, and the special ones: zeros, subnormals,
/// infinities and NaNs (with payloads), at positions that fall inside and at the ends of vectors.
fn nasty(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| match i % 53 {
            0 => 0.0,
            7 => -0.0,
            13 => f32::from_bits(rng.random_range(1..0x0080_0000)),
            20 if i % 5 == 0 => f32::NAN,
            21 if i % 7 == 0 => f32::from_bits(0xFFC0_1234),
            31 if i % 11 == 0 => f32::INFINITY,
            _ => {
                let x = scale * 10f32.powf(rng.random_range(-8.0f32..1.0));
                if rng.random_bool(0.5) {
                    -x
                } else {
                    x
                }
            }
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|x| x.to_bits()).collect()
}

/// A whole pass over bf16 and 8-bit moments on each instruction set gives the scalar pass's
/// master, moments and upload copy bit for bit: several steps (warm moments), f32 and bf16
/// gradients (signalling NaNs among the latter), no upload copy, a bf16 one (written by the
/// kernels) and an f32 one (cast after), lengths that end inside a vector and inside an 8-bit
/// block and span two chunks, finite and non-finite gradients, and 8-bit blocks whose gradients
/// are all zero, mostly subnormal (the block's `top / max` overflows and is clamped), tiny, or
/// huge enough that `g²` overflows.
#[test]
fn every_instruction_set_gives_the_scalar_bits() {
    let isas = Isa::available();
    assert!(isas.contains(&Isa::SCALAR));
    let mut rng = StdRng::seed_from_u64(11);
    let h = AdamW { weight_decay: 0.1, ..AdamW::default() };
    let cases = [
        (3 * 1024 + 517, true, false),
        (5 * Q8_BLOCK, true, false),
        (2 * 1024 + 7, false, false),
        (13, true, false),
        (CHUNK + 3 * Q8_BLOCK + 5, true, false),
        (6 * Q8_BLOCK + 9, true, true),
    ];
    for (n, finite, scaled_blocks) in cases {
        let grads: Vec<Vec<f32>> = (0..4)
            .map(|_| {
                let g = nasty(&mut rng, n, 1e-2);
                let g: Vec<f32> = if finite {
                    g.iter().map(|&x| if x.is_finite() { x } else { 1e-3 }).collect()
                } else {
                    g
                };
                if !scaled_blocks {
                    return g;
                }
                // Block by block: zero, subnormal (inverse clamped), tiny, plain, g² overflowing, plain.
                let scale = [0.0f32, 1e-36, 1e-30, 1.0, 1e30, 1.0, 1.0];
                g.iter().enumerate().map(|(i, &x)| x * scale[i / Q8_BLOCK]).collect()
            })
            .collect();
        let grads_bf16: Vec<Vec<bf16>> = grads
            .iter()
            .map(|g| {
                let nan = |i: usize| !finite && i % 97 == 5;
                // A signalling NaN (quiet bit clear) where the gradient may be non-finite.
                g.iter()
                    .enumerate()
                    .map(|(i, &x)| if nan(i) { bf16::from_bits(0x7F81) } else { bf16::from_f32(x) })
                    .collect()
            })
            .collect();
        let p0: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for (dtype, bf16_grads, upload) in [StateDtype::Bf16, StateDtype::Int8]
            .into_iter()
            .flat_map(|d| [false, true].into_iter().flat_map(move |b| [0, 1, 2].map(|u| (d, b, u))))
        {
            let run = |isa: Isa| {
                let mut state = vec![0f32; dtype.state_words(n)];
                state[..n].copy_from_slice(&p0);
                let (mut up16, mut up32) = (vec![bf16::ZERO; n], vec![0f32; n]);
                for t in 0..grads.len() {
                    let a = StepArgs { step: t as u64 + 1, lr: 1e-3, grad_scale: 0.5 };
                    let c = Coeffs::of(&h, &a).unwrap();
                    let (p, mom) = Moments::split_state(dtype, n, &mut state, 7).unwrap();
                    match (bf16_grads, upload) {
                        (false, 0) => run_coded::<f32, f32>(isa, &c, a.step, &grads[t], p, mom, None),
                        (false, 1) => run_coded(isa, &c, a.step, &grads[t], p, mom, Some(&mut up16[..])),
                        (false, _) => run_coded(isa, &c, a.step, &grads[t], p, mom, Some(&mut up32[..])),
                        (true, 0) => run_coded::<bf16, f32>(isa, &c, a.step, &grads_bf16[t], p, mom, None),
                        (true, 1) => run_coded(isa, &c, a.step, &grads_bf16[t], p, mom, Some(&mut up16[..])),
                        (true, _) => run_coded(isa, &c, a.step, &grads_bf16[t], p, mom, Some(&mut up32[..])),
                    }
                }
                let up: Vec<u32> = up16.iter().map(|x| u32::from(x.to_bits())).chain(bits(&up32)).collect();
                (bits(&state), up)
            };
            let scalar = run(Isa::SCALAR);
            let what = format!("{dtype} n={n} finite={finite} bf16 grads={bf16_grads} upload={upload}");
            if upload > 0 {
                assert!(scalar.1.iter().any(|&x| x != 0), "{what}: an upload copy is written");
            }
            for &isa in &isas[1..] {
                let got = run(isa);
                let first = scalar.0.iter().zip(&got.0).position(|(a, b)| a != b);
                assert_eq!(first, None, "{what}: {isa:?} state differs at word {first:?}");
                assert!(scalar.1 == got.1, "{what}: {isa:?} upload differs");
            }
        }
    }
}

/// A chunk whose elements' indices cross 2³² (a unit of more than 4 Gi parameters: the draws'
/// index is the element's index modulo 2³², `(base + j) as u32`): each instruction set gives the
/// scalar bits, and a chunk 2³² elements further on draws exactly the same.
#[test]
fn draw_indices_wrap_at_2_pow_32_alike_on_every_instruction_set() {
    let mut rng = StdRng::seed_from_u64(14);
    let n = 4 * Q8_BLOCK;
    let g: Vec<f32> =
        nasty(&mut rng, n, 1e-2).into_iter().map(|x| if x.is_finite() { x } else { 0.0 }).collect();
    let p0: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let h = AdamW { weight_decay: 0.1, ..AdamW::default() };
    let a = StepArgs { step: 3, lr: 1e-3, grad_scale: 1.0 };
    let c = Coeffs::of(&h, &a).unwrap();
    let near = u32::MAX as usize - Q8_BLOCK - 5;
    for dtype in [StateDtype::Bf16, StateDtype::Int8] {
        let run = |isa: Isa, base: usize| {
            let mut state = vec![0f32; dtype.state_words(n)];
            state[..n].copy_from_slice(&p0);
            // Warm moments, from a first update at index 0.
            for base in [0, base] {
                let (p, mom) = Moments::split_state(dtype, n, &mut state, 7).unwrap();
                let (mut chunks, key) = mom_chunks(mom, a.step);
                update_coded::<f32, f32>(Pass { isa, c: &c, key }, base, &g, p, chunks.remove(0), None);
            }
            bits(&state)
        };
        let scalar = run(Isa::SCALAR, near);
        assert_eq!(run(Isa::SCALAR, near + (1 << 32)), scalar, "{dtype}: index modulo 2³²");
        assert_ne!(run(Isa::SCALAR, near + 1), scalar, "{dtype}: the draws depend on the index");
        for &isa in &Isa::available()[1..] {
            assert_eq!(run(isa, near), scalar, "{dtype}: {isa:?} across 2³²");
            assert_eq!(run(isa, near + (1 << 32)), scalar, "{dtype}: {isa:?} past 2³²");
        }
    }
}

/// The codes of single values (`inv = 1`, so `y = |x|`) at, just below and just above every
/// code boundary (`k²`, `fourth(k)`), and of zeros, subnormals, NaNs and infinities: each
/// instruction set's lanes give the scalar `code_m` and `code_v`, with draws at both ends of
/// `[0, 1)` and in between.
#[test]
fn codes_at_every_boundary_are_the_scalar_ones() {
    let mut ys = vec![0.0f32, -0.0, 1e-45, 1e-30, 0.25, 0.5, f32::NAN, f32::INFINITY, f32::MAX, 1e30];
    for k in 0..=256u32 {
        let k = k as f32;
        for edge in [k * k, fourth(k), M_TOP, V_TOP] {
            for d in -3i32..=3 {
                ys.push(f32::from_bits((edge.to_bits() as i32 + d).max(0) as u32));
            }
        }
    }
    let draws = [0u32, 0xFFFF, 0x1_0000, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_0000, 0x0000_8000, u32::MAX];
    check_codes(&ys, &draws);
}

/// The same over a sweep of every 4099th f32 from 0 to past `255⁴` (every one with
/// `MT_OPTIM_SWEEP_STRIDE=1` in the environment: about 1.1e9 values, for a release build).
#[test]
fn codes_over_a_sweep_of_f32_are_the_scalar_ones() {
    let stride = std::env::var("MT_OPTIM_SWEEP_STRIDE").ok().and_then(|s| s.parse().ok()).unwrap_or(4099u32);
    let top = (V_TOP * 1.001).to_bits();
    let mut rng = StdRng::seed_from_u64(12);
    let mut ys = Vec::with_capacity(1 << 16);
    let mut draws = Vec::with_capacity(1 << 16);
    let mut b = 0u32;
    while b <= top {
        ys.push(f32::from_bits(b));
        draws.push(rng.random());
        if ys.len() == 1 << 16 {
            check_codes_paired(&ys, &draws);
            ys.clear();
            draws.clear();
        }
        b = b.saturating_add(stride);
        if b == u32::MAX {
            break;
        }
    }
    check_codes_paired(&ys, &draws);
}

/// Every `y` with every draw.
fn check_codes(ys: &[f32], draws: &[u32]) {
    for &h in draws {
        check_codes_paired(ys, &vec![h; ys.len()]);
    }
}

/// `ys[i]` with `draws[i]`, as `m` of both signs and as `v`.
fn check_codes_paired(ys: &[f32], draws: &[u32]) {
    for &isa in &Isa::available()[1..] {
        for sign in [1.0f32, -1.0] {
            let x: Vec<f32> = ys.iter().map(|&y| sign * y).collect();
            let (mut m, mut v) = (vec![0u8; x.len()], vec![0u8; x.len()]);
            let done = super::codes(isa, &x, 1.0, draws, &mut m, &mut v);
            for i in 0..done {
                let (want_m, want_v) =
                    (code_m(x[i], 1.0, m_bits(draws[i])), code_v(x[i], 1.0, v_bits(draws[i])));
                let what = |w| {
                    format!("{isa:?}: {w} code of {:e} ({:#x}), draw {:#x}", x[i], x[i].to_bits(), draws[i])
                };
                assert_eq!(m[i], want_m, "{}", what("m"));
                assert_eq!(v[i], want_v, "{}", what("v"));
            }
        }
    }
}

/// The scalar codes are the definition's: the largest `lo` whose code value is at most `y`, by
/// a plain scan.
#[test]
fn scalar_floors_are_the_definitions() {
    use crate::moments::{m_floor, v_floor};
    let mut rng = StdRng::seed_from_u64(13);
    let mut ys: Vec<f32> =
        (0..20_000).map(|_| f32::from_bits(rng.random_range(0..=(V_TOP * 1.01).to_bits()))).collect();
    for k in 0..=256u32 {
        let k = k as f32;
        for edge in [k * k, fourth(k)] {
            for d in -2i32..=2 {
                ys.push(f32::from_bits((edge.to_bits() as i32 + d).max(0) as u32));
            }
        }
    }
    for y in ys {
        let scan_m = (0..=126).rev().map(|k| k as f32).find(|&k| k * k <= y).unwrap();
        let scan_v = (0..=254).rev().map(|k| k as f32).find(|&k| fourth(k) <= y).unwrap();
        assert_eq!(m_floor(y), scan_m, "m_floor({y:e})");
        assert_eq!(v_floor(y), scan_v, "v_floor({y:e})");
    }
}

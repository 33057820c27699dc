//! Tests of the moment encodings: error bounds of the 8-bit codes and bf16 stochastic rounding
//! (named below, quoted by `docs/decisions/0033-optimizer-state-precision.md`), unbiasedness,
//! special values, layouts, and the fused update over coded moments against the scalar
//! reference on the decoded moments.

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::{land_and_step, step_fused, step_reference, AdamW, Grad, StepArgs, Upload};

/// `m`: an element of at least 1% of its block's largest magnitude decodes within this relative
/// error (one step of the square-root code at code 12.7: `(2c + 1) / c²`).
const M_REL_AT_1PCT: f64 = 0.17;
/// `m`: at least 10% of the block's largest: within this (code 40.2).
const M_REL_AT_10PCT: f64 = 0.051;
/// `v`: an element of at least 1e-4 of its block's largest decodes within this relative error
/// (one step of the fourth-root code at code 25.5: `((c + 1)⁴ − c⁴) / c⁴`).
const V_REL_AT_1E4: f64 = 0.17;
/// `v`: at least 1e-2 of the block's largest: within this (code 80.6).
const V_REL_AT_1E2: f64 = 0.051;
/// bf16 with stochastic rounding: within one bf16 ulp, `2⁻⁷` relative.
const BF16_SR_REL: f64 = 1.0 / 128.0;

/// Values over many orders of magnitude, both signs, exact zeros.
fn wide(rng: &mut StdRng, n: usize, signed: bool) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if i % 29 == 0 {
                return 0.0;
            }
            let x = 10f32.powf(rng.random_range(-9.0f32..0.0));
            if signed && rng.random_bool(0.5) {
                -x
            } else {
                x
            }
        })
        .collect()
}

fn rel(a: f32, b: f32) -> f64 {
    (f64::from(a) - f64::from(b)).abs() / f64::from(b).abs()
}

#[test]
fn int8_m_decodes_within_its_named_bounds_and_keeps_signs_and_zeros() {
    let mut rng = StdRng::seed_from_u64(1);
    for trial in 0..50u32 {
        let x = wide(&mut rng, Q8_BLOCK, true);
        let mut codes = vec![0u8; Q8_BLOCK];
        let s = encode_m(&x, &mut codes, mix32(trial), 0);
        let mut d = vec![0.0; Q8_BLOCK];
        decode_m(&codes, s, &mut d);
        let amax = x.iter().fold(0f32, |a, b| a.max(b.abs()));
        assert!(rel(s * M_TOP, amax) < 1e-6, "the step is max|m| / 127²");
        for (i, (&x, &d)) in x.iter().zip(&d).enumerate() {
            if x == 0.0 {
                assert_eq!(d, 0.0, "[{i}]: zero stays zero");
                continue;
            }
            assert!(d == 0.0 || d.signum() == x.signum(), "[{i}]: {x} decoded as {d}");
            // One of the two codes around it.
            let c = (x.abs() / s).sqrt();
            let (lo, hi) = ((c.floor() - 1.0).max(0.0), c.ceil() + 1.0);
            assert!((lo * lo * s..=hi * hi * s).contains(&d.abs()), "[{i}]: {x} decoded as {d}");
            let bound = match x.abs() / amax {
                f if f >= 0.1 => M_REL_AT_10PCT,
                f if f >= 0.01 => M_REL_AT_1PCT,
                _ => continue,
            };
            assert!(rel(d, x) <= bound, "[{i}]: {x} decoded as {d} (rel {:.3e} > {bound})", rel(d, x));
        }
    }
}

#[test]
fn int8_v_decodes_within_its_named_bounds() {
    let mut rng = StdRng::seed_from_u64(2);
    for trial in 0..50u32 {
        let x = wide(&mut rng, Q8_BLOCK, false);
        let mut codes = vec![0u8; Q8_BLOCK];
        let s = encode_v(&x, &mut codes, mix32(trial), 0);
        let mut d = vec![0.0; Q8_BLOCK];
        decode_v(&codes, s, &mut d);
        let vmax = x.iter().fold(0f32, |a, &b| a.max(b));
        for (i, (&x, &d)) in x.iter().zip(&d).enumerate() {
            if x == 0.0 {
                assert_eq!(d, 0.0, "[{i}]: zero stays zero");
                continue;
            }
            let bound = match x / vmax {
                f if f >= 1e-2 => V_REL_AT_1E2,
                f if f >= 1e-4 => V_REL_AT_1E4,
                _ => continue,
            };
            assert!(rel(d, x) <= bound, "[{i}]: {x} decoded as {d} (rel {:.3e} > {bound})", rel(d, x));
        }
    }
}

/// Stochastic rounding is unbiased: averaged over many keys, each decoded value is its input
/// (within 4 standard errors of the two-point draw).
#[test]
fn stochastic_rounding_is_unbiased() {
    let mut rng = StdRng::seed_from_u64(3);
    let (xm, xv) = (wide(&mut rng, Q8_BLOCK, true), wide(&mut rng, Q8_BLOCK, false));
    let xb: Vec<f32> = (0..Q8_BLOCK).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    const DRAWS: u32 = 4000;
    let (mut sm, mut sv) = (vec![0f64; Q8_BLOCK], vec![0f64; Q8_BLOCK]);
    let (mut sb, mut sb_hi) = (vec![0f64; Q8_BLOCK], vec![0f64; Q8_BLOCK]);
    let mut codes = vec![0u8; Q8_BLOCK];
    let mut d = vec![0f32; Q8_BLOCK];
    for k in 0..DRAWS {
        let s = encode_m(&xm, &mut codes, mix32(k), 0);
        decode_m(&codes, s, &mut d);
        sm.iter_mut().zip(&d).for_each(|(a, &b)| *a += f64::from(b));
        let s = encode_v(&xv, &mut codes, mix32(k + DRAWS), 0);
        decode_v(&codes, s, &mut d);
        sv.iter_mut().zip(&d).for_each(|(a, &b)| *a += f64::from(b));
        for (i, ((a, a_hi), &x)) in sb.iter_mut().zip(sb_hi.iter_mut()).zip(&xb).enumerate() {
            let h = draw(i as u32, mix32(k + 2 * DRAWS));
            *a += f64::from(widen(bf16_sr(x, m_bits(h))));
            *a_hi += f64::from(widen(bf16_sr(x, v_bits(h))));
        }
    }
    let check = |what: &str, sums: &[f64], x: &[f32], step: &dyn Fn(f32) -> f64| {
        for (i, (&sum, &x)) in sums.iter().zip(x).enumerate() {
            let mean = sum / f64::from(DRAWS);
            // A two-point draw a step apart has a standard deviation of at most step / 2.
            let tol = 4.0 * step(x) / 2.0 / f64::from(DRAWS).sqrt() + 1e-12 * f64::from(x.abs());
            assert!((mean - f64::from(x)).abs() <= tol, "{what}[{i}]: mean {mean:e} of {x:e} (tol {tol:e})");
        }
    };
    let am = xm.iter().fold(0f32, |a, b| a.max(b.abs()));
    let vm = xv.iter().fold(0f32, |a, &b| a.max(b));
    check("m", &sm, &xm, &|x| {
        let c = f64::from(x.abs() / (am / M_TOP)).sqrt().ceil();
        (2.0 * c + 1.0) * f64::from(am / M_TOP)
    });
    check("v", &sv, &xv, &|x| {
        let c = f64::from(x / (vm / V_TOP)).sqrt().sqrt().ceil();
        ((c + 1.0).powi(4) - c.powi(4)) * f64::from(vm / V_TOP)
    });
    check("bf16", &sb, &xb, &|x| f64::from(x.abs()) / 128.0);
    check("bf16 (a draw's high half)", &sb_hi, &xb, &|x| f64::from(x.abs()) / 128.0);
}

#[test]
fn bf16_stochastic_rounding_brackets_its_input_and_keeps_specials() {
    let mut rng = StdRng::seed_from_u64(4);
    for i in 0..100_000u32 {
        let x = rng.random_range(-1e6f32..1e6) * 10f32.powi(rng.random_range(-30..0));
        let r = widen(bf16_sr(x, mix32(i)));
        let lo = f32::from_bits(x.to_bits() & 0xFFFF_0000);
        let hi = f32::from_bits((x.to_bits() & 0xFFFF_0000) + 0x1_0000);
        assert!(r == lo || r == hi, "{x:e} -> {r:e}");
        assert!(rel(r, x) <= BF16_SR_REL, "{x:e} -> {r:e}");
    }
    for x in [0.0f32, -0.0, 1.0, -2.5, f32::INFINITY, f32::NEG_INFINITY] {
        for r in [0, 0xFFFF, 0x8000] {
            assert_eq!(widen(bf16_sr(x, r)).to_bits(), x.to_bits(), "{x} is a bf16 value already");
        }
    }
    let nan = f32::from_bits(0x7FFF_FFFF);
    assert!(widen(bf16_sr(nan, 0xFFFF)).is_nan(), "a NaN never carries into the sign bit");
    assert_eq!(bf16_sr(f32::NAN, 0x1234), bf16::NAN.to_bits());
}

#[test]
fn encodings_are_deterministic_and_keyed() {
    let mut rng = StdRng::seed_from_u64(5);
    let x = wide(&mut rng, Q8_BLOCK, false);
    let (mut a, mut b, mut c) = (vec![0u8; Q8_BLOCK], vec![0u8; Q8_BLOCK], vec![0u8; Q8_BLOCK]);
    encode_v(&x, &mut a, 7, 0);
    encode_v(&x, &mut b, 7, 0);
    encode_v(&x, &mut c, 8, 0);
    assert_eq!(a, b);
    assert_ne!(a, c, "another key, other draws");
    assert_ne!(rounding_key(3, 1), rounding_key(3, 2));
    assert_ne!(rounding_key(3, 1), rounding_key(4, 1));
    // One draw rounds both moments, from its two halves: the same value as m and as v takes
    // different codes somewhere.
    encode_m(&x, &mut b, 7, 0);
    assert!(a.iter().zip(&b).any(|(v, m)| v != m), "m and v round with different bits of the draw");
}

#[test]
fn layouts_from_bytes_and_state_slots() {
    let n = 3 * Q8_BLOCK + 5;
    for dtype in StateDtype::ALL {
        let mb = dtype.moment_bytes(n);
        let mut words = vec![0f32; dtype.state_words(n)];
        let (master, mom) = Moments::split_state(dtype, n, &mut words, 0).unwrap();
        assert_eq!((master.len(), mom.len(), mom.dtype()), (n, n, dtype));
        if let Moments::Int8 { m, v, .. } = &mom {
            assert_eq!((m.scales.len(), v.scales.len()), (4, 4));
        }
        let err = Moments::split_state(dtype, n, &mut words[1..], 0).unwrap_err();
        assert!(err.to_string().contains(&format!("{} moments of {n} parameters", dtype.name())), "{err}");
        let (mut m, mut v) = (vec![0u32; mb / 4 + 10], vec![0u32; mb / 4]);
        let ok = Moments::from_bytes(
            dtype,
            n,
            bytemuck::cast_slice_mut(&mut m),
            bytemuck::cast_slice_mut(&mut v),
            0,
        );
        assert_eq!(ok.unwrap().len(), n, "a longer (page-padded) region is fine");
        let short = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut v)[..mb - 4];
        let err = Moments::from_bytes(dtype, n, bytemuck::cast_slice_mut(&mut m), short, 0).unwrap_err();
        assert!(matches!(err, Error::MomentBytes { moment: "v", .. }), "{err}");
    }
}

/// The fused update over coded moments is `update_block_coded` on the decoded moments, the new
/// moments then encoded with the step's key; the master and the upload copy bitwise, whatever
/// the thread count, and within rounding of [`step_reference`]'s (the update's one product by
/// `1 / bc2_sqrt` for its quotient); [`land_and_step`] is the same update.
#[test]
fn coded_update_is_the_reference_on_decoded_moments() {
    let mut rng = StdRng::seed_from_u64(6);
    let n = 2 * crate::CHUNK + 3 * Q8_BLOCK + 77;
    let h = AdamW { weight_decay: 0.1, ..AdamW::default() };
    let a = StepArgs { step: 9, lr: 2e-3, grad_scale: 0.75 };
    let g: Vec<f32> = wide(&mut rng, n, true);
    let p0: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    for dtype in [StateDtype::Bf16, StateDtype::Int8] {
        // A warm state: encode some moments first (one step from zero).
        let mut warm = vec![0f32; dtype.state_words(n)];
        {
            let (p, mom) = Moments::split_state(dtype, n, &mut warm, 5).unwrap();
            p.copy_from_slice(&p0);
            step_fused(&h, &StepArgs { step: 8, ..a }, Grad::F32(&g), p, mom, Upload::None).unwrap();
        }
        let bytes = |w: &[f32]| -> (Vec<u8>, Vec<u8>) {
            let b: &[u8] = bytemuck::cast_slice(&w[n..]);
            let mb = dtype.moment_bytes(n);
            (b[..mb].to_vec(), b[mb..].to_vec())
        };
        let (m0, v0) = bytes(&warm);
        let (mut rm, mut rv) = decode_moments(dtype, n, &m0, &v0).unwrap();
        let mut rp = warm[..n].to_vec();
        let (mut tp, mut tm, mut tv) = (rp.clone(), rm.clone(), rv.clone());
        step_reference(&h, &a, &g, &mut tp, &mut tm, &mut tv);
        let c = crate::Coeffs::of(&h, &a).unwrap();
        crate::adamw::update_block_coded(&c, &g, &mut rp, &mut rm, &mut rv);
        // Against the fp32 update: each master within a few roundings of its update.
        for i in 0..n {
            let (step, diff) = ((tp[i] - warm[i] * c.decay).abs(), (rp[i] - tp[i]).abs());
            assert!(
                diff <= 4e-7 * step + f32::EPSILON * tp[i].abs(),
                "{dtype}: master[{i}] {} vs {}",
                rp[i],
                tp[i]
            );
            let same = rm[i].to_bits() == tm[i].to_bits() && rv[i].to_bits() == tv[i].to_bits();
            assert!(same, "{dtype}: [{i}]: the moments are the fp32 update's");
        }
        let mut results = Vec::new();
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut w = warm.clone();
            let mut up = vec![bf16::ZERO; n];
            pool.install(|| {
                let (p, mom) = Moments::split_state(dtype, n, &mut w, 5).unwrap();
                step_fused(&h, &a, Grad::F32(&g), p, mom, Upload::Bf16(&mut up)).unwrap();
            });
            assert!(w[..n].iter().zip(&rp).all(|(x, y)| x.to_bits() == y.to_bits()), "{dtype}: master");
            assert!(
                up.iter().zip(&rp).all(|(u, p)| u.to_bits() == bf16::from_f32(*p).to_bits()),
                "{dtype}: upload"
            );
            results.push(w);
        }
        assert_eq!(
            results[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            results[1].iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // The new moments are the reference's, encoded: every element within one code.
        let (m1, v1) = bytes(&results[0]);
        let (dm, dv) = decode_moments(dtype, n, &m1, &v1).unwrap();
        for i in 0..n {
            let blk = i / Q8_BLOCK * Q8_BLOCK..(i / Q8_BLOCK * Q8_BLOCK + Q8_BLOCK).min(n);
            let am = rm[blk.clone()].iter().fold(0f32, |x, y| x.max(y.abs()));
            let vm = rv[blk].iter().fold(0f32, |x, &y| x.max(y));
            let (tol_m, tol_v) = match dtype {
                StateDtype::Bf16 => (rm[i].abs() / 128.0, rv[i] / 128.0),
                _ if rv[i] >= 1e-4 * vm => (am / 60.0, rv[i] * V_REL_AT_1E4 as f32),
                _ => (am / 60.0, 1.2e-4 * vm),
            };
            assert!((dm[i] - rm[i]).abs() <= tol_m, "{dtype}: m[{i}] {} vs {}", dm[i], rm[i]);
            assert!(dv[i] >= 0.0 && (dv[i] - rv[i]).abs() <= tol_v, "{dtype}: v[{i}] {} vs {}", dv[i], rv[i]);
        }
        // Lean mode's land + update: the same update (and the stored gradient, the sum).
        let mut w = warm.clone();
        let mut stored = vec![bf16::ZERO; n];
        let ss = {
            let (p, mom) = Moments::split_state(dtype, n, &mut w, 5).unwrap();
            land_and_step(&h, &a, &g, Upload::Bf16(&mut stored), p, mom).unwrap()
        };
        assert_eq!(ss.to_bits(), crate::sum_squares(Grad::F32(&g)).to_bits());
        assert!(stored.iter().zip(&g).all(|(s, g)| s.to_bits() == bf16::from_f32(*g).to_bits()));
        assert_eq!(
            w.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            results[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{dtype}: land_and_step"
        );
    }
}

/// The inputs `kernels/emu/adamw_check.cpp` gives the CUDA kernels on the CPU emulator: integer
/// hashes, so both languages make the same f32 values.
fn emu_input(i: u32, salt: u32) -> f32 {
    (mix32(i.wrapping_mul(2_654_435_761) ^ salt) >> 8) as f32 * (1.0 / 16_777_216.0) - 0.5
}

/// FNV-1a over bytes.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The coefficient bits (grad_scale, decay, lerp_small, lerp_coeff, beta2, one_minus_beta2,
/// bc2_sqrt, eps, step_size) and the rounding key of steps 1..=3 of
/// [`emu_state_hashes`]'s run; `kernels/emu/adamw_check.cpp` holds the same numbers.
const EMU_COEFFS: [[u32; 10]; 3] = [
    [
        0x3f40_0000,
        0x3f7f_f972,
        0x1,
        0x3dcc_cccd,
        0x3f7f_be77,
        0x3a83_126f,
        0x3d01_86e2,
        0x322b_cc77,
        0x3c23_d70a,
        0x1551_61c7,
    ],
    [
        0x3f40_0000,
        0x3f7f_f972,
        0x1,
        0x3dcc_cccd,
        0x3f7f_be77,
        0x3a83_126f,
        0x3d37_2205,
        0x322b_cc77,
        0x3bac_7692,
        0x4a65_eeb5,
    ],
    [
        0x3f40_0000,
        0x3f7f_f972,
        0x1,
        0x3dcc_cccd,
        0x3f7f_be77,
        0x3a83_126f,
        0x3d60_3c29,
        0x322b_cc77,
        0x3b71_d48c,
        0xff48_4a82,
    ],
];
/// FNV-1a of the bf16 and the 8-bit state after those three steps, and of the bf16 weights
/// written with the last; `kernels/emu/adamw_check.cpp` asserts the kernels give the same.
const EMU_HASHES: [u64; 4] =
    [0x8f0b_fbc5_c08d_9afb, 0xdd39_7977_c89c_4921, 0x2184_4c0e_3b01_a3f5, 0xc8b5_b101_7562_1976];

/// Three updates of 845 parameters (three 8-bit blocks and a partial one) with bf16 and with
/// 8-bit moments, from integer-hash inputs, stream 5.
fn emu_state_hashes() -> ([[u32; 10]; 3], [u64; 4]) {
    const N: usize = 3 * Q8_BLOCK + 77;
    let h = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
    let mut coeffs = [[0u32; 10]; 3];
    for t in 1..=3u64 {
        let c = crate::Coeffs::of(&h, &StepArgs { step: t, lr: 1e-3, grad_scale: 0.75 }).unwrap();
        let key = rounding_key(t, 5);
        coeffs[t as usize - 1] = [
            c.grad_scale.to_bits(),
            c.decay.to_bits(),
            u32::from(c.lerp_small),
            c.lerp_coeff.to_bits(),
            c.beta2.to_bits(),
            c.one_minus_beta2.to_bits(),
            c.bc2_sqrt.to_bits(),
            c.eps.to_bits(),
            c.step_size.to_bits(),
            key,
        ];
    }
    let mut hashes = [0u64; 4];
    for (k, dtype) in [StateDtype::Bf16, StateDtype::Int8].into_iter().enumerate() {
        let mut state = vec![0f32; dtype.state_words(N)];
        for (i, x) in state[..N].iter_mut().enumerate() {
            // Block 0's masters as small as their updates, so that every rounding of an update shows.
            *x = emu_input(i as u32, 99) * if i < 256 { 2e-3 } else { 2.0 };
        }
        let mut w = vec![bf16::ZERO; N];
        for t in 1..=3u32 {
            let g: Vec<f32> = (0..N as u32)
                .map(|i| {
                    // Block 1 all zero, block 2 so small that its inverse steps are clamped.
                    let scale = if i % 11 == 0 || i / 256 == 1 {
                        0.0
                    } else if i / 256 == 2 {
                        1e-36
                    } else if i % 7 == 0 {
                        1e-6
                    } else {
                        1e-2
                    };
                    emu_input(i, t) * scale
                })
                .collect();
            let (p, mom) = Moments::split_state(dtype, N, &mut state, 5).unwrap();
            let a = StepArgs { step: u64::from(t), lr: 1e-3, grad_scale: 0.75 };
            step_fused(&h, &a, Grad::F32(&g), p, mom, Upload::Bf16(&mut w)).unwrap();
        }
        hashes[2 * k] = fnv1a(bytemuck::cast_slice(&state));
        hashes[2 * k + 1] = fnv1a(bytemuck::cast_slice(&w));
    }
    (coeffs, hashes)
}

/// The host update over bf16 and 8-bit moments gives the state `kernels/emu/adamw_check.cpp`
/// computes with the CUDA kernels (`mt_adamw_bf16`, `mt_adamw_q8`) on the CPU emulator
/// (`kernels/emu/run_adamw.sh`): the same bytes (hashes), from the same coefficients and keys.
/// So the device update of a resident or GPU-updated unit is bitwise the host's before any GPU
/// runs it; `crates/sched/tests/gpu.rs` checks it on the GPU.
#[test]
fn coded_moments_match_the_cuda_kernels_on_the_emulator() {
    let (coeffs, hashes) = emu_state_hashes();
    assert_eq!(
        coeffs, EMU_COEFFS,
        "coefficients and keys (copy into kernels/emu/adamw_check.cpp): {coeffs:#x?}"
    );
    assert_eq!(
        hashes, EMU_HASHES,
        "state hashes (kernels/emu/adamw_check.cpp asserts the same): {hashes:#x?}"
    );
}

//! Tests of the fused AdamW: bitwise against the scalar reference, against PyTorch literals,
//! determinism across thread counts, upload casts and argument checks.

use super::*;
use crate::land_and_step;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Over two full chunks plus a ragged tail, so chunk and block boundaries are crossed.
const N: usize = 2 * CHUNK + 3 * BLOCK + 77;

fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Gradients spanning many magnitudes (incl. exact zeros and values below eps) and both signs.
fn grads(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match i % 17 {
            0 => 0.0,
            1 => rng.random_range(-1e-9f32..1e-9),
            _ => rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-6..3)),
        })
        .collect()
}

#[track_caller]
fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}[{i}]: fused {:e} ({:#010x}) != reference {:e} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

struct State {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl State {
    /// torch's state before step 1: m = v = 0.
    fn fresh(rng: &mut StdRng, n: usize) -> Self {
        Self { p: uniform(rng, n, -2.0, 2.0), m: vec![0.0; n], v: vec![0.0; n] }
    }

    /// A state deep into training.
    fn warm(rng: &mut StdRng, n: usize) -> Self {
        let m = uniform(rng, n, -1e-2, 1e-2);
        let v = m.iter().map(|x| x * x * rng.random_range(1.0f32..4.0)).collect();
        Self { p: uniform(rng, n, -2.0, 2.0), m, v }
    }
}

/// Runs `steps` steps from `first` on both paths (f32 grads) and asserts bitwise equality.
fn fused_matches_reference(h: AdamW, grad_scale: f32, first: u64, steps: u64, start: State, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut r = State { p: start.p.clone(), m: start.m.clone(), v: start.v.clone() };
    let mut f = start;
    for t in first..first + steps {
        let g = grads(&mut rng, f.p.len());
        // A schedule: a different lr each step.
        let a = StepArgs { step: t, lr: h.lr * (1.0 + 0.1 * t as f64), grad_scale };
        step_fused(&h, &a, Grad::F32(&g), &mut f.p, Moments::f32(&mut f.m, &mut f.v), Upload::None).unwrap();
        step_reference(&h, &a, &g, &mut r.p, &mut r.m, &mut r.v);
        assert_bitwise(&format!("t={t} master"), &f.p, &r.p);
        assert_bitwise(&format!("t={t} m"), &f.m, &r.m);
        assert_bitwise(&format!("t={t} v"), &f.v, &r.v);
    }
}

#[test]
fn fused_equals_reference_bitwise_weight_decay_zero() {
    let mut rng = StdRng::seed_from_u64(1);
    let h = AdamW { weight_decay: 0.0, ..AdamW::default() };
    fused_matches_reference(h, 1.0, 1, 4, State::fresh(&mut rng, N), 11);
}

#[test]
fn fused_equals_reference_bitwise_weight_decay_and_clipping() {
    let mut rng = StdRng::seed_from_u64(2);
    let h = AdamW { lr: 3e-4, weight_decay: 0.1, ..AdamW::default() };
    fused_matches_reference(h, 0.37, 1, 4, State::fresh(&mut rng, N), 12);
    fused_matches_reference(h, 0.8125, 1000, 3, State::warm(&mut rng, N), 13);
}

#[test]
fn fused_equals_reference_bitwise_large_lerp_weight() {
    // 1 - beta1 >= 0.5 takes ATen lerp's other formula: g - (g - m) * (1 - w).
    let mut rng = StdRng::seed_from_u64(3);
    for beta1 in [0.3, 0.0] {
        let h = AdamW { beta1, ..AdamW::default() };
        fused_matches_reference(h, 1.0, 5, 3, State::warm(&mut rng, N), 14);
    }
}

#[test]
fn bf16_grads_match_reference_on_widened_grads() {
    let mut rng = StdRng::seed_from_u64(4);
    let h = AdamW { weight_decay: 0.05, ..AdamW::default() };
    let mut f = State::warm(&mut rng, N);
    let (mut rp, mut rm, mut rv) = (f.p.clone(), f.m.clone(), f.v.clone());
    let mut up = vec![bf16::ZERO; N];
    for t in 7..10 {
        let g: Vec<bf16> = grads(&mut rng, N).into_iter().map(bf16::from_f32).collect();
        let wide: Vec<f32> = g.iter().map(|x| x.to_f32()).collect();
        let a = StepArgs { step: t, lr: 2e-3, grad_scale: 0.5 };
        step_fused(&h, &a, Grad::Bf16(&g), &mut f.p, Moments::f32(&mut f.m, &mut f.v), Upload::Bf16(&mut up))
            .unwrap();
        step_reference(&h, &a, &wide, &mut rp, &mut rm, &mut rv);
        assert_bitwise("master", &f.p, &rp);
        assert_bitwise("m", &f.m, &rm);
        assert_bitwise("v", &f.v, &rv);
        assert!(up.iter().zip(&rp).all(|(u, p)| u.to_bits() == bf16::from_f32(*p).to_bits()));
    }
}

#[test]
fn result_does_not_depend_on_thread_count() {
    let mut rng = StdRng::seed_from_u64(5);
    let s = State::warm(&mut rng, N);
    let g = grads(&mut rng, N);
    let h = AdamW::default();
    let run_on = |threads| {
        let (mut p, mut m, mut v) = (s.p.clone(), s.m.clone(), s.v.clone());
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            step_fused(&h, &h.args(3), Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::None)
                .unwrap()
        });
        (p, m, v)
    };
    let (one, four) = (run_on(1), run_on(4));
    assert_bitwise("master", &four.0, &one.0);
    assert_bitwise("m", &four.1, &one.1);
    assert_bitwise("v", &four.2, &one.2);
}

/// Step 1 by hand. With m0 = v0 = 0, beta1 = 0.9, beta2 = 0.999:
///   m1 = 0.1 g, v1 = 0.001 g^2, bias_correction1 = 0.1, bias_correction2 = 0.001,
///   step_size = lr / 0.1, denom = sqrt(0.001 g^2) / sqrt(0.001) + eps = |g| + eps,
///   update = step_size * m1 / denom = lr * g / (|g| + eps),
/// which is lr * sign(g) for |g| >> eps, and lr * g / eps for |g| << eps.
/// Weight decay first scales the parameter by 1 - lr * wd.
#[test]
fn first_step_moves_each_parameter_by_lr_times_sign_of_grad() {
    let h = AdamW { lr: 1e-3, weight_decay: 0.0, ..AdamW::default() };
    let g = [0.5f32, -2.0, 300.0, -1e-4, 1e-12, 0.0];
    let mut p = [1.0f32, 1.0, -0.25, 0.0, 0.0, 3.0];
    let (mut m, mut v) = ([0.0f32; 6], [0.0f32; 6]);
    let p0 = p;
    step_fused(&h, &h.args(1), Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::None).unwrap();
    for i in 0..g.len() {
        let (g, eps) = (f64::from(g[i]), 1e-8);
        let update = 1e-3 * g / (g.abs() + eps);
        if g.abs() >= 0.5 {
            assert!((update - 1e-3 * g.signum()).abs() < 1e-10, "|g| >> eps: update is lr * sign(g)");
        }
        let want = f64::from(p0[i]) - update;
        let got = f64::from(p[i]);
        assert!((got - want).abs() <= 1e-7 * want.abs().max(1e-3), "p[{i}] = {got}, want {want}");
    }
    // m1 = (1 - beta1) g and v1 = (1 - beta2) g^2, with the f32-rounded coefficients.
    assert_eq!(m, g.map(|x| 0.1f32 * x));
    assert_eq!(v, g.map(|x| 0.001f32 * x * x));

    // Weight decay: p = 2 (1 - 1e-3 * 0.1) - 1e-3 = 1.9988 for g = 3.
    let h = AdamW { weight_decay: 0.1, ..h };
    let (mut p, mut m, mut v) = ([2.0f32], [0.0f32], [0.0f32]);
    step_fused(&h, &h.args(1), Grad::F32(&[3.0]), &mut p, Moments::f32(&mut m, &mut v), Upload::None)
        .unwrap();
    assert!((f64::from(p[0]) - 1.9988).abs() < 2e-7, "p = {}", p[0]);
}

#[test]
fn upload_copies_equal_the_cast_of_the_new_master() {
    let mut rng = StdRng::seed_from_u64(6);
    let h = AdamW::default();
    let s = State::warm(&mut rng, N);
    let g = grads(&mut rng, N);
    let fresh = || (s.p.clone(), s.m.clone(), s.v.clone());

    let (mut p, mut m, mut v) = fresh();
    step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::None).unwrap();
    let new_master = p;

    let mut u32s = vec![0.0f32; N];
    let (mut p, mut m, mut v) = fresh();
    step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::F32(&mut u32s))
        .unwrap();
    assert_bitwise("f32 upload", &u32s, &new_master);
    assert_bitwise("master with f32 upload", &p, &new_master);

    let mut ubf = vec![bf16::ZERO; N];
    let (mut p, mut m, mut v) = fresh();
    step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::Bf16(&mut ubf))
        .unwrap();
    assert!(ubf.iter().zip(&new_master).all(|(u, x)| u.to_bits() == bf16::from_f32(*x).to_bits()));

    let mut uf16 = vec![f16::ZERO; N];
    let (mut p, mut m, mut v) = fresh();
    step_fused(&h, &h.args(2), Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::F16(&mut uf16))
        .unwrap();
    assert!(uf16.iter().zip(&new_master).all(|(u, x)| u.to_bits() == f16::from_f32(*x).to_bits()));
}

#[test]
fn cast_into_rounds_to_nearest_even() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut src = uniform(&mut rng, N, -70000.0, 70000.0);
    // Ties and specials: 1 + 2^-8 is halfway between two bf16 values and rounds to even (1.0);
    // 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
    src[..6].copy_from_slice(&[
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        f32::INFINITY,
        -0.0,
        f32::MAX,
        1e-40,
    ]);
    let mut ubf = vec![bf16::ZERO; N];
    cast_into(&src, Upload::Bf16(&mut ubf)).unwrap();
    assert_eq!(ubf[0], bf16::ONE);
    assert_eq!(ubf[1].to_f32(), 1.0 + 2f32.powi(-6));
    assert_eq!(ubf[2], bf16::INFINITY);
    assert_eq!(ubf[4], bf16::INFINITY, "f32::MAX rounds up past the largest bf16");
    assert!(ubf.iter().zip(&src).all(|(u, x)| u.to_bits() == bf16::from_f32(*x).to_bits()));

    let mut uf16 = vec![f16::ZERO; N];
    cast_into(&src, Upload::F16(&mut uf16)).unwrap();
    assert!(uf16.iter().zip(&src).all(|(u, x)| u.to_bits() == f16::from_f32(*x).to_bits()));

    let mut u32s = vec![0.0f32; N];
    cast_into(&src, Upload::F32(&mut u32s)).unwrap();
    assert_bitwise("f32 cast", &u32s, &src);
    cast_into(&src, Upload::None).unwrap();
}

#[test]
fn length_mismatch_is_reported_with_the_slice_name_and_nothing_is_written() {
    let h = AdamW::default();
    let a = h.args(1);
    let g = [1.0f32; 4];
    let g_short = [1.0f32; 3];
    let (mut p, mut m, mut v, mut v5) = ([0.5f32; 4], [0.0f32; 4], [0.0f32; 4], [0.0f32; 5]);
    let mut m3 = [0.0f32; 3];
    let mut up = [bf16::ZERO; 2];

    let e = step_fused(&h, &a, Grad::F32(&g_short), &mut p, Moments::f32(&mut m, &mut v), Upload::None)
        .unwrap_err();
    assert_eq!(e, Error::LengthMismatch { slice: "grad", expected: 4, found: 3 });
    let e =
        step_fused(&h, &a, Grad::F32(&g), &mut p, Moments::f32(&mut m3, &mut v), Upload::None).unwrap_err();
    assert_eq!(e, Error::LengthMismatch { slice: "m", expected: 4, found: 3 });
    let e =
        step_fused(&h, &a, Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v5), Upload::None).unwrap_err();
    assert_eq!(e, Error::LengthMismatch { slice: "v", expected: 4, found: 5 });
    let e = step_fused(&h, &a, Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::Bf16(&mut up))
        .unwrap_err();
    assert_eq!(e, Error::LengthMismatch { slice: "upload", expected: 4, found: 2 });
    let msg = e.to_string();
    assert!(msg.contains("`upload` has 2") && msg.contains("`master` has 4"), "{msg}");
    assert_eq!((p, m, v), ([0.5; 4], [0.0; 4], [0.0; 4]), "a rejected call wrote nothing");

    let e = cast_into(&p, Upload::Bf16(&mut up)).unwrap_err();
    assert_eq!(e, Error::LengthMismatch { slice: "upload", expected: 4, found: 2 });
    assert_eq!(up, [bf16::ZERO; 2]);
}

#[test]
fn zero_step_and_out_of_range_hyperparameters_are_rejected() {
    let (mut p, mut m, mut v) = ([0.5f32; 2], [0.0f32; 2], [0.0f32; 2]);
    let g = [1.0f32; 2];
    let mut call = |h: AdamW, a: StepArgs| {
        step_fused(&h, &a, Grad::F32(&g), &mut p, Moments::f32(&mut m, &mut v), Upload::None)
    };
    let h = AdamW::default();
    assert_eq!(call(h, h.args(0)), Err(Error::ZeroStep));
    let bad = [
        (AdamW { beta1: 1.0, ..h }, h.args(1), "beta1"),
        (AdamW { beta2: -0.1, ..h }, h.args(1), "beta2"),
        (AdamW { eps: f64::NAN, ..h }, h.args(1), "eps"),
        (AdamW { weight_decay: -1.0, ..h }, h.args(1), "weight_decay"),
        (h, StepArgs { lr: -1e-3, ..h.args(1) }, "lr"),
    ];
    for (h, a, field) in bad {
        match call(h, a) {
            Err(Error::Hyperparameter { name, .. }) => assert_eq!(name, field),
            other => panic!("{field}: expected a hyperparameter error, got {other:?}"),
        }
    }
    assert_eq!((p, m, v), ([0.5; 2], [0.0; 2], [0.0; 2]));
}

/// Golden values from PyTorch 2.15.0 (`/opt/golden-venv`, CPU), produced by this script:
///
/// ```python
/// import torch
/// p = torch.tensor([0.5, -1.25, 2.0, 0.0, -0.03125, 3.5, -7.0, 1e-3], dtype=torch.float32, requires_grad=True)
/// grads = [
///     torch.tensor([0.1, -0.2, 0.3, -0.4, 5.0, -6.0, 1e-9, 0.0], dtype=torch.float32),
///     torch.tensor([-0.05, 0.25, 0.125, -1.5, 2.0, 0.75, 3e-9, 0.5], dtype=torch.float32),
///     torch.tensor([0.2, 0.2, -0.7, 0.01, -4.0, 1.0, 2e-9, -0.25], dtype=torch.float32),
/// ]
/// opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
///                         foreach=False, fused=False)
/// for g in grads:
///     p.grad = g.clone()
///     p.grad.mul_(0.5)  # clip_grad_norm_ multiplies the grads in place by its coefficient
///     opt.step()
/// s = opt.state[p]
/// for name, t in [("p", p.detach()), ("m", s["exp_avg"]), ("v", s["exp_avg_sq"])]:
///     print(name, ", ".join(f"{x:.9e}" for x in t.tolist()))
/// ```
///
/// torch 2.15 on the AVX-512 machine that produced these fuses `lerp_` and `addcmul_` into FMAs,
/// which this crate does not: 4 of the 24 values differ from ours by one f32 ulp (largest
/// relative difference 9.1e-8), the other 20 are bitwise equal.
#[test]
fn three_steps_match_pytorch_adamw() {
    let mut p = [0.5f32, -1.25, 2.0, 0.0, -0.03125, 3.5, -7.0, 1e-3];
    let grads: [[f32; 8]; 3] = [
        [0.1, -0.2, 0.3, -0.4, 5.0, -6.0, 1e-9, 0.0],
        [-0.05, 0.25, 0.125, -1.5, 2.0, 0.75, 3e-9, 0.5],
        [0.2, 0.2, -0.7, 0.01, -4.0, 1.0, 2e-9, -0.25],
    ];
    let want_p = [
        4.979257882e-01,
        -1.249233007e+00,
        1.997780561e+00,
        2.576394472e-03,
        -3.331518173e-02,
        3.500854254e+00,
        -6.998131752e+00,
        2.699736797e-05,
    ];
    let want_m = [
        1.180000044e-02,
        1.315000001e-02,
        -1.722499914e-02,
        -8.320000023e-02,
        9.249997884e-02,
        -1.592500210e-01,
        2.755000117e-10,
        9.999999776e-03,
    ];
    let want_v = [
        1.311937831e-05,
        3.558938624e-05,
        1.488573762e-04,
        6.018825225e-04,
        1.123650745e-02,
        9.372492321e-03,
        3.497250160e-21,
        7.806250505e-05,
    ];
    let h = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
    let (mut m, mut v) = ([0.0f32; 8], [0.0f32; 8]);
    for (i, g) in grads.iter().enumerate() {
        let a = StepArgs { step: i as u64 + 1, lr: 1e-3, grad_scale: 0.5 };
        step_fused(&h, &a, Grad::F32(g), &mut p, Moments::f32(&mut m, &mut v), Upload::None).unwrap();
    }
    for (name, got, want) in [("p", p, want_p), ("m", m, want_m), ("v", v, want_v)] {
        for (i, (&got, want)) in got.iter().zip(want).enumerate() {
            let rel = (f64::from(got) - want).abs() / want.abs();
            assert!(rel <= 1e-6, "{name}[{i}] = {got:e}, torch {want:e} (relative error {rel:e})");
        }
    }
}

#[test]
fn branchless_bf16_rounding_equals_half_on_every_rounding_boundary_and_special_value() {
    // Every upper half (sign, exponent, kept mantissa) with the dropped half at the places the
    // rounding decides on: zero, just below / at / just above one half, and all ones. That is
    // every tie (both parities), every carry into the exponent (incl. to infinity) and every NaN
    // pattern of the upper bits; plus a strided sweep of everything else.
    let lows = [0x0000u32, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF];
    let boundary = (0..=0xFFFFu32).flat_map(|hi| lows.iter().map(move |&lo| (hi << 16) | lo));
    let sweep = (0..=u32::MAX / 7919).map(|i| i * 7919);
    let mut checked = 0u64;
    for b in boundary.chain(sweep) {
        let x = f32::from_bits(b);
        assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "f32 bits {b:#010x}");
        checked += 1;
    }
    assert!(checked > 900_000);
}

#[test]
fn branchless_bf16_widening_equals_half_on_every_bf16() {
    for b in 0..=u16::MAX {
        let x = bf16::from_bits(b);
        assert_eq!(GradElem::to_f32(x).to_bits(), x.to_f32().to_bits(), "bf16 bits {b:#06x}");
    }
}

/// The fused land + update is bitwise the three passes it replaces (store, sum of squares,
/// update), for every stored type, across chunk boundaries and thread counts; an invalid step
/// writes nothing.
#[test]
fn land_and_step_is_bitwise_the_separate_passes() {
    let mut rng = StdRng::seed_from_u64(77);
    let g = grads(&mut rng, N);
    let (p0, m0) = (uniform(&mut rng, N, -1.0, 1.0), uniform(&mut rng, N, -1e-3, 1e-3));
    let v0 = uniform(&mut rng, N, 0.0, 1e-4);
    let h = AdamW { weight_decay: 0.1, ..AdamW::default() };
    let a = StepArgs { step: 3, lr: 1e-3, grad_scale: 0.7 };
    for stored in ["none", "f32", "bf16"] {
        let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
        let (mut s32, mut s16) = (vec![0.0f32; N], vec![bf16::ZERO; N]);
        let want_ss = crate::sum_squares(Grad::F32(&g));
        let (mut w32, mut w16) = (vec![0.0f32; N], vec![bf16::ZERO; N]);
        match stored {
            "f32" => cast_into(&g, Upload::F32(&mut w32)).unwrap(),
            "bf16" => cast_into(&g, Upload::Bf16(&mut w16)).unwrap(),
            _ => {}
        }
        step_fused(&h, &a, Grad::F32(&g), &mut p1, Moments::f32(&mut m1, &mut v1), Upload::None).unwrap();
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
            let ss = pool.install(|| {
                let st = match stored {
                    "f32" => Upload::F32(&mut s32),
                    "bf16" => Upload::Bf16(&mut s16),
                    _ => Upload::None,
                };
                land_and_step(&h, &a, &g, st, &mut p2, Moments::f32(&mut m2, &mut v2)).unwrap()
            });
            let what = format!("stored {stored}, {threads} threads");
            assert_eq!(ss.to_bits(), want_ss.to_bits(), "{what}: sum of squares");
            assert_bitwise(&format!("{what}: master"), &p2, &p1);
            assert_bitwise(&format!("{what}: m"), &m2, &m1);
            assert_bitwise(&format!("{what}: v"), &v2, &v1);
            assert_bitwise(&format!("{what}: stored f32"), &s32, &w32);
            assert!(s16.iter().zip(&w16).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: stored bf16");
        }
    }
    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
    let zero = StepArgs { step: 0, ..a };
    assert!(land_and_step(&h, &zero, &g, Upload::None, &mut p, Moments::f32(&mut m, &mut v)).is_err());
    assert_bitwise("untouched master", &p, &p0);
}

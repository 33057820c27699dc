//! The MoE kernels (`moe.rs`) against an f64 evaluation on the host, on a CUDA device (run on the
//! GPU machine: `cargo test -p mt-kernels --features cuda --lib moe`; not part of the CPU suite):
//! the routing against the CPU engine's rule, the grouping against a stable sort, and the MoE MLP
//! forward and backward through the grouped GEMMs (output, dX, both expert weight gradients, the
//! routing weights' and the router logits' gradients) from the same bf16 inputs and routing; an
//! expert with no token and one with every token, tied logits, widths off the tiles, several sort
//! chunks; a second run compared bit for bit; and the launchers on views as mt-layers' MoE device
//! path hands them over (a tile of token rows, gradients added into a flat f32 buffer).

use candle_core::{DType, Device, Tensor};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::{moe_swiglu, moe_swiglu_backward, ExpertMatrix, MoeGemm, MoeRouting};

#[derive(Clone, Copy)]
enum Logits {
    Random,
    /// Values from {0, 0.5, 1}: many equal probabilities in each row.
    Tied,
    /// Expert 0 gets no token, expert 1 every token.
    Skewed,
}

fn rbf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Relative L2 error of `got` against `want`, asserted below `tol`.
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert!(got.iter().all(|x| x.is_finite()), "{what}: not finite");
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    let rel = (num / den.max(1e-300)).sqrt();
    eprintln!("  {what}: rel L2 {rel:.2e}");
    assert!(rel < tol, "{what}: relative L2 error {rel:.2e} over {tol:.0e}");
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

fn u32s(t: &Tensor) -> Vec<usize> {
    t.flatten_all().unwrap().to_vec1::<u32>().unwrap().into_iter().map(|x| x as usize).collect()
}

/// Everything one run computes, on the host.
#[derive(PartialEq)]
struct Run {
    probs: Vec<f64>,
    top: Vec<usize>,
    weights: Vec<f64>,
    counts: Vec<usize>,
    offsets: Vec<usize>,
    perm: Vec<usize>,
    row_slot: Vec<usize>,
    out: Vec<f64>,
    dx: Vec<f64>,
    g_gu: Vec<f64>,
    g_d: Vec<f64>,
    dw: Vec<f64>,
    dlogit: Vec<f64>,
    sums: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
fn run(
    dev: &Device,
    logits: &Tensor,
    x: &Tensor,
    x1: &Tensor,
    wgu: &Tensor,
    wd: &Tensor,
    dout: &Tensor,
    aux: &Tensor,
    k: usize,
    normalise: bool,
    gemm: MoeGemm,
) -> Run {
    let (e, f2, h) = wgu.dims3().unwrap();
    let f = f2 / 2;
    let rt = MoeRouting::route(logits, k, normalise).unwrap().with_gemm(gemm).unwrap();
    let gu = rt.matmul(x, true, wgu, ExpertMatrix::OutIn).unwrap();
    let mid = moe_swiglu(&gu).unwrap();
    let y = rt.matmul(&mid, false, wd, ExpertMatrix::OutIn).unwrap();
    let out = rt.combine(&y, true, Some(x1)).unwrap();
    let dys = rt.gather(dout, true).unwrap();
    let (dmid, partial) = rt.down_backward(dout, wd, &mid).unwrap();
    let dgu = moe_swiglu_backward(&dmid, &gu).unwrap();
    let g_d = Tensor::zeros((e, h, f), DType::F32, dev).unwrap();
    rt.weight_grad(&g_d, &dys, &mid, false).unwrap();
    let g_gu = Tensor::zeros((e, f2, h), DType::F32, dev).unwrap();
    rt.weight_grad(&g_gu, &dgu, x, true).unwrap();
    let dcp = rt.matmul(&dgu, false, wgu, ExpertMatrix::InOut).unwrap();
    let dx = rt.combine(&dcp, false, None).unwrap();
    let (dlogit, dw) = rt.router_backward(&partial, Some(aux)).unwrap();
    let sums = Tensor::zeros(e, DType::F64, dev).unwrap();
    rt.prob_sums_add(&sums).unwrap();
    Run {
        probs: host(rt.probs()),
        top: u32s(rt.top()),
        weights: host(rt.weights()),
        counts: u32s(rt.counts()),
        offsets: u32s(rt.offsets()),
        perm: u32s(rt.perm()),
        row_slot: u32s(rt.row_slot()),
        out: host(&out),
        dx: host(&dx),
        g_gu: host(&g_gu),
        g_d: host(&g_d),
        dw: host(&dw),
        dlogit: host(&dlogit),
        sums: host(&sums),
    }
}

/// The kernel sets this GPU runs: mma.sync everywhere, wgmma on compute capability 9.0.
fn gemm_sets(dev: &Device) -> Vec<MoeGemm> {
    let hopper = match dev {
        Device::Cuda(d) => super::nvrtc::sm90a_runs(d),
        _ => false,
    };
    if hopper {
        vec![MoeGemm::MmaSync, MoeGemm::Wgmma]
    } else {
        vec![MoeGemm::MmaSync]
    }
}

#[allow(clippy::too_many_arguments)]
fn check_case(t: usize, e: usize, k: usize, h: usize, f: usize, normalise: bool, kind: Logits, seed: u64) {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
    for gemm in gemm_sets(&dev) {
        eprintln!("T={t} E={e} k={k} h={h} f={f} normalise={normalise} {gemm:?}");
        check_case_on(&dev, t, e, k, h, f, normalise, kind, seed, gemm);
    }
}

#[allow(clippy::too_many_arguments)]
fn check_case_on(
    dev: &Device,
    t: usize,
    e: usize,
    k: usize,
    h: usize,
    f: usize,
    normalise: bool,
    kind: Logits,
    seed: u64,
    gemm: MoeGemm,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut normal = |s: f32| -> f32 {
        // Box-Muller from two uniforms (rand's normal distribution lives in another crate).
        let (u, v): (f32, f32) = (rng.random::<f32>().max(1e-7), rng.random());
        rbf((-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos() * s)
    };
    let f2 = 2 * f;
    let x: Vec<f32> = (0..t * h).map(|_| normal(1.0)).collect();
    let x1: Vec<f32> = (0..t * h).map(|_| normal(1.0)).collect();
    let dout: Vec<f32> = (0..t * h).map(|_| normal(1.0)).collect();
    let wgu: Vec<f32> = (0..e * f2 * h).map(|_| normal(1.0 / (h as f32).sqrt())).collect();
    let wd: Vec<f32> = (0..e * h * f).map(|_| normal(1.0 / (f as f32).sqrt())).collect();
    let mut logits: Vec<f32> = (0..t * e).map(|_| normal(2.0)).collect();
    for (i, l) in logits.iter_mut().enumerate() {
        match kind {
            Logits::Random => {}
            Logits::Tied => *l = ((i * 7919 + seed as usize) % 3) as f32 * 0.5,
            Logits::Skewed if i % e == 0 => *l = -30.0,
            Logits::Skewed if i % e == 1 => *l = 12.0,
            Logits::Skewed => {}
        }
    }
    let aux: Vec<f64> = (0..e).map(|i| 1e-3 * ((i * 37) % 11) as f64).collect();
    let bf_dev = |v: &[f32], shape: &[usize]| {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            .to_device(dev)
            .unwrap()
    };
    let lt = Tensor::from_vec(logits.clone(), (t, e), dev).unwrap();
    let (xt, x1t, dt) = (bf_dev(&x, &[t, h]), bf_dev(&x1, &[t, h]), bf_dev(&dout, &[t, h]));
    let (gut, wdt) = (bf_dev(&wgu, &[e, f2, h]), bf_dev(&wd, &[e, h, f]));
    let auxt = Tensor::from_vec(aux.clone(), e, dev).unwrap();
    let a = run(dev, &lt, &xt, &x1t, &gut, &wdt, &dt, &auxt, k, normalise, gemm);
    let b = run(dev, &lt, &xt, &x1t, &gut, &wdt, &dt, &auxt, k, normalise, gemm);
    assert!(a == b, "a second run differs");

    // Routing: the CPU engine's rule (crates/layers/src/moe.rs).
    let mut probs = vec![0f32; t * e];
    for r in 0..t {
        let row = &logits[r * e..(r + 1) * e];
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let ex: Vec<f64> = row.iter().map(|&x| (f64::from(x) - m).exp()).collect();
        let s: f64 = ex.iter().sum();
        for j in 0..e {
            probs[r * e + j] = (ex[j] / s) as f32;
        }
    }
    let max_dp = a.probs.iter().zip(&probs).map(|(g, &w)| (g - f64::from(w)).abs()).fold(0.0, f64::max);
    assert!(max_dp <= 1e-7, "probabilities differ by {max_dp:e}");
    // Top-k and weights from the device's probabilities (the rule itself, bit for bit).
    let dev_probs: Vec<f32> = a.probs.iter().map(|&x| x as f32).collect();
    for r in 0..t {
        let p = &dev_probs[r * e..(r + 1) * e];
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&i, &j| p[j].total_cmp(&p[i]).then(i.cmp(&j)));
        assert_eq!(&a.top[r * k..(r + 1) * k], &order[..k], "token {r}'s experts");
        let s: f64 = order[..k].iter().map(|&i| f64::from(p[i])).sum();
        for (j, &i) in order[..k].iter().enumerate() {
            let want = if normalise { (f64::from(p[i]) / s) as f32 } else { p[i] };
            assert_eq!(a.weights[r * k + j], f64::from(want), "token {r}'s weight {j}");
        }
    }
    // Grouping: a stable sort of the slots by expert.
    let r_all = t * k;
    let mut rs: Vec<usize> = (0..r_all).collect();
    rs.sort_by_key(|&s| a.top[s]);
    assert_eq!(a.row_slot, rs);
    for (p, &s) in rs.iter().enumerate() {
        assert_eq!(a.perm[s], p);
    }
    for x in 0..e {
        let n = a.top.iter().filter(|&&y| y == x).count();
        assert_eq!((a.counts[x], a.offsets[x + 1] - a.offsets[x]), (n, n), "expert {x}");
    }
    eprintln!(
        "  experts without rows {}, largest {} of {r_all}",
        a.counts.iter().filter(|&&c| c == 0).count(),
        a.counts.iter().max().unwrap()
    );
    let col: Vec<f64> = (0..e).map(|x| (0..t).map(|r| a.probs[r * e + x]).sum()).collect();
    assert_close("probability sums", &a.sums, &col, 1e-12);

    // The MoE MLP in f64 with the same routing.
    let (mut out, mut dx) = (vec![0f64; t * h], vec![0f64; t * h]);
    let (mut g_gu, mut g_d) = (vec![0f64; e * f2 * h], vec![0f64; e * h * f]);
    let (mut dw, mut dl) = (vec![0f64; r_all], vec![0f64; t * e]);
    let xr = |r: usize, i: usize| f64::from(x[r * h + i]);
    let dor = |r: usize, i: usize| f64::from(dout[r * h + i]);
    for r in 0..t {
        for i in 0..h {
            out[r * h + i] = f64::from(x1[r * h + i]);
        }
        for j in 0..k {
            let ex = a.top[r * k + j];
            let wj = f64::from(rbf(a.weights[r * k + j] as f32));
            let wg = |o: usize, i: usize| f64::from(wgu[(ex * f2 + o) * h + i]);
            let wdn = |i: usize, o: usize| f64::from(wd[(ex * h + i) * f + o]);
            let gate: Vec<f64> = (0..f).map(|o| (0..h).map(|i| xr(r, i) * wg(o, i)).sum()).collect();
            let up: Vec<f64> = (0..f).map(|o| (0..h).map(|i| xr(r, i) * wg(f + o, i)).sum()).collect();
            let mid: Vec<f64> = (0..f).map(|o| silu(gate[o]) * up[o]).collect();
            let mut dwj = 0.0;
            for i in 0..h {
                let yi: f64 = (0..f).map(|o| mid[o] * wdn(i, o)).sum();
                out[r * h + i] += wj * yi;
                dwj += dor(r, i) * yi;
                for o in 0..f {
                    g_d[(ex * h + i) * f + o] += wj * dor(r, i) * mid[o];
                }
            }
            dw[r * k + j] = dwj;
            for o in 0..f {
                let dm = wj * (0..h).map(|i| dor(r, i) * wdn(i, o)).sum::<f64>();
                let s = 1.0 / (1.0 + (-gate[o]).exp());
                let (dg, du) = (dm * up[o] * s * (1.0 + gate[o] * (1.0 - s)), dm * silu(gate[o]));
                for i in 0..h {
                    g_gu[(ex * f2 + o) * h + i] += dg * xr(r, i);
                    g_gu[(ex * f2 + f + o) * h + i] += du * xr(r, i);
                    dx[r * h + i] += dg * wg(o, i) + du * wg(f + o, i);
                }
            }
        }
        // The router's backward (the CPU engine's formulas).
        let p: Vec<f64> = (0..e).map(|x| a.probs[r * e + x]).collect();
        let top = &a.top[r * k..(r + 1) * k];
        let mut dp = aux.clone();
        let s: f64 = top.iter().map(|&x| p[x]).sum();
        let weighted: f64 = (0..k).map(|j| dw[r * k + j] * p[top[j]] / s).sum();
        for j in 0..k {
            dp[top[j]] += if normalise { (dw[r * k + j] - weighted) / s } else { dw[r * k + j] };
        }
        let dot: f64 = (0..e).map(|x| p[x] * dp[x]).sum();
        for x in 0..e {
            dl[r * e + x] = p[x] * (dp[x] - dot);
        }
    }
    assert_close("output", &a.out, &out, 1e-2);
    assert_close("dx", &a.dx, &dx, 2e-2);
    assert_close("dW_gate_up", &a.g_gu, &g_gu, 2e-2);
    assert_close("dW_down", &a.g_d, &g_d, 2e-2);
    assert_close("routing weights' gradient", &a.dw, &dw, 2e-2);
    assert_close("router logits' gradient", &a.dlogit, &dl, 2e-2);
}

#[test]
fn moe_kernels_match_an_f64_evaluation() {
    check_case(150, 5, 2, 72, 40, true, Logits::Random, 1);
    check_case(97, 6, 3, 64, 24, false, Logits::Tied, 2);
    check_case(200, 5, 2, 72, 40, false, Logits::Skewed, 3);
    // Rows past one sort chunk and one 128-row tile per expert, widths past one column tile.
    check_case(700, 8, 2, 136, 136, true, Logits::Random, 4);
    check_case(700, 8, 2, 136, 136, false, Logits::Skewed, 5);
    // Widths past two 256-wide column tiles, k steps with a tail (the wgmma kernels' tiles).
    check_case(160, 4, 2, 520, 264, true, Logits::Random, 6);
}

/// The wgmma kernels' CUBIN compiles with no ptxas warning that they lost their Hopper features
/// (`compile_cubin` refuses those) and the geometry the launchers use (the kernels refuse another
/// at compile time). Needs NVRTC, not a GPU.
#[test]
fn moe_wgmma_kernels_compile_without_lost_features() {
    let cubin = super::moe::wgmma_cubin().expect("the wgmma kernels compile cleanly");
    for name in ["mt_moe_hgemm_nk", "mt_moe_hgemm_kn", "mt_moe_hgemm_kn_dmid", "mt_moe_hgemm_wgrad"] {
        assert!(cubin.windows(name.len()).any(|w| w == name.as_bytes()), "{name} is not in the CUBIN");
    }
}

/// Bad shapes are refused with a sentence, before any launch.
#[test]
fn moe_refuses_what_the_kernels_do_not_take() {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
    let logits = Tensor::zeros((4, 8), DType::F32, &dev).unwrap();
    let err = MoeRouting::route(&logits, 9, false).err().unwrap().to_string();
    assert!(err.contains("top-9"), "{err}");
    let rt = MoeRouting::route(&logits, 2, false).unwrap();
    let x = Tensor::zeros((4, 12), DType::BF16, &dev).unwrap();
    let w = Tensor::zeros((8, 16, 12), DType::BF16, &dev).unwrap();
    let err = rt.matmul(&x, true, &w, ExpertMatrix::OutIn).err().unwrap().to_string();
    assert!(err.contains("multiples of 8"), "{err}");
}

/// As the engine hands them over: the token rows a view into a larger tensor (an MLP tile of a
/// chunk), the expert weight gradients added twice into a view of one flat f32 buffer at an
/// aligned offset (`mt_layers::GradSink::accumulate_in_place`). The products are the bits of
/// the same calls on tensors of their own, the second addition doubles the first exactly, and
/// the rest of the buffer is untouched.
#[test]
fn moe_launchers_take_views_as_the_engine_hands_them() {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
    let (t, e, k, h, f, skip) = (96, 6, 2, 64, 40, 5);
    let mut rng = StdRng::seed_from_u64(11);
    let mut bf = |shape: &[usize], s: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (rng.random::<f32>() - 0.5) * s).collect();
        Tensor::from_vec(v, shape, &dev).unwrap().to_dtype(DType::BF16).unwrap()
    };
    let rows = bf(&[skip + t, h], 2.0);
    let x = rows.narrow(0, skip, t).unwrap();
    let x_own = x.copy().unwrap();
    let (wgu, wd, dout) = (bf(&[e, 2 * f, h], 0.3), bf(&[e, h, f], 0.3), bf(&[t, h], 2.0));
    let logits = bf(&[t, e], 4.0);
    let rt = MoeRouting::route(&logits, k, true).unwrap();
    let gu = rt.matmul(&x, true, &wgu, ExpertMatrix::OutIn).unwrap();
    let bits = |t: &Tensor| host(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&gu), bits(&rt.matmul(&x_own, true, &wgu, ExpertMatrix::OutIn).unwrap()));
    let mid = moe_swiglu(&gu).unwrap();
    let (d_mid, _) = rt.down_backward(&dout, &wd, &mid).unwrap();
    let dgu = moe_swiglu_backward(&d_mid, &gu).unwrap();
    let dys = rt.gather(&dout, true).unwrap();
    for (shape, a, b, gather) in [([e, h, f], &dys, &mid, false), ([e, 2 * f, h], &dgu, &x, true)] {
        let n: usize = shape.iter().product();
        let own = Tensor::zeros(&shape, DType::F32, &dev).unwrap();
        rt.weight_grad(&own, a, if gather { &x_own } else { b }, gather).unwrap();
        let flat = Tensor::zeros(64 + n + 64, DType::F32, &dev).unwrap();
        let view = flat.narrow(0, 64, n).unwrap().reshape(&shape).unwrap();
        rt.weight_grad(&view, a, b, gather).unwrap();
        rt.weight_grad(&view, a, b, gather).unwrap();
        assert_eq!(bits(&view), bits(&(&own * 2.0).unwrap()), "{shape:?}: twice into a view");
        let edges =
            Tensor::cat(&[flat.narrow(0, 0, 64).unwrap(), flat.narrow(0, 64 + n, 64).unwrap()], 0).unwrap();
        assert!(host(&edges).iter().all(|&v| v == 0.0), "{shape:?}: outside the view");
    }
}

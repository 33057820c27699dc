//! The flash attention kernels against an f32 reference computed in query tiles (no `[s, s]`
//! tensor of all heads), on a CUDA device (run on the GPU machine:
//! `cargo test -p mt-kernels --features cuda --lib`; not part of the CPU suite).

use candle_core::{DType, Device, Tensor, D};

use super::{flash_backward, flash_forward, hopper_applies};
use crate::FlashKernel;

/// Rows of the reference's query tiles.
const TILE: usize = 1024;

struct Reference {
    o: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
}

/// Causal (and, with `docs`, per-document) attention and its gradients in f32 with true f32
/// GEMMs, one tile of `TILE` query rows (against the keys up to the tile's last row) and one head
/// at a time: `q, d_o: [s, nh, hd]`, `k, v: [s, nkv, hd]`, all f32.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, docs: Option<&[u32]>) -> Reference {
    let (s, nh, hd) = q.dims3().unwrap();
    let nkv = k.dim(1).unwrap();
    let dev = q.device();
    let scale = 1.0 / (hd as f64).sqrt();
    let head = |x: &Tensor, i: usize| x.narrow(1, i, 1).unwrap().squeeze(1).unwrap().contiguous().unwrap();
    let (qh, doh): (Vec<_>, Vec<_>) = (0..nh).map(|h| (head(q, h), head(d_o, h))).unzip();
    let (kh, vh): (Vec<_>, Vec<_>) = (0..nkv).map(|h| (head(k, h), head(v, h))).unzip();
    let (mut o, mut lse, mut dq) = (vec![Vec::new(); nh], vec![Vec::new(); nh], vec![Vec::new(); nh]);
    let mut dk = vec![Tensor::zeros((s, hd), DType::F32, dev).unwrap(); nkv];
    let mut dv = dk.clone();
    for r0 in (0..s).step_by(TILE) {
        let (n, kend) = (TILE.min(s - r0), (r0 + TILE).min(s));
        // Additive mask of the tile: key j visible to query i iff lo[i] <= j <= i.
        let mask: Vec<f32> = (r0..r0 + n)
            .flat_map(|i| {
                let lo = docs.map_or(0, |d| d[i] as usize);
                (0..kend).map(move |j| if j <= i && j >= lo { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, kend), dev).unwrap();
        for h in 0..nh {
            let kv = h / (nh / nkv);
            let (kt, vt) = (kh[kv].narrow(0, 0, kend).unwrap(), vh[kv].narrow(0, 0, kend).unwrap());
            let qt = qh[h].narrow(0, r0, n).unwrap();
            let dot = doh[h].narrow(0, r0, n).unwrap();
            let sc = ((qt.matmul(&kt.t().unwrap()).unwrap() * scale).unwrap() + &mask).unwrap();
            let m = sc.max_keepdim(D::Minus1).unwrap();
            let e = sc.broadcast_sub(&m).unwrap().exp().unwrap();
            let z = e.sum_keepdim(D::Minus1).unwrap();
            let p = e.broadcast_div(&z).unwrap();
            let ot = p.matmul(&vt).unwrap();
            let dp = dot.matmul(&vt.t().unwrap()).unwrap();
            let dd = (&dot * &ot).unwrap().sum_keepdim(D::Minus1).unwrap();
            let ds = (&p * dp.broadcast_sub(&dd).unwrap()).unwrap();
            dq[h].push((ds.matmul(&kt).unwrap() * scale).unwrap());
            let pad = |x: Tensor| x.pad_with_zeros(0, 0, s - kend).unwrap();
            dk[kv] = (&dk[kv] + pad((ds.t().unwrap().matmul(&qt).unwrap() * scale).unwrap())).unwrap();
            dv[kv] = (&dv[kv] + pad(p.t().unwrap().matmul(&dot).unwrap())).unwrap();
            lse[h].push((m + z.log().unwrap()).unwrap().squeeze(1).unwrap());
            o[h].push(ot);
        }
    }
    let cat = |parts: Vec<Vec<Tensor>>| -> Vec<Tensor> {
        parts.iter().map(|p| Tensor::cat(p, 0).unwrap()).collect()
    };
    Reference {
        o: Tensor::stack(&cat(o), 1).unwrap(),
        lse: Tensor::stack(&cat(lse), 0).unwrap(),
        dq: Tensor::stack(&cat(dq), 1).unwrap(),
        dk: Tensor::stack(&dk, 1).unwrap(),
        dv: Tensor::stack(&dv, 1).unwrap(),
    }
}

/// (relative L2, largest absolute difference over the largest reference magnitude).
fn errs(got: &Tensor, want: &Tensor) -> (f64, f64) {
    let g = got.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let w = want.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let d = (&g - &w).unwrap();
    let norm = |x: &Tensor| x.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64;
    let amax = |x: &Tensor| x.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() as f64;
    (norm(&d) / norm(&w), amax(&d) / amax(&w))
}

/// Seeded normal bf16 `[1, s, heads, hd]`.
fn randn(s: usize, heads: usize, hd: usize, seed: u64, dev: &Device) -> Tensor {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..s * heads * hd)
        .map(|_| {
            // Box-Muller.
            let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
            (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect();
    Tensor::from_vec(v, (1, s, heads, hd), dev).unwrap().to_dtype(DType::BF16).unwrap()
}

/// s = 4096 and 32768: the Qwen2.5-7B head layout (28 query heads over 4 KV heads, d 128), a
/// Llama-like 8/2 of d 64, and s = 4096 with seven packed documents (and a length that is not a
/// multiple of any tile); output, LSE and dQ/dK/dV within bf16 rounding of the f32 reference
/// (relative L2 ≤ 1e-2: the kernels round P and dS to bf16 before their products, and their
/// outputs to bf16), and a second backward bitwise the first (but for the unordered dQ adds).
/// For each set of kernels the GPU runs (the portable ones everywhere, the Hopper ones ordered and
/// unordered on compute capability 9.0). Every figure is printed.
#[test]
fn flash_kernels_match_a_tiled_f32_reference() {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let hopper = match &dev {
        Device::Cuda(d) => hopper_applies(d, 128),
        _ => false,
    };
    let kernels: &[FlashKernel] = if hopper {
        &[FlashKernel::Portable, FlashKernel::Hopper, FlashKernel::HopperUnordered]
    } else {
        &[FlashKernel::Portable]
    };
    let mut failures = Vec::new();
    for (&kernel, (s, nh, nkv, hd, n_docs)) in kernels.iter().flat_map(|k| {
        [
            (4096, 28, 4, 128, 1),
            (4096, 8, 2, 64, 1),
            (4096, 28, 4, 128, 7),
            (3000, 8, 2, 128, 3),
            (32768, 28, 4, 128, 1),
        ]
        .into_iter()
        .map(move |c| (k, c))
    }) {
        let seed = (s + nh + n_docs) as u64;
        let (q, k, v, d_o) = (
            randn(s, nh, hd, seed, &dev),
            randn(s, nkv, hd, seed + 1, &dev),
            randn(s, nkv, hd, seed + 2, &dev),
            randn(s, nh, hd, seed + 3, &dev),
        );
        // Documents of a fixed pseudo-random length split.
        let docs: Option<(Vec<u32>, Vec<u32>)> = (n_docs > 1).then(|| {
            let cuts: Vec<usize> = (1..n_docs).map(|i| i * s / n_docs + (i * 97) % 61).collect();
            let mut lo = vec![0u32; s];
            let mut hi = vec![0u32; s];
            let bounds: Vec<usize> = std::iter::once(0).chain(cuts).chain(std::iter::once(s)).collect();
            for w in bounds.windows(2) {
                for i in w[0]..w[1] {
                    lo[i] = w[0] as u32;
                    hi[i] = w[1] as u32;
                }
            }
            (lo, hi)
        });
        let dev_docs = docs.as_ref().map(|(lo, hi)| {
            (Tensor::from_slice(lo, (1, s), &dev).unwrap(), Tensor::from_slice(hi, (1, s), &dev).unwrap())
        });
        let bounds = dev_docs.as_ref().map(|(lo, hi)| (lo, hi));
        let (o, lse) = flash_forward(&q, &k, &v, bounds, kernel).unwrap();
        let (dq, dk, dv) = flash_backward(&q, &k, &v, &o, &lse, &d_o, bounds, kernel).unwrap();
        let (dq2, dk2, dv2) = flash_backward(&q, &k, &v, &o, &lse, &d_o, bounds, kernel).unwrap();
        let same = |a: &Tensor, b: &Tensor| {
            let bits =
                |x: &Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            bits(a) == bits(b)
        };
        let repeatable = same(&dq, &dq2) && same(&dk, &dk2) && same(&dv, &dv2);
        let f32_of = |x: &Tensor| x.squeeze(0).unwrap().to_dtype(DType::F32).unwrap();
        let r = reference(
            &f32_of(&q),
            &f32_of(&k),
            &f32_of(&v),
            &f32_of(&d_o),
            docs.as_ref().map(|(lo, _)| &lo[..]),
        );
        let checks = [
            ("o", errs(&o.squeeze(0).unwrap(), &r.o)),
            ("lse", errs(&lse.squeeze(0).unwrap(), &r.lse)),
            ("dq", errs(&dq.squeeze(0).unwrap(), &r.dq)),
            ("dk", errs(&dk.squeeze(0).unwrap(), &r.dk)),
            ("dv", errs(&dv.squeeze(0).unwrap(), &r.dv)),
        ];
        eprintln!(
            "SUMMARY flash {kernel:?} s={s} heads {nh}/{nkv} d {hd} documents {n_docs}: {} (relative L2 / max abs over max ref); backward bitwise repeatable: {repeatable}",
            checks.iter().map(|(n, (l2, mx))| format!("{n} {l2:.2e}/{mx:.2e}")).collect::<Vec<_>>().join(", ")
        );
        let lse_ok = checks[1].1 .0 <= 1e-5;
        // The unordered backward adds dQ's partials in arrival order: its bits may differ run to run.
        let must_repeat = kernel != FlashKernel::HopperUnordered;
        if (must_repeat && !repeatable)
            || !lse_ok
            || checks.iter().any(|(_, (l2, _))| l2.is_nan() || *l2 > 1e-2)
        {
            failures.push(format!("{kernel:?} s={s} {nh}/{nkv} d {hd} docs {n_docs}"));
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
}

/// The Hopper kernels' CUBIN compiles with no ptxas warning that they lost their Hopper features
/// (`setmaxnreg` ignored, wgmma serialised): `compile_cubin` refuses those. Needs NVRTC, not a GPU.
#[test]
fn hopper_kernels_compile_without_lost_features() {
    let cubin = super::flash_hopper::compiled_cubin().expect("the Hopper kernels compile cleanly");
    for name in [
        "mt_hfa_fwd_hd128",
        "mt_hfa_bwd_hd128",
        "mt_hfa_fwd_hd64",
        "mt_hfa_bwd_hd64",
        "mt_hfa_dq_convert_hd128",
    ] {
        assert!(cubin.windows(name.len()).any(|w| w == name.as_bytes()), "{name} is not in the CUBIN");
    }
}

/// `compile_cubin` refuses what ptxas reports as lost Hopper features: a `setmaxnreg` it ignores
/// (no register cap at entry) and a wgmma whose accumulator is read before its wait (ptxas
/// injects the wait).
#[test]
fn compile_cubin_refuses_lost_hopper_features() {
    let ignored = r#"extern "C" __global__ void k(float* x) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
        x[threadIdx.x] = 1.0f;
    }"#;
    let e = refusal(ignored);
    assert!(e.contains("C7508"), "{e}");
    let injected = r#"extern "C" __global__ void k(float* x, unsigned long long d) {
        float a[4] = {0, 0, 0, 0};
        asm volatile("wgmma.fence.sync.aligned;\n"
                     "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %4, 1, 1, 1, 0, 0;\n"
                     "wgmma.commit_group.sync.aligned;\n"
                     : "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3]) : "l"(d));
        a[0] += 1.0f;
        asm volatile("wgmma.wait_group.sync.aligned 0;\n");
        x[threadIdx.x] = a[0] + a[1] + a[2] + a[3];
    }"#;
    let e = refusal(injected);
    assert!(e.contains("C7517"), "{e}");
}

/// `compile_cubin`'s refusal of a probe kernel; a probe that compiles fails the test with the
/// NVRTC log (which says what ptxas reported instead).
fn refusal(probe: &str) -> String {
    match super::nvrtc::compile_cubin_logged(probe, "probe.cu", "sm_90a") {
        (Err(e), _) => e,
        (Ok(_), log) => panic!("the probe compiled without a refusal; NVRTC's log:\n{log}"),
    }
}

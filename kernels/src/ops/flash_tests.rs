//! The flash attention kernels against an f32 reference computed in query tiles (no `[s, s]`
//! tensor of all heads), on a CUDA device (run on the GPU machine:
//! `cargo test -p mt-kernels --features cuda --lib`; not part of the CPU suite).

use candle_core::{DType, Device, Tensor, D};

use super::{flash_backward_with, flash_forward_with, hopper_applies, FlashExtras};
use crate::FlashKernel;

/// Rows of the reference's query tiles.
const TILE: usize = 1024;

struct Reference {
    o: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    /// dQ and dK with every term's magnitude (`|P| ⊙ (|dP| + |D|)` in place of dS, `|K|`, `|Q|`):
    /// the size a gradient has before its terms cancel. Where they cancel exactly (a window of
    /// one key: softmax over one column has no gradient), dQ and dK are rounding noise on both
    /// sides, and their error is measured against 1% of this instead.
    dq_terms: Tensor,
    dk_terms: Tensor,
    /// With sinks, their gradient `[nh]` and its scale, `Σ_rows |e^{sink} / Z · rowsum(dO ⊙ O)|`
    /// per head (the sum's terms largely cancel, so an error is measured against their size).
    dsinks: Option<(Tensor, Tensor)>,
}

/// Causal (and, with `docs`, per-document; with `window`, sliding-window) attention and its
/// gradients in f32 with true f32 GEMMs, one tile of `TILE` query rows (against the keys up to
/// the tile's last row) and one head at a time: `q, d_o: [s, nh, hd]`, `k, v: [s, nkv, hd]`, all
/// f32. With `sinks` (`[nh]`), each head's logit is one more softmax column with no value:
/// `Z = Σ_j e^{s_j} + e^{sink}`, `dsink = -Σ_rows (e^{sink} / Z) rowsum(dO ⊙ O)`.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    docs: Option<&[u32]>,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) -> Reference {
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
    let (mut dq_terms, mut dk_terms) = (vec![Vec::new(); nh], dk.clone());
    let (mut dsinks, mut dsinks_scale) = (vec![0f64; nh], vec![0f64; nh]);
    for r0 in (0..s).step_by(TILE) {
        let (n, kend) = (TILE.min(s - r0), (r0 + TILE).min(s));
        // Additive mask of the tile: key j visible to query i iff lo[i] <= j <= i and
        // i - j < window.
        let mask: Vec<f32> = (r0..r0 + n)
            .flat_map(|i| {
                let lo = docs.map_or(0, |d| d[i] as usize);
                (0..kend).map(move |j| {
                    let seen = j <= i && j >= lo && window.is_none_or(|w| i - j < w);
                    if seen {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, kend), dev).unwrap();
        for h in 0..nh {
            let kv = h / (nh / nkv);
            let (kt, vt) = (kh[kv].narrow(0, 0, kend).unwrap(), vh[kv].narrow(0, 0, kend).unwrap());
            let qt = qh[h].narrow(0, r0, n).unwrap();
            let dot = doh[h].narrow(0, r0, n).unwrap();
            let sc = ((qt.matmul(&kt.t().unwrap()).unwrap() * scale).unwrap() + &mask).unwrap();
            let sink = sinks.map(|x| x[h]);
            let mut m = sc.max_keepdim(D::Minus1).unwrap();
            if let Some(sink) = sink {
                m = m.maximum(sink).unwrap();
            }
            let e = sc.broadcast_sub(&m).unwrap().exp().unwrap();
            let mut z = e.sum_keepdim(D::Minus1).unwrap();
            let e_sink = sink.map(|sink| (m.neg().unwrap() + sink as f64).unwrap().exp().unwrap());
            if let Some(es) = &e_sink {
                z = (z + es).unwrap();
            }
            let p = e.broadcast_div(&z).unwrap();
            let ot = p.matmul(&vt).unwrap();
            let dp = dot.matmul(&vt.t().unwrap()).unwrap();
            let dd = (&dot * &ot).unwrap().sum_keepdim(D::Minus1).unwrap();
            if let Some(es) = &e_sink {
                let terms = ((es / &z).unwrap() * &dd).unwrap();
                let sum = |x: Tensor| x.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
                dsinks[h] -= sum(terms.clone());
                dsinks_scale[h] += sum(terms.abs().unwrap());
            }
            let ds = (&p * dp.broadcast_sub(&dd).unwrap()).unwrap();
            dq[h].push((ds.matmul(&kt).unwrap() * scale).unwrap());
            let pad = |x: Tensor| x.pad_with_zeros(0, 0, s - kend).unwrap();
            dk[kv] = (&dk[kv] + pad((ds.t().unwrap().matmul(&qt).unwrap() * scale).unwrap())).unwrap();
            let abs = |x: &Tensor| x.abs().unwrap();
            let ds_terms = (abs(&p) * abs(&dp).broadcast_add(&abs(&dd)).unwrap()).unwrap();
            dq_terms[h].push((ds_terms.matmul(&abs(&kt)).unwrap() * scale).unwrap());
            dk_terms[kv] = (&dk_terms[kv]
                + pad((ds_terms.t().unwrap().matmul(&abs(&qt)).unwrap() * scale).unwrap()))
            .unwrap();
            dv[kv] = (&dv[kv] + pad(p.t().unwrap().matmul(&dot).unwrap())).unwrap();
            lse[h].push((m + z.log().unwrap()).unwrap().squeeze(1).unwrap());
            o[h].push(ot);
        }
    }
    let cat = |parts: Vec<Vec<Tensor>>| -> Vec<Tensor> {
        parts.iter().map(|p| Tensor::cat(p, 0).unwrap()).collect()
    };
    let vec_of = |x: Vec<f64>| Tensor::from_vec(x.iter().map(|&x| x as f32).collect(), nh, dev).unwrap();
    let dsinks = sinks.map(|_| (vec_of(dsinks), vec_of(dsinks_scale)));
    Reference {
        o: Tensor::stack(&cat(o), 1).unwrap(),
        lse: Tensor::stack(&cat(lse), 0).unwrap(),
        dq: Tensor::stack(&cat(dq), 1).unwrap(),
        dk: Tensor::stack(&dk, 1).unwrap(),
        dv: Tensor::stack(&dv, 1).unwrap(),
        dq_terms: Tensor::stack(&cat(dq_terms), 1).unwrap(),
        dk_terms: Tensor::stack(&dk_terms, 1).unwrap(),
        dsinks,
    }
}

/// (relative L2, largest absolute difference over the largest reference magnitude).
fn errs(got: &Tensor, want: &Tensor) -> (f64, f64) {
    errs_floored(got, want, None)
}

/// [`errs`], measured against `terms` (the reference with no cancellation) at 1% of its size
/// where the reference itself is smaller than that.
fn errs_floored(got: &Tensor, want: &Tensor, terms: Option<&Tensor>) -> (f64, f64) {
    let f32_flat = |x: &Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let (g, w) = (f32_flat(got), f32_flat(want));
    let d = (&g - &w).unwrap();
    let norm = |x: &Tensor| x.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64;
    let amax = |x: &Tensor| x.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() as f64;
    let (mut n, mut m) = (norm(&w), amax(&w));
    if let Some(t) = terms.map(f32_flat) {
        (n, m) = (n.max(1e-2 * norm(&t)), m.max(1e-2 * amax(&t)));
    }
    (norm(&d) / n, amax(&d) / m)
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

/// One call's shape and masks: `s` tokens, `nh` query over `nkv` KV heads of `hd`, `n_docs`
/// packed documents, GPT-OSS's window and sinks.
#[derive(Debug, Clone, Copy)]
struct Case {
    s: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    n_docs: usize,
    window: Option<usize>,
    sinks: bool,
}

impl Case {
    const fn plain(s: usize, nh: usize, nkv: usize, hd: usize, n_docs: usize) -> Self {
        Case { s, nh, nkv, hd, n_docs, window: None, sinks: false }
    }
}

/// Bits of a tensor, to compare two runs.
fn bits(x: &Tensor) -> Vec<u32> {
    let v = x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter().map(|f| f.to_bits()).collect()
}

/// A case's inputs on the device (seeded by its shape), and on the host what the reference
/// takes besides them.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
    /// Each token's document's first and one-past-last index (more than one document).
    docs: Option<(Vec<u32>, Vec<u32>)>,
    dev_docs: Option<(Tensor, Tensor)>,
    sinks: Option<Vec<f32>>,
    dev_sinks: Option<Tensor>,
}

impl Inputs {
    fn new(c: Case, dev: &Device) -> Self {
        let Case { s, nh, nkv, hd, n_docs, window, .. } = c;
        let seed = (s + nh + n_docs + window.unwrap_or(0)) as u64;
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
        // GPT-OSS-like sink logits: a spread around the scores' scale, so some heads' sinks take
        // most of a row and some almost none.
        let sinks: Option<Vec<f32>> =
            c.sinks.then(|| (0..nh).map(|h| (h as f32 * 0.37).sin() * 3.0).collect());
        Inputs {
            q: randn(s, nh, hd, seed, dev),
            k: randn(s, nkv, hd, seed + 1, dev),
            v: randn(s, nkv, hd, seed + 2, dev),
            d_o: randn(s, nh, hd, seed + 3, dev),
            dev_docs: docs.as_ref().map(|(lo, hi)| {
                (Tensor::from_slice(lo, (1, s), dev).unwrap(), Tensor::from_slice(hi, (1, s), dev).unwrap())
            }),
            docs,
            dev_sinks: sinks.as_ref().map(|x| Tensor::from_slice(x, nh, dev).unwrap()),
            sinks,
        }
    }

    /// `kernel`'s forward and backward: `[o, lse, dq, dk, dv]` and the sinks' gradient, or the
    /// launchers' error.
    fn run(
        &self,
        kernel: FlashKernel,
        window: Option<usize>,
    ) -> Result<(Vec<Tensor>, Option<Tensor>), String> {
        let Inputs { q, k, v, d_o, .. } = self;
        let extras = FlashExtras { window, sinks: self.dev_sinks.as_ref() };
        let bounds = self.dev_docs.as_ref().map(|(lo, hi)| (lo, hi));
        let (o, lse) = flash_forward_with(q, k, v, bounds, extras, kernel).map_err(|e| e.to_string())?;
        let (dq, dk, dv, dsinks) =
            flash_backward_with(q, k, v, &o, &lse, d_o, bounds, extras, kernel).map_err(|e| e.to_string())?;
        Ok((vec![o, lse, dq, dk, dv], dsinks))
    }
}

/// Runs `case` on `kernel` against the reference: output, LSE, dQ/dK/dV within bf16 rounding of
/// the f32 reference (relative L2 ≤ 1e-2, LSE ≤ 1e-5), the sinks' gradient within 1e-2 of its
/// scale (the L2 norm of the error over that of each head's `Σ |terms|`: the terms cancel), and
/// a second backward bitwise the first (but for the unordered dQ adds). Prints every figure;
/// returns the outputs (`[o, lse, dq, dk, dv]`, then the sinks' gradient), or what failed.
fn check(kernel: FlashKernel, c: Case, dev: &Device) -> Result<Vec<Tensor>, String> {
    let Case { s, nh, nkv, hd, n_docs, window, .. } = c;
    let x = Inputs::new(c, dev);
    let (outs, dsinks) = x.run(kernel, window)?;
    let (again, dsinks2) = x.run(kernel, window)?;
    // Both forwards ran the same kernels on the same inputs; the backward is what must repeat.
    let repeatable = outs[2..].iter().map(bits).eq(again[2..].iter().map(bits))
        && dsinks.as_ref().map(bits) == dsinks2.as_ref().map(bits);
    let f32_of = |x: &Tensor| x.squeeze(0).unwrap().to_dtype(DType::F32).unwrap();
    let r = reference(
        &f32_of(&x.q),
        &f32_of(&x.k),
        &f32_of(&x.v),
        &f32_of(&x.d_o),
        x.docs.as_ref().map(|(lo, _)| &lo[..]),
        window,
        x.sinks.as_deref(),
    );
    let terms = [None, None, Some(&r.dq_terms), Some(&r.dk_terms), None];
    let mut checks: Vec<(&str, (f64, f64))> = ["o", "lse", "dq", "dk", "dv"]
        .into_iter()
        .zip(&outs)
        .zip([&r.o, &r.lse, &r.dq, &r.dk, &r.dv])
        .zip(terms)
        .map(|(((n, got), want), terms)| (n, errs_floored(&got.squeeze(0).unwrap(), want, terms)))
        .collect();
    match (&dsinks, &r.dsinks) {
        (Some(got), Some((want, scale))) => {
            let (l2, _) = errs(got, want);
            let d = (got - want).unwrap();
            let norm =
                |x: &Tensor| x.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64;
            let amax = |x: &Tensor| x.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() as f64;
            eprintln!("SUMMARY flash {kernel:?} sinks' gradient: relative L2 {l2:.2e} (not bounded: its terms cancel)");
            checks.push(("dsinks/scale", (norm(&d) / norm(scale), amax(&d) / amax(scale))));
        }
        (None, None) => {}
        _ => return Err(format!("{kernel:?} {c:?}: the sinks' gradient is missing or unasked for")),
    }
    eprintln!(
        "SUMMARY flash {kernel:?} s={s} heads {nh}/{nkv} d {hd} documents {n_docs} window {window:?} sinks {}: {} (relative L2 / max abs over max ref); backward bitwise repeatable: {repeatable}",
        c.sinks,
        checks.iter().map(|(n, (l2, mx))| format!("{n} {l2:.2e}/{mx:.2e}")).collect::<Vec<_>>().join(", ")
    );
    let lse_ok = checks[1].1 .0 <= 1e-5;
    // The unordered backward adds dQ's partials in arrival order: its bits may differ run to run.
    let must_repeat = kernel != FlashKernel::HopperUnordered;
    if (must_repeat && !repeatable) || !lse_ok || checks.iter().any(|(_, (l2, _))| l2.is_nan() || *l2 > 1e-2)
    {
        return Err(format!("{kernel:?} {c:?}"));
    }
    Ok(outs.into_iter().chain(dsinks).collect())
}

/// The device and which kernel sets it runs: the portable ones everywhere, the Hopper ones
/// ordered and unordered on compute capability 9.0.
fn device_and_kernels() -> (Device, bool) {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let hopper = match &dev {
        Device::Cuda(d) => hopper_applies(d, 128),
        _ => false,
    };
    (dev, hopper)
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
    let (dev, hopper) = device_and_kernels();
    let kernels: &[FlashKernel] = if hopper {
        &[FlashKernel::Portable, FlashKernel::Hopper, FlashKernel::HopperUnordered]
    } else {
        &[FlashKernel::Portable]
    };
    let cases = [
        Case::plain(4096, 28, 4, 128, 1),
        Case::plain(4096, 8, 2, 64, 1),
        Case::plain(4096, 28, 4, 128, 7),
        Case::plain(3000, 8, 2, 128, 3),
        Case::plain(32768, 28, 4, 128, 1),
    ];
    let dev = &dev;
    let failures: Vec<String> =
        kernels.iter().flat_map(|&k| cases.iter().filter_map(move |&c| check(k, c, dev).err())).collect();
    assert!(failures.is_empty(), "failed: {failures:?}");
}

/// GPT-OSS's sliding windows and sinks on each set of kernels the GPU runs (the portable ones,
/// and on compute capability 9.0 the Hopper ones ordered and unordered), against the same
/// reference with the window in its mask and the sink as one more softmax column: GPT-OSS's head
/// layout (64 query heads over 8 KV heads of 64) with its 128-token window and sinks at 4096 and
/// 16384 tokens, sinks alone (its full-context layers), windows of 1 and 7 with packed documents,
/// a window longer than the sequence, head dim 128 with a length no tile divides. The sinks'
/// gradient within 1e-2 of its scale and bitwise on a second backward (but for the unordered
/// dQ adds). `Auto` runs the Hopper kernels where they apply, else the portable ones: bitwise
/// the same outputs as those asked for by name.
#[test]
fn flash_kernels_with_windows_and_sinks_match_a_tiled_f32_reference() {
    let (dev, hopper) = device_and_kernels();
    let gpt_oss = |s, window, sinks| Case { s, nh: 64, nkv: 8, hd: 64, n_docs: 1, window, sinks };
    let cases = [
        gpt_oss(4096, Some(128), true),
        gpt_oss(4096, None, true),
        gpt_oss(16384, Some(128), true),
        Case { window: Some(1), ..Case::plain(4096, 8, 2, 64, 7) },
        Case { window: Some(7), sinks: true, ..Case::plain(4096, 8, 2, 64, 7) },
        Case { window: Some(128), sinks: true, ..Case::plain(3000, 8, 2, 128, 3) },
        Case { window: Some(5000), sinks: true, ..Case::plain(3000, 8, 2, 128, 1) },
        Case { window: Some(128), ..Case::plain(4096, 28, 4, 128, 1) },
    ];
    let mut failures = Vec::new();
    for c in cases {
        let mut by_name = None;
        for k in [FlashKernel::Portable, FlashKernel::Hopper, FlashKernel::HopperUnordered] {
            if k != FlashKernel::Portable && !hopper {
                continue;
            }
            match check(k, c, &dev) {
                // What `Auto` must equal: the Hopper kernels (ordered) where they run.
                Ok(outs) if k == FlashKernel::Portable || k == FlashKernel::Hopper => by_name = Some(outs),
                Ok(_) => {}
                Err(e) => failures.push(e),
            }
        }
        let Some(by_name) = by_name else { continue };
        match Inputs::new(c, &dev).run(FlashKernel::Auto, c.window) {
            Ok((auto, ds)) if auto.iter().chain(&ds).map(bits).eq(by_name.iter().map(bits)) => {}
            Ok(_) => failures.push(format!("Auto {c:?}: not bitwise the outputs of the kernels it picks")),
            Err(e) => failures.push(format!("Auto {c:?}: {e}")),
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
        "mt_hfa_fwd_ext_hd64",
        "mt_hfa_bwd_ext_hd64",
        "mt_hfa_fwd_ext_hd128",
        "mt_hfa_bwd_ext_hd128",
        "mt_flash_sink_grad",
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

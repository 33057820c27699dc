//! The attention softmax pair (`kernels/cuda/softmax.cu`): the causal softmax forward (bf16
//! probabilities and per-row statistics) and its backward (the f32 probabilities recomputed bit
//! for bit), warp-per-row for rows of up to `WARP_ROW_MAX` keys (the `_warp8` kernels, which
//! issue a row's loads all at once, when the row length is a multiple of 8), block-per-row
//! beyond (the `_block8` kernels, 16-byte loads, when it is a multiple of 8).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor};
use half::bf16;

use super::sources::SOFTMAX;
use super::{launch_cfg, msg, rows_and_t};

/// Longest row the warp-per-row softmax kernels keep in registers (`WARP_ROW_MAX` in
/// `kernels/cuda/softmax.cu`); longer rows take the block-per-row kernels.
const WARP_ROW_MAX: usize = 2048;
/// Rows (warps) per block of the warp-per-row kernels: small blocks, as the backward holds 152
/// registers a thread (ptxas, sm_90), so that several blocks share a multiprocessor.
const WARP_ROWS_PER_BLOCK: usize = 4;

/// One block per row, or one warp per row.
fn softmax_cfg(rows: usize, warp: bool) -> LaunchConfig {
    if !warp {
        return launch_cfg(rows);
    }
    let blocks = rows.div_ceil(WARP_ROWS_PER_BLOCK) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32 * WARP_ROWS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
struct CausalSoftmax {
    scale: f32,
    /// Take the `_warp8` kernel where it applies (always, but in the test that compares it with
    /// the `_warp` kernel bit for bit).
    warp8: bool,
}

/// bf16 elements that hold the row statistics `(max, sum)` (two f32) of `rows` rows after the
/// `rows · t` probabilities in [`CausalSoftmax`]'s one output buffer; the probabilities are
/// padded to an even count so the f32 pairs are 4-byte aligned.
fn stats_offset(rows: usize, t: usize) -> usize {
    (rows * t).next_multiple_of(2)
}

impl CustomOp1 for CausalSoftmax {
    cuda_only!("mt-causal-softmax", 1);

    /// One buffer: `P` in bf16 (`rows · t`, padded to even), then `(max, sum)` per row as f32 bits
    /// (4 bf16 slots a row).
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, t) = rows_and_t(l, "causal softmax")?;
        let dev = s.device();
        let src = s.as_cuda_slice::<bf16>()?.slice(l.start_offset()..);
        // The warp kernel's 16-byte accesses need 16-byte aligned rows: an aligned view start.
        let aligned = l.start_offset().is_multiple_of(8);
        let warp = t <= WARP_ROW_MAX && aligned;
        let kernel = match (warp, self.warp8 && t.is_multiple_of(8)) {
            (true, true) => "mt_causal_softmax_fwd_warp8",
            (true, false) => "mt_causal_softmax_fwd_warp",
            (false, true) if aligned => "mt_causal_softmax_fwd_block8",
            (false, _) => "mt_causal_softmax_fwd",
        };
        let func = dev.get_or_load_custom_func(kernel, SOFTMAX.module, SOFTMAX.ptx()?)?;
        let off = stats_offset(rows, t);
        let len = off + 4 * rows;
        // SAFETY: every element but the (at most one) padding slot is written by the kernel
        // below before anyone reads it; the padding slot is never read.
        let out = unsafe { dev.alloc::<bf16>(len)? };
        let (pb, stats) = (out.slice(..off), out.slice(off..));
        let (t32, c, rows64) = (t as i32, self.scale, rows as i64);
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&pb);
        b.arg(&stats);
        b.arg(&t32);
        b.arg(&c);
        if warp {
            b.arg(&rows64);
        }
        // SAFETY: argument types match the kernel's signature (bf16 bits in and out, the stats
        // region as float*: it starts at an even bf16 index of a fresh allocation, so 4-byte
        // aligned, and holds 2 f32 per row; the warp kernel also takes the row count as i64);
        // one block per row, or one warp per row for rows of at most WARP_ROW_MAX elements
        // (16-byte accesses, and the `_warp8` and `_block8` kernels, only when t % 8 == 0 and the
        // view starts at a multiple of 8 elements of candle's 256-byte aligned allocation, so
        // every row start is 16-byte aligned); src holds rows * t elements, pb rows * t, stats
        // 2 * rows f32.
        unsafe { b.launch(softmax_cfg(rows, warp)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(len)))
    }
}

struct SoftmaxBackward {
    scale: f32,
    /// As [`CausalSoftmax::warp8`].
    warp8: bool,
}

impl CustomOp3 for SoftmaxBackward {
    cuda_only!("mt-softmax-backward", 3);

    fn cuda_fwd(
        &self,
        dp: &CudaStorage,
        ldp: &Layout,
        s: &CudaStorage,
        ls: &Layout,
        stats: &CudaStorage,
        lst: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, t) = rows_and_t(ldp, "softmax backward dP")?;
        if rows_and_t(ls, "softmax backward S")? != (rows, t) {
            return Err(msg("softmax backward: dP and S differ in shape"));
        }
        if !lst.is_contiguous()
            || lst.shape().elem_count() != 4 * rows
            || !lst.start_offset().is_multiple_of(2)
        {
            return Err(msg("softmax backward: row statistics of another shape"));
        }
        let dev = dp.device();
        let dps = dp.as_cuda_slice::<bf16>()?.slice(ldp.start_offset()..);
        let ss = s.as_cuda_slice::<bf16>()?.slice(ls.start_offset()..);
        let st = stats.as_cuda_slice::<bf16>()?.slice(lst.start_offset()..);
        let aligned = ldp.start_offset().is_multiple_of(8) && ls.start_offset().is_multiple_of(8);
        let warp = t <= WARP_ROW_MAX && aligned;
        let kernel = match (warp, self.warp8 && t.is_multiple_of(8)) {
            (true, true) => "mt_softmax_bwd_warp8",
            (true, false) => "mt_softmax_bwd_warp",
            (false, true) if aligned => "mt_softmax_bwd_block8",
            (false, _) => "mt_softmax_bwd",
        };
        let func = dev.get_or_load_custom_func(kernel, SOFTMAX.module, SOFTMAX.ptx()?)?;
        // SAFETY: every element is written by the kernel below before anyone reads it.
        let out = unsafe { dev.alloc::<bf16>(rows * t)? };
        let (t32, c, rows64) = (t as i32, self.scale, rows as i64);
        let mut b = func.builder();
        b.arg(&dps);
        b.arg(&ss);
        b.arg(&st);
        b.arg(&out);
        b.arg(&t32);
        b.arg(&c);
        if warp {
            b.arg(&rows64);
        }
        // SAFETY: argument types match the kernel's signature; the stats view starts at an even
        // bf16 offset of its allocation (checked above; [`causal_softmax`] made it 4-byte
        // aligned) and holds 2 f32 per row; one block (or, as in the forward, one warp) per row,
        // the `_warp8` and `_block8` kernels only under the forward's alignment conditions
        // (t % 8 == 0, views at multiples of 8 elements); dP, S and dS hold rows * t elements,
        // contiguous from their views' starts.
        unsafe { b.launch(softmax_cfg(rows, warp)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), ldp.shape().clone()))
    }
}

/// `softmax(scale · s)` over the last axis with the causal mask of query position `row % t` (see
/// `kernels/cuda/softmax.cu`); `s` bf16 on a CUDA device. Returns the probabilities in bf16 (`s`'s
/// shape) and the row statistics for [`softmax_backward`] (opaque: f32 pairs in a bf16 tensor).
pub fn causal_softmax(s: &Tensor, scale: f64) -> candle_core::Result<(Tensor, Tensor)> {
    causal_softmax_with(s, scale, true)
}

fn causal_softmax_with(s: &Tensor, scale: f64, warp8: bool) -> candle_core::Result<(Tensor, Tensor)> {
    if s.dtype() != DType::BF16 {
        return Err(msg(format!("causal softmax kernel takes bf16, not {:?}", s.dtype())));
    }
    let t = *s.dims().last().unwrap_or(&1);
    let rows = s.elem_count() / t.max(1);
    let out = s.contiguous()?.apply_op1_no_bwd(&CausalSoftmax { scale: scale as f32, warp8 })?;
    let off = stats_offset(rows, t);
    Ok((out.narrow(0, 0, rows * t)?.reshape(s.shape())?, out.narrow(0, off, 4 * rows)?))
}

/// `scale · P ⊙ (dP − rowsum(dP ⊙ P))` with `P` recomputed from the scores `s` and the
/// statistics of [`causal_softmax`]; `dp`, `s` bf16, result bf16.
pub fn softmax_backward(dp: &Tensor, s: &Tensor, stats: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    softmax_backward_with(dp, s, stats, scale, true)
}

fn softmax_backward_with(
    dp: &Tensor,
    s: &Tensor,
    stats: &Tensor,
    scale: f64,
    warp8: bool,
) -> candle_core::Result<Tensor> {
    if dp.dtype() != DType::BF16 || s.dtype() != DType::BF16 || stats.dtype() != DType::BF16 {
        return Err(msg("softmax backward kernel takes bf16 dP and S and causal_softmax's statistics"));
    }
    dp.contiguous()?.apply_op3_no_bwd(
        &s.contiguous()?,
        stats,
        &SoftmaxBackward { scale: scale as f32, warp8 },
    )
}

/// Run on the GPU machine (`cargo test -p mt-kernels --features cuda --lib softmax`); they need a
/// CUDA device and are not part of the CPU test suite.
#[cfg(test)]
mod gpu_tests {
    use super::*;
    use candle_core::Device;

    /// Random bf16 scores and upstream gradients of `[2, 3, t, t]` attention, on the CPU.
    fn inputs(t: usize, seed: u64) -> (Tensor, Tensor) {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(seed);
        let n = 2 * 3 * t * t;
        let mut draw = |scale: f32| -> Tensor {
            let v: Vec<bf16> =
                (0..n).map(|_| bf16::from_f32((rng.random::<f32>() * 2.0 - 1.0) * scale)).collect();
            Tensor::from_vec(v, (2, 3, t, t), &Device::Cpu).unwrap()
        };
        (draw(64.0), draw(2.0))
    }

    fn host(x: &Tensor) -> Vec<bf16> {
        x.flatten_all().unwrap().to_device(&Device::Cpu).unwrap().to_vec1::<bf16>().unwrap()
    }

    /// Every path (warp8: t % 8 == 0; warp: other t; block8 and block: t > WARP_ROW_MAX, a multiple
    /// of 8 or not), rows shorter and
    /// longer than a 256-key chunk, against an f64 evaluation of the same formulas from the same
    /// bf16 inputs: P within one bf16 ulp (2^-7 relative: a correctly rounded result is within
    /// 2^-8, the f32 evaluation may round the other way near a tie), dS within one bf16 ulp plus
    /// f32 summation error, and zeros above the diagonal (the block kernel writes -0.0 there).
    #[test]
    fn softmax_kernels_match_an_f64_reference() {
        let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
        let scale = 1.0 / 128f64.sqrt();
        for t in [13usize, 64, 200, 520, 2048, 2053, 2056, 4096] {
            let (s, dp) = inputs(t, t as u64);
            let (sd, dpd) = (s.to_device(&dev).unwrap(), dp.to_device(&dev).unwrap());
            let (p, stats) = causal_softmax(&sd, scale).unwrap();
            let ds = softmax_backward(&dpd, &sd, &stats, scale).unwrap();
            let (s, dp, p, ds) = (host(&s), host(&dp), host(&p), host(&ds));
            let (mut worst_p, mut worst_ds) = (0f64, 0f64);
            for (r, ((sr, dpr), (pr, dsr))) in
                s.chunks(t).zip(dp.chunks(t)).zip(p.chunks(t).zip(ds.chunks(t))).enumerate()
            {
                let i = r % t;
                let x: Vec<f64> = sr[..=i].iter().map(|v| scale * f64::from(v.to_f32())).collect();
                let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
                let pref: Vec<f64> = x.iter().map(|v| (v - m).exp() / z).collect();
                let acc: f64 = pref.iter().zip(dpr).map(|(p, g)| p * f64::from(g.to_f32())).sum();
                let mag: f64 = pref.iter().zip(dpr).map(|(p, g)| p * f64::from(g.to_f32()).abs()).sum();
                for j in 0..t {
                    let (pg, dg) = (f64::from(pr[j].to_f32()), f64::from(dsr[j].to_f32()));
                    if j > i {
                        assert!(
                            pr[j].to_f32() == 0.0 && dsr[j].to_f32() == 0.0,
                            "t={t} row {r} col {j}: not 0 above the diagonal"
                        );
                        continue;
                    }
                    let dref = scale * pref[j] * (f64::from(dpr[j].to_f32()) - acc);
                    let ep = (pg - pref[j]).abs() / (pref[j] * 2f64.powi(-7) + 1e-30);
                    let eds = (dg - dref).abs()
                        / (dref.abs() * 2f64.powi(-7) + scale * pref[j] * 1e-4 * (1.0 + mag) + 1e-30);
                    worst_p = worst_p.max(ep);
                    worst_ds = worst_ds.max(eds);
                }
            }
            eprintln!("SUMMARY softmax kernels t={t}: worst P error {worst_p:.3} and dS error {worst_ds:.3} of their bounds");
            assert!(
                worst_p <= 1.0 && worst_ds <= 1.0,
                "t={t}: P {worst_p:.3}, dS {worst_ds:.3} of the bound"
            );
        }
    }

    /// The `_warp8` kernels (all loads first, rows as raw bits) give the `_warp` kernels' bits:
    /// probabilities, statistics and dS.
    #[test]
    fn softmax_warp8_kernels_are_bitwise_the_warp_kernels() {
        let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
        let scale = 1.0 / 128f64.sqrt();
        for t in [64usize, 200, 2048] {
            let (s, dp) = inputs(t, 100 + t as u64);
            let (s, dp) = (s.to_device(&dev).unwrap(), dp.to_device(&dev).unwrap());
            let run = |warp8: bool| {
                let (p, st) = causal_softmax_with(&s, scale, warp8).unwrap();
                let ds = softmax_backward_with(&dp, &s, &st, scale, warp8).unwrap();
                (host(&p), host(&st), host(&ds))
            };
            let (a, b) = (run(true), run(false));
            let differ =
                |x: &[bf16], y: &[bf16]| x.iter().zip(y).filter(|(u, v)| u.to_bits() != v.to_bits()).count();
            let d = (differ(&a.0, &b.0), differ(&a.1, &b.1), differ(&a.2, &b.2));
            eprintln!(
                "SUMMARY softmax warp8 vs warp t={t}: P {} stats {} dS {} elements differ",
                d.0, d.1, d.2
            );
            assert_eq!(d, (0, 0, 0), "t={t}");
        }
    }
}

//! Criterion benchmark of the fused AdamW step and the gradient sum of squares on 64M parameters,
//! and of the host update pass with each precision of the moments (`--optim-states`: group
//! `adamw_states_64M`, exact mode's update with a bf16 gradient and bf16 upload copy, and lean
//! mode's land + update from an f32 gradient; all on the same rayon pool, one after another).
//!
//! Throughput is `Elements(n)` with one element per parameter, so criterion's "Gelem/s" is Gparam/s
//! (the unit of the torch and DeepSpeed CPU AdamW figures in docs/peers.md; torch's fused
//! CPU AdamW writes no upload copy, so compare it with `f32_grad+no_upload`). A rayon-parallel f32
//! copy of the same size is timed beside them as a bandwidth yardstick for the machine at hand,
//! and beside each precision's update its traffic twin (`traffic`): a pass that reads and writes
//! exactly the bytes the update does, the upload copy with the same streaming stores, with no
//! arithmetic to speak of: the update's memory-bandwidth bound on this machine.
//!
//! The coded updates run on the widest vector instruction set the CPU has; set
//! `MEGATRAIN_HOST_SIMD=avx2` (or `scalar`) to time a narrower one.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput};
use half::bf16;
use mt_core::StateDtype;
use mt_optim::{
    cast_into, cast_sum_squares, land_and_step, step_fused, sum_squares, AdamW, Grad, Moments, StepArgs,
    Upload, CHUNK,
};
use rayon::prelude::*;

const N: usize = 64 << 20;

/// Deterministic, normal-range values (no denormals to slow anything down).
fn pattern(n: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..n).map(|i| ((i % 1021) as f32 / 1021.0 - 0.5) * scale + offset).collect()
}

fn bench(c: &mut Criterion) {
    let grad = pattern(N, 2e-2, 0.0);
    let grad_bf16: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut master = pattern(N, 2.0, 0.0);
    let mut m = pattern(N, 2e-3, 0.0);
    let mut v = pattern(N, 1e-6, 1e-6);
    let mut upload = vec![bf16::ZERO; N];
    let h = AdamW::default();
    let a = StepArgs { step: 100, lr: 1e-4, grad_scale: 0.5 };

    let mut g = c.benchmark_group("adamw_64M");
    g.sample_size(10).sampling_mode(SamplingMode::Flat).warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(N as u64));
    g.bench_function(BenchmarkId::new("step_fused", "f32_grad+bf16_upload"), |b| {
        b.iter(|| {
            step_fused(
                &h,
                &a,
                Grad::F32(&grad),
                &mut master,
                Moments::f32(&mut m, &mut v),
                Upload::Bf16(&mut upload),
            )
            .unwrap()
        })
    });
    g.bench_function(BenchmarkId::new("step_fused", "f32_grad+no_upload"), |b| {
        b.iter(|| {
            step_fused(&h, &a, Grad::F32(&grad), &mut master, Moments::f32(&mut m, &mut v), Upload::None)
                .unwrap()
        })
    });
    g.bench_function(BenchmarkId::new("step_fused", "bf16_grad+bf16_upload"), |b| {
        b.iter(|| {
            step_fused(
                &h,
                &a,
                Grad::Bf16(&grad_bf16),
                &mut master,
                Moments::f32(&mut m, &mut v),
                Upload::Bf16(&mut upload),
            )
            .unwrap()
        })
    });
    g.bench_function(BenchmarkId::new("cast_into", "bf16"), |b| {
        b.iter(|| cast_into(&master, Upload::Bf16(&mut upload)).unwrap())
    });
    // The engine's land: the downloaded f32 gradient stored as bf16, with its sum of squares.
    let mut grad_store = vec![bf16::ZERO; N];
    g.bench_function(BenchmarkId::new("cast_sum_squares", "f32_to_bf16"), |b| {
        b.iter(|| cast_sum_squares(&grad, Upload::Bf16(&mut grad_store)).unwrap())
    });
    g.bench_function(BenchmarkId::new("sum_squares", "f32"), |b| b.iter(|| sum_squares(Grad::F32(&grad))));
    // 8 B of traffic per element (plus 4 B if the stores allocate the line first).
    g.bench_function(BenchmarkId::new("yardstick", "par_copy_f32"), |b| {
        b.iter(|| m.par_chunks_mut(CHUNK).zip(grad.par_chunks(CHUNK)).for_each(|(d, s)| d.copy_from_slice(s)))
    });
    g.finish();
}

/// The host update pass with fp32, bf16 and 8-bit moments: exact mode's `step_fused` (bf16
/// store gradient, bf16 upload copy: the `Stage` of a streamed layer) and lean mode's
/// `land_and_step` (f32 landed gradient, nothing stored). Each precision's state is warmed by
/// criterion's warm-up iterations (the moments start at zero).
///
/// Master, `m` and `v` are separate allocations, as the first group's are. In one buffer
/// `[master | m | v]` of 64Mi parameters the three streams sit exactly 2^28 bytes apart, and on
/// the 2-core development machine every precision's pass ran 3-5x slower than with the regions
/// 4 KiB or more off that stride (an address-aliasing effect of power-of-two strides, not of the
/// pass; a real model's records are not such strides).
fn bench_states(c: &mut Criterion) {
    eprintln!("coded updates' vector kernels: {}", mt_optim::simd_name());
    let grad = pattern(N, 2e-2, 0.0);
    let grad_bf16: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut upload = vec![bf16::ZERO; N];
    let h = AdamW::default();
    let a = StepArgs { step: 100, lr: 1e-4, grad_scale: 0.5 };
    let mut g = c.benchmark_group("adamw_states_64M");
    g.sample_size(10).sampling_mode(SamplingMode::Flat).warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(N as u64));
    for states in StateDtype::ALL {
        let mut master = pattern(N, 2.0, 0.0);
        let words = states.moment_bytes(N) / 4;
        let (mut m, mut v) = (vec![0u32; words], vec![0u32; words]);
        g.bench_function(BenchmarkId::new("traffic_bf16_grad+bf16_upload", states.name()), |b| {
            b.iter(|| traffic(&grad_bf16, &mut master, &mut m, &mut v, &mut upload))
        });
        g.bench_function(BenchmarkId::new("update_bf16_grad+bf16_upload", states.name()), |b| {
            b.iter(|| {
                let mom = Moments::from_bytes(
                    states,
                    N,
                    bytemuck::cast_slice_mut(&mut m),
                    bytemuck::cast_slice_mut(&mut v),
                    1,
                )
                .unwrap();
                step_fused(&h, &a, Grad::Bf16(&grad_bf16), &mut master, mom, Upload::Bf16(&mut upload))
                    .unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("land_and_step_f32_grad", states.name()), |b| {
            b.iter(|| {
                let mom = Moments::from_bytes(
                    states,
                    N,
                    bytemuck::cast_slice_mut(&mut m),
                    bytemuck::cast_slice_mut(&mut v),
                    1,
                )
                .unwrap();
                land_and_step(&h, &a, &grad, Upload::None, &mut master, mom).unwrap()
            })
        });
    }
    g.finish();
}

/// The traffic of exact mode's update (`update_bf16_grad+bf16_upload`) with no arithmetic to
/// speak of: `grad` (bf16), `master` and the moments' words (`m`, `v`: fp32, bf16 or 8-bit
/// codes and steps, as 4-byte words) read and written once, in the same chunks on the same rayon
/// pool, and `master` cast into `upload` with the update's streaming stores (`cast_into`), in the
/// same task while the chunk is in cache.
fn traffic(grad: &[bf16], master: &mut [f32], m: &mut [u32], v: &mut [u32], upload: &mut [bf16]) {
    // Each moment's words per CHUNK of parameters (the last chunk takes what is left).
    let per = m.len().div_ceil(N / CHUNK);
    (master.par_chunks_mut(CHUNK), grad.par_chunks(CHUNK), upload.par_chunks_mut(CHUNK))
        .into_par_iter()
        .zip(m.par_chunks_mut(per).zip(v.par_chunks_mut(per)))
        .for_each(|((p, g, u), (m, v))| {
            for (p, g) in p.iter_mut().zip(g) {
                *p += f32::from_bits(u32::from(g.to_bits()) << 16);
            }
            for (m, v) in m.iter_mut().zip(v.iter_mut()) {
                (*m, *v) = (*m ^ 1, *v ^ 1);
            }
            cast_into(p, Upload::Bf16(u)).unwrap();
        });
}

criterion_group!(benches, bench, bench_states);
criterion_main!(benches);

//! The fused cross-entropy kernels against an f64 evaluation, on a CUDA device (run on the GPU
//! machine: `cargo test -p mt-kernels --features cuda --lib`; not part of the CPU
//! suite).

use candle_core::{DType, Device, Tensor};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::{ce_grad, ce_loss};

/// Both kernel pairs (16-byte loads when V % 8 == 0, one element a thread otherwise), a small and
/// the Llama-3 vocabulary: the loss per row within f32 rounding of `logsumexp(l) - l[target]`,
/// the gradient within one bf16 ulp of `w softmax(l) - w [j == target]` plus f32 rounding.
#[test]
fn cross_entropy_kernels_match_an_f64_reference() {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
    let mut rng = StdRng::seed_from_u64(5);
    for v in [1000usize, 1001, 128256] {
        let rows = 48;
        let logits: Vec<bf16> =
            (0..rows * v).map(|_| bf16::from_f32((rng.random::<f32>() * 2.0 - 1.0) * 8.0)).collect();
        let targets: Vec<u32> = (0..rows).map(|_| rng.random_range(0..v as u32)).collect();
        let weights: Vec<f32> = (0..rows).map(|_| rng.random::<f32>() + 0.1).collect();
        let l = Tensor::from_vec(logits.clone(), (rows, v), &dev).unwrap();
        let t = Tensor::from_vec(targets.clone(), rows, &dev).unwrap();
        let w = Tensor::from_vec(weights.clone(), rows, &dev).unwrap();
        let ce = ce_loss(&l, &t).unwrap().to_device(&Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        let dl = ce_grad(&l, &t, &w)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let (mut worst_ce, mut worst_dl) = (0f64, 0f64);
        for r in 0..rows {
            let x: Vec<f64> = logits[r * v..(r + 1) * v].iter().map(|b| f64::from(b.to_f32())).collect();
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|a| (a - m).exp()).sum();
            let tg = targets[r] as usize;
            let ce_ref = m + z.ln() - x[tg];
            worst_ce = worst_ce
                .max((f64::from(ce[r]) - ce_ref).abs() / (1e-5 * (m.abs() + z.ln() + x[tg].abs()) + 1e-6));
            let wr = f64::from(weights[r]);
            for j in 0..v {
                let p = (x[j] - m).exp() / z;
                let reference = wr * p - if j == tg { wr } else { 0.0 };
                let err = (f64::from(dl[r * v + j]) - reference).abs();
                worst_dl =
                    worst_dl.max(err / (reference.abs() * 2f64.powi(-7) + wr * (1e-5 * p + 1e-6) + 1e-30));
            }
        }
        eprintln!("SUMMARY cross-entropy kernels V={v}: worst loss error {worst_ce:.3} and gradient error {worst_dl:.3} of their bounds");
        assert!(
            worst_ce <= 1.0 && worst_dl <= 1.0,
            "V={v}: loss {worst_ce:.3}, gradient {worst_dl:.3} of the bound"
        );
    }
}

//! GPU vs CPU (engine-brief "Oracles" 3), compiled only with the `cuda` feature and run on the
//! GPU machine: the same step program on candle's CUDA device must reproduce the CPU engine's
//! loss, every gradient, and 3 steps of training — fp32 within 1e-4, bf16 within 2e-2 per tensor.
//! Every figure is printed (SUMMARY lines) before the bounds are asserted.
#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use mt_sched::{CpuBackend, CpuOptions, Engine, EngineOptions};
use mt_store::GradDtype;
use mt_testkit::golden::{self, GOLDEN_NAMES};
use mt_testkit::tol::compare_maps;
use mt_testkit::Tolerance;

use common::*;

struct Run {
    losses: Vec<f64>,
    grads: BTreeMap<String, Tensor>,
    params: BTreeMap<String, Tensor>,
}

fn run(name: &str, device: Device, dtype: DType) -> Run {
    let g = golden::load(name).unwrap();
    let store = store_with(&g.cfg, &g.params, GradDtype::F32);
    let opts = EngineOptions { weight_dtype: dtype, n_chunks: 2, ..golden_opts() };
    let mut e =
        Engine::new(&g.cfg, store.clone(), CpuBackend::on_device(device, CpuOptions::default()), opts)
            .unwrap();
    let batch = golden_batch(&g);
    let mut losses = vec![e.step(&batch, 1e-3).unwrap().loss];
    let grads = grads_of(&store);
    for _ in 0..2 {
        losses.push(e.step(&batch, 1e-3).unwrap().loss);
    }
    e.flush_pending().unwrap();
    Run { losses, grads, params: params_of(&store) }
}

#[test]
fn cuda_engine_matches_cpu_engine() {
    // True fp32 GEMMs (no TF32) for the fp32 comparison.
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut failures = Vec::new();
    for name in GOLDEN_NAMES {
        let cpu = run(name, Device::Cpu, DType::F32);
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2)] {
            let r = run(name, gpu.clone(), dtype);
            let loss_rel: Vec<f64> =
                r.losses.iter().zip(&cpu.losses).map(|(a, b)| (a - b).abs() / b).collect();
            let grads = compare_maps(&r.grads, &cpu.grads, Tolerance { rel: tol });
            let params = compare_maps(&r.params, &cpu.params, Tolerance { rel: tol });
            let (wg, wp) = (grads.worst().unwrap(), params.worst().unwrap());
            eprintln!(
                "SUMMARY gpu {name} {dtype:?}: losses rel {loss_rel:.2e?}; worst grad {:.2e} ({}); worst param after 3 steps {:.2e} ({})",
                wg.rel_err(), wg.name, wp.rel_err(), wp.name
            );
            if !grads.is_ok() || !params.is_ok() || loss_rel.iter().any(|x| *x > tol) {
                failures.push(format!("{name} {dtype:?}\n{grads}\n{params}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

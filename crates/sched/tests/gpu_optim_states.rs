//! GPU tests of the optimizer-state precisions (`--optim-states`), compiled only with the `cuda`
//! feature and run on the GPU machine: the device AdamW over bf16 and 8-bit moments is bitwise
//! mt-optim's CPU update, and the GPU engine's device updates (resident, GPU-updated) train
//! bitwise as its host updates. Every figure is printed (SUMMARY lines) before it is asserted.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use mt_sched::Placement;
use mt_sched::{CpuOptions, CudaBackend, Engine, EngineOptions};
use mt_store::GradDtype;
use mt_testkit::golden;
use mt_testkit::init::randn;

use common::*;

/// The device AdamW over bf16 and 8-bit moments (`mt_adamw_bf16`, `mt_adamw_q8`) is bitwise
/// mt-optim's CPU update — the master, the encoded moments (stochastic rounding's draws
/// included) and the bf16 slot — over three steps, for sizes with a partial 8-bit block and views
/// at an offset (the same ops in the same order: `kernels/emu/run_adamw.sh` shows it on the CPU
/// emulator too).
#[test]
fn cuda_adamw_over_bf16_and_int8_moments_is_bitwise_the_cpus() {
    use mt_core::StateDtype;
    use mt_kernels::device_optim::{adamw_step_into, StateKind};
    use mt_optim::{AdamW, StepArgs};
    let gpu = Device::new_cuda(0).unwrap();
    let h = AdamW { weight_decay: 0.1, ..AdamW::default() };
    for dtype in [StateDtype::Bf16, StateDtype::Int8] {
        for n in [4096usize, 4097, 300] {
            for off in [0usize, 1] {
                let seed = 8 * n as u64 + 4 * off as u64;
                let words = dtype.state_words(n);
                let mut init = vec![0f32; off + words];
                init[off..off + n].copy_from_slice(&randn(n, seed).to_vec1::<f32>().unwrap());
                let grads: Vec<Tensor> = (0..3).map(|k| (randn(n, seed + 1 + k) * 1e-2).unwrap()).collect();
                let kind = StateKind { dtype, stream: 7 };
                let run = |d: &Device| -> (Vec<f32>, Vec<half::bf16>) {
                    let st = Tensor::from_slice(&init, off + words, d).unwrap();
                    let w = Tensor::zeros(n + off, DType::BF16, d).unwrap();
                    let (st_view, w_view) = (st.narrow(0, off, words).unwrap(), w.narrow(0, off, n).unwrap());
                    for (k, g) in grads.iter().enumerate() {
                        let a = StepArgs { step: k as u64 + 1, lr: 1e-3, grad_scale: 0.5 };
                        adamw_step_into(&st_view, &g.to_device(d).unwrap(), &h, &a, kind, &w_view).unwrap();
                    }
                    let st = st_view.to_device(&Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
                    (st, w_view.to_device(&Device::Cpu).unwrap().to_vec1::<half::bf16>().unwrap())
                };
                let ((st_c, w_c), (st_g, w_g)) = (run(&Device::Cpu), run(&gpu));
                let state_diff = st_c.iter().zip(&st_g).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                let slot_diff = w_c.iter().zip(&w_g).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                eprintln!(
                    "SUMMARY gpu adamw {dtype} moments n={n} offset={off}: {state_diff} of {words} state words and {slot_diff} of {n} slot weights differ from the CPU's"
                );
                assert_eq!(
                    (state_diff, slot_diff),
                    (0, 0),
                    "{dtype} n={n} offset={off}: not bitwise the CPU's"
                );
            }
        }
    }
}

/// The GPU engine with bf16 and 8-bit moments: resident and GPU-updated placements (their
/// updates on the device) train bitwise as the same GPU engine with every update on the host,
/// as on the CPU backend (`tests/optim_states.rs`). f32 store gradients (a resident unit updates
/// from its f32 device gradient) and no clipping (a resident unit's Σg² is summed on the device,
/// in another order than the host's).
#[test]
fn cuda_engine_device_updates_are_the_hosts_with_bf16_and_int8_moments() {
    use mt_core::{ModelLayout, StateDtype};
    use mt_store::HostStore;
    let g = golden::load("llama_gqa").unwrap();
    let batch = golden_batch(&g);
    for states in [StateDtype::Bf16, StateDtype::Int8] {
        let run = |opts: EngineOptions| {
            let store = HostStore::anonymous_with(&ModelLayout::new(&g.cfg), GradDtype::F32, states).unwrap();
            fill_store(&store, &g.params);
            let store = std::sync::Arc::new(store);
            let backend = CudaBackend::new(0, CpuOptions::default()).unwrap();
            let opts = EngineOptions { weight_dtype: DType::BF16, clip: None, ..opts };
            let mut e = Engine::new(&g.cfg, store.clone(), backend, opts).unwrap();
            let losses: Vec<u64> = (0..3).map(|_| e.step(&batch, 1e-3).unwrap().loss.to_bits()).collect();
            e.flush_pending().unwrap();
            drop(e);
            (losses, params_of(&store))
        };
        let host = run(golden_opts());
        for (what, opts) in [
            (
                "resident",
                EngineOptions {
                    placement: Placement { resident_outer: true, resident_layers: 1, ..Placement::default() },
                    ..golden_opts()
                },
            ),
            (
                "GPU-updated",
                EngineOptions {
                    placement: Placement { gpu_updated_layers: 2, ..Placement::default() },
                    ..golden_opts()
                },
            ),
        ] {
            let (losses, params) = run(opts);
            let same = losses == host.0;
            eprintln!(
                "SUMMARY gpu engine {states} moments, {what}: losses bitwise the host-updated run's: {same}"
            );
            assert!(same, "{states} {what}: losses {losses:?} vs {:?}", host.0);
            mt_testkit::tol::assert_bitwise_eq(&params, &host.1, &format!("{states} {what}: params"));
        }
    }
}

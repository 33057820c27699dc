//! Non-finite steps on the GPU (compiled only with the `cuda` feature, run on the GPU machine):
//! `tests/faults.rs` on the overlapped CUDA backend. A NaN or infinity injected into a device
//! gradient (before its bf16 narrowing, download and land, or into a resident unit's, which never
//! leaves the device) or into the loss skips the exact-mode step: the store then equals, bitwise,
//! the same device's run without the bad step (flushed), holds no non-finite value, and the next
//! steps match that run's. Lean mode leaves the units with a non-finite gradient un-updated.
#![cfg(feature = "cuda")]

mod common;

use mt_sched::Placement;
use std::sync::Arc;

use candle_core::DType;
use mt_core::{ModelConfig, Unit};
use mt_sched::{Batch, CpuOptions, CudaBackend, Engine, EngineOptions, Fault, OptimMode};
use mt_store::{GradDtype, GradRef, HostStore};
use mt_testkit::golden;
use mt_testkit::init::random_params;

use common::*;

fn cfg5() -> ModelConfig {
    ModelConfig { num_hidden_layers: 5, ..golden::load("llama_gqa").unwrap().cfg }
}

fn engine(cfg: &ModelConfig, store: Arc<HostStore>, opts: EngineOptions) -> Engine<CudaBackend> {
    let backend = CudaBackend::new(0, CpuOptions::uniform(100, 3)).unwrap();
    Engine::new(cfg, store, backend, opts).unwrap()
}

/// Per unit the bytes of master, m and v (the moments' in their encoding) and its update mark;
/// the header's step.
type State = (Vec<(Vec<u8>, u64)>, u64);

/// What [`run`] saw: the state after the bad step (flushed), after the later steps, the bad
/// step's skip, and whether the store was all finite after it.
type Seen = (State, State, Option<mt_sched::Skipped>, bool);

fn state_of(store: &HostStore) -> State {
    let records = store
        .layout()
        .units()
        .map(|u| {
            let r = store.record(u);
            let master = bytemuck::cast_slice::<f32, u8>(r.master());
            (master.iter().chain(r.m()).chain(r.v()).copied().collect(), r.applied_step())
        })
        .collect();
    (records, store.state().step)
}

fn all_finite(store: &HostStore) -> bool {
    store.layout().units().all(|u| {
        let r = store.record(u);
        let grad = match r.grad() {
            Some(GradRef::F32(g)) => g.iter().all(|x| x.is_finite()),
            Some(GradRef::Bf16(g)) => g.iter().all(|x| x.is_finite()),
            None => true,
        };
        let (n, states) = (r.master().len(), r.states());
        grad && r.master().iter().all(|x| x.is_finite())
            && states.first_non_finite(n, r.m()).is_none()
            && states.first_non_finite(n, r.v()).is_none()
    })
}

/// `data[..2]`, then `data[2]` with `fault` (or skipped over when `None`: the run without the bad
/// step), flushed; then `data[3..]`, flushed. Returns the states after each part and the report
/// of the faulted step.
fn run(
    cfg: &ModelConfig,
    grad: GradDtype,
    opts: &EngineOptions,
    data: &[Batch],
    fault: Option<Fault>,
) -> Seen {
    let store = store_with(cfg, &random_params(cfg, 8), grad);
    let mut e = engine(cfg, store.clone(), opts.clone());
    for b in &data[..2] {
        e.step(b, 1e-3).unwrap();
    }
    let skipped = match fault {
        Some(f) => {
            e.inject(f);
            e.step(&data[2], 1e-3).unwrap().skipped
        }
        None => None,
    };
    e.flush_pending().unwrap();
    let mid = state_of(&store);
    let finite = all_finite(&store);
    for b in &data[3..] {
        e.step(b, 1e-3).unwrap();
    }
    e.flush_pending().unwrap();
    drop(e);
    (mid, state_of(&store), skipped, finite)
}

#[test]
fn cuda_a_non_finite_step_is_skipped_bitwise() {
    let cfg = cfg5();
    let n = cfg.num_hidden_layers;
    let data = small_batches(&cfg, 5, 80);
    let base = EngineOptions { weight_dtype: DType::BF16, n_chunks: 2, ..golden_opts() };
    let cases = [
        ("streamed, bf16 gradients narrowed on the device", GradDtype::Bf16, base.clone()),
        (
            "resident outer and layer 0, held and kept layers",
            GradDtype::Bf16,
            EngineOptions {
                placement: Placement {
                    resident_outer: true,
                    resident_layers: 1,
                    held_layers: 1,
                    kept_layers: 2,
                    ..base.placement
                },
                ..base.clone()
            },
        ),
        (
            "GPU-updated with late downloads and an early upload",
            GradDtype::Bf16,
            EngineOptions {
                placement: Placement {
                    gpu_updated_layers: n,
                    held_layers: n,
                    late_state_downloads: 2,
                    early_state_uploads: 1,
                    ..base.placement
                },
                ..base.clone()
            },
        ),
    ];
    let faults = [
        Fault::Gradient { unit: Unit::Layer(2), value: f32::NAN },
        Fault::Gradient { unit: Unit::Layer(0), value: f32::INFINITY },
        Fault::Gradient { unit: Unit::Outer, value: f32::NAN },
        Fault::Loss(f64::NAN),
    ];
    for (name, grad, opts) in &cases {
        let (want_mid, want_end, _, _) = run(&cfg, *grad, opts, &data, None);
        for f in faults {
            let (mid, end, skipped, finite) = run(&cfg, *grad, opts, &data, Some(f));
            let skipped = skipped.unwrap_or_else(|| panic!("{name}, {f:?}: not skipped"));
            eprintln!("SUMMARY gpu_faults {name}, {f:?}: {skipped:?}");
            assert!(finite, "{name}, {f:?}: a non-finite value in the store");
            assert!(mid == want_mid, "{name}, {f:?}: the store differs from the run without the bad step");
            assert!(end == want_end, "{name}, {f:?}: the steps after the skip differ");
        }
    }
}

#[test]
fn cuda_a_lean_step_updates_only_units_with_a_finite_gradient() {
    let cfg = cfg5();
    let data = small_batches(&cfg, 3, 100);
    let opts = EngineOptions {
        weight_dtype: DType::BF16,
        mode: OptimMode::Lean,
        placement: Placement { resident_outer: true, resident_layers: 2, ..Placement::default() },
        ..golden_opts()
    };
    let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::None);
    let mut e = engine(&cfg, store.clone(), opts);
    e.step(&data[0], 1e-3).unwrap();
    e.flush_pending().unwrap();
    let before = state_of(&store);
    // A resident and a streamed layer.
    for unit in [Unit::Layer(1), Unit::Layer(3)] {
        e.inject(Fault::Gradient { unit, value: f32::NAN });
    }
    let s = e.step(&data[1], 1e-3).unwrap().skipped.expect("reported skipped");
    e.flush_pending().unwrap();
    let after = state_of(&store);
    assert_eq!(s.not_finite, vec![Unit::Layer(1), Unit::Layer(3)]);
    for (i, u) in store.layout().units().enumerate() {
        let sat_out = matches!(u, Unit::Layer(1) | Unit::Layer(3));
        assert_eq!(after.0[i].0 == before.0[i].0, sat_out, "{u:?}: updated iff its gradient was finite");
    }
    assert!(all_finite(&store));
    assert!(e.step(&data[2], 1e-3).unwrap().skipped.is_none());
}

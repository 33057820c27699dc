//! Resident units (the outer unit and leading decoder layers with their fp32 master weights and
//! AdamW moments on the compute device, updated there) train exactly as streamed ones: on the
//! CPU backend both run mt-optim's update on the same f32 gradient and take the global norm's
//! shares in the same order, so losses, weights and moments agree bitwise — with clipping, in
//! exact and lean mode, at every ring depth, for any number of resident layers; a dropped
//! engine leaves a store that a new engine (resident or not) continues bitwise; resident units'
//! bytes never cross the (simulated) bus.

mod common;

use mt_sched::Placement;
use std::sync::Arc;

use mt_core::{ModelConfig, ModelLayout, Unit};
use mt_sched::{Batch, EngineOptions, OptimMode};
use mt_store::{GradDtype, HostStore};
use mt_testkit::golden;
use mt_testkit::init::random_params;
use mt_testkit::tol::assert_bitwise_eq;

use common::*;

fn cfg() -> ModelConfig {
    golden::load("llama_gqa").unwrap().cfg
}

/// Losses of `data`'s steps, run in two sessions split after `split` steps (each session a new
/// engine over the same store), and the store after a final flush.
fn train(
    opts: &EngineOptions,
    resident: [bool; 2],
    data: &[Batch],
    split: usize,
) -> (Vec<f64>, Arc<HostStore>) {
    let placed = |r: bool| EngineOptions {
        placement: Placement { resident_outer: r, ..opts.placement },
        ..opts.clone()
    };
    train_sessions([placed(resident[0]), placed(resident[1])], data, split)
}

/// As [`train`], each session with its own options.
fn train_sessions(sessions: [EngineOptions; 2], data: &[Batch], split: usize) -> (Vec<f64>, Arc<HostStore>) {
    let cfg = cfg();
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let mut losses = Vec::new();
    for (session, part) in [&data[..split], &data[split..]].into_iter().enumerate() {
        let o = sessions[session].clone();
        let mut e = engine(&cfg, store.clone(), o, 200);
        for b in part {
            losses.push(e.step(b, 1e-3).unwrap().loss);
        }
        if session == 1 {
            e.flush_pending().unwrap();
        }
    }
    (losses, store)
}

/// The outer unit's moments (the bytes of their encoding).
fn moments(store: &HostStore) -> Vec<u8> {
    let mut r = store.record(Unit::Outer);
    let p = r.parts();
    p.m.iter().chain(p.v.iter()).copied().collect()
}

/// Every unit's moments and applied-step counter.
fn all_moments(store: &HostStore) -> Vec<(Vec<u8>, u64)> {
    store
        .layout()
        .units()
        .map(|u| {
            let mut r = store.record(u);
            let applied = r.applied_step();
            let p = r.parts();
            (p.m.iter().chain(p.v.iter()).copied().collect(), applied)
        })
        .collect()
}

#[test]
fn a_resident_outer_unit_trains_bitwise_as_the_streamed_one() {
    let data = small_batches(&cfg(), 4, 70);
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        for ring_depth in [1, 3] {
            let opts = EngineOptions { mode, ring_depth, ..golden_opts() };
            let (l0, s0) = train(&opts, [false, false], &data, 4);
            let (l1, s1) = train(&opts, [true, true], &data, 4);
            assert_eq!(l0, l1, "{mode:?} ring {ring_depth}: losses");
            assert_bitwise_eq(&params_of(&s1), &params_of(&s0), "resident vs streamed params");
            assert_eq!(moments(&s1), moments(&s0), "{mode:?} ring {ring_depth}: outer moments");
            assert_eq!(s1.state(), s0.state());
        }
    }
}

#[test]
fn a_dropped_resident_engine_leaves_a_store_the_next_engine_continues_bitwise() {
    let data = small_batches(&cfg(), 4, 70);
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        let opts = EngineOptions { mode, ..golden_opts() };
        let (l0, s0) = train(&opts, [true, true], &data, 4);
        // Dropped after step 2 (exact mode: with its update pending on the device), then
        // continued by a resident and by a streamed engine.
        for next in [true, false] {
            let (l1, s1) = train(&opts, [true, next], &data, 2);
            assert_eq!(l0, l1, "{mode:?} then resident={next}: losses");
            assert_bitwise_eq(&params_of(&s1), &params_of(&s0), "split vs uninterrupted params");
            assert_eq!(moments(&s1), moments(&s0), "{mode:?} then resident={next}: outer moments");
        }
    }
}

#[test]
fn a_resident_outer_unit_never_crosses_the_bus() {
    let cfg = cfg();
    let layout = ModelLayout::new(&cfg);
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let opts = EngineOptions {
        placement: Placement { resident_outer: true, ..Placement::default() },
        ..golden_opts()
    };
    let mut e = engine(&cfg, store, opts, 0);
    for b in small_batches(&cfg, 2, 70) {
        let r = e.step(&b, 1e-3).unwrap();
        let (n, l) = (layout.n_layers as u64, layout.layer.len as u64);
        assert_eq!(r.h2d_bytes, 2 * n * l * 4);
        assert_eq!(r.d2h_bytes, n * l * 4);
    }
}

/// An engine that stops without writing its resident outer unit back (a crash: no drop) leaves
/// the store's outer record behind its step; the next engine refuses it, naming the way out,
/// instead of silently training on stale embeddings.
#[test]
fn a_store_left_by_a_crashed_resident_engine_is_refused() {
    let cfg = cfg();
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let opts = EngineOptions {
        placement: Placement { resident_outer: true, ..Placement::default() },
        ..golden_opts()
    };
    let mut e = engine(&cfg, store.clone(), opts.clone(), 0);
    for b in small_batches(&cfg, 3, 70) {
        e.step(&b, 1e-3).unwrap();
    }
    std::mem::forget(e);
    for resident in [true, false] {
        let o = EngineOptions {
            placement: Placement { resident_outer: resident, ..opts.placement },
            ..opts.clone()
        };
        let r = mt_sched::Engine::new(&cfg, store.clone(), mt_sched::CpuBackend::new(Default::default()), o);
        let err = r.map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("resume from a checkpoint"), "resident={resident}: {err}");
    }
}

#[test]
fn resident_layers_train_bitwise_as_streamed_ones() {
    let cfg = cfg();
    let n = cfg.num_hidden_layers;
    assert!(n >= 2, "the test needs a model with a streamed and a resident layer");
    let data = small_batches(&cfg, 4, 70);
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        for ring_depth in [1, 3] {
            let opts = EngineOptions { mode, ring_depth, ..golden_opts() };
            let (l0, s0) = train(&opts, [false, false], &data, 4);
            for (k, outer) in [(1, false), (n, true), (n - 1, true)] {
                let o = EngineOptions {
                    placement: Placement { resident_layers: k, resident_outer: outer, ..opts.placement },
                    ..opts.clone()
                };
                let (l1, s1) = train_sessions([o.clone(), o], &data, 4);
                let what = format!("{mode:?} ring {ring_depth}, {k} resident layers, outer {outer}");
                assert_eq!(l0, l1, "{what}: losses");
                assert_bitwise_eq(&params_of(&s1), &params_of(&s0), &what);
                assert!(all_moments(&s1) == all_moments(&s0), "{what}: moments");
                assert_eq!(s1.state(), s0.state(), "{what}");
            }
        }
    }
}

#[test]
fn a_store_moves_between_resident_and_streamed_layers_bitwise() {
    let cfg = cfg();
    let n = cfg.num_hidden_layers;
    let data = small_batches(&cfg, 4, 70);
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        let opts = EngineOptions { mode, ..golden_opts() };
        let (l0, s0) = train(&opts, [false, false], &data, 4);
        let with = |k: usize| EngineOptions {
            placement: Placement { resident_layers: k, ..opts.placement },
            ..opts.clone()
        };
        // Dropped after step 2 (exact mode: with the update pending on the device), continued
        // with more, fewer or no resident layers.
        for (a, b) in [(n, 0), (1, n), (0, 1)] {
            let (l1, s1) = train_sessions([with(a), with(b)], &data, 2);
            let what = format!("{mode:?}: {a} then {b} resident layers");
            assert_eq!(l0, l1, "{what}: losses");
            assert_bitwise_eq(&params_of(&s1), &params_of(&s0), &what);
            assert!(all_moments(&s1) == all_moments(&s0), "{what}: moments");
        }
    }
}

#[test]
fn resident_layers_never_cross_the_bus_and_a_crash_leaves_a_refused_store() {
    let cfg = cfg();
    let layout = ModelLayout::new(&cfg);
    let (n, l, o) = (layout.n_layers as u64, layout.layer.len as u64, layout.outer.len as u64);
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let opts = EngineOptions {
        placement: Placement { resident_layers: 1, ..Placement::default() },
        ..golden_opts()
    };
    let mut e = engine(&cfg, store.clone(), opts.clone(), 0);
    for b in small_batches(&cfg, 2, 70) {
        let r = e.step(&b, 1e-3).unwrap();
        assert_eq!(r.h2d_bytes, (2 * (n - 1) * l + o) * 4);
        assert_eq!(r.d2h_bytes, ((n - 1) * l + o) * 4);
    }
    let too_many = EngineOptions {
        placement: Placement { resident_layers: layout.n_layers + 1, ..opts.placement },
        ..opts.clone()
    };
    let r =
        mt_sched::Engine::new(&cfg, store.clone(), mt_sched::CpuBackend::new(Default::default()), too_many);
    let err = r.map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("resident layers asked of a"), "{err}");
    // A crash (no drop, no write-back) leaves the store marked, and layer 0's record behind.
    std::mem::forget(e);
    assert!(store.device_owned());
    let r = mt_sched::Engine::new(&cfg, store, mt_sched::CpuBackend::new(Default::default()), opts);
    let err = r.map(|_| ()).unwrap_err().to_string();
    assert!(
        err.contains("stopped without writing them back") && err.contains("resume from a checkpoint"),
        "{err}"
    );
}

/// A crash right after a flush and one more step leaves every record at the store's step, but
/// the pending update's gradient of the resident layers only on the (lost) device: the mark
/// refuses the store; a normal drop clears it and the next engine continues.
#[test]
fn a_crash_after_a_flush_and_a_step_is_refused_and_a_drop_is_not() {
    let cfg = cfg();
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let opts = EngineOptions {
        placement: Placement { resident_layers: 1, ..Placement::default() },
        ..golden_opts()
    };
    let data = small_batches(&cfg, 2, 70);
    let mut e = engine(&cfg, store.clone(), opts.clone(), 0);
    e.step(&data[0], 1e-3).unwrap();
    e.flush_pending().unwrap();
    assert!(!store.device_owned());
    e.step(&data[1], 1e-3).unwrap();
    std::mem::forget(e);
    for resident in [1, 0] {
        let o = EngineOptions {
            placement: Placement { resident_layers: resident, ..opts.placement },
            ..opts.clone()
        };
        let r = mt_sched::Engine::new(&cfg, store.clone(), mt_sched::CpuBackend::new(Default::default()), o);
        let err = r.map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("stopped without writing them back"), "{resident} resident: {err}");
    }
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let mut e = engine(&cfg, store.clone(), opts.clone(), 0);
    e.step(&data[0], 1e-3).unwrap();
    assert!(store.device_owned());
    drop(e);
    assert!(!store.device_owned());
    engine(&cfg, store, opts, 0).step(&data[1], 1e-3).unwrap();
}

/// The write-back (`sync_store`) moves a resident unit through the landing buffer a layer's
/// length at a time: here the outer unit (a 1024-token vocabulary) is 4.3 layers long, so it
/// crosses in five pieces, the last one partial. A resident run dropped half-way and continued
/// by a streamed engine trains bitwise as a streamed run throughout. With bf16 store gradients
/// the landing ring holds bf16 (half the bytes: nine pieces of f32, as raw bytes), and the same
/// sessions train bitwise as with an f32 landing ring (device narrowing off).
#[test]
fn a_resident_unit_longer_than_the_landing_buffer_is_written_back_whole() {
    let cfg = ModelConfig { vocab_size: 1024, ..cfg() };
    let layout = ModelLayout::new(&cfg);
    assert!(layout.outer.len > 4 * layout.layer.len && !layout.outer.len.is_multiple_of(layout.layer.len));
    let data = small_batches(&cfg, 4, 71);
    let run = |grad: GradDtype, device_narrowing: bool, sessions: [(bool, usize); 2]| {
        let store = store_with(&cfg, &random_params(&cfg, 5), grad);
        let mut losses = Vec::new();
        for ((outer, layers), part) in sessions.into_iter().zip([&data[..2], &data[2..]]) {
            let o = EngineOptions {
                device_narrowing,
                placement: Placement {
                    resident_outer: outer,
                    resident_layers: layers,
                    ..Placement::default()
                },
                ..golden_opts()
            };
            let mut e = engine(&cfg, store.clone(), o, 200);
            for b in part {
                losses.push(e.step(b, 1e-3).unwrap().loss);
            }
            e.flush_pending().unwrap();
        }
        (losses, store)
    };
    let (l0, s0) = run(GradDtype::F32, true, [(false, 0), (false, 0)]);
    let (l1, s1) = run(GradDtype::F32, true, [(true, 1), (false, 0)]);
    assert_eq!(l0, l1, "losses");
    assert_bitwise_eq(&params_of(&s1), &params_of(&s0), "resident-then-streamed vs streamed params");
    assert_eq!(all_moments(&s1), all_moments(&s0), "moments and applied steps");
    let (l2, s2) = run(GradDtype::Bf16, true, [(true, 1), (false, 0)]);
    let (l3, s3) = run(GradDtype::Bf16, false, [(true, 1), (false, 0)]);
    assert_eq!(l2, l3, "bf16 gradients: losses");
    assert_bitwise_eq(&params_of(&s2), &params_of(&s3), "bf16 landing ring vs f32 landing ring params");
    assert_eq!(all_moments(&s2), all_moments(&s3), "bf16 gradients: moments and applied steps");
}

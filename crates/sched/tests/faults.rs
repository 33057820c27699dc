//! Non-finite steps (`engine/commit.rs`): a NaN or infinity injected into a gradient or the loss
//! skips the step. In exact mode the store then equals, bitwise (master weights, moments, update
//! marks, step), that of the run without the bad step, whatever the placement (streamed,
//! resident, held, kept, GPU-updated with late downloads and early uploads; 8-bit moments in one
//! case and for Mixtral), holds no non-finite value, and training goes on as that run does. In lean mode a unit with a
//! non-finite gradient is not updated, the others are; a step where none was is skipped as in
//! exact mode.

mod common;

use mt_core::{ModelConfig, ModelLayout, StateDtype, Unit};
use mt_sched::Placement;
use mt_sched::{Batch, EngineOptions, Fault, OptimMode, SkipCause};
use mt_store::{GradDtype, GradRef, HostStore};
use mt_testkit::golden;
use mt_testkit::init::random_params;

use common::*;

/// The golden model with five layers (room for late downloads and an early upload).
fn cfg5() -> ModelConfig {
    ModelConfig { num_hidden_layers: 5, ..golden::load("llama_gqa").unwrap().cfg }
}

/// Everything of the store a later step reads: per unit the bits of master, m and v and its
/// update mark; the header's step and pending flag.
#[derive(PartialEq)]
struct State {
    records: Vec<(Vec<u8>, u64)>,
    step: u64,
    pending: bool,
}

fn state_of(store: &HostStore) -> State {
    let records = store
        .layout()
        .units()
        .map(|u| {
            let r = store.record(u);
            // The master's bytes, then the moments' (the bytes of their encoding).
            let bytes = bytemuck::cast_slice::<f32, u8>(r.master())
                .iter()
                .chain(r.m())
                .chain(r.v())
                .copied()
                .collect();
            (bytes, r.applied_step())
        })
        .collect();
    let s = store.state();
    State { records, step: s.step, pending: s.pending_update }
}

fn assert_same(a: &State, b: &State, what: &str) {
    assert_eq!((a.step, a.pending), (b.step, b.pending), "{what}: step and pending flag");
    for (u, (x, y)) in a.records.iter().zip(&b.records).enumerate() {
        assert_eq!(x.1, y.1, "{what}: unit {u}'s update mark");
        assert!(x.0 == y.0, "{what}: unit {u}'s master weights or moments differ");
    }
}

/// Every value in the store (master, m, v, stored gradient) is finite.
fn assert_all_finite(store: &HostStore, what: &str) {
    for u in store.layout().units() {
        let r = store.record(u);
        let grad_ok = match r.grad() {
            Some(GradRef::F32(g)) => g.iter().all(|x| x.is_finite()),
            Some(GradRef::Bf16(g)) => g.iter().all(|x| x.is_finite()),
            None => true,
        };
        let n = r.master().len();
        let states = r.states();
        let state_ok = r.master().iter().all(|x| x.is_finite())
            && states.first_non_finite(n, r.m()).is_none()
            && states.first_non_finite(n, r.v()).is_none();
        assert!(grad_ok && state_ok, "{what}: {u:?} holds a non-finite value");
    }
}

struct Case {
    name: &'static str,
    grad: GradDtype,
    states: StateDtype,
    opts: EngineOptions,
}

/// The case's store with the seeded parameters.
fn case_store(cfg: &ModelConfig, c: &Case) -> std::sync::Arc<HostStore> {
    let store = HostStore::anonymous_with(&ModelLayout::new(cfg), c.grad, c.states).unwrap();
    fill_store(&store, &random_params(cfg, 8));
    std::sync::Arc::new(store)
}

fn exact_cases(n: usize) -> Vec<Case> {
    let base = EngineOptions { n_chunks: 2, ..golden_opts() };
    let gpu_updated = EngineOptions {
        placement: Placement {
            gpu_updated_layers: n,
            held_layers: n,
            late_state_downloads: 2,
            early_state_uploads: 1,
            ..base.placement
        },
        ..base.clone()
    };
    vec![
        Case {
            name: "streamed, f32 gradients",
            grad: GradDtype::F32,
            states: StateDtype::F32,
            opts: base.clone(),
        },
        Case {
            name: "streamed, bf16 gradients narrowed on the device",
            grad: GradDtype::Bf16,
            states: StateDtype::F32,
            opts: base.clone(),
        },
        Case {
            name: "resident outer and layer 0, held and kept layers",
            grad: GradDtype::Bf16,
            states: StateDtype::F32,
            opts: EngineOptions {
                placement: Placement {
                    resident_outer: true,
                    resident_layers: 1,
                    held_layers: 1,
                    kept_layers: 2,
                    ..base.placement
                },
                ..base.clone()
            },
        },
        Case {
            name: "GPU-updated with late downloads and an early upload",
            grad: GradDtype::Bf16,
            states: StateDtype::F32,
            opts: gpu_updated.clone(),
        },
        Case {
            name: "GPU-updated with late downloads and an early upload, 8-bit moments",
            grad: GradDtype::Bf16,
            states: StateDtype::Int8,
            opts: gpu_updated,
        },
    ]
}

/// The run without the bad step: `data[..k]` then a flush.
fn reference(cfg: &ModelConfig, c: &Case, data: &[Batch], k: usize) -> (std::sync::Arc<HostStore>, State) {
    let store = case_store(cfg, c);
    let mut e = engine(cfg, store.clone(), c.opts.clone(), 50);
    for b in &data[..k] {
        e.step(b, 1e-3).unwrap();
    }
    e.flush_pending().unwrap();
    let s = state_of(&store);
    drop(e);
    (store, s)
}

#[test]
fn an_exact_step_with_a_non_finite_gradient_or_loss_applies_nothing_and_the_run_goes_on() {
    let cfg = cfg5();
    let n = cfg.num_hidden_layers;
    let data = small_batches(&cfg, 5, 80);
    let faults = [
        (Fault::Gradient { unit: Unit::Layer(2), value: f32::NAN }, "NaN in layer 2's gradient"),
        (Fault::Gradient { unit: Unit::Outer, value: f32::INFINITY }, "inf in the outer unit's gradient"),
        (Fault::Gradient { unit: Unit::Layer(0), value: f32::NEG_INFINITY }, "-inf in layer 0's gradient"),
        (Fault::Loss(f64::NAN), "NaN loss"),
    ];
    for c in exact_cases(n) {
        // Without the bad step: steps 0, 1, flush (the state the skipped step must leave), then
        // steps 3, 4 (the bad step's batch 2 is consumed by the skip).
        let (_, before) = reference(&cfg, &c, &data, 2);
        let after = {
            let store = case_store(&cfg, &c);
            let mut e = engine(&cfg, store.clone(), c.opts.clone(), 50);
            for b in &data[..2] {
                e.step(b, 1e-3).unwrap();
            }
            e.flush_pending().unwrap();
            for b in &data[3..] {
                e.step(b, 1e-3).unwrap();
            }
            e.flush_pending().unwrap();
            drop(e);
            state_of(&store)
        };
        for (fault, what) in faults {
            let what = format!("{}: {what}", c.name);
            let store = case_store(&cfg, &c);
            let mut e = engine(&cfg, store.clone(), c.opts.clone(), 50);
            for b in &data[..2] {
                assert!(e.step(b, 1e-3).unwrap().skipped.is_none());
            }
            e.inject(fault);
            let r = e.step(&data[2], 1e-3).unwrap();
            let skipped = r.skipped.unwrap_or_else(|| panic!("{what}: the step must be skipped"));
            assert_eq!(skipped.units_updated, 0, "{what}");
            match fault {
                Fault::Loss(_) => {
                    assert!(matches!(skipped.cause, SkipCause::Loss(x) if x.is_nan()), "{what}: {skipped:?}");
                    assert!(skipped.not_finite.is_empty(), "{what}");
                }
                Fault::Gradient { unit, .. } => {
                    assert!(matches!(skipped.cause, SkipCause::GradNorm(x) if !x.is_finite()), "{what}");
                    assert_eq!(skipped.not_finite, vec![unit], "{what}");
                }
            }
            assert_eq!(store.skipped_steps(), 1, "{what}: the store counts the skip");
            // Checked as a checkpoint or an export would see it.
            e.flush_pending().unwrap();
            assert_same(&state_of(&store), &before, &format!("{what}, after the skip"));
            assert_all_finite(&store, &what);
            for b in &data[3..] {
                assert!(e.step(b, 1e-3).unwrap().skipped.is_none(), "{what}: later steps run");
            }
            e.flush_pending().unwrap();
            drop(e);
            assert_same(&state_of(&store), &after, &format!("{what}, two steps later"));
        }
    }
}

#[test]
fn consecutive_skips_keep_the_store_and_an_injected_fault_lasts_one_step() {
    let cfg = cfg5();
    let data = small_batches(&cfg, 4, 90);
    let c = &exact_cases(cfg.num_hidden_layers)[2];
    let (_, before) = reference(&cfg, c, &data, 1);
    let store = case_store(&cfg, c);
    let mut e = engine(&cfg, store.clone(), c.opts.clone(), 50);
    e.step(&data[0], 1e-3).unwrap();
    for (k, b) in data[1..3].iter().enumerate() {
        e.inject(Fault::Gradient { unit: Unit::Layer(3), value: f32::NAN });
        assert!(e.step(b, 1e-3).unwrap().skipped.is_some(), "skip {k}");
    }
    assert_eq!(store.skipped_steps(), 2);
    // Resident units' state is the store's once written back (as for a checkpoint).
    e.flush_pending().unwrap();
    assert_same(&state_of(&store), &before, "two skips in a row");
    assert!(e.step(&data[3], 1e-3).unwrap().skipped.is_none(), "no fault injected: a normal step");
    assert_eq!(store.state().step, 1, "the update of step 0 applied, step 3's pending");
}

/// Lean mode updates as gradients land: a unit with a non-finite gradient sits the step out,
/// the others update (resident ones too, at the step's end); when every unit's gradient is
/// non-finite nothing is written and the step is skipped as in exact mode.
#[test]
fn a_lean_step_updates_only_the_units_whose_gradient_is_finite() {
    let cfg = cfg5();
    let data = small_batches(&cfg, 3, 100);
    for (name, opts) in [
        ("streamed", EngineOptions { mode: OptimMode::Lean, n_chunks: 2, ..golden_opts() }),
        (
            "resident outer and layers 0-1",
            EngineOptions {
                mode: OptimMode::Lean,
                placement: Placement { resident_outer: true, resident_layers: 2, ..Placement::default() },
                ..golden_opts()
            },
        ),
    ] {
        let run = |faults: &[Unit]| {
            let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::None);
            let mut e = engine(&cfg, store.clone(), opts.clone(), 50);
            e.step(&data[0], 1e-3).unwrap();
            e.flush_pending().unwrap();
            let before = state_of(&store);
            for &unit in faults {
                e.inject(Fault::Gradient { unit, value: f32::NAN });
            }
            let r = e.step(&data[1], 1e-3).unwrap();
            e.flush_pending().unwrap();
            let after = state_of(&store);
            let norm = store.state().grad_norm;
            // The next step clips with the last finite norm.
            let next = e.step(&data[2], 1e-3).unwrap();
            drop(e);
            (before, r, after, norm, next, store)
        };
        let (_, clean, clean_after, clean_norm, _, _) = run(&[]);
        assert!(clean.skipped.is_none());
        // One streamed and one (where resident) resident layer not finite.
        let (before, r, after, norm, next, store) = run(&[Unit::Layer(1), Unit::Layer(3)]);
        let s = r.skipped.unwrap_or_else(|| panic!("{name}: the step is reported skipped"));
        assert_eq!(s.not_finite, vec![Unit::Layer(1), Unit::Layer(3)], "{name}");
        assert_eq!(s.units_updated, 1 + cfg.num_hidden_layers - 2, "{name}");
        assert_eq!(after.step, before.step + 1, "{name}: the step advances (units were updated)");
        assert_eq!(store.skipped_steps(), 0, "{name}");
        for (i, u) in store.layout().units().enumerate() {
            let sat_out = matches!(u, Unit::Layer(1) | Unit::Layer(3));
            let expect = if sat_out { &before.records[i].0 } else { &clean_after.records[i].0 };
            assert!(after.records[i].0 == *expect, "{name}: {u:?} (sat out: {sat_out})");
            assert_eq!(after.records[i].1, after.step, "{name}: {u:?} has passed the step");
        }
        assert_eq!(norm, before_norm(&cfg, &opts, &data), "{name}: the header keeps the last finite norm");
        assert!(next.skipped.is_none() && next.loss.is_finite(), "{name}");
        assert_all_finite(&store, name);
        assert!(clean_norm.is_finite());

        // Every unit poisoned: nothing is written, the step is skipped.
        let all: Vec<Unit> = store.layout().units().collect();
        let (before, r, after, _, next, store) = run(&all);
        let s = r.skipped.unwrap();
        assert_eq!((s.units_updated, s.not_finite.len()), (0, all.len()), "{name}");
        assert_same(&after, &before, &format!("{name}: every gradient non-finite"));
        assert_eq!(store.skipped_steps(), 1, "{name}");
        assert!(next.skipped.is_none(), "{name}");
    }
}

/// The norm of the first lean step of `lean_faults`' runs (what the header keeps past a step
/// whose norm is not finite).
fn before_norm(cfg: &ModelConfig, opts: &EngineOptions, data: &[Batch]) -> f64 {
    let store = store_with(cfg, &random_params(cfg, 8), GradDtype::None);
    let mut e = engine(cfg, store.clone(), opts.clone(), 0);
    e.step(&data[0], 1e-3).unwrap().grad_norm
}

/// A mixture of experts (the load-balancing loss on, so the step's loss holds its term and the
/// routers' gradients count in the norm) skips as a dense model does: the routing is decided on
/// the host, but the skip is decided at the step's end over the whole loss and norm.
#[test]
fn a_moe_step_with_a_non_finite_gradient_or_loss_applies_nothing() {
    for name in ["qwen3_moe", "mixtral"] {
        let cfg = ModelConfig { num_hidden_layers: 3, ..golden::load(name).unwrap().cfg };
        assert!(cfg.moe.as_ref().is_some_and(|m| m.aux_coef().is_some()), "{name}");
        let data = small_batches(&cfg, 4, 110);
        let c = Case {
            name,
            grad: GradDtype::Bf16,
            // Mixtral's moments in 8 bits.
            states: if name == "mixtral" { StateDtype::Int8 } else { StateDtype::F32 },
            opts: EngineOptions {
                n_chunks: 2,
                placement: Placement { resident_layers: 1, kept_layers: 1, ..Placement::default() },
                ..golden_opts()
            },
        };
        let (_, before) = reference(&cfg, &c, &data, 2);
        for fault in [Fault::Gradient { unit: Unit::Layer(1), value: f32::NAN }, Fault::Loss(f64::INFINITY)] {
            let what = format!("{name}: {fault:?}");
            let store = case_store(&cfg, &c);
            let mut e = engine(&cfg, store.clone(), c.opts.clone(), 50);
            for b in &data[..2] {
                assert!(e.step(b, 1e-3).unwrap().skipped.is_none(), "{what}");
            }
            e.inject(fault);
            let s = e.step(&data[2], 1e-3).unwrap().skipped;
            assert!(s.is_some_and(|s| s.units_updated == 0), "{what}: the step must be skipped");
            assert_eq!(store.skipped_steps(), 1, "{what}");
            e.flush_pending().unwrap();
            assert_same(&state_of(&store), &before, &what);
            assert_all_finite(&store, &what);
            let next = e.step(&data[3], 1e-3).unwrap();
            assert!(next.skipped.is_none() && next.loss.is_finite(), "{what}: the run goes on");
        }
    }
}

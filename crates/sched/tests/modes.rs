//! Optimizer modes and step failure: lean vs exact, 12 B/param lean stores, switching modes on
//! one store, retrying a step that failed half-way, refusing bad optimizer settings, and the
//! bytes that actually cross the (CPU-simulated) bus.

mod common;

use mt_core::{ModelConfig, ModelLayout};
use mt_optim::AdamW;
use mt_sched::program::Op;
use mt_sched::{Batch, CpuBackend, Engine, EngineOptions, OptimMode};
use mt_store::{GradDtype, HostStore};
use mt_testkit::golden;
use mt_testkit::init::{random_batch, random_params};
use mt_testkit::tol::assert_bitwise_eq;

use common::*;

fn cfg() -> ModelConfig {
    golden::load("llama_gqa").unwrap().cfg
}

fn train(
    cfg: &ModelConfig,
    grad: GradDtype,
    opts: EngineOptions,
    data: &[Batch],
) -> std::sync::Arc<HostStore> {
    let store = store_with(cfg, &random_params(cfg, 8), grad);
    let mut e = engine(cfg, store.clone(), opts, 100);
    for b in data {
        e.step(b, 1e-3).unwrap();
    }
    e.flush_pending().unwrap();
    store
}

/// Without clipping, applying each update right after its gradient lands (lean) or just before
/// the next upload (exact) is the same arithmetic on the same numbers.
#[test]
fn lean_and_exact_agree_bitwise_without_clipping_and_lean_needs_no_gradient_buffer() {
    let cfg = cfg();
    let data = small_batches(&cfg, 3, 40);
    let exact = train(&cfg, GradDtype::F32, EngineOptions { clip: None, ..golden_opts() }, &data);
    let lean_opts = EngineOptions { clip: None, mode: OptimMode::Lean, ..golden_opts() };
    let lean = train(&cfg, GradDtype::F32, lean_opts.clone(), &data);
    assert_bitwise_eq(&params_of(&lean), &params_of(&exact), "lean vs exact params");
    let lean12 = train(&cfg, GradDtype::None, lean_opts, &data);
    assert_bitwise_eq(&params_of(&lean12), &params_of(&exact), "lean without grad buffers vs exact");
    assert!(lean12.bytes_per_param() < exact.bytes_per_param() - 3.9, "12 vs 16 B/param");
    assert_eq!(lean12.state().step, 3);
}

#[test]
fn exact_mode_refuses_a_store_without_gradient_buffers() {
    let cfg = cfg();
    let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::None);
    let err =
        Engine::new(&cfg, store, CpuBackend::new(Default::default()), golden_opts()).unwrap_err().to_string();
    assert!(err.contains("gradient buffers"), "{err}");
}

/// An exact step leaves its update pending in the store; a lean engine opened on that store
/// must apply it, not drop it.
#[test]
fn switching_from_exact_to_lean_applies_the_pending_update() {
    let cfg = cfg();
    let data = small_batches(&cfg, 2, 40);
    let no_clip = EngineOptions { clip: None, ..golden_opts() };
    let reference = train(&cfg, GradDtype::F32, no_clip.clone(), &data);
    let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::F32);
    engine(&cfg, store.clone(), no_clip.clone(), 0).step(&data[0], 1e-3).unwrap();
    assert!(store.state().pending_update);
    let mut lean = engine(&cfg, store.clone(), EngineOptions { mode: OptimMode::Lean, ..no_clip }, 0);
    lean.step(&data[1], 1e-3).unwrap();
    assert_eq!(store.state().step, 2);
    assert_bitwise_eq(&params_of(&store), &params_of(&reference), "exact then lean vs exact");
}

/// A step that fails after some units' pending updates were applied must not apply them twice
/// when retried (or flushed).
#[test]
fn a_step_that_fails_half_way_can_be_retried_without_applying_an_update_twice() {
    let cfg = cfg();
    let data = small_batches(&cfg, 3, 40);
    let reference = train(&cfg, GradDtype::F32, golden_opts(), &data);
    for flush_instead in [false, true] {
        let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::F32);
        let mut e = engine(&cfg, store.clone(), golden_opts(), 100);
        e.step(&data[0], 1e-3).unwrap();
        // Step 2 dies in layer 1's backward, after every unit's pending update was applied.
        let err = e
            .step_with(&data[1], 1e-3, |p| {
                for i in &mut p.instrs {
                    if matches!(i.op, Op::Backward { layer: 1, .. }) {
                        i.op = Op::Land {
                            unit: mt_core::Unit::Outer,
                            landing: mt_sched::program::HostBuf::Outer,
                            update: false,
                        };
                    }
                }
            })
            .unwrap_err();
        assert!(err.to_string().contains("not a compute op"), "{err}");
        assert_eq!(store.state().step, 0, "the failed step must not be counted");
        if flush_instead {
            e.flush_pending().unwrap(); // must be a no-op on the units already updated
            assert_eq!(store.state().step, 1);
        }
        e.step(&data[1], 1e-3).unwrap();
        e.step(&data[2], 1e-3).unwrap();
        e.flush_pending().unwrap();
        if !flush_instead {
            assert_bitwise_eq(&params_of(&store), &params_of(&reference), "retried run vs uninterrupted");
        }
    }
}

#[test]
fn bad_optimizer_settings_are_refused_up_front() {
    let cfg = cfg();
    let bad = [
        (EngineOptions { adamw: AdamW { beta1: 1.0, ..AdamW::default() }, ..golden_opts() }, "beta1"),
        (EngineOptions { adamw: AdamW { eps: -1.0, ..AdamW::default() }, ..golden_opts() }, "eps"),
        (EngineOptions { clip: Some(-1.0), ..golden_opts() }, "clip"),
        (EngineOptions { clip: Some(f64::NAN), ..golden_opts() }, "clip"),
        (EngineOptions { ring_depth: 0, ..golden_opts() }, "ring_depth"),
        (EngineOptions { weight_dtype: candle_core::DType::U8, ..golden_opts() }, "weight dtype"),
    ];
    for (opts, needle) in bad {
        let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::F32);
        let err =
            Engine::new(&cfg, store, CpuBackend::new(Default::default()), opts).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle}");
    }
    let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::F32);
    let mut e = engine(&cfg, store, golden_opts(), 0);
    let err = e.step(&small_batches(&cfg, 1, 40)[0], f64::NAN).unwrap_err().to_string();
    assert!(err.contains("learning rate"), "{err}");
}

/// Bytes counted by the copy operations themselves: each layer's weights cross twice, the outer
/// unit's once, and every gradient once (fp32), whatever the batch size or chunking.
#[test]
fn each_layer_crosses_twice_and_its_gradient_once() {
    let cfg = cfg();
    let layout = ModelLayout::new(&cfg);
    for (dtype, size) in [(candle_core::DType::F32, 4u64), (candle_core::DType::BF16, 2)] {
        for (batch, chunks) in [(2, 1), (4, 4)] {
            let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::Bf16);
            let opts = EngineOptions { weight_dtype: dtype, n_chunks: chunks, ..golden_opts() };
            let mut e = engine(&cfg, store, opts, 0);
            let (input_ids, targets) = random_batch(&cfg, batch, 8, 1, 0.0);
            let mut planned = (0, 0);
            let r = e
                .step_with(&Batch { batch, seq: 8, input_ids, targets }, 1e-3, |p| {
                    planned = (p.uploads().count(), p.downloads().count())
                })
                .unwrap();
            let (l, o, n) = (layout.layer.len as u64, layout.outer.len as u64, layout.n_layers as u64);
            assert_eq!(r.h2d_bytes, (2 * n * l + o) * size, "{dtype:?}, batch {batch}");
            assert_eq!(r.d2h_bytes, (n * l + o) * 4, "{dtype:?}, batch {batch}");
            assert_eq!(planned, (2 * n as usize + 1, n as usize + 1), "the program plans what was copied");
        }
    }
}

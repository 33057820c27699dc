//! Optimizer modes and step failure: lean vs exact, 12 B/param lean stores, switching modes on
//! one store, retrying a step that failed half-way, refusing bad optimizer settings, and the
//! bytes that actually cross the (CPU-simulated) bus.

mod common;

use mt_core::{ModelConfig, ModelLayout};
use mt_optim::AdamW;
use mt_sched::program::Op;
use mt_sched::Placement;
use mt_sched::{Batch, CpuBackend, Engine, EngineOptions, OptimMode};
use mt_store::{GradDtype, HostStore};
use mt_testkit::golden;
use mt_testkit::init::{random_batch, random_params};
use mt_testkit::tol::assert_bitwise_eq;

use common::*;

fn cfg() -> ModelConfig {
    golden::load("llama_gqa").unwrap().cfg
}

/// The golden model with five layers: room for an early upload (an early layer at least
/// `ring_depth` layers before its late partner).
fn cfg5() -> ModelConfig {
    ModelConfig { num_hidden_layers: 5, ..cfg() }
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

/// Exact mode with bf16 store gradients narrows each streamed layer's gradient on the device and
/// lands it in bf16 (half the bytes); landing f32 and narrowing on the host is the same rounding
/// and the same sum of squares: gradients, norms (so clipping), losses, weights and moments are
/// bitwise those of the host's land, step after step.
#[test]
fn a_gradient_narrowed_on_the_device_lands_bitwise_as_the_hosts_narrowing() {
    let cfg = cfg();
    let data = small_batches(&cfg, 3, 60);
    let run = |device_narrowing: bool| {
        let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::Bf16);
        let opts = EngineOptions { device_narrowing, n_chunks: 2, ..golden_opts() };
        let mut e = engine(&cfg, store.clone(), opts, 100);
        let mut seen = Vec::new();
        for b in &data {
            let r = e.step(b, 1e-2).unwrap();
            seen.push((r.loss.to_bits(), r.grad_norm.to_bits(), r.d2h_bytes, grads_of(&store)));
        }
        e.flush_pending().unwrap();
        (seen, store)
    };
    let ((device, dstore), (host, hstore)) = (run(true), run(false));
    for (s, (d, h)) in device.iter().zip(&host).enumerate() {
        assert_eq!((d.0, d.1), (h.0, h.1), "step {s}: loss and gradient norm bits");
        assert!(d.2 < h.2, "step {s}: bf16 landing moves fewer bytes ({} vs {})", d.2, h.2);
        assert_bitwise_eq(&d.3, &h.3, &format!("step {s}: stored gradients"));
    }
    assert!(f64::from_bits(device[0].1) > 1.0, "the clip (1.0) is active, so the norm matters");
    assert_bitwise_eq(&params_of(&dstore), &params_of(&hstore), "params");
    let moments = |st: &HostStore| -> Vec<u8> {
        st.layout()
            .units()
            .flat_map(|u| {
                let r = st.record(u);
                r.m().iter().chain(r.v().iter()).copied().collect::<Vec<u8>>()
            })
            .collect()
    };
    assert!(moments(&dstore) == moments(&hstore), "AdamW moments differ");
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

/// Makes `layer`'s backward fail when the step runs it (a host op where a compute op belongs):
/// every pending update of the step has been applied by then.
fn fail_in_backward(p: &mut mt_sched::program::Program, layer: usize) {
    for i in &mut p.instrs {
        if matches!(i.op, Op::Backward { layer: l, .. } if l == layer) {
            i.op = Op::Land {
                unit: mt_core::Unit::Outer,
                landing: mt_sched::program::HostBuf::Outer,
                update: false,
            };
        }
    }
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
        let err = e.step_with(&data[1], 1e-3, |p| fail_in_backward(p, 1)).unwrap_err();
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

/// The same for GPU-updated layers: a step that dies after some of their states came back
/// updated (in the backward: all of them; at the last one's device update: all but that one)
/// must not apply those updates again when retried (a record is marked once its state is there)
/// nor when flushed, and must apply the others once; the retried run is bitwise the
/// uninterrupted one, which is bitwise the run with every update on the host. With late state
/// downloads (every layer held, each state back only in the backward, one per backward
/// position), a step failing at the last device update has marked none, one failing in layer
/// `m`'s backward the layers `m..` (whose downloads went out before it) and not the others. With
/// an early state upload (master and moments for the next step sent up in the backward into a
/// free state slot, the gradient copied on the device), the failed step's successor uploads
/// it again; with two late downloads and one early upload, a layer is marked where its download
/// was issued before the failing instruction. (Five layers: an early layer needs a late partner
/// `ring_depth` layers after it.)
#[test]
fn a_failed_step_does_not_apply_a_gpu_updated_layers_update_twice() {
    let cfg = cfg5();
    let n = cfg.num_hidden_layers;
    let data = small_batches(&cfg, 3, 41);
    let reference = train(&cfg, GradDtype::Bf16, golden_opts(), &data);
    let last = mt_core::Unit::Layer(n - 1);
    // (late downloads: none, all or one; early uploads; where the step fails: `None` at the last
    // device update, `Some(m)` in layer m's backward; flush instead of retrying)
    let mid = n / 2;
    assert!(mid > 0, "the model needs two layers for a middle one");
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Late {
        None,
        All,
        Two,
    }
    let mut cases = Vec::new();
    for flush in [false, true] {
        cases.extend([(Late::None, 0, Some(0), flush), (Late::None, 0, None, flush)]);
        for fail_in in [Some(0), Some(mid), None] {
            // Two late layers of five (1 and 3): one early partner (0, in 3's slot).
            cases.extend([(Late::All, 0, fail_in, flush), (Late::Two, 1, fail_in, flush)]);
        }
    }
    for (late, early, fail_in, flush_instead) in cases {
        let fail_at_last_update = fail_in.is_none();
        let opts = match late {
            Late::None => EngineOptions {
                placement: Placement { gpu_updated_layers: n, ..Placement::default() },
                ..golden_opts()
            },
            Late::All | Late::Two => EngineOptions {
                placement: Placement {
                    gpu_updated_layers: n,
                    held_layers: n,
                    late_state_downloads: if late == Late::All { n } else { 2 },
                    early_state_uploads: early,
                    ..Placement::default()
                },
                ..golden_opts()
            },
        };
        let late = late != Late::None;
        assert_bitwise_eq(
            &params_of(&train(&cfg, GradDtype::Bf16, opts.clone(), &data)),
            &params_of(&reference),
            &format!("GPU-updated (late {late}) vs host-updated"),
        );
        let what = format!(
            "{}{}",
            match fail_in {
                None => "failed at the last device update".to_string(),
                Some(m) => format!("failed in layer {m}'s backward"),
            },
            if late { ", late downloads" } else { "" }
        ) + &format!(", {early} early uploads");
        let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::Bf16);
        let mut e = engine(&cfg, store.clone(), opts.clone(), 100);
        e.step(&data[0], 1e-3).unwrap();
        let mut device_updates = 0;
        // Per layer, whether its state download is issued before the instruction that fails.
        let mut downloaded_before_failure = vec![false; n];
        let err = e
            .step_with(&data[1], 1e-3, |p| {
                device_updates =
                    p.instrs.iter().filter(|i| matches!(i.op, Op::UpdateStreamed { .. })).count();
                let state_uploads_in_forward = p
                    .instrs
                    .iter()
                    .take_while(|i| i.op != Op::Loss)
                    .filter(|i| matches!(i.op, Op::UploadState { .. }))
                    .count();
                assert_eq!(state_uploads_in_forward, n - early, "early states up since the last step");
                if fail_at_last_update {
                    for i in &mut p.instrs {
                        if matches!(i.op, Op::UpdateStreamed { unit, .. } if unit == last) {
                            i.op = Op::Land {
                                unit: last,
                                landing: mt_sched::program::HostBuf::Outer,
                                update: false,
                            };
                        }
                    }
                } else {
                    fail_in_backward(p, fail_in.unwrap_or(0));
                }
                let failing = p
                    .instrs
                    .iter()
                    .position(|i| {
                        i.stream == mt_sched::program::Stream::Compute && matches!(i.op, Op::Land { .. })
                    })
                    .expect("a failing instruction");
                for (i, ins) in p.instrs.iter().enumerate() {
                    if let Op::DownloadState { unit: mt_core::Unit::Layer(l), .. } = ins.op {
                        downloaded_before_failure[l] = i < failing;
                    }
                }
            })
            .unwrap_err();
        assert_eq!(device_updates, n, "every layer is updated on the device");
        assert!(err.to_string().contains("not a compute op"), "{what}: {err}");
        for (l, &went) in downloaded_before_failure.iter().enumerate() {
            let marked = match (late, early, fail_in) {
                (false, _, None) => u64::from(l != n - 1),
                (false, _, Some(_)) => 1,
                (true, 0, None) => 0,
                (true, 0, Some(m)) => u64::from(l >= m),
                (true, _, _) => u64::from(went),
            };
            assert_eq!(store.applied_step(mt_core::Unit::Layer(l)), marked, "{what}: layer {l}'s marker");
        }
        if flush_instead {
            e.flush_pending().unwrap();
            assert_eq!(store.state().step, 1);
        }
        // The failed step may have left early slots half updated: the next step uploads every
        // state in its forward (none after a flush: no update pending).
        let mut forward_uploads = usize::MAX;
        e.step_with(&data[1], 1e-3, |p| {
            forward_uploads = p
                .instrs
                .iter()
                .take_while(|i| i.op != Op::Loss)
                .filter(|i| matches!(i.op, Op::UploadState { .. }))
                .count()
        })
        .unwrap();
        assert_eq!(forward_uploads, if flush_instead { 0 } else { n }, "{what}: the step after");
        e.step(&data[2], 1e-3).unwrap();
        e.flush_pending().unwrap();
        let how = if flush_instead { "flushed" } else { "retried" };
        assert_bitwise_eq(
            &params_of(&store),
            &params_of(&reference),
            &format!("{what}, {how}, vs uninterrupted"),
        );
    }
}

/// A store that a failed state copy left untrustworthy (`HostStore::poison`) is refused by every
/// later step and flush, naming why, and nothing in it changes.
#[test]
fn a_poisoned_store_is_refused() {
    let cfg = cfg();
    let data = small_batches(&cfg, 2, 42);
    let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::Bf16);
    let mut e = engine(&cfg, store.clone(), golden_opts(), 0);
    e.step(&data[0], 1e-3).unwrap();
    let before = params_of(&store);
    store.poison("the state download of Layer(1) failed part-way (test)".into());
    let err = e.step(&data[1], 1e-3).unwrap_err().to_string();
    assert!(err.contains("can no longer be trusted") && err.contains("Layer(1) failed part-way"), "{err}");
    let err = e.flush_pending().unwrap_err().to_string();
    assert!(err.contains("resume from a checkpoint"), "{err}");
    assert_bitwise_eq(&params_of(&store), &before, "a refused step changes nothing");
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
/// unit's once, and every gradient once, whatever the batch size or chunking: a layer's in bf16
/// where exact mode keeps bf16 gradients (the device narrows it), else in fp32.
#[test]
fn each_layer_crosses_twice_and_its_gradient_once() {
    let cfg = cfg();
    let layout = ModelLayout::new(&cfg);
    let combos = [
        (candle_core::DType::F32, 4u64, OptimMode::Exact, GradDtype::Bf16, 2u64),
        (candle_core::DType::BF16, 2, OptimMode::Exact, GradDtype::Bf16, 2),
        (candle_core::DType::BF16, 2, OptimMode::Exact, GradDtype::F32, 4),
        (candle_core::DType::BF16, 2, OptimMode::Lean, GradDtype::Bf16, 4),
    ];
    for (dtype, size, mode, grad, landed) in combos {
        for (batch, chunks) in [(2, 1), (4, 4)] {
            let store = store_with(&cfg, &random_params(&cfg, 8), grad);
            let opts = EngineOptions { weight_dtype: dtype, n_chunks: chunks, mode, ..golden_opts() };
            let mut e = engine(&cfg, store, opts, 0);
            let (input_ids, targets) = random_batch(&cfg, batch, 8, 1, 0.0);
            let mut planned = (0, 0);
            let r = e
                .step_with(&Batch { batch, seq: 8, input_ids, targets, positions: None }, 1e-3, |p| {
                    planned = (p.uploads().count(), p.downloads().count())
                })
                .unwrap();
            let (l, o, n) = (layout.layer.len as u64, layout.outer.len as u64, layout.n_layers as u64);
            let what = format!("{dtype:?}, {mode:?}, {grad:?} gradients, batch {batch}");
            assert_eq!(r.h2d_bytes, (2 * n * l + o) * size, "{what}");
            assert_eq!(r.d2h_bytes, n * l * landed + o * 4, "{what}");
            assert_eq!(planned, (2 * n as usize + 1, n as usize + 1), "the program plans what was copied");
        }
    }
}

/// A GPU-updated layer's forward weights are not uploaded: its state (fp32 master, m, v and the
/// stored gradient) goes up and master, m and v come back, measured by the copies themselves and
/// equal to the program's plan; the first step, with no update pending, moves weights as usual.
/// Early state uploads move master and moments in the backward, for the next step, and not the
/// gradient (copied on the device); the first step moves theirs besides. Lean mode, more
/// GPU-updated layers than stream, and more early uploads than late layers with a partner are
/// refused, naming the problem.
#[test]
fn a_gpu_updated_layer_moves_its_state_instead_of_its_weights() {
    let cfg = cfg5();
    let layout = ModelLayout::new(&cfg);
    let (l, o, n) = (layout.layer.len as u64, layout.outer.len as u64, layout.n_layers as u64);
    for (grad, g) in [(GradDtype::Bf16, 2u64), (GradDtype::F32, 4)] {
        let nl = layout.n_layers;
        // Early: 2 late (1 and 3), 0 paired with 3; 3 late (0, 2, 4), 1 paired with 4.
        let placements = (0..=nl).map(|k| (k, 0, 0)).chain([(nl, nl, 0), (nl, 2, 1), (nl, 3, 1)]);
        for (gpu, late, early) in placements {
            let store = store_with(&cfg, &random_params(&cfg, 8), grad);
            let opts = EngineOptions {
                n_chunks: 2,
                placement: Placement {
                    gpu_updated_layers: gpu,
                    late_state_downloads: late,
                    early_state_uploads: early,
                    held_layers: if late > 0 { nl } else { 0 },
                    ..Placement::default()
                },
                ..golden_opts()
            };
            let mut e = engine(&cfg, store, opts, 0);
            let (input_ids, targets) = random_batch(&cfg, 2, 8, 1, 0.0);
            let b = Batch { batch: 2, seq: 8, input_ids, targets, positions: None };
            let first = e.step(&b, 1e-3).unwrap();
            let h = if late > 0 { n } else { 0 }; // held layers
            let ke = early as u64;
            assert_eq!(
                first.h2d_bytes,
                ((2 * n - h) * l + o) * 4 + ke * 12 * l,
                "{gpu} GPU-updated, {early} early, first step (their master and moments for the next)"
            );
            let mut states = 0;
            let r = e.step_with(&b, 1e-3, |p| states = p.state_uploads().count()).unwrap();
            let k = gpu as u64;
            assert_eq!(states, gpu - early, "the early ones' went up in the last step");
            assert_eq!(
                r.h2d_bytes,
                ((2 * n - h - k) * l + o) * 4 + k * (12 + g) * l - ke * g * l,
                "{gpu} GPU-updated, {grad:?}: an early one's gradient is copied on the device"
            );
            assert_eq!(
                r.d2h_bytes,
                n * l * (if g == 2 { 2 } else { 4 }) + o * 4 + k * 12 * l,
                "{gpu} GPU-updated"
            );
        }
    }
    let refused = |opts: EngineOptions| {
        let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::Bf16);
        mt_sched::Engine::new(&cfg, store, CpuBackend::new(mt_sched::CpuOptions::default()), opts)
            .unwrap_err()
            .to_string()
    };
    let err = refused(EngineOptions {
        mode: OptimMode::Lean,
        placement: Placement { gpu_updated_layers: 1, ..Placement::default() },
        ..golden_opts()
    });
    assert!(err.contains("lean mode"), "{err}");
    let err = refused(EngineOptions {
        placement: Placement { gpu_updated_layers: 5, resident_layers: 1, ..Placement::default() },
        ..golden_opts()
    });
    assert!(err.contains("GPU-updated layers are streamed ones"), "{err}");
    let err = refused(EngineOptions {
        placement: Placement { gpu_updated_layers: 2, late_state_downloads: 1, ..Placement::default() },
        ..golden_opts()
    });
    assert!(
        err.contains("1 late state downloads asked, but only 0 of the 2 GPU-updated layers are held"),
        "{err}"
    );
    let all_held = EngineOptions {
        placement: Placement { gpu_updated_layers: 5, held_layers: 5, ..Placement::default() },
        ..golden_opts()
    };
    let err = refused(EngineOptions {
        placement: Placement { late_state_downloads: 2, early_state_uploads: 2, ..all_held.placement },
        ..all_held.clone()
    });
    assert!(
        err.contains("2 early state uploads asked, but only 1 of the 2 late-download layers have a partner"),
        "{err}"
    );
    let err = refused(EngineOptions {
        placement: Placement { early_state_uploads: 1, ..all_held.placement },
        ..all_held.clone()
    });
    assert!(
        err.contains("no layer downloads its state late") && err.contains("--late-state-downloads"),
        "{err}"
    );
    let err = refused(EngineOptions {
        mode: OptimMode::Lean,
        placement: Placement { early_state_uploads: 1, ..Placement::default() },
        ..golden_opts()
    });
    assert!(err.contains("lean mode has none"), "{err}");
    // The gradient an early upload copies on the device is the bf16 twin device narrowing makes.
    let err = refused(EngineOptions {
        device_narrowing: false,
        placement: Placement { late_state_downloads: 2, early_state_uploads: 1, ..all_held.placement },
        ..all_held
    });
    assert!(err.contains("without device narrowing there is none"), "{err}");
}

/// A held layer (uploaded once, its weights kept on the device from forward to backward) crosses
/// once: the measured upload bytes fall by exactly its weights.
#[test]
fn a_held_layer_crosses_once() {
    let cfg = cfg();
    let layout = ModelLayout::new(&cfg);
    let (l, o, n) = (layout.layer.len as u64, layout.outer.len as u64, layout.n_layers as u64);
    for held_layers in 0..=layout.n_layers {
        let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::Bf16);
        let opts = EngineOptions {
            n_chunks: 2,
            placement: Placement { held_layers, ..Placement::default() },
            ..golden_opts()
        };
        let mut e = engine(&cfg, store, opts, 0);
        let (input_ids, targets) = random_batch(&cfg, 2, 8, 1, 0.0);
        let r = e.step(&Batch { batch: 2, seq: 8, input_ids, targets, positions: None }, 1e-3).unwrap();
        assert_eq!(r.h2d_bytes, ((2 * n - held_layers as u64) * l + o) * 4, "{held_layers} held");
        assert_eq!(r.d2h_bytes, n * l * 2 + o * 4, "{held_layers} held");
    }
    let store = store_with(&cfg, &random_params(&cfg, 8), GradDtype::Bf16);
    let opts = EngineOptions {
        placement: Placement { held_layers: 2, resident_layers: 1, ..Placement::default() },
        ..golden_opts()
    };
    let err = mt_sched::Engine::new(&cfg, store, CpuBackend::new(mt_sched::CpuOptions::default()), opts)
        .unwrap_err();
    assert!(err.to_string().contains("held layers are streamed ones"), "{err}");
}

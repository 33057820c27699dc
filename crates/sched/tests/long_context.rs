//! The engine's long-sequence paths on the CPU backend: a packed batch's gradient equals that of
//! the same samples run one per sequence, and MLP row tiles change the step only by rounding.

mod common;

use mt_core::ModelConfig;
use mt_sched::Placement;
use mt_sched::{Batch, EngineOptions, IGNORE_INDEX};
use mt_store::GradDtype;
use mt_testkit::golden;
use mt_testkit::init::random_params;
use mt_testkit::tol::{compare_maps, Tolerance};

use common::*;

fn config() -> ModelConfig {
    golden::load("qwen3_qknorm").unwrap().cfg
}

/// One step's loss and landed gradients (f32 store gradients).
fn step(
    cfg: &ModelConfig,
    opts: EngineOptions,
    b: &Batch,
) -> (f64, std::collections::BTreeMap<String, candle_core::Tensor>) {
    let store = store_with(cfg, &random_params(cfg, 5), GradDtype::F32);
    let mut e = engine(cfg, store.clone(), opts, 0);
    let loss = e.step(b, 1e-3).unwrap().loss;
    (loss, grads_of(&store))
}

/// Three samples (6, 5 and 4 tokens) packed in one sequence of 16 (one padding token), with
/// position ids restarting at each sample, train exactly as the three run as sequences of their
/// own (padded to 6): same loss, same gradients, to f32 rounding.
#[test]
fn packed_batch_equals_samples_one_per_sequence() {
    let cfg = config();
    let samples: [Vec<u32>; 3] = [vec![3, 17, 9, 44, 2, 8], vec![11, 5, 60, 7, 21], vec![99, 4, 13, 70]];
    // Packed: the samples back to back, then one padding token continuing the last positions.
    let (mut ids, mut pos, mut tgt) = (Vec::new(), Vec::new(), Vec::new());
    for s in &samples {
        for (k, &id) in s.iter().enumerate() {
            ids.push(id);
            pos.push(k as u32);
            tgt.push(s.get(k + 1).map_or(IGNORE_INDEX, |&n| i64::from(n)));
        }
    }
    ids.push(0);
    pos.push(4);
    tgt.push(IGNORE_INDEX);
    let packed = Batch { batch: 1, seq: 16, input_ids: ids, targets: tgt, positions: Some(pos) };
    // One per sequence, padded to 6.
    let (mut ids, mut tgt) = (Vec::new(), Vec::new());
    for s in &samples {
        for k in 0..6 {
            ids.push(s.get(k).copied().unwrap_or(0));
            tgt.push(s.get(k + 1).map_or(IGNORE_INDEX, |&n| i64::from(n)));
        }
    }
    let separate = Batch { batch: 3, seq: 6, input_ids: ids, targets: tgt, positions: None };
    assert_eq!(packed.n_targets(), separate.n_targets());
    let (lp, gp) = step(&cfg, golden_opts(), &packed);
    let (ls, gs) = step(&cfg, golden_opts(), &separate);
    assert!((lp - ls).abs() <= 1e-6 * ls, "loss packed {lp} vs separate {ls}");
    compare_maps(&gp, &gs, Tolerance::F32_GOLDEN).assert_ok("packed vs one per sequence");
    // Without the position ids the samples attend to each other: the gradient moves.
    let unmasked = Batch { positions: None, ..packed };
    let (lu, _) = step(&cfg, golden_opts(), &unmasked);
    assert!((lu - ls).abs() > 1e-4 * ls, "loss without documents {lu} vs {ls}");
}

/// MLP tiles of 5 rows over 2 x 12 tokens (tiles straddling the sequences) give the untiled
/// step's loss and gradients to f32 rounding.
#[test]
fn mlp_tiles_change_the_step_only_by_rounding() {
    let cfg = config();
    let (input_ids, targets) = mt_testkit::init::random_batch(&cfg, 2, 12, 3, 0.1);
    let b = Batch { batch: 2, seq: 12, input_ids, targets, positions: None };
    let (l0, g0) = step(&cfg, golden_opts(), &b);
    let (l1, g1) = step(&cfg, EngineOptions { mlp_rows: 5, ..golden_opts() }, &b);
    assert!((l0 - l1).abs() <= 1e-6 * l0, "{l0} vs {l1}");
    compare_maps(&g1, &g0, Tolerance::F32_TIGHT).assert_ok("tiled vs whole MLP");
}

/// Position ids that point past a token are refused before the step, naming them.
#[test]
fn bad_position_ids_are_refused() {
    let cfg = config();
    let b = Batch {
        batch: 1,
        seq: 4,
        input_ids: vec![1, 2, 3, 4],
        targets: vec![2, 3, 4, IGNORE_INDEX],
        positions: Some(vec![0, 1, 5, 0]),
    };
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let mut e = engine(&cfg, store, golden_opts(), 0);
    let err = e.step(&b, 1e-3).unwrap_err().to_string();
    assert!(err.contains("position id 5 at token 2"), "{err}");
    let short = Batch { positions: Some(vec![0, 1]), ..b };
    let err = e.step(&short, 1e-3).unwrap_err().to_string();
    assert!(err.contains("4 position ids"), "{err}");
}

/// Two steps (and the flush) of a 4-layer model with random copy-stream delays, checkpoints of
/// boundaries `0..spilled` spilled to host memory: losses, landed gradients and weights.
fn spilled_run(
    spilled: usize,
    n_chunks: usize,
    edit: impl Fn(&mut mt_sched::program::Program) + Copy,
) -> Outcome {
    let mut cfg = config();
    cfg.num_hidden_layers = 4;
    let store = store_with(&cfg, &random_params(&cfg, 5), GradDtype::F32);
    let opts = EngineOptions {
        n_chunks,
        ring_depth: 2,
        placement: Placement { spilled_checkpoints: spilled, ..Placement::default() },
        ..golden_opts()
    };
    let mut e = engine(&cfg, store.clone(), opts, 200);
    let mut losses = Vec::new();
    for seed in 0..2 {
        let (input_ids, targets) = mt_testkit::init::random_batch(&cfg, 2, 12, seed, 0.1);
        let b = Batch { batch: 2, seq: 12, input_ids, targets, positions: None };
        losses.push(e.step_with(&b, 1e-3, edit).unwrap().loss.to_bits());
    }
    let grads = grads_of(&store);
    e.flush_pending().unwrap();
    (losses, grads, params_of(&store))
}

type Outcome = (
    Vec<u64>,
    std::collections::BTreeMap<String, candle_core::Tensor>,
    std::collections::BTreeMap<String, candle_core::Tensor>,
);

/// Spilled checkpoints change no bit: one, three and every layer input spilled (one and two
/// chunks) train exactly as with every checkpoint on the device, with random copy delays.
#[test]
fn spilled_checkpoints_train_bitwise_as_kept_ones() {
    for n_chunks in [1, 2] {
        let base = spilled_run(0, n_chunks, |_| {});
        for spilled in [1, 3, 4] {
            let r = spilled_run(spilled, n_chunks, |_| {});
            assert_eq!(r.0, base.0, "losses, {spilled} spilled, {n_chunks} chunks");
            mt_testkit::tol::assert_bitwise_eq(&r.1, &base.1, "grads");
            mt_testkit::tol::assert_bitwise_eq(&r.2, &base.2, "params");
        }
    }
}

/// A backward that does not wait for its checkpoint's reload reads a stale reload buffer (the
/// copies run late): the wait is what makes the result right.
#[test]
fn a_backward_without_its_reload_wait_is_caught() {
    use mt_sched::program::{Op, Program};
    let base = spilled_run(0, 1, |_| {});
    let cut = |p: &mut Program| {
        let reloads: Vec<usize> =
            (0..p.instrs.len()).filter(|&i| matches!(p.instrs[i].op, Op::ReloadCheckpoint { .. })).collect();
        for ins in &mut p.instrs {
            if matches!(ins.op, Op::Backward { .. }) {
                ins.waits.retain(|w| !reloads.contains(w));
            }
        }
    };
    let r = spilled_run(4, 1, cut);
    assert_ne!(r.0, base.0, "dropping the reload waits should break the losses");
}

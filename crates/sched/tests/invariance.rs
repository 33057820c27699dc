//! Invariance tests of the step program (docs/design.md, "Oracles" 4): ring depth changes nothing,
//! chunking changes results only by rounding, the loss is normalised by the global target count,
//! and a missing wait is caught as a wrong gradient.

mod common;

use mt_sched::Placement;
use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use mt_core::{ModelConfig, Unit};
use mt_sched::program::{Op, Stream};
use mt_sched::{Batch, CpuOptions, EngineOptions, OptimMode, IGNORE_INDEX};
use mt_store::GradDtype;
use mt_testkit::golden;
use mt_testkit::init::{random_batch, random_params};
use mt_testkit::tol::{assert_bitwise_eq, compare_maps, Tolerance};
use mt_testkit::ReferenceModel;

use common::*;

fn config() -> ModelConfig {
    // Llama with GQA and llama3 rope scaling, 2 layers (the golden llama_gqa shape) but 4 layers
    // so that a depth-3 ring wraps around.
    let mut cfg = golden::load("llama_gqa").unwrap().cfg;
    cfg.num_hidden_layers = 4;
    cfg
}

fn batch(cfg: &ModelConfig, b: usize, seed: u64) -> Batch {
    let (input_ids, targets) = random_batch(cfg, b, 12, seed, 0.2);
    Batch { batch: b, seq: 12, input_ids, targets, positions: None }
}

/// What a run leaves behind: loss bits per step, params, grads of the last step, one layer's m
/// (the bytes of its encoding).
type Outcome = (Vec<u64>, BTreeMap<String, Tensor>, BTreeMap<String, Tensor>, Vec<u8>);

/// Runs one step per batch (then flushes the pending update).
fn run(cfg: &ModelConfig, opts: EngineOptions, batches: &[Batch], delay_us: u64) -> Outcome {
    run_with(cfg, opts, batches, delay_us, GradDtype::F32)
}

/// [`run`] over a store keeping `grad` gradients.
fn run_with(
    cfg: &ModelConfig,
    opts: EngineOptions,
    batches: &[Batch],
    delay_us: u64,
    grad: GradDtype,
) -> Outcome {
    let store = store_with(cfg, &random_params(cfg, 11), grad);
    let mut e = engine(cfg, store.clone(), opts, delay_us);
    let losses = batches.iter().map(|b| e.step(b, 1e-3).unwrap().loss.to_bits()).collect();
    // Resident units' gradients reach the store when they are synced.
    e.sync_store().unwrap();
    let grads = grads_of(&store);
    e.flush_pending().unwrap();
    let m = store.record(Unit::Layer(1)).m().to_vec();
    (losses, params_of(&store), grads, m)
}

#[test]
fn ring_depth_1_2_3_give_bitwise_identical_training() {
    let cfg = config();
    let batches: Vec<Batch> = (0..3).map(|s| batch(&cfg, 3, s)).collect();
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        let opts = |d| EngineOptions { ring_depth: d, n_chunks: 2, mode, ..golden_opts() };
        let (l1, p1, g1, m1) = run(&cfg, opts(1), &batches, 300);
        for depth in [2, 3] {
            let (l, p, g, m) = run(&cfg, opts(depth), &batches, 300);
            assert_eq!(l, l1, "{mode:?}: losses differ between depth 1 and {depth}");
            assert_bitwise_eq(&p, &p1, &format!("{mode:?} params, depth {depth} vs 1"));
            assert_bitwise_eq(&g, &g1, &format!("{mode:?} grads, depth {depth} vs 1"));
            assert!(m == m1, "{mode:?} moments differ");
        }
    }
}

/// Keeping a layer's forward activations for its backward (instead of recomputing them from the
/// checkpoint), and holding a streamed layer's weights on the device from its forward to its
/// backward (instead of re-casting and re-uploading them), are the same arithmetic: losses,
/// gradients, weights and moments are bitwise those of full recompute and streaming, for none,
/// some or all layers kept or held, streamed or resident, over two chunks (a state handed to the
/// wrong chunk or layer would show), Llama and Qwen3 (q/k norms), f32 and bf16.
#[test]
fn kept_activations_and_held_weights_train_bitwise_as_recompute_and_streaming() {
    let mut qwen3 = golden::load("qwen3_qknorm").unwrap().cfg;
    qwen3.num_hidden_layers = 3;
    for cfg in [config(), qwen3] {
        let n = cfg.num_hidden_layers;
        let batches: Vec<Batch> = (0..3).map(|s| batch(&cfg, 3, 20 + s)).collect();
        for weight_dtype in [DType::F32, DType::BF16] {
            let opts = |kept_layers, resident_layers| EngineOptions {
                n_chunks: 2,
                weight_dtype,
                placement: Placement { kept_layers, resident_layers, ..Placement::default() },
                ..golden_opts()
            };
            let (l0, p0, g0, m0) = run(&cfg, opts(0, 0), &batches, 0);
            // (kept, resident, held)
            for (kept, resident, held) in
                [(1, 0, 0), (n, 0, 0), (n, 1, 0), (2, n, 0), (0, 0, 1), (n, 0, n), (2, 1, 1)]
            {
                let what =
                    format!("{dtype:?}, {kept} kept, {resident} resident, {held} held", dtype = weight_dtype);
                let (l, p, g, m) = run(
                    &cfg,
                    EngineOptions {
                        placement: Placement { held_layers: held, ..opts(kept, resident).placement },
                        ..opts(kept, resident)
                    },
                    &batches,
                    0,
                );
                assert_eq!(l, l0, "{what}: losses differ from full recompute");
                assert_bitwise_eq(&p, &p0, &format!("{what}: params"));
                assert_bitwise_eq(&g, &g0, &format!("{what}: grads"));
                assert!(m == m0, "{what}: moments differ");
            }
        }
    }
}

/// A GPU-updated layer's update (its state uploaded into a state slot, AdamW there, the weights
/// written into its slot, master and moments downloaded back into its record) is the host's
/// update, bit for bit: losses, gradients, weights and moments over three steps equal those of
/// the same placement with every streamed layer's update on the host, for one, some or all
/// streamed layers, ring or held slots, resident layers beside them, ring depths 2 and 3 (as many
/// state slots), f32 and bf16 stored gradients and weights, with random delays on every worker
/// stream. (A resident layer updates from its f32 device gradient, so with bf16 stored gradients
/// a placement with resident layers is compared with itself, not with the all-streamed run.)
/// Late state downloads (held layers keeping their state on the device until their backward)
/// and early state uploads (into a state slot free in the backward; a six-layer model)
/// change nothing either.
#[test]
fn gpu_updated_layers_train_bitwise_as_host_updates() {
    let mut qwen3 = golden::load("qwen3_qknorm").unwrap().cfg;
    qwen3.num_hidden_layers = 3;
    // Early uploads need a late partner `ring_depth` layers after the early layer.
    let qwen3_deep = ModelConfig { num_hidden_layers: 6, ..qwen3.clone() };
    // (GPU-updated, held, resident, ring depth, late state downloads, early uploads): early
    // layers held and not, ring depths 2 and 3, one resident.
    let early_placements = |n: usize| {
        vec![(n, n, 0, 2, 2, 1), (n, n - 2, 0, 2, 2, 2), (n, n, 0, 3, 2, 1), (n - 1, n - 1, 1, 2, 2, 1)]
    };
    for cfg in [config(), qwen3, qwen3_deep] {
        let n = cfg.num_hidden_layers;
        let batches: Vec<Batch> = (0..3).map(|s| batch(&cfg, 3, 30 + s)).collect();
        for (weight_dtype, grad) in [(DType::F32, GradDtype::F32), (DType::BF16, GradDtype::Bf16)] {
            // (GPU-updated, held, resident, ring depth, late state downloads, early uploads)
            for (gpu, held, resident, depth, late, early) in [
                (1, 0, 0, 2, 0, 0),
                (2, 0, 0, 3, 0, 0),
                (n, 0, 0, 2, 0, 0),
                (n, n, 0, 2, 0, 0),
                (1, 1, 1, 2, 0, 0),
                (n, n, 0, 2, 1, 0),
                (n, n, 0, 3, n, 0),
                (2, n, 0, 2, 2, 0),
            ]
            .into_iter()
            .chain(if n >= 6 { early_placements(n) } else { vec![] })
            {
                let what = format!(
                    "{weight_dtype:?}/{grad:?}: {gpu} GPU-updated ({late} late, {early} early), {held} held, {resident} resident, depth {depth}"
                );
                let opts = |gpu_updated_layers| EngineOptions {
                    ring_depth: depth,
                    n_chunks: 2,
                    weight_dtype,
                    placement: Placement {
                        gpu_updated_layers,
                        late_state_downloads: if gpu_updated_layers > 0 { late } else { 0 },
                        early_state_uploads: if gpu_updated_layers > 0 { early } else { 0 },
                        held_layers: held,
                        resident_layers: resident,
                        ..Placement::default()
                    },
                    ..golden_opts()
                };
                let (l0, p0, g0, m0) = run_with(&cfg, opts(0), &batches, 0, grad);
                let (l, p, g, m) = run_with(&cfg, opts(gpu), &batches, 200, grad);
                assert_eq!(l, l0, "{what}: losses differ from host updates");
                assert_bitwise_eq(&p, &p0, &format!("{what}: params"));
                assert_bitwise_eq(&g, &g0, &format!("{what}: grads"));
                assert!(m == m0, "{what}: moments differ");
            }
        }
    }
}

#[test]
fn one_chunk_and_four_chunks_agree_to_rounding() {
    let cfg = config();
    let b = batch(&cfg, 4, 5);
    let opts = |c| EngineOptions { n_chunks: c, ..golden_opts() };
    let (l1, _, g1, _) = run(&cfg, opts(1), std::slice::from_ref(&b), 0);
    let (l4, _, g4, _) = run(&cfg, opts(4), std::slice::from_ref(&b), 200);
    let (a, c) = (f64::from_bits(l1[0]), f64::from_bits(l4[0]));
    assert!((a - c).abs() / a <= 1e-6, "loss {a} vs {c}");
    let r = compare_maps(&g4, &g1, Tolerance::F32_TIGHT);
    r.assert_ok("4 chunks vs 1 chunk");
    eprintln!(
        "SUMMARY 1 vs 4 chunks: loss rel {:.2e}, worst grad {:.2e} ({})",
        (a - c).abs() / a,
        r.worst().unwrap().rel_err(),
        r.worst().unwrap().name
    );
}

/// The loss is the mean over the non-masked targets of the whole batch, however they are spread
/// over chunks. A per-chunk mean (MegaTrain's accumulation) would weight chunk 0's two targets
/// like chunk 1's twenty-four.
#[test]
fn loss_is_normalised_by_the_global_count_of_targets() {
    let cfg = config();
    let mut b = batch(&cfg, 2, 9);
    for t in 0..b.seq {
        b.targets[t] = if t < 2 { b.input_ids[t + 1] as i64 } else { IGNORE_INDEX }; // padding
        if t + 1 < b.seq {
            b.targets[b.seq + t] = b.input_ids[b.seq + t + 1] as i64;
        }
    }
    b.targets[2 * b.seq - 1] = IGNORE_INDEX;
    assert_eq!(b.n_targets(), 2 + 11);
    let params = random_params(&cfg, 11);
    let reference = ReferenceModel::new(&cfg, &params, DType::F64).unwrap();
    let ids = Tensor::from_slice(&b.input_ids, (b.batch, b.seq), &candle_core::Device::Cpu).unwrap();
    let (ref_loss, ref_grads) = reference.loss_and_grads(&ids, &b.targets).unwrap();
    for chunks in [1, 2] {
        let store = store_with(&cfg, &params, GradDtype::F32);
        let mut e = engine(&cfg, store.clone(), EngineOptions { n_chunks: chunks, ..golden_opts() }, 0);
        let r = e.step(&b, 1e-3).unwrap();
        assert_eq!(r.n_targets, 13);
        assert!(
            (r.loss - ref_loss).abs() / ref_loss <= 1e-6,
            "{chunks} chunks: loss {} vs {ref_loss}",
            r.loss
        );
        compare_maps(&grads_of(&store), &ref_grads, Tolerance::F32_GOLDEN)
            .assert_ok(&format!("{chunks} chunks"));
    }
    // What per-chunk normalisation would have given: clearly different.
    let per_chunk: f64 = (0..2)
        .map(|s| {
            let ids = ids.narrow(0, s, 1).unwrap();
            reference.loss(&ids, &b.targets[s * b.seq..(s + 1) * b.seq]).unwrap().to_scalar::<f64>().unwrap()
        })
        .sum::<f64>()
        / 2.0;
    assert!((per_chunk - ref_loss).abs() > 1e-3, "test batch does not discriminate");
}

/// The CPU copy streams run on threads with random delays: if the compute stream did not wait
/// for an upload, it would read stale weights; if a backward did not wait for the download out
/// of its gradient buffer, it would zero the buffer under the download. Removing those waits
/// must therefore break the result — proof that the invariance tests above would catch a
/// missing wait. (On the CPU backend compute runs inline in issue order, so only races in which
/// a worker stream runs late are observable; the program tests check the other direction.)
#[test]
fn a_missing_wait_shows_up_as_a_wrong_gradient() {
    let cfg = config();
    let b = batch(&cfg, 2, 3);
    let params = random_params(&cfg, 11);
    let good = {
        let store = store_with(&cfg, &params, GradDtype::F32);
        engine(&cfg, store.clone(), golden_opts(), 0).step(&b, 1e-3).unwrap();
        grads_of(&store)
    };
    type Edit = fn(&mut mt_sched::Program);
    // Delays far longer than a tiny layer's compute even on a loaded 2-core CI machine (a race
    // window shorter than the compute it races with would pass by luck).
    let slow_h2d = CpuOptions { h2d_delay_us: 30_000, seed: 1, ..CpuOptions::default() };
    let slow_d2h = CpuOptions { d2h_delay_us: 60_000, seed: 1, ..CpuOptions::default() };
    let edits: [(&str, CpuOptions, Edit); 2] = [
        ("compute does not wait for uploads", slow_h2d, |p| {
            for i in &mut p.instrs {
                if matches!(i.op, Op::Forward { .. } | Op::Backward { .. }) {
                    i.waits.clear();
                }
            }
        }),
        ("backward does not wait for the download out of its gradient buffer", slow_d2h, |p| {
            let downloads: Vec<usize> = p
                .instrs
                .iter()
                .enumerate()
                .filter(|(_, i)| i.stream == Stream::D2H)
                .map(|(k, _)| k)
                .collect();
            for i in &mut p.instrs {
                if matches!(i.op, Op::Backward { .. }) {
                    i.waits.retain(|w| !downloads.contains(w));
                }
            }
        }),
    ];
    for (what, cpu, edit) in edits {
        let store = store_with(&cfg, &params, GradDtype::F32);
        let mut e = engine_on(&cfg, store.clone(), golden_opts(), cpu);
        match e.step_with(&b, 1e-3, edit) {
            Ok(_) => {
                let r = compare_maps(&grads_of(&store), &good, Tolerance::F32_GOLDEN);
                assert!(!r.is_ok(), "{what}: gradients still correct — the delay does not expose races");
                eprintln!(
                    "{what}: caught, worst {:.2e} ({})",
                    r.worst().unwrap().rel_err(),
                    r.worst().unwrap().name
                );
            }
            Err(err) => eprintln!("{what}: step failed instead ({err}) — also caught"),
        }
    }
}

/// A mixture of experts with the load-balancing loss (the golden Mixtral, 3 layers): ring depth,
/// kept activations, held and (exact mode) resident layers change nothing, bit for bit,
/// over two chunks and three steps (each step's router statistics are the step's own, and every
/// placement's backward adds the same load-balancing gradient).
#[test]
fn moe_placements_and_ring_depths_train_bitwise_alike() {
    let mut cfg = golden::load("mixtral").unwrap().cfg;
    cfg.num_hidden_layers = 3;
    assert!(cfg.moe.as_ref().is_some_and(|m| m.aux_coef().is_some()));
    let batches: Vec<Batch> = (0..3).map(|s| batch(&cfg, 3, 40 + s)).collect();
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        let opts = EngineOptions { n_chunks: 2, mode, ..golden_opts() };
        let (l0, p0, g0, m0) = run(&cfg, EngineOptions { ring_depth: 1, ..opts.clone() }, &batches, 100);
        // (ring depth, kept, resident, held)
        for (depth, kept, resident, held) in
            [(2, 0, 0, 0), (3, 0, 0, 0), (2, 3, 0, 0), (2, 1, 1, 1), (2, 0, 0, 3)]
        {
            if mode == OptimMode::Lean && resident > 0 {
                // A resident layer's lean-mode gradient is not written back to the store.
                continue;
            }
            let what = format!("{mode:?}, depth {depth}, {kept} kept, {resident} resident, {held} held");
            let o = EngineOptions {
                ring_depth: depth,
                placement: Placement {
                    kept_layers: kept,
                    resident_layers: resident,
                    held_layers: held,
                    ..opts.placement
                },
                ..opts.clone()
            };
            let (l, p, g, m) = run(&cfg, o, &batches, 100);
            assert_eq!(l, l0, "{what}: losses differ");
            assert_bitwise_eq(&p, &p0, &format!("{what}: params"));
            assert_bitwise_eq(&g, &g0, &format!("{what}: grads"));
            assert!(m == m0, "{what}: moments differ");
        }
    }
}

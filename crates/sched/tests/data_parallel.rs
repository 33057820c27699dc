//! Data parallel on the CPU: N ranks (threads, each its own engine over the one shared store, the
//! gradient sums through the in-memory `LocalReduce`) train as one engine with the whole batch
//! cut into the same N chunks, for N = 1..4, exact and lean modes, with clipping: the first step's
//! loss within 1e-12 and its gradients within 1e-6 (the chunk gradients are added in another
//! order), 3 steps' weights within 1e-5 (AdamW turns that rounding into update-sized element
//! differences); one rank is bitwise the plain engine. A run resumed at another rank count
//! continues the same run; the batch split and the refusals. A NaN or infinity on any one rank
//! makes every rank skip the step alike. bf16 and 8-bit moments (host path only: the ranks keep
//! no optimizer state on a device) train as one engine too.

mod common;

use mt_sched::Placement;
use std::sync::{Arc, Mutex};

use mt_core::{ModelConfig, ModelLayout, StateDtype, Unit};
use mt_sched::data_parallel::split_batch;
use mt_sched::{
    Batch, CpuBackend, CpuOptions, DataParallel, Engine, EngineOptions, Fault, LocalReduce, OptimMode, Ranks,
    SkipCause, StepReport,
};
use mt_store::{GradDtype, HostStore};
use mt_testkit::golden;
use mt_testkit::init::{random_batch, random_params};
use mt_testkit::tol::{compare_maps, Tolerance};

use common::*;

fn config() -> ModelConfig {
    let mut cfg = golden::load("llama_gqa").unwrap().cfg;
    cfg.num_hidden_layers = 3;
    cfg
}

fn batches(cfg: &ModelConfig, b: usize, n: u64) -> Vec<Batch> {
    (0..n)
        .map(|s| {
            let (input_ids, targets) = random_batch(cfg, b, 10, 40 + s, 0.2);
            Batch { batch: b, seq: 10, input_ids, targets, positions: None }
        })
        .collect()
}

/// `world` CPU ranks over `store`, each one chunk per step, copy streams randomly delayed.
fn ranks(cfg: &ModelConfig, store: &Arc<HostStore>, opts: EngineOptions, world: usize) -> Ranks<CpuBackend> {
    let reducers = Mutex::new(LocalReduce::group(world).into_iter().map(Some).collect::<Vec<_>>());
    let (c, s) = (cfg.clone(), Arc::clone(store));
    Ranks::start(cfg, world, move |rank| {
        let reduce = reducers.lock().unwrap()[rank].take().expect("each rank starts once");
        let backend = CpuBackend::new(CpuOptions::uniform(200, 3 + rank as u64));
        let mut e = Engine::new(&c, Arc::clone(&s), backend, EngineOptions { n_chunks: 1, ..opts.clone() })?;
        e.set_data_parallel(DataParallel { rank, world, lead: 0, reduce: Box::new(reduce) })?;
        Ok(e)
    })
    .unwrap()
}

/// Losses (bits) of each step, and the store after the pending update is applied.
fn train_ranks(
    cfg: &ModelConfig,
    store: &Arc<HostStore>,
    opts: &EngineOptions,
    world: usize,
    bs: &[Batch],
) -> Vec<f64> {
    let r = ranks(cfg, store, opts.clone(), world);
    let losses = bs.iter().map(|b| r.step(b, 1e-3).unwrap().loss).collect();
    r.with_rank0(|e| e.flush_pending()).unwrap().unwrap();
    losses
}

fn train_one(
    cfg: &ModelConfig,
    store: &Arc<HostStore>,
    opts: &EngineOptions,
    n_chunks: usize,
    bs: &[Batch],
) -> Vec<f64> {
    let mut e = engine(cfg, Arc::clone(store), EngineOptions { n_chunks, ..opts.clone() }, 200);
    let losses = bs.iter().map(|b| e.step(b, 1e-3).unwrap().loss).collect();
    e.flush_pending().unwrap();
    losses
}

#[test]
fn n_ranks_train_as_one_engine_with_the_whole_batch() {
    let cfg = config();
    let params = random_params(&cfg, 5);
    let bs = batches(&cfg, 4, 3);
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        let opts = EngineOptions { mode, ..golden_opts() };
        for world in 1..=4 {
            let one = store_with(&cfg, &params, GradDtype::F32);
            let l1 = train_one(&cfg, &one, &opts, world, &bs);
            let many = store_with(&cfg, &params, GradDtype::F32);
            let ln = train_ranks(&cfg, &many, &opts, world, &bs);
            // The first step's loss is the same sum of the same chunk losses; later ones see
            // weights that differ by fp32 rounding: the outer unit's head and embedding gradients
            // are added per rank and then summed, not head then embedding over all chunks.
            for (s, (a, b)) in ln.iter().zip(&l1).enumerate() {
                let bound = if s == 0 { 1e-12 } else { 1e-6 };
                assert!(
                    (a - b).abs() <= bound * b.abs(),
                    "{mode:?}, {world} ranks, step {s}: loss {a} vs {b}"
                );
            }
            let r = compare_maps(&params_of(&many), &params_of(&one), Tolerance::F32_GOLDEN);
            if world == 1 {
                mt_testkit::tol::assert_bitwise_eq(&params_of(&many), &params_of(&one), "one rank vs plain");
            }
            let worst = r.worst().map_or(0.0, |t| t.rel_err());
            // The yardstick: how far chunking alone moves one engine (whole batch in one chunk).
            let whole = store_with(&cfg, &params, GradDtype::F32);
            train_one(&cfg, &whole, &opts, 1, &bs);
            let chunking = compare_maps(&params_of(&one), &params_of(&whole), Tolerance::F32_GOLDEN);
            let chunking = chunking.worst().map_or(0.0, |t| t.rel_err());
            eprintln!("SUMMARY dp cpu {mode:?} {world} chunks vs 1 chunk, one engine: weights worst rel {chunking:.2e}");
            eprintln!("SUMMARY dp cpu {mode:?} {world} ranks: losses {ln:?} vs {l1:?}; weights worst rel {worst:.2e}");
            r.assert_ok(&format!("{mode:?}, {world} ranks vs one engine"));
            assert_eq!(many.state().step, one.state().step);
        }
    }
}

/// Two processes of two ranks each, every process over a store of its own (one process per host:
/// issue 37's hybrid), stepped on the same global batches, train as one process of the four
/// ranks over one store: the four ranks' gradients go through the same reduction, and each
/// store's lead (ranks 0 and 2) lands the same sum and applies the same update. Both stores end
/// bitwise equal to the one store, and the two processes' losses add up to its loss.
#[test]
fn processes_with_a_store_each_train_as_one_process_of_every_rank() {
    let cfg = config();
    let params = random_params(&cfg, 5);
    let bs = batches(&cfg, 4, 3);
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        let opts = EngineOptions { mode, n_chunks: 1, ..golden_opts() };
        let one = store_with(&cfg, &params, GradDtype::F32);
        let l1 = train_ranks(&cfg, &one, &opts, 4, &bs);
        let stores = [store_with(&cfg, &params, GradDtype::F32), store_with(&cfg, &params, GradDtype::F32)];
        let reducers = Arc::new(Mutex::new(LocalReduce::group(4).into_iter().map(Some).collect::<Vec<_>>()));
        let parts: Vec<Ranks<CpuBackend>> = stores
            .iter()
            .enumerate()
            .map(|(p, store)| {
                let (c, s, o, r) = (cfg.clone(), Arc::clone(store), opts.clone(), Arc::clone(&reducers));
                let first = 2 * p;
                Ranks::start_part(&cfg, first, 2, 4, move |rank| {
                    let reduce = r.lock().unwrap()[rank].take().expect("each rank starts once");
                    let backend = CpuBackend::new(CpuOptions::uniform(200, 3 + rank as u64));
                    let mut e = Engine::new(&c, Arc::clone(&s), backend, o.clone())?;
                    e.set_data_parallel(DataParallel {
                        rank,
                        world: 4,
                        lead: first,
                        reduce: Box::new(reduce),
                    })?;
                    Ok(e)
                })
                .unwrap()
            })
            .collect();
        for (k, b) in bs.iter().enumerate() {
            let losses: Vec<f64> = std::thread::scope(|sc| {
                let runs: Vec<_> = parts.iter().map(|r| sc.spawn(|| r.step(b, 1e-3).unwrap().loss)).collect();
                runs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            // Every process reports the whole batch's loss: the four ranks' shares summed in
            // rank order, as the one process sums them.
            for (p, l) in losses.iter().enumerate() {
                assert_eq!(l.to_bits(), l1[k].to_bits(), "{mode:?} step {k}, process {p}: {l} vs {}", l1[k]);
            }
        }
        // What the processes must agree on before they step is summed over every rank: here two
        // ranks a process, each adding its process's number and 1.
        let sums: Vec<Vec<f64>> = std::thread::scope(|sc| {
            let runs: Vec<_> = parts
                .iter()
                .enumerate()
                .map(|(p, r)| sc.spawn(move || r.sum_over_ranks(&[p as f64, 1.0]).unwrap()))
                .collect();
            runs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![vec![2.0, 4.0]; 2], "{mode:?}");
        // Exact mode: a loss that is not finite in the second process's share only makes both
        // processes skip the step (nothing applied: the bitwise comparison below still holds),
        // and both name the whole batch's loss, NaN, as the cause (the first's own share was
        // finite). (Lean
        // mode applies finite gradients as they land: the single-store tests cover it.)
        if mode == OptimMode::Exact {
            parts[1].with_rank0(|e| e.inject(Fault::Loss(f64::NAN))).unwrap();
            let reports: Vec<StepReport> = std::thread::scope(|sc| {
                let runs: Vec<_> = parts.iter().map(|r| sc.spawn(|| r.step(&bs[0], 1e-3).unwrap())).collect();
                runs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (p, r) in reports.iter().enumerate() {
                let skipped = r.skipped.as_ref().unwrap_or_else(|| panic!("process {p} did not skip"));
                assert!(
                    matches!(skipped.cause, SkipCause::Loss(l) if l.is_nan()),
                    "process {p}: {skipped:?}"
                );
            }
            assert_eq!((stores[0].skipped_steps(), stores[1].skipped_steps()), (1, 1));
        }
        for r in &parts {
            r.with_rank0(|e| e.flush_pending()).unwrap().unwrap();
        }
        for (p, store) in stores.iter().enumerate() {
            let what = format!("{mode:?}: process {p}'s store vs the one store");
            mt_testkit::tol::assert_bitwise_eq(&params_of(store), &params_of(&one), &what);
            assert_eq!(store.state().step, one.state().step, "{what}");
        }
    }
}

#[test]
fn gradients_and_norm_are_those_of_the_whole_batch() {
    let cfg = config();
    let params = random_params(&cfg, 6);
    let bs = batches(&cfg, 3, 1);
    let opts = golden_opts();
    let one = store_with(&cfg, &params, GradDtype::F32);
    let mut e = engine(&cfg, Arc::clone(&one), EngineOptions { n_chunks: 3, ..opts.clone() }, 0);
    let r1 = e.step(&bs[0], 1e-3).unwrap();
    let many = store_with(&cfg, &params, GradDtype::F32);
    let r = ranks(&cfg, &many, opts, 3);
    let rn = r.step(&bs[0], 1e-3).unwrap();
    compare_maps(&grads_of(&many), &grads_of(&one), Tolerance::F32_TIGHT).assert_ok("ranks vs one engine");
    assert!(
        (rn.grad_norm - r1.grad_norm).abs() <= 1e-6 * r1.grad_norm,
        "{} vs {}",
        rn.grad_norm,
        r1.grad_norm
    );
    assert_eq!((rn.n_targets, rn.n_tokens), (r1.n_targets, r1.n_tokens));
    // Only rank 0 downloads: the gradient bytes come down once.
    assert_eq!(rn.d2h_bytes, r1.d2h_bytes);
}

#[test]
fn a_run_resumed_at_another_rank_count_continues_the_same_run() {
    let cfg = config();
    let params = random_params(&cfg, 7);
    let bs = batches(&cfg, 4, 3);
    let opts = golden_opts();
    let whole = store_with(&cfg, &params, GradDtype::F32);
    train_ranks(&cfg, &whole, &opts, 2, &bs);
    let split = store_with(&cfg, &params, GradDtype::F32);
    train_ranks(&cfg, &split, &opts, 2, &bs[..2]);
    train_ranks(&cfg, &split, &opts, 4, &bs[2..]);
    let one = store_with(&cfg, &params, GradDtype::F32);
    train_one(&cfg, &one, &opts, 2, &bs);
    compare_maps(&params_of(&split), &params_of(&one), Tolerance::F32_GOLDEN)
        .assert_ok("ranks vs one engine");
    compare_maps(&params_of(&whole), &params_of(&one), Tolerance::F32_GOLDEN)
        .assert_ok("ranks vs one engine");
}

#[test]
fn a_rank_whose_share_has_no_targets_still_trains_its_share_of_nothing() {
    let cfg = config();
    let params = random_params(&cfg, 8);
    let mut b = batches(&cfg, 2, 1).remove(0);
    for t in &mut b.targets[..10] {
        *t = mt_sched::IGNORE_INDEX;
    }
    let opts = golden_opts();
    let one = store_with(&cfg, &params, GradDtype::F32);
    let l1 = train_one(&cfg, &one, &opts, 2, std::slice::from_ref(&b));
    let many = store_with(&cfg, &params, GradDtype::F32);
    let l2 = train_ranks(&cfg, &many, &opts, 2, std::slice::from_ref(&b));
    assert!((l1[0] - l2[0]).abs() <= 1e-12 * l1[0].abs());
    compare_maps(&params_of(&many), &params_of(&one), Tolerance::F32_GOLDEN).assert_ok("ranks vs one engine");
}

#[test]
fn the_split_covers_every_sequence_once_in_order() {
    let cfg = config();
    for b in 1..7 {
        let whole = batches(&cfg, b, 1).remove(0);
        for world in 1..=b {
            let parts = split_batch(&whole, world).unwrap();
            assert_eq!(parts.len(), world);
            assert!(parts.iter().all(|p| p.batch >= 1));
            let ids: Vec<u32> = parts.iter().flat_map(|p| p.input_ids.clone()).collect();
            let tg: Vec<i64> = parts.iter().flat_map(|p| p.targets.clone()).collect();
            assert_eq!((ids, tg), (whole.input_ids.clone(), whole.targets.clone()));
        }
        let err = split_batch(&whole, b + 1).unwrap_err().to_string();
        assert!(err.contains("at least the number of GPUs"), "{err}");
    }
}

#[test]
fn device_owned_optimizer_state_is_refused_with_several_ranks() {
    let cfg = config();
    let store = store_with(&cfg, &random_params(&cfg, 9), GradDtype::F32);
    for opts in [
        EngineOptions {
            placement: Placement { resident_layers: 1, ..Placement::default() },
            ..golden_opts()
        },
        EngineOptions {
            placement: Placement { resident_outer: true, ..Placement::default() },
            ..golden_opts()
        },
        EngineOptions {
            placement: Placement { gpu_updated_layers: 1, ..Placement::default() },
            ..golden_opts()
        },
    ] {
        let mut e = engine(&cfg, Arc::clone(&store), opts, 0);
        let reduce = LocalReduce::group(2).remove(0);
        let err = e
            .set_data_parallel(DataParallel { rank: 0, world: 2, lead: 0, reduce: Box::new(reduce) })
            .unwrap_err();
        assert!(err.to_string().contains("--resident-layers 0"), "{err}");
    }
    // A plain engine refuses step_rank, a rank refuses step.
    let mut e = engine(&cfg, Arc::clone(&store), golden_opts(), 0);
    let b = batches(&cfg, 2, 1).remove(0);
    assert!(e.step_rank(&b, b.n_targets(), 1e-3).unwrap_err().to_string().contains("set_data_parallel"));
    let reduce = LocalReduce::group(1).remove(0);
    e.set_data_parallel(DataParallel { rank: 0, world: 1, lead: 0, reduce: Box::new(reduce) }).unwrap();
    assert!(e.step(&b, 1e-3).unwrap_err().to_string().contains("step_rank"));
}

/// Every rank's reports of `bs` stepped by `world` ranks (threads of this test) over `store`,
/// `(k, rank, fault)` injected into `rank`'s share of step `k`; rank 0 then applies the pending
/// update. Steps are barriers, as in [`Ranks::step`]: no rank reads the store's state for a step
/// before rank 0 has written the previous step's.
fn rank_reports(
    cfg: &ModelConfig,
    store: &Arc<HostStore>,
    opts: &EngineOptions,
    world: usize,
    bs: &[Batch],
    faults: &[(usize, usize, Fault)],
) -> Vec<Vec<StepReport>> {
    let barrier = std::sync::Barrier::new(world);
    let barrier = &barrier;
    std::thread::scope(|s| {
        let handles: Vec<_> = LocalReduce::group(world)
            .into_iter()
            .enumerate()
            .map(|(rank, reduce)| {
                s.spawn(move || {
                    let backend = CpuBackend::new(CpuOptions::uniform(200, 3 + rank as u64));
                    let o = EngineOptions { n_chunks: 1, ..opts.clone() };
                    let mut e = Engine::new(cfg, Arc::clone(store), backend, o).unwrap();
                    e.set_data_parallel(DataParallel { rank, world, lead: 0, reduce: Box::new(reduce) })
                        .unwrap();
                    let reports = bs
                        .iter()
                        .enumerate()
                        .map(|(k, b)| {
                            for &(_, _, f) in faults.iter().filter(|(s, r, _)| *s == k && *r == rank) {
                                e.inject(f);
                            }
                            let part = &split_batch(b, world).unwrap()[rank];
                            let r = e.step_rank(part, b.n_targets(), 1e-3).unwrap();
                            barrier.wait();
                            r
                        })
                        .collect::<Vec<_>>();
                    if rank == 0 {
                        e.flush_pending().unwrap();
                    }
                    reports
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_non_finite_step_on_any_rank_is_skipped_by_every_rank() {
    let cfg = config();
    let params = random_params(&cfg, 11);
    let bs = batches(&cfg, 4, 3);
    let n_units = ModelLayout::new(&cfg).n_units();
    let world = 2;
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        let opts = EngineOptions { mode, ..golden_opts() };
        // The same ranks without the bad step.
        let clean = store_with(&cfg, &params, GradDtype::F32);
        rank_reports(&cfg, &clean, &opts, world, &[bs[0].clone(), bs[2].clone()], &[]);
        let faults = [Fault::Loss(f64::NAN), Fault::Gradient { unit: Unit::Layer(1), value: f32::INFINITY }];
        for fault in faults {
            // Into rank 1's share: rank 0, which writes the store, sees only the flags.
            let store = store_with(&cfg, &params, GradDtype::F32);
            let reps = rank_reports(&cfg, &store, &opts, world, &bs, &[(1, 1, fault)]);
            for (rank, r) in reps.iter().enumerate() {
                let what = format!("{mode:?}, {fault:?}, rank {rank}");
                // Every rank reports the whole batch's loss.
                assert_eq!(r[0].loss.to_bits(), reps[0][0].loss.to_bits(), "{what}");
                assert!(r[0].skipped.is_none() && r[2].skipped.is_none(), "{what}: a clean step skipped");
                let skipped = r[1].skipped.as_ref().unwrap_or_else(|| panic!("{what}: not skipped"));
                match fault {
                    Fault::Loss(_) => {
                        assert!(matches!(skipped.cause, SkipCause::Loss(x) if x.is_nan()), "{what}")
                    }
                    Fault::Gradient { .. } => {
                        assert!(matches!(skipped.cause, SkipCause::GradNorm(_)), "{what}")
                    }
                }
            }
            let landed = reps[0][1].skipped.clone().unwrap();
            match (mode, fault) {
                (OptimMode::Exact, _) => {
                    // Nothing applied: the run without the bad step, bitwise.
                    assert_eq!(landed.units_updated, 0);
                    mt_testkit::tol::assert_bitwise_eq(
                        &params_of(&store),
                        &params_of(&clean),
                        "skip vs none",
                    );
                    assert_eq!(store.state().step, clean.state().step);
                    assert_eq!(store.skipped_steps(), 1);
                }
                (_, Fault::Gradient { .. }) => {
                    // Lean: every unit but the one whose summed gradient is infinite updated.
                    assert_eq!(landed.units_updated, n_units - 1);
                    assert_eq!(landed.not_finite, vec![Unit::Layer(1)]);
                    assert_eq!(store.state().step, 3);
                }
                (_, Fault::Loss(_)) => {
                    // Lean: the gradients were finite and applied as they landed.
                    assert_eq!(landed.units_updated, n_units);
                    assert_eq!(store.state().step, 3);
                }
            }
        }
    }
    // Through `Ranks`, the cause is the whole batch's loss.
    let store = store_with(&cfg, &params, GradDtype::F32);
    let r = ranks(&cfg, &store, golden_opts(), 2);
    r.with_rank0(|e| e.inject(Fault::Loss(f64::INFINITY))).unwrap();
    let rep = r.step(&bs[0], 1e-3).unwrap();
    assert_eq!(rep.skipped.map(|s| s.cause), Some(SkipCause::Loss(f64::INFINITY)));
    assert_eq!(rep.loss, f64::INFINITY);
}

#[test]
fn bf16_and_int8_moments_train_on_ranks_as_on_one_engine() {
    let cfg = config();
    let params = random_params(&cfg, 12);
    let bs = batches(&cfg, 4, 3);
    let store = |states: StateDtype| {
        let s = HostStore::anonymous_with(&ModelLayout::new(&cfg), GradDtype::F32, states).unwrap();
        fill_store(&s, &params);
        Arc::new(s)
    };
    for states in [StateDtype::Bf16, StateDtype::Int8] {
        for mode in [OptimMode::Exact, OptimMode::Lean] {
            let opts = EngineOptions { mode, ..golden_opts() };
            let one = store(states);
            let l1 = train_one(&cfg, &one, &opts, 2, &bs);
            let many = store(states);
            let ln = train_ranks(&cfg, &many, &opts, 2, &bs);
            for (s, (a, b)) in ln.iter().zip(&l1).enumerate() {
                let bound = if s == 0 { 1e-12 } else { 1e-5 };
                assert!((a - b).abs() <= bound * b.abs(), "{states:?} {mode:?} step {s}: loss {a} vs {b}");
            }
            assert_eq!(many.state().step, one.state().step);
            assert_eq!(many.state_dtype(), states);
        }
    }
}

//! Store round trip: a file-backed store is its own checkpoint. Training stopped after step k,
//! the process gone, the store reopened: steps k+1.. continue bitwise as without the restart
//! (including the exact-mode update still pending in the store).

mod common;

use std::sync::Arc;

use mt_core::{ModelConfig, ModelLayout, Unit};
use mt_sched::{Batch, EngineOptions, OptimMode};
use mt_store::{GradDtype, HostStore};
use mt_testkit::golden;
use mt_testkit::init::{random_batch, random_params};
use mt_testkit::tol::assert_bitwise_eq;

use common::*;

fn batches(cfg: &ModelConfig) -> Vec<Batch> {
    (0..4)
        .map(|s| {
            let (input_ids, targets) = random_batch(cfg, 2, 10, 100 + s, 0.1);
            Batch { batch: 2, seq: 10, input_ids, targets, positions: None }
        })
        .collect()
}

fn moments(store: &HostStore) -> Vec<u8> {
    store
        .layout()
        .units()
        .flat_map(|u: Unit| {
            let r = store.record(u);
            r.m().iter().chain(r.v().iter()).copied().collect::<Vec<u8>>()
        })
        .collect()
}

#[test]
fn reopened_store_continues_bitwise() {
    let cfg = golden::load("qwen2_bias").unwrap().cfg;
    let layout = ModelLayout::new(&cfg);
    let params = random_params(&cfg, 3);
    let data = batches(&cfg);
    for mode in [OptimMode::Exact, OptimMode::Lean] {
        for grad in [GradDtype::F32, GradDtype::Bf16] {
            let opts = EngineOptions { mode, ..golden_opts() };
            // Uninterrupted: 4 steps in RAM.
            let straight = store_with(&cfg, &params, grad);
            let mut e = engine(&cfg, straight.clone(), opts.clone(), 100);
            let straight_losses: Vec<u64> =
                data.iter().map(|b| e.step(b, 1e-3).unwrap().loss.to_bits()).collect();
            e.flush_pending().unwrap();

            // Interrupted: 2 steps into a file, drop everything, reopen, 2 more.
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store.mt");
            let mut losses = Vec::new();
            {
                let store = HostStore::create(&path, &layout, grad).unwrap();
                fill_store(&store, &params);
                let mut e = engine(&cfg, Arc::new(store), opts.clone(), 100);
                losses.extend(data[..2].iter().map(|b| e.step(b, 1e-3).unwrap().loss.to_bits()));
                e.store().flush().unwrap();
            }
            let store = Arc::new(HostStore::open(&path, &layout).unwrap());
            assert_eq!(
                store.state().pending_update,
                mode == OptimMode::Exact,
                "{mode:?}: pending flag persisted"
            );
            let mut e = engine(&cfg, store.clone(), opts, 100);
            losses.extend(data[2..].iter().map(|b| e.step(b, 1e-3).unwrap().loss.to_bits()));
            e.flush_pending().unwrap();

            let what = format!("{mode:?}/{grad:?}");
            assert_eq!(losses, straight_losses, "{what}: losses after restart");
            assert_eq!(store.state(), straight.state(), "{what}: optimizer state");
            assert_bitwise_eq(&params_of(&store), &params_of(&straight), &format!("{what}: params"));
            assert!(moments(&store) == moments(&straight), "{what}: AdamW moments differ");
        }
    }
}

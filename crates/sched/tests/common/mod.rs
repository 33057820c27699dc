//! Shared helpers of the engine's integration tests: stores from named parameters, engines on
//! the CPU backend, and maps of the store's parameters and landed gradients.
#![allow(dead_code, unreachable_pub)]

pub mod lora_base;

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use mt_core::{ModelConfig, ModelLayout};
use mt_optim::AdamW;
use mt_sched::{Batch, CpuBackend, CpuOptions, Engine, EngineOptions, OptimMode};
use mt_store::{GradDtype, HostStore};
use mt_testkit::golden::Golden;

/// Writes every named f32 tensor into a store.
pub fn fill_store(store: &HostStore, params: &BTreeMap<String, Tensor>) {
    for (name, t) in params {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        store.write_param(name, &v).unwrap();
    }
}

/// An anonymous store holding `params`.
pub fn store_with(cfg: &ModelConfig, params: &BTreeMap<String, Tensor>, grad: GradDtype) -> Arc<HostStore> {
    let store = HostStore::anonymous(&ModelLayout::new(cfg), grad).unwrap();
    fill_store(&store, params);
    Arc::new(store)
}

/// AdamW and clipping as in scripts/make_golden.py.
pub fn golden_opts() -> EngineOptions {
    EngineOptions {
        adamw: AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
        clip: Some(1.0),
        mode: OptimMode::Exact,
        ..EngineOptions::default()
    }
}

/// An engine on the CPU backend with random copy-stream delays of up to `max_delay_us`.
pub fn engine(
    cfg: &ModelConfig,
    store: Arc<HostStore>,
    opts: EngineOptions,
    max_delay_us: u64,
) -> Engine<CpuBackend> {
    engine_on(cfg, store, opts, CpuOptions::uniform(max_delay_us, 7))
}

/// An engine on a CPU backend with the given stream delays.
pub fn engine_on(
    cfg: &ModelConfig,
    store: Arc<HostStore>,
    opts: EngineOptions,
    cpu: CpuOptions,
) -> Engine<CpuBackend> {
    Engine::new(cfg, store, CpuBackend::new(cpu), opts).unwrap()
}

fn shaped(store: &HostStore, read: impl Fn(&str) -> Vec<f32>) -> BTreeMap<String, Tensor> {
    store
        .layout()
        .all_params()
        .into_iter()
        .map(|(name, _, spec)| {
            let t = Tensor::from_vec(read(&name), spec.shape.clone(), &Device::Cpu).unwrap();
            (name, t)
        })
        .collect()
}

/// Every master parameter of the store, by HF name.
pub fn params_of(store: &HostStore) -> BTreeMap<String, Tensor> {
    shaped(store, |n| store.read_param(n).unwrap())
}

/// Every landed gradient of the store, by HF name.
pub fn grads_of(store: &HostStore) -> BTreeMap<String, Tensor> {
    shaped(store, |n| store.read_grad(n).unwrap())
}

/// The golden fixture's batch.
pub fn golden_batch(g: &Golden) -> Batch {
    Batch {
        batch: g.batch,
        seq: g.seq,
        input_ids: g.input_ids.clone(),
        targets: g.targets.clone(),
        positions: None,
    }
}

/// `n` seeded random batches of 2 x 8 tokens (10% of targets masked), seeds `seed0..seed0 + n`.
pub fn small_batches(cfg: &ModelConfig, n: u64, seed0: u64) -> Vec<Batch> {
    (0..n)
        .map(|s| {
            let (input_ids, targets) = mt_testkit::init::random_batch(cfg, 2, 8, seed0 + s, 0.1);
            Batch { batch: 2, seq: 8, input_ids, targets, positions: None }
        })
        .collect()
}

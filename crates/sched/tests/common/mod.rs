//! Shared helpers of the engine's integration tests: stores from named parameters, engines on
//! the CPU backend, and maps of the store's parameters and landed gradients.
#![allow(dead_code, unreachable_pub)]

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

/// The golden Qwen3-MoE model with its routing skewed on purpose (`qwen3_moe`'s fixture, weights
/// changed, no transformers oracle): the embedding's column 0 is the constant 4 and its column 1
/// `±4` by the token id's parity, so that every token's post-attention norm output carries both
/// with a sign known in advance; each layer's router reads column 0 as `+8` for expert 1 and
/// `-8` for expert 0 and column 1 as `±8` for experts 2 and 3. Every token routes to expert 1
/// and to expert 2 or 3 (by parity); experts 0 and 4-7 get none, with margins no rounding can
/// cross (`skewed_routing_is_as_built` checks them).
pub fn skewed_moe() -> (ModelConfig, BTreeMap<String, Tensor>, Batch) {
    let g = mt_testkit::golden::load("qwen3_moe").unwrap();
    let mut params = g.params.clone();
    let set = |t: &Tensor, f: &dyn Fn(usize, usize, f32) -> f32| {
        let (r, c) = t.dims2().unwrap();
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let v: Vec<f32> = (0..r * c).map(|i| f(i / c, i % c, v[i])).collect();
        Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()
    };
    let emb = "model.embed_tokens.weight";
    params.insert(
        emb.into(),
        set(&params[emb], &|tok, col, x| match col {
            0 => 4.0,
            1 if tok % 2 == 0 => 4.0,
            1 => -4.0,
            _ => x,
        }),
    );
    for l in 0..g.cfg.num_hidden_layers {
        // The post-attention norm's weight may flip a column's sign: the router follows it.
        let norm =
            params[&format!("model.layers.{l}.post_attention_layernorm.weight")].to_vec1::<f32>().unwrap();
        let (s0, s1) = (norm[0].signum(), norm[1].signum());
        let name = format!("model.layers.{l}.mlp.gate.weight");
        let skewed = set(&params[&name], &|e, col, x| match (e, col) {
            (1, 0) => 8.0 * s0,
            (0, 0) => -8.0 * s0,
            (2, 1) => 8.0 * s1,
            (3, 1) => -8.0 * s1,
            (_, 0 | 1) => 0.0,
            _ => x,
        });
        params.insert(name, skewed);
    }
    let batch = golden_batch(&g);
    (g.cfg, params, batch)
}

/// The skewed model's (`skewed_moe`) expert gradients in `grads`: exactly zero for the experts
/// no token reaches (0 and 4-7), not zero for experts 1-3, in every layer.
pub fn assert_skewed_experts(cfg: &ModelConfig, grads: &BTreeMap<String, Tensor>) {
    for l in 0..cfg.num_hidden_layers {
        for local in [mt_core::names::EXPERTS_GATE_UP, mt_core::names::EXPERTS_DOWN] {
            let g = &grads[&format!("model.layers.{l}.{local}")];
            let peak =
                |x: usize| g.get(x).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            for idle in [0, 4, 5, 6, 7] {
                assert_eq!(peak(idle), 0.0, "layer {l} {local}: expert {idle} gets no token");
            }
            for busy in [1, 2, 3] {
                assert!(peak(busy) > 0.0, "layer {l} {local}: expert {busy}");
            }
        }
    }
}

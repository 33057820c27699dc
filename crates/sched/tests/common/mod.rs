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

/// The golden Qwen3-MoE model with its routing skewed on purpose (`qwen3_moe`'s fixture, weights
/// changed, no transformers oracle). Columns 0 and 1 of the residual stream are made known in
/// advance: the embedding's column 0 is `C`, its column 1 `±C` by the token id's parity, and
/// every layer's `o_proj` and experts' `down_proj` rows 0 and 1 are zero, so no layer adds to
/// them; the post-attention norm (its weight 1 there) then passes their signs on in every token
/// of every layer. Each router reads column 0 as `+A` for expert 1 and `-A` for expert 0, column 1 as `±A` for experts
/// 2 and 3, and nothing else there. Every token routes to expert 1 and to expert 2 or 3 (by
/// parity); experts 0 and 4-7 get none, with margins no rounding can cross
/// (`skewed_routing_is_as_built` checks them). `C` is twice the embedding's RMS and `A` 8: the
/// activations keep their scale, so that bf16 runs stay as well conditioned as the fixture's (a
/// large constant column in the residual stream loses its small parts to bf16 rounding).
pub fn skewed_moe() -> (ModelConfig, BTreeMap<String, Tensor>, Batch) {
    let (cc, aa) = (2.0, 8.0);
    let g = mt_testkit::golden::load("qwen3_moe").unwrap();
    let mut params = g.params.clone();
    // Each element of a tensor of any rank, by (row index of its last two axes, column, value).
    let set = |t: &Tensor, f: &dyn Fn(usize, usize, f32) -> f32| {
        let dims = t.dims().to_vec();
        let (r, c) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let v: Vec<f32> = v.iter().enumerate().map(|(i, &x)| f((i / c) % r, i % c, x)).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    };
    let emb = "model.embed_tokens.weight";
    let rms = {
        let v = params[emb].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt()
    };
    let c = cc * rms;
    let column = move |tok: usize, col: usize, x: f32| match col {
        0 => c,
        1 if tok.is_multiple_of(2) => c,
        1 => -c,
        _ => x,
    };
    params.insert(emb.into(), set(&params[emb], &column));
    for l in 0..g.cfg.num_hidden_layers {
        let p = |local: &str| format!("model.layers.{l}.{local}");
        // Nothing is added to columns 0 and 1: `o_proj` `[h, q]` and `down_proj` `[E, h, f]` rows.
        for local in [mt_core::names::O, mt_core::names::EXPERTS_DOWN] {
            let zeroed = set(&params[&p(local)], &|row, _, x| if row < 2 { 0.0 } else { x });
            params.insert(p(local), zeroed);
        }
        // The post-attention norm passes columns 0 and 1 on unscaled.
        let norm = p(mt_core::names::POST_NORM);
        let unit = set(&params[&norm].unsqueeze(0).unwrap(), &|_, col, x| if col < 2 { 1.0 } else { x });
        params.insert(norm, unit.squeeze(0).unwrap());
        let skewed = set(&params[&p(mt_core::names::ROUTER)], &|e, col, x| match (e, col) {
            (1, 0) => aa,
            (0, 0) => -aa,
            (2, 1) => aa,
            (3, 1) => -aa,
            (_, 0 | 1) => 0.0,
            _ => x,
        });
        params.insert(p(mt_core::names::ROUTER), skewed);
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

/// `params` rounded to bf16 and held as f32: a perturbation of the weights of the size bf16
/// rounding makes.
pub fn rounded_to_bf16(params: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    let round = |t: &Tensor| t.to_dtype(candle_core::DType::BF16).unwrap().to_dtype(t.dtype()).unwrap();
    params.iter().map(|(n, t)| (n.clone(), round(t))).collect()
}

/// The gradient bound of a bf16 GPU run of a mixture of experts: the dense models' `dense`, or
/// twice the worst per-tensor change that rounding the weights alone to bf16 makes to an f32
/// engine's gradients (`exact`: at the weights, `rounded`: at [`rounded_to_bf16`] of them),
/// whichever is larger. A router's top-k flips where two logits are closer than rounding, and a
/// flipped token moves its experts' gradients (and, through the backward, every layer's below)
/// by its share; a bf16 GPU run rounds its activations too, so it meets such flips wherever a
/// rounding-sized change of the weights does. A well-separated router keeps the dense bound.
pub fn routing_bound(
    exact: &BTreeMap<String, Tensor>,
    rounded: &BTreeMap<String, Tensor>,
    dense: f64,
) -> f64 {
    let r = mt_testkit::tol::compare_maps(rounded, exact, mt_testkit::Tolerance { rel: f64::INFINITY });
    let worst = r.worst().map_or(0.0, |t| t.rel_err());
    (2.0 * worst).max(dense)
}

//! A LoRA run's frozen base in each encoding, shared by the CPU test (`tests/lora.rs`) and the
//! GPU one (`tests/gpu_lora.rs`): the same body on every backend.

use std::sync::Arc;

use candle_core::DType;
use mt_core::{BaseDtype, LoraConfig, ModelConfig, ModelLayout};
use mt_sched::{Backend, Engine, EngineOptions};
use mt_store::{FrozenBase, GradDtype, HostStore, ParamSink};
use mt_testkit::lora::LoraGolden;
use mt_testkit::tol::diff;

use super::{fill_store, golden_batch, golden_opts, params_of};

/// `cfg`'s base (held as its LoRA config says) with each weight `weight(name)`, and a store of
/// `g`'s initial adapters.
pub fn stores_on(
    cfg: &ModelConfig,
    weight: impl Fn(&str) -> Vec<f32>,
    g: &LoraGolden,
) -> (Arc<FrozenBase>, Arc<HostStore>) {
    let dtype = cfg.lora.as_ref().expect("a LoRA model").base;
    let base = FrozenBase::zeroed(&ModelLayout::new(&ModelConfig { lora: None, ..cfg.clone() }), dtype);
    for name in g.base.params.keys() {
        base.write_param(name, &weight(name)).unwrap();
    }
    let store = HostStore::anonymous(&ModelLayout::trainable(cfg), GradDtype::F32).unwrap();
    fill_store(&store, &g.adapters);
    (Arc::new(base), Arc::new(store))
}

/// `g`'s model with its base held as `dtype`.
pub fn held_as(g: &LoraGolden, dtype: BaseDtype) -> ModelConfig {
    let l = g.base.cfg.lora.clone().expect("a LoRA fixture");
    ModelConfig { lora: Some(LoraConfig { base: dtype, ..l }), ..g.base.cfg.clone() }
}

/// An int8 or NF4 base, staged and uploaded in its encoding and dequantised on the device
/// (`backend()`'s), is bitwise an fp32 base holding its dequantised weights on the same device:
/// the logits, three steps' losses and norms and the adapters after them, in fp32 and in bf16
/// slots, the encoded engine holding its last layer (its slot keeps the base from the first
/// step on) and the fp32 one streaming every layer. Each step uploads the bytes
/// `plan::base_bytes` prices (the encoded layers, the outer unit as weights, the adapters), fewer
/// than the fp32 base's; from the second step on the outer unit's base and the held layer's stay
/// in their slots and only their adapters go up.
pub fn an_encoded_base_trains_as_its_dequantised_weights<B: Backend>(
    g: &LoraGolden,
    backend: impl Fn() -> B,
) {
    let batch = golden_batch(&g.base);
    let weight = |name: &str| g.base.params[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for weight_dtype in [DType::F32, DType::BF16] {
        for dtype in [BaseDtype::Int8, BaseDtype::Nf4] {
            let what = format!("{dtype} base, {weight_dtype:?} slots");
            eprintln!("lora base: {what}");
            let cfg = held_as(g, dtype);
            let (base, store) = stores_on(&cfg, weight, g);
            // The same weights as the encoding holds them, in an fp32 base.
            let f32_cfg = held_as(g, BaseDtype::F32);
            let (f32_base, f32_store) = stores_on(&f32_cfg, |name| base.read_param(name).unwrap(), g);
            let opts = |b: &Arc<FrozenBase>| EngineOptions {
                frozen_base: Some(Arc::clone(b)),
                weight_dtype,
                ..golden_opts()
            };
            let mut held = opts(&base);
            held.placement.held_layers = 1;
            let mut e = Engine::new(&cfg, Arc::clone(&store), backend(), held).unwrap();
            let mut f = Engine::new(&f32_cfg, Arc::clone(&f32_store), backend(), opts(&f32_base)).unwrap();
            let (le, lf) = (e.logits(&batch).unwrap(), f.logits(&batch).unwrap());
            assert_eq!(diff(&le, &lf).unwrap().max_abs_diff, 0.0, "{what}: logits");
            let b = mt_sched::plan::base_bytes(&cfg, weight_dtype);
            let adapters = ModelLayout::trainable(&cfg).layer.len * weight_dtype.size_in_bytes();
            // The held layer goes up once a step, the others twice.
            let layers_up = (2 * cfg.num_hidden_layers as u64 - 1) * (b.layer_up + adapters as u64);
            for k in 0..3 {
                let (re, rf) = (e.step(&batch, 1e-3).unwrap(), f.step(&batch, 1e-3).unwrap());
                let bits = |r: &mt_sched::StepReport| (r.loss.to_bits(), r.grad_norm.to_bits());
                assert_eq!(bits(&re), bits(&rf), "{what}: step {k}");
                let up = if k == 0 { b.outer_up + layers_up } else { layers_up - b.layer_up };
                assert_eq!(re.h2d_bytes, up, "{what}: step {k} uploads");
                assert!(
                    re.h2d_bytes < rf.h2d_bytes,
                    "{what}: {} vs the fp32 base's {}",
                    re.h2d_bytes,
                    rf.h2d_bytes
                );
            }
            // Evaluation after the steps reads the kept outer slot (not rewritten) and the ring.
            let (le, lf) = (e.logits(&batch).unwrap(), f.logits(&batch).unwrap());
            assert_eq!(diff(&le, &lf).unwrap().max_abs_diff, 0.0, "{what}: logits after three steps");
            e.flush_pending().unwrap();
            f.flush_pending().unwrap();
            let (pe, pf) = (params_of(&store), params_of(&f32_store));
            for (name, t) in &pe {
                assert_eq!(diff(t, &pf[name]).unwrap().max_abs_diff, 0.0, "{what}: {name} after three steps");
            }
        }
    }
}

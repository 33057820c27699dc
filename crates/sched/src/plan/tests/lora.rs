//! A LoRA run priced as it runs (decisions 0044, 0048): the store, gradient buffers, landings and
//! downloads of the adapters alone, the frozen base's bytes in its encoding beside the store,
//! weight slots of the base and its adapters, uploads of the base in its encoding where the
//! device dequantises it, and no optimizer state on the device.

use super::*;
use mt_core::{BaseDtype, LoraConfig, LoraTarget};
use mt_store::{FrozenBase, TransferDtype};

/// `cfg` with rank-`r` adapters on every linear layer of the decoder.
fn with_lora(cfg: ModelConfig, r: usize) -> ModelConfig {
    with_lora_on(cfg, r, BaseDtype::F32)
}

/// `cfg` with rank-`r` adapters on every linear layer of the decoder, on a `base` base.
fn with_lora_on(cfg: ModelConfig, r: usize, base: BaseDtype) -> ModelConfig {
    let l = LoraConfig::new(r, 2.0 * r as f64, &LoraTarget::ALL, 0.0, false).unwrap();
    ModelConfig { lora: Some(LoraConfig { base, ..l }), ..cfg }
}

/// The plan's host bytes are what a LoRA run allocates: the store the trainer builds on
/// `ModelLayout::trainable` and the `FrozenBase` it imports the base into, in each encoding; its
/// fixed GPU buffers are what the pool allocates for the engine's `PoolSpec` (slots of the base
/// and adapters, gradient buffers of the adapters, the scratch buffer an encoded layer lands
/// in); its uploads are each slot's base as the engine stages it and its adapters.
#[test]
fn a_lora_plan_counts_what_a_lora_run_allocates() {
    for dtype in BaseDtype::ALL {
        a_lora_plan_counts_what_a_lora_run_allocates_on(dtype);
    }
}

fn a_lora_plan_counts_what_a_lora_run_allocates_on(dtype: BaseDtype) {
    let cfg = with_lora_on(ModelConfig::tiny_llama(), 4, dtype);
    let (slot, trainable) = (ModelLayout::new(&cfg), ModelLayout::trainable(&cfg));
    let base = FrozenBase::zeroed(&ModelLayout::new(&ModelConfig { lora: None, ..cfg.clone() }), dtype);
    // As the engine decides (bf16 slots): an int8 or NF4 layer goes up encoded, through a scratch
    // buffer of its bytes; anything else as bf16 weights.
    let layer = base.encoding(Unit::Layer(0));
    let encoded = mt_store::uploads_encoded(layer, TransferDtype::Bf16);
    assert_eq!(encoded, matches!(dtype, BaseDtype::Int8 | BaseDtype::Nf4));
    let scratch = if encoded { layer.bytes } else { 0 };
    let layer_up = if encoded { layer.bytes } else { 2 * layer.elems() } + 2 * trainable.layer.len;
    for (mode, grad) in [
        (OptimMode::Exact, GradDtype::F32),
        (OptimMode::Exact, GradDtype::Bf16),
        (OptimMode::Lean, GradDtype::None),
    ] {
        for states in StateDtype::ALL {
            let store = HostStore::anonymous_with(&trainable, grad, states).unwrap();
            let i =
                PlanInput { mode, grad_dtype: grad, state_dtype: states, ..input(cfg.clone(), 2, 16, GIB) };
            let p = plan(&i).unwrap();
            let what = format!("{dtype} {mode:?} {grad:?} {states}");
            assert_eq!(p.host.store, store.bytes() as u64, "{what}: the adapters' store");
            assert_eq!(p.host.frozen_base, base.bytes() as u64, "{what}: the frozen base");
            let (e, le) = (2, if lands_bf16(mode, grad) { 2 } else { 4 });
            let pinned =
                (2 * slot.layer.len + slot.outer.len) as u64 * e + 2 * trainable.layer.len as u64 * le;
            assert_eq!(p.host.pinned, pinned, "{what}: staging of slots, landing of the adapters");
            assert_eq!(p.host.total, p.host.store + p.host.frozen_base + p.host.pinned, "{what}");
            assert_eq!(p.trainable_params, trainable.n_params() as u64);
            assert_eq!(p.n_params, slot.n_params() as u64);

            let b = pool_bytes(&p, &i, &slot, &trainable, scratch);
            assert_eq!(b.grads as u64, p.gpu.grads, "{what}: gradient buffers");
            assert_eq!(b.weight_ring as u64, p.gpu.weight_ring, "{what}: weight ring");
            assert_eq!(b.outer as u64, p.gpu.outer, "{what}: outer slot");
            // The outer unit's base stays in its slot after the first step: its adapters (none)
            // go up.
            let up = 2 * trainable.outer.len + 2 * slot.n_layers * layer_up;
            assert_eq!(p.pcie_h2d_per_step, up as u64, "{what}: the uploads");
            // Held layers go up once a step, and from the second step on without their base.
            let held = plan(&PlanInput { placement: Placement { held_layers: Some(1), ..i.placement }, ..i })
                .unwrap();
            assert_eq!(held.placement.held_layers, 1, "{what}");
            let up = up - layer_up - (layer_up - 2 * trainable.layer.len);
            assert_eq!(held.pcie_h2d_per_step, up as u64, "{what}: the uploads with a held layer");
        }
    }
}

/// Against a full fine-tune of the same 3.6B: the host holds the base once in fp32 and the
/// adapters' training state (4 + 8 + 4 B/param of f32 master, moments, gradient), not 16 B of
/// every parameter; the downloads are the adapters' gradients; the uploads are the layers'
/// with the adapters riding in each slot, the outer unit's base not among them (it stays in its
/// slot from the first step on).
#[test]
fn a_lora_plan_prices_the_adapters_not_the_full_model() {
    let full_cfg = llama3_3b();
    let cfg = with_lora(full_cfg.clone(), 16);
    let i = |cfg: &ModelConfig| PlanInput {
        grad_dtype: GradDtype::F32,
        mode: OptimMode::Exact,
        host_bytes: 256 * GIB,
        ..input(cfg.clone(), 4, 2048, H200)
    };
    let (full, lora) = (plan(&i(&full_cfg)).unwrap(), plan(&i(&cfg)).unwrap());
    let n = ModelLayout::new(&full_cfg).n_params() as f64;
    let adapters = ModelLayout::trainable(&cfg).n_params() as f64;
    // Rank 16 on all seven linear layers: (in + out) x 16 per projection.
    let per_layer = 16 * (2 * (3072 + 3072) + 2 * (3072 + 1024) + 3 * (3072 + 8192));
    assert_eq!(adapters as usize, 28 * per_layer);
    let (store, base) = (lora.host.store as f64, lora.host.frozen_base as f64);
    assert!((16.0..16.1).contains(&(store / adapters)), "adapters' store: {} B/param", store / adapters);
    assert!((4.0..4.01).contains(&(base / n)), "frozen base: {} B/param", base / n);
    assert!((16.0..16.01).contains(&(full.host.store as f64 / n)), "full store");
    assert!(
        (lora.host.total as f64) < 0.3 * full.host.total as f64,
        "LoRA host {} vs full {}",
        lora.host.total,
        full.host.total
    );
    let streamed = 28u64;
    assert_eq!(lora.pcie_d2h_per_step, streamed * ModelLayout::trainable(&cfg).layer.len as u64 * 4);
    assert!(full.pcie_d2h_per_step > 100 * lora.pcie_d2h_per_step);
    let slot = ModelLayout::new(&cfg);
    let outer_adapters = ModelLayout::trainable(&cfg).outer.len as u64;
    assert_eq!(lora.pcie_h2d_per_step, (outer_adapters + 2 * streamed * slot.layer.len as u64) * 2);
    assert_eq!(lora.gpu.grads, 2 * ModelLayout::trainable(&cfg).layer.len as u64 * 4);
    assert!(full.gpu.grads > 100 * lora.gpu.grads);
}

/// A LoRA run keeps its adapters' optimizer state on the host: `auto` places no resident unit
/// and no GPU-updated layer even where they would fit, and asking for one is refused, naming it.
#[test]
fn a_lora_plan_keeps_no_optimizer_state_on_the_device() {
    let cfg = with_lora(ModelConfig::tiny_llama(), 4);
    let auto = PlanInput { placement: PlacementChoice::AUTO, ..input(cfg.clone(), 2, 16, GIB) };
    let p = plan(&auto).unwrap();
    assert!(!p.placement.resident_outer && p.placement.resident_layers == 0, "{p}");
    assert_eq!(p.placement.gpu_updated_layers, 0, "{p}");
    assert_eq!((p.gpu.outer_state, p.gpu.resident_layers, p.gpu.state_slots), (0, 0, 0));
    // Without LoRA the same request places optimizer state on the device.
    let full = plan(&PlanInput { cfg: ModelConfig::tiny_llama(), ..auto.clone() }).unwrap();
    assert!(full.placement.resident_outer || full.placement.resident_layers > 0, "{full}");
    for (flag, placement) in [
        ("--resident-outer", Placement { resident_outer: Some(true), ..auto.placement }),
        ("--resident-layers", Placement { resident_layers: Some(1), ..auto.placement }),
        ("--gpu-updated-layers", Placement { gpu_updated_layers: Some(1), ..auto.placement }),
    ] {
        let e = err(&PlanInput { placement, ..auto.clone() });
        assert!(e.contains(flag) && e.contains("a LoRA run"), "{flag}: {e}");
    }
}

/// A LoRA run whose frozen base does not fit the host is refused naming the base, and not sent
/// to a store file, which would page only the adapters.
#[test]
fn a_lora_base_larger_than_the_host_is_refused_naming_it() {
    let cfg = with_lora(llama3_3b(), 16);
    for store_file in [false, true] {
        let e = err(&PlanInput { host_bytes: 12 * GIB, store_file, ..input(cfg.clone(), 1, 2048, H200) });
        assert!(e.contains("+ frozen base (13.") && e.contains("needs more --host-mem"), "{e}");
        assert!(e.contains("(fp32, 4.00 B/param)") && e.contains("--base-dtype"), "{e}");
        assert!(!e.contains("--store"), "{e}");
    }
}

/// At the 3.6B shape the base costs what its encoding says: a decoder layer's matrices 4, 2,
/// 17/16 or 9/16 bytes a parameter (int8 and NF4: a byte or half a byte and an f32 scale per
/// 64), everything else (norms, embedding, LM head) bf16 under int8 and NF4; an int8 or NF4
/// layer goes up in those bytes (its adapters in bf16) through one scratch buffer of a layer's
/// encoding, the rest as bf16 weights.
#[test]
fn a_lora_plan_prices_the_base_by_its_encoding() {
    let full = llama3_3b();
    let layout = ModelLayout::new(&full);
    let per_layer_mats: usize =
        layout.layer.tensors.iter().filter(|t| t.shape.len() == 2).map(|t| t.numel()).sum();
    let (n, mats) = (layout.n_params() as u64, (28 * per_layer_mats) as u64);
    let layer_rest = (layout.layer.len - per_layer_mats) as u64;
    for (dtype, host, layer_base_up) in [
        (BaseDtype::F32, 4 * n, 2 * layout.layer.len as u64),
        (BaseDtype::Bf16, 2 * n, 2 * layout.layer.len as u64),
        (BaseDtype::Int8, mats / 16 * 17 + 2 * (n - mats), per_layer_mats as u64 / 16 * 17 + 2 * layer_rest),
        (BaseDtype::Nf4, mats / 16 * 9 + 2 * (n - mats), per_layer_mats as u64 / 16 * 9 + 2 * layer_rest),
    ] {
        let cfg = with_lora_on(full.clone(), 16, dtype);
        let p = plan(&PlanInput { host_bytes: 256 * GIB, ..input(cfg.clone(), 4, 2048, H200) }).unwrap();
        assert_eq!(p.host.frozen_base, host, "{dtype}: the base in host memory");
        let trainable = ModelLayout::trainable(&cfg);
        let layer_up = layer_base_up + 2 * trainable.layer.len as u64;
        assert_eq!(p.pcie_h2d_per_step, 2 * trainable.outer.len as u64 + 2 * 28 * layer_up, "{dtype}");
        let scratch = if layer_base_up < 2 * layout.layer.len as u64 { layer_base_up } else { 0 };
        let slots = 2 * 2 * ModelLayout::new(&cfg).layer.len as u64;
        assert_eq!(p.gpu.weight_ring, slots + scratch, "{dtype}: the ring and the scratch buffer");
        eprintln!(
            "SUMMARY 3.6B LoRA r16 base {dtype}: host {:.3} B/param, a layer's base up {:.4} B/param, H2D {:.2} GB a step",
            host as f64 / n as f64,
            layer_base_up as f64 / layout.layer.len as f64,
            p.pcie_h2d_per_step as f64 / 1e9
        );
    }
}

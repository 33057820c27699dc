//! A LoRA run priced as it runs (decision 0044): the store, gradient buffers, landings and
//! downloads of the adapters alone, the frozen base's fp32 bytes beside the store, weight slots
//! and uploads of the base and its adapters, and no optimizer state on the device.

use super::*;
use mt_core::{LoraConfig, LoraTarget};
use mt_store::FrozenBase;

/// `cfg` with rank-`r` adapters on every linear layer of the decoder.
fn with_lora(cfg: ModelConfig, r: usize) -> ModelConfig {
    ModelConfig {
        lora: Some(LoraConfig::new(r, 2.0 * r as f64, &LoraTarget::ALL, 0.0, false).unwrap()),
        ..cfg
    }
}

/// The plan's host bytes are what a LoRA run allocates: the store the trainer builds on
/// `ModelLayout::trainable` and the `FrozenBase` it imports the base into; its fixed GPU buffers
/// are what the pool allocates for the engine's `PoolSpec` (slots of the base and adapters,
/// gradient buffers of the adapters).
#[test]
fn a_lora_plan_counts_what_a_lora_run_allocates() {
    let cfg = with_lora(ModelConfig::tiny_llama(), 4);
    let (slot, trainable) = (ModelLayout::new(&cfg), ModelLayout::trainable(&cfg));
    let base = FrozenBase::zeroed(&ModelLayout::new(&ModelConfig { lora: None, ..cfg.clone() }));
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
            let what = format!("{mode:?} {grad:?} {states}");
            assert_eq!(p.host.store, store.bytes() as u64, "{what}: the adapters' store");
            assert_eq!(p.host.frozen_base, base.bytes() as u64, "{what}: the frozen base");
            let (e, le) = (2, if lands_bf16(mode, grad) { 2 } else { 4 });
            let pinned =
                (2 * slot.layer.len + slot.outer.len) as u64 * e + 2 * trainable.layer.len as u64 * le;
            assert_eq!(p.host.pinned, pinned, "{what}: staging of slots, landing of the adapters");
            assert_eq!(p.host.total, p.host.store + p.host.frozen_base + p.host.pinned, "{what}");
            assert_eq!(p.trainable_params, trainable.n_params() as u64);
            assert_eq!(p.n_params, slot.n_params() as u64);

            let b = pool_bytes(&p, &i, &slot, &trainable);
            assert_eq!(b.grads as u64, p.gpu.grads, "{what}: gradient buffers");
            assert_eq!(b.weight_ring as u64, p.gpu.weight_ring, "{what}: weight ring");
            assert_eq!(b.outer as u64, p.gpu.outer, "{what}: outer slot");
        }
    }
}

/// Against a full fine-tune of the same 3.6B: the host holds the base once in fp32 and the
/// adapters' training state (4 + 8 + 4 B/param of f32 master, moments, gradient), not 16 B of
/// every parameter; the downloads are the adapters' gradients; the uploads are unchanged but
/// for the adapters riding in each slot.
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
    assert_eq!(lora.pcie_h2d_per_step, (slot.outer.len as u64 + 2 * streamed * slot.layer.len as u64) * 2);
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
        assert!(!e.contains("--store"), "{e}");
    }
}

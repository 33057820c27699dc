//! LoRA on the streamed engine against peft + transformers (fixtures:
//! crates/testkit/fixtures/lora, made by scripts/make_lora_golden.py): the frozen base is a
//! golden fixture's weights, the adapters train. A base held in int8 or NF4 goes up encoded and
//! trains bitwise as an fp32 base of its dequantised weights would, with the uploads the plan
//! prices.

mod common;

use std::sync::Arc;

use mt_core::ModelConfig;
use mt_sched::{CpuBackend, CpuOptions, Engine, EngineOptions};
use mt_store::{FrozenBase, GradDtype, HostStore};
use mt_testkit::lora::{self, LoraGolden, LORA_NAMES};
use mt_testkit::tol::{compare_maps, diff, Tolerance};

use common::lora_base::{self, stores_on};
use common::*;

/// The base weights of `g` (fp32) and a store of its initial adapters.
fn stores(g: &LoraGolden) -> (Arc<FrozenBase>, Arc<HostStore>) {
    stores_on(&g.base.cfg, |name| g.base.params[name].flatten_all().unwrap().to_vec1::<f32>().unwrap(), g)
}

fn lora_engine(g: &LoraGolden, base: &Arc<FrozenBase>, store: &Arc<HostStore>) -> Engine<CpuBackend> {
    let opts = EngineOptions { frozen_base: Some(Arc::clone(base)), ..golden_opts() };
    engine(&g.base.cfg, Arc::clone(store), opts, 200)
}

/// Logits, loss, the adapters' gradient norm and every adapter gradient of step 0 equal peft's,
/// and the base gets no gradient (the store holds the adapters alone).
#[test]
fn adapter_gradients_match_peft() {
    for name in LORA_NAMES {
        let g = lora::load(name).unwrap();
        let (base, store) = stores(&g);
        let mut e = lora_engine(&g, &base, &store);
        let batch = golden_batch(&g.base);
        let logits = e.logits(&batch).unwrap();
        let d = diff(&logits, &g.logits).unwrap();
        assert!(Tolerance::F32_GOLDEN.accepts(d.rel_err), "{name}: logits rel err {:.3e}", d.rel_err);
        // The adapters change the model: the base's own logits are far from these.
        let off = diff(&g.base.logits, &g.logits).unwrap().rel_err;
        assert!(off > 1e-2, "{name}: the adapters barely move the logits ({off:.2e}): a weak fixture");

        let r = e.step(&batch, 1e-3).unwrap();
        let loss_rel = (r.loss - g.loss).abs() / g.loss;
        assert!(loss_rel <= 1e-6, "{name}: loss {} vs peft {} ({loss_rel:.2e})", r.loss, g.loss);
        let norm_rel = (r.grad_norm - g.grad_norms[0]).abs() / g.grad_norms[0];
        assert!(norm_rel <= 1e-5, "{name}: grad norm {} vs {}", r.grad_norm, g.grad_norms[0]);
        let grads = grads_of(&store);
        assert_eq!(grads.len(), g.grads.len(), "{name}: the store holds the adapters alone");
        let vs = compare_maps(&grads, &g.grads, Tolerance::F32_GOLDEN);
        eprintln!("{name}: adapter grads vs peft:\n{vs}");
        vs.assert_ok(&format!("{name}: adapter gradients vs peft"));
        let w = vs.worst().unwrap();
        eprintln!(
            "SUMMARY {name}: logits {:.2e}, loss {loss_rel:.2e}, norm {norm_rel:.2e}, worst adapter grad {:.2e} ({})",
            d.rel_err,
            w.rel_err(),
            w.name
        );
    }
}

/// Three exact-mode steps of AdamW (lr 1e-3, weight decay 0.1, clipping at 1) over the adapters
/// equal peft + torch.optim.AdamW, and the base is never updated.
///
/// Tolerance: every loss within 1e-6 and grad norm within 1e-5 (relative), every adapter
/// element within 1e-5 of its tensor's largest value (`Tolerance::F32_GOLDEN`, max-norm), as
/// for the full fine-tuning fixtures' gradients.
#[test]
fn three_adamw_steps_match_peft() {
    const LR: f64 = 1e-3;
    for name in LORA_NAMES {
        let g = lora::load(name).unwrap();
        let (base, store) = stores(&g);
        let before: Vec<f32> = g.base.params.keys().flat_map(|n| base.read_param(n).unwrap()).collect();
        let mut e = lora_engine(&g, &base, &store);
        let batch = golden_batch(&g.base);
        for k in 0..3 {
            let r = e.step(&batch, LR).unwrap();
            let rel = (r.loss - g.losses[k]).abs() / g.losses[k];
            assert!(rel <= 1e-6, "{name}: step {k} loss {} vs peft {} ({rel:.2e})", r.loss, g.losses[k]);
            let nrel = (r.grad_norm - g.grad_norms[k]).abs() / g.grad_norms[k];
            assert!(
                nrel <= 1e-5,
                "{name}: step {k} grad norm {} vs {} ({nrel:.2e})",
                r.grad_norm,
                g.grad_norms[k]
            );
        }
        e.flush_pending().unwrap();
        assert_eq!(store.state().step, 3);
        let vs = compare_maps(&params_of(&store), &g.step3, Tolerance::F32_GOLDEN);
        eprintln!("{name}: adapters after 3 steps vs peft:\n{vs}");
        vs.assert_ok(&format!("{name}: adapters after three AdamW steps vs peft"));
        let w = vs.worst().unwrap();
        eprintln!("SUMMARY {name}: adapters after 3 steps: worst {:.2e} ({})", w.rel_err(), w.name);
        let after: Vec<f32> = g.base.params.keys().flat_map(|n| base.read_param(n).unwrap()).collect();
        assert!(before == after, "{name}: the frozen base changed");
    }
}

/// A LoRA model without its base, or a base for a model without LoRA, is refused by a sentence.
#[test]
fn a_lora_engine_needs_its_base() {
    let g = lora::load("llama_gqa").unwrap();
    let (base, store) = stores(&g);
    let err =
        Engine::new(&g.base.cfg, Arc::clone(&store), CpuBackend::new(Default::default()), golden_opts())
            .unwrap_err()
            .to_string();
    assert!(err.contains("frozen base"), "{err}");
    let full = ModelConfig { lora: None, ..g.base.cfg.clone() };
    let full_store = store_with(&full, &g.base.params, GradDtype::F32);
    let opts = EngineOptions { frozen_base: Some(base), ..golden_opts() };
    let err =
        Engine::new(&full, full_store, CpuBackend::new(Default::default()), opts).unwrap_err().to_string();
    assert!(err.contains("without LoRA"), "{err}");
}

/// An int8 or NF4 base, staged and uploaded in its encoding and dequantised by the CPU backend,
/// is bitwise an fp32 base holding its dequantised weights, with the uploads the plan prices
/// (`common::lora_base`; `tests/gpu_lora.rs` runs the same on the GPU).
#[test]
fn an_encoded_base_trains_as_its_dequantised_weights() {
    let g = lora::load("llama_gqa").unwrap();
    lora_base::an_encoded_base_trains_as_its_dequantised_weights(&g, || {
        CpuBackend::new(CpuOptions::uniform(200, 7))
    });
}

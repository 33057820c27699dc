//! Oracle tests: the streamed engine against HF transformers' golden fixtures and against the
//! resident candle-autograd reference model, tensor by tensor.
//!
//! Fixtures: crates/testkit/fixtures/golden, made by scripts/make_golden.py.

mod common;

use candle_core::DType;
use mt_sched::EngineOptions;
use mt_store::GradDtype;
use mt_testkit::golden::{self, GOLDEN_NAMES};
use mt_testkit::tol::{compare_maps, diff, Tolerance};
use mt_testkit::ReferenceModel;

use common::*;

/// Loss, logits, the evaluation loss and every gradient of step 0 equal the HF fixture and the f64
/// reference.
#[test]
fn gradients_match_transformers_and_the_reference_model() {
    for name in GOLDEN_NAMES {
        let g = golden::load(name).unwrap();
        let store = store_with(&g.cfg, &g.params, GradDtype::F32);
        let mut e = engine(&g.cfg, store.clone(), golden_opts(), 200);
        let batch = golden_batch(&g);

        let logits = e.logits(&batch).unwrap();
        let d = diff(&logits, &g.logits).unwrap();
        assert!(Tolerance::F32_GOLDEN.accepts(d.rel_err), "{name}: logits rel err {:.3e}", d.rel_err);

        // The evaluation loss (on-device log-sum-exp, masked targets skipped) is transformers' loss.
        let (sum, n) = e.loss_sum(&batch).unwrap();
        assert_eq!(n, batch.n_targets());
        let eval_rel = (sum / n as f64 - g.loss).abs() / g.loss.abs();
        assert!(
            eval_rel <= 1e-6,
            "{name}: eval loss {} vs golden {} (rel {eval_rel:.2e})",
            sum / n as f64,
            g.loss
        );

        let report = e.step(&batch, 1e-3).unwrap();
        let loss_rel = (report.loss - g.loss).abs() / g.loss.abs();
        assert!(loss_rel <= 1e-6, "{name}: loss {} vs golden {} (rel {loss_rel:.2e})", report.loss, g.loss);
        let norm_rel = (report.grad_norm - g.grad_norms[0]).abs() / g.grad_norms[0];
        assert!(norm_rel <= 1e-5, "{name}: grad norm {} vs {}", report.grad_norm, g.grad_norms[0]);

        let grads = grads_of(&store);
        let vs_hf = compare_maps(&grads, &g.grads, Tolerance::F32_GOLDEN);
        eprintln!("{name}: engine grads vs transformers:\n{vs_hf}");
        vs_hf.assert_ok(&format!("{name}: engine vs transformers"));

        let reference = ReferenceModel::new(&g.cfg, &g.params, DType::F64).unwrap();
        let (ref_loss, ref_grads) = reference.loss_and_grads(&g.input_tensor().unwrap(), &g.targets).unwrap();
        assert!((report.loss - ref_loss).abs() / ref_loss <= 1e-6, "{name}: loss vs reference");
        let vs_ref = compare_maps(&grads, &ref_grads, Tolerance::F32_GOLDEN);
        vs_ref.assert_ok(&format!("{name}: engine vs reference model"));
        let (w_hf, w_ref) = (vs_hf.worst().unwrap(), vs_ref.worst().unwrap());
        eprintln!(
            "SUMMARY {name}: logits {:.2e}, loss {loss_rel:.2e}, worst grad vs HF {:.2e} ({}), vs reference {:.2e} ({})",
            d.rel_err,
            w_hf.rel_err(),
            w_hf.name,
            w_ref.rel_err(),
            w_ref.name
        );
    }
}

/// Three exact-mode steps (deferred, fused AdamW with global-norm clipping) reproduce
/// torch.optim.AdamW + clip_grad_norm_ on the same batch.
///
/// What is asserted, and why not "every element within 1e-5":
/// - every step's loss (≤ 1e-6 rel) and pre-clip grad norm (≤ 1e-5 rel): a wrong update, clip
///   or ordering would move the step-1 and step-2 losses far more than that;
/// - ≥ 99.5% of all parameter elements within 1e-5 of their tensor's scale, and every element
///   within 0.25·lr absolute.
///
/// Where a gradient element is comparable to AdamW's eps, m̂/(√v̂+eps) turns f32 rounding of g
/// (~1e-7·max|g|) into an O(0.1·lr) update difference (qwen3_qknorm o_proj[752]: step-0
/// gradient 1.8e-9 in torch, 5.4e-9 here, both noise), and the perturbed weights then nudge
/// later gradients. PyTorch itself in float32 misses the float64 fixture by up to 5.4e-4
/// relative after 3 steps (`scripts/make_golden.py --f32-control`: 99.952-99.997% of elements
/// within 1e-5, worst 0.042·lr); an Adam update is at most ~lr per step, so a wrong-sign update
/// (~2·lr) still fails the absolute bound, and a wrong formula fails the fraction.
#[test]
fn three_adamw_steps_match_torch() {
    const LR: f64 = 1e-3;
    for name in GOLDEN_NAMES {
        let g = golden::load(name).unwrap();
        let store = store_with(&g.cfg, &g.params, GradDtype::F32);
        let mut e = engine(&g.cfg, store.clone(), golden_opts(), 200);
        let batch = golden_batch(&g);
        for k in 0..3 {
            let r = e.step(&batch, LR).unwrap();
            let rel = (r.loss - g.losses[k]).abs() / g.losses[k];
            assert!(rel <= 1e-6, "{name}: step {k} loss {} vs torch {} ({rel:.2e})", r.loss, g.losses[k]);
            let nrel = (r.grad_norm - g.grad_norms[k]).abs() / g.grad_norms[k];
            assert!(nrel <= 1e-5, "{name}: step {k} grad norm {} vs {}", r.grad_norm, g.grad_norms[k]);
        }
        e.flush_pending().unwrap();
        assert_eq!(store.state().step, 3);
        let ours = params_of(&store);
        let (mut n, mut n_over, mut worst, mut worst_name, mut worst_abs) =
            (0usize, 0usize, 0.0f64, String::new(), 0.0f64);
        for (pname, expected) in &g.step3 {
            let a = ours[pname].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = expected.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let scale = b.iter().fold(0f64, |m, x| m.max(f64::from(x.abs())));
            for i in 0..a.len() {
                let d = f64::from((a[i] - b[i]).abs());
                n += 1;
                n_over += usize::from(d / scale > Tolerance::F32_GOLDEN.rel);
                worst_abs = worst_abs.max(d);
                if d / scale > worst {
                    (worst, worst_name) = (d / scale, format!("{pname}[{i}]"));
                }
            }
        }
        eprintln!(
            "SUMMARY {name}: params after 3 steps: {} of {n} elements within 1e-5 ({:.4}%), worst rel {worst:.2e} ({worst_name}), worst abs {:.2e}·lr",
            n - n_over,
            100.0 * (n - n_over) as f64 / n as f64,
            worst_abs / LR
        );
        assert!(n_over * 200 <= n, "{name}: {n_over} of {n} elements beyond 1e-5");
        assert!(worst_abs <= 0.25 * LR, "{name}: an element differs by {:.3e}·lr", worst_abs / LR);
    }
}

/// The GPU's default precision, on the CPU backend: bf16 weights and activations (fp32
/// statistics, fp32 gradient accumulation), small loss row blocks, 2 chunks.
///
/// Held to 3e-2 against transformers' float64 gradients: bf16 carries 8 significant bits
/// (eps 7.8e-3) and Qwen3's q/k RMSNorm amplifies it (measured worst: 2.6e-2, q_norm).
///
/// And to 2e-2 against the exact gradient of the same weights rounded to bf16
/// ([`Golden::rounded_model_grads`]): that takes out the weights' own rounding (up to 1.7e-2
/// between the two oracles) and bounds the noise of the bf16 computation alone (the worst per
/// fixture: docs/decisions/0041). The GPU engine,
/// which rounds at the same points, is within 1.3e-2 of this one on every tensor (`tests/gpu.rs`).
///
/// [`Golden::rounded_model_grads`]: mt_testkit::golden::Golden::rounded_model_grads
#[test]
fn bf16_engine_matches_transformers_within_bf16_tolerance() {
    for name in GOLDEN_NAMES {
        let g = golden::load(name).unwrap();
        let store = store_with(&g.cfg, &g.params, GradDtype::F32);
        let opts =
            EngineOptions { weight_dtype: DType::BF16, rows_per_block: 7, n_chunks: 2, ..golden_opts() };
        let mut e = engine(&g.cfg, store.clone(), opts, 100);
        let r = e.step(&golden_batch(&g), 1e-3).unwrap();
        assert!((r.loss - g.loss).abs() / g.loss <= 1e-2, "{name}: bf16 loss {} vs {}", r.loss, g.loss);
        let grads = grads_of(&store);
        let report = compare_maps(&grads, &g.grads, Tolerance { rel: 3e-2 });
        report.assert_ok(&format!("{name}: bf16 engine vs transformers"));
        let rounded =
            compare_maps(&grads, &g.rounded_model_grads(DType::BF16).unwrap(), Tolerance { rel: 2e-2 });
        rounded.assert_ok(&format!("{name}: bf16 engine vs the exact gradient of its bf16 weights"));
        let (w, wr) = (report.worst().unwrap(), rounded.worst().unwrap());
        eprintln!(
            "SUMMARY {name}: bf16 engine, worst grad {:.2e} ({}); vs its bf16 weights' exact gradient {:.2e} ({})",
            w.rel_err(),
            w.name,
            wr.rel_err(),
            wr.name
        );
    }
}

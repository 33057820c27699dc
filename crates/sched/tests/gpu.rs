//! GPU vs CPU (docs/design.md, "Oracles" 3), compiled only with the `cuda` feature and run on the
//! GPU machine: the same step program on the overlapped CUDA backend (dedicated H2D/D2H streams,
//! events, page-locked rings) must reproduce the CPU engine's loss, every gradient, and 3 steps of
//! training — fp32 within 1e-4, bf16 within 2e-2 per tensor; ring depths 1/2/3 must give the same
//! bits on the GPU; and a removed wait must break the result on the GPU too.
//! Every figure is printed (SUMMARY lines) before the bounds are asserted.
#![cfg(feature = "cuda")]

mod common;

use mt_sched::Placement;
use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use mt_sched::program::{Op, Stream};
use mt_sched::{Backend, CpuBackend, CpuOptions, CudaBackend, Engine, EngineOptions, StepReport};
use mt_store::GradDtype;
use mt_testkit::golden::{self, GOLDEN_NAMES};
use mt_testkit::tol::compare_maps;
use mt_testkit::Tolerance;

use common::*;

struct Run {
    losses: Vec<f64>,
    grads: BTreeMap<String, Tensor>,
    params: BTreeMap<String, Tensor>,
    /// The first step's report.
    first: StepReport,
}

fn run_on<B: Backend>(name: &str, backend: B, dtype: DType, ring_depth: usize) -> Run {
    run_placed(name, backend, dtype, ring_depth, (false, 0))
}

/// A run with the outer unit resident or not and this many leading layers resident.
fn run_placed<B: Backend>(
    name: &str,
    backend: B,
    dtype: DType,
    ring_depth: usize,
    (resident_outer, resident_layers): (bool, usize),
) -> Run {
    let opts = EngineOptions {
        ring_depth,
        placement: Placement { resident_outer, resident_layers, ..Placement::default() },
        ..EngineOptions::default()
    };
    run_with(name, backend, dtype, opts)
}

/// Three steps of a golden model in `dtype` over two chunks, with these placement options: the
/// losses, the first step's gradients and report, the weights after the last update.
fn run_with<B: Backend>(name: &str, backend: B, dtype: DType, placement: EngineOptions) -> Run {
    run_with_grad(name, backend, dtype, placement, GradDtype::F32)
}

/// [`run_with`] over a store keeping `grad` gradients.
fn run_with_grad<B: Backend>(
    name: &str,
    backend: B,
    dtype: DType,
    placement: EngineOptions,
    grad: GradDtype,
) -> Run {
    let g = golden::load(name).unwrap();
    run_model(&g.cfg, &g.params, &golden_batch(&g), backend, dtype, placement, grad)
}

/// [`run_with_grad`] of any model, parameters and batch.
fn run_model<B: Backend>(
    cfg: &mt_core::ModelConfig,
    params: &BTreeMap<String, Tensor>,
    batch: &mt_sched::Batch,
    backend: B,
    dtype: DType,
    placement: EngineOptions,
    grad: GradDtype,
) -> Run {
    let store = store_with(cfg, params, grad);
    let opts = EngineOptions {
        weight_dtype: dtype,
        n_chunks: 2,
        ring_depth: placement.ring_depth,
        placement: placement.placement,
        ..golden_opts()
    };
    let mut e = Engine::new(cfg, store.clone(), backend, opts).unwrap();
    let first = e.step(batch, 1e-3).unwrap();
    let mut losses = vec![first.loss];
    // Resident units' gradients reach the store when they are synced.
    e.sync_store().unwrap();
    let grads = grads_of(&store);
    for _ in 0..2 {
        losses.push(e.step(batch, 1e-3).unwrap().loss);
    }
    e.flush_pending().unwrap();
    Run { losses, grads, params: params_of(&store), first }
}

fn cpu_run(name: &str) -> Run {
    run_on(name, CpuBackend::on_device(Device::Cpu, CpuOptions::default()), DType::F32, 2)
}

/// The overlapped backend, with random delays on its issuing and optimizer threads.
fn cuda_run(name: &str, dtype: DType, ring_depth: usize, seed: u64) -> Run {
    run_on(name, CudaBackend::new(0, CpuOptions::uniform(300, seed)).unwrap(), dtype, ring_depth)
}

/// Fraction of parameter elements within `rel` of their tensor's scale, and the largest absolute
/// difference in units of lr (1e-3).
fn param_agreement(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, rel: f64) -> (f64, f64) {
    let (mut n, mut within, mut worst) = (0usize, 0usize, 0.0f64);
    for (name, eb) in b {
        let x = a[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let y = eb.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = y.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        for (p, q) in x.iter().zip(&y) {
            let d = f64::from((p - q).abs());
            n += 1;
            within += usize::from(d <= rel * scale);
            worst = worst.max(d / 1e-3);
        }
    }
    (within as f64 / n as f64, worst)
}

/// Bounds (measured on an H100: docs/decisions/0041):
/// - fp32 (true fp32 GEMMs): every step's loss ≤ 1e-6, every gradient ≤ 1e-4 per tensor, ≥ 99.5%
///   of parameters within 1e-4 after 3 steps and all within 0.25·lr (the eps-regime elements, as in
///   tests/golden.rs, differ between any two fp32 implementations);
/// - bf16 weights and activations vs the fp32 CPU engine: every step's loss ≤ 1e-3, every gradient
///   ≤ 3e-2 per tensor (the CPU bf16 engine vs transformers' fp64 needs the same: Qwen3's q/k norm).
#[test]
fn cuda_engine_matches_cpu_engine() {
    // True fp32 GEMMs (no TF32) for the fp32 comparison.
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let mut failures = Vec::new();
    for name in GOLDEN_NAMES {
        let cpu = cpu_run(name);
        for (dtype, loss_tol, grad_tol) in [(DType::F32, 1e-6, 1e-4), (DType::BF16, 1e-3, 3e-2)] {
            let r = cuda_run(name, dtype, 2, 7);
            let loss_rel: Vec<f64> =
                r.losses.iter().zip(&cpu.losses).map(|(a, b)| (a - b).abs() / b).collect();
            let grads = compare_maps(&r.grads, &cpu.grads, Tolerance { rel: grad_tol });
            let (frac, worst_lr) = param_agreement(&r.params, &cpu.params, grad_tol);
            let wg = grads.worst().unwrap();
            eprintln!(
                "SUMMARY gpu {name} {dtype:?}: losses rel [{}]; worst grad {:.2e} ({}); params after 3 steps: {:.4}% within {grad_tol:.0e}, worst {worst_lr:.3}·lr",
                loss_rel.iter().map(|x| format!("{x:.2e}")).collect::<Vec<_>>().join(", "),
                wg.rel_err(),
                wg.name,
                100.0 * frac
            );
            let params_ok = dtype != DType::F32 || (frac >= 0.995 && worst_lr <= 0.25);
            if !grads.is_ok() || loss_rel.iter().any(|x| *x > loss_tol) || !params_ok {
                failures.push(format!("{name} {dtype:?}\n{grads}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Units resident on the GPU (AdamW there, `kernels/adamw.cu`): the outer unit, one leading
/// layer, every layer. Each placement trains as the CPU engine within the same bounds as the
/// streamed GPU engine, and within rounding of the streamed GPU engine (the update kernel rounds
/// as mt-optim; only the order of a resident gradient's sum of squares differs).
#[test]
fn cuda_resident_units_match_the_cpu_and_streamed_engines() {
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let mut failures = Vec::new();
    for name in GOLDEN_NAMES {
        let cpu = cpu_run(name);
        let n = golden::load(name).unwrap().cfg.num_hidden_layers;
        for (dtype, loss_tol, grad_tol) in [(DType::F32, 1e-6, 1e-4), (DType::BF16, 1e-3, 3e-2)] {
            for placed in [(true, 0), (false, 1), (true, n)] {
                let backend = || CudaBackend::new(0, CpuOptions::uniform(300, 5)).unwrap();
                let r = run_placed(name, backend(), dtype, 2, placed);
                let streamed = run_placed(name, backend(), dtype, 2, (false, 0));
                let loss_rel: Vec<f64> =
                    r.losses.iter().zip(&cpu.losses).map(|(a, b)| (a - b).abs() / b).collect();
                let vs_streamed: f64 =
                    r.losses.iter().zip(&streamed.losses).map(|(a, b)| (a - b).abs() / b).fold(0.0, f64::max);
                let grads = compare_maps(&r.grads, &cpu.grads, Tolerance { rel: grad_tol });
                let (frac, worst_lr) = param_agreement(&r.params, &cpu.params, grad_tol);
                let (frac_s, worst_s) = param_agreement(&r.params, &streamed.params, 1e-6);
                let wg = grads.worst().unwrap();
                eprintln!(
                    "SUMMARY gpu resident (outer, layers) {placed:?} {name} {dtype:?}: losses rel to CPU [{}]; worst grad {:.2e} ({}); params {:.4}% within {grad_tol:.0e} of CPU, worst {worst_lr:.3}·lr; vs streamed GPU: losses {vs_streamed:.2e}, params {:.4}% within 1e-6, worst {worst_s:.4}·lr",
                    loss_rel.iter().map(|x| format!("{x:.2e}")).collect::<Vec<_>>().join(", "),
                    wg.rel_err(),
                    wg.name,
                    100.0 * frac,
                    100.0 * frac_s,
                );
                let params_ok = dtype != DType::F32 || (frac >= 0.995 && worst_lr <= 0.25);
                // Against the streamed GPU engine (both dtypes; in bf16 this covers the fused
                // AdamW's write of the resident slot): the same losses, parameters within rounding.
                let same_as_streamed = vs_streamed == 0.0 && frac_s >= 0.9999 && worst_s <= 1e-3;
                if !grads.is_ok() || loss_rel.iter().any(|x| *x > loss_tol) || !params_ok || !same_as_streamed
                {
                    failures.push(format!("{name} {dtype:?} {placed:?}\n{grads}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn bitwise_eq(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> bool {
    a.iter().all(|(n, x)| {
        let (x, y) = (x.flatten_all().unwrap(), b[n].flatten_all().unwrap());
        x.to_vec1::<f32>().unwrap() == y.to_vec1::<f32>().unwrap()
    })
}

/// GPU-updated streamed layers (state uploaded straight from the page-locked store record, AdamW
/// in `kernels/adamw.cu`, the bf16 weights written into the slot in the same pass, master and
/// moments downloaded back and the record marked): the same bits as every update on the host, in
/// bf16 with bf16 stored gradients (the default) and in fp32 with f32 ones, for one layer, every
/// layer, every layer held too, every layer held with its state downloaded late (in the
/// backward), and (on a six-layer variant with random weights: an early layer needs a late
/// partner `ring_depth` layers after it) states uploaded early into a free state slot in the
/// last step's backward, early layers held or not; losses of all three steps and the weights
/// after the last update, with random delays on the issuing and optimizer threads.
#[test]
fn cuda_gpu_updated_layers_train_bitwise_as_host_updates() {
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let mut failures = Vec::new();
    for name in GOLDEN_NAMES {
        let g = golden::load(name).unwrap();
        let n = g.cfg.num_hidden_layers;
        let deep = mt_core::ModelConfig { num_hidden_layers: 6, ..g.cfg.clone() };
        let deep_params = mt_testkit::init::random_params(&deep, 17);
        for (dtype, grad) in [(DType::BF16, GradDtype::Bf16), (DType::F32, GradDtype::F32)] {
            let backend = |seed| CudaBackend::new(0, CpuOptions::uniform(300, seed)).unwrap();
            let host = run_with_grad(name, backend(3), dtype, EngineOptions::default(), grad);
            let deep_run = |o: EngineOptions, seed| {
                run_model(&deep, &deep_params, &golden_batch(&g), backend(seed), dtype, o, grad)
            };
            let deep_host = deep_run(EngineOptions::default(), 3);
            for (gpu, held, late, early) in [
                (1, 0, 0, 0),
                (n, 0, 0, 0),
                (n, n, 0, 0),
                (n, n, n, 0),
                // The six-layer variant: early layers held, and not held.
                (6, 6, 2, 1),
                (6, 4, 2, 2),
            ] {
                let o = EngineOptions {
                    placement: Placement {
                        gpu_updated_layers: gpu,
                        held_layers: held,
                        late_state_downloads: late,
                        early_state_uploads: early,
                        ..Placement::default()
                    },
                    ..EngineOptions::default()
                };
                let (r, host) = if early > 0 {
                    (deep_run(o, 4 + gpu as u64), &deep_host)
                } else {
                    (run_with_grad(name, backend(4 + gpu as u64), dtype, o, grad), &host)
                };
                let same = r.losses == host.losses && bitwise_eq(&r.params, &host.params);
                eprintln!(
                    "SUMMARY gpu {name} {dtype:?} {gpu} GPU-updated, {held} held, {late} late, {early} early vs host updates: bitwise identical = {same}"
                );
                if !same {
                    failures.push(format!(
                        "{name} {dtype:?} {gpu} GPU-updated {held} held {late} late {early} early"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "differ from host updates: {}", failures.join(", "));
}

/// Ring depth changes only when copies run, never what is computed: 1, 2 and 3 slots give the
/// same bits on the GPU (bf16, random issue delays).
#[test]
fn cuda_ring_depths_are_bitwise_identical() {
    for name in ["llama_gqa", "qwen2_bias"] {
        let base = cuda_run(name, DType::BF16, 1, 1);
        for depth in [2, 3] {
            let r = cuda_run(name, DType::BF16, depth, depth as u64);
            let same = r.losses == base.losses
                && bitwise_eq(&r.grads, &base.grads)
                && bitwise_eq(&r.params, &base.params);
            eprintln!("SUMMARY gpu {name} ring depth {depth} vs 1: bitwise identical = {same}");
            assert!(same, "{name}: ring depth {depth} differs from ring depth 1");
        }
    }
}

/// With the H2D issuing thread delayed, compute that does not wait for its upload reads a slot
/// still holding another layer: the gradients must come out wrong (proof that the waits matter
/// on the GPU, and that the tests above would catch a missing one).
#[test]
fn cuda_missing_upload_wait_is_caught() {
    let name = "llama_gqa";
    let g = golden::load(name).unwrap();
    let good = cuda_run(name, DType::F32, 2, 3);
    let store = store_with(&g.cfg, &g.params, GradDtype::F32);
    let opts = EngineOptions { weight_dtype: DType::F32, n_chunks: 2, ..golden_opts() };
    let slow_h2d = CpuOptions { h2d_delay_us: 20_000, seed: 1, ..CpuOptions::default() };
    let mut e = Engine::new(&g.cfg, store.clone(), CudaBackend::new(0, slow_h2d).unwrap(), opts).unwrap();
    let r = e.step_with(&golden_batch(&g), 1e-3, |p| {
        let uploads: Vec<usize> =
            p.instrs.iter().enumerate().filter(|(_, i)| i.stream == Stream::H2D).map(|(k, _)| k).collect();
        for i in &mut p.instrs {
            if matches!(i.op, Op::Forward { .. } | Op::Backward { .. }) {
                i.waits.retain(|w| !uploads.contains(w));
            }
        }
    });
    match r {
        Ok(_) => {
            let c = compare_maps(&grads_of(&store), &good.grads, Tolerance { rel: 1e-4 });
            eprintln!("SUMMARY gpu missing upload wait: worst grad {:.2e}", c.worst().unwrap().rel_err());
            assert!(!c.is_ok(), "gradients still correct without upload waits: the test cannot see races");
        }
        Err(err) => eprintln!("SUMMARY gpu missing upload wait: step failed instead ({err}) — caught"),
    }
}

/// The evaluation loss (on-device log-sum-exp over the f32 logits) equals transformers' loss on
/// the GPU as on the CPU: fp32 within 1e-6, bf16 within 2e-2.
#[test]
fn cuda_eval_loss_matches_the_golden_loss() {
    for name in GOLDEN_NAMES {
        let g = golden::load(name).unwrap();
        for (dtype, bound) in [(DType::F32, 1e-6), (DType::BF16, 2e-2)] {
            let store = store_with(&g.cfg, &g.params, GradDtype::F32);
            let opts = EngineOptions { weight_dtype: dtype, ..golden_opts() };
            let mut e = Engine::new(&g.cfg, store, CudaBackend::new(0, CpuOptions::default()).unwrap(), opts)
                .unwrap();
            let batch = golden_batch(&g);
            let (sum, n) = e.loss_sum(&batch).unwrap();
            let rel = (sum / n as f64 - g.loss).abs() / g.loss.abs();
            eprintln!(
                "SUMMARY {name} {dtype:?}: eval loss {} vs golden {} (rel {rel:.2e})",
                sum / n as f64,
                g.loss
            );
            assert_eq!(n, batch.n_targets());
            assert!(rel <= bound, "{name} {dtype:?}: rel {rel:.2e} > {bound:.0e}");
        }
    }
}

/// The bf16 GPU engine against the CPU engine *in bf16* (the same roundings by design: the
/// kernels reproduce the candle path's bf16 sequence, and the candle attention scales its scores
/// in f32 and folds the scale into dS before rounding, as the fused softmax kernels do): what the
/// backend itself adds, apart from bf16's own error against fp32 (which the test above bounds).
/// Bound: every gradient within 2e-2 per tensor, Qwen3's q/k-norm weights included; every step's
/// loss within 1e-3; after 3 steps, at least 99.5% of the weights within 2e-2 of their tensor's
/// largest (a per-tensor bound cannot hold there: where a gradient is near zero, AdamW's first
/// steps move a weight by up to ±lr whatever its size, as between any two fp32 engines in
/// `tests/golden.rs`, so single elements differ by a few lr; the 99.5% is that test's; what an
/// H200 gave: docs/decisions/0041). Three steps on other batches leave fewer than half of the
/// weights within it (the CPU engine, bf16), so the bound is not loose. Before the candle attention rounded like the kernels (it rounded
/// `q kᵀ` to bf16, scaled, and rounded again; likewise `dS K`), Qwen3's k_norm gradient was
/// 2.29e-2 apart: its gradient is a sum over every token and head of bf16 products that largely
/// cancel, so one more rounding of dq and dk on one side showed.
///
/// Each engine is also held to 2e-2 against the exact gradient of the same bf16 weights
/// ([`Golden::rounded_model_grads`]; the CPU engine in `tests/golden.rs`).
///
/// [`Golden::rounded_model_grads`]: mt_testkit::golden::Golden::rounded_model_grads
#[test]
fn cuda_bf16_engine_matches_the_cpu_engine_in_bf16() {
    let mut failures = Vec::new();
    for name in GOLDEN_NAMES {
        let cpu = run_on(name, CpuBackend::on_device(Device::Cpu, CpuOptions::default()), DType::BF16, 2);
        let r = cuda_run(name, DType::BF16, 2, 11);
        let loss_rel: Vec<f64> = r.losses.iter().zip(&cpu.losses).map(|(a, b)| (a - b).abs() / b).collect();
        let grads = compare_maps(&r.grads, &cpu.grads, Tolerance { rel: 2e-2 });
        let qk_norm = |n: &str| n.ends_with("q_norm.weight") || n.ends_with("k_norm.weight");
        let norms = grads
            .tensors
            .iter()
            .filter(|t| qk_norm(&t.name))
            .max_by(|a, b| a.rel_err().total_cmp(&b.rel_err()));
        let (frac, worst_lr) = param_agreement(&r.params, &cpu.params, 2e-2);
        let oracle = golden::load(name).unwrap().rounded_model_grads(DType::BF16).unwrap();
        let exact = compare_maps(&r.grads, &oracle, Tolerance { rel: 2e-2 });
        let (wg, we) = (grads.worst().unwrap(), exact.worst().unwrap());
        eprintln!(
            "SUMMARY gpu bf16 vs cpu bf16 {name}: losses rel [{}]; worst grad {:.2e} ({}); q/k norm {}; weights after 3 steps {:.4}% within 2e-2, worst {worst_lr:.3}·lr; gpu vs its bf16 weights' exact gradient {:.2e} ({})",
            loss_rel.iter().map(|x| format!("{x:.2e}")).collect::<Vec<_>>().join(", "),
            wg.rel_err(),
            wg.name,
            norms.map_or("none".into(), |w| format!("{:.2e} ({})", w.rel_err(), w.name)),
            100.0 * frac,
            we.rel_err(),
            we.name
        );
        if !grads.is_ok() || frac < 0.995 || !exact.is_ok() || loss_rel.iter().any(|x| *x > 1e-3) {
            failures.push(format!("{name}: weights {:.4}% within 2e-2\n{grads}\n{exact}", 100.0 * frac));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Exact mode with bf16 store gradients narrows each streamed layer's gradient on the GPU
/// (`mt_narrow_bf16`, then `mt_sumsq_bf16`) and lands it in bf16. Against landing f32 and
/// narrowing on the host: the stored bf16 gradients must be bitwise equal (the same rounding of
/// the same f32 sums), the gradient norm equal up to the order of its sum (1e-12), and 3 steps of
/// training agree (a norm differing in its last bits may move the clip coefficient by an ulp).
#[test]
fn cuda_bf16_landing_matches_the_hosts_narrowing() {
    let name = "qwen2_bias";
    let g = golden::load(name).unwrap();
    let run = |device_narrowing: bool| {
        let store = store_with(&g.cfg, &g.params, GradDtype::Bf16);
        let opts =
            EngineOptions { weight_dtype: DType::BF16, n_chunks: 2, device_narrowing, ..golden_opts() };
        let mut e =
            Engine::new(&g.cfg, store.clone(), CudaBackend::new(0, CpuOptions::default()).unwrap(), opts)
                .unwrap();
        let batch = golden_batch(&g);
        let first = e.step(&batch, 1e-3).unwrap();
        let grads = grads_of(&store);
        let mut losses = vec![first.loss];
        for _ in 0..2 {
            losses.push(e.step(&batch, 1e-3).unwrap().loss);
        }
        (first.grad_norm, first.d2h_bytes, grads, losses)
    };
    let (dev, host) = (run(true), run(false));
    let same_grads = bitwise_eq(&dev.2, &host.2);
    let norm_rel = (dev.0 - host.0).abs() / host.0;
    let loss_rel = dev.3.iter().zip(&host.3).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
    eprintln!(
        "SUMMARY gpu bf16 landing {name}: stored grads bitwise {same_grads}; norm rel {norm_rel:.2e}; \
         D2H bytes {} vs {}; losses worst rel {loss_rel:.2e}",
        dev.1, host.1
    );
    assert!(same_grads, "bf16 gradients narrowed on the GPU differ from the host's narrowing");
    assert!(norm_rel < 1e-12, "gradient norm {} vs {}", dev.0, host.0);
    assert!(dev.1 < host.1, "bf16 landing must move fewer bytes");
    assert!(loss_rel < 1e-6, "losses {:?} vs {:?}", dev.3, host.3);
}

/// Keeping every layer's forward activations on the GPU (no recompute in the backward), and
/// holding the streamed layers' weights there from forward to backward (no re-cast, no second
/// upload), train bitwise as recomputing and re-streaming: losses, first-step gradients and the
/// weights after 3 steps, for every golden model in bf16 (the fused kernels) and fp32, streamed
/// and with a resident layer. The bytes the kept layers held equal the planner's count (the
/// fused kernels' in bf16, candle's ops' in fp32); a held layer's upload is saved.
#[test]
fn cuda_kept_activations_and_held_weights_train_bitwise_as_recompute() {
    for name in GOLDEN_NAMES {
        let g = golden::load(name).unwrap();
        let n = g.cfg.num_hidden_layers;
        let layer = mt_core::ModelLayout::new(&g.cfg).layer.len as u64;
        for dtype in [DType::BF16, DType::F32] {
            for resident_layers in [0, 1] {
                let run = |kept_layers, held_layers| {
                    let backend = CudaBackend::new(0, CpuOptions::default()).unwrap();
                    let opts = EngineOptions {
                        placement: Placement {
                            resident_layers,
                            kept_layers,
                            held_layers,
                            ..Placement::default()
                        },
                        ..EngineOptions::default()
                    };
                    run_with(name, backend, dtype, opts)
                };
                let full = run(0, 0);
                assert_eq!(full.first.kept_bytes, 0, "nothing kept without kept layers");
                let streamed = n - resident_layers;
                for (kept, held) in [(n, 0), (0, streamed), (n, streamed)] {
                    let r = run(kept, held);
                    let what =
                        format!("{name} {dtype:?} {resident_layers} resident, {kept} kept, {held} held");
                    // bf16 runs the fused kernels (the H200/H100 this test runs on: sm_90), f32
                    // candle's ops (which keep more).
                    let (e, fused) = if dtype == DType::BF16 { (2, true) } else { (4, false) };
                    let planned = kept as u64
                        * mt_layers::DecoderLayer::kept_state_bytes(
                            &g.cfg, g.batch, g.seq, e, fused, false, false,
                        );
                    let (same_losses, same_grads, same_params) = (
                        r.losses == full.losses,
                        bitwise_eq(&r.grads, &full.grads),
                        bitwise_eq(&r.params, &full.params),
                    );
                    eprintln!(
                        "SUMMARY gpu kept/held {what}: losses bitwise {same_losses}; grads bitwise {same_grads}; params bitwise {same_params}; kept {} B (plan {planned} B); H2D {} B vs {} B",
                        r.first.kept_bytes, r.first.h2d_bytes, full.first.h2d_bytes
                    );
                    assert!(same_losses, "{what}: losses {:?} vs {:?}", r.losses, full.losses);
                    assert!(same_grads, "{what}: gradients differ");
                    assert!(same_params, "{what}: weights after 3 steps differ");
                    assert_eq!(r.first.kept_bytes, planned, "{what}: kept bytes vs the planner's count");
                    assert_eq!(r.first.kept_bytes > 0, kept > 0, "{what}");
                    assert_eq!(
                        full.first.h2d_bytes - r.first.h2d_bytes,
                        held as u64 * layer * e,
                        "{what}: each held layer saves its upload"
                    );
                }
            }
        }
    }
}

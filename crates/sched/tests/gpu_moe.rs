//! The GPU engine's mixture of experts, compiled only with the `cuda` feature and run on the GPU
//! machine: the device MoE kernels (`mt_layers::MoeKernels::Device`, decision 0049) on the golden
//! MoE models (Qwen3-MoE, Mixtral, OLMoE; GPT-OSS never reaches a GPU) against the CPU engine in
//! the bounds the dense models are held to (`gpu.rs`) and against the exact gradient of their
//! bf16 weights, against the portable path on the same GPU,
//! on a skewed router (experts without a token, one with every token), bitwise across ring depths
//! and between a kept forward and the recompute; and what a kept forward holds against the
//! planner's count, which also shows which path ran (the portable one keeps other tensors).
//! Every figure is printed (SUMMARY lines) before the bounds are asserted.
#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use mt_core::ModelConfig;
use mt_layers::MoeKernels;
use mt_sched::{
    Backend, Batch, CpuBackend, CpuOptions, CudaBackend, Engine, EngineOptions, Placement, StepReport,
};
use mt_store::GradDtype;
use mt_testkit::golden;
use mt_testkit::tol::compare_maps;
use mt_testkit::{ReferenceModel, Tolerance};

use common::*;

/// The golden MoE models a GPU runs (GPT-OSS's sinks and windows are refused there).
const GPU_MOE_NAMES: [&str; 3] = ["qwen3_moe", "mixtral", "olmoe"];

struct Run {
    losses: Vec<f64>,
    grads: BTreeMap<String, Tensor>,
    params: BTreeMap<String, Tensor>,
    /// The first step's report.
    first: StepReport,
}

/// A model's parameters and batch.
struct Model {
    name: String,
    cfg: ModelConfig,
    params: BTreeMap<String, Tensor>,
    batch: Batch,
}

fn golden_model(name: &str) -> Model {
    let g = golden::load(name).unwrap();
    let batch = golden_batch(&g);
    Model { name: name.into(), cfg: g.cfg, params: g.params, batch }
}

fn skewed_model() -> Model {
    let (cfg, params, batch) = skewed_moe();
    Model { name: "qwen3_moe skewed".into(), cfg, params, batch }
}

/// Three steps of `m` in `dtype` (golden AdamW and clipping, `opts` for the rest): the losses,
/// the first step's gradients and report, the weights after the last update.
fn run<B: Backend>(m: &Model, backend: B, dtype: DType, opts: EngineOptions) -> Run {
    let store = store_with(&m.cfg, &m.params, GradDtype::F32);
    let opts = EngineOptions { weight_dtype: dtype, ..opts };
    let mut e = Engine::new(&m.cfg, store.clone(), backend, opts).unwrap();
    let first = e.step(&m.batch, 1e-3).unwrap();
    let mut losses = vec![first.loss];
    let grads = grads_of(&store);
    for _ in 0..2 {
        losses.push(e.step(&m.batch, 1e-3).unwrap().loss);
    }
    e.flush_pending().unwrap();
    Run { losses, grads, params: params_of(&store), first }
}

/// Two chunks, golden AdamW, the MoE path `kernels`.
fn opts(kernels: MoeKernels) -> EngineOptions {
    EngineOptions { n_chunks: 2, moe_kernels: kernels, ..golden_opts() }
}

fn cuda() -> CudaBackend {
    CudaBackend::new(0, CpuOptions::uniform(300, 7)).unwrap()
}

fn cpu_run(m: &Model, dtype: DType) -> Run {
    run(m, CpuBackend::on_device(Device::Cpu, CpuOptions::default()), dtype, opts(MoeKernels::Device))
}

/// The exact (f64) gradient of `m`'s loss at its weights rounded to bf16: the oracle of an engine
/// holding bf16 weights (`Golden::rounded_model_grads`, for any model).
fn rounded_exact_grads(m: &Model) -> BTreeMap<String, Tensor> {
    let rounded: BTreeMap<String, Tensor> = m
        .params
        .iter()
        .map(|(n, t)| (n.clone(), t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F64).unwrap()))
        .collect();
    let reference = ReferenceModel::new(&m.cfg, &rounded, DType::F64).unwrap();
    let ids = Tensor::from_slice(&m.batch.input_ids, (m.batch.batch, m.batch.seq), &Device::Cpu).unwrap();
    reference.loss_and_grads(&ids, &m.batch.targets).unwrap().1
}

/// Whether the device kernels apply to `cfg` in bf16 on GPU 0.
fn kernels_apply(cfg: &ModelConfig) -> bool {
    let dev = Device::new_cuda(0).unwrap();
    mt_layers::moe_kernels_apply(cfg, &dev, DType::BF16, MoeKernels::Device)
}

/// `a` against `b`: every step's loss within `loss_tol` and every first-step gradient within
/// `grad_tol` (relative, per tensor), printed; the failure, if any.
fn compare(what: &str, a: &Run, b: &Run, loss_tol: f64, grad_tol: f64) -> Option<String> {
    let loss_rel: Vec<f64> = a.losses.iter().zip(&b.losses).map(|(x, y)| (x - y).abs() / y.abs()).collect();
    let grads = compare_maps(&a.grads, &b.grads, Tolerance { rel: grad_tol });
    let worst = grads.worst().unwrap();
    let params = compare_maps(&a.params, &b.params, Tolerance { rel: grad_tol });
    let worst_p = params.worst().unwrap();
    eprintln!(
        "SUMMARY {what}: losses rel [{}]; worst grad {:.2e} ({}); params after 3 steps worst {:.2e} ({})",
        loss_rel.iter().map(|x| format!("{x:.2e}")).collect::<Vec<_>>().join(", "),
        worst.rel_err(),
        worst.name,
        worst_p.rel_err(),
        worst_p.name,
    );
    (!grads.is_ok() || loss_rel.iter().any(|x| *x > loss_tol)).then(|| format!("{what}\n{grads}"))
}

/// The device kernels train the golden MoE models and the skewed one as the CPU engine does in
/// bf16 (the same rounding of the weights): every step's loss within 1e-3, every gradient
/// within the bf16 bound per tensor, against the CPU's bf16 engine and against the exact
/// gradient of the bf16 weights. The bound is the dense models' 3e-2 (`gpu.rs`, and the CPU bf16
/// engine's, `golden_moe.rs`) or, for a router whose top-k rounding can flip, twice what
/// rounding the weights alone to bf16 moves the f32 CPU engine's gradients
/// (`common::routing_bound`; the GPU rounds its activations to bf16, the CPU's bf16 engine only
/// its weights). On the GPU in fp32 (the portable path: the kernels are bf16 only) the dense
/// fp32 bounds against the CPU's fp32, 1e-6 and 1e-4.
#[test]
fn cuda_moe_kernels_match_the_cpu_engine() {
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let mut failures = Vec::new();
    for m in GPU_MOE_NAMES.into_iter().map(golden_model).chain([skewed_model()]) {
        let name = &m.name;
        assert!(kernels_apply(&m.cfg), "{name}: the device MoE kernels should apply in bf16");
        let gpu = run(&m, cuda(), DType::BF16, opts(MoeKernels::Device));
        let cpu32 = cpu_run(&m, DType::F32);
        let rounded = Model {
            name: name.clone(),
            cfg: m.cfg.clone(),
            params: rounded_to_bf16(&m.params),
            batch: m.batch.clone(),
        };
        let bound = routing_bound(&cpu32.grads, &cpu_run(&rounded, DType::F32).grads, 3e-2);
        eprintln!("SUMMARY gpu moe {name} bf16 gradient bound {bound:.2e}");
        failures.extend(compare(
            &format!("gpu moe {name} bf16 vs cpu bf16"),
            &gpu,
            &cpu_run(&m, DType::BF16),
            1e-3,
            bound,
        ));
        let exact = compare_maps(&gpu.grads, &rounded_exact_grads(&m), Tolerance { rel: bound });
        let w = exact.worst().unwrap();
        eprintln!(
            "SUMMARY gpu moe {name} bf16 vs its bf16 weights' exact gradient: worst {:.2e} ({})",
            w.rel_err(),
            w.name
        );
        if !exact.is_ok() {
            failures.push(format!("gpu moe {name} bf16 vs the exact gradient\n{exact}"));
        }
        let gpu32 = run(&m, cuda(), DType::F32, opts(MoeKernels::Device));
        failures.extend(compare(&format!("gpu moe {name} f32 vs cpu f32"), &gpu32, &cpu32, 1e-6, 1e-4));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// On one GPU in bf16 the device kernels and the portable path (`--moe-kernels portable`) round
/// alike and differ in reduction order only: losses within 1e-3, gradients within the bf16
/// tolerance (2e-2), on the golden models and on the skewed router.
#[test]
fn cuda_moe_kernels_match_the_portable_path() {
    let mut failures = Vec::new();
    for m in GPU_MOE_NAMES.into_iter().map(golden_model).chain([skewed_model()]) {
        let device = run(&m, cuda(), DType::BF16, opts(MoeKernels::Device));
        let portable = run(&m, cuda(), DType::BF16, opts(MoeKernels::Portable));
        let what = format!("gpu moe {} device vs portable", m.name);
        failures.extend(compare(&what, &device, &portable, 1e-3, Tolerance::BF16.rel));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A skewed router (`common::skewed_moe`: every token to expert 1, none to experts 0 and 4-7):
/// the device kernels give the idle experts exactly zero gradients and the busy ones some (its
/// numbers against the CPU engine and the portable path: the tests above).
#[test]
fn cuda_moe_kernels_on_a_skewed_router() {
    let m = skewed_model();
    let gpu = run(&m, cuda(), DType::BF16, opts(MoeKernels::Device));
    assert_skewed_experts(&m.cfg, &gpu.grads);
}

fn bitwise_eq(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> bool {
    let bits = |t: &Tensor| {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    a.len() == b.len() && a.iter().all(|(k, v)| b.get(k).is_some_and(|w| bits(v) == bits(w)))
}

/// The device kernels are deterministic: ring depths 1 and 3 and a forward that keeps its
/// activations give the bits of the streamed recompute (losses, gradients, weights after 3
/// steps). What a kept forward holds is the planner's count for the device path
/// (`DecoderLayer::kept_state_bytes`, one chunk of one MLP tile), not the portable path's.
#[test]
fn cuda_moe_kernels_are_bitwise_repeatable_and_keep_what_the_planner_counts() {
    for name in GPU_MOE_NAMES {
        let m = golden_model(name);
        let n = m.cfg.num_hidden_layers;
        let one_chunk = |ring_depth, kept_layers, kernels| EngineOptions {
            n_chunks: 1,
            ring_depth,
            placement: Placement { kept_layers, ..Placement::default() },
            moe_kernels: kernels,
            ..golden_opts()
        };
        let base = run(&m, cuda(), DType::BF16, one_chunk(2, 0, MoeKernels::Device));
        for (ring, kept) in [(1, 0), (3, 0), (2, n)] {
            let r = run(&m, cuda(), DType::BF16, one_chunk(ring, kept, MoeKernels::Device));
            let same = (
                r.losses == base.losses,
                bitwise_eq(&r.grads, &base.grads),
                bitwise_eq(&r.params, &base.params),
            );
            eprintln!(
                "SUMMARY gpu moe {name} ring {ring}, {kept} kept: (losses, grads, params) bitwise {same:?}"
            );
            assert_eq!(same, (true, true, true), "{name} ring {ring}, {kept} kept");
        }
        let kept_bytes = |kernels, device| {
            let r = run(&m, cuda(), DType::BF16, one_chunk(2, n, kernels));
            let planned = n as u64
                * mt_layers::DecoderLayer::kept_state_bytes(
                    &m.cfg,
                    m.batch.batch,
                    m.batch.seq,
                    2,
                    true,
                    false,
                    device,
                );
            (r.first.kept_bytes, planned)
        };
        let (device, portable) =
            (kept_bytes(MoeKernels::Device, true), kept_bytes(MoeKernels::Portable, false));
        eprintln!("SUMMARY gpu moe {name} kept (ran, planned): device {device:?}, portable {portable:?}");
        assert_eq!(device.0, device.1, "{name}: the device path's kept bytes vs the planner's count");
        assert_eq!(portable.0, portable.1, "{name}: the portable path's kept bytes vs the planner's count");
        assert_ne!(device.1, portable.1, "{name}: the two paths keep different tensors");
    }
}

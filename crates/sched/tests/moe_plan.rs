//! The planner on a mixture of experts (the Qwen3-30B-A3B shape,
//! `bench-harness/configs/qwen3-30b-a3b.json`): every expert streams with its layer, so the
//! bytes are those of all 30.5B parameters (in the store too, with any `--optim-states`), while
//! the model FLOPs count the 3.3B a token uses.

use candle_core::DType;
use mt_core::{active_params, model_flops_per_step, ModelConfig, ModelLayout, StateDtype};
use mt_sched::plan::{layer_workspace, plan, LayerPath, PlanInput};
use mt_sched::OptimMode;
use mt_sched::Placement;
use mt_store::GradDtype;

const GIB: u64 = 1 << 30;

fn bench_config(name: &str) -> ModelConfig {
    let path = format!("{}/../../bench-harness/configs/{name}.json", env!("CARGO_MANIFEST_DIR"));
    ModelConfig::from_file(std::path::Path::new(&path)).unwrap()
}

fn qwen3_30b_a3b() -> ModelConfig {
    bench_config("qwen3-30b-a3b")
}

/// `batch` x 2048 tokens of `cfg` in bf16 on an H200 with 512 GiB of host memory, the device
/// MoE kernels, the materialised attention and whole-chunk MLPs, the placement fixed to nothing.
fn h200(cfg: &ModelConfig, batch: usize) -> PlanInput {
    PlanInput {
        cfg: cfg.clone(),
        batch,
        seq: 2048,
        weight_dtype: DType::BF16,
        grad_dtype: GradDtype::Bf16,
        state_dtype: StateDtype::F32,
        mode: OptimMode::Exact,
        gpu_bytes: 143_771_000_000,
        host_bytes: 512 * GIB,
        ring_depth: None,
        n_chunks: None,
        rows_per_block: 1024,
        fused_kernels: true,
        flash_attention: Some(false),
        hopper_attention: false,
        moe_kernels: true,
        mlp_rows: Some(0),
        store_file: false,
        host_reserved: 0,
        placement: Placement::default(),
    }
}

#[test]
fn moe_bytes_are_every_expert_and_flops_the_active_ones() {
    let cfg = qwen3_30b_a3b();
    let layout = ModelLayout::new(&cfg);
    // Hugging Face's model card: 30.5B parameters, 3.3B activated.
    let (n, active) = (layout.n_params() as f64, active_params(&cfg) as f64);
    assert!((n / 1e9 - 30.53).abs() < 0.01, "{n}");
    assert!((active / 1e9 - 3.35).abs() < 0.01, "{active}");
    let input = PlanInput {
        placement: Placement {
            resident_outer: Some(false),
            resident_layers: Some(0),
            kept_layers: Some(0),
            held_layers: Some(0),
            gpu_updated_layers: Some(0),
            late_state_downloads: None,
            early_state_uploads: None,
            spilled_checkpoints: Some(0),
        },
        ..h200(&cfg, 4)
    };
    let p = plan(&input).unwrap();
    assert_eq!(p.n_params, layout.n_params() as u64);
    assert_eq!(p.flops_per_step, model_flops_per_step(&cfg, 4, 2048));
    let t = 4.0 * 2048.0;
    let attention = 6.0 * 48.0 * 2048.0 * 2048.0 * t;
    assert!((p.flops_per_step - (6.0 * active * t + attention)).abs() < 1e3, "{}", p.flops_per_step);
    // Every layer, all 128 experts, goes up twice in bf16.
    let layers_up = 2 * 48 * layout.layer.len as u64 * 2;
    assert!(p.pcie_h2d_per_step >= layers_up, "{} < {layers_up}\n{p}", p.pcie_h2d_per_step);
    assert!(p.pcie_h2d_per_step < layers_up + 2 * layout.outer.len as u64 * 2, "{p}");

    // Every expert's master and moments are in the store: 14 / 10 / 8 B/param of all 30.5B with
    // fp32 / bf16 / 8-bit moments (bf16 gradients; the 8-bit scales add 8 / 256).
    for (states, want) in StateDtype::ALL.into_iter().zip([14.0, 10.0, 8.0 + 8.0 / 256.0]) {
        let b = plan(&PlanInput { state_dtype: states, ..input.clone() }).unwrap().host.store as f64 / n;
        assert!((b - want).abs() < 1e-3, "{states}: {b} B/param");
    }
}

/// The device MoE kernels' tensors over an MLP tile of `t` tokens (`R = t·k` routed rows), one
/// by one, in bf16 (`e` = 2) where they are bf16: the router logits and its f32 probabilities
/// `[t, E]`; per routed row its expert, weight, sort rank, permuted row and slot (4 B each); the
/// sort's per-chunk `[E]` counts and bases, the counts and offsets; `gu [R, 2f]` and `mid [R, f]`
/// (kept for the backward); the backward's `dys [R, h]`, `d_mid [R, f]`, the f32 partials
/// `[R, ceil(f / 128)]`, the f64 routing weights' gradient `[R]`, `dgu [R, 2f]`, the dX product
/// `[R, h]`, `dlogit [t, E]`, and the router's and the combined `dc [t, h]`.
fn device_moe_tensors(cfg: &ModelConfig, t: u64) -> u64 {
    let m = cfg.moe.as_ref().unwrap();
    let (ne, k, h, f) = (
        m.num_experts as u64,
        m.num_experts_per_tok as u64,
        cfg.hidden_size as u64,
        m.moe_intermediate_size as u64,
    );
    let r = t * k;
    let routing = [t * ne * 2, t * ne * 4, 5 * r * 4, 2 * r.div_ceil(1024) * ne * 4, ne * 4, (ne + 1) * 4];
    let saved = [r * 2 * f * 2, r * f * 2];
    let backward = [
        r * h * 2,
        r * f * 2,
        r * f.div_ceil(128) * 4,
        r * 8,
        r * 2 * f * 2,
        r * h * 2,
        t * ne * 2,
        2 * t * h * 2,
    ];
    routing.iter().chain(&saved).chain(&backward).sum()
}

/// OLMoE-1B-7B and Qwen3-30B-A3B on the device MoE kernels: a layer's workspace as the planner
/// prices it is what the portable path's costs without its own MLP tensors (`9 x [rows, k·f]`
/// and the router's f32 `[rows, E]`, `plan::layer_workspace`) plus at least every tensor the
/// kernels hold (`device_moe_tensors`), for whole chunks and tiles; and a plan says which path it
/// priced.
#[test]
fn the_planner_prices_the_device_moe_kernels_tensors() {
    for cfg in [bench_config("olmoe-1b-7b"), qwen3_30b_a3b()] {
        let m = cfg.moe.clone().unwrap();
        let trainable = ModelLayout::trainable(&cfg);
        for (b, s, mlp_rows) in [(16, 2048, 0), (4, 2048, 0), (16, 2048, 8192), (1, 4096, 1024)] {
            let path =
                |moe_kernels| LayerPath { fused: true, flash: true, hopper: true, moe_kernels, mlp_rows };
            let device = layer_workspace(&cfg, &trainable, b, s, 2, path(true));
            let portable = layer_workspace(&cfg, &trainable, b, s, 2, path(false));
            let rows = if mlp_rows == 0 { (b * s) as u64 } else { mlp_rows as u64 };
            let portable_mlp = 2 * rows * 9 * (m.num_experts_per_tok * m.moe_intermediate_size) as u64
                + rows * m.num_experts as u64 * 4;
            let listed = device_moe_tensors(&cfg, rows);
            assert!(
                device >= portable - portable_mlp + listed,
                "{b} x {s}, tiles of {mlp_rows}: {device} < {} + {listed}",
                portable - portable_mlp
            );
            // Not grossly more: the listed tensors are the whole of it.
            assert!(device <= portable - portable_mlp + listed + listed / 10, "{b} x {s}: {device}");
        }
        let input = PlanInput {
            flash_attention: None,
            hopper_attention: true,
            mlp_rows: None,
            placement: Placement::default(),
            ..h200(&cfg, 16)
        };
        let p = plan(&input).unwrap();
        let rows = if p.mlp_rows == 0 { (p.seqs_per_chunk * 2048) as u64 } else { p.mlp_rows as u64 };
        assert!(p.moe_kernels, "{p}");
        assert!(p.gpu.workspace >= device_moe_tensors(&cfg, rows), "{p}");
        assert!(p.to_string().contains("device MoE kernels"), "{p}");
        let portable = plan(&PlanInput { moe_kernels: false, ..input }).unwrap();
        assert!(!portable.moe_kernels && !portable.to_string().contains("MoE kernels"), "{portable}");
    }
}

//! The planner on a mixture of experts (the Qwen3-30B-A3B shape,
//! `bench-harness/configs/qwen3-30b-a3b.json`): every expert streams with its layer, so the
//! bytes are those of all 30.5B parameters (in the store too, with any `--optim-states`), while
//! the model FLOPs count the 3.3B a token uses.

use candle_core::DType;
use mt_core::{active_params, model_flops_per_step, ModelConfig, ModelLayout, StateDtype};
use mt_sched::plan::{plan, PlanInput};
use mt_sched::OptimMode;
use mt_sched::Placement;
use mt_store::GradDtype;

const GIB: u64 = 1 << 30;

fn qwen3_30b_a3b() -> ModelConfig {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench-harness/configs/qwen3-30b-a3b.json");
    ModelConfig::from_file(std::path::Path::new(path)).unwrap()
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
        cfg: cfg.clone(),
        batch: 4,
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
        mlp_rows: Some(0),
        store_file: false,
        host_reserved: 0,
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

//! The placement table (`Plan::placement_table`) and the plan as a run prints it: every decoder layer
//! once, picked as the step program picks them, and in the words of the run's device.

use candle_core::DType;
use mt_core::ModelConfig;
use mt_sched::placement::{DeviceKind, LayerPlacement, StateMove, Update, Weights};
use mt_sched::plan::{plan, PlanInput};
use mt_sched::OptimMode;
use mt_sched::Placement;
use mt_store::GradDtype;

const GIB: u64 = 1 << 30;

/// An H200's memory as the driver reports it, and 128 GiB of host memory.
fn input(cfg: ModelConfig, batch: usize, seq: usize, gpu_bytes: u64) -> PlanInput {
    PlanInput {
        cfg,
        batch,
        seq,
        weight_dtype: DType::BF16,
        grad_dtype: GradDtype::Bf16,
        state_dtype: mt_core::StateDtype::F32,
        mode: OptimMode::Exact,
        gpu_bytes,
        host_bytes: 128 * GIB,
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
        placement: Placement {
            resident_outer: Some(false),
            resident_layers: Some(0),
            kept_layers: Some(0),
            held_layers: None,
            gpu_updated_layers: None,
            late_state_downloads: None,
            early_state_uploads: None,
            spilled_checkpoints: Some(0),
        },
    }
}

/// The 3.6B at 4 x 2048 with every layer streamed and the rest automatic: all 28 held, 14
/// updated on the GPU, 5 of them downloading late and 5 uploading early, as the planner's tests
/// find; the CPU backend's plan speaks of neither a GPU nor PCIe.
#[test]
fn the_placement_table_lists_each_layer_once_in_the_words_of_its_device() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench-harness/configs/llama3-3.6b.json");
    let cfg = ModelConfig::from_file(std::path::Path::new(path)).unwrap();
    let p = plan(&input(cfg, 4, 2048, 143_771_000_000)).unwrap();
    let t = p.placement_table();
    assert_eq!(t.layers.len(), 28);
    let count = |f: &dyn Fn(&LayerPlacement) -> bool| t.layers.iter().filter(|l| f(l)).count();
    assert_eq!(count(&|l| l.weights == Weights::Held), 28, "{p}");
    assert_eq!(count(&|l| l.update == Update::Device), 14, "{p}");
    assert_eq!(count(&|l| l.state == StateMove::BackInBackward), 5, "{p}");
    assert_eq!(count(&|l| l.state == StateMove::UpInBackward), 5, "{p}");
    let rows: usize = t.groups().iter().map(|(_, layers)| layers.len()).sum();
    assert_eq!(rows, 28, "each layer in exactly one row");
    let gpu = p.to_string();
    assert!(gpu.contains("placement of 28 decoder layers") && gpu.contains("PCIe per step"), "{gpu}");

    // As a CPU run asks: nothing placed on the "device" (its buffers are host memory).
    let none = Some(0);
    let cpu = PlanInput {
        placement: Placement {
            held_layers: none,
            gpu_updated_layers: none,
            late_state_downloads: none,
            early_state_uploads: none,
            ..input(ModelConfig::tiny_llama(), 4, 16, GIB).placement
        },
        ..input(ModelConfig::tiny_llama(), 4, 16, GIB)
    };
    let cpu = plan(&cpu).unwrap();
    let s = cpu.display_on(DeviceKind::Cpu).to_string();
    assert!(s.contains("0-3     streamed (up twice)  recomputed   host   host store"), "{s}");
    assert!(s.contains("device buffers (in host memory): ring 0.69 MiB | "), "{s}");
    assert!(!s.contains("GPU") && !s.contains("PCIe"), "{s}");
}

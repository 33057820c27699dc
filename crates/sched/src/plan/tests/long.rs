//! The planner at long sequences: flash attention where it runs, MLP tiles, spilled checkpoints
//! and their host memory, and refusals that name the missing bytes.

use candle_core::DType;
use mt_core::ModelConfig;
use mt_store::GradDtype;

use super::*;

const GIB: u64 = 1 << 30;
/// An H200's memory as CUDA reports it (139.8 GiB), and an H100's (79.1 GiB).
const H200: u64 = 150_110_011_392;
const H100: u64 = 84_934_656_000;

/// The Qwen2.5-7B shape (hidden 3584, 28 layers, 28 / 4 heads, FFN 18944, vocab 152064).
fn qwen7b() -> ModelConfig {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(
        &path,
        r#"{"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
            "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
            "vocab_size": 152064, "max_position_embeddings": 1010000, "rms_norm_eps": 1e-6,
            "rope_theta": 10000000.0, "tie_word_embeddings": false, "hidden_act": "silu"}"#,
    )
    .unwrap();
    ModelConfig::from_file(&path).unwrap()
}

fn input(seq: usize, gpu_bytes: u64, host_gib: u64, mode: OptimMode) -> PlanInput {
    PlanInput {
        cfg: qwen7b(),
        batch: 1,
        seq,
        weight_dtype: DType::BF16,
        grad_dtype: if mode == OptimMode::Lean { GradDtype::None } else { GradDtype::Bf16 },
        state_dtype: mt_core::StateDtype::F32,
        mode,
        gpu_bytes,
        host_bytes: host_gib * GIB,
        ring_depth: None,
        n_chunks: None,
        rows_per_block: 4096,
        fused_kernels: true,
        flash_attention: None,
        hopper_attention: false,
        moe_kernels: true,
        mlp_rows: None,
        store_file: false,
        host_reserved: 0,
        placement: Placement {
            resident_outer: None,
            resident_layers: None,
            kept_layers: None,
            held_layers: None,
            gpu_updated_layers: None,
            late_state_downloads: None,
            early_state_uploads: None,
            spilled_checkpoints: None,
        },
    }
}

/// Auto picks flash wherever it runs and MLP tiles of 8192 rows for long chunks; the
/// materialised attention at 128k needs `b·heads·s²·8` bytes of scores and is refused, naming
/// them; flash asked where it cannot run is refused, saying why.
#[test]
fn long_sequences_take_flash_attention_and_mlp_tiles() {
    let p = plan(&input(131072, H200, 120, OptimMode::Exact)).unwrap();
    assert!(p.flash_attention && p.mlp_rows == 8192 && p.placement.spilled_checkpoints == 0, "{p}");
    assert!(p.gpu.total <= p.gpu.budget);
    let e = plan(&PlanInput { flash_attention: Some(false), ..input(131072, H200, 120, OptimMode::Exact) })
        .unwrap_err()
        .to_string();
    assert!(e.contains("workspace of a chunk of 1 x 131072 tokens") && e.contains("GiB more than"), "{e}");
    let e = plan(&PlanInput {
        fused_kernels: false,
        flash_attention: Some(true),
        ..input(4096, H200, 120, OptimMode::Exact)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("flash attention asked") && e.contains("bf16"), "{e}");
    // Short chunks stay whole.
    let short = plan(&PlanInput { batch: 4, ..input(2048, H200, 120, OptimMode::Exact) }).unwrap();
    assert_eq!(short.mlp_rows, 0);
}

/// 512k tokens: checkpoints of every boundary (29 x 3.5 GiB) do not fit an H200 beside the
/// workspace; the planner spills the fewest that make it fit and counts their page-locked host
/// memory, which exact mode's 14 B/param store leaves no room for on a 120 GiB host (refused,
/// naming the bytes) and lean mode's 12 does. On an H100, 256k spills too.
#[test]
fn checkpoints_spill_to_host_memory_when_the_gpu_is_short() {
    let e = plan(&input(524288, H200, 120, OptimMode::Exact)).unwrap_err().to_string();
    assert!(
        e.contains("checkpoints spilled to host memory") && e.contains("more than the host's 120.00 GiB"),
        "{e}"
    );
    let p = plan(&input(524288, H200, 120, OptimMode::Lean)).unwrap();
    let cp = 524288 * 3584 * 2;
    assert!(p.placement.spilled_checkpoints > 0 && p.placement.spilled_checkpoints < 28, "{p}");
    assert_eq!(p.host.spilled_checkpoints, p.placement.spilled_checkpoints as u64 * cp);
    assert!(p.host.total <= 120 * GIB && p.gpu.total <= p.gpu.budget, "{p}");
    // The device keeps the others, the one on its way down and the two reload buffers.
    assert_eq!(p.gpu.checkpoints, (28 + 2 - p.placement.spilled_checkpoints as u64 + 2) * cp);
    // One fewer would not fit.
    let fewer = PlanInput {
        placement: Placement {
            spilled_checkpoints: Some(p.placement.spilled_checkpoints - 1),
            ..input(524288, H200, 120, OptimMode::Lean).placement
        },
        ..input(524288, H200, 120, OptimMode::Lean)
    };
    assert!(plan(&fewer).is_err());
    // Kept activations and spilled checkpoints exclude each other.
    let both = PlanInput {
        placement: Placement { kept_layers: Some(1), ..input(524288, H200, 120, OptimMode::Lean).placement },
        ..input(524288, H200, 120, OptimMode::Lean)
    };
    assert!(plan(&both).unwrap_err().to_string().contains("use one or the other"));
    let h100 = plan(&input(262144, H100, 120, OptimMode::Exact)).unwrap();
    assert!(h100.placement.spilled_checkpoints > 0 && h100.gpu.total <= h100.gpu.budget, "{h100}");
    let e = plan(&PlanInput {
        placement: Placement {
            spilled_checkpoints: Some(29),
            ..input(4096, H200, 120, OptimMode::Exact).placement
        },
        ..input(4096, H200, 120, OptimMode::Exact)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("29 spilled checkpoints asked of a 28-layer model"), "{e}");
}

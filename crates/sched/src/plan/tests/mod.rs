//! Tests of the planner: byte accounting against the store and the step program, closed-form
//! numbers for a Llama-3-shaped 3.6B model, and the choice (or refusal) of a chunking; the
//! helpers the planner's other tests share. One file per concern beside it: residency
//! (`resident.rs`), what else a plan places on the GPU (`placed.rs`), long sequences
//! (`long.rs`), the disk tier (`paging.rs`), the moments' precision (`states.rs`), the
//! optimizer's work (`update.rs`), LoRA (`lora.rs`).

use super::*;
use crate::program::ProgramSpec;
use crate::Program;
use mt_core::{ModelLayout, Unit};
use mt_store::HostStore;

pub(super) const GIB: u64 = 1 << 30;
pub(super) const H200: u64 = 143_771_000_000;

/// Llama-3-shaped 3.6B (untied), as an HF config.json.
pub(super) fn llama3_3b() -> ModelConfig {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(
        &path,
        r#"{"model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192,
            "vocab_size": 128256, "tie_word_embeddings": false, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}"#,
    )
    .unwrap();
    ModelConfig::from_file(&path).unwrap()
}

pub(super) fn input(cfg: ModelConfig, batch: usize, seq: usize, gpu_bytes: u64) -> PlanInput {
    PlanInput {
        cfg,
        batch,
        seq,
        weight_dtype: DType::BF16,
        grad_dtype: GradDtype::Bf16,
        state_dtype: StateDtype::F32,
        mode: OptimMode::Exact,
        gpu_bytes,
        host_bytes: 128 * GIB,
        ring_depth: None,
        n_chunks: None,
        rows_per_block: 1024,
        fused_kernels: true,
        // The materialised attention and untiled MLPs, which the tests below were written for;
        // `long_sequences_*` plan flash attention and MLP tiles.
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
            held_layers: Some(0),
            gpu_updated_layers: Some(0),
            late_state_downloads: None,
            early_state_uploads: Some(0),
            spilled_checkpoints: Some(0),
        },
    }
}

/// What the device pool allocates for plan `p` of `i` as the engine specifies it: slots of
/// `slot` (with LoRA the base and its adapters), gradient buffers of `trainable` (the adapters),
/// the scratch buffer of `base_scratch` bytes (a LoRA run's int8 or NF4 layer); resident units'
/// buffers left out (the tests compare the streamed ones).
pub(super) fn pool_bytes(
    p: &Plan,
    i: &PlanInput,
    slot: &ModelLayout,
    trainable: &ModelLayout,
    base_scratch: usize,
) -> mt_pool::PoolBytes {
    let spec = mt_pool::PoolSpec {
        ring_depth: p.ring_depth,
        layer_len: slot.layer.len,
        outer_len: slot.outer.len,
        grad_lens: (trainable.layer.len, trainable.outer.len),
        weight_dtype: i.weight_dtype,
        grad_dtype: DType::F32,
        n_grad_bufs: grad_bufs(p.placement.late_state_downloads),
        n_layers: slot.n_layers,
        n_chunks: p.n_chunks,
        placement: Placement { resident_outer: false, resident_layers: 0, ..p.placement },
        land_bf16: lands_bf16(i.mode, i.grad_dtype),
        state_slots: if p.placement.gpu_updated_layers > 0 {
            p.ring_depth + p.placement.late_state_downloads
        } else {
            0
        },
        state_grad_dtype: if i.grad_dtype == GradDtype::F32 { DType::F32 } else { DType::BF16 },
        state_dtype: i.state_dtype,
        base_scratch,
    };
    mt_pool::DevicePool::new(&spec, &candle_core::Device::Cpu).unwrap().bytes()
}

pub(super) fn err(i: &PlanInput) -> String {
    plan(i).unwrap_err().to_string()
}

#[test]
fn store_bytes_equal_what_the_host_store_maps() {
    let cfg = ModelConfig::tiny_llama();
    let layout = ModelLayout::new(&cfg);
    for g in [GradDtype::F32, GradDtype::Bf16, GradDtype::None] {
        for states in StateDtype::ALL {
            let store = HostStore::anonymous_with(&layout, g, states).unwrap();
            assert_eq!(store_bytes(&layout, g, states), store.bytes() as u64, "{g:?} {states}");
            let i = PlanInput {
                grad_dtype: g,
                state_dtype: states,
                mode: OptimMode::Lean,
                ..input(cfg.clone(), 2, 16, GIB)
            };
            assert_eq!(plan(&i).unwrap().host.store, store.bytes() as u64);
        }
    }
}

/// The step program of a 2-deep ring for these layers and placement.
fn program(n_layers: usize, mode: OptimMode, pending_update: bool, resident_outer: bool) -> Program {
    program_placed(n_layers, mode, pending_update, resident_outer, 0)
}

fn program_placed(
    n_layers: usize,
    mode: OptimMode,
    pending_update: bool,
    resident_outer: bool,
    resident_layers: usize,
) -> Program {
    program_held(n_layers, mode, pending_update, resident_outer, resident_layers, 0)
}

fn program_held(
    n_layers: usize,
    mode: OptimMode,
    pending_update: bool,
    resident_outer: bool,
    resident_layers: usize,
    held_layers: usize,
) -> Program {
    program_gpu(n_layers, mode, pending_update, resident_outer, resident_layers, held_layers, 0)
}

fn program_gpu(
    n_layers: usize,
    mode: OptimMode,
    pending_update: bool,
    resident_outer: bool,
    resident_layers: usize,
    held_layers: usize,
    gpu_updated: usize,
) -> Program {
    Program::build(ProgramSpec {
        n_layers,
        ring_depth: 2,
        n_staging: 2,
        n_grad_bufs: 2,
        n_landing: 2,
        mode,
        pending_update,
        early_ready: false,
        n_state_bufs: 2,
        narrow_grads: false,
        rank: None,
        overlap_optimizer: true,
        reload_slots: 0,
        placement: Placement {
            resident_outer,
            resident_layers,
            held_layers,
            gpu_updated_layers: gpu_updated,
            ..Placement::default()
        },
    })
}

/// Bytes a program's downloads move: layer gradients in bf16 where they land so, the rest f32.
fn downloaded(prog: &Program, layout: &ModelLayout, mode: OptimMode, grad: GradDtype) -> u64 {
    let le = if lands_bf16(mode, grad) { 2 } else { 4 };
    prog.downloads()
        .map(|u| layout.unit(u).len as u64 * if matches!(u, Unit::Layer(_)) { le } else { 4 })
        .sum()
}

#[test]
fn pcie_bytes_equal_the_step_programs_copies() {
    let cfg = ModelConfig::tiny_llama();
    let layout = ModelLayout::new(&cfg);
    let len = |u: Unit| layout.unit(u).len as u64;
    for (((mode, pending), held), gpu) in [(OptimMode::Exact, true), (OptimMode::Lean, false)]
        .into_iter()
        .flat_map(|m| [(m, 0), (m, 1), (m, 2)])
        .flat_map(|(m, h)| [((m, h), 0), ((m, h), 1), ((m, h), 2)])
        .filter(|&(((mode, _), _), gpu)| mode == OptimMode::Exact || gpu == 0)
    {
        let prog = program_gpu(layout.n_layers, mode, pending, false, 0, held, gpu);
        assert_eq!(prog.state_uploads().count(), gpu, "{mode:?} {held} held");
        for grad in [GradDtype::Bf16, GradDtype::F32] {
            let g = if grad == GradDtype::Bf16 { 2 } else { 4 };
            for (dtype, e) in [(DType::BF16, 2), (DType::F32, 4)] {
                let i = PlanInput {
                    weight_dtype: dtype,
                    mode,
                    grad_dtype: grad,
                    placement: Placement {
                        held_layers: Some(held),
                        gpu_updated_layers: Some(gpu),
                        ..input(cfg.clone(), 2, 16, GIB).placement
                    },
                    ..input(cfg.clone(), 2, 16, GIB)
                };
                let p = plan(&i).unwrap();
                let state_up = prog.state_uploads().map(len).sum::<u64>();
                assert_eq!(
                    p.pcie_h2d_per_step,
                    prog.uploads().map(len).sum::<u64>() * e + state_up * (12 + g)
                );
                assert_eq!(p.pcie_d2h_per_step, downloaded(&prog, &layout, mode, grad) + state_up * 12);
            }
        }
    }
}

#[test]
fn llama3_3b_parameters_pcie_and_flops_match_the_closed_form() {
    let p = plan(&input(llama3_3b(), 16, 2048, H200)).unwrap();
    // Per layer: norms 2·3072 + q, o 2·3072² + k, v 2·1024·3072 + MLP 3·8192·3072
    // = 6_144 + 18_874_368 + 6_291_456 + 75_497_472 = 100_669_440 (no padding: all multiples of 64).
    // Outer: embedding + head 2·128_256·3072 + norm 3072 = 788_007_936.
    // Total: 28 · 100_669_440 + 788_007_936 = 3_606_752_256.
    assert_eq!(p.n_params, 3_606_752_256);
    assert!((p.n_params as f64 / 3.6e9 - 1.0).abs() < 0.01);
    // Uploads: (788_007_936 + 2 · 28 · 100_669_440) · 2 B; downloads (exact mode, bf16 store
    // gradients: layers land in bf16): 28 · 100_669_440 · 2 B + 788_007_936 · 4 B.
    assert_eq!(p.pcie_h2d_per_step, 12_850_993_152);
    assert_eq!(p.pcie_d2h_per_step, 8_789_520_384);
    // FLOPs (docs/peers.md's convention): 6 · N · T + 6 · L · seq · hidden · T, all parameters;
    // at this size 7.78e14 per step (329 TFLOP/s = 14_505 tok/s at 4 x 2048, as docs/peers.md).
    let want = 6.0 * 3_606_752_256.0 * 32_768.0 + 6.0 * 28.0 * 2048.0 * 3072.0 * 32_768.0;
    assert_eq!(p.flops_per_step, want);
    // Checkpoints: 29 boundaries · 32_768 tokens · 3072 · 2 B.
    assert_eq!(p.gpu.checkpoints, 29 * 32_768 * 3072 * 2);
    // Two f32 layer gradient buffers with their bf16 twins, and the outer one.
    assert_eq!(p.gpu.grads, 2 * 100_669_440 * (4 + 2) + 788_007_936 * 4);
    assert!(p.gpu.total <= p.gpu.budget);
    assert_eq!(p.placement.resident_layers, 0);
}

#[test]
fn a_plan_that_cannot_fit_names_what_does_not() {
    let e = err(&input(llama3_3b(), 16, 2048, 8 * GIB));
    assert!(e.contains("checkpoints for 16 x 2048 tokens need 5.44 GiB"), "{e}");
    let e = err(&input(llama3_3b(), 16, 2048, 4 * GIB));
    assert!(e.contains("weights and gradient buffers need 5.90 GiB"), "{e}");
    let e = err(&PlanInput { host_bytes: 32 * GIB, ..input(llama3_3b(), 1, 2048, H200) });
    assert!(e.contains("host store (47.") && e.contains("32.00 GiB"), "{e}");
    let e = err(&input(llama3_3b(), 1, 131_072, H200));
    assert!(e.contains("workspace of a chunk of 1 x 131072 tokens"), "{e}");
}

#[test]
fn a_larger_gpu_gives_fewer_chunks_and_each_choice_is_the_fewest_that_fit() {
    let chunks = |gpu: u64| {
        let p = plan(&input(llama3_3b(), 16, 2048, gpu)).unwrap();
        assert!(p.gpu.total <= p.gpu.budget);
        if p.n_chunks > 1 {
            let fewer = PlanInput { n_chunks: Some(p.n_chunks - 1), ..input(llama3_3b(), 16, 2048, gpu) };
            assert!(err(&fewer).contains("use more chunks"));
        }
        p.n_chunks
    };
    let (small, large) = (chunks(24 * GIB), chunks(80 * GIB));
    assert!(small > large, "{small} vs {large}");
}

#[test]
fn bad_user_choices_are_refused() {
    let base = input(ModelConfig::tiny_llama(), 4, 16, GIB);
    assert!(err(&PlanInput { n_chunks: Some(5), ..base.clone() }).contains("n_chunks 5"));
    assert!(err(&PlanInput { n_chunks: Some(0), ..base.clone() }).contains("n_chunks 0"));
    assert!(err(&PlanInput { ring_depth: Some(0), ..base.clone() }).contains("ring_depth 0"));
    let lean_less = PlanInput { grad_dtype: GradDtype::None, ..base.clone() };
    assert!(err(&lean_less).contains("exact mode"));
    let p = plan(&PlanInput { n_chunks: Some(3), ring_depth: Some(3), ..base }).unwrap();
    assert_eq!((p.n_chunks, p.seqs_per_chunk, p.ring_depth), (3, 2, 3));
}

#[test]
fn display_shows_the_pcie_line() {
    let s = plan(&input(llama3_3b(), 16, 2048, H200)).unwrap().to_string();
    assert!(s.contains("PCIe per step: H2D 12850993152 B (11.97 GiB), D2H 8789520384 B"), "{s}");
    assert!(s.contains("ring depth 2") && s.contains("layer checkpoints on the GPU"), "{s}");
}

/// The resident outer unit and resident layers: bytes, PCIe, auto's choice, the pages given back.
mod resident;

/// The pool's fixed buffers, kept activations, held layers.
mod placed;

/// Long sequences: flash attention, MLP tiles, spilled checkpoints.
mod long;

/// The disk tier: a store file paged through a RAM window.
mod paging;

/// The moments' precision (`--optim-states`).
mod states;

/// The optimizer's work: the forward window, GPU-updated layers, early uploads.
mod update;

/// LoRA: the adapters' training state, the frozen base beside it.
mod lora;

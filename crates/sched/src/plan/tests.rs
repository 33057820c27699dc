//! Tests of the planner: byte accounting against the store and the step program, closed-form
//! numbers for a Llama-3-shaped 3.6B model, and the choice (or refusal) of a chunking.

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

#[test]
fn a_resident_outer_unit_moves_no_bytes_and_costs_its_state_on_the_gpu() {
    let cfg = ModelConfig::tiny_llama();
    let layout = ModelLayout::new(&cfg);
    let len = |u: Unit| layout.unit(u).len as u64;
    let base = input(cfg.clone(), 2, 16, GIB);
    for (mode, pending) in [(OptimMode::Exact, true), (OptimMode::Lean, false)] {
        let prog = program(layout.n_layers, mode, pending, true);
        let p = plan(&PlanInput {
            mode,
            placement: Placement { resident_outer: Some(true), ..base.placement },
            ..base.clone()
        })
        .unwrap();
        assert!(p.placement.resident_outer);
        assert_eq!(p.pcie_h2d_per_step, prog.uploads().map(len).sum::<u64>() * 2);
        assert_eq!(p.pcie_d2h_per_step, downloaded(&prog, &layout, mode, GradDtype::Bf16));
        assert_eq!(p.gpu.outer_state, 12 * len(Unit::Outer));
        let streamed = plan(&PlanInput { mode, ..base.clone() }).unwrap();
        assert_eq!(streamed.pcie_h2d_per_step - p.pcie_h2d_per_step, 2 * len(Unit::Outer));
        assert_eq!(streamed.host.pinned - p.host.pinned, 6 * len(Unit::Outer));
    }
}

#[test]
fn the_planner_keeps_the_outer_unit_resident_only_where_it_costs_no_chunk() {
    // 3.6B Llama-3 at 16 x 2048 on an H200: 9.5 GB of outer state fits beside one chunk.
    let auto = PlanInput {
        placement: Placement { resident_outer: None, ..input(llama3_3b(), 16, 2048, H200).placement },
        ..input(llama3_3b(), 16, 2048, H200)
    };
    let p = plan(&auto).unwrap();
    assert!(p.placement.resident_outer && p.n_chunks == 1, "{p}");
    // On a 24 GiB GPU it would cost chunks (or not fit): streamed, as before.
    let small = PlanInput { gpu_bytes: 24 * GIB, ..auto.clone() };
    let streamed = plan(&PlanInput {
        placement: Placement { resident_outer: Some(false), ..small.placement },
        ..small.clone()
    })
    .unwrap();
    let p = plan(&small).unwrap();
    assert_eq!(p.n_chunks, streamed.n_chunks);
    if p.placement.resident_outer {
        assert!(p.gpu.total <= p.gpu.budget);
    }
    // Forcing residency where the state cannot fit is refused, naming it.
    let e = err(&PlanInput {
        gpu_bytes: 8 * GIB,
        placement: Placement { resident_outer: Some(true), ..auto.placement },
        ..auto
    });
    assert!(e.contains("resident outer state"), "{e}");
}

#[test]
fn auto_takes_the_resident_outer_unit_when_only_it_fits_the_host() {
    // The streamed layout needs the outer unit's pinned rings (6 B per outer parameter) more.
    let base = input(llama3_3b(), 4, 2048, H200);
    let resident = plan(&PlanInput {
        placement: Placement { resident_outer: Some(true), ..base.placement },
        ..base.clone()
    })
    .unwrap();
    let tight = PlanInput {
        host_bytes: resident.host.total,
        placement: Placement { resident_outer: None, ..base.placement },
        ..base
    };
    assert!(plan(&PlanInput {
        placement: Placement { resident_outer: Some(false), ..tight.placement },
        ..tight.clone()
    })
    .is_err());
    assert!(plan(&tight).unwrap().placement.resident_outer);
}

#[test]
fn resident_layers_move_no_bytes_and_cost_their_state_on_the_gpu() {
    let cfg = ModelConfig::tiny_llama();
    let layout = ModelLayout::new(&cfg);
    let len = |u: Unit| layout.unit(u).len as u64;
    let n = layout.n_layers;
    let base = input(cfg.clone(), 2, 16, GIB);
    for k in 0..=n {
        for (mode, pending) in [(OptimMode::Exact, true), (OptimMode::Lean, false)] {
            let prog = program_placed(n, mode, pending, true, k);
            let placed = PlanInput {
                mode,
                placement: Placement {
                    resident_outer: Some(true),
                    resident_layers: Some(k),
                    ..base.placement
                },
                ..base.clone()
            };
            let p = plan(&placed).unwrap();
            assert_eq!(p.placement.resident_layers, k);
            assert_eq!(p.pcie_h2d_per_step, prog.uploads().map(len).sum::<u64>() * 2, "{k} resident");
            assert_eq!(
                p.pcie_d2h_per_step,
                downloaded(&prog, &layout, mode, GradDtype::Bf16),
                "{k} resident"
            );
            // bf16 weights + f32 gradient + f32 master, m, v.
            assert_eq!(p.gpu.resident_layers, k as u64 * 18 * len(Unit::Layer(0)));
            assert!(p.gpu.total <= p.gpu.budget);
        }
    }
    let e =
        err(&PlanInput { placement: Placement { resident_layers: Some(n + 1), ..base.placement }, ..base });
    assert!(e.contains(&format!("{} resident layers asked of a {n}-layer model", n + 1)), "{e}");
}

#[test]
fn auto_keeps_as_many_leading_layers_resident_as_the_gpu_holds_after_its_chunking() {
    let per_layer = 100_669_440 * 18;
    // 3.6B at 4 x 2048 on an H200: every layer (50.7 GB) and the outer state fit: nothing moves.
    let auto = PlanInput {
        placement: Placement {
            resident_outer: None,
            resident_layers: None,
            ..input(llama3_3b(), 4, 2048, H200).placement
        },
        ..input(llama3_3b(), 4, 2048, H200)
    };
    let p = plan(&auto).unwrap();
    assert!(p.placement.resident_outer && p.placement.resident_layers == 28, "{p}");
    assert_eq!((p.pcie_h2d_per_step, p.pcie_d2h_per_step), (0, 0));
    // An 80 GiB GPU at 16 x 2048: some layers, as many as fit, without costing a chunk.
    let small = PlanInput { gpu_bytes: 80 * GIB, batch: 16, ..auto.clone() };
    let p = plan(&small).unwrap();
    assert!(p.placement.resident_layers > 0 && p.placement.resident_layers < 28, "{p}");
    assert!(p.gpu.total <= p.gpu.budget && p.gpu.total + per_layer > p.gpu.budget, "{p}");
    let none = plan(&PlanInput {
        placement: Placement { resident_layers: Some(0), ..small.placement },
        ..small.clone()
    })
    .unwrap();
    assert_eq!(p.n_chunks, none.n_chunks);
    assert_eq!(
        none.pcie_h2d_per_step - p.pcie_h2d_per_step,
        2 * 2 * p.placement.resident_layers as u64 * 100_669_440
    );
    // Asking for every layer there costs chunks (auto would have taken them otherwise); on a
    // 40 GiB GPU it is refused before anything is allocated, naming them.
    if let Ok(q) = plan(&PlanInput {
        placement: Placement { resident_layers: Some(28), ..small.placement },
        ..small.clone()
    }) {
        assert!(q.n_chunks > p.n_chunks, "{q}");
    }
    let e = err(&PlanInput {
        gpu_bytes: 40 * GIB,
        placement: Placement { resident_layers: Some(28), ..small.placement },
        ..small
    });
    assert!(e.contains("resident layers 47.2"), "{e}");
}

#[test]
fn the_gradient_pages_the_plan_counts_as_given_back_are_what_the_store_releases() {
    let cfg = ModelConfig::tiny_llama();
    let layout = ModelLayout::new(&cfg);
    for (grad, mode) in [
        (GradDtype::F32, OptimMode::Exact),
        (GradDtype::Bf16, OptimMode::Exact),
        (GradDtype::None, OptimMode::Lean),
    ] {
        let base = PlanInput {
            grad_dtype: grad,
            mode,
            placement: Placement { resident_outer: Some(true), ..input(cfg.clone(), 2, 16, GIB).placement },
            ..input(cfg.clone(), 2, 16, GIB)
        };
        let p = plan(&PlanInput {
            placement: Placement { resident_layers: Some(2), ..base.placement },
            ..base.clone()
        })
        .unwrap();
        let store = HostStore::anonymous(&layout, grad).unwrap();
        let released: usize = [Unit::Outer, Unit::Layer(0), Unit::Layer(1)]
            .into_iter()
            .map(|u| store.release_grad(u).unwrap())
            .sum();
        assert_eq!(p.host.released_by_resident, released as u64, "{grad:?}");
        assert_eq!(released > 0, grad != GradDtype::None);
        let streamed = plan(&PlanInput {
            placement: Placement { resident_outer: Some(false), resident_layers: Some(0), ..base.placement },
            ..base
        })
        .unwrap();
        assert_eq!(streamed.host.released_by_resident, 0);
    }
}

/// The plan's fixed GPU bytes are what the pool allocates for the same choices: the weight ring,
/// the outer slot, and the gradient buffers with their bf16 twins where gradients land in bf16;
/// with late state downloads, a state slot more for each and two more gradient buffers (which
/// the plan counts with the state slots).
#[test]
fn the_planned_gpu_buffers_are_what_the_pool_allocates() {
    let cfg = ModelConfig::tiny_llama();
    let layout = ModelLayout::new(&cfg);
    let n = layout.n_layers;
    for (mode, grad, held, gpu, late) in [
        (OptimMode::Exact, GradDtype::Bf16, 0, 0, 0),
        (OptimMode::Exact, GradDtype::F32, 1, 1, 0),
        (OptimMode::Exact, GradDtype::Bf16, 1, 2, 0),
        (OptimMode::Lean, GradDtype::Bf16, 2, 0, 0),
        (OptimMode::Exact, GradDtype::Bf16, n, 2, 1),
        (OptimMode::Exact, GradDtype::F32, n, 2, 2),
    ] {
        let i = PlanInput {
            mode,
            grad_dtype: grad,
            placement: Placement {
                held_layers: Some(held),
                gpu_updated_layers: Some(gpu),
                late_state_downloads: Some(late),
                ..input(cfg.clone(), 2, 16, GIB).placement
            },
            ..input(cfg.clone(), 2, 16, GIB)
        };
        let p = plan(&i).unwrap();
        let spec = mt_pool::PoolSpec {
            ring_depth: p.ring_depth,
            layer_len: layout.layer.len,
            outer_len: layout.outer.len,
            weight_dtype: DType::BF16,
            grad_dtype: DType::F32,
            n_grad_bufs: grad_bufs(p.placement.late_state_downloads),
            n_layers: layout.n_layers,
            n_chunks: p.n_chunks,
            resident_outer: false,
            resident_layers: 0,
            held_layers: p.placement.held_layers,
            land_bf16: lands_bf16(mode, grad),
            state_slots: if p.placement.gpu_updated_layers > 0 {
                p.ring_depth + p.placement.late_state_downloads
            } else {
                0
            },
            state_grad_dtype: if grad == GradDtype::F32 { DType::F32 } else { DType::BF16 },
            state_dtype: StateDtype::F32,
        };
        let b = mt_pool::DevicePool::new(&spec, &candle_core::Device::Cpu).unwrap().bytes();
        let what = format!("{mode:?}, {grad:?} gradients, {late} late");
        assert_eq!(p.placement.late_state_downloads, late, "{what}");
        let per_grad_buf = layout.layer.len as u64 * if lands_bf16(mode, grad) { 6 } else { 4 };
        let extra = if late > 0 { 2 * per_grad_buf } else { 0 };
        assert_eq!(b.grads as u64, p.gpu.grads + extra, "{what}: gradient buffers");
        assert_eq!(b.weight_ring as u64, p.gpu.weight_ring, "{what}: weight ring");
        assert_eq!(b.outer as u64, p.gpu.outer, "{what}: outer slot");
        assert_eq!(
            (b.held as u64, p.placement.held_layers),
            (p.gpu.held, held),
            "{what}: held layers' slots"
        );
        // The widening copy of a bf16 stored gradient is a transient of the update, not a slot.
        let widen = if gpu > 0 && grad == GradDtype::Bf16 { 4 * layout.layer.len as u64 } else { 0 };
        assert_eq!(
            (b.state_slots as u64 + widen + extra, p.placement.gpu_updated_layers),
            (p.gpu.state_slots, gpu),
            "{what}: state slots"
        );
    }
}

/// Auto keeps the activations of as many resident (or, when every layer is resident or held,
/// held) layers as fit in what is left, counts them in the GPU total, and refuses an explicit
/// count that does not fit. The count per layer is the fused path's or candle's.
#[test]
fn kept_activations_fill_what_residency_leaves() {
    let base = PlanInput {
        placement: Placement { kept_layers: None, ..input(llama3_3b(), 4, 2048, H200).placement },
        ..input(llama3_3b(), 4, 2048, H200)
    };
    let cfg = llama3_3b();
    let per = mt_layers::DecoderLayer::kept_state_bytes(&cfg, 4, 2048, 2, true, false);
    // a, x1, c, q, o (3072 each), k, v (1024 each), gate, up, mid (8192 each) per token in bf16,
    // raw scores and probabilities of 4 x 24 heads with their f32 (max, sum) per row, the two
    // norms' f32 reciprocal RMS per token: ~2.1 GiB a layer.
    let acts = 4 * 2048 * 2 * (5 * 3072 + 2 * 1024 + 3 * 8192);
    let scores = 4 * 24 * 2048 * 2048 * 2 * 2;
    let (stats, rms) = (4 * 24 * 2048 * 2 * 4, 2 * 4 * 2048 * 4);
    assert_eq!(per, acts + scores + stats + rms);
    // candle's ops also keep each norm's f32 input copy and x·r, silu(gate), and f32
    // probabilities instead of the bf16 scores and probabilities with their statistics.
    let unfused = mt_layers::DecoderLayer::kept_state_bytes(&cfg, 4, 2048, 2, false, false);
    let n = 4 * 2048;
    assert_eq!(unfused, per + 2 * n * 3072 * 4 + n * 3072 * 2 + n * 8192 * 2 - stats);
    // Auto keeps none of the streamed, not held layers' (their backward waits on the host);
    // asked for, every layer's fit beside a streamed 3.6B, counted in the total.
    assert_eq!(plan(&base).unwrap().placement.kept_layers, 0);
    let streamed =
        plan(&PlanInput { placement: Placement { kept_layers: Some(28), ..base.placement }, ..base.clone() })
            .unwrap();
    assert_eq!(streamed.gpu.kept, 28 * per);
    let none =
        plan(&PlanInput { placement: Placement { kept_layers: Some(0), ..base.placement }, ..base.clone() })
            .unwrap();
    assert_eq!(streamed.gpu.total, none.gpu.total + 28 * per);
    assert!(streamed.gpu.total <= streamed.gpu.budget);
    // Every layer held: all kept.
    let held =
        plan(&PlanInput { placement: Placement { held_layers: None, ..base.placement }, ..base.clone() })
            .unwrap();
    assert_eq!((held.placement.held_layers, held.placement.kept_layers), (28, 28));
    // Residency first: all 28 layers resident, and on an H200 with the fused kernels every
    // layer's activations kept beside them; on a smaller GPU as many as fit, up to the budget.
    let all =
        plan(&PlanInput { placement: Placement { resident_layers: None, ..base.placement }, ..base.clone() })
            .unwrap();
    assert_eq!((all.placement.resident_layers, all.placement.kept_layers), (28, 28), "{all}");
    assert!(all.gpu.total <= all.gpu.budget);
    let both = plan(&PlanInput {
        gpu_bytes: 128 * GIB,
        placement: Placement { resident_layers: None, ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!(both.placement.resident_layers, 28);
    assert!(
        both.placement.kept_layers > 0 && both.placement.kept_layers < 28,
        "{}",
        both.placement.kept_layers
    );
    assert!(both.gpu.total <= both.gpu.budget && both.gpu.budget - both.gpu.total < per);
    // Without the fused kernels the larger count decides.
    let candle = plan(&PlanInput {
        fused_kernels: false,
        gpu_bytes: 128 * GIB,
        placement: Placement { resident_layers: None, ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!(candle.gpu.kept, candle.placement.kept_layers as u64 * unfused);
    assert!(
        candle.placement.kept_layers < both.placement.kept_layers && candle.gpu.total <= candle.gpu.budget,
        "{candle}"
    );
    // An explicit count is served before automatic residency takes the memory.
    let asked = plan(&PlanInput {
        gpu_bytes: 128 * GIB,
        placement: Placement { resident_layers: None, kept_layers: Some(28), ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!(asked.placement.kept_layers, 28);
    assert!(asked.placement.resident_layers < 28 && asked.gpu.total <= asked.gpu.budget, "{asked}");
    let e = err(&PlanInput {
        gpu_bytes: 72 * GIB,
        placement: Placement { kept_layers: Some(28), ..base.placement },
        ..base.clone()
    });
    assert!(e.contains("--kept-layers"), "{e}");
    assert!(err(&PlanInput { placement: Placement { kept_layers: Some(29), ..base.placement }, ..base })
        .contains("29 layers"));
}

/// Auto holds every streamed layer whose weights fit in what residency leaves (a streamed 3.6B:
/// all 28, 5.25 GiB), which takes one upload per layer off the PCIe bytes; with room for none
/// it holds none; asking for more than stream, or more than fit, is refused.
#[test]
fn held_layers_take_what_residency_leaves_and_cross_once() {
    let base = PlanInput {
        placement: Placement { held_layers: None, ..input(llama3_3b(), 4, 2048, H200).placement },
        ..input(llama3_3b(), 4, 2048, H200)
    };
    let layout = ModelLayout::new(&llama3_3b());
    let (ll, ol) = (layout.layer.len as u64, layout.outer.len as u64);
    let p = plan(&base).unwrap();
    assert_eq!(p.placement.held_layers, 28);
    assert_eq!(p.gpu.held, 28 * ll * 2);
    assert_eq!(p.pcie_h2d_per_step, (ol + 28 * ll) * 2, "each layer crosses once");
    let none =
        plan(&PlanInput { placement: Placement { held_layers: Some(0), ..base.placement }, ..base.clone() })
            .unwrap();
    assert_eq!(none.pcie_h2d_per_step, (ol + 56 * ll) * 2);
    assert_eq!(p.gpu.total, none.gpu.total + 28 * ll * 2);
    // Everything resident: nothing streams, so nothing is held.
    let resident =
        plan(&PlanInput { placement: Placement { resident_layers: None, ..base.placement }, ..base.clone() })
            .unwrap();
    assert_eq!((resident.placement.resident_layers, resident.placement.held_layers), (28, 0));
    let e = err(&PlanInput {
        placement: Placement { resident_layers: Some(20), held_layers: Some(9), ..base.placement },
        ..base.clone()
    });
    assert!(e.contains("only 8 of 28 layers stream"), "{e}");
    // Asked for with residency left to the planner: those layers stay streamed and are held.
    let asked = plan(&PlanInput {
        placement: Placement { resident_layers: None, held_layers: Some(2), ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!((asked.placement.resident_layers, asked.placement.held_layers), (26, 2), "{asked}");
    let e = err(&PlanInput {
        gpu_bytes: 18 * GIB,
        placement: Placement { held_layers: Some(28), ..base.placement },
        ..base
    });
    assert!(e.contains("--held-layers"), "{e}");
}

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
        resident_outer: Some(false),
        resident_layers: Some(0),
        kept_layers: Some(0),
        held_layers: Some(0),
        gpu_updated_layers: Some(0),
        late_state_downloads: None,
        early_state_uploads: Some(0),
        fused_kernels: true,
        // The materialised attention and untiled MLPs, which the tests below were written for;
        // `long_sequences_*` plan flash attention and MLP tiles.
        flash_attention: Some(false),
        mlp_rows: Some(0),
        spilled_checkpoints: Some(0),
    }
}

fn err(i: &PlanInput) -> String {
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
        resident_outer,
        resident_layers,
        held_layers,
        gpu_updated,
        late_downloads: 0,
        early_uploads: 0,
        early_ready: false,
        n_state_bufs: 2,
        spilled_checkpoints: 0,
        reload_slots: 0,
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
                    held_layers: Some(held),
                    gpu_updated_layers: Some(gpu),
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
    assert_eq!(p.resident_layers, 0);
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
        let p = plan(&PlanInput { resident_outer: Some(true), mode, ..base.clone() }).unwrap();
        assert!(p.resident_outer);
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
    let auto = PlanInput { resident_outer: None, ..input(llama3_3b(), 16, 2048, H200) };
    let p = plan(&auto).unwrap();
    assert!(p.resident_outer && p.n_chunks == 1, "{p}");
    // On a 24 GiB GPU it would cost chunks (or not fit): streamed, as before.
    let small = PlanInput { gpu_bytes: 24 * GIB, ..auto.clone() };
    let streamed = plan(&PlanInput { resident_outer: Some(false), ..small.clone() }).unwrap();
    let p = plan(&small).unwrap();
    assert_eq!(p.n_chunks, streamed.n_chunks);
    if p.resident_outer {
        assert!(p.gpu.total <= p.gpu.budget);
    }
    // Forcing residency where the state cannot fit is refused, naming it.
    let e = err(&PlanInput { resident_outer: Some(true), gpu_bytes: 8 * GIB, ..auto });
    assert!(e.contains("resident outer state"), "{e}");
}

#[test]
fn auto_takes_the_resident_outer_unit_when_only_it_fits_the_host() {
    // The streamed layout needs the outer unit's pinned rings (6 B per outer parameter) more.
    let base = input(llama3_3b(), 4, 2048, H200);
    let resident = plan(&PlanInput { resident_outer: Some(true), ..base.clone() }).unwrap();
    let tight = PlanInput { host_bytes: resident.host.total, resident_outer: None, ..base };
    assert!(plan(&PlanInput { resident_outer: Some(false), ..tight.clone() }).is_err());
    assert!(plan(&tight).unwrap().resident_outer);
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
            let placed =
                PlanInput { resident_outer: Some(true), resident_layers: Some(k), mode, ..base.clone() };
            let p = plan(&placed).unwrap();
            assert_eq!(p.resident_layers, k);
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
    let e = err(&PlanInput { resident_layers: Some(n + 1), ..base });
    assert!(e.contains(&format!("{} resident layers asked of a {n}-layer model", n + 1)), "{e}");
}

#[test]
fn auto_keeps_as_many_leading_layers_resident_as_the_gpu_holds_after_its_chunking() {
    let per_layer = 100_669_440 * 18;
    // 3.6B at 4 x 2048 on an H200: every layer (50.7 GB) and the outer state fit: nothing moves.
    let auto = PlanInput { resident_outer: None, resident_layers: None, ..input(llama3_3b(), 4, 2048, H200) };
    let p = plan(&auto).unwrap();
    assert!(p.resident_outer && p.resident_layers == 28, "{p}");
    assert_eq!((p.pcie_h2d_per_step, p.pcie_d2h_per_step), (0, 0));
    // An 80 GiB GPU at 16 x 2048: some layers, as many as fit, without costing a chunk.
    let small = PlanInput { gpu_bytes: 80 * GIB, batch: 16, ..auto.clone() };
    let p = plan(&small).unwrap();
    assert!(p.resident_layers > 0 && p.resident_layers < 28, "{p}");
    assert!(p.gpu.total <= p.gpu.budget && p.gpu.total + per_layer > p.gpu.budget, "{p}");
    let none = plan(&PlanInput { resident_layers: Some(0), ..small.clone() }).unwrap();
    assert_eq!(p.n_chunks, none.n_chunks);
    assert_eq!(none.pcie_h2d_per_step - p.pcie_h2d_per_step, 2 * 2 * p.resident_layers as u64 * 100_669_440);
    // Asking for every layer there costs chunks (auto would have taken them otherwise); on a
    // 40 GiB GPU it is refused before anything is allocated, naming them.
    if let Ok(q) = plan(&PlanInput { resident_layers: Some(28), ..small.clone() }) {
        assert!(q.n_chunks > p.n_chunks, "{q}");
    }
    let e = err(&PlanInput { resident_layers: Some(28), gpu_bytes: 40 * GIB, ..small });
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
            resident_outer: Some(true),
            ..input(cfg.clone(), 2, 16, GIB)
        };
        let p = plan(&PlanInput { resident_layers: Some(2), ..base.clone() }).unwrap();
        let store = HostStore::anonymous(&layout, grad).unwrap();
        let released: usize = [Unit::Outer, Unit::Layer(0), Unit::Layer(1)]
            .into_iter()
            .map(|u| store.release_grad(u).unwrap())
            .sum();
        assert_eq!(p.host.released_by_resident, released as u64, "{grad:?}");
        assert_eq!(released > 0, grad != GradDtype::None);
        let streamed =
            plan(&PlanInput { resident_outer: Some(false), resident_layers: Some(0), ..base }).unwrap();
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
            held_layers: Some(held),
            gpu_updated_layers: Some(gpu),
            late_state_downloads: Some(late),
            ..input(cfg.clone(), 2, 16, GIB)
        };
        let p = plan(&i).unwrap();
        let spec = mt_pool::PoolSpec {
            ring_depth: p.ring_depth,
            layer_len: layout.layer.len,
            outer_len: layout.outer.len,
            weight_dtype: DType::BF16,
            grad_dtype: DType::F32,
            n_grad_bufs: grad_bufs(p.late_state_downloads),
            n_layers: layout.n_layers,
            n_chunks: p.n_chunks,
            resident_outer: false,
            resident_layers: 0,
            held_layers: p.held_layers,
            land_bf16: lands_bf16(mode, grad),
            state_slots: if p.gpu_updated_layers > 0 { p.ring_depth + p.late_state_downloads } else { 0 },
            state_grad_dtype: if grad == GradDtype::F32 { DType::F32 } else { DType::BF16 },
            state_dtype: StateDtype::F32,
        };
        let b = mt_pool::DevicePool::new(&spec, &candle_core::Device::Cpu).unwrap().bytes();
        let what = format!("{mode:?}, {grad:?} gradients, {late} late");
        assert_eq!(p.late_state_downloads, late, "{what}");
        let per_grad_buf = layout.layer.len as u64 * if lands_bf16(mode, grad) { 6 } else { 4 };
        let extra = if late > 0 { 2 * per_grad_buf } else { 0 };
        assert_eq!(b.grads as u64, p.gpu.grads + extra, "{what}: gradient buffers");
        assert_eq!(b.weight_ring as u64, p.gpu.weight_ring, "{what}: weight ring");
        assert_eq!(b.outer as u64, p.gpu.outer, "{what}: outer slot");
        assert_eq!((b.held as u64, p.held_layers), (p.gpu.held, held), "{what}: held layers' slots");
        // The widening copy of a bf16 stored gradient is a transient of the update, not a slot.
        let widen = if gpu > 0 && grad == GradDtype::Bf16 { 4 * layout.layer.len as u64 } else { 0 };
        assert_eq!(
            (b.state_slots as u64 + widen + extra, p.gpu_updated_layers),
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
    let base = PlanInput { kept_layers: None, ..input(llama3_3b(), 4, 2048, H200) };
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
    assert_eq!(plan(&base).unwrap().kept_layers, 0);
    let streamed = plan(&PlanInput { kept_layers: Some(28), ..base.clone() }).unwrap();
    assert_eq!(streamed.gpu.kept, 28 * per);
    let none = plan(&PlanInput { kept_layers: Some(0), ..base.clone() }).unwrap();
    assert_eq!(streamed.gpu.total, none.gpu.total + 28 * per);
    assert!(streamed.gpu.total <= streamed.gpu.budget);
    // Every layer held: all kept.
    let held = plan(&PlanInput { held_layers: None, ..base.clone() }).unwrap();
    assert_eq!((held.held_layers, held.kept_layers), (28, 28));
    // Residency first: all 28 layers resident, and on an H200 with the fused kernels every
    // layer's activations kept beside them; on a smaller GPU as many as fit, up to the budget.
    let all = plan(&PlanInput { resident_layers: None, ..base.clone() }).unwrap();
    assert_eq!((all.resident_layers, all.kept_layers), (28, 28), "{all}");
    assert!(all.gpu.total <= all.gpu.budget);
    let both = plan(&PlanInput { resident_layers: None, gpu_bytes: 128 * GIB, ..base.clone() }).unwrap();
    assert_eq!(both.resident_layers, 28);
    assert!(both.kept_layers > 0 && both.kept_layers < 28, "{}", both.kept_layers);
    assert!(both.gpu.total <= both.gpu.budget && both.gpu.budget - both.gpu.total < per);
    // Without the fused kernels the larger count decides.
    let candle = plan(&PlanInput {
        resident_layers: None,
        fused_kernels: false,
        gpu_bytes: 128 * GIB,
        ..base.clone()
    })
    .unwrap();
    assert_eq!(candle.gpu.kept, candle.kept_layers as u64 * unfused);
    assert!(candle.kept_layers < both.kept_layers && candle.gpu.total <= candle.gpu.budget, "{candle}");
    // An explicit count is served before automatic residency takes the memory.
    let asked = plan(&PlanInput {
        resident_layers: None,
        kept_layers: Some(28),
        gpu_bytes: 128 * GIB,
        ..base.clone()
    })
    .unwrap();
    assert_eq!(asked.kept_layers, 28);
    assert!(asked.resident_layers < 28 && asked.gpu.total <= asked.gpu.budget, "{asked}");
    let e = err(&PlanInput { kept_layers: Some(28), gpu_bytes: 72 * GIB, ..base.clone() });
    assert!(e.contains("--kept-layers"), "{e}");
    assert!(err(&PlanInput { kept_layers: Some(29), ..base }).contains("29 layers"));
}

/// Auto holds every streamed layer whose weights fit in what residency leaves (a streamed 3.6B:
/// all 28, 5.25 GiB), which takes one upload per layer off the PCIe bytes; with room for none
/// it holds none; asking for more than stream, or more than fit, is refused.
#[test]
fn held_layers_take_what_residency_leaves_and_cross_once() {
    let base = PlanInput { held_layers: None, ..input(llama3_3b(), 4, 2048, H200) };
    let layout = ModelLayout::new(&llama3_3b());
    let (ll, ol) = (layout.layer.len as u64, layout.outer.len as u64);
    let p = plan(&base).unwrap();
    assert_eq!(p.held_layers, 28);
    assert_eq!(p.gpu.held, 28 * ll * 2);
    assert_eq!(p.pcie_h2d_per_step, (ol + 28 * ll) * 2, "each layer crosses once");
    let none = plan(&PlanInput { held_layers: Some(0), ..base.clone() }).unwrap();
    assert_eq!(none.pcie_h2d_per_step, (ol + 56 * ll) * 2);
    assert_eq!(p.gpu.total, none.gpu.total + 28 * ll * 2);
    // Everything resident: nothing streams, so nothing is held.
    let resident = plan(&PlanInput { resident_layers: None, ..base.clone() }).unwrap();
    assert_eq!((resident.resident_layers, resident.held_layers), (28, 0));
    let e = err(&PlanInput { resident_layers: Some(20), held_layers: Some(9), ..base.clone() });
    assert!(e.contains("only 8 of 28 layers stream"), "{e}");
    // Asked for with residency left to the planner: those layers stay streamed and are held.
    let asked = plan(&PlanInput { resident_layers: None, held_layers: Some(2), ..base.clone() }).unwrap();
    assert_eq!((asked.resident_layers, asked.held_layers), (26, 2), "{asked}");
    let e = err(&PlanInput { held_layers: Some(28), gpu_bytes: 18 * GIB, ..base });
    assert!(e.contains("--held-layers"), "{e}");
}

/// The forward window of 28 streamed layers, `n` GPU-updated, `l` late, `x` early.
fn window(n: usize, l: usize, x: usize, host_gbs: f64) -> f64 {
    forward_window(UpdatePlacement { streamed: 28, gpu: n, late: l, early: x }, 2, 2, 12, host_gbs, 40.0)
}

/// The forward window's model: a GPU-updated layer trades host memory traffic (30 B/param of a
/// host update and upload for 26 B of state DMA, 14 B when its download is late, 12 B when its
/// upload is early) for uploads (2 B/param for 14 B, none when early); the slower side sets the
/// window.
#[test]
fn the_forward_window_is_the_slower_of_host_memory_and_uploads() {
    let w = |n, l| window(n, l, 0, 165.0);
    assert_eq!(w(0, 0), 28.0 * 30.0 / 165.0, "host-bound with every update on the host");
    assert_eq!(w(28, 0), 28.0 * 14.0 / 40.0, "upload-bound with every update on the GPU");
    assert_eq!(w(10, 0), (18.0 * 30.0 + 10.0 * 26.0) / 165.0);
    assert_eq!(w(10, 4), (18.0 * 30.0 + 10.0 * 26.0 - 4.0 * 12.0) / 165.0, "late ones leave 14 B");
    assert_eq!(w(10, 40), w(10, 10), "no more late downloads than GPU-updated layers");
    let x = |n, l, x| window(n, l, x, 165.0);
    assert_eq!(
        x(10, 4, 3),
        (18.0 * 30.0 + 10.0 * 26.0 - 4.0 * 12.0 - 3.0 * 14.0) / 165.0,
        "early ones leave 12 B"
    );
    assert_eq!(x(10, 4, 9), x(10, 4, 6), "early uploads only of layers not late");
    assert_eq!(x(28, 0, 28), 28.0 * 12.0 / 165.0, "every upload early: host-bound by the downloads");
    assert_eq!(x(28, 0, 14), 14.0 * 14.0 / 40.0, "half of them early: bound by the others' uploads");
    // Infinitely fast host memory: no layer is worth moving; infinitely slow: every one is.
    let best = |host_gbs: f64| {
        (0..=28).min_by(|&a, &b| {
            let c = |n| window(n, 0, 0, host_gbs);
            c(a).total_cmp(&c(b))
        })
    };
    assert_eq!(best(1e9), Some(0));
    assert_eq!(best(1e-9), Some(28));
}

/// Auto picks the count of GPU-updated layers with the shortest forward window (11 of the
/// 3.6B's 28 streamed layers with bf16 weights and gradients, none held; 10 when every layer is
/// held and 5 of them download late), none in lean mode or when their state slots do not fit;
/// an explicit count is served before auto residency takes the GPU (its slots reserved, its
/// layers left streamed), and one that does not fit is refused, naming the flag.
#[test]
fn gpu_updated_layers_balance_the_host_pass_and_are_served_before_residency() {
    let base = input(llama3_3b(), 4, 2048, H200);
    let auto = plan(&PlanInput { gpu_updated_layers: None, ..base.clone() }).unwrap();
    assert_eq!((auto.gpu_updated_layers, auto.late_state_downloads), (11, 0), "none held, none late");
    let ll = ModelLayout::new(&base.cfg).layer.len as u64;
    assert_eq!(auto.gpu.state_slots, 2 * 14 * ll + 4 * ll);
    let held = plan(&PlanInput { gpu_updated_layers: None, held_layers: None, ..base.clone() }).unwrap();
    assert_eq!((held.held_layers, held.gpu_updated_layers, held.late_state_downloads), (28, 10, 5), "{held}");
    assert_eq!(
        held.late_state_downloads,
        late_download_capacity(held.flops_per_step, 28, 28, ll, 2, 12 * ll)
    );
    // Fewer held layers: the late downloads must go out in their (first) part of the backward.
    assert_eq!(late_download_capacity(held.flops_per_step, 28, 14, ll, 2, 12 * ll), 2);
    assert_eq!(late_download_capacity(held.flops_per_step, 28, 0, ll, 2, 12 * ll), 0);
    let half = plan(&PlanInput { gpu_updated_layers: None, held_layers: Some(14), ..base.clone() }).unwrap();
    assert_eq!(half.late_state_downloads, 2, "{half}");
    // Five more state slots and two more gradient buffers (f32 + bf16 twin).
    assert_eq!(held.gpu.state_slots, (2 + 5) * 14 * ll + 4 * ll + 2 * 6 * ll);
    // Late or not, the same bytes cross.
    let prompt = PlanInput { gpu_updated_layers: Some(10), held_layers: None, ..base.clone() };
    let on_time = plan(&PlanInput { late_state_downloads: Some(0), ..prompt.clone() }).unwrap();
    assert_eq!(
        (on_time.pcie_h2d_per_step, on_time.pcie_d2h_per_step),
        (held.pcie_h2d_per_step, held.pcie_d2h_per_step)
    );
    assert_eq!(on_time.gpu.state_slots, 2 * 14 * ll + 4 * ll);
    let e = err(&PlanInput { late_state_downloads: Some(11), ..prompt.clone() });
    assert!(e.contains("only 10 of the 10 GPU-updated layers are held"), "{e}");
    let e = err(&PlanInput { late_state_downloads: Some(1), held_layers: Some(0), ..prompt.clone() });
    assert!(e.contains("only 0 of the 10"), "{e}");
    let e = err(&PlanInput {
        late_state_downloads: Some(10),
        held_layers: Some(28),
        gpu_bytes: 36 * GIB,
        ..prompt.clone()
    });
    assert!(e.contains("10 of them downloading late") && e.contains("--late-state-downloads"), "{e}");
    // Asked for with the GPU-updated count left to the planner: the reason it cannot be is named.
    let auto_gpu = PlanInput { gpu_updated_layers: None, held_layers: Some(28), ..prompt };
    let e = err(&PlanInput { late_state_downloads: Some(10), gpu_bytes: 36 * GIB, ..auto_gpu.clone() });
    assert!(e.contains("10 late state downloads need") && e.contains("--late-state-downloads"), "{e}");
    let e = err(&PlanInput { late_state_downloads: Some(1), mode: OptimMode::Lean, ..auto_gpu.clone() });
    assert!(e.contains("lean mode"), "{e}");
    let asked = plan(&PlanInput { late_state_downloads: Some(3), ..auto_gpu }).unwrap();
    assert_eq!(asked.late_state_downloads, 3);
    assert!(crate::program::held_gpu_updated_of(28, 0, 28, asked.gpu_updated_layers).len() >= 3, "{asked}");
    let lean = PlanInput { gpu_updated_layers: None, mode: OptimMode::Lean, ..base.clone() };
    assert_eq!(plan(&lean).unwrap().gpu_updated_layers, 0);
    let e = err(&PlanInput { gpu_updated_layers: Some(2), ..lean });
    assert!(e.contains("lean mode"), "{e}");
    // The smallest GPU (in GiB) the step fits on leaves less than a GiB: no room for 3.2 GB of slots.
    let fits = |gib: u64| plan(&PlanInput { gpu_bytes: gib * GIB, ..base.clone() }).is_ok();
    let least = (1..200).find(|&g| fits(g)).unwrap();
    let small = PlanInput { gpu_updated_layers: None, gpu_bytes: least * GIB, ..base.clone() };
    assert_eq!(
        plan(&small).unwrap().gpu_updated_layers,
        0,
        "slots that do not fit are not picked ({least} GiB)"
    );
    // Explicit count with auto residency: the slots are reserved first and the layers stay streamed.
    let asked =
        plan(&PlanInput { resident_layers: None, gpu_updated_layers: Some(4), ..base.clone() }).unwrap();
    assert_eq!(asked.gpu_updated_layers, 4);
    assert!(asked.resident_layers <= 24 && asked.resident_layers > 0, "{asked}");
    assert!(asked.gpu.total <= asked.gpu.budget, "{asked}");
    let e = err(&PlanInput { gpu_updated_layers: Some(4), gpu_bytes: least * GIB, ..base.clone() });
    assert!(e.contains("--gpu-updated-layers"), "{e}");
    let e = err(&PlanInput { resident_layers: Some(26), gpu_updated_layers: Some(4), ..base });
    assert!(e.contains("GPU-updated layers are streamed ones"), "{e}");
}

/// Auto early uploads: as many as the backward's H2D and host memory have room for, only when
/// every streamed layer is held (the others' re-casts take the backward's H2D); with them a
/// GPU-updated layer costs the forward only its download (the 3.6B at 4 x 2048, every layer held:
/// 14 GPU-updated, 5 late, 5 early). They take state slots free in the backward, so early uploads
/// cost no device memory; the same bytes cross a step but the gradient's; a count beyond the late
/// layers with a partner, in lean mode, or without room for GPU-updated layers is refused,
/// naming the flag.
#[test]
fn early_state_uploads_fill_the_backwards_idle_uploads_when_every_layer_is_held() {
    let base = input(llama3_3b(), 4, 2048, H200);
    let ll = ModelLayout::new(&base.cfg).layer.len as u64;
    let all_auto =
        PlanInput { gpu_updated_layers: None, held_layers: None, early_state_uploads: None, ..base.clone() };
    let p = plan(&all_auto).unwrap();
    let placed = (p.held_layers, p.gpu_updated_layers, p.late_state_downloads, p.early_state_uploads);
    assert_eq!(placed, (28, 14, 5, 5), "{p}");
    assert!(
        early_upload_capacity(p.flops_per_step, 28, 28, 5, ll, 2, 12 * ll) >= 5,
        "the pairs, not the backward, limit it"
    );
    assert_eq!(p.gpu.state_slots, (2 + 5) * 14 * ll + 4 * ll + 2 * 6 * ll);
    // The model: fewer early uploads, a longer forward window.
    let w = |x: usize| {
        forward_window(
            UpdatePlacement { streamed: 28, gpu: 17, late: 5, early: x },
            2,
            2,
            12,
            HOST_MEMORY_GBS,
            STATE_UPLOAD_GBS,
        )
    };
    assert!(w(5) < w(3) && w(3) < w(0), "{} {} {}", w(5), w(3), w(0));
    // Not every layer held: none.
    let half = plan(&PlanInput { held_layers: Some(14), ..all_auto.clone() }).unwrap();
    assert_eq!(half.early_state_uploads, 0, "{half}");
    assert_eq!(early_upload_capacity(p.flops_per_step, 28, 27, 0, ll, 2, 12 * ll), 0);
    // Early, the same bytes cross a step but the gradient's (copied on the device), and the
    // state slots are the same.
    let fixed = PlanInput { gpu_updated_layers: Some(17), late_state_downloads: Some(5), ..all_auto.clone() };
    let five = plan(&fixed).unwrap();
    assert_eq!(five.early_state_uploads, 5, "{five}");
    let none = plan(&PlanInput { early_state_uploads: Some(0), ..fixed.clone() }).unwrap();
    assert_eq!(none.pcie_h2d_per_step - five.pcie_h2d_per_step, 5 * 2 * ll);
    assert_eq!(none.pcie_d2h_per_step, five.pcie_d2h_per_step);
    assert_eq!(five.gpu.state_slots, (2 + 5) * 14 * ll + 4 * ll + 2 * 6 * ll);
    assert_eq!(none.gpu.state_slots, five.gpu.state_slots);
    let e = err(&PlanInput { early_state_uploads: Some(6), ..fixed.clone() });
    assert!(
        e.contains("6 early state uploads asked, but only 5 of the 5 late-download layers have a partner")
            && e.contains("--late-state-downloads"),
        "{e}"
    );
    let lean = PlanInput {
        mode: OptimMode::Lean,
        gpu_updated_layers: Some(0),
        late_state_downloads: Some(0),
        ..base.clone()
    };
    let e = err(&PlanInput { early_state_uploads: Some(1), ..lean });
    assert!(e.contains("lean mode"), "{e}");
    // Asked with automatic GPU-updated and late counts that the memory limits: the memory is
    // named.
    let tight = PlanInput {
        gpu_bytes: 24 * GIB,
        held_layers: Some(28),
        kept_layers: Some(0),
        gpu_updated_layers: None,
        early_state_uploads: Some(9),
        ..base.clone()
    };
    let e = err(&tight);
    assert!(e.contains("0 late downloads are all the state slots the GPU has room for"), "{e}");
    let e = err(&PlanInput { gpu_bytes: 20 * GIB, ..tight.clone() });
    assert!(
        e.contains("9 early state uploads need GPU-updated layers, whose state slots need")
            && e.contains("--early-state-uploads 0"),
        "{e}"
    );
    let small = PlanInput { gpu_bytes: 24 * GIB, held_layers: Some(28), kept_layers: Some(0), ..fixed };
    let e = err(&PlanInput { early_state_uploads: Some(5), ..small });
    assert!(
        e.contains("(5 of them downloading late)") && e.contains("fewer --late-state-downloads or"),
        "{e}"
    );
}

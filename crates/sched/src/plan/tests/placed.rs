//! What else the planner places on the GPU: the fixed buffers (as the pool allocates them),
//! kept activations in what residency leaves, held layers that cross once.

use super::*;

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
        let b = pool_bytes(&p, &i, &layout, &layout, 0);
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
    let per = mt_layers::DecoderLayer::kept_state_bytes(&cfg, 4, 2048, 2, true, false, false);
    // a, x1, c, q, o (3072 each), k, v (1024 each), gate, up, mid (8192 each) per token in bf16,
    // raw scores and probabilities of 4 x 24 heads with their f32 (max, sum) per row, the two
    // norms' f32 reciprocal RMS per token: ~2.1 GiB a layer.
    let acts = 4 * 2048 * 2 * (5 * 3072 + 2 * 1024 + 3 * 8192);
    let scores = 4 * 24 * 2048 * 2048 * 2 * 2;
    let (stats, rms) = (4 * 24 * 2048 * 2 * 4, 2 * 4 * 2048 * 4);
    assert_eq!(per, acts + scores + stats + rms);
    // candle's ops also keep each norm's f32 input copy and x·r, silu(gate), and f32
    // probabilities instead of the bf16 scores and probabilities with their statistics.
    let unfused = mt_layers::DecoderLayer::kept_state_bytes(&cfg, 4, 2048, 2, false, false, false);
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

//! The planner's placement of the optimizer's work: the forward window that weighs GPU-updated
//! layers against the host's pass, the GPU-updated layers it picks, and early state uploads.

use super::*;
use super::{err, input, llama3_3b, GIB, H200};
use mt_core::ModelLayout;

/// The forward window of 28 streamed layers, `n` GPU-updated, `l` late, `x` early.
fn window(n: usize, l: usize, x: usize, host_gbs: f64) -> f64 {
    let p = Placement {
        gpu_updated_layers: n,
        late_state_downloads: l,
        early_state_uploads: x,
        ..Placement::default()
    };
    forward_window(28, p, 2, 2, 12, host_gbs, 40.0)
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
    let auto = plan(&PlanInput {
        placement: Placement { gpu_updated_layers: None, ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!(
        (auto.placement.gpu_updated_layers, auto.placement.late_state_downloads),
        (11, 0),
        "none held, none late"
    );
    let ll = ModelLayout::new(&base.cfg).layer.len as u64;
    assert_eq!(auto.gpu.state_slots, 2 * 14 * ll + 4 * ll);
    let held = plan(&PlanInput {
        placement: Placement { gpu_updated_layers: None, held_layers: None, ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!(
        (held.placement.held_layers, held.placement.gpu_updated_layers, held.placement.late_state_downloads),
        (28, 10, 5),
        "{held}"
    );
    assert_eq!(
        held.placement.late_state_downloads,
        late_download_capacity(held.flops_per_step, 28, 28, ll, 2, 12 * ll)
    );
    // Fewer held layers: the late downloads must go out in their (first) part of the backward.
    assert_eq!(late_download_capacity(held.flops_per_step, 28, 14, ll, 2, 12 * ll), 2);
    assert_eq!(late_download_capacity(held.flops_per_step, 28, 0, ll, 2, 12 * ll), 0);
    let half = plan(&PlanInput {
        placement: Placement { gpu_updated_layers: None, held_layers: Some(14), ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!(half.placement.late_state_downloads, 2, "{half}");
    // Five more state slots and two more gradient buffers (f32 + bf16 twin).
    assert_eq!(held.gpu.state_slots, (2 + 5) * 14 * ll + 4 * ll + 2 * 6 * ll);
    // Late or not, the same bytes cross.
    let prompt = PlanInput {
        placement: Placement { gpu_updated_layers: Some(10), held_layers: None, ..base.placement },
        ..base.clone()
    };
    let on_time = plan(&PlanInput {
        placement: Placement { late_state_downloads: Some(0), ..prompt.placement },
        ..prompt.clone()
    })
    .unwrap();
    assert_eq!(
        (on_time.pcie_h2d_per_step, on_time.pcie_d2h_per_step),
        (held.pcie_h2d_per_step, held.pcie_d2h_per_step)
    );
    assert_eq!(on_time.gpu.state_slots, 2 * 14 * ll + 4 * ll);
    let e = err(&PlanInput {
        placement: Placement { late_state_downloads: Some(11), ..prompt.placement },
        ..prompt.clone()
    });
    assert!(e.contains("only 10 of the 10 GPU-updated layers are held"), "{e}");
    let e = err(&PlanInput {
        placement: Placement { late_state_downloads: Some(1), held_layers: Some(0), ..prompt.placement },
        ..prompt.clone()
    });
    assert!(e.contains("only 0 of the 10"), "{e}");
    let e = err(&PlanInput {
        gpu_bytes: 36 * GIB,
        placement: Placement { late_state_downloads: Some(10), held_layers: Some(28), ..prompt.placement },
        ..prompt.clone()
    });
    assert!(e.contains("10 of them downloading late") && e.contains("--late-state-downloads"), "{e}");
    // Asked for with the GPU-updated count left to the planner: the reason it cannot be is named.
    let auto_gpu = PlanInput {
        placement: Placement { gpu_updated_layers: None, held_layers: Some(28), ..prompt.placement },
        ..prompt
    };
    let e = err(&PlanInput {
        gpu_bytes: 36 * GIB,
        placement: Placement { late_state_downloads: Some(10), ..auto_gpu.placement },
        ..auto_gpu.clone()
    });
    assert!(e.contains("10 late state downloads need") && e.contains("--late-state-downloads"), "{e}");
    let e = err(&PlanInput {
        mode: OptimMode::Lean,
        placement: Placement { late_state_downloads: Some(1), ..auto_gpu.placement },
        ..auto_gpu.clone()
    });
    assert!(e.contains("lean mode"), "{e}");
    let asked = plan(&PlanInput {
        placement: Placement { late_state_downloads: Some(3), ..auto_gpu.placement },
        ..auto_gpu
    })
    .unwrap();
    assert_eq!(asked.placement.late_state_downloads, 3);
    assert!(
        Placement {
            held_layers: 28,
            gpu_updated_layers: asked.placement.gpu_updated_layers,
            ..Placement::default()
        }
        .held_gpu_updated(28)
        .len()
            >= 3,
        "{asked}"
    );
    let lean = PlanInput {
        mode: OptimMode::Lean,
        placement: Placement { gpu_updated_layers: None, ..base.placement },
        ..base.clone()
    };
    assert_eq!(plan(&lean).unwrap().placement.gpu_updated_layers, 0);
    let e =
        err(&PlanInput { placement: Placement { gpu_updated_layers: Some(2), ..lean.placement }, ..lean });
    assert!(e.contains("lean mode"), "{e}");
    // The smallest GPU (in GiB) the step fits on leaves less than a GiB: no room for 3.2 GB of slots.
    let fits = |gib: u64| plan(&PlanInput { gpu_bytes: gib * GIB, ..base.clone() }).is_ok();
    let least = (1..200).find(|&g| fits(g)).unwrap();
    let small = PlanInput {
        gpu_bytes: least * GIB,
        placement: Placement { gpu_updated_layers: None, ..base.placement },
        ..base.clone()
    };
    assert_eq!(
        plan(&small).unwrap().placement.gpu_updated_layers,
        0,
        "slots that do not fit are not picked ({least} GiB)"
    );
    // Explicit count with auto residency: the slots are reserved first and the layers stay streamed.
    let asked = plan(&PlanInput {
        placement: Placement { resident_layers: None, gpu_updated_layers: Some(4), ..base.placement },
        ..base.clone()
    })
    .unwrap();
    assert_eq!(asked.placement.gpu_updated_layers, 4);
    assert!(asked.placement.resident_layers <= 24 && asked.placement.resident_layers > 0, "{asked}");
    assert!(asked.gpu.total <= asked.gpu.budget, "{asked}");
    let e = err(&PlanInput {
        gpu_bytes: least * GIB,
        placement: Placement { gpu_updated_layers: Some(4), ..base.placement },
        ..base.clone()
    });
    assert!(e.contains("--gpu-updated-layers"), "{e}");
    let e = err(&PlanInput {
        placement: Placement { resident_layers: Some(26), gpu_updated_layers: Some(4), ..base.placement },
        ..base
    });
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
    let all_auto = PlanInput {
        placement: Placement {
            gpu_updated_layers: None,
            held_layers: None,
            early_state_uploads: None,
            ..base.placement
        },
        ..base.clone()
    };
    let p = plan(&all_auto).unwrap();
    let placed = (
        p.placement.held_layers,
        p.placement.gpu_updated_layers,
        p.placement.late_state_downloads,
        p.placement.early_state_uploads,
    );
    assert_eq!(placed, (28, 14, 5, 5), "{p}");
    assert!(
        early_upload_capacity(p.flops_per_step, 28, 28, 5, ll, 2, 12 * ll) >= 5,
        "the pairs, not the backward, limit it"
    );
    assert_eq!(p.gpu.state_slots, (2 + 5) * 14 * ll + 4 * ll + 2 * 6 * ll);
    // The model: fewer early uploads, a longer forward window.
    let w = |x: usize| {
        forward_window(
            28,
            Placement {
                gpu_updated_layers: 17,
                late_state_downloads: 5,
                early_state_uploads: x,
                ..Placement::default()
            },
            2,
            2,
            12,
            HOST_MEMORY_GBS,
            STATE_UPLOAD_GBS,
        )
    };
    assert!(w(5) < w(3) && w(3) < w(0), "{} {} {}", w(5), w(3), w(0));
    // Not every layer held: none.
    let half = plan(&PlanInput {
        placement: Placement { held_layers: Some(14), ..all_auto.placement },
        ..all_auto.clone()
    })
    .unwrap();
    assert_eq!(half.placement.early_state_uploads, 0, "{half}");
    assert_eq!(early_upload_capacity(p.flops_per_step, 28, 27, 0, ll, 2, 12 * ll), 0);
    // Early, the same bytes cross a step but the gradient's (copied on the device), and the
    // state slots are the same.
    let fixed = PlanInput {
        placement: Placement {
            gpu_updated_layers: Some(17),
            late_state_downloads: Some(5),
            ..all_auto.placement
        },
        ..all_auto.clone()
    };
    let five = plan(&fixed).unwrap();
    assert_eq!(five.placement.early_state_uploads, 5, "{five}");
    let none = plan(&PlanInput {
        placement: Placement { early_state_uploads: Some(0), ..fixed.placement },
        ..fixed.clone()
    })
    .unwrap();
    assert_eq!(none.pcie_h2d_per_step - five.pcie_h2d_per_step, 5 * 2 * ll);
    assert_eq!(none.pcie_d2h_per_step, five.pcie_d2h_per_step);
    assert_eq!(five.gpu.state_slots, (2 + 5) * 14 * ll + 4 * ll + 2 * 6 * ll);
    assert_eq!(none.gpu.state_slots, five.gpu.state_slots);
    let e = err(&PlanInput {
        placement: Placement { early_state_uploads: Some(6), ..fixed.placement },
        ..fixed.clone()
    });
    assert!(
        e.contains("6 early state uploads asked, but only 5 of the 5 late-download layers have a partner")
            && e.contains("--late-state-downloads"),
        "{e}"
    );
    let lean = PlanInput {
        mode: OptimMode::Lean,
        placement: Placement { gpu_updated_layers: Some(0), late_state_downloads: Some(0), ..base.placement },
        ..base.clone()
    };
    let e =
        err(&PlanInput { placement: Placement { early_state_uploads: Some(1), ..lean.placement }, ..lean });
    assert!(e.contains("lean mode"), "{e}");
    // Asked with automatic GPU-updated and late counts that the memory limits: the memory is
    // named.
    let tight = PlanInput {
        gpu_bytes: 24 * GIB,
        placement: Placement {
            held_layers: Some(28),
            kept_layers: Some(0),
            gpu_updated_layers: None,
            early_state_uploads: Some(9),
            ..base.placement
        },
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
    let small = PlanInput {
        gpu_bytes: 24 * GIB,
        placement: Placement { held_layers: Some(28), kept_layers: Some(0), ..fixed.placement },
        ..fixed
    };
    let e =
        err(&PlanInput { placement: Placement { early_state_uploads: Some(5), ..small.placement }, ..small });
    assert!(
        e.contains("(5 of them downloading late)") && e.contains("fewer --late-state-downloads or"),
        "{e}"
    );
}

//! The planner's resident units: a resident outer unit and resident layers move no bytes and
//! cost their state on the GPU, auto takes them where they cost no chunk (or only they fit the
//! host), and the gradient pages the plan counts as given back are the ones the store releases.

use super::*;

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

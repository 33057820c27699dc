//! The planner with each precision of the AdamW moments (`--optim-states`): the store's bytes
//! per parameter in exact and lean mode, and the state a resident unit, a GPU-updated layer's
//! slot and the PCIe copies carry.

use super::*;
use super::{input, llama3_3b, H200};
use mt_core::ModelLayout;

/// Exact mode with bf16 gradients stores 14 / 10 / 8 B/param, with f32 gradients 16 / 12 / 10;
/// lean mode, with no gradient buffer, 12 / 8 / 6 (an 8-bit moment's scales add 8 / 256).
#[test]
fn the_store_takes_14_10_8_bytes_a_parameter_exact_and_12_8_6_lean() {
    let n = ModelLayout::new(&llama3_3b()).n_params() as f64;
    let cases = [
        (OptimMode::Exact, GradDtype::Bf16, [14.0, 10.0, 8.0]),
        (OptimMode::Exact, GradDtype::F32, [16.0, 12.0, 10.0]),
        (OptimMode::Lean, GradDtype::None, [12.0, 8.0, 6.0]),
    ];
    for (mode, grad_dtype, want) in cases {
        for (states, want) in StateDtype::ALL.into_iter().zip(want) {
            let i = PlanInput { mode, grad_dtype, state_dtype: states, ..input(llama3_3b(), 1, 2048, H200) };
            let b = plan(&i).unwrap().host.store as f64 / n;
            let scales = if states == StateDtype::Int8 { 8.0 / 256.0 } else { 0.0 };
            assert!((b - want - scales).abs() < 1e-3, "{mode:?} {grad_dtype:?} {states}: {b} B/param");
        }
    }
}

/// The moments' encoding sizes the store (`4 + 2·s + g` B/param), a resident unit's optimizer
/// state, a GPU-updated layer's state slot and the state bytes that cross PCIe.
#[test]
fn optimizer_states_size_the_store_residency_and_state_slots() {
    let base = PlanInput {
        placement: Placement { gpu_updated_layers: Some(4), ..input(llama3_3b(), 4, 2048, H200).placement },
        ..input(llama3_3b(), 4, 2048, H200)
    };
    let layout = ModelLayout::new(&base.cfg);
    let (ll, ol) = (layout.layer.len as u64, layout.outer.len as u64);
    let n = layout.n_params() as f64;
    let plans: Vec<Plan> = StateDtype::ALL
        .into_iter()
        .map(|states| {
            let i = PlanInput {
                state_dtype: states,
                placement: Placement {
                    resident_outer: Some(true),
                    resident_layers: Some(2),
                    ..base.placement
                },
                ..base.clone()
            };
            plan(&i).unwrap()
        })
        .collect();
    for (p, (states, per_param)) in
        plans.iter().zip([(StateDtype::F32, 14.0), (StateDtype::Bf16, 10.0), (StateDtype::Int8, 8.0)])
    {
        let b = p.host.store as f64 / n;
        assert!((per_param..per_param + 0.1).contains(&b), "{states}: {b} B/param in the store");
        let sl = states.state_bytes(layout.layer.len) as u64;
        assert_eq!(p.gpu.outer_state, states.state_bytes(layout.outer.len) as u64, "{states}");
        assert_eq!(p.gpu.resident_layers, 2 * (ll * (2 + 4) + sl), "{states}");
        assert_eq!(p.gpu.state_slots, 2 * (sl + 2 * ll) + 4 * ll, "{states}");
        assert_eq!(p.pcie_d2h_per_step + 4 * 12 * ll, plans[0].pcie_d2h_per_step + 4 * sl, "{states}");
    }
    assert_eq!(plans[0].gpu.outer_state, 12 * ol);
}

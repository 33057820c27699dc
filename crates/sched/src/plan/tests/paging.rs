//! The planner's disk tier: a `--store` file that does not fit the host is paged through a RAM
//! window the plan sizes (the record in use, the next, one on its way to disk at least); an
//! anonymous store that does not fit is refused, naming `--store`.

use super::*;
use super::{err, input, llama3_3b, GIB, H200};
use mt_core::ModelLayout;

#[test]
fn a_store_file_larger_than_the_host_is_paged_through_a_window() {
    let cfg = llama3_3b();
    let layout = ModelLayout::new(&cfg);
    let (grad, states) = (GradDtype::Bf16, StateDtype::F32);
    let (store, record) = (store_bytes(&layout, grad, states), largest_record(&layout, grad, states));
    let fits = plan(&PlanInput { store_file: true, ..input(cfg.clone(), 1, 2048, H200) }).unwrap();
    assert_eq!(fits.host.store_window, None, "a store that fits stays whole in RAM");
    // 47 GiB of store, its largest record the untied embedding and LM head (10.3 GiB).
    let host_bytes = 40 * GIB;
    assert!(store > host_bytes, "the test pages a store larger than the host");
    let p = plan(&PlanInput { store_file: true, host_bytes, ..input(cfg.clone(), 1, 2048, H200) }).unwrap();
    let window = p.host.store_window.expect("paged");
    assert!(window >= PAGED_MIN_RECORDS * record, "{window}");
    assert_eq!(p.host.store, store, "the store's size is still the whole file's");
    assert_eq!(p.host.total, window + mt_store::PAGED_IN_FLIGHT * record + p.host.pinned);
    assert!(p.host.total <= host_bytes, "{} > {host_bytes}", p.host.total);
    assert!(p.host.total + record > host_bytes, "the window takes what the host has");
    // Below three records beside the pinned buffers there is no window: refused, naming them.
    let tiny = p.host.pinned + 2 * record;
    let e = err(&PlanInput { store_file: true, host_bytes: tiny, ..input(cfg.clone(), 1, 2048, H200) });
    assert!(e.contains("paging it from its file needs") && e.contains("3 records"), "{e}");
    // Without a file the refusal says how to get one.
    let e = err(&PlanInput { host_bytes, ..input(cfg, 1, 2048, H200) });
    assert!(e.contains("--store FILE"), "{e}");
}

//! Phase 2 of the planner (`phases/mod.rs`): the host's bytes: the store (or the window of a
//! store paged from its file), a LoRA run's frozen base in its encoding, and the page-locked
//! staging and landing rings.

use super::*;

/// `b` bytes in GiB, or in MiB below one.
fn size(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", gib(b))
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// Phase 2: the host holds the store and the staging and landing rings (page-locked on CUDA).
pub(super) fn host_bytes(c: &Ctx<'_>) -> Result<HostBytes> {
    let Ctx { input, ll, tl, e, le, ol_moved, tol_moved, .. } = *c;
    let layout = &c.trainable;
    let store = store_bytes(layout, input.grad_dtype, input.state_dtype);
    // Staging holds a slot (a LoRA run's base and adapters), landing a gradient (its adapters').
    let pinned = N_BUFS * ll * e + ol_moved * e + N_BUFS * tl * le + tol_moved * 4;
    let frozen_base = c.base.host;
    let mut host = HostBytes {
        store,
        frozen_base,
        pinned,
        spilled_checkpoints: 0,
        total: store + frozen_base + pinned,
        store_window: None,
        released_by_resident: 0,
    };
    // A file-backed store stays whole in RAM only if the rest of the run fits beside it too.
    let reserved = if input.store_file { input.host_reserved } else { 0 };
    if host.total + reserved <= input.host_bytes {
        return Ok(host);
    }
    let base =
        if frozen_base > 0 { format!(" + frozen base ({:.2} GiB)", gib(frozen_base)) } else { String::new() };
    let over = format!(
        "host store ({:.2} GiB){base} + pinned staging/landing ({:.2} GiB) = {:.2} GiB exceed the host's {:.2} GiB by {:.2} GiB",
        gib(store), gib(pinned), gib(host.total), gib(input.host_bytes), gib(host.total - input.host_bytes)
    );
    if frozen_base > store {
        // Paging the adapters' store would not make room: the base is what does not fit.
        let dtype = c.cfg.lora.as_ref().map_or(mt_core::BaseDtype::F32, |l| l.base);
        return opt(format!(
            "{over}; a LoRA run keeps its frozen base in host RAM ({dtype}, {:.2} B/param): it needs more --host-mem, or a smaller --base-dtype (int8, nf4)",
            frozen_base as f64 / ((c.layout.n_params() - c.trainable.n_params()) as f64).max(1.0)
        ));
    }
    if !input.store_file {
        return opt(format!(
            "{over}; a file-backed store (--store FILE on a disk with room) pages it from disk"
        ));
    }
    // The disk tier: the store stays in its file; RAM holds a window of records (the record in
    // use and the next at least) and PAGED_IN_FLIGHT more on their way to or from disk.
    let record = largest_record(layout, input.grad_dtype, input.state_dtype);
    let in_flight = mt_store::PAGED_IN_FLIGHT * record;
    let window = input.host_bytes.saturating_sub(frozen_base + pinned + in_flight + input.host_reserved);
    if window < PAGED_MIN_RECORDS * record {
        return opt(format!(
            "{over}; paging it from its file needs {} beside the pinned buffers{} and {} for the rest of the run ({} records of {}: in use, next, {} on their way to or from disk)",
            size((PAGED_MIN_RECORDS + mt_store::PAGED_IN_FLIGHT) * record),
            if frozen_base > 0 { " and the frozen base" } else { "" }, size(input.host_reserved),
            PAGED_MIN_RECORDS + mt_store::PAGED_IN_FLIGHT, size(record), mt_store::PAGED_IN_FLIGHT
        ));
    }
    host.store_window = Some(window);
    host.total = window + in_flight + frozen_base + pinned;
    Ok(host)
}

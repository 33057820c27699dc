//! `PinnedRecords`: some records of a store page-locked in place (registered with CUDA) for the
//! time an engine streams their whole optimizer state through the GPU (the GPU-updated streamed
//! layers: master, moments and gradient go up, master and moments come back, by DMA straight
//! from and into the record).
//!
//! Only what crosses PCIe is pinned (docs/design.md, "Memory"): the chosen records, never the
//! whole store. Registering existing pages is cheap (no copy, no allocation); the records stay in
//! the store's mapping, so the host's bytes per parameter do not change. Registration is undone
//! in `Drop`, and the value keeps the store (and so its mapping) alive, so a registered range
//! never outlives its memory.

use std::sync::Arc;

use mt_core::Unit;

use crate::{HostStore, PinError};

/// Records of a store, page-locked in place until dropped.
#[derive(Debug)]
pub struct PinnedRecords {
    /// `(address, bytes)` of each registered record.
    ranges: Vec<(usize, usize)>,
    /// Keeps the mapping alive for as long as it is registered.
    _store: Arc<HostStore>,
}

impl PinnedRecords {
    /// Page-locks the whole record of every unit in `units` (meta page, master, moments,
    /// gradient). A CUDA context must be current on the calling thread. On failure the records
    /// registered so far are unregistered again and the error names the unit.
    #[cfg(feature = "cuda")]
    pub fn pin(store: &Arc<HostStore>, units: &[Unit]) -> Result<Self, PinError> {
        use cudarc::driver::sys;
        let mut pinned = PinnedRecords { ranges: Vec::with_capacity(units.len()), _store: Arc::clone(store) };
        for &u in units {
            let (addr, bytes) = store.record_range(u);
            // SAFETY: [addr, addr + bytes) is one whole record of the store's live mapping
            // (page-aligned, `HostStore::record_range`); `pinned` holds the store, so the mapping
            // outlives the registration, which `Drop` undoes.
            let r =
                unsafe { sys::cuMemHostRegister_v2(addr as *mut _, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE) };
            if r != sys::cudaError_enum::CUDA_SUCCESS {
                let what = if store.is_file_backed() { " of a file-backed store" } else { "" };
                return Err(PinError {
                    bytes,
                    msg: format!("cuMemHostRegister of the {u:?} record{what} failed: {r:?}"),
                });
            }
            pinned.ranges.push((addr, bytes));
        }
        Ok(pinned)
    }

    /// Page-locking needs the `cuda` feature; without it this always fails.
    #[cfg(not(feature = "cuda"))]
    pub fn pin(store: &Arc<HostStore>, units: &[Unit]) -> Result<Self, PinError> {
        let bytes = units.iter().map(|&u| store.record_range(u).1).sum();
        Err(PinError { bytes, msg: "built without the cuda feature".into() })
    }

    /// Bytes page-locked.
    pub fn bytes(&self) -> usize {
        self.ranges.iter().map(|r| r.1).sum()
    }
}

impl Drop for PinnedRecords {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        for &(addr, _) in &self.ranges {
            // SAFETY: the address was registered by `pin` and the mapping is still alive (held by
            // `_store`). Failure is ignored: the range stays mapped either way, and drop cannot
            // report it.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(addr as *mut _) };
        }
    }
}

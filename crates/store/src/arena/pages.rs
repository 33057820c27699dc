//! [`HostStore`]'s pages: pre-faulting an anonymous store before anything is written into it,
//! and giving a unit's gradient pages back to the kernel.

use std::path::PathBuf;

use memmap2::Advice;
use mt_core::{Error, Result, Unit};

use super::{round_page, GradDtype, HostStore};

impl HostStore {
    /// Pre-faults an anonymous store's pages for writing (`MADV_POPULATE_WRITE`, in parallel
    /// ranges), so the first optimizer update does not pay for faulting in the moments it is
    /// the first to write (importing leaves them as untouched zero pages). Contents are not
    /// changed. Returns the bytes populated: 0 for a file-backed store, whose pages come from
    /// the file; an error where the kernel lacks the advice (Linux < 5.14), which callers may
    /// ignore, leaving the faults to the first update.
    pub fn prefault(&self) -> Result<usize> {
        use rayon::prelude::*;
        if self.is_file_backed() {
            return Ok(0);
        }
        const RANGE: usize = 64 << 20;
        (0..self.total_len.div_ceil(RANGE)).into_par_iter().try_for_each(|i| {
            let off = i * RANGE;
            self.map.advise_range(Advice::PopulateWrite, off, RANGE.min(self.total_len - off)).map_err(
                |source| Error::Io { path: PathBuf::from("<anonymous store: MADV_POPULATE_WRITE>"), source },
            )
        })?;
        Ok(self.total_len)
    }

    /// Gives one unit's gradient region of an anonymous store back to the kernel
    /// (`MADV_DONTNEED`): it reads as zeros afterwards and costs no RAM until written again.
    /// For a unit whose gradient lives elsewhere (a GPU-resident unit, whose host gradient is
    /// written only when a pending update must be handed over). Returns the bytes released: 0
    /// for a file-backed store (its file is the training state) or a store without gradients.
    pub fn release_grad(&self, u: Unit) -> Result<usize> {
        if self.is_file_backed() || self.grad == GradDtype::None {
            return Ok(0);
        }
        let idx = u.index();
        assert!(idx < self.records.len(), "{u:?} is not a unit of this store ({} units)", self.records.len());
        // Held so that no guard of this record is alive (none can be: it would be this lock).
        let _lock = self.locks[idx].lock().unwrap_or_else(|p| p.into_inner());
        let loc = self.records[idx];
        let (off, len) = (loc.base + loc.grad_off(), round_page(loc.len * self.grad.size()));
        // SAFETY: the range is the record's page-aligned gradient region, inside the private
        // anonymous mapping (`plan`), and the record's lock is held, so no slice of it is alive:
        // every later access goes through a new guard, which reads the zero pages the kernel
        // maps back in. No other data shares these pages.
        unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, len) }.map_err(
            |source| Error::Io { path: PathBuf::from("<anonymous store: MADV_DONTNEED>"), source },
        )?;
        Ok(len)
    }
}

//! [`HostStore`]'s disk tier: paging a file-backed store through a bounded RAM window
//! (`crate::pager` does the work; this is the store's side of it).

use std::path::PathBuf;

use mt_core::{Error, Result, Unit};

use super::HostStore;
use crate::pager::{Pager, PagingStats};

impl HostStore {
    /// Starts paging this file-backed store: from now on the records a window of `window_bytes`
    /// holds (never fewer than the one in use and the next) stay in memory, read ahead in `order`
    /// (the units one step touches, in the order it touches them; the next step repeats it) and
    /// written back to the file once the window has moved past them; at most one record more is
    /// held, and a touch waits while write-back is behind. Every unit the store holds should be in
    /// `order`: another one is dropped again after each use. Refused for an anonymous store
    /// (nothing to page to), one already paging, or an empty order or one naming no unit of it.
    pub fn start_paging(&self, order: &[Unit], window_bytes: u64) -> Result<()> {
        let bad = |msg: &str| Error::Store {
            path: self.path().map_or_else(|| PathBuf::from("<anonymous store>"), ToOwned::to_owned),
            msg: msg.to_owned(),
        };
        let (Some(_), Some(path)) = (&self.file, self.path()) else {
            return Err(bad("only a file-backed store (--store FILE) can be paged to disk"));
        };
        if self.pager.get().is_some() {
            return Err(bad("the store is paging already"));
        }
        if order.is_empty() {
            return Err(bad("paging needs the order in which a step touches the records; none given"));
        }
        if let Some(u) = order.iter().find(|u| u.index() >= self.records.len()) {
            return Err(bad(&format!("{u:?} is not a unit of this store ({} units)", self.records.len())));
        }
        // Its own open file: a write error the pager meets is reported to it, and not taken from
        // the mapping's flush.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| Error::Io { path: path.to_owned(), source })?;
        // The pager reads whole records ahead itself: no kernel read-around on a fault, which
        // would bring pages of records outside the window (`pager.rs`).
        self.map
            .advise(memmap2::Advice::Random)
            .map_err(|source| Error::Io { path: path.to_owned(), source })?;
        let ranges = self.records.iter().map(|l| (l.base, l.bytes(self.grad))).collect();
        let order = order.iter().map(|u| u.index()).collect();
        let pager = Pager::start(self.base as usize, ranges, order, window_bytes, file)
            .map_err(|source| Error::Io { path: PathBuf::from("<pager threads>"), source })?;
        self.pager.set(pager).map_err(|_| bad("the store is paging already"))
    }

    /// The pager's counters, if the store is paging.
    pub fn paging_stats(&self) -> Option<PagingStats> {
        self.pager.get().map(Pager::stats)
    }

    /// Bytes of records the pager holds in memory now, if the store is paging.
    pub fn paged_in_bytes(&self) -> Option<u64> {
        self.pager.get().map(Pager::held_bytes)
    }

    /// Waits until the pager's window is settled (everything it wants in memory, the rest
    /// written back); returns at once if the store is not paging.
    pub fn settle_paging(&self) {
        if let Some(p) = self.pager.get() {
            p.settle();
        }
    }

    /// Whether the store is paging to its file.
    pub fn is_paging(&self) -> bool {
        self.pager.get().is_some()
    }

    /// Bytes of the largest record (the unit the pager can never split).
    pub fn largest_record_bytes(&self) -> u64 {
        self.records.iter().map(|l| l.bytes(self.grad) as u64).max().unwrap_or(0)
    }
}

impl HostStore {
    /// Bytes of the store's pages in RAM now (`mincore`: the page cache's pages of a file-backed
    /// store, the touched pages of an anonymous one), the measure of a paged store's window.
    pub fn bytes_in_memory(&self) -> Result<u64> {
        let pages = self.total_len.div_ceil(crate::PAGE);
        let mut vec = vec![0u8; pages];
        // SAFETY: `base..base + total_len` is this store's live mapping (page-aligned, as mmap
        // returns it) and `vec` has one byte per page of it, as mincore(2) writes; mincore reads
        // no byte of the mapping.
        let rc = unsafe { libc::mincore(self.base.cast(), self.total_len, vec.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::Io {
                path: PathBuf::from("<mincore>"),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(vec.iter().filter(|&&b| b & 1 == 1).count() as u64 * crate::PAGE as u64)
    }
}

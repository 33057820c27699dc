//! The memory-mapped arena and its per-unit records.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use half::bf16;
use memmap2::{Advice, MmapMut, MmapOptions};
use mt_core::{Error, ModelLayout, Result, StateDtype, Unit};

use crate::grad::{GradDtype, GradMut, GradRef};
use crate::header::{self, off};
use crate::PAGE;

mod header_fields;
mod pages;
mod paging;
mod params;

/// Training state persisted in the header page next to the records.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StoreState {
    /// Optimizer steps applied to the master weights so far.
    pub step: u64,
    /// The gradient buffers hold a complete step's gradients whose update has not been applied
    /// yet (exact mode defers each unit's update to just before its next upload).
    pub pending_update: bool,
    /// Gradient scale (clip coefficient) to apply with the pending update.
    pub pending_grad_scale: f32,
    /// Learning rate to apply with the pending update.
    pub pending_lr: f64,
    /// Global gradient norm of the last completed step (before clipping).
    pub grad_norm: f64,
}

/// Exclusive access to one unit's record: typed views of its regions, valid only while the
/// guard (and so the record's lock) lives. The views are private so that no slice can escape the
/// guard's lifetime; borrow them through the accessors.
///
/// The moments are the bytes of their encoding ([`StateDtype::moment_bytes`] each; the store
/// knows their sizes, mt-optim their encoding).
#[derive(Debug)]
pub struct RecordGuard<'a> {
    master: &'a mut [f32],
    m: &'a mut [u8],
    v: &'a mut [u8],
    grad: Option<GradMut<'a>>,
    applied: &'a mut u64,
    states: StateDtype,
    /// The pager to tell when the record is no longer in use (a paged store), and its index.
    pager: Option<(&'a crate::pager::Pager, usize)>,
    _lock: MutexGuard<'a, ()>,
}

impl Drop for RecordGuard<'_> {
    fn drop(&mut self) {
        if let Some((p, i)) = self.pager {
            p.release(i);
        }
    }
}

/// Simultaneous views of a record for one optimizer pass: the state it writes and the gradient
/// it reads.
#[derive(Debug)]
pub struct RecordParts<'r> {
    /// fp32 master weights.
    pub master: &'r mut [f32],
    /// AdamW first moment, encoded as `states` says (4-byte aligned).
    pub m: &'r mut [u8],
    /// AdamW second moment, likewise.
    pub v: &'r mut [u8],
    /// The moments' encoding.
    pub states: StateDtype,
    /// Landed gradient (absent in a store without gradient buffers).
    pub grad: Option<GradRef<'r>>,
}

/// Simultaneous views of a record for a pass that lands a gradient and updates at once (lean
/// mode): the state and the gradient buffer, all writable.
#[derive(Debug)]
pub struct RecordPartsMut<'r> {
    /// fp32 master weights.
    pub master: &'r mut [f32],
    /// AdamW first moment, encoded as `states` says (4-byte aligned).
    pub m: &'r mut [u8],
    /// AdamW second moment, likewise.
    pub v: &'r mut [u8],
    /// The moments' encoding.
    pub states: StateDtype,
    /// Gradient buffer (absent in a store without gradient buffers).
    pub grad: Option<GradMut<'r>>,
}

impl RecordGuard<'_> {
    /// fp32 master weights.
    pub fn master(&self) -> &[f32] {
        self.master
    }
    /// Mutable fp32 master weights.
    pub fn master_mut(&mut self) -> &mut [f32] {
        self.master
    }
    /// AdamW first moment: the bytes of its encoding ([`RecordGuard::states`]).
    pub fn m(&self) -> &[u8] {
        self.m
    }
    /// AdamW second moment: the bytes of its encoding.
    pub fn v(&self) -> &[u8] {
        self.v
    }
    /// The moments' encoding.
    pub fn states(&self) -> StateDtype {
        self.states
    }
    /// Landed gradient, if the store keeps gradient buffers.
    pub fn grad(&self) -> Option<GradRef<'_>> {
        self.grad.as_ref().map(GradMut::as_ref)
    }
    /// Mutable gradient buffer, if the store keeps one. The slice is reborrowed for the guard's
    /// borrow only, so it cannot be swapped out and kept past the lock.
    pub fn grad_mut(&mut self) -> Option<GradMut<'_>> {
        match &mut self.grad {
            Some(GradMut::F32(g)) => Some(GradMut::F32(g)),
            Some(GradMut::Bf16(g)) => Some(GradMut::Bf16(g)),
            None => None,
        }
    }
    /// Master, moments (mutable) and gradient (shared) at once, for a fused optimizer pass.
    pub fn parts(&mut self) -> RecordParts<'_> {
        RecordParts {
            master: self.master,
            m: self.m,
            v: self.v,
            states: self.states,
            grad: self.grad.as_ref().map(GradMut::as_ref),
        }
    }
    /// Master, moments and gradient buffer, all mutable, for a pass that lands and updates.
    pub fn parts_mut(&mut self) -> RecordPartsMut<'_> {
        let grad = match &mut self.grad {
            Some(GradMut::F32(g)) => Some(GradMut::F32(g)),
            Some(GradMut::Bf16(g)) => Some(GradMut::Bf16(g)),
            None => None,
        };
        RecordPartsMut { master: self.master, m: self.m, v: self.v, states: self.states, grad }
    }
    /// Number of optimizer updates applied to this unit so far (kept in the record, under its
    /// lock, so an update interrupted by an error is never applied twice).
    pub fn applied_step(&self) -> u64 {
        *self.applied
    }
    /// Records that the update of optimizer step `t` has been applied to this unit.
    pub fn set_applied_step(&mut self, t: u64) {
        *self.applied = t;
    }
}

/// Where one record's regions are in memory ([`HostStore::record_addrs`]): byte addresses of
/// the fp32 master weights, moments and the gradient buffer, each of `len` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordAddrs {
    /// fp32 master weights.
    pub master: usize,
    /// AdamW first moment (`moment_bytes` bytes, encoded as `states` says).
    pub m: usize,
    /// AdamW second moment (likewise).
    pub v: usize,
    /// Bytes of each moment ([`StateDtype::moment_bytes`] of `len`).
    pub moment_bytes: usize,
    /// The moments' encoding.
    pub states: StateDtype,
    /// Gradient buffer (of `grad_dtype`; nothing when that is `None`).
    pub grad: usize,
    /// Elements of each region.
    pub len: usize,
    /// The store's gradient dtype.
    pub grad_dtype: GradDtype,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct RecordLoc {
    /// Byte offset of the record in the arena: a metadata page (applied-update counter), then
    /// the regions.
    pub(crate) base: usize,
    /// Elements per region.
    pub(crate) len: usize,
    /// Bytes of the fp32 master region, page-rounded.
    pub(crate) f32_region: usize,
    /// Bytes of one moment (unrounded) and of its region (page-rounded).
    pub(crate) moment_bytes: usize,
    pub(crate) moment_region: usize,
}

impl RecordLoc {
    fn new(base: usize, len: usize, states: StateDtype) -> Self {
        let moment_bytes = states.moment_bytes(len);
        RecordLoc {
            base,
            len,
            f32_region: round_page(len * 4),
            moment_bytes,
            moment_region: round_page(moment_bytes),
        }
    }

    pub(crate) fn bytes(&self, grad: GradDtype) -> usize {
        self.grad_off() + round_page(self.len * grad.size())
    }

    /// Offsets from `base` of the master, the moments and the gradient.
    pub(crate) fn master_off(&self) -> usize {
        PAGE
    }
    pub(crate) fn m_off(&self) -> usize {
        PAGE + self.f32_region
    }
    pub(crate) fn v_off(&self) -> usize {
        self.m_off() + self.moment_region
    }
    pub(crate) fn grad_off(&self) -> usize {
        self.v_off() + self.moment_region
    }
}

fn round_page(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

/// The host store. See the crate docs for the layout.
#[derive(Debug)]
pub struct HostStore {
    /// The disk tier's pager, once started (first field: dropped, its threads joined, before
    /// the mapping they advise is unmapped).
    pager: std::sync::OnceLock<crate::pager::Pager>,
    /// Owns the mapping (unmapped on drop). All data access goes through `base`.
    map: MmapMut,
    base: *mut u8,
    pub(crate) total_len: usize,
    /// The backing file, holding an exclusive advisory lock for the store's lifetime.
    file: Option<File>,
    path: Option<PathBuf>,
    layout: ModelLayout,
    grad: GradDtype,
    states: StateDtype,
    pub(crate) records: Vec<RecordLoc>,
    locks: Vec<Mutex<()>>,
    header_lock: Mutex<()>,
    /// Why the store's contents can no longer be trusted, if a writer failed part-way through a
    /// record (see [`HostStore::poison`]).
    poisoned: Mutex<Option<String>>,
}

// SAFETY: `base` points into `map`, which lives as long as the store. Every access to the
// bytes behind it through the store is serialised by `locks` (one per record; records are
// disjoint byte ranges) or `header_lock` (the header page), so sharing the store across threads
// creates no data race. Accesses by DMA through `record_addrs` are outside the store's locks:
// the backend that makes them orders them against every other access itself (mt-sched's step
// program, `cuda_ffi.rs`).
unsafe impl Send for HostStore {}
// SAFETY: as for `Send`: all interior mutation goes through the per-record and header mutexes.
unsafe impl Sync for HostStore {}

fn plan(layout: &ModelLayout, grad: GradDtype, states: StateDtype) -> (Vec<RecordLoc>, usize) {
    let mut at = PAGE; // header page
    let records = layout
        .units()
        .map(|u| {
            let loc = RecordLoc::new(at, layout.unit(u).len, states);
            at += loc.bytes(grad);
            loc
        })
        .collect();
    (records, at)
}

impl HostStore {
    /// An anonymous (RAM-backed, zero-filled) store with fp32 moments.
    pub fn anonymous(layout: &ModelLayout, grad: GradDtype) -> Result<Self> {
        Self::anonymous_with(layout, grad, StateDtype::F32)
    }

    /// An anonymous (RAM-backed, zero-filled) store with moments in `states`.
    pub fn anonymous_with(layout: &ModelLayout, grad: GradDtype, states: StateDtype) -> Result<Self> {
        let (records, total) = plan(layout, grad, states);
        let map = MmapOptions::new()
            .len(total)
            .map_anon()
            .map_err(|source| Error::Io { path: PathBuf::from("<anonymous store>"), source })?;
        // Transparent huge pages where the kernel allows them: a store is tens of GB touched
        // once, and 4 KiB faults made the first AdamW update many times slower than later ones
        // (docs/decisions/0010, 0041). Advisory only: a kernel without THP ignores or refuses it.
        let _ = map.advise(Advice::HugePage);
        let store = Self::assemble(map, None, None, layout, (grad, states), records, total);
        store.init_header();
        Ok(store)
    }

    /// Creates a new file-backed store at `path` (zero-filled, sparse) with fp32 moments.
    /// Refuses to overwrite an existing file.
    pub fn create(path: &Path, layout: &ModelLayout, grad: GradDtype) -> Result<Self> {
        Self::create_with(path, layout, grad, StateDtype::F32)
    }

    /// Creates a new file-backed store at `path` (zero-filled, sparse) with moments in `states`.
    /// Refuses to overwrite an existing file.
    pub fn create_with(
        path: &Path,
        layout: &ModelLayout,
        grad: GradDtype,
        states: StateDtype,
    ) -> Result<Self> {
        let io = |source| Error::Io { path: path.to_owned(), source };
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path).map_err(io)?;
        Self::lock_file(&file, path)?;
        let (records, total) = plan(layout, grad, states);
        file.set_len(total as u64).map_err(io)?;
        let map = Self::map_file(&file, path)?;
        let store =
            Self::assemble(map, Some(file), Some(path.to_owned()), layout, (grad, states), records, total);
        store.init_header();
        store.flush()?;
        Ok(store)
    }

    /// Opens an existing file-backed store written for the same layout (its gradient dtype and
    /// moments' encoding are the header's: [`HostStore::state_dtype`]).
    pub fn open(path: &Path, layout: &ModelLayout) -> Result<Self> {
        let io = |source| Error::Io { path: path.to_owned(), source };
        let bad = |msg: String| Error::Store { path: path.to_owned(), msg };
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io)?;
        Self::lock_file(&file, path)?;
        let size = file.metadata().map_err(io)?.len() as usize;
        if size < PAGE {
            return Err(bad(format!("file is {size} bytes, smaller than the header page; not a store")));
        }
        let map = Self::map_file(&file, path)?;
        let page = &map[..PAGE];
        if &page[off::MAGIC..off::MAGIC + 8] != header::MAGIC {
            return Err(bad("bad magic; not a megatrain host store".into()));
        }
        let version = header::get_u32(page, off::VERSION);
        if version != header::VERSION {
            return Err(bad(format!("store format version {version}, this build reads {}", header::VERSION)));
        }
        let grad = GradDtype::from_code(header::get_u32(page, off::GRAD_DTYPE))
            .ok_or_else(|| bad("unknown gradient dtype code".into()))?;
        let states = StateDtype::from_code(header::get_u32(page, off::STATE_DTYPE))
            .ok_or_else(|| bad("unknown optimizer state dtype code".into()))?;
        if header::get_u64(page, off::FINGERPRINT) != header::fingerprint(layout) {
            return Err(bad("written for a different model layout (config mismatch)".into()));
        }
        let (records, total) = plan(layout, grad, states);
        let recorded = header::get_u64(page, off::TOTAL_LEN) as usize;
        if recorded != total || size != total {
            return Err(bad(format!(
                "size mismatch: layout needs {total} bytes, header says {recorded}, file has {size} (truncated?)"
            )));
        }
        Ok(Self::assemble(map, Some(file), Some(path.to_owned()), layout, (grad, states), records, total))
    }

    fn lock_file(file: &File, path: &Path) -> Result<()> {
        file.try_lock().map_err(|e| Error::Store {
            path: path.to_owned(),
            msg: format!("cannot take an exclusive lock ({e}); is another process using this store?"),
        })
    }

    fn map_file(file: &File, path: &Path) -> Result<MmapMut> {
        // SAFETY: memmap2 requires that the file is not modified or truncated by anyone else
        // while mapped. We hold an exclusive advisory lock on it for the store's lifetime
        // (`lock_file`), which every megatrain process honours; writers that ignore advisory
        // locks are outside the store's contract (documented in ARCHITECTURE.md).
        unsafe { MmapOptions::new().map_mut(file) }
            .map_err(|source| Error::Io { path: path.to_owned(), source })
    }

    fn assemble(
        mut map: MmapMut,
        file: Option<File>,
        path: Option<PathBuf>,
        layout: &ModelLayout,
        (grad, states): (GradDtype, StateDtype),
        records: Vec<RecordLoc>,
        total_len: usize,
    ) -> Self {
        let base = map.as_mut_ptr();
        let locks = records.iter().map(|_| Mutex::new(())).collect();
        HostStore {
            pager: std::sync::OnceLock::new(),
            map,
            base,
            total_len,
            file,
            path,
            layout: layout.clone(),
            grad,
            states,
            records,
            locks,
            header_lock: Mutex::new(()),
            poisoned: Mutex::new(None),
        }
    }

    pub(crate) fn with_header<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let _g = self.header_lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the header page is bytes [0, PAGE) of the live mapping, disjoint from every
        // record; `header_lock` makes this the only reference to it.
        let page = unsafe { std::slice::from_raw_parts_mut(self.base, PAGE) };
        f(page)
    }

    fn init_header(&self) {
        let fp = header::fingerprint(&self.layout);
        let (grad, states, total) = (self.grad, self.states, self.total_len);
        self.with_header(|p| {
            p[off::MAGIC..off::MAGIC + 8].copy_from_slice(header::MAGIC);
            header::put_u32(p, off::VERSION, header::VERSION);
            header::put_u32(p, off::GRAD_DTYPE, grad.code());
            header::put_u32(p, off::STATE_DTYPE, states.code());
            header::put_u64(p, off::FINGERPRINT, fp);
            header::put_u64(p, off::TOTAL_LEN, total as u64);
        });
        self.set_state(StoreState { pending_grad_scale: 1.0, ..StoreState::default() });
    }

    /// Locks one unit's record for exclusive access.
    ///
    /// # Panics
    /// If `u` is not a unit of the store's layout (units come from the layout, never from user
    /// input; names from users go through [`ModelLayout::resolve`]).
    pub fn record(&self, u: Unit) -> RecordGuard<'_> {
        let idx = u.index();
        assert!(idx < self.records.len(), "{u:?} is not a unit of this store ({} units)", self.records.len());
        if let Some(p) = self.pager.get() {
            p.touch(idx);
        }
        let lock = self.locks[idx].lock().unwrap_or_else(|p| p.into_inner());
        let loc = self.records[idx];
        let n = loc.len;
        // SAFETY: `loc` was planned inside the mapping (`plan` sums every region into
        // `total_len`, the mapping's size); its metadata page and regions are disjoint,
        // page-aligned (so the u64/f32/bf16 casts are aligned), each at least as long as the
        // slice made of it, and disjoint from every other record and the header. The record's
        // mutex, held by the returned guard, makes these the only references, and the guard's
        // fields are private so none outlives the lock.
        unsafe {
            let at = |o: usize| self.base.add(loc.base + o);
            let applied = &mut *at(0).cast::<u64>();
            let master = std::slice::from_raw_parts_mut(at(loc.master_off()).cast::<f32>(), n);
            let m = std::slice::from_raw_parts_mut(at(loc.m_off()), loc.moment_bytes);
            let v = std::slice::from_raw_parts_mut(at(loc.v_off()), loc.moment_bytes);
            let g = at(loc.grad_off());
            let grad = match self.grad {
                GradDtype::F32 => Some(GradMut::F32(std::slice::from_raw_parts_mut(g.cast::<f32>(), n))),
                GradDtype::Bf16 => Some(GradMut::Bf16(std::slice::from_raw_parts_mut(g.cast::<bf16>(), n))),
                GradDtype::None => None,
            };
            let pager = self.pager.get().map(|p| (p, idx));
            RecordGuard { master, m, v, grad, applied, states: self.states, pager, _lock: lock }
        }
    }

    /// The optimizer step applied to `u` so far ([`RecordGuard::applied_step`]), read under the
    /// record's lock from its meta page alone: no view of its data regions is made, so it may be
    /// read while a DMA engine copies them.
    ///
    /// # Panics
    /// If `u` is not a unit of the store's layout.
    pub fn applied_step(&self, u: Unit) -> u64 {
        let idx = u.index();
        assert!(idx < self.records.len(), "{u:?} is not a unit of this store ({} units)", self.records.len());
        let _lock = self.locks[idx].lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the record's meta page lies inside the mapping (`plan`), is page-aligned (so
        // the u64 read is aligned) and is written only under this record's lock (by a guard or
        // `set_applied_step`), which is held here.
        unsafe { self.base.add(self.records[idx].base).cast::<u64>().read() }
    }

    /// Records optimizer step `t` as applied to `u` ([`RecordGuard::set_applied_step`]), written
    /// under the record's lock into its meta page alone (a DMA engine may just have written its
    /// data regions).
    ///
    /// # Panics
    /// If `u` is not a unit of the store's layout.
    pub fn set_applied_step(&self, u: Unit, t: u64) {
        let idx = u.index();
        assert!(idx < self.records.len(), "{u:?} is not a unit of this store ({} units)", self.records.len());
        let _lock = self.locks[idx].lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: as in `applied_step`; the lock held makes this the only access to the page.
        unsafe { self.base.add(self.records[idx].base).cast::<u64>().write(t) }
    }

    /// Marks the store as untrustworthy: a writer (a DMA copy into a record) failed part-way, so
    /// a record may hold a mix of old and new values while its meta page says otherwise. Every
    /// later step, flush or checkpoint of an engine on this store refuses with `why`; resume
    /// from a checkpoint instead. The first reason is kept.
    pub fn poison(&self, why: String) {
        let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
        p.get_or_insert(why);
    }

    /// Why the store was poisoned ([`HostStore::poison`]), or its pager's write-back failed
    /// (`start_paging`), if either happened.
    pub fn poisoned(&self) -> Option<String> {
        let own = self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).clone();
        own.or_else(|| self.pager.get().and_then(crate::pager::Pager::failure))
    }

    /// Addresses of `u`'s regions, for DMA by a backend that orders every access to them itself
    /// (the scheduler's step program). Computing them touches nothing; using them is the
    /// backend's `unsafe`, under its own invariant.
    pub fn record_addrs(&self, u: Unit) -> RecordAddrs {
        let loc = self.records[u.index()];
        let at = self.base as usize + loc.base;
        RecordAddrs {
            master: at + loc.master_off(),
            m: at + loc.m_off(),
            v: at + loc.v_off(),
            moment_bytes: loc.moment_bytes,
            states: self.states,
            grad: at + loc.grad_off(),
            len: loc.len,
            grad_dtype: self.grad,
        }
    }

    /// `(address, bytes)` of `u`'s whole record (meta page and regions; page-aligned), for
    /// page-locking it in place ([`crate::PinnedRecords`]).
    pub(crate) fn record_range(&self, u: Unit) -> (usize, usize) {
        let loc = self.records[u.index()];
        (self.base as usize + loc.base, loc.bytes(self.grad))
    }

    /// Flushes a file-backed store to disk (no-op for anonymous stores).
    pub fn flush(&self) -> Result<()> {
        match &self.path {
            Some(path) => self.map.flush().map_err(|source| Error::Io { path: path.clone(), source }),
            None => Ok(()),
        }
    }

    /// The layout the store was built for.
    pub fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    /// Gradient buffer dtype.
    pub fn grad_dtype(&self) -> GradDtype {
        self.grad
    }

    /// The AdamW moments' encoding (`--optim-states`), recorded in the header.
    pub fn state_dtype(&self) -> StateDtype {
        self.states
    }

    /// Backing file, if file-backed.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Size of the arena in bytes (header and page padding included).
    pub fn bytes(&self) -> usize {
        self.total_len
    }

    /// Arena bytes per model parameter (with fp32 moments 14 for bf16 gradients, 16 for fp32;
    /// `4 + 2·s + g` for moments of `s` bytes and gradients of `g`; plus padding).
    pub fn bytes_per_param(&self) -> f64 {
        self.total_len as f64 / self.layout.n_params() as f64
    }

    /// Whether a file lock is held (file-backed stores).
    pub fn is_file_backed(&self) -> bool {
        self.file.is_some()
    }
}

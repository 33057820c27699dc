//! The disk tier: a file-backed store paged through a bounded RAM window.
//!
//! A store larger than the RAM a run may use lives in its file; only a window of records stays
//! in memory. The pager is told the order in which one step touches the records (cyclic: the
//! next step repeats it) and the window's size; every [`HostStore::record`] call moves its
//! cursor. Two threads then keep the window right:
//!
//! - **read-ahead** brings the next records in the order into memory before the step reaches
//!   them: `MADV_WILLNEED` in pieces (the kernel's asynchronous reads into the page cache) then
//!   `MADV_POPULATE_READ` (mapped in this process, so the step takes no major page faults; mapped
//!   read-only, so a page becomes dirty, and is written back, only if the step writes it);
//! - **write-back** sends every record that fell out of the window to disk and drops it:
//!   `MADV_DONTNEED` (unmapped; on a shared file mapping the data stays in the page cache, dirty),
//!   `sync_file_range` (written, waited for, no device cache flush) and `POSIX_FADV_DONTNEED`
//!   (the now-clean pages leave the page cache).
//!
//! The mapping is `MADV_RANDOM`: the kernel reads no more than the faulting page on a miss, so
//! nothing of a record outside the window comes in unasked (with the kernel's own read-ahead,
//! pieces of every record did, and stayed).
//!
//! The window holds the record in use, the next ones in the order up to its size (with the cyclic
//! order known, those whose next use is soonest: Belady's choice) and, where it fits, the previous
//! one. Memory is bounded, not only aimed at: read-ahead never takes more than the window plus
//! [`crate::PAGED_IN_FLIGHT`] records, a touch waits (back-pressure) while write-back is behind, and a record whose guard is
//! alive is never dropped. Nothing here changes a byte of the store: every call keeps a shared
//! file mapping's contents. A failed write-back is the one thing the pager cannot repair: it stops
//! paging and the store reports itself poisoned ([`crate::HostStore::poisoned`]), so no step or
//! checkpoint follows.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// Counters of a pager since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PagingStats {
    /// Bytes of records brought in ahead of use (pages already cached cost no I/O).
    pub read_ahead_bytes: u64,
    /// Bytes of records dropped from memory, their dirty pages written to the file first.
    pub evicted_bytes: u64,
    /// Seconds the read-ahead thread spent reading.
    pub read_ahead_s: f64,
    /// Seconds the write-back thread spent writing and dropping.
    pub write_back_s: f64,
    /// Seconds the step waited in a touch for write-back to make room or read-ahead to bring
    /// the record in (the disk was the bound).
    pub stalled_s: f64,
    /// Records the step touched while they were not (yet) in memory.
    pub misses: u64,
    /// Advice calls that failed (a kernel without `MADV_POPULATE_READ`, say): paging then falls
    /// back to page faults, slower but correct. A failed write-back is not counted here: it
    /// poisons the store.
    pub errors: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Absent,
    Loading,
    Resident,
    Evicting,
    /// Out of memory as far as the pager knows, and being swept of stray pages (not counted).
    Sweeping,
}

#[derive(Debug)]
struct State {
    /// Record indices in the order one step touches them (never empty).
    order: Vec<usize>,
    /// Position in `order` of the latest touch.
    pos: usize,
    status: Vec<Status>,
    want: Vec<bool>,
    /// Touched while being written back: its pages are (partly) back in memory.
    retouched: Vec<bool>,
    /// Guards of the record alive (`HostStore::record` to their drop): never dropped from
    /// memory while in use.
    in_use: Vec<u32>,
    /// Touched since it was last dropped: a record touched while out of memory (or dropped
    /// while a job still used it) may have pages back that the pager did not count; write-back
    /// sweeps those once the window has passed them.
    touched: Vec<bool>,
    stop: bool,
    /// Why write-back failed (the store's data on disk can no longer be trusted).
    failed: Option<String>,
    stats: PagingStats,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    /// Address of the store's mapping (valid while the pager lives: the store drops its pager,
    /// joining its threads, before it unmaps).
    base: usize,
    /// `(offset, bytes)` of each record in the mapping and the file, page-aligned.
    ranges: Vec<(usize, usize)>,
    window: u64,
    /// The most the pager lets be in memory: the window and [`crate::PAGED_IN_FLIGHT`] records
    /// on their way in or out.
    limit: u64,
    /// The store's file, opened again (its own error state: a write error it reports is not
    /// taken from the mapping's flush).
    file: File,
}

/// A running pager ([`crate::HostStore::start_paging`]); stops its threads on drop.
#[derive(Debug)]
pub(crate) struct Pager {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// Bytes a load populates at a time, so that a stop is seen between chunks of a large record.
const LOAD_CHUNK: usize = 64 << 20;
/// Bytes one `MADV_WILLNEED` asks for: the kernel reads at most its read-ahead maximum a call
/// (`max(read_ahead_kb, max_sectors_kb)`, 128 KiB on some disks), so a record is asked for in
/// pieces no larger, all queued before the populate waits for them.
const WILLNEED_PIECE: usize = 128 << 10;

impl State {
    /// Record `i` may hold pages the pager does not count: touched while out of memory (or
    /// dropped while in use), outside the window, out of memory as far as the pager knows.
    fn stray(&self, i: usize) -> bool {
        self.touched[i] && !self.want[i] && self.status[i] == Status::Absent && self.in_use[i] == 0
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.wake.wait(st).unwrap_or_else(|p| p.into_inner())
    }

    fn len(&self, i: usize) -> u64 {
        self.ranges[i].1 as u64
    }

    /// Bytes of records in memory or on their way in or out.
    fn held(&self, st: &State) -> u64 {
        let counted = |s: Status| !matches!(s, Status::Absent | Status::Sweeping);
        (0..self.ranges.len()).filter(|&i| counted(st.status[i])).map(|i| self.len(i)).sum()
    }

    /// Marks the window: the record in use and the next in the order up to the window's bytes
    /// (at least the next one), then the previous one if it fits (a job may still be finishing it).
    fn recompute(&self, st: &mut State) {
        let n = st.order.len();
        st.want.fill(false);
        let (mut bytes, mut count) = (0u64, 0);
        for k in 0..n {
            let i = st.order[(st.pos + k) % n];
            if st.want[i] {
                continue;
            }
            if count >= 2 && bytes + self.len(i) > self.window {
                break;
            }
            st.want[i] = true;
            bytes += self.len(i);
            count += 1;
        }
        let prev = st.order[(st.pos + n - 1) % n];
        if !st.want[prev] && bytes + self.len(prev) <= self.window {
            st.want[prev] = true;
        }
    }

    /// The next wanted record in the order not in memory, if it fits beside what is.
    fn next_to_load(&self, st: &State) -> Option<usize> {
        let n = st.order.len();
        let i = (0..n)
            .map(|k| st.order[(st.pos + k) % n])
            .find(|&i| st.want[i] && st.status[i] == Status::Absent)?;
        (self.held(st) + self.len(i) <= self.limit).then_some(i)
    }

    /// A record in memory the window does not want: the one whose next use is farthest (just
    /// behind the cursor) first, then any outside the order.
    fn next_to_evict(&self, st: &State) -> Option<usize> {
        let n = st.order.len();
        let dropped = |i: usize| !st.want[i] && st.status[i] == Status::Resident && st.in_use[i] == 0;
        (1..n)
            .rev()
            .map(|k| st.order[(st.pos + k) % n])
            .find(|&i| dropped(i))
            .or_else(|| (0..self.ranges.len()).find(|&i| dropped(i)))
    }

    fn addr(&self, i: usize) -> (*mut libc::c_void, usize, usize) {
        let (off, len) = self.ranges[i];
        ((self.base + off) as *mut libc::c_void, off, len)
    }

    /// Reads record `i` into memory, mapped, a chunk at a time (stopping early if the pager
    /// stops). Returns whether every advice succeeded.
    fn load(&self, i: usize) -> bool {
        let (ptr, _, len) = self.addr(i);
        let mut ok = true;
        for at in (0..len).step_by(LOAD_CHUNK) {
            if self.lock().stop {
                break;
            }
            let n = LOAD_CHUNK.min(len - at);
            // SAFETY: `ptr + at .. + n` is a page-aligned part of record `i`'s range of the
            // store's live shared file mapping (the store drops the pager, joining this thread,
            // before it unmaps). WILLNEED and POPULATE_READ only read the file's pages in and map
            // them; no byte changes, so threads holding slices of the record are unaffected.
            unsafe {
                let p = ptr.cast::<u8>().add(at);
                for piece in (0..n).step_by(WILLNEED_PIECE) {
                    let m = WILLNEED_PIECE.min(n - piece);
                    ok &= libc::madvise(p.add(piece).cast(), m, libc::MADV_WILLNEED) == 0;
                }
                ok &= libc::madvise(p.cast(), n, libc::MADV_POPULATE_READ) == 0;
            }
        }
        ok
    }

    /// Writes record `i` back to the file and drops it from memory. `Err` if the write failed:
    /// its pages are then kept (never dropped as if written).
    fn evict(&self, i: usize) -> Result<bool, String> {
        let (ptr, off, len) = self.addr(i);
        // SAFETY: as in `load` for the range. MADV_DONTNEED on a *shared file* mapping only
        // unmaps: the kernel moves each page's dirty bit to the page cache, and a later access
        // faults the same data back in (it never reads zeros, as a private mapping would), so a
        // thread still reading the record sees the same bytes.
        let unmapped = unsafe { libc::madvise(ptr, len, libc::MADV_DONTNEED) } == 0;
        write_out(&self.file, off as u64, len as u64, true)
            .map_err(|e| format!("writing a record of the --store file back to disk failed ({e})"))?;
        Ok(unmapped)
    }
}

/// Waits for a job `pick` finds (marking it with `mark`), or `None` once the pager stops or
/// has failed.
fn next_job<T>(s: &Shared, mut pick: impl FnMut(&mut State) -> Option<T>) -> Option<T> {
    let mut st = s.lock();
    loop {
        if st.stop || st.failed.is_some() {
            return None;
        }
        if let Some(i) = pick(&mut st) {
            return Some(i);
        }
        st = s.wait(st);
    }
}

fn read_ahead(s: &Shared) {
    while let Some(i) = next_job(s, |st| {
        let i = s.next_to_load(st)?;
        st.status[i] = Status::Loading;
        Some(i)
    }) {
        let t = Instant::now();
        let ok = s.load(i);
        let mut st = s.lock();
        st.status[i] = Status::Resident;
        st.stats.read_ahead_bytes += s.len(i);
        st.stats.read_ahead_s += t.elapsed().as_secs_f64();
        st.stats.errors += u64::from(!ok);
        s.wake.notify_all();
    }
}

fn write_back(s: &Shared) {
    while let Some((i, sweep)) = next_job(s, |st| {
        if let Some(i) = s.next_to_evict(st) {
            st.status[i] = Status::Evicting;
            return Some((i, false));
        }
        // A record touched while the pager counted it out of memory: sweep its stray pages
        // (written back first where the step wrote them).
        let i = (0..s.ranges.len()).find(|&i| st.stray(i))?;
        st.status[i] = Status::Sweeping;
        Some((i, true))
    }) {
        let t = Instant::now();
        let r = s.evict(i);
        let mut st = s.lock();
        match r {
            Ok(unmapped) => {
                // A record the step touched meanwhile has pages in memory again.
                // A record the step touched meanwhile: read in again if the window wants it
                // (the touch waits for that), else swept of what it faulted in.
                let back = std::mem::take(&mut st.retouched[i]);
                st.status[i] = Status::Absent;
                st.touched[i] = back;
                st.stats.errors += u64::from(!unmapped);
                if !sweep {
                    st.stats.evicted_bytes += s.len(i);
                    st.stats.write_back_s += t.elapsed().as_secs_f64();
                }
            }
            Err(why) => {
                st.status[i] = Status::Resident;
                st.failed.get_or_insert(why);
            }
        }
        s.wake.notify_all();
    }
    // Wake a touch waiting for room that will not come.
    s.wake.notify_all();
}

impl Pager {
    /// Starts paging the records at `ranges` (offsets into the mapping at `base` and into
    /// `file`) in `order` (not empty, every index a record), keeping at most `window` bytes of
    /// them wanted in memory (never fewer than the record in use and the next) and at most one
    /// record more held. Every record counts as in memory at first, so the write-back thread
    /// starts by dropping what the window does not want.
    pub(crate) fn start(
        base: usize,
        ranges: Vec<(usize, usize)>,
        order: Vec<usize>,
        window: u64,
        file: File,
    ) -> std::io::Result<Self> {
        let n = ranges.len();
        assert!(!order.is_empty() && order.iter().all(|&i| i < n), "the store checks the order");
        let largest = ranges.iter().map(|r| r.1 as u64).max().unwrap_or(0);
        let state = State {
            order,
            pos: 0,
            status: vec![Status::Resident; n],
            want: vec![false; n],
            retouched: vec![false; n],
            touched: vec![false; n],
            in_use: vec![0; n],
            stop: false,
            failed: None,
            stats: PagingStats::default(),
        };
        let limit = window + crate::PAGED_IN_FLIGHT * largest;
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            wake: Condvar::new(),
            base,
            ranges,
            window,
            limit,
            file,
        });
        {
            let mut st = shared.lock();
            shared.recompute(&mut st);
        }
        // Built first, so that a thread that fails to start leaves the other one stopped by drop.
        let mut pager = Pager { shared, threads: Vec::new() };
        for (name, f) in [("mt-read-ahead", read_ahead as fn(&Shared)), ("mt-write-back", write_back)] {
            let s = Arc::clone(&pager.shared);
            pager.threads.push(std::thread::Builder::new().name(name.into()).spawn(move || f(&s))?);
        }
        Ok(pager)
    }

    /// Record `i` is being used: the cursor moves to its next place in the order (a touch of
    /// a record behind the cursor, from a job finishing late, moves nothing). Then waits while
    /// memory is over the limit (write-back behind the step), counting the record itself, and
    /// while the window's record is not yet read in.
    pub(crate) fn touch(&self, i: usize) {
        let s = &self.shared;
        let mut st = s.lock();
        let n = st.order.len();
        match (0..n).find(|&k| st.order[(st.pos + k) % n] == i) {
            Some(k) if k <= n / 2 => st.pos = (st.pos + k) % n,
            _ => {}
        }
        match st.status[i] {
            Status::Resident => {}
            Status::Evicting | Status::Sweeping => {
                st.retouched[i] = true;
                st.stats.misses += 1;
            }
            Status::Absent | Status::Loading => st.stats.misses += 1,
        }
        s.recompute(&mut st);
        st.touched[i] = true;
        st.in_use[i] += 1;
        s.wake.notify_all();
        let t = Instant::now();
        let mut waited = false;
        while !st.stop && st.failed.is_none() {
            let own = if matches!(st.status[i], Status::Absent | Status::Sweeping) { s.len(i) } else { 0 };
            // Room for it, and a record of the window read in whole by the read-ahead thread (at
            // the disk's speed) rather than faulted in a page at a time (MADV_RANDOM).
            if s.held(&st) + own <= s.limit && !(st.want[i] && st.status[i] != Status::Resident) {
                break;
            }
            waited = true;
            st = s.wait(st);
        }
        if st.status[i] == Status::Absent && !st.want[i] {
            // A record outside the order (a resident unit's): in memory now, so write-back
            // drops it again.
            st.status[i] = Status::Resident;
        }
        if waited {
            st.stats.stalled_s += t.elapsed().as_secs_f64();
        }
    }

    /// A guard of record `i` ([`Pager::touch`]'s) is gone.
    pub(crate) fn release(&self, i: usize) {
        let mut st = self.shared.lock();
        st.in_use[i] = st.in_use[i].saturating_sub(1);
        self.shared.wake.notify_all();
    }

    /// Counters so far.
    pub(crate) fn stats(&self) -> PagingStats {
        self.shared.lock().stats
    }

    /// Why write-back failed, if it did (the store is then poisoned).
    pub(crate) fn failure(&self) -> Option<String> {
        self.shared.lock().failed.clone()
    }

    /// Bytes of records in memory now (resident or being read in or written back).
    pub(crate) fn held_bytes(&self) -> u64 {
        let st = self.shared.lock();
        self.shared.held(&st)
    }

    /// Waits until the window is settled: every wanted record in memory, every other one
    /// written back and swept (returns at once if paging stopped or failed).
    pub(crate) fn settle(&self) {
        let mut st = self.shared.lock();
        while !st.stop
            && st.failed.is_none()
            && ((0..st.want.len()).any(|i| st.stray(i))
                || st.status.iter().zip(&st.want).any(|(s, w)| {
                    if *w {
                        *s != Status::Resident
                    } else {
                        *s != Status::Absent
                    }
                }))
        {
            st = self.shared.wait(st);
        }
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Drops `len` bytes at `off` of a file from the page cache if they are clean (advisory: a
/// snapshot read once need not stay cached in a bounded run).
pub(crate) fn drop_cached(file: &File, off: u64, len: u64) {
    // SAFETY: the call acts on our own open file over a byte range; it touches no memory of this
    // process and drops only clean, unmapped pages.
    let _ =
        unsafe { libc::posix_fadvise(file.as_raw_fd(), off as i64, len as i64, libc::POSIX_FADV_DONTNEED) };
}

/// Sends `len` bytes at `off` of a file to disk (`wait`: waits for the write and then drops
/// the now-clean pages from the page cache; otherwise only starts the write). The pager's
/// write-back, and a paged store's snapshot a record behind, so neither holds more than a record
/// or two of dirty pages. An error is the write's: the pages are then not dropped.
pub(crate) fn write_out(file: &File, off: u64, len: u64, wait: bool) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    // SAFETY: both calls act on our own open file over a byte range; neither touches memory of
    // this process.
    if unsafe { libc::sync_file_range(fd, off as i64, len as i64, flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if wait {
        // SAFETY: as above. FADV_DONTNEED drops only clean, unmapped pages; advisory, so its
        // failure loses nothing.
        let _ = unsafe { libc::posix_fadvise(fd, off as i64, len as i64, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(())
}

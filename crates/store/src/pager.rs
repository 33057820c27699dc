//! The disk tier: a file-backed store paged through a bounded RAM window.
//!
//! A store larger than the RAM a run may use lives in its file; only a window of records stays
//! in memory. The pager is told the order in which one step touches the records (cyclic: the
//! next step repeats it) and the window's size; every [`HostStore::record`] call moves its
//! cursor. Two threads then keep the window right:
//!
//! - **read-ahead** brings the next records in the order into memory before the step reaches
//!   them: `MADV_WILLNEED` (the kernel's large asynchronous reads into the page cache) then
//!   `MADV_POPULATE_READ` (mapped in this process, so the step takes no major page faults; mapped
//!   read-only, so a page becomes dirty, and is written back, only if the step writes it);
//! - **write-back** sends every record that fell out of the window to disk and drops it:
//!   `MADV_DONTNEED` (unmapped; on a shared file mapping the data stays in the page cache, dirty),
//!   `sync_file_range` (written, waited for, no device cache flush) and `POSIX_FADV_DONTNEED`
//!   (the now-clean pages leave the page cache).
//!
//! The window holds the records whose next use is soonest (with the cyclic order known this is
//! Belady's choice), never fewer than the record in use and the next. Nothing here changes a
//! byte of the store: every call above keeps a shared file mapping's contents, so a record the
//! pager drops while a step still reads it is only read back from the file (slower, never
//! wrong). What the window bounds is the process's share of RAM: the planner sizes it from
//! `--host-mem` (`mt_sched::plan`).

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
    /// Records the step touched while they were not (yet) in memory.
    pub misses: u64,
    /// System calls that failed (the kernel lacks an advice, say): paging then falls back to
    /// page faults and the kernel's own reclaim, slower but correct.
    pub errors: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Absent,
    Loading,
    Resident,
    Evicting,
}

#[derive(Debug)]
struct State {
    /// Record indices in the order one step touches them.
    order: Vec<usize>,
    /// Position in `order` of the latest touch.
    pos: usize,
    status: Vec<Status>,
    want: Vec<bool>,
    /// Touched while being written back: its pages are (partly) back in memory.
    retouched: Vec<bool>,
    /// The records outside the window that count as out of memory were swept since the cursor
    /// last moved (the kernel's own read-ahead on a page fault may have brought some of their
    /// pages in, clean).
    swept: bool,
    stop: bool,
    stats: PagingStats,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    /// Address of the store's mapping (valid while the pager lives: the store drops its pager
    /// before its mapping).
    base: usize,
    /// `(offset, bytes)` of each record in the mapping and the file, page-aligned.
    ranges: Vec<(usize, usize)>,
    window: u64,
    file: File,
}

/// A running pager ([`crate::HostStore::start_paging`]); stops its threads on drop.
#[derive(Debug)]
pub(crate) struct Pager {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the records whose next use is soonest, from the latest touch on, up to the window
    /// (the previous record too: a job may still be finishing it).
    fn recompute(&self, st: &mut State) {
        let n = st.order.len();
        st.want.fill(false);
        let mut bytes = 0u64;
        let mut count = 0;
        let prev = st.order[(st.pos + n - 1) % n];
        for k in std::iter::once(n - 1).chain(0..n) {
            let i = if k == n - 1 { prev } else { st.order[(st.pos + k) % n] };
            if st.want[i] {
                continue;
            }
            let len = self.ranges[i].1 as u64;
            if count >= 2 && bytes + len > self.window {
                break;
            }
            st.want[i] = true;
            bytes += len;
            count += 1;
        }
    }

    fn next_to_load(st: &State) -> Option<usize> {
        let n = st.order.len();
        (0..n).map(|k| st.order[(st.pos + k) % n]).find(|&i| st.want[i] && st.status[i] == Status::Absent)
    }

    fn next_to_evict(st: &State) -> Option<usize> {
        // The record left behind longest ago first: its next use is the farthest.
        let n = st.order.len();
        (1..=n).map(|k| st.order[(st.pos + k) % n]).find(|&i| !st.want[i] && st.status[i] == Status::Resident)
    }

    fn addr(&self, i: usize) -> (*mut libc::c_void, usize, usize) {
        let (off, len) = self.ranges[i];
        ((self.base + off) as *mut libc::c_void, off, len)
    }

    /// Reads record `i` into memory, mapped writable. Returns whether every call succeeded.
    fn load(&self, i: usize) -> bool {
        let (ptr, _, len) = self.addr(i);
        // SAFETY: `ptr..ptr+len` is a page-aligned range of the store's live shared file mapping
        // (the store drops the pager, joining this thread, before it unmaps). WILLNEED and
        // POPULATE_READ only read the file's pages in and map them; no byte changes, so threads
        // holding slices of the record are unaffected.
        unsafe {
            let a = libc::madvise(ptr, len, libc::MADV_WILLNEED);
            let b = libc::madvise(ptr, len, libc::MADV_POPULATE_READ);
            a == 0 && b == 0
        }
    }

    /// Writes record `i` back to the file and drops it from memory. Returns whether every call
    /// succeeded.
    fn evict(&self, i: usize) -> bool {
        let (ptr, off, len) = self.addr(i);
        let fd = self.file.as_raw_fd();
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: as in `load` for the range. MADV_DONTNEED on a *shared file* mapping only
        // unmaps: the kernel moves each page's dirty bit to the page cache, and a later access
        // faults the same data back in (it never reads zeros, as a private mapping would), so a
        // thread still reading the record sees the same bytes. `sync_file_range` and
        // `posix_fadvise` act on our own open file over the record's byte range; FADV_DONTNEED
        // drops only clean, unmapped pages.
        unsafe {
            let a = libc::madvise(ptr, len, libc::MADV_DONTNEED);
            let b = libc::sync_file_range(fd, off as i64, len as i64, flags);
            let c = libc::posix_fadvise(fd, off as i64, len as i64, libc::POSIX_FADV_DONTNEED);
            a == 0 && b == 0 && c == 0
        }
    }
}

fn read_ahead(s: &Shared) {
    loop {
        let i = {
            let mut st = s.lock();
            loop {
                if st.stop {
                    return;
                }
                if let Some(i) = Shared::next_to_load(&st) {
                    st.status[i] = Status::Loading;
                    break i;
                }
                st = s.wake.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let t = Instant::now();
        let ok = s.load(i);
        let mut st = s.lock();
        st.status[i] = Status::Resident;
        st.stats.read_ahead_bytes += s.ranges[i].1 as u64;
        st.stats.read_ahead_s += t.elapsed().as_secs_f64();
        st.stats.errors += u64::from(!ok);
        s.wake.notify_all();
    }
}

/// Drops what the kernel's own read-ahead brought in of the records outside the window that
/// count as out of memory (clean pages; nothing to write), one record at a time.
fn sweep(s: &Shared) {
    for i in 0..s.ranges.len() {
        let mut st = s.lock();
        if st.stop || st.want[i] || st.status[i] != Status::Absent {
            continue;
        }
        st.status[i] = Status::Evicting;
        drop(st);
        let ok = s.evict(i);
        let mut st = s.lock();
        st.status[i] = if std::mem::take(&mut st.retouched[i]) { Status::Resident } else { Status::Absent };
        st.stats.errors += u64::from(!ok);
    }
}

fn write_back(s: &Shared) {
    loop {
        let i = {
            let mut st = s.lock();
            loop {
                if st.stop {
                    return;
                }
                if let Some(i) = Shared::next_to_evict(&st) {
                    st.status[i] = Status::Evicting;
                    break i;
                }
                if !st.swept {
                    st.swept = true;
                    drop(st);
                    sweep(s);
                    st = s.lock();
                    s.wake.notify_all();
                    continue;
                }
                st = s.wake.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let t = Instant::now();
        let ok = s.evict(i);
        let mut st = s.lock();
        // A record the step touched meanwhile has pages in memory again: the next pass drops
        // them (or the window keeps them).
        st.status[i] = if std::mem::take(&mut st.retouched[i]) { Status::Resident } else { Status::Absent };
        st.stats.evicted_bytes += s.ranges[i].1 as u64;
        st.stats.write_back_s += t.elapsed().as_secs_f64();
        st.stats.errors += u64::from(!ok);
        s.wake.notify_all();
    }
}

impl Pager {
    /// Starts paging the records at `ranges` (offsets into the mapping at `base` and into
    /// `file`) in `order`, keeping at most `window` bytes of them in memory (and never fewer
    /// than two records). Every record counts as in memory at first, so the write-back thread
    /// starts by dropping what the window does not want.
    pub(crate) fn start(
        base: usize,
        ranges: Vec<(usize, usize)>,
        order: Vec<usize>,
        window: u64,
        file: File,
    ) -> std::io::Result<Self> {
        let n = ranges.len();
        let state = State {
            order,
            pos: 0,
            status: vec![Status::Resident; n],
            want: vec![false; n],
            retouched: vec![false; n],
            swept: false,
            stop: false,
            stats: PagingStats::default(),
        };
        let shared =
            Arc::new(Shared { state: Mutex::new(state), wake: Condvar::new(), base, ranges, window, file });
        {
            let mut st = shared.lock();
            shared.recompute(&mut st);
        }
        let mut threads = Vec::new();
        for (name, f) in [("mt-read-ahead", read_ahead as fn(&Shared)), ("mt-write-back", write_back)] {
            let s = Arc::clone(&shared);
            threads.push(std::thread::Builder::new().name(name.into()).spawn(move || f(&s))?);
        }
        Ok(Pager { shared, threads })
    }

    /// Record `i` is being used: the cursor moves to its next place in the order (a touch of
    /// a record behind the cursor, from a job finishing late, moves nothing).
    pub(crate) fn touch(&self, i: usize) {
        let mut st = self.shared.lock();
        let n = st.order.len();
        match (0..n).find(|&k| st.order[(st.pos + k) % n] == i) {
            Some(k) if k <= n / 2 => st.pos = (st.pos + k) % n,
            Some(_) => {}
            // A record outside the order (a resident unit's, read at load or write-back): in
            // memory now, so the write-back thread drops it again.
            None if st.status[i] == Status::Absent => st.status[i] = Status::Resident,
            None => {}
        }
        if st.status[i] != Status::Resident {
            st.stats.misses += 1;
        }
        if st.status[i] == Status::Evicting {
            st.retouched[i] = true;
        }
        self.shared.recompute(&mut st);
        st.swept = false;
        self.shared.wake.notify_all();
    }

    /// Counters so far.
    pub(crate) fn stats(&self) -> PagingStats {
        self.shared.lock().stats
    }

    /// Bytes of records in memory now (resident or being read in or written back).
    pub(crate) fn held_bytes(&self) -> u64 {
        let st = self.shared.lock();
        st.status
            .iter()
            .zip(&self.shared.ranges)
            .filter(|(s, _)| **s != Status::Absent)
            .map(|(_, r)| r.1 as u64)
            .sum()
    }

    /// Waits until the window is settled: every wanted record in memory, every other one
    /// written back.
    pub(crate) fn settle(&self) {
        let mut st = self.shared.lock();
        while !st.swept
            || st.status.iter().zip(&st.want).any(|(s, w)| {
                if *w {
                    *s != Status::Resident
                } else {
                    *s != Status::Absent
                }
            })
        {
            st = self.shared.wake.wait(st).unwrap_or_else(|p| p.into_inner());
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

/// Sends `len` bytes at `off` of a file just written to disk and out of the page cache
/// (`wait`: wait for the write and drop the pages; otherwise only start the write), so a
/// snapshot of a paged store never holds more than a record or two of dirty pages. Returns
/// whether the calls succeeded; a failure only leaves the pages to the kernel.
pub(crate) fn write_out(file: &File, off: u64, len: u64, wait: bool) -> bool {
    let fd = file.as_raw_fd();
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    // SAFETY: both calls act on our own open file over a byte range; neither touches memory of
    // this process.
    unsafe {
        let a = libc::sync_file_range(fd, off as i64, len as i64, flags);
        let b =
            if wait { libc::posix_fadvise(fd, off as i64, len as i64, libc::POSIX_FADV_DONTNEED) } else { 0 };
        a == 0 && b == 0
    }
}

//! The disk tier: a file-backed store paged through a RAM window keeps every byte a step wrote
//! and no more of itself in memory than the window (measured with mincore), never holds more
//! than the window and a record, drops records outside the order after use, and refuses to page
//! what has no file or an order naming no unit of it.

use mt_core::{ModelConfig, ModelLayout, Unit};
use mt_store::{GradDtype, GradMut, HostStore, PAGE};

fn layout() -> ModelLayout {
    let mut cfg = ModelConfig::tiny_llama();
    cfg.num_hidden_layers = 12;
    ModelLayout::new(&cfg)
}

/// The order of a step's host accesses in exact mode: forward, then backward.
fn step_order(l: &ModelLayout) -> Vec<Unit> {
    let units: Vec<Unit> = l.units().collect();
    units.iter().copied().chain(units.iter().rev().copied()).collect()
}

fn value(round: usize, u: Unit, i: usize) -> f32 {
    (round * 1_000_003 + u.index() * 7919 + i) as f32
}

/// Whether `dir` is on a tmpfs, whose pages are the file itself (nothing to write back to).
fn on_tmpfs(dir: &std::path::Path) -> bool {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    let mut s = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `s` a statfs buffer for the call to fill.
    let rc = unsafe { libc::statfs(c.as_ptr(), s.as_mut_ptr()) };
    // SAFETY: statfs returned 0, so it filled `s`.
    rc == 0 && unsafe { s.assume_init() }.f_type == libc::TMPFS_MAGIC
}

/// A new file-backed store on the disk the build is on (a tmpfs /tmp would hold every page by
/// definition), its directory, layout, path and largest record's bytes.
fn file_store(name: &str) -> (tempfile::TempDir, ModelLayout, std::path::PathBuf, HostStore, u64) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (l, path) = (layout(), dir.path().join(name));
    let s = HostStore::create(&path, &l, GradDtype::Bf16).unwrap();
    let record = s.largest_record_bytes();
    (dir, l, path, s, record)
}

#[test]
fn a_paged_store_holds_its_window_and_keeps_every_byte() {
    let (dir, l, path, s, record) = file_store("paged.store");
    assert!(s.bytes() as u64 > 8 * record, "the test needs a store of many records");
    let order = step_order(&l);
    s.start_paging(&order, 2 * record).unwrap();
    assert!(s.start_paging(&order, 2 * record).unwrap_err().to_string().contains("paging already"));
    for round in 0..3 {
        for &u in &order {
            let mut r = s.record(u);
            let held = s.paged_in_bytes().unwrap();
            assert!(
                held <= (2 + mt_store::PAGED_IN_FLIGHT) * record,
                "round {round}: the pager holds {held} B, limit {} ({:?})",
                (2 + mt_store::PAGED_IN_FLIGHT) * record,
                s.poisoned()
            );
            for (i, x) in r.master_mut().iter_mut().enumerate() {
                *x = value(round, u, i);
            }
            if let Some(GradMut::Bf16(g)) = r.grad_mut() {
                g.fill(half::bf16::from_f32(round as f32));
            }
        }
        s.settle_paging();
        let held = s.bytes_in_memory().unwrap();
        // The window (two records), the header page; nothing else of the store.
        if !on_tmpfs(dir.path()) {
            assert!(
                held <= 2 * record + PAGE as u64,
                "round {round}: {held} B in RAM, window {}",
                2 * record
            );
        }
        let counted = s.paged_in_bytes().unwrap();
        assert!(counted > 0 && counted <= 2 * record, "the pager's own count: {counted}");
    }
    let stats = s.paging_stats().unwrap();
    assert!(stats.evicted_bytes >= (s.bytes() as u64 - 3 * record) * 3, "{stats:?}");
    assert!(stats.read_ahead_bytes > 0 && stats.errors == 0, "{stats:?}");
    drop(s);
    let s = HostStore::open(&path, &l).unwrap();
    for u in l.units() {
        let r = s.record(u);
        assert!(r.master().iter().enumerate().all(|(i, &x)| x == value(2, u, i)), "{u:?}");
    }
}

#[test]
fn a_record_outside_the_order_is_dropped_after_use() {
    let (dir, l, _, s, record) = file_store("outside.store");
    // The outer unit resident elsewhere: its record is read, not streamed.
    let order: Vec<Unit> = step_order(&l).into_iter().filter(|&u| u != Unit::Outer).collect();
    s.start_paging(&order, 2 * record).unwrap();
    for _ in 0..2 {
        s.record(Unit::Outer).master_mut().fill(1.5);
        for &u in &order {
            s.record(u).master_mut().fill(2.5);
        }
    }
    s.settle_paging();
    let held = s.bytes_in_memory().unwrap();
    // The window and the header page, and at most a fault-around's 16 pages at the edge of each
    // record (seen: 10 pages at the start of some records, 0.8% of this store).
    let slack = (PAGE * (1 + 16 * l.n_units())) as u64;
    if !on_tmpfs(dir.path()) {
        assert!(held <= 2 * record + slack, "{held} B in RAM, window {}", 2 * record);
    }
    assert!(s.record(Unit::Outer).master().iter().all(|&x| x == 1.5));
}

#[test]
fn only_a_file_backed_store_pages() {
    let l = layout();
    let s = HostStore::anonymous(&l, GradDtype::Bf16).unwrap();
    let e = s.start_paging(&step_order(&l), 1 << 20).unwrap_err().to_string();
    assert!(e.contains("only a file-backed store"), "{e}");
    assert!(s.paging_stats().is_none() && !s.is_paging());
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let f = HostStore::create(&dir.path().join("s.store"), &l, GradDtype::Bf16).unwrap();
    let e = f.start_paging(&[Unit::Layer(99)], 1 << 20).unwrap_err().to_string();
    assert!(e.contains("is not a unit of this store"), "{e}");
    assert!(f.start_paging(&[], 1 << 20).unwrap_err().to_string().contains("order"));
}

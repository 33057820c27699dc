//! The disk tier: a file-backed store paged through a RAM window keeps every byte a step wrote
//! and no more of itself in memory than the window (measured with mincore), and refuses to page
//! what has no file.

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

#[test]
fn a_paged_store_holds_its_window_and_keeps_every_byte() {
    // On the disk the build is on (a tmpfs /tmp would hold every page by definition).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (l, path) = (layout(), dir.path().join("paged.store"));
    let s = HostStore::create(&path, &l, GradDtype::Bf16).unwrap();
    let record = s.largest_record_bytes();
    assert!(s.bytes() as u64 > 8 * record, "the test needs a store of many records");
    let order = step_order(&l);
    s.start_paging(&order, 2 * record).unwrap();
    assert!(s.start_paging(&order, 2 * record).unwrap_err().to_string().contains("paging already"));
    for round in 0..3 {
        for &u in &order {
            let mut r = s.record(u);
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
fn only_a_file_backed_store_pages() {
    let l = layout();
    let s = HostStore::anonymous(&l, GradDtype::Bf16).unwrap();
    let e = s.start_paging(&step_order(&l), 1 << 20).unwrap_err().to_string();
    assert!(e.contains("only a file-backed store"), "{e}");
    assert!(s.paging_stats().is_none() && !s.is_paging());
}

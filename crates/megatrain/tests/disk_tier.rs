//! The disk tier through the `megatrain` binary: a `--store` file larger than `--host-mem` is
//! paged through a RAM window, and the run (a checkpoint, a kill and a resume included) ends
//! with the same weights, bit for bit, as one that holds the whole store in RAM.

use std::path::Path;
use std::process::{Command, Output};

fn megatrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megatrain")).args(args).output().expect("run megatrain")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The built-in model and data (a 12 MiB store of five records of at most 2.6 MiB).
const RUN: [&str; 9] = ["train", "--steps", "5", "--batch-size", "2", "--seq-len", "16", "--lr", "0.003"];
/// Host memory for the paged runs: 12.6 MiB, a window of two to three records beside the rings.
const SMALL_HOST: &str = "0.0123";

#[test]
fn a_paged_store_trains_resumes_and_ends_bitwise_as_one_in_ram() {
    // On the build's disk: a tmpfs would keep every page anyway.
    let t = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (a, b, c) = (t.path().join("a"), t.path().join("b"), t.path().join("c"));
    let whole = megatrain(&[&RUN[..], &["--store", s(&t.path().join("a.mts")), "--out", s(&a)]].concat());
    assert!(whole.status.success(), "{}", text(&whole));
    assert!(!text(&whole).contains("paged from its file"), "{}", text(&whole));

    let paged = |out: &Path, store: &str, extra: &[&str]| {
        let store = t.path().join(store);
        let args =
            [&RUN[..], &["--store", s(&store), "--out", s(out), "--host-mem", SMALL_HOST], extra].concat();
        megatrain(&args)
    };
    let p = paged(&b, "b.mts", &[]);
    assert!(p.status.success(), "{}", text(&p));
    let out = text(&p);
    assert!(out.contains("store (paged from its file)") && out.contains("store window in RAM"), "{out}");
    assert!(out.contains("disk tier: "), "the summary reports the pager:\n{out}");
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(weights(&a), weights(&b), "paging changes no byte of the training");

    // Killed after a checkpoint, resumed, paged throughout.
    let killed = paged(&c, "c.mts", &["--save-every", "2", "--abort-after-step", "3"]);
    assert!(!killed.status.success(), "the hook must abort");
    let resumed = paged(&c, "c.mts", &["--save-every", "2", "--resume"]);
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert_eq!(weights(&a), weights(&c), "a paged run resumed from its checkpoint ends as the whole one");

    // Too little host memory even for the window: refused before anything is written.
    let d = t.path().join("d");
    let refused = megatrain(
        &[&RUN[..], &["--store", s(&t.path().join("d.mts")), "--out", s(&d), "--host-mem", "0.005"]].concat(),
    );
    assert!(!refused.status.success());
    assert!(text(&refused).contains("paging it from its file needs"), "{}", text(&refused));
    assert!(!t.path().join("d.mts").exists() && !d.exists(), "a refused run creates nothing");
}

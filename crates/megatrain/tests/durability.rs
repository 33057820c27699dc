//! Durability of the binary's outputs: a damaged checkpoint (a flipped byte in either file, a
//! truncated or missing snapshot, a missing checkpoint) is named by `megatrain verify` and skipped
//! by `--resume`, whose run then ends bitwise where the uninterrupted one does; two runs on one
//! `--out` or one `--store`: the second is refused at once, naming the first, which finishes
//! unharmed; an export that fails part way leaves no export that looks complete, and `--resume`
//! finishes it, bitwise, without training a step again.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The fine-tune of these tests: 8 steps, a checkpoint every 2 (3 kept).
fn run_args(out: &Path, data: &Path, more: &[&str]) -> Vec<String> {
    let model = model_fixture();
    let base = ["train", "--model", s(&model), "--data", s(data), "--out", s(out), "--steps", "8"];
    let ckpt = ["--save-every", "2", "--keep-checkpoints", "3"];
    base.iter().chain(&ckpt).chain(&FINE_TUNE).chain(more).map(|a| a.to_string()).collect()
}

/// A scratch directory with the data file, and the uninterrupted run's export in `reference/`
/// (`more`: its options beyond [`run_args`]'s).
fn with_reference(more: &[&str]) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data.jsonl");
    write_data(&data);
    let reference = t.path().join("reference");
    ok(&run_args(&reference, &data, more));
    (t, data, reference)
}

fn run(args: &[String]) -> std::process::Output {
    megatrain(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn ok(args: &[String]) -> String {
    let o = run(args);
    assert!(o.status.success(), "megatrain {args:?} failed:\n{}\n{}", stdout(&o), stderr(&o));
    stdout(&o)
}

fn weights(out: &Path) -> Vec<u8> {
    fs::read(out.join("model.safetensors")).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

/// XORs one byte of `file` at `at` (from its end, if negative).
fn flip(file: &Path, at: i64, mask: u8) {
    let f = fs::OpenOptions::new().read(true).write(true).open(file).unwrap();
    let len = f.metadata().unwrap().len() as i64;
    let at = if at < 0 { len + at } else { at } as u64;
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ mask], at).unwrap();
}

#[test]
fn a_damaged_newest_checkpoint_is_named_skipped_and_the_resumed_export_is_bitwise() {
    let (t, data, reference) = with_reference(&[]);
    let want = weights(&reference);

    // A run that crashed after step 6 and its checkpoint: checkpoints 2, 4 and 6, no export.
    let crashed = t.path().join("crashed");
    let o = run(&run_args(&crashed, &data, &["--abort-after-step", "6"]));
    assert!(!o.status.success(), "the crash hook aborts");
    let ckpt = |out: &Path, name: &str| out.join("checkpoints").join(name);
    assert!(ckpt(&crashed, "step-000000006.json").exists() && !crashed.join("config.json").exists());

    // (what is done to the newest checkpoint, the file `verify` names, whether `verify` sees it)
    type Damage = fn(&Path);
    let cases: [(&str, Damage, Option<&str>); 5] = [
        (
            "flipped snapshot byte",
            |c| flip(&c.join("step-000000006.store"), 600_000, 0x04),
            Some("step-000000006.store"),
        ),
        (
            "flipped manifest byte",
            |c| flip(&c.join("step-000000006.json"), -40, 0x01),
            Some("step-000000006.json"),
        ),
        (
            "truncated snapshot",
            |c| {
                let f = fs::OpenOptions::new().write(true).open(c.join("step-000000006.store")).unwrap();
                f.set_len(f.metadata().unwrap().len() / 2).unwrap();
            },
            Some("step-000000006.store"),
        ),
        (
            "missing snapshot",
            |c| fs::remove_file(c.join("step-000000006.store")).unwrap(),
            Some("step-000000006.store"),
        ),
        (
            "missing checkpoint",
            |c| {
                fs::remove_file(c.join("step-000000006.store")).unwrap();
                fs::remove_file(c.join("step-000000006.json")).unwrap();
            },
            None,
        ),
    ];
    for (i, (what, damage, named)) in cases.into_iter().enumerate() {
        let out = t.path().join(format!("case{i}"));
        copy_dir(&crashed, &out);
        damage(&out.join("checkpoints"));
        let v = megatrain(&["verify", s(&out)]);
        match named {
            Some(file) => {
                assert!(!v.status.success(), "{what}: verify must fail\n{}", stdout(&v));
                let line =
                    stdout(&v).lines().find(|l| l.starts_with("step 6:")).unwrap_or_default().to_owned();
                assert!(line.contains("DAMAGED") && line.contains(file), "{what}: {line}");
                assert!(line.contains("--resume skips it"), "{what}: says what to do: {line}");
                assert!(stdout(&v).contains("step 4: intact"), "{what}: {}", stdout(&v));
            }
            None => assert!(v.status.success(), "{what}: the older checkpoints are intact\n{}", stdout(&v)),
        }
        let o = run(&[run_args(&out, &data, &[]), vec!["--resume".into()]].concat());
        assert!(o.status.success(), "{what}: the resume failed\n{}", stderr(&o));
        if let Some(file) = named {
            let err = stderr(&o);
            assert!(err.contains("--resume: skipping") && err.contains(file), "{what}: {err}");
            assert!(ckpt(&out, "damaged/step-000000006.json").exists(), "{what}: moved aside");
        }
        assert!(stdout(&o).contains("at step 4"), "{what}: resumed from the older one\n{}", stdout(&o));
        assert!(weights(&out) == want, "{what}: the export differs from the uninterrupted run's");
        let v = megatrain(&["verify", s(&out)]);
        assert!(v.status.success(), "{what}: every checkpoint left is intact\n{}", stdout(&v));
    }
}

fn spawn(args: &[String]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits until `file` exists and names process `pid`.
fn wait_for_lock(file: &Path, pid: u32, first: &mut std::process::Child) {
    let t = Instant::now();
    while !fs::read_to_string(file).is_ok_and(|s| s.starts_with(&format!("pid {pid} "))) {
        assert!(first.try_wait().unwrap().is_none(), "the first run ended before its lock was seen");
        assert!(t.elapsed() < Duration::from_secs(60), "no lock file {}", file.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_second_run_on_one_out_or_store_is_refused_at_once_and_the_first_finishes_unharmed() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data.jsonl");
    write_data(&data);
    // Long enough (200 steps, a few seconds) that the second run comes while the first trains.
    let long = |out: &Path, extra: &[&str]| {
        let mut a = run_args(out, &data, &["--steps", "200", "--save-every", "0"]);
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    let store = t.path().join("run.store");
    for (label, extra) in [("without checkpoints", vec![]), ("with checkpoints", vec!["--save-every", "40"])]
    {
        let (reference, out) = (t.path().join(format!("ref {label}")), t.path().join(label));
        ok(&long(&reference, &extra));
        let with_store = [extra.clone(), vec!["--store", s(&store)]].concat();
        let mut first = spawn(&long(&out, &with_store));
        wait_for_lock(&out.join(".megatrain.lock"), first.id(), &mut first);
        let t0 = Instant::now();
        let o = run(&long(&out, &extra));
        let (err, took) = (stderr(&o), t0.elapsed());
        assert!(!o.status.success(), "{label}: the second run must be refused");
        let holder = format!("in use by another run: pid {} ", first.id());
        assert!(err.contains("--out") && err.contains(&holder), "{label}: names the first run: {err}");
        // The same --store under another --out: refused too.
        let o = run(&long(&t.path().join("elsewhere"), &with_store));
        assert!(stderr(&o).contains("--store") && stderr(&o).contains(&holder), "{label}: {}", stderr(&o));
        assert!(!t.path().join("elsewhere").exists(), "{label}: a refused run leaves nothing");
        assert!(first.try_wait().unwrap().is_none(), "{label}: the refusals came while the first trained");
        assert!(took < Duration::from_secs(10), "{label}: refused at once, not after {took:?}");
        assert!(first.wait().unwrap().success(), "{label}: the first run failed");
        assert!(weights(&out) == weights(&reference), "{label}: the first run's export is harmed");
        assert!(!out.join(".megatrain.lock").exists() && !Path::new(&format!("{}.lock", s(&store))).exists());
        fs::remove_file(&store).unwrap();
    }
}

#[test]
fn an_export_that_fails_part_way_is_finished_by_resume_without_training() {
    let (t, data, reference) = with_reference(&["--save-every", "0"]);
    let out = t.path().join("out");
    // Without --save-every: every step since the start would be lost but for the last checkpoint.
    let a = run_args(&out, &data, &["--save-every", "0"]);
    let o = run(&[a.clone(), vec!["--inject-export-failure".into(), "100000".into()]].concat());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(err.contains("No trained step is lost") && err.contains("--resume"), "says what to do: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let left: Vec<String> =
        fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    assert_eq!(left, ["checkpoints"], "no export, half or whole, and no lock");
    let o = run(&[a.clone(), vec!["--resume".into()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("nothing to train") && stdout(&o).contains("model exported to"),
        "{}",
        stdout(&o)
    );
    assert!(weights(&out) == weights(&reference), "the finished export differs from the uninterrupted run's");
    // Complete: a further resume says so, exits 0 and leaves the export alone.
    let before = fs::metadata(out.join("model.safetensors")).unwrap().modified().unwrap();
    let o = run(&[a, vec!["--resume".into()]].concat());
    assert!(o.status.success() && stdout(&o).contains("left as it is"), "{}", stdout(&o));
    assert_eq!(fs::metadata(out.join("model.safetensors")).unwrap().modified().unwrap(), before);
    assert!(!stdout(&o).contains("NaN"), "{}", stdout(&o));
}

/// Where `megatrain verify` looks, and what it says with nothing to check.
#[test]
fn verify_refuses_what_is_not_a_checkpoint_directory() {
    let t = tempfile::tempdir().unwrap();
    let o = megatrain(&["verify", s(&t.path().join("nope"))]);
    assert!(!o.status.success() && stderr(&o).contains("is not a directory"), "{}", stderr(&o));
    let o = megatrain(&["verify", s(t.path())]);
    assert!(!o.status.success() && stderr(&o).contains("no checkpoint in"), "{}", stderr(&o));
}

//! Non-finite steps through the binary: a NaN injected into a gradient or the loss skips the
//! step (logged with its step and cause, counted in `--metrics` and the summary) and the run
//! goes on; a run killed after a skipped step resumes bitwise; `--max-skipped-steps K` skipped
//! steps in a row stop the run with an error naming the step and the cause, and no export.

mod common;

use std::fs;
use std::path::Path;

use common::*;

fn run(data: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let model = model_fixture();
    let mut v = vec![
        "train",
        "--model",
        s(&model),
        "--data",
        s(data),
        "--out",
        s(out),
        "--steps",
        "6",
        "--batch-size",
        "3",
        "--seq-len",
        "16",
        "--lr",
        "0.003",
        "--seed",
        "5",
        "--log-every",
        "1",
    ];
    v.extend_from_slice(extra);
    megatrain(&v)
}

#[test]
fn skipped_steps_are_logged_counted_resumed_and_stop_the_run_when_too_many_in_a_row() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data.jsonl");
    write_data(&data);
    let faults = ["--inject-fault", "3:nan-grad", "--inject-fault", "4:nan-loss"];

    let (a, metrics) = (t.path().join("a"), t.path().join("a.jsonl"));
    let o = run(&data, &a, &[&faults[..], &["--metrics", s(&metrics)]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("step 3 skipped: the global gradient norm is NaN (no update applied)"), "{out}");
    assert!(out.contains("step 4 skipped: the loss is NaN"), "{out}");
    assert!(out.contains("skipped steps: 2"), "{out}");
    let steps: Vec<serde_json::Value> = fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r["type"] == "step")
        .collect();
    assert_eq!(steps.len(), 6);
    let skipped: Vec<bool> = steps.iter().map(|r| !r["skipped"].is_null()).collect();
    assert_eq!(skipped, [false, false, true, true, false, false]);
    assert_eq!(steps[5]["skipped_steps"], 2);
    assert!(steps[5]["loss"].as_f64().unwrap().is_finite());

    // Killed after the second skip (checkpoint at 4), resumed: the same weights, bit for bit.
    let b = t.path().join("b");
    let crashed = run(&data, &b, &[&faults[..], &["--save-every", "2", "--abort-after-step", "4"]].concat());
    assert!(!crashed.status.success());
    let resumed = run(&data, &b, &[&faults[..], &["--save-every", "2", "--resume"]].concat());
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(stdout(&resumed).contains("global steps 5..=6"), "{}", stdout(&resumed));
    assert_eq!(
        fs::read(a.join("model.safetensors")).unwrap(),
        fs::read(b.join("model.safetensors")).unwrap(),
        "a run resumed past skipped steps ends where the uninterrupted one does"
    );

    // Two in a row with --max-skipped-steps 2: stopped at the second, naming it and the cause.
    let c = t.path().join("c");
    let two = ["--inject-fault", "2:inf-grad", "--inject-fault", "3:nan-grad", "--max-skipped-steps", "2"];
    let o = run(&data, &c, &two);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("training stopped at step 3: 2 steps in a row were skipped, the last because the global gradient norm is NaN"),
        "{e}"
    );
    assert!(!c.join("config.json").exists(), "a stopped run exports nothing");
    // One skip, then a good step: the count starts again.
    let d = t.path().join("d");
    let apart = ["--inject-fault", "2:nan-grad", "--inject-fault", "4:nan-grad", "--max-skipped-steps", "2"];
    let o = run(&data, &d, &apart);
    assert!(o.status.success(), "{}", stderr(&o));
}

//! `--optim-states` through the `megatrain` binary: with bf16 and int8 moments (int8 in lean
//! mode too) a run killed after a checkpoint resumes bitwise where the uninterrupted run ends; a
//! checkpoint or a `--store` of one precision is refused by a run asking for another, in a
//! sentence naming both; the summary and `estimate` count the smaller states (8 and 6 B/param of
//! master weights and moments).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn megatrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megatrain")).args(args).output().expect("run megatrain")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The built-in model and data, small and quick.
const RUN: [&str; 9] = ["train", "--steps", "5", "--batch-size", "2", "--seq-len", "16", "--lr", "0.003"];

fn run(out: &Path, extra: &[&str]) -> Output {
    let mut v = RUN.to_vec();
    v.extend_from_slice(&["--out", s(out)]);
    v.extend_from_slice(extra);
    megatrain(&v)
}

#[test]
fn bf16_and_int8_states_resume_bitwise_and_refuse_another_precision() {
    let t = tempfile::tempdir().unwrap();
    for (states, mode) in [("bf16", "exact"), ("int8", "exact"), ("int8", "lean")] {
        let (a, b): (PathBuf, PathBuf) =
            (t.path().join(format!("{states}-{mode}-a")), t.path().join(format!("{states}-{mode}-b")));
        let opts = ["--optim-states", states, "--optim-mode", mode];
        let whole = run(&a, &opts);
        assert!(whole.status.success(), "{}", stderr(&whole));
        let out = String::from_utf8_lossy(&whole.stdout);
        assert!(out.contains(&format!("{states} optimizer states")), "the summary names them:\n{out}");

        let crashed = run(&b, &[&opts[..], &["--save-every", "2", "--abort-after-step", "3"]].concat());
        assert!(!crashed.status.success(), "the hook must abort");
        let resumed = run(&b, &[&opts[..], &["--save-every", "2", "--resume"]].concat());
        assert!(resumed.status.success(), "{}", stderr(&resumed));
        assert_eq!(
            std::fs::read(a.join("model.safetensors")).unwrap(),
            std::fs::read(b.join("model.safetensors")).unwrap(),
            "{states} {mode}: the resumed run's weights must equal the uninterrupted run's bit for bit"
        );

        // Another precision (fp32: the default) is refused, naming both.
        let other = run(&b, &["--optim-mode", mode, "--save-every", "2", "--resume"]);
        assert!(!other.status.success());
        let want = format!("keeps {states} optimizer states and this run asks for fp32 (--optim-states)");
        assert!(stderr(&other).contains(&want), "{}", stderr(&other));
    }

    // A --store written with int8 moments is refused by a bf16 run, naming both.
    let store = t.path().join("s.mts");
    let first = megatrain(&[&RUN[..], &["--optim-states", "int8", "--store", s(&store)]].concat());
    assert!(first.status.success(), "{}", stderr(&first));
    let again = megatrain(&[&RUN[..], &["--optim-states", "bf16", "--store", s(&store)]].concat());
    assert!(!again.status.success());
    let want = "keeps int8 optimizer states and this run asks for bf16 (--optim-states)";
    assert!(stderr(&again).contains(want), "{}", stderr(&again));
}

/// The store's bytes per parameter in the summary and `estimate`'s store shrink with the
/// moments: 4 + 2·s + 4 (f32 gradients, the fp32 default) = 16, 12, 10 B/param.
#[test]
fn the_summary_and_estimate_count_the_smaller_states() {
    let mut stores = Vec::new();
    for (states, lo) in [("fp32", 16.0), ("bf16", 12.0), ("int8", 10.0)] {
        let o = megatrain(&[
            "train",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--optim-states",
            states,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        let line = out.lines().find(|l| l.starts_with("host store: ")).expect("a host store line");
        let words: Vec<&str> = line.split_whitespace().collect();
        let at = words.iter().position(|&w| w == "bytes/param").unwrap();
        let bpp: f64 = words[at - 1].parse().unwrap();
        assert!((lo..lo + 0.6).contains(&bpp), "{states}: {bpp} B/param: {line}");

        let e = megatrain(&["estimate", "--optim-states", states, "--json"]);
        assert!(e.status.success(), "{}", stderr(&e));
        let v: serde_json::Value = serde_json::from_slice(&e.stdout).unwrap();
        let (store, n) = (v["host_store_bytes"].as_f64().unwrap(), v["n_params"].as_f64().unwrap());
        assert!((lo..lo + 0.6).contains(&(store / n)), "{states}: estimate's store {} B/param", store / n);
        stores.push(store);
    }
    assert!(stores[0] > stores[1] && stores[1] > stores[2], "{stores:?}");
}

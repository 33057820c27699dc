//! The kill loop: a CPU run of the fixture model on a file-backed store (`--store`), with a
//! checkpoint every step, is SIGKILLed at seeded random instants and resumed (`--resume`) after
//! each kill until it finishes; its export must equal an uninterrupted run's bit for bit. Some
//! kills are aimed: at the first sight of a `.tmp` file in the checkpoint directory (inside a
//! snapshot or manifest write) or in `--out` (inside the export). Every round runs in a fresh
//! directory; the test counts the kills and where they landed.
//!
//! `MT_KILLS` (default 8: CI) sets the kills wanted, `MT_KILL_SEED` (default 1) the seed (the
//! acceptance run's: docs/decisions/0041).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn args(model: &Path, data: &Path, out: &Path, store: &Path) -> Vec<String> {
    let run = ["train", "--model", s(model), "--data", s(data), "--out", s(out), "--store", s(store)];
    let more = ["--save-every", "1", "--resume", "--steps", "8"];
    run.iter().chain(&more).chain(&FINE_TUNE).map(|a| a.to_string()).collect()
}

fn spawn(args: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start megatrain")
}

/// The `.tmp` files in `dir`, each with its length and modification time (a file rewritten by a
/// later run is another one).
fn tmps(dir: &Path) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .filter_map(|e| {
            let md = e.metadata().ok()?;
            Some((e.path(), md.len(), md.modified().ok()?))
        })
        .collect()
}

fn has_tmp(dir: &Path) -> bool {
    !tmps(dir).is_empty()
}

/// Where a kill is aimed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Aim {
    /// After this many seconds.
    After(f64),
    /// At the first `.tmp` seen in the checkpoint directory after this many checkpoints exist.
    CheckpointWrite(usize),
    /// At the first `.tmp` seen in `--out` (the export's files).
    Export,
}

/// What one attempt did.
#[derive(Debug, PartialEq)]
enum Outcome {
    Finished,
    /// Killed; whether inside a checkpoint's write, inside the export's.
    Killed {
        in_ckpt: bool,
        in_export: bool,
    },
}

fn attempt(args: &[String], out: &Path, aim: Aim, limit: Duration) -> Outcome {
    let ckpt = out.join("checkpoints");
    // Debris of earlier kills is not a write of this run.
    let debris: Vec<_> = tmps(&ckpt).into_iter().chain(tmps(out)).collect();
    let writing = |dir: &Path| tmps(dir).iter().any(|t| !debris.contains(t));
    let mut child = spawn(args);
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            assert!(status.success(), "a resumed run failed: {err}");
            return Outcome::Finished;
        }
        let fire = match aim {
            Aim::After(s) => t.elapsed().as_secs_f64() >= s,
            Aim::CheckpointWrite(n) => {
                let done = fs::read_dir(&ckpt)
                    .map(|d| {
                        d.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".json")).count()
                    })
                    .unwrap_or(0);
                done >= n.min(2) && writing(&ckpt)
            }
            Aim::Export => writing(out),
        };
        if fire {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            // Whether the kill fell inside a write: a file of this run's still under its `.tmp`
            // name (its rename had not happened).
            let (in_ckpt, in_export) = (writing(&ckpt), writing(out));
            return Outcome::Killed { in_ckpt, in_export };
        }
        assert!(t.elapsed() < limit, "an attempt ran for {:?} without finishing", t.elapsed());
        if matches!(aim, Aim::After(_)) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

#[test]
fn a_run_killed_at_random_instants_resumes_to_the_uninterrupted_runs_weights() {
    let kills_wanted = env_or("MT_KILLS", 8);
    let mut rng = Rng(env_or("MT_KILL_SEED", 1));
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data.jsonl");
    write_data(&data);
    let model = model_fixture();

    let reference = t.path().join("reference");
    let t0 = Instant::now();
    let mut child = spawn(&args(&model, &data, &reference, &t.path().join("reference.store")));
    assert!(child.wait().unwrap().success(), "the uninterrupted run failed");
    let whole = t0.elapsed().as_secs_f64();
    let want = fs::read(reference.join("model.safetensors")).unwrap();

    let (mut kills, mut in_write, mut in_export, mut rounds, mut attempts) = (0, 0, 0, 0, 0);
    while kills < kills_wanted {
        rounds += 1;
        let dir: PathBuf = t.path().join(format!("round{rounds}"));
        let out = dir.join("out");
        fs::create_dir_all(&dir).unwrap();
        let a = args(&model, &data, &out, &dir.join("run.store"));
        loop {
            attempts += 1;
            let aim = match rng.next() % 8 {
                0 | 1 => Aim::CheckpointWrite((rng.next() % 8) as usize),
                2 => Aim::Export,
                _ => Aim::After(rng.unit() * whole * 1.2),
            };
            match attempt(&a, &out, aim, Duration::from_secs_f64(60.0 + 20.0 * whole)) {
                Outcome::Finished => break,
                Outcome::Killed { in_ckpt, in_export: e } => {
                    kills += 1;
                    in_write += usize::from(in_ckpt);
                    in_export += usize::from(e);
                }
            }
            assert!(attempts < 40 * kills_wanted + 100, "no progress: {attempts} attempts");
        }
        assert!(
            fs::read(out.join("model.safetensors")).unwrap() == want,
            "round {rounds}: the resumed run's weights differ from the uninterrupted run's"
        );
        assert!(out.join("config.json").exists() && !has_tmp(&out), "round {rounds}: a complete export");
    }
    eprintln!(
        "SUMMARY kill loop: {kills} SIGKILLs in {rounds} rounds ({attempts} runs), {in_write} inside a \
         checkpoint write, {in_export} inside the export; every round's export bitwise equal \
         to the uninterrupted run's ({whole:.2} s)"
    );
}

/// A `--store` file is the live state, not a checkpoint: one left by a killed run is refused
/// when reopened as it is (it may hold a half-applied update), and `--resume` starts it afresh
/// (or from the newest checkpoint) instead.
#[test]
fn a_store_file_left_by_a_killed_run_is_refused_without_resume() {
    let t = tempfile::tempdir().unwrap();
    let (store, out) = (t.path().join("run.store"), t.path().join("out"));
    let a: Vec<String> = [
        "train",
        "--store",
        s(&store),
        "--out",
        s(&out),
        "--steps",
        "100000",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]
    .map(String::from)
    .to_vec();
    let mut child = spawn(&a);
    let t0 = Instant::now();
    while !(store.exists() && t0.elapsed() > Duration::from_millis(1500)) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let short: Vec<&str> = [
        "train",
        "--store",
        s(&store),
        "--out",
        s(&out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]
    .to_vec();
    let o = megatrain(&short);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("was left by a run that was killed mid-step"), "{}", stderr(&o));
    let o = megatrain(&[&short[..], &["--resume"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("global steps 1..=2"), "no checkpoint: a fresh start\n{}", stdout(&o));
    // Finished in order: reopened as it is, it continues.
    let o = megatrain(&short);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("global steps 3..=4"), "{}", stdout(&o));
}

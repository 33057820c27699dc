//! The kill loop: a CPU run of the fixture model on a file-backed store (`--store`), with a
//! checkpoint every step or every third, is SIGKILLed at seeded random instants and resumed
//! (`--resume`) after each kill until it finishes; its export must equal an uninterrupted run's
//! bit for bit, and every checkpoint left must verify. Some kills are aimed: at the first sight
//! of a `.tmp` file in the checkpoint directory (inside a snapshot or manifest write), of the last
//! step's snapshot when it is the final checkpoint (a checkpoint every third step: the eighth is
//! written before the export), or in `--out` (inside the export); at the moment a resumed run has
//! said it checks its newest checkpoint and is verifying and restoring it (inside `--resume`).
//! Between attempts, `megatrain verify` is run on the directory and killed at a random instant.
//! Every round runs in a fresh directory; the test counts the kills and where they landed.
//!
//! `MT_KILLS` (default 8: CI) sets the kills wanted, `MT_KILL_SEED` (default 1) the seed (the
//! acceptance runs': docs/decisions/0041).

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
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

fn args(model: &Path, data: &Path, out: &Path, store: &Path, save_every: u64) -> Vec<String> {
    let run = ["train", "--model", s(model), "--data", s(data), "--out", s(out), "--store", s(store)];
    let every = save_every.to_string();
    let more = ["--save-every", every.as_str(), "--resume", "--steps", "8"];
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

/// The last step's snapshot, as the final checkpoint writes it.
const FINAL: &str = "step-000000008.store.tmp";

/// Where a kill is aimed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Aim {
    /// After this many seconds.
    After(f64),
    /// At the first `.tmp` seen in the checkpoint directory after this many checkpoints exist.
    CheckpointWrite(usize),
    /// At the first sight of the last step's snapshot being written.
    FinalCheckpoint,
    /// At the first `.tmp` seen in `--out` (the export's files).
    Export,
    /// This many microseconds after the run has said it checks its newest checkpoint: it is
    /// verifying and restoring it, or starting its engine.
    Resume(u64),
}

/// What one attempt did.
#[derive(Debug, Default, PartialEq)]
struct Killed {
    in_ckpt: bool,
    in_final: bool,
    in_export: bool,
    in_resume: bool,
}

/// The run's stderr, read as it comes: the whole text, and how far the set-up has got (1: the
/// newest checkpoint being checked against its hashes, 2: the engine ready).
fn watch(child: &mut Child) -> (Arc<Mutex<String>>, Arc<AtomicU8>) {
    let (text, phase) = (Arc::new(Mutex::new(String::new())), Arc::new(AtomicU8::new(0)));
    let (t, p) = (Arc::clone(&text), Arc::clone(&phase));
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if line.starts_with("--resume: checking") {
                p.store(1, Ordering::SeqCst);
            } else if line.starts_with("engine ready") {
                p.store(2, Ordering::SeqCst);
            }
            let mut t = t.lock().unwrap();
            t.push_str(&line);
            t.push('\n');
        }
    });
    (text, phase)
}

fn attempt(args: &[String], out: &Path, aim: Aim, limit: Duration) -> Option<Killed> {
    let ckpt = out.join("checkpoints");
    // Debris of earlier kills is not a write of this run.
    let debris: Vec<_> = tmps(&ckpt).into_iter().chain(tmps(out)).collect();
    let writing = |dir: &Path| tmps(dir).iter().any(|t| !debris.contains(t));
    let final_write = || tmps(&ckpt).iter().any(|t| !debris.contains(t) && t.0.ends_with(FINAL));
    let had_checkpoint = fs::read_dir(&ckpt)
        .map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().ends_with(".json")))
        .unwrap_or(false);
    let mut child = spawn(args);
    let (text, phase) = watch(&mut child);
    let t = Instant::now();
    let mut planned_at = None;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            std::thread::sleep(Duration::from_millis(20)); // the reader's last lines
            assert!(status.success(), "a resumed run failed: {}", text.lock().unwrap());
            return None;
        }
        if planned_at.is_none() && phase.load(Ordering::SeqCst) >= 1 {
            planned_at = Some(Instant::now());
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
            Aim::FinalCheckpoint => final_write(),
            Aim::Export => writing(out),
            Aim::Resume(us) => planned_at.is_some_and(|p| p.elapsed() >= Duration::from_micros(us)),
        };
        if fire {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            std::thread::sleep(Duration::from_millis(5)); // the reader's last lines
                                                          // Whether the kill fell inside a write: a file of this run's still under its `.tmp`
                                                          // name (its rename had not happened); inside the resume: checking or restoring its
                                                          // checkpoint, the engine not yet ready.
            let p = phase.load(Ordering::SeqCst);
            return Some(Killed {
                in_ckpt: writing(&ckpt),
                in_final: final_write(),
                in_export: writing(out),
                in_resume: had_checkpoint && p == 1,
            });
        }
        assert!(t.elapsed() < limit, "an attempt ran for {:?} without finishing", t.elapsed());
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Runs `megatrain verify` on `out` and kills it after `after`; whether it was still running.
fn kill_verify(out: &Path, after: Duration) -> bool {
    let mut child = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(["verify", s(out)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(after);
    let alive = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    child.wait().unwrap();
    alive
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
    let mut child = spawn(&args(&model, &data, &reference, &t.path().join("reference.store"), 1));
    assert!(child.wait().unwrap().success(), "the uninterrupted run failed");
    let whole = t0.elapsed().as_secs_f64();
    let want = fs::read(reference.join("model.safetensors")).unwrap();
    let t0 = Instant::now();
    assert!(megatrain(&["verify", s(&reference)]).status.success());
    let verify_s = t0.elapsed().as_secs_f64();

    let (mut kills, mut rounds, mut attempts) = (0u64, 0, 0usize);
    let (mut in_write, mut in_final, mut in_export, mut in_resume, mut in_verify) = (0, 0, 0, 0, 0);
    while kills < kills_wanted {
        rounds += 1;
        let dir: PathBuf = t.path().join(format!("round{rounds}"));
        let out = dir.join("out");
        fs::create_dir_all(&dir).unwrap();
        // Every other round checkpoints every third step: its last checkpoint is the final one.
        let every = if rounds % 2 == 1 { 3 } else { 1 };
        let a = args(&model, &data, &out, &dir.join("run.store"), every);
        loop {
            attempts += 1;
            if out.join("checkpoints").is_dir() && (rng.next().is_multiple_of(3) || attempts == 3) {
                // A verify killed at a random instant changes nothing.
                if kill_verify(&out, Duration::from_secs_f64(rng.unit() * verify_s * 1.2)) {
                    kills += 1;
                    in_verify += 1;
                }
            }
            // The first attempts take each aim once (CI's few kills see them all), then at random.
            let pick = if attempts <= 6 { attempts - 1 } else { (rng.next() % 12) as usize };
            // A run with no checkpoint yet has nothing to resume from: a write is aimed at instead.
            let resumable = fs::read_dir(out.join("checkpoints"))
                .is_ok_and(|d| d.flatten().any(|e| e.file_name().to_string_lossy().ends_with(".json")));
            let aim = match pick {
                0 | 4 | 5 if !resumable => Aim::CheckpointWrite(0),
                0 => Aim::Resume(rng.next() % 3000),
                1 => Aim::CheckpointWrite((rng.next() % 8) as usize),
                2 if every == 3 => Aim::FinalCheckpoint,
                3 => Aim::Export,
                4 | 5 => Aim::Resume(rng.next() % 3000),
                6 | 7 => Aim::CheckpointWrite((rng.next() % 8) as usize),
                8 if every == 3 => Aim::FinalCheckpoint,
                _ => Aim::After(rng.unit() * whole * 1.2),
            };
            match attempt(&a, &out, aim, Duration::from_secs_f64(60.0 + 20.0 * whole)) {
                None => break,
                Some(k) => {
                    kills += 1;
                    in_write += usize::from(k.in_ckpt);
                    in_final += usize::from(k.in_final);
                    in_export += usize::from(k.in_export);
                    in_resume += usize::from(k.in_resume);
                }
            }
            assert!((attempts as u64) < 40 * kills_wanted + 100, "no progress: {attempts} attempts");
        }
        assert!(
            fs::read(out.join("model.safetensors")).unwrap() == want,
            "round {rounds}: the resumed run's weights differ from the uninterrupted run's"
        );
        assert!(out.join("config.json").exists() && !has_tmp(&out), "round {rounds}: a complete export");
        let v = megatrain(&["verify", s(&out)]);
        assert!(v.status.success(), "round {rounds}: a checkpoint left is damaged:\n{}", stdout(&v));
        assert!(!out.join("checkpoints/damaged").exists(), "round {rounds}: no kill damages a checkpoint");
    }
    eprintln!(
        "SUMMARY kill loop: {kills} SIGKILLs in {rounds} rounds ({attempts} runs): {in_write} inside a \
         checkpoint write ({in_final} of them the final checkpoint's), {in_export} inside the export, \
         {in_resume} inside a resume (checking or restoring its checkpoint, before its engine was ready), {in_verify} inside \
         megatrain verify; every round's export bitwise equal to the uninterrupted run's ({whole:.2} s) \
         and every checkpoint left intact"
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

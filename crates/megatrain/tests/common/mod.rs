//! Shared helpers of the binary's fault tests: the fixture model, its data, running the binary.
#![allow(dead_code, unreachable_pub)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The tiny Llama saved by transformers (vocabulary 128).
pub fn model_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/roundtrip/llama/model")
}

/// Runs `megatrain` with `args` to completion.
pub fn megatrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megatrain")).args(args).output().expect("run megatrain")
}

/// Its standard error, as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Its standard output, as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// 40 samples of 5..=16 ids below 128 (the fixture's vocabulary), deterministic.
pub fn write_data(path: &Path) {
    let mut x: u64 = 12345;
    let mut lines = String::new();
    for i in 0..40 {
        let n = 5 + i % 12;
        let ids: Vec<String> = (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) % 128).to_string()
            })
            .collect();
        lines.push_str(&format!("{{\"input_ids\": [{}]}}\n", ids.join(", ")));
    }
    fs::write(path, lines).unwrap();
}

/// The fine-tune both the kill loop and the real-use test run on [`model_fixture`] and
/// [`write_data`]'s data: schedule, warm-up, held-out fraction and seed (steps are the caller's).
pub const FINE_TUNE: [&str; 16] = [
    "--batch-size",
    "3",
    "--seq-len",
    "16",
    "--lr",
    "0.003",
    "--warmup",
    "2",
    "--schedule",
    "cosine",
    "--eval-fraction",
    "0.1",
    "--seed",
    "5",
    "--log-every",
    "0",
];

/// A path as `&str`.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

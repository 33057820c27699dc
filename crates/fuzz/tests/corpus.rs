//! The fuzz targets on stable, as CI runs them: every committed corpus input of each target
//! (`corpus/TARGET/`: the seeds and every input that ever crashed it, kept as a regression
//! test), then a short seeded mutation smoke (bit flips, byte insertions and deletions,
//! splices of corpus inputs) bounded in time. The long runs are cargo-fuzz's
//! (`scripts/fuzz.sh SECONDS`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mt_fuzz::TARGETS;

fn corpus(name: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(name);
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

/// SplitMix64: the smoke's mutations are a function of the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: [&[u8]; 10] =
    [b"0", b"-1", b"1e309", b"18446744073709551616", b"null", b"\"\"", b"[]", b"{}", b"\xff", b"\n"];

fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(5) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.insert(at, rng.next() as u8),
            2 if !v.is_empty() => {
                let end = (at + 1 + rng.below(8)).min(v.len());
                v.drain(at.min(end)..end);
            }
            3 => {
                let s = INTERESTING[rng.below(INTERESTING.len())];
                v.splice(at..at, s.iter().copied());
            }
            _ => {
                let from = rng.below(other.len() + 1);
                let to = (from + rng.below(64)).min(other.len());
                v.splice(at..at, other[from..to].iter().copied());
            }
        }
    }
    v
}

#[test]
fn every_target_accepts_or_refuses_its_corpus_and_mutations_without_panicking() {
    // The smoke's budget per target (the corpus replay itself is not bounded).
    let budget = Duration::from_millis(
        std::env::var("MT_FUZZ_SMOKE_MS").ok().and_then(|s| s.parse().ok()).unwrap_or(1500),
    );
    for target in TARGETS {
        let inputs = corpus(target.name);
        assert!(!inputs.is_empty(), "{}: no corpus", target.name);
        for (path, bytes) in &inputs {
            let r = std::panic::catch_unwind(|| (target.run)(bytes));
            assert!(r.is_ok(), "{} panicked on {}", target.name, path.display());
        }
        let mut rng = Rng(0x5eed ^ target.name.len() as u64);
        let t = Instant::now();
        let mut n = 0;
        while t.elapsed() < budget {
            let a = &inputs[rng.below(inputs.len())].1;
            let b = &inputs[rng.below(inputs.len())].1;
            let input = mutate(&mut rng, a, b);
            let r = std::panic::catch_unwind(|| (target.run)(&input));
            assert!(
                r.is_ok(),
                "{} panicked on the mutation {:?}",
                target.name,
                String::from_utf8_lossy(&input)
            );
            n += 1;
        }
        eprintln!("{}: {} corpus inputs, {n} mutations", target.name, inputs.len());
    }
}

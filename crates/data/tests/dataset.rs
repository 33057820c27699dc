//! Pre-tokenised data files end to end: packing layout and targets, the step order with and
//! without shuffling, the eval split, and every data-file error.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use mt_data::{Cursor, DataOptions, Dataset, Error, Format, TokenBatch, IGNORE_INDEX};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const X: i64 = IGNORE_INDEX;

fn write(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("data.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

fn ids_lines(samples: &[Vec<u32>]) -> String {
    samples.iter().map(|s| format!("{{\"input_ids\": {s:?}}}\n")).collect()
}

fn load(text: &str, opts: &DataOptions) -> mt_data::Result<Dataset> {
    let dir = tempfile::tempdir().unwrap();
    Dataset::load(&write(dir.path(), text), None, opts)
}

fn opts(seq_len: usize) -> DataOptions {
    DataOptions { shuffle: false, ..DataOptions::new(seq_len, 5000) }
}

/// Lines of exactly `seq` tokens; line `l` is `[100*l + 1, 100*l + 2, ...]`.
fn full_lines(n: usize, seq: usize) -> Vec<Vec<u32>> {
    (0..n).map(|l| (0..seq).map(|t| (100 * l + t + 1) as u32).collect()).collect()
}

/// The line a full-length row came from.
fn line_of(row: &[u32]) -> usize {
    (row[0] as usize - 1) / 100
}

fn rows(b: &TokenBatch) -> Vec<(&[u32], &[i64])> {
    (0..b.batch)
        .map(|r| (&b.input_ids[r * b.seq..(r + 1) * b.seq], &b.targets[r * b.seq..(r + 1) * b.seq]))
        .collect()
}

#[test]
fn packing_layout_and_targets_of_a_hand_made_file() {
    let text = "{\"input_ids\": [1, 2, 3]}\n\n{\"input_ids\": [4, 5]}\n  \n{\"input_ids\": [6, 7, 8, 9]}\n\
                {\"input_ids\": [10]}\n{\"input_ids\": [11, 12, 13, 14, 15, 16]}\n{\"input_ids\": [17, 18]}";
    let ds = load(text, &opts(6)).unwrap();
    assert_eq!(ds.format(), Format::InputIds);
    // [10] predicts nothing: dropped at load.
    assert_eq!((ds.n_train(), ds.n_eval(), ds.n_train_samples(), ds.n_dropped_samples()), (4, 0, 5, 1));
    let b = ds.train_batch(0, 4);
    assert_eq!((b.batch, b.seq), (4, 6));
    assert_eq!(
        rows(&b),
        [
            (&[1, 2, 3, 4, 5, 0][..], &[2, 3, X, 5, X, X][..]),
            (&[6, 7, 8, 9, 0, 0][..], &[7, 8, 9, X, X, X][..]),
            (&[11, 12, 13, 14, 15, 16][..], &[12, 13, 14, 15, 16, X][..]),
            (&[17, 18, 0, 0, 0, 0][..], &[18, X, X, X, X, X][..]),
        ]
    );
    assert_eq!(ds.n_target_tokens(), 3 + 3 + 5 + 1);
    assert_eq!(b.n_targets(), 12);

    let unpacked = load(text, &DataOptions { pack: false, ..opts(6) }).unwrap();
    assert_eq!(unpacked.n_train(), 5);
    let b = unpacked.train_batch(0, 2);
    assert_eq!(
        rows(&b),
        [
            (&[1, 2, 3, 0, 0, 0][..], &[2, 3, X, X, X, X][..]),
            (&[4, 5, 0, 0, 0, 0][..], &[5, X, X, X, X, X][..])
        ]
    );
}

/// Random files: the packed rows, with padding removed, are the samples in file order, no sample
/// straddles two rows, the greedy rule decides the row count, and targets are exactly the next
/// token inside a sample.
#[test]
fn packing_invariants_hold_on_random_files() {
    let mut rng = StdRng::seed_from_u64(17);
    for _ in 0..20 {
        let seq = rng.random_range(1..=12);
        let n = rng.random_range(1..=30);
        let mut next = 1u32; // pad id 0 never occurs in a sample
        let samples: Vec<Vec<u32>> = (0..n)
            .map(|_| {
                let len = rng.random_range(1..=seq);
                (0..len)
                    .map(|_| {
                        next += 1;
                        next
                    })
                    .collect()
            })
            .collect();
        let Ok(ds) = load(&ids_lines(&samples), &opts(seq)) else {
            assert!(samples.iter().all(|s| s.len() == 1), "only a file without targets may fail");
            continue;
        };
        // One-token samples predict nothing and are dropped at load.
        assert_eq!(ds.n_dropped_samples(), samples.iter().filter(|s| s.len() == 1).count());
        let samples: Vec<Vec<u32>> = samples.into_iter().filter(|s| s.len() > 1).collect();
        let mut want_rows = 0;
        let mut used = seq;
        for s in &samples {
            if used + s.len() > seq {
                want_rows += 1;
                used = 0;
            }
            used += s.len();
        }
        assert_eq!(ds.n_train(), want_rows);
        let b = ds.train_batch(0, ds.n_train());
        let sample_of: std::collections::HashMap<u32, usize> =
            samples.iter().enumerate().flat_map(|(i, s)| s.iter().map(move |&t| (t, i))).collect();
        let mut flat = Vec::new();
        for (row, tg) in rows(&b) {
            for t in 0..seq {
                let same = t + 1 < seq
                    && row[t] != 0
                    && row[t + 1] != 0
                    && sample_of[&row[t]] == sample_of[&row[t + 1]];
                assert_eq!(tg[t], if same { i64::from(row[t + 1]) } else { X });
            }
            let real: Vec<u32> = row.iter().copied().filter(|&i| i != 0).collect();
            assert!(row[real.len()..].iter().all(|&i| i == 0), "padding only at the end");
            flat.extend(real);
        }
        assert_eq!(flat, samples.concat());
        let n_targets: usize = samples.iter().map(|s| s.len() - 1).sum();
        assert_eq!(ds.n_target_tokens(), n_targets as u64);
    }
}

#[test]
fn without_shuffle_step_k_trains_on_lines_kb_to_kb_plus_b_wrapping_at_the_end() {
    let (seq, n, b) = (4, 5, 2);
    let ds = load(&ids_lines(&full_lines(n, seq)), &opts(seq)).unwrap();
    assert_eq!(ds.n_train(), 5);
    for step in 0..12u64 {
        let batch = ds.train_batch(step, b);
        let lines: Vec<usize> = rows(&batch).iter().map(|(r, _)| line_of(r)).collect();
        let want: Vec<usize> = (0..b).map(|j| (step as usize * b + j) % n).collect();
        assert_eq!(lines, want, "step {step}");
        for (row, tg) in rows(&batch) {
            let want_tg: Vec<i64> = row[1..].iter().map(|&i| i64::from(i)).chain([X]).collect();
            assert_eq!(tg, want_tg.as_slice());
        }
    }
    // Step 2 = sequences 4, 5 -> line 4 of epoch 0, line 0 of epoch 1.
    assert_eq!(ds.cursor(2, b), Cursor { epoch: 0, index_in_epoch: 4 });
    assert_eq!(ds.cursor(3, b), Cursor { epoch: 1, index_in_epoch: 1 });
    assert_eq!(ds.cursor(0, b), Cursor { epoch: 0, index_in_epoch: 0 });
}

#[test]
fn shuffled_epochs_are_seeded_permutations_and_steps_are_independent() {
    let (seq, n) = (3, 20);
    let text = ids_lines(&full_lines(n, seq));
    let shuffled = |seed| load(&text, &DataOptions { shuffle: true, seed, ..opts(seq) }).unwrap();
    let ds = shuffled(7);
    // Batch 3 does not divide 20: steps straddle epoch ends.
    let order: Vec<usize> = (0..20u64)
        .flat_map(|s| rows(&ds.train_batch(s, 3)).iter().map(|(r, _)| line_of(r)).collect::<Vec<_>>())
        .collect();
    let epochs: Vec<&[usize]> = order.chunks(n).collect();
    for e in &epochs {
        assert_eq!(
            e.iter().copied().collect::<BTreeSet<_>>(),
            (0..n).collect(),
            "each epoch is a permutation"
        );
    }
    assert_ne!(epochs[0], epochs[1], "epochs are shuffled differently");
    assert_ne!(epochs[0], (0..n).collect::<Vec<_>>().as_slice());
    // Deterministic: another load, and steps asked for in another order, give the same batches.
    let again = shuffled(7);
    for s in (0..20u64).rev() {
        assert_eq!(again.train_batch(s, 3), ds.train_batch(s, 3), "step {s}");
    }
    assert_ne!(shuffled(8).train_batch(0, 10), ds.train_batch(0, 10), "the seed matters");
    assert_eq!(ds.cursor(7, 3), Cursor { epoch: 1, index_in_epoch: 1 });
}

#[test]
fn eval_split_is_disjoint_complete_and_seeded() {
    let (seq, n) = (3, 20);
    let text = ids_lines(&full_lines(n, seq));
    let split = |seed| {
        let ds = load(&text, &DataOptions { eval_fraction: 0.25, seed, ..opts(seq) }).unwrap();
        let train: BTreeSet<usize> =
            rows(&ds.train_batch(0, ds.n_train())).iter().map(|(r, _)| line_of(r)).collect();
        let eval_batches = ds.eval_batches(2);
        let eval: Vec<usize> = eval_batches
            .iter()
            .flat_map(|b| rows(b).iter().map(|(r, _)| line_of(r)).collect::<Vec<_>>())
            .collect();
        (ds, train, eval)
    };
    let (ds, train, eval) = split(3);
    assert_eq!((ds.n_train_samples(), ds.n_eval_samples()), (15, 5));
    assert_eq!((ds.n_train(), ds.n_eval()), (15, 5));
    assert_eq!(ds.n_eval_target_tokens(), 5 * 2);
    assert!(eval.windows(2).all(|w| w[0] < w[1]), "eval sequences are in file order: {eval:?}");
    assert!(train.is_disjoint(&eval.iter().copied().collect()));
    assert_eq!(train.len() + eval.len(), n);
    let batches = ds.eval_batches(2);
    assert_eq!(batches.iter().map(|b| b.batch).collect::<Vec<_>>(), [2, 2, 1]);
    let (_, train2, eval2) = split(3);
    assert_eq!((train2, eval2.clone()), (train, eval.clone()));
    let (_, _, eval_other) = split(4);
    assert_ne!(eval_other, eval, "the seed chooses the split");
    // No split: no eval batches.
    assert!(load(&text, &opts(seq)).unwrap().eval_batches(4).is_empty());
}

#[test]
fn truncate_cuts_long_samples() {
    let text = "{\"input_ids\": [1, 2, 3, 4, 5, 6]}\n{\"input_ids\": [7, 8]}\n";
    let e = load(text, &opts(4)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::AtLine { line: 1, .. }), "{msg}");
    assert!(
        msg.contains("6 tokens") && msg.contains("sequence length 4") && msg.contains("--truncate"),
        "{msg}"
    );
    let ds = load(text, &DataOptions { truncate: true, ..opts(4) }).unwrap();
    let b = ds.train_batch(0, 2);
    assert_eq!(rows(&b), [(&[1, 2, 3, 4][..], &[2, 3, 4, X][..]), (&[7, 8, 0, 0][..], &[8, X, X, X][..])]);
}

/// `(line, message)` of a per-line error.
fn line_err(text: &str, o: &DataOptions) -> (usize, String) {
    match load(text, o) {
        Err(e @ Error::AtLine { line, .. }) => (line, e.to_string()),
        other => panic!("expected a line error, got {other:?}"),
    }
}

#[test]
fn every_line_error_names_the_file_and_line() {
    let ok = "{\"input_ids\": [1, 2]}\n";
    let cases: [(String, usize, &str); 10] = [
        (format!("{ok}\n{{\"input_ids\": [1, 2]\n"), 3, "invalid JSON: EOF while parsing"),
        (
            format!("{ok}{{\"input_ids\": [1], \"labels\": [1]}}\n"),
            2,
            r#"found the keys "input_ids", "labels""#,
        ),
        (format!("{ok}{{\"ids\": [1]}}\n"), 2, r#"found the keys "ids""#),
        (format!("{ok}{{}}\n"), 2, "found an empty object"),
        (format!("{ok}[1, 2]\n"), 2, "found a JSON array"),
        (
            format!("{ok}{ok}{{\"text\": \"hi\"}}\n"),
            3,
            "\"text\" sample but the file's first sample (line 1) is \"input_ids\"",
        ),
        (
            format!("{ok}{{\"input_ids\": [1, 5000]}}\n"),
            2,
            "token id 5000 is outside the model's vocabulary (vocab_size 5000)",
        ),
        (format!("{ok}{{\"input_ids\": [-3]}}\n"), 2, "token id -3 is outside"),
        (format!("{ok}{{\"input_ids\": []}}\n"), 2, "the sample has no tokens"),
        ("{\"text\": \"hi\"}\n".to_string(), 1, "pass a --model dir that contains tokenizer.json"),
    ];
    for (text, line, needle) in cases {
        let (n, msg) = line_err(&text, &opts(8));
        assert_eq!(n, line, "{msg}");
        assert!(
            msg.contains(&format!("data.jsonl:{line}: ")) && msg.contains(needle),
            "{msg}\nwanted: {needle}"
        );
    }
    let (n, msg) = line_err("{\"messages\": []}\n", &opts(8));
    assert_eq!(n, 1);
    assert!(msg.contains("a --model dir"), "{msg}");
    let (n, msg) = line_err("{\"input_ids\": [1, 2]}\n\u{0}\u{ff}\n", &opts(8));
    assert_eq!(n, 2);
    assert!(msg.contains("invalid JSON"), "{msg}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl");
    std::fs::write(&path, b"{\"input_ids\": [1, 2]}\n\xff\xfe\n").unwrap();
    let e = Dataset::load(&path, None, &opts(8)).unwrap_err();
    assert!(e.to_string().ends_with("data.jsonl:2: the line is not valid UTF-8"), "{e}");
}

#[test]
fn file_level_errors() {
    for text in ["", "\n  \n\n"] {
        let e = load(text, &opts(8)).unwrap_err();
        assert!(matches!(e, Error::Empty { .. }) && e.to_string().contains("data.jsonl: no samples"), "{e}");
    }
    let e = load("{\"input_ids\": [1, 2]}\n", &DataOptions { eval_fraction: 0.1, ..opts(8) }).unwrap_err();
    assert!(e.to_string().contains("eval_fraction 0.1 needs at least 2 samples"), "{e}");
    let e = load("{\"input_ids\": [1]}\n{\"input_ids\": [2]}\n", &opts(8)).unwrap_err();
    assert!(matches!(e, Error::NoTargets { .. }), "{e}");
    let e = Dataset::load(Path::new("/nonexistent/data.jsonl"), None, &opts(8)).unwrap_err();
    assert!(e.to_string().starts_with("cannot read /nonexistent/data.jsonl"), "{e}");
    let e = load("{\"input_ids\": [1, 2]}\n", &DataOptions { eval_fraction: 1.5, ..opts(8) }).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { name: "eval_fraction", .. }), "{e}");
}

#[test]
fn a_byte_order_mark_and_crlf_line_ends_are_accepted() {
    let ds = load("\u{feff}{\"input_ids\": [1, 2]}\r\n{\"input_ids\": [3, 4]}\r\n", &opts(2)).unwrap();
    assert_eq!(ds.n_train(), 2);
    assert_eq!(ds.train_batch(1, 1).input_ids, [3, 4]);
}

#[test]
fn samples_without_a_target_are_dropped_and_counted() {
    // A one-token line predicts nothing; unpacked it would be a batch with no targets.
    let text = ids_lines(&[vec![1, 2, 3], vec![7], vec![4, 5], vec![9]]);
    let d = load(&text, &DataOptions { pack: false, ..opts(4) }).unwrap();
    assert_eq!((d.n_dropped_samples(), d.n_train()), (2, 2));
    for step in 0..4 {
        assert!(d.train_batch(step, 1).n_targets() > 0, "step {step}");
    }
    // Only targetless lines: refused as a file without targets.
    let e = load(&ids_lines(&[vec![7], vec![8]]), &opts(4)).unwrap_err().to_string();
    assert!(e.contains("target"), "{e}");
}

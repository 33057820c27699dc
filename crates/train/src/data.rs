//! Training data: the built-in corpus with its byte tokenizer, the synthetic arithmetic
//! sequences, and the deterministic sampler that turns (seed, step) into a [`Batch`].
//!
//! Every sequence is a window of `seq + 1` tokens: the first `seq` are the inputs and the last
//! `seq` the targets (next token at every position, the last position predicting the token after
//! the window), so no position is masked. The batch of global step `k` depends only on the seed
//! and `k`, which is what makes a run resumed from a store see the same data as an uninterrupted
//! one.

use std::path::Path;

use mt_core::Error as CoreError;
use mt_sched::Batch;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::checkpoint::DataCursor;
use crate::config::{DataKind, DataSource, TrainConfig};
use crate::error::{Context, Error, Result};

/// `--data` as written in logs and manifests.
pub fn describe_source(d: &DataSource) -> String {
    match d {
        DataSource::Builtin(DataKind::Builtin) => "builtin".into(),
        DataSource::Builtin(DataKind::Synthetic) => "synthetic".into(),
        DataSource::File(p) => p.display().to_string(),
    }
}

/// The training data of a run: a built-in source, or a JSON Lines file through `mt-data`.
#[derive(Debug)]
pub enum TrainData {
    /// `--data builtin|synthetic`.
    Builtin(Dataset),
    /// `--data FILE`, with `--eval-data FILE` if given.
    File(Box<mt_data::Dataset>, Option<Box<mt_data::Dataset>>),
}

impl TrainData {
    /// Loads the data of `c` for a model with `vocab_size` tokens; the tokenizer (for text and
    /// chat data only) comes from the model directory `model_dir`.
    pub fn new(c: &TrainConfig, vocab_size: usize, model_dir: Option<&Path>) -> Result<Self> {
        match &c.data {
            DataSource::Builtin(kind) => {
                if c.eval_fraction > 0.0 {
                    return Err(Error::Options(
                        "--eval-fraction needs --data FILE (the built-in sources have no held-out split)"
                            .into(),
                    ));
                }
                Ok(TrainData::Builtin(Dataset::new(*kind, vocab_size).context_with(|| "--data".into())?))
            }
            DataSource::File(path) => {
                // The tokenizer only for data that needs one: pre-tokenised data trains with a
                // model directory whose tokenizer is missing, or one this build cannot load.
                let needs = |p: &Path| mt_data::file_format(p).is_none_or(|f| f.needs_tokenizer());
                let needed = needs(path) || c.eval_data.as_deref().is_some_and(needs);
                let tok = match model_dir {
                    Some(dir) if needed && dir.join("tokenizer.json").is_file() => Some(
                        mt_data::Tokenizer::from_model_dir(dir)
                            .context_with(|| format!("loading the tokenizer of {}", dir.display()))?,
                    ),
                    _ => None,
                };
                let opts = mt_data::DataOptions {
                    seq_len: c.seq_len,
                    vocab_size,
                    pack: c.pack,
                    truncate: c.truncate,
                    eval_fraction: c.eval_fraction,
                    shuffle: c.shuffle,
                    seed: c.seed,
                };
                let d = mt_data::Dataset::load(path, tok.as_ref(), &opts)
                    .context_with(|| format!("--data {}", path.display()))?;
                if d.n_train() == 0 {
                    return Err(Error::Options(format!("--data {}: no training sequences", path.display())));
                }
                let eval = match &c.eval_data {
                    Some(e) => {
                        let o = mt_data::DataOptions { eval_fraction: 0.0, shuffle: false, ..opts };
                        let d = mt_data::Dataset::load(e, tok.as_ref(), &o)
                            .context_with(|| format!("--eval-data {}", e.display()))?;
                        Some(Box::new(d))
                    }
                    None => None,
                };
                if c.eval_every > 0 && eval.is_none() && d.n_eval() == 0 {
                    return Err(Error::Options(
                        "--eval-every needs held-out data: --eval-fraction F or --eval-data FILE".into(),
                    ));
                }
                Ok(TrainData::File(Box::new(d), eval))
            }
        }
    }

    /// The batch of global step `step`.
    pub fn batch(&self, seed: u64, step: u64, batch: usize, seq: usize) -> Batch {
        match self {
            TrainData::Builtin(d) => d.batch(seed, step, batch, seq),
            TrainData::File(d, _) => into_batch(d.train_batch(step, batch)),
        }
    }

    /// Held-out batches of at most `batch` sequences (none for the built-in sources).
    pub fn eval_batches(&self, batch: usize) -> Vec<Batch> {
        match self {
            TrainData::Builtin(_) => Vec::new(),
            TrainData::File(_, Some(e)) => {
                // Every sequence of the eval file, in order.
                let (n, batch) = (e.n_train(), batch.max(1));
                let all = e.train_batch(0, n);
                let seq = all.seq;
                (0..n.div_ceil(batch))
                    .map(|k| {
                        let rows = k * batch..(k * batch + batch).min(n);
                        Batch {
                            batch: rows.len(),
                            seq,
                            input_ids: all.input_ids[rows.start * seq..rows.end * seq].to_vec(),
                            targets: all.targets[rows.start * seq..rows.end * seq].to_vec(),
                            positions: Some(all.positions[rows.start * seq..rows.end * seq].to_vec()),
                        }
                    })
                    .collect()
            }
            TrainData::File(d, None) => d.eval_batches(batch).into_iter().map(into_batch).collect(),
        }
    }

    /// Where the data stands before step `step` (files only).
    pub fn cursor(&self, step: u64, batch: usize) -> Option<DataCursor> {
        match self {
            TrainData::Builtin(_) => None,
            TrainData::File(d, _) => {
                let c = d.cursor(step, batch);
                Some(DataCursor { epoch: c.epoch, index: c.index_in_epoch })
            }
        }
    }

    /// One line for the log: what the data is.
    pub fn describe(&self) -> String {
        match self {
            TrainData::Builtin(Dataset::Text { tokens }) => {
                format!("built-in text, {} byte tokens", tokens.len())
            }
            TrainData::Builtin(Dataset::Synthetic { vocab }) => {
                format!("synthetic sequences over {vocab} ids")
            }
            TrainData::File(d, e) => format!(
                "{:?} data: {} training sequences of {} samples ({} target tokens), {} held out; {} samples without a target dropped",
                d.format(),
                d.n_train(),
                d.n_train_samples(),
                d.n_target_tokens(),
                e.as_ref().map_or(d.n_eval(), |e| e.n_train()),
                d.n_dropped_samples() + e.as_ref().map_or(0, |e| e.n_dropped_samples())
            ),
        }
    }
}

fn into_batch(b: mt_data::TokenBatch) -> Batch {
    Batch {
        batch: b.batch,
        seq: b.seq,
        input_ids: b.input_ids,
        targets: b.targets,
        positions: Some(b.positions),
    }
}

/// The built-in training text (original prose, ASCII).
pub const CORPUS: &str = include_str!("../data/corpus.txt");

/// Vocabulary size of the byte tokenizer.
pub const BYTE_VOCAB: usize = 256;

/// Largest stride of the synthetic sequences (strides are drawn from `1..=MAX_STRIDE`).
pub const MAX_STRIDE: u32 = 3;

/// Byte-level tokenizer: one token per byte, ids 0..256.
pub fn encode_bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// A source of training batches.
#[derive(Debug, Clone)]
pub enum Dataset {
    /// Windows of a token stream, read cyclically (the end wraps to the beginning).
    Text {
        /// Token ids.
        tokens: Vec<u32>,
    },
    /// Sequences `t_i = (a + i * d) mod vocab`, with `a` and `d in 1..=MAX_STRIDE` drawn per
    /// sequence: after two tokens the rest is determined, so the loss can fall far.
    Synthetic {
        /// Vocabulary size (token ids are below it).
        vocab: u32,
    },
}

impl Dataset {
    /// The dataset for `kind`, checked against the model's vocabulary.
    pub fn new(kind: DataKind, vocab_size: usize) -> mt_core::Result<Self> {
        match kind {
            DataKind::Builtin => {
                if vocab_size < BYTE_VOCAB {
                    return Err(CoreError::Data(format!(
                        "the built-in text is tokenised as bytes and needs vocab_size >= {BYTE_VOCAB}, \
                         but the model's vocab_size is {vocab_size}; use --data synthetic or a larger vocabulary"
                    )));
                }
                Ok(Dataset::Text { tokens: encode_bytes(CORPUS) })
            }
            DataKind::Synthetic => {
                let vocab = u32::try_from(vocab_size).ok().filter(|&v| v >= 2).ok_or_else(|| {
                    CoreError::Data(format!(
                        "synthetic data needs 2 <= vocab_size < 2^32, found {vocab_size}"
                    ))
                })?;
                Ok(Dataset::Synthetic { vocab })
            }
        }
    }

    /// The batch of global step `step`: `batch` sequences of `seq` tokens with next-token
    /// targets. Deterministic in (`seed`, `step`).
    pub fn batch(&self, seed: u64, step: u64, batch: usize, seq: usize) -> Batch {
        let mut rng = StdRng::seed_from_u64(step_seed(seed, step));
        let mut input_ids = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        let mut window = Vec::with_capacity(seq + 1);
        for _ in 0..batch {
            window.clear();
            match self {
                Dataset::Text { tokens } => {
                    let start = rng.random_range(0..tokens.len());
                    window.extend(tokens.iter().cycle().skip(start).take(seq + 1));
                }
                Dataset::Synthetic { vocab } => {
                    let v = u64::from(*vocab);
                    let a = rng.random_range(0..v);
                    let d = rng.random_range(1..=u64::from(MAX_STRIDE)) % v;
                    // Each id is reduced mod `vocab` (a u32), so the cast is lossless.
                    window.extend((0..=seq as u64).map(|i| ((a + i % v * d) % v) as u32));
                }
            }
            input_ids.extend_from_slice(&window[..seq]);
            targets.extend(window[1..].iter().map(|&t| i64::from(t)));
        }
        Batch { batch, seq, input_ids, targets, positions: None }
    }
}

/// Mixes the run seed and a step index into the seed of that step's sampler (SplitMix64
/// finaliser), so neighbouring steps get unrelated streams.
fn step_seed(seed: u64, step: u64) -> u64 {
    let mut z = seed ^ step.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use mt_core::ModelConfig;

    use super::*;

    #[test]
    fn the_corpus_is_a_few_kilobytes_of_ascii() {
        assert!(CORPUS.is_ascii());
        assert!((3_000..20_000).contains(&CORPUS.len()), "{}", CORPUS.len());
    }

    #[test]
    fn targets_are_the_next_token_of_the_window() {
        let d = Dataset::new(DataKind::Builtin, 256).unwrap();
        let b = d.batch(3, 7, 4, 16);
        assert!(b.validate(&ModelConfig::tiny_llama()).is_ok());
        assert_eq!(b.n_targets(), 4 * 16);
        for r in 0..4 {
            let (ids, tg) = (&b.input_ids[r * 16..(r + 1) * 16], &b.targets[r * 16..(r + 1) * 16]);
            for t in 0..15 {
                assert_eq!(i64::from(ids[t + 1]), tg[t]);
            }
            let text = String::from_utf8(ids.iter().map(|&i| i as u8).collect()).unwrap();
            assert!(format!("{CORPUS}{CORPUS}").contains(&text), "{text:?} is not a window of the corpus");
        }
    }

    #[test]
    fn batches_depend_only_on_seed_and_step() {
        for kind in [DataKind::Builtin, DataKind::Synthetic] {
            let d = Dataset::new(kind, 256).unwrap();
            assert_eq!(d.batch(1, 5, 3, 8), d.batch(1, 5, 3, 8));
            assert_ne!(d.batch(1, 5, 3, 8), d.batch(1, 6, 3, 8));
            assert_ne!(d.batch(1, 5, 3, 8), d.batch(2, 5, 3, 8));
        }
    }

    #[test]
    fn synthetic_sequences_are_arithmetic_mod_vocab() {
        let d = Dataset::new(DataKind::Synthetic, 7).unwrap();
        let b = d.batch(0, 0, 5, 20);
        for r in 0..5 {
            let w = &b.input_ids[r * 20..(r + 1) * 20];
            let step = (w[1] + 7 - w[0]) % 7;
            assert!((1..=MAX_STRIDE).contains(&step), "{w:?}");
            assert!(w.windows(2).all(|p| (p[1] + 7 - p[0]) % 7 == step), "{w:?}");
            assert!(w.iter().all(|&t| t < 7));
        }
    }

    #[test]
    fn bytes_need_a_byte_vocabulary() {
        let e = Dataset::new(DataKind::Builtin, 100).unwrap_err().to_string();
        assert!(e.contains("vocab_size") && e.contains("--data synthetic"), "{e}");
        assert!(Dataset::new(DataKind::Synthetic, 100).is_ok());
    }
}

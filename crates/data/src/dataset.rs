//! The dataset: options, the eval split, the packed train and eval sequences, and the
//! deterministic order in which training steps visit the train sequences.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::pack::{Packed, IGNORE_INDEX};
use crate::rng::{SplitMix64, PURPOSE_EPOCH, PURPOSE_SPLIT};
use crate::sample::{read_samples, Format, Sample};
use crate::tokenizer::Tokenizer;

/// How a data file becomes sequences.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataOptions {
    /// Tokens per sequence (`>= 1`).
    pub seq_len: usize,
    /// The model's vocabulary size: every token id must be below it.
    pub vocab_size: usize,
    /// Pack several samples into one sequence (else one sample per sequence).
    pub pack: bool,
    /// Cut samples longer than `seq_len` to `seq_len` tokens (else they are an error).
    pub truncate: bool,
    /// Fraction of the samples held out for evaluation, in `[0, 1)`.
    pub eval_fraction: f64,
    /// Visit the train sequences in a seeded random order per epoch (else in file order).
    pub shuffle: bool,
    /// Seed of the eval split and of the epoch orders.
    pub seed: u64,
}

impl DataOptions {
    /// Options with the defaults: packing on, no truncation, no eval split, shuffled, seed 0.
    pub fn new(seq_len: usize, vocab_size: usize) -> Self {
        DataOptions {
            seq_len,
            vocab_size,
            pack: true,
            truncate: false,
            eval_fraction: 0.0,
            shuffle: true,
            seed: 0,
        }
    }

    /// Checks the ranges of the fields.
    pub fn validate(&self) -> Result<()> {
        let invalid = |name, value: String, expected| Err(Error::InvalidOption { name, value, expected });
        if self.seq_len == 0 {
            return invalid("seq_len", "0".into(), "at least 1");
        }
        if self.vocab_size == 0 || self.vocab_size as u64 > 1 << 32 {
            return invalid("vocab_size", self.vocab_size.to_string(), "1 ..= 2^32");
        }
        if !(self.eval_fraction.is_finite() && (0.0..1.0).contains(&self.eval_fraction)) {
            return invalid("eval_fraction", self.eval_fraction.to_string(), "a number in [0, 1)");
        }
        Ok(())
    }
}

/// A batch of token sequences in the engine's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Token ids, row-major `[batch, seq]`.
    pub input_ids: Vec<u32>,
    /// The token each position must predict, or [`IGNORE_INDEX`] (`-100`), `[batch, seq]`.
    pub targets: Vec<i64>,
    /// Each token's position within its sample, `[batch, seq]`: packed samples restart at 0, so
    /// each is a document of its own (transformers' `position_ids` for packed SFT).
    pub positions: Vec<u32>,
}

impl TokenBatch {
    /// Positions with a target (not [`IGNORE_INDEX`]).
    pub fn n_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// Where a step starts in the train order: the epoch and the position within it of the step's
/// first sequence (for checkpoint manifests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Cursor {
    /// Completed passes over the train sequences before this one.
    pub epoch: u64,
    /// Position in this epoch's order.
    pub index_in_epoch: u64,
}

/// A loaded data file: packed train sequences, packed eval sequences, and the order in which
/// training visits them (see the crate documentation for the contract).
pub struct Dataset {
    path: PathBuf,
    format: Format,
    opts: DataOptions,
    n_train_samples: usize,
    n_eval_samples: usize,
    train: Packed,
    eval: Packed,
    /// The orders of the last epochs asked for (at most two: a batch can span an epoch end).
    orders: Mutex<Vec<(u64, Arc<Vec<usize>>)>>,
    /// Samples dropped at load for having no target.
    n_dropped: usize,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("opts", &self.opts)
            .field("n_train_samples", &self.n_train_samples)
            .field("n_eval_samples", &self.n_eval_samples)
            .field("n_train", &self.n_train())
            .field("n_eval", &self.n_eval())
            .finish()
    }
}

/// `ceil(x)`, where an `x` within `1e-9` (relative) of an integer counts as that integer, so that
/// `0.3 * 10` is 3 and not 4.
fn ceil_tolerant(x: f64) -> f64 {
    let r = x.round();
    if (x - r).abs() <= 1e-9 * r.abs().max(1.0) {
        r
    } else {
        x.ceil()
    }
}

/// Indices (in file order) of the samples held out for eval: the last
/// `min(ceil(fraction * n), n - 1)` of `0..n` after a seeded Fisher–Yates shuffle.
pub(crate) fn eval_indices(n: usize, fraction: f64, seed: u64) -> Vec<usize> {
    if fraction <= 0.0 || n < 2 {
        return Vec::new();
    }
    let n_eval = (ceil_tolerant(fraction * n as f64) as usize).clamp(1, n - 1);
    let mut order: Vec<usize> = (0..n).collect();
    SplitMix64::stream(seed, PURPOSE_SPLIT, 0).shuffle(&mut order);
    let mut eval = order.split_off(n - n_eval);
    eval.sort_unstable();
    eval
}

impl Dataset {
    /// Reads, tokenises, splits and packs a JSON Lines data file. `tokenizer` is needed for
    /// `text` and `messages` files.
    pub fn load(path: &Path, tokenizer: Option<&Tokenizer>, opts: &DataOptions) -> Result<Self> {
        opts.validate()?;
        let (format, mut samples) =
            read_samples(path, tokenizer, opts.vocab_size, opts.seq_len, opts.truncate)?;
        // A sample with nothing to predict (an empty text, a chat whose assistant turn was cut by
        // --truncate) would make a batch of no targets, which the engine refuses: drop it here,
        // counted, so such a line can never stop a run (or every resume of it) at one step.
        let before = samples.len();
        samples.retain(|s| s.is_target.iter().skip(1).any(|&t| t));
        let n_dropped = before - samples.len();
        let mut d = Self::from_samples(path, format, samples, opts)?;
        d.n_dropped = n_dropped;
        Ok(d)
    }

    /// Samples dropped at load because none of their tokens is a target.
    pub fn n_dropped_samples(&self) -> usize {
        self.n_dropped
    }

    /// Splits and packs samples (already checked to fit in `seq_len`).
    pub(crate) fn from_samples(
        path: &Path,
        format: Format,
        samples: Vec<Sample>,
        opts: &DataOptions,
    ) -> Result<Self> {
        let n = samples.len();
        if opts.eval_fraction > 0.0 && n < 2 {
            return Err(Error::TooFewForEval {
                path: path.to_path_buf(),
                fraction: opts.eval_fraction,
                n_samples: n,
            });
        }
        let eval_idx = eval_indices(n, opts.eval_fraction, opts.seed);
        let mut is_eval = vec![false; n];
        for &i in &eval_idx {
            is_eval[i] = true;
        }
        let train_samples = samples.iter().zip(&is_eval).filter(|(_, &e)| !e).map(|(s, _)| s);
        let train = Packed::pack(train_samples, opts.seq_len, opts.pack);
        let eval_samples = samples.iter().zip(&is_eval).filter(|(_, &e)| e).map(|(s, _)| s);
        let eval = Packed::pack(eval_samples, opts.seq_len, opts.pack);
        if train.n_targets() == 0 {
            return Err(Error::NoTargets { path: path.to_path_buf() });
        }
        Ok(Dataset {
            path: path.to_path_buf(),
            format,
            opts: opts.clone(),
            n_train_samples: n - eval_idx.len(),
            n_eval_samples: eval_idx.len(),
            train,
            eval,
            orders: Mutex::new(Vec::new()),
            n_dropped: 0,
        })
    }

    /// The data file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The options the dataset was built with.
    pub fn options(&self) -> &DataOptions {
        &self.opts
    }

    /// The file's format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Tokens per sequence.
    pub fn seq_len(&self) -> usize {
        self.opts.seq_len
    }

    /// Train sequences (one epoch).
    pub fn n_train(&self) -> usize {
        self.train.len()
    }

    /// Eval sequences.
    pub fn n_eval(&self) -> usize {
        self.eval.len()
    }

    /// Samples (lines) in the train split.
    pub fn n_train_samples(&self) -> usize {
        self.n_train_samples
    }

    /// Samples (lines) in the eval split.
    pub fn n_eval_samples(&self) -> usize {
        self.n_eval_samples
    }

    /// Target positions in one epoch of train sequences.
    pub fn n_target_tokens(&self) -> u64 {
        self.train.n_targets()
    }

    /// Target positions in the eval sequences.
    pub fn n_eval_target_tokens(&self) -> u64 {
        self.eval.n_targets()
    }

    /// The epoch and in-epoch position of the first sequence of step `step` with `batch`
    /// sequences per step (global sequence index `step * batch`).
    pub fn cursor(&self, step: u64, batch: usize) -> Cursor {
        let (epoch, pos) = self.locate(u128::from(step) * batch as u128);
        Cursor { epoch, index_in_epoch: pos as u64 }
    }

    /// The batch of global step `step`: the train sequences at global indices
    /// `step * batch .. step * batch + batch` of the epoch-wise order (global index `i` is
    /// position `i % n_train` of epoch `i / n_train`). Depends only on the file, the options,
    /// `step` and `batch`.
    pub fn train_batch(&self, step: u64, batch: usize) -> TokenBatch {
        let seq = self.opts.seq_len;
        let mut input_ids = Vec::with_capacity(batch * seq);
        let mut positions = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        let first = u128::from(step) * batch as u128;
        for j in 0..batch {
            let (epoch, pos) = self.locate(first + j as u128);
            let k = if self.opts.shuffle { self.epoch_order(epoch)[pos] } else { pos };
            self.train.write(k, &mut input_ids, &mut positions, &mut targets);
        }
        TokenBatch { batch, seq, input_ids, targets, positions }
    }

    /// All eval sequences in order, `batch` per batch (the last batch may be smaller; `batch` 0
    /// counts as 1). Empty without an eval split.
    pub fn eval_batches(&self, batch: usize) -> Vec<TokenBatch> {
        let seq = self.opts.seq_len;
        let batch = batch.max(1);
        (0..self.eval.len())
            .step_by(batch)
            .map(|start| {
                let end = (start + batch).min(self.eval.len());
                let (mut input_ids, mut positions, mut targets) = (Vec::new(), Vec::new(), Vec::new());
                for k in start..end {
                    self.eval.write(k, &mut input_ids, &mut positions, &mut targets);
                }
                TokenBatch { batch: end - start, seq, input_ids, targets, positions }
            })
            .collect()
    }

    /// (epoch, position) of a global sequence index.
    fn locate(&self, i: u128) -> (u64, usize) {
        let n = self.train.len().max(1) as u128;
        // The position is below n_train (a usize); the epoch saturates only past 2^64 epochs.
        (u64::try_from(i / n).unwrap_or(u64::MAX), (i % n) as usize)
    }

    /// Epoch `epoch`'s permutation of the train sequences (seeded by (seed, epoch)).
    fn epoch_order(&self, epoch: u64) -> Arc<Vec<usize>> {
        let mut cache = self.orders.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, order)) = cache.iter().find(|(e, _)| *e == epoch) {
            return Arc::clone(order);
        }
        let order = Arc::new(epoch_permutation(self.train.len(), self.opts.seed, epoch));
        if cache.len() >= 2 {
            cache.remove(0);
        }
        cache.push((epoch, Arc::clone(&order)));
        order
    }
}

/// The order of `n` train sequences in epoch `epoch`: `0..n` shuffled by the (seed, epoch)
/// stream.
pub(crate) fn epoch_permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    SplitMix64::stream(seed, PURPOSE_EPOCH, epoch).shuffle(&mut order);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_count_is_the_tolerant_ceiling_and_leaves_a_train_sample() {
        assert_eq!(eval_indices(10, 0.3, 1).len(), 3);
        assert_eq!(eval_indices(10, 0.31, 1).len(), 4);
        assert_eq!(eval_indices(10, 0.01, 1).len(), 1);
        assert_eq!(eval_indices(2, 0.99, 1).len(), 1);
        assert_eq!(eval_indices(10, 0.0, 1).len(), 0);
    }

    #[test]
    fn eval_indices_are_sorted_distinct_and_seeded() {
        let a = eval_indices(100, 0.2, 5);
        assert_eq!(a.len(), 20);
        assert!(a.windows(2).all(|w| w[0] < w[1]) && a[19] < 100);
        assert_eq!(a, eval_indices(100, 0.2, 5));
        assert_ne!(a, eval_indices(100, 0.2, 6));
    }

    #[test]
    fn datasets_and_tokenizers_can_be_shared_between_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Dataset>();
        shareable::<Tokenizer>();
    }

    #[test]
    fn options_are_validated() {
        let ok = DataOptions::new(8, 100);
        assert!(ok.validate().is_ok());
        for (opts, name) in [
            (DataOptions { seq_len: 0, ..ok.clone() }, "seq_len"),
            (DataOptions { vocab_size: 0, ..ok.clone() }, "vocab_size"),
            (DataOptions { eval_fraction: 1.0, ..ok.clone() }, "eval_fraction"),
            (DataOptions { eval_fraction: -0.1, ..ok.clone() }, "eval_fraction"),
            (DataOptions { eval_fraction: f64::NAN, ..ok.clone() }, "eval_fraction"),
        ] {
            let e = opts.validate().unwrap_err();
            assert!(matches!(e, Error::InvalidOption { name: n, .. } if n == name), "{e}");
        }
    }
}

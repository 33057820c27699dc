//! A training batch (token ids and aligned next-token targets), its validation, and its split
//! into token chunks (contiguous groups of sequences).

use candle_core::{Device, Tensor};
use mt_core::{Error as CoreError, ModelConfig};

use crate::Result;

/// Target value that excludes a position from the loss (HF convention).
pub const IGNORE_INDEX: i64 = -100;

/// A global batch: `batch` sequences of `seq` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Token ids, row-major `[batch, seq]`.
    pub input_ids: Vec<u32>,
    /// Next-token target of every position (`IGNORE_INDEX` = not trained on), `[batch, seq]`.
    pub targets: Vec<i64>,
    /// HF-style position ids `[batch, seq]`, or `None` for `0..seq` in every sequence. In a
    /// packed sequence they restart at 0 with every sample, and each sample is then a document
    /// of its own: its tokens attend only to earlier tokens of the same sample, and RoPE sees
    /// their position within it (as transformers does for packed SFT with `position_ids`).
    pub positions: Option<Vec<u32>>,
}

impl Batch {
    /// Builds a batch from HF-style `input_ids`/`labels` rows (labels unshifted: the target of
    /// position t is `labels[t + 1]`).
    pub fn from_labels(batch: usize, seq: usize, input_ids: Vec<u32>, labels: &[i64]) -> Result<Self> {
        let n = batch * seq;
        if input_ids.len() != n || labels.len() != n {
            return Err(CoreError::Data(format!(
                "a batch of {batch} x {seq} needs {n} input ids and labels, got {} and {}",
                input_ids.len(),
                labels.len()
            ))
            .into());
        }
        let mut targets = vec![IGNORE_INDEX; n];
        for b in 0..batch {
            for t in 0..seq.saturating_sub(1) {
                targets[b * seq + t] = labels[b * seq + t + 1];
            }
        }
        Ok(Batch { batch, seq, input_ids, targets, positions: None })
    }

    /// Non-masked targets (the loss normaliser).
    pub fn n_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }

    /// Checks shapes and ranges against the model, and that something is trained on.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        self.validate_shape(cfg)?;
        if self.n_targets() == 0 {
            return Err(CoreError::NoTargetTokens.into());
        }
        Ok(())
    }

    /// [`Batch::validate`] less the target count: a data-parallel rank's share may have no
    /// targets of its own (the global batch has).
    pub fn validate_shape(&self, cfg: &ModelConfig) -> Result<()> {
        let data = |m: String| CoreError::Data(m);
        if self.batch == 0 || self.seq == 0 {
            return Err(data(format!("empty batch ({} sequences x {} tokens)", self.batch, self.seq)).into());
        }
        let n = self.batch * self.seq;
        if self.input_ids.len() != n || self.targets.len() != n {
            return Err(data(format!(
                "batch of {} x {} needs {n} ids and targets, got {} ids and {} targets",
                self.batch,
                self.seq,
                self.input_ids.len(),
                self.targets.len()
            ))
            .into());
        }
        let v = cfg.vocab_size;
        if let Some((i, id)) = self.input_ids.iter().enumerate().find(|(_, &id)| id as usize >= v) {
            return Err(
                data(format!("token id {id} at position {i} is outside the vocabulary (size {v})")).into()
            );
        }
        if let Some((i, t)) =
            self.targets.iter().enumerate().find(|(_, &t)| t != IGNORE_INDEX && (t < 0 || t as usize >= v))
        {
            return Err(data(format!(
                "target {t} at position {i} is neither {IGNORE_INDEX} (ignored) nor a token id below {v}"
            ))
            .into());
        }
        if let Some(p) = &self.positions {
            if p.len() != n {
                return Err(data(format!(
                    "batch of {} x {} needs {n} position ids, got {}",
                    self.batch,
                    self.seq,
                    p.len()
                ))
                .into());
            }
            if let Some((i, &pos)) = p.iter().enumerate().find(|(i, &pos)| pos as usize > i % self.seq) {
                return Err(data(format!(
                    "position id {pos} at token {} of sequence {} is past the token itself (position ids count from 0 at the start of each sample)",
                    i % self.seq,
                    i / self.seq
                ))
                .into());
            }
        }
        cfg.check_seq_len(self.seq)?;
        Ok(())
    }
}

/// One token chunk on the device: a contiguous group of sequences.
#[derive(Debug, Clone)]
pub struct Chunk {
    /// `[b, t]` u32 token ids.
    pub ids: Tensor,
    /// The same ids in host memory, for the embedding's backward, which orders them on the host:
    /// reading them off the GPU there would wait for the downloads in flight.
    pub host_ids: Tensor,
    /// `[b, t]` u32 targets (ignored positions hold 0 and weight 0).
    pub targets: Tensor,
    /// `[b, t]` f64 loss weights: `1 / N_global` where trained, 0 elsewhere (the loss casts them
    /// to its statistics dtype: f32 for bf16, so `1 / N` is rounded there, not here).
    pub weights: Tensor,
    /// The chunk's position ids, `[b, t]` row-major (`Batch::positions`), if the batch has them.
    pub positions: Option<Vec<u32>>,
}

/// Sequence ranges of `n_chunks` near-equal contiguous groups.
pub fn chunk_ranges(batch: usize, n_chunks: usize) -> Vec<std::ops::Range<usize>> {
    let n = n_chunks.min(batch).max(1);
    (0..n).map(|c| (c * batch / n)..((c + 1) * batch / n)).collect()
}

/// Splits a validated batch into device chunks; the loss weights are normalised by the number of
/// non-masked targets of the whole batch, so any chunking yields the same gradient (to rounding).
pub fn make_chunks(b: &Batch, n_chunks: usize, device: &Device) -> Result<Vec<Chunk>> {
    make_chunks_normalised(b, n_chunks, b.n_targets(), device)
}

/// [`make_chunks`] with the loss weights `1 / norm_targets`: a data-parallel rank's share of a
/// batch is normalised by the whole batch's target count.
pub fn make_chunks_normalised(
    b: &Batch,
    n_chunks: usize,
    norm_targets: usize,
    device: &Device,
) -> Result<Vec<Chunk>> {
    let inv_n = 1.0 / norm_targets as f64;
    chunk_ranges(b.batch, n_chunks)
        .into_iter()
        .map(|r| {
            let (lo, hi) = (r.start * b.seq, r.end * b.seq);
            let shape = (r.len(), b.seq);
            let tg = &b.targets[lo..hi];
            let targets: Vec<u32> =
                tg.iter().map(|&t| if t == IGNORE_INDEX { 0 } else { t as u32 }).collect();
            let weights: Vec<f64> = tg.iter().map(|&t| if t == IGNORE_INDEX { 0.0 } else { inv_n }).collect();
            Ok(Chunk {
                ids: Tensor::from_slice(&b.input_ids[lo..hi], shape, device)?,
                host_ids: Tensor::from_slice(&b.input_ids[lo..hi], shape, &Device::Cpu)?,
                targets: Tensor::from_slice(&targets, shape, device)?,
                weights: Tensor::from_slice(&weights, shape, device)?,
                positions: b.positions.as_ref().map(|p| p[lo..hi].to_vec()),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_ranges_cover_the_batch_once() {
        for batch in 1..9 {
            for n in 1..6 {
                let r = chunk_ranges(batch, n);
                assert_eq!(r.first().unwrap().start, 0);
                assert_eq!(r.last().unwrap().end, batch);
                assert!(r.windows(2).all(|w| w[0].end == w[1].start && !w[1].is_empty()));
            }
        }
    }

    #[test]
    fn from_labels_shifts_like_transformers() {
        let b = Batch::from_labels(1, 4, vec![5, 6, 7, 8], &[5, 6, -100, 8]).unwrap();
        assert_eq!(b.targets, vec![6, -100, 8, -100]);
        let err = Batch::from_labels(2, 4, vec![5, 6, 7, 8], &[5, 6, -100, 8]).unwrap_err().to_string();
        assert!(err.contains("needs 8"), "{err}");
    }

    #[test]
    fn bad_batches_are_refused_with_a_reason() {
        let cfg = ModelConfig::tiny_llama();
        let ok =
            Batch { batch: 1, seq: 3, input_ids: vec![1, 2, 3], targets: vec![2, 3, -100], positions: None };
        assert!(ok.validate(&cfg).is_ok());
        let cases = [
            (Batch { input_ids: vec![1, 2, 999], ..ok.clone() }, "999"),
            (Batch { targets: vec![2, -5, -100], ..ok.clone() }, "-5"),
            (Batch { targets: vec![-100; 3], ..ok.clone() }, "no target tokens"),
            (Batch { input_ids: vec![1, 2], ..ok.clone() }, "needs 3 ids"),
            (Batch { batch: 0, ..ok.clone() }, "empty batch"),
        ];
        for (b, needle) in cases {
            let e = b.validate(&cfg).unwrap_err().to_string();
            assert!(e.contains(needle), "{e:?} should mention {needle:?}");
        }
    }
}

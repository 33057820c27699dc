//! Packing samples into fixed-length sequences and deriving their next-token targets.

use crate::sample::Sample;

/// Target value of a position that is not trained on (HF convention).
pub const IGNORE_INDEX: i64 = -100;

/// Token id of padding.
pub const PAD_ID: u32 = 0;

/// Packed sequences of `seq_len` tokens, stored flat: the ids, each token's position within its
/// sample and, per position, whether it predicts the next position's token.
#[derive(Debug, Clone, Default)]
pub(crate) struct Packed {
    seq_len: usize,
    ids: Vec<u32>,
    positions: Vec<u32>,
    predicts: Vec<bool>,
    n_targets: u64,
}

impl Packed {
    /// Packs `samples` in the given order. With `pack`, a sample goes into the current sequence if
    /// it fits in the space left, else it starts a new one; without, every sample starts a new
    /// sequence. The rest of a sequence is padding ([`PAD_ID`], never a target). Samples must not
    /// be longer than `seq_len`. Positions count from 0 at each sample's first token (so each
    /// sample of a packed sequence is a document of its own); padding continues the last
    /// sample's count (it is never a target, and no earlier token sees it).
    pub(crate) fn pack<'a>(
        samples: impl IntoIterator<Item = &'a Sample>,
        seq_len: usize,
        pack: bool,
    ) -> Self {
        let mut p = Packed { seq_len, ..Packed::default() };
        let mut used = seq_len; // tokens used in the last sequence (none open yet)
        for s in samples {
            let n = s.ids.len();
            debug_assert!(n <= seq_len, "line {}: {n} tokens > seq_len {seq_len}", s.line);
            if !pack || used + n > seq_len {
                p.ids.resize(p.ids.len() + seq_len, PAD_ID);
                p.predicts.resize(p.predicts.len() + seq_len, false);
                p.positions.resize(p.positions.len() + seq_len, 0);
                used = 0;
            }
            let base = p.ids.len() - seq_len + used;
            p.ids[base..base + n].copy_from_slice(&s.ids);
            // This sample's positions from 0, and the padding after it continuing them.
            let row_end = p.ids.len();
            for (k, pos) in p.positions[base..row_end].iter_mut().enumerate() {
                *pos = k as u32;
            }
            for k in 0..n.saturating_sub(1) {
                if s.is_target[k + 1] {
                    p.predicts[base + k] = true;
                    p.n_targets += 1;
                }
            }
            used += n;
        }
        p
    }

    /// Number of sequences.
    pub(crate) fn len(&self) -> usize {
        self.ids.len().checked_div(self.seq_len).unwrap_or(0)
    }

    /// Positions with a target, over all sequences.
    pub(crate) fn n_targets(&self) -> u64 {
        self.n_targets
    }

    /// Appends sequence `k`'s ids, positions and targets (`ids[t + 1]` where position `t`
    /// predicts, else [`IGNORE_INDEX`]).
    pub(crate) fn write(
        &self,
        k: usize,
        ids: &mut Vec<u32>,
        positions: &mut Vec<u32>,
        targets: &mut Vec<i64>,
    ) {
        let r = k * self.seq_len..(k + 1) * self.seq_len;
        let (seq_ids, predicts) = (&self.ids[r.clone()], &self.predicts[r.clone()]);
        ids.extend_from_slice(seq_ids);
        positions.extend_from_slice(&self.positions[r]);
        targets.extend(predicts.iter().enumerate().map(|(t, &p)| {
            // `predicts[t]` is only set when `t + 1` is in the same sample, so inside the sequence.
            if p {
                i64::from(seq_ids[t + 1])
            } else {
                IGNORE_INDEX
            }
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ids: &[u32]) -> Sample {
        Sample { line: 0, ids: ids.to_vec(), is_target: (0..ids.len()).map(|k| k > 0).collect() }
    }

    fn rows(p: &Packed) -> Vec<(Vec<u32>, Vec<i64>)> {
        (0..p.len())
            .map(|k| {
                let (mut ids, mut pos, mut tg) = (Vec::new(), Vec::new(), Vec::new());
                p.write(k, &mut ids, &mut pos, &mut tg);
                (ids, tg)
            })
            .collect()
    }

    fn positions(p: &Packed) -> Vec<Vec<u32>> {
        (0..p.len())
            .map(|k| {
                let (mut ids, mut pos, mut tg) = (Vec::new(), Vec::new(), Vec::new());
                p.write(k, &mut ids, &mut pos, &mut tg);
                pos
            })
            .collect()
    }

    const X: i64 = IGNORE_INDEX;

    #[test]
    fn greedy_packing_never_splits_a_sample() {
        let s =
            [sample(&[1, 2, 3]), sample(&[4, 5]), sample(&[6, 7, 8, 9]), sample(&[10]), sample(&[11, 12])];
        let p = Packed::pack(&s, 6, true);
        assert_eq!(
            rows(&p),
            [
                (vec![1, 2, 3, 4, 5, 0], vec![2, 3, X, 5, X, X]),
                (vec![6, 7, 8, 9, 10, 0], vec![7, 8, 9, X, X, X]),
                (vec![11, 12, 0, 0, 0, 0], vec![12, X, X, X, X, X]),
            ]
        );
        assert_eq!(p.n_targets(), 2 + 1 + 3 + 1);
        // Each sample counts its positions from 0; padding continues the last sample's.
        assert_eq!(positions(&p), [vec![0, 1, 2, 0, 1, 2], vec![0, 1, 2, 3, 0, 1], vec![0, 1, 2, 3, 4, 5]]);
    }

    #[test]
    fn without_packing_each_sample_has_its_own_sequence() {
        let s = [sample(&[1, 2, 3]), sample(&[4, 5])];
        let p = Packed::pack(&s, 4, false);
        assert_eq!(rows(&p), [(vec![1, 2, 3, 0], vec![2, 3, X, X]), (vec![4, 5, 0, 0], vec![5, X, X, X])]);
    }

    #[test]
    fn a_full_length_sample_predicts_all_but_its_last_token() {
        let p = Packed::pack(&[sample(&[5, 6, 7, 8])], 4, true);
        assert_eq!(rows(&p), [(vec![5, 6, 7, 8], vec![6, 7, 8, X])]);
    }

    #[test]
    fn only_flagged_tokens_are_targets() {
        let s = Sample { line: 0, ids: vec![1, 2, 3, 4, 5], is_target: vec![true, false, true, true, false] };
        let p = Packed::pack(&[s], 6, true);
        // Token 0's flag has no predecessor in its sample and is ignored.
        assert_eq!(rows(&p), [(vec![1, 2, 3, 4, 5, 0], vec![X, 3, 4, X, X, X])]);
        assert_eq!(p.n_targets(), 2);
    }
}

//! Where a chunk's tokens sit: the RoPE rows of their positions and, in packed sequences, the
//! bounds of each token's document, so that attention stays inside a document.
//!
//! transformers' convention for packed supervised fine-tuning: `position_ids` restart at 0 at the
//! start of every sample, and attention (its varlen flash path) treats each run from one 0 to the
//! next as its own sequence. [`Positions::from_ids`] reads the same ids the same way.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};

use crate::rope::Rope;
use crate::{Error, Result};

/// The positions of a chunk of `b` sequences of `t` tokens.
#[derive(Debug)]
pub struct Positions {
    /// `[t, head_dim]` rows shared by every sequence, or `[b·t, head_dim]`, a row per token.
    cos: Tensor,
    sin: Tensor,
    docs: Option<Arc<Docs>>,
}

/// Document bounds of packed sequences: token `i` of a row attends to keys `lo[i] ..= i` of it.
#[derive(Debug)]
pub(crate) struct Docs {
    b: usize,
    t: usize,
    /// First index (within its row) of each token's document, `[b, t]` row-major.
    lo: Vec<u32>,
    /// The same as a device tensor (u32 `[b, t]`), and one past each document's last index.
    lo_dev: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    hi_dev: Tensor,
    /// The additive masks of the materialised attention, `[b, 1, 1, t, t]`, built on first use,
    /// by dtype and window.
    masks: Mutex<Vec<(DType, Option<usize>, Tensor)>>,
}

impl Docs {
    /// The first and one-past-last index of every token's document, u32 `[b, t]` on the device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn bounds(&self) -> (&Tensor, &Tensor) {
        (&self.lo_dev, &self.hi_dev)
    }

    /// The additive mask `[b, 1, 1, t, t]` in `dtype`: 0 where key `j` is in query `i`'s document
    /// at or before it (`lo[i] <= j <= i`) and, with a `window`, among its last `window` keys
    /// (`j > i - window`), `-inf` elsewhere. Causal by itself. Built once per dtype and window
    /// (every layer of a kind asks for the same one).
    pub(crate) fn mask(&self, dtype: DType, window: Option<usize>) -> Result<Tensor> {
        let mut cached = self.masks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, _, m)) = cached.iter().find(|(d, w, _)| *d == dtype && *w == window) {
            return Ok(m.clone());
        }
        let (b, t) = (self.b, self.t);
        let mut v = vec![f32::NEG_INFINITY; b * t * t];
        for (q, &lo) in self.lo.iter().enumerate() {
            let i = q % t;
            let lo = window.map_or(lo as usize, |w| (lo as usize).max((i + 1).saturating_sub(w)));
            v[q * t + lo..=q * t + i].fill(0.0);
        }
        let m = Tensor::from_vec(v, (b, 1, 1, t, t), self.lo_dev.device())?.to_dtype(dtype)?;
        cached.push((dtype, window, m.clone()));
        Ok(m)
    }
}

impl Positions {
    /// Every sequence at positions `start..start + t`, one document per sequence.
    pub fn range(rope: &Rope, start: usize, t: usize) -> Result<Self> {
        let (cos, sin) = rope.cos_sin(start, t)?;
        Ok(Positions { cos, sin, docs: None })
    }

    /// From HF-style position ids, `[b, t]` row-major, each below the table's `max_t`: a token's
    /// RoPE row is that of its id, and an id 0 after a row's first token starts a new document
    /// there (the row's first token always starts one). Ids `0..t` in every row are
    /// [`Positions::range`]`(rope, 0, t)`.
    pub fn from_ids(rope: &Rope, b: usize, t: usize, ids: &[u32]) -> Result<Self> {
        if ids.len() != b * t {
            return Err(Error::shape("position ids", format!("[{b}, {t}] = {} ids", b * t), &[ids.len()]));
        }
        if let Some(&bad) = ids.iter().find(|&&p| p as usize >= rope.max_t()) {
            return Err(Error::Positions { start: bad as usize, end: bad as usize + 1, max_t: rope.max_t() });
        }
        let standard = ids.chunks(t.max(1)).all(|row| row.iter().enumerate().all(|(i, &p)| p as usize == i));
        if standard {
            return Self::range(rope, 0, t);
        }
        let device = rope.device();
        let idx = Tensor::from_slice(ids, b * t, device)?;
        let (cos, sin) = rope.tables();
        let (cos, sin) = (cos.index_select(&idx, 0)?, sin.index_select(&idx, 0)?);
        let mut lo = vec![0u32; b * t];
        let mut hi = vec![0u32; b * t];
        let mut restarts = false;
        for row in 0..b {
            let r = row * t;
            for i in 0..t {
                let start = i == 0 || ids[r + i] == 0;
                restarts |= start && i > 0;
                lo[r + i] = if start { i as u32 } else { lo[r + i - 1] };
            }
            for i in (0..t).rev() {
                hi[r + i] = if i + 1 == t || lo[r + i + 1] == (i + 1) as u32 {
                    (i + 1) as u32
                } else {
                    hi[r + i + 1]
                };
            }
        }
        let docs = if restarts {
            Some(Arc::new(Docs {
                b,
                t,
                lo_dev: Tensor::from_slice(&lo, (b, t), device)?,
                hi_dev: Tensor::from_slice(&hi, (b, t), device)?,
                lo,
                masks: Mutex::new(Vec::new()),
            }))
        } else {
            None
        };
        Ok(Positions { cos, sin, docs })
    }

    /// Whether some sequence packs more than one document.
    pub fn has_docs(&self) -> bool {
        self.docs.is_some()
    }

    /// The RoPE rows: `[t, head_dim]` shared by every sequence, or `[b·t, head_dim]`.
    pub(crate) fn cos_sin(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    pub(crate) fn docs_arc(&self) -> Option<Arc<Docs>> {
        self.docs.clone()
    }

    /// The dtype of the RoPE rows.
    pub(crate) fn dtype(&self) -> DType {
        self.cos.dtype()
    }
}

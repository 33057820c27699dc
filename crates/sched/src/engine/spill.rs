//! Spilled checkpoints (`EngineOptions::spilled_checkpoints`): the page-locked host buffers
//! boundaries `0..k` go down to in the forward, the device buffers they come back up through
//! in the backward, and the three operations that move and free them (`Op::SpillCheckpoint`,
//! `Op::ReloadCheckpoint`, `Op::DropCheckpoint`).

use std::sync::{Arc, Mutex};

use mt_store::TransferBuf;

use super::{upload_dtype, Engine};
use crate::backend::{Backend, UploadHead};
use crate::batch::Chunk;
use crate::program::{BackwardInput, RELOAD_SLOTS};
use crate::{Error, Result};

impl<B: Backend> Engine<B> {
    /// Host buffers for every spilled boundary's chunks and the reload buffers, sized for this
    /// step's `chunks` (kept while the sizes stay); a fresh allocation is synchronised before a
    /// copy stream may touch it.
    pub(super) fn ensure_spill(&mut self, chunks: &[Chunk]) -> Result<()> {
        let k = self.opts.placement.spilled_checkpoints;
        if k == 0 {
            return Ok(());
        }
        let h = self.cfg.hidden_size;
        let sizes: Vec<usize> = chunks.iter().map(|c| c.ids.elem_count() * h).collect();
        let device = self.backend.device().clone();
        let fresh = self.pool.ensure_reload(RELOAD_SLOTS, &sizes, &device)?;
        let fits = |b: &Vec<Arc<Mutex<TransferBuf>>>| {
            b.iter().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len()).eq(sizes.iter().copied())
        };
        if self.spill_host.len() != k || !self.spill_host.iter().all(fits) {
            let dtype = upload_dtype(self.opts.weight_dtype)?;
            let pin = self.backend.pins_host_buffers();
            self.spill_host = (0..k)
                .map(|_| {
                    sizes
                        .iter()
                        .map(|&n| {
                            let mut s = TransferBuf::new(dtype, n);
                            if pin {
                                s.pin()?;
                            }
                            Ok(Arc::new(Mutex::new(s)))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<_>>()?;
        }
        if fresh {
            self.backend.synchronize()?;
        }
        Ok(())
    }

    /// D2H: every chunk's checkpoint of `boundary` into its host buffer; the last copy's event
    /// (the stream runs them in order).
    pub(super) fn issue_spill(&self, boundary: usize, waits: &[B::Event], name: &str) -> Result<B::Event> {
        let host = self.spill_host.get(boundary).ok_or_else(|| spill_bug(boundary))?;
        let mut last = None;
        for (c, dst) in host.iter().enumerate() {
            let src = self.pool.checkpoint(boundary, c)?.clone();
            let w = if c == 0 { waits.to_vec() } else { Vec::new() };
            last = Some(self.backend.download(&w, src, Arc::clone(dst), format!("{name} chunk {c}")));
        }
        last.ok_or_else(|| spill_bug(boundary))
    }

    /// H2D: a spilled boundary's host buffers into reload buffer `slot`.
    pub(super) fn issue_reload(
        &self,
        boundary: usize,
        slot: usize,
        waits: &[B::Event],
        name: &str,
    ) -> Result<B::Event> {
        let host = self.spill_host.get(boundary).ok_or_else(|| spill_bug(boundary))?;
        let bufs = self.pool.reload.get(slot).ok_or_else(|| spill_bug(boundary))?;
        let mut last = None;
        for (c, (src, dst)) in host.iter().zip(bufs).enumerate() {
            let w = if c == 0 { waits.to_vec() } else { Vec::new() };
            last = Some(self.backend.upload(
                &w,
                Arc::clone(src),
                dst.clone(),
                UploadHead::Staged,
                format!("{name} chunk {c}"),
            ));
        }
        last.ok_or_else(|| spill_bug(boundary))
    }

    /// The layer input `boundary`, chunk `chunk`, for a backward that recomputes from `input`:
    /// its reload buffer (shaped as the chunk's `[b, t, hidden]`), or the pool's checkpoint.
    pub(super) fn backward_input(
        &self,
        boundary: usize,
        chunk: usize,
        ch: &Chunk,
        input: BackwardInput,
    ) -> Result<candle_core::Tensor> {
        match input {
            BackwardInput::Reload(slot) => {
                let (b, t) = ch.ids.dims2()?;
                let buf = self
                    .pool
                    .reload
                    .get(slot)
                    .and_then(|s| s.get(chunk))
                    .ok_or_else(|| spill_bug(boundary))?;
                Ok(buf.reshape((b, t, self.cfg.hidden_size))?)
            }
            BackwardInput::Checkpoint => Ok(self.pool.checkpoint(boundary, chunk)?.clone()),
            BackwardInput::Kept => Err(Error::Schedule(format!(
                "layer {boundary}'s backward takes its kept activations, not its input"
            ))),
        }
    }
}

fn spill_bug(boundary: usize) -> Error {
    Error::Schedule(format!("checkpoint {boundary} has no spill buffer"))
}

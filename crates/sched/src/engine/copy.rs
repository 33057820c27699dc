//! The copy streams' operations: uploads of staged weights, of a GPU-updated layer's state and of
//! an early layer's moments, the state's download back into its record, checkpoint spills and
//! reloads, gradient downloads, issued as the step program says.

use std::sync::Arc;

use mt_core::Unit;

use super::Engine;
use crate::backend::{Backend, EncodedBase, UploadHead};
use crate::program::{Op, Slot};
use crate::{Error, Result};

impl<B: Backend> Engine<B> {
    /// Issues copy `op` (H2D or D2H) after `waits`; `applied` is the optimizer step a state
    /// download marks its record with.
    pub(super) fn issue_copy(&self, op: &Op, waits: &[B::Event], applied: u64) -> Result<B::Event> {
        let name = format!("{op:?}");
        Ok(match *op {
            Op::Upload { unit, staging, slot } => {
                let dst = match slot {
                    Slot::Ring(k) => self.ring_slot(k)?,
                    Slot::Outer => self.pool.outer_slot.clone(),
                    Slot::Held(l) => self.held_slot(l)?,
                    Slot::Resident(l) => {
                        return Err(Error::Schedule(format!("upload into resident layer {l}'s slot")))
                    }
                };
                // A slot that holds its frozen base already takes the adapters alone; a decoder
                // layer of an int8 or NF4 base goes up encoded (its staging says so too:
                // `host::stage_base`).
                let head = match (self.base_kept(unit), unit, &self.encoded_base, &self.pool.base_scratch) {
                    (Some(_), _, _, _) if !matches!(slot, Slot::Held(_) | Slot::Outer) => {
                        return Err(Error::Schedule(format!(
                            "{op:?}: {unit:?}'s base is kept in its own slot, not {slot:?}"
                        )))
                    }
                    (Some(n), ..) => UploadHead::Kept(n),
                    (None, Unit::Layer(_), Some(encoding), Some(scratch)) => {
                        UploadHead::Encoded(EncodedBase {
                            encoding: Arc::clone(encoding),
                            scratch: scratch.clone(),
                        })
                    }
                    _ => UploadHead::Staged,
                };
                self.backend.upload(waits, self.staging_of(staging)?, dst, head, name)
            }
            Op::UploadState { unit, buf } => {
                let (state, grad) = (self.state_slot(buf)?, self.state_grad_slot(buf)?);
                self.backend.upload_record(waits, Arc::clone(&self.store), unit, state, Some(grad), name)
            }
            Op::UploadMoments { unit, buf } => {
                let state = self.state_slot(buf)?;
                self.backend.upload_record(waits, Arc::clone(&self.store), unit, state, None, name)
            }
            Op::DownloadState { unit, buf } => {
                let state = self.state_slot(buf)?;
                self.backend.download_record(waits, state, Arc::clone(&self.store), unit, applied, name)
            }
            Op::SpillCheckpoint { boundary } => self.issue_spill(boundary, waits, &name)?,
            Op::ReloadCheckpoint { boundary, slot } => self.issue_reload(boundary, slot, waits, &name)?,
            Op::Download { grad_buf, landing, narrowed, .. } => {
                let src = match (grad_buf, narrowed) {
                    (Some(k), true) => self.pool.grad_narrow.get(k).cloned().ok_or_else(|| {
                        Error::Schedule(format!("{op:?}: gradient buffer {k} has no bf16 twin"))
                    })?,
                    (Some(k), false) => self.ring_grad(k)?,
                    (None, false) => self.pool.outer_grad.clone(),
                    (None, true) => {
                        return Err(Error::Schedule(format!("{op:?}: the outer gradient is never narrowed")))
                    }
                };
                self.backend.download(waits, src, self.landing_of(landing)?, name)
            }
            _ => return Err(Error::Schedule(format!("{op:?} is not a copy"))),
        })
    }
}

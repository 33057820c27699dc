//! [`HostStore`]'s header fields: the training state, the marks of a store not current (left by
//! an engine with device-owned state, or by a run killed mid-step) and the skipped-step count.

use super::{HostStore, StoreState};
use crate::header::{self, off};

impl HostStore {
    /// The training state recorded in the header.
    pub fn state(&self) -> StoreState {
        self.with_header(|p| StoreState {
            step: header::get_u64(p, off::STEP),
            pending_update: header::get_u64(p, off::PENDING) != 0,
            pending_grad_scale: f32::from_bits(header::get_u32(p, off::PENDING_GRAD_SCALE)),
            pending_lr: f64::from_bits(header::get_u64(p, off::PENDING_LR)),
            grad_norm: f64::from_bits(header::get_u64(p, off::GRAD_NORM)),
        })
    }

    /// Records the training state in the header.
    pub fn set_state(&self, s: StoreState) {
        self.with_header(|p| {
            header::put_u64(p, off::STEP, s.step);
            header::put_u64(p, off::PENDING, u64::from(s.pending_update));
            header::put_u32(p, off::PENDING_GRAD_SCALE, s.pending_grad_scale.to_bits());
            header::put_u64(p, off::PENDING_LR, s.pending_lr.to_bits());
            header::put_u64(p, off::GRAD_NORM, s.grad_norm.to_bits());
        })
    }

    /// Whether an engine has marked the store as not current: some units' newest state (weights,
    /// moments, a pending update's gradient) lives on its device until it writes them back. A
    /// store still marked when a new engine opens it was left by one that stopped without
    /// writing back (a crash); its records must not be trained on.
    pub fn device_owned(&self) -> bool {
        self.with_header(|p| header::get_u64(p, off::DEVICE_OWNED) != 0)
    }

    /// Sets or clears the mark of [`HostStore::device_owned`].
    pub fn set_device_owned(&self, owned: bool) {
        self.with_header(|p| header::put_u64(p, off::DEVICE_OWNED, u64::from(owned)))
    }

    /// Steps that applied no update because their loss or gradient was not finite (the engine
    /// skipped them): with [`StoreState::step`] (the updates applied) they make the run's global
    /// step. 0 in a store from before the count existed.
    pub fn skipped_steps(&self) -> u64 {
        self.with_header(|p| header::get_u64(p, off::SKIPPED))
    }

    /// Sets [`HostStore::skipped_steps`].
    pub fn set_skipped_steps(&self, n: u64) {
        self.with_header(|p| header::put_u64(p, off::SKIPPED, n))
    }

    /// Whether a run has this store open, from its start to its orderly end ([`HostStore::set_run_open`]):
    /// a file-backed store still marked when opened was left by a run killed mid-step, and may
    /// hold a half-applied update.
    pub fn run_open(&self) -> bool {
        self.with_header(|p| header::get_u64(p, off::RUN_OPEN) != 0)
    }

    /// Sets or clears the mark of [`HostStore::run_open`].
    pub fn set_run_open(&self, open: bool) {
        self.with_header(|p| header::put_u64(p, off::RUN_OPEN, u64::from(open)))
    }
}

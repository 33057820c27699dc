//! The store's header page: identity (magic, version, layout fingerprint, gradient dtype, the
//! moments' encoding) and the
//! small mutable training state that must travel with the records (optimizer step, pending update).

use mt_core::ModelLayout;

pub(crate) const MAGIC: &[u8; 8] = b"MTSTORE1";
pub(crate) const VERSION: u32 = 1;

/// FNV-1a over every unit's tensor names, shapes and offsets: two stores with the same
/// fingerprint have byte-compatible records.
pub(crate) fn fingerprint(layout: &ModelLayout) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&(layout.n_layers as u64).to_le_bytes());
    for unit in [&layout.outer, &layout.layer] {
        eat(&(unit.len as u64).to_le_bytes());
        for t in &unit.tensors {
            eat(t.name.as_bytes());
            for d in &t.shape {
                eat(&(*d as u64).to_le_bytes());
            }
            eat(&(t.offset as u64).to_le_bytes());
        }
    }
    h
}

/// Byte offsets of the header fields.
pub(crate) mod off {
    pub(crate) const MAGIC: usize = 0;
    pub(crate) const VERSION: usize = 8;
    pub(crate) const GRAD_DTYPE: usize = 12;
    pub(crate) const FINGERPRINT: usize = 16;
    pub(crate) const TOTAL_LEN: usize = 24;
    pub(crate) const STEP: usize = 32;
    pub(crate) const PENDING: usize = 40;
    pub(crate) const PENDING_GRAD_SCALE: usize = 48;
    pub(crate) const GRAD_NORM: usize = 56;
    pub(crate) const PENDING_LR: usize = 64;
    /// Non-zero while an engine holds units whose newest state is on its device only.
    pub(crate) const DEVICE_OWNED: usize = 72;
    /// The moments' encoding (`mt_core::StateDtype::code`; 0, in stores written before it was
    /// recorded, reads as fp32).
    pub(crate) const STATE_DTYPE: usize = 80;
    /// Steps that applied no update (a non-finite loss or gradient): the run's global step is
    /// `STEP + SKIPPED` (+1 while an update is pending). Apart from the optimizer's fields.
    pub(crate) const SKIPPED: usize = 128;
    /// Non-zero from a run's start until its orderly end: a file-backed store still marked when
    /// it is opened was left by a run that was killed mid-step.
    pub(crate) const RUN_OPEN: usize = 136;
}

pub(crate) fn put_u64(page: &mut [u8], at: usize, v: u64) {
    page[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn get_u64(page: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&page[at..at + 8]);
    u64::from_le_bytes(b)
}

pub(crate) fn put_u32(page: &mut [u8], at: usize, v: u32) {
    page[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn get_u32(page: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&page[at..at + 4]);
    u32::from_le_bytes(b)
}

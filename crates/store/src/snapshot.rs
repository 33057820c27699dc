//! Checkpoint snapshots: a copy of the store's training state written to a new file while no
//! step runs, and read back into a live store on resume.
//!
//! A snapshot is a file in the file-backed store format (so [`HostStore::open`] reads it too)
//! holding the header page and, per record, the meta page and the master, m and v regions. The
//! gradient regions are left as holes (sparse, no disk blocks): a snapshot is only taken with no
//! update pending, when the gradient buffer holds nothing the next step needs. That makes a
//! checkpoint `4 + 2·s` bytes per parameter on disk whatever the gradient dtype: 12 with fp32
//! moments, 8 with bf16, 6 with 8-bit (`--optim-states`; the header records it, and a store
//! keeping another encoding refuses the snapshot).
//!
//! Crash consistency: the file is written as `PATH.tmp`, synced, and renamed to `PATH`; a reader
//! never sees a half-written snapshot under the final name. Writing the manifest that points at
//! it (and syncing the directory) is the caller's job.
//!
//! Integrity: the BLAKE3 hash of the file's bytes (the holes and padding as the zeros a reader
//! sees) is computed from what is written, in file order, as it is written, and returned; the
//! caller records it so that a later read of the file can be checked against it.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use mt_core::{Error, Result, StateDtype, Unit};

use crate::arena::HostStore;
use crate::header::{self, off};
use crate::{GradDtype, StoreState, PAGE};

/// What [`HostStore::write_snapshot`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotWritten {
    /// Bytes of data written (the header page and the master and moment regions).
    pub bytes: u64,
    /// The file's length (holes included).
    pub len: u64,
    /// BLAKE3 of the file's bytes.
    pub blake3: blake3::Hash,
}

impl HostStore {
    /// Writes a snapshot of the whole training state to `path` (see the module docs) and
    /// returns what it wrote, with the file's hash. Refuses while an update is pending (apply it
    /// first: the engine's `flush_pending`) and refuses to overwrite an existing `path`.
    pub fn write_snapshot(&self, path: &Path) -> Result<SnapshotWritten> {
        let io = |p: &Path| {
            let p = p.to_owned();
            move |source| Error::Io { path: p, source }
        };
        let state = self.state();
        if state.pending_update {
            return Err(Error::Store {
                path: path.to_owned(),
                msg: "cannot snapshot with an optimizer update pending; apply it first".into(),
            });
        }
        if path.exists() {
            return Err(Error::Store { path: path.to_owned(), msg: "snapshot file already exists".into() });
        }
        let tmp = tmp_path(path);
        let file = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp).map_err(io(&tmp))?;
        let result = (|| {
            file.set_len(self.total_len as u64).map_err(io(&tmp))?;
            let mut hash = FileHasher::default();
            let mut page = vec![0u8; PAGE];
            self.with_header(|h| page.copy_from_slice(h));
            // A snapshot is no run's live state.
            header::put_u64(&mut page, off::RUN_OPEN, 0);
            file.write_all_at(&page, 0).map_err(io(&tmp))?;
            hash.bytes(0, &page);
            let mut written = PAGE as u64;
            for (i, loc) in self.records.iter().enumerate() {
                let r = self.record(self.unit_at(i));
                let mut meta = [0u8; 8];
                meta.copy_from_slice(&r.applied_step().to_le_bytes());
                file.write_all_at(&meta, loc.base as u64).map_err(io(&tmp))?;
                hash.bytes(loc.base as u64, &meta);
                let n = r.master().len();
                let regions: [(&[u8], usize, StateDtype); 3] = [
                    (bytemuck::cast_slice(r.master()), loc.master_off(), StateDtype::F32),
                    (r.m(), loc.m_off(), self.state_dtype()),
                    (r.v(), loc.v_off(), self.state_dtype()),
                ];
                for (k, (region, off, dtype)) in regions.into_iter().enumerate() {
                    // Never a checkpoint of a poisoned state (the engine skips non-finite steps, so
                    // this is a last line of defence: one more read of data on its way to disk).
                    if let Some((at, x)) = dtype.first_non_finite(n, region) {
                        return Err(Error::Store {
                            path: path.to_owned(),
                            msg: format!(
                                "{:?}'s {} holds {x} at element {at}: no checkpoint is written from a \
                                 non-finite state",
                                self.unit_at(i),
                                ["master weights", "first moment", "second moment"][k],
                            ),
                        });
                    }
                    file.write_all_at(region, (loc.base + off) as u64).map_err(io(&tmp))?;
                    hash.bytes((loc.base + off) as u64, region);
                    written += region.len() as u64;
                }
                drop(r);
                if self.is_paging() {
                    // A paged store runs in a bounded amount of RAM: the snapshot's dirty pages
                    // go to disk a record behind the one being written, and leave the cache.
                    let range =
                        |l: &super::arena::RecordLoc| (l.base as u64, l.bytes(self.grad_dtype()) as u64);
                    let (off, len) = range(loc);
                    crate::pager::write_out(&file, off, len, false).map_err(io(&tmp))?;
                    if let Some(prev) = i.checked_sub(1).map(|p| range(&self.records[p])) {
                        crate::pager::write_out(&file, prev.0, prev.1, true).map_err(io(&tmp))?;
                    }
                }
            }
            file.sync_all().map_err(io(&tmp))?;
            let len = self.total_len as u64;
            Ok(SnapshotWritten { bytes: written, len, blake3: hash.finish(len) })
        })();
        drop(file);
        match result {
            Ok(n) => {
                fs::rename(&tmp, path).map_err(io(path))?;
                Ok(n)
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Replaces this store's training state with the snapshot at `path` (written by
    /// [`HostStore::write_snapshot`] for the same model layout, gradient dtype and moments'
    /// encoding) and returns the restored header state. The gradient buffer is zeroed. Nothing is
    /// changed if the snapshot is refused (wrong model, gradient dtype or optimizer states,
    /// truncated, pending update); a read error part-way leaves the store partly overwritten, so
    /// the caller must then discard it.
    pub fn restore_snapshot(&self, path: &Path) -> Result<StoreState> {
        let io = |source| Error::Io { path: path.to_owned(), source };
        let bad = |msg: String| Error::Store { path: path.to_owned(), msg };
        let file = File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut page = vec![0u8; PAGE];
        if size < PAGE as u64 {
            return Err(bad(format!("file is {size} bytes, smaller than the header page; not a snapshot")));
        }
        file.read_exact_at(&mut page, 0).map_err(io)?;
        if &page[off::MAGIC..off::MAGIC + 8] != header::MAGIC {
            return Err(bad("bad magic; not a megatrain store snapshot".into()));
        }
        if header::get_u32(&page, off::VERSION) != header::VERSION {
            return Err(bad(format!(
                "store format version {}, this build reads {}",
                header::get_u32(&page, off::VERSION),
                header::VERSION
            )));
        }
        if header::get_u64(&page, off::FINGERPRINT) != header::fingerprint(self.layout()) {
            return Err(bad("written for a different model layout (config mismatch)".into()));
        }
        let grad = GradDtype::from_code(header::get_u32(&page, off::GRAD_DTYPE));
        if grad != Some(self.grad_dtype()) {
            return Err(bad(format!(
                "gradient dtype {grad:?} differs from this store's {:?}; resume with the same --grad-dtype",
                self.grad_dtype()
            )));
        }
        let states = StateDtype::from_code(header::get_u32(&page, off::STATE_DTYPE));
        if states != Some(self.state_dtype()) {
            let theirs = states.map_or("an unknown encoding of".to_owned(), |s| s.name().to_owned());
            return Err(bad(format!(
                "the snapshot keeps {theirs} optimizer states and this run {} ones; resume with --optim-states {theirs}",
                self.state_dtype()
            )));
        }
        if size != self.total_len as u64 || header::get_u64(&page, off::TOTAL_LEN) != self.total_len as u64 {
            return Err(bad(format!(
                "file is {size} bytes, the layout needs {} (truncated?)",
                self.total_len
            )));
        }
        if header::get_u64(&page, off::PENDING) != 0 {
            return Err(bad("snapshot has an update pending; it was not written by write_snapshot".into()));
        }
        for (i, loc) in self.records.iter().enumerate() {
            let mut r = self.record(self.unit_at(i));
            let mut meta = [0u8; 8];
            file.read_exact_at(&mut meta, loc.base as u64).map_err(io)?;
            let p = r.parts();
            let regions: [(&mut [u8], usize); 3] = [
                (bytemuck::cast_slice_mut(p.master), loc.master_off()),
                (p.m, loc.m_off()),
                (p.v, loc.v_off()),
            ];
            for (region, off) in regions {
                file.read_exact_at(region, (loc.base + off) as u64).map_err(io)?;
            }
            match r.grad_mut() {
                Some(crate::GradMut::F32(g)) => g.fill(0.0),
                Some(crate::GradMut::Bf16(g)) => g.fill(half::bf16::ZERO),
                None => {}
            }
            r.set_applied_step(u64::from_le_bytes(meta));
            if self.is_paging() {
                // The snapshot's pages, read once, need not stay cached in a bounded run.
                crate::pager::drop_cached(&file, loc.base as u64, loc.bytes(self.grad_dtype()) as u64);
            }
        }
        let state = StoreState {
            step: header::get_u64(&page, off::STEP),
            pending_update: false,
            pending_grad_scale: f32::from_bits(header::get_u32(&page, off::PENDING_GRAD_SCALE)),
            pending_lr: f64::from_bits(header::get_u64(&page, off::PENDING_LR)),
            grad_norm: f64::from_bits(header::get_u64(&page, off::GRAD_NORM)),
        };
        self.set_state(state);
        self.set_skipped_steps(header::get_u64(&page, off::SKIPPED));
        Ok(state)
    }

    fn unit_at(&self, i: usize) -> Unit {
        self.layout().units().nth(i).expect("record index within the layout's units")
    }
}

/// The BLAKE3 hash of a file from the bytes written into it in increasing offsets: the gaps
/// between them (holes, padding) are hashed as the zeros a reader of the file sees.
#[derive(Default)]
struct FileHasher {
    hasher: blake3::Hasher,
    at: u64,
}

/// Zeros for the gaps (1 MiB: large enough for the multi-threaded update to pay off).
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

impl FileHasher {
    fn update(&mut self, bytes: &[u8]) {
        // Below ~128 KiB the thread pool costs more than it saves (BLAKE3's documentation).
        if bytes.len() >= 1 << 17 {
            self.hasher.update_rayon(bytes);
        } else {
            self.hasher.update(bytes);
        }
        self.at += bytes.len() as u64;
    }

    fn zeros_to(&mut self, to: u64) {
        while self.at < to {
            let n = (to - self.at).min(ZEROS.len() as u64) as usize;
            self.update(&ZEROS[..n]);
        }
    }

    /// `bytes` written at offset `at`, at or after everything before.
    fn bytes(&mut self, at: u64, bytes: &[u8]) {
        assert!(at >= self.at, "snapshot regions are written in file order ({at} after {})", self.at);
        self.zeros_to(at);
        self.update(bytes);
    }

    /// The hash of the whole file of `len` bytes.
    fn finish(mut self, len: u64) -> blake3::Hash {
        self.zeros_to(len);
        self.hasher.finalize()
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

//! The CPU backend: the compute stream is the calling thread; the host, H2D and D2H streams are
//! worker threads ([`crate::worker`]) that run their jobs in order, each after its events.
//!
//! The same backend also runs over candle's CUDA device ([`CpuBackend::on_device`], `cuda`
//! feature): every copy is then a blocking candle copy issued from a worker thread, so results
//! are correct but nothing overlaps. It is kept as the simple oracle for the overlapped
//! [`crate::cuda::CudaBackend`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use mt_core::Unit;
use mt_store::{decode_unit, Decoded, GradRef, HostStore, TransferBuf};

use crate::backend::{Backend, EncodedBase, HostJob, Span, UploadHead};
use crate::program::Stream;
use crate::worker::Workers;
pub use crate::worker::{CpuEvent, CpuOptions};
use crate::{Error, Result};

/// CPU implementation of [`Backend`].
pub struct CpuBackend {
    device: Device,
    workers: Workers,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend").finish_non_exhaustive()
    }
}

impl CpuBackend {
    /// Starts the worker threads; tensors live on the CPU.
    pub fn new(opts: CpuOptions) -> Self {
        Self::on_device(Device::Cpu, opts)
    }

    /// Starts the worker threads; tensors (slots, gradient buffers, checkpoints) live on `device`.
    pub fn on_device(device: Device, opts: CpuOptions) -> Self {
        CpuBackend { device, workers: Workers::start(opts, &[Stream::Host, Stream::H2D, Stream::D2H]) }
    }
}

/// The head of `staging` that is an encoded frozen base (`b`) through the scratch buffer, as on
/// the GPU, dequantised into `dst`'s first elements by the reference decoding; returns the bytes
/// copied.
fn upload_encoded_base(
    staging: &TransferBuf,
    b: &EncodedBase,
    dst: &Tensor,
    device: &Device,
) -> Result<usize> {
    let (bytes, n) = (b.encoding.bytes, b.encoding.elems());
    b.scratch.slice_set(&Tensor::from_slice(&staging.as_bytes()[..bytes], bytes, device)?, 0, 0)?;
    let encoded = b.scratch.narrow(0, 0, bytes)?.to_vec1::<u8>()?;
    let t = match dst.dtype() {
        DType::BF16 => {
            let mut v = vec![half::bf16::ZERO; n];
            decode_unit(&b.encoding, &encoded, Decoded::Bf16(&mut v));
            Tensor::from_vec(v, n, device)?
        }
        DType::F32 => {
            let mut v = vec![0f32; n];
            decode_unit(&b.encoding, &encoded, Decoded::F32(&mut v));
            Tensor::from_vec(v, n, device)?
        }
        other => {
            return Err(Error::Stream {
                stream: "h2d",
                msg: format!("an encoded base into a {other:?} slot"),
            })
        }
    };
    dst.slice_set(&t, 0, 0)?;
    Ok(bytes)
}

impl Backend for CpuBackend {
    type Event = CpuEvent;

    fn device(&self) -> &Device {
        &self.device
    }

    fn upload(
        &self,
        waits: &[CpuEvent],
        src: Arc<Mutex<TransferBuf>>,
        dst: Tensor,
        head: UploadHead,
        name: String,
    ) -> CpuEvent {
        let device = self.device.clone();
        let clock = Arc::clone(&self.workers.clock);
        let job: HostJob = Box::new(move || {
            let staging = src.lock().unwrap_or_else(|p| p.into_inner());
            // An encoded base's elements come from its dequantisation, a kept one's stay as they
            // are; the rest as staged.
            let (at, mut bytes) = match &head {
                UploadHead::Staged => (0, 0),
                UploadHead::Encoded(b) => {
                    (b.encoding.elems(), upload_encoded_base(&staging, b, &dst, &device)?)
                }
                UploadHead::Kept(n) => (*n, 0),
            };
            if at > staging.len() {
                return Err(Error::Stream {
                    stream: "h2d",
                    msg: format!("an upload from element {at} of a {}-element staging buffer", staging.len()),
                });
            }
            let t = match &*staging {
                TransferBuf::F32(v) => Tensor::from_slice(&v[at..], v.len() - at, &device)?,
                TransferBuf::Bf16(v) => Tensor::from_slice(&v[at..], v.len() - at, &device)?,
                TransferBuf::F16(v) => Tensor::from_slice(&v[at..], v.len() - at, &device)?,
            };
            if t.elem_count() > 0 {
                dst.slice_set(&t, 0, at)?;
            }
            bytes += t.elem_count() * t.dtype().size_in_bytes();
            clock.h2d_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            Ok(())
        });
        self.workers.submit(Stream::H2D, waits.to_vec(), job, name)
    }

    fn download(
        &self,
        waits: &[CpuEvent],
        src: Tensor,
        dst: Arc<Mutex<TransferBuf>>,
        name: String,
    ) -> CpuEvent {
        let clock = Arc::clone(&self.workers.clock);
        let job: HostJob = Box::new(move || {
            let mut d = dst.lock().unwrap_or_else(|p| p.into_inner());
            let flat = src.flatten_all()?;
            let v: Vec<u8> = match src.dtype() {
                DType::F32 => bytemuck::cast_slice(&flat.to_vec1::<f32>()?).to_vec(),
                DType::BF16 => bytemuck::cast_slice(&flat.to_vec1::<half::bf16>()?).to_vec(),
                other => {
                    return Err(Error::Stream {
                        stream: "d2h",
                        msg: format!("download of a {other:?} buffer"),
                    })
                }
            };
            let dst = d.as_bytes_mut();
            if dst.len() != v.len() {
                return Err(Error::Stream {
                    stream: "d2h",
                    msg: format!("{}-byte device buffer into a {}-byte landing buffer", v.len(), dst.len()),
                });
            }
            dst.copy_from_slice(&v);
            let n = src.elem_count();
            clock.d2h_bytes.fetch_add((n * src.dtype().size_in_bytes()) as u64, Ordering::Relaxed);
            Ok(())
        });
        self.workers.submit(Stream::D2H, waits.to_vec(), job, name)
    }

    fn upload_record(
        &self,
        waits: &[CpuEvent],
        store: Arc<HostStore>,
        unit: Unit,
        state: Tensor,
        grad: Option<Tensor>,
        name: String,
    ) -> CpuEvent {
        let clock = Arc::clone(&self.workers.clock);
        let job: HostJob = Box::new(move || {
            let r = store.record(unit);
            let n = r.master().len();
            let device = state.device().clone();
            let grad_len = grad.as_ref().map_or(n, Tensor::elem_count);
            let words = r.states().state_words(n);
            if state.elem_count() != words || grad_len != n {
                return Err(Error::Stream {
                    stream: "h2d",
                    msg: format!(
                        "state slot of {} words and gradient of {grad_len} elements for a {n}-element record ({words} words of master and {} moments)",
                        state.elem_count(),
                        r.states(),
                    ),
                });
            }
            let mut at = 0;
            for part in crate::engine::state_words(&r) {
                state.slice_set(&Tensor::from_slice(part, part.len(), &device)?, 0, at)?;
                at += part.len();
            }
            let state_bytes = 4 * words as u64;
            let Some(grad) = grad else {
                // Master and moments only (an early upload: the gradient is copied on the device).
                clock.h2d_bytes.fetch_add(state_bytes, Ordering::Relaxed);
                return Ok(());
            };
            let g = match r.grad() {
                Some(GradRef::F32(g)) => Tensor::from_slice(g, n, &device)?,
                Some(GradRef::Bf16(g)) => Tensor::from_slice(g, n, &device)?,
                None => {
                    return Err(Error::Stream {
                        stream: "h2d",
                        msg: "a state upload needs a store with gradients".into(),
                    })
                }
            };
            grad.slice_set(&g, 0, 0)?;
            let bytes = state_bytes + (n * g.dtype().size_in_bytes()) as u64;
            clock.h2d_bytes.fetch_add(bytes, Ordering::Relaxed);
            Ok(())
        });
        self.workers.submit(Stream::H2D, waits.to_vec(), job, name)
    }

    fn download_record(
        &self,
        waits: &[CpuEvent],
        state: Tensor,
        store: Arc<HostStore>,
        unit: Unit,
        applied: u64,
        name: String,
    ) -> CpuEvent {
        let clock = Arc::clone(&self.workers.clock);
        let job: HostJob = Box::new(move || {
            let v = state.flatten_all()?.to_vec1::<f32>()?;
            let mut r = store.record(unit);
            let n = r.master().len();
            let words = r.states().state_words(n);
            if v.len() != words {
                return Err(Error::Stream {
                    stream: "d2h",
                    msg: format!(
                        "a {}-word state slot into a {n}-element record ({words} words with {} moments)",
                        v.len(),
                        r.states()
                    ),
                });
            }
            let p = r.parts();
            let mut at = 0;
            for dst in [p.master, bytemuck::cast_slice_mut(p.m), bytemuck::cast_slice_mut(p.v)] {
                dst.copy_from_slice(&v[at..at + dst.len()]);
                at += dst.len();
            }
            r.set_applied_step(applied);
            clock.d2h_bytes.fetch_add(4 * words as u64, Ordering::Relaxed);
            Ok(())
        });
        self.workers.submit(Stream::D2H, waits.to_vec(), job, name)
    }

    fn host(&self, waits: &[CpuEvent], job: HostJob, name: String) -> CpuEvent {
        self.workers.submit(Stream::Host, waits.to_vec(), job, name)
    }

    fn compute_wait(&self, waits: &[CpuEvent]) -> Result<()> {
        for w in waits {
            w.wait().map_err(|msg| Error::Stream { stream: "compute (waiting)", msg })?;
        }
        Ok(())
    }

    fn compute_record(&self, name: String, start_s: f64) -> CpuEvent {
        self.workers.clock.record(Stream::Compute, name, start_s);
        CpuEvent::completed()
    }

    fn synchronize(&self) -> Result<()> {
        self.workers.drain()
    }

    fn begin_step(&self) {
        self.workers.clock.begin_step();
    }

    fn now_s(&self) -> f64 {
        self.workers.clock.now()
    }

    fn transferred(&self) -> (u64, u64) {
        self.workers.clock.transferred()
    }

    fn spans(&self) -> Vec<Span> {
        self.workers.clock.spans()
    }
}

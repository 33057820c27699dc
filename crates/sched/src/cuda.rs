//! The overlapped CUDA backend: compute runs on candle's CUDA stream; weights go up on a dedicated
//! H2D stream and gradients come down on a dedicated D2H stream, both as asynchronous DMA between
//! device buffers and page-locked host rings; the CPU optimizer runs on a host worker thread.
//!
//! Events: an operation's [`CudaOpEvent`] is a CPU-side flag plus, for GPU operations, a CUDA
//! event. For a GPU operation the flag means "enqueued and its CUDA event recorded": a GPU
//! consumer then waits on the stream (`cuStreamWaitEvent`, no CPU blocking), a host consumer
//! blocks on the CUDA event. Copies are issued from two worker threads so that a copy waiting for
//! the host optimizer never holds up the thread that enqueues compute.
//!
//! Timing: every GPU operation is bracketed by two timing events, read back after the step
//! relative to an event recorded on the compute stream when the step begins, so per-stream busy
//! time and gaps are GPU time, not issue time. Host spans are wall-clock from the same origin.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::CudaDevice;
use candle_core::{Device, Tensor};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use mt_core::Unit;
use mt_store::{HostStore, TransferBuf};

use crate::backend::{Backend, DevicePeak, HostJob, Span, UploadHead};
use crate::cuda_ffi;
use crate::program::Stream;
use crate::worker::{CpuEvent, CpuOptions, Workers};
use crate::{Error, Result};

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// Completion marker of an operation of the CUDA backend.
#[derive(Debug, Clone)]
pub struct CudaOpEvent {
    /// Host operations: completed. GPU operations: enqueued, with `gpu` recorded.
    done: CpuEvent,
    /// The CUDA event that completes with a GPU operation.
    gpu: Option<Arc<CudaEvent>>,
}

impl CudaOpEvent {
    fn wait_issued(&self, who: &'static str) -> Result<()> {
        self.done.wait().map_err(|msg| Error::Stream { stream: who, msg })
    }
}

struct GpuSpan {
    stream: Stream,
    name: String,
    start: Arc<CudaEvent>,
    end: Arc<CudaEvent>,
}

/// CUDA implementation of [`Backend`].
pub struct CudaBackend {
    device: Device,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    d2h: Arc<CudaStream>,
    workers: Workers,
    step_origin: Mutex<Option<Arc<CudaEvent>>>,
    compute_start: Mutex<Option<Arc<CudaEvent>>>,
    gpu_spans: Arc<Mutex<Vec<GpuSpan>>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("ordinal", &self.ctx.ordinal()).finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Opens GPU `ordinal` with a fresh compute stream and two copy streams. `opts` adds random
    /// delays to the worker threads (tests).
    pub fn new(ordinal: usize, opts: CpuOptions) -> Result<Self> {
        let dev = CudaDevice::new_with_stream(ordinal)?;
        cuda_ffi::disable_event_tracking(&dev);
        let compute = dev.cuda_stream();
        let ctx = Arc::clone(compute.context());
        ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        cuda_ffi::keep_freed_memory(&ctx)?;
        let h2d = ctx.new_stream().map_err(cuda_err("creating the H2D stream"))?;
        let d2h = ctx.new_stream().map_err(cuda_err("creating the D2H stream"))?;
        Ok(CudaBackend {
            device: Device::Cuda(dev),
            ctx,
            compute,
            h2d,
            d2h,
            workers: Workers::start(opts, &[]),
            step_origin: Mutex::new(None),
            compute_start: Mutex::new(None),
            gpu_spans: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The compute stream (candle's), where NCCL collectives of a data-parallel rank go.
    pub fn compute_stream(&self) -> Arc<CudaStream> {
        Arc::clone(&self.compute)
    }

    /// Number of CUDA devices this process sees.
    pub fn device_count() -> Result<usize> {
        let n = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Device name and total memory.
    pub fn describe(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let mem = self.ctx.total_mem().unwrap_or(0);
        format!("{name} ({:.1} GiB)", mem as f64 / (1u64 << 30) as f64)
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(cuda_err("cuMemGetInfo"))
    }

    fn timing_event(&self) -> Result<Arc<CudaEvent>> {
        let ev = self
            .ctx
            // Blocking sync: a host thread waiting on it sleeps instead of spinning a core the
            // CPU optimizer needs.
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(cuda_err("creating an event"))?;
        Ok(Arc::new(ev))
    }

    /// Splits `waits` into CPU flags to wait for before issuing, and CUDA events.
    fn split(waits: &[CudaOpEvent]) -> (Vec<CpuEvent>, Vec<Arc<CudaEvent>>) {
        (waits.iter().map(|w| w.done.clone()).collect(), waits.iter().filter_map(|w| w.gpu.clone()).collect())
    }

    /// Runs `copy` on `stream`'s issuing worker after `waits`, bracketed by timing events.
    fn issue_copy(
        &self,
        which: Stream,
        waits: &[CudaOpEvent],
        name: String,
        copy: impl FnOnce(&CudaStream) -> Result<u64> + Send + 'static,
    ) -> CudaOpEvent {
        let events = self.timing_event().and_then(|s| Ok((s, self.timing_event()?)));
        let (start, end) = match events {
            Ok(x) => x,
            Err(e) => {
                let done = CpuEvent::default();
                done.signal(Err(e.to_string()));
                return CudaOpEvent { done, gpu: None };
            }
        };
        let (cpu_waits, gpu_waits) = Self::split(waits);
        let stream = Arc::clone(if which == Stream::H2D { &self.h2d } else { &self.d2h });
        let (ctx, clock, spans) =
            (Arc::clone(&self.ctx), Arc::clone(&self.workers.clock), Arc::clone(&self.gpu_spans));
        let (s2, e2, span_name) = (Arc::clone(&start), Arc::clone(&end), name.clone());
        let job: HostJob = Box::new(move || {
            ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
            for g in &gpu_waits {
                stream.wait(g).map_err(cuda_err("cuStreamWaitEvent"))?;
            }
            s2.record(&stream).map_err(cuda_err("recording an event"))?;
            let bytes = copy(&stream)?;
            e2.record(&stream).map_err(cuda_err("recording an event"))?;
            let counter = if which == Stream::H2D { &clock.h2d_bytes } else { &clock.d2h_bytes };
            counter.fetch_add(bytes, Ordering::Relaxed);
            spans.lock().unwrap_or_else(|p| p.into_inner()).push(GpuSpan {
                stream: which,
                name: span_name,
                start: s2,
                end: e2,
            });
            Ok(())
        });
        let done = self.workers.submit(which, cpu_waits, job, name);
        CudaOpEvent { done, gpu: Some(end) }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Nothing in flight may outlive the buffers it reads or writes.
        let _ = self.workers.drain();
        let _ = self.compute.synchronize();
        let _ = self.h2d.synchronize();
        let _ = self.d2h.synchronize();
    }
}

impl Backend for CudaBackend {
    type Event = CudaOpEvent;

    fn device(&self) -> &Device {
        &self.device
    }

    fn pins_host_buffers(&self) -> bool {
        true
    }

    fn upload(
        &self,
        waits: &[CudaOpEvent],
        src: Arc<Mutex<TransferBuf>>,
        dst: Tensor,
        head: UploadHead,
        name: String,
    ) -> CudaOpEvent {
        self.issue_copy(Stream::H2D, waits, name, move |stream| {
            let staging = src.lock().unwrap_or_else(|p| p.into_inner());
            match &head {
                UploadHead::Staged => cuda_ffi::enqueue_upload(&staging, &dst, 0, stream),
                UploadHead::Kept(n) => cuda_ffi::enqueue_upload(&staging, &dst, *n, stream),
                // The dequantisation runs on this stream too, so the upload's event covers it.
                UploadHead::Encoded(b) => cuda_ffi::enqueue_encoded_upload(&staging, &dst, b, stream),
            }
        })
    }

    fn download(
        &self,
        waits: &[CudaOpEvent],
        src: Tensor,
        dst: Arc<Mutex<TransferBuf>>,
        name: String,
    ) -> CudaOpEvent {
        self.issue_copy(Stream::D2H, waits, name, move |stream| {
            cuda_ffi::enqueue_download(&src, &dst, stream)
        })
    }

    fn upload_record(
        &self,
        waits: &[CudaOpEvent],
        store: Arc<HostStore>,
        unit: Unit,
        state: Tensor,
        grad: Option<Tensor>,
        name: String,
    ) -> CudaOpEvent {
        self.issue_copy(Stream::H2D, waits, name, move |stream| {
            cuda_ffi::enqueue_record_upload(&store, unit, &state, grad.as_ref(), stream)
        })
    }

    fn download_record(
        &self,
        waits: &[CudaOpEvent],
        state: Tensor,
        store: Arc<HostStore>,
        unit: Unit,
        applied: u64,
        name: String,
    ) -> CudaOpEvent {
        // A blocking-sync event: the D2H worker sleeps until the state is in the record (rather
        // than spinning a core the host optimizer needs), then marks the record updated.
        let arrived = self.timing_event();
        self.issue_copy(Stream::D2H, waits, name, move |stream| {
            let copied = arrived.and_then(|arrived| {
                let bytes = cuda_ffi::enqueue_record_download(&state, &store, unit, stream)?;
                arrived.record(stream).map_err(cuda_err("recording an event"))?;
                arrived.synchronize().map_err(cuda_err("waiting for a state download"))?;
                Ok(bytes)
            });
            match copied {
                Ok(bytes) => {
                    store.set_applied_step(unit, applied);
                    Ok(bytes)
                }
                Err(e) => {
                    // Part of the state may have reached the record, which is not marked: a
                    // retry or flush would apply the update to it again. Nothing may.
                    store.poison(format!(
                        "the state download of {unit:?} failed part-way ({e}): its host record may mix old and new values"
                    ));
                    Err(e)
                }
            }
        })
    }

    fn host(&self, waits: &[CudaOpEvent], job: HostJob, name: String) -> CudaOpEvent {
        let (cpu_waits, gpu_waits) = Self::split(waits);
        let (ctx, clock, span_name) = (Arc::clone(&self.ctx), Arc::clone(&self.workers.clock), name.clone());
        let wrapped: HostJob = Box::new(move || {
            if !gpu_waits.is_empty() {
                ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
                for g in &gpu_waits {
                    g.synchronize().map_err(cuda_err("cuEventSynchronize"))?;
                }
            }
            let t0 = clock.now();
            let r = job();
            clock.record(Stream::Host, span_name, t0);
            r
        });
        CudaOpEvent { done: self.workers.submit(Stream::Host, cpu_waits, wrapped, name), gpu: None }
    }

    fn compute_wait(&self, waits: &[CudaOpEvent]) -> Result<()> {
        for w in waits {
            w.wait_issued("compute (waiting)")?;
            if let Some(g) = &w.gpu {
                self.compute.wait(g).map_err(cuda_err("cuStreamWaitEvent"))?;
            }
        }
        Ok(())
    }

    fn compute_begin(&self) {
        let ev = self.timing_event().and_then(|e| {
            e.record(&self.compute).map_err(cuda_err("recording an event"))?;
            Ok(e)
        });
        *self.compute_start.lock().unwrap_or_else(|p| p.into_inner()) = ev.ok();
    }

    fn compute_record(&self, name: String, _start_s: f64) -> CudaOpEvent {
        let done = CpuEvent::default();
        let end = self.timing_event().and_then(|e| {
            e.record(&self.compute).map_err(cuda_err("recording an event"))?;
            Ok(e)
        });
        match end {
            Ok(end) => {
                if let Some(start) = self.compute_start.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    self.gpu_spans.lock().unwrap_or_else(|p| p.into_inner()).push(GpuSpan {
                        stream: Stream::Compute,
                        name,
                        start,
                        end: Arc::clone(&end),
                    });
                }
                done.signal(Ok(()));
                CudaOpEvent { done, gpu: Some(end) }
            }
            Err(e) => {
                done.signal(Err(e.to_string()));
                CudaOpEvent { done, gpu: None }
            }
        }
    }

    fn synchronize(&self) -> Result<()> {
        // Binds the context to the calling thread too (the engine's Drop relies on it).
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        let workers = self.workers.drain();
        let streams = [("compute", &self.compute), ("h2d", &self.h2d), ("d2h", &self.d2h)]
            .into_iter()
            .map(|(n, s)| s.synchronize().map_err(|e| Error::Stream { stream: n, msg: e.to_string() }))
            .collect::<Result<Vec<()>>>();
        workers.and(streams.map(drop))
    }

    fn begin_step(&self) {
        self.workers.clock.begin_step();
        self.gpu_spans.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let origin = self.timing_event().and_then(|e| {
            e.record(&self.compute).map_err(cuda_err("recording an event"))?;
            Ok(e)
        });
        *self.step_origin.lock().unwrap_or_else(|p| p.into_inner()) = origin.ok();
    }

    fn now_s(&self) -> f64 {
        self.workers.clock.now()
    }

    fn transferred(&self) -> (u64, u64) {
        self.workers.clock.transferred()
    }

    fn device_peak(&self) -> Option<DevicePeak> {
        let (used, reserved) = cuda_ffi::pool_high_water(&self.ctx).ok()?;
        (used > 0).then_some(DevicePeak { used, reserved })
    }

    /// Host spans (wall clock) and GPU spans (CUDA event time since the step's origin event);
    /// call after [`Backend::synchronize`].
    fn spans(&self) -> Vec<Span> {
        let mut v = self.workers.clock.spans();
        let origin = self.step_origin.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(o) = origin {
            let gpu = self.gpu_spans.lock().unwrap_or_else(|p| p.into_inner());
            for s in gpu.iter() {
                let (Ok(a), Ok(b)) = (cuda_ffi::elapsed_ms(&o, &s.start), cuda_ffi::elapsed_ms(&o, &s.end))
                else {
                    continue;
                };
                v.push(Span {
                    stream: s.stream,
                    name: s.name.clone(),
                    start_s: f64::from(a) / 1e3,
                    end_s: f64::from(b) / 1e3,
                });
            }
        }
        v
    }
}

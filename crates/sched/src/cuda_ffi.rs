//! The CUDA driver calls the overlapped backend needs that have no safe wrapper: asynchronous
//! copies between page-locked host rings and device buffers, the allocator's release threshold,
//! and turning off cudarc's per-buffer event tracking (the step program orders every access).
//!
//! This is the only module of mt-sched with `unsafe`; each call says why it is sound.
//!
//! Module invariant the copy functions rely on (the caller, `cuda.rs`, keeps it by executing a
//! validated step `Program`): a staging buffer is not written until the upload reading it has
//! completed (Stage waits for that upload's CUDA event); a landing buffer is not read until the
//! download writing it has completed (Land waits for it); the master, m and v of a host record
//! whose state a GPU-updated layer's copies read or write are not written by the host until they
//! have completed (the host writes them only in its own update, which a GPU-updated layer never
//! runs during a step; its Land and any re-cast wait for its state download, which follows its
//! state upload and completes before the record is marked updated); its gradient region is not
//! written while a copy reads it (an early upload, `upload` without a gradient, reads master and
//! moments only, while the layer's Land may write its gradient: disjoint page-aligned regions);
//! every buffer outlives its copies (the backend
//! drains all streams at the end of each step and before it is dropped, and the engine holds the
//! store).

use std::sync::Mutex;

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Storage, Tensor};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DevicePtr};
use half::{bf16, f16};
use mt_core::Unit;
use mt_store::{HostStore, TransferBuf};

use crate::backend::EncodedBase;
use crate::{Error, Result};

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{what}: {r:?}")))
    }
}

/// Turns off cudarc's automatic cross-stream event tracking for buffers allocated from now on.
/// Must be called before the pool allocates anything.
pub(crate) fn disable_event_tracking(dev: &CudaDevice) {
    // SAFETY: from here on the step program orders every cross-stream access (uploads wait for the
    // last compute reader of a slot, downloads wait for the backward that wrote the buffer, compute
    // waits for its upload), pool buffers are allocated before any copy touches them and the
    // engine synchronises after allocating them, and every stream is drained before a buffer is
    // freed (CudaBackend's Drop and the end of every step).
    unsafe { dev.disable_event_tracking() }
}

/// Keeps memory freed by stream-ordered frees in the device's default pool instead of returning
/// it to the driver at every synchronisation (the equivalent of a caching allocator).
pub(crate) fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(|e| Error::Cuda(format!("binding the context: {e}")))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: pool is a valid out-pointer; the device handle comes from a live context.
    check("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
    })?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: RELEASE_THRESHOLD takes a pointer to a u64, which lives across the call.
    check("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    })
}

/// The device's default memory pool's high-water marks `(used, reserved)`:
/// `CU_MEMPOOL_ATTR_USED_MEM_HIGH` (memory in use by allocations) and `RESERVED_MEM_HIGH` (memory
/// the pool held from the driver: used plus what fragmentation kept free). Every stream-ordered
/// allocation candle makes counts; the context, modules and library workspaces allocated outside
/// the pool do not.
pub(crate) fn pool_high_water(ctx: &CudaContext) -> Result<(u64, u64)> {
    ctx.bind_to_thread().map_err(|e| Error::Cuda(format!("binding the context: {e}")))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: pool is a valid out-pointer; the device handle comes from a live context.
    check("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
    })?;
    let get = |attr, what| -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: both high-water attributes write one u64 through the pointer, which lives
        // across the call; the pool handle is the device's default pool.
        check(what, unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) })?;
        Ok(v)
    };
    use sys::CUmemPool_attribute::{CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, CU_MEMPOOL_ATTR_USED_MEM_HIGH};
    Ok((
        get(CU_MEMPOOL_ATTR_USED_MEM_HIGH, "cuMemPoolGetAttribute(USED_MEM_HIGH)")?,
        get(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, "cuMemPoolGetAttribute(RESERVED_MEM_HIGH)")?,
    ))
}

// The original (pre-12.8) entry point: every driver since CUDA 2 exports it for old binaries,
// while cudarc's CUDA-13 bindings only name `cuEventElapsedTime_v2`, which the Debian libcuda
// this project links against at build time (535) lacks.
#[link(name = "cuda")]
extern "C" {
    fn cuEventElapsedTime(ms: *mut f32, start: sys::CUevent, end: sys::CUevent) -> sys::CUresult;
}

/// Milliseconds between two completed timing events. Calls `cuEventElapsedTime` (not cudarc's
/// `_v2` spelling, which the build machine's libcuda lacks; the GPU machine's driver has both).
pub(crate) fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32> {
    let mut ms = 0f32;
    // SAFETY: both handles are live events owned by the CudaEvent values; ms is a valid
    // out-pointer for the duration of the call.
    let r = unsafe { cuEventElapsedTime(&mut ms, start.cu_event(), end.cu_event()) };
    check("cuEventElapsedTime", r)?;
    Ok(ms)
}

/// Enqueues a copy of `src` into device memory at `dst` on `stream`.
///
/// # Safety
/// `dst` must point to at least `src.len()` bytes of live device memory; `src` must stay alive and
/// unmodified until the copy has completed on `stream` (the caller orders that with events).
unsafe fn htod_async(dst: sys::CUdeviceptr, src: &[u8], stream: &CudaStream) -> Result<()> {
    // SAFETY: forwarded to the caller's contract above.
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
        .map_err(|e| Error::Cuda(format!("cuMemcpyHtoDAsync of {} bytes: {e}", src.len())))
}

/// Enqueues a copy of `bytes` bytes of device memory at `src` into host memory at `dst`.
///
/// # Safety
/// `dst` must point to `bytes` bytes of live host memory that nothing else reads or writes until
/// the copy has completed on `stream`; `src` must point to at least `bytes` bytes of live device
/// memory.
unsafe fn dtoh_async(dst: *mut u8, bytes: usize, src: sys::CUdeviceptr, stream: &CudaStream) -> Result<()> {
    // SAFETY: forwarded to the caller's contract above.
    let r = unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream.cu_stream()) };
    check(&format!("cuMemcpyDtoHAsync of {bytes} bytes"), r)
}

/// Enqueues a copy of `bytes` bytes of host memory at `src` into device memory at `dst`.
///
/// # Safety
/// `dst` must point to at least `bytes` bytes of live device memory; `src` must point to `bytes`
/// bytes of live host memory that nothing writes until the copy has completed on `stream`.
unsafe fn htod_raw(dst: sys::CUdeviceptr, src: *const u8, bytes: usize, stream: &CudaStream) -> Result<()> {
    // SAFETY: forwarded to the caller's contract above.
    let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.cu_stream()) };
    check(&format!("cuMemcpyHtoDAsync of {bytes} bytes"), r)
}

/// The two ends of a state copy: the record's host addresses, the state slot's device address,
/// and the gradient buffer's device address and size, if it takes part.
struct StateCopy {
    record: mt_store::RecordAddrs,
    state: sys::CUdeviceptr,
    grad: Option<(sys::CUdeviceptr, usize)>,
}

/// Checks a state slot (`[master | m | v]` in f32 words: the fp32 master and the moments as the
/// record encodes them) and, if given, a gradient buffer against `unit`'s record.
fn state_copy_plan(
    store: &HostStore,
    unit: Unit,
    state: &Tensor,
    grad: Option<&Tensor>,
    stream: &CudaStream,
) -> Result<StateCopy> {
    let a = store.record_addrs(unit);
    let n = a.len;
    let (sptr, sbytes) = device_ptr(state, stream)?;
    if state.dtype() != DType::F32 || sbytes != a.states.state_bytes(n) {
        return Err(Error::Cuda(format!(
            "a {sbytes}-byte {:?} state slot for {unit:?}'s {n}-element record (needs {} bytes: f32 master and {} moments)",
            state.dtype(),
            a.states.state_bytes(n),
            a.states
        )));
    }
    let grad = match grad {
        None => None,
        Some(g) => {
            let (gptr, gbytes) = device_ptr(g, stream)?;
            let gsize = a.grad_dtype.size();
            if gsize == 0 || g.dtype().size_in_bytes() != gsize || gbytes != gsize * n {
                return Err(Error::Cuda(format!(
                    "a {gbytes}-byte {:?} gradient buffer for {unit:?}'s {n}-element {:?} store gradient",
                    g.dtype(),
                    a.grad_dtype
                )));
            }
            Some((gptr, gbytes))
        }
    };
    Ok(StateCopy { record: a, state: sptr, grad })
}

/// The record's master, m and v as (host address, byte offset in the state slot, bytes): the
/// slot is `[master | m | v]` back to back, the record's regions page-aligned apart.
fn state_parts(a: &mt_store::RecordAddrs) -> [(usize, u64, usize); 3] {
    let (master, mb) = (4 * a.len, a.moment_bytes);
    [(a.master, 0, master), (a.m, master as u64, mb), (a.v, (master + mb) as u64, mb)]
}

/// Enqueues the upload of `unit`'s fp32 master and its moments (into `state` back to back) and
/// its stored gradient (into `grad`) straight from its host record (page-locked in place by the
/// engine: `mt_store::PinnedRecords`); returns the bytes copied. Sound under the module invariant.
pub(crate) fn enqueue_record_upload(
    store: &HostStore,
    unit: Unit,
    state: &Tensor,
    grad: Option<&Tensor>,
    stream: &CudaStream,
) -> Result<u64> {
    let StateCopy { record: a, state: sptr, grad: g } = state_copy_plan(store, unit, state, grad, stream)?;
    let state_bytes = a.states.state_bytes(a.len) as u64;
    for (host, at, bytes) in state_parts(&a) {
        // SAFETY: `host` is the start of the record's master (4n bytes) or moment region
        // (`moment_bytes`; `record_addrs`), inside the store's mapping, which the engine keeps
        // alive past every copy; the host writes none of the record's master, m and v until this
        // copy has completed (module invariant); the device range `at..at + bytes` lies in the
        // state slot, whose size (`state_bytes(n)`, the three parts' sum) is checked above.
        unsafe { htod_raw(sptr + at, host as *const u8, bytes, stream)? };
    }
    let Some((gptr, gbytes)) = g else {
        // Master and moments only (an early upload: the gradient is copied on the device).
        return Ok(state_bytes);
    };
    // SAFETY: as above, for the record's gradient region of gbytes bytes and the whole gradient
    // buffer of the same size.
    unsafe { htod_raw(gptr, a.grad as *const u8, gbytes, stream)? };
    Ok(state_bytes + gbytes as u64)
}

/// Enqueues the download of `state`'s master and moments into `unit`'s host record; returns the
/// bytes copied. Sound under the module invariant.
pub(crate) fn enqueue_record_download(
    state: &Tensor,
    store: &HostStore,
    unit: Unit,
    stream: &CudaStream,
) -> Result<u64> {
    let StateCopy { record: a, state: sptr, .. } = state_copy_plan(store, unit, state, None, stream)?;
    for (host, at, bytes) in state_parts(&a) {
        // SAFETY: `host` addresses the record's master or moment region of `bytes` bytes
        // (`record_addrs`), inside the store's mapping, which the engine keeps alive past every
        // copy, and which nothing reads or writes until this copy has completed (module
        // invariant); the source `at..at + bytes` lies in the state slot checked above.
        unsafe { dtoh_async(host as *mut u8, bytes, sptr + at, stream)? };
    }
    Ok(a.states.state_bytes(a.len) as u64)
}

/// Device address and size in bytes of a whole, contiguous CUDA tensor.
fn device_ptr(t: &Tensor, stream: &CudaStream) -> Result<(sys::CUdeviceptr, usize)> {
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        return Err(Error::Cuda("a transfer buffer must be a whole contiguous tensor".into()));
    }
    let Storage::Cuda(cs) = &*storage else {
        return Err(Error::Cuda("a transfer buffer is not on the CUDA device".into()));
    };
    let ptr = match t.dtype() {
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(stream).0,
        DType::BF16 => cs.as_cuda_slice::<bf16>()?.device_ptr(stream).0,
        DType::F16 => cs.as_cuda_slice::<f16>()?.device_ptr(stream).0,
        DType::U8 => cs.as_cuda_slice::<u8>()?.device_ptr(stream).0,
        other => return Err(Error::Cuda(format!("transfer buffers are f32/bf16/f16/u8, not {other:?}"))),
    };
    Ok((ptr, t.elem_count() * t.dtype().size_in_bytes()))
}

/// Enqueues the upload of a page-locked staging buffer into a device slot of the same size on
/// `stream`, from element `from` on (0: the whole slot; more: the slot's first `from` elements
/// are kept as they are); returns the bytes copied. Sound under the module invariant.
pub(crate) fn enqueue_upload(
    staging: &TransferBuf,
    dst: &Tensor,
    from: usize,
    stream: &CudaStream,
) -> Result<u64> {
    let bytes = staging.as_bytes();
    let (dptr, dbytes) = device_ptr(dst, stream)?;
    let at = from * staging.dtype().size();
    if dst.dtype().size_in_bytes() != staging.dtype().size() || dbytes != bytes.len() || at > bytes.len() {
        return Err(Error::Cuda(format!(
            "upload of {} staged bytes ({:?}) from element {from} into a {dbytes}-byte {:?} slot",
            bytes.len(),
            staging.dtype(),
            dst.dtype()
        )));
    }
    if at == bytes.len() {
        // Nothing after the kept elements (a LoRA run's outer unit, which has no adapters).
        return Ok(0);
    }
    // SAFETY: dptr + at is inside dst's allocation of dbytes == bytes.len() >= at bytes, whose
    // last bytes.len() - at bytes this fills, kept alive by `dst` (a pool buffer); the staging
    // buffer stays untouched until the copy completes and outlives it (module invariant).
    unsafe { htod_async(dptr + at as u64, &bytes[at..], stream)? };
    Ok((bytes.len() - at) as u64)
}

/// Enqueues the upload of a staging buffer whose head is a unit's encoded frozen base (`base`):
/// those bytes into the scratch buffer, their dequantisation into the slot's first elements
/// (mt-kernels' `decode_base`, on `stream` too), and the rest of the staging buffer (the
/// adapters) into the rest of the slot; returns the bytes copied. Sound under the module
/// invariant; the scratch buffer is rewritten only by the next such upload, which `stream`
/// runs after this one's dequantisation.
pub(crate) fn enqueue_encoded_upload(
    staging: &TransferBuf,
    dst: &Tensor,
    base: &EncodedBase,
    stream: &CudaStream,
) -> Result<u64> {
    let bytes = staging.as_bytes();
    let (encoded, at) = (base.encoding.bytes, base.encoding.elems() * staging.dtype().size());
    let (sptr, sbytes) = device_ptr(&base.scratch, stream)?;
    let (dptr, dbytes) = device_ptr(dst, stream)?;
    if dst.dtype().size_in_bytes() != staging.dtype().size()
        || dbytes != bytes.len()
        || encoded > sbytes
        || encoded > at
        || at > bytes.len()
    {
        return Err(Error::Cuda(format!(
            "upload of {} staged bytes ({:?}; an encoded base of {encoded} bytes for {at} bytes of the slot) into a {dbytes}-byte {:?} slot through a {sbytes}-byte scratch buffer",
            bytes.len(),
            staging.dtype(),
            dst.dtype()
        )));
    }
    // SAFETY: sptr is the scratch buffer's whole allocation of sbytes >= encoded bytes, kept
    // alive by the pool; the staging buffer stays untouched until the copy completes and
    // outlives it (module invariant); nothing but this stream's dequantisation reads the scratch.
    unsafe { htod_async(sptr, &bytes[..encoded], stream)? };
    mt_kernels::decode_base(stream, &base.scratch, dst, &base.encoding.segments)
        .map_err(|e| Error::Cuda(format!("dequantising the frozen base: {e}")))?;
    // SAFETY: dptr + at is inside dst's allocation of dbytes == bytes.len() >= at bytes, whose
    // last bytes.len() - at bytes this fills; the staging buffer as above.
    unsafe { htod_async(dptr + at as u64, &bytes[at..], stream)? };
    Ok((encoded + bytes.len() - at) as u64)
}

/// Enqueues the download of a whole device buffer's bytes into a page-locked landing buffer of
/// the same size in bytes on `stream`; returns the bytes copied. Sound under the module invariant.
pub(crate) fn enqueue_download(src: &Tensor, dst: &Mutex<TransferBuf>, stream: &CudaStream) -> Result<u64> {
    let (sptr, sbytes) = device_ptr(src, stream)?;
    let mut land = dst.lock().unwrap_or_else(|p| p.into_inner());
    if sbytes != land.as_bytes().len() {
        return Err(Error::Cuda(format!(
            "download of a {sbytes}-byte {:?} gradient into a {}-element {:?} landing buffer",
            src.dtype(),
            land.len(),
            land.dtype()
        )));
    }
    let dst_ptr = land.as_bytes_mut().as_mut_ptr();
    drop(land);
    // SAFETY: dst_ptr addresses the landing buffer's sbytes bytes, which nothing reads or writes
    // until this copy completes and which outlive it (module invariant); sptr is the whole
    // gradient buffer, alive in the pool.
    unsafe { dtoh_async(dst_ptr, sbytes, sptr, stream)? };
    Ok(sbytes as u64)
}

/// An NCCL communicator: this process's rank of a group made from one unique id, bound to the
/// compute stream its collectives are enqueued on.
#[cfg(feature = "nccl")]
pub(crate) struct NcclComm {
    comm: cudarc::nccl::sys::ncclComm_t,
    stream: std::sync::Arc<CudaStream>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two calls on it run at
// once; the one engine that owns it issues its collectives from whichever thread runs that
// engine's compute, one at a time (`&self` methods are only reached through the engine's
// `&mut self` step), and it is destroyed by the single owner's Drop.
#[cfg(feature = "nccl")]
unsafe impl Send for NcclComm {}

#[cfg(feature = "nccl")]
impl NcclComm {
    /// Joins rank `rank` of `world` to the group of `id` (blocks until every rank has joined),
    /// its collectives on `stream`. Fails with a sentence, not a panic, when libnccl is missing.
    pub(crate) fn new(
        stream: std::sync::Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: cudarc::nccl::sys::ncclUniqueId,
    ) -> Result<Self> {
        use cudarc::nccl::result as nccl;
        let to_i32 = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| Error::Options(format!("{what} {v} is too large for NCCL")))
        };
        let (n, r) = (to_i32(world, "world size")?, to_i32(rank, "rank")?);
        stream.context().bind_to_thread().map_err(|e| Error::Cuda(format!("binding the context: {e}")))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: comm is a valid out-pointer; id is a unique id from ncclGetUniqueId shared by
        // every rank of the group, and the current device is this rank's (the context bound above).
        unsafe { nccl::comm_init_rank(comm.as_mut_ptr(), n, id, r) }
            .map_err(|e| Error::Cuda(format!("ncclCommInitRank (rank {rank} of {world}): {e:?}")))?;
        // SAFETY: ncclCommInitRank succeeded, so it wrote the communicator.
        let comm = unsafe { comm.assume_init() };
        Ok(NcclComm { comm, stream })
    }

    /// Enqueues the in-place sum of a whole f32 (gradients) or f64 (a step's loss and flags)
    /// device buffer over every rank on the stream.
    pub(crate) fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        use cudarc::nccl::{result as nccl, sys as ncs};
        let (kind, size) = match t.dtype() {
            DType::F32 => (ncs::ncclDataType_t::ncclFloat32, 4),
            DType::F64 => (ncs::ncclDataType_t::ncclFloat64, 8),
            other => return Err(Error::Cuda(format!("sums over the ranks are f32 or f64, not {other:?}"))),
        };
        let (ptr, bytes) = device_ptr(t, &self.stream)?;
        let ptr = ptr as *mut std::ffi::c_void;
        // SAFETY: ptr addresses the whole live buffer of bytes / size elements of `kind`, kept alive by the
        // pool until every stream is drained; sum in place (send == receive is allowed); the
        // communicator is live and owned by this engine; the stream is this rank's compute stream,
        // so the sum runs after the backward that wrote the buffer and before anything reads it.
        unsafe {
            nccl::all_reduce(
                ptr,
                ptr,
                bytes / size,
                kind,
                ncs::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream.cu_stream() as ncs::cudaStream_t,
            )
        }
        .map_err(|e| Error::Cuda(format!("ncclAllReduce of {bytes} bytes: {e:?}")))?;
        Ok(())
    }
}

#[cfg(feature = "nccl")]
impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and dropped once; the engine drained its streams before
        // its fields drop. Abort (not destroy): local, so a rank whose peers died does not hang.
        if let Err(e) = unsafe { cudarc::nccl::result::comm_abort(self.comm) } {
            tracing::error!("ncclCommAbort: {e:?}");
        }
    }
}

/// A new NCCL unique id (rank 0 makes it, every rank joins with it). Fails with a sentence when
/// libnccl cannot be loaded.
#[cfg(feature = "nccl")]
pub(crate) fn nccl_unique_id() -> Result<cudarc::nccl::sys::ncclUniqueId> {
    cudarc::nccl::result::get_uniqueid().map_err(|e| Error::Cuda(format!("ncclGetUniqueId: {e:?}")))
}

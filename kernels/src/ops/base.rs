//! Launches of `kernels/cuda/base.cu`: a LoRA run's frozen base, uploaded in its encoding (a
//! decoder layer's int8 or NF4 blocks and its bf16 norms), dequantised into the weight slot on
//! the stream the caller gives (mt-sched's H2D stream, right after the upload of those bytes),
//! bitwise mt-store's reference decoding (`base_codec::decode`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Storage, Tensor};
use half::bf16;
use mt_core::{BaseCode, BaseSegment};

use super::nvrtc::note_device;
use super::sources::BASE;
use super::{grid_for, msg};

/// The kernels' number for a code (`kernels/cuda/base.cu`).
fn code_arg(c: BaseCode) -> i32 {
    match c {
        BaseCode::F32 => 0,
        BaseCode::Bf16 => 1,
        BaseCode::Int8 => 2,
        BaseCode::Nf4 => 3,
    }
}

/// Decodes `segments` of a unit's encoded base record, whose bytes are at the start of `src` (a
/// contiguous u8 CUDA tensor), into their elements of `dst` (the slot: a contiguous bf16 or f32
/// CUDA tensor), one launch a segment on `stream`, which must be of `src`'s and `dst`'s device.
/// The caller orders the launches after the copy that fills `src` and before any reader of
/// `dst` (on `stream`, or by an event recorded on it).
pub fn decode_base(
    stream: &CudaStream,
    src: &Tensor,
    dst: &Tensor,
    segments: &[BaseSegment],
) -> candle_core::Result<()> {
    let (bytes, elems) =
        segments.iter().fold((0, 0), |(b, e), s| (b.max(s.byte_range().end), e.max(s.start + s.len)));
    let (ss, sl) = src.storage_and_layout();
    let (ds, dl) = dst.storage_and_layout();
    let (Storage::Cuda(sc), Storage::Cuda(dc)) = (&*ss, &*ds) else {
        return Err(msg("base dequantisation: both buffers must be on the CUDA device"));
    };
    if src.dtype() != DType::U8 || !sl.is_contiguous() || src.elem_count() < bytes {
        return Err(msg(format!(
            "base dequantisation: the encoded bytes must be a contiguous u8 buffer of at least {bytes} bytes, not {} {:?}",
            src.elem_count(),
            src.dtype()
        )));
    }
    if !dl.is_contiguous() || dst.elem_count() < elems {
        return Err(msg(format!(
            "base dequantisation: a slot of {} elements for a base of {elems}",
            dst.elem_count()
        )));
    }
    let dev = sc.device().clone();
    note_device(&dev);
    let sptr = sc.as_cuda_slice::<u8>()?.slice(sl.start_offset()..).device_ptr(stream).0;
    let (kernel, esz, dptr) = match dst.dtype() {
        DType::BF16 => (
            "mt_base_decode_bf16",
            2,
            dc.as_cuda_slice::<bf16>()?.slice(dl.start_offset()..).device_ptr(stream).0,
        ),
        DType::F32 => (
            "mt_base_decode_f32",
            4,
            dc.as_cuda_slice::<f32>()?.slice(dl.start_offset()..).device_ptr(stream).0,
        ),
        other => return Err(msg(format!("base dequantisation: a {other:?} slot; bf16 or f32"))),
    };
    let func = dev.get_or_load_custom_func(kernel, BASE.module, BASE.ptx()?)?;
    for s in segments {
        let (from, to, n, code) =
            (sptr + s.byte_offset as u64, dptr + (esz * s.start) as u64, s.len as i64, code_arg(s.code));
        let mut b = stream.launch_builder(&func);
        b.arg(&from);
        b.arg(&to);
        b.arg(&n);
        b.arg(&code);
        // SAFETY: the arguments match the kernel's signature (two device addresses, long long,
        // int); `from` addresses the segment's `s.bytes()` bytes inside `src` (its byte range
        // ends within the `bytes` checked above), `to` its `n` elements inside `dst` (checked
        // likewise), distinct buffers alive under the storage locks held here until the launch
        // is enqueued and kept alive by the caller (the device pool) until the stream has run it;
        // the caller orders the launch after the copy into `src` and before `dst`'s readers.
        unsafe { b.launch(grid_for(s.len)) }.w()?;
    }
    Ok(())
}

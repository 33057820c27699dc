//! `HostVec<T>`: a fixed-length, page-aligned, zeroed host buffer that can be page-locked
//! (registered with CUDA) once, for the staging and landing rings that cross PCIe.
//!
//! Only these few ring buffers (and, in place, the records whose whole optimizer state crosses
//! PCIe: `PinnedRecords`) are ever pinned, never the whole store: pinning tens of GiB would take
//! the memory away from the OS and make start-up slow. Registration is undone in
//! `Drop` before the memory is freed, so a registered range can never outlive its allocation.
//!
//! Architecture Invariant: the length never changes after construction, so a registered
//! address range stays valid for the buffer's whole life.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::PAGE;

/// Error of pinning a buffer.
#[derive(Debug, thiserror::Error)]
#[error("page-locking a {bytes}-byte host buffer: {msg}")]
pub struct PinError {
    /// Size of the buffer.
    pub bytes: usize,
    /// What went wrong.
    pub msg: String,
}

/// Fixed-length, page-aligned, zero-initialised host buffer of plain-old-data elements.
pub struct HostVec<T: bytemuck::Pod> {
    ptr: NonNull<T>,
    len: usize,
    pinned: bool,
}

// SAFETY: HostVec owns its allocation exclusively (like Vec<T>); T is Pod, hence Send + Sync.
unsafe impl<T: bytemuck::Pod + Send> Send for HostVec<T> {}
// SAFETY: shared access only hands out &[T]; mutation needs &mut self.
unsafe impl<T: bytemuck::Pod + Sync> Sync for HostVec<T> {}

impl<T: bytemuck::Pod> HostVec<T> {
    fn layout(len: usize) -> Layout {
        let bytes = (len * std::mem::size_of::<T>()).div_ceil(PAGE).max(1) * PAGE;
        Layout::from_size_align(bytes, PAGE).expect("page-aligned layout")
    }

    /// A zeroed buffer of `len` elements; its allocation is rounded up to whole pages.
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has non-zero size (at least one page) and a power-of-two alignment.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { std::alloc::handle_alloc_error(layout) };
        HostVec { ptr, len, pinned: false }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the buffer is registered (page-locked) with CUDA.
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// Page-locks the buffer for asynchronous DMA (portable across CUDA contexts). Idempotent.
    /// A CUDA context must be current on the calling thread.
    #[cfg(feature = "cuda")]
    pub fn pin(&mut self) -> Result<(), PinError> {
        use cudarc::driver::sys;
        if self.pinned {
            return Ok(());
        }
        let bytes = Self::layout(self.len).size();
        // SAFETY: the range [ptr, ptr + bytes) is this buffer's own live allocation (whole pages);
        // it is unregistered in Drop before being freed and its length never changes.
        let r = unsafe {
            sys::cuMemHostRegister_v2(self.ptr.as_ptr().cast(), bytes, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(PinError { bytes, msg: format!("cuMemHostRegister failed: {r:?}") });
        }
        self.pinned = true;
        Ok(())
    }

    /// Page-locking needs the `cuda` feature; without it this always fails.
    #[cfg(not(feature = "cuda"))]
    pub fn pin(&mut self) -> Result<(), PinError> {
        Err(PinError { bytes: Self::layout(self.len).size(), msg: "built without the cuda feature".into() })
    }
}

impl<T: bytemuck::Pod> Deref for HostVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is a live, aligned allocation of at least len zero-initialised Pod elements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: bytemuck::Pod> DerefMut for HostVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in Deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: bytemuck::Pod> Drop for HostVec<T> {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if self.pinned {
            // SAFETY: the pointer was registered by `pin` and is still allocated. Failure is
            // ignored: the memory is freed next either way, and drop cannot report it.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr.as_ptr().cast()) };
        }
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast(), Self::layout(self.len)) }
    }
}

impl<T: bytemuck::Pod> Clone for HostVec<T> {
    /// A new, unpinned buffer with the same contents.
    fn clone(&self) -> Self {
        let mut c = HostVec::zeroed(self.len);
        c.copy_from_slice(self);
        c
    }
}

impl<T: bytemuck::Pod + std::fmt::Debug> std::fmt::Debug for HostVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostVec").field("len", &self.len).field("pinned", &self.pinned).finish()
    }
}

/// `dst.copy_from_slice(src)` on every core, in 1 Mi-element blocks: host buffers here are
/// hundreds of MB (a layer's landed gradient, a parameter's master weights), which one thread
/// copies several times slower than the machine's memory allows.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice`).
pub fn par_copy<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    use rayon::prelude::*;
    const BLOCK: usize = 1 << 20;
    assert_eq!(dst.len(), src.len(), "par_copy: lengths differ");
    dst.par_chunks_mut(BLOCK).zip(src.par_chunks(BLOCK)).for_each(|(d, s)| d.copy_from_slice(s));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_page_aligned_and_writable() {
        let mut v = HostVec::<f32>::zeroed(1000);
        assert_eq!(v.len(), 1000);
        assert_eq!(v.as_ptr() as usize % PAGE, 0);
        assert!(v.iter().all(|&x| x == 0.0));
        v[999] = 3.5;
        let c = v.clone();
        assert_eq!(c[999], 3.5);
        assert!(!c.is_pinned());
        let e = HostVec::<half::bf16>::zeroed(0);
        assert!(e.is_empty());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn pin_without_cuda_says_why() {
        let e = HostVec::<f32>::zeroed(10).pin().unwrap_err();
        assert!(e.to_string().contains("cuda feature"), "{e}");
    }
}

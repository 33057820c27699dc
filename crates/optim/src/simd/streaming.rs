//! Non-temporal ("streaming") stores for outputs the CPU will not read again soon: the upload copy
//! of the new master that the GPU's DMA engine reads from the staging ring, and casts into it.
//!
//! A plain store to a line that is not in cache first reads the line from memory (read for
//! ownership), so writing 2 B of bf16 upload copy costs 4 B of DRAM traffic. A streaming store
//! writes whole lines through the write-combining buffers without that read, and does not evict
//! the master, `m` and `v` lines the update is working on. On the H200 machines' 16-core Xeon the
//! fused bf16 AdamW is bound by DRAM bandwidth (it runs as fast as a loop that only adds the
//! gradient to `p`, `m` and `v`), and streaming its upload copy made it a few percent faster
//! (docs/decisions/0006, 0041).
//!
//! Streaming stores are weakly ordered: the thread that issued them must fence before any other
//! thread or device may read the memory. [`Writer`] fences when it is dropped.
//!
//! With the vector kernels beside it, this is where `mt-optim` allows `unsafe` (CPU intrinsics,
//! `super`); every block says why it is sound.

/// Writes with streaming stores; dropping it fences them (x86-64 `sfence`), so whatever it wrote
/// is visible to every thread and device before any later store of the thread that dropped it
/// (the rayon latch that publishes a task's completion among them). Create one per rayon task, not
/// per block: a fence waits for the write-combining buffers to drain.
/// It is neither `Send` nor `Sync` (the raw-pointer marker): the fence must run on the thread that
/// issued the stores. Leaking it (`mem::forget`) would skip the fence; nothing here does.
pub(crate) struct Writer(std::marker::PhantomData<*const ()>);

impl Writer {
    pub(crate) fn new() -> Self {
        Writer(std::marker::PhantomData)
    }

    /// Copies `src` into `dst` (same length) with streaming stores where the CPU has them (x86-64:
    /// SSE2's `movntdq` on the 16-byte-aligned middle, plain stores for the unaligned ends);
    /// elsewhere a plain copy. The bytes written are exactly `src`'s.
    ///
    /// # Panics
    /// If the lengths differ.
    pub(crate) fn copy<T: bytemuck::Pod>(&mut self, dst: &mut [T], src: &[T]) {
        assert_eq!(dst.len(), src.len(), "streaming copy: lengths differ");
        let d: &mut [u8] = bytemuck::cast_slice_mut(dst);
        let s: &[u8] = bytemuck::cast_slice(src);
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let head = d.as_ptr().align_offset(16).min(d.len());
            let (d_head, d_rest) = d.split_at_mut(head);
            let (s_head, s_rest) = s.split_at(head);
            d_head.copy_from_slice(s_head);
            let body = d_rest.len() / 16 * 16;
            let (d_body, d_tail) = d_rest.split_at_mut(body);
            let (s_body, s_tail) = s_rest.split_at(body);
            for (dc, sc) in d_body.chunks_exact_mut(16).zip(s_body.chunks_exact(16)) {
                // SAFETY: SSE2 is part of the x86-64 baseline. `sc` is 16 readable bytes (the load
                // is unaligned); `dc` is 16 writable bytes of an exclusively borrowed slice,
                // 16-byte aligned because `d_body` starts at `d`'s first 16-byte boundary and
                // steps by 16. The store's weak ordering is closed by `Drop`'s fence.
                unsafe {
                    let x = _mm_loadu_si128(sc.as_ptr().cast::<__m128i>());
                    _mm_stream_si128(dc.as_mut_ptr().cast::<__m128i>(), x);
                }
            }
            d_tail.copy_from_slice(s_tail);
        }
        #[cfg(not(target_arch = "x86_64"))]
        d.copy_from_slice(s);
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `sfence` has no operands and touches no memory; it orders this thread's
        // streaming stores before all of its later stores.
        unsafe {
            std::arch::x86_64::_mm_sfence()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_every_alignment_and_length() {
        let src: Vec<u16> = (0..300u16).map(|i| i.wrapping_mul(40503) ^ 0x5a5a).collect();
        for off in 0..9 {
            for len in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200] {
                let mut dst = vec![0xFFFFu16; off + len + 3];
                Writer::new().copy(&mut dst[off..off + len], &src[..len]);
                assert!(dst[..off].iter().all(|&x| x == 0xFFFF), "off {off} len {len}: head touched");
                assert_eq!(&dst[off..off + len], &src[..len], "off {off} len {len}");
                assert!(dst[off + len..].iter().all(|&x| x == 0xFFFF), "off {off} len {len}: tail touched");
            }
        }
        let f: Vec<f32> = (0..100).map(|i| i as f32 * 0.37 - 5.0).collect();
        let mut g = vec![0.0f32; 101];
        let mut w = Writer::new();
        w.copy(&mut g[1..51], &f[..50]);
        w.copy(&mut g[51..], &f[50..]);
        drop(w);
        assert_eq!(&g[1..], &f[..]);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn refuses_different_lengths() {
        Writer::new().copy(&mut [0u16; 3], &[1u16; 4]);
    }
}

//! The embedding backward's row scatter-add (`kernels/cuda/embed.cu`): one block per distinct token
//! id, that id's tokens added in ascending order — deterministic, no atomics, and the same sums
//! as candle's sequential `scatter_add` (which runs a handful of blocks sequentially over every
//! token: ~8 ms per 8k tokens on an H200, against microseconds here).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp3, Layout, Tensor};
use half::bf16;

use super::sources::EMBED;
use super::{msg, THREADS};

struct RowsAdd {
    k: usize,
    n_rows: usize,
    width: usize,
}

impl InplaceOp3 for RowsAdd {
    cuda_only!("mt-rows-add", inplace3);

    fn cuda_fwd(
        &self,
        g: &mut CudaStorage,
        lg: &Layout,
        src: &CudaStorage,
        ls: &Layout,
        csr: &CudaStorage,
        lc: &Layout,
    ) -> candle_core::Result<()> {
        if !lg.is_contiguous() || !ls.is_contiguous() || !lc.is_contiguous() {
            return Err(msg("rows add: needs contiguous tensors"));
        }
        if ls.shape().elem_count() != self.k * self.width
            || lc.shape().elem_count() != self.k + 2 * self.n_rows + 1
        {
            return Err(msg("rows add: source or index sizes do not match"));
        }
        let dev = g.device().clone();
        let kernel = match src.dtype() {
            DType::BF16 => "mt_rows_add_bf16",
            DType::F32 => "mt_rows_add_f32",
            other => return Err(msg(format!("rows add: source dtype {other:?}; bf16 or f32"))),
        };
        let func = dev.get_or_load_custom_func(kernel, EMBED.module, EMBED.ptx()?)?;
        let mut gs = g.as_cuda_slice_mut::<f32>()?.slice_mut(lg.start_offset()..);
        let cs = csr.as_cuda_slice::<u32>()?.slice(lc.start_offset()..);
        let to_i32 = |x: usize| i32::try_from(x).map_err(|_| msg("rows add: size exceeds i32"));
        let (k, n_rows, h) = (to_i32(self.k)?, to_i32(self.n_rows)?, to_i32(self.width)?);
        let cfg = LaunchConfig {
            grid_dim: (self.n_rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        let src_bf16;
        let src_f32;
        if src.dtype() == DType::BF16 {
            src_bf16 = src.as_cuda_slice::<bf16>()?.slice(ls.start_offset()..);
            b.arg(&src_bf16);
        } else {
            src_f32 = src.as_cuda_slice::<f32>()?.slice(ls.start_offset()..);
            b.arg(&src_f32);
        }
        b.arg(&mut gs);
        b.arg(&cs);
        b.arg(&k);
        b.arg(&n_rows);
        b.arg(&h);
        // SAFETY: signature (const src*, float*, const unsigned*, int, int, int) with the source
        // type chosen above; `csr` holds k + 2·n_rows + 1 entries (checked) built by `rows_add`
        // with every position < k and every row id < the destination's rows (checked there), so
        // each block reads its id's source rows and writes only its own destination row, which
        // no other block touches; the destination view is contiguous from its offset.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// `dst[ids[t]] += src[t]` for every row `t` (`dst: [rows, width]` f32 CUDA view, `src:
/// [k, width]` bf16 or f32, `ids: [k]` u32), deterministic, in ascending `t` per id.
pub fn rows_add(dst: &Tensor, ids: &Tensor, src: &Tensor) -> candle_core::Result<()> {
    let (rows, width) = dst.dims2()?;
    let ids = ids.to_vec1::<u32>()?;
    let k = ids.len();
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= rows) {
        return Err(msg(format!("rows add: id {bad} out of range for {rows} rows")));
    }
    if k == 0 {
        return Ok(());
    }
    let mut order: Vec<u32> = (0..k as u32).collect();
    order.sort_by_key(|&t| ids[t as usize]); // stable: ascending t within an id
    let mut seg = vec![0u32];
    let mut row_ids = Vec::new();
    for (i, &t) in order.iter().enumerate() {
        let id = ids[t as usize];
        if row_ids.last() != Some(&id) {
            if i > 0 {
                seg.push(i as u32);
            }
            row_ids.push(id);
        }
    }
    seg.push(k as u32);
    let n_rows = row_ids.len();
    let csr: Vec<u32> = order.into_iter().chain(seg).chain(row_ids).collect();
    let csr = Tensor::from_vec(csr, k + 2 * n_rows + 1, dst.device())?;
    dst.inplace_op3(&src.contiguous()?, &csr, &RowsAdd { k, n_rows, width })
}

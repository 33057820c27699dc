//! A projection's weight gradient added straight into the unit's f32 gradient buffer by one
//! cuBLAS call: `dW[out, in] += dyᵀ x` with bf16 operands, f32 accumulation and f32 `C` (β = 1).
//!
//! The unfused path computes `dyᵀ x` as a bf16 matrix (rounding every element to bf16), then a
//! cast and an add pass read and write the f32 buffer again (~26 bytes per parameter per chunk).
//! Here the GEMM's f32 accumulators are added to the buffer in its epilogue: no bf16 rounding of
//! the gradient and no extra pass.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result as cublas, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp3, Layout, Tensor};
use half::bf16;

use super::msg;

/// `dst += dyᵀ x` for `dst` an f32 view of `out · in` elements, `dy: [N, out]`, `x: [N, in]`.
struct GemmAccumulate;

/// Row count and width of a contiguous 2-D layout.
fn matrix(l: &Layout, what: &str) -> candle_core::Result<(usize, usize)> {
    match l.dims() {
        [r, c] if l.is_contiguous() => Ok((*r, *c)),
        d => Err(msg(format!("gemm accumulate: {what} must be a contiguous matrix, found {d:?}"))),
    }
}

fn int(v: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(v).map_err(|_| msg(format!("gemm accumulate: {what} = {v} exceeds cuBLAS's int range")))
}

impl InplaceOp3 for GemmAccumulate {
    cuda_only!("mt-gemm-accumulate", inplace3);

    fn cuda_fwd(
        &self,
        c: &mut CudaStorage,
        lc: &Layout,
        dy: &CudaStorage,
        ldy: &Layout,
        x: &CudaStorage,
        lx: &Layout,
    ) -> candle_core::Result<()> {
        let (n, out) = matrix(ldy, "dy")?;
        let (nx, inp) = matrix(lx, "x")?;
        if nx != n {
            return Err(msg(format!("gemm accumulate: dy has {n} rows, x has {nx}")));
        }
        if !lc.is_contiguous() || lc.shape().elem_count() != out * inp {
            return Err(msg(format!(
                "gemm accumulate: destination must be a contiguous view of {out} x {inp} elements, found {:?}",
                lc.dims()
            )));
        }
        let (m_, n_, k_) = (int(inp, "in")?, int(out, "out")?, int(n, "rows")?);
        let dev = c.device().clone();
        let blas = dev.cublas_handle();
        let stream = dev.cuda_stream();
        let a = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
        let b = dy.as_cuda_slice::<bf16>()?.slice(ldy.start_offset()..);
        let mut cs = c.as_cuda_slice_mut::<f32>()?.slice_mut(lc.start_offset()..);
        let (pa, _ga) = a.device_ptr(&stream);
        let (pb, _gb) = b.device_ptr(&stream);
        let (pc, _gc) = cs.device_ptr_mut(&stream);
        let (alpha, beta) = (1.0f32, 1.0f32);
        // Row-major C[out, in] is column-major Cᶜ[in, out] (ldc = in); x [N, in] row-major is
        // column-major [in, N] (lda = in); dy [N, out] is column-major [out, N] (ldb = out), used
        // transposed: Cᶜ = x̃ · dỹᵀ = (dyᵀ x)ᵀ.
        // SAFETY: the three pointers address live device buffers of candle's device, on the
        // stream the cuBLAS handle is bound to (candle's compute stream); the views hold at
        // least in·N (a), out·N (b) and in·out (c) elements, checked above from the layouts; the
        // data types passed match the buffers (bf16, bf16, f32) and alpha/beta are f32 as
        // CUBLAS_COMPUTE_32F requires; the guards keep the buffers borrowed until the call is
        // enqueued.
        unsafe {
            cublas::gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_T,
                m_,
                n_,
                k_,
                (&alpha as *const f32).cast(),
                pa as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                m_,
                pb as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                n_,
                (&beta as *const f32).cast(),
                pc as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                m_,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| msg(format!("gemm accumulate: cuBLAS: {e:?}")))
    }
}

/// Whether [`accumulate_matmul_t`] applies: CUDA, bf16 operands, an f32 destination.
pub fn gemm_applies(dst: &Tensor, dy: &Tensor, x: &Tensor) -> bool {
    dst.device().is_cuda()
        && dst.dtype() == DType::F32
        && dy.dtype() == DType::BF16
        && x.dtype() == DType::BF16
}

/// `dst += dyᵀ x` in place: `dst` an f32 CUDA view of `out · in` elements (row-major
/// `[out, in]`), `dy: [N, out]`, `x: [N, in]` bf16 (made contiguous if they are not).
pub fn accumulate_matmul_t(dst: &Tensor, dy: &Tensor, x: &Tensor) -> candle_core::Result<()> {
    dst.inplace_op3(&dy.contiguous()?, &x.contiguous()?, &GemmAccumulate)
}

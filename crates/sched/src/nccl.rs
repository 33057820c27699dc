//! Gradient sums over GPUs through NCCL (cudarc's `nccl` feature; the calls are in `cuda_ffi`):
//! [`NcclId`], made once and shared by the ranks, and [`NcclReduce`], one rank's
//! [`GradReduce`] on its compute stream.

use crate::cuda::CudaBackend;
use crate::cuda_ffi::{nccl_unique_id, NcclComm};
use crate::data_parallel::GradReduce;
use crate::Result;

/// The id every rank of one NCCL group joins with (128 opaque bytes; across hosts it is what
/// a rendezvous ships).
#[derive(Clone, Copy)]
pub struct NcclId(cudarc::nccl::sys::ncclUniqueId);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A new id (loads libnccl: see README, "Several GPUs").
    pub fn new() -> Result<Self> {
        Ok(NcclId(nccl_unique_id()?))
    }
}

/// One rank's all-reduce (sum) of gradient buffers, on its backend's compute stream.
pub struct NcclReduce {
    comm: NcclComm,
}

impl std::fmt::Debug for NcclReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclReduce")
    }
}

impl NcclReduce {
    /// Joins rank `rank` of `world` to the group of `id` on `backend`'s GPU (blocks until every
    /// rank has joined).
    pub fn new(backend: &CudaBackend, rank: usize, world: usize, id: NcclId) -> Result<Self> {
        Ok(NcclReduce { comm: NcclComm::new(backend.compute_stream(), rank, world, id.0)? })
    }
}

impl GradReduce for NcclReduce {
    fn sum(&self, buf: &candle_core::Tensor) -> Result<()> {
        self.comm.all_reduce_sum_f32(buf)
    }
}

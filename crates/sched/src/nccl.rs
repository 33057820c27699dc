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
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// A new id (loads libnccl: see README, "Several GPUs").
    pub fn new() -> Result<Self> {
        Ok(NcclId(nccl_unique_id()?))
    }

    /// The id's bytes, as a rendezvous ships them to the other processes (`mt_dist`'s blob).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id another process made ([`NcclId::to_bytes`]); refuses a blob of another length.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let b: &[u8; Self::BYTES] = bytes.try_into().map_err(|_| {
            crate::Error::Options(format!(
                "an NCCL id is {} bytes, the rendezvous shipped {}: ranks of different builds?",
                Self::BYTES,
                bytes.len()
            ))
        })?;
        Ok(NcclId(cudarc::nccl::sys::ncclUniqueId { internal: b.map(|c| c as _) }))
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
        self.comm.all_reduce_sum(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::NcclId;

    /// An id survives its bytes (what the rendezvous ships), and a blob of another length is
    /// refused with a sentence: no NCCL call needed.
    #[test]
    fn an_id_round_trips_through_its_bytes() {
        let bytes: Vec<u8> = (0..NcclId::BYTES).map(|i| (i * 37 % 256) as u8).collect();
        assert_eq!(NcclId::from_bytes(&bytes).unwrap().to_bytes().to_vec(), bytes);
        let e = NcclId::from_bytes(&bytes[..5]).unwrap_err().to_string();
        assert!(e.contains("128 bytes") && e.contains("shipped 5"), "{e}");
    }
}

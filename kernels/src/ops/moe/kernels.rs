//! The two sets of grouped GEMM kernels a routing's products can run (decision 0050): moe.cu's
//! mma.sync kernels (any GPU of compute capability 8.0 or later, the PTX of `MOE`) and
//! moe_hopper.cu's wgmma kernels (compute capability 9.0 only: an sm_90a CUBIN of both files),
//! each with its launch geometry. Both take the same arguments and write the same outputs.

use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::CudaDevice;

use super::{allow_smem, func, msg};
use crate::ops::nvrtc::{sm90a_runs, Cubin};
use crate::ops::sources::{COMMON, HOPPER, MOE, MOE_HOPPER};

/// Which grouped GEMM kernels a routing's products run ([`super::MoeRouting::with_gemm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeGemm {
    /// The GPU's default: the wgmma kernels on compute capability 9.0 (measured 1.1x the best
    /// mma.sync variant's GEMMs on an H200, decision 0050), moe.cu's mma.sync ones elsewhere.
    #[default]
    Auto,
    /// moe.cu's mma.sync kernels (compute capability 8.0 and later).
    MmaSync,
    /// moe_hopper.cu's wgmma kernels (compute capability 9.0 only).
    Wgmma,
}

/// A kernel set: its names' prefix and launch geometry (the kernels' own constants: moe.cu's
/// `MT_MOE_*` defaults, moe_hopper.cu's `MoeH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GemmSet {
    /// `mt_moe_gemm_` or `mt_moe_hgemm_`, followed by `nk`, `kn`, `kn_dmid` or `wgrad`.
    prefix: &'static str,
    /// Rows (M-grouped: routed rows; K-grouped: the gradient's rows) and columns of a CTA tile.
    pub(super) bm: usize,
    pub(super) bn: usize,
    /// Threads of a CTA.
    pub(super) threads: u32,
    /// Dynamic shared memory of a CTA (opted in past 48 KiB).
    pub(super) smem: u32,
}

/// moe.cu's k step and stages (`MT_MOE_BK`, `MT_MOE_STAGES`).
const MMA_BK: usize = 32;
const MMA_STAGES: usize = 3;
/// moe_hopper.cu's k step and stages (`MoeH::BK`, `MT_MOE_H_STAGES`).
const WG_BK: usize = 64;
const WG_STAGES: usize = 4;

impl GemmSet {
    /// moe.cu: 128 x 128 tiles, 8 warps; each stage an A and a B tile of bf16.
    pub(super) const MMA_SYNC: GemmSet = GemmSet {
        prefix: "mt_moe_gemm_",
        bm: 128,
        bn: 128,
        threads: 256,
        smem: (MMA_STAGES * (128 + 128) * MMA_BK * 2) as u32,
    };
    /// moe_hopper.cu: 128 x 256 tiles, three warpgroups; the stages, their full and empty
    /// barriers, the job, the gathered rows of two k steps, and 1 KiB to align the base.
    pub(super) const WGMMA: GemmSet = GemmSet {
        prefix: "mt_moe_hgemm_",
        bm: 128,
        bn: 256,
        threads: 384,
        smem: (WG_STAGES * (128 + 256) * WG_BK * 2 + 16 * WG_STAGES + 16 + 8 * WG_BK + 1024) as u32,
    };

    /// The set `choice` asks for on `dev`, or an error where it cannot run there.
    pub(super) fn pick(choice: MoeGemm, dev: &CudaDevice) -> candle_core::Result<GemmSet> {
        match choice {
            MoeGemm::Auto if sm90a_runs(dev) => Ok(GemmSet::WGMMA),
            MoeGemm::Auto | MoeGemm::MmaSync => Ok(GemmSet::MMA_SYNC),
            MoeGemm::Wgmma if sm90a_runs(dev) => Ok(GemmSet::WGMMA),
            MoeGemm::Wgmma => Err(msg(
                "moe: the wgmma GEMMs run on a GPU of compute capability 9.0 (H100, H200) with MEGATRAIN_NVRTC_CC unset or 90",
            )),
        }
    }

    /// Kernel `kind` (`nk`, `kn`, `kn_dmid`, `wgrad`) of the set, allowed its shared memory.
    pub(super) fn func(&self, dev: &CudaDevice, kind: &str) -> candle_core::Result<CudaFunction> {
        let name = format!("{}{kind}", self.prefix);
        let f = if *self == GemmSet::WGMMA {
            CUBIN.function(dev, &name, wgmma_source)?
        } else {
            func(dev, &name)?
        };
        allow_smem(&f, self.smem)?;
        Ok(f)
    }
}

/// The wgmma kernels' CUBIN.
static CUBIN: Cubin = Cubin::new("moe_hopper.cu");

/// Its source: the geometry launched here (the kernels refuse to compile if theirs differs),
/// the shared helpers, the Hopper wrappers, moe.cu (whose helpers moe_hopper.cu uses), then
/// moe_hopper.cu.
fn wgmma_source() -> String {
    let g = GemmSet::WGMMA;
    format!(
        "#define MT_MOE_HOPPER 1\n#define MT_MOE_EXPECT_SMEM {}\n#define MT_MOE_EXPECT_THREADS {}\n#define MT_MOE_EXPECT_BM {}\n#define MT_MOE_EXPECT_BN {}\n#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"hopper.cuh\"\n{HOPPER}\n#line 1 \"{}\"\n{}\n#line 1 \"{}\"\n{}",
        g.smem, g.threads, g.bm, g.bn, MOE.file, MOE.text, MOE_HOPPER.file, MOE_HOPPER.text
    )
}

/// The wgmma kernels' CUBIN, compiled once per process (for the test that it compiles cleanly).
#[cfg(test)]
pub(crate) fn wgmma_cubin() -> candle_core::Result<&'static [u8]> {
    CUBIN.bytes(wgmma_source)
}

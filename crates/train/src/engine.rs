//! The device a run computes on, behind one type: the CPU backend or (with the `cuda` feature)
//! GPU 0, and the engine over it, so the trainer needs no `cfg` and no backend type parameter.

use std::sync::Arc;

use mt_core::ModelConfig;
use mt_sched::placement::DeviceKind;
use mt_sched::{Batch, CpuBackend, CpuOptions, Engine, EngineOptions, StepReport};
use mt_store::HostStore;

use crate::error::{Context, Result};
use crate::{Device, TrainConfig};

/// An opened backend, before the engine starts on it.
pub(crate) enum Backend {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(mt_sched::CudaBackend),
}

/// The engine on its backend.
pub(crate) enum DeviceEngine {
    Cpu(Engine<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<mt_sched::CudaBackend>),
}

/// Runs `$body` with `$e` bound to the engine, whichever backend it is on.
macro_rules! on_engine {
    ($engine:expr, $e:ident => $body:expr) => {
        match $engine {
            DeviceEngine::Cpu($e) => $body,
            #[cfg(feature = "cuda")]
            DeviceEngine::Cuda($e) => $body,
        }
    };
}

impl Device {
    /// The planner's word for this device.
    pub fn kind(self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda => DeviceKind::Gpu,
        }
    }
}

impl Backend {
    /// Opens the device `c` asks for; refuses CUDA in a build without the `cuda` feature.
    pub(crate) fn open(c: &TrainConfig) -> Result<Self> {
        let opts = CpuOptions::uniform(c.delay_us, c.seed);
        match c.device {
            Device::Cpu => Ok(Backend::Cpu(CpuBackend::new(opts))),
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                let b = mt_sched::CudaBackend::new(0, opts)
                    .context_with(|| "--device cuda: cannot open GPU 0".into())?;
                Ok(Backend::Cuda(b))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => Err(crate::Error::Options(
                "--device cuda: this megatrain was built without the cuda feature; use --device cpu".into(),
            )),
        }
    }

    /// What the device is, in one line (`None` on the CPU).
    pub(crate) fn describe(&self) -> Option<String> {
        match self {
            Backend::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => Some(b.describe()),
        }
    }

    /// Device memory the plan may assume, before `--gpu-mem`: the GPU's total, or on the CPU
    /// (whose "device" buffers are host memory) the host's available memory.
    pub(crate) fn memory_bytes(&self, host_available: u64) -> Result<u64> {
        match self {
            Backend::Cpu(_) => Ok(host_available),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => Ok(b.mem_info().context_with(|| "reading the GPU's memory".into())?.1 as u64),
        }
    }

    /// Whether bf16 runs through the fused CUDA kernels here (`mt_layers::fused_kernels`).
    pub(crate) fn fused_kernels(&self, dtype: candle_core::DType) -> bool {
        match self {
            Backend::Cpu(_) => {
                let _ = dtype;
                false
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => mt_layers::fused_kernels(mt_sched::Backend::device(b), dtype),
        }
    }

    /// Starts the engine: device pool, page-locked rings, resident units loaded from the store.
    pub(crate) fn start(
        self,
        cfg: &ModelConfig,
        store: Arc<HostStore>,
        opts: EngineOptions,
    ) -> Result<DeviceEngine> {
        let what = || "starting the engine".to_string();
        Ok(match self {
            Backend::Cpu(b) => DeviceEngine::Cpu(Engine::new(cfg, store, b, opts).context_with(what)?),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => DeviceEngine::Cuda(Engine::new(cfg, store, b, opts).context_with(what)?),
        })
    }
}

impl DeviceEngine {
    /// One optimizer step on `batch` at learning rate `lr`.
    pub(crate) fn step(&mut self, batch: &Batch, lr: f64) -> mt_sched::Result<StepReport> {
        on_engine!(self, e => e.step(batch, lr))
    }

    /// Injects a NaN or infinity into the next step (tests only).
    pub(crate) fn inject(&mut self, fault: mt_sched::Fault) {
        on_engine!(self, e => e.inject(fault))
    }

    /// Applies a pending exact-mode update and writes resident units back into the store.
    pub(crate) fn flush_pending(&mut self) -> mt_sched::Result<()> {
        on_engine!(self, e => e.flush_pending())
    }

    /// Summed loss over `batch`'s targets and their count, under the store's weights.
    pub(crate) fn loss_sum(&mut self, batch: &Batch) -> mt_sched::Result<(f64, usize)> {
        on_engine!(self, e => e.loss_sum(batch))
    }

    /// Bytes of the store page-locked in place for GPU-updated layers.
    pub(crate) fn pinned_record_bytes(&self) -> usize {
        on_engine!(self, e => e.pinned_record_bytes())
    }
}

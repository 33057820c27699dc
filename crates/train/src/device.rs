//! The device a run computes on, behind one type: the CPU backend or (with the `cuda` feature)
//! this process's first GPU, and the engine over it, so the trainer needs no `cfg` and no
//! backend type parameter.

use std::sync::Arc;

use mt_core::ModelConfig;
use mt_sched::placement::DeviceKind;
use mt_sched::{Batch, CpuBackend, CpuOptions, Engine, EngineOptions, StepReport};
use mt_store::HostStore;

use crate::error::{Context, Result};
use crate::{Device, TrainConfig};

/// The device a run opened (its backend), before the engine starts on it.
pub(crate) enum OpenedDevice {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(mt_sched::CudaBackend),
}

/// The engine on its backend.
pub(crate) enum DeviceEngine {
    Cpu(Engine<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<mt_sched::CudaBackend>),
    /// `--gpus N` above 1: one engine per GPU, on threads of their own (`mt_sched::Ranks`).
    #[cfg(feature = "nccl")]
    Ranks(mt_sched::Ranks<mt_sched::CudaBackend>),
}

/// Runs `$body` with `$e` bound to the engine, whichever backend it is on; on data-parallel
/// ranks, `$ranks` with `$r` bound to them.
macro_rules! on_engine {
    ($engine:expr, $e:ident => $body:expr, $r:ident => $ranks:expr) => {
        match $engine {
            DeviceEngine::Cpu($e) => $body,
            #[cfg(feature = "cuda")]
            DeviceEngine::Cuda($e) => $body,
            #[cfg(feature = "nccl")]
            DeviceEngine::Ranks($r) => $ranks,
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

impl OpenedDevice {
    /// Opens the device `c` asks for; refuses CUDA in a build without the `cuda` feature.
    pub(crate) fn open(c: &TrainConfig) -> Result<Self> {
        let opts = CpuOptions::uniform(c.delay_us, c.seed);
        match c.device {
            Device::Cpu => Ok(OpenedDevice::Cpu(CpuBackend::new(opts))),
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                let gpu = c.first_gpu();
                let b = mt_sched::CudaBackend::new(gpu, opts)
                    .context_with(|| format!("--device cuda: cannot open GPU {gpu}"))?;
                Ok(OpenedDevice::Cuda(b))
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
            OpenedDevice::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            OpenedDevice::Cuda(b) => Some(b.describe()),
        }
    }

    /// Device memory the plan may assume, before `--gpu-mem`: the GPU's total, or on the CPU
    /// (whose "device" buffers are host memory) the host's available memory.
    pub(crate) fn memory_bytes(&self, host_available: u64) -> Result<u64> {
        match self {
            OpenedDevice::Cpu(_) => Ok(host_available),
            #[cfg(feature = "cuda")]
            OpenedDevice::Cuda(b) => {
                Ok(b.mem_info().context_with(|| "reading the GPU's memory".into())?.1 as u64)
            }
        }
    }

    /// Which of our kernels run here for `cfg` with activations of `dtype`
    /// (`mt_layers::fused_kernels`, `mt_layers::hopper_attention`, `mt_layers::moe_kernels_apply`).
    pub(crate) fn kernels(
        &self,
        cfg: &ModelConfig,
        dtype: candle_core::DType,
        flash_kernel: mt_layers::FlashKernel,
        moe_kernels: mt_layers::MoeKernels,
    ) -> crate::DeviceKernels {
        match self {
            OpenedDevice::Cpu(_) => {
                let _ = (cfg, dtype, flash_kernel, moe_kernels);
                crate::DeviceKernels::default()
            }
            #[cfg(feature = "cuda")]
            OpenedDevice::Cuda(b) => {
                let d = mt_sched::Backend::device(b);
                crate::DeviceKernels {
                    fused: mt_layers::fused_kernels(d, dtype),
                    hopper_attention: mt_layers::hopper_attention(d, dtype, cfg.head_dim, flash_kernel),
                    moe: mt_layers::moe_kernels_apply(cfg, d, dtype, moe_kernels),
                }
            }
        }
    }

    /// Starts the engine: device pool, page-locked rings, resident units loaded from the store;
    /// data-parallel ranks with `--gpus` above 1 or in a job of several processes.
    pub(crate) fn start(
        self,
        cfg: &ModelConfig,
        store: Arc<HostStore>,
        opts: EngineOptions,
        c: &TrainConfig,
        cpu: CpuOptions,
    ) -> Result<DeviceEngine> {
        let what = || "starting the engine".to_string();
        if c.ranks() > 1 {
            return self.start_ranks(cfg, store, opts, c, cpu);
        }
        Ok(match self {
            OpenedDevice::Cpu(b) => DeviceEngine::Cpu(Engine::new(cfg, store, b, opts).context_with(what)?),
            #[cfg(feature = "cuda")]
            OpenedDevice::Cuda(b) => DeviceEngine::Cuda(Engine::new(cfg, store, b, opts).context_with(what)?),
        })
    }
}

impl OpenedDevice {
    /// Data parallel: one engine per GPU `0..gpus` of this host, each on its own thread with its
    /// own CUDA context and streams, over the one host store, its gradients summed through NCCL
    /// with every rank of the job. Alone, this process is the job (ranks `0..gpus`, a new NCCL
    /// id); in a job of several processes ([`crate::JobPlace`]) it runs ranks
    /// `process * gpus ..` of `processes * gpus`, in the group of the id process 0 made, its
    /// first rank landing its store, on its host's GPUs `first_gpu ..`. The first, opened for
    /// planning, is given back first (this process's first rank opens it again on its thread).
    #[cfg(feature = "nccl")]
    fn start_ranks(
        self,
        cfg: &ModelConfig,
        store: Arc<HostStore>,
        opts: EngineOptions,
        c: &TrainConfig,
        cpu: CpuOptions,
    ) -> Result<DeviceEngine> {
        use mt_sched::{CudaBackend, DataParallel, NcclId, NcclReduce};
        let gpus = c.gpus;
        let OpenedDevice::Cuda(first_gpu) = self else {
            return Err(crate::Error::Options(format!("--gpus {gpus} needs --device cuda")));
        };
        drop(first_gpu);
        let have = CudaBackend::device_count().context_with(|| "counting the GPUs".into())?;
        let gpu0 = c.first_gpu();
        if gpu0 + gpus > have {
            let from = match gpu0 {
                0 => String::new(),
                g => format!(" from GPU {g} (the launcher's local rank times --gpus)"),
            };
            let fit = have.saturating_sub(gpu0);
            return Err(crate::Error::Options(format!(
                "--gpus {gpus}{from}: this machine has {have} GPU(s) visible (CUDA_VISIBLE_DEVICES?); use --gpus {fit} or fewer"
            )));
        }
        let (first, world) = match &c.job {
            Some(j) => (j.process * gpus, j.processes * gpus),
            None => (0, gpus),
        };
        let id = match &c.job {
            Some(j) => NcclId::from_bytes(&j.nccl_id).context_with(|| "the job's NCCL id".into())?,
            None => NcclId::new().context_with(|| {
                "--gpus: NCCL is not usable (is libnccl.so on LD_LIBRARY_PATH? README, \"Several GPUs\")"
                    .into()
            })?,
        };
        let c2 = cfg.clone();
        let ranks = mt_sched::Ranks::start_part(cfg, first, gpus, world, move |rank| {
            let b = CudaBackend::new(gpu0 + rank - first, cpu)?;
            let reduce = NcclReduce::new(&b, rank, world, id)?;
            let mut e = Engine::new(&c2, Arc::clone(&store), b, opts.clone())?;
            e.set_data_parallel(DataParallel { rank, world, lead: first, reduce: Box::new(reduce) })?;
            Ok(e)
        })
        .context_with(|| match &c.job {
            Some(j) => format!(
                "starting ranks {first}..{} of the job's {world} (process {} of {})",
                first + gpus,
                j.process,
                j.processes
            ),
            None => format!("starting {gpus} data-parallel engines"),
        })?;
        Ok(DeviceEngine::Ranks(ranks))
    }

    #[cfg(not(feature = "nccl"))]
    fn start_ranks(
        self,
        _cfg: &ModelConfig,
        _store: Arc<HostStore>,
        _opts: EngineOptions,
        c: &TrainConfig,
        _cpu: CpuOptions,
    ) -> Result<DeviceEngine> {
        Err(nccl_missing(&format!("--gpus {} over {} GPUs in all", c.gpus, c.ranks())))
    }
}

/// A new NCCL unique id's bytes, for process 0 of a job of several to ship to the others through
/// the rendezvous ([`crate::JobPlace::nccl_id`]).
pub fn nccl_unique_id() -> Result<Vec<u8>> {
    #[cfg(feature = "nccl")]
    {
        let id = mt_sched::NcclId::new().context_with(|| {
            "NCCL is not usable (is libnccl.so on LD_LIBRARY_PATH? README, \"Several GPUs\")".into()
        })?;
        Ok(id.to_bytes().to_vec())
    }
    #[cfg(not(feature = "nccl"))]
    Err(nccl_missing("a job of several processes"))
}

#[cfg(not(feature = "nccl"))]
fn nccl_missing(what: &str) -> crate::Error {
    crate::Error::Options(format!(
        "{what}: this megatrain was built without the nccl feature (cargo build --features megatrain/nccl); use --gpus 1 in one process"
    ))
}

impl DeviceEngine {
    /// One optimizer step on `batch` at learning rate `lr`.
    pub(crate) fn step(&mut self, batch: &Batch, lr: f64) -> mt_sched::Result<StepReport> {
        on_engine!(self, e => e.step(batch, lr), r => r.step(batch, lr))
    }

    /// Injects a NaN or infinity into the next step (tests only); on data-parallel ranks, into
    /// rank 0's share (a gradient fault reaches every rank through the gradient sum, a loss fault
    /// through the ranks' agreement on the skip).
    pub(crate) fn inject(&mut self, fault: mt_sched::Fault) -> mt_sched::Result<()> {
        on_engine!(self, e => {
            e.inject(fault);
            Ok(())
        }, r => r.with_rank0(move |e| e.inject(fault)))
    }

    /// Applies a pending exact-mode update and writes resident units back into the store.
    pub(crate) fn flush_pending(&mut self) -> mt_sched::Result<()> {
        // Rank 0 applies it to every record; the other ranks hold no device state.
        on_engine!(self, e => e.flush_pending(), r => r.with_rank0(|e| e.flush_pending()).and_then(|x| x))
    }

    /// Summed loss over `batch`'s targets and their count, under the store's weights.
    pub(crate) fn loss_sum(&mut self, batch: &Batch) -> mt_sched::Result<(f64, usize)> {
        on_engine!(self, e => e.loss_sum(batch), r => {
            let batch = batch.clone();
            r.with_rank0(move |e| e.loss_sum(&batch)).and_then(|x| x)
        })
    }

    /// `values` summed over every data-parallel rank of the job (each rank adds its own); alone,
    /// `values`.
    pub(crate) fn sum_over_ranks(&self, values: &[f64]) -> mt_sched::Result<Vec<f64>> {
        on_engine!(self, e => e.sum_over_ranks(values), r => r.sum_over_ranks(values))
    }

    /// Bytes of the store page-locked in place for GPU-updated layers.
    pub(crate) fn pinned_record_bytes(&self) -> usize {
        // Data parallel refuses GPU-updated layers: nothing is pinned in place.
        on_engine!(self, e => e.pinned_record_bytes(), _r => 0)
    }
}

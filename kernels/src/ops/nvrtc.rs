//! Compiling our CUDA sources with NVRTC: once per process and source, for the architecture of
//! the process's GPU (no nvcc at build time, so the CPU-only CI and the GPU machine build the same
//! way; one release binary serves compute capability 8.0 to 9.0), the PTX then loaded through
//! candle's per-device module cache. The sources themselves are listed in `sources.rs`.

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use candle_core::cuda_backend::WrapErr;
use candle_core::CudaDevice;

use super::msg;
use super::sources::COMMON;

/// NVRTC's target: the virtual architecture of the process's GPU ([`note_device`]; one GPU per
/// process), `compute_80` until a device is known (PTX that the driver compiles for any GPU of
/// compute capability 8.0 or later: right everywhere, if not tuned for newer ones).
static ARCH: OnceLock<&'static str> = OnceLock::new();

/// The virtual architecture NVRTC targets for a GPU of compute capability `major.minor`: the
/// newest of those our kernels are built and checked for that is not above it (A100 8.0, RTX 30xx
/// 8.6, RTX 40xx / L40S 8.9, H100 / H200 9.0); a newer GPU gets `compute_90`, whose PTX its
/// driver compiles forward.
pub(crate) fn nvrtc_arch(major: i32, minor: i32) -> &'static str {
    const ARCHS: [(i32, &str); 5] =
        [(75, "compute_75"), (80, "compute_80"), (86, "compute_86"), (89, "compute_89"), (90, "compute_90")];
    let cc = major * 10 + minor;
    ARCHS.iter().rev().find(|(a, _)| *a <= cc).map_or(ARCHS[0].1, |(_, name)| name)
}

/// Records the process's GPU for NVRTC ([`ARCH`]; the first device noted wins) and returns its
/// architecture. `MEGATRAIN_NVRTC_CC=80` (or 86, 89) compiles for that older capability instead:
/// the A100's PTX on an H100, so one Hopper machine checks the portable build's kernels.
pub(crate) fn note_device(dev: &candle_core::CudaDevice) -> &'static str {
    ARCH.get_or_init(|| {
        let found =
            dev.cuda_stream().context().compute_capability().ok().map(|(major, minor)| major * 10 + minor);
        let forced = std::env::var("MEGATRAIN_NVRTC_CC").ok().and_then(|s| s.trim().parse::<i32>().ok());
        let cc = match (found, forced) {
            (Some(d), Some(f)) => Some(d.min(f)),
            (d, f) => d.or(f),
        };
        cc.map_or("compute_80", |cc| nvrtc_arch(cc / 10, cc % 10))
    })
}

/// Whether `dev` runs our `sm_90a` code (the Hopper kernels): a GPU of compute capability 9.0
/// exactly (sm_90a code runs on nothing else) and no `MEGATRAIN_NVRTC_CC` below 90 (which asks
/// for an older GPU's code, the portable kernels, on this one).
pub(crate) fn sm90a_runs(dev: &CudaDevice) -> bool {
    let cc = dev.cuda_stream().context().compute_capability().ok();
    let forced = std::env::var("MEGATRAIN_NVRTC_CC").ok().and_then(|s| s.trim().parse::<i32>().ok());
    cc == Some((9, 0)) && forced.is_none_or(|f| f >= 90)
}

/// One CUDA source file of `kernels/cuda/` (`sources.rs` lists them all), compiled at its first
/// use and kept for the process.
pub(crate) struct Source {
    /// Its file name under `kernels/cuda/`: NVRTC's program name and the file its messages name.
    pub(crate) file: &'static str,
    /// Its module's name in candle's per-device module cache (the second argument of
    /// `CudaDevice::get_or_load_custom_func`).
    pub(crate) module: &'static str,
    /// The CUDA C.
    pub(crate) text: &'static str,
    /// Its PTX, or NVRTC's complaint, once compiled.
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl Source {
    /// `file` (under `kernels/cuda/`, its text `text`), loaded as candle module `module`.
    pub(crate) const fn new(file: &'static str, module: &'static str, text: &'static str) -> Self {
        Source { file, module, text, ptx: OnceLock::new() }
    }

    /// The source's PTX for the process's GPU ([`note_device`]; `compute_80` if none is noted
    /// yet), compiled by the first call; a compile error is kept and returned by every call.
    pub(crate) fn ptx(&'static self) -> candle_core::Result<&'static str> {
        let r = self.ptx.get_or_init(|| {
            // No FMA contraction: candle rounds every multiply and add separately, and the kernels
            // promise the same roundings (kernels/cuda/fused.cu).
            let opts = CompileOptions {
                arch: Some(ARCH.get().copied().unwrap_or("compute_80")),
                name: Some(self.file.into()),
                fmad: Some(false),
                ..Default::default()
            };
            // The shared helpers first; `#line` keeps NVRTC's messages pointing into the right file.
            let src = format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{}", self.file, self.text);
            compile_ptx_with_opts(src, opts).map(|p| p.to_src()).map_err(|e| format!("{e:?}"))
        });
        r.as_deref().map_err(|e| msg(format!("NVRTC compiling kernels/cuda/{}: {e}", self.file)))
    }
}

/// ptxas's words for a kernel that lost what it was written for, said as "info" lines with a
/// code: `setmaxnreg` ignored (C7508: no register split between producer and consumer warps),
/// wgmma serialised (C7510, C7515) or a wait injected after one (C7517: no overlap of the tensor
/// cores with anything else); all are "Potential Performance Loss" or name the wgmma pipeline.
const FATAL_PTXAS: [&str; 7] =
    ["Potential Performance Loss", "C7508", "C7510", "C7515", "C7517", "serializ", "injected"];

/// Compiles `src` with NVRTC for the real architecture `arch` (`sm_90a`: wgmma and setmaxnreg
/// exist only there) into a CUBIN, with ptxas's report on: refused, with ptxas's words, if any
/// line says the kernels lost their Hopper features (on the PTX route ptxas would run inside
/// the driver at load time and those warnings would never be seen). Same options as [`Source`]
/// otherwise (C++17, no FMA contraction).
///
/// A CUBIN whose compile carried ptxas's report and passed is kept between processes
/// ([`crate::cubin_cache`], under the hash of the source, options, NVRTC's version and the list
/// of ptxas's words it was checked against): a fresh compile of the Hopper attention kernels
/// takes ~16 s.
pub(crate) fn compile_cubin(src: &str, name: &str, arch: &str) -> Result<Vec<u8>, String> {
    let version = nvrtc_version();
    let opts = cubin_options(arch).join(" ");
    // The check too: a CUBIN checked against another list of ptxas's words is not this one's.
    let check = FATAL_PTXAS.join("\n");
    let parts: [&[u8]; 6] = [
        src.as_bytes(),
        name.as_bytes(),
        arch.as_bytes(),
        opts.as_bytes(),
        version.as_bytes(),
        check.as_bytes(),
    ];
    crate::cubin_cache::CubinCache::from_env().get_or_compile(&parts, || {
        let (result, log) = compile_cubin_logged(src, name, arch);
        result.map(|cubin| (cubin, log.contains("ptxas")))
    })
}

/// NVRTC's version as `major.minor` (a part of a cached CUBIN's key), or `unknown`.
fn nvrtc_version() -> String {
    use candle_core::cuda_backend::cudarc::nvrtc::sys;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out pointers; NVRTC writes one int to each.
    match unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result() {
        Ok(()) => format!("{major}.{minor}"),
        Err(_) => "unknown".into(),
    }
}

/// The NVRTC options of [`compile_cubin`] for `arch`.
fn cubin_options(arch: &str) -> [String; 5] {
    [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "--ptxas-options=-v".into(),
        // A cached compile says nothing from ptxas (see compile_cubin_logged).
        "--no-cache".into(),
    ]
}

/// [`compile_cubin`]'s result with NVRTC's whole log beside it (ptxas's report included).
/// NVRTC's compile cache is off (`--no-cache`): a compile served from it (NVRTC 12.9 on, the
/// second process on a machine to compile a source) comes back with no word from ptxas, so on
/// the H200 machines most processes' logs were empty and a lost Hopper feature would have passed
/// unseen (the probe test failed 2 of 3 runs). A CUBIN that still comes without ptxas's report is
/// used, as before this check existed, with a warning on standard error (refusing it would stop
/// a run over a missing log, not a known loss).
pub(crate) fn compile_cubin_logged(src: &str, name: &str, arch: &str) -> (Result<Vec<u8>, String>, String) {
    use candle_core::cuda_backend::cudarc::nvrtc::{result, sys};
    use std::ffi::CString;

    let (c_src, c_name) = match (CString::new(src), CString::new(name)) {
        (Ok(s), Ok(n)) => (s, n),
        _ => return (Err("the source or its name holds a NUL byte".into()), String::new()),
    };
    let prog = match result::create_program(&c_src, Some(&c_name)) {
        Ok(p) => p,
        Err(e) => return (Err(format!("{e:?}")), String::new()),
    };
    let opts = cubin_options(arch);
    // SAFETY: `prog` was just created and is destroyed once, below, after its last use; the
    // options are NUL-free strings (cudarc turns them into C strings).
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: as above; the log and the CUBIN are copied out of NVRTC before the destroy.
    let log = unsafe { result::get_program_log(prog) }
        .map(|l| l.iter().map(|&c| c as u8).take_while(|&c| c != 0).map(char::from).collect::<String>())
        .unwrap_or_default();
    let cubin = compiled.map_err(|e| format!("{e:?}: {log}")).and_then(|()| {
        let mut size = 0usize;
        // SAFETY: `prog` compiled; `size` is a valid out pointer.
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| format!("{e:?}"))?;
        let mut bytes = vec![0u8; size];
        // SAFETY: `bytes` has the `size` bytes NVRTC reported for the CUBIN it writes.
        unsafe { sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast()) }
            .result()
            .map_err(|e| format!("{e:?}"))?;
        Ok(bytes)
    });
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { result::destroy_program(prog) };
    let fatal: Vec<&str> = log.lines().filter(|l| FATAL_PTXAS.iter().any(|w| l.contains(w))).collect();
    let result = match cubin {
        Ok(_) if !fatal.is_empty() => Err(format!("ptxas: {}", fatal.join("; "))),
        other => other,
    };
    if result.is_ok() && !log.contains("ptxas") {
        eprintln!(
            "warning: NVRTC compiled {name} for {arch} without ptxas's report, so whether its \
             kernels kept their {arch} features (setmaxnreg, asynchronous wgmma) was not checked"
        );
    }
    (result, log)
}

/// An `sm_90a` CUBIN of our sources (the Hopper kernels: `flash_hopper.rs`, `moe/`): compiled by
/// [`compile_cubin`] once per process (its error kept for every later call) and loaded once per
/// GPU of the process.
pub(crate) struct Cubin {
    /// The kernel file the CUBIN is named after (in messages).
    file: &'static str,
    bytes: OnceLock<Result<Vec<u8>, String>>,
    modules: Mutex<Vec<(usize, Arc<CudaModule>)>>,
}

impl Cubin {
    /// The CUBIN of `kernels/cuda/<file>` (and what it is compiled with), not compiled yet.
    pub(crate) const fn new(file: &'static str) -> Self {
        Cubin { file, bytes: OnceLock::new(), modules: Mutex::new(Vec::new()) }
    }

    /// The CUBIN, compiled from `src()` by the first call.
    pub(crate) fn bytes(&self, src: impl FnOnce() -> String) -> candle_core::Result<&[u8]> {
        let r = self.bytes.get_or_init(|| compile_cubin(&src(), self.file, "sm_90a"));
        r.as_deref().map_err(|e| msg(format!("NVRTC compiling kernels/cuda/{}: {e}", self.file)))
    }

    /// Kernel `name` of the CUBIN loaded on `dev`'s GPU (compiled from `src()` if it is not yet).
    pub(crate) fn function(
        &self,
        dev: &CudaDevice,
        name: &str,
        src: impl FnOnce() -> String,
    ) -> candle_core::Result<CudaFunction> {
        let ctx = dev.cuda_stream().context().clone();
        let ordinal = ctx.ordinal();
        let mut mods = self
            .modules
            .lock()
            .map_err(|_| msg(format!("the module cache of kernels/cuda/{} was poisoned", self.file)))?;
        let module = match mods.iter().find(|(o, _)| *o == ordinal) {
            Some((_, m)) => m.clone(),
            None => {
                let m = ctx.load_module(Ptx::from_binary(self.bytes(src)?.to_vec())).w()?;
                mods.push((ordinal, m.clone()));
                m
            }
        };
        module.load_function(name).w()
    }
}

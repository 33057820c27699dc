"""The Hopper flash attention kernels (kernels/cuda/flash_attn_hopper.cu) from Python, for the kernel
benchmark and its checks: NVRTC to an sm_90a CUBIN and the CUDA driver through ctypes (the TMA
descriptors are kernel parameters passed by value, which CuPy's launcher cannot do), tensors and
streams from torch. The launch geometry, shared-memory sizes and buffers are the engine's
(kernels/src/ops/flash_hopper.rs); a change to one is a change to both.

`python3 scripts/hopper_attention.py --compile-only` needs no GPU: it compiles the kernels with
the NVRTC library it finds (CUDA 13.0, e.g. the toolchain of scripts/cuda-toolchain.sh), prints
ptxas's resource report and the kernels' spills, and fails on ptxas's words that the kernels lost
their Hopper features (setmaxnreg ignored, wgmma serialised or a wait injected).
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels" / "cuda"
THREADS = 384
BM, BN, BQ = 128, 128, 64
# ptxas lines that mean the kernel is not what it was written to be.
BAD_PTXAS = ("setmaxnreg ignored", "serialized", "bytes spill stores", "Local memory")


def source(extra: str = "") -> str:
    parts = [("common.cuh", KERNELS / "common.cuh"), ("flash_attn.cu", KERNELS / "flash_attn.cu"),
             ("hopper.cuh", KERNELS / "hopper.cuh"), ("flash_attn_hopper.cu", KERNELS / "flash_attn_hopper.cu")]
    text = "".join(f'#line 1 "{n}"\n{p.read_text()}\n' for n, p in parts)
    return text + extra


def smem_fwd(hd: int, stages: int = 3) -> int:
    tq, tk = BM * hd * 2, BN * hd * 2
    return tq + 2 * stages * tk + 8 * (1 + 4 * stages) + 8 + 1024


def smem_bwd(hd: int) -> int:
    tk, tq, ds, dq = BN * hd * 2, BQ * hd * 2, BN * BQ * 2, BQ * hd * 4
    return 2 * tk + 4 * tq + 2 * ds + 2 * dq + 4 * BQ * 4 + 8 * 9 + 8 + 1024


# --- NVRTC ---------------------------------------------------------------------------------------

def _find_lib(names, hints):
    for h in hints:
        for n in names:
            for p in sorted(glob.glob(os.path.join(h, n))):
                try:
                    # NVRTC opens its builtins library by name: load the one beside it first.
                    for b in sorted(glob.glob(os.path.join(h, "libnvrtc-builtins.so.*"))):
                        if ".alt." not in b:
                            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                    return ctypes.CDLL(p)
                except OSError:
                    pass
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            pass
    raise OSError(f"none of {names} found (looked in {hints} and the loader path)")


def nvrtc_lib():
    hints = []
    for env in ("MEGATRAIN_CUDA_PREFIX",):
        if os.environ.get(env):
            hints += glob.glob(os.path.join(os.environ[env], "lib/python3*/site-packages/nvidia/cu13/lib"))
    hints += glob.glob(str(ROOT / ".venv-cuda/lib/python3*/site-packages/nvidia/cu13/lib"))
    hints += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
    try:
        import nvidia  # torch's CUDA wheels

        for p in nvidia.__path__:
            hints += glob.glob(os.path.join(p, "cu13/lib")) + glob.glob(os.path.join(p, "cuda_nvrtc/lib"))
    except ImportError:
        pass
    return _find_lib(["libnvrtc.so.13", "libnvrtc.so"], hints)


def compile_cubin(src: str, name: str = "flash_attn_hopper.cu", arch: str = "sm_90a", extra_opts=()):
    """Returns (cubin bytes, compile log). Raises with the log on an error."""
    lib = nvrtc_lib()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed ({rc})")
    # --no-cache: NVRTC (12.9 on) serves a source it compiled before without ptxas's report,
    # and the report is what says the kernels kept their Hopper features (and their spills).
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "--fmad=false", "--ptxas-options=-v",
            "--no-cache", "-lineinfo", *extra_opts]
    copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    log_s = log.value.decode(errors="replace")
    if rc != 0:
        raise RuntimeError(f"NVRTC failed ({rc}):\n{log_s}")
    if "ptxas" not in log_s:
        # As the engine does (kernels/src/ops/nvrtc.rs): without the report, no lost feature or
        # spill could have been seen.
        print(f"warning: NVRTC compiled {name} for {arch} without ptxas's report: its Hopper "
              "features and spills were not checked", file=sys.stderr)
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log_s


# ptxas's "info" lines (with a code) that say the kernels lost their Hopper features: setmaxnreg
# ignored (C7508), wgmma serialised (C7510, C7515), a wait injected after one (C7517). The engine
# refuses such a build (kernels/src/ops/nvrtc.rs, the same list).
FATAL_PTXAS = ("Potential Performance Loss", "C7508", "C7510", "C7515", "C7517", "serializ", "injected")


def ptxas_warnings(log: str):
    """ptxas's lines that say the kernels lost their Hopper features (fatal: the engine refuses them)."""
    return [ln.strip() for ln in log.splitlines() if any(w in ln for w in FATAL_PTXAS)]


def ptxas_spills(log: str, prefix: str = "mt_hfa_"):
    """Stack frames and spills of the kernels whose names start with `prefix` (reported, not fatal)."""
    out, current = [], None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line) or re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m and current and current.startswith(prefix) and (int(m.group(1)) or int(m.group(2))):
            out.append(f"{current}: {line.split('.', 1)[-1].strip()}")
    return out


# --- the driver ----------------------------------------------------------------------------------

class Driver:
    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0), "cuInit")

    def check(self, rc, what):
        if rc != 0:
            s = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(s))
            raise RuntimeError(f"{what} failed: {rc} {s.value.decode() if s.value else ''}")

    def load(self, cubin: bytes):
        mod = ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        return mod

    def function(self, mod, name: str, smem: int = 0):
        f = ctypes.c_void_p()
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), f"cuModuleGetFunction {name}")
        if smem > 48 * 1024:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            self.check(self.cu.cuFuncSetAttribute(f, 8, smem), f"cuFuncSetAttribute {name}")
        return f

    def launch(self, f, grid, block, smem, stream, args):
        """args: list of ctypes objects (values), passed by address as kernel parameters."""
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.check(self.cu.cuLaunchKernel(f, *grid, *block, smem, ctypes.c_void_p(stream), ptrs, None),
                   "cuLaunchKernel")

    def tensor_map(self, ptr: int, dims, strides_bytes, box):
        """A 4-d bf16 tensor map, 128-byte swizzle, zero fill out of bounds. dims/box innermost first;
        strides_bytes for dims 1..3."""
        m = (ctypes.c_uint64 * 16)()
        gdim = (ctypes.c_uint64 * 4)(*dims)
        gstr = (ctypes.c_uint64 * 3)(*strides_bytes)
        bdim = (ctypes.c_uint32 * 4)(*box)
        estr = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        # dtype BFLOAT16 = 9, rank 4, interleave none 0, swizzle 128B = 3, L2 promotion 256B = 3,
        # oob fill none (zeros) = 0
        self.check(self.cu.cuTensorMapEncodeTiled(m, 9, 4, ctypes.c_void_p(ptr), gdim, gstr, bdim, estr, 0, 3, 3, 0),
                   "cuTensorMapEncodeTiled")
        return m


class Hopper:
    """The Hopper kernels launched as the engine launches them."""

    def __init__(self, defines=()):
        import torch

        torch.cuda.init()
        torch.zeros(1, device="cuda")  # makes the primary context current on this thread
        self.drv = Driver()
        prefix = "".join(f"#define {d.replace('=', ' ')}\n" for d in defines)
        self.fwd_stages = 3
        for d in defines:
            if d.startswith("MT_HFA_FWD_STAGES="):
                self.fwd_stages = int(d.split("=")[1])
        self.cubin, self.log = compile_cubin(prefix + source())
        self.problems = ptxas_warnings(self.log)
        self.spills = ptxas_spills(self.log)
        self.mod = self.drv.load(self.cubin)
        self.fns = {}

    def fn(self, name, smem=0):
        if name not in self.fns:
            self.fns[name] = self.drv.function(self.mod, name, smem)
        return self.fns[name]

    def map_of(self, t, rows):
        b, s, heads, hd = t.shape
        e = 2
        return self.drv.tensor_map(t.data_ptr(), (hd, heads, s, b), (hd * e, heads * hd * e, s * heads * hd * e),
                                   (64, 1, rows, 1))

    def stream(self):
        import torch

        return torch.cuda.current_stream().cuda_stream

    def forward(self, q, k, v, seg_lo=None, window=0, sinks=None):
        """`window` (0: none) and `sinks` (f32 [nh] or None): GPT-OSS's, through the `_ext` kernel."""
        import torch

        b, t, nh, hd = q.shape
        nkv = k.shape[2]
        o = torch.empty_like(q)
        lse = torch.empty((b, nh, t), dtype=torch.float32, device=q.device)
        counter = torch.zeros(1, dtype=torch.int32, device=q.device)
        tiles = (t + BM - 1) // BM * nh * b
        sm = smem_fwd(hd, self.fwd_stages)
        ext = window > 0 or sinks is not None
        f = self.fn(f"mt_hfa_fwd{'_ext' if ext else ''}_hd{hd}", sm)
        extras = [ctypes.c_void_p(sinks.data_ptr() if sinks is not None else 0),
                  ctypes.c_int(min(window, t))] if ext else []
        args = [self.map_of(q, BM), self.map_of(k, BN), self.map_of(v, BN), ctypes.c_void_p(o.data_ptr()),
                ctypes.c_void_p(lse.data_ptr()), ctypes.c_void_p(seg_lo.data_ptr() if seg_lo is not None else 0),
                *extras, ctypes.c_int(t), ctypes.c_int(b), ctypes.c_int(nh), ctypes.c_int(nkv),
                ctypes.c_float(1.0 / math.sqrt(hd) * math.log2(math.e)), ctypes.c_void_p(counter.data_ptr())]
        self.drv.launch(f, (tiles, 1, 1), (THREADS, 1, 1), sm, self.stream(), args)
        return o, lse

    def backward(self, q, k, v, o, lse, do, seg_lo=None, seg_hi=None, deterministic=True, dot_fn=None, window=0,
                 sinks=None):
        """(dq, dk, dv), and with `sinks` also their gradient (f32 [nh]) as a fourth."""
        import torch

        b, t, nh, hd = q.shape
        nkv = k.shape[2]
        scale = 1.0 / math.sqrt(hd)
        d = torch.empty((b, nh, t), dtype=torch.float32, device=q.device)
        rows = b * t * nh
        self.drv.launch(self.fn("mt_flash_bwd_dot"), ((rows + 3) // 4, 1, 1), (128, 1, 1), 0, self.stream(),
                        [ctypes.c_void_p(do.data_ptr()), ctypes.c_void_p(o.data_ptr()), ctypes.c_void_p(d.data_ptr()),
                         ctypes.c_int(t), ctypes.c_int(nh), ctypes.c_int(hd), ctypes.c_int64(rows)])
        nqt = (t + BQ - 1) // BQ
        # Ordered, each tile's first adder stores its partial: no zeroing needed.
        alloc = torch.empty if deterministic else torch.zeros
        dq_acc = alloc((b, nh, nqt, BQ * hd), dtype=torch.float32, device=q.device)
        sync = torch.zeros(1 + b * nh * nqt, dtype=torch.int32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        blocks = (t + BN - 1) // BN * nkv * b
        sm = smem_bwd(hd)
        ext = window > 0 or sinks is not None
        f = self.fn(f"mt_hfa_bwd{'_ext' if ext else ''}_hd{hd}", sm)
        args = [self.map_of(q, BQ), self.map_of(k, BN), self.map_of(v, BN), self.map_of(do, BQ),
                ctypes.c_void_p(lse.data_ptr()), ctypes.c_void_p(d.data_ptr()), ctypes.c_void_p(dq_acc.data_ptr()),
                ctypes.c_void_p(sync.data_ptr()), ctypes.c_void_p(dk.data_ptr()), ctypes.c_void_p(dv.data_ptr()),
                ctypes.c_void_p(seg_lo.data_ptr() if seg_lo is not None else 0),
                ctypes.c_void_p(seg_hi.data_ptr() if seg_hi is not None else 0),
                *([ctypes.c_int(min(window, t))] if ext else []), ctypes.c_int(t), ctypes.c_int(b), ctypes.c_int(nh), ctypes.c_int(nkv), ctypes.c_float(scale),
                ctypes.c_float(scale * math.log2(math.e)), ctypes.c_int(1 if deterministic else 0)]
        self.drv.launch(f, (blocks, 1, 1), (THREADS, 1, 1), sm, self.stream(), args)
        groups = b * t * nh * hd // 8
        self.drv.launch(self.fn(f"mt_hfa_dq_convert_hd{hd}"), ((groups + 255) // 256, 1, 1), (256, 1, 1), 0,
                        self.stream(), [ctypes.c_void_p(dq_acc.data_ptr()), ctypes.c_void_p(dq.data_ptr()),
                                        ctypes.c_int(t), ctypes.c_int(nh), ctypes.c_float(scale),
                                        ctypes.c_int64(groups)])
        if sinks is None:
            return dq, dk, dv
        dsinks = torch.empty(nh, dtype=torch.float32, device=q.device)
        self.drv.launch(self.fn("mt_flash_sink_grad"), (nh, 1, 1), (128, 1, 1), 16, self.stream(),
                        [ctypes.c_void_p(lse.data_ptr()), ctypes.c_void_p(d.data_ptr()),
                         ctypes.c_void_p(sinks.data_ptr()), ctypes.c_void_p(dsinks.data_ptr()), ctypes.c_int(b),
                         ctypes.c_int(t), ctypes.c_int(nh)])
        return dq, dk, dv, dsinks


def main():
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--log", help="write the full NVRTC/ptxas log here")
    p.add_argument("--define", action="append", default=[], metavar="MACRO[=VALUE]",
                   help="compile a variant (e.g. MT_HFA_BWD_SPLIT); repeatable")
    p.add_argument("--run", metavar="S:NH:NKV:HD", help="run one forward and one backward of this shape "
                   "(for a profiler to watch), e.g. 16384:28:4:128")
    a = p.parse_args()
    if a.run:
        import torch

        t, nh, nkv, hd = (int(x) for x in a.run.split(":"))
        h = Hopper()
        q = torch.randn(1, t, nh, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, t, nkv, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, t, nkv, hd, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(1, t, nh, hd, device="cuda", dtype=torch.bfloat16)
        o, lse = h.forward(q, k, v)
        h.backward(q, k, v, o, lse, do)
        torch.cuda.synchronize()
        print("ran", a.run)
        return 0
    prefix = "".join(f"#define {d.replace('=', ' ')}\n" for d in a.define)
    cubin, log = compile_cubin(prefix + source())
    if a.log:
        Path(a.log).write_text(log)
    for line in log.splitlines():
        if "mt_hfa" in line or "registers" in line or "spill" in line or "warning" in line.lower():
            print(line)
    bad, spills = ptxas_warnings(log), ptxas_spills(log)
    print(f"cubin: {len(cubin)} bytes; fatal ptxas warnings: {len(bad)}; spills: {spills or 'none'}")
    for b in bad:
        print("  ", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

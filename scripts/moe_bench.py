#!/usr/bin/env python3
"""Our mixture-of-experts kernels (kernels/cuda/moe.cu) against PyTorch, on one GPU, one run.

The kernels are compiled with NVRTC for the GPU's own architecture (sm_XY CUBIN, through
scripts/hopper_attention.py's NVRTC and driver helpers: ctypes, no CuPy) and launched with the
geometry of mt-kernels' launchers (kernels/src/ops/moe/, not yet called by the engine: decision
0047); a change to one is a change to both.
The MoE MLP is the SwiGLU family's (Qwen3-MoE, Mixtral, OLMoE): router logits in, softmax, top-k
(CPU engine's tie rule), stable grouping by expert, gate_up and down grouped GEMMs, SwiGLU over
all rows, the weighted combine; the backward's dX, expert weight gradients (f32) and the router
logits' gradient. The router GEMM itself is dense (cuBLAS in the engine) and not timed here.

  check:  every output against a plain PyTorch float32 reference on random inputs: routing
          (probabilities, top-k indices, weights, per-expert counts, the permutation), the
          forward output, dX, dW_gate_up, dW_down, the routing weights' and the router logits'
          gradients; cases: random logits, tied logits (the tie rule), skewed routing (experts
          with zero tokens and one expert with nearly every token), norm_topk_prob on and off,
          and a second run compared bit for bit (determinism).
  bench:  forward and backward time of ours, of a per-expert PyTorch loop (gather, two bf16
          matmuls, SwiGLU, index_add; autograd backward) and of PyTorch's dense bf16 matmuls of
          the same FLOPs, at the OLMoE-1B-7B shape (bench-harness/configs/olmoe-1b-7b.json) for
          4 x 2048 and 16 x 2048 tokens. FLOPs (active parameters): forward 6 R H F with R = T k
          routed rows, backward 2x forward.

  variants: the grouped GEMMs compiled with other -D defines (tile shape, k step, stages, warps,
          hoisted gathers, CTA order: kernels/cuda/moe.cu's MT_MOE_* switches; VARIANTS below),
          each one checked as above and timed per GEMM kind (gate_up, down, down_bwd, dx,
          wgrad_down, wgrad_gate_up) and over the whole forward and backward; beside them
          PyTorch's own grouped GEMM (torch._grouped_mm, device offsets) on the same routing,
          where the installed torch has it.

Writes one JSON document (machine, date, config, checks, bench, variants, peer) to --out and
prints a table. Needs torch on a CUDA GPU of compute capability 8.0 or later.

  python3 scripts/moe_bench.py --out results.json [--tokens 8192,32768] [--reps 5]
  python3 scripts/moe_bench.py --out sweep.json --variants all --tokens 32768 --skip-loop
  python3 scripts/moe_bench.py --variants base,mine=MT_MOE_BK=64+MT_MOE_HOIST=1 --out x.json
  python3 scripts/moe_bench.py --compile-only [--variants all]  # no GPU: NVRTC for sm_80, sm_90
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import hopper_attention as ha  # noqa: E402  (NVRTC and the driver through ctypes)
from attention_bench import machine, time_ms  # noqa: E402

SCHEMA_VERSION = 1
CONFIG = ROOT / "bench-harness" / "configs" / "olmoe-1b-7b.json"
# kernels/cuda/moe.cu's MT_MOE_* constants.
CHUNK, MAX_K = 1024, 32
# Its GEMM geometry's defaults, which a variant's defines override.
GEOMETRY = {"MT_MOE_BM": 128, "MT_MOE_BN": 128, "MT_MOE_BK": 32, "MT_MOE_STAGES": 3, "MT_MOE_WARPS_M": 2,
            "MT_MOE_WARPS_N": 4}
# The most dynamic shared memory a CTA may opt in to (227 KiB on sm_80 and sm_90).
SMEM_MAX = 227 * 1024
FWD_FLOPS = "6*R*H*F, R = tokens*k (gate_up 4RHF + down 2RHF)"
BWD_FLOPS = "2 x forward (dX and dW of both projections)"

# The GEMM variants a sweep measures: name -> defines (kernels/cuda/moe.cu's and moe_hopper.cu's
# switches).
VARIANTS = {
    # The first kernel: 128 x 128 x 32, 3 stages, 8 warps of 64 x 32, 2 CTAs an SM, 48 KiB.
    "base": {"MT_MOE_HOIST": 0, "MT_MOE_GROUP": 0},
    # The mma.sync ladder, each step on top of the one before.
    # The CTA's setup once: its expert found by a warp's scan, its gathered A rows' sources read
    # once (not an index load and a division per row per k step), a multiplier for the weight
    # gradient's gather.
    "hoist": {"MT_MOE_HOIST": 1},
    # + CTAs in groups of 8 row tiles x every column tile: an A tile is read from DRAM once, not
    # once per column tile.
    "group": {"MT_MOE_HOIST": 1, "MT_MOE_GROUP": 8},
    # + a 4-stage ring (64 KiB, still 2 CTAs an SM): one more k step of latency hidden.
    "s4": {"MT_MOE_HOIST": 1, "MT_MOE_GROUP": 8, "MT_MOE_STAGES": 4},
    # + k step 64, 3 stages (96 KiB, 2 CTAs an SM): half the barriers, 128-byte row copies.
    "k64": {"MT_MOE_HOIST": 1, "MT_MOE_GROUP": 8, "MT_MOE_BK": 64},
    # Then bigger warp tiles. 4 warps of 64 x 64 (a third fewer ldmatrix per mma), k step 64,
    # 3 stages, 2 CTAs an SM.
    "w64_k64": {"MT_MOE_HOIST": 1, "MT_MOE_GROUP": 8, "MT_MOE_BK": 64, "MT_MOE_WARPS_M": 2, "MT_MOE_WARPS_N": 2},
    # 128 x 256 CTA tile, 8 warps of 64 x 64, k 32, 4 stages (96 KiB), 1 CTA an SM: a quarter
    # less L2 traffic per FLOP than 128 x 128.
    "t128x256": {"MT_MOE_HOIST": 1, "MT_MOE_GROUP": 8, "MT_MOE_BN": 256, "MT_MOE_STAGES": 4, "MT_MOE_MIN_CTAS": 1},
    # The same with k step 64, 3 stages (144 KiB).
    "t128x256_k64": {"MT_MOE_HOIST": 1, "MT_MOE_GROUP": 8, "MT_MOE_BN": 256, "MT_MOE_BK": 64,
                     "MT_MOE_MIN_CTAS": 1},
    # 256 x 128, 8 warps of 64 x 64, k 64, 3 stages (144 KiB), 1 CTA an SM.
    "t256x128_k64": {"MT_MOE_HOIST": 1, "MT_MOE_GROUP": 8, "MT_MOE_BM": 256, "MT_MOE_WARPS_M": 4,
                     "MT_MOE_WARPS_N": 2, "MT_MOE_BK": 64, "MT_MOE_MIN_CTAS": 1},
    # Every GEMM on wgmma (moe_hopper.cu, sm_90a only): 128 x 256 x 64 tiles, 4 stages (194 KiB),
    # a copier warpgroup and two multiplying ones, CTAs in groups of 8 row tiles. Last, with its
    # two variations, so that a first run of new kernels that fails the device (a sticky CUDA
    # error) or hangs cannot take the measurements before it with it.
    "wgmma": {"MT_MOE_HOPPER": 1},
    # The wgmma kernels with 3 stages and a copy lag of 1 (146 KiB).
    "wgmma_s3": {"MT_MOE_HOPPER": 1, "MT_MOE_H_STAGES": 3, "MT_MOE_H_LAG": 1},
    # The wgmma kernels with 128 x 128 x 64 tiles, 6 stages (194 KiB).
    "wgmma_n128": {"MT_MOE_HOPPER": 1, "MT_MOE_H_BN": 128, "MT_MOE_H_STAGES": 6},
    # The wgmma kernels with persistent weight gradients: P CTAs an expert, each walking its
    # expert's tiles in turn, the next tile's loads under the last one's f32 read-modify-write.
    "wgmma_p2": {"MT_MOE_HOPPER": 1, "MT_MOE_H_PERSIST": 2},
    "wgmma_p4": {"MT_MOE_HOPPER": 1, "MT_MOE_H_PERSIST": 4},
}


def parse_variants(spec: str):
    """[(name, {define: value})] from "all", or a comma list of VARIANTS names and
    NAME=DEFINE=VALUE+DEFINE=VALUE items."""
    if spec == "all":
        return list(VARIANTS.items())
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        if "=" not in item:
            if item not in VARIANTS:
                raise SystemExit(f"unknown variant {item!r}: one of {', '.join(VARIANTS)} or NAME=DEFINE=VALUE+...")
            out.append((item, VARIANTS[item]))
            continue
        name, rest = item.split("=", 1)
        defines = {}
        for d in (x for x in rest.split("+") if x):
            key, _, value = d.partition("=")
            if not key.startswith("MT_MOE_") or not value.lstrip("-").isdigit():
                raise SystemExit(f"variant {name}: {d!r} is not MT_MOE_NAME=INTEGER")
            defines[key] = int(value)
        out.append((name, defines))
    return out


class Geometry:
    """The launch geometry of moe.cu's GEMMs compiled with `defines` (its MT_MOE_* rules)."""

    def __init__(self, defines=None):
        g = {**GEOMETRY, **{k: int(v) for k, v in (defines or {}).items() if k in GEOMETRY}}
        self.bm, self.bn, self.bk, self.stages = g["MT_MOE_BM"], g["MT_MOE_BN"], g["MT_MOE_BK"], g["MT_MOE_STAGES"]
        self.threads = 32 * g["MT_MOE_WARPS_M"] * g["MT_MOE_WARPS_N"]
        self.smem = self.stages * (self.bm + self.bn) * self.bk * 2

    def as_dict(self):
        return {"bm": self.bm, "bn": self.bn, "bk": self.bk, "stages": self.stages, "threads": self.threads,
                "smem_bytes": self.smem}


class HopperGeometry:
    """The launch geometry of moe_hopper.cu's GEMMs compiled with `defines` (its MoeH)."""

    def __init__(self, defines=None):
        d = defines or {}
        self.bm, self.bk, self.threads = 128, 64, 384
        self.bn, self.stages = int(d.get("MT_MOE_H_BN", 256)), int(d.get("MT_MOE_H_STAGES", 4))
        self.persist = int(d.get("MT_MOE_H_PERSIST", 0))  # weight gradients' CTAs an expert (0: a tile each)
        self.smem = self.stages * (self.bm + self.bn) * self.bk * 2 + 16 * self.stages + 16 + 8 * self.bk + 1024

    def as_dict(self):
        return {"bm": self.bm, "bn": self.bn, "bk": self.bk, "stages": self.stages, "threads": self.threads,
                "smem_bytes": self.smem, "kernel": "wgmma", "wgrad_ctas_per_expert": self.persist or None}


def is_hopper(defines) -> bool:
    """A variant whose GEMMs run moe_hopper.cu's wgmma kernels (MT_MOE_HOPPER=1, a switch of this
    script's: an sm_90a CUBIN of moe.cu and moe_hopper.cu)."""
    return bool(int((defines or {}).get("MT_MOE_HOPPER", 0)))


def source(defines=None) -> str:
    """The CUDA source of a variant: its defines, and the geometry this script launches it with
    (MT_MOE_EXPECT_*: the kernels refuse to compile if theirs differs), then the files."""
    geo = HopperGeometry(defines) if is_hopper(defines) else Geometry(defines)
    expect = {"MT_MOE_EXPECT_SMEM": geo.smem, "MT_MOE_EXPECT_THREADS": geo.threads, "MT_MOE_EXPECT_BM": geo.bm,
              "MT_MOE_EXPECT_BN": geo.bn}
    head = "".join(f"#define {k} {v}\n" for k, v in {**(defines or {}), **expect}.items())
    files = ("common.cuh", "hopper.cuh", "moe.cu", "moe_hopper.cu") if is_hopper(defines) else ("common.cuh", "moe.cu")
    return head + "".join(f'#line 1 "{n}"\n{(ha.KERNELS / n).read_text()}\n' for n in files)


def ptxas_report(log: str):
    """{kernel: (registers, static shared bytes)} from ptxas's verbose log."""
    out, cur = {}, None
    for line in log.splitlines():
        if "Compiling entry function" in line:
            cur = line.split("'")[1]
        elif "Used" in line and "registers" in line and cur:
            smem = int(line.split("bytes smem")[0].split(",")[-1]) if "bytes smem" in line else 0
            out[cur] = (int(line.split("Used")[1].split("registers")[0]), smem)
    return out


def compile_only(variants) -> int:
    """Compiles the default kernels and every variant for sm_80 and sm_90 (a wgmma variant for
    sm_90a only): fails on a spill, a stack frame, a ptxas warning, or a GEMM's shared memory past
    what a CTA may have."""
    rc = 0
    for arch in ("sm_80", "sm_90"):
        first = True
        for vname, defines in variants:
            hopper = is_hopper(defines)
            if hopper and arch != "sm_90":
                continue
            geo = HopperGeometry(defines) if hopper else Geometry(defines)
            try:
                cubin, log = ha.compile_cubin(source(defines), "moe.cu", "sm_90a" if hopper else arch)
            except OSError as e:
                print(f"no NVRTC library: {e}\n(set MEGATRAIN_CUDA_PREFIX to the toolchain of scripts/cuda-toolchain.sh)")
                return 1
            except RuntimeError as e:
                print(f"{arch} {vname}: FAILED to compile\n{e}")
                rc = 1
                continue
            problems = ha.ptxas_spills(log, prefix="mt_moe_") + ha.ptxas_warnings(log)
            problems += [ln.strip() for ln in log.splitlines() if "warning" in ln.lower()]
            regs = ptxas_report(log)
            if first:
                print(f"{arch}: cubin {len(cubin)} bytes, {len(regs)} kernels; spills: {problems or 'none'}")
                for name, (r, smem) in sorted(regs.items()):
                    print(f"  {name}: {r} registers, {smem} bytes static shared")
                first = False
            gemm = {n[len("mt_moe_"):]: r for n, (r, _) in sorted(regs.items()) if "gemm" in n}
            static = max((sm for n, (_, sm) in regs.items() if "gemm" in n), default=0)
            opt_in = " (opts in past 48 KiB)" if static + geo.smem > 48 * 1024 else ""
            kind = "wgmma " if hopper else ""
            print(f"  variant {vname:13} {kind}{geo.bm}x{geo.bn}x{geo.bk} s{geo.stages} {geo.threads} threads, "
                  f"{geo.smem // 1024} KiB{opt_in}; registers {gemm}; problems: {problems or 'none'}")
            if static + geo.smem > SMEM_MAX:
                print(f"  variant {vname}: {static} static + {geo.smem} dynamic bytes exceed {SMEM_MAX}")
                rc = 1
            if problems:  # stack frames, spills or warnings: none expected
                rc = 1
    return rc


# --- launching ------------------------------------------------------------------------------------

def _p(t):
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


class Moe:
    """The kernels of moe.cu, launched as kernels/src/ops/moe/ launches them."""

    def __init__(self, defines=None):
        import torch

        torch.cuda.init()
        torch.zeros(1, device="cuda")
        major, minor = torch.cuda.get_device_capability()
        self.arch = f"sm_{major}{minor}"
        self.defines = dict(defines or {})
        # The GEMMs' geometry: moe.cu's, or (a wgmma variant) moe_hopper.cu's.
        self.hopper = is_hopper(self.defines)
        self.geo = HopperGeometry(self.defines) if self.hopper else Geometry(self.defines)
        if self.hopper:
            if (major, minor) != (9, 0):
                raise RuntimeError(f"the wgmma kernels need compute capability 9.0 (sm_90a), not {major}.{minor}")
            self.arch = "sm_90a"
        self.drv = ha.Driver()
        self.cubin, self.log = ha.compile_cubin(source(self.defines), "moe.cu", self.arch)
        self.spills = ha.ptxas_spills(self.log, prefix="mt_moe_")
        self.ptxas_warnings = ha.ptxas_warnings(self.log)
        if self.ptxas_warnings:  # the engine refuses such a build (kernels/src/ops/nvrtc.rs)
            raise RuntimeError("ptxas: " + "; ".join(self.ptxas_warnings))
        self.registers = {n: r for n, (r, _) in ptxas_report(self.log).items()}
        self.mod = self.drv.load(self.cubin)
        self.fns = {}

    def go(self, name, grid, block, smem, args):
        import torch

        if name not in self.fns:
            self.fns[name] = self.drv.function(self.mod, name, smem)
        try:
            self.drv.launch(self.fns[name], grid, (block, 1, 1), smem, torch.cuda.current_stream().cuda_stream, args)
        except RuntimeError as err:
            raise RuntimeError(f"{name} (grid {grid}, {block} threads, {smem} B shared): {err}") from None

    # Routing and grouping.
    def route(self, logits, k, normalise):
        import torch

        t, e = logits.shape
        probs = torch.empty(t, e, dtype=torch.float32, device=logits.device)
        top = torch.empty(t, k, dtype=torch.int32, device=logits.device)
        w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
        name = "mt_moe_route_bf16" if logits.dtype == torch.bfloat16 else "mt_moe_route_f32"
        self.go(name, ((t + 3) // 4, 1, 1), 128, 4 * e * 12,
                [_p(logits), _p(probs), _p(top), _p(w), ctypes.c_int(t), ctypes.c_int(e), ctypes.c_int(k),
                 ctypes.c_int(1 if normalise else 0)])
        return probs, top, w

    def sort(self, top, e):
        import torch

        n = top.numel()
        dev = top.device
        chunks = (n + CHUNK - 1) // CHUNK
        rank = torch.empty(n, dtype=torch.int32, device=dev)
        cc = torch.empty(chunks * e, dtype=torch.int32, device=dev)
        base = torch.empty(chunks * e, dtype=torch.int32, device=dev)
        counts = torch.empty(e, dtype=torch.int32, device=dev)
        off = torch.empty(e + 1, dtype=torch.int32, device=dev)
        perm = torch.empty(n, dtype=torch.int32, device=dev)
        row_slot = torch.empty(n, dtype=torch.int32, device=dev)
        self.go("mt_moe_sort_count", (chunks, 1, 1), 32, 4 * e,
                [_p(top), _p(rank), _p(cc), ctypes.c_int(n), ctypes.c_int(e)])
        self.go("mt_moe_sort_scan", (1, 1, 1), 256, 4 * e,
                [_p(cc), _p(base), _p(counts), _p(off), ctypes.c_int(chunks), ctypes.c_int(e)])
        self.go("mt_moe_sort_scatter", (min((n + 255) // 256, 4096), 1, 1), 256, 0,
                [_p(top), _p(rank), _p(base), _p(perm), _p(row_slot), ctypes.c_int(n), ctypes.c_int(e)])
        return counts, off, perm, row_slot

    def prob_sums(self, probs, sums):
        t, e = probs.shape
        self.go("mt_moe_prob_sums", (e, 1, 1), 256, 0, [_p(probs), _p(sums), ctypes.c_int(t), ctypes.c_int(e)])

    # Grouped GEMMs.
    def gemm(self, name, a, a_idx, a_div, w, off, n, k, rows, extra=()):
        import torch

        e = w.shape[0]
        c = torch.empty(rows, n, dtype=torch.bfloat16, device=a.device)
        g = self.geo
        if self.hopper:
            name = name.replace("mt_moe_gemm_", "mt_moe_hgemm_")
        grid = ((rows + g.bm - 1) // g.bm + e, (n + g.bn - 1) // g.bn, 1)
        self.go(name, grid, g.threads, g.smem,
                [_p(a), _p(a_idx), ctypes.c_int(a_div), _p(w), _p(off), ctypes.c_int(e), ctypes.c_int(n),
                 ctypes.c_int(k), _p(c), *extra])
        return c

    def wgrad(self, a, b, b_idx, b_div, off, g):
        e, m, n = g.shape
        geo = self.geo
        tiles = ((m + geo.bm - 1) // geo.bm) * ((n + geo.bn - 1) // geo.bn)
        persist = getattr(geo, "persist", 0)
        grid = (min(tiles, persist) if persist else tiles, e, 1)
        self.go("mt_moe_hgemm_wgrad" if self.hopper else "mt_moe_gemm_wgrad", grid, geo.threads, geo.smem,
                [_p(a), _p(b), _p(b_idx), ctypes.c_int(b_div), _p(off), ctypes.c_int(m), ctypes.c_int(n), _p(g)])

    def elementwise_grid(self, total):
        return (max(1, min((total + 255) // 256, 132 * 32)), 1, 1)

    def forward(self, x, x1, logits, w_gu, w_d, k, normalise):
        import torch

        t, h = x.shape
        e, f2, _ = w_gu.shape
        f = f2 // 2
        r = t * k
        if h % 8 or f % 8:
            raise ValueError(f"hidden {h} and expert width {f} must be multiples of 8 (16-byte rows of bf16)")
        if e > 1024 or not 1 <= k <= min(e, MAX_K):
            raise ValueError(f"{e} experts, top-{k}: the kernels take at most 1024 experts and top-{MAX_K}")
        if r >= 2**31:
            raise ValueError(f"{t} tokens x top-{k} = {r} routed rows: more than 2^31 - 1")
        probs, top, w = self.route(logits, k, normalise)
        counts, off, perm, row_slot = self.sort(top.view(-1), e)
        gu = self.gemm("mt_moe_gemm_nk", x, row_slot, k, w_gu, off, 2 * f, h, r)
        mid = torch.empty(r, f, dtype=torch.bfloat16, device=x.device)
        self.go("mt_moe_swiglu", self.elementwise_grid(r * f), 256, 0,
                [_p(gu), _p(mid), ctypes.c_longlong(r), ctypes.c_int(f)])
        y = self.gemm("mt_moe_gemm_nk", mid, None, 1, w_d, off, h, f, r)
        out = torch.empty_like(x)
        self.go("mt_moe_combine", (t, 1, 1), 256, 0,
                [_p(y), _p(perm), _p(w), _p(x1), _p(out), ctypes.c_int(t), ctypes.c_int(h), ctypes.c_int(k)])
        saved = dict(x=x, probs=probs, top=top, w=w, counts=counts, off=off, perm=perm, row_slot=row_slot,
                     gu=gu, mid=mid, k=k, normalise=normalise)
        return out, saved

    def backward(self, s, dout, w_gu, w_d, g_gu, g_d, aux_dprob=None):
        """dC (the experts' share of the input's gradient), dlogit, dw; adds into g_gu, g_d (f32)."""
        import torch

        x, k = s["x"], s["k"]
        t, h = x.shape
        e, f2, _ = w_gu.shape
        f = f2 // 2
        r = t * k
        tiles = (f + self.geo.bn - 1) // self.geo.bn
        dys = torch.empty(r, h, dtype=torch.bfloat16, device=x.device)
        self.go("mt_moe_gather", self.elementwise_grid(r * h // 8), 256, 0,
                [_p(dout), _p(s["row_slot"]), _p(s["w"]), _p(dys), ctypes.c_int(r), ctypes.c_int(h), ctypes.c_int(k)])
        partial = torch.empty(r, tiles, dtype=torch.float32, device=x.device)
        dmid = self.gemm("mt_moe_gemm_kn_dmid", dout, s["row_slot"], k, w_d, s["off"], f, h, r,
                         extra=(_p(s["row_slot"]), _p(s["w"]), _p(s["mid"]), _p(partial)))
        dgu = torch.empty(r, 2 * f, dtype=torch.bfloat16, device=x.device)
        self.go("mt_moe_swiglu_bwd", self.elementwise_grid(r * f), 256, 0,
                [_p(dmid), _p(s["gu"]), _p(dgu), ctypes.c_longlong(r), ctypes.c_int(f)])
        self.wgrad(dys, s["mid"], None, 1, s["off"], g_d)
        self.wgrad(dgu, x, s["row_slot"], k, s["off"], g_gu)
        dcp = self.gemm("mt_moe_gemm_kn", dgu, None, 1, w_gu, s["off"], h, 2 * f, r)
        dc = torch.empty_like(x)
        self.go("mt_moe_combine", (t, 1, 1), 256, 0,
                [_p(dcp), _p(s["perm"]), _p(None), _p(None), _p(dc), ctypes.c_int(t), ctypes.c_int(h),
                 ctypes.c_int(k)])
        dlogit = torch.empty(t, e, dtype=torch.bfloat16, device=x.device)
        dw = torch.empty(t, k, dtype=torch.float64, device=x.device)
        self.go("mt_moe_router_bwd", ((t + 3) // 4, 1, 1), 128, 4 * e * 8,
                [_p(s["probs"]), _p(s["top"]), _p(s["perm"]), _p(partial), ctypes.c_int(tiles), _p(aux_dprob),
                 ctypes.c_int(1 if s["normalise"] else 0), _p(dw), _p(dlogit), ctypes.c_int(t), ctypes.c_int(e),
                 ctypes.c_int(k)])
        return dc, dlogit, dw


# --- reference --------------------------------------------------------------------------------------

def ref_routing(logits, k, normalise):
    import torch

    probs = torch.softmax(logits.double(), dim=-1).float()
    top = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    p = probs.gather(1, top)
    w = (p.double() / p.double().sum(-1, keepdim=True)).float() if normalise else p
    return probs, top, w


def ref_moe(x, x1, logits, w_gu, w_d, top, normalise, dout, aux_dprob):
    """f32 forward and gradients with the routing `top` fixed: out, dx (experts' share), dW_gu,
    dW_d, dlogits, dw (the routing weights' gradient)."""
    import torch

    xf = x.float().requires_grad_()
    guf = w_gu.float().requires_grad_()
    df = w_d.float().requires_grad_()
    lf = logits.float().requires_grad_()
    probs = torch.softmax(lf, dim=-1)
    p = probs.gather(1, top)
    w = p / p.sum(-1, keepdim=True) if normalise else p
    w.retain_grad()
    out = per_expert(xf, guf, df, top, w, x1.float().clone())
    loss = (out * dout.float()).sum()
    if aux_dprob is not None:
        loss = loss + (probs * aux_dprob.float()).sum()
    loss.backward()
    return out.detach(), xf.grad, guf.grad, df.grad, lf.grad, w.grad


def errs(got, want):
    g, w = got.double(), want.double()
    return {"rel_l2": ((g - w).norm() / w.norm().clamp_min(1e-30)).item(),
            "max_abs_over_max_ref": ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item(),
            "finite": bool(__import__("torch").isfinite(g).all().item())}


def make_logits(kind, t, e, gen):
    import torch

    dev = gen.device
    if kind == "random":
        return torch.randn(t, e, generator=gen, device=dev) * 2.0
    if kind == "ties":
        # Few distinct values: many exactly equal probabilities in every row (the tie rule decides).
        return torch.randint(0, 4, (t, e), generator=gen, device=dev).float() * 0.5
    if kind == "skewed":
        # Experts 0-3 get no token; expert 4 gets every token; the rest share what is left.
        lg = torch.randn(t, e, generator=gen, device=dev)
        lg[:, :4] = -30.0
        lg[:, 4] = 12.0
        return lg
    raise ValueError(kind)


def check(moe, kind, t, e, k, h, f, normalise, seed):
    import torch

    # Drawn on the GPU: the host's generator takes seconds for the experts' 400M weights.
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(t, h, generator=gen, device=dev).to(bf)
    x1 = torch.randn(t, h, generator=gen, device=dev).to(bf)
    logits = make_logits(kind, t, e, gen).to(bf)
    w_gu = (torch.randn(e, 2 * f, h, generator=gen, device=dev) / math.sqrt(h)).to(bf)
    w_d = (torch.randn(e, h, f, generator=gen, device=dev) / math.sqrt(f)).to(bf)
    dout = torch.randn(t, h, generator=gen, device=dev).to(bf)
    aux = torch.rand(e, generator=gen, dtype=torch.float64, device=dev) * 1e-2

    def run():
        g_gu = torch.zeros(e, 2 * f, h, dtype=torch.float32, device=dev)
        g_d = torch.zeros(e, h, f, dtype=torch.float32, device=dev)
        out, s = moe.forward(x, x1, logits, w_gu, w_d, k, normalise)
        dc, dlogit, dw = moe.backward(s, dout, w_gu, w_d, g_gu, g_d, aux)
        sums = torch.zeros(e, dtype=torch.float64, device=dev)
        moe.prob_sums(s["probs"], sums)
        torch.cuda.synchronize()
        return dict(out=out, dc=dc, dlogit=dlogit, dw=dw, g_gu=g_gu, g_d=g_d, sums=sums, **{
            n: s[n] for n in ("probs", "top", "w", "counts", "off", "perm", "row_slot", "gu", "mid")})

    a, b = run(), run()
    repeat = all(torch.equal(a[n], b[n]) for n in a)
    probs_r, top_r, w_r = ref_routing(logits, k, normalise)
    top_flat = top_r.reshape(-1)
    counts_r = torch.bincount(top_flat, minlength=e)
    row_slot_r = torch.sort(top_flat, stable=True).indices
    perm_r = torch.empty_like(row_slot_r)
    perm_r[row_slot_r] = torch.arange(row_slot_r.numel(), device=dev)
    out_r, dx_r, dgu_r, dd_r, dl_r, dw_r = ref_moe(x, x1, logits, w_gu, w_d, top_r, normalise, dout, aux)
    res = {
        "case": kind, "tokens": t, "experts": e, "top_k": k, "hidden": h, "expert_width": f,
        "norm_topk_prob": normalise,
        "experts_without_tokens": int((counts_r == 0).sum().item()), "largest_expert_rows": int(counts_r.max().item()),
        "top_k_mismatched_rows": int((a["top"].long() != top_r).any(-1).sum().item()),
        "probs_max_abs": (a["probs"] - probs_r).abs().max().item(),
        "probs_bitwise_equal_fraction": (a["probs"] == probs_r).float().mean().item(),
        "weights_max_abs": (a["w"] - w_r).abs().max().item(),
        "counts_equal": bool(torch.equal(a["counts"].long(), counts_r)),
        "offsets_equal": bool(torch.equal(a["off"].long(), torch.cat([counts_r.new_zeros(1), counts_r.cumsum(0)]))),
        "permutation_equal": bool(torch.equal(a["perm"].long(), perm_r)),
        "row_slot_equal": bool(torch.equal(a["row_slot"].long(), row_slot_r)),
        "prob_sums": errs(a["sums"], a["probs"].double().sum(0)),
        "out": errs(a["out"], out_r),
        "dx": errs(a["dc"], dx_r),
        "dw_gate_up": errs(a["g_gu"], dgu_r),
        "dw_down": errs(a["g_d"], dd_r),
        "d_routing_weights": errs(a["dw"], dw_r),
        "d_logits": errs(a["dlogit"], dl_r),
        "bitwise_repeatable": repeat,
    }
    tol = 2e-2
    res["pass"] = bool(
        res["top_k_mismatched_rows"] == 0 and res["counts_equal"] and res["offsets_equal"]
        and res["permutation_equal"] and res["row_slot_equal"] and res["probs_max_abs"] < 1e-6
        and res["weights_max_abs"] < 1e-6 and repeat
        and all(res[n]["rel_l2"] < tol and res[n]["finite"]
                for n in ("out", "dx", "dw_gate_up", "dw_down", "d_routing_weights", "d_logits"))
        and res["prob_sums"]["rel_l2"] < 1e-9)
    return res


# --- bench ----------------------------------------------------------------------------------------

def torch_loop(x, logits, w_gu, w_d, k, normalise):
    """The per-expert loop (transformers 4's MoE block): routing in torch, one gather, two
    matmuls, SwiGLU and an index_add per expert."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    w, top = torch.topk(probs, k, dim=-1)
    if normalise:
        w = w / w.sum(-1, keepdim=True)
    w = w.to(x.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return per_expert(x, w_gu, w_d, top, w, out).to(x.dtype)


def per_expert(x, w_gu, w_d, top, w, out):
    """`out` plus each token's experts' SwiGLU outputs times their weights, one expert at a time
    (gather, gate_up matmul, SwiGLU, down matmul, index_add), in the dtype of `x`; the sums in
    `out`'s."""
    import torch.nn.functional as F

    f = w_gu.shape[1] // 2
    for ex in range(w_gu.shape[0]):
        tok, j = (top == ex).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ w_gu[ex].t()
        mid = F.silu(gu[:, :f]) * gu[:, f:]
        y = mid @ w_d[ex].t()
        out = out.index_add(0, tok, (y * w[tok, j].unsqueeze(1)).to(out.dtype))
    return out


def bench_inputs(t, e, h, f):
    """The benchmark's inputs at T = t (seeded): x, logits, w_gu, w_d, dout."""
    import torch

    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(t, h, device=dev, dtype=bf)
    logits = torch.randn(t, e, device=dev, dtype=bf)
    w_gu = (torch.randn(e, 2 * f, h, device=dev) / math.sqrt(h)).to(bf)
    w_d = (torch.randn(e, h, f, device=dev) / math.sqrt(f)).to(bf)
    dout = torch.randn(t, h, device=dev, dtype=bf)
    return x, logits, w_gu, w_d, dout


def entry(fwd_flops, tf, tb):
    return {"status": "ok", "fwd_ms": tf, "bwd_ms": tb, "fwd_tflops": fwd_flops / tf / 1e9,
            "bwd_tflops": 2 * fwd_flops / tb / 1e9, "fwd_bwd_tflops": 3 * fwd_flops / (tf + tb) / 1e9}


def time_ours(moe, t, e, k, h, f, normalise, reps):
    """Our whole forward and backward at T = t (an `entry`)."""
    import torch

    x, logits, w_gu, w_d, dout = bench_inputs(t, e, h, f)
    g_gu = torch.zeros(e, 2 * f, h, dtype=torch.float32, device="cuda")
    g_d = torch.zeros(e, h, f, dtype=torch.float32, device="cuda")
    out, s = moe.forward(x, x, logits, w_gu, w_d, k, normalise)
    tf = time_ms(lambda: moe.forward(x, x, logits, w_gu, w_d, k, normalise), reps)
    tb = time_ms(lambda: moe.backward(s, dout, w_gu, w_d, g_gu, g_d), reps)
    res = entry(6.0 * t * k * h * f, tf, tb)
    res["largest_expert_rows"] = int(s["counts"].max().item())
    return res


# The grouped GEMMs of one forward and backward, by kind: FLOPs in units of R H F.
GEMM_KINDS = {"gate_up": 4, "down": 2, "down_bwd": 2, "dx": 4, "wgrad_down": 2, "wgrad_gate_up": 4}


def gemm_calls(moe, t, e, k, h, f, normalise):
    """{kind: a call of that GEMM} on the benchmark's inputs and routing at T = t."""
    import torch

    dev, bf = "cuda", torch.bfloat16
    x, logits, w_gu, w_d, dout = bench_inputs(t, e, h, f)
    _, s = moe.forward(x, x, logits, w_gu, w_d, k, normalise)
    r = t * k
    off, rs = s["off"], s["row_slot"]
    dgu = torch.randn(r, 2 * f, device=dev, dtype=bf)
    dys = torch.randn(r, h, device=dev, dtype=bf)
    partial = torch.empty(r, (f + moe.geo.bn - 1) // moe.geo.bn, dtype=torch.float32, device=dev)
    g_gu = torch.zeros(e, 2 * f, h, dtype=torch.float32, device=dev)
    g_d = torch.zeros(e, h, f, dtype=torch.float32, device=dev)
    return {
        "gate_up": lambda: moe.gemm("mt_moe_gemm_nk", x, rs, k, w_gu, off, 2 * f, h, r),
        "down": lambda: moe.gemm("mt_moe_gemm_nk", s["mid"], None, 1, w_d, off, h, f, r),
        "down_bwd": lambda: moe.gemm("mt_moe_gemm_kn_dmid", dout, rs, k, w_d, off, f, h, r,
                                     extra=(_p(rs), _p(s["w"]), _p(s["mid"]), _p(partial))),
        "dx": lambda: moe.gemm("mt_moe_gemm_kn", dgu, None, 1, w_gu, off, h, 2 * f, r),
        "wgrad_down": lambda: moe.wgrad(dys, s["mid"], None, 1, off, g_d),
        "wgrad_gate_up": lambda: moe.wgrad(dgu, x, rs, k, off, g_gu),
    }


def gemm_bench(moe, t, e, k, h, f, normalise, reps):
    """Each grouped GEMM kind timed alone at T = t: {kind: {flops, ms, tflops}} and the sum."""
    calls = gemm_calls(moe, t, e, k, h, f, normalise)
    unit = float(t * k * h * f)
    kinds, total_ms = {}, 0.0
    for kind, fn in calls.items():
        ms = time_ms(fn, reps)
        flops = GEMM_KINDS[kind] * unit
        kinds[kind] = {"flops": flops, "ms": ms, "tflops": flops / ms / 1e9}
        total_ms += ms
    total = sum(GEMM_KINDS.values()) * unit
    return {"tokens": t, "kinds": kinds, "total_ms": total_ms, "total_tflops": total / total_ms / 1e9}


def grouped_mm_fn():
    """PyTorch's grouped GEMM with device offsets, or None where the installed torch has none."""
    import torch

    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def peer_bench(moe, t, e, k, h, f, normalise, reps):
    """torch's grouped GEMM on our routing at T = t, kind by kind (the A rows gathered into
    expert order beforehand: it reads no index), and its gate_up and dx next to ours. Its
    weight gradients come out in bf16 (ours add into f32): the same FLOPs, not the same job."""
    import torch

    gmm = grouped_mm_fn()
    if gmm is None:
        return {"status": "absent", "reason": f"torch {torch.__version__} has no grouped_mm"}
    dev, bf = "cuda", torch.bfloat16
    x, logits, w_gu, w_d, dout = bench_inputs(t, e, h, f)
    _, s = moe.forward(x, x, logits, w_gu, w_d, k, normalise)
    r = t * k
    tok = (s["row_slot"].long() // k)
    offs = s["off"][1:].to(torch.int32).contiguous()
    xp, dyp = x[tok].contiguous(), dout[tok].contiguous()
    mid = s["mid"]
    dgu = torch.randn(r, 2 * f, device=dev, dtype=bf)
    calls = {
        "gate_up": lambda: gmm(xp, w_gu.transpose(1, 2), offs=offs),
        "down": lambda: gmm(mid, w_d.transpose(1, 2), offs=offs),
        "down_bwd": lambda: gmm(dyp, w_d, offs=offs),
        "dx": lambda: gmm(dgu, w_gu, offs=offs),
        "wgrad_down": lambda: gmm(dyp.t(), mid, offs=offs),
        "wgrad_gate_up": lambda: gmm(dgu.t(), xp, offs=offs),
    }
    res = {"status": "ok", "function": getattr(gmm, "__module__", "") + "." + gmm.__name__, "tokens": t, "kinds": {}}
    unit = float(r * h * f)
    for kind, fn in calls.items():
        try:
            ms = time_ms(fn, reps)
            res["kinds"][kind] = {"flops": GEMM_KINDS[kind] * unit, "ms": ms, "tflops": GEMM_KINDS[kind] * unit / ms / 1e9}
        except Exception as ex:  # a layout it does not take: say so, time the rest
            res["kinds"][kind] = {"status": "failed", "reason": str(ex).splitlines()[0][:300]}
    ok = [v for v in res["kinds"].values() if "ms" in v]
    if len(ok) == len(calls):
        total_ms = sum(v["ms"] for v in ok)
        res["total_ms"], res["total_tflops"] = total_ms, sum(v["flops"] for v in ok) / total_ms / 1e9
    # Ours against it on the same products (both bf16 out of f32 sums: only the order differs).
    try:
        res["ours_vs_peer_gate_up"] = errs(moe.gemm("mt_moe_gemm_nk", x, s["row_slot"], k, w_gu, s["off"], 2 * f, h, r),
                                           gmm(xp, w_gu.transpose(1, 2), offs=offs))
        res["ours_vs_peer_dx"] = errs(moe.gemm("mt_moe_gemm_kn", dgu, None, 1, w_gu, s["off"], h, 2 * f, r),
                                      gmm(dgu, w_gu, offs=offs))
    except Exception as ex:
        res["ours_vs_peer"] = {"status": "failed", "reason": str(ex).splitlines()[0][:300]}
    return res


def bench(moe, t, e, k, h, f, normalise, reps, loop=True):
    import torch

    dev, bf = "cuda", torch.bfloat16
    r = t * k
    fwd_flops = 6.0 * r * h * f
    res = {"tokens": t, "routed_rows": r, "forward_flops": fwd_flops, "systems": {}}

    try:
        res["systems"]["ours_grouped"] = time_ours(moe, t, e, k, h, f, normalise, reps)
    except Exception as ex:  # keep going: the other systems still say something
        res["systems"]["ours_grouped"] = {"status": "failed", "reason": str(ex).splitlines()[0][:300]}
    torch.cuda.empty_cache()

    if loop:
        try:
            x, logits, w_gu, w_d, dout = bench_inputs(t, e, h, f)
            xg = x.detach().requires_grad_()
            gg, dg = w_gu.detach().requires_grad_(), w_d.detach().requires_grad_()
            tf = time_ms(lambda: torch_loop(xg, logits, gg, dg, k, normalise), max(1, reps // 2))
            o = torch_loop(xg, logits, gg, dg, k, normalise)
            tb = time_ms(lambda: torch.autograd.grad(o, (xg, gg, dg), dout, retain_graph=True), max(1, reps // 2))
            res["systems"]["torch_per_expert_loop"] = entry(fwd_flops, tf, tb)
            del o
        except Exception as ex:
            res["systems"]["torch_per_expert_loop"] = {"status": "failed", "reason": str(ex).splitlines()[0][:300]}
        torch.cuda.empty_cache()

    try:
        # Dense bf16 matmuls of the same FLOPs: [R, H] x [H, 2F], [R, F] x [F, H]; backward: the
        # dX and dW products of both.
        a = torch.randn(r, h, device=dev, dtype=bf)
        wg = torch.randn(h, 2 * f, device=dev, dtype=bf)
        m = torch.randn(r, f, device=dev, dtype=bf)
        wd = torch.randn(f, h, device=dev, dtype=bf)
        dgu = torch.randn(r, 2 * f, device=dev, dtype=bf)
        dy = torch.randn(r, h, device=dev, dtype=bf)

        def fwd():
            a @ wg
            m @ wd

        def bwd():
            dy @ wd.t()
            m.t() @ dy
            dgu @ wg.t()
            a.t() @ dgu

        res["systems"]["torch_dense_matmul"] = entry(fwd_flops, time_ms(fwd, reps), time_ms(bwd, reps))
        del a, wg, m, wd, dgu, dy
    except Exception as ex:
        res["systems"]["torch_dense_matmul"] = {"status": "failed", "reason": str(ex).splitlines()[0][:300]}
    torch.cuda.empty_cache()
    ours, dense = res["systems"].get("ours_grouped", {}), res["systems"].get("torch_dense_matmul", {})
    if ours.get("status") == "ok" and dense.get("status") == "ok":
        res["ours_over_dense_fwd_bwd"] = ours["fwd_bwd_tflops"] / dense["fwd_bwd_tflops"]
    return res


def run_checks(moe, tokens, e, k, h, f, normalise, label=""):
    """Every check case at each token count: (results, failures)."""
    import torch

    out, failed = [], 0
    cases = [("random", normalise), ("random", not normalise), ("ties", normalise), ("skewed", normalise),
             ("skewed", not normalise)]
    for t in tokens:
        for i, (kind, norm) in enumerate(cases):
            try:
                r = check(moe, kind, t, e, k, h, f, norm, seed=t + i)
            except Exception as ex:
                print(f"{label}check {kind} t={t} norm={norm}: FAILED {ex}", flush=True)
                out.append({"case": kind, "tokens": t, "norm_topk_prob": norm, "error": str(ex)[:500]})
                failed += 1
                continue
            failed += 0 if r["pass"] else 1
            out.append(r)
            print(f"{label}check {kind:6} t={t} norm={int(norm)} pass={r['pass']} "
                  f"top_k_mismatch={r['top_k_mismatched_rows']} perm={r['permutation_equal']} "
                  f"empty={r['experts_without_tokens']} max_rows={r['largest_expert_rows']} "
                  + " ".join(f"{n} {r[n]['rel_l2']:.1e}/{r[n]['max_abs_over_max_ref']:.1e}"
                             for n in ("out", "dx", "dw_gate_up", "dw_down", "d_routing_weights", "d_logits"))
                  + f" repeatable={r['bitwise_repeatable']}", flush=True)
            torch.cuda.empty_cache()
    return out, failed


def sweep_variant(name, defines, tokens, e, k, h, f, normalise, a):
    """One variant: compiled, checked, each GEMM kind timed, the whole forward and backward timed."""
    import torch

    geo = HopperGeometry(defines) if is_hopper(defines) else Geometry(defines)
    res = {"name": name, "defines": defines, "geometry": geo.as_dict()}
    if is_hopper(defines) and torch.cuda.get_device_capability() != (9, 0):
        res["skipped"] = "the wgmma kernels need compute capability 9.0"
        print(f"variant {name}: skipped ({res['skipped']})", flush=True)
        return res, None
    try:
        moe = Moe(defines)
    except Exception as ex:
        res["error"] = str(ex)[:2000]
        print(f"variant {name}: FAILED to compile or load: {str(ex)[:500]}", flush=True)
        return res, None
    res["arch"], res["ptxas_spills"] = moe.arch, moe.spills
    res["registers"] = {n: r for n, r in moe.registers.items() if "gemm" in n}
    res["checks"], res["checks_failed"] = run_checks(moe, tokens, e, k, h, f, normalise, label=f"[{name}] ")
    if not a.skip_bench:
        for t in [int(x) for x in a.tokens.split(",") if x]:
            try:
                res.setdefault("gemms", []).append(gemm_bench(moe, t, e, k, h, f, normalise, a.reps))
                torch.cuda.empty_cache()
                res.setdefault("pipeline", []).append({"tokens": t, **time_ours(moe, t, e, k, h, f, normalise, a.reps)})
            except Exception as ex:
                res.setdefault("bench_errors", []).append(f"t={t}: {str(ex).splitlines()[0][:300]}")
                print(f"variant {name} t={t}: bench FAILED {ex}", flush=True)
            torch.cuda.empty_cache()
    return res, moe


TABLE_HEAD = (f"{'variant':14} {'regs':>4} {'KiB':>4} {'checks':>7} | " + " ".join(f"{k:>13}" for k in GEMM_KINDS)
              + f" | {'gemms':>6} {'fwd+bwd':>7}  (TFLOP/s)")


def table_row(v):
    """A variant's line of the table: TFLOP/s of each GEMM kind (the largest token count), their
    sum, the whole layer."""
    regs = max(v.get("registers", {}).values(), default=0)
    n_checks = len(v.get("checks", []))
    line = (f"{v['name']:14} {regs:>4} {v['geometry']['smem_bytes'] // 1024:>4} "
            f"{n_checks - v.get('checks_failed', n_checks):>3}/{n_checks:<3} | ")
    g = (v.get("gemms") or [None])[-1]
    line += " ".join(f"{g['kinds'][k]['tflops']:>13.0f}" if g else f"{'-':>13}" for k in GEMM_KINDS)
    p = (v.get("pipeline") or [None])[-1]
    line += f" | {g['total_tflops']:>6.0f}" if g else f" | {'-':>6}"
    line += f" {p['fwd_bwd_tflops']:>7.0f}" if p and p.get("status") == "ok" else f" {'-':>7}"
    return (line + ("  FAILED: " + v["error"][:60] if "error" in v else "")
            + ("  skipped: " + v["skipped"] if "skipped" in v else ""))


def print_table(variants, peer):
    """Every variant's line, and the peer's."""
    print(TABLE_HEAD)
    for v in variants:
        print(table_row(v))
    if peer and peer.get("status") == "ok":
        line = f"{'torch grouped':14} {'':>4} {'':>4} {'':>7} | "
        line += " ".join(f"{peer['kinds'][k]['tflops']:>13.0f}" if "tflops" in peer["kinds"][k] else f"{'fail':>13}"
                         for k in GEMM_KINDS)
        line += f" | {peer['total_tflops']:>6.0f}" if "total_tflops" in peer else f" | {'-':>6}"
        print(line)
    elif peer:
        print(f"torch grouped GEMM: {peer.get('status')} {peer.get('reason', '')}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--compile-only", action="store_true", help="compile for sm_80 and sm_90 and report (no GPU)")
    p.add_argument("--tokens", default="8192,32768", help="bench token counts (4 x 2048, 16 x 2048)")
    p.add_argument("--check-tokens", default="512,4096")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-loop", action="store_true", help="leave out the per-expert PyTorch loop (slow)")
    p.add_argument("--variants", help="GEMM variants to check and time: 'all' or a comma list of names "
                   f"({', '.join(VARIANTS)}) and NAME=DEFINE=VALUE+DEFINE=VALUE items (--compile-only: all)")
    a = p.parse_args()
    if a.compile_only:
        return compile_only(parse_variants(a.variants or "all"))
    if not a.out:
        p.error("--out is required (or --compile-only)")
    variants = parse_variants(a.variants) if a.variants else None

    import torch

    cfg = json.loads(CONFIG.read_text())
    e, k, h, f = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["intermediate_size"]
    normalise = bool(cfg.get("norm_topk_prob", False))
    moe = Moe()
    doc = {
        "schema_version": SCHEMA_VERSION,
        "suite": "moe",
        "machine": machine(),
        "commit": os.environ.get("MT_COMMIT"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": {"file": str(CONFIG.relative_to(ROOT)), "experts": e, "top_k": k, "hidden": h,
                   "expert_width": f, "norm_topk_prob": normalise},
        "arch": moe.arch,
        "ptxas_spills": moe.spills,
        "flops": {"forward": FWD_FLOPS, "backward": BWD_FLOPS,
                  "gemm_kinds": {kd: f"{n}*R*H*F" for kd, n in GEMM_KINDS.items()}},
        "checks": [],
        "bench": [],
    }
    check_tokens = [int(x) for x in a.check_tokens.split(",") if x]
    bench_tokens = [int(x) for x in a.tokens.split(",") if x]
    failed = 0
    if variants is None:  # the default kernels' checks (a sweep checks every variant instead)
        doc["checks"], failed = run_checks(moe, check_tokens, e, k, h, f, normalise)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    if not a.skip_bench:
        for t in bench_tokens:
            r = bench(moe, t, e, k, h, f, normalise, a.reps, loop=not a.skip_loop)
            doc["bench"].append(r)
            line = f"bench t={t}:"
            for name, en in r["systems"].items():
                line += (f" {name} {en['fwd_ms']:.2f}/{en['bwd_ms']:.2f} ms {en['fwd_tflops']:.0f}/{en['bwd_tflops']:.0f}"
                         f"/{en['fwd_bwd_tflops']:.0f} TFLOP/s;" if en["status"] == "ok" else f" {name} failed;")
            print(line, flush=True)
            Path(a.out).write_text(json.dumps(doc, indent=1))
    if variants is not None:
        # The mma.sync variants, the peer, then the wgmma variants (new kernels last: one that
        # fails the device or hangs takes nothing measured before it), each written out as it ends.
        peer = None
        doc["variants"] = []
        order = [v for v in variants if not is_hopper(v[1])] + [None] + [v for v in variants if is_hopper(v[1])]
        for item in order:
            if item is None:
                if not a.skip_bench and bench_tokens:
                    try:
                        peer = peer_bench(moe, bench_tokens[-1], e, k, h, f, normalise, a.reps)
                    except Exception as ex:
                        peer = {"status": "failed", "reason": str(ex).splitlines()[0][:300]}
                    doc["peer_grouped_mm"] = peer
                    torch.cuda.empty_cache()
                continue
            name, defines = item
            res, vmoe = sweep_variant(name, defines, check_tokens, e, k, h, f, normalise, a)
            failed += res.get("checks_failed", 0) + (1 if "error" in res else 0)
            doc["variants"].append(res)
            del vmoe
            torch.cuda.empty_cache()
            Path(a.out).write_text(json.dumps(doc, indent=1))
            print(table_row(res), flush=True)
        print_table(doc["variants"], peer)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}; checks failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

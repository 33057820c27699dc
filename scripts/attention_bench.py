#!/usr/bin/env python3
"""Our flash attention kernels against PyTorch SDPA, on one GPU, one run.

Two implementations of ours: `hopper` (kernels/cuda/flash_attn_hopper.cu: wgmma, TMA, warp
specialisation; compute capability 9.0 only; launched through scripts/hopper_attention.py) and
`portable` (kernels/cuda/flash_attn.cu: mma.sync, any GPU of capability 8.0+, compiled with NVRTC
through CuPy). Both are compiled from the same sources and preludes as the engine's and launched
with its geometry, so what is timed here is what the engine runs. `hopper_nondet` is the Hopper
backward with its dQ adds in arrival order (not bitwise repeatable).

  check:  output, LSE, dQ, dK, dV against an f32 reference (SDPA's f32 path on upcast inputs,
          K/V repeated to the query heads; per document for packed sequences): relative L2 and
          max relative error, and a second backward compared bit for bit (determinism).
  bench:  forward and backward time of ours and of each SDPA backend torch has here (flash,
          cuDNN, efficient), causal, bf16, at each sequence length and head layout; TFLOP/s with
          the causal FLOPs: forward 2*B*NH*S^2*HD, backward 2.5x that. Medians of rounds that
          run every system once in turn (interleaved, after a warm-up round, the order rotating),
          so all see the same clocks and GPU state. With --window W and/or
          --sinks (GPT-OSS's sliding window and per-head sink logits; ours only, SDPA has
          neither: the SDPA backends are timed without them, for scale), the FLOPs count the
          visible (query, key) pairs: forward 4*B*NH*HD*pairs, pairs = sum_i min(i + 1, W).

Writes one JSON document (schema below) to --out and prints a table. Needs torch and cupy.

  python3 scripts/attention_bench.py --out results.json [--seqs 16384,65536,131072]
      [--heads 28:4,32:8] [--d64-heads 32:8] [--check-seqs 4096,32768] [--reps 5]
      [--ours hopper,portable] [--sdpa flash,cudnn] [--window 128] [--sinks]

  GPT-OSS's attention (64/8 heads of 64, window 128, sinks) on ours, with and without extras:
  python3 scripts/attention_bench.py --out w.json --heads '' --d64-heads 64:8 --check-seqs '' \
      --seqs 4096,16384,65536 --window 128 --sinks --sdpa ''
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1
FWD_FLOPS = "2*B*NH*S^2*HD (causal); with a window W: 4*B*NH*HD*sum_i min(i + 1, W)"
BWD_FLOPS = "2.5 x forward"
TIMING = ("median of --reps rounds (at least 3 past 16k, --reps / 2 if more) after one warm-up round; "
          "each round runs every system's forward and backward once, in turn (interleaved), "
          "starting one further along each round")


def kernels_source() -> str:
    common = (ROOT / "kernels" / "cuda" / "common.cuh").read_text()
    flash = (ROOT / "kernels" / "cuda" / "flash_attn.cu").read_text()
    return f'#line 1 "common.cuh"\n{common}\n#line 1 "flash_attn.cu"\n{flash}'


class Ours:
    """The four kernels, launched as the engine launches them."""

    THREADS = 128

    def __init__(self):
        import cupy

        self.cp = cupy
        self.mod = cupy.RawModule(code=kernels_source(), options=("--std=c++17", "-arch=compute_90"))
        self.fns = {}

    def fn(self, name: str, smem: int):
        k = self.fns.get(name)
        if k is None:
            k = self.mod.get_function(name)
            self.fns[name] = k
        if smem > 48 * 1024:
            k.max_dynamic_shared_size_bytes = smem
        return k

    @staticmethod
    def smem(hd: int) -> dict:
        return {"fwd": hd * 768, "dkdv": hd * 768 + 1024, "dq": hd * 768}

    def ptr(self, t):
        import numpy

        return numpy.uint64(t.data_ptr())

    def forward(self, q, k, v, seg_lo=None, window=0, sinks=None):
        import numpy
        import torch

        b, t, nh, hd = q.shape
        nkv = k.shape[2]
        o = torch.empty_like(q)
        lse = torch.empty((b, nh, t), dtype=torch.float32, device=q.device)
        scale = 1.0 / math.sqrt(hd)
        sm = self.smem(hd)["fwd"]
        f = self.fn(f"mt_flash_fwd_hd{hd}", sm)
        lo = self.ptr(seg_lo) if seg_lo is not None else numpy.uint64(0)
        f(
            ((t + 127) // 128, nh, b),
            (self.THREADS,),
            (self.ptr(q), self.ptr(k), self.ptr(v), self.ptr(o), self.ptr(lse), lo,
             self.ptr(sinks) if sinks is not None else numpy.uint64(0), numpy.int32(min(window, t)), numpy.int32(t), numpy.int32(nh), numpy.int32(nkv), numpy.float32(scale * math.log2(math.e))),
            shared_mem=sm,
        )
        return o, lse

    def backward(self, q, k, v, o, lse, do, seg_lo=None, seg_hi=None, window=0, sinks=None):
        """(dq, dk, dv), and with `sinks` also their gradient (f32 [nh]) as a fourth."""
        import numpy
        import torch

        b, t, nh, hd = q.shape
        nkv = k.shape[2]
        scale = 1.0 / math.sqrt(hd)
        sl2 = scale * math.log2(math.e)
        d = torch.empty((b, nh, t), dtype=torch.float32, device=q.device)
        rows = b * t * nh
        self.fn("mt_flash_bwd_dot", 0)(
            ((rows + 3) // 4,), (self.THREADS,),
            (self.ptr(do), self.ptr(o), self.ptr(d), numpy.int32(t), numpy.int32(nh), numpy.int32(hd),
             numpy.int64(rows)),
        )
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lo = self.ptr(seg_lo) if seg_lo is not None else numpy.uint64(0)
        hi = self.ptr(seg_hi) if seg_hi is not None else numpy.uint64(0)
        sm = self.smem(hd)
        self.fn(f"mt_flash_bwd_dkdv_hd{hd}", sm["dkdv"])(
            ((t + 63) // 64, nkv, b), (self.THREADS,),
            (self.ptr(q), self.ptr(k), self.ptr(v), self.ptr(do), self.ptr(lse), self.ptr(d), self.ptr(dk),
             self.ptr(dv), lo, hi, numpy.int32(min(window, t)), numpy.int32(t), numpy.int32(nh), numpy.int32(nkv),
             numpy.float32(scale), numpy.float32(sl2)),
            shared_mem=sm["dkdv"],
        )
        self.fn(f"mt_flash_bwd_dq_hd{hd}", sm["dq"])(
            ((t + 63) // 64, nh, b), (self.THREADS,),
            (self.ptr(q), self.ptr(k), self.ptr(v), self.ptr(do), self.ptr(lse), self.ptr(d), self.ptr(dq), lo,
             numpy.int32(min(window, t)), numpy.int32(t), numpy.int32(nh), numpy.int32(nkv), numpy.float32(scale),
             numpy.float32(sl2)),
            shared_mem=sm["dq"],
        )
        if sinks is None:
            return dq, dk, dv
        dsinks = torch.empty(nh, dtype=torch.float32, device=q.device)
        self.fn("mt_flash_sink_grad", 16)(
            (nh,), (self.THREADS,),
            (self.ptr(lse), self.ptr(d), self.ptr(sinks), self.ptr(dsinks), numpy.int32(b), numpy.int32(t),
             numpy.int32(nh)),
            shared_mem=16,
        )
        return dq, dk, dv, dsinks


def reference(q, k, v, do, docs=None):
    """f32 attention and gradients, [b, t, heads, hd] in and out, through SDPA's f32 path."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2).detach().requires_grad_()
    kf = k.float().transpose(1, 2).detach().requires_grad_()
    vf = v.float().transpose(1, 2).detach().requires_grad_()
    ke, ve = kf.repeat_interleave(g, dim=1), vf.repeat_interleave(g, dim=1)
    dof = do.float().transpose(1, 2)
    # The memory-efficient backend takes f32 and keeps O(s) memory (the math one would need s x s).
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        if docs is None:
            o = F.scaled_dot_product_attention(qf, ke, ve, is_causal=True)
        else:
            parts = [F.scaled_dot_product_attention(qf[:, :, s:e], ke[:, :, s:e], ve[:, :, s:e], is_causal=True)
                     for s, e in docs]
            o = torch.cat(parts, dim=2)
        o.backward(dof)
    return o.transpose(1, 2), None, qf.grad.transpose(1, 2), kf.grad.transpose(1, 2), vf.grad.transpose(1, 2)


def errs(got, want):
    g, w = got.float(), want.float()
    rel_l2 = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
    max_rel = ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
    finite = bool(torch_isfinite(g))
    return {"rel_l2": rel_l2, "max_abs_over_max_ref": max_rel, "finite": finite}


def torch_isfinite(x):
    import torch

    return torch.isfinite(x).all().item()


def check(ours, s, nh, nkv, hd, docs_n, seed, impl="portable"):
    import torch

    torch.manual_seed(seed)
    dev = "cuda"
    q = torch.randn(1, s, nh, hd, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, s, nkv, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, s, nkv, hd, device=dev, dtype=torch.bfloat16)
    do = torch.randn(1, s, nh, hd, device=dev, dtype=torch.bfloat16)
    docs, lo, hi = None, None, None
    if docs_n:
        cuts = sorted(torch.randperm(s - 1)[: docs_n - 1].add(1).tolist())
        bounds = [0] + cuts + [s]
        docs = list(zip(bounds[:-1], bounds[1:]))
        lo = torch.empty(s, dtype=torch.int32)
        hi = torch.empty(s, dtype=torch.int32)
        for a, b in docs:
            lo[a:b], hi[a:b] = a, b
        lo, hi = lo.to(dev), hi.to(dev)
    o, lse = ours.forward(q, k, v, lo)
    dq, dk, dv = ours.backward(q, k, v, o, lse, do, lo, hi)
    dq2, dk2, dv2 = ours.backward(q, k, v, o, lse, do, lo, hi)
    torch.cuda.synchronize()
    det = bool(torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2))
    ro, _, rdq, rdk, rdv = reference(q, k, v, do, docs)
    # LSE reference from the f32 scores, a row block at a time (whole rows only where s is small).
    res = {
        "impl": impl, "seq_len": s, "heads": nh, "kv_heads": nkv, "head_dim": hd, "documents": docs_n or 1,
        "o": errs(o, ro), "dq": errs(dq, rdq), "dk": errs(dk, rdk), "dv": errs(dv, rdv),
        "backward_bitwise_repeatable": det,
    }
    if s <= 8192 and not docs_n:
        qf, kf = q.float().transpose(1, 2), k.float().transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        sc = (qf @ kf.transpose(-1, -2)) / math.sqrt(hd)
        sc = sc.masked_fill(torch.ones(s, s, device=dev, dtype=torch.bool).triu(1), float("-inf"))
        rl = torch.logsumexp(sc, dim=-1)
        res["lse"] = errs(lse, rl)
        del sc
    return res


def time_once(fn, ctx=contextlib.nullcontext):
    """Milliseconds of one call of `fn` on the GPU (CUDA events around it, then a synchronise),
    inside `ctx()` (entered before the first event: an SDPA backend's selection is not timed)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ctx():
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def time_ms(fn, reps):
    """Median milliseconds of `reps` calls of `fn` after one warm-up call (one system alone; the
    MoE bench's timing)."""
    import torch

    fn()
    torch.cuda.synchronize()
    return sorted(time_once(fn) for _ in range(reps))[reps // 2]


def time_interleaved(fns, reps):
    """Median milliseconds of each callable in `fns` (name -> callable, or (context factory,
    callable) to run it inside a context, see `time_once`), or the error that stopped it (a
    RuntimeError holding its message, no traceback: nothing of the bench stays alive through
    it). Each runs once as warm-up, then `reps` rounds run every one once, in turn, starting one
    further along each round, so all see the same clocks and GPU state: timed one system after
    another, the same forward code varied by up to 14% between systems (the Hopper forward at
    64k 32/8 on an H200: 538 TFLOP/s in one build, 594-614 in three others). A callable that
    raises is dropped from later rounds."""
    import torch

    names = list(fns)
    times, failed = {n: [] for n in names}, {}
    for r in range(reps + 1):
        k = r % len(names) if names else 0
        for n in names[k:] + names[:k]:
            if n in failed:
                continue
            ctx, f = fns[n] if isinstance(fns[n], tuple) else (contextlib.nullcontext, fns[n])
            try:
                t = time_once(f, ctx)
            except Exception as e:  # out of memory, or a backend torch lacks here
                failed[n] = RuntimeError(str(e) or type(e).__name__)
                torch.cuda.synchronize()
                continue
            if r > 0:
                times[n].append(t)
    return {n: failed.get(n) or sorted(t)[len(t) // 2] for n, t in times.items()}


def visible_pairs(s, window=0):
    """Causal (query, key) pairs of one sequence of s tokens, with a sliding window if W > 0."""
    if window <= 0 or window >= s:
        return s * (s + 1) / 2
    return window * (window + 1) / 2 + (s - window) * window


def bench(impls, s, nh, nkv, hd, reps, sdpa=("flash", "cudnn"), window=0, sinks=False):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda"
    torch.manual_seed(0)
    q = torch.randn(1, s, nh, hd, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, s, nkv, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, s, nkv, hd, device=dev, dtype=torch.bfloat16)
    do = torch.randn(1, s, nh, hd, device=dev, dtype=torch.bfloat16)
    extras = {"window": window, "sinks": torch.randn(nh, device=dev, dtype=torch.float32) if sinks else None}
    fwd_flops = 2.0 * nh * s * s * hd
    ours_flops = 4.0 * nh * hd * visible_pairs(s, window) if window else fwd_flops
    out = {"seq_len": s, "heads": nh, "kv_heads": nkv, "head_dim": hd, "window": window or None,
           "sinks": sinks, "systems": {}}

    # Each system's forward and backward callables, then all timed in interleaved rounds.
    fns, meta, keep = {}, {}, []
    for name, (ours, kw) in impls.items():
        try:
            o, lse = ours.forward(q, k, v, **extras)
        except Exception as e:
            out["systems"][name] = {"status": "failed", "reason": str(e).splitlines()[0][:300]}
            continue
        keep.append((o, lse))
        fns[(name, "fwd")] = lambda ours=ours: ours.forward(q, k, v, **extras)
        fns[(name, "bwd")] = lambda ours=ours, kw=kw, o=o, lse=lse: ours.backward(q, k, v, o, lse, do, **kw, **extras)
        meta[name] = (ours_flops, None)

    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, be in ((n, backends[n]) for n in sdpa):
        try:
            gqa = "enable_gqa"
            kk, vv = kt, vt
            try:
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=True)
            except Exception:
                gqa = "kv repeated"
                kk, vv = kt.repeat_interleave(nh // nkv, 1), vt.repeat_interleave(nh // nkv, 1)
            kw = {"enable_gqa": True} if gqa == "enable_gqa" else {}
            qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kk, vv))
            with sdpa_kernel([be]):
                ot = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, **kw)
        except Exception as e:  # a backend torch lacks here, or out of memory
            out["systems"][name] = {"status": "failed", "reason": str(e).splitlines()[0][:300]}
            continue
        keep.append(ot)

        # The forward inside the backend's selection; the backward of the forward above runs
        # the backend that forward chose.
        fns[(name, "fwd")] = (lambda be=be: sdpa_kernel([be]),
                              lambda qg=qg, kg=kg, vg=vg, kw=kw: F.scaled_dot_product_attention(
                                  qg, kg, vg, is_causal=True, **kw))
        fns[(name, "bwd")] = lambda ot=ot, qg=qg, kg=kg, vg=vg: torch.autograd.grad(
            ot, (qg, kg, vg), dot, retain_graph=True)
        meta[name] = (fwd_flops, gqa)

    t = time_interleaved(fns, reps)
    for name, (flops, gqa) in meta.items():
        t_f, t_b = t[(name, "fwd")], t[(name, "bwd")]
        bad = next((x for x in (t_f, t_b) if isinstance(x, Exception)), None)
        if bad is not None:
            out["systems"][name] = {"status": "failed", "reason": str(bad).splitlines()[0][:300]}
        else:
            out["systems"][name] = entry(t_f, t_b, flops, "ok", gqa)
    del keep, fns, t
    torch.cuda.empty_cache()
    return out


def entry(t_f, t_b, fwd_flops, status, gqa=None):
    e = {
        "status": status,
        "fwd_ms": t_f,
        "bwd_ms": t_b,
        "fwd_tflops": fwd_flops / t_f / 1e9,
        "bwd_tflops": 2.5 * fwd_flops / t_b / 1e9,
        "fwd_bwd_tflops": 3.5 * fwd_flops / (t_f + t_b) / 1e9,
    }
    if gqa:
        e["gqa"] = gqa
    return e


def machine():
    import torch

    gpu = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        smi = None
    return {"hostname": platform.node(), "gpu": gpu.name, "sm_count": gpu.multi_processor_count,
            "nvidia_smi": smi, "torch": torch.__version__, "cuda": torch.version.cuda}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seqs", default="16384,65536,131072")
    p.add_argument("--heads", default="28:4,32:8", help="NH:NKV pairs, head dim 128")
    p.add_argument("--d64-heads", default="32:8", help="NH:NKV pairs benchmarked at head dim 64 ('' for none)")
    p.add_argument("--ours", default="hopper,portable", help="our implementations: hopper, portable")
    p.add_argument("--sdpa", default="flash,cudnn", help="SDPA backends: flash, cudnn, efficient")
    p.add_argument("--hopper-variants", default="", help="NAME:MACRO[+MACRO],... extra builds of the Hopper kernels")
    p.add_argument("--check-seqs", default="4096,32768")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--window", type=int, default=0, help="GPT-OSS's sliding window for ours in the bench (0: none)")
    p.add_argument("--sinks", action="store_true", help="GPT-OSS's per-head sink logits for ours in the bench")
    p.add_argument("--also-plain", action="store_true",
                   help="with --window/--sinks, also time ours without them at the same shapes")
    a = p.parse_args()

    import torch

    impls = {}
    wanted = [x for x in a.ours.split(",") if x]
    cc = torch.cuda.get_device_capability()
    hopper = None
    if "hopper" in wanted:
        if cc != (9, 0):
            print(f"hopper kernels skipped: compute capability {cc[0]}.{cc[1]} is not 9.0")
        else:
            sys.path.insert(0, str(ROOT / "scripts"))
            import hopper_attention

            hopper = hopper_attention.Hopper()
            print(f"hopper kernels compiled: fatal ptxas warnings {hopper.problems or 'none'}; "
                  f"spills {hopper.spills or 'none'}", flush=True)
            impls["hopper"] = (hopper, {})
            impls["hopper_nondet"] = (hopper, {"deterministic": False})
            # Experiments: the same kernels compiled with extra macros (flash_attn_hopper.cu's
            # MT_HFA_* switches), timed beside the default.
            for v in [x for x in a.hopper_variants.split(",") if x]:
                name, defs = v.split(":")
                impls[f"hopper_{name}"] = (hopper_attention.Hopper(defs.split("+")), {})
    if "portable" in wanted:
        impls["portable"] = (Ours(), {})
    doc = {
        "schema_version": SCHEMA_VERSION,
        "suite": "attention",
        "machine": machine(),
        "commit": os.environ.get("MT_COMMIT"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "flops": {"forward": FWD_FLOPS, "backward": BWD_FLOPS},
        "timing": TIMING,
        "ptxas_warnings": hopper.problems if hopper else None,
        "ptxas_spills": hopper.spills if hopper else None,
        "checks": [],
        "bench": [],
    }
    heads = [tuple(int(x) for x in h.split(":")) for h in a.heads.split(",") if h]
    heads64 = [tuple(int(x) for x in h.split(":")) for h in a.d64_heads.split(",") if h]
    for s in [int(x) for x in a.check_seqs.split(",") if x]:
        for (impl, (ours, _)), (nh, nkv, hd, docs) in ((i, c) for i in impls.items()
                                                        if i[0] != "hopper_nondet" and "nodq" not in i[0]
                                                        for c in ((28, 4, 128, 0), (32, 8, 128, 0), (8, 2, 64, 0),
                                                                  (28, 4, 128, 7))):
            try:
                r = check(ours, s, nh, nkv, hd, docs, seed=s + nh, impl=impl)
            except Exception as e:  # keep going: the other checks and the bench still say something
                print(f"check {impl} s={s} nh={nh} nkv={nkv} hd={hd} docs={docs}: FAILED {e}", flush=True)
                doc["checks"].append({"impl": impl, "seq_len": s, "heads": nh, "kv_heads": nkv, "head_dim": hd,
                                      "documents": docs or 1, "error": str(e)[:500]})
                continue
            doc["checks"].append(r)
            print(f"check {impl} s={s} nh={nh} nkv={nkv} hd={hd} docs={r['documents']}: "
                  + " ".join(f"{n} {r[n]['rel_l2']:.2e}/{r[n]['max_abs_over_max_ref']:.2e}"
                             for n in ("o", "dq", "dk", "dv"))
                  + (f" lse {r['lse']['rel_l2']:.1e}" if "lse" in r else "")
                  + f" repeatable={r['backward_bitwise_repeatable']}", flush=True)
            torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(doc, indent=1))
    if not a.skip_bench:
        for s in [int(x) for x in a.seqs.split(",") if x]:
            layouts = [(nh, nkv, 128) for nh, nkv in heads] + [(nh, nkv, 64) for nh, nkv in heads64]
            for nh, nkv, hd in layouts:
                reps = a.reps if s <= 16384 else max(3, a.reps // 2)
                extras = [(a.window, a.sinks)]
                if (a.window or a.sinks) and a.also_plain:
                    extras.append((0, False))
                for window, sinks in extras:
                    sdpa = [x for x in a.sdpa.split(",") if x] if (window, sinks) == extras[-1] else []
                    r = bench(impls, s, nh, nkv, hd, reps, sdpa=sdpa, window=window, sinks=sinks)
                    doc["bench"].append(r)
                    line = f"bench s={s} {nh}/{nkv} d{hd} window {window} sinks {int(sinks)}:"
                    for name, e in r["systems"].items():
                        if e["status"] == "ok":
                            line += (f" {name} {e['fwd_ms']:.2f}+{e['bwd_ms']:.2f} ms "
                                     f"{e['fwd_tflops']:.0f}/{e['bwd_tflops']:.0f}/{e['fwd_bwd_tflops']:.0f}")
                        else:
                            line += f" {name} failed"
                    print(line, flush=True)
                Path(a.out).write_text(json.dumps(doc, indent=1))
                torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())

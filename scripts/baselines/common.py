"""Shared parts of the baseline training scripts (resident_torch.py, deepspeed_zero3.py).

Pure helpers (argument parsing, config reading, the FLOPs convention, host memory, the JSON Lines
writer) import nothing beyond the standard library, so they can be tested without torch. The
torch-dependent helpers import torch lazily.

The metrics log follows the contract of megatrain's `--metrics` log (crates/megatrain/src/metrics.rs):
one JSON object per line, a `run` record first, then one `step` record per optimizer step, or an
`error` record (reason "out of GPU memory: ..." and exit status 3 for a CUDA OOM). The fields are
listed in README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SCHEMA_VERSION = 1
FLOPS_FORMULA = "6*N*T + 6*L*S*H*T"
EXIT_OOM = 3


# ----------------------------------------------------------------------------- arguments


def parse_args(description: str, argv=None, extra=()) -> argparse.Namespace:
    """The baselines' shared command line, plus a script's own `extra` options (pairs of a flag
    and `add_argument`'s keyword arguments)."""
    p = argparse.ArgumentParser(description=description)
    for flag, kwargs in extra:
        p.add_argument(flag, **kwargs)
    p.add_argument("--config", required=True, help="HF config.json of the model (random init)")
    p.add_argument("--batch-size", type=int, required=True, help="sequences per optimizer step (B)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence (S)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps; step 1 is warm-up (still logged)")
    p.add_argument("--metrics", required=True, help="JSON Lines output (appended)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per forward/backward; B/M micro-batches are accumulated per step (default: B)",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0, help="seeds the model init and the synthetic tokens")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: smoke tests only")
    p.add_argument("--no-checkpointing", action="store_true", help="disable activation checkpointing")
    a = p.parse_args(argv)
    if a.micro_batch is None:
        a.micro_batch = a.batch_size
    for name in ("batch_size", "seq_len", "steps", "micro_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.batch_size % a.micro_batch != 0:
        p.error(f"--batch-size {a.batch_size} is not a multiple of --micro-batch {a.micro_batch}")
    a.grad_accum = a.batch_size // a.micro_batch
    return a


# ----------------------------------------------------------------------------- model config


def read_config(path: str | os.PathLike) -> dict:
    """The config.json as a dict (must name its model_type)."""
    with open(path) as f:
        d = json.load(f)
    if "model_type" not in d:
        raise ValueError(f"{path}: no model_type")
    return d


def model_dims(cfg: dict) -> dict:
    """The dimensions the FLOPs formula and the run record need, from a config dict."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return {
        "model_type": cfg["model_type"],
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": h,
        "intermediate_size": int(cfg["intermediate_size"]) if "intermediate_size" in cfg else None,
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or h // heads),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


MOE_TYPES = ("olmoe", "qwen3_moe", "mixtral", "gpt_oss")


def active_params(cfg: dict, n_params: int) -> int:
    """Parameters one token's forward uses (megatrain's mt_core::active_params): all of a dense
    model's; for a mixture of experts, all but the (E - k) experts per layer a token is not routed
    to (3 h f_e each; GPT-OSS adds its 2 f_e + h expert biases). The router counts in full."""
    mt = cfg["model_type"]
    if mt not in MOE_TYPES:
        return n_params
    e = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
    if not 0 < k <= e:
        raise ValueError(f"{mt}: {e} experts with top-{k}")
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"{mt}: dense layers among the MoE ones are not counted here")
    h = int(cfg["hidden_size"])
    fe = int(cfg["moe_intermediate_size"] if mt == "qwen3_moe" else cfg["intermediate_size"])
    per_expert = 3 * h * fe + (2 * fe + h if mt == "gpt_oss" else 0)
    return n_params - int(cfg["num_hidden_layers"]) * (e - k) * per_expert


def model_flops_per_step(n_params: int, batch: int, seq: int, layers: int, hidden: int) -> float:
    """6*N*T + 6*L*S*H*T with T = batch*seq and N the active parameters (active_params: attention
    counted, recompute not; the same convention as megatrain's mt_core::model_flops_per_step)."""
    t = batch * seq
    return 6.0 * n_params * t + 6.0 * layers * seq * hidden * t


def hf_config(cfg_dict: dict):
    """A transformers PretrainedConfig from a config dict (no hub access)."""
    from transformers import AutoConfig

    d = dict(cfg_dict)
    model_type = d.pop("model_type")
    for k in ("architectures", "transformers_version", "_name_or_path"):
        d.pop(k, None)
    c = AutoConfig.for_model(model_type, **d)
    c.use_cache = False
    return c


# ----------------------------------------------------------------------------- host memory


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """Current host resident set (VmRSS), None where it cannot be read."""
    return _proc_status_kb("VmRSS")


def rss_peak_bytes() -> int | None:
    """Peak host resident set of the process so far (VmHWM)."""
    return _proc_status_kb("VmHWM")


# ----------------------------------------------------------------------------- metrics log


class MetricsWriter:
    """Appends one JSON object per line, flushed and fsynced per record (a killed run keeps its
    lines); echo: also print each record to stderr (the run's log)."""

    def __init__(self, path: str | os.PathLike, echo: bool = True):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a")
        self._echo = echo

    def write(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, allow_nan=True) + "\n")
        self._f.flush()
        try:
            os.fsync(self._f.fileno())
        except OSError:
            pass
        if self._echo:
            print(json.dumps(rec), file=sys.stderr, flush=True)

    def close(self) -> None:
        self._f.close()


def run_record(system: str, args: argparse.Namespace, cfg: dict, n_params: int, **extra) -> dict:
    dims = model_dims(cfg)
    rec = {
        "type": "run",
        "system": system,
        "schema_version": SCHEMA_VERSION,
        "n_params": int(n_params),
        "config": str(args.config),
        "model": dims,
        "batch_size": args.batch_size,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "lr": args.lr,
        "seed": args.seed,
        "activation_checkpointing": not args.no_checkpointing,
        "tokens_per_step": args.batch_size * args.seq_len,
        "active_params": active_params(cfg, n_params),
        "model_flops_per_step": model_flops_per_step(
            active_params(cfg, n_params), args.batch_size, args.seq_len, dims["num_hidden_layers"], dims["hidden_size"]
        ),
        "flops_formula": FLOPS_FORMULA,
        "cpus": os.cpu_count(),
    }
    rec.update(extra)
    return rec


def step_record(
    step: int,
    loss: float,
    step_s: float,
    tokens: int,
    flops_per_step: float,
    gpu_peak_bytes: int | None,
    gpu_reserved_peak_bytes: int | None = None,
) -> dict:
    return {
        "type": "step",
        "step": step,
        "loss": loss,
        "step_ms": step_s * 1e3,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "model_tflops": flops_per_step / step_s / 1e12 if step_s > 0 else 0.0,
        "rss_bytes": rss_bytes(),
        "rss_peak_bytes": rss_peak_bytes(),
        "gpu_peak_bytes": gpu_peak_bytes,
        "gpu_reserved_peak_bytes": gpu_reserved_peak_bytes,
        "warmup": step == 1,
    }


def error_record(system: str, reason: str, **extra) -> dict:
    rec = {"type": "error", "system": system, "reason": reason}
    rec.update(extra)
    return rec


# ----------------------------------------------------------------------------- torch helpers


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is a GPU out-of-memory: torch.OutOfMemoryError (the caching allocator),
    or a RuntimeError carrying its message or cuBLAS's allocation failure. A bare "CUDA error: out
    of memory" is not counted: cudaHostAlloc (pinned host memory) fails with it too."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA out of memory" in msg or "CUBLAS_STATUS_ALLOC_FAILED" in msg)


def oom_reason(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"out of GPU memory: {first[:500]}"


def token_batches(vocab_size: int, batch: int, seq: int, seed: int):
    """Endless synthetic token ids, [batch, seq] int64 on the CPU, from a seeded generator: the same
    sequence of batches for every system and run with the same seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab_size, (batch, seq), generator=g, dtype=torch.long)


def gpu_name(device: str) -> str | None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


def gpu_peaks(device: str) -> tuple[int | None, int | None]:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return None, None


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def autocast_step(model, optimizer, device, grad_accum: int):
    """One optimizer step of a model resident on `device` over its micro-batches: each forward
    under bf16 autocast, its loss / `grad_accum` back-propagated, then the optimizer's step; the
    mean loss back (the resident baselines' step; DeepSpeed's engine steps itself)."""
    import torch

    def step(micro):
        total = torch.zeros((), device=device, dtype=torch.float32)
        for ids in micro:
            ids = ids.to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / grad_accum).backward()
            total += loss.detach().float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return (total / grad_accum).item()

    return step


def versions() -> dict:
    import torch
    import transformers

    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__}


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def s(self) -> float:
        return time.perf_counter() - self.t0


# ----------------------------------------------------------------------------- driver


_PHASE = {"phase": "init", "step": None}


def set_phase(phase: str, step: int | None = None) -> None:
    """Where the run is, for the error record."""
    _PHASE["phase"], _PHASE["step"] = phase, step


def run_guarded(system: str, metrics_path: str, body) -> None:
    """Calls body(writer). A GPU out-of-memory anywhere (model build included) becomes an `error`
    record and exit status 3; any other exception an `error` record, then it propagates."""
    writer = MetricsWriter(metrics_path)
    try:
        body(writer)
    except Exception as e:  # noqa: BLE001 - every failure is recorded, OOM is told apart
        if is_oom(e):
            writer.write(error_record(system, oom_reason(e), phase=_PHASE["phase"], step=_PHASE["step"]))
            writer.close()
            sys.exit(EXIT_OOM)
        first = str(e).strip().splitlines()[0][:500] if str(e).strip() else ""
        writer.write(
            error_record(system, f"{type(e).__name__}: {first}", phase=_PHASE["phase"], step=_PHASE["step"])
        )
        writer.close()
        raise
    writer.close()


def train_loop(args: argparse.Namespace, writer: MetricsWriter, vocab_size: int, flops_per_step: float, train_step):
    """The timed loop shared by both baselines. train_step(micro_batches) runs one optimizer step
    over the list of [micro_batch, seq] CPU token tensors and returns the mean loss as a float.
    Each step is timed wall-clock between two device synchronizations; step 1 is the warm-up and is
    logged like the others (with warmup: true)."""
    batches = token_batches(vocab_size, args.batch_size, args.seq_len, args.seed)
    tokens = args.batch_size * args.seq_len
    for step in range(1, args.steps + 1):
        set_phase("step", step)
        micro = list(next(batches).split(args.micro_batch))
        sync(args.device)
        t0 = time.perf_counter()
        loss = train_step(micro)
        sync(args.device)
        dt = time.perf_counter() - t0
        peak, reserved = gpu_peaks(args.device)
        writer.write(step_record(step, loss, dt, tokens, flops_per_step, peak, reserved))
    set_phase("done")

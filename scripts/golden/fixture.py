"""One fixture written: its config.json, its tensors as safetensors with the header metadata
sorted (byte-reproducible), and the summary `make_golden.py` prints."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy
import safetensors
import safetensors.torch
import torch
import transformers

from golden.model import build_model, check_rope, check_saved_config
from golden.run import make_batch, train
from golden.specs import (
    BIAS_STD,
    IGNORE,
    MAX_NORM,
    NORM_JITTER,
    PAD_TAIL,
    SCATTERED_IGNORED,
    Spec,
    B,
    T,
)

FORMAT = "megatrain-golden-v1"

TARGETS_DEF = (
    f"targets[b,t] = input_ids[b,t+1] for t < T-1, -100 at t = T-1; also -100 at the last "
    f"{PAD_TAIL} positions of sequence 1 and at (b,t) in {SCATTERED_IGNORED}"
)
LOSS_DEF = (
    "F.cross_entropy(logits.reshape(-1,V), targets.reshape(-1), ignore_index=-100, "
    "reduction='mean') on model(input_ids, position_ids=0..T-1).logits, no labels passed"
)
OPTIM_DEF = (
    f"per step: grad_norm = clip_grad_norm_(params, {MAX_NORM}) (pre-clip norm; clips), then "
    "AdamW(lr=1e-3, betas=(0.9,0.999), eps=1e-8, weight_decay=0.1), one param group"
)


def metadata(spec: Spec) -> dict[str, str]:
    return {
        "format": FORMAT,
        "model": spec.name,
        "seed": str(spec.seed),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": numpy.__version__,
        "batch": f"B={B}, T={T}, position_ids 0..T-1, causal, no attention mask",
        "targets": TARGETS_DEF,
        "loss": LOSS_DEF,
        "optimizer": OPTIM_DEF,
        "compute_dtype": "float64 (rotary cos/sin, RMSNorm and softmax internally float32)",
        "init": (
            f"transformers init in float32 after torch.manual_seed(seed); then RMSNorm weights "
            f"1+{NORM_JITTER}*randn and biases {BIAS_STD}*randn from Generator(seed+1)"
        ),
        "script": "scripts/make_golden.py",
    }


def make_one(spec: Spec, out_dir: Path, verbose: bool) -> dict:
    cfg_path = out_dir / f"{spec.name}.config.json"
    spec.config().to_json_file(cfg_path)
    check_saved_config(spec, cfg_path, verbose)

    model = build_model(spec)
    check_rope(spec, model)
    tensors: dict[str, torch.Tensor] = {}
    input_ids, targets = make_batch(spec, model.config.vocab_size)
    tensors["input_ids"] = input_ids
    tensors["targets"] = targets
    for name, p in model.named_parameters():
        tensors[f"param.{name}"] = p.detach().clone()
    n_params = sum(p.numel() for p in model.parameters())

    model.double()
    model.train()
    for name, t in train(model, input_ids, targets).items():
        tensors[name] = t.to(torch.float32).contiguous()
    path = out_dir / f"{spec.name}.safetensors"
    blob = safetensors.torch.save(tensors, metadata=metadata(spec))
    path.write_bytes(canonical_header(blob))
    return dict(
        name=spec.name,
        n_params=n_params,
        n_targets=int((targets != IGNORE).sum()),
        losses=[float(x) for x in tensors["losses"]],
        grad_norms=[float(x) for x in tensors["grad_norms"]],
        path=path,
    )


def canonical_header(blob: bytes) -> bytes:
    """Rewrites a safetensors file's JSON header with the metadata keys sorted.

    The safetensors writer keeps `__metadata__` in a Rust HashMap, whose order changes from run
    to run; sorting it makes the file bytes reproducible. Tensor entries keep their order (data
    offsets are relative to the end of the header, so its length may change freely).
    """
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + n :]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


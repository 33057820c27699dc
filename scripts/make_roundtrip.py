#!/usr/bin/env python3
"""Round-trip fixtures: HF models saved by transformers, trained by PyTorch, for `megatrain train`.

Run from the repository root (versions pinned in scripts/requirements-golden.txt):

    /opt/golden-venv/bin/python scripts/make_roundtrip.py            # (re)write the fixtures
    /opt/golden-venv/bin/python scripts/make_roundtrip.py --check    # ... twice, byte-identical
    /opt/golden-venv/bin/python scripts/make_roundtrip.py --verify NAME=EXPORT_DIR ...

The fixtures live in crates/megatrain/tests/fixtures/roundtrip/NAME/ for NAME in (llama, qwen2):

  model/config.json, model/model.safetensors   a tiny random model as `save_pretrained` writes it
  data.jsonl                                   N_LINES lines {"input_ids": [...]} of exactly SEQ tokens
  expected.safetensors                         PyTorch's weights after STEPS steps (float32, HF names),
                                               plus `losses` F32 [STEPS] (loss of each step before its update)
  expected.json                                the hyper-parameters below, so the Rust test uses the same

Training (the fixed interface of `megatrain train --no-shuffle`, issue REAL-USE): step k uses lines
k*B .. k*B+B-1 in file order; labels = input_ids shifted by one (logits[:, t] predicts ids[:, t+1]);
loss = mean cross-entropy over all B*(SEQ-1) targets; then torch.nn.utils.clip_grad_norm_(CLIP) and
torch.optim.AdamW(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD) (one parameter group,
decay on every parameter), constant learning rate, no warmup.

The reference computes in float64 (`model.double()`; transformers' own float32 islands -- rotary
cos/sin, the RMSNorm upcast, the eager softmax -- stay as transformers has them), so it is far more
accurate than a float32 engine; the script also trains the same model in float32 and prints how far
PyTorch's own float32 run lands from the float64 one, the scale the Rust test's bound is set against.

--verify loads each EXPORT_DIR (what `megatrain train --out` wrote) with
`transformers.AutoModelForCausalLM.from_pretrained`, checks that every parameter equals
expected.safetensors within the same bound as the Rust test (relative L2 per tensor), and runs a forward pass.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

OUT = Path("crates/megatrain/tests/fixtures/roundtrip")
SEQ, BATCH, STEPS, N_LINES = 16, 2, 4, 9  # 9 lines: the last one is never used (a partial batch)
LR, WD, CLIP = 1e-3, 0.1, 1.0
# Relative bound per tensor: ||ours - expected||_2 <= REL_TOL * ||expected||_2. (The max-norm
# version, max|d| / max|expected|, is printed too; PyTorch's own float32 run misses 1e-5 in it by
# 6x: AdamW turns fp32 rounding of near-cancelling gradient sums into update-sized differences.)
REL_TOL = 1e-5

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
MODELS = {
    "llama": (LlamaConfig, 2001, {}),
    "qwen2": (Qwen2Config, 2002, dict(use_sliding_window=False)),
}


def build(name: str, out: Path) -> None:
    cls, seed, extra = MODELS[name]
    d = out / name
    (d / "model").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = cls(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Non-trivial norms and biases, so every parameter has its own gradient.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    model.save_pretrained(d / "model")
    # transformers may write a generation_config.json; the engine ignores it, export copies it.

    g = torch.Generator().manual_seed(seed + 2)
    lines = torch.randint(0, COMMON["vocab_size"], (N_LINES, SEQ), generator=g)
    with open(d / "data.jsonl", "w") as f:
        for row in lines.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")

    ref, losses = train(d / "model", lines, torch.float64)
    f32, _ = train(d / "model", lines, torch.float32)
    worst = max(rel(f32[k], ref[k]) for k in ref)
    worst_max = max(rel_max(f32[k], ref[k]) for k in ref)
    print(f"{name}: {len(ref)} tensors; losses {[round(x, 6) for x in losses]}; "
          f"PyTorch float32 vs float64: worst tensor {worst:.2e} relative L2 (bound {REL_TOL:.0e}), "
          f"{worst_max:.2e} max-norm")
    tensors = {k: v.to(torch.float32).contiguous() for k, v in ref.items()}
    tensors["losses"] = torch.tensor(losses, dtype=torch.float32)
    save_file(tensors, d / "expected.safetensors")
    (d / "expected.json").write_text(json.dumps(dict(
        seq_len=SEQ, batch_size=BATCH, steps=STEPS, lr=LR, weight_decay=WD, clip=CLIP,
        betas=[0.9, 0.999], eps=1e-8, schedule="constant", warmup=0, rel_tol=REL_TOL,
        rel_metric="||a - b||_2 / ||b||_2 per tensor", reference="float64 PyTorch",
        float32_pytorch_worst_rel=float(f"{worst:.3e}"), float32_pytorch_worst_rel_max=float(f"{worst_max:.3e}"),
    ), indent=2) + "\n")


def train(model_dir: Path, lines: torch.Tensor, dtype: torch.dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = model.to(dtype)
    model.train()
    params = [p for _, p in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    losses = []
    for k in range(STEPS):
        ids = lines[k * BATCH:(k + 1) * BATCH]
        logits = model(input_ids=ids).logits
        V = logits.shape[-1]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="mean")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_2 / ||b||_2 (the bound's metric)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def verify(pairs: list[str]) -> int:
    bad = 0
    for pair in pairs:
        name, export = pair.split("=", 1)
        expected = load_file(OUT / name / "expected.safetensors")
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, local_files_only=True)
        got = dict(model.named_parameters())
        names = set(expected) - {"losses"}
        if set(got) != names:
            print(f"{name}: parameter names differ: {sorted(set(got) ^ names)}")
            bad += 1
            continue
        worst = max((rel(got[n].detach(), expected[n]), n) for n in names)
        worst_max = max(rel_max(got[n].detach(), expected[n]) for n in names)
        ids = torch.arange(SEQ).unsqueeze(0) % model.config.vocab_size
        logits = model(input_ids=ids).logits
        ok = worst[0] <= REL_TOL and torch.isfinite(logits).all().item()
        print(f"{name}: {type(model).__name__} from {export}: {len(names)} tensors, worst {worst[0]:.2e} "
              f"relative L2 ({worst[1]}), {worst_max:.2e} max-norm; forward ok: {ok}")
        bad += not ok
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="build twice and require identical bytes")
    ap.add_argument("--verify", nargs="+", metavar="NAME=DIR", help="load exported dirs with transformers")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.verify:
        return 1 if verify(a.verify) else 0
    for name in MODELS:
        build(name, a.out)
    if a.check:
        with tempfile.TemporaryDirectory() as t:
            for name in MODELS:
                build(name, Path(t))
            cmp = filecmp.dircmp(a.out, t)
            diffs = []
            for name in MODELS:
                for sub in ("", "model"):
                    c = filecmp.dircmp(a.out / name / sub, Path(t) / name / sub)
                    _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
                    diffs += mismatch + errors
            del cmp
            if diffs:
                print(f"not reproducible: {diffs}")
                return 1
            print("check: a second build wrote identical bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""LoRA golden fixtures from peft + transformers for the engine's adapter tests.

Run (from the repository root; the venv of scripts/requirements-golden.txt plus peft, pinned in
scripts/requirements-lora.txt):

    .venv/bin/python scripts/make_lora_golden.py [--out DIR] [--check]

DIR defaults to crates/testkit/fixtures/lora. The base models are make_golden.py's (imported from
its package, scripts/golden/: same config, seed, initialisation, batch and loss), so a fixture's base weights are the
`param.*` tensors of crates/testkit/fixtures/golden/NAME.safetensors: the script checks that they
are, bit for bit, and records that file's sha256.

Adapters (peft's LoraConfig, task_type CAUSAL_LM, bias "none", lora_dropout 0, on every linear
layer of the decoder: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj):
  llama_gqa     r 4, lora_alpha 8: scale alpha / r = 2.
  qwen2_bias    r 4, lora_alpha 8, use_rslora: scale alpha / sqrt(r) = 4.
A is peft's own initialisation (kaiming-uniform, a = sqrt(5): uniform in +-1/sqrt(in)) after
torch.manual_seed(seed + 10); B, which peft sets to zero, is set to B_STD * randn from
Generator(seed + 11) in named_parameters() order, so that the gradient of A and the adapter's
contribution to every activation are non-zero: every gradient path is tested.

For each model NAME the script writes:
  NAME/adapter_config.json, NAME/adapter_model.safetensors: the initial adapter as peft's
      save_pretrained writes it (float32): what `megatrain train --lora-from` reads.
  NAME.safetensors: (all float32 but the ids)
      input_ids, targets  I64 [B, T]  (make_golden.py's batch)
      logits      [B, T, V]  step-0 logits of base + adapter
      loss        []         step-0 loss (make_golden.py's definition)
      losses      [3], grad_norms [3]  per step, as make_golden.py (norm over the adapters only)
      grad.NAME   step-0 gradient of each adapter tensor (NAME as in adapter_model.safetensors,
                  e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)
      step3.NAME  each adapter tensor after three steps
The base weights are frozen (requires_grad False, as peft leaves them); the three steps are
make_golden.py's: clip_grad_norm_(adapters, 1.0), then AdamW(adapters, lr 1e-3, betas (0.9,
0.999), eps 1e-8, weight_decay 0.1), all in float64 (model.double() after the float32 init).

Determinism: as make_golden.py (seeds, one thread, sorted metadata); --check runs twice and
compares the bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import safetensors.torch
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The base models, batch and loss are make_golden.py's (its package scripts/golden/).
from golden.fixture import LOSS_DEF, OPTIM_DEF, TARGETS_DEF, canonical_header  # noqa: E402
from golden.model import build_model  # noqa: E402
from golden.run import make_batch  # noqa: E402
from golden.specs import ADAMW, IGNORE, MAX_NORM, SPECS, STEPS, B, Spec, T  # noqa: E402

import peft  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

FORMAT = "megatrain-lora-golden-v1"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.05
LORA = {
    "llama_gqa": dict(r=4, lora_alpha=8, use_rslora=False),
    "qwen2_bias": dict(r=4, lora_alpha=8, use_rslora=True),
}


def spec_of(name: str) -> Spec:
    return next(s for s in SPECS if s.name == name)


def check_base(spec: Spec, model, golden_dir: Path) -> str:
    """The base weights are bit for bit the golden fixture's `param.*`; returns its sha256."""
    path = golden_dir / f"{spec.name}.safetensors"
    golden = safetensors.torch.load_file(path)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), golden[f"param.{name}"]), f"{spec.name}: {name} differs from {path}"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def saved_name(param_name: str) -> str:
    """peft's name in adapter_model.safetensors (the adapter's name `default` dropped)."""
    return param_name.replace(".default", "")


def build(spec: Spec, golden_dir: Path):
    model = build_model(spec)
    base_sha = check_base(spec, model, golden_dir)
    torch.manual_seed(spec.seed + 10)
    cfg = LoraConfig(
        task_type="CAUSAL_LM",
        target_modules=TARGETS,
        lora_dropout=0.0,
        bias="none",
        **LORA[spec.name],
    )
    pm = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(spec.seed + 11)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                assert bool((p == 0).all()), f"peft's B starts at zero: {name}"
                p.copy_(B_STD * torch.randn(p.shape, generator=gen))
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    n_modules = len(trainable) // 2
    assert n_modules == len(TARGETS) * spec.config().num_hidden_layers, trainable
    return pm, base_sha


def forward_loss(pm, input_ids, targets):
    position_ids = torch.arange(T, dtype=torch.int64).expand(B, T)
    logits = pm(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    v = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, v), targets.reshape(-1), ignore_index=IGNORE, reduction="mean"
    )
    return logits, loss


def train(pm, input_ids, targets) -> dict[str, torch.Tensor]:
    params = {saved_name(n): p for n, p in pm.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(params.values()), foreach=False, **ADAMW)
    out: dict[str, torch.Tensor] = {}
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        logits, loss = forward_loss(pm, input_ids, targets)
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().clone()
            out["loss"] = loss.detach().clone()
            for name, p in params.items():
                assert p.grad is not None and bool(p.grad.abs().max() > 0), f"no gradient: {name}"
                out[f"grad.{name}"] = p.grad.detach().clone()
            for n, p in pm.named_parameters():
                assert p.requires_grad or p.grad is None, f"a frozen parameter got a gradient: {n}"
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM)
        losses.append(loss.detach())
        norms.append(norm.detach())
        opt.step()
    out["losses"] = torch.stack(losses)
    out["grad_norms"] = torch.stack(norms)
    for name, p in params.items():
        out[f"step3.{name}"] = p.detach().clone()
    return out


def metadata(spec: Spec, base_sha: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "model": spec.name,
        "seed": str(spec.seed),
        "lora": json.dumps({**LORA[spec.name], "target_modules": TARGETS, "lora_dropout": 0.0}, sort_keys=True),
        "b_init": f"{B_STD} * randn from Generator(seed + 11); A: peft's init after manual_seed(seed + 10)",
        "base": f"param.* of crates/testkit/fixtures/golden/{spec.name}.safetensors, sha256 {base_sha}",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "peft_version": peft.__version__,
        "loss": LOSS_DEF,
        "targets": TARGETS_DEF,
        "optimizer": OPTIM_DEF + " over the adapters only; the base frozen",
        "compute_dtype": "float64 (transformers' float32 islands as in make_golden.py)",
        "script": "scripts/make_lora_golden.py",
    }


def make_one(name: str, out_dir: Path, golden_dir: Path) -> dict:
    spec = spec_of(name)
    pm, base_sha = build(spec, golden_dir)
    adapter_dir = out_dir / name
    pm.save_pretrained(adapter_dir)
    (adapter_dir / "README.md").unlink()  # peft's model card template: nothing we read
    input_ids, targets = make_batch(spec, pm.config.vocab_size)
    tensors = {"input_ids": input_ids, "targets": targets}
    pm.double()
    pm.train()
    for k, t in train(pm, input_ids, targets).items():
        tensors[k] = t.to(torch.float32).contiguous()
    path = out_dir / f"{name}.safetensors"
    blob = safetensors.torch.save(tensors, metadata=metadata(spec, base_sha))
    path.write_bytes(canonical_header(blob))
    n_adapter = sum(t.numel() for k, t in tensors.items() if k.startswith("step3."))
    return dict(
        name=name,
        n_adapter=n_adapter,
        losses=[float(x) for x in tensors["losses"]],
        grad_norms=[float(x) for x in tensors["grad_norms"]],
        files=[path, adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_config.json"],
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=repo / "crates/testkit/fixtures/lora")
    ap.add_argument("--golden", type=Path, default=repo / "crates/testkit/fixtures/golden")
    ap.add_argument("--check", action="store_true", help="run twice and compare sha256")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    results = [make_one(n, args.out, args.golden) for n in LORA]
    total = 0
    for r in results:
        size = sum(f.stat().st_size for f in r["files"])
        total += size
        losses = ", ".join(f"{x:.6f}" for x in r["losses"])
        norms = ", ".join(f"{x:.6f}" for x in r["grad_norms"])
        print(f"{r['name']:11s} adapter params {r['n_adapter']:6d}  losses [{losses}]  grad_norms [{norms}]  {size} bytes")
    print(f"total {total} bytes")
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            for r in results:
                again = make_one(r["name"], Path(tmp), args.golden)
                for a, b in zip(r["files"], again["files"]):
                    if sha256(a) != sha256(b):
                        print(f"error: {a} differs between two runs", file=sys.stderr)
                        return 1
        print("check: a second run produced byte-identical files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

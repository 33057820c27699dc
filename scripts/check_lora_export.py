#!/usr/bin/env python3
"""Checks a LoRA export of `megatrain train` against peft: the adapter directory loaded by
`PeftModel.from_pretrained` over the base model gives the same logits as the `--merge` export of
the same run loaded by transformers alone, and peft's loaded adapter tensors are the file's.

    .venv/bin/python scripts/check_lora_export.py BASE_DIR ADAPTER_DIR MERGED_DIR [--tol 1e-5]

(venv: scripts/requirements-lora.txt). Prints the relative error max|a - b| / max|b| of the
logits on a fixed random batch, in float64, and exits non-zero beyond --tol.
"""

import argparse
import sys

import safetensors.torch
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("adapter")
    ap.add_argument("merged")
    ap.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float64, attn_implementation="eager")
    pm = PeftModel.from_pretrained(base, a.adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(a.merged, dtype=torch.float64, attn_implementation="eager").eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 16))
    with torch.no_grad():
        x = pm(input_ids=ids).logits
        y = merged(input_ids=ids).logits
        z = base.get_base_model()(input_ids=ids).logits if hasattr(base, "get_base_model") else None
    saved = safetensors.torch.load_file(f"{a.adapter}/adapter_model.safetensors")
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    assert set(saved) == set(loaded), (sorted(saved)[:3], sorted(loaded)[:3])
    worst_t = max(float((loaded[k].double() - saved[k].double()).abs().max()) for k in saved)
    rel = float((x - y).abs().max() / y.abs().max())
    print(f"adapter tensors as loaded by peft vs the file: max abs diff {worst_t:.2e}")
    print(f"logits: peft(base + adapter) vs transformers(merged): rel err {rel:.2e} (tol {a.tol:.0e})")
    nonzero = sum(int((saved[k] != 0).any()) for k in saved if "lora_B" in k)
    print(f"lora_B tensors that are non-zero (trained): {nonzero} of {sum(1 for k in saved if 'lora_B' in k)}")
    return 0 if rel <= a.tol and worst_t == 0.0 and nonzero > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

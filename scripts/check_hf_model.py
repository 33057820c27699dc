#!/usr/bin/env python3
"""Check that a Hugging Face model directory loads in transformers and generates, offline.

Usage: check_hf_model.py DIR [--prompt TEXT] [--max-new-tokens N] [--compare DIR2_OR_GGUF]
                           [--probes PROBES_JSONL [--min-probe-acc X]]

- loads DIR with AutoModelForCausalLM + AutoTokenizer (local_files_only, float32, CPU unless --device),
- prints the parameter count,
- applies the tokenizer's chat template to a one-turn user prompt and generates greedily (40 new tokens by
  default), printing the completion,
- with --compare, runs a fixed prompt through DIR and through DIR2 (a model directory, or a .gguf file loaded
  by transformers' own GGUF support with gguf_file=...) and prints the max abs logit difference and whether
  the two tokenizers agree on a fixed text; fails if the difference exceeds --tol,
- with --probes (lines of {"prompt", "expect"}, as written by make_chat_data.py), answers every prompt greedily
  and counts the answers that contain the expected string; fails if the share is below --min-probe-acc.

Note: transformers' GGUF tokenizer loading ignores tokenizer.ggml.pre and so drops SmolLM's split-every-digit
step; it then differs from llama.cpp (and from our converted tokenizer) where whitespace runs precede a digit
("\n    0"). The probe texts here avoid that case; the rest of the comparison is exact.

Exits nonzero if loading, generation or the comparison fails, or the completion is empty.
Run with /opt/golden-venv/bin/python; transformers' GGUF loading needs the `gguf` package importable
(e.g. PYTHONPATH=/work/models/pylib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

COMPARE_TEXT = (
    "<|im_start|>user\nThe year 1987 had 365 days; what's 12*34? Explain, then write \"done\".<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TOKENIZER_PROBE = [
    "Hello, world! It's 2024-06-01 and 3.14159 isn't rational.\n\n  indented\tTab  café naïve 日本語 🙂",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 17+25?<|im_end|>\n",
    "def f(x):\n    return x**2  # square\n",
]


def load(path: str, device: str):
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        kw = dict(gguf_file=p.name, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(p.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), dtype=torch.float32, **kw)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return tok, model.to(device).eval()


@torch.no_grad()
def logits_for(model, tok, text: str, device: str) -> tuple[list[int], torch.Tensor]:
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    return ids[0].tolist(), model(ids).logits[0].float().cpu()


@torch.no_grad()
def chat_generate(model, tok, prompt: str, max_new_tokens: int, device: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = enc["input_ids"].to(device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    )
    return tok.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--compare", help="another model dir, or a .gguf file loaded by transformers")
    ap.add_argument("--tol", type=float, default=1e-3, help="max abs logit diff allowed with --compare")
    ap.add_argument("--probes", help="jsonl of {prompt, expect}; report how many greedy answers contain expect")
    ap.add_argument("--min-probe-acc", type=float, default=0.0, help="fail if the probe accuracy is below this")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.manual_seed(0)

    tok, model = load(args.dir, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"loaded {args.dir}: {type(model).__name__}, {n_params:,} parameters, dtype {model.dtype}")

    completion = chat_generate(model, tok, args.prompt, args.max_new_tokens, args.device)
    n_new = len(tok(completion, add_special_tokens=False).input_ids)
    print(f"prompt: {args.prompt!r}")
    print(f"generated (~{n_new} tokens, greedy): {completion!r}")
    ok = bool(completion.strip())
    if not ok:
        print("FAIL: empty completion", file=sys.stderr)

    if args.probes:
        probes = [json.loads(line) for line in Path(args.probes).read_text(encoding="utf-8").splitlines() if line]
        hits = 0
        for p in probes:
            answer = chat_generate(model, tok, p["prompt"], args.max_new_tokens, args.device)
            hit = p["expect"] in answer
            hits += hit
            print(f"  [{'ok' if hit else '--'}] {p['prompt']!r} -> {answer!r} (expect {p['expect']!r})")
        acc = hits / max(len(probes), 1)
        print(f"probes: {hits}/{len(probes)} answers contain the expected string ({acc:.0%})")
        if acc < args.min_probe_acc:
            print(f"FAIL: probe accuracy {acc:.0%} < {args.min_probe_acc:.0%}", file=sys.stderr)
            ok = False

    if args.compare:
        tok2, model2 = load(args.compare, args.device)
        ids1, l1 = logits_for(model, tok, COMPARE_TEXT, args.device)
        ids2, l2 = logits_for(model2, tok2, COMPARE_TEXT, args.device)
        if ids1 != ids2:
            print(f"FAIL: the two tokenizers disagree on the compare prompt:\n  {ids1}\n  {ids2}", file=sys.stderr)
            return 1
        diff = (l1 - l2).abs().max().item()
        scale = l1.abs().max().item()
        same_argmax = bool((l1.argmax(-1) == l2.argmax(-1)).all())
        print(
            f"compare vs {args.compare}: {len(ids1)} tokens, max abs logit diff {diff:.3e} "
            f"(max |logit| {scale:.2f}), same argmax at every position: {same_argmax}"
        )
        probe_ok = True
        for text in TOKENIZER_PROBE:
            a = tok(text, add_special_tokens=False).input_ids
            b = tok2(text, add_special_tokens=False).input_ids
            if a != b:
                probe_ok = False
                print(f"tokenizers disagree on {text!r}:\n  {a}\n  {b}", file=sys.stderr)
        print(f"tokenizer probe ({len(TOKENIZER_PROBE)} texts): {'identical ids' if probe_ok else 'DIFFERENT'}")
        if diff > args.tol:
            print(f"FAIL: logit diff {diff:.3e} > tol {args.tol:.1e}", file=sys.stderr)
            ok = False
        ok = ok and probe_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

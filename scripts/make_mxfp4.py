#!/usr/bin/env python3
"""MXFP4 fixture: a tiny GPT-OSS checkpoint written the way the released ones are, and what
transformers loads from it, for crates/hf/tests/mxfp4.rs.

Run from the repository root (versions pinned in scripts/requirements-golden.txt):

    /opt/golden-venv/bin/python scripts/make_mxfp4.py            # (re)write the fixture
    /opt/golden-venv/bin/python scripts/make_mxfp4.py --check    # ... twice, byte-identical
    /opt/golden-venv/bin/python scripts/make_mxfp4.py --verify EXPORT_DIR

Writes crates/hf/tests/fixtures/gpt_oss_mxfp4/:

  model/config.json      the released gpt-oss-20b config.json's keys (transformers 4 spelling:
                         `rope_scaling`, `experts_per_token`, `initial_context_length`, and
                         `quantization_config` {quant_method: mxfp4, modules_to_not_convert}) at a
                         tiny size: vocab 64, hidden 64, 2 layers (sliding 4, full), 4 query / 2 KV
                         heads of 16, 8 experts of width 32, top-4, swiglu_limit 7, and
                         max_position_embeddings 131072 = 32 x 4096 as released.
  model/model-00001-of-00002.safetensors, model-00002-of-00002.safetensors,
  model/model.safetensors.index.json
                         every tensor as the released shards hold it: attention (with sinks),
                         router, embeddings, norms, LM head and the experts' biases in BF16; each
                         expert matrix NAME (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)
                         as NAME_blocks U8 [E, out, in/32, 16] (two E2M1 values a byte, low nibble
                         first) and NAME_scales U8 [E, out, in/32] (E8M0, bias 127). The blocks are
                         random bytes; the scales random in 119..124, with one block of each layer's
                         gate_up at scale 0 (subnormal values) and one at 130.
  expected.safetensors   every parameter of GptOssForCausalLM.from_pretrained(model, dtype=float32,
                         quantization_config=Mxfp4Config(dequantize=True)) (transformers' own MXFP4
                         dequantisation), by name, in BF16 (every value is exact in it: checked);
                         and `logits` F32 [1, 8, 64] of that model on `input_ids` I64 [1, 8].

The script checks that transformers reports no missing, unexpected or mismatched key.

--verify EXPORT_DIR loads a directory exported by megatrain from an import of this fixture (no
training) with GptOssForCausalLM (float32, no quantization) and checks that it loads with no
missing or unexpected key, that every parameter equals expected.safetensors bit for bit (the
dequantised values are exact in bf16), and that its logits equal the expected ones.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

SEED = 38
VOCAB, HIDDEN, LAYERS, EXPERTS, WIDTH = 64, 64, 2, 8, 32
BLOCK = 32
EXPERT_MATRICES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 63,
    "experts_per_token": 4,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": WIDTH,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": 2,
    "num_local_experts": EXPERTS,
    "output_router_logits": False,
    "pad_token_id": 62,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 4,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": VOCAB,
}


def stored_tensors() -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: a seeded random model's non-expert parameters in bf16, the expert
    matrices as random MXFP4 blocks and scales."""
    torch.manual_seed(SEED)
    # A copy: the config class edits the dicts it is given.
    cfg = GptOssConfig(**{k: v for k, v in copy.deepcopy(CONFIG).items() if k != "quantization_config"})
    model = GptOssForCausalLM(cfg)
    gen = torch.Generator().manual_seed(SEED + 1)
    out = {}
    for name, p in model.named_parameters():
        if any(name.endswith(m) for m in EXPERT_MATRICES):
            e, inp, outw = p.shape  # transformers' [E, in, out]
            g = inp // BLOCK
            out[name + "_blocks"] = torch.randint(0, 256, (e, outw, g, BLOCK // 2), generator=gen, dtype=torch.uint8)
            scales = torch.randint(119, 125, (e, outw, g), generator=gen, dtype=torch.uint8)
            if name.endswith("gate_up_proj"):
                scales[0, 0, 0] = 0  # subnormal values
                scales[1, 2, 1] = 130
            out[name + "_scales"] = scales
        else:
            # transformers' init leaves the sinks, biases and norms flat; spread them.
            std = 0.5 if name.endswith(("sinks", "bias")) else 0.05
            v = torch.randn(p.shape, generator=gen) * std
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * v
            out[name] = v.to(torch.bfloat16)
    return out


def write_model(model_dir: Path) -> None:
    """config.json and two shards with an index (the layers split between them)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    tensors = stored_tensors()
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    names = list(shards)
    for name, t in tensors.items():
        second = name.startswith("model.layers.1.") or name in ("lm_head.weight", "model.norm.weight")
        shards[names[int(second)]][name] = t.contiguous()
    weight_map = {}
    for file, ts in shards.items():
        save_file(ts, model_dir / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in ts})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(SEED + 2))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids(), use_cache=False).logits.float()


def load(model_dir: Path, **kwargs):
    model, info = GptOssForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{model_dir}: transformers reports {bad}"
    return model.eval()


def make(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    write_model(out / "model")
    model = load(out / "model", quantization_config=Mxfp4Config(dequantize=True))
    expected = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    for m in EXPERT_MATRICES:
        w = expected[f"model.layers.0.{m}"]
        assert w.abs().max() > 0 and (w[0] != 0).any(), m
    # Every value is exact in bf16 (the checkpoint's bf16 tensors, and E2M1 values, two
    # significant bits, times a power of two): stored so, at half the size.
    for n, p in expected.items():
        assert torch.equal(p.bfloat16().float(), p), f"{n} is not exact in bf16"
    expected = {n: p.bfloat16() for n, p in expected.items()}
    expected["logits"] = logits_of(model)
    expected["input_ids"] = input_ids()
    save_file(expected, out / "expected.safetensors", metadata={"format": "pt"})


def digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def verify(export_dir: Path, fixture: Path) -> int:
    expected = load_file(fixture / "expected.safetensors")
    cfg = json.loads((export_dir / "config.json").read_text())
    assert "quantization_config" not in cfg, "the export still declares a quantization"
    model = load(export_dir)
    params = dict(model.named_parameters())
    assert set(params) == set(expected) - {"logits", "input_ids"}, set(params) ^ set(expected)
    for name, p in params.items():
        assert torch.equal(p.detach().float(), expected[name].float()), f"{name} differs"
    diff = (logits_of(model) - expected["logits"]).abs().max().item()
    print(f"{export_dir}: loads in GptOssForCausalLM, {len(params)} parameters equal bit for bit, logits max |diff| {diff:.3e}")
    assert diff == 0.0
    return 0


def main() -> int:
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=repo / "crates/hf/tests/fixtures/gpt_oss_mxfp4")
    ap.add_argument("--check", action="store_true", help="run twice and compare sha256")
    ap.add_argument("--verify", type=Path, metavar="EXPORT_DIR")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.verify:
        return verify(args.verify, args.out)
    make(args.out)
    print(json.dumps(digest(args.out), indent=2))
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            make(Path(tmp))
            assert digest(Path(tmp)) == digest(args.out), "a second run differs"
        print("check: a second run produced byte-identical files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model of one fixture: built from transformers' init with its norms, biases, routers and
sinks set as specified, and the written config.json and RoPE frequencies checked."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from golden.specs import BIAS_STD, IDLE_EXPERT, NORM_JITTER, ROUTER_SCALE, SINK_STD, Spec


def check_saved_config(spec: Spec, path: Path, verbose: bool) -> None:
    """Asserts that the written config.json carries every value the engine's parser reads."""
    saved = json.loads(path.read_text())
    if verbose:
        print(f"--- {path.name}\n{json.dumps(saved, indent=2, sort_keys=True)}")
    expected = {**spec.common, **spec.kwargs}
    expected.pop("rope_parameters")
    expected.pop("use_sliding_window", None)
    if "num_experts" in expected and spec.name == "qwen3_moe":
        # transformers 5 writes qwen3_moe's expert count as num_local_experts.
        expected["num_local_experts"] = expected.pop("num_experts")
    for key, value in expected.items():
        if key == "tie_word_embeddings" and not value:
            assert saved.get(key, False) is False, (path, key)
            continue
        assert saved.get(key) == value, f"{path}: {key} = {saved.get(key)!r}, expected {value!r}"
    assert saved.get("use_sliding_window", False) is False, path
    assert saved.get("attention_bias", False) is spec.is_gpt_oss(), path
    assert saved.get("mlp_bias", False) is False, path
    rope = saved["rope_parameters"]
    want = spec.kwargs["rope_parameters"]
    for key, value in want.items():
        assert rope.get(key) == value, f"{path}: rope_parameters.{key} = {rope.get(key)!r}"
    assert saved.get("rope_theta", rope["rope_theta"]) == rope["rope_theta"], path


def build_model(spec: Spec):
    """The float32 model from transformers' init, with norms and biases perturbed."""
    torch.manual_seed(spec.seed)
    # MoE: the "eager" experts loop (the per-expert Python loop of the modelling file); the
    # default grouped GEMM has no float64 kernel.
    extra = dict(experts_implementation="eager") if spec.is_moe() else {}
    model = AutoModelForCausalLM.from_config(
        spec.config(), attn_implementation="eager", dtype=torch.float32, **extra
    )
    assert model.config._attn_implementation == "eager"
    if spec.is_moe():
        assert model.config._experts_implementation == "eager"
    assert model.config.attention_dropout == 0.0
    gen = torch.Generator().manual_seed(spec.seed + 1)
    norm_weights = {
        f"{mod_name}.weight"
        for mod_name, mod in model.named_modules()
        if type(mod).__name__.endswith("RMSNorm")
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32, name
            if name in norm_weights:
                p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
        if spec.is_moe():
            # Sharper routing (router logits of order 1 rather than 0.1): wider routing margins.
            for layer in model.model.layers:
                router = layer.mlp.router if spec.is_gpt_oss() else layer.mlp.gate
                router.weight.mul_(ROUTER_SCALE)
        if spec.is_gpt_oss():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(SINK_STD * torch.randn(layer.self_attn.sinks.shape, generator=gen))
        if spec.name in IDLE_EXPERT:
            layer, expert = IDLE_EXPERT[spec.name]
            assert expert == 0
            w = model.model.layers[layer].mlp.gate.weight
            w[0].zero_()
            w[2].copy_(-w[1])
            w[4].copy_(-w[3])
    names = [n for n, _ in model.named_parameters()]
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in names, names
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert "lm_head.weight" in names, names
    return model


def check_rope(spec: Spec, model) -> None:
    """Asserts that llama3 scaling hits all three of its frequency bands at these sizes."""
    cfg = model.config
    rope = cfg.rope_parameters
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    used = model.model.rotary_emb.inv_freq.float()
    if rope["rope_type"] == "yarn":
        # Kept (extrapolated), blended by the ramp, and interpolated (divided by the factor).
        ratio = used / plain
        kept = int(torch.isclose(ratio, torch.tensor(1.0), rtol=1e-6).sum())
        divided = int(torch.isclose(ratio, torch.tensor(1.0 / rope["factor"]), rtol=1e-6).sum())
        blended = dim // 2 - kept - divided
        assert kept > 0 and divided > 0 and blended > 0, (spec.name, ratio)
        print(f"{spec.name}: yarn rope: of {dim // 2} frequencies {kept} kept, {blended} blended, {divided} interpolated")
        return
    if rope["rope_type"] != "llama3":
        assert torch.equal(used, plain), f"{spec.name}: unexpected rope scaling"
        return
    ratio = used / plain
    kept = int(torch.isclose(ratio, torch.tensor(1.0), rtol=1e-6).sum())
    divided = int(torch.isclose(ratio, torch.tensor(1.0 / rope["factor"]), rtol=1e-6).sum())
    smoothed = dim // 2 - kept - divided
    assert kept > 0 and divided > 0 and smoothed > 0, (spec.name, ratio)
    print(
        f"{spec.name}: llama3 rope: of {dim // 2} inverse frequencies {kept} kept, "
        f"{smoothed} smoothed, {divided} divided by {rope['factor']}"
    )


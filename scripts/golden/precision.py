"""The diagnostics of scripts/make_golden.py, apart from the fixture writer itself.

- `precision_report(spec)` (`make_golden.py --precision-report`): the effect of transformers'
  float32 islands (RMSNorm, softmax, rotary cos/sin) on the fixtures, by re-running a model with
  float64 versions of the same formulas (`pure_float64`).
- `f32_control(spec, out_dir)` (`make_golden.py --f32-control`): a float32 PyTorch run of the same
  model against the committed float64 fixtures, the yardstick for the engine's fp32 bounds.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import safetensors.torch
import torch

from golden.model import build_model
from golden.run import make_batch, train
from golden.specs import ADAMW, Spec


@contextlib.contextmanager
def pure_float64():
    """Temporarily replaces transformers' float32 islands (RMSNorm, softmax, rotary cos/sin) by
    float64 versions of the same formulas. Used only by --precision-report."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    def norm_forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        rep = module.num_key_value_groups
        k = modeling_llama.repeat_kv(key, rep)
        v = modeling_llama.repeat_kv(value, rep)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    @torch.no_grad()
    def rotary_forward(self, x, position_ids):
        rope = self.config.rope_parameters
        dim = getattr(self.config, "head_dim", None) or (
            self.config.hidden_size // self.config.num_attention_heads
        )
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if rope["rope_type"] == "llama3":
            old = rope["original_max_position_embeddings"]
            lo, hi, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - lo) / (hi - lo)
            mid = (1 - smooth) * inv / factor + smooth * inv
            inv = torch.where(wavelen > old / lo, inv / factor, inv)
            inv = torch.where((wavelen >= old / hi) & (wavelen <= old / lo), mid, inv)
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    patches = []
    for mod, prefix in [
        (modeling_llama, "Llama"),
        (modeling_qwen2, "Qwen2"),
        (modeling_qwen3, "Qwen3"),
    ]:
        patches += [
            (getattr(mod, f"{prefix}RMSNorm"), "forward", norm_forward),
            (getattr(mod, f"{prefix}RotaryEmbedding"), "forward", rotary_forward),
            (mod, "eager_attention_forward", eager),
        ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def precision_report(spec: Spec) -> None:
    """Compares the stock float64 run (float32 islands) with a fully float64 one."""
    runs = []
    for pure in (False, True):
        with pure_float64() if pure else contextlib.nullcontext():
            model = build_model(spec)
            input_ids, targets = make_batch(spec, model.config.vocab_size)
            model.double()
            model.train()
            runs.append(train(model, input_ids, targets))
    stock, exact = runs
    parts = []
    for key in ("logits", "loss", "losses", "grad_norms", "grad."):
        names = [k for k in exact if k == key or (key.endswith(".") and k.startswith(key))]
        rel = max(
            float((stock[k] - exact[k]).abs().max() / exact[k].abs().max().clamp_min(1e-300))
            for k in names
        )
        parts.append(f"{key} {rel:.1e}")
    text = ", ".join(parts)
    lr = ADAMW["lr"]
    step3 = max(float((stock[k] - exact[k]).abs().max()) for k in exact if k.startswith("step3."))
    print(
        f"{spec.name}: max|stock - pure f64| / max|pure f64| per tensor: {text}; "
        f"step3. max|stock - pure f64| = {step3 / lr:.1e} * lr"
    )


def f32_control(spec: Spec, out_dir: Path) -> None:
    """Control experiment: PyTorch itself in float32 against the committed float64 fixture.

    Prints, per model, the worst per-tensor relative error (max|a-b| / max|b|) of the step-0
    gradients and of the parameters after 3 steps. It tells how close any float32
    implementation can be expected to get to the fixture: the engine's tests are held to
    bars that PyTorch-f32 itself meets.
    """
    ref = safetensors.torch.load_file(out_dir / f"{spec.name}.safetensors")
    model = build_model(spec)
    model.float()
    model.train()
    input_ids, targets = make_batch(spec, model.config.vocab_size)
    got = train(model, input_ids, targets)

    def worst(prefix: str) -> tuple[float, str]:
        w = (0.0, "")
        for k, v in got.items():
            if k.startswith(prefix):
                e = ref[k].double()
                r = float((v.double() - e).abs().max() / e.abs().max())
                w = max(w, (r, k))
        return w

    g, p = worst("grad."), worst("step3.")
    n = n_within = 0
    worst_abs = 0.0
    for k, v in got.items():
        if k.startswith("step3."):
            e = ref[k].double()
            d = (v.double() - e).abs()
            n += d.numel()
            n_within += int((d / e.abs().max() <= 1e-5).sum())
            worst_abs = max(worst_abs, float(d.max()))
    print(f"{spec.name}: torch-f32 vs fixture: worst grad {g[0]:.2e} ({g[1]}), "
          f"worst param after 3 steps {p[0]:.2e} ({p[1]}), "
          f"{100.0 * n_within / n:.4f}% of elements within 1e-5, worst abs {worst_abs / ADAMW['lr']:.2e}*lr")

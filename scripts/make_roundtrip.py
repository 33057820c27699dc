#!/usr/bin/env python3
"""Round-trip fixtures: HF models saved by transformers, trained by PyTorch, for `megatrain train`.

Run from the repository root (versions pinned in scripts/requirements-golden.txt):

    /opt/golden-venv/bin/python scripts/make_roundtrip.py            # (re)write the fixtures
    /opt/golden-venv/bin/python scripts/make_roundtrip.py --check    # ... twice, byte-identical
    /opt/golden-venv/bin/python scripts/make_roundtrip.py --verify NAME=EXPORT_DIR ...

The fixtures live in crates/megatrain/tests/fixtures/roundtrip/NAME/ for NAME in (llama, qwen2,
qwen3_moe, mixtral):

  model/config.json, model/model.safetensors   a tiny random model as `save_pretrained` writes it
  data.jsonl                                   N_LINES lines {"input_ids": [...]} of exactly SEQ tokens
  expected.safetensors                         the float64 reference's weights after STEPS steps (rounded to
                                               float32, HF names), plus `losses` F32 [STEPS] (loss of each
                                               step before its update)
  float32.safetensors                          PyTorch's own float32 run of the same training: its weights
                                               after STEPS steps and `losses`, the scale the bounds of
                                               crates/megatrain/tests/numerics.rs are set against
  expected.json                                the hyper-parameters below, so the Rust tests use the same;
                                               the reference's per-step losses and pre-clip gradient norms
                                               in full precision; PyTorch float32's distances from the
                                               reference per tensor (step-0 gradients, final weights)

Training (the fixed interface of `megatrain train --no-shuffle`, issue REAL-USE): step k uses lines
k*B .. k*B+B-1 in file order; labels = input_ids shifted by one (logits[:, t] predicts ids[:, t+1]);
loss = mean cross-entropy over all B*(SEQ-1) targets; then torch.nn.utils.clip_grad_norm_(CLIP) and
torch.optim.AdamW(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD) (one parameter group,
decay on every parameter), constant learning rate, no warmup.

The reference is the model evaluated in float64 (`model.double()`), with transformers' float32
islands replaced by float64 versions of the same formulas (`float64_reference`): the RMSNorm's
`x.to(float32)` upcast, the eager softmax's `dtype=float32`, and the rotary cos/sin, whose angle
`position * inv_freq` is still formed in float32 exactly as transformers forms it (the model's
definition: `RopeAngles::Transformers` in crates/layers/src/rope.rs) and whose cos/sin are then
evaluated in float64 without rounding. Stock `.double()` keeps those islands in float32: its result
carries float32 rounding (up to 5e-6 relative on a tensor after 4 steps) and shares it with
PyTorch's float32 run (bit for bit where the two evaluate the same float32 rotary table), which
biased the comparison towards PyTorch; `--report` prints the islands' effect. The script also
trains the same model in float32 with stock PyTorch (float32.safetensors) and prints how far that
run lands from the reference.

Mixtures of experts (qwen3_moe: 4 experts, top-2, head_dim 16 != hidden/heads, norm_topk_prob, the load-balancing loss with
coefficient 0.05 added to the loss; mixtral: 4 experts, top-2, no load-balancing loss; both smaller:
hidden 32, experts of width 16, router weights transformers' init x 10 for wide routing margins):
the reference also evaluates the router's softmax, top-k renormalisation and the load-balancing
loss in float64 (transformers' float32 islands there). Their expected.safetensors and
float32.safetensors hold the weights under the names `save_pretrained` writes (each expert apart:
`mlp.experts.{e}.gate_proj.weight`, `block_sparse_moe.experts.{e}.w1.weight`, ...), which is what
the export must write too. Every step's k-th and (k+1)-th router probabilities of every token
differ by more than 1e-5 relative (checked).

--verify loads each EXPORT_DIR (what `megatrain train --out` wrote) with
`transformers.AutoModelForCausalLM.from_pretrained`, checks that every parameter equals
expected.safetensors within the same bound as the Rust test (relative L2 per tensor), and runs a forward pass.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3_moe import modeling_qwen3_moe

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
MOE = dict(COMMON, hidden_size=32, intermediate_size=16, num_experts_per_tok=2)
ROUTER_SCALE = 10.0
MIN_ROUTING_MARGIN = 1e-5
MODELS = {
    "llama": (LlamaConfig, 2001, {}),
    "qwen2": (Qwen2Config, 2002, dict(use_sliding_window=False)),
    "qwen3_moe": (Qwen3MoeConfig, 2003, dict(
        moe_intermediate_size=16, num_experts=4, norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=0.05, use_sliding_window=False, head_dim=16)),
    "mixtral": (MixtralConfig, 2004, dict(num_local_experts=4, output_router_logits=False)),
}


def is_moe(name: str) -> bool:
    return name in ("qwen3_moe", "mixtral")


def build(name: str, out: Path) -> None:
    cls, seed, extra = MODELS[name]
    d = out / name
    (d / "model").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = cls(**(MOE if is_moe(name) else COMMON), **extra)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if is_moe(name):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(ROUTER_SCALE)
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

    with float64_reference():
        ref = train(d / "model", lines, torch.float64)
    f32 = train(d / "model", lines, torch.float32)
    names = list(ref["weights"])
    w_rel = {k: rel(f32["weights"][k], ref["weights"][k]) for k in names}
    g_rel = {k: rel(f32["grad0"][k], ref["grad0"][k]) for k in names}
    worst = max(w_rel.values())
    worst_max = max(rel_max(f32["weights"][k], ref["weights"][k]) for k in names)
    print(f"{name}: {len(names)} tensors; losses {[round(x, 6) for x in ref['losses']]}; "
          f"PyTorch float32 vs float64: worst tensor {worst:.2e} relative L2 (bound {REL_TOL:.0e}), "
          f"{worst_max:.2e} max-norm; step-0 gradients: worst {max(g_rel.values()):.2e}")
    for file, run in (("expected.safetensors", ref), ("float32.safetensors", f32)):
        tensors = run["saved"] if is_moe(name) else {}
        tensors = tensors or {k: v.to(torch.float32).contiguous() for k, v in run["weights"].items()}
        tensors["losses"] = torch.tensor(run["losses"], dtype=torch.float32)
        save_file(tensors, d / file)
    (d / "expected.json").write_text(json.dumps(dict(
        seq_len=SEQ, batch_size=BATCH, steps=STEPS, lr=LR, weight_decay=WD, clip=CLIP,
        betas=[0.9, 0.999], eps=1e-8, schedule="constant", warmup=0, rel_tol=REL_TOL,
        rel_metric="||a - b||_2 / ||b||_2 per tensor", reference=REFERENCE,
        reference_losses=ref["losses"], reference_grad_norms=ref["grad_norms"],
        float32_pytorch_worst_rel=float(f"{worst:.3e}"), float32_pytorch_worst_rel_max=float(f"{worst_max:.3e}"),
        float32_pytorch_losses=f32["losses"],
        float32_pytorch_grad0_rel={k: float(f"{v:.4e}") for k, v in g_rel.items()},
        float32_pytorch_weights_rel={k: float(f"{v:.4e}") for k, v in w_rel.items()},
    ), indent=2) + "\n")


REFERENCE = ("float64 PyTorch, transformers' float32 islands removed (RMSNorm, softmax and rotary cos/sin "
             "in float64; the rotary angle position * inv_freq formed in float32 as transformers does)")


@contextlib.contextmanager
def float64_reference():
    """transformers' float32 islands replaced by float64 versions of the same formulas, for a
    model run in float64 (in float32 they compute what transformers computes, but the rotary
    table, whose cos/sin would then be evaluated in float64 and rounded once)."""

    def norm_forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = modeling_llama.repeat_kv(key, module.num_key_value_groups)
        v = modeling_llama.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    @torch.no_grad()
    def rotary_forward(self, x, position_ids):
        # The angle exactly as transformers forms it (float32 product), its cos/sin in float64.
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1).double()
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def router_forward(self, hidden_states):
        # transformers' router with its softmax and renormalisation in the model's dtype.
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral's router always renormalises
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    def load_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        assert attention_mask is None
        logits = torch.cat(gate_logits, dim=0)
        p = torch.softmax(logits, dim=-1)
        picked = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        counts = torch.zeros(num_experts, dtype=p.dtype).scatter_add_(0, picked, torch.ones_like(picked, dtype=p.dtype))
        n = logits.shape[0]
        return num_experts * torch.sum(counts / n * (p.sum(dim=0) / n))

    patches = []
    for mod, prefix in ((modeling_llama, "Llama"), (modeling_qwen2, "Qwen2"), (modeling_qwen3_moe, "Qwen3Moe"),
                        (modeling_mixtral, "Mixtral")):
        patches += [
            (getattr(mod, f"{prefix}RMSNorm"), "forward", norm_forward),
            (getattr(mod, f"{prefix}RotaryEmbedding"), "forward", rotary_forward),
            (mod, "eager_attention_forward", eager),
        ]
        if hasattr(mod, f"{prefix}TopKRouter"):
            patches += [
                (getattr(mod, f"{prefix}TopKRouter"), "forward", router_forward),
                (mod, "load_balancing_loss_func", load_balancing_loss),
            ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def train(model_dir: Path, lines: torch.Tensor, dtype: torch.dtype) -> dict:
    """STEPS steps; returns the final weights, each step's loss and pre-clip gradient norm, and
    the step-0 gradients."""
    torch.manual_seed(0)
    moe = json.loads((model_dir / "config.json").read_text()).get("num_experts_per_tok") is not None
    extra = dict(experts_implementation="eager") if moe else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager", **extra)
    model = model.to(dtype)
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    losses, norms, grad0 = [], [], {}
    for k in range(STEPS):
        ids = lines[k * BATCH:(k + 1) * BATCH]
        out = model(input_ids=ids, **(dict(output_router_logits=True) if moe else {}))
        logits = out.logits
        V = logits.shape[-1]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="mean")
        if moe:
            check_margins(out.router_logits, model.config.num_experts_per_tok)
            if model.config.output_router_logits:
                loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad()
        loss.backward()
        if k == 0:
            grad0 = {n: p.grad.detach().clone() for n, p in named}
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in named}
    saved = saved_state(model) if moe else {}
    return dict(weights=weights, losses=losses, grad_norms=norms, grad0=grad0, saved=saved)


def check_margins(router_logits, k: int) -> None:
    for r in router_logits:
        p = torch.softmax(r.double(), dim=-1).sort(dim=-1, descending=True).values
        margin = float(((p[:, k - 1] - p[:, k]) / p[:, k - 1]).min())
        assert margin > MIN_ROUTING_MARGIN, f"routing margin {margin:.2e}: pick another seed"


def saved_state(model) -> dict:
    """The model's weights in float32 under the names save_pretrained writes (a MoE's experts
    one by one), read back from a save."""
    with tempfile.TemporaryDirectory() as t:
        model.to(torch.float32).save_pretrained(t)
        return {k: v.contiguous() for k, v in load_file(Path(t) / "model.safetensors").items()}


def report(name: str) -> None:
    """The float32 islands' effect: stock `.double()` against the reference, and PyTorch float32
    against both."""
    d = OUT / name
    lines = torch.tensor([json.loads(x)["input_ids"] for x in (d / "data.jsonl").read_text().splitlines()])
    with float64_reference():
        ref = train(d / "model", lines, torch.float64)
    stock = train(d / "model", lines, torch.float64)
    f32 = train(d / "model", lines, torch.float32)
    for label, run in (("stock float64", stock), ("PyTorch float32", f32)):
        for key in ("grad0", "weights"):
            w = max((rel(run[key][k], ref[key][k]), k) for k in ref[key])
            print(f"{name}: {label} vs reference, {key}: worst {w[0]:.2e} ({w[1]})")
    w = max((rel(f32["weights"][k], stock["weights"][k]), k) for k in ref["weights"])
    print(f"{name}: PyTorch float32 vs stock float64, weights: worst {w[0]:.2e} ({w[1]})")


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
        if is_moe(name):
            # Compare under the names save_pretrained writes, as expected.safetensors holds them.
            got = saved_state(model)
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
    ap.add_argument("--report", action="store_true", help="measure transformers' float32 islands (writes nothing)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.verify:
        return 1 if verify(a.verify) else 0
    if a.report:
        for name in MODELS:
            report(name)
        return 0
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

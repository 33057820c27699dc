"""Per-kernel CUDA time of our MoE forward + backward (3 iterations) at the OLMoE-1B-7B shape, 8192 and
32768 tokens, through torch.profiler (moe_prof.txt). Run from the repository root:
python3 results/2026-11-28-moe-kernels-h200/profile.py"""
import sys, math, torch
sys.path.insert(0, "scripts")
import moe_bench as mb
from torch.profiler import profile, ProfilerActivity
moe = mb.Moe()
e, k, h, f = 64, 8, 2048, 1024
for t in (8192, 32768):
    torch.manual_seed(0); dev, bf = "cuda", torch.bfloat16
    x = torch.randn(t, h, device=dev, dtype=bf); logits = torch.randn(t, e, device=dev, dtype=bf)
    w_gu = (torch.randn(e, 2 * f, h, device=dev) / math.sqrt(h)).to(bf); w_d = (torch.randn(e, h, f, device=dev) / math.sqrt(f)).to(bf)
    dout = torch.randn(t, h, device=dev, dtype=bf)
    g_gu = torch.zeros(e, 2 * f, h, device=dev); g_d = torch.zeros(e, h, f, device=dev)
    for _ in range(2):
        out, s = moe.forward(x, x, logits, w_gu, w_d, k, False); moe.backward(s, dout, w_gu, w_d, g_gu, g_d)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            out, s = moe.forward(x, x, logits, w_gu, w_d, k, False); moe.backward(s, dout, w_gu, w_d, g_gu, g_d)
        torch.cuda.synchronize()
    print(f"=== t={t}")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=40))

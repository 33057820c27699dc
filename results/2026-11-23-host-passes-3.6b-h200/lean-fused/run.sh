#!/usr/bin/env bash
# H200 call, build da0e32e (lean mode's fused land + update): 3.6B every layer streamed at 4x2048, lean (no gradient
# buffer) and exact, with traces of step 3.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin6/megatrain.xz > $B/megatrain; chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --resident-layers 0 --batch-size 4 --steps 4"
timeout 90 $B/megatrain train $common --optim-mode lean --grad-dtype none --trace $R/trace-lean-4x2048.json --trace-step 3 > $R/lean-4x2048-streamed.log 2>&1
echo "lean rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams" $R/lean-4x2048-streamed.log
timeout 90 $B/megatrain train $common --optim-mode lean --trace $R/trace-lean-bf16grad-4x2048.json --trace-step 3 > $R/lean-bf16grad-4x2048-streamed.log 2>&1
echo "lean bf16 grads rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams" $R/lean-bf16grad-4x2048-streamed.log
timeout 90 $B/megatrain train $common > $R/exact-4x2048-streamed.log 2>&1
echo "exact rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams" $R/exact-4x2048-streamed.log
echo "wall $SECONDS s"

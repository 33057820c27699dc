#!/usr/bin/env bash
# H200 call, build c988152 (review fixes: mt_narrow_bf16 + mt_sumsq_bf16 instead of the fused kernel; NaN rounding as
# the host): GPU tests; the 3.6B every layer streamed at 4x2048 (the extra bf16 sum-of-squares pass must cost nothing).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in megatrain gpu-test; do xz -dc .gpu/bin6/$f.xz > $B/$f; done; chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
timeout 100 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "test result|panicked|SUMMARY gpu bf16 landing|SUMMARY gpu resident|fused adamw" $R/gpu-test.log | head
timeout 80 $B/megatrain train --config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 \
  --data synthetic --log-every 0 --resident-layers 0 --batch-size 4 --steps 4 > $R/exact-4x2048-streamed.log 2>&1
echo "streamed rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams" $R/exact-4x2048-streamed.log
echo "wall $SECONDS s"

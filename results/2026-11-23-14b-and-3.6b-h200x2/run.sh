#!/usr/bin/env bash
# x2 call (one H200, 32 cores, 256 GiB), session 2026-11-23 build (bf16 landing, x86-64-v3 host code):
# GPU tests; 14B (Qwen2.5-14B shape) at 4x2048 and 16x2048 with the planner's placement; 3.6B every layer
# streamed at 4x2048 (32 cores); 3.6B planner's placement at 4x2048 with this build and with 2a2deb2 (A/B).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export CUDA_VISIBLE_DEVICES=0
B=/tmp/b; mkdir -p $B && for f in .gpu/bin6/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
timeout 100 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "test result|panicked|SUMMARY gpu bf16 landing" $R/gpu-test.log | head
common="--device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0"
C=bench-harness/configs/llama3-3.6b.json
for m in megatrain megatrain-2a2deb2; do
  MT_COMMIT=$m timeout 70 $B/$m train --config $C $common --batch-size 4 --steps 4 > $R/3.6b-4x2048-default-$m.log 2>&1
  echo "3.6b default $m rc=$? at $SECONDS s"; grep -E "steady|streams" $R/3.6b-4x2048-default-$m.log | head -3
done
timeout 80 $M train --config $C $common --resident-layers 0 --batch-size 4 --steps 4 \
  --trace $R/trace-3.6b-4x2048-streamed.json --trace-step 3 > $R/3.6b-4x2048-streamed.log 2>&1
echo "3.6b streamed rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams" $R/3.6b-4x2048-streamed.log | head
for b in 4 16; do
  timeout 170 $M train --config bench-harness/configs/qwen2.5-14b.json $common --batch-size $b --steps 4 --host-mem 240 \
    --trace $R/trace-14b-${b}x2048.json --trace-step 3 > $R/14b-${b}x2048.log 2>&1
  echo "14b b$b rc=$? at $SECONDS s"; grep -E "^step:|PCIe per step|steady|host RSS|streams|trained|rror" $R/14b-${b}x2048.log | head
done
echo "wall $SECONDS s"

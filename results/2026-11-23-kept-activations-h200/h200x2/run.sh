#!/usr/bin/env bash
# x2 call (one H200, 32 cores): kept activations A/B: 3.6B 4x2048 every layer streamed, --kept-layers 0 vs auto;
# 14B (Qwen2.5-14B shape) 4x2048 planner's placement, --kept-layers 0 vs auto.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export CUDA_VISIBLE_DEVICES=0
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin8/megatrain.xz > $B/megatrain; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
common="--device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0"
for k in auto 0; do
  timeout 80 $M train --config bench-harness/configs/llama3-3.6b.json $common --resident-layers 0 --batch-size 4 --steps 8 --kept-layers $k \
    --trace $R/trace-3.6b-streamed-kept-$k.json --trace-step 5 > $R/3.6b-4x2048-streamed-kept-$k.log 2>&1
  echo "3.6b streamed kept=$k rc=$? at $SECONDS s"; grep -E "steady|kept activations|streams" $R/3.6b-4x2048-streamed-kept-$k.log
done
for k in auto 0; do
  timeout 200 $M train --config bench-harness/configs/qwen2.5-14b.json $common --batch-size 4 --steps 5 --host-mem 240 --kept-layers $k \
    > $R/14b-4x2048-kept-$k.log 2>&1
  echo "14b 4x2048 kept=$k rc=$? at $SECONDS s"; grep -E "^step:|^GPU|steady|kept activations|host RSS|streams|rror" $R/14b-4x2048-kept-$k.log
done
echo "wall $SECONDS s"

#!/usr/bin/env bash
# x2 call (one H200, 32 cores): 3.6B 4x2048 every layer streamed, held+kept (default) vs neither, alternated;
# 14B 4x2048 planner's default (residency, then held layers, then kept activations).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export CUDA_VISIBLE_DEVICES=0
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin10/megatrain.xz > $B/megatrain; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
common="--device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0"
for v in "auto auto" "0 0" "auto auto" "0 0"; do
  set -- $v; tag=3.6b-streamed-held-$1-kept-$2-$SECONDS
  timeout 80 $M train --config bench-harness/configs/llama3-3.6b.json $common --resident-layers 0 --batch-size 4 --steps 10 \
    --held-layers $1 --kept-layers $2 > $R/$tag.log 2>&1
  echo "$tag rc=$?"; grep -E "PCIe per step|steady|streams" $R/$tag.log
done
timeout 200 $M train --config bench-harness/configs/qwen2.5-14b.json $common --batch-size 4 --steps 5 --host-mem 240 \
  > $R/14b-4x2048-default.log 2>&1
echo "14b 4x2048 rc=$? at $SECONDS s"; grep -E "^step:|^GPU|PCIe per step|steady|kept activations|host RSS|streams|rror" $R/14b-4x2048-default.log
echo "wall $SECONDS s"

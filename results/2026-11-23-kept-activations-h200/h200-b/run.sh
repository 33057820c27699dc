#!/usr/bin/env bash
# H200: 3.6B 4x2048 every layer streamed, --kept-layers 0 vs auto, traces of step 4 (why is kept slower when host-bound?).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin7/megatrain.xz > $B/megatrain; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --resident-layers 0 --batch-size 4 --steps 6"
for k in auto 0 ${EXTRA:-}; do
  timeout 90 $M train $common --kept-layers $k --trace $R/trace-$k.json --trace-step 4 > $R/streamed-kept-$k.log 2>&1
  echo "kept=$k rc=$? at $SECONDS s"; grep -E "steady|streams" $R/streamed-kept-$k.log
done
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200: the device memory pool's high-water mark against the plan (bin16), 3.6B: planner default and every layer
# streamed, at 4x2048 and 16x2048.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/bin16; mkdir -p $B && xz -dc .gpu/bin16/megatrain.xz > $B/megatrain; chmod +x $B/*
R=$OUT/r; mkdir -p $R
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --steps 4"
for v in "default-4 --batch-size 4" "streamed-4 --batch-size 4 --resident-layers 0" "default-16 --batch-size 16" "streamed-16 --batch-size 16 --resident-layers 0"; do
  set -- $v; tag=$1; shift
  timeout 100 $B/megatrain train $common "$@" > $R/$tag.log 2>&1
  echo "$tag rc=$?"; grep -E "^step:|GPU \(GiB\)|GPU memory in use|steady|rror" $R/$tag.log
done
echo "wall $SECONDS s"

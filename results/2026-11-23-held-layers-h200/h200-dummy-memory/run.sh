#!/usr/bin/env bash
# H200 experiment (build 3c99b5c + an env hook that holds N GiB of unused device memory): is the
# host slowdown with kept activations caused by the GPU memory footprint or by the kept states' use?
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && xz -dc .gpu/exp/megatrain.xz > $B/megatrain; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --resident-layers 0 --batch-size 4 --steps 6"
run() { tag=$1; e=$2; shift 2; env $e timeout 90 $M train $common "$@" --trace $R/trace-$tag.json --trace-step 4 > $R/$tag.log 2>&1
  echo "$tag rc=$? at $SECONDS s"; grep -E "EXPERIMENT|steady|streams" $R/$tag.log; }
run kept0 X=1 --kept-layers 0
run kept0-dummy60 MT_EXP_DUMMY_GB=60 --kept-layers 0
run kept28 X=1 --kept-layers 28
run kept0-again X=1 --kept-layers 0
echo "wall $SECONDS s"

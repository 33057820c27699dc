#!/usr/bin/env bash
# The streamed 3.6B at 4 x 2048 three more times (10 steps each) on the same machine kind, to see the spread.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin31/megatrain.xz > $B/megatrain && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g; lscpu | grep -E "Model name|NUMA node\(s\)") > $R/env.txt 2>&1
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 10 --resident-layers 0"
for i in 1 2 3; do
  timeout 150 $B/megatrain train $common > $R/streamed-4x2048-$i.log 2>&1; echo "streamed $i rc=$?"; grep -E "steady|host RSS|streams \(|rror" $R/streamed-4x2048-$i.log | cut -c1-300
done
echo "wall $SECONDS s"

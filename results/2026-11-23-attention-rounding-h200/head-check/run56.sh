#!/usr/bin/env bash
# H200: HEAD 03036cb's GPU tests (bin28) and the 3.6B at 4 x 2048, planner default and every layer streamed (bin26's
# megatrain: 9a16396, the same engine code as HEAD), once each.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin28/gpu-test.xz > $B/gpu-test && xz -dc .gpu/bin26/megatrain.xz > $B/megatrain && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt 2>&1
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 200 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "SUMMARY gpu bf16 vs cpu bf16|test result|panicked" $R/gpu-test.log | cut -c1-330
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 6"
timeout 90 $B/megatrain train $common > $R/default-4x2048.log 2>&1; echo "default rc=$?"; grep -E "steady|rror" $R/default-4x2048.log
timeout 120 $B/megatrain train $common --resident-layers 0 > $R/streamed-4x2048.log 2>&1; echo "streamed rc=$?"; grep -E "steady|host RSS|streams \(|rror" $R/streamed-4x2048.log | cut -c1-300
echo "wall $SECONDS s"

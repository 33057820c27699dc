#!/usr/bin/env bash
# H200 call, session 2026-11-23 (uncommitted tree on 2a2deb2 + vectorised bf16 cast/sum of squares): GPU tests;
# the host optimizer's kernels in isolation (criterion, 16 threads; baseline x86-64, -v3, -v4 builds);
# 3.6B every layer streamed at 4x2048, exact and lean, with a trace of step 3.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_COMMIT=${MT_COMMIT:-wip}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin5/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g; lscpu | grep -E "Model name|^CPU\(s\)|NUMA|L3") > $R/env.txt
timeout 120 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "^test |test result|panicked" $R/gpu-test.log | head -20
for v in base v3 v4; do
  timeout 60 $B/adamw-$v --bench --warm-up-time 1 --measurement-time 2 "bf16_grad|cast|yardstick" > $R/bench-optim-$v.log 2>&1
  echo "bench $v rc=$? at $SECONDS s"; grep -E "^adamw|thrpt:  \[[0-9]" $R/bench-optim-$v.log
done
common="--device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --resident-layers 0"
C=bench-harness/configs/llama3-3.6b.json
timeout 100 $M train --config $C $common --batch-size 4 --steps 4 --trace $R/trace-exact-4x2048.json --trace-step 3 > $R/exact-4x2048.log 2>&1
echo "exact rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams|busy" $R/exact-4x2048.log | head
timeout 100 $M train --config $C $common --batch-size 4 --steps 4 --optim-mode lean --grad-dtype none --trace $R/trace-lean-4x2048.json --trace-step 3 > $R/lean-4x2048.log 2>&1
echo "lean rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams|busy" $R/lean-4x2048.log | head
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200 call, session 2026-11-23: build with bf16 gradient landing (device narrowing) + x86-64-v3 host code.
# GPU tests (10, one new); 3.6B every layer streamed, exact, at 4x2048 (trace of step 3) and 16x2048;
# the planner's default placement at 4x2048 (all resident) as a regression check.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_COMMIT=${MT_COMMIT:-wip}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin6/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
timeout 120 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "^test |test result|panicked|SUMMARY gpu bf16 landing" $R/gpu-test.log | head -24
common="--device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0"
C=bench-harness/configs/llama3-3.6b.json
for b in 4 16; do
  timeout 110 $M train --config $C $common --resident-layers 0 --batch-size $b --steps 4 --trace $R/trace-exact-${b}x2048.json --trace-step 3 > $R/exact-${b}x2048-streamed.log 2>&1
  echo "exact b$b streamed rc=$? at $SECONDS s"; grep -E "PCIe per step|steady|host RSS|streams|busy" $R/exact-${b}x2048-streamed.log | head
done
timeout 100 $M train --config $C $common --batch-size 4 --steps 4 > $R/exact-4x2048-default.log 2>&1
echo "default rc=$? at $SECONDS s"; grep -E "steady|host RSS|streams" $R/exact-4x2048-default.log | head
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200/H100: HEAD's kernel tests (prelude with #line for common.cuh), GPU tests (seeded inputs) twice,
# and the 3.6B at 4 x 2048, planner default and every layer streamed, once each.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in gpu-test layers-test megatrain; do xz -dc .gpu/bin31/$f.xz > $B/$f; done && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt 2>&1
timeout 120 $B/layers-test --test-threads 1 cuda_kernels > $R/kernel-test.log 2>&1; echo "kernel-test rc=$?"; grep -E "test result|panicked" $R/kernel-test.log
for i in 1 2; do
  MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 200 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test-$i.log 2>&1; echo "gpu-test $i rc=$?"
  grep -E "SUMMARY gpu bf16 vs cpu bf16|test result|panicked" $R/gpu-test-$i.log | cut -c1-330
done
cmp <(grep SUMMARY $R/gpu-test-1.log) <(grep SUMMARY $R/gpu-test-2.log) && echo "SUMMARY lines identical across the two runs"
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 6"
timeout 90 $B/megatrain train $common > $R/default-4x2048.log 2>&1; echo "default rc=$?"; grep -E "steady|rror" $R/default-4x2048.log
timeout 120 $B/megatrain train $common --resident-layers 0 > $R/streamed-4x2048.log 2>&1; echo "streamed rc=$?"; grep -E "steady|host RSS|streams \(|rror" $R/streamed-4x2048.log | cut -c1-300
echo "wall $SECONDS s"

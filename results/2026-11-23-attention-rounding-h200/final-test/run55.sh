#!/usr/bin/env bash
# H200: bin27 (bf16-vs-bf16 GPU test: weights after 3 steps as a fraction within 2e-2): the GPU engine tests.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin27/gpu-test.xz > $B/gpu-test && chmod +x $B/gpu-test
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; cat /sys/kernel/mm/transparent_hugepage/enabled) > $R/env.txt 2>&1
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 200 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "SUMMARY gpu bf16 vs cpu bf16|test result|panicked" $R/gpu-test.log
echo "wall $SECONDS s"

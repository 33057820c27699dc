#!/usr/bin/env bash
# H100/H200: the GPU tests after the gpu.rs refactor (run_with shared by every run).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
mkdir -p /tmp/b $OUT/r && xz -dc .gpu/bin12/gpu-test.xz > /tmp/b/gpu-test && chmod +x /tmp/b/gpu-test
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc) > $OUT/r/env.txt
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 200 /tmp/b/gpu-test --test-threads 1 --nocapture > $OUT/r/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "test result|panicked" $OUT/r/gpu-test.log; grep -c "SUMMARY gpu kept/held.*losses bitwise true; grads bitwise true; params bitwise true" $OUT/r/gpu-test.log

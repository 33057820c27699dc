#!/usr/bin/env bash
# H200: bin29 (HEAD + the bias column-sum test comparing changed sets): the GPU engine tests, twice.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && xz -dc .gpu/bin29/gpu-test.xz > $B/gpu-test && chmod +x $B/gpu-test
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc) > $R/env.txt 2>&1
for k in 1 2; do
  MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 200 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test-$k.log 2>&1; echo "gpu-test #$k rc=$?"
  grep -E "SUMMARY gpu bias|test result|panicked" $R/gpu-test-$k.log
done
echo "wall $SECONDS s"

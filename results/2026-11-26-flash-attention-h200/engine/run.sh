#!/usr/bin/env bash
# GPU run 2: flash attention through the engine. Kernel tests (mt-layers), the GPU test suites
# (tests/gpu.rs, tests/gpu_long_context.rs), the 3.6B at 4 x 2048 and 16 x 2048 with flash and
# with the materialised attention (the planner's placement), the Qwen2.5-7B shape at 1 x 32768.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); done && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt 2>&1
timeout 240 $B/layers-test --test-threads 1 --nocapture cuda_kernels > $R/kernel-test.log 2>&1; echo "kernel-test rc=$? at $SECONDS s"
grep -E "^test |test result|SUMMARY" $R/kernel-test.log | cut -c1-250
export MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
timeout 200 $B/gpu-long --test-threads 1 --nocapture > $R/gpu-long.log 2>&1; echo "gpu-long rc=$? at $SECONDS s"
grep -E "^test |test result|SUMMARY" $R/gpu-long.log | cut -c1-250
timeout 200 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "^test .*(ok|FAILED)$|test result" $R/gpu-test.log | cut -c1-150
run() { # name, timeout, args
  local n=$1 t=$2; shift 2
  timeout $t $B/megatrain train --device cuda --precision bf16 --data synthetic --log-every 1 --lr 1e-4 "$@" > $R/$n.log 2>&1; echo "$n rc=$? at $SECONDS s"
  grep -E "^step:|steady|loss:|in use at most|host RSS|rror|panick" $R/$n.log | sed 's/.*keep their activations (no recompute)/  .../' | cut -c1-220
}
c36="--config bench-harness/configs/llama3-3.6b.json --seq-len 2048 --steps 6"
run 36-4x2048-flash 100 $c36 --batch-size 4 --attention flash
run 36-4x2048-mat 100 $c36 --batch-size 4 --attention materialized
run 36-16x2048-flash 120 $c36 --batch-size 16 --attention flash
run 36-16x2048-mat 120 $c36 --batch-size 16 --attention materialized
run 7b-32k 150 --config bench-harness/configs/qwen2.5-7b.json --seq-len 32768 --batch-size 1 --steps 3
tar czf $OUT/run2.tgz -C $OUT r --remove-files
echo "wall $SECONDS s"

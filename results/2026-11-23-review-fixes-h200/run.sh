#!/usr/bin/env bash
# H200: final check of the review fixes (bin20: __launch_bounds__(1024) on the CE kernels, Writer !Send, the pool's
# reserved high-water mark reported beside the used one): kernel tests, GPU tests, 3.6B 4x2048 default and streamed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/bin20; mkdir -p $B && for f in .gpu/bin20/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*
R=$OUT/r; mkdir -p $R
timeout 120 $B/layers-test cuda_kernels --test-threads 1 --nocapture > $R/layers-test.log 2>&1; echo "layers-test rc=$?"
grep -E "SUMMARY|test result|panicked" $R/layers-test.log
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 170 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "test result|panicked" $R/gpu-test.log; grep -c "SUMMARY gpu kept/held.*losses bitwise true; grads bitwise true; params bitwise true" $R/gpu-test.log
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --batch-size 4 --steps 6"
for v in "default" "streamed --resident-layers 0"; do
  set -- $v; tag=$1; shift
  timeout 90 $B/megatrain train $common "$@" > $R/3.6b-4x2048-$tag.log 2>&1
  echo "$tag rc=$?"; grep -E "steady|GPU memory in use|rror" $R/3.6b-4x2048-$tag.log
done
echo "wall $SECONDS s"

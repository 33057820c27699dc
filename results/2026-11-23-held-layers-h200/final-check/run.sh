#!/usr/bin/env bash
# H200 (16 cores): final check of HEAD's binaries: GPU tests; 3.6B 4x2048 planner default (all resident, kept) and every
# layer streamed (held + kept by default), 6 steps each; explicit --held-layers 2 with residency on auto.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin13/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 150 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "test result|panicked" $R/gpu-test.log; grep -c "SUMMARY gpu kept/held.*losses bitwise true; grads bitwise true; params bitwise true" $R/gpu-test.log
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --batch-size 4 --steps 6"
for v in "default" "streamed --resident-layers 0" "held2 --held-layers 2"; do
  set -- $v; tag=$1; shift
  timeout 80 $M train $common "$@" > $R/3.6b-4x2048-$tag.log 2>&1
  echo "$tag rc=$?"; grep -E "^step:|PCIe per step|steady|kept activations|host RSS|rror" $R/3.6b-4x2048-$tag.log
done
echo "wall $SECONDS s"

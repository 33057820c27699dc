#!/usr/bin/env bash
# H200 (16 cores): GPU tests (kept activations and held weights bitwise); 3.6B 4x2048 every layer streamed:
# held+kept auto (all 28 held and kept), held only, neither; A/B in one call, traces of step 4.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
[ -n "${CUDA_VISIBLE:-}" ] && export CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE
B=/tmp/b; mkdir -p $B && for f in .gpu/bin10/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
if [ -z "${NOTEST:-}" ]; then
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 240 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "test result|panicked" $R/gpu-test.log | head; grep -c "SUMMARY gpu kept/held.*bitwise true; grads bitwise true; params bitwise true" $R/gpu-test.log
fi
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --resident-layers 0 --batch-size 4 --steps 8"
for v in "auto auto" "auto 0" "0 0" "auto auto"; do
  set -- $v; tag=held-$1-kept-$2-$SECONDS
  timeout 90 $M train $common --held-layers $1 --kept-layers $2 --trace $R/trace-$tag.json --trace-step 5 > $R/$tag.log 2>&1
  echo "$tag rc=$?"; grep -E "^step:|PCIe per step|steady|kept activations|streams" $R/$tag.log
done
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200: the fused path's workspace count (bin17) against the candle-path count (bin16): plans, the device pool's
# high-water mark against them, and throughput (alternating) for the 3.6B planner default at 4x2048 and 16x2048;
# every layer streamed at both sizes (bin17); GPU tests of bin17.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
for d in bin16 bin17; do B=/tmp/$d; mkdir -p $B && for f in .gpu/$d/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*; done
R=$OUT/r; mkdir -p $R
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 170 /tmp/bin17/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "test result|panicked" $R/gpu-test.log
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --steps 5"
i=0
for v in "bin16 default-4 --batch-size 4" "bin17 default-4 --batch-size 4" "bin16 default-4 --batch-size 4" "bin17 default-4 --batch-size 4" \
         "bin16 default-16 --batch-size 16" "bin17 default-16 --batch-size 16" \
         "bin17 streamed-4 --batch-size 4 --resident-layers 0" "bin17 streamed-16 --batch-size 16 --resident-layers 0"; do
  set -- $v; d=$1; tag=$2; shift 2; i=$((i+1))
  timeout 100 /tmp/$d/megatrain train $common "$@" > $R/$i-$d-$tag.log 2>&1
  echo "$d $tag rc=$?"; grep -E "^step:|GPU \(GiB\)|GPU memory in use|steady|rror" $R/$i-$d-$tag.log | sed 's/(the memory pool.s high-water mark: every tensor, not the CUDA context or library workspaces)//'
done
echo "wall $SECONDS s"

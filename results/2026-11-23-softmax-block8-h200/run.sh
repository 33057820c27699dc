#!/usr/bin/env bash
# H200: block-per-row softmax over 16-byte loads (`_block8`, rows longer than 2048 keys): kernel tests (f64 reference at
# t = 2053 / 2056 / 4096), GPU engine tests, ncu of the softmax kernels at 2 x 4096 (2-layer 3.6B shape), and the 3.6B
# planner default at 2 x 4096, bin22 (before) vs bin23 (after) alternating.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
for d in bin22 bin23; do B=/tmp/$d; mkdir -p $B && for f in .gpu/$d/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*; done
R=$OUT/r; mkdir -p $R
timeout 150 /tmp/bin23/layers-test cuda_kernels --test-threads 1 --nocapture > $R/layers-test.log 2>&1; echo "layers-test rc=$?"
grep -E "SUMMARY|test result|panicked" $R/layers-test.log
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 170 /tmp/bin23/gpu-test --test-threads 1 > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "test result|panicked" $R/gpu-test.log
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
common="--device cuda --precision bf16 --seq-len 4096 --data synthetic --log-every 0 --batch-size 2"
for d in bin22 bin23; do
  timeout 120 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu-$d.csv -k regex:softmax \
    /tmp/$d/megatrain train --config .gpu/l2.json $common --steps 2 > /dev/null 2>&1; echo "ncu $d rc=$?"
  python3 .gpu/ncu_sum.py $R/ncu-$d.csv | head -4
done
i=0
for d in bin22 bin23 bin22 bin23; do
  i=$((i+1))
  timeout 90 /tmp/$d/megatrain train --config bench-harness/configs/llama3-3.6b.json $common --steps 6 > $R/default-2x4096-$d-$i.log 2>&1
  echo "$d #$i rc=$?"; grep -E "^step:|steady|GPU memory in use|rror" $R/default-2x4096-$d-$i.log | sed 's/(every tensor; not the CUDA context or library workspaces)//'
done
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200: vectorised cross-entropy kernels (bin18) against bin17: kernel tests (softmax, cross-entropy vs f64), GPU
# engine tests, ncu times of the CE kernels (2-layer 3.6B shape, 4x2048), and the 3.6B default at 4x2048 alternating.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
for d in bin17 bin18; do B=/tmp/$d; mkdir -p $B && for f in .gpu/$d/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*; done
R=$OUT/r; mkdir -p $R
timeout 120 /tmp/bin18/layers-test cuda_kernels --test-threads 1 --nocapture > $R/layers-test.log 2>&1; echo "layers-test rc=$?"
grep -E "SUMMARY|test result|panicked" $R/layers-test.log
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 170 /tmp/bin18/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "test result|panicked" $R/gpu-test.log
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
common="--device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --batch-size 4"
for d in bin17 bin18; do
  timeout 120 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu-$d.csv -k regex:mt_ce \
    /tmp/$d/megatrain train --config .gpu/l2.json $common --steps 2 > /dev/null 2>&1; echo "ncu $d rc=$?"
  python3 .gpu/ncu_sum.py $R/ncu-$d.csv | head -4
done
i=0
for d in bin17 bin18 bin17 bin18; do
  i=$((i+1))
  timeout 80 /tmp/$d/megatrain train --config bench-harness/configs/llama3-3.6b.json $common --steps 6 > $R/default-4x2048-$d-$i.log 2>&1
  echo "$d #$i rc=$?"; grep -E "steady|GPU memory in use|rror" $R/default-4x2048-$d-$i.log | sed 's/(the memory pool.s high-water mark: every tensor, not the CUDA context or library workspaces)//'
done
echo "wall $SECONDS s"

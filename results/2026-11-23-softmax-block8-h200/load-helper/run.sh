#!/usr/bin/env bash
# H200: the _block8 softmax's loads through one helper (bin24) against bin23: kernel tests, ncu of the softmax kernels
# at 2 x 4096, and the 3.6B default at 2 x 4096 once each.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
for d in bin23 bin24; do B=/tmp/$d; mkdir -p $B && for f in .gpu/$d/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*; done
R=$OUT/r; mkdir -p $R
timeout 150 /tmp/bin24/layers-test softmax --test-threads 1 --nocapture > $R/layers-test.log 2>&1; echo "layers-test rc=$?"
grep -E "SUMMARY softmax kernels t=4096|SUMMARY softmax kernels t=2056|test result|panicked" $R/layers-test.log
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
common="--device cuda --precision bf16 --seq-len 4096 --data synthetic --log-every 0 --batch-size 2"
for d in bin23 bin24; do
  timeout 120 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu-$d.csv -k regex:softmax \
    /tmp/$d/megatrain train --config .gpu/l2.json $common --steps 2 > /dev/null 2>&1; echo "ncu $d rc=$?"
  python3 .gpu/ncu_sum.py $R/ncu-$d.csv | head -4
done
for d in bin23 bin24; do
  timeout 90 /tmp/$d/megatrain train --config bench-harness/configs/llama3-3.6b.json $common --steps 6 > $R/default-2x4096-$d.log 2>&1
  echo "$d rc=$?"; grep -E "steady|rror" $R/default-2x4096-$d.log
done
echo "wall $SECONDS s"

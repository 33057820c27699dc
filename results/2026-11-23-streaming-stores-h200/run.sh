#!/usr/bin/env bash
# H200 (16 cores): streaming stores for the upload copy. Criterion before/after (same call), GPU tests of
# the new build, and the 3.6B every layer streamed at 4x2048, old (bin13) and new (bin14) builds alternating.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
for d in bin13 bin14; do B=/tmp/$d; mkdir -p $B && for f in .gpu/$d/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*; done
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
for b in before after before after; do
  /tmp/bin14/adamw-$b --bench "bf16_grad\+bf16_upload|cast_into|par_copy" --noplot > $R/bench-$b.log 2>&1
  echo "== bench $b"; grep -E "^adamw|thrpt:" $R/bench-$b.log | grep -v "%"
done
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 170 /tmp/bin14/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "test result|panicked" $R/gpu-test.log
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0 --batch-size 4 --steps 6 --resident-layers 0"
i=0
for d in bin13 bin14 bin13 bin14; do
  i=$((i+1))
  timeout 90 /tmp/$d/megatrain train $common > $R/streamed-4x2048-$d-$i.log 2>&1
  echo "$d #$i rc=$?"; grep -E "steady|streams \(|host RSS|rror" $R/streamed-4x2048-$d-$i.log
done
echo "wall $SECONDS s"

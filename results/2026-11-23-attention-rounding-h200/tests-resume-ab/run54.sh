#!/usr/bin/env bash
# H200: build bin26 (attention rounding like the kernels; kernels/common.cuh prelude). Kernel tests, GPU engine tests,
# a GPU run killed after a checkpoint and resumed vs the uninterrupted run (three placements), and the 3.6B default at
# 4 x 2048 bin24 vs bin26 alternating.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
for d in bin24 bin26; do B=/tmp/$d; mkdir -p $B && for f in .gpu/$d/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*; done
R=$OUT/r; mkdir -p $R
timeout 150 /tmp/bin26/layers-test cuda_kernels --test-threads 1 --nocapture > $R/layers-test.log 2>&1; echo "layers-test rc=$?"
grep -E "SUMMARY|test result|panicked" $R/layers-test.log
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 200 /tmp/bin26/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$?"
grep -E "^SUMMARY gpu (bf16 vs|llama|qwen)|test result|panicked" $R/gpu-test.log | cut -c1-400
# Resume on the GPU: the uninterrupted run vs killed after step 5 (checkpoint at 3) and resumed, bf16, tiny Llama fixture.
python3 - <<'PY' > /tmp/data.jsonl
x = 12345
for i in range(40):
    n = 5 + i % 12; ids = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64; ids.append((x >> 33) % 128)
    print('{"input_ids": [%s]}' % ", ".join(map(str, ids)))
PY
M=/tmp/bin26/megatrain
common="train --model crates/megatrain/tests/fixtures/roundtrip/llama/model --data /tmp/data.jsonl --steps 7 --batch-size 3 --seq-len 16 --lr 0.003 --warmup 2 --schedule cosine --eval-fraction 0.1 --seed 5 --device cuda --precision bf16 --log-every 1"
i=0
for place in "" "--resident-layers 0 --resident-outer off" "--resident-layers 0 --resident-outer off --held-layers 0 --kept-layers 0"; do
  i=$((i+1)); A=/tmp/res$i/a; Bd=/tmp/res$i/b; mkdir -p /tmp/res$i
  $M $common $place --out $A > $R/resume$i-whole.log 2>&1; r1=$?
  $M $common $place --out $Bd --save-every 3 --abort-after-step 5 > $R/resume$i-crash.log 2>&1; r2=$?
  $M $common $place --out $Bd --save-every 3 --resume > $R/resume$i-resumed.log 2>&1; r3=$?
  if cmp -s $A/model.safetensors $Bd/model.safetensors; then same=BITWISE-EQUAL; else same=DIFFERENT; fi
  echo "resume placement [$place]: rc whole=$r1 crash=$r2 resumed=$r3; export $same"
  grep -hE "resident|held|resumed from" $R/resume$i-whole.log $R/resume$i-resumed.log | head -3 | cut -c1-200
done
i=0
for d in bin24 bin26 bin24 bin26; do
  i=$((i+1))
  timeout 90 /tmp/$d/megatrain train --config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 6 > $R/default-4x2048-$d-$i.log 2>&1
  echo "$d #$i rc=$?"; grep -E "steady|rror" $R/default-4x2048-$d-$i.log
done
echo "wall $SECONDS s"

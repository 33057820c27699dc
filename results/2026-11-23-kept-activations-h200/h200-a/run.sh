#!/usr/bin/env bash
# H200 call (16 cores): GPU tests (kept activations bitwise, the bf16 oracle); 3.6B 4x2048 every layer streamed and
# planner's placement, each with --kept-layers 0 and auto, A/B in one call; 3.6B 16x2048 streamed, kept auto.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin7/*.xz; do xz -dc $f > $B/$(basename $f .xz); done; chmod +x $B/*
M=$B/megatrain
R=$OUT/r; mkdir -p $R
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 240 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "test result|panicked|SUMMARY gpu (bf16 vs|kept)" $R/gpu-test.log | head -30
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --data synthetic --log-every 0"
for place in streamed default; do
  extra=""; [ $place = streamed ] && extra="--resident-layers 0"
  for k in 0 auto; do
    tr=""; [ $k = auto ] && tr="--trace $R/trace-3.6b-4x2048-$place-kept.json --trace-step 4"
    timeout 90 $M train $common $extra --kept-layers $k --batch-size 4 --steps 6 $tr > $R/3.6b-4x2048-$place-kept-$k.log 2>&1
    echo "3.6b $place kept=$k rc=$? at $SECONDS s"; grep -E "^step:|^GPU|steady|kept activations|streams|rror" $R/3.6b-4x2048-$place-kept-$k.log
  done
done
timeout 120 $M train $common --resident-layers 0 --kept-layers auto --batch-size 16 --steps 4 > $R/3.6b-16x2048-streamed-kept-auto.log 2>&1
echo "3.6b 16x2048 streamed kept=auto rc=$? at $SECONDS s"; grep -E "^step:|^GPU|steady|kept activations|streams|rror" $R/3.6b-16x2048-streamed-kept-auto.log
echo "wall $SECONDS s"

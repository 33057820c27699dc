#!/usr/bin/env bash
# GPU run 4 (H200): the 3.6B Llama-3 shape at 4 x 2048 and 16 x 2048, the planner's placement
# and every layer streamed (--resident-layers 0), with the binary before flash attention (7c1e2ab,
# "old") and the current one ("new"), interleaved; then spilled checkpoints on the GPU: the 3.6B at
# 1 x 16384, 3 steps, with 0 and 6 checkpoints spilled (the losses must be the same bits).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); done && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt 2>&1
run() { # binary, name, timeout, args
  local bin=$1 n=$2 t=$3; shift 3
  timeout $t $B/$bin train --device cuda --precision bf16 --data synthetic --log-every 1 --lr 1e-4 --metrics $R/m-$n.jsonl "$@" > $R/$n.log 2>&1; echo "$n rc=$? at $SECONDS s"
  grep -E "steady|rror|panick" $R/$n.log | cut -c1-160
}
c="--config bench-harness/configs/llama3-3.6b.json --seq-len 2048 --steps 6"
for v in "4x2048:--batch-size 4" "16x2048:--batch-size 16" "4x2048-streamed:--batch-size 4 --resident-layers 0" "16x2048-streamed:--batch-size 16 --resident-layers 0"; do
  name=${v%%:*}; args=${v#*:}
  run megatrain-old old-$name 120 $c $args
  run megatrain new-$name 120 $c $args
done
s="--config bench-harness/configs/llama3-3.6b.json --seq-len 16384 --batch-size 1 --steps 3 --resident-layers 0"
run megatrain spill0 150 $s --spill-checkpoints 0
run megatrain spill6 150 $s --spill-checkpoints 6
grep -h "^step " $R/spill0.log $R/spill6.log
diff <(grep "^step " $R/spill0.log | awk '{print $2, $4}') <(grep "^step " $R/spill6.log | awk '{print $2, $4}') && echo "spill: losses identical" || echo "spill: LOSSES DIFFER"
grep -h "^step:" $R/spill6.log | grep -o "[0-9]* checkpoints spilled"
echo "wall $SECONDS s"

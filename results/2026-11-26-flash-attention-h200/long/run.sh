#!/usr/bin/env bash
# GPU run 3 (detached; poll with scripts/gpu-runs/poll.sh): the golden flash test with its
# per-tensor bound, then the Qwen2.5-7B shape at 1 x 131072 (2 steps) and 1 x 262144 (1 step).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); done && chmod +x $B/*
R=/tmp/r; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt 2>&1
export MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
timeout 200 $B/gpu-long --test-threads 1 --nocapture > $R/gpu-long.log 2>&1; echo "gpu-long rc=$? at $SECONDS s" >> $R/progress
run() { # name, timeout, args
  local n=$1 t=$2; shift 2
  (while sleep 20; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done) > $R/$n.smi 2>&1 &
  local mon=$!
  timeout $t $B/megatrain train --device cuda --precision bf16 --data synthetic --log-every 1 --lr 1e-4 "$@" > $R/$n.log 2>&1
  echo "$n rc=$? at $SECONDS s" >> $R/progress
  kill $mon
}
c7="--config bench-harness/configs/qwen2.5-7b.json --batch-size 1"
run 7b-128k 600 $c7 --seq-len 131072 --steps 2
run 7b-256k 900 $c7 --seq-len 262144 --steps 1
echo "done at $SECONDS s" >> $R/progress

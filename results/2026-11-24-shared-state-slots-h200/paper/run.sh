#!/usr/bin/env bash
# H200 (16 cores), build f9d3c37 (early slots back to the free list after their download). The 3.6B
# (--resident-layers 0) at 4 x 2048, prev (10, 5 late, 0 early) vs auto (14, 5, 5), two interleaved rounds; then one
# bench-harness paper run (ours planner, ours every layer streamed, streamed with host updates, resident PyTorch)
# at 4x2048 and 16x2048.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_COMMIT=f9d3c37
B=/tmp/b; mkdir -p $B && for f in megatrain bench-harness gpu-test; do xz -dc .gpu/bin41/$f.xz > $B/$f; done && chmod +x $B/*
R=$OUT/r; mkdir -p $R; rm -rf /tmp/p41
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; free -g; lscpu | grep -E "Model name|NUMA node\(s\)|MHz"; which python3) > $R/env.txt 2>&1
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 8 --resident-layers 0"
run() { # name, extra args
  local n=$1; shift
  timeout 120 $B/megatrain train $common "$@" > $R/$n.log 2>&1; echo "$n rc=$? at $SECONDS s"
  grep -E "steady|rror" $R/$n.log | cut -c1-200
}
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 200 $B/gpu-test --test-threads 1 --nocapture cuda_gpu_updated_layers > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "test result|SUMMARY gpu" $R/gpu-test.log | cut -c1-200
for rep in 1 2; do
  run prev-$rep --gpu-updated-layers 10 --late-state-downloads 5 --early-state-uploads 0
  run auto-$rep
done
timeout $((580 - SECONDS)) $B/bench-harness --megatrain $B/megatrain --suite paper --models 3.6b \
  --systems ours,torch --ours-streamed --tokens 4x2048,16x2048 --depths 0 --slices 0 --steps 5 --run-timeout-s 150 \
  --python python3 --out /tmp/p41 2>&1 | tee $R/paper.log | grep -E "^\[|ok:|Failed|wrote|rror" | cut -c1-200
tar czf $OUT/paper-3.6b.tgz -C /tmp/p41 .
grep -hE "steady|host RSS|last step" /tmp/p41/logs/*ours*.log 2>/dev/null | cut -c1-200
tar czf $OUT/r80.tgz -C $OUT r --remove-files
echo "wall $SECONDS s"

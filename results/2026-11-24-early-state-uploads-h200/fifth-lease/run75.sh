#!/usr/bin/env bash
# H200 (16 cores), build 28ff011: the 3.6B (--resident-layers 0) at 4 x 2048, the last session's auto (10 GPU-updated,
# 5 late, 0 early) vs the new auto (17, 5, 9) vs 14 GPU-updated with 5 late and 5 early (as many early as late: what a
# version whose early uploads reuse the late layers' slots, no extra GPU memory, would move), three interleaved rounds.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in megatrain; do xz -dc .gpu/bin39/$f.xz > $B/$f; done && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; free -g; lscpu | grep -E "Model name|NUMA node\(s\)|MHz") > $R/env.txt 2>&1
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 8 --resident-layers 0"
run() { # name, extra args
  local n=$1; shift
  if [ $SECONDS -gt 540 ]; then echo "$n skipped (time)"; return; fi
  timeout 120 $B/megatrain train $common "$@" > $R/$n.log 2>&1; echo "$n rc=$? at $SECONDS s"
  grep -E "GPU-updated layers|steady|last step|streams \(|rror" $R/$n.log | cut -c1-260
}
for rep in 1 2 3; do
  run prev-$rep --gpu-updated-layers 10 --late-state-downloads 5 --early-state-uploads 0
  run auto-$rep
  run n14-e5-$rep --gpu-updated-layers 14 --late-state-downloads 5 --early-state-uploads 5
done
tar czf $OUT/r75.tgz -C $OUT r --remove-files
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200 (16 cores), build 7508690 (late downloads spread over the backward, no scalar reads in the step): GPU tests, then the 3.6B with every layer streamed
# (--resident-layers 0) at 4 x 2048: host-only vs GPU-updated N=10 without late downloads vs auto (10 GPU-updated, 5 late),
# interleaved, a late-download sweep, and a trace of auto.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in gpu-test megatrain; do [ -x $B/$f ] || xz -dc .gpu/bin36/$f.xz > $B/$f; done && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; free -g; lscpu | grep -E "Model name|NUMA node\(s\)|MHz") > $R/env.txt 2>&1
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 240 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "GPU-updated|test result|panicked" $R/gpu-test.log | cut -c1-200
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 8 --resident-layers 0"
run() { # name, extra args
  local n=$1; shift
  if [ $SECONDS -gt 500 ]; then echo "$n skipped (time)"; return; fi
  timeout 120 $B/megatrain train $common "$@" > $R/$n.log 2>&1; echo "$n rc=$? at $SECONDS s"
  grep -E "GPU-updated layers|steady|last step|streams \(|rror" $R/$n.log | cut -c1-230
}
for rep in 1 2; do
  run host-$rep --gpu-updated-layers 0
  run n10-$rep --gpu-updated-layers 10 --late-state-downloads 0
  run auto-$rep
done
run auto-trace --trace $R/trace-auto.json --trace-step 4 --steps 6
run n10-trace --gpu-updated-layers 10 --late-state-downloads 0 --trace $R/trace-n10.json --trace-step 4 --steps 6
run n10-late3 --gpu-updated-layers 10 --late-state-downloads 3
run n10-late8 --gpu-updated-layers 10 --late-state-downloads 8
run n11-late6 --gpu-updated-layers 11 --late-state-downloads 6
tar czf $OUT/r67.tgz -C $OUT r --remove-files
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200 (16 cores): GPU tests (new: GPU-updated layers bitwise as host updates), then the 3.6B at 4 x 2048 with
# every layer streamed (--resident-layers 0), host-only updates vs GPU-updated layers (auto = balanced, and a sweep),
# and 16 x 2048 streamed with auto. One machine, one lease.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in gpu-test megatrain; do xz -dc .gpu/bin32/$f.xz > $B/$f; done && chmod +x $B/*
R=$OUT/r; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; free -g; lscpu | grep -E "Model name|NUMA node\(s\)|MHz") > $R/env.txt 2>&1
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 240 $B/gpu-test --test-threads 1 --nocapture > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"
grep -E "GPU-updated|test result|panicked" $R/gpu-test.log | cut -c1-200
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 8 --resident-layers 0"
run() { # name, extra args
  local n=$1; shift
  timeout 150 $B/megatrain train $common "$@" > $R/$n.log 2>&1; echo "$n rc=$? at $SECONDS s"
  grep -E "^step:|GPU-updated layers|PCIe per step|steady|host RSS|pcie per step|streams \(|rror" $R/$n.log | cut -c1-260
}
run streamed-host --gpu-updated-layers 0
run streamed-auto --trace $R/trace-auto.json
run streamed-gpu6 --gpu-updated-layers 6
run streamed-gpu8 --gpu-updated-layers 8
run streamed-gpu12 --gpu-updated-layers 12
run streamed-host-2 --gpu-updated-layers 0
run streamed-auto-2
common="${common/--batch-size 4/--batch-size 16}"
run streamed16-auto
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200 (16 cores), build 28ff011 (early state uploads): the 3.6B Llama-3 shape in one bench-harness paper run at 4x2048 and 16x2048:
# ours (planner), ours every layer streamed (GPU-updated layers, late state downloads and early state uploads auto), ours every layer streamed with every update
# on the host (streamed_host), resident PyTorch. DeepSpeed not run (measured 80 on this kind, docs/peers.md).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_COMMIT=${MT_COMMIT:-28ff011}
mkdir -p /tmp/b && for f in megatrain bench-harness; do xz -dc .gpu/bin39/$f.xz > /tmp/b/$f; done; chmod +x /tmp/b/*
R=$OUT/r; mkdir -p $R; rm -rf /tmp/p39
(date; hostname; cat /proc/sys/kernel/random/boot_id; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g; which python3) > $R/env.txt 2>&1
timeout $((${LIMIT:-580} - SECONDS)) /tmp/b/bench-harness --megatrain /tmp/b/megatrain --suite paper --models 3.6b \
  --systems ours,torch --ours-streamed --tokens ${TOK:-4x2048,16x2048} --depths 0 --slices 0 --steps 5 --run-timeout-s 150 \
  --python python3 --out /tmp/p39 2>&1 | tee $R/paper.log | grep -E "^\[|ok:|Failed|wrote|rror" | cut -c1-200
tar czf $OUT/paper-3.6b.tgz -C /tmp/p39 .
grep -hE "^step:|steady|host RSS|streams \(|last step" /tmp/p39/logs/*ours*.log 2>/dev/null | cut -c1-220
echo "wall $SECONDS s"

#!/usr/bin/env bash
# x2 call, build 9d53c31: the new write-back (through the page-locked landing buffer) at 14B with 16 resident layers.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export CUDA_VISIBLE_DEVICES=0
mkdir -p /tmp/b && xz -dc .gpu/bin4/megatrain.xz > /tmp/b/megatrain && chmod +x /tmp/b/megatrain
R=$OUT/r; mkdir -p $R
timeout 240 /tmp/b/megatrain train --config bench-harness/configs/qwen2.5-14b.json --device cuda --precision bf16 --seq-len 2048 \
  --batch-size 4 --steps 3 --data synthetic --log-every 0 --host-mem 240 > $R/14b-4x2048-writeback.log 2>&1; echo "rc=$? wall $SECONDS s"
grep -E "^step:|pre-faulted|initialised|engine ready|steady|last update|trained|RSS|rror" $R/14b-4x2048-writeback.log

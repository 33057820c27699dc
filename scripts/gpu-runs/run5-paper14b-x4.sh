#!/usr/bin/env bash
# GPU run 5 (nvidia-h200-x4, one of its H200s; 64 cores, 512 GiB): the paper suite's headline pair,
# the Qwen2.5-14B shape at 4 x 2048 and 16 x 2048: ours (planner placement), ours with every decoder
# layer streamed, and DeepSpeed ZeRO-3 with CPU offload, in one bench-harness run. Started detached
# (it outlasts one 10-minute call); poll with scripts/gpu-runs/poll-paper.sh.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_VISIBLE_DEVICES=0
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_COMMIT=${MT_COMMIT:?set MT_COMMIT} PYTHONUNBUFFERED=1
B=/tmp/b; mkdir -p $B && for f in .gpu/bin5/*.xz; do xz -dc $f > $B/$(basename $f .xz); done && chmod +x $B/*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
R=/tmp/r; mkdir -p $R; rm -rf /tmp/p14
(date; hostname; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; free -g; lscpu | grep -E "Model name|NUMA node\(s\)|MHz"; python3 -c "import deepspeed, torch, transformers; print(deepspeed.__version__, torch.__version__, transformers.__version__)") > $R/env.txt 2>&1
cat $R/env.txt
echo "started $(date +%T)" > $R/progress
setsid nohup bash -c "$B/bench-harness --megatrain $B/megatrain --suite paper --models 14b \
  --systems ours,deepspeed --ours-streamed --tokens 4x2048,16x2048 --depths 0 --slices 0 --steps 3 \
  --run-timeout-s 420 --megatrain-arg=--host-mem --megatrain-arg=480 --python python3 --out /tmp/p14 \
  > $R/paper.log 2>&1; echo \"done rc=\$? \$(date +%T)\" >> $R/progress" > /dev/null 2>&1 &
sleep 5; cat $R/progress

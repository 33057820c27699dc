#!/usr/bin/env bash
# GPU job 46 (session 46, one H200). Order: issue 38's merge gate (hopper-sinks' flash tests,
# GPT-OSS on the Hopper kernels), issue 32's 7B 1 x 524288 two steps, issue 35's LoRA speed
# against transformers + peft, issue 38's GPT-OSS attention benchmark. Progress in /tmp/r/progress.
set -u
NCCL_LIB=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
B=/tmp/b; R=/tmp/r; rm -rf $B $R; mkdir -p $B $R
xz -dc .gpu/bin46.tar.xz | tar xf - -C $B; chmod +x $B/*
log() { echo "$* at $SECONDS s" >> $R/progress; }
(date; nvidia-smi; lscpu | head -20; free -g; df -h /tmp; cat .gpu/commit) > $R/env.txt 2>&1
log start
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw --format=csv -l 5 > $R/smi.csv 2>&1 &
t() { # name timeout command...
  local n=$1 to=$2; shift 2
  timeout $to "$@" > $R/$n.log 2>&1; local rc=$?
  log "$n rc=$rc $(grep -E '^test result|^step +[0-9]+ ' $R/$n.log | tail -2 | tr '\n' ' ' | cut -c1-160)"
}
# 38: hopper-sinks (kernels and test binaries built from the branch, 8e95297)
t kt-flash 240 $B/kt --test-threads 1 --nocapture flash
MEGATRAIN_NVRTC_CC=80 t kt-flash-cc80 240 $B/kt --test-threads 1 --nocapture flash
t gpu_long_context 240 $B/gpu_long_context --test-threads 1 --nocapture gpt_oss
# 32: the 7B at 512k, two steps (main f6cae5f)
T="$B/mt-main train --config bench-harness/configs/qwen2.5-7b.json --device cuda --precision bf16 --data synthetic --batch-size 1 --optim-mode lean --grad-dtype none --lr 1e-4 --log-every 1"
t 7b-512k 1500 $T --seq-len 524288 --steps 2 --metrics $R/m-7b-512k.jsonl
# 35: LoRA r 16, Llama-3-8B shape, bf16 base (random, from --config), ours vs transformers + peft
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/peft-*.whl >> $R/pip.log 2>&1; log "pip rc=$?"
L="$B/mt-main train --config bench-harness/configs/llama3-8b.json --device cuda --precision bf16 --data synthetic --seq-len 2048 --steps 6 --log-every 1 --lora-rank 16"
P="python3 scripts/baselines/peft_lora.py --config bench-harness/configs/llama3-8b.json --seq-len 2048 --steps 6 --lora-rank 16"
t lora-16 240 $L --batch-size 16 --metrics $R/lora-16.jsonl
PYTHONPATH=/tmp/site t peft-16 300 $P --batch-size 16 --metrics $R/peft-16.jsonl
t lora-4 200 $L --batch-size 4 --metrics $R/lora-4.jsonl
PYTHONPATH=/tmp/site t peft-4 240 $P --batch-size 4 --metrics $R/peft-4.jsonl
t lora-16-streamed 240 $L --batch-size 16 --gpu-mem 12 --metrics $R/lora-16-streamed.jsonl
# 38: GPT-OSS attention shape (window 128, sinks) on the branch's kernels
MT_COMMIT=8e95297 t attn-gptoss 300 python3 .gpu/hs/scripts/attention_bench.py --out $R/attn-gptoss.json --heads '' --d64-heads 64:8 --check-seqs '' --seqs 4096,16384,65536 --window 128 --sinks --also-plain --sdpa ''
log done

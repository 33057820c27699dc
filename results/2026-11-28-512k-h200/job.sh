#!/usr/bin/env bash
# GPU job 15 (session 44, one H200): issue 32's 7B 1 x 524288 (2 steps, fp32 master + AdamW, lean),
# then issue 34's MoE kernel benchmark. Progress in /tmp/r/progress.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; R=/tmp/r; mkdir -p $B $R
xz -dc .gpu/bin14.tar.xz | tar xf - -C $B; chmod +x $B/*
log() { echo "$* at $SECONDS s" >> $R/progress; }
(nvidia-smi; lscpu | head -20; free -g; df -h /tmp; cat .gpu/commit) > $R/env.txt 2>&1
log start
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw --format=csv -l 5 > $R/smi.csv 2>&1 &
T="$B/mt-main train --config bench-harness/configs/qwen2.5-7b.json --device cuda --precision bf16 --data synthetic --batch-size 1 --optim-mode lean --grad-dtype none --lr 1e-4 --log-every 1"
$T --seq-len 524288 --steps 2 --metrics $R/m-7b-512k.jsonl > $R/7b-512k.log 2>&1; log "7b 512k rc=$?"
MT_COMMIT=6eb9783 timeout 580 python3 scripts/moe_bench.py --out $R/moe_bench.json > $R/moe_bench.log 2>&1; log "moe_bench rc=$?"
log done

#!/usr/bin/env bash
# The job behind this folder, run detached on one H200 from the repository root with the release
# binary of 22c832b unpacked to /tmp/b; outputs in /tmp/r (copied here). The 1 x 524288 run of an
# earlier machine of the same session is not here: that machine went back before its first step ended.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; R=/tmp/r; mkdir -p $B $R
xz -dc .gpu/bin14.tar.xz | tar xf - -C $B; chmod +x $B/*
log() { echo "$* at $SECONDS s" >> $R/progress; }
(nvidia-smi; lscpu | head -20; free -g; cat .gpu/commit) > $R/env.txt 2>&1
log start
python3 scripts/attention_bench.py --out $R/attention.json --ours hopper --sdpa cudnn --seqs 16384,65536,131072 --check-seqs 4096,32768 --reps 3 > $R/attention.log 2>&1; log "attention rc=$?"
T="$B/mt-main train --config bench-harness/configs/qwen2.5-7b.json --device cuda --precision bf16 --data synthetic --batch-size 1 --optim-mode lean --grad-dtype none --lr 1e-4 --log-every 1"
$T --seq-len 131072 --steps 3 --metrics $R/m-7b-128k.jsonl > $R/7b-128k.log 2>&1; log "7b 128k rc=$?"
$T --seq-len 262144 --steps 2 --metrics $R/m-7b-256k.jsonl > $R/7b-256k.log 2>&1; log "7b 256k rc=$?"
log done

#!/usr/bin/env bash
# The learning rate at the 3.6B Llama-3 shape's width, on the 2-core development machine (no GPU):
# config.json is bench-harness/configs/llama3-3.6b.json with 2 decoder layers and a vocabulary of
# 8192 (so that it fits in 23 GiB of RAM); hidden 3072, FFN 8192, 24/8 heads as the 3.6B. Synthetic
# data as the bench-harness runs; 10 steps of 2 x 256 tokens; the default warmup (5), cosine
# schedule and clipping (1.0). Binary: build 0df5f68 (release). Then: python3 summarize.py.
set -eu
M=${MEGATRAIN:-target/release/megatrain}
for lr in 1e-2 1e-3 4e-4 1.6e-4; do
    $M train --config config.json --data synthetic --batch-size 2 --seq-len 256 --steps 10 \
        --lr $lr --log-every 1 --metrics lr$lr.jsonl > lr$lr.log 2>&1
done

#!/usr/bin/env bash
# The three runs of this folder, one after another: the same seeded SmolLM2-shaped model, data,
# order, schedule and seed; only --optim-states differs. Usage: run.sh WORKDIR (scratch space).
# SEEDS (default "0") repeats them with other --seed values (the data order; the model's
# initialisation comes from `megatrain init` and is the same for every seed): seed 0 writes
# NAME.jsonl/.log, seed N NAME-seedN.jsonl/.log. STATES (default "fp32 bf16 int8") picks and orders
# the --optim-states. MEGATRAIN names the binary (default target/release/megatrain, from
# cargo build --release -p megatrain). Needs python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
M=${MEGATRAIN:-$repo/target/release/megatrain}
W=${1:?usage: run.sh WORKDIR}
mkdir -p "$W"
cd "$W"
# The chat set (2,000 train / 100 eval conversations); the first 50 eval ones are the held-out set.
python3 "$repo/scripts/make_chat_data.py" chat
head -50 chat/eval.jsonl > chat/eval50.jsonl
# SmolLM2-135M's layer shape, 2 of its 30 layers, with the 320-token byte-level BPE tokenizer
# of the tests (SmolLM2's chat template and special tokens).
rm -rf model
"$M" init --config "$here/config.json" --out model --export-dtype fp32
cp "$repo/crates/data/fixtures/tiny_tok/tokenizer.json" "$repo/crates/data/fixtures/tiny_tok/tokenizer_config.json" model/
for seed in ${SEEDS:-0}; do
  for s in ${STATES:-fp32 bf16 int8}; do
    name=$s
    [ "$seed" = 0 ] || name=$s-seed$seed
    "$M" train --model model --data chat/train.jsonl --eval-data chat/eval50.jsonl \
        --steps 500 --batch-size 4 --seq-len 256 --lr 8.68e-4 --warmup 10 --schedule cosine \
        --seed "$seed" --device cpu --precision fp32 --optim-states "$s" \
        --eval-every 20 --metrics "$here/$name.jsonl" > "$here/$name.log" 2>&1
  done
done

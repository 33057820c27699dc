#!/usr/bin/env bash
# Same lease as run63: the streamed 3.6B at 4 x 2048, GPU-updated layers 0 / 4 / 6 / 10, 8 steps each, twice over.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; [ -x $B/megatrain ] || { mkdir -p $B && xz -dc .gpu/bin33/megatrain.xz > $B/megatrain && chmod +x $B/megatrain; }
R=/tmp/r64; rm -rf $R; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id) > $R/env.txt
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 8 --resident-layers 0"
for rep in 1 2; do for k in 0 4 6 10; do
  timeout 120 $B/megatrain train $common --gpu-updated-layers $k > $R/gpu$k-$rep.log 2>&1; echo "k=$k rep $rep rc=$? at $SECONDS s: $(grep -oE '[0-9.]+ model TFLOP/s' $R/gpu$k-$rep.log | tail -1) $(grep -oE 'host busy [0-9.]+%' $R/gpu$k-$rep.log)"
done; done
tar czf $OUT/r64.tgz -C /tmp r64
echo "wall $SECONDS s"

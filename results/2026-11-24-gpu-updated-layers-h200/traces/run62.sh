#!/usr/bin/env bash
# Same lease as run61: traces of one steady step, streamed 3.6B at 4 x 2048, host-only vs GPU-updated (auto = 10).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; [ -x $B/megatrain ] || { mkdir -p $B && xz -dc .gpu/bin32/megatrain.xz > $B/megatrain && chmod +x $B/megatrain; }
R=/tmp/r62; rm -rf $R; mkdir -p $R
(date; hostname; cat /proc/sys/kernel/random/boot_id) > $R/env.txt
common="--config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --seq-len 2048 --batch-size 4 --data synthetic --log-every 0 --steps 6 --resident-layers 0 --trace-step 4"
for v in host:0 auto:auto gpu14:14; do n=${v%%:*}; k=${v#*:}
  timeout 120 $B/megatrain train $common --gpu-updated-layers $k --trace $R/trace-$n.json > $R/streamed-$n.log 2>&1; echo "$n rc=$? at $SECONDS s"
  grep -E "steady|streams \(" $R/streamed-$n.log | cut -c1-250
done
tar czf $OUT/r62.tgz -C /tmp r62; ls -la $OUT
echo "wall $SECONDS s"

#!/usr/bin/env bash
# GPU job 50 (session 50, one H200), run from a copy in /tmp/gpu.
# Issue 32: the Hopper backward variants (dQ mid, P early, first store, combined) beside the
# default and cuDNN at 16k and 64k with checks at 4096 (interleaved rounds, 10); the Rust flash
# tests on the GPU (the default's loop was split); the CUBIN cache across two processes; a second
# 16k sample of the variants.
set -u
G=/tmp/gpu
NCCL_LIB=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
export MT_COMMIT=$(cat $G/commit)
B=/tmp/b; R=/tmp/r; W=/tmp/w; rm -rf $B $R $W; mkdir -p $B $R $W
xz -dc $G/bin50.tar.xz | tar xf - -C $B; chmod +x $B/*
log() { echo "$* at $SECONDS s" >> $R/progress; }
(date; pwd; nvidia-smi; lscpu | head -20; free -g; df -h /tmp; cat $G/commit) > $R/env.txt 2>&1
log start
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw,clocks.sm --format=csv -l 5 > $R/smi.csv 2>&1 &
t() { # name timeout command...
  local n=$1 to=$2; shift 2
  timeout $to "$@" > $R/$n.log 2>&1; local rc=$?
  log "$n rc=$rc $(grep -E '^test result|^step +[0-9]+ |rel err|^bench|FAILED|RSS' $R/$n.log | tail -2 | tr '\n' ' ' | cut -c1-240)"
}
V=mid:MT_HFA_BWD_DQ_MID,pe:MT_HFA_BWD_P_EARLY,fs:MT_HFA_DQ_FIRST_STORE,both:MT_HFA_BWD_DQ_MID+MT_HFA_BWD_P_EARLY,all:MT_HFA_BWD_DQ_MID+MT_HFA_BWD_P_EARLY+MT_HFA_DQ_FIRST_STORE
t attention 540 python3 scripts/attention_bench.py --out $R/attention.json --ours hopper --sdpa cudnn \
  --hopper-variants $V --seqs 16384,65536 --check-seqs 4096 --reps 10
t kt-flash 300 $B/kt --test-threads 1 flash
M=$B/megatrain
X="$M train --config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --data synthetic --batch-size 1 --seq-len 4096 --steps 2 --log-every 1 --optim-mode lean --grad-dtype none --lr 1e-4"
export MEGATRAIN_CUBIN_CACHE=/tmp/cc
for i in 1 2; do s0=$SECONDS; t cache-$i 300 $X; log "cache-$i wall $((SECONDS - s0)) s"; ls -la /tmp/cc >> $R/cache-ls.txt 2>&1; done
unset MEGATRAIN_CUBIN_CACHE
t attention16k-2 400 python3 scripts/attention_bench.py --out $R/attention16k-2.json --ours hopper --sdpa cudnn \
  --hopper-variants $V --seqs 16384 --check-seqs '' --reps 10
log done

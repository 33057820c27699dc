#!/usr/bin/env bash
# GPU job 50b (session 50, one H200), run from a copy in /tmp/gpu. Issue 32 with the new defaults
# (f6d52af): the Rust flash tests on the GPU; the kernel bench at 16k/64k/128k with the old order as
# a variant and checks at 4k and 32k; then the edge sweep's 3.6B rows (resumable) while time lasts.
set -u
G=/tmp/gpu
NCCL_LIB=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
export MT_COMMIT=$(cat $G/commit)
B=/tmp/b; R=/tmp/r; W=/tmp/w; rm -rf $B $R $W; mkdir -p $B $R $W
xz -dc $G/bin50b.tar.xz | tar xf - -C $B; chmod +x $B/*
log() { echo "$* at $SECONDS s" >> $R/progress; }
(date; pwd; nvidia-smi; lscpu | head -20; free -g; df -h /tmp; cat $G/commit) > $R/env.txt 2>&1
log start
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw,clocks.sm --format=csv -l 5 > $R/smi.csv 2>&1 &
t() { # name timeout command...
  local n=$1 to=$2; shift 2
  timeout $to "$@" > $R/$n.log 2>&1; local rc=$?
  log "$n rc=$rc $(grep -E '^test result|^step +[0-9]+ |^bench|FAILED|RSS' $R/$n.log | tail -2 | tr '\n' ' ' | cut -c1-240)"
}
t kt-flash 300 $B/kt --test-threads 1 flash
t attention 560 python3 scripts/attention_bench.py --out $R/attention.json --ours hopper --sdpa cudnn \
  --hopper-variants old:MT_HFA_BWD_DQ_MID_HD=0+MT_HFA_BWD_P_EARLY_HD=0 --seqs 16384,65536,131072 --check-seqs 4096,32768 --reps 10
t edge 900 python3 scripts/edge_sweep.py --megatrain $B/megatrain --models bench-harness/configs/llama3-3.6b.json \
  --batches 4,2 --out $R/edge.json --logs $R/edge-logs --max-seconds 280
log done

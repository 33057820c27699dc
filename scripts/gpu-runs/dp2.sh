#!/usr/bin/env bash
# GPU run dp2 (4 GPUs of one host): `bench-harness --suite scale` on the 3.6B Llama-3 shape at
# 16 x 2048, --gpus 1, 2, 4 (same global batch and placement: no optimizer state on a GPU), 4 steps
# each (the first is warm-up). Release binaries megatrain and bench-harness in $BIN (xz).
set -u
export NCCL_NVLS_ENABLE=0
NCCL=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$NCCL:/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
BIN=${BIN:-.gpu/bin}
B=/tmp/b; mkdir -p $B && for f in $BIN/*.xz; do xz -dc $f > $B/$(basename $f .xz); done && chmod +x $B/*
O=${OUT:-/tmp/out}; mkdir -p $O
(date; nvidia-smi -L; nproc; free -g) | tee $O/env.txt
timeout ${SCALE_TIMEOUT:-420} $B/bench-harness --suite scale --megatrain $B/megatrain --models ${MODELS:-3.6b} \
  --tokens ${TOKENS:-16x2048} --gpus-list ${GPUS:-1,2,4} --steps ${STEPS:-4} --run-timeout-s 200 \
  --megatrain-arg=--host-mem --megatrain-arg=${HOST_MEM:-400} --out /tmp/scale 2>&1 | tee $O/scale.log | grep -v "^\s*$" | tail -30
python3 - <<'PY'
import json
r = json.load(open('/tmp/scale/results.json'))
for run in r['runs']:
    print(run['key'], run['status'], 'tokens/s', run.get('tokens_per_s'), 'step_ms', run.get('step_ms'),
          'TFLOP/s', run.get('model_tflops'), 'host busy', run.get('host_busy_frac'), 'compute busy', run.get('compute_busy_frac'))
for q in r['ratios']:
    g = int(q['variant'].removeprefix('gpus'))
    print(q['model'], q['variant'], 'x one GPU:', round(q['tokens_per_s_ratio_ours_over_peer'], 3), 'efficiency', round(q['tokens_per_s_ratio_ours_over_peer'] / g, 3))
PY
cp /tmp/scale/results.json $O/ 2>/dev/null
tar -C /tmp/scale -cJf $O/scale-logs.tar.xz logs metrics 2>/dev/null
echo "wall $SECONDS s"

#!/usr/bin/env bash
# GPU run dp1 (2 or 4 GPUs of one host): data parallel through NCCL. The GPU test binary
# (crates/sched/tests/gpu_data_parallel.rs: one NCCL rank bitwise the plain engine; 2 and 4 ranks
# against one GPU with the whole batch), then `megatrain train` on the built-in tiny Llama at
# --gpus 1, 2, 4 with the same global batch (losses side by side). Binaries: .gpu/bin/*.xz.
set -u
export NCCL_NVLS_ENABLE=0 MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
NCCL=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$NCCL:/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); done && chmod +x $B/*
R=/tmp/r; mkdir -p $R; O=${OUT:-/tmp/out}; mkdir -p $O
(date; nvidia-smi -L; echo "libnccl: $NCCL"; nproc) > $R/env.txt 2>&1; cat $R/env.txt
if [[ -x $B/gpu_data_parallel ]]; then
  timeout 300 $B/gpu_data_parallel --test-threads=1 --nocapture > $O/gpu_test.log 2>&1; echo "gpu test rc=$?"
  grep -E "SUMMARY|test |panicked|result" $O/gpu_test.log | cut -c1-300
fi
if [[ -x $B/megatrain ]]; then
  G=$(nvidia-smi -L | wc -l)
  for p in fp32 bf16; do
    for g in 1 2 4; do
      [[ $g -le $G ]] || continue
      timeout 120 $B/megatrain train --device cuda --gpus $g --precision $p --batch-size 8 --seq-len 64 --steps 6 \
        --log-every 1 --metrics $R/m-$p-$g.jsonl > $R/cli-$p-$g.log 2>&1; echo "cli $p gpus $g rc=$?"
      cat $R/cli-$p-$g.log >> $O/cli.log
      python3 -c "import json,sys; print('$p gpus $g', [(r['step'], r['loss'], round(r['grad_norm'], 6)) for r in map(json.loads, open(sys.argv[1])) if r.get('type') == 'step'])" $R/m-$p-$g.jsonl
      grep -E "rror|panick" $R/cli-$p-$g.log | head -3
    done
  done
fi
echo "wall $SECONDS s"

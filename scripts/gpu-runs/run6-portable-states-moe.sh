#!/usr/bin/env bash
# GPU run 6 (one H200): the merged build (faults + optimizer-state precision + one binary for
# compute capability 8.0-9.0) checked on the GPU. Kernel tests and the GPU engine tests with our
# kernels compiled for the device (compute_90) and forced to compute_80 (the A100's code);
# the 3.6B at 4 x 2048 with the previous Hopper-only build (6bb20e7, candle sm_90a) and the
# portable one, per optimizer-state precision; an OLMoE-1B-7B-shaped MoE at 4 and 16 x 2048.
# Started detached; poll with scripts/gpu-runs/poll.sh.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
B=/tmp/b; mkdir -p $B && for f in .gpu/bin6/*.xz; do xz -dc $f > $B/$(basename $f .xz); done && chmod +x $B/*
R=/tmp/r; mkdir -p $R
(date; hostname; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt 2>&1
export MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
cat > $R/job.sh <<'JOB'
B=/tmp/b; R=/tmp/r
t() { local n=$1; shift; [[ -x ${1#*=} || -x $1 ]] || { echo "$n: no binary" >> $R/progress; return; }; timeout 240 "$@" > $R/$n.log 2>&1; echo "$n rc=$? $(grep -h '^test result' $R/$n.log | tr '\n' ' ') at $SECONDS s" >> $R/progress; }
t kernels $B/mt_layers --test-threads 1 cuda_kernels
MEGATRAIN_NVRTC_CC=80 t kernels-cc80 $B/mt_layers --test-threads 1 cuda_kernels
t gpu $B/gpu --test-threads 1
t gpu-states $B/gpu_optim_states --test-threads 1
t gpu-faults $B/gpu_faults --test-threads 1
MEGATRAIN_NVRTC_CC=80 t gpu-cc80 $B/gpu --test-threads 1
run_train() { local bin=$1 n=$2; shift 2
  timeout 150 $B/$bin train --device cuda --precision bf16 --data synthetic --log-every 1 --lr 1e-4 --metrics $R/m-$n.jsonl "$@" > $R/$n.log 2>&1
  echo "$n rc=$? $(grep -h 'steady' $R/$n.log | cut -c1-120) at $SECONDS s" >> $R/progress; }
c="--config bench-harness/configs/llama3-3.6b.json --batch-size 4 --seq-len 2048 --steps 6"
run_train megatrain-old old-sm90a $c
run_train megatrain new-fp32 $c
MEGATRAIN_NVRTC_CC=80 run_train megatrain new-fp32-cc80 $c
run_train megatrain new-int8 $c --optim-states int8
run_train megatrain new-bf16 $c --optim-states bf16
o="--config bench-harness/configs/olmoe-1b-7b.json --seq-len 2048 --steps 4"
run_train megatrain olmoe-4x2048 $o --batch-size 4
run_train megatrain olmoe-16x2048 $o --batch-size 16
echo "done $SECONDS s" >> $R/progress
JOB
echo "started" > $R/progress
setsid nohup bash $R/job.sh > $R/job.out 2>&1 &
sleep 2; cat $R/progress

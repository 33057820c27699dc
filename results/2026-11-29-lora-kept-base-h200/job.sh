#!/usr/bin/env bash
# GPU job 47 (session 47, one H200). Order: issue 35's LoRA speed with the kept base (decision
# 0054) against transformers + peft in one lease, the int8 / NF4 bases, the 70B shape, the
# real-size peft check (3.6B), the cc80 probe test three times, issue 34's ncu profile of the
# wgmma MoE GEMMs, issue 35's real fine-tune (SmolLM2-135M-Instruct, full vs LoRA; its GGUF
# arrives in four parts, copied to /tmp/ch by the polling calls). Progress in /tmp/r/progress.
set -u
NCCL_LIB=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
export PYTHONUNBUFFERED=1
B=/tmp/b; R=/tmp/r; W=/tmp/w; rm -rf $B $R $W; mkdir -p $B $R $W /tmp/ch
xz -dc .gpu/bin47.tar.xz | tar xf - -C $B; chmod +x $B/*
log() { echo "$* at $SECONDS s" >> $R/progress; }
(date; pwd; nvidia-smi; lscpu | head -20; free -g; df -h /tmp; cat .gpu/commit) > $R/env.txt 2>&1
log start
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw --format=csv -l 5 > $R/smi.csv 2>&1 &
t() { # name timeout command...
  local n=$1 to=$2; shift 2
  timeout $to "$@" > $R/$n.log 2>&1; local rc=$?
  log "$n rc=$rc $(grep -E '^test result|^step +[0-9]+ |rel err|^bench' $R/$n.log | tail -2 | tr '\n' ' ' | cut -c1-200)"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/peft-*.whl >> $R/pip.log 2>&1; log "pip rc=$?"
M=$B/megatrain
# 35: LoRA r 16, Llama-3-8B shape, bf16 base (random, from --config), ours vs transformers + peft
L="$M train --config bench-harness/configs/llama3-8b.json --device cuda --precision bf16 --data synthetic --seq-len 2048 --steps 6 --log-every 1 --lora-rank 16"
P="python3 scripts/baselines/peft_lora.py --config bench-harness/configs/llama3-8b.json --seq-len 2048 --steps 6 --lora-rank 16"
t lora-4 200 $L --batch-size 4 --metrics $R/lora-4.jsonl
PYTHONPATH=/tmp/site t peft-4 240 $P --batch-size 4 --metrics $R/peft-4.jsonl
t lora-16 240 $L --batch-size 16 --metrics $R/lora-16.jsonl
PYTHONPATH=/tmp/site t peft-16 300 $P --batch-size 16 --metrics $R/peft-16.jsonl
# 37: a job of two processes (one GPU each, started as torchrun starts them) against one process
# of two GPUs, and a process killed mid-run (only on a machine with two GPUs)
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  export NCCL_NVLS_ENABLE=0
  D="$M train --config bench-harness/configs/llama3-3.6b.json --device cuda --precision bf16 --data synthetic --seq-len 2048 --log-every 1 --lr 1e-4 --batch-size 8"
  t dp-one 300 $D --steps 6 --gpus 2 --metrics $R/dp-one.jsonl
  job() { # name steps: two processes in the background, their pids in /tmp/pid-NAME-RANK
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
        $D --steps $2 --gpus 1 --metrics $R/$1-$r.jsonl > $R/$1-$r.log 2>&1 &
      echo $! > /tmp/pid-$1-$r
    done
  }
  ends() { # pid seconds: waits for it at most that long (then kills it); prints its status
    for i in $(seq 1 $2); do kill -0 $1 2>/dev/null || break; sleep 1; done
    kill -9 $1 2>/dev/null; wait $1; echo $?
  }
  job dp-two 6
  log "dp-two rc $(ends $(cat /tmp/pid-dp-two-0) 300) $(ends $(cat /tmp/pid-dp-two-1) 30) $(grep -h '^step ' $R/dp-two-0.log | tail -1 | cut -c1-100) | $(grep -h '^step ' $R/dp-two-1.log | tail -1 | cut -c1-100)"
  job dp-kill 40
  for i in $(seq 1 180); do grep -q '^step  *3 ' $R/dp-kill-1.log 2>/dev/null && break; sleep 1; done
  kill -9 $(cat /tmp/pid-dp-kill-1); k=$SECONDS; rc=$(ends $(cat /tmp/pid-dp-kill-0) 120)
  echo "process 1 killed after step 3; process 0 ended with status $rc after $((SECONDS-k)) s" > $R/dp-kill.txt
  log "dp-kill $(cat $R/dp-kill.txt) | $(tail -1 $R/dp-kill-0.log | cut -c1-200)"
fi
# 35: the Llama-3-70B shape, r 16, int8 and NF4 bases in this machine's 128 GiB
X="$M train --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 --data synthetic --seq-len 2048 --log-every 1 --lora-rank 16"
$M estimate --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 --seq-len 2048 --lora-rank 16 --base-dtype int8 --batch-size 4 > $R/est-70b-int8-4.txt 2>&1
t l70-int8-4 420 $X --steps 4 --batch-size 4 --base-dtype int8 --metrics $R/l70-int8-4.jsonl
t l70-int8-16 420 $X --steps 3 --batch-size 16 --base-dtype int8 --metrics $R/l70-int8-16.jsonl
# 35: the real-size peft check: a 3.6B LoRA run's adapter through PeftModel vs its --merge export
S="$M train --model $W/b36 --device cuda --precision bf16 --data synthetic --seq-len 512 --batch-size 2 --steps 3 --lr 1e-3 --lora-rank 16"
t init-36 300 $M init --config bench-harness/configs/llama3-3.6b.json --out $W/b36
t lora36-ad 300 $S --out $W/ad36
t lora36-merged 300 $S --out $W/m36 --merge
PYTHONPATH=/tmp/site t peft-check-36 600 python3 scripts/check_lora_export.py $W/b36 $W/ad36 $W/m36
rm -rf $W/b36 $W/m36
# 35: the 8B streamed and on int8 / NF4 bases
t lora-4-streamed 200 $L --batch-size 4 --gpu-mem 12 --metrics $R/lora-4-streamed.jsonl
t lora-16-streamed 240 $L --batch-size 16 --gpu-mem 12 --metrics $R/lora-16-streamed.jsonl
t lora-16-int8 240 $L --batch-size 16 --base-dtype int8 --metrics $R/lora-16-int8.jsonl
t lora-16-nf4 240 $L --batch-size 16 --base-dtype nf4 --metrics $R/lora-16-nf4.jsonl
# 32/38: the probe test at compute_80, three times (an intermittent empty NVRTC log)
for i in 1 2 3; do MEGATRAIN_NVRTC_CC=80 t kt-probe-cc80-$i 120 $B/kt --test-threads 1 --nocapture compile_cubin; done
# 34: ncu of the wgmma MoE GEMMs at 32768 tokens (OLMoE shape), one launch of each kind
t moe-ncu 400 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
  -k regex:mt_moe_hgemm -c 8 -o $R/moe-ncu python3 scripts/moe_bench.py --out $R/moe-ncu.json --tokens 32768 --reps 1 --skip-loop --check-tokens ''
ncu -i $R/moe-ncu.ncu-rep --page details --csv > $R/moe-ncu-details.csv 2>&1; log "ncu details rc=$?"
ncu -i $R/moe-ncu.ncu-rep --page source --csv --print-source sass -k regex:wgrad > $R/moe-ncu-wgrad-sass.csv 2>&1; log "ncu sass rc=$?"
xz -T4 -6 $R/moe-ncu-wgrad-sass.csv; rm -f $R/moe-ncu.ncu-rep
# 35: a real fine-tune, SmolLM2-135M-Instruct: full vs LoRA on the chat set (parts of the GGUF in /tmp/ch)
for i in $(seq 1 120); do [ $(ls /tmp/ch/s.? 2>/dev/null | wc -l) -ge 4 ] && break; sleep 10; done
cat /tmp/ch/s.0 /tmp/ch/s.1 /tmp/ch/s.2 /tmp/ch/s.3 > $W/smol.gguf.xz; sha256sum $W/smol.gguf.xz > $R/smol-sha.txt; cat .gpu/smol.sha >> $R/smol-sha.txt
xz -dc $W/smol.gguf.xz > $W/smol.gguf; log "gguf rc=$?"
t smol-convert 300 python3 scripts/convert_gguf.py $W/smol.gguf $W/smol
python3 scripts/make_chat_data.py $W/chat > $R/chat.log 2>&1
F="$M train --model $W/smol --data $W/chat/train.jsonl --eval-data $W/chat/eval.jsonl --steps 300 --batch-size 8 --seq-len 256 --warmup 10 --device cuda --precision bf16 --eval-every 10"
t smol-full 300 $F --lr 2e-4 --out $W/smol-full --metrics $R/smol-full.jsonl
t smol-lora 300 $F --lr 1e-3 --lora-rank 16 --out $W/smol-lora --metrics $R/smol-lora.jsonl
t smol-lora-merged 300 $F --lr 1e-3 --lora-rank 16 --out $W/smol-lora-merged --merge
PYTHONPATH=/tmp/site t smol-peft-check 300 python3 scripts/check_lora_export.py $W/smol $W/smol-lora $W/smol-lora-merged
t smol-probes-full 300 python3 scripts/check_hf_model.py $W/smol-full --probes $W/chat/probes.jsonl
t smol-probes-lora 300 python3 scripts/check_hf_model.py $W/smol-lora-merged --probes $W/chat/probes.jsonl
t smol-probes-base 300 python3 scripts/check_hf_model.py $W/smol --probes $W/chat/probes.jsonl
cp $W/smol-lora/adapter_config.json $R/smol-adapter_config.json 2>/dev/null
log done

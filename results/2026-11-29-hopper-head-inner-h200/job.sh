#!/usr/bin/env bash
# GPU job 48, second machine (the first went back after the kernel bench and kt flash 4/4) (session 48, one H200), run from a copy in /tmp/gpu (the calls after the first carry
# other folders, so .gpu may vanish from the repository copy). Order: issue 32's kernel bench (the
# backward's head-inner walk, now the default, beside the old head-outer walk) and the GPU tests
# of the new walk; issue 35's 70B on int8 at 16 x 2048 and on NF4; the cc80 probe test x3; issue
# 35's real fine-tune (SmolLM2-135M-Instruct; its GGUF arrives in four parts in /tmp/ch); issue
# 34's ncu profile of the wgmma MoE GEMMs. Progress in /tmp/r/progress.
set -u
G=/tmp/gpu
NCCL_LIB=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
export PYTHONUNBUFFERED=1
B=/tmp/b; R=/tmp/r; W=/tmp/w; rm -rf $B $R $W; mkdir -p $B $R $W /tmp/ch
xz -dc $G/bin48.tar.xz | tar xf - -C $B; chmod +x $B/*
log() { echo "$* at $SECONDS s" >> $R/progress; }
(date; pwd; nvidia-smi; lscpu | head -20; free -g; df -h /tmp; cat $G/commit) > $R/env.txt 2>&1
log start
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw,clocks.sm --format=csv -l 5 > $R/smi.csv 2>&1 &
t() { # name timeout command...
  local n=$1 to=$2; shift 2
  timeout $to "$@" > $R/$n.log 2>&1; local rc=$?
  log "$n rc=$rc $(grep -E '^test result|^step +[0-9]+ |rel err|^bench|RSS|in use at most' $R/$n.log | tail -2 | tr '\n' ' ' | cut -c1-240)"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $G/peft-*.whl >> $R/pip.log 2>&1; log "pip rc=$?"
M=$B/megatrain
# 32: the kernels (default: head-inner walk; `outer`: the walk before), checks at 4k and 32k
t attention 400 python3 scripts/attention_bench.py --out $R/attention.json --ours hopper --sdpa cudnn \
  --hopper-variants outer:MT_HFA_BWD_HEAD_OUTER --seqs 16384,65536,131072 --check-seqs 4096,32768 --reps 5
# 35: the Llama-3-70B shape, r 16, int8 at 16 x 2048 and NF4 at 4 and 16 x 2048 in this machine's 128 GiB
X="$M train --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 --data synthetic --seq-len 2048 --log-every 1 --lora-rank 16"
for c in "int8 16" "nf4 4" "nf4 16"; do
  set -- $c
  $M estimate --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 --seq-len 2048 --lora-rank 16 --base-dtype $1 --batch-size $2 > $R/est-70b-$1-$2.txt 2>&1
  t l70-$1-$2 300 $X --steps 3 --batch-size $2 --base-dtype $1 --metrics $R/l70-$1-$2.jsonl
done
# 32/38: the probe test at compute_80, three times (an intermittent empty NVRTC log)
for i in 1 2 3; do MEGATRAIN_NVRTC_CC=80 t kt-probe-cc80-$i 120 $B/kt --test-threads 1 --nocapture compile_cubin; done
# 32: the GPU engine against the CPU engine with the new walk (test binaries in the second part)
for i in $(seq 1 60); do [ -f /tmp/ch/tests.tar.xz ] && break; sleep 5; done
xz -dc /tmp/ch/tests.tar.xz | tar xf - -C $B; chmod +x $B/*
t gpu 400 $B/gpu --test-threads 1
t gpu-long 400 $B/gpu_long_context --test-threads 1
# 35: a real fine-tune, SmolLM2-135M-Instruct: full vs LoRA on the chat set (parts of the GGUF in /tmp/ch)
for i in $(seq 1 120); do [ $(ls /tmp/ch/s.? 2>/dev/null | wc -l) -ge 4 ] && break; sleep 5; done
cat /tmp/ch/s.0 /tmp/ch/s.1 /tmp/ch/s.2 /tmp/ch/s.3 > $W/smol.gguf.xz; sha256sum $W/smol.gguf.xz > $R/smol-sha.txt; cat $G/smol.sha >> $R/smol-sha.txt
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
log smol-done
# 34: ncu of the wgmma MoE GEMMs at 32768 tokens (OLMoE shape), one launch of each kind
t moe-ncu 400 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
  -k regex:mt_moe_hgemm -c 8 -o $R/moe-ncu python3 scripts/moe_bench.py --out $R/moe-ncu.json --tokens 32768 --reps 1 --skip-loop --check-tokens ''
ncu -i $R/moe-ncu.ncu-rep --page details --csv > $R/moe-ncu-details.csv 2>&1; log "ncu details rc=$?"
ncu -i $R/moe-ncu.ncu-rep --page source --csv --print-source sass -k regex:wgrad > $R/moe-ncu-wgrad-sass.csv 2>&1; log "ncu sass rc=$?"
xz -T4 -6 $R/moe-ncu-wgrad-sass.csv; rm -f $R/moe-ncu.ncu-rep
log done

#!/usr/bin/env bash
# GPU job 49 (session 49, one H200), run from a copy in /tmp/gpu (later calls carry other folders).
# Order: issue 32's kernel bench at 16k and 64k with the early-release dQ variant beside the default
# and the old head-outer walk; issue 32's remainder profile (MT_PROFILE=1, the 7B at 1 x 131072);
# issue 35's 70B on int8 at 16 x 2048; the cc80 probe test x3 (NVRTC's retry); issue 35's peft
# re-check of the merge fix on SmolLM2-135M-Instruct (GGUF in four parts in /tmp/ch); issue 34's ncu
# of the wgmma MoE GEMMs; then, if time is left, the 70B on NF4 at 16 x 2048.
set -u
G=/tmp/gpu
NCCL_LIB=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
B=/tmp/b; R=/tmp/r; W=/tmp/w; rm -rf $B $R $W; mkdir -p $B $R $W /tmp/ch
xz -dc $G/bin49.tar.xz | tar xf - -C $B; chmod +x $B/*
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
# 32: the kernels at 16k and 64k: default, early dQ release, the old walk; checks at 4k
t attention 400 python3 scripts/attention_bench.py --out $R/attention.json --ours hopper --sdpa cudnn \
  --hopper-variants early:MT_HFA_DQ_RELEASE_EARLY,outer:MT_HFA_BWD_HEAD_OUTER --seqs 16384,65536 --check-seqs 4096 --reps 5
# 32: where a long step's time goes (sections synchronised; the totals, not the speed)
MT_PROFILE=1 t prof-7b-128k 300 $M train --config bench-harness/configs/qwen2.5-7b.json --device cuda --precision bf16 \
  --data synthetic --batch-size 1 --optim-mode lean --grad-dtype none --lr 1e-4 --log-every 1 --seq-len 131072 --steps 2 \
  --metrics $R/prof-7b-128k.jsonl
# 35: the Llama-3-70B shape, r 16, int8 base at 16 x 2048
X="$M train --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 --data synthetic --seq-len 2048 --log-every 1 --lora-rank 16"
$M estimate --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 --seq-len 2048 --lora-rank 16 --base-dtype int8 --batch-size 16 > $R/est-70b-int8-16.txt 2>&1
t l70-int8-16 540 $X --steps 3 --batch-size 16 --base-dtype int8 --metrics $R/l70-int8-16.jsonl
# 32/38: the probe test at compute_80, three times (NVRTC's intermittent empty log, now retried)
for i in 1 2 3; do MEGATRAIN_NVRTC_CC=80 t kt-probe-cc80-$i 120 $B/kt --test-threads 1 --nocapture compile_cubin; done
# 35: peft re-check of the merge fix on SmolLM2-135M-Instruct (parts of the GGUF in /tmp/ch)
for i in $(seq 1 120); do [ $(ls /tmp/ch/s.? 2>/dev/null | wc -l) -ge 4 ] && break; sleep 5; done
cat /tmp/ch/s.0 /tmp/ch/s.1 /tmp/ch/s.2 /tmp/ch/s.3 > $W/smol.gguf.xz; sha256sum $W/smol.gguf.xz > $R/smol-sha.txt; cat $G/smol.sha >> $R/smol-sha.txt
xz -dc $W/smol.gguf.xz > $W/smol.gguf; log "gguf rc=$?"
t smol-convert 300 python3 scripts/convert_gguf.py $W/smol.gguf $W/smol
python3 scripts/make_chat_data.py $W/chat > $R/chat.log 2>&1
F="$M train --model $W/smol --data $W/chat/train.jsonl --steps 50 --batch-size 8 --seq-len 256 --warmup 10 --device cuda --precision bf16 --lr 1e-3 --lora-rank 16"
t smol-lora 300 $F --out $W/smol-lora --metrics $R/smol-lora.jsonl
t smol-lora-merged 300 $F --out $W/smol-lora-merged --merge
PYTHONPATH=/tmp/site t smol-peft-check 300 python3 scripts/check_lora_export.py $W/smol $W/smol-lora $W/smol-lora-merged
log smol-done
# 34: ncu of the wgmma MoE GEMMs at 32768 tokens (OLMoE shape)
t moe-ncu 400 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
  -k regex:mt_moe_hgemm -c 8 -o $R/moe-ncu python3 scripts/moe_bench.py --out $R/moe-ncu.json --tokens 32768 --reps 1 --skip-loop --check-tokens '' --variants wgmma
ncu -i $R/moe-ncu.ncu-rep --page details --csv > $R/moe-ncu-details.csv 2>&1; log "ncu details rc=$?"
rm -f $R/moe-ncu.ncu-rep
# 35: NF4 base at 16 x 2048, if the lease lasts
$M estimate --config bench-harness/configs/llama3-70b.json --device cuda --precision bf16 --seq-len 2048 --lora-rank 16 --base-dtype nf4 --batch-size 16 > $R/est-70b-nf4-16.txt 2>&1
t l70-nf4-16 540 $X --steps 3 --batch-size 16 --base-dtype nf4 --metrics $R/l70-nf4-16.jsonl
log done

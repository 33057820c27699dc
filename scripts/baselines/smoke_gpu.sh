#!/usr/bin/env bash
# Smoke test of both baselines on the GPU machine (run from anywhere; needs .whl/, see README.md):
# installs the wheels into /tmp/site, trains a tiny Llama for 3 steps with each baseline (micro-batch
# 2 of batch 4, so gradient accumulation is exercised) and checks the metrics logs.
#
#   scripts/baselines/smoke_gpu.sh [OUT_DIR]        (default /tmp/baselines-smoke)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-/tmp/baselines-smoke}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

cat >"$OUT/tiny-llama.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
 "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 256,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "hidden_act": "silu"}
EOF

for s in resident_torch deepspeed_zero3; do
  rm -f "$OUT/$s.jsonl"
  python3 "$HERE/$s.py" --config "$OUT/tiny-llama.json" --batch-size 4 --micro-batch 2 --seq-len 64 \
    --steps 3 --metrics "$OUT/$s.jsonl" >"$OUT/$s.log" 2>&1 || { tail -40 "$OUT/$s.log"; exit 1; }
done

python3 - "$OUT" <<'EOF'
import json, math, sys
out = sys.argv[1]
for s, system in (("resident_torch", "torch_resident"), ("deepspeed_zero3", "deepspeed_zero3_offload")):
    recs = [json.loads(l) for l in open(f"{out}/{s}.jsonl")]
    run, steps = recs[0], [r for r in recs if r["type"] == "step"]
    assert run["type"] == "run" and run["system"] == system, run
    assert len(steps) == 3 and [r["step"] for r in steps] == [1, 2, 3], steps
    assert all(math.isfinite(r["loss"]) and r["step_ms"] > 0 and r["gpu_peak_bytes"] for r in steps), steps
    print(f"{s}: ok, n_params {run['n_params']}, losses {[round(r['loss'], 4) for r in steps]}")
print("2 passed, 0 failed")
EOF

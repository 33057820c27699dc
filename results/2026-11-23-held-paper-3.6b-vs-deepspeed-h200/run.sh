#!/usr/bin/env bash
# H200 call (16 cores, 128 GiB), build d62e888 (held layers and kept activations by default; GPU tests first): the 3.6B Llama-3 shape at 16x2048 and 4x2048 in one harness run:
# ours (planner's placement), ours with every decoder layer streamed, resident PyTorch, DeepSpeed ZeRO-3 offload.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MT_COMMIT=${MT_COMMIT:-d62e888}
mkdir -p /tmp/b && for f in megatrain bench-harness; do xz -dc .gpu/bin11/$f.xz > /tmp/b/$f; done; chmod +x /tmp/b/*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
R=$OUT/r; mkdir -p $R; rm -rf /tmp/p36
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
xz -dc .gpu/bin11/gpu-test.xz > /tmp/b/gpu-test && chmod +x /tmp/b/gpu-test
MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden timeout 100 /tmp/b/gpu-test --test-threads 1 > $R/gpu-test.log 2>&1; echo "gpu-test rc=$? at $SECONDS s"; grep -E "test result|panicked" $R/gpu-test.log
timeout $((${LIMIT:-585} - SECONDS)) /tmp/b/bench-harness --megatrain /tmp/b/megatrain --suite paper --models 3.6b \
  --systems ours,torch,deepspeed --ours-streamed --tokens ${TOK:-16x2048,4x2048} --depths 0 --slices 0 --steps 4 --run-timeout-s 200 \
  --python python3 --out /tmp/p36 2>&1 | tee $R/paper.log | grep -E "^\[|ok:|Failed|wrote|rror"
tar czf $OUT/paper-3.6b.tgz -C /tmp/p36 .
grep -hE "resident|steady|host RSS|streams|initialised|engine ready|trained" /tmp/p36/logs/*ours*.log 2>/dev/null
echo "wall $SECONDS s"

#!/usr/bin/env bash
# H200 call, build da0e32e (engine of HEAD 40bafeb, which only refactors argument checks): the ablate suite on the
# 3.6B at 4x2048, every decoder layer streamed (ring depth 1/2/3, optimizer overlap off, chunks 1/2/4).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export MT_COMMIT=${MT_COMMIT:-da0e32e}
mkdir -p /tmp/b && for f in megatrain bench-harness; do xz -dc .gpu/bin6/$f.xz > /tmp/b/$f; done; chmod +x /tmp/b/*
R=$OUT/r; mkdir -p $R; rm -rf /tmp/ablate
(date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g) > $R/env.txt
timeout 540 /tmp/b/bench-harness --megatrain /tmp/b/megatrain --suite ablate --models 3.6b --tokens 4x2048 --steps 5 \
  --run-timeout-s 120 --out /tmp/ablate 2>&1 | tee $R/ablate.log | grep -E "^\[|ok:|Failed|wrote|rror|skip"
tar czf $OUT/ablate-3.6b.tgz -C /tmp/ablate .
echo "wall $SECONDS s"

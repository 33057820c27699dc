#!/usr/bin/env bash
# Type-checks and lints the `cuda` feature without a GPU (CI runs it after scripts/test.sh):
# installs the pinned CUDA 13.0 toolchain (scripts/cuda-toolchain.sh, idempotent) and runs
# clippy with warnings as errors over every crate the feature touches. Nothing is executed on a
# GPU here; the GPU tests run on the GPU machine (README "The GPU build").
# Cost on a cold 2-core machine: ~1 min install + ~13 min (candle-kernels' CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/cuda-toolchain.sh
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh

echo "== cargo clippy --features nccl (implies cuda; warnings are errors)"
# nccl covers the cuda code and the data-parallel code over NCCL; clippy links nothing, so no
# libnccl is needed here (the CPU build covers the code compiled without nccl).
cargo clippy --workspace --all-targets --locked --features megatrain/nccl,mt-sched/nccl -- -D warnings

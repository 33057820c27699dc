#!/usr/bin/env bash
# Builds and runs the CPU emulator check of kernels/cuda/adamw.cu's bf16 and 8-bit moment kernels
# against mt-optim's host update (needs g++ with C++20). No FMA contraction, as NVRTC's
# --fmad=false and Rust.
set -euo pipefail
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/mt_adamw_check
g++ -std=c++20 -O2 -ffp-contract=off -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas -o "$out" adamw_check.cpp
"$out"

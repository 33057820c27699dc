#!/usr/bin/env bash
# Builds and runs the CPU emulator check of kernels/cuda/base.cu's dequantisation kernels against
# mt-store's reference decoding (needs g++ with C++20). No FMA contraction, as NVRTC's
# --fmad=false and Rust.
set -euo pipefail
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/mt_base_check
g++ -std=c++20 -O2 -ffp-contract=off -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas -o "$out" base_check.cpp
"$out"

#!/usr/bin/env bash
# Builds and runs the CPU emulator check of kernels/cuda/moe.cu (needs g++ with C++20).
set -euo pipefail
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/mt_moe_check
g++ -std=c++20 -O2 -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas -o "$out" moe_check.cpp
"$out"

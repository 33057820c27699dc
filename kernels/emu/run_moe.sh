#!/usr/bin/env bash
# Builds and runs the CPU emulator check of kernels/cuda/moe.cu (needs g++ with C++20). Extra
# arguments are compiler flags: a GEMM variant's defines, e.g.
#   kernels/emu/run_moe.sh -DMT_MOE_BK=64 -DMT_MOE_HOIST=1
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp "${TMPDIR:-/tmp}/mt_moe_check.XXXXXX")
trap 'rm -f "$out"' EXIT
g++ -std=c++20 -O2 -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas "$@" -o "$out" moe_check.cpp
"$out"

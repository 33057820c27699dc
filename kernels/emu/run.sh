#!/usr/bin/env bash
# Builds and runs the CPU emulator check of kernels/cuda/flash_attn.cu and flash_attn_hopper.cu
# (needs g++ with C++20). An argument "portable" or "hopper" runs only those kernels' cases;
# EMU_DEFINES="-DMT_HFA_BWD_DQ_MID ..." checks a variant of the kernels.
set -euo pipefail
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/mt_flash_check
g++ -std=c++20 -O2 ${EMU_DEFINES:-} -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas -o "$out" flash_check.cpp
"$out" "$@"

# shellcheck shell=bash
# Environment for building with the `cuda` feature, using the toolchain that
# scripts/cuda-toolchain.sh installed. Source it (bash), do not run it:
#
#   source scripts/cuda-env.sh && cargo build --release --features cuda
#
# Toolchain location: $MEGATRAIN_CUDA_PREFIX, default <repo>/.venv-cuda.
# Exports PATH (nvcc), CUDA_ROOT/CUDA_PATH/CUDA_HOME (found by cudarc's and candle-kernels' build
# scripts), CUDA_COMPUTE_CAP (default 80: candle's kernels as PTX for compute_80, which the driver
# compiles for any GPU of compute capability 8.0 or later, so one binary runs on A100, RTX 30xx,
# RTX 40xx / L40S and H100 / H200; 90 builds `sm_90a` PTX that loads on Hopper only:
# docs/decisions/0034-gpu-portability.md) and
# LIBRARY_PATH (link-time libcuda/libcudart/libcublas/libcublasLt/libcurand/libnvrtc).
# LD_LIBRARY_PATH is left alone: binaries run on the GPU machine against its own CUDA libraries.
# Returns 1 with a message, changing nothing, when the toolchain is not installed.

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    echo "cuda-env.sh: source this file (source scripts/cuda-env.sh), do not execute it" >&2
    exit 1
fi

_mt_cuda_env() {
    local root prefix cu13 dirs
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    prefix=${MEGATRAIN_CUDA_PREFIX:-$root/.venv-cuda}
    [[ $prefix == /* ]] || prefix=$PWD/$prefix
    if [[ ! -f $prefix/.cuda-toolchain.stamp ]]; then
        echo "cuda-env.sh: no CUDA toolchain in $prefix; run: scripts/cuda-toolchain.sh${MEGATRAIN_CUDA_PREFIX:+ $prefix}" >&2
        return 1
    fi
    dirs=("$prefix"/lib/python3*/site-packages/nvidia/cu13)
    cu13=${dirs[0]}
    if [[ ${#dirs[@]} -ne 1 || ! -x $cu13/bin/nvcc || ! -e $cu13/lib/libcuda.so ]]; then
        echo "cuda-env.sh: the CUDA toolchain in $prefix is incomplete; rerun scripts/cuda-toolchain.sh" >&2
        return 1
    fi
    case ":$PATH:" in
        *":$cu13/bin:"*) ;;
        *) export PATH="$cu13/bin:$PATH" ;;
    esac
    case ":${LIBRARY_PATH:-}:" in
        *":$cu13/lib:"*) ;;
        *) export LIBRARY_PATH="$cu13/lib${LIBRARY_PATH:+:$LIBRARY_PATH}" ;;
    esac
    export CUDA_ROOT="$cu13" CUDA_PATH="$cu13" CUDA_HOME="$cu13"
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
}

_mt_cuda_env_rc=0
_mt_cuda_env || _mt_cuda_env_rc=$?
unset -f _mt_cuda_env
if [[ $_mt_cuda_env_rc -ne 0 ]]; then
    unset _mt_cuda_env_rc
    return 1
fi
unset _mt_cuda_env_rc

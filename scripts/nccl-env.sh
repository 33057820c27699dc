# shellcheck shell=bash
# Environment for building and running with the `nccl` feature (`megatrain train --gpus N`).
# Source it (bash) after scripts/cuda-env.sh, do not run it:
#
#   source scripts/cuda-env.sh && source scripts/nccl-env.sh
#   cargo build --release -p megatrain --features megatrain/nccl
#
# cudarc links libnccl (its `dynamic-linking`): the build needs `libnccl.so` on LIBRARY_PATH and
# the binary needs `libnccl.so.2` on LD_LIBRARY_PATH where it runs. NCCL comes from NVIDIA's
# nvidia-nccl-cu13 wheel: here it is installed (pip --target) into $MEGATRAIN_NCCL_PREFIX (default
# <repo>/.venv-nccl) when missing, and a `libnccl.so` link to its `libnccl.so.2` is made beside it.
# On a GPU machine with PyTorch, point MEGATRAIN_NCCL_PREFIX at the site-packages folder holding
# nvidia/nccl (e.g. /opt/torch/.venv/lib/python3.12/site-packages): nothing is installed then.
# Returns 1 with a message when it cannot find or install NCCL.

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    echo "nccl-env.sh: source this file (source scripts/nccl-env.sh), do not execute it" >&2
    exit 1
fi

_mt_nccl_env() {
    local root prefix lib
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    prefix=${MEGATRAIN_NCCL_PREFIX:-$root/.venv-nccl}
    lib=$prefix/nvidia/nccl/lib
    if [[ ! -e $lib/libnccl.so.2 ]]; then
        if [[ -n ${MEGATRAIN_NCCL_PREFIX:-} ]]; then
            echo "nccl-env.sh: no nvidia/nccl/lib/libnccl.so.2 under $prefix" >&2
            return 1
        fi
        echo "nccl-env.sh: installing nvidia-nccl-cu13 into $prefix" >&2
        python3 -m pip install --disable-pip-version-check --no-input -q --target "$prefix" nvidia-nccl-cu13 ||
            { echo "nccl-env.sh: pip install nvidia-nccl-cu13 failed" >&2; return 1; }
    fi
    # The linker's -lnccl wants the unversioned name; the wheel ships only the soname.
    if [[ ! -e $lib/libnccl.so && -w $lib ]]; then
        ln -s libnccl.so.2 "$lib/libnccl.so"
    fi
    export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
_mt_nccl_env

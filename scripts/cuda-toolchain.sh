#!/usr/bin/env bash
# Installs the CUDA 13.0 *build* toolchain (nvcc, headers, link-time libraries) that
# `cargo check/build --features cuda` needs, on a machine without a GPU (development machine, CI).
#
#   scripts/cuda-toolchain.sh [PREFIX]      # default PREFIX: $MEGATRAIN_CUDA_PREFIX or <repo>/.venv-cuda
#   source scripts/cuda-env.sh              # then: cargo build --release --features cuda
#
# What it does (checked end to end for candle-core 0.11.1 / cudarc 0.19):
#   1. pip-installs NVIDIA's CUDA 13.0 wheels, pinned by version and sha256, into a venv at PREFIX.
#      Everything lands in <site-packages>/nvidia/cu13/{bin,include,lib,nvvm}.
#      13.0 on purpose: the GPU machines run driver 580 (CUDA 13.0), which rejects PTX newer than
#      `.version 9.0`; nvidia-nvvm must be pinned too, or nvcc 13.0 pulls a newer NVVM.
#   2. Makes the unversioned `libX.so` links the linker needs (the wheels ship `libX.so.13` only).
#   3. Installs Debian's `libcuda1` (non-free) to link against; at run time the GPU machine's own
#      driver is used. Only step needing root (or sudo); skipped when libcuda.so.1 is already there.
#   4. Compiles a tiny kernel to PTX and to an object, then writes a stamp. A second run with the
#      same pins only checks the stamp and exits.
# Needs: x86_64 Linux, python3 with venv/ensurepip (Debian: python3-venv), g++ (nvcc's host compiler).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${1:-${MEGATRAIN_CUDA_PREFIX:-$ROOT/.venv-cuda}}
[[ $PREFIX == /* ]] || PREFIX=$PWD/$PREFIX

say() { printf 'cuda-toolchain: %s\n' "$*"; }
die() {
    printf 'cuda-toolchain: error: %s\n' "$*" >&2
    exit 1
}

# Exact CUDA 13.0 (Update 2) wheels. `--no-deps` with this complete list: the resolver would
# otherwise be free to pick a newer nvidia-nvvm for nvidia-cuda-nvcc. Hashes: x86_64 wheels on PyPI.
REQUIREMENTS='nvidia-cuda-nvcc==13.0.88 --hash=sha256:56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03
nvidia-nvvm==13.0.88 --hash=sha256:c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0
nvidia-cuda-crt==13.0.88 --hash=sha256:2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4
nvidia-cuda-runtime==13.0.96 --hash=sha256:7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548
nvidia-cuda-cccl==13.0.85 --hash=sha256:e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649
nvidia-cuda-nvrtc==13.0.88 --hash=sha256:ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575
nvidia-cublas==13.0.2.14 --hash=sha256:0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c
nvidia-curand==10.4.0.35 --hash=sha256:1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc'
# Libraries linked by name (-lX) in a candle `cuda` build: cudarc (driver, nvrtc, curand, cublas,
# cublaslt) and candle-kernels' static MoE library (cudart). libcuda comes from the system.
LINK_LIBS='cudart cublas cublasLt curand nvrtc'
EXPECT_NVCC_RELEASE='13.0'
EXPECT_PTX_VERSION='9.0'
STAMP_FORMAT=1

STAMP="$PREFIX/.cuda-toolchain.stamp"
expected_stamp() {
    printf 'format %s\nlibcuda1 (Debian non-free)\n%s\n' "$STAMP_FORMAT" "$REQUIREMENTS"
}

# The one nvidia/cu13 directory of the venv (empty when there is none yet).
find_cu13() {
    local dirs=("$PREFIX"/lib/python3*/site-packages/nvidia/cu13)
    [[ ${#dirs[@]} -eq 1 && -d ${dirs[0]} ]] && printf '%s\n' "${dirs[0]}"
    return 0
}

# --- fast path: already installed with these pins ---------------------------------------------
if [[ -f $STAMP ]] && [[ "$(cat "$STAMP")" == "$(expected_stamp)" ]]; then
    cu13=$(find_cu13)
    if [[ -n $cu13 && -x $cu13/bin/nvcc && -e $cu13/lib/libcuda.so ]]; then
        say "CUDA $EXPECT_NVCC_RELEASE toolchain already installed in $PREFIX (stamp matches); nothing to do."
        exit 0
    fi
    say "stamp matches but files are missing; reinstalling"
fi

# --- preconditions -----------------------------------------------------------------------------
[[ "$(uname -s)/$(uname -m)" == Linux/x86_64 ]] ||
    die "only x86_64 Linux is supported (the pinned wheels are x86_64); this is $(uname -s)/$(uname -m)"
command -v python3 >/dev/null || die "python3 not found (Debian: apt-get install python3 python3-venv)"
command -v g++ >/dev/null ||
    die "g++ not found; nvcc needs it as host compiler and candle links libstdc++ (Debian: apt-get install g++)"

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then SUDO=(sudo); fi
fi

# --- 1. libcuda.so.1 to link against (Debian libcuda1, non-free) --------------------------------
find_libcuda() {
    local f
    for f in /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 /usr/local/cuda/lib64/stubs/libcuda.so; do
        if [[ -e $f ]]; then
            printf '%s\n' "$f"
            return 0
        fi
    done
    return 0
}

# Adds `contrib non-free` to the Debian sources (deb822 `Components:` lines or one-line `deb`
# entries) where missing, keeping whatever mirror is configured.
enable_non_free() {
    local f changed=0
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        grep -q '^Components:' "$f" || continue
        if grep '^Components:' "$f" | grep -qv -w 'non-free'; then
            "${SUDO[@]}" sed -i -E '/^Components:/{/[[:space:]]contrib([[:space:]]|$)/!s/$/ contrib/}' "$f"
            "${SUDO[@]}" sed -i -E '/^Components:/{/[[:space:]]non-free([[:space:]]|$)/!s/$/ non-free/}' "$f"
            say "enabled contrib non-free in $f"
            changed=1
        fi
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        if grep -E '^deb[[:space:]]' "$f" | grep -qv -w 'non-free'; then
            "${SUDO[@]}" sed -i -E '/^deb[[:space:]]/{/[[:space:]]contrib([[:space:]]|$)/!s/$/ contrib/}' "$f"
            "${SUDO[@]}" sed -i -E '/^deb[[:space:]]/{/[[:space:]]non-free([[:space:]]|$)/!s/$/ non-free/}' "$f"
            say "enabled contrib non-free in $f"
            changed=1
        fi
    done
    [[ $changed -eq 1 ]] || say "contrib/non-free already enabled"
}

libcuda=$(find_libcuda)
if [[ -z $libcuda ]]; then
    command -v apt-get >/dev/null ||
        die "libcuda.so.1 not found and apt-get is missing; install the NVIDIA driver library (libcuda) by hand"
    [[ $(id -u) -eq 0 || ${#SUDO[@]} -gt 0 ]] ||
        die "libcuda.so.1 not found; installing Debian's libcuda1 needs root (or sudo): run this script as root once"
    say "installing libcuda1 from Debian non-free (link-time only; the GPU machine uses its own driver)"
    enable_non_free
    "${SUDO[@]}" apt-get update -q || die "apt-get update failed"
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libcuda1 ||
        die "apt-get install libcuda1 failed (is non-free reachable on the configured Debian mirror?)"
    libcuda=$(find_libcuda)
    [[ -n $libcuda ]] || die "libcuda1 is installed but libcuda.so.1 was not found in /usr/lib/x86_64-linux-gnu"
fi
say "libcuda for linking: $libcuda"

# --- 2. venv with the pinned wheels --------------------------------------------------------------
if [[ ! -x $PREFIX/bin/python ]]; then
    say "creating venv $PREFIX"
    python3 -m venv "$PREFIX" ||
        die "python3 -m venv failed (Debian: apt-get install python3-venv), or remove a broken $PREFIX"
fi
req_file=$(mktemp)
trap 'rm -f "$req_file"' EXIT
printf '%s\n' "$REQUIREMENTS" >"$req_file"
say "installing pinned CUDA 13.0 wheels into $PREFIX (about 1 GB on disk)"
"$PREFIX/bin/python" -m pip install --disable-pip-version-check --no-input -q --no-cache-dir \
    --no-deps --require-hashes --only-binary=:all: -r "$req_file" ||
    die "pip install of the pinned CUDA wheels failed (PyPI reachable? disk space?)"
"$PREFIX/bin/python" -m pip check --disable-pip-version-check >/dev/null ||
    die "pip check failed in $PREFIX: $("$PREFIX/bin/python" -m pip check 2>&1 | head -5)"

cu13=$(find_cu13)
[[ -n $cu13 ]] || die "expected exactly one nvidia/cu13 directory under $PREFIX/lib/python3*/site-packages"
for f in bin/nvcc bin/ptxas bin/fatbinary include/cuda_runtime.h include/cublas_v2.h include/curand.h; do
    [[ -e $cu13/$f ]] || die "$cu13/$f is missing after install"
done

# --- 3. unversioned link names -----------------------------------------------------------------
for name in $LINK_LIBS; do
    versioned=''  # the shortest lib$name.so.* (the soname, e.g. libcublas.so.13)
    for f in "$cu13/lib/lib$name.so."*; do
        [[ -e $f ]] || continue
        f=${f##*/}
        if [[ -z $versioned || ${#f} -lt ${#versioned} ]]; then versioned=$f; fi
    done
    [[ -n $versioned ]] || die "no lib$name.so.* in $cu13/lib"
    ln -sfn "$versioned" "$cu13/lib/lib$name.so"
done
ln -sfn "$libcuda" "$cu13/lib/libcuda.so"

# --- 4. self-test: nvcc release, PTX ISA version, object code ------------------------------------
release=$("$cu13/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\),.*/\1/p')
[[ $release == "$EXPECT_NVCC_RELEASE" ]] || die "nvcc reports release '$release', expected $EXPECT_NVCC_RELEASE"
work=$(mktemp -d)
trap 'rm -f "$req_file"; rm -rf "$work"' EXIT
cat >"$work/k.cu" <<'EOF'
#include <cuda_bf16.h>
extern "C" __global__ void axpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
EOF
PATH="$cu13/bin:$PATH" "$cu13/bin/nvcc" -arch=sm_90 --ptx -o "$work/k.ptx" "$work/k.cu" ||
    die "nvcc could not compile a test kernel to PTX"
ptx_version=$(sed -n 's/^\.version \([0-9.]*\).*/\1/p' "$work/k.ptx")
[[ $ptx_version == "$EXPECT_PTX_VERSION" ]] ||
    die "nvcc emits PTX .version $ptx_version, expected $EXPECT_PTX_VERSION (wrong nvidia-nvvm?)"
PATH="$cu13/bin:$PATH" "$cu13/bin/nvcc" -gencode arch=compute_90,code=sm_90 -Xcompiler -fPIC -c \
    -o "$work/k.o" "$work/k.cu" || die "nvcc could not compile a test kernel to an object (ptxas/g++?)"
say "self-test ok: nvcc $release, PTX .version $ptx_version, sm_90 object code"

expected_stamp >"$STAMP"
say "done. CUDA $EXPECT_NVCC_RELEASE toolchain in $cu13"
env_prefix=''
[[ $PREFIX == "$ROOT/.venv-cuda" ]] || env_prefix="MEGATRAIN_CUDA_PREFIX=$PREFIX "
say "use it with: ${env_prefix}source scripts/cuda-env.sh && cargo build --release --features cuda"

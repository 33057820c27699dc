#!/usr/bin/env bash
# Rebuilds the wheel directory (default: <repo>/.whl, git-ignored) that deepspeed_zero3.py needs on
# the GPU machine, which has torch 2.11 + transformers + accelerate but no DeepSpeed and no network.
# Run it on a development machine that reaches PyPI (any Python 3 with venv; no torch, no GPU).
#
#   scripts/baselines/make_wheels.sh [OUT_DIR]
#
# - deepspeed: built from the sdist as a pure-Python wheel (DS_BUILD_OPS=0: no ops precompiled;
#   cpu_adam is JIT-compiled on the GPU machine on first use, about a minute, with its nvcc/ninja).
# - Its requirements that the GPU image lacks (its Requires-Dist checked against the image's
#   package list in the device notes, "Python packages already there"): hjson and pydantic 2.x,
#   and pydantic's own: pydantic-core (binary, cp312 manylinux x86_64: the GPU machine's python3
#   is 3.12), annotated-types, typing-inspection, typing-extensions (pydantic 2.14 needs >= 4.16;
#   carried because the image's may be older; newer versions only add to the module).
#   einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, torch, tqdm (and nvidia-ml-py)
#   are in the image.
# Versions are pinned so the directory is reproducible; they are mutually compatible (pydantic
# 2.14.3 pins pydantic-core 2.50.4 and needs annotated-types >= 0.6, typing-inspection >= 0.4.4,
# typing-extensions >= 4.16).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${1:-$ROOT/.whl}
PY=${PYTHON:-python3}

DEEPSPEED=0.19.8
PINS=(
  hjson==3.1.0
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== deepspeed $DEEPSPEED: sdist -> pure-Python wheel (DS_BUILD_OPS=0)"
"$PY" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check wheel setuptools
"$work/venv/bin/pip" download -q --disable-pip-version-check --no-binary=:all: --no-deps \
  "deepspeed==$DEEPSPEED" -d "$work/sdist"
tar -xzf "$work/sdist/deepspeed-$DEEPSPEED.tar.gz" -C "$work"
(
  cd "$work/deepspeed-$DEEPSPEED"
  DS_BUILD_OPS=0 "$work/venv/bin/python" setup.py -q bdist_wheel -d "$work/dist" >"$work/build.log" 2>&1 \
    || { tail -50 "$work/build.log"; exit 1; }
)

echo "== dependencies (cp312, manylinux x86_64 binaries)"
"$work/venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/dist" "${PINS[@]}"

mkdir -p "$OUT"
rm -f "$OUT"/*.whl
cp "$work"/dist/*.whl "$OUT"/

# The wheel must carry no compiled op and must not ask for anything beyond the image + this dir.
ds_whl=$(ls "$OUT"/deepspeed-"$DEEPSPEED"-py3-none-any.whl)
if unzip -l "$ds_whl" | grep -E '\.so$' >/dev/null; then
  echo "error: $ds_whl contains compiled objects" >&2
  exit 1
fi
echo "== deepspeed Requires-Dist"
unzip -p "$ds_whl" "deepspeed-$DEEPSPEED.dist-info/METADATA" | grep '^Requires-Dist' | grep -v 'extra ==' || true

echo "== $OUT"
ls -l "$OUT"
du -ch "$OUT"/*.whl | tail -1

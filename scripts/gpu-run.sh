#!/usr/bin/env bash
# One run on a GPU machine, parameterised: the environment the machine needs (its CUDA and NCCL
# libraries), the release binaries unpacked, the machine recorded (env.txt), then each STEP in
# order, every log under $OUT/r and packed into $OUT/r.tgz at the end. It replaces the per-run
# copies that used to sit in results/*/run*.sh and scripts/gpu-runs/; results/README.md says
# which steps made each results folder.
#
#   scripts/gpu-run.sh STEP...
#   DETACH=1 scripts/gpu-run.sh STEP...   the same, detached from the call (a run longer than one
#                                         command may take); progress lines in $OUT/r/progress
#   scripts/gpu-run.sh --poll SECONDS     waits up to SECONDS for a detached run to finish, prints
#                                         its progress and packs $OUT/r.tgz
#
# A STEP is one argument (quote it), fields separated by `:` (the last field takes the rest):
#   test:BINARY[:FILTER]        a test binary of $BIN (e.g. `test:gpu-test`, `test:kernels-test:flash`),
#                               one thread, --nocapture, MT_GOLDEN_DIR set; log BINARY.log
#   train:NAME:TIMEOUT:ARGS     `megatrain train --device cuda --metrics NAME.jsonl $COMMON ARGS`, log
#                               NAME.log (ARGS word-split)
#   estimate:NAME:ARGS          `megatrain estimate ARGS`, log NAME.log
#   harness:NAME:TIMEOUT:ARGS   `bench-harness --megatrain <it> ARGS --out $OUT/NAME` (its results.json,
#                               logs, metrics and figures), log NAME.log
#   with:VAR=VALUE:STEP         STEP with VAR set (e.g. `with:MEGATRAIN_NVRTC_CC=80:test:gpu-test`)
#   cmd:NAME:TIMEOUT:COMMAND    COMMAND by bash -c (the scripts' benches, a profiler), with $BINS the
#                               unpacked binaries and $R this run's output folder; log NAME.log
#                               (single-quoted, so that $R reaches it: 'cmd:attn:400:python3
#                               scripts/attention_bench.py --out $R/a.json')
#
# Environment:
#   BIN     directory of the binaries, as built for the GPU machine and compressed with xz
#           (megatrain, bench-harness, test binaries) [default: .gpu/bin]
#   OUT     output directory [default: /tmp/out]
#   COMMON  arguments given to every train step [default: none]
#   LIMIT   seconds the whole run may take; a step starts only if its timeout fits [default: 580]
#   MT_COMMIT  the commit the binaries were built from (recorded in env.txt and the harness's results)
#   WHEELS  directory of Python wheels the baselines need (DeepSpeed, transformers), installed
#           into /tmp/site for the harness [default: .whl, if it exists]
#
# An interleaved A/B lists its steps in turn (`train:a-1:...` `train:b-1:...` `train:a-2:...`).
#
# Example (the 3.6B at 4 x 2048 with flash and materialised attention, after the GPU tests):
#   COMMON="--config bench-harness/configs/llama3-3.6b.json --precision bf16 --data synthetic \
#     --seq-len 2048 --steps 6 --log-every 1" scripts/gpu-run.sh test:gpu-test \
#     'train:flash:100:--batch-size 4 --attention flash' 'train:mat:100:--batch-size 4 --attention materialized'
set -u

BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-580}
R=$OUT/r
B=/tmp/gpu-run-bin

if [[ ${1:-} == --poll ]]; then
    for _ in $(seq 1 $(( ${2:-500} / 10 ))); do
        grep -q "^done" "$R/progress" 2>/dev/null && break
        sleep 10
    done
    cat "$R/progress" 2>/dev/null
    tar czf "$OUT/r.tgz" -C "$OUT" r
    exit 0
fi
if [[ ${DETACH:-0} == 1 ]]; then
    mkdir -p "$R"
    echo "started $(date +%T)" > "$R/progress"
    DETACH=0 setsid nohup "$0" "$@" >> "$R/progress" 2>&1 < /dev/null &
    echo "detached; poll with: OUT=$OUT $0 --poll SECONDS"
    exit 0
fi
mkdir -p "$R" "$B"

# The machine's CUDA libraries (the toolkit's and those of the PyTorch the baselines use), and
# NCCL's where there is one (NVLink multicast off: docs/decisions/0035).
NCCL_LIB=$(dirname "$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MT_GOLDEN_DIR=$PWD/crates/testkit/fixtures/golden
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

for f in "$BIN"/*.xz; do
    [[ -e $f ]] || { echo "no binaries in $BIN (xz-compressed)" >&2; exit 1; }
    xz -dc "$f" > "$B/$(basename "$f" .xz)"
done
chmod +x "$B"/*
{
    date; hostname; echo "commit: ${MT_COMMIT:-unknown}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader
    nproc; free -g; lscpu | grep -E "Model name|NUMA node\(s\)|MHz"; echo "libnccl: ${NCCL_LIB:-none}"
} > "$R/env.txt" 2>&1

# The lines of a log worth reading in the call's output.
summary() {
    grep -E "^test .*(ok|FAILED)$|test result|SUMMARY|^step:|steady|loss:|in use at most|host RSS|^\[|ok:|wrote|rror|panick|^bench |FAILED" "$1" \
        | cut -c1-250 | tail -40
}

fits() { # timeout
    if (( SECONDS + $1 > LIMIT )); then
        echo "skipped: $1 s would pass LIMIT=$LIMIT at $SECONDS s"
        return 1
    fi
}

step() { # STEP
    local kind=${1%%:*} rest=${1#*:} name t args
    case $kind in
        test)
            local bin=${rest%%:*} filter=""
            [[ $rest == *:* ]] && filter=${rest#*:}
            # shellcheck disable=SC2086
            timeout 300 "$B/$bin" --test-threads 1 --nocapture $filter > "$R/$bin.log" 2>&1
            echo "test $bin rc=$? at $SECONDS s"; summary "$R/$bin.log" ;;
        train)
            name=${rest%%:*}; rest=${rest#*:}; t=${rest%%:*}; args=${rest#*:}
            fits "$t" || return
            # shellcheck disable=SC2086
            timeout "$t" "$B/megatrain" train --device cuda --metrics "$R/$name.jsonl" ${COMMON:-} $args > "$R/$name.log" 2>&1
            echo "train $name rc=$? at $SECONDS s"; summary "$R/$name.log" ;;
        estimate)
            name=${rest%%:*}; args=${rest#*:}
            # shellcheck disable=SC2086
            "$B/megatrain" estimate $args > "$R/$name.log" 2>&1
            echo "estimate $name rc=$?"; summary "$R/$name.log" ;;
        harness)
            name=${rest%%:*}; rest=${rest#*:}; t=${rest%%:*}; args=${rest#*:}
            fits "$t" || return
            # shellcheck disable=SC2086
            timeout "$t" "$B/bench-harness" --megatrain "$B/megatrain" $args --out "$OUT/$name" > "$R/$name.log" 2>&1
            echo "harness $name rc=$? at $SECONDS s"; summary "$R/$name.log" ;;
        cmd)
            name=${rest%%:*}; rest=${rest#*:}; t=${rest%%:*}; args=${rest#*:}
            fits "$t" || return
            # Unbuffered: a Python bench stopped by the timeout keeps what it printed.
            PYTHONUNBUFFERED=1 BINS=$B R=$R timeout "$t" bash -c "$args" > "$R/$name.log" 2>&1
            echo "cmd $name rc=$? at $SECONDS s"; summary "$R/$name.log" ;;
        with)
            local assign=${rest%%:*}
            (export "${assign?}"; step "${rest#*:}") ;;
        *)
            echo "unknown step kind '$kind' in '$1' (test, train, estimate, harness, cmd, with)" >&2
            return 1 ;;
    esac
}

for s in "$@"; do
    step "$s"
done
tar czf "$OUT/r.tgz" -C "$OUT" r
echo "done: wall $SECONDS s"

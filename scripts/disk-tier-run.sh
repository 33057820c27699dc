#!/usr/bin/env bash
# Beyond RAM on any Linux machine (no GPU needed): a model whose --store file is >= 1.5x the
# memory its process may use trains from that file inside a memory cgroup, against (a) the disk's
# measured sequential bandwidth, the bound, and (b) the same model with its store in RAM.
#
#   scripts/disk-tier-run.sh OUTDIR [LIMIT_GIB] [HOST_MEM_GIB] [TOKENS...]
#
# Needs root (a memory cgroup, v1 or v2) and ~4 GB free on the disk of OUTDIR's --store files.
# The run in RAM has an anonymous store (the default) and no limit. Uses target/release/megatrain (cargo build --release -p megatrain) and the 197M-parameter
# Llama shape bench-harness/configs/disk-tier-200m.json (3.15 GB store: 16 B/param, fp32 moments
# and gradients, the CPU default). Writes OUTDIR/results.json, one log per run and env.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/disk-tier-run.sh OUTDIR [LIMIT_GIB] [HOST_MEM_GIB] [TOKENS...]}
limit_gib=${2:-1.9}
host_mem=${3:-1.3}
tokens=("${@:4}")
[ ${#tokens[@]} -eq 0 ] && tokens=(32 256)
bin=${BIN:-target/release/megatrain}
config=bench-harness/configs/disk-tier-200m.json
steps=${STEPS:-6}
work=${WORK:-$out/work}
mkdir -p "$out" "$work"

# The memory cgroup: v2 (memory.max, memory.peak) or v1 (memory.limit_in_bytes, max_usage).
limit=$(python3 -c "print(int($limit_gib * 2**30))")
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    cg=/sys/fs/cgroup/megatrain-disk-tier; mkdir -p "$cg"
    echo "$limit" >"$cg/memory.max"; echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
    peak_file=memory.peak; kind=v2
else
    parent=/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)
    cg=$parent/megatrain-disk-tier; mkdir -p "$cg"
    echo "$limit" >"$cg/memory.limit_in_bytes"
    peak_file=memory.max_usage_in_bytes; kind=v1
fi
echo "cgroup $kind $cg: limit $limit bytes ($limit_gib GiB)"

# The bound: the disk's sequential write and read bandwidth, direct I/O, 4 GiB.
dd if=/dev/zero of="$work/dd.bin" bs=16M count=256 oflag=direct 2>"$work/dd-write.txt"
dd if="$work/dd.bin" of=/dev/null bs=16M iflag=direct 2>"$work/dd-read.txt"
rm -f "$work/dd.bin"
bw() { python3 - "$1" <<'EOF'
import re, sys
t = open(sys.argv[1]).read()
m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", t)
print(int(m.group(1)) / float(m.group(2)))
EOF
}
write_bw=$(bw "$work/dd-write.txt"); read_bw=$(bw "$work/dd-read.txt")
echo "disk: write $write_bw B/s, read $read_bw B/s"

run() { # name tokens confined(0/1) extra...
    local name=$1 t=$2 confined=$3; shift 3
    local store="$work/$name.mts"
    rm -f "$store"
    local args=(train --config "$config" --data synthetic --batch-size 1 --seq-len "$t" --steps "$steps"
        --metrics "$out/$name.jsonl" "$@")
    # The paged run's store is a file; the one in RAM is anonymous memory, as by default.
    [ "$confined" = 1 ] && args+=(--store "$store")
    if [ "$confined" = 1 ]; then
        sync; echo 3 >/proc/sys/vm/drop_caches
        [ "$kind" = v1 ] && echo 0 >"$cg/memory.max_usage_in_bytes"
        sh -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' _ "$cg" "$bin" "${args[@]}" >"$out/$name.log" 2>&1
        cat "$cg/$peak_file" >"$out/$name.peak"
        grep -E "^(oom_kill|under_oom) " "$cg/memory.oom_control" 2>/dev/null >"$out/$name.oom" || true
    else
        "$bin" "${args[@]}" >"$out/$name.log" 2>&1
    fi
    rm -f "$store"
}

for t in "${tokens[@]}"; do
    run "ram-1x$t" "$t" 0
    run "paged-1x$t" "$t" 1 --host-mem "$host_mem"
done

{ uname -a; nproc; free -b; df -h "$work"; git rev-parse HEAD; date -u; } >"$out/env.txt"
python3 scripts/disk_tier_report.py "$out" "$limit" "$write_bw" "$read_bw" "$kind" "${tokens[@]}"
rmdir "$cg" 2>/dev/null || true

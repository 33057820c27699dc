#!/usr/bin/env bash
# Runs a command with its whole process tree confined to a memory limit (a cgroup), the way a
# desktop with that much RAM would confine it, and reports the cgroup's peak and whether the
# kernel's OOM killer fired. Anonymous memory, page-locked (pinned) buffers, the CUDA driver's host
# allocations and page cache all count.
#
#   sudo scripts/memory-limit.sh 64G -- target/release/megatrain train ...
#
# Works without systemd (containers whose PID 1 is something else): it writes the cgroup files
# itself, cgroup v2 (`memory.max`, swap off with `memory.swap.max`) or v1 (`memory.limit_in_bytes`
# and, where swap is accounted, `memory.memsw.limit_in_bytes`), as a child of the cgroup this
# shell is in. Needs root (or a delegated cgroup). MEMLIMIT_CGROUP_ROOT overrides the cgroup
# mount point (for testing the script against a plain directory). On the 2-core development
# machine (cgroup v1, PID 1 not systemd, so `systemd-run` fails) a 256 MiB limit let a 100 MiB
# process finish and killed a 400 MiB one (`OOM kills 1`). scripts/disk-tier-run.sh sets up the
# same kind of cgroup inline for its paired runs.
set -euo pipefail

usage() {
    echo "usage: $0 LIMIT -- COMMAND [ARGS...]   (LIMIT in bytes or with K/M/G/T, e.g. 64G)" >&2
    exit 2
}
[ $# -ge 3 ] && [ "$2" = "--" ] || usage
limit_arg=$1
shift 2

bytes() {
    local v=$1 n unit
    n=${v%[KkMmGgTt]}
    unit=${v#"$n"}
    [[ $n =~ ^[0-9]+$ ]] || { echo "memory-limit: '$v' is not a size (bytes, or a number with K, M, G or T)" >&2; exit 2; }
    case $unit in
        "") echo "$n" ;;
        [Kk]) echo $((n << 10)) ;;
        [Mm]) echo $((n << 20)) ;;
        [Gg]) echo $((n << 30)) ;;
        [Tt]) echo $((n << 40)) ;;
    esac
}
limit=$(bytes "$limit_arg")
root=${MEMLIMIT_CGROUP_ROOT:-/sys/fs/cgroup}
name="megatrain-limit-$$"

if [ -e "$root/cgroup.controllers" ]; then
    # cgroup v2: a child of this shell's cgroup, with the memory controller enabled for it.
    parent="$root$(sed -n 's/^0::\/*/\//p' /proc/self/cgroup)"
    parent=${parent%/}
    if ! grep -qw memory "$parent/cgroup.subtree_control" 2>/dev/null \
        && ! echo +memory >"$parent/cgroup.subtree_control" 2>/dev/null; then
        # cgroup v2 enables a controller for children only of a cgroup with no processes of its own.
        echo "memory-limit: cannot enable the memory controller under $parent (it holds processes);" \
            "run this from a shell in an empty child cgroup, or use systemd-run --scope -p MemoryMax=$limit_arg" \
            "-p MemorySwapMax=0 where systemd is PID 1, or docker run --memory $limit_arg --memory-swap $limit_arg" >&2
        exit 1
    fi
    cg="$parent/$name"
    mkdir "$cg"
    echo "$limit" >"$cg/memory.max"
    [ -e "$cg/memory.swap.max" ] && echo 0 >"$cg/memory.swap.max"
    peak_file="$cg/memory.peak"
    oom_count() { sed -n 's/^oom_kill //p' "$cg/memory.events"; }
elif [ -d "$root/memory" ]; then
    # cgroup v1: the memory hierarchy's child of this shell's memory cgroup.
    parent="$root/memory$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup)"
    cg="$parent/$name"
    mkdir "$cg"
    echo "$limit" >"$cg/memory.limit_in_bytes"
    # With swap accounting, memory + swap is capped too, so nothing goes to swap.
    [ -e "$cg/memory.memsw.limit_in_bytes" ] && echo "$limit" >"$cg/memory.memsw.limit_in_bytes"
    peak_file="$cg/memory.max_usage_in_bytes"
    oom_count() { sed -n 's/^oom_kill //p' "$cg/memory.oom_control"; }
else
    echo "memory-limit: no cgroup memory controller under $root (neither v2 nor v1)" >&2
    exit 1
fi

cleanup() {
    # The cgroup can go once the command's processes have left it (they have exited).
    rmdir "$cg" 2>/dev/null || echo "memory-limit: left $cg in place (processes still in it)" >&2
}
trap cleanup EXIT

echo "memory-limit: $cg, limit $limit bytes ($limit_arg)" >&2
# The command runs in a child shell that first moves itself into the cgroup: everything it starts
# is inside; this script stays outside to report and clean up.
status=0
bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' memory-limit "$cg" "$@" || status=$?
peak=$(cat "$peak_file" 2>/dev/null || echo unknown)
ooms=$(oom_count 2>/dev/null || true)
echo "memory-limit: exit status $status, peak $peak bytes, OOM kills ${ooms:-unknown}" >&2
exit "$status"

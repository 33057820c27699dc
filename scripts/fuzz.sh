#!/usr/bin/env bash
# Fuzzes every input parser for SECONDS each, one target at a time:
#   bash scripts/fuzz.sh SECONDS [TARGET...]
# Targets (crates/fuzz/src/lib.rs): config_json safetensors_header safetensors_index jsonl
# chat_template toml_config manifest. Needs a nightly toolchain and cargo-fuzz
# (`rustup toolchain install nightly && cargo install cargo-fuzz`; both are installed if missing).
# Built without a sanitizer (the parsers are safe Rust: a panic, an overflow with debug
# assertions on, a timeout or an allocation past -rss_limit_mb is what a crash is), with debug
# assertions. Each target starts from its committed corpus (crates/fuzz/corpus/TARGET) and grows
# a working one in fuzz/corpus/TARGET; a crash lands in fuzz/artifacts/TARGET/ — copy it into
# crates/fuzz/corpus/TARGET/ (as crash-WHAT) once fixed: `cargo test -p mt-fuzz` replays it.
# Logs go to $FUZZ_LOG_DIR (default fuzz/logs); the last lines are a table of executions and
# coverage per target. Exits 1 if any target crashed.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:?usage: scripts/fuzz.sh SECONDS [TARGET...]}
shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(config_json safetensors_header safetensors_index jsonl chat_template toml_config manifest)
fi
logs=${FUZZ_LOG_DIR:-fuzz/logs}
mkdir -p "$logs"
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo +nightly install cargo-fuzz --locked
fi
flags=(--sanitizer none --debug-assertions)
cargo +nightly fuzz build "${flags[@]}"
failed=0
summary=()
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    log="$logs/$t.log"
    echo "== $t: $secs s (log: $log)"
    start=$(date +%s)
    if ! cargo +nightly fuzz run "${flags[@]}" "$t" "fuzz/corpus/$t" "crates/fuzz/corpus/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb=2048 -timeout=10 \
        -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1; then
        failed=1
        echo "   CRASH: see $log and fuzz/artifacts/$t/"
    fi
    took=$(( $(date +%s) - start ))
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    last=$(grep -E '#[0-9]+.*cov: [0-9]+' "$log" | tail -n 1)
    cov=$(echo "$last" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*' || echo '?')
    ft=$(echo "$last" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*' || echo '?')
    corp=$(echo "$last" | grep -o 'corp: [0-9]*/[0-9a-zA-Z]*' | cut -d' ' -f2 || echo '?')
    summary+=("$(printf '%-20s %6ss %12s execs %8s/s  cov %6s  ft %7s  corpus %s' "$t" "$took" "$execs" "$rate" "$cov" "$ft" "$corp")")
done
echo "== summary (cov: edges covered, ft: libFuzzer features)"
printf '%s\n' "${summary[@]}" | tee "$logs/summary.txt"
exit $failed

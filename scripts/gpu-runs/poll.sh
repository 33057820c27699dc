#!/usr/bin/env bash
# Polls a detached GPU run: waits up to $1 seconds for /tmp/r/progress to say "done", then
# copies /tmp/r to $OUT and prints the progress and the runs' key lines.
set -u
for _ in $(seq 1 $(( ${1:-500} / 10 ))); do grep -q "^done" /tmp/r/progress 2>/dev/null && break; sleep 10; done
cat /tmp/r/progress 2>/dev/null
for f in /tmp/r/*.log; do echo "== $f"; grep -E "^step |^step:|steady|loss:|in use at most|host RSS|rror|panick|SUMMARY|test result" $f | sed 's/.*keep their activations (no recompute)/  .../' | cut -c1-260 | tail -12; done
tar czf $OUT/r.tgz -C /tmp r

#!/usr/bin/env bash
# Polls run5: waits up to $1 seconds for /tmp/r/progress to say "done", printing each finished run's
# line, then packs /tmp/p14 and /tmp/r into $OUT.
set -u
for _ in $(seq 1 $(( ${1:-500} / 10 ))); do grep -q "^done" /tmp/r/progress 2>/dev/null && break; sleep 10; done
cat /tmp/r/progress; grep -E "^\[|ok|Failed|wrote|rror" /tmp/r/paper.log | cut -c1-220 | tail -20
free -g | head -2
tar czf $OUT/p14.tgz -C /tmp p14 r 2>/dev/null; ls -la $OUT

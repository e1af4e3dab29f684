#!/usr/bin/env bash
# AMX probe on the GPU machine: which CPUs share a core (reg-only tdp on every pair), then the tile-load patterns
# with threads pinned one per core first. Not a test. Logs to ${OUT:-/tmp}.
set -u
out=${OUT:-/tmp}
gcc -O2 -pthread native/tests/probes/amx_probe.c -o /tmp/amx_probe || exit 1
PROBE_PAIRS=1 /tmp/amx_probe 0.08 | tee $out/pairs.log
order=$(python3 - "$out/pairs.log" <<'PY'
import re, sys, os
n = os.cpu_count()
pairs = [tuple(map(int, m.groups())) for m in re.finditer(r"pair (\d+),(\d+) shares", open(sys.argv[1]).read())]
first, second = [], []
for c in range(n):
    if any(b == c and a in first for a, b in pairs): second.append(c)
    else: first.append(c)
print(",".join(map(str, first + second)))
PY
)
echo "order: $order"
PROBE_CPUS=$order /tmp/amx_probe ${SECS:-0.25} | tee $out/probe.log

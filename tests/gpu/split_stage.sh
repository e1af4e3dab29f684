#!/usr/bin/env bash
# Short-prefill split sweep (issue 19) on the GPU machine, from the repository root (carry .whl):
#   bash tests/gpu/split_stage.sh [probe_split.py args...]      logs: $OUT/split-*.log; host steal over the call printed
set -uo pipefail
OUT=${OUT:-/tmp/ktinject-out}; mkdir -p "$OUT"
OUT=$OUT bash tests/gpu/run_gpu_machine.sh build > "$OUT/split-setup.log" 2>&1
grep -q "^build rc=0" "$OUT/split-setup.log" || { tail -30 "$OUT/split-setup.log"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=/tmp/site:$PWD
s0=$(head -1 /proc/stat)
timeout "${SPLIT_S:-460}" python3 tests/gpu/probe_split.py "$@" > "$OUT/split-probe.log" 2>&1; echo "probe rc=$?"
s1=$(head -1 /proc/stat)
grep -E "^#|^##|Error|error" "$OUT/split-probe.log" | tail -80
python3 - "$s0" "$s1" <<'PY'
import sys
a, b = ([int(v) for v in s.split()[1:]] for s in sys.argv[1:3])
d = [y - x for x, y in zip(a, b)]
print(f"host steal over the probe: {100 * d[7] / max(1, sum(d)):.1f}% of CPU time")
PY
echo "=== $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

#!/usr/bin/env bash
# Decode-chain kernel settings A/B'd inside decode graphs on the GPU machine (carry .whl): optional GPU tests, then
# tests/gpu/probe_variants.py with the variants given (module constants of ktinject.operators, "name:mod.ATTR=int,..."):
#   [TESTS="tests/gpu/test_graph_gpu.py"] [ROUNDS=3] bash tests/gpu/variants_stage.sh "base:" "x:fused.SOME_FLAG=0"
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
echo "=== $(steal)"
if [ -n "${TESTS:-}" ]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -x $TESTS > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|^E  |Error" "$OUT/tests.log" | head -12
fi
[ $# -gt 0 ] || { echo "usage: bash tests/gpu/variants_stage.sh VARIANT..."; exit 2; }
args=(); for v in "$@"; do args+=(--variant "$v"); done
echo "=== probe $(steal)"
(cd tests/gpu && timeout "${PROBE_S:-300}" python3 probe_variants.py --rounds "${ROUNDS:-3}" --tokens 32 "${args[@]}" \
  > "$OUT/probe.log" 2>&1)
echo "probe rc=$?"; grep -E "median|^round" "$OUT/probe.log" | cut -c1-250
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

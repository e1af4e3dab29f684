#!/usr/bin/env bash
# The serving GPU tests (batch > 1: wait nodes and the polling copy between PDL launches), then bench decode int4
# with KTINJECT_PDL=1 and =0 (one device call, ~6 minutes), from the repository root, carry .whl:
#   bash tests/gpu/pdl_final.sh
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
PYTHONPATH=/tmp/site:$PWD timeout "${TESTS_S:-120}" python3 -m pytest -q -rs -m "gpu or amx" tests/gpu/test_serve_gpu.py \
  > "$OUT/serve-tests.log" 2>&1
echo "serve tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/serve-tests.log" | head; tail -1 "$OUT/serve-tests.log"
for pdl in 1 0; do
  echo "=== PDL=$pdl $(steal)"
  KTINJECT_PDL=$pdl PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m ktinject.bench decode --quant int4 --defer 0 \
    --tokens 32 --defer-rounds 3 > "$OUT/decode-$pdl.log" 2>&1
  grep -E "^# defer(: GPU|: CPU experts alone \|| 0)" "$OUT/decode-$pdl.log" | cut -c1-260
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) $(git log --oneline -1 | cut -c1-8)"

#!/usr/bin/env bash
# GPU tests of the decode kernels and graph paths (PDL on), the kernel table of muted replays, and bench decode
# int4 with KTINJECT_PDL=1 / 0 in turns (one device call, ~9 minutes), from the repository root, carry .whl:
#   [ROUNDS=1] bash tests/gpu/pdl_check.sh
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
PYTHONPATH=/tmp/site:$PWD timeout "${TESTS_S:-260}" python3 -m pytest -q -rs -m "gpu or amx" tests/test_fused_kernels.py \
  tests/test_hostio.py tests/gpu/test_graph_gpu.py tests/gpu/test_deferral_gpu.py tests/gpu/test_kv_cache_gpu.py \
  tests/gpu/test_hot_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head; tail -1 "$OUT/tests.log"
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m ktinject.bench decode --quant int4 --tokens 32 --profile \
  > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
for r in $(seq "${ROUNDS:-1}"); do
  for pdl in 1 0; do
    echo "=== round $r PDL=$pdl $(steal)"
    KTINJECT_PDL=$pdl PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m ktinject.bench decode --quant int4 --defer 0 \
      --tokens 32 --defer-rounds 3 > "$OUT/decode-$pdl-$r.log" 2>&1
    grep -E "^# defer(: GPU|: CPU experts alone \|| 0)" "$OUT/decode-$pdl-$r.log" | cut -c1-260
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

#!/usr/bin/env bash
# One device call (~8 minutes) checking and measuring this session's native changes (pool profile, the gather's
# quantization per token, the down phase's minimum chunk), from the repository root, carry .whl:
#     BASE=<commit> bash tests/gpu/session4_final.sh
# 1. build; AMX- and GPU-marked tests of the native core, deferral and serving (limit 200 s);
# 2. bench serve int4, 8 streams, 16 layers: BASE then this tree (tests/gpu/ab_serve.sh);
# 3. bench decode int4 --defer 0 on 48 layers (batch 1 tok/s, CPU experts alone, GPU part) for this tree.
set -uo pipefail
: "${BASE:?BASE=<commit> to compare against}"
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -rs -m "gpu or amx" tests/test_native.py tests/test_int4.py tests/test_pool_profile.py \
  tests/test_batch_invariance.py tests/gpu/test_deferral_gpu.py tests/gpu/test_serve_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head
BASE=$BASE bash tests/gpu/ab_serve.sh 2>&1 | grep -vE "^\|---" | cut -c1-400
timeout 150 python3 -m ktinject.bench decode --quant int4 --defer 0 --tokens 32 --defer-rounds 3 > "$OUT/decode.log" 2>&1
grep -E "^# defer" "$OUT/decode.log" | cut -c1-220
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

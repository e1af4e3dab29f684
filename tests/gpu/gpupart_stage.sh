#!/usr/bin/env bash
# The decode step's GPU part against a base commit (one device call, ~9 minutes), from the repository root, carry
# .whl:   BASE=<commit> bash tests/gpu/gpupart_stage.sh
# GPU tests of the pieces touched (fused kernels, hostio, graph decode, deferral); then bench decode int4 (tok/s,
# GPU part = muted replay) for this tree and BASE (built in a worktree), in turns. Logs under $OUT.
set -uo pipefail
: "${BASE:?BASE=<commit> to compare against}"
. tests/gpu/stage_lib.sh
stage_setup
stage_base "$BASE"
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -m "gpu or amx" tests/test_fused_kernels.py \
    tests/test_hostio.py tests/gpu/test_graph_gpu.py tests/gpu/test_deferral_gpu.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
for r in $(seq "${ROUNDS:-1}"); do
  for v in new base; do
    dir=$PWD; [ $v = base ] && dir=/tmp/base
    echo "=== round $r $v $(steal)"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python3 -m ktinject.bench decode --quant int4 --defer 0 \
       --tokens 32 --defer-rounds 3 2>&1) > "$OUT/decode-$v-$r.log"
    grep -E "^# defer(: GPU|: CPU experts alone \|| 0)" "$OUT/decode-$v-$r.log" | cut -c1-260
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

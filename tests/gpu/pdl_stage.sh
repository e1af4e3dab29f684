#!/usr/bin/env bash
# Programmatic dependent launch (fused.pdl) on and off, and a base commit, through bench decode (one device call,
# ~8 minutes), from the repository root, carry .whl:   BASE=<commit> [ROUNDS=1] [TESTS=1] bash tests/gpu/pdl_stage.sh
# GPU tests of the kernels and graph decode first (PDL on: the default); then bench decode int4 (tok/s, GPU part =
# muted replay) for this tree with KTINJECT_PDL=1 and =0 and for BASE, in turns. Logs under $OUT.
set -uo pipefail
: "${BASE:?BASE=<commit> to compare against}"
. tests/gpu/stage_lib.sh
stage_setup
stage_base "$BASE"
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout "${TESTS_S:-200}" python3 -m pytest -q -rs -m "gpu or amx" -x \
    tests/test_fused_kernels.py tests/gpu/test_graph_gpu.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
for r in $(seq "${ROUNDS:-1}"); do
  for v in pdl nopdl base; do
    dir=$PWD; [ $v = base ] && dir=/tmp/base
    pdl=1; [ $v = nopdl ] && pdl=0
    echo "=== round $r $v $(steal)"
    (cd "$dir" && KTINJECT_PDL=$pdl PYTHONPATH=/tmp/site:$dir timeout 200 python3 -m ktinject.bench decode --quant int4 \
       --defer 0 --tokens 32 --defer-rounds 3 2>&1) > "$OUT/decode-$v-$r.log"
    grep -E "^# defer(: GPU|: CPU experts alone \|| 0)" "$OUT/decode-$v-$r.log" | cut -c1-260
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

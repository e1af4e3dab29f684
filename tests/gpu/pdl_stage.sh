#!/usr/bin/env bash
# Programmatic dependent launch (fused.pdl) on and off through bench decode int4 (tok/s, GPU part = muted replay),
# in turns, optionally against a base commit; GPU tests first. One device call, from the repository root, carry .whl:
#   [BASE=<commit>] [TESTS=full|serve|0] [PROFILE=1] [ROUNDS=1] bash tests/gpu/pdl_stage.sh
# TESTS=full (default): the decode kernels, hostio, graph, deferral, KV-cache and hot-expert GPU tests (~210 s);
# serve: the serving GPU tests (batch > 1: wait nodes and polling copies between PDL launches, ~30 s).
# PROFILE=1: the kernel table of muted replays (bench decode --profile). Logs under $OUT.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
[ -n "${BASE:-}" ] && stage_base "$BASE"
case "${TESTS:-full}" in
  full) tests=(tests/test_fused_kernels.py tests/test_hostio.py tests/gpu/test_graph_gpu.py tests/gpu/test_deferral_gpu.py
               tests/gpu/test_kv_cache_gpu.py tests/gpu/test_hot_gpu.py) ;;
  serve) tests=(tests/gpu/test_serve_gpu.py) ;;
  *) tests=() ;;
esac
if [ ${#tests[@]} -gt 0 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout "${TESTS_S:-260}" python3 -m pytest -q -rs -m "gpu or amx" "${tests[@]}" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head; tail -1 "$OUT/tests.log"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m ktinject.bench decode --quant int4 --tokens 32 --profile \
    > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
fi
variants="pdl nopdl"; [ -n "${BASE:-}" ] && variants="pdl nopdl base"
for r in $(seq "${ROUNDS:-1}"); do
  for v in $variants; do
    dir=$PWD; [ $v = base ] && dir=/tmp/base
    pdl=1; [ $v = nopdl ] && pdl=0
    echo "=== round $r $v $(steal)"
    (cd "$dir" && KTINJECT_PDL=$pdl PYTHONPATH=/tmp/site:$dir timeout 200 python3 -m ktinject.bench decode --quant int4 \
       --defer 0 --tokens 32 --defer-rounds 3 2>&1) > "$OUT/decode-$v-$r.log"
    grep -E "^# defer(: GPU|: CPU experts alone \|| 0)" "$OUT/decode-$v-$r.log" | cut -c1-260
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

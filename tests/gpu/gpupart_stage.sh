#!/usr/bin/env bash
# The decode step's GPU part against another version of the code (one device call, ~9 minutes), from the repository
# root, carry .whl:
#   BASE=<commit> bash tests/gpu/gpupart_stage.sh     this tree against BASE, built in a worktree at /tmp/base
#   PATCH=<file> bash tests/gpu/gpupart_stage.sh      this tree with and without a patch of Python / Triton code
#                                                     (`git diff main my-branch > file` here: the device's .git may be
#                                                     stale, an untracked file travels with the tree; native (C)
#                                                     changes need a rebuild: use BASE); the tree restored on exit
# GPU tests of the pieces touched (fused kernels, hostio, graph decode, deferral, the KV cache) on the new side; then
# bench decode int4 (tok/s, GPU part = muted replay) for both sides in turns, ROUNDS rounds (default 1). Logs under
# $OUT.
set -uo pipefail
[ -n "${BASE:-}" ] || [ -n "${PATCH:-}" ] || { echo "BASE=<commit> or PATCH=<file> to compare against"; exit 1; }
. tests/gpu/stage_lib.sh
stage_setup
use() {  # use new|base: the code of that side in place (PATCH) and its directory on stdout
  if [ -n "${PATCH:-}" ]; then
    if [ "$1" = new ]; then git apply -R --check "$PATCH" 2>/dev/null || git apply "$PATCH"
    else git apply -R --check "$PATCH" 2>/dev/null && git apply -R "$PATCH"; fi
    echo "$PWD"
  elif [ "$1" = new ]; then echo "$PWD"
  else echo /tmp/base; fi
}
if [ -n "${PATCH:-}" ]; then
  git apply --check "$PATCH" || { echo "the patch does not apply to this tree"; exit 1; }
  trap 'use base > /dev/null' EXIT
else
  stage_base "$BASE"
fi
if [ "${TESTS:-1}" = 1 ]; then
  dir=$(use new)
  PYTHONPATH=/tmp/site:$dir timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -m "gpu or amx" \
    tests/test_fused_kernels.py tests/test_hostio.py tests/gpu/test_graph_gpu.py tests/gpu/test_deferral_gpu.py \
    tests/gpu/test_kv_cache_gpu.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
for r in $(seq "${ROUNDS:-1}"); do
  for v in new base; do
    dir=$(use $v)
    echo "=== round $r $v $(steal)"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python3 -m ktinject.bench decode --quant int4 --defer 0 \
       --tokens 32 --defer-rounds 3 2>&1) > "$OUT/decode-$v-$r.log"
    grep -E "^# defer(: GPU|: CPU experts alone \|| 0)" "$OUT/decode-$v-$r.log" | cut -c1-260
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

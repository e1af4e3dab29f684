#!/usr/bin/env bash
# A change to Python / Triton code against this tree in one device call, when the change lives on a branch: the
# device's copy of .git may be stale, so the change travels as a patch file (an untracked file travels with the
# tree). From the repository root, carry .whl:
#   git diff main my-branch > change.patch            (here, with main checked out)
#   PATCH=change.patch bash tests/gpu/patch_ab.sh      (on the GPU machine)
# Applies the patch, runs the GPU tests of the decode kernels on it (TESTS=0 skips them), then `bench decode --quant
# int4 --defer 0` (muted replay = GPU part, bare replay, tok/s through generate) without and with the patch in
# turns, ROUNDS rounds (default 2), and leaves the tree as it found it. Native (C) changes need a rebuild: not here.
# Logs under $OUT.
set -uo pipefail
: "${PATCH:?PATCH=<file> (git diff main <branch> > file)}"
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
git apply --check "$PATCH" || { echo "the patch does not apply to this tree"; exit 1; }
apply() { git apply "$PATCH"; }
revert() { git apply -R "$PATCH"; }
trap 'git apply -R --check "$PATCH" 2>/dev/null && revert' EXIT
if [ "${TESTS:-1}" = 1 ]; then
  apply
  timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -m "gpu or amx" tests/test_fused_kernels.py tests/test_hostio.py \
    tests/gpu/test_graph_gpu.py tests/gpu/test_deferral_gpu.py tests/gpu/test_kv_cache_gpu.py > "$OUT/patch-tests.log" 2>&1
  echo "tests with the patch rc=$?"; tail -3 "$OUT/patch-tests.log"
  revert
fi
for r in $(seq "${ROUNDS:-2}"); do
  for v in base patched; do
    [ $v = patched ] && apply
    echo "=== round $r $v $(steal)"
    timeout 200 python3 -m ktinject.bench decode --quant int4 --defer 0 --tokens 32 --defer-rounds 3 \
      > "$OUT/patch-$v-$r.log" 2>&1
    grep -E "^# defer(: GPU|: CPU experts alone \|| 0: graph)" "$OUT/patch-$v-$r.log" | cut -c1-240
    [ $v = patched ] && revert
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

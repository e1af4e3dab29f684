#!/usr/bin/env bash
# Interleaved A/B of bench serve (int4, 8 streams, 16 layers) on a GPU machine, from the repository root:
#   BASE=<commit> bash benchmarks/ab_serve.sh      (~3 minutes per round: base then this tree, ROUNDS rounds, default 1)
# BASE is built in a worktree (/tmp/base, in place); this tree with pip -e. Host steal beside each run. SERVE_ARGS
# replaces the bench's arguments. Logs under $OUT (default /tmp/ktinject-out).
set -uo pipefail
: "${BASE:?BASE=<commit> to compare against}"
. benchmarks/stage_lib.sh
stage_setup
stage_base "$BASE"
args=${SERVE_ARGS:---quant int4 --streams 8 --layers 16}
for r in $(seq "${ROUNDS:-1}"); do
  for v in base new; do
    dir=$PWD; [ $v = base ] && dir=/tmp/base
    echo "=== round $r $v $(steal)"
    # shellcheck disable=SC2086
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 240 python3 -m ktinject.bench serve $args 2>&1) \
      | grep -E "^\||^# (memory|batch|engine)" | cut -c1-260
  done
done 2>&1 | tee "$OUT/ab_serve.log"
echo "=== $(steal) $(date -u +%FT%TZ)"

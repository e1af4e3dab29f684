#!/usr/bin/env bash
# Whole-model A/B of two commits through `python -m ktinject.bench` on a GPU machine, from the repository root:
#   BASE=<commit> bash benchmarks/ab_bench.sh
# Builds this tree (pip -e) and BASE in a worktree (/tmp/base, built in place), then runs each of the bench commands
# below for base and this tree in turns (base, new, base, new, ... ROUNDS rounds, default 1), the host's steal read
# beside each, each cut off after BENCH_S seconds (default 150). Logs under $OUT (default /tmp/ktinject-out).
# DECODE_ARGS / PREFILL_ARGS replace the commands' arguments ('' skips that bench); ORDER="new base" runs this tree first.
set -uo pipefail
: "${BASE:?BASE=<commit> to compare against}"
. benchmarks/stage_lib.sh
stage_setup
stage_base "$BASE"
decode=${DECODE_ARGS-"--quant int4 --defer 0 --hf-tokens 0 --tokens 32"}
prefill=${PREFILL_ARGS-"--quant int4 --prefill 512,2048"}
for r in $(seq "${ROUNDS:-1}"); do
  for what in decode prefill; do
    args=${!what}
    [ -n "$args" ] || continue
    for v in ${ORDER:-base new}; do
      dir=$PWD; [ $v = base ] && dir=/tmp/base
      echo "=== round $r bench $what $v ($(git -C "$dir" rev-parse --short HEAD)) $(steal)"
      # shellcheck disable=SC2086
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${BENCH_S:-150}" python3 -m ktinject.bench $what $args 2>&1 \
        | grep -v Warning)
    done
  done
done 2>&1 | tee "$OUT/ab_bench.log"
echo "=== $(steal) $(date -u +%FT%TZ)"

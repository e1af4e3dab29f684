#!/usr/bin/env bash
# Interleaved A/B of the native decode path on a GPU machine's CPU (~4 minutes), from the repository root:
#   BASE=<commit> bash benchmarks/ab_stage.sh
# Builds this tree (pip -e) and BASE in a worktree (/tmp/base, built in place), then runs
# benchmarks/probe_cpu_decode.py (int4, 16 layers, 15 threads, batch 1 and 8, cache-cold) ROUNDS (default 2) times
# for each, in turns (base, new, base, new, ...), host steal read beside each; and the one-thread kernel probe
# native/tests/probes/gemv_probe.c. Logs under $OUT (default /tmp/ktinject-out). PROBE_ARGS replaces the probe's
# arguments.
set -uo pipefail
: "${BASE:?BASE=<commit> to compare against}"
. benchmarks/stage_lib.sh
stage_setup
stage_base "$BASE"
cc -O2 -pthread -Inative/src native/tests/probes/gemv_probe.c native/src/kernels/{generic,avx2,avx512,amx}/*.c -lm \
  -o /tmp/gemv_probe && /tmp/gemv_probe | tee "$OUT/gemv_probe.log"
args=${PROBE_ARGS:---layers 16 --quant int4 --threads 15 --batch 1,8 --passes 5}
for r in $(seq "${ROUNDS:-2}"); do
  for v in base new; do
    dir=$PWD; [ $v = base ] && dir=/tmp/base
    echo "=== round $r $v ($(git -C "$dir" rev-parse --short HEAD)) $(steal)"
    # shellcheck disable=SC2086
    PYTHONPATH=/tmp/site:$dir timeout 200 python3 benchmarks/probe_cpu_decode.py $args 2>&1 | grep -v Warning
  done
done 2>&1 | tee "$OUT/ab.log"
echo "=== $(steal) $(date -u +%FT%TZ)"

#!/usr/bin/env bash
# Gated ahead layers (gpu_experts/split.py) on the GPU machine from the repository root (carry .whl): their GPU tests
# and the pieces touched, the gap probe with and without them, `bench prefill` without and with them in turns:
#   [QUANTS=int8] [LENS=512] [ROUNDS=1] [TESTS=1] [PROBE=1] bash tests/gpu/gated_stage.sh
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -x ${TEST_SEL:-tests/gpu/test_prefill_gpu.py tests/test_hostio.py} \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|^E  |Error" "$OUT/tests.log" | head -12
fi
if [ "${PROBE:-1}" = 1 ]; then
  for v in 1 0; do
    echo "=== probe gated=$v $(steal)"
    KTINJECT_PREFILL_GATED=$v timeout 200 python3 tests/gpu/probe_ahead_gap.py --quant "${QUANTS:-int8}" \
      --tokens "${LENS:-512}" --reps 5 > "$OUT/probe-$v.log" 2>&1
    echo "rc=$?"; grep "^#" "$OUT/probe-$v.log"; grep -v "^#" "$OUT/probe-$v.log" | tail -3
  done
fi
for r in $(seq "${ROUNDS:-1}"); do
  for v in 0 1; do
    echo "=== round $r gated=$v $(steal)"
    KTINJECT_PREFILL_GATED=$v timeout "${BENCH_S:-200}" python3 -m ktinject.bench prefill --layers 12 \
      --quant "${QUANTS:-int8}" --prefill "${LENS:-512}" --mode cpu,gpu,auto > "$OUT/bench-$v-$r.log" 2>&1
    echo "rc=$?"; grep -E "^\| (bf16|int8|int4) |target" "$OUT/bench-$v-$r.log" | grep -v "per layer" | cut -c1-200
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

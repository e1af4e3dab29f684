#!/usr/bin/env bash
# Split prefill layers with the host not waiting for the CPU's task (gpu_experts/split.py's overlap) against the
# host waiting (KTINJECT_PREFILL_OVERLAP=0), on the GPU machine from the repository root (carry .whl), ~8 minutes:
#   [QUANTS=int8] [LENS=512] [ROUNDS=1] [TESTS=1] bash tests/gpu/overlap_stage.sh
# GPU tests of the pieces touched (streamed prefill == cpu incl. forced split, hostio's kernels with the done word,
# the native signal word), then `bench prefill` (cpu / gpu / auto) without and with the overlap in turns, one
# process each. Logs under $OUT.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_S:-200}" python3 -m pytest -q -rs tests/gpu/test_prefill_gpu.py tests/test_hostio.py \
    tests/test_native.py::test_task_signal_word_and_times > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
for r in $(seq "${ROUNDS:-1}"); do
  for v in 0 1; do
    echo "=== round $r overlap=$v $(steal)"
    KTINJECT_PREFILL_OVERLAP=$v timeout "${BENCH_S:-200}" python3 -m ktinject.bench prefill --layers 12 \
      --quant "${QUANTS:-int8}" --prefill "${LENS:-512}" --mode cpu,gpu,auto > "$OUT/bench-$v-$r.log" 2>&1
    echo "rc=$?"; grep -E "^\| (bf16|int8|int4) |target" "$OUT/bench-$v-$r.log" | cut -c1-230
  done
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

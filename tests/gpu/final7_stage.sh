#!/usr/bin/env bash
# The seventh session's last device call (from the repository root, carry .whl): GPU tests of streamed prefill and
# the hostio kernels, bench prefill at 512 tokens (three quants, the overlap on), deferral at a 16K context.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -rs tests/gpu/test_prefill_gpu.py tests/test_hostio.py \
  tests/test_native.py::test_task_signal_word_and_times > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -2 "$OUT/tests.log"
echo "=== prefill $(steal)"
timeout 180 python3 -m ktinject.bench prefill --layers 12 --quant bf16,int8,int4 --prefill 512 --mode cpu,gpu,auto \
  > "$OUT/prefill.log" 2>&1; echo "rc=$? $(steal)"
grep -E "^\| .*(prefill [0-9]+ |target)" "$OUT/prefill.log" | cut -c1-300
echo "=== defer $(steal)"
timeout "${DEFER_S:-230}" python3 -m ktinject.bench decode --quant int4 --defer 0,3 --prompt 16384 --tokens 64 \
  --defer-rounds 3 > "$OUT/defer.log" 2>&1; echo "rc=$? $(steal)"
grep -E "^\| defer" "$OUT/defer.log" | cut -c1-300
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

#!/usr/bin/env bash
# What bounds the CPU side of decode (issues 18, 21): tests/gpu/probe_cap.py (read-loop and decode passes in turns)
# for bf16 batch 1 and int4 batch 8, then probe_cpu_decode's fit (fixed time a layer + bytes at a bandwidth) for bf16.
# One device call from the repository root, carry .whl; logs under $OUT.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
cd tests/gpu
run() { echo "=== $* $(steal)"; timeout "${T:-240}" python3 "$@" 2>&1 | grep -v Warning; }
run probe_cap.py --quant bf16 --batch 1 --layers 16 --windows ${WINDOWS:-120} | tee "$OUT/cap-bf16.log"
run probe_cap.py --quant int4 --batch 8 --layers 16 --windows ${WINDOWS:-120} | tee "$OUT/cap-int4.log"
run probe_cpu_decode.py --quant bf16 --threads 15 --batch 1,8 --layers 16 --passes 5 | tee "$OUT/fit-bf16.log" \
  | grep -E 'B=|fit|read band'
echo "=== $(steal) $(date -u +%FT%TZ)"

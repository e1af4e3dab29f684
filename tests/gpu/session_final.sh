#!/usr/bin/env bash
# One device call at the end of a session (about 9 minutes): build; every GPU- and AMX-marked test in one process
# (also shows whether the interpreter exits cleanly); a one-minute serve soak (exit status checked); bench prefill on
# 12 of the 48 Qwen3-30B-A3B layers, cpu / gpu / auto, three formats. Logs under $OUT; a summary line per step last.
set -uo pipefail
OUT=${OUT:-/tmp/ktinject-out}; mkdir -p "$OUT"
bash tests/gpu/run_gpu_machine.sh build > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
summary=()
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  summary+=("$name rc=$rc $((SECONDS - t0))s")
}
step gpu-tests 260 python3 -m pytest -q -rs -m "gpu or amx" tests
tail -4 "$OUT/gpu-tests.log"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -20
step soak 130 python3 tests/gpu/soak_serve.py --minutes 1 --disconnects 10
grep -E "^# (ok|FAIL)|soak (PASSED|FAILED)|corrupt|Abort" "$OUT/soak.log" | tail -14
step bench-prefill 200 python3 -m ktinject.bench prefill --layers 12 --quant bf16,int8,int4 --prefill 512,2048,8192 \
  --mode cpu,gpu,auto
grep -E "^# (bf16|int8|int4) |target" "$OUT/bench-prefill.log" | grep -v "^|" | cut -c1-220
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
printf '%s\n' "${summary[@]}"

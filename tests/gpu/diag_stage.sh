#!/usr/bin/env bash
# Diagnosis of the decode gaps (issues 18 and 21) in one device call (~8 minutes), from the repository root, carry
# .whl:  bash tests/gpu/diag_stage.sh
# build; bench serve int4 at 1 and 8 streams on 16 layers (the 'CPU experts alone ms' column: is the 8-stream gap
# the CPU kernels or the rest of the step?); bench decode --defer 0 for int8 and int4 (tok/s, CPU experts alone,
# GPU part). Host steal from /proc/stat before and after each. Logs under $OUT.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
summary=()
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  echo "# $(steal)" > "$OUT/$name.log"
  timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1; rc=$?
  echo "# $(steal)" >> "$OUT/$name.log"
  summary+=("$name rc=$rc $((SECONDS - t0))s")
}
for s in ${STEPS:-serve decode}; do
  case $s in
    serve) step bench-serve 240 python3 -m ktinject.bench serve --quant int4 --streams ${STREAMS:-1,8} --layers 16
           grep -E "^\||^# (memory|batch|steal)" "$OUT/bench-serve.log" | cut -c1-300 ;;
    decode) for q in ${QUANTS:-int8 int4}; do
              step "decode-$q" 150 python3 -m ktinject.bench decode --quant "$q" --defer 0 --tokens 32 --defer-rounds 3
              grep -vE "^\s*$" "$OUT/decode-$q.log" | tail -14 | cut -c1-300
            done ;;
  esac
done
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) $(git rev-parse --short HEAD)"
printf '%s\n' "${summary[@]}"

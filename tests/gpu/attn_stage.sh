#!/usr/bin/env bash
# The decode attention kernel on the GPU machine (one device call, ~7 minutes), from the repository root, carry .whl:
#   bash tests/gpu/attn_stage.sh
# GPU tests of the fused kernels and graph decode; probe_fused.py (each piece timed in CUDA graphs, attention at
# several keys per split); bench decode int4 (tok/s, GPU part = muted replay). Logs under $OUT.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
for s in ${STEPS:-tests probe decode}; do
  case $s in
    tests) timeout 240 python3 -m pytest -q -rs -m "gpu or amx" tests/test_fused_kernels.py tests/gpu/test_graph_gpu.py \
             > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -4 "$OUT/tests.log" ;;
    probe) PYTHONPATH=$PYTHONPATH:$PWD/tests/gpu timeout 150 python3 tests/gpu/probe_fused.py 2>&1 | grep -v Warn \
             | tee "$OUT/fused.log" | cut -c1-330 ;;
    decode) echo "# $(steal)"; timeout 220 python3 -m ktinject.bench decode --quant int4 --defer 0 --tokens 32 \
              --defer-rounds 3 > "$OUT/decode.log" 2>&1; echo "decode rc=$? $(steal)"
            grep -E "^# (defer|inj)" "$OUT/decode.log" | cut -c1-300 ;;
  esac
done
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) $(git rev-parse --short HEAD 2>/dev/null)"

#!/usr/bin/env bash
# The decode chain's L2 prefetch before the PDL wait and the attention's late lengths counter on the GPU machine
# (carry .whl): GPU tests of the kernels touched, then probe_variants.py (in-graph A/B, muted replays).
#   [TESTS=...] [ROUNDS=3] bash tests/gpu/pf_stage.sh
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
echo "=== $(steal)"
timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -x ${TESTS:-tests/gpu/test_graph_gpu.py tests/test_decode_layer.py} \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^E  |Error" "$OUT/tests.log" | head -12
echo "=== probe $(steal)"
(cd tests/gpu && timeout "${PROBE_S:-300}" python3 probe_variants.py --rounds "${ROUNDS:-3}" --tokens 32 \
  --variant "base:fused.L2_PREFETCH=0,fused_attn.LENS_COUNT_LATE=0" --variant "late:fused.L2_PREFETCH=0" \
  --variant "pf:fused_attn.LENS_COUNT_LATE=0" --variant "both:" > "$OUT/probe.log" 2>&1)
echo "probe rc=$?"; grep -E "median|^round" "$OUT/probe.log" | cut -c1-250
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

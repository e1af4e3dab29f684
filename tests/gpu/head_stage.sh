#!/usr/bin/env bash
# The LM head through fused_dense.linear and q/k/v's PDL credit on the GPU machine (carry .whl): the head's kernel
# against cuBLAS in turns in one process (probe_qkv_choice.py --which head: muted replays, bare replays, generate),
# the choices fused_dense measured, then the GPU tests of the pieces touched.
#   bash tests/gpu/head_stage.sh
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
echo "=== $(steal)"
(cd tests/gpu && timeout "${PROBE_S:-150}" python3 probe_qkv_choice.py --which head --rounds 3 --tokens 32 \
  --configs "${HEAD_CONFIGS:-auto,cublas,2x2048x2x1}" > "$OUT/head.log" 2>&1)
echo "probe rc=$?"; grep -E "median|round|choices" "$OUT/head.log" | cut -c1-330
echo "=== $(steal)"
timeout "${TESTS_S:-150}" python3 -m pytest -q -rs -x tests/test_decode_layer.py tests/gpu/test_graph_gpu.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^E  |Error" "$OUT/tests.log" | head -12
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

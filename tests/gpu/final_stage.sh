#!/usr/bin/env bash
# Serving on the GPU machine after a decode-step change (one device call, ~7 minutes), from the repository root,
# carry .whl:   bash tests/gpu/final_stage.sh
# GPU serving tests (batch > 1 through the graph's handshakes), then bench serve int4 at 1 and 8 streams. Logs
# under $OUT.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
timeout "${TESTS_S:-170}" python3 -m pytest -q -rs -m "gpu or amx" tests/gpu/test_serve_gpu.py \
  tests/test_batch_invariance.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests.log"
echo "# $(steal)"
timeout "${SERVE_S:-230}" python3 -m ktinject.bench serve --quant int4 --streams 1,8 --layers 16 > "$OUT/serve.log" 2>&1
echo "serve rc=$? $(steal)"; grep -E "^\||^# (memory|batch|steal|roof)" "$OUT/serve.log" | cut -c1-300
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"

#!/usr/bin/env bash
# Expert deferral on the GPU machine (issue 20), one device call of under 5 minutes: build, the deferral GPU tests
# (graph decode with deferral == eager decode with deferral, batch 1 and 2; int4 + hot experts; host-callback
# fallback; a new d captures anew), then bench decode --defer on Qwen3-30B-A3B shapes: int4 first (the target), then
# bf16, each cut off by a timeout so the call stays short (rows print as they are measured). Logs under $OUT.
# From the repository root:  bash tests/gpu/defer_stage.sh      (carry: .whl when transformers must be upgraded)
# Knobs: DEFER (settings, default 0,1,2,3), TOKENS (decode tokens per timing, 32), ROUNDS (3), BENCH_S (seconds per
# quant, 110), QUANTS ("int4 bf16").
set -uo pipefail
OUT=${OUT:-/tmp/ktinject-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
t0=$SECONDS
pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "=== build $((SECONDS - t0))s"
python3 -m pytest -q -rs tests/gpu/test_deferral_gpu.py -s 2>&1 | tee "$OUT/defer_gpu_tests.log" | \
  grep -E "passed|failed|error|differ from defer|^FAILED" | tail -20
echo "=== tests $((SECONDS - t0))s"
for q in ${QUANTS:-int4 bf16}; do
  timeout "${BENCH_S:-110}" python3 -m ktinject.bench decode --quant "$q" --defer "${DEFER:-0,1,2,3}" \
    --tokens "${TOKENS:-32}" --defer-rounds "${ROUNDS:-3}" 2>&1 | tee "$OUT/defer_bench_$q.log" | grep -E "^# " | tail -12
  echo "=== bench $q rc=${PIPESTATUS[0]} $((SECONDS - t0))s"
done
echo "=== done (commit $(git rev-parse --short HEAD 2>/dev/null), $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null))"
